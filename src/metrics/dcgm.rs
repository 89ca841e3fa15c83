//! The GPU series, named and labelled as dcgm-exporter names and labels them, so its Grafana
//! dashboards and alerts work unchanged.
//!
//! Names, HELP texts and types follow dcgm-exporter's counter files (`default-counters.csv`,
//! `dcp-metrics-included.csv`). Labels follow its exposition: `gpu` (NVML index), `UUID` (the
//! GPU's, also on its MIG series), `pci_bus_id`, `device` (`nvidia<index>`), `modelName`,
//! `GPU_I_PROFILE` and `GPU_I_ID` on MIG GPU-instance series, `Hostname`,
//! `DCGM_FI_DRIVER_VERSION`, then `container`, `namespace`, `pod` when a pod holds the device,
//! and `err_code` on `DCGM_FI_DEV_XID_ERRORS` (dcgm-exporter's `err_msg`, a text per Xid
//! number, is left out).
//!
//! One difference in the OpenMetrics exposition (what Prometheus asks for): a `counter` family
//! must name its samples `<name>_total`, so the cumulative DCGM fields, which keep
//! dcgm-exporter's names (dashboards query them by name), are typed `unknown` there. In the
//! Prometheus text format (served to scrapers that do not ask for OpenMetrics) they are
//! `counter`, as dcgm-exporter has them.
//!
//! A scrape encodes the last [`Snapshot`]; it never calls NVML.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder};
use prometheus_client::metrics::MetricType;

use super::gpm::{PROF_FIELDS, ProfValues};
use super::pods::Attribution;
use super::readings::{Readings, Values};
use crate::nvml::NO_INSTANCE;

/// How a field is exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down (`gauge`).
    Gauge,
    /// A cumulative count (dcgm-exporter's `counter`; typed `unknown`, see the module docs).
    Cumulative,
}

/// A reading's value: integer or floating point.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Number {
    Int(i64),
    Float(f64),
}

/// One DCGM field this agent exposes.
pub struct Field {
    /// The metric name, e.g. `DCGM_FI_DEV_GPU_UTIL`.
    pub name: &'static str,
    /// dcgm-exporter's HELP text.
    pub help: &'static str,
    /// Gauge or cumulative.
    pub kind: Kind,
    read: fn(&Values) -> Option<Number>,
}

impl fmt::Debug for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Field").field("name", &self.name).finish()
    }
}

fn int(v: Option<impl Into<i64>>) -> Option<Number> {
    v.map(|v| Number::Int(v.into()))
}

fn int64(v: Option<u64>) -> Option<Number> {
    v.map(|v| Number::Int(i64::try_from(v).unwrap_or(i64::MAX)))
}

/// The name of the Xid family (its value comes from health events, not from [`Values`]).
pub const XID_ERRORS: &str = "DCGM_FI_DEV_XID_ERRORS";
const XID_HELP: &str = "Value of the last XID error encountered.";

/// Every field read from NVML, in dcgm-exporter's file order.
pub const FIELDS: &[Field] = &[
    Field {
        name: "DCGM_FI_DEV_SM_CLOCK",
        help: "SM clock frequency (in MHz).",
        kind: Kind::Gauge,
        read: |v| int(v.sm_clock_mhz),
    },
    Field {
        name: "DCGM_FI_DEV_MEM_CLOCK",
        help: "Memory clock frequency (in MHz).",
        kind: Kind::Gauge,
        read: |v| int(v.mem_clock_mhz),
    },
    Field {
        name: "DCGM_FI_DEV_MEMORY_TEMP",
        help: "Memory temperature (in C).",
        kind: Kind::Gauge,
        read: |v| int(v.memory_temp),
    },
    Field {
        name: "DCGM_FI_DEV_GPU_TEMP",
        help: "GPU temperature (in C).",
        kind: Kind::Gauge,
        read: |v| int(v.gpu_temp),
    },
    Field {
        name: "DCGM_FI_DEV_POWER_USAGE",
        help: "Power draw (in W).",
        kind: Kind::Gauge,
        read: |v| v.power_w.map(Number::Float),
    },
    Field {
        name: "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        help: "Total energy consumption since boot (in mJ).",
        kind: Kind::Cumulative,
        read: |v| int64(v.energy_mj),
    },
    Field {
        name: "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        help: "Total number of PCIe retries.",
        kind: Kind::Cumulative,
        read: |v| int(v.pcie_replays),
    },
    Field {
        name: "DCGM_FI_DEV_GPU_UTIL",
        help: "GPU utilization (in %).",
        kind: Kind::Gauge,
        read: |v| int(v.gpu_util),
    },
    Field {
        name: "DCGM_FI_DEV_MEM_COPY_UTIL",
        help: "Memory utilization (in %).",
        kind: Kind::Gauge,
        read: |v| int(v.mem_copy_util),
    },
    Field {
        name: "DCGM_FI_DEV_FB_FREE",
        help: "Framebuffer memory free (in MiB).",
        kind: Kind::Gauge,
        read: |v| int64(v.fb_free_mib),
    },
    Field {
        name: "DCGM_FI_DEV_FB_USED",
        help: "Framebuffer memory used (in MiB).",
        kind: Kind::Gauge,
        read: |v| int64(v.fb_used_mib),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        help: "Total number of single-bit volatile ECC errors.",
        kind: Kind::Cumulative,
        read: |v| int64(v.ecc_sbe_volatile),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        help: "Total number of double-bit volatile ECC errors.",
        kind: Kind::Cumulative,
        read: |v| int64(v.ecc_dbe_volatile),
    },
    Field {
        name: "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        help: "Current clock throttle reasons (bitmask of DCGM_CLOCKS_THROTTLE_REASON_*).",
        kind: Kind::Gauge,
        read: |v| int64(v.throttle_reasons),
    },
];

/// Labels of one series, in dcgm-exporter's order.
type Labels = Vec<(&'static str, String)>;

/// Where a device's last Xid is kept.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum XidKey {
    /// A physical GPU, by UUID.
    Gpu(String),
    /// A MIG GPU instance: parent UUID, GPU instance id.
    Instance(String, u32),
}

/// One device's series labels and values.
#[derive(Debug, Clone)]
struct Device {
    labels: Labels,
    values: Values,
    xid: XidKey,
    /// The profiling (GPM) values, where the GPU has them.
    prof: ProfValues,
}

/// The GPU series of the last readings interval.
#[derive(Debug, Default)]
pub struct Snapshot {
    devices: Vec<Device>,
    /// MIG device UUID → (parent UUID, GPU instance id), to file an Xid named by MIG UUID.
    mig_uuids: HashMap<String, (String, u32)>,
}

impl Snapshot {
    /// The series for `readings`, labelled with `hostname` (left out when empty, as
    /// dcgm-exporter does) and with the pods of `attribution`.
    pub fn build(readings: &Readings, attribution: &Attribution, hostname: &str) -> Snapshot {
        let mut snapshot = Snapshot::default();
        for gpu in &readings.gpus {
            let base = |instance: Option<(&str, u32)>| {
                let mut labels: Labels = vec![
                    ("gpu", gpu.index.to_string()),
                    ("UUID", gpu.uuid.clone()),
                    ("pci_bus_id", gpu.pci_bus_id.clone()),
                    ("device", format!("nvidia{}", gpu.index)),
                    ("modelName", gpu.model.clone()),
                ];
                if let Some((profile, gi_id)) = instance {
                    labels.push(("GPU_I_PROFILE", profile.to_string()));
                    labels.push(("GPU_I_ID", gi_id.to_string()));
                }
                if !hostname.is_empty() {
                    labels.push(("Hostname", hostname.to_string()));
                }
                labels.push(("DCGM_FI_DRIVER_VERSION", readings.driver_version.clone()));
                labels
            };
            let mut labels = base(None);
            if let Some(pod) = attribution.get(&gpu.uuid) {
                push_pod(&mut labels, pod);
            }
            snapshot.devices.push(Device {
                labels,
                values: gpu.values,
                xid: XidKey::Gpu(gpu.uuid.clone()),
                prof: readings.profiling.gpu(&gpu.uuid).copied().unwrap_or_default(),
            });
            for instance in &gpu.instances {
                let mut labels = base(Some((&instance.profile, instance.gi_id)));
                if let Some(pod) = instance.mig_uuids.iter().find_map(|u| attribution.get(u)) {
                    push_pod(&mut labels, pod);
                }
                for mig in &instance.mig_uuids {
                    snapshot
                        .mig_uuids
                        .insert(mig.clone(), (gpu.uuid.clone(), instance.gi_id));
                }
                snapshot.devices.push(Device {
                    labels,
                    values: instance.values,
                    xid: XidKey::Instance(gpu.uuid.clone(), instance.gi_id),
                    prof: (readings.profiling)
                        .instance(&gpu.uuid, instance.gi_id)
                        .copied()
                        .unwrap_or_default(),
                });
            }
        }
        snapshot
    }

    /// How many devices (GPUs and MIG GPU instances) have series.
    pub fn devices(&self) -> usize {
        self.devices.len()
    }
}

fn push_pod(labels: &mut Labels, pod: &super::pods::PodRef) {
    labels.push(("container", pod.container.clone()));
    labels.push(("namespace", pod.namespace.clone()));
    labels.push(("pod", pod.pod.clone()));
}

/// The GPU series as a prometheus-client collector: the last snapshot plus the last Xid per
/// device.
#[derive(Debug, Default)]
pub struct GpuCollector {
    snapshot: RwLock<Snapshot>,
    xids: Mutex<HashMap<XidKey, u64>>,
}

impl GpuCollector {
    /// Replaces the series; the Xids of devices that are gone are forgotten.
    pub fn replace(&self, snapshot: Snapshot) {
        {
            let mut xids = self.xids.lock().unwrap_or_else(|p| p.into_inner());
            xids.retain(|key, _| snapshot.devices.iter().any(|d| d.xid == *key));
        }
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = snapshot;
    }

    /// Records Xid `xid` on the GPU or MIG device `uuid` (a MIG device's Xid also counts for its
    /// GPU instance and its parent GPU).
    pub fn xid(&self, uuid: &str, xid: u64) {
        let instance = {
            let snapshot = self.snapshot.read().unwrap_or_else(|p| p.into_inner());
            snapshot.mig_uuids.get(uuid).cloned()
        };
        match instance {
            Some((parent, gi_id)) => self.xid_on(&parent, Some(gi_id), xid),
            None => self.xid_on(uuid, None, xid),
        }
    }

    /// Records Xid `xid` on the GPU `uuid` and, when NVML attributed it to a GPU instance, on
    /// that instance too.
    pub fn xid_on(&self, uuid: &str, gi_id: Option<u32>, xid: u64) {
        let mut xids = self.xids.lock().unwrap_or_else(|p| p.into_inner());
        xids.insert(XidKey::Gpu(uuid.to_string()), xid);
        if let Some(gi) = gi_id.filter(|gi| *gi != NO_INSTANCE) {
            xids.insert(XidKey::Instance(uuid.to_string(), gi), xid);
        }
    }
}

fn descriptor(kind: Kind) -> MetricType {
    match kind {
        Kind::Gauge => MetricType::Gauge,
        Kind::Cumulative => MetricType::Unknown,
    }
}

fn encode_value(encoder: &mut MetricEncoder<'_>, value: Number) -> fmt::Result {
    match value {
        Number::Int(v) => encoder.encode_gauge(&v),
        Number::Float(v) => encoder.encode_gauge(&v),
    }
}

impl Collector for GpuCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let snapshot = self.snapshot.read().unwrap_or_else(|p| p.into_inner());
        for field in FIELDS {
            let series: Vec<(&Labels, Number)> = snapshot
                .devices
                .iter()
                .filter_map(|d| (field.read)(&d.values).map(|v| (&d.labels, v)))
                .collect();
            if series.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(field.name, field.help, None, descriptor(field.kind))?;
            for (labels, value) in series {
                let mut metric = family.encode_family(labels)?;
                encode_value(&mut metric, value)?;
            }
        }
        // The profiling (GPM) families: only devices whose GPU gave a value.
        for field in PROF_FIELDS {
            let series: Vec<(&Labels, f64)> = snapshot
                .devices
                .iter()
                .filter_map(|d| (field.read)(&d.prof).map(|v| (&d.labels, v)))
                .collect();
            if series.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(field.name, field.help, None, MetricType::Gauge)?;
            for (labels, value) in series {
                let mut metric = family.encode_family(labels)?;
                encode_value(&mut metric, Number::Float(value))?;
            }
        }
        // The Xid family: every GPU (0 until an Xid happens), and each GPU instance that had one.
        let xids = self.xids.lock().unwrap_or_else(|p| p.into_inner());
        let series: Vec<(Labels, u64)> = snapshot
            .devices
            .iter()
            .filter_map(|d| {
                let value = match (&d.xid, xids.get(&d.xid)) {
                    (_, Some(x)) => *x,
                    (XidKey::Gpu(_), None) => 0,
                    (XidKey::Instance(..), None) => return None,
                };
                let mut labels = d.labels.clone();
                labels.push(("err_code", value.to_string()));
                Some((labels, value))
            })
            .collect();
        if !series.is_empty() {
            let mut family = encoder.encode_descriptor(XID_ERRORS, XID_HELP, None, MetricType::Gauge)?;
            for (labels, value) in series {
                let mut metric = family.encode_family(&labels)?;
                encode_value(&mut metric, Number::Int(i64::try_from(value).unwrap_or(i64::MAX)))?;
            }
        }
        Ok(())
    }
}
