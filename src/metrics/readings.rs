//! One readings interval: what NVML says about every GPU and MIG GPU instance, as plain values.
//!
//! [`sample`] makes the NVML calls and nothing else; [`Metrics::update`](super::Metrics::update)
//! turns the result into series. A call NVML answers NOT_SUPPORTED (a MIG handle's
//! temperature, a GPU's utilization in MIG mode, ECC on a part without it) leaves that value
//! out for that device; any other failure (a lost GPU) does too, logged at debug level.
//!
//! Calls nvml-wrapper has no safe method for (remapped rows, the vGPU license, field values with
//! a `scopeId`) go through its raw symbol table.

use std::collections::BTreeMap;

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::{
    NVML_FI_DEV_MEMORY_TEMP, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
};
use nvml_wrapper_sys::bindings::{
    nvmlFieldValue_t, nvmlGridLicensableFeatures_t, nvmlGridLicenseFeatureCode_t_NVML_GRID_LICENSE_FEATURE_CODE_VGPU,
    nvmlReturn_enum_NVML_SUCCESS, nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
};

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
    /// Framebuffer the driver reserves, MiB (`nvmlMemory_v2_t.reserved`).
    pub fb_reserved_mib: Option<u64>,
    /// PCIe TX throughput, KB/s (`nvmlDeviceGetPcieThroughput`, as DCGM reports it).
    pub pcie_tx_kbps: Option<u32>,
    /// PCIe RX throughput, KB/s.
    pub pcie_rx_kbps: Option<u32>,
    /// Encoder utilization, %.
    pub enc_util: Option<u32>,
    /// Decoder utilization, %.
    pub dec_util: Option<u32>,
    /// NVLink data TX + RX over all links since the driver loaded, KiB (NVML fields
    /// `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`/`_RX`, scope all links).
    pub nvlink_kib: Option<u64>,
    /// vGPU license: 1 licensed, 0 not; `None` outside a vGPU guest.
    pub vgpu_license: Option<u32>,
    /// Rows remapped for uncorrectable errors (`nvmlDeviceGetRemappedRows`).
    pub remapped_uncorrectable: Option<u32>,
    /// Rows remapped for correctable errors.
    pub remapped_correctable: Option<u32>,
    /// Whether a row remapping failed: 1 or 0.
    pub row_remap_failure: Option<u32>,
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
    let remapped = remapped_rows(device, uuid);
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
        fb_reserved_mib: memory.as_ref().map(|m| m.reserved / MIB),
        pcie_tx_kbps: keep(
            "nvmlDeviceGetPcieThroughput(TX)",
            uuid,
            device.pcie_throughput(PcieUtilCounter::Send),
        ),
        pcie_rx_kbps: keep(
            "nvmlDeviceGetPcieThroughput(RX)",
            uuid,
            device.pcie_throughput(PcieUtilCounter::Receive),
        ),
        enc_util: keep("nvmlDeviceGetEncoderUtilization", uuid, device.encoder_utilization()).map(|u| u.utilization),
        dec_util: keep("nvmlDeviceGetDecoderUtilization", uuid, device.decoder_utilization()).map(|u| u.utilization),
        nvlink_kib: nvlink_data(device, uuid),
        vgpu_license: vgpu_license(device, uuid),
        remapped_uncorrectable: remapped.map(|r| r.1),
        remapped_correctable: remapped.map(|r| r.0),
        row_remap_failure: remapped.map(|r| u32::from(r.3)),
    }
}

/// NVML's answer as a `Result`.
fn nvml_result(rc: nvml_wrapper_sys::bindings::nvmlReturn_t) -> Result<(), NvmlError> {
    if rc == nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::from(rc))
    }
}

/// `nvmlDeviceGetRemappedRows`: (correctable, uncorrectable, pending, failure occurred).
/// NOT_SUPPORTED before Ampere (those GPUs retire pages instead) and on MIG devices.
fn remapped_rows(device: &Device<'_>, uuid: &str) -> Option<(u32, u32, bool, bool)> {
    let call = || -> Result<(u32, u32, bool, bool), NvmlError> {
        let sym = device
            .nvml()
            .lib()
            .nvmlDeviceGetRemappedRows
            .as_ref()
            .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
        let (mut corr, mut unc, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
        // SAFETY: the handle is live (we hold its `Device`), the out-pointers are u32s on our
        // stack.
        nvml_result(unsafe { sym(device.handle(), &mut corr, &mut unc, &mut pending, &mut failure) })?;
        Ok((corr, unc, pending != 0, failure != 0))
    };
    keep("nvmlDeviceGetRemappedRows", uuid, call())
}

/// `nvmlDeviceGetGridLicensableFeatures_v4`: the vGPU feature's state (1 licensed, 0 not) when
/// the GPU is a vGPU guest; `None` on bare metal (NOT_SUPPORTED, or no vGPU feature listed).
fn vgpu_license(device: &Device<'_>, uuid: &str) -> Option<u32> {
    let call = || -> Result<Option<u32>, NvmlError> {
        let sym = device
            .nvml()
            .lib()
            .nvmlDeviceGetGridLicensableFeatures_v4
            .as_ref()
            .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
        // SAFETY: an all-zero struct of integers and char arrays is valid.
        let mut features: nvmlGridLicensableFeatures_t = unsafe { std::mem::zeroed() };
        // SAFETY: live handle; `features` is a valid struct on our stack.
        nvml_result(unsafe { sym(device.handle(), &mut features) })?;
        if features.isGridLicenseSupported == 0 {
            return Ok(None);
        }
        let count = (features.licensableFeaturesCount as usize).min(features.gridLicensableFeatures.len());
        Ok(features.gridLicensableFeatures[..count]
            .iter()
            .find(|f| f.featureCode == nvmlGridLicenseFeatureCode_t_NVML_GRID_LICENSE_FEATURE_CODE_VGPU)
            .map(|f| u32::from(f.featureState != 0)))
    };
    keep("nvmlDeviceGetGridLicensableFeatures_v4", uuid, call()).flatten()
}

/// NVLink data TX + RX of all links (`scopeId` = `UINT_MAX`), KiB. NOT_SUPPORTED without NVLink.
fn nvlink_data(device: &Device<'_>, uuid: &str) -> Option<u64> {
    let call = || -> Result<u64, NvmlError> {
        let sym = device
            .nvml()
            .lib()
            .nvmlDeviceGetFieldValues
            .as_ref()
            .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
        let request = |field_id| {
            // SAFETY: an all-zero field value (integers and a union of integers) is valid.
            let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
            v.fieldId = field_id;
            v.scopeId = u32::MAX;
            v
        };
        let mut values = [
            request(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
            request(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
        ];
        // SAFETY: live handle; `values` holds the 2 entries we say it holds.
        nvml_result(unsafe { sym(device.handle(), 2, values.as_mut_ptr()) })?;
        let mut total = 0u64;
        for v in &values {
            nvml_result(v.nvmlReturn)?;
            if v.valueType != nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG {
                return Err(NvmlError::UnexpectedVariant(v.valueType));
            }
            // SAFETY: NVML said the union holds an unsigned long long.
            total = total.saturating_add(unsafe { v.value.ullVal });
        }
        Ok(total)
    };
    keep("nvmlDeviceGetFieldValues(NVLINK_THROUGHPUT_DATA)", uuid, call())
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
            placement: None,
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
