//! The machine file: a TOML description of the simulated host (`FAKE_NVML_MACHINE`).
//!
//! Parsing rejects unknown keys and checks every cross-field rule (model known, MIG only on
//! MIG models, unique UUIDs and bus ids, NVLink only on NVLink models). Pre-existing MIG
//! devices are checked when the initial state is built from the machine
//! ([`crate::state::State::from_machine`]).

use std::collections::HashSet;

use serde::Deserialize;

use crate::ids::{BusId, default_gpu_uuid};
use crate::models::{GpuModel, MODELS, model_by_key};

/// The raw TOML document.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineFile {
    driver_version: String,
    cuda_driver_version: i32,
    nvml_version: Option<String>,
    arch: Option<String>,
    #[serde(default)]
    profiles_need_mig: bool,
    #[serde(default)]
    gpu: Vec<GpuEntry>,
    #[serde(default)]
    nvswitch: Vec<NvSwitchEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NvSwitchEntry {
    pci_bus_id: String,
    pci_device_id: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuEntry {
    model: String,
    uuid: Option<String>,
    pci_bus_id: Option<String>,
    numa_node: Option<u32>,
    minor: Option<u32>,
    #[serde(default)]
    mig_mode: bool,
    #[serde(default)]
    mig_reset_required: bool,
    pci_subsystem_id: Option<u32>,
    pcie_switch: Option<String>,
    pcie_path: Option<Vec<String>>,
    pcie_board: Option<String>,
    #[serde(default)]
    nvlink_peers: Vec<String>,
    #[serde(default)]
    mig_device: Vec<MigDeviceEntry>,
    #[serde(default)]
    readings: Readings,
    fabric: Option<crate::fabric::FabricEntry>,
    pci_class: Option<u32>,
    #[serde(default)]
    vgpu: bool,
    #[serde(default)]
    gpm: crate::gpm::Activity,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MigDeviceEntry {
    profile: String,
    placement: Option<u32>,
}

/// Fixed sensor and counter values for one GPU (`[gpu.readings]`). Each key left out keeps the
/// fake's default (see the README); a key that is set is what NVML reports, whatever the
/// processes on the GPU.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Readings {
    /// `nvmlDeviceGetUtilizationRates().gpu`, in %.
    pub gpu_utilization: Option<u32>,
    /// `nvmlDeviceGetUtilizationRates().memory`, in %.
    pub memory_utilization: Option<u32>,
    /// `nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`, in °C.
    pub temperature: Option<u32>,
    /// Field value `NVML_FI_DEV_MEMORY_TEMP`, in °C (also on models without HBM when set).
    pub memory_temperature: Option<u32>,
    /// `nvmlDeviceGetPowerUsage`, in milliwatts.
    pub power_mw: Option<u32>,
    /// `nvmlDeviceGetTotalEnergyConsumption`, in millijoules (fixed: it does not grow).
    pub energy_mj: Option<u64>,
    /// `nvmlDeviceGetClockInfo(NVML_CLOCK_SM)` (and `NVML_CLOCK_GRAPHICS`), in MHz.
    pub sm_clock_mhz: Option<u32>,
    /// `nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)`, in MHz.
    pub memory_clock_mhz: Option<u32>,
    /// `nvmlDeviceGetPcieReplayCounter`.
    pub pcie_replay: Option<u32>,
    /// `nvmlDeviceGetTotalEccErrors(NVML_MEMORY_ERROR_TYPE_CORRECTED, …)`.
    pub ecc_corrected: Option<u64>,
    /// `nvmlDeviceGetTotalEccErrors(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, …)`.
    pub ecc_uncorrected: Option<u64>,
    /// `nvmlDeviceGetCurrentClocksThrottleReasons` bitmask.
    pub throttle_reasons: Option<u64>,
    /// `nvmlDeviceGetMemoryInfo_v2().reserved`, in MiB (default: the model's, see the README).
    pub memory_reserved_mib: Option<u64>,
    /// `nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES)`, in KB/s.
    pub pcie_tx_kbps: Option<u32>,
    /// `nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_RX_BYTES)`, in KB/s.
    pub pcie_rx_kbps: Option<u32>,
    /// `nvmlDeviceGetEncoderUtilization`, in %.
    pub encoder_utilization: Option<u32>,
    /// `nvmlDeviceGetDecoderUtilization`, in %.
    pub decoder_utilization: Option<u32>,
    /// Field `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX` summed over all links, in KiB (models with
    /// NVLink only).
    pub nvlink_data_tx_kib: Option<u64>,
    /// Field `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX` summed over all links, in KiB.
    pub nvlink_data_rx_kib: Option<u64>,
    /// `nvmlDeviceGetRemappedRows` correctable rows (Ampere and later only).
    pub remapped_rows_correctable: Option<u32>,
    /// `nvmlDeviceGetRemappedRows` uncorrectable rows.
    pub remapped_rows_uncorrectable: Option<u32>,
    /// `nvmlDeviceGetRemappedRows` `isPending`.
    pub row_remap_pending: Option<bool>,
    /// `nvmlDeviceGetRemappedRows` `failureOccurred`.
    pub row_remap_failure: Option<bool>,
    /// Makes the GPU a licensed (true) or unlicensed (false) vGPU guest:
    /// `nvmlDeviceGetGridLicensableFeatures_v4` then lists the vGPU feature in that state. Left
    /// out (bare metal), the call answers NOT_SUPPORTED.
    pub vgpu_licensed: Option<bool>,
}

/// A validated machine description.
#[derive(Debug)]
pub struct Machine {
    /// The node's architecture as `uname -m` names it, `x86_64` (the default) or `aarch64`
    /// (`arch = "aarch64"`, a Grace node): what the host files say ([`crate::host`]).
    pub arch: String,
    /// `nvmlSystemGetDriverVersion`.
    pub driver_version: String,
    /// `nvmlSystemGetCudaDriverVersion(_v2)`, e.g. 12040.
    pub cuda_driver_version: i32,
    /// `nvmlSystemGetNVMLVersion`.
    pub nvml_version: String,
    /// The driver lists no GPU instance profiles while a GPU's MIG mode is off (drivers of the
    /// R535 class, as mig-parted notes): `nvmlDeviceGetGpuInstanceProfileInfo(V)` answers
    /// NOT_SUPPORTED for every profile index, and `…ProfileInfoByIdV` and
    /// `…GpuInstancePossiblePlacements_v2` for every profile id, until MIG mode is current.
    pub profiles_need_mig: bool,
    /// NVSwitches that NVLinks can end at (`[[nvswitch]]`).
    pub nvswitches: Vec<NvSwitchSpec>,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<GpuSpec>,
}

/// One GPU of the machine.
#[derive(Debug)]
pub struct GpuSpec {
    /// Model and its tables.
    pub model: &'static GpuModel,
    /// `GPU-...` UUID.
    pub uuid: String,
    /// PCI address.
    pub bus_id: BusId,
    /// NUMA node, if the GPU has an affinity.
    pub numa_node: Option<u32>,
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// Initial MIG mode (current = pending).
    pub mig_mode: bool,
    /// MIG mode changes wait for a GPU reset (`SetMigMode` activation status RESET_REQUIRED;
    /// a line with the UUID in the `reset` injection file performs the reset).
    pub mig_reset_required: bool,
    /// `pciSubSystemId` (subsystem device << 16 | subsystem vendor): the model's unless the
    /// machine file names one (boards of one device id differ here).
    pub pci_subsystem_id: u32,
    /// PCIe switch name, for topology.
    pub pcie_switch: Option<String>,
    /// PCIe path from the host bridge down to the switch the GPU sits under (names); empty
    /// when not given.
    pub pcie_path: Vec<String>,
    /// Multi-GPU board name: GPUs on one board are `NVML_TOPOLOGY_INTERNAL`.
    pub pcie_board: Option<String>,
    /// Remote end of each active NVLink, link 0 first.
    pub nvlink_peers: Vec<BusId>,
    /// MIG devices that exist when the state is first built.
    pub mig_devices: Vec<MigDeviceSpec>,
    /// Fixed readings from the machine file.
    pub readings: Readings,
    /// NVLink fabric info (`[gpu.fabric]`); `None` answers NOT_SUPPORTED.
    pub fabric: Option<crate::fabric::Fabric>,
    /// PCI class code in sysfs (`0x030200` 3D controller unless the file says otherwise).
    pub pci_class: u32,
    /// A vGPU guest: the PCI config space carries NVIDIA's vGPU vendor capability.
    pub vgpu: bool,
    /// GPM activity from the machine file (`[gpu.gpm]`).
    pub gpm: crate::gpm::Activity,
}

/// An NVSwitch: the remote end of the NVLinks that name its bus id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvSwitchSpec {
    /// PCI address.
    pub bus_id: BusId,
    /// PCI device id (the vendor is NVIDIA's).
    pub pci_device_id: u16,
}

/// PCI device id of an NVSwitch when the machine file names none: the second-generation
/// switch of the DGX A100.
pub const DEFAULT_NVSWITCH_DEVICE_ID: u16 = 0x1af1;

/// `nvmlDeviceGetTopologyCommonAncestor` of two distinct GPUs (`nvmlGpuTopologyLevel_t`):
/// the same `pcie_board` is INTERNAL (0), the same `pcie_switch` SINGLE (10); with
/// `pcie_path`s under one host bridge, the same path is SINGLE (10), a common switch
/// MULTIPLE (20), only the host bridge in common HOSTBRIDGE (30); otherwise the same
/// `numa_node` is NODE (40), and anything else SYSTEM (50).
pub fn common_ancestor(x: &GpuSpec, y: &GpuSpec) -> u32 {
    let (a, b) = (&x.pcie_path, &y.pcie_path);
    if x.pcie_board.is_some() && x.pcie_board == y.pcie_board {
        0
    } else if x.pcie_switch.is_some() && x.pcie_switch == y.pcie_switch {
        10
    } else if !a.is_empty() && !b.is_empty() && a[0] == b[0] {
        let common = a.iter().zip(b).take_while(|(p, q)| p == q).count();
        if a == b && a.len() >= 2 {
            10
        } else if common >= 2 {
            20
        } else {
            30
        }
    } else if x.numa_node.is_some() && x.numa_node == y.numa_node {
        40
    } else {
        50
    }
}

/// Checks that the `pcie_path`s describe one tree (each name has one parent, a host bridge is
/// never a switch), that GPUs under one host bridge share a NUMA node, and that NVSwitch bus
/// ids are unique. (NVLinks are not checked for symmetry: a file may list one end only.)
fn check_topology(gpus: &[GpuSpec], nvswitches: &[NvSwitchSpec]) -> Result<(), String> {
    use std::collections::HashMap;
    let mut parent: HashMap<&str, (Option<&str>, usize)> = HashMap::new();
    let mut bridge_numa: HashMap<&str, (Option<u32>, usize)> = HashMap::new();
    for (i, g) in gpus.iter().enumerate() {
        for (depth, name) in g.pcie_path.iter().enumerate() {
            let up = depth.checked_sub(1).map(|d| g.pcie_path[d].as_str());
            match parent.get(name.as_str()) {
                Some(&(seen, first)) if seen != up => {
                    let show = |p: Option<&str>| p.map_or("the root (a host bridge)".to_string(), |p| format!("{p:?}"));
                    return Err(format!(
                        "gpu[{i}]: pcie_path puts {name:?} under {}, gpu[{first}] under {}",
                        show(up),
                        show(seen)
                    ));
                }
                Some(_) => {}
                None => {
                    parent.insert(name, (up, i));
                }
            }
        }
        if let Some(bridge) = g.pcie_path.first() {
            match bridge_numa.get(bridge.as_str()) {
                Some(&(numa, first)) if numa != g.numa_node => {
                    return Err(format!(
                        "gpu[{i}]: host bridge {bridge:?} is also gpu[{first}]'s, but the numa_node differs ({:?} and {:?})",
                        g.numa_node, numa
                    ));
                }
                Some(_) => {}
                None => {
                    bridge_numa.insert(bridge, (g.numa_node, i));
                }
            }
        }
    }
    for (k, sw) in nvswitches.iter().enumerate() {
        if gpus.iter().any(|g| g.bus_id == sw.bus_id) || nvswitches[..k].iter().any(|o| o.bus_id == sw.bus_id) {
            return Err(format!("nvswitch[{k}]: pci_bus_id {} is used twice", sw.bus_id));
        }
    }
    Ok(())
}

/// A pre-existing MIG device from the machine file.
#[derive(Debug, Clone)]
pub struct MigDeviceSpec {
    /// GPU-instance profile name (`3g.20gb`) or compute-instance form (`1c.3g.20gb`).
    pub profile: String,
    /// Start memory slice of the GPU instance, if given.
    pub placement: Option<u32>,
}

impl Machine {
    /// Parses and validates a machine file. The error is one line meant for stderr.
    pub fn parse(text: &str) -> Result<Machine, String> {
        let raw: MachineFile = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
        if raw.driver_version.trim().is_empty() {
            return Err("driver_version must not be empty".into());
        }
        if raw.cuda_driver_version <= 0 {
            return Err(format!(
                "cuda_driver_version = {} is not valid: expected NVML's integer form, e.g. 12040",
                raw.cuda_driver_version
            ));
        }
        let nvml_version = raw.nvml_version.unwrap_or_else(|| format!("12.{}", raw.driver_version));
        let mut gpus = Vec::with_capacity(raw.gpu.len());
        let mut uuids = HashSet::new();
        let mut buses = HashSet::new();
        for (index, entry) in raw.gpu.into_iter().enumerate() {
            let gpu = gpu_spec(index, entry).map_err(|e| format!("gpu[{index}]: {e}"))?;
            if !uuids.insert(gpu.uuid.clone()) {
                return Err(format!("gpu[{index}]: uuid {} is used twice", gpu.uuid));
            }
            if !buses.insert(gpu.bus_id) {
                return Err(format!("gpu[{index}]: pci_bus_id {} is used twice", gpu.bus_id));
            }
            gpus.push(gpu);
        }
        let nvswitches = raw
            .nvswitch
            .into_iter()
            .enumerate()
            .map(|(k, e)| {
                let bus_id = BusId::parse(&e.pci_bus_id)
                    .ok_or_else(|| format!("nvswitch[{k}]: pci_bus_id {:?} is not a PCI bus id", e.pci_bus_id))?;
                Ok(NvSwitchSpec {
                    bus_id,
                    pci_device_id: e.pci_device_id.unwrap_or(DEFAULT_NVSWITCH_DEVICE_ID),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        check_topology(&gpus, &nvswitches)?;
        let arch = raw.arch.unwrap_or_else(|| "x86_64".into());
        if !matches!(arch.as_str(), "x86_64" | "aarch64") {
            return Err(format!("arch = {arch:?}: expected \"x86_64\" or \"aarch64\""));
        }
        Ok(Machine {
            arch,
            driver_version: raw.driver_version,
            cuda_driver_version: raw.cuda_driver_version,
            nvml_version,
            profiles_need_mig: raw.profiles_need_mig,
            nvswitches,
            gpus,
        })
    }

    /// The NVSwitch with this bus id.
    pub fn nvswitch_by_bus_id(&self, bus: &BusId) -> Option<&NvSwitchSpec> {
        self.nvswitches.iter().find(|s| s.bus_id == *bus)
    }

    /// Index of the GPU with this bus id.
    pub fn gpu_by_bus_id(&self, bus: &BusId) -> Option<usize> {
        self.gpus.iter().position(|g| g.bus_id == *bus)
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn gpu_spec(index: usize, e: GpuEntry) -> Result<GpuSpec, String> {
    let model = model_by_key(&e.model).ok_or_else(|| {
        let known: Vec<&str> = MODELS.iter().map(|m| m.key).collect();
        format!("unknown model {:?}; known models: {}", e.model, known.join(", "))
    })?;
    let uuid = match e.uuid {
        Some(u) => {
            if !u.starts_with("GPU-") || u.len() > 80 || u.chars().any(char::is_whitespace) {
                return Err(format!(
                    "uuid {u:?} is not valid: expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
                ));
            }
            u
        }
        None => default_gpu_uuid(model.key, index),
    };
    let bus_id = match e.pci_bus_id {
        Some(s) => BusId::parse(&s)
            .ok_or_else(|| format!("pci_bus_id {s:?} is not valid: expected e.g. \"00000000:07:00.0\""))?,
        None => BusId {
            domain: 0,
            bus: u8::try_from(0x10 + index).map_err(|_| "too many GPUs for default pci_bus_id values".to_string())?,
            device: 0,
            function: 0,
        },
    };
    for (key, value) in [
        ("gpu_utilization", e.readings.gpu_utilization),
        ("memory_utilization", e.readings.memory_utilization),
        ("encoder_utilization", e.readings.encoder_utilization),
        ("decoder_utilization", e.readings.decoder_utilization),
    ] {
        if let Some(v) = value
            && v > 100
        {
            return Err(format!("readings.{key} = {v} is not a percentage"));
        }
    }
    e.gpm.validate()?;
    if e.mig_mode && !model.has_mig() {
        return Err(format!("mig_mode = true but model {} has no MIG", model.key));
    }
    if !e.mig_device.is_empty() && !e.mig_mode {
        return Err("mig_device entries need mig_mode = true".into());
    }
    if (e.readings.nvlink_data_tx_kib.is_some() || e.readings.nvlink_data_rx_kib.is_some()) && model.nvlink_links == 0 {
        return Err(format!(
            "readings.nvlink_data_* given but model {} has no NVLink",
            model.key
        ));
    }
    if e.readings.memory_reserved_mib.is_some_and(|r| r > model.memory_mib) {
        return Err("readings.memory_reserved_mib is more than the model's memory".into());
    }
    if !e.nvlink_peers.is_empty() && model.nvlink_links == 0 {
        return Err(format!("nvlink_peers given but model {} has no NVLink", model.key));
    }
    if e.nvlink_peers.len() > model.nvlink_links as usize {
        return Err(format!(
            "{} nvlink_peers but model {} has only {} NVLink links",
            e.nvlink_peers.len(),
            model.key,
            model.nvlink_links
        ));
    }
    let nvlink_peers = e
        .nvlink_peers
        .iter()
        .map(|s| {
            let b = BusId::parse(s).ok_or_else(|| format!("nvlink_peers entry {s:?} is not a PCI bus id"))?;
            if b == bus_id {
                return Err(format!("nvlink_peers entry {s:?} is the GPU itself"));
            }
            Ok(b)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mig_devices = e
        .mig_device
        .into_iter()
        .map(|m| MigDeviceSpec {
            profile: m.profile,
            placement: m.placement,
        })
        .collect();
    if e.pcie_switch.is_some() && e.pcie_path.is_some() {
        return Err(
            "pcie_switch and pcie_path both given: pcie_path = [\"<host bridge>\", \"<switch>\", ...] says it all"
                .into(),
        );
    }
    let pcie_path = e.pcie_path.unwrap_or_default();
    if let Some(bad) = pcie_path.iter().find(|n| n.trim().is_empty()) {
        return Err(format!("pcie_path entry {bad:?} is empty"));
    }
    let fabric = e.fabric.map(|f| crate::fabric::fabric_spec(model, f)).transpose()?;
    let pci_class = e.pci_class.unwrap_or(0x030200);
    if pci_class > 0xff_ffff {
        return Err(format!("pci_class {pci_class:#x} is not a 24-bit PCI class code"));
    }
    Ok(GpuSpec {
        model,
        uuid,
        bus_id,
        numa_node: e.numa_node,
        minor: e.minor.unwrap_or(u32::try_from(index).unwrap_or(u32::MAX)),
        mig_mode: e.mig_mode,
        mig_reset_required: e.mig_reset_required,
        pci_subsystem_id: e.pci_subsystem_id.unwrap_or(model.pci_subsystem_id),
        pcie_switch: e.pcie_switch,
        pcie_path,
        pcie_board: e.pcie_board,
        nvlink_peers,
        mig_devices,
        readings: e.readings,
        fabric,
        pci_class,
        vgpu: e.vgpu,
        gpm: e.gpm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_filled() {
        let m = Machine::parse(
            r#"
            driver_version = "550.54.15"
            cuda_driver_version = 12040
            [[gpu]]
            model = "T4"
            [[gpu]]
            model = "T4"
            "#,
        )
        .unwrap();
        assert_eq!(m.nvml_version, "12.550.54.15");
        assert_eq!(m.gpus[1].bus_id.to_string(), "00000000:11:00.0");
        assert_eq!(m.gpus[1].minor, 1);
        assert_eq!(m.gpus[0].uuid, default_gpu_uuid("T4", 0));
        assert!(m.gpus[0].numa_node.is_none());
        assert!(!m.profiles_need_mig);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        let base = "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n";
        let cases = [
            ("color = 1\n", "unknown field"),
            ("[[gpu]]\nmodel = \"T4\"\nfoo = 1\n", "unknown field"),
            ("[[gpu]]\nmodel = \"V100\"\n", "unknown model"),
            ("[[gpu]]\nmodel = \"T4\"\nmig_mode = true\n", "has no MIG"),
            (
                "[[gpu]]\nmodel = \"T4\"\nnvlink_peers = [\"0000:12:00.0\"]\n",
                "no NVLink",
            ),
            (
                "[[gpu]]\nmodel = \"A100-SXM4-40GB\"\n[[gpu.mig_device]]\nprofile = \"1g.5gb\"\n",
                "need mig_mode",
            ),
            (
                "[[gpu]]\nmodel = \"T4\"\npci_bus_id = \"0000:07:00.0\"\n[[gpu]]\nmodel = \"T4\"\npci_bus_id = \"00000000:07:00.0\"\n",
                "used twice",
            ),
        ];
        for (extra, want) in cases {
            let err = Machine::parse(&format!("{base}{extra}")).unwrap_err();
            assert!(err.contains(want), "{extra:?}: {err}");
            assert!(!err.contains('\n'));
        }
        assert!(Machine::parse("cuda_driver_version = 12040\n").is_err());
    }

    fn gpu(path: &[&str], numa: u32, peers: &[&str]) -> String {
        let path: Vec<String> = path.iter().map(|p| format!("{p:?}")).collect();
        let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
        format!(
            "[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nnuma_node = {numa}\npcie_path = [{}]\nnvlink_peers = [{}]\n",
            path.join(", "),
            peers.join(", ")
        )
    }

    #[test]
    fn pcie_paths_give_every_level() {
        let base = "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n";
        let text = [
            gpu(&["hb0", "sw0", "sw1"], 0, &[]),
            gpu(&["hb0", "sw0", "sw1"], 0, &[]),
            gpu(&["hb0", "sw0", "sw2"], 0, &[]),
            gpu(&["hb0", "sw3"], 0, &[]),
            gpu(&["hb1"], 0, &[]),
            gpu(&["hb2"], 1, &[]),
        ]
        .concat();
        let mut m = Machine::parse(&format!("{base}{text}")).unwrap();
        let level = |m: &Machine, a: usize, b: usize| common_ancestor(&m.gpus[a], &m.gpus[b]);
        assert_eq!(level(&m, 0, 1), 10);
        assert_eq!(level(&m, 0, 2), 20);
        assert_eq!(level(&m, 0, 3), 30);
        assert_eq!(level(&m, 0, 4), 40);
        assert_eq!(level(&m, 4, 5), 50);
        m.gpus[0].pcie_board = Some("b".into());
        m.gpus[3].pcie_board = Some("b".into());
        assert_eq!(level(&m, 0, 3), 0);
    }

    #[test]
    fn topology_mistakes_are_named() {
        let base = "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n";
        let cases = [
            (
                [gpu(&["hb0", "sw0"], 0, &[]), gpu(&["hb1", "sw0"], 0, &[])].concat(),
                "gpu[1]: pcie_path puts \"sw0\" under \"hb1\", gpu[0] under \"hb0\"",
            ),
            (
                [gpu(&["hb0", "sw0"], 0, &[]), gpu(&["sw0"], 0, &[])].concat(),
                "gpu[1]: pcie_path puts \"sw0\" under the root (a host bridge), gpu[0] under \"hb0\"",
            ),
            (
                [gpu(&["hb0"], 0, &[]), gpu(&["hb0"], 1, &[])].concat(),
                "gpu[1]: host bridge \"hb0\" is also gpu[0]'s, but the numa_node differs",
            ),
            (gpu(&["hb0", " "], 0, &[]), "gpu[0]: pcie_path entry \" \" is empty"),
            (
                "[[gpu]]\nmodel = \"T4\"\npcie_switch = \"s\"\npcie_path = [\"h\"]\n".to_string(),
                "pcie_switch and pcie_path both given",
            ),
            (
                "[[nvswitch]]\npci_bus_id = \"00000000:10:00.0\"\n[[gpu]]\nmodel = \"T4\"\n".to_string(),
                "nvswitch[0]: pci_bus_id 00000000:10:00.0 is used twice",
            ),
        ];
        for (extra, want) in cases {
            let err = Machine::parse(&format!("{base}{extra}")).unwrap_err();
            assert!(err.contains(want), "{extra:?}: {err}");
        }
    }

    #[test]
    fn nvswitches_are_parsed() {
        let text = "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n\
                    [[nvswitch]]\npci_bus_id = \"0000:c0:00.0\"\n\
                    [[nvswitch]]\npci_bus_id = \"0000:c1:00.0\"\npci_device_id = 0x22a3\n";
        let m = Machine::parse(text).unwrap();
        let bus = BusId::parse("00000000:C1:00.0").unwrap();
        assert_eq!(m.nvswitch_by_bus_id(&bus).map(|s| s.pci_device_id), Some(0x22a3));
        assert_eq!(m.nvswitches[0].pci_device_id, DEFAULT_NVSWITCH_DEVICE_ID);
    }
}
