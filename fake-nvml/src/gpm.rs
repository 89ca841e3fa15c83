//! GPU Performance Monitoring (GPM): the counters behind `nvmlGpmSampleGet`,
//! `nvmlGpmMigSampleGet` and `nvmlGpmMetricsGet`, as on Hopper and newer parts.
//!
//! A sample records a timestamp and cumulative counters of one GPU, or of one GPU instance of
//! a GPU in MIG mode. The counters grow with the device's simulated activity: the machine
//! file's `[gpu.gpm]` values (fractions of time and bytes per second) where it sets them, else
//! values derived from the processes on the device. Activity is read at each sample and counted
//! for the time since the previous sample of the same device, so two samples of a device whose
//! activity did not change give exactly that activity back.
//!
//! Rules (see the README): GPM exists on Hopper (architecture 9) and newer only; a sample
//! belongs to one device or instance, and `nvmlGpmMetricsGet` needs two filled samples of the
//! same one, the second taken later; PCIe and NVLink rates exist per GPU, not per GPU instance.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper_sys::bindings::{
    NVML_DEVICE_ARCH_HOPPER, NVML_GPM_METRICS_GET_VERSION, NVML_GPM_SUPPORT_VERSION, nvmlGpmMetric_t,
    nvmlGpmMetric_t__bindgen_ty_1, nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX, nvmlGpmMetricsGet_t,
};
use serde::Deserialize;

use crate::error::{NvmlError, NvmlResult, SUCCESS};
use crate::runtime::{Cx, START};

const MIB: f64 = 1024.0 * 1024.0;
const NS_PER_S: f64 = 1e9;

/// The simulated activity of a GPU or GPU instance (`[gpu.gpm]`, `[gpu.gpm.instance.<id>]`).
/// Every key is optional; a key left out follows the processes on the device (see
/// [`Activity::defaults`]).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Activity {
    /// Fraction of time the graphics/compute engine was active (`GRAPHICS_UTIL` / 100).
    pub graphics: Option<f64>,
    /// Fraction of SMs busy (`SM_UTIL` / 100).
    pub sm_active: Option<f64>,
    /// Fraction of resident warps vs the maximum (`SM_OCCUPANCY` / 100).
    pub sm_occupancy: Option<f64>,
    /// Fraction of time any tensor pipe was busy (`ANY_TENSOR_UTIL` / 100).
    pub tensor: Option<f64>,
    /// Fraction of DRAM bandwidth used (`DRAM_BW_UTIL` / 100).
    pub dram: Option<f64>,
    /// Fraction of time the FP64 pipe was busy (`FP64_UTIL` / 100).
    pub fp64: Option<f64>,
    /// Fraction of time the FP32 pipe was busy (`FP32_UTIL` / 100).
    pub fp32: Option<f64>,
    /// Fraction of time the FP16 pipe was busy (`FP16_UTIL` / 100).
    pub fp16: Option<f64>,
    /// PCIe bytes per second from the GPU (`PCIE_TX_PER_SEC` × 2²⁰); GPU only.
    pub pcie_tx_bytes: Option<f64>,
    /// PCIe bytes per second to the GPU (`PCIE_RX_PER_SEC` × 2²⁰); GPU only.
    pub pcie_rx_bytes: Option<f64>,
    /// NVLink bytes per second sent, all links (`NVLINK_TOTAL_TX_PER_SEC` × 2²⁰); GPU only.
    pub nvlink_tx_bytes: Option<f64>,
    /// NVLink bytes per second received, all links (`NVLINK_TOTAL_RX_PER_SEC` × 2²⁰); GPU only.
    pub nvlink_rx_bytes: Option<f64>,
    /// Per GPU instance (by GPU instance id, as a string key): that instance's activity.
    #[serde(default)]
    pub instance: BTreeMap<String, Activity>,
}

/// One modelled GPM metric.
struct Metric {
    id: u32,
    short: &'static CStr,
    long: &'static CStr,
    unit: &'static CStr,
    /// A byte rate (MiB/s in NVML; GPU only) rather than a percentage.
    rate: bool,
}

/// The metrics the fake computes, in counter order.
const METRICS: [Metric; 12] = [
    Metric {
        id: 1,
        short: c"gr_util",
        long: c"graphics util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 2,
        short: c"sm_util",
        long: c"sm util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 3,
        short: c"sm_occ",
        long: c"sm occupancy",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 5,
        short: c"tensor_util",
        long: c"any tensor util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 10,
        short: c"dram_bw_util",
        long: c"dram bandwidth util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 11,
        short: c"fp64_util",
        long: c"fp64 util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 12,
        short: c"fp32_util",
        long: c"fp32 util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 13,
        short: c"fp16_util",
        long: c"fp16 util",
        unit: c"%",
        rate: false,
    },
    Metric {
        id: 20,
        short: c"pcie_tx",
        long: c"pcie tx",
        unit: c"MiB/sec",
        rate: true,
    },
    Metric {
        id: 21,
        short: c"pcie_rx",
        long: c"pcie rx",
        unit: c"MiB/sec",
        rate: true,
    },
    Metric {
        id: 60,
        short: c"nvlink_rx",
        long: c"nvlink total rx",
        unit: c"MiB/sec",
        rate: true,
    },
    Metric {
        id: 61,
        short: c"nvlink_tx",
        long: c"nvlink total tx",
        unit: c"MiB/sec",
        rate: true,
    },
];

const N: usize = METRICS.len();

impl Activity {
    /// Checks the values: fractions in 0..=1, rates ≥ 0, instance keys GPU instance ids,
    /// instances without rates or nested instances.
    pub fn validate(&self) -> Result<(), String> {
        self.check_values("gpm")?;
        for (key, a) in &self.instance {
            key.parse::<u32>()
                .map_err(|_| format!("gpm.instance.{key}: the key must be a GPU instance id"))?;
            a.check_values(&format!("gpm.instance.{key}"))?;
            if !a.instance.is_empty() {
                return Err(format!("gpm.instance.{key}: instances have no instances"));
            }
            let rates = [a.pcie_tx_bytes, a.pcie_rx_bytes, a.nvlink_tx_bytes, a.nvlink_rx_bytes];
            if rates.iter().any(Option::is_some) {
                return Err(format!(
                    "gpm.instance.{key}: PCIe and NVLink rates are per GPU, not per GPU instance"
                ));
            }
        }
        Ok(())
    }

    fn check_values(&self, at: &str) -> Result<(), String> {
        let fractions = [
            ("graphics", self.graphics),
            ("sm_active", self.sm_active),
            ("sm_occupancy", self.sm_occupancy),
            ("tensor", self.tensor),
            ("dram", self.dram),
            ("fp64", self.fp64),
            ("fp32", self.fp32),
            ("fp16", self.fp16),
        ];
        for (key, v) in fractions {
            if let Some(v) = v
                && !(0.0..=1.0).contains(&v)
            {
                return Err(format!("{at}.{key} = {v} is not a fraction (0 to 1)"));
            }
        }
        let rates = [
            ("pcie_tx_bytes", self.pcie_tx_bytes),
            ("pcie_rx_bytes", self.pcie_rx_bytes),
            ("nvlink_tx_bytes", self.nvlink_tx_bytes),
            ("nvlink_rx_bytes", self.nvlink_rx_bytes),
        ];
        for (key, v) in rates {
            if let Some(v) = v
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(format!("{at}.{key} = {v} is not a rate in bytes per second"));
            }
        }
        Ok(())
    }

    /// The values this activity sets, in counter order (`None` where it sets none).
    fn values(&self) -> [Option<f64>; N] {
        [
            self.graphics,
            self.sm_active,
            self.sm_occupancy,
            self.tensor,
            self.dram,
            self.fp64,
            self.fp32,
            self.fp16,
            self.pcie_tx_bytes,
            self.pcie_rx_bytes,
            self.nvlink_rx_bytes,
            self.nvlink_tx_bytes,
        ]
    }

    /// The activity a busy fraction `busy` (0..1) gives where the machine file sets nothing:
    /// graphics = busy, SM active 0.9×, occupancy 0.5×, tensor 0.5×, DRAM 0.4×, FP64 0.1×,
    /// FP32 0.3×, FP16 0.2×; `procs` processes move 256 MiB/s each over PCIe each way and,
    /// with active NVLinks, 1 GiB/s each over NVLink each way.
    fn defaults(busy: f64, procs: u32, nvlink: bool) -> [f64; N] {
        let p = f64::from(procs);
        let link = if nvlink { p * 1024.0 * MIB } else { 0.0 };
        [
            busy,
            busy * 0.9,
            busy * 0.5,
            busy * 0.5,
            busy * 0.4,
            busy * 0.1,
            busy * 0.3,
            busy * 0.2,
            p * 256.0 * MIB,
            p * 256.0 * MIB,
            link,
            link,
        ]
    }
}

/// What a sample belongs to: a GPU (by UUID) or one of its GPU instances (by id).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Target {
    uuid: String,
    gi_id: Option<u32>,
}

/// A filled sample.
#[derive(Debug, Clone)]
struct Taken {
    target: Target,
    at_ns: u64,
    /// Cumulative: fraction × ns for percentages, bytes for rates.
    counters: [f64; N],
}

#[derive(Default)]
struct Store {
    /// Allocated sample buffers (by handle address) and what they hold.
    samples: HashMap<usize, Option<Taken>>,
    /// Per device: when its counters were last advanced, and their values then.
    counters: HashMap<Target, (u64, [f64; N])>,
}

static STORE: Mutex<Option<Store>> = Mutex::new(None);

fn store() -> MutexGuard<'static, Option<Store>> {
    STORE.lock().unwrap_or_else(|p| p.into_inner())
}

fn with_store<T>(f: impl FnOnce(&mut Store) -> T) -> T {
    let mut guard = store();
    f(guard.get_or_insert_with(Store::default))
}

/// Whether GPU `g` has GPM: Hopper and newer.
pub fn supported(cx: &Cx<'_>, g: usize) -> bool {
    cx.lib.machine.gpus[g].model.architecture >= NVML_DEVICE_ARCH_HOPPER
}

/// `nvmlGpmQueryDeviceSupport` for a resolved GPU: the version word must be
/// `NVML_GPM_SUPPORT_VERSION`.
pub fn query_support(cx: &Cx<'_>, g: usize, version: u32) -> NvmlResult<u32> {
    if version != NVML_GPM_SUPPORT_VERSION {
        return Err(NvmlError::InvalidArgument);
    }
    Ok(u32::from(supported(cx, g)))
}

/// `nvmlGpmSampleAlloc`: a new, empty sample buffer.
pub fn alloc() -> usize {
    let handle = Box::into_raw(Box::new(0u64)) as usize;
    with_store(|s| s.samples.insert(handle, None));
    handle
}

/// `nvmlGpmSampleFree`: INVALID_ARGUMENT for a handle that is not an allocated sample.
pub fn free(handle: usize) -> NvmlResult<()> {
    with_store(|s| s.samples.remove(&handle)).ok_or(NvmlError::InvalidArgument)?;
    // SAFETY: `handle` came from Box::into_raw in `alloc` and was still in the table, so it
    // has not been freed yet; removing it from the table means it is freed only once.
    drop(unsafe { Box::from_raw(handle as *mut u64) });
    Ok(())
}

/// `nvmlGpmSampleGet` (`gi_id` None, a GPU) or `nvmlGpmMigSampleGet` (a GPU instance of GPU
/// `g`): NOT_SUPPORTED before Hopper; a GPU instance needs MIG mode (NOT_SUPPORTED) and an
/// existing instance id (NOT_FOUND).
pub fn sample(cx: &mut Cx<'_>, g: usize, gi_id: Option<u32>, handle: usize) -> NvmlResult<()> {
    if !with_store(|s| s.samples.contains_key(&handle)) {
        return Err(NvmlError::InvalidArgument);
    }
    if !supported(cx, g) {
        return Err(NvmlError::NotSupported);
    }
    let rates = match gi_id {
        None => gpu_rates(cx, g),
        Some(id) => {
            if !cx.mig_enabled(g) {
                return Err(NvmlError::NotSupported);
            }
            let pos = cx.lib.state.gpus[g]
                .gpu_instances
                .iter()
                .position(|gi| gi.id == id)
                .ok_or(NvmlError::NotFound)?;
            instance_rates(cx, g, pos)
        }
    };
    let target = Target {
        uuid: cx.lib.machine.gpus[g].uuid.clone(),
        gi_id,
    };
    let now = u64::try_from(START.elapsed().as_nanos()).unwrap_or(u64::MAX);
    with_store(|s| {
        let (last, mut counters) = s.counters.get(&target).copied().unwrap_or((now, [0.0; N]));
        let dt = now.saturating_sub(last) as f64;
        for (c, rate) in counters.iter_mut().zip(rates) {
            *c += rate * dt;
        }
        s.counters.insert(target.clone(), (now, counters));
        s.samples.insert(
            handle,
            Some(Taken {
                target,
                at_ns: now,
                counters,
            }),
        );
    });
    Ok(())
}

/// Per-ns counter rates of GPU `g`: fractions, and bytes per ns for the byte rates.
fn gpu_rates(cx: &mut Cx<'_>, g: usize) -> [f64; N] {
    let set = cx.lib.machine.gpus[g].gpm.values();
    let nvlink = !cx.lib.machine.gpus[g].nvlink_peers.is_empty();
    let procs = cx.processes_of(crate::runtime::Dev::Gpu(g)).len() as u32;
    let mut values = if cx.mig_enabled(g) {
        // The whole GPU is its instances, weighted by their compute slices.
        let total = f64::from(cx.lib.machine.gpus[g].model.mig.compute_slices.max(1));
        let mut sum = Activity::defaults(0.0, procs, nvlink);
        sum[..8].fill(0.0);
        for pos in 0..cx.lib.state.gpus[g].gpu_instances.len() {
            let weight = f64::from(cx.gi_profile_of(g, pos).slices) / total;
            let gi = instance_rates(cx, g, pos);
            for (s, v) in sum[..8].iter_mut().zip(gi) {
                *s += v * weight;
            }
        }
        sum
    } else {
        let (util, _) = cx.utilization(g);
        Activity::defaults(f64::from(util) / 100.0, procs, nvlink)
    };
    for (v, fixed) in values.iter_mut().zip(set) {
        if let Some(f) = fixed {
            *v = f;
        }
    }
    for (v, m) in values.iter_mut().zip(&METRICS) {
        if m.rate {
            *v /= NS_PER_S;
        }
    }
    values
}

/// Per-ns counter rates of the GPU instance at position `pos` of GPU `g` (rates stay 0: PCIe
/// and NVLink are not counted per instance).
fn instance_rates(cx: &mut Cx<'_>, g: usize, pos: usize) -> [f64; N] {
    let id = cx.lib.state.gpus[g].gpu_instances[pos].id;
    let procs = cx
        .processes()
        .iter()
        .filter(|p| p.gpu == g && p.mig.map(|(gi, _)| gi) == Some(pos))
        .count() as u32;
    let busy = (0.3 * f64::from(procs)).min(1.0);
    let mut values = Activity::defaults(busy, 0, false);
    if let Some(a) = cx.lib.machine.gpus[g].gpm.instance.get(&id.to_string()) {
        for (v, fixed) in values.iter_mut().zip(a.values()) {
            if let Some(f) = fixed {
                *v = f;
            }
        }
    }
    values
}

/// `nvmlGpmMetricsGet`: INVALID_ARGUMENT for a wrong version, more metrics than
/// `NVML_GPM_METRIC_MAX`, a sample that is not allocated or not filled, samples of two
/// devices, or a second sample not taken after the first. Each requested metric gets its own
/// `nvmlReturn`: SUCCESS with a value, NOT_SUPPORTED for a metric the fake does not model (or a
/// PCIe/NVLink rate of a GPU instance), INVALID_ARGUMENT for an id outside the enum.
pub fn metrics(get: &mut nvmlGpmMetricsGet_t) -> NvmlResult<()> {
    if get.version != NVML_GPM_METRICS_GET_VERSION || get.numMetrics > nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX {
        return Err(NvmlError::InvalidArgument);
    }
    let (s1, s2) = with_store(|s| {
        let one = s.samples.get(&(get.sample1 as usize)).cloned().flatten();
        let two = s.samples.get(&(get.sample2 as usize)).cloned().flatten();
        (one, two)
    });
    let (Some(s1), Some(s2)) = (s1, s2) else {
        return Err(NvmlError::InvalidArgument);
    };
    if s1.target != s2.target || s2.at_ns <= s1.at_ns {
        return Err(NvmlError::InvalidArgument);
    }
    let dt = (s2.at_ns - s1.at_ns) as f64;
    let instance = s1.target.gi_id.is_some();
    let n = get.numMetrics as usize;
    for entry in &mut get.metrics[..n] {
        let found = METRICS.iter().position(|m| m.id == entry.metricId);
        *entry = match found {
            Some(i) if !(instance && METRICS[i].rate) => {
                let m = &METRICS[i];
                let per_ns = (s2.counters[i] - s1.counters[i]) / dt;
                let value = if m.rate {
                    per_ns * NS_PER_S / MIB
                } else {
                    per_ns * 100.0
                };
                metric(entry.metricId, SUCCESS, value, Some(m))
            }
            Some(_) => metric(entry.metricId, NvmlError::NotSupported.code(), 0.0, None),
            None if entry.metricId == 0 || entry.metricId >= nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX => {
                metric(entry.metricId, NvmlError::InvalidArgument.code(), 0.0, None)
            }
            None => metric(entry.metricId, NvmlError::NotSupported.code(), 0.0, None),
        };
    }
    Ok(())
}

fn metric(id: u32, rc: u32, value: f64, info: Option<&Metric>) -> nvmlGpmMetric_t {
    let ptr = |s: &'static CStr| s.as_ptr().cast_mut().cast::<c_char>();
    let null = std::ptr::null_mut();
    nvmlGpmMetric_t {
        metricId: id,
        nvmlReturn: rc,
        value,
        metricInfo: match info {
            Some(m) => nvmlGpmMetric_t__bindgen_ty_1 {
                shortName: ptr(m.short),
                longName: ptr(m.long),
                unit: ptr(m.unit),
            },
            None => nvmlGpmMetric_t__bindgen_ty_1 {
                shortName: null,
                longName: null,
                unit: null,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_validation() {
        let ok = Activity {
            tensor: Some(0.4),
            pcie_tx_bytes: Some(1e9),
            instance: BTreeMap::from([(
                "1".to_string(),
                Activity {
                    tensor: Some(1.0),
                    ..Activity::default()
                },
            )]),
            ..Activity::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        let over = Activity {
            tensor: Some(1.5),
            ..Activity::default()
        };
        assert!(over.validate().unwrap_err().contains("gpm.tensor"));
        let negative = Activity {
            nvlink_rx_bytes: Some(-1.0),
            ..Activity::default()
        };
        assert!(negative.validate().is_err());
        let bad_key = Activity {
            instance: BTreeMap::from([("x".to_string(), Activity::default())]),
            ..Activity::default()
        };
        assert!(bad_key.validate().unwrap_err().contains("GPU instance id"));
        let gi_rate = Activity {
            instance: BTreeMap::from([(
                "2".to_string(),
                Activity {
                    pcie_rx_bytes: Some(1.0),
                    ..Activity::default()
                },
            )]),
            ..Activity::default()
        };
        assert!(gi_rate.validate().unwrap_err().contains("per GPU"));
    }

    #[test]
    fn samples_are_freed_once() {
        let h = alloc();
        assert_eq!(free(h), Ok(()));
        assert_eq!(free(h), Err(NvmlError::InvalidArgument));
    }
}
