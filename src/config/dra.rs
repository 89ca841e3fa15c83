//! `[dra]`: the agent as the node's Dynamic Resource Allocation driver (`resource.k8s.io/v1`):
//! its driver name, the kubelet's plugin directories and which devices it publishes.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Check, absolute_path, invalid};

/// Serve DRA: off until it is proven on a real cluster.
pub const DEFAULT_DRA_ENABLED: bool = false;
/// NVIDIA's DRA driver name, so existing DeviceClasses (`device.driver == 'gpu.nvidia.com'`) and
/// claims keep working.
pub const DEFAULT_DRA_DRIVER: &str = "gpu.nvidia.com";
/// The kubelet's plugin-watcher directory (registration sockets).
pub const DEFAULT_DRA_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The kubelet's plugin directory: the DRA socket is `<plugins_dir>/<driver>/dra.sock`.
pub const DEFAULT_DRA_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Device kinds published by default.
pub const DEFAULT_DRA_PUBLISH: &[DraDeviceKind] = &[DraDeviceKind::Gpu, DraDeviceKind::Mig];

/// A kind of device the DRA driver publishes (its `type` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DraDeviceKind {
    /// Whole GPUs (those not in MIG mode).
    Gpu,
    /// MIG devices that exist.
    Mig,
}

impl DraDeviceKind {
    /// The `type` attribute value (NVIDIA's).
    pub fn as_str(self) -> &'static str {
        match self {
            DraDeviceKind::Gpu => "gpu",
            DraDeviceKind::Mig => "mig",
        }
    }
}

/// `[dra]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DraConfig {
    /// Register with the kubelet as a DRA plugin and publish ResourceSlices.
    pub enabled: bool,
    /// The driver name: DeviceClasses and claims select devices by it.
    pub driver: String,
    /// The kubelet's plugin-watcher directory (host path).
    pub registry_dir: PathBuf,
    /// The kubelet's plugin directory (host path).
    pub plugins_dir: PathBuf,
    /// Which devices are published: `gpu`, `mig`.
    pub publish: Vec<DraDeviceKind>,
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            enabled: DEFAULT_DRA_ENABLED,
            driver: DEFAULT_DRA_DRIVER.to_string(),
            registry_dir: DEFAULT_DRA_REGISTRY_DIR.into(),
            plugins_dir: DEFAULT_DRA_PLUGINS_DIR.into(),
            publish: DEFAULT_DRA_PUBLISH.to_vec(),
        }
    }
}

impl DraConfig {
    pub(super) fn validate(&self) -> Check {
        // A CSI-style driver name: DNS-1123 subdomain of at most 63 characters (the API
        // rejects ResourceSlices with any other).
        if self.driver.len() > 63 || !crate::names::is_dns_subdomain(&self.driver) {
            return Err(invalid(
                "dra.driver",
                format!(
                    "{:?} is not a DRA driver name: lower-case DNS subdomain of at most 63 characters, e.g. \"gpu.nvidia.com\"",
                    self.driver
                ),
            ));
        }
        absolute_path("dra.registry_dir", &self.registry_dir)?;
        absolute_path("dra.plugins_dir", &self.plugins_dir)?;
        if self.publish.is_empty() {
            return Err(invalid("dra.publish", "expected at least one of \"gpu\", \"mig\""));
        }
        let unique: BTreeSet<_> = self.publish.iter().collect();
        if unique.len() != self.publish.len() {
            return Err(invalid("dra.publish", "lists a kind twice"));
        }
        Ok(())
    }
}
