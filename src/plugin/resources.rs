//! The device model the plugin advertises: one [`Resource`] per kubelet resource name, each a
//! list of [`PluginDevice`]s built from the NVML inventory and the MIG strategy.

use std::collections::{BTreeMap, BTreeSet};

/// Health as the kubelet device plugin API spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    Healthy,
    Unhealthy,
}

impl Health {
    /// The string the kubelet expects in `Device.health`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "Healthy",
            Health::Unhealthy => "Unhealthy",
        }
    }
}

/// Where a MIG device sits on its parent GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInfo {
    /// UUID of the parent GPU (`GPU-...`).
    pub parent_uuid: String,
    /// NVML index of the parent GPU.
    pub parent_index: u32,
    /// GPU instance id.
    pub gi_id: u32,
    /// Compute instance id inside the GPU instance.
    pub ci_id: u32,
    /// Profile name as NVML reports it without the `MIG ` prefix, e.g. `1g.5gb`, `1c.3g.20gb`.
    pub profile: String,
}

/// One device as advertised to the kubelet, before any time-slicing replication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginDevice {
    /// UUID of the device: `GPU-...` for a whole GPU, `MIG-...` for a MIG device.
    pub uuid: String,
    /// NVIDIA's index form: `"0"` for a whole GPU, `"<gpu>:<mig>"` for a MIG device.
    pub index: String,
    /// Minor number of `/dev/nvidia<minor>`; for a MIG device, the parent GPU's.
    pub minor: u32,
    /// NUMA node of the (parent) GPU, if the platform reports one.
    pub numa_node: Option<i64>,
    /// Set for MIG devices.
    pub mig: Option<MigInfo>,
    pub health: Health,
}

impl PluginDevice {
    /// UUID of the physical GPU this device lives on.
    pub fn physical_uuid(&self) -> &str {
        self.mig.as_ref().map_or(self.uuid.as_str(), |m| m.parent_uuid.as_str())
    }
}

/// A kubelet resource (`nvidia.com/gpu`, `nvidia.com/mig-1g.5gb`, ...) and its devices, keyed by
/// the device ID advertised in `ListAndWatch` (the UUID for now; `<uuid>::<n>` for replicas).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// Full resource name, e.g. `nvidia.com/gpu`.
    pub name: String,
    pub devices: BTreeMap<String, PluginDevice>,
}

impl Resource {
    /// Socket file name for this resource: `nvidia-<name after "nvidia.com/">.sock`.
    pub fn socket_name(&self) -> String {
        let short = self.name.strip_prefix("nvidia.com/").unwrap_or(&self.name);
        format!("nvidia-{short}.sock")
    }
}

/// Devices held elsewhere (claims of the agent's DRA driver), which the device plugin must not
/// hand out: those with these UUIDs, the MIG devices of these GPUs, and the whole GPUs that
/// have a held MIG device (`parents`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Withdrawn {
    /// UUIDs of held GPUs and MIG devices.
    pub devices: BTreeSet<String>,
    /// GPUs with a held MIG device.
    pub parents: BTreeSet<String>,
}

impl Withdrawn {
    /// Whether handing out `device` would hand out something held.
    pub fn covers(&self, device: &PluginDevice) -> bool {
        self.devices.contains(&device.uuid)
            || self.devices.contains(device.physical_uuid())
            || (device.mig.is_none() && self.parents.contains(&device.uuid))
    }

    /// Whether the GPU with this UUID, or a MIG device on it, is held.
    pub fn touches_gpu(&self, gpu_uuid: &str) -> bool {
        self.devices.contains(gpu_uuid) || self.parents.contains(gpu_uuid)
    }

    /// `resources` without the devices this covers (replicas follow their device).
    pub fn apply(&self, resources: &mut [Resource]) {
        if self.devices.is_empty() {
            return;
        }
        for r in resources {
            r.devices.retain(|_, d| !self.covers(d));
        }
    }
}
