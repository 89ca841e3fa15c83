//! The agent as the node's Dynamic Resource Allocation driver (`resource.k8s.io/v1`), beside
//! (or instead of) the device plugin, from the same inventory, health and CDI spec.
//!
//! - `devices.rs` (pure): the GPUs and MIG devices in NVIDIA's DRA names and attributes, and
//!   the ResourceSlices that carry them;
//! - `claims.rs` (pure): what an allocated claim gives this driver, the checkpoint, the names
//!   of a claim's CDI spec (its edits are the node's container edits, [`crate::edits`],
//!   rendered by `runtime::cdi::claim_spec`);
//! - `driver.rs`: prepare/unprepare with the checkpoint, and the slice publisher;
//! - `server.rs`: the registration and DRA node services on their Unix sockets.
//!
//! [`start`] runs it all: sockets, publisher, and a watch on the socket files (recreated when
//! someone removes them). The device plugin reads [`DraHandle::withdrawn`]: GPUs prepared for
//! claims are not advertised there, and the publisher leaves out what the device plugin has
//! handed out, so the two APIs never give out one GPU twice.

pub mod claims;
pub mod devices;
pub mod driver;
pub mod server;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::devices::Withdrawn;
use crate::host::HostRoot;
use crate::kube::KubeClient;
use crate::nvml::Inventory;
pub use claims::checkpoint_path;
pub use driver::{DraStatus, Driver, HealthFn, Inputs};

/// How often the socket files are checked (someone may delete them).
const SOCKET_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Whether the DRA driver ran on this node (its checkpoint exists from its first start), so
/// that its slices may still be out there.
pub fn was_on(config: &Config, root: &HostRoot) -> bool {
    checkpoint_path(config, root).exists()
}

/// The registration socket's host path: `<registry_dir>/<driver>-reg.sock`.
pub fn registration_socket(config: &Config) -> PathBuf {
    config.dra.registry_dir.join(format!("{}-reg.sock", config.dra.driver))
}

/// The DRA socket's host path: `<plugins_dir>/<driver>/dra.sock`.
pub fn dra_socket(config: &Config) -> PathBuf {
    config.dra.plugins_dir.join(&config.dra.driver).join("dra.sock")
}

/// The Kubernetes client the driver uses (the same credentials as the cluster link); `None`
/// without any, or with `[kubernetes] enabled = false`.
pub fn client(config: &Config, root: &HostRoot) -> Option<KubeClient> {
    if !config.kubernetes.enabled {
        return None;
    }
    match crate::kube::discover(&config.kubernetes, root) {
        Ok(Some(credentials)) => match KubeClient::new(credentials, &config.kubernetes) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!("DRA: cannot build the Kubernetes API client: {e}");
                None
            }
        },
        Ok(None) => None,
        Err(e) => {
            tracing::error!("DRA: {e}");
            None
        }
    }
}

/// The running driver.
pub struct DraHandle {
    pub driver: Arc<Driver>,
    /// The agent's inventory for the driver (GPUs whose MIG layout is changing left out).
    pub inventory: watch::Sender<Option<Arc<Inventory>>>,
    /// The devices claims hold, for the device plugin.
    pub withdrawn: watch::Receiver<Withdrawn>,
    /// The driver's state, for status.
    pub status: watch::Receiver<DraStatus>,
    task: JoinHandle<()>,
}

impl DraHandle {
    /// Waits for the driver to stop (after `stop` was cancelled).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Starts the driver: sockets (DRA first, then registration), the slice publisher. Runs until
/// `stop`; then removes the sockets. `Err` when a socket cannot be bound (the message names it).
pub fn start(config: Config, root: HostRoot, inputs: Inputs, stop: CancellationToken) -> Result<DraHandle, String> {
    let node = crate::kube::node_name(&config.kubernetes, &root);
    let client = client(&config, &root);
    let dra_host = dra_socket(&config);
    let reg_host = registration_socket(&config);
    let (dra_path, reg_path) = (root.join(&dra_host), root.join(&reg_host));
    let endpoint = dra_host.display().to_string();
    let (inventory, inventory_rx) = watch::channel(None);
    let (driver, withdrawn) = Driver::new(config, root, node, client, inputs, inventory_rx);
    tracing::info!(
        "DRA driver {} serving {} (registration {})",
        driver.config.dra.driver,
        dra_path.display(),
        reg_path.display()
    );
    let bind = move |driver: &Arc<Driver>| {
        server::Sockets::start(driver.clone(), &dra_path, &reg_path, endpoint.clone()).map_err(|e| {
            format!(
                "DRA: cannot serve {} and {}: {e}",
                dra_path.display(),
                reg_path.display()
            )
        })
    };
    let mut sockets = bind(&driver)?;
    let publisher = tokio::spawn(driver.clone().publish(stop.clone()));
    let d = driver.clone();
    let task = tokio::spawn(async move {
        let mut check = tokio::time::interval(SOCKET_CHECK_EVERY);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = check.tick() => {
                    if !sockets.intact() {
                        tracing::warn!("DRA: a socket of driver {} was removed: serving it again", d.config.dra.driver);
                        sockets.stop().await;
                        match bind(&d) {
                            Ok(s) => sockets = s,
                            Err(e) => {
                                tracing::error!("{e}");
                                return;
                            }
                        }
                    }
                }
            }
        }
        sockets.stop().await;
        let _ = publisher.await;
    });
    let status = driver.status.subscribe();
    Ok(DraHandle {
        driver,
        inventory,
        withdrawn,
        status,
        task,
    })
}

/// Deletes this node's slices of the driver (DRA turned off, or the agent unconfigured);
/// returns how many there were. `Err` without credentials, or when the API server refuses.
pub async fn remove_slices(config: &Config, root: &HostRoot) -> Result<usize, String> {
    let client = client(config, root).ok_or_else(|| "no Kubernetes credentials".to_string())?;
    let node = crate::kube::node_name(&config.kubernetes, root);
    let driver = &config.dra.driver;
    let slices = client
        .list_resource_slices(&node, driver)
        .await
        .map_err(|e| e.to_string())?;
    for s in &slices {
        if let Some(name) = s.pointer("/metadata/name").and_then(serde_json::Value::as_str) {
            client.delete_resource_slice(name).await.map_err(|e| e.to_string())?;
        }
    }
    Ok(slices.len())
}
