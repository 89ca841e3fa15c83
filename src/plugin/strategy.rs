//! From the NVML inventory to the kubelet resources, by MIG strategy (pure).
//!
//! The rules are NVIDIA's device plugin's, so resource names and device IDs match what
//! existing pod specs request:
//! - `none`: every GPU is a `nvidia.com/gpu`, MIG-enabled ones included (as whole GPUs);
//! - `single`: MIG devices are advertised as `nvidia.com/gpu`; all GPUs must agree on MIG being
//!   enabled, every MIG-enabled GPU must have MIG devices, and all of them one profile;
//! - `mixed`: one resource per MIG profile, `nvidia.com/mig-<profile>` with `+` written as `.`;
//!   GPUs without MIG stay `nvidia.com/gpu`. Unlike NVIDIA's plugin, compute-instance profiles
//!   (`1c.3g.20gb`) are advertised too, as `nvidia.com/mig-1c.3g.20gb`, instead of failing.

use std::collections::BTreeMap;

use crate::config::MigStrategy;
use crate::devices::{PluginDevice, Resource};
use crate::edits::{mig_plugin_devices, whole_gpu};
use crate::nvml::{GpuInfo, Inventory};

/// The resource every whole GPU (and MIG device under `single`) is advertised as.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Why the inventory cannot be advertised with the chosen strategy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StrategyError {
    #[error(
        "mig_strategy = \"single\" needs every GPU in the same MIG mode, but MIG is enabled on {enabled} and disabled on {disabled}"
    )]
    MixedMigModes { enabled: String, disabled: String },
    #[error("mig_strategy = \"single\": GPU {gpu} has MIG enabled but no MIG devices")]
    NoMigDevices { gpu: String },
    #[error("mig_strategy = \"single\" needs one MIG profile on every GPU, found {profiles}")]
    MixedProfiles { profiles: String },
}

/// Builds the resources to advertise. Every device starts healthy; health is applied later.
pub fn build_resources(inventory: &Inventory, strategy: MigStrategy) -> Result<Vec<Resource>, StrategyError> {
    let mut resources: BTreeMap<String, Resource> = BTreeMap::new();
    let mut add = |name: String, device: PluginDevice| {
        resources
            .entry(name.clone())
            .or_insert_with(|| Resource {
                name,
                devices: BTreeMap::new(),
            })
            .devices
            .insert(device.uuid.clone(), device);
    };
    let mig_on = |g: &GpuInfo| g.mig.is_some_and(|m| m.current);
    match strategy {
        MigStrategy::None => {
            for gpu in &inventory.gpus {
                add(GPU_RESOURCE.into(), whole_gpu(gpu));
            }
        }
        MigStrategy::Single => {
            let (on, off): (Vec<&GpuInfo>, Vec<&GpuInfo>) = inventory.gpus.iter().partition(|g| mig_on(g));
            if !on.is_empty() && !off.is_empty() {
                return Err(StrategyError::MixedMigModes {
                    enabled: list(&on),
                    disabled: list(&off),
                });
            }
            if let Some(gpu) = on.iter().find(|g| g.mig_devices.is_empty()) {
                return Err(StrategyError::NoMigDevices { gpu: gpu.to_string() });
            }
            let profiles: std::collections::BTreeSet<&str> = on
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(|m| m.profile.as_str()))
                .collect();
            if profiles.len() > 1 {
                let profiles = profiles.into_iter().collect::<Vec<_>>().join(", ");
                return Err(StrategyError::MixedProfiles { profiles });
            }
            for gpu in &inventory.gpus {
                if mig_on(gpu) {
                    for device in mig_plugin_devices(gpu) {
                        add(GPU_RESOURCE.into(), device);
                    }
                } else {
                    add(GPU_RESOURCE.into(), whole_gpu(gpu));
                }
            }
        }
        MigStrategy::Mixed => {
            for gpu in &inventory.gpus {
                if !mig_on(gpu) {
                    add(GPU_RESOURCE.into(), whole_gpu(gpu));
                    continue;
                }
                if gpu.mig_devices.is_empty() {
                    tracing::warn!("{gpu} has MIG enabled but no MIG devices: nothing to advertise for it");
                }
                for device in mig_plugin_devices(gpu) {
                    let profile = device
                        .mig
                        .as_ref()
                        .map(|m| m.profile.replace('+', "."))
                        .unwrap_or_default();
                    add(format!("nvidia.com/mig-{profile}"), device);
                }
            }
        }
    }
    Ok(resources.into_values().collect())
}

fn list(gpus: &[&GpuInfo]) -> String {
    gpus.iter()
        .map(|g| format!("GPU {}", g.index))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::sample::{self, inventory as inv};

    fn gpu(index: u32, mig: Option<bool>, profiles: &[&str]) -> GpuInfo {
        GpuInfo {
            numa_node: Some(i64::from(index / 4)),
            mig: mig.map(sample::mig),
            mig_devices: sample::mig_devices(index, profiles),
            ..sample::a100(index)
        }
    }

    fn names(r: &[Resource]) -> Vec<(&str, usize)> {
        r.iter().map(|r| (r.name.as_str(), r.devices.len())).collect()
    }

    #[test]
    fn none_advertises_whole_gpus_even_with_mig() {
        let r = build_resources(
            &inv(vec![gpu(0, Some(true), &["1g.5gb"]), gpu(1, None, &[])]),
            MigStrategy::None,
        )
        .expect("ok");
        assert_eq!(names(&r), vec![("nvidia.com/gpu", 2)]);
        assert_eq!(r[0].devices["GPU-0"].index, "0");
    }

    #[test]
    fn single_advertises_mig_devices_as_gpu() {
        let r = build_resources(
            &inv(vec![
                gpu(0, Some(true), &["1g.5gb", "1g.5gb"]),
                gpu(1, Some(true), &["1g.5gb"]),
            ]),
            MigStrategy::Single,
        )
        .expect("ok");
        assert_eq!(names(&r), vec![("nvidia.com/gpu", 3)]);
        let d = &r[0].devices["MIG-0-1"];
        assert_eq!(d.index, "0:1");
        assert_eq!(d.physical_uuid(), "GPU-0");
    }

    #[test]
    fn single_rejects_mixed_modes_profiles_and_empty_gpus() {
        let e = build_resources(
            &inv(vec![gpu(0, Some(true), &["1g.5gb"]), gpu(1, Some(false), &[])]),
            MigStrategy::Single,
        )
        .expect_err("mixed modes");
        assert!(e.to_string().contains("enabled on GPU 0 and disabled on GPU 1"), "{e}");
        let e = build_resources(
            &inv(vec![gpu(0, Some(true), &["1g.5gb", "2g.10gb"])]),
            MigStrategy::Single,
        )
        .expect_err("two profiles");
        assert!(e.to_string().contains("1g.5gb, 2g.10gb"), "{e}");
        let e = build_resources(&inv(vec![gpu(0, Some(true), &[])]), MigStrategy::Single).expect_err("empty");
        assert!(e.to_string().contains("GPU 0"), "{e}");
    }

    #[test]
    fn single_without_mig_is_whole_gpus() {
        let r = build_resources(
            &inv(vec![gpu(0, None, &[]), gpu(1, Some(false), &[])]),
            MigStrategy::Single,
        )
        .expect("ok");
        assert_eq!(names(&r), vec![("nvidia.com/gpu", 2)]);
    }

    #[test]
    fn mixed_has_one_resource_per_profile() {
        let r = build_resources(
            &inv(vec![
                gpu(0, Some(true), &["3g.20gb", "1g.5gb+me", "1c.3g.20gb"]),
                gpu(1, None, &[]),
            ]),
            MigStrategy::Mixed,
        )
        .expect("ok");
        assert_eq!(
            names(&r),
            vec![
                ("nvidia.com/gpu", 1),
                ("nvidia.com/mig-1c.3g.20gb", 1),
                ("nvidia.com/mig-1g.5gb.me", 1),
                ("nvidia.com/mig-3g.20gb", 1)
            ]
        );
    }
}
