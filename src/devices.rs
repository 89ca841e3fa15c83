//! Plain facts about the node's devices that several layers share: the pairwise GPU
//! [`Topology`] the NVML inventory reads and the device plugin's preferred allocation scores,
//! and the replica IDs (`<uuid>::<n>`) time-slicing and MPS advertise, which the device plugin
//! writes and the metrics' pod attribution reads back; and how sysfs writes PCI ids, which the
//! driver stage, the inventory and the labels read.
//!
//! A leaf: it imports nothing from the crate, so the inventory (`nvml`), the device plugin and
//! the metrics can all use it without importing each other.

use std::collections::HashMap;

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
