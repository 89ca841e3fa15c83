//! Time-slicing (pure): a shared resource's devices are advertised as replicas, NVIDIA's
//! `<id>::<n>` for `n` in `0..replicas`, each a copy of its device (health, NUMA node, MIG
//! placement), so health, `Allocate` (which maps a replica back to its device) and
//! `GetPreferredAllocation` (which spreads or packs replicas over physical GPUs) need nothing
//! else. Also what the memory-limit enforcer and the GPU feature labels need to know about the
//! sharing config.
//!
//! The config is `[device_plugin.sharing]` ([`Sharing`]); a profile's `sharing` table replaces
//! it whole.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{
    MemoryBudget, MigStrategy, RESOURCE_PREFIX, SharedDevices, SharedResource, Sharing, SharingStrategy,
};
use crate::devices::REPLICA_SEPARATOR;
use crate::devices::{PluginDevice, Resource};
use crate::labels::gfd::ResourceSharing;
use crate::nvml::Inventory;
use crate::plugin::strategy::build_resources;

/// Why the sharing config cannot be applied to the resources.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharingError {
    /// A compact entry that does not parse (a loaded config has been validated; this is for
    /// configs built in code).
    #[error("[device_plugin.sharing] compact: {0}")]
    Compact(String),
    /// `strategy = "mps"` on a MIG device (NVIDIA's "sharing using MPS is not supported for MIG
    /// devices", `internal/plugin/mps.go`), as under `mig_strategy = "single"` with MIG on.
    #[error(
        "[device_plugin.sharing] strategy = \"mps\": {resource} has MIG device {device} (GPU {gpu}); sharing using MPS is not supported for MIG devices: disable MIG on the GPU or use mig_strategy = \"none\""
    )]
    MpsOnMig {
        resource: String,
        device: String,
        gpu: String,
    },
    /// The replicas' name is already advertised for other devices.
    #[error(
        "sharing {resource}: its replicas would be advertised as {name}, which is already advertised for other devices; choose another rename"
    )]
    NameTaken { resource: String, name: String },
}

/// The resources with every shared device replaced by its replicas, under the shared
/// resource's advertised name (`rename`, or `<name>.shared` with `rename_by_default`).
///
/// - An entry applies to the resource it names; a resource that is not advertised is skipped.
/// - Only the devices `devices` selects are replicated; the others stay as they were, under the
///   original name.
/// - A device gets `replicas_per_gpu` for its own index or UUID, else for its GPU's (MIG
///   devices), else `replicas`. An entry whose devices all get 1 changes nothing (NVIDIA wants
///   at least 2 to share; 1 is accepted as "not shared").
/// - Resources left without devices are dropped; the result is sorted by name.
pub fn apply_sharing(resources: Vec<Resource>, sharing: &Sharing) -> Result<Vec<Resource>, SharingError> {
    let entries = sharing.entries().map_err(SharingError::Compact)?;
    let advertised: BTreeSet<String> = resources.iter().map(|r| r.name.clone()).collect();
    let mut out: BTreeMap<String, Resource> = resources.into_iter().map(|r| (r.name.clone(), r)).collect();
    for entry in &entries {
        let source = entry.resource_name();
        // Entries apply to the resources as built, never to another entry's replicas.
        let Some(resource) = out.get_mut(&source).filter(|_| advertised.contains(&source)) else {
            continue;
        };
        let (picked, kept): (BTreeMap<String, PluginDevice>, BTreeMap<String, PluginDevice>) = resource
            .devices
            .clone()
            .into_iter()
            .partition(|(_, d)| selects(entry, d));
        if picked.values().all(|d| replicas_for(entry, d) <= 1) {
            continue;
        }
        if sharing.strategy == SharingStrategy::Mps
            && let Some(d) = picked.values().find(|d| d.mig.is_some())
        {
            return Err(SharingError::MpsOnMig {
                resource: source,
                device: d.uuid.clone(),
                gpu: d.index.clone(),
            });
        }
        resource.devices = kept;
        let name = entry.advertised_name(sharing.rename_by_default);
        if name != source && out.contains_key(&name) {
            return Err(SharingError::NameTaken { resource: source, name });
        }
        let target = out.entry(name.clone()).or_insert_with(|| Resource {
            name,
            devices: BTreeMap::new(),
        });
        for (id, device) in picked {
            for n in 0..replicas_for(entry, &device) {
                target
                    .devices
                    .insert(format!("{id}{REPLICA_SEPARATOR}{n}"), device.clone());
            }
        }
    }
    out.retain(|_, r| !r.devices.is_empty());
    Ok(out.into_values().collect())
}

/// The memory budget of one replica for every device a sharing entry selects, keyed by the
/// device's UUID (the GPU's, or the MIG device's where MIG devices are the resource): the
/// entry's `memory_per_replica` in MiB, or with `"fair"` the device's memory divided by its
/// replica count (rounded down); `None` when the entry sets no budget. Devices no entry selects
/// are not in the map. What the memory-limit enforcer compares GPU processes with.
///
/// `mig_strategy` decides what `nvidia.com/gpu` is (whole GPUs, or MIG devices under
/// `single`), as it does for the advertised resources. An inventory the strategy cannot
/// advertise, or a compact entry that does not parse, gives an empty map.
///
/// Under `strategy = "mps"` the map is empty: the MPS server enforces each client's pinned
/// memory limit itself ([`crate::plugin::mps`]), so the enforcer has nothing to watch.
pub fn replica_budgets(
    sharing: &Sharing,
    inventory: &Inventory,
    mig_strategy: MigStrategy,
) -> BTreeMap<String, Option<u64>> {
    if sharing.strategy == SharingStrategy::Mps {
        return BTreeMap::new();
    }
    let (Ok(resources), Ok(entries)) = (build_resources(inventory, mig_strategy), sharing.entries()) else {
        return BTreeMap::new();
    };
    let memory: BTreeMap<&str, u64> = inventory
        .gpus
        .iter()
        .flat_map(|g| {
            let migs = g.mig_devices.iter().map(|m| (m.uuid.as_str(), m.memory_mib));
            std::iter::once((g.uuid.as_str(), g.memory_mib)).chain(migs)
        })
        .collect();
    let mut out = BTreeMap::new();
    for entry in &entries {
        let source = entry.resource_name();
        let Some(resource) = resources.iter().find(|r| r.name == source) else {
            continue;
        };
        for device in resource.devices.values().filter(|d| selects(entry, d)) {
            let budget = entry.memory_per_replica.map(|budget| match budget {
                MemoryBudget::Mib(mib) => mib,
                MemoryBudget::Fair => {
                    let total = memory.get(device.uuid.as_str()).copied().unwrap_or(0);
                    total / u64::from(replicas_for(entry, device).max(1))
                }
            });
            out.insert(device.uuid.clone(), budget);
        }
    }
    out
}

/// The sharing of each resource as the GPU feature labels report it, keyed by the resource's
/// unrenamed name after `nvidia.com/` (`gpu`, `mig-1g.5gb`). With per-GPU counts, the largest
/// count is the one labelled.
pub fn feature_sharing(sharing: &Sharing) -> BTreeMap<String, ResourceSharing> {
    let entries = sharing.entries().unwrap_or_default();
    entries
        .iter()
        .map(|e| {
            let name = e.resource_name();
            let short = name.strip_prefix(RESOURCE_PREFIX).unwrap_or(&name).to_string();
            let sharing = ResourceSharing {
                replicas: e.max_replicas(),
                renamed: e.advertised_name(sharing.rename_by_default) != name,
            };
            (short, sharing)
        })
        .collect()
}

/// Whether `key` (from `devices` or `replicas_per_gpu`) names the device itself: its UUID or
/// its index (`0`, `0:1`).
fn names_device(key: &str, device: &PluginDevice) -> bool {
    key == device.uuid || key == device.index
}

/// Whether `key` names the GPU a MIG device is on.
fn names_parent(key: &str, device: &PluginDevice) -> bool {
    device
        .mig
        .as_ref()
        .is_some_and(|m| key == m.parent_uuid || key == m.parent_index.to_string())
}

/// Whether the entry's `devices` selects `device` (a GPU selects its MIG devices too).
pub(crate) fn selects(entry: &SharedResource, device: &PluginDevice) -> bool {
    match &entry.devices {
        SharedDevices::All => true,
        SharedDevices::List(list) => list
            .iter()
            .any(|key| names_device(key, device) || names_parent(key, device)),
    }
}

/// The replica count of `device`: `replicas_per_gpu` for the device itself, else for its GPU,
/// else `replicas`.
pub(crate) fn replicas_for(entry: &SharedResource, device: &PluginDevice) -> u32 {
    let per_gpu = &entry.replicas_per_gpu;
    let own = per_gpu.iter().find(|(key, _)| names_device(key, device));
    let parent = || per_gpu.iter().find(|(key, _)| names_parent(key, device));
    own.or_else(parent).map_or(entry.replicas, |(_, n)| *n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SharedPolicy;
    use crate::devices::Health;
    use crate::nvml::GpuInfo;
    use crate::nvml::sample::{self, inventory};

    fn gpu(index: u32, migs: &[&str]) -> GpuInfo {
        GpuInfo {
            numa_node: Some(i64::from(index)),
            mig: (!migs.is_empty()).then_some(sample::mig(true)),
            mig_devices: sample::mig_devices(index, migs),
            ..sample::a100(index)
        }
    }

    fn entry(name: &str, replicas: u32) -> SharedResource {
        SharedResource::new(name, replicas)
    }

    fn time_slicing(resources: Vec<SharedResource>) -> Sharing {
        Sharing {
            strategy: SharingStrategy::TimeSlicing,
            resources,
            ..Sharing::default()
        }
    }

    fn shared(inv: &Inventory, strategy: MigStrategy, sharing: &Sharing) -> Vec<Resource> {
        apply_sharing(build_resources(inv, strategy).expect("resources"), sharing).expect("sharing")
    }

    fn names(resources: &[Resource]) -> Vec<(&str, usize)> {
        resources.iter().map(|r| (r.name.as_str(), r.devices.len())).collect()
    }

    fn ids(resource: &Resource) -> Vec<&str> {
        resource.devices.keys().map(String::as_str).collect()
    }

    #[test]
    fn replicas_copy_their_device_and_are_numbered_from_zero() {
        let inv = inventory(vec![gpu(0, &[]), gpu(1, &[])]);
        let mut sharing = time_slicing(vec![entry("nvidia.com/gpu", 4)]);
        sharing.rename_by_default = true;
        let mut before = build_resources(&inv, MigStrategy::None).expect("resources");
        before[0].devices.get_mut("GPU-1").expect("GPU 1").health = Health::Unhealthy;
        let got = apply_sharing(before, &sharing).expect("sharing");
        assert_eq!(names(&got), [("nvidia.com/gpu.shared", 8)]);
        assert_eq!(
            ids(&got[0]),
            [
                "GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-0::3", "GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-1::3"
            ]
        );
        let replica = &got[0].devices["GPU-1::3"];
        assert_eq!(replica.uuid, "GPU-1");
        assert_eq!(replica.index, "1");
        assert_eq!(replica.numa_node, Some(1));
        assert_eq!(replica.health, Health::Unhealthy);
        assert_eq!(got[0].socket_name(), "nvidia-gpu.shared.sock");

        // Without rename_by_default the name stays; a bare name means nvidia.com/.
        let sharing = time_slicing(vec![entry("gpu", 2)]);
        assert_eq!(
            names(&shared(&inv, MigStrategy::None, &sharing)),
            [("nvidia.com/gpu", 4)]
        );
    }

    #[test]
    fn one_replica_or_no_sharing_changes_nothing() {
        let inv = inventory(vec![gpu(0, &[]), gpu(1, &[])]);
        let before = build_resources(&inv, MigStrategy::None).expect("resources");
        let mut sharing = time_slicing(vec![entry("nvidia.com/gpu", 1)]);
        sharing.rename_by_default = true;
        assert_eq!(apply_sharing(before.clone(), &sharing), Ok(before.clone()));
        assert_eq!(apply_sharing(before.clone(), &Sharing::default()), Ok(before.clone()));
        // Listed but strategy none: nothing either.
        let mut off = time_slicing(vec![entry("nvidia.com/gpu", 4)]);
        off.strategy = SharingStrategy::None;
        assert_eq!(apply_sharing(before.clone(), &off), Ok(before.clone()));
        // A resource that is not advertised is skipped.
        let other = time_slicing(vec![entry("mig-1g.5gb", 4)]);
        assert_eq!(apply_sharing(before.clone(), &other), Ok(before));
    }

    #[test]
    fn per_gpu_counts_and_device_selection() {
        let inv = inventory(vec![gpu(0, &[]), gpu(1, &[]), gpu(2, &[])]);
        let mut e = entry("nvidia.com/gpu", 2);
        e.rename = "gpu.small".into();
        e.devices = SharedDevices::List(vec!["0".into(), "GPU-1".into()]);
        e.replicas_per_gpu = BTreeMap::from([("GPU-0".into(), 3), ("2".into(), 7)]);
        let got = shared(&inv, MigStrategy::None, &time_slicing(vec![e]));
        // GPU 2 is not selected: it stays a whole nvidia.com/gpu (its count is not used).
        assert_eq!(names(&got), [("nvidia.com/gpu", 1), ("nvidia.com/gpu.small", 5)]);
        assert_eq!(ids(&got[0]), ["GPU-2"]);
        assert_eq!(
            ids(&got[1]),
            ["GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-1::0", "GPU-1::1"]
        );

        // A base of 1 with one GPU at 4: that GPU is shared, the others get one replica each.
        let mut e = entry("nvidia.com/gpu", 1);
        e.replicas_per_gpu = BTreeMap::from([("1".into(), 4)]);
        let got = shared(&inv, MigStrategy::None, &time_slicing(vec![e]));
        assert_eq!(names(&got), [("nvidia.com/gpu", 6)]);
        assert!(got[0].devices.contains_key("GPU-0::0") && !got[0].devices.contains_key("GPU-0::1"));
    }

    #[test]
    fn mig_resources_are_shared_by_profile_and_by_gpu() {
        let inv = inventory(vec![gpu(0, &["1g.5gb", "1g.5gb", "3g.20gb"]), gpu(1, &["1g.5gb"])]);
        let mut small = entry("mig-1g.5gb", 2);
        small.replicas_per_gpu = BTreeMap::from([("1".into(), 3), ("0:1".into(), 5)]);
        let sharing = Sharing {
            rename_by_default: true,
            ..time_slicing(vec![small])
        };
        let got = shared(&inv, MigStrategy::Mixed, &sharing);
        assert_eq!(
            names(&got),
            [("nvidia.com/mig-1g.5gb.shared", 10), ("nvidia.com/mig-3g.20gb", 1)]
        );
        let r = &got[0];
        assert_eq!(r.devices.keys().filter(|k| k.starts_with("MIG-0-0::")).count(), 2);
        assert_eq!(r.devices.keys().filter(|k| k.starts_with("MIG-0-1::")).count(), 5);
        assert_eq!(r.devices.keys().filter(|k| k.starts_with("MIG-1-0::")).count(), 3);
        assert_eq!(r.devices["MIG-1-0::2"].physical_uuid(), "GPU-1");

        // GPU 0 selected by index selects its MIG devices.
        let mut mid = entry("nvidia.com/mig-3g.20gb", 2);
        mid.rename = "nvidia.com/mig-3g.20gb.pair".into();
        mid.devices = SharedDevices::List(vec!["0".into()]);
        let got = shared(&inv, MigStrategy::Mixed, &time_slicing(vec![mid]));
        assert_eq!(
            names(&got),
            [("nvidia.com/mig-1g.5gb", 3), ("nvidia.com/mig-3g.20gb.pair", 2)]
        );
    }

    #[test]
    fn compact_entries_are_resources_too() {
        let inv = inventory(vec![gpu(0, &["3g.20gb", "3g.20gb"]), gpu(1, &[])]);
        let sharing = Sharing {
            compact: vec!["gpu:sharedgpu:4".into(), "mig-3g.20gb:small:2".into()],
            ..time_slicing(Vec::new())
        };
        let got = shared(&inv, MigStrategy::Mixed, &sharing);
        assert_eq!(names(&got), [("nvidia.com/sharedgpu", 4), ("nvidia.com/small", 4)]);
        // An empty new name is the default naming.
        let sharing = Sharing {
            compact: vec!["gpu::3".into()],
            rename_by_default: true,
            ..time_slicing(Vec::new())
        };
        assert_eq!(
            names(&shared(&inv, MigStrategy::None, &sharing)),
            [("nvidia.com/gpu.shared", 6)]
        );
        let bad = Sharing {
            compact: vec!["gpu:4".into()],
            ..time_slicing(Vec::new())
        };
        let resources = build_resources(&inv, MigStrategy::None).expect("resources");
        let e = apply_sharing(resources, &bad).expect_err("does not parse");
        assert!(e.to_string().contains("expected resource:newname:replicas"), "{e}");
    }

    #[test]
    fn entries_never_share_replicas_again() {
        let inv = inventory(vec![gpu(0, &[]), gpu(1, &[])]);
        let sharing = Sharing {
            compact: vec!["gpu:foo:2".into(), "foo::3".into()],
            ..time_slicing(Vec::new())
        };
        assert_eq!(
            names(&shared(&inv, MigStrategy::None, &sharing)),
            [("nvidia.com/foo", 4)]
        );
    }

    #[test]
    fn a_rename_onto_another_resource_is_refused() {
        let inv = inventory(vec![gpu(0, &["1g.5gb"]), gpu(1, &[])]);
        let mut e = entry("mig-1g.5gb", 2);
        e.rename = "nvidia.com/gpu".into();
        let resources = build_resources(&inv, MigStrategy::Mixed).expect("resources");
        let err = apply_sharing(resources, &time_slicing(vec![e])).expect_err("name taken");
        assert_eq!(
            err,
            SharingError::NameTaken {
                resource: "nvidia.com/mig-1g.5gb".into(),
                name: "nvidia.com/gpu".into()
            }
        );
    }

    #[test]
    fn budgets_in_mib_or_a_fair_share() {
        let inv = inventory(vec![gpu(0, &[]), gpu(1, &[]), gpu(2, &["1g.5gb", "1g.5gb"])]);
        let mut whole = entry("gpu", 4);
        whole.memory_per_replica = Some(MemoryBudget::Fair);
        whole.replicas_per_gpu = BTreeMap::from([("1".into(), 8)]);
        let mut small = entry("mig-1g.5gb", 2);
        small.memory_per_replica = Some(MemoryBudget::Mib(1000));
        small.devices = SharedDevices::List(vec!["2:1".into()]);
        let sharing = time_slicing(vec![whole.clone(), small]);
        let got = replica_budgets(&sharing, &inv, MigStrategy::Mixed);
        assert_eq!(
            got,
            BTreeMap::from([
                ("GPU-0".to_string(), Some(10240)),
                ("GPU-1".to_string(), Some(5120)),
                ("MIG-2-1".to_string(), Some(1000)),
            ])
        );
        // Under none the MIG-enabled GPU is a whole nvidia.com/gpu; no budget set: None.
        whole.memory_per_replica = None;
        let got = replica_budgets(&time_slicing(vec![whole]), &inv, MigStrategy::None);
        assert_eq!(got.len(), 3);
        assert!(got.values().all(Option::is_none));
        assert!(replica_budgets(&Sharing::default(), &inv, MigStrategy::None).is_empty());
    }

    #[test]
    fn feature_sharing_is_per_resource() {
        let mut renamed = entry("nvidia.com/gpu", 4);
        renamed.replicas_per_gpu = BTreeMap::from([("0".into(), 6)]);
        let sharing = Sharing {
            rename_by_default: true,
            policy: SharedPolicy::Packed,
            compact: vec!["mig-1g.5gb::2".into()],
            ..time_slicing(vec![renamed])
        };
        let got = feature_sharing(&sharing);
        assert_eq!(
            got,
            BTreeMap::from([
                (
                    "gpu".to_string(),
                    ResourceSharing {
                        replicas: 6,
                        renamed: true
                    }
                ),
                (
                    "mig-1g.5gb".to_string(),
                    ResourceSharing {
                        replicas: 2,
                        renamed: true
                    }
                ),
            ])
        );
        assert!(feature_sharing(&Sharing::default()).is_empty());
    }
}
