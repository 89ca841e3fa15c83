//! Plain facts about the node's devices that several layers share: the pairwise GPU
//! [`Topology`] the NVML inventory reads and the device plugin's preferred allocation scores,
//! and the replica IDs (`<uuid>::<n>`) time-slicing and MPS advertise, which the device plugin
//! writes and the metrics' pod attribution reads back; and how sysfs writes PCI ids, which the
//! driver stage, the inventory and the labels read. Also the devices as the device plugin and
//! the DRA driver hand them out ([`PluginDevice`], one per GPU or MIG device, grouped into a
//! kubelet [`Resource`]) and the devices the DRA driver holds ([`Withdrawn`]), which both read.
//!
//! A leaf: it imports nothing from the crate, so the inventory (`nvml`), the device plugin and
//! the metrics can all use it without importing each other.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The PCI vendor id of NVIDIA.
pub const NVIDIA_VENDOR: u16 = 0x10de;

/// Parses a sysfs hex attribute such as `0x10de\n` (`vendor`, `device`, `class`).
pub fn parse_sysfs_hex(text: &str) -> Option<u32> {
    let t = text.trim();
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    u32::from_str_radix(digits, 16).ok()
}

/// Separator between a device UUID and its replica number in time-slicing/MPS IDs.
pub const REPLICA_SEPARATOR: &str = "::";

/// Splits a replica ID `<uuid>::<n>` into its parts; `None` for a plain device ID.
pub fn split_replica_id(id: &str) -> Option<(&str, &str)> {
    id.split_once(REPLICA_SEPARATOR)
}

/// Whether `id` names a time-slicing/MPS replica (`<uuid>::<n>`).
pub fn is_replica_id(id: &str) -> bool {
    split_replica_id(id).is_some()
}

/// Pairwise link scores between physical GPUs, keyed by GPU UUID; symmetric. Built from NVML
/// by the inventory code with [`link_score`]. Unknown pairs score 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    scores: HashMap<(String, String), u32>,
}

impl Topology {
    /// An empty topology: every pair scores 0, so only the NUMA and index tie-breaks apply.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the score of the pair `a`–`b` (both directions). A GPU paired with itself is
    /// ignored.
    pub fn set(&mut self, a: &str, b: &str, score: u32) {
        if a != b {
            self.scores.insert(Self::key(a, b), score);
        }
    }

    /// Score of the pair `a`–`b`; 0 when unknown or `a == b`.
    pub fn score(&self, a: &str, b: &str) -> u32 {
        if a == b {
            return 0;
        }
        self.scores.get(&Self::key(a, b)).copied().unwrap_or(0)
    }

    /// Whether no pair has been set.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    fn key(a: &str, b: &str) -> (String, String) {
        if a <= b {
            (a.to_string(), b.to_string())
        } else {
            (b.to_string(), a.to_string())
        }
    }
}

/// NVML's common-ancestor level of two GPUs on the PCIe tree (`nvmlGpuTopologyLevel_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TopologyLevel {
    /// Same board (multi-GPU board).
    Internal,
    /// Behind one PCIe switch.
    Single,
    /// Behind several PCIe switches, no host bridge crossed.
    Multiple,
    /// Behind the same host bridge.
    HostBridge,
    /// Same CPU / NUMA node, different host bridges.
    Node,
    /// Across CPUs (SMP interconnect).
    System,
}

impl TopologyLevel {
    /// go-gpuallocator's PCIe score: Internal 60, Single 50, Multiple 40, HostBridge 30,
    /// Node 20, System 10.
    pub fn score(self) -> u32 {
        match self {
            TopologyLevel::Internal => 60,
            TopologyLevel::Single => 50,
            TopologyLevel::Multiple => 40,
            TopologyLevel::HostBridge => 30,
            TopologyLevel::Node => 20,
            TopologyLevel::System => 10,
        }
    }
}

/// Most NVLinks between two GPUs that go-gpuallocator scores: its pair score has cases for
/// 1..=12 links only, so a pair with more (18 on a bridged H100 NVL pair) gets no NVLink points.
pub const MAX_SCORED_NVLINKS: u32 = 12;

/// Score of one GPU pair, go-gpuallocator's `calculateGPUPairScore`: 100 per NVLink between
/// them (none past [`MAX_SCORED_NVLINKS`]) plus the PCIe level's score (`None` when NVML could
/// not tell: 0). Links to an NVSwitch are not links to a GPU and score nothing (go-gpuallocator
/// matches a link's remote PCI address against the other GPU's).
pub fn link_score(nvlinks: u32, level: Option<TopologyLevel>) -> u32 {
    let nvlink = if nvlinks <= MAX_SCORED_NVLINKS {
        nvlinks * 100
    } else {
        0
    };
    nvlink + level.map_or(0, TopologyLevel::score)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores() {
        assert_eq!(link_score(0, None), 0);
        assert_eq!(link_score(0, Some(TopologyLevel::System)), 10);
        assert_eq!(link_score(0, Some(TopologyLevel::Node)), 20);
        assert_eq!(link_score(0, Some(TopologyLevel::HostBridge)), 30);
        assert_eq!(link_score(0, Some(TopologyLevel::Multiple)), 40);
        assert_eq!(link_score(0, Some(TopologyLevel::Single)), 50);
        assert_eq!(link_score(0, Some(TopologyLevel::Internal)), 60);
        assert_eq!(link_score(12, Some(TopologyLevel::System)), 1210);
        assert_eq!(link_score(13, Some(TopologyLevel::System)), 10);
        assert_eq!(link_score(18, None), 0);
        assert_eq!(link_score(u32::MAX, None), 0);

        let mut t = Topology::new();
        assert!(t.is_empty());
        t.set("a", "b", 7);
        t.set("a", "a", 99);
        assert_eq!((t.score("a", "b"), t.score("b", "a")), (7, 7));
        assert_eq!((t.score("a", "a"), t.score("a", "c")), (0, 0));
    }

    #[test]
    fn replica_ids() {
        assert_eq!(split_replica_id("GPU-1::3"), Some(("GPU-1", "3")));
        assert_eq!(split_replica_id("GPU-1"), None);
        assert!(is_replica_id("GPU-1::0"));
        assert!(!is_replica_id("MIG-2"));
    }
}
