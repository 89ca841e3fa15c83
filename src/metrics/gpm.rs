//! DCGM's profiling ("DCP") fields from NVML's GPU Performance Monitoring (GPM), on Hopper and
//! newer GPUs, without DCGM.
//!
//! GPM gives rates between two samples, so [`GpmSampler`] keeps the last sample of every GPU
//! and of every MIG GPU instance, takes a new one each readings interval and asks NVML for
//! the metrics of the pair. The first interval after start (and after a GPU or instance
//! appears) has no pair, so no series yet. A GPU whose `nvmlGpmQueryDeviceSupport` says no
//! (Ampere and older), a driver without the GPM symbols, and a call that fails leave the series
//! out: a metric the GPU cannot give is absent, never zero.
//!
//! Units: NVML's GPM utilizations are percentages (0–100); DCGM's `*_ACTIVE` fields are ratios
//! (0–1), so they are divided by 100. NVML's PCIe and NVLink rates are MiB/s; DCGM's
//! `*_BYTES` fields are bytes per second, so they are multiplied by 2²⁰.
//!
//! nvml-wrapper 0.13 does not wrap GPM: the calls go through `Nvml::lib()`, each `unsafe`
//! block says why it is sound. Sample buffers are freed when their [`Sample`] drops.

use std::collections::{BTreeMap, HashMap, HashSet};

use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as sys;

use crate::nvml::{Gpus, Inventory};

const MIB: f64 = 1024.0 * 1024.0;

/// One device's profiling values, in DCGM's units; `None` where NVML gave nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProfValues {
    /// `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (GPM `GRAPHICS_UTIL` / 100).
    pub gr_engine_active: Option<f64>,
    /// `DCGM_FI_PROF_SM_ACTIVE` (`SM_UTIL` / 100).
    pub sm_active: Option<f64>,
    /// `DCGM_FI_PROF_SM_OCCUPANCY` (`SM_OCCUPANCY` / 100).
    pub sm_occupancy: Option<f64>,
    /// `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` (`ANY_TENSOR_UTIL` / 100).
    pub tensor_active: Option<f64>,
    /// `DCGM_FI_PROF_DRAM_ACTIVE` (`DRAM_BW_UTIL` / 100).
    pub dram_active: Option<f64>,
    /// `DCGM_FI_PROF_PIPE_FP64_ACTIVE` (`FP64_UTIL` / 100).
    pub fp64_active: Option<f64>,
    /// `DCGM_FI_PROF_PIPE_FP32_ACTIVE` (`FP32_UTIL` / 100).
    pub fp32_active: Option<f64>,
    /// `DCGM_FI_PROF_PIPE_FP16_ACTIVE` (`FP16_UTIL` / 100).
    pub fp16_active: Option<f64>,
    /// `DCGM_FI_PROF_PCIE_TX_BYTES`, bytes/s (`PCIE_TX_PER_SEC` × 2²⁰).
    pub pcie_tx_bytes: Option<f64>,
    /// `DCGM_FI_PROF_PCIE_RX_BYTES`, bytes/s (`PCIE_RX_PER_SEC` × 2²⁰).
    pub pcie_rx_bytes: Option<f64>,
    /// `DCGM_FI_PROF_NVLINK_TX_BYTES`, bytes/s (`NVLINK_TOTAL_TX_PER_SEC` × 2²⁰).
    pub nvlink_tx_bytes: Option<f64>,
    /// `DCGM_FI_PROF_NVLINK_RX_BYTES`, bytes/s (`NVLINK_TOTAL_RX_PER_SEC` × 2²⁰).
    pub nvlink_rx_bytes: Option<f64>,
}

/// A GPM metric NVML computes, and where its value goes.
struct Wanted {
    id: sys::nvmlGpmMetricId_t,
    /// Multiplier from NVML's unit to DCGM's.
    scale: f64,
    slot: fn(&mut ProfValues) -> &mut Option<f64>,
}

const WANTED: [Wanted; 12] = [
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL,
        scale: 0.01,
        slot: |v| &mut v.gr_engine_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL,
        scale: 0.01,
        slot: |v| &mut v.sm_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_OCCUPANCY,
        scale: 0.01,
        slot: |v| &mut v.sm_occupancy,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        scale: 0.01,
        slot: |v| &mut v.tensor_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL,
        scale: 0.01,
        slot: |v| &mut v.dram_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_FP64_UTIL,
        scale: 0.01,
        slot: |v| &mut v.fp64_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_FP32_UTIL,
        scale: 0.01,
        slot: |v| &mut v.fp32_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_FP16_UTIL,
        scale: 0.01,
        slot: |v| &mut v.fp16_active,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_PCIE_TX_PER_SEC,
        scale: MIB,
        slot: |v| &mut v.pcie_tx_bytes,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        scale: MIB,
        slot: |v| &mut v.pcie_rx_bytes,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
        scale: MIB,
        slot: |v| &mut v.nvlink_tx_bytes,
    },
    Wanted {
        id: sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
        scale: MIB,
        slot: |v| &mut v.nvlink_rx_bytes,
    },
];

/// One profiling series family: dcgm-exporter's name and HELP text (`dcp-metrics-included.csv`;
/// NVLink's from DCGM's field descriptions); all are gauges.
pub struct ProfField {
    /// The metric name.
    pub name: &'static str,
    /// The HELP text.
    pub help: &'static str,
    /// The value of a device.
    pub read: fn(&ProfValues) -> Option<f64>,
}

/// The profiling fields, in dcgm-exporter's file order.
pub const PROF_FIELDS: &[ProfField] = &[
    ProfField {
        name: "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        help: "Ratio of time the graphics engine is active.",
        read: |v| v.gr_engine_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_SM_ACTIVE",
        help: "The ratio of cycles an SM has at least 1 warp assigned.",
        read: |v| v.sm_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_SM_OCCUPANCY",
        help: "The ratio of number of warps resident on an SM.",
        read: |v| v.sm_occupancy,
    },
    ProfField {
        name: "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        help: "Ratio of cycles the tensor (HMMA) pipe is active.",
        read: |v| v.tensor_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_DRAM_ACTIVE",
        help: "Ratio of cycles the device memory interface is active sending or receiving data.",
        read: |v| v.dram_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        help: "Ratio of cycles the fp64 pipes are active.",
        read: |v| v.fp64_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        help: "Ratio of cycles the fp32 pipes are active.",
        read: |v| v.fp32_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        help: "Ratio of cycles the fp16 pipes are active.",
        read: |v| v.fp16_active,
    },
    ProfField {
        name: "DCGM_FI_PROF_PCIE_TX_BYTES",
        help: "The rate of data transmitted over the PCIe bus - including both protocol headers and data \
               payloads - in bytes per second.",
        read: |v| v.pcie_tx_bytes,
    },
    ProfField {
        name: "DCGM_FI_PROF_PCIE_RX_BYTES",
        help: "The rate of data received over the PCIe bus - including both protocol headers and data payloads \
               - in bytes per second.",
        read: |v| v.pcie_rx_bytes,
    },
    ProfField {
        name: "DCGM_FI_PROF_NVLINK_TX_BYTES",
        help: "The rate of data transmitted over NVLink, not including protocol headers, in bytes per second.",
        read: |v| v.nvlink_tx_bytes,
    },
    ProfField {
        name: "DCGM_FI_PROF_NVLINK_RX_BYTES",
        help: "The rate of data received over NVLink, not including protocol headers, in bytes per second.",
        read: |v| v.nvlink_rx_bytes,
    },
];

/// A GPU (GPU instance `None`) or a MIG GPU instance of it, by the GPU's UUID.
type Key = (String, Option<u32>);

/// The profiling values of one readings interval, per GPU and per MIG GPU instance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profiling {
    values: BTreeMap<Key, ProfValues>,
}

impl Profiling {
    /// The values of GPU `uuid`, if GPM gave any this interval.
    pub fn gpu(&self, uuid: &str) -> Option<&ProfValues> {
        self.values.get(&(uuid.to_string(), None))
    }

    /// The values of GPU instance `gi_id` of GPU `uuid`, if GPM gave any this interval.
    pub fn instance(&self, uuid: &str, gi_id: u32) -> Option<&ProfValues> {
        self.values.get(&(uuid.to_string(), Some(gi_id)))
    }

    /// How many devices have values.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no device has values.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

fn rc(code: sys::nvmlReturn_t) -> Result<(), NvmlError> {
    if code == sys::nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::from(code))
    }
}

/// Copies a symbol out of the loaded library (FunctionNotFound on a driver without it).
fn sym<T: Copy>(sym: &Result<T, libloading::Error>) -> Result<T, NvmlError> {
    sym.as_ref().copied().map_err(|_| NvmlError::FunctionNotFound)
}

/// A GPM sample buffer, freed on drop. Holds the library open until then.
struct Sample {
    gpus: Gpus,
    raw: sys::nvmlGpmSample_t,
}

// SAFETY: NVML is thread-safe, and a sample buffer is only ever used through its one owner.
unsafe impl Send for Sample {}

impl Sample {
    fn alloc(gpus: &Gpus) -> Result<Sample, NvmlError> {
        let alloc = sym(&gpus.nvml().lib().nvmlGpmSampleAlloc)?;
        let mut raw: sys::nvmlGpmSample_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for one handle.
        rc(unsafe { alloc(&mut raw) })?;
        Ok(Sample {
            gpus: gpus.clone(),
            raw,
        })
    }
}

impl Drop for Sample {
    fn drop(&mut self) {
        if let Ok(free) = sym(&self.gpus.nvml().lib().nvmlGpmSampleFree) {
            // SAFETY: `raw` came from nvmlGpmSampleAlloc of this library (kept loaded by
            // `gpus`) and is freed only here, once.
            let _ = unsafe { free(self.raw) };
        }
    }
}

/// The samples of one device: the last one taken, and a spare buffer for the next.
#[derive(Default)]
struct Slot {
    previous: Option<Sample>,
    spare: Option<Sample>,
}

/// Keeps the previous GPM sample of every GPU and GPU instance between readings intervals.
#[derive(Default)]
pub struct GpmSampler {
    /// GPM support per GPU UUID, asked once.
    support: HashMap<String, bool>,
    slots: HashMap<Key, Slot>,
    /// The request, reused (it is 8 KiB).
    request: Option<Request>,
}

/// A boxed `nvmlGpmMetricsGet_t`.
struct Request(Box<sys::nvmlGpmMetricsGet_t>);

// SAFETY: the pointers inside are sample handles owned by the same GpmSampler and NVML's
// static metric names; NVML is thread-safe, and the request is used by its one owner only.
unsafe impl Send for Request {}

impl std::fmt::Debug for GpmSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpmSampler")
            .field("devices", &self.slots.len())
            .finish()
    }
}

impl GpmSampler {
    /// A sampler with no previous samples.
    pub fn new() -> GpmSampler {
        GpmSampler::default()
    }

    /// One interval: a new sample of every GPM-capable GPU and of each of its MIG GPU
    /// instances, and the metrics against the previous one where there is one. Samples of
    /// devices no longer in `inventory` are freed.
    pub fn sample(&mut self, gpus: &Gpus, inventory: &Inventory) -> Profiling {
        let mut out = Profiling::default();
        let mut seen: HashSet<Key> = HashSet::new();
        for gpu in &inventory.gpus {
            let device = match gpus.nvml().device_by_uuid(gpu.uuid.as_str()) {
                Ok(d) => d,
                Err(e) => {
                    tracing::debug!(gpu = %gpu.uuid, "no NVML handle for GPM: {e}");
                    continue;
                }
            };
            // SAFETY: the handle is live while `gpus` keeps NVML initialised.
            let handle = unsafe { device.handle() };
            if !self.supported(gpus, &gpu.uuid, handle) {
                continue;
            }
            let mut instances: Vec<u32> = gpu.mig_devices.iter().map(|m| m.gi_id).collect();
            instances.sort_unstable();
            instances.dedup();
            for gi in std::iter::once(None).chain(instances.into_iter().map(Some)) {
                let key = (gpu.uuid.clone(), gi);
                if let Some(values) = self.interval(gpus, handle, &key) {
                    out.values.insert(key.clone(), values);
                }
                seen.insert(key);
            }
        }
        self.slots.retain(|k, _| seen.contains(k));
        out
    }

    /// Whether GPU `uuid` has GPM (a failed call counts as no and is asked again next interval;
    /// an answer, or a driver without the call, is kept).
    fn supported(&mut self, gpus: &Gpus, uuid: &str, handle: sys::nvmlDevice_t) -> bool {
        if let Some(known) = self.support.get(uuid) {
            return *known;
        }
        let answer = sym(&gpus.nvml().lib().nvmlGpmQueryDeviceSupport).and_then(|query| {
            let mut support = sys::nvmlGpmSupport_t {
                version: sys::NVML_GPM_SUPPORT_VERSION,
                isSupportedDevice: 0,
            };
            // SAFETY: live device handle; `support` is the versioned struct NVML fills.
            rc(unsafe { query(handle, &mut support) })?;
            Ok(support.isSupportedDevice != 0)
        });
        match answer {
            Ok(supported) => {
                tracing::debug!(gpu = %uuid, supported, "nvmlGpmQueryDeviceSupport");
                self.support.insert(uuid.to_string(), supported);
                supported
            }
            Err(e) => {
                tracing::debug!(gpu = %uuid, "nvmlGpmQueryDeviceSupport: {e}; no profiling metrics");
                if matches!(e, NvmlError::FunctionNotFound) {
                    self.support.insert(uuid.to_string(), false);
                }
                false
            }
        }
    }

    /// Takes the device's new sample; the values against its previous one, if any.
    fn interval(&mut self, gpus: &Gpus, handle: sys::nvmlDevice_t, key: &Key) -> Option<ProfValues> {
        let slot = self.slots.entry(key.clone()).or_default();
        let current = match slot.spare.take().map_or_else(|| Sample::alloc(gpus), Ok) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(gpu = %key.0, gi = ?key.1, "nvmlGpmSampleAlloc: {e}");
                return None;
            }
        };
        if let Err(e) = take(gpus, handle, key.1, &current) {
            tracing::debug!(gpu = %key.0, gi = ?key.1, "GPM sample: {e}");
            // Start afresh once the device answers again.
            slot.previous = None;
            slot.spare = Some(current);
            return None;
        }
        let previous = slot.previous.replace(current);
        let values = previous.as_ref().and_then(|prev| {
            let current = slot.previous.as_ref()?;
            let request = self.request.get_or_insert_with(|| {
                // SAFETY: all-zero is a valid nvmlGpmMetricsGet_t (integers, doubles, NULLs).
                Request(Box::new(unsafe { std::mem::zeroed() }))
            });
            match metrics(gpus, &mut request.0, prev, current) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::debug!(gpu = %key.0, gi = ?key.1, "nvmlGpmMetricsGet: {e}");
                    None
                }
            }
        });
        slot.spare = previous;
        values
    }
}

/// Fills `sample` for the GPU (`gi` None) or its GPU instance `gi`.
fn take(gpus: &Gpus, handle: sys::nvmlDevice_t, gi: Option<u32>, sample: &Sample) -> Result<(), NvmlError> {
    let lib = gpus.nvml().lib();
    match gi {
        None => {
            let get = sym(&lib.nvmlGpmSampleGet)?;
            // SAFETY: live device handle and a sample buffer from nvmlGpmSampleAlloc.
            rc(unsafe { get(handle, sample.raw) })
        }
        Some(id) => {
            let get = sym(&lib.nvmlGpmMigSampleGet)?;
            // SAFETY: as above; the GPU instance id is a plain integer NVML checks.
            rc(unsafe { get(handle, id, sample.raw) })
        }
    }
}

/// Asks NVML for the wanted metrics between `first` and `second`, in DCGM's units. A metric
/// NVML answers with an error of its own (or a value that is not a finite, non-negative
/// number) is left out.
fn metrics(
    gpus: &Gpus,
    request: &mut sys::nvmlGpmMetricsGet_t,
    first: &Sample,
    second: &Sample,
) -> Result<ProfValues, NvmlError> {
    let get = sym(&gpus.nvml().lib().nvmlGpmMetricsGet)?;
    request.version = sys::NVML_GPM_METRICS_GET_VERSION;
    request.numMetrics = WANTED.len() as u32;
    request.sample1 = first.raw;
    request.sample2 = second.raw;
    for (entry, wanted) in request.metrics.iter_mut().zip(&WANTED) {
        entry.metricId = wanted.id;
        entry.nvmlReturn = sys::nvmlReturn_enum_NVML_SUCCESS;
        entry.value = 0.0;
    }
    // SAFETY: `request` is a whole nvmlGpmMetricsGet_t with the version, count and ids set,
    // and both samples were filled by NVML for the same device.
    rc(unsafe { get(request) })?;
    let mut values = ProfValues::default();
    for (entry, wanted) in request.metrics.iter().zip(&WANTED) {
        if entry.nvmlReturn == sys::nvmlReturn_enum_NVML_SUCCESS && entry.value.is_finite() && entry.value >= 0.0 {
            *(wanted.slot)(&mut values) = Some(entry.value * wanted.scale);
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wanted_metric_has_a_field_and_a_unit() {
        // Each wanted metric fills its own slot, and each slot is read by exactly one field.
        for (i, w) in WANTED.iter().enumerate() {
            let mut v = ProfValues::default();
            *(w.slot)(&mut v) = Some(i as f64 + 1.0);
            let named: Vec<&str> = PROF_FIELDS
                .iter()
                .filter(|f| (f.read)(&v).is_some())
                .map(|f| f.name)
                .collect();
            assert_eq!(named.len(), 1, "metric {}: {named:?}", w.id);
            let ratio = named[0].ends_with("_ACTIVE") || named[0].ends_with("_OCCUPANCY");
            assert_eq!(w.scale, if ratio { 0.01 } else { MIB }, "{}", named[0]);
        }
        assert_eq!(PROF_FIELDS.len(), WANTED.len());
    }
}
