//! The GPU series, named and labelled as dcgm-exporter names and labels them, so its Grafana
//! dashboards and alerts work unchanged.
//!
//! Names, HELP texts and types follow dcgm-exporter's counter files (every series of
//! `etc/default-counters.csv`, plus `DCGM_FI_DEV_FB_RESERVED` of `dcp-metrics-included.csv` and
//! the ECC and throttle-reason fields). Labels follow its exposition: `gpu` (NVML index), `UUID`
//! (the GPU's, also on its MIG series), `pci_bus_id`, `device` (`nvidia<index>`), `modelName`,
//! `GPU_I_PROFILE` and `GPU_I_ID` on MIG GPU-instance series, `Hostname`,
//! `DCGM_FI_DRIVER_VERSION`, then `container`, `namespace`, `pod` when a pod holds the device,
//! and `err_code` and `err_msg` on `DCGM_FI_DEV_XID_ERRORS` (see [`xid_message`]).
//!
//! A field NVML does not give for a device is left out for it, as dcgm-exporter skips DCGM's
//! blank values: remapped rows before Ampere, NVLink without NVLink, the vGPU license outside a
//! vGPU guest, sensors on MIG GPU instances.
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

/// The text dcgm-exporter puts in `err_msg` for Xid `xid`: NVIDIA's name of the Xid, as listed in
/// dcgm-exporter's `internal/pkg/collector/xid_errors.go` (NVIDIA/dcgm-exporter, which takes it
/// from <https://docs.nvidia.com/deploy/xid-errors/>), and `Unknown Error` past its table.
pub fn xid_message(xid: u64) -> &'static str {
    usize::try_from(xid)
        .ok()
        .and_then(|i| XID_MESSAGES.get(i))
        .copied()
        .unwrap_or("Unknown Error")
}

/// Xid number → message, indexed by number (0 = no error).
const XID_MESSAGES: &[&str] = &[
    "No Error",
    "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer stream",
    "Unused",
    "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer address",
    "GPU stopped processing",
    "Driver error programming GPU",
    "Unused", // 10
    "Invalid or corrupted push buffer stream",
    "Driver error handling GPU exception",
    "Graphics Engine Exception",
    "Unused",
    "Unused",
    "Display engine hung",
    "Unused",
    "Bus mastering disabled in PCI Config Space",
    "Display Engine error",
    "Invalid or corrupted Mpeg push buffer", // 20
    "Invalid or corrupted Motion Estimation push buffer",
    "Invalid or corrupted Video Processor push buffer",
    "Unused",
    "GPU semaphore timeout",
    "Invalid or illegal push buffer stream",
    "Framebuffer timeout",
    "Video processor exception",
    "Video processor exception",
    "Video processor exception",
    "GPU semaphore access error", // 30
    "GPU memory page fault",
    "Invalid or corrupted push buffer stream",
    "Internal micro-controller error",
    "Video processor exception",
    "Video processor exception",
    "Video processor exception",
    "Driver firmware error",
    "Driver firmware error",
    "Unused",
    "Unused", // 40
    "Unused",
    "Video processor exception",
    "GPU stopped processing",
    "Graphics Engine fault during context switch",
    "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
    "GPU stopped processing",
    "Video processor exception",
    "Double Bit ECC Error",
    "Unused",
    "Unused", // 50
    "Unused",
    "Unused",
    "Unused",
    "Auxiliary power is not connected to the GPU board",
    "Unused",
    "Display Engine error",
    "Error programming video memory interface",
    "Unstable video memory interface detected",
    "Internal micro-controller error",
    "Video processor exception", // 60
    "Internal micro-controller breakpoint/warning",
    "Internal micro-controller halt",
    "ECC page retirement or row remapping recording event",
    "ECC page retirement or row remapper recording failure",
    "Video processor exception",
    "Illegal access by driver",
    "Illegal access by driver",
    "NVDEC0 Exception",
    "Graphics Engine class error",
    "CE3: Unknown Error", // 70
    "CE4: Unknown Error",
    "CE5: Unknown Error",
    "NVENC2 Error",
    "NVLINK Error",
    "CE6: Unknown Error",
    "CE7: Unknown Error",
    "CE8: Unknown Error",
    "vGPU Start Error",
    "GPU has fallen off the bus",
    "Corrupted data sent to GPU", // 80
    "VGA Subsystem Error",
    "NVJPG0 Error",
    "NVDEC1 Error",
    "NVDEC2 Error",
    "CE9: Unknown Error",
    "OFA Exception",
    "Reserved",
    "NVDEC3 Error",
    "NVDEC4 Error",
    "Reserved", // 90
    "Reserved",
    "High single-bit ECC error rate",
    "Non-fatal violation of provisioned InfoROM wear limit",
    "Contained ECC error",
    "Uncontained ECC error",
    "NVDEC5 Error",
    "NVDEC6 Error",
    "NVDEC7 Error",
    "NVJPG1 Error",
    "NVJPG2 Error", // 100
    "NVJPG3 Error",
    "NVJPG4 Error",
    "NVJPG5 Error",
    "NVJPG6 Error",
    "NVJPG7 Error",
    "SMBPBI Test Message",
    "SMBPBI Test Message Silent",
    "Reserved",
    "Context Switch Timeout Error",
    "Security Fault Error", // 110
    "Display Bundle Error Event",
    "Display Supervisor Error",
    "DP Link Training Error",
    "Display Pipeline Underflow Error",
    "Display Core Channel Error",
    "Display Window Channel Error",
    "Display Cursor Channel Error",
    "Display Pixel Pipeline Error",
    "GSP RPC Timeout",
    "GSP Error", // 120
    "C2C Link Error",
    "SPI PMU RPC Read Failure",
    "SPI PMU RPC Write Failure",
    "SPI PMU RPC Erase Failure",
    "Inforom FS Failure",
    "Robust Channel CE10 Error",
    "Robust Channel CE11 Error",
    "Robust Channel CE12 Error",
    "Robust Channel CE13 Error",
    "Robust Channel CE14 Error", // 130
    "Robust Channel CE15 Error",
    "Robust Channel CE16 Error",
    "Robust Channel CE17 Error",
    "Robust Channel CE18 Error",
    "Robust Channel CE19 Error",
    "ALI Training Fail",
    "NVLink Privilege Error",
    "Robust Channel DLA Error",
    "Robust Channel OFA1 Error",
    "Unrecovered ECC Error", // 140
    "Robust Channel Fast Path Error",
    "Robust Channel NVENVC3 Error",
    "GPU Initialization Failure",
    "NVLINK: Saw Error",
    "NVLINK: RLW Error",
    "NVLINK: TLW Error",
    "NVLINK: TREX Error",
    "NVLINK: NVLPW_CTRL Error",
    "NVLINK: NETIR Error",
    "NVLINK: MSE Error", // 150
    "Robust Channel Key rotation Error",
    "Robust Channel DLA SMMU Error",
    "Robust Channel DLA timeout Error",
    "GPU Recovery Action Changed",
    "NVLINK: SW Defined Error",
    "Resource Retirement Event",
    "Resource Retirement Failure",
    "GPU Fatal Timeout",
    "Robust Channel CHI Non-Data Error",
    "Channel Retirement Event", // 160
    "Channel Retirement Failure",
    "Power Smoothing HW Circuitry Reengaged",
    "Power Smoothing HW Circuitry Disengaged",
    "Power Smoothing HW Circuitry Low Lifetime",
    "Power Smoothing HW Circuitry Lifetime Exhausted",
    "NVLINK Secure Crypto Error",
    "PCIE Fatal Timeout",
    "Reduced GPU Memory Capacity (Errors found in write protection region)",
    "Internal micro-controller halt",
    "NVLINK: Interrupt seen in CC mode", // 170
    "Uncorrectable DRAM Error",
    "Uncorrectable SRAM Error",
];

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
        name: "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        help: "Total number of bytes transmitted through PCIe TX (in KB) via NVML.",
        kind: Kind::Cumulative,
        // DCGM's value is nvmlDeviceGetPcieThroughput's: KB/s over NVML's last 20 ms window
        // (dcgm-exporter's file types it `counter` all the same).
        read: |v| int(v.pcie_tx_kbps),
    },
    Field {
        name: "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        help: "Total number of bytes received through PCIe RX (in KB) via NVML.",
        kind: Kind::Cumulative,
        read: |v| int(v.pcie_rx_kbps),
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
        name: "DCGM_FI_DEV_ENC_UTIL",
        help: "Encoder utilization (in %).",
        kind: Kind::Gauge,
        read: |v| int(v.enc_util),
    },
    Field {
        name: "DCGM_FI_DEV_DEC_UTIL",
        help: "Decoder utilization (in %).",
        kind: Kind::Gauge,
        read: |v| int(v.dec_util),
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
        name: "DCGM_FI_DEV_FB_RESERVED",
        help: "Framebuffer memory reserved (in MiB).",
        kind: Kind::Gauge,
        read: |v| int64(v.fb_reserved_mib),
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
        name: "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        help: "Total number of NVLink bandwidth counters for all lanes",
        kind: Kind::Cumulative,
        read: |v| int64(v.nvlink_kib),
    },
    Field {
        name: "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        help: "vGPU License status",
        kind: Kind::Gauge,
        read: |v| int(v.vgpu_license),
    },
    Field {
        name: "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        help: "Number of remapped rows for uncorrectable errors",
        kind: Kind::Cumulative,
        read: |v| int(v.remapped_uncorrectable),
    },
    Field {
        name: "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        help: "Number of remapped rows for correctable errors",
        kind: Kind::Cumulative,
        read: |v| int(v.remapped_correctable),
    },
    Field {
        name: "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        help: "Whether remapping of rows has failed",
        kind: Kind::Gauge,
        read: |v| int(v.row_remap_failure),
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
                labels.push(("err_msg", xid_message(value).to_string()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_messages_follow_dcgm_exporter() {
        assert_eq!(XID_MESSAGES.len(), 173, "Xids 0 to 172");
        assert_eq!(xid_message(0), "No Error");
        assert_eq!(xid_message(13), "Graphics Engine Exception");
        assert_eq!(xid_message(48), "Double Bit ECC Error");
        assert_eq!(xid_message(79), "GPU has fallen off the bus");
        assert_eq!(xid_message(94), "Contained ECC error");
        assert_eq!(xid_message(109), "Context Switch Timeout Error");
        assert_eq!(xid_message(172), "Uncorrectable SRAM Error");
        assert_eq!(xid_message(173), "Unknown Error");
        assert_eq!(xid_message(999), "Unknown Error");
        assert_eq!(xid_message(u64::MAX), "Unknown Error");
    }

    #[test]
    fn fields_have_unique_names_in_dcgm_style() {
        let mut names: Vec<&str> = FIELDS.iter().map(|f| f.name).collect();
        assert!(names.iter().all(|n| n.starts_with("DCGM_FI_DEV_")), "{names:?}");
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FIELDS.len());
    }
}
