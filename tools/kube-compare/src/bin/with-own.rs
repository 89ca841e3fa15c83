//! The comparison program on the agent's own client (`gpu_node_agent::kube`), used the way
//! `src/cluster/mod.rs` uses it.
//!
//! `with-own KUBECONFIG NODE`: merge-patches `example.com/ready=true` on the Node, posts one
//! core/v1 Event about it, then follows the Node with `spawn_node_watcher` (the default
//! `[kubernetes]` settings: watch, 5 min `timeoutSeconds`, backoff 1 s to 5 min) and keeps the
//! label `example.com/have` equal to `example.com/want` (removed when `want` is). `with-kube`
//! does the same with kube-rs; `measure` runs both against the test API server.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::Path;

use gpu_node_agent::config::KubernetesConfig;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::kube::{EventType, FoundBy, KubeClient, NodeEvent, load_kubeconfig, spawn_node_watcher};

/// The label the program sets once at start.
const READY: &str = "example.com/ready";
/// The label it follows ...
const WANT: &str = "example.com/want";
/// ... and the one it keeps equal to it.
const HAVE: &str = "example.com/have";

// One thread, as the agent's main runs.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(kubeconfig), Some(name)) = (args.next(), args.next()) else {
        return Err("usage: with-own KUBECONFIG NODE".into());
    };
    let cfg = KubernetesConfig::default();
    let credentials = load_kubeconfig(Path::new(&kubeconfig), FoundBy::Config, &HostRoot::new("/"))?;
    let client = KubeClient::new(credentials, &cfg)?;

    let ready = BTreeMap::from([(READY.to_string(), Some("true".to_string()))]);
    let node = client.patch_node_metadata(&name, &ready, &BTreeMap::new()).await?;
    client
        .create_event(&NodeEvent {
            node_name: name.clone(),
            node_uid: node.uid.clone(),
            event_type: EventType::Normal,
            reason: "Started".into(),
            message: "with-own is watching this Node".into(),
        })
        .await?;
    eprintln!("with-own: ready");

    let (mut view, _task) = spawn_node_watcher(client.clone(), name.clone(), &cfg);
    loop {
        let node = view.borrow_and_update().node.clone();
        if let Some(node) = node {
            let want = node.labels.get(WANT);
            if node.labels.get(HAVE) != want {
                let patch = BTreeMap::from([(HAVE.to_string(), want.cloned())]);
                if let Err(e) = client.patch_node_metadata(&name, &patch, &BTreeMap::new()).await {
                    eprintln!("with-own: patching {HAVE} on node {name}: {e}");
                }
            }
        }
        if view.changed().await.is_err() {
            return Err("the node watcher stopped".into());
        }
    }
}
