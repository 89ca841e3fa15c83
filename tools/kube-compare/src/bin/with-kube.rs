//! The comparison program on kube-rs, written the way a kube-rs user would write it.
//!
//! `with-kube KUBECONFIG NODE`: merge-patches `example.com/ready=true` on the Node, posts one
//! core/v1 Event about it, then watches the Node with kube-runtime's `watcher` (field selector
//! `metadata.name=NODE`, the default backoff) and keeps the label `example.com/have` equal to
//! `example.com/want` (removed when `want` is). `with-own` does the same with the agent's own
//! client; `measure` runs both against the test API server.

use std::error::Error;

use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config};
use serde_json::json;

/// The label the program sets once at start.
const READY: &str = "example.com/ready";
/// The label it follows ...
const WANT: &str = "example.com/want";
/// ... and the one it keeps equal to it.
const HAVE: &str = "example.com/have";

// One thread, as the agent runs (its main builds a current-thread runtime), so that RSS
// compares like for like.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(kubeconfig), Some(name)) = (args.next(), args.next()) else {
        return Err("usage: with-kube KUBECONFIG NODE".into());
    };
    let kubeconfig = Kubeconfig::read_from(&kubeconfig).map_err(|e| format!("kubeconfig {kubeconfig}: {e}"))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;
    let nodes: Api<Node> = Api::all(client.clone());

    let ready = json!({ "metadata": { "labels": { READY: "true" } } });
    let node = nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(&ready))
        .await?;

    let now = Time(Timestamp::now());
    let event = Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}.")),
            namespace: Some("default".into()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.clone()),
            uid: node.metadata.uid.clone(),
            ..ObjectReference::default()
        },
        reason: Some("Started".into()),
        message: Some("with-kube is watching this Node".into()),
        type_: Some("Normal".into()),
        source: Some(EventSource {
            component: Some("with-kube".into()),
            host: Some(name.clone()),
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        reporting_component: Some("with-kube".into()),
        reporting_instance: Some(name.clone()),
        ..Event::default()
    };
    Api::<Event>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &event)
        .await?;
    eprintln!("with-kube: ready");

    let selector = format!("metadata.name={name}");
    let mut stream = watcher(nodes.clone(), watcher::Config::default().fields(&selector))
        .default_backoff()
        .applied_objects()
        .boxed();
    loop {
        match stream.try_next().await {
            Ok(Some(node)) => {
                let labels = node.metadata.labels.unwrap_or_default();
                let want = labels.get(WANT);
                if labels.get(HAVE) != want {
                    let patch = json!({ "metadata": { "labels": { HAVE: want } } });
                    if let Err(e) = nodes.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                        eprintln!("with-kube: patching {HAVE} on node {name}: {e}");
                    }
                }
            }
            Ok(None) => return Err("the watcher stream ended".into()),
            // The stream backs off by itself (default_backoff) and goes on.
            Err(e) => eprintln!("with-kube: watching node {name}: {e}"),
        }
    }
}
