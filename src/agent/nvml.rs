//! NVML's lifecycle in the agent: where the library is, opening and closing it (around a driver
//! change), the health watcher on the GPUs it sees, and the node with no NVIDIA GPU at all that
//! idles until one appears.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc;

use super::error::AgentError;
use crate::config::Config;
use crate::host::HostRoot;
use crate::host::arch::HostArch;
use crate::nvml::{Gpus, HealthEvent, Inventory};

/// The NVML library to load ([`crate::nvml::library_path`]): a path under the root; a soname
/// as-is on the real root, else found in the node's library folders for its architecture.
pub fn nvml_library(config: &Config, root: &HostRoot) -> PathBuf {
    crate::nvml::library_path(&config.nvml.library, root, &HostArch::read(root))
}

/// NVML as the agent holds it, with its health watcher.
pub(super) struct Nvml {
    /// NVML, once it loads.
    pub gpus: Option<Gpus>,
    /// Where the health watcher sends what it sees (the health relay).
    health_tx: mpsc::UnboundedSender<HealthEvent>,
    /// Set to stop the running health watcher.
    health_stop: Option<Arc<AtomicBool>>,
    /// The GPUs (UUIDs) the health watcher watches.
    watched: BTreeSet<String>,
    /// Set on a node with no NVIDIA GPU (none on the PCI bus, and NVML cannot load): why. The
    /// agent idles, every stage skipped, and looks again every `nvml.retry_interval`.
    pub no_gpu: Option<String>,
}

impl Nvml {
    pub(super) fn new(health_tx: mpsc::UnboundedSender<HealthEvent>) -> Nvml {
        Nvml {
            gpus: None,
            health_tx,
            health_stop: None,
            watched: BTreeSet::new(),
            no_gpu: None,
        }
    }

    /// Loads NVML.
    pub(super) fn open(&mut self, config: &Config, root: &HostRoot) -> Result<(), AgentError> {
        let library = nvml_library(config, root);
        let gpus = Gpus::open(&library)?;
        tracing::info!("NVML loaded from {}", library.display());
        self.gpus = Some(gpus);
        Ok(())
    }

    /// Drops NVML (before the driver under it is unloaded): the health watcher stops.
    pub(super) fn close(&mut self) {
        self.stop_health();
        self.watched.clear();
        self.gpus = None;
    }

    /// Stops the health watcher.
    pub(super) fn stop_health(&mut self) {
        if let Some(stop) = self.health_stop.take() {
            stop.store(true, Ordering::Relaxed);
        }
    }

    /// (Re)starts the NVML health watcher when the set of GPUs changed.
    pub(super) fn watch_health(&mut self, config: &Config, inventory: Option<&Inventory>) {
        let Some(gpus) = &self.gpus else { return };
        let uuids: BTreeSet<String> = inventory
            .iter()
            .flat_map(|i| i.gpus.iter().map(|g| g.uuid.clone()))
            .collect();
        if uuids == self.watched && self.health_stop.is_some() {
            return;
        }
        if let Some(stop) = self.health_stop.take() {
            stop.store(true, Ordering::Relaxed);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let interval = config.health.lost_check_interval;
        match gpus.watch_health(
            uuids.iter().cloned().collect(),
            interval,
            self.health_tx.clone(),
            stop.clone(),
        ) {
            Ok(_) => {
                self.health_stop = Some(stop);
                self.watched = uuids;
            }
            Err(e) => tracing::error!("{}", AgentError::HealthThread(e)),
        }
    }

    /// While idle: whether a GPU has appeared (on the PCI bus, or NVML now loads: a driver
    /// loaded later on a host whose sysfs shows no bus). Quiet while nothing changed.
    pub(super) fn gpu_appeared(&mut self, config: &Config, root: &HostRoot) -> bool {
        let library = nvml_library(config, root);
        let found = match crate::driver::observe::nvidia_gpus(root) {
            Ok(gpus) if !gpus.is_empty() => Some(format!(
                "NVIDIA GPU(s) on the PCI bus: {}",
                gpus.iter().map(|g| g.address.as_str()).collect::<Vec<_>>().join(", ")
            )),
            _ => match Gpus::open(&library) {
                Ok(gpus) => {
                    self.gpus = Some(gpus);
                    Some(format!("NVML loads from {}", library.display()))
                }
                Err(e) => {
                    tracing::debug!("still no NVIDIA GPU: {e}");
                    None
                }
            },
        };
        let Some(found) = found else {
            return false;
        };
        tracing::info!("{found}: no longer idle, every stage runs");
        self.no_gpu = None;
        true
    }
}

/// Why this node has no NVIDIA GPU to manage, given that NVML failed with `nvml`: `None` when a
/// GPU is on the PCI bus (then NVML's failure is an error) or the bus cannot be read.
pub(super) fn without_gpus(root: &HostRoot, nvml: &AgentError) -> Option<String> {
    match crate::driver::observe::nvidia_gpus(root) {
        Ok(gpus) if gpus.is_empty() => Some(format!(
            "no NVIDIA GPU on this node (none on the PCI bus, and NVML: {nvml})"
        )),
        _ => None,
    }
}
