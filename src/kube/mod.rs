//! The Kubernetes API client: finding credentials (kubeconfig, exec plugins, the in-cluster
//! service account), TLS with rustls, and the few calls the agent makes on its own Node: get,
//! watch (with the poll fallback), merge-patch labels and annotations, and post Events.
//!
//! Effects: reads kubeconfig, token, certificate and CA files through the `--root` prefix,
//! runs exec credential plugins (argv, never a shell), and talks HTTPS to the API server.
//! Nothing here writes files.
//!
//! - [`discover`] finds [`Credentials`] (or none: the agent then runs without Kubernetes);
//! - [`KubeClient::new`] turns them into a client, which re-reads rotated files and refreshes
//!   credentials once on a 401;
//! - [`spawn_node_watcher`] keeps a [`NodeView`] current with about one request per
//!   `watch_timeout` at steady state;
//! - [`node_name`] says which Node is ours.

mod client;
mod credentials;
mod discover;
mod error;
mod exec;
mod kubeconfig;
mod limit;
mod node;
mod time;
mod watch;
mod watcher;

#[cfg(test)]
mod testserver;

pub use client::{
    COMPONENT, EVENT_NAMESPACE, EventType, KubeClient, MAX_EVENT_MESSAGE, NodeEvent, ResponseObserver,
    WATCH_IDLE_MARGIN,
};
pub use credentials::{
    Auth, ClientCert, Credentials, ENV_KUBECONFIG, ENV_SERVICE_HOST, ENV_SERVICE_PORT, ExecApiVersion, ExecConfig,
    FoundBy, Material, MaterialSource, Origin, Secret, TokenSource, in_cluster,
};
pub use discover::{discover, discover_with, load_kubeconfig};
pub(crate) use error::error_chain;
pub use error::{ApiFailure, ApiStatus, HttpFailure, KubeError};
pub use exec::{EXEC_TIMEOUT, EXPIRY_MARGIN};
pub use limit::{
    MAX_API_BODY, MAX_CREDENTIAL_FILE, MAX_ERROR_BODY, MAX_EXEC_OUTPUT, MAX_EXEC_STDERR, MAX_KUBECONFIG,
    MAX_WATCH_EVENT,
};
pub use node::Node;
pub use time::{format_rfc3339, parse_rfc3339};
pub use watch::{WatchEvent, WatchStream};
pub use watcher::{NodeApi, NodeView, SyncMode, spawn_node_watcher, spawn_node_watcher_with};

use crate::config::KubernetesConfig;
use crate::host::HostRoot;

/// Env var with the Node's name (set from the downward API, or in the unit file).
pub const ENV_NODE_NAME: &str = "NODE_NAME";

/// This node's name: `kubernetes.node_name`, else `$NODE_NAME`, else the hostname, lowercased
/// as the kubelet does.
pub fn node_name(cfg: &KubernetesConfig, root: &HostRoot) -> String {
    node_name_with(cfg, root, &|name| std::env::var(name).ok())
}

/// [`node_name`] with an explicit environment lookup.
pub fn node_name_with(cfg: &KubernetesConfig, root: &HostRoot, env: &dyn Fn(&str) -> Option<String>) -> String {
    let configured = cfg.node_name.trim();
    if !configured.is_empty() {
        return configured.to_string();
    }
    if let Some(name) = env(ENV_NODE_NAME)
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
    {
        return name;
    }
    crate::host::hostname(root).trim().to_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_name_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("etc")).expect("mkdir");
        std::fs::write(dir.path().join("etc/hostname"), "GPU-Host-7\n").expect("write");
        let root = HostRoot::new(dir.path());
        let mut cfg = KubernetesConfig::default();
        let env_set = |name: &str| (name == ENV_NODE_NAME).then(|| "from-env".to_string());
        let env_empty = |_: &str| None;
        assert_eq!(node_name_with(&cfg, &root, &env_empty), "gpu-host-7");
        assert_eq!(node_name_with(&cfg, &root, &env_set), "from-env");
        cfg.node_name = "configured".into();
        assert_eq!(node_name_with(&cfg, &root, &env_set), "configured");
    }
}
