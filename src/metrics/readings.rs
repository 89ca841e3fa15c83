//! One readings interval: what NVML says about every GPU and MIG GPU instance, as plain values.
//!
//! [`sample`] makes the NVML calls and nothing else; [`Metrics::update`](super::Metrics::update)
//! turns the result into series. A call NVML answers NOT_SUPPORTED (a MIG handle's
//! temperature, a GPU's utilization in MIG mode, ECC on a part without it) leaves that value
//! out for that device; any other failure (a lost GPU) does too, logged at debug level.

use std::collections::BTreeMap;

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_MEMORY_TEMP;

use crate::nvml::{Gpus, Inventory, MigDeviceInfo};

const MIB: u64 = 1024 * 1024;

/// Everything one readings interval saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Readings {
    /// The driver version (the `DCGM_FI_DRIVER_VERSION` label).
    pub driver_version: String,
    /// One entry per GPU of the inventory, in NVML index order.
    pub gpus: Vec<GpuReadings>,
    /// The profiling (GPM) values per GPU and MIG GPU instance; [`sample`] leaves this empty,
    /// the [`GpmSampler`](super::gpm::GpmSampler) fills it.
    pub profiling: super::gpm::Profiling,
}

/// The readings of one physical GPU and of its MIG GPU instances.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuReadings {
    /// NVML index (the `gpu` label; `device` is `nvidia<index>`).
    pub index: u32,
    /// The GPU's UUID (the `UUID` label, also on its MIG series).
    pub uuid: String,
    /// NVML's product name, e.g. `NVIDIA A100-SXM4-40GB` (the `modelName` label).
    pub model: String,
    /// NVML's bus id, e.g. `00000000:07:00.0`.
    pub pci_bus_id: String,
    /// What NVML said of the GPU (a lost GPU has none: only its Xid series stays).
    pub values: Values,
    /// One entry per GPU instance with at least one MIG device, by GPU instance id.
    pub instances: Vec<InstanceReadings>,
}

/// The readings of one MIG GPU instance: dcgm-exporter reports GPU instances (`GPU_I_ID`), so
/// the compute instances (MIG devices) of one GPU instance share one set of series. NVML reads
/// them through the first MIG device of the instance; its memory is the instance's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InstanceReadings {
    /// The GPU instance id (`GPU_I_ID`).
    pub gi_id: u32,
    /// The GPU instance profile, e.g. `3g.20gb` (`GPU_I_PROFILE`).
    pub profile: String,
    /// The MIG device UUIDs of the instance's compute instances, in slot order.
    pub mig_uuids: Vec<String>,
    /// What NVML said of the instance (memory only, on NVML so far).
    pub values: Values,
}

/// One device's values; `None` where NVML gave nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Values {
    /// Percent of time a kernel ran (`DCGM_FI_DEV_GPU_UTIL`).
    pub gpu_util: Option<u32>,
    /// Percent of time memory was read or written (`DCGM_FI_DEV_MEM_COPY_UTIL`).
    pub mem_copy_util: Option<u32>,
    /// Framebuffer used, MiB.
    pub fb_used_mib: Option<u64>,
    /// Framebuffer free, MiB.
    pub fb_free_mib: Option<u64>,
    /// GPU temperature, °C.
    pub gpu_temp: Option<u32>,
    /// HBM temperature, °C (NVML field `NVML_FI_DEV_MEMORY_TEMP`).
    pub memory_temp: Option<u32>,
    /// Power draw, W.
    pub power_w: Option<f64>,
    /// Energy since the driver loaded, mJ.
    pub energy_mj: Option<u64>,
    /// SM clock, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Memory clock, MHz.
    pub mem_clock_mhz: Option<u32>,
    /// PCIe replays since the driver loaded.
    pub pcie_replays: Option<u32>,
    /// Corrected (single-bit) ECC errors since the driver loaded.
    pub ecc_sbe_volatile: Option<u64>,
    /// Uncorrected (double-bit) ECC errors since the driver loaded.
    pub ecc_dbe_volatile: Option<u64>,
    /// NVML's clock throttle (clock event) reason bits.
    pub throttle_reasons: Option<u64>,
}

/// Reads every GPU and MIG GPU instance of `inventory` through NVML. Never fails: a device
/// NVML cannot find, or a call it refuses, leaves values out.
pub fn sample(gpus: &Gpus, inventory: &Inventory) -> Readings {
    let nvml = gpus.nvml();
    let readings = inventory
        .gpus
        .iter()
        .map(|gpu| {
            let values = match nvml.device_by_uuid(gpu.uuid.as_str()) {
                Ok(device) => read_values(&device, &gpu.uuid),
                Err(e) => {
                    tracing::debug!(gpu = %gpu.uuid, "no NVML handle for the readings: {e}");
                    Values::default()
                }
            };
            let instances = group_instances(&gpu.mig_devices)
                .into_iter()
                .filter_map(|(gi_id, members)| {
                    let first = *members.first()?;
                    let values = match nvml.device_by_uuid(first.uuid.as_str()) {
                        Ok(device) => read_values(&device, &first.uuid),
                        Err(e) => {
                            tracing::debug!(mig = %first.uuid, "no NVML handle for the readings: {e}");
                            Values::default()
                        }
                    };
                    Some(InstanceReadings {
                        gi_id,
                        profile: gpu_instance_profile(&first.profile).to_string(),
                        mig_uuids: members.iter().map(|m| m.uuid.clone()).collect(),
                        values,
                    })
                })
                .collect();
            GpuReadings {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: gpu.name.clone(),
                pci_bus_id: gpu.pci_bus_id.clone(),
                values,
                instances,
            }
        })
        .collect();
    Readings {
        driver_version: inventory.driver_version.clone(),
        gpus: readings,
        profiling: Default::default(),
    }
}

/// MIG devices grouped by GPU instance id (ordered by id; members keep slot order).
fn group_instances(devices: &[MigDeviceInfo]) -> BTreeMap<u32, Vec<&MigDeviceInfo>> {
    let mut by_gi: BTreeMap<u32, Vec<&MigDeviceInfo>> = BTreeMap::new();
    for d in devices {
        by_gi.entry(d.gi_id).or_default().push(d);
    }
    by_gi
}

/// The GPU instance profile of a MIG device profile: `1c.3g.20gb` → `3g.20gb`; a profile that
/// spans its GPU instance (`3g.20gb`, `1g.5gb+me`) is returned as it is.
pub fn gpu_instance_profile(profile: &str) -> &str {
    match profile.split_once('.') {
        Some((first, rest)) if first.ends_with('c') && first[..first.len() - 1].parse::<u32>().is_ok() => rest,
        _ => profile,
    }
}

/// Keeps a reading NVML gave; NOT_SUPPORTED (and anything else) leaves it out.
fn keep<T>(what: &str, uuid: &str, result: Result<T, NvmlError>) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(NvmlError::NotSupported) => None,
        Err(e) => {
            tracing::debug!(device = %uuid, "{what} failed: {e}");
            None
        }
    }
}

fn read_values(device: &Device<'_>, uuid: &str) -> Values {
    let utilization = keep("nvmlDeviceGetUtilizationRates", uuid, device.utilization_rates());
    let memory = keep("nvmlDeviceGetMemoryInfo_v2", uuid, device.memory_info());
    Values {
        gpu_util: utilization.as_ref().map(|u| u.gpu),
        mem_copy_util: utilization.as_ref().map(|u| u.memory),
        fb_used_mib: memory.as_ref().map(|m| m.used / MIB),
        fb_free_mib: memory.as_ref().map(|m| m.free / MIB),
        gpu_temp: keep(
            "nvmlDeviceGetTemperature",
            uuid,
            device.temperature(TemperatureSensor::Gpu),
        ),
        memory_temp: memory_temperature(device, uuid),
        power_w: keep("nvmlDeviceGetPowerUsage", uuid, device.power_usage()).map(|mw| f64::from(mw) / 1000.0),
        energy_mj: keep(
            "nvmlDeviceGetTotalEnergyConsumption",
            uuid,
            device.total_energy_consumption(),
        ),
        sm_clock_mhz: keep("nvmlDeviceGetClockInfo(SM)", uuid, device.clock_info(Clock::SM)),
        mem_clock_mhz: keep("nvmlDeviceGetClockInfo(MEM)", uuid, device.clock_info(Clock::Memory)),
        pcie_replays: keep("nvmlDeviceGetPcieReplayCounter", uuid, device.pcie_replay_counter()),
        ecc_sbe_volatile: keep(
            "nvmlDeviceGetTotalEccErrors(corrected)",
            uuid,
            device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile),
        ),
        ecc_dbe_volatile: keep(
            "nvmlDeviceGetTotalEccErrors(uncorrected)",
            uuid,
            device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        ),
        throttle_reasons: keep(
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            uuid,
            device.current_throttle_reasons(),
        )
        .map(|r| r.bits()),
    }
}

/// HBM temperature through `nvmlDeviceGetFieldValues` (NVML has no plain call for it).
fn memory_temperature(device: &Device<'_>, uuid: &str) -> Option<u32> {
    let samples = keep(
        "nvmlDeviceGetFieldValues(MEMORY_TEMP)",
        uuid,
        device.field_values_for(&[FieldId(NVML_FI_DEV_MEMORY_TEMP)]),
    )?;
    let sample = keep(
        "nvmlDeviceGetFieldValues(MEMORY_TEMP)",
        uuid,
        samples.into_iter().next()?,
    )?;
    match keep("NVML_FI_DEV_MEMORY_TEMP", uuid, sample.value)? {
        SampleValue::U32(t) => Some(t),
        SampleValue::U64(t) => u32::try_from(t).ok(),
        SampleValue::I64(t) => u32::try_from(t).ok(),
        SampleValue::F64(t) if t.is_finite() && t >= 0.0 => Some(t.round() as u32),
        SampleValue::F64(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_instance_profiles() {
        assert_eq!(gpu_instance_profile("3g.20gb"), "3g.20gb");
        assert_eq!(gpu_instance_profile("1c.3g.20gb"), "3g.20gb");
        assert_eq!(gpu_instance_profile("2c.7g.80gb"), "7g.80gb");
        assert_eq!(gpu_instance_profile("1g.5gb+me"), "1g.5gb+me");
        assert_eq!(gpu_instance_profile("1g.10gb"), "1g.10gb");
    }

    #[test]
    fn mig_devices_group_by_gpu_instance() {
        let dev = |index, gi_id, uuid: &str| MigDeviceInfo {
            index,
            uuid: uuid.into(),
            gi_id,
            ci_id: index,
            profile: "1c.3g.20gb".into(),
            memory_mib: 19968,
            attributes: None,
        };
        let devices = [dev(4, 2, "MIG-c"), dev(0, 1, "MIG-a"), dev(1, 1, "MIG-b")];
        let groups = group_instances(&devices);
        let ids: Vec<(u32, Vec<&str>)> = groups
            .iter()
            .map(|(gi, m)| (*gi, m.iter().map(|d| d.uuid.as_str()).collect()))
            .collect();
        assert_eq!(ids, vec![(1, vec!["MIG-a", "MIG-b"]), (2, vec!["MIG-c"])]);
    }
}
