//! GPU inventory, topology and health events through NVML (nvml-wrapper).
//!
//! The safe nvml-wrapper API is used wherever it exists; the MIG read calls it does not wrap
//! (GPU/compute instance ids, profile names) and the event wait (whose safe wrapper drops the
//! GPU/compute instance ids of an Xid) go through `Nvml::lib()`, each `unsafe` block saying why
//! it is sound. One thing here changes GPU state: the compute mode, which MPS sharing sets
//! ([`Gpus::set_compute_mode`]); everything else only reads.

use std::collections::BTreeMap;
use std::ffi::{CStr, OsStr};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel as NvmlTopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;
use serde::Serialize;

use crate::devices::{Topology, TopologyLevel, link_score};
use crate::host::HostRoot;
use crate::host::arch::HostArch;

/// NVML's "not attributable" GPU/compute instance id in event and process records.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// The most NVLink links any supported GPU has (NVML_NVLINK_MAX_LINKS in the 13.0 header).
const MAX_NVLINKS: u32 = 18;

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "cannot load the NVML library {library}: {source} (is the NVIDIA driver installed? [nvml] library names the file)"
    )]
    Load { library: String, source: NvmlError },
    #[error("NVML call {call} failed: {source}")]
    Call { call: String, source: NvmlError },
    #[error("NVML call {call} failed for GPU {gpu}: {source}")]
    Device {
        call: String,
        gpu: String,
        source: NvmlError,
    },
}

impl GpuError {
    fn call(call: &str) -> impl FnOnce(NvmlError) -> GpuError + '_ {
        move |source| GpuError::Call {
            call: call.to_string(),
            source,
        }
    }
}

fn dev_err<'a>(call: &'a str, gpu: &'a str) -> impl FnOnce(NvmlError) -> GpuError + 'a {
    move |source| GpuError::Device {
        call: call.to_string(),
        gpu: gpu.to_string(),
        source,
    }
}

/// Everything the agent knows about the node's GPUs at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inventory {
    pub driver_version: String,
    /// CUDA driver API version as `major.minor`, e.g. `12.4`.
    pub cuda_driver_version: String,
    pub gpus: Vec<GpuInfo>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_mib: u64,
    /// NVML's bus id, e.g. `00000000:07:00.0`.
    pub pci_bus_id: String,
    /// The 16-bit PCI device id, e.g. `0x20b0` for an A100-SXM4-40GB.
    pub pci_device_id: u16,
    pub minor: u32,
    pub numa_node: Option<i64>,
    pub compute_capability: Option<(i32, i32)>,
    /// `None` when the GPU does not support MIG.
    pub mig: Option<MigState>,
    /// MIG devices that exist now, by slot index.
    pub mig_devices: Vec<MigDeviceInfo>,
    /// The GPU's NVLink fabric membership (`nvmlDeviceGetGpuFabricInfoV`); `None` where NVML
    /// has none (NOT_SUPPORTED: no fabric, an older GPU or driver).
    pub fabric: Option<FabricInfo>,
    /// The PCI class code sysfs gives for the GPU's bus id (`0x030200` 3D controller, `0x030000`
    /// VGA); `None` when it cannot be read.
    pub pci_class: Option<u32>,
}

/// What NVML says of a GPU's place in an NVLink fabric (GB200 NVL72 class: many nodes, one
/// NVLink domain).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FabricInfo {
    /// `clusterUuid` in the canonical form, e.g. `0123abcd-0000-1111-2222-333344445555`;
    /// all zeros when the GPU is in no multi-node domain.
    pub cluster_uuid: String,
    pub clique_id: u32,
    /// `NVML_GPU_FABRIC_STATE_*`: 1 not started, 2 in progress, 3 completed.
    pub state: u8,
    /// The fabric probe's own `nvmlReturn_t` (0 = success).
    pub status: u32,
}

/// `NVML_GPU_FABRIC_STATE_COMPLETED`.
pub const FABRIC_STATE_COMPLETED: u8 = 3;

impl FabricInfo {
    /// Attached to a multi-node fabric as NVIDIA's go-nvlib decides it (`IsFabricAttached`):
    /// registration completed, the probe succeeded and the cluster UUID is not all zeros.
    pub fn attached(&self) -> bool {
        self.state == FABRIC_STATE_COMPLETED
            && self.status == 0
            && self.cluster_uuid.chars().any(|c| c != '0' && c != '-')
    }
}

/// MIG mode as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MigState {
    pub current: bool,
    pub pending: bool,
}

/// One MIG device (a compute instance inside a GPU instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigDeviceInfo {
    /// NVML's sparse MIG device slot on the parent GPU.
    pub index: u32,
    pub uuid: String,
    pub gi_id: u32,
    pub ci_id: u32,
    /// Profile name without NVML's `MIG ` prefix, e.g. `1g.5gb` or `1c.3g.20gb`.
    pub profile: String,
    pub memory_mib: u64,
    /// The device's MIG attributes (`nvmlDeviceGetAttributes_v2` on the MIG handle); `None`
    /// when NVML would not give them.
    pub attributes: Option<MigAttributes>,
    /// Where its GPU instance sits on the GPU (`nvmlGpuInstanceGetInfo`): the profile id and
    /// the memory slices it occupies. NVIDIA's DRA driver names MIG devices by these
    /// (`gpu-<minor>-mig-<profile id>-<start>-<size>`). `None` for devices read some other way.
    #[serde(default)]
    pub placement: Option<GiPlacement>,
}

/// A GPU instance's profile id and placement (`nvmlGpuInstanceInfo_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GiPlacement {
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
}

/// What NVML says a MIG device has: its share of the GPU, as GPU Feature Discovery labels it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigAttributes {
    /// Streaming multiprocessors of the compute instance.
    pub multiprocessors: u32,
    /// Compute slices of the GPU instance.
    pub gpu_instance_slices: u32,
    /// Compute slices of the compute instance.
    pub compute_instance_slices: u32,
    /// Engines shared by the GPU instance's compute instances.
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg: u32,
    pub ofa: u32,
    /// The GPU instance's memory in MiB (NVML's `memorySizeMB`).
    pub memory_mib: u64,
}

impl From<nvml_wrapper::struct_wrappers::device::DeviceAttributes> for MigAttributes {
    fn from(a: nvml_wrapper::struct_wrappers::device::DeviceAttributes) -> MigAttributes {
        MigAttributes {
            multiprocessors: a.multiprocessor_count,
            gpu_instance_slices: a.gpu_instance_slice_count,
            compute_instance_slices: a.compute_instance_slice_count,
            copy_engines: a.shared_copy_engine_count,
            decoders: a.shared_decoder_count,
            encoders: a.shared_encoder_count,
            jpeg: a.shared_jpeg_count,
            ofa: a.shared_ofa_count,
            memory_mib: a.memory_size_mb,
        }
    }
}

impl fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU {} ({}, {})", self.index, self.uuid, self.pci_bus_id)
    }
}

/// What [`Gpus::open`] loads for `[nvml] library` (`library`) on the node under `root`:
///
/// - an absolute path: that host path under the root prefix;
/// - a soname (`libnvidia-ml.so.1`) on the real root: the soname, for the dynamic loader, which
///   searches the folders of its own architecture;
/// - a soname under another root (the agent in a container with the host at `/host`, a
///   simulated node): the first of the node's library folders for `arch`
///   ([`HostArch::library_dirs`]: `/usr/lib/aarch64-linux-gnu` on a Debian arm64 node, then
///   `/usr/lib64` ...) that holds it, under the root; the soname itself when none does.
pub fn library_path(library: &Path, root: &HostRoot, arch: &HostArch) -> PathBuf {
    if library.is_absolute() {
        return root.join(library);
    }
    if root.is_real() {
        return library.to_path_buf();
    }
    arch.library_dirs()
        .iter()
        .map(|dir| root.join(dir.join(library)))
        .find(|path| path.exists())
        .unwrap_or_else(|| library.to_path_buf())
}

/// An open NVML library. Cheap to clone; NVML is thread-safe.
#[derive(Clone)]
pub struct Gpus {
    nvml: Arc<Nvml>,
}

impl fmt::Debug for Gpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Gpus")
    }
}

impl Gpus {
    /// Loads and initialises NVML from `library` (a soname searched by the dynamic loader, or a
    /// path already resolved under the root prefix).
    pub fn open(library: &Path) -> Result<Gpus, GpuError> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(library.as_os_str()))
            .init()
            .map_err(|source| GpuError::Load {
                library: library.display().to_string(),
                source,
            })?;
        Ok(Gpus { nvml: Arc::new(nvml) })
    }

    /// The NVML library, for modules that make raw calls (MIG).
    pub(crate) fn nvml(&self) -> &Nvml {
        &self.nvml
    }

    /// The driver version and the GPU count: two NVML calls, for checks that need no more
    /// than that (the driver stage's validation on every pass).
    pub fn driver_and_count(&self) -> Result<(String, usize), GpuError> {
        let version = self
            .nvml
            .sys_driver_version()
            .map_err(GpuError::call("nvmlSystemGetDriverVersion"))?;
        let count = self
            .nvml
            .device_count()
            .map_err(GpuError::call("nvmlDeviceGetCount_v2"))?;
        Ok((version, count as usize))
    }

    /// Reads the whole inventory. `sysfs` is the root-prefixed `/sys`, where NUMA affinity is
    /// read first (as NVIDIA's plugin does); NVML's own NUMA id is the fallback.
    pub fn inventory(&self, sysfs: &Path) -> Result<Inventory, GpuError> {
        let nvml = &self.nvml;
        let driver_version = nvml
            .sys_driver_version()
            .map_err(GpuError::call("nvmlSystemGetDriverVersion"))?;
        let cuda = nvml
            .sys_cuda_driver_version()
            .map_err(GpuError::call("nvmlSystemGetCudaDriverVersion_v2"))?;
        let cuda_driver_version = format!("{}.{}", cuda / 1000, (cuda % 1000) / 10);
        let count = nvml.device_count().map_err(GpuError::call("nvmlDeviceGetCount_v2"))?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let gpu = format!("index {index}");
            let device = nvml
                .device_by_index(index)
                .map_err(dev_err("nvmlDeviceGetHandleByIndex_v2", &gpu))?;
            gpus.push(self.gpu_info(index, &device, sysfs)?);
        }
        Ok(Inventory {
            driver_version,
            cuda_driver_version,
            gpus,
        })
    }

    fn gpu_info(&self, index: u32, device: &Device<'_>, sysfs: &Path) -> Result<GpuInfo, GpuError> {
        let at = format!("index {index}");
        let uuid = device.uuid().map_err(dev_err("nvmlDeviceGetUUID", &at))?;
        let name = device.name().map_err(dev_err("nvmlDeviceGetName", &uuid))?;
        let memory = device
            .memory_info()
            .map_err(dev_err("nvmlDeviceGetMemoryInfo_v2", &uuid))?;
        let pci = device.pci_info().map_err(dev_err("nvmlDeviceGetPciInfo_v3", &uuid))?;
        let minor = device
            .minor_number()
            .map_err(dev_err("nvmlDeviceGetMinorNumber", &uuid))?;
        let pci_class = class_from_sysfs(sysfs, &pci.bus_id);
        let numa_node = numa_from_sysfs(sysfs, &pci.bus_id).or_else(|| device.numa_node_id().ok().map(i64::from));
        let compute_capability = device.cuda_compute_capability().ok().map(|c| (c.major, c.minor));
        let mig = match device.mig_mode() {
            Ok(mode) => Some(MigState {
                current: mode.current == 1,
                pending: mode.pending == 1,
            }),
            Err(NvmlError::NotSupported) => None,
            Err(source) => return Err(dev_err("nvmlDeviceGetMigMode", &uuid)(source)),
        };
        let mig_devices = if mig.is_some_and(|m| m.current) {
            self.mig_devices(device, &uuid)?
        } else {
            Vec::new()
        };
        Ok(GpuInfo {
            index,
            uuid,
            name,
            memory_mib: memory.total / (1024 * 1024),
            pci_bus_id: pci.bus_id,
            pci_device_id: (pci.pci_device_id >> 16) as u16,
            minor,
            numa_node,
            compute_capability,
            mig,
            mig_devices,
            fabric: self.fabric_info(device, index),
            pci_class,
        })
    }

    /// `nvmlDeviceGetGpuFabricInfoV` with the v2 struct (what every driver with the call takes).
    /// NOT_SUPPORTED (no fabric), a library without the symbol or any other answer is `None`:
    /// fabric facts only add a label, they never fail the inventory.
    fn fabric_info(&self, device: &Device<'_>, index: u32) -> Option<FabricInfo> {
        let call = self.nvml.lib().nvmlDeviceGetGpuFabricInfoV.as_ref().ok()?;
        // SAFETY: the device handle is live (we hold the Nvml and the Device); the out-pointer is
        // a zeroed v2 struct on our stack with its version word set, which NVML reads before
        // writing that version's fields only.
        let (rc, info) = unsafe {
            let mut info: sys::nvmlGpuFabricInfo_v2_t = std::mem::zeroed();
            info.version = struct_version(std::mem::size_of::<sys::nvmlGpuFabricInfo_v2_t>(), 2);
            let rc = call(device.handle(), (&raw mut info).cast::<sys::nvmlGpuFabricInfoV_t>());
            (rc, info)
        };
        if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
            if rc != sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED {
                tracing::debug!(gpu = index, "nvmlDeviceGetGpuFabricInfoV: {}", NvmlError::from(rc));
            }
            return None;
        }
        let u = info.clusterUuid;
        let hex: String = u.iter().map(|b| format!("{b:02x}")).collect();
        Some(FabricInfo {
            cluster_uuid: format!(
                "{}-{}-{}-{}-{}",
                &hex[0..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..32]
            ),
            clique_id: info.cliqueId,
            state: info.state,
            status: info.status,
        })
    }

    fn mig_devices(&self, parent: &Device<'_>, parent_uuid: &str) -> Result<Vec<MigDeviceInfo>, GpuError> {
        let max = parent
            .mig_device_count()
            .map_err(dev_err("nvmlDeviceGetMaxMigDeviceCount", parent_uuid))?;
        let mut found = Vec::new();
        for slot in 0..max {
            let mig = match parent.mig_device_by_index(slot) {
                Ok(mig) => mig,
                // Slots are sparse: an empty one answers NOT_FOUND.
                Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
                Err(source) => return Err(dev_err("nvmlDeviceGetMigDeviceHandleByIndex", parent_uuid)(source)),
            };
            let uuid = mig.uuid().map_err(dev_err("nvmlDeviceGetUUID", parent_uuid))?;
            let memory_mib = mig.memory_info().map(|m| m.total / (1024 * 1024)).unwrap_or(0);
            let raw = RawMig {
                nvml: &self.nvml,
                parent,
                mig: &mig,
                uuid: &uuid,
            };
            let (gi_id, ci_id) = raw.instance_ids()?;
            let (profile, placement) = raw.profile_name(gi_id, ci_id)?;
            let attributes = match mig.attributes() {
                Ok(a) => Some(MigAttributes::from(a)),
                Err(err) => {
                    tracing::debug!(mig = %uuid, "nvmlDeviceGetAttributes_v2 failed: {err}; no MIG attribute labels");
                    None
                }
            };
            found.push(MigDeviceInfo {
                index: slot,
                uuid,
                gi_id,
                ci_id,
                profile,
                memory_mib,
                attributes,
                placement: Some(placement),
            });
        }
        Ok(found)
    }

    /// Pairwise link scores between the GPUs: NVLink first, then the PCIe common ancestor.
    pub fn topology(&self, inventory: &Inventory) -> Topology {
        let mut topology = Topology::new();
        let devices: Vec<(String, Option<Device<'_>>)> = inventory
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), self.nvml.device_by_uuid(g.uuid.as_str()).ok()))
            .collect();
        let bus_ids: BTreeMap<String, String> = inventory
            .gpus
            .iter()
            .map(|g| (normalise_bus_id(&g.pci_bus_id), g.uuid.clone()))
            .collect();
        let mut nvlinks: BTreeMap<(String, String), u32> = BTreeMap::new();
        for (uuid, device) in &devices {
            let Some(device) = device else { continue };
            for link in 0..MAX_NVLINKS {
                let wrapper = device.link_wrapper_for(link);
                match wrapper.is_active() {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(_) => break,
                }
                let Ok(remote) = wrapper.remote_pci_info() else {
                    continue;
                };
                if let Some(peer) = bus_ids.get(&normalise_bus_id(&remote.bus_id)) {
                    *nvlinks.entry((uuid.clone(), peer.clone())).or_default() += 1;
                }
            }
        }
        for (i, (a, da)) in devices.iter().enumerate() {
            for (b, _) in devices.iter().skip(i + 1) {
                let links = nvlinks.get(&(a.clone(), b.clone())).copied().unwrap_or(0);
                let other = self.nvml.device_by_uuid(b.as_str()).ok();
                let level = match (da, other) {
                    (Some(da), Some(db)) => da.topology_common_ancestor(db).ok().map(level_from_nvml),
                    _ => None,
                };
                topology.set(a, b, link_score(links, level));
            }
        }
        topology
    }

    /// How many compute processes run on the GPU (and its MIG devices); `None` if NVML cannot
    /// tell (then the caller must assume the GPU may be busy).
    pub fn process_count(&self, uuid: &str) -> Option<usize> {
        let device = self.nvml.device_by_uuid(uuid).ok()?;
        device.running_compute_processes().ok().map(|p| p.len())
    }

    /// Whether NVML still answers for the GPU with this UUID (`false` when it is lost or gone).
    pub fn answers(&self, uuid: &str) -> bool {
        match self.nvml.device_by_uuid(uuid) {
            Ok(device) => device.memory_info().is_ok(),
            Err(_) => false,
        }
    }

    /// Starts the health watcher thread: critical Xid events for every GPU in `uuids`, and a
    /// probe of each GPU every `probe_interval` so a lost GPU, and one that comes back, are seen
    /// even when the event wait says nothing. Events go to `sink`; the thread ends when `stop`
    /// is set or the sink is closed.
    pub fn watch_health(
        &self,
        uuids: Vec<String>,
        probe_interval: Duration,
        sink: tokio::sync::mpsc::UnboundedSender<HealthEvent>,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let gpus = self.clone();
        std::thread::Builder::new()
            .name("nvml-health".into())
            .spawn(move || gpus.health_loop(&uuids, probe_interval, &sink, &stop))
    }

    fn health_loop(
        &self,
        uuids: &[String],
        probe_interval: Duration,
        sink: &tokio::sync::mpsc::UnboundedSender<HealthEvent>,
        stop: &AtomicBool,
    ) {
        let nvml = &*self.nvml;
        let set = match self.register_xid_events(uuids) {
            Ok(set) => Some(set),
            Err(err) => {
                tracing::warn!("Xid health events are not available: {err}; only lost GPUs are detected");
                None
            }
        };
        let wait = nvml.lib().nvmlEventSetWait_v2.as_ref().ok();
        let mut answering: BTreeMap<&str, bool> = uuids.iter().map(|u| (u.as_str(), true)).collect();
        let mut last_probe = Instant::now();
        while !stop.load(Ordering::Relaxed) && !sink.is_closed() {
            let mut probe_now = last_probe.elapsed() >= probe_interval;
            match (&set, wait) {
                (Some(set), Some(wait)) => {
                    // SAFETY: `data` is a plain C struct NVML fills; `set` is a live event set
                    // owned by this thread for the whole loop.
                    let mut data: sys::nvmlEventData_t = unsafe { std::mem::zeroed() };
                    let rc = unsafe { wait(set.handle(), &mut data, 200) };
                    match rc {
                        sys::nvmlReturn_enum_NVML_SUCCESS => {
                            if let Some(event) = self.xid_event(&data) {
                                let _ = sink.send(event);
                            }
                        }
                        sys::nvmlReturn_enum_NVML_ERROR_TIMEOUT => {}
                        // A lost GPU (or anything else) breaks the wait: find out who.
                        _ => {
                            probe_now = true;
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
                _ => std::thread::sleep(Duration::from_millis(200).min(probe_interval)),
            }
            if probe_now {
                last_probe = Instant::now();
                for (uuid, was) in answering.iter_mut() {
                    let now = self.answers(uuid);
                    if now != *was {
                        *was = now;
                        let event = if now {
                            HealthEvent::Answering { uuid: uuid.to_string() }
                        } else {
                            HealthEvent::Lost { uuid: uuid.to_string() }
                        };
                        let _ = sink.send(event);
                    }
                }
            }
        }
    }

    fn register_xid_events(&self, uuids: &[String]) -> Result<nvml_wrapper::EventSet<'_>, GpuError> {
        let mut set = self
            .nvml
            .create_event_set()
            .map_err(GpuError::call("nvmlEventSetCreate"))?;
        for uuid in uuids {
            let device = self
                .nvml
                .device_by_uuid(uuid.as_str())
                .map_err(dev_err("nvmlDeviceGetHandleByUUID", uuid))?;
            let supported = device
                .supported_event_types()
                .map_err(dev_err("nvmlDeviceGetSupportedEventTypes", uuid))?;
            let wanted = EventTypes::CRITICAL_XID_ERROR & supported;
            if wanted.is_empty() {
                tracing::warn!(gpu = %uuid, "GPU does not report Xid events; its health comes from NVML answering only");
                continue;
            }
            set = device.register_events(wanted, set).map_err(|e| GpuError::Device {
                call: "nvmlDeviceRegisterEvents".into(),
                gpu: uuid.clone(),
                source: e.error,
            })?;
        }
        Ok(set)
    }

    fn xid_event(&self, data: &sys::nvmlEventData_t) -> Option<HealthEvent> {
        if data.eventType & sys::nvmlEventTypeXidCriticalError as u64 == 0 {
            return None;
        }
        // SAFETY: `data.device` is a device handle NVML just returned in the event record, valid
        // while the library is initialised (we hold the Nvml). `Device::new` only stores it.
        let device = unsafe { Device::new(data.device, &self.nvml) };
        let uuid = device.uuid().ok()?;
        Some(HealthEvent::Xid {
            uuid,
            xid: data.eventData,
            gi_id: data.gpuInstanceId,
            ci_id: data.computeInstanceId,
        })
    }

    /// The compute processes on the GPU or MIG device `uuid`: host PID and used GPU memory in MiB
    /// (rounded down; `None` where NVML cannot tell, as under WDDM). NVML answers for the handle
    /// it is given: a MIG UUID gives that MIG device's own processes, a GPU in MIG mode the
    /// processes of all its MIG devices (NVML docs of `nvmlDeviceGetComputeRunningProcesses_v3`:
    /// "per-instance information can be queried by using specific MIG device handles"), so a
    /// memory budget for a MIG device is looked up by its MIG UUID.
    pub fn compute_processes(&self, uuid: &str) -> Result<Vec<(u32, Option<u64>)>, GpuError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(dev_err("nvmlDeviceGetHandleByUUID", uuid))?;
        let processes = device
            .running_compute_processes()
            .map_err(dev_err("nvmlDeviceGetComputeRunningProcesses_v3", uuid))?;
        Ok(processes
            .into_iter()
            .map(|p| {
                let used_mib = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes / (1024 * 1024)),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, used_mib)
            })
            .collect())
    }
}

/// A GPU's compute mode (`nvmlComputeMode_t`), as MPS sharing needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ComputeMode {
    /// Many contexts per GPU (`NVML_COMPUTEMODE_DEFAULT`).
    Default,
    /// One context per GPU, from one process (`NVML_COMPUTEMODE_EXCLUSIVE_PROCESS`): with MPS,
    /// that process is the MPS server, which every client goes through.
    ExclusiveProcess,
    /// No contexts (`NVML_COMPUTEMODE_PROHIBITED`).
    Prohibited,
    /// The removed exclusive-thread mode, or a value this agent does not know.
    Other,
}

impl ComputeMode {
    /// As `nvidia-smi -c` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
            ComputeMode::Prohibited => "PROHIBITED",
            ComputeMode::Other => "OTHER",
        }
    }
}

impl fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Gpus {
    /// The compute mode of the GPU `uuid` (`nvmlDeviceGetComputeMode`).
    pub fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, GpuError> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
        let device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(dev_err("nvmlDeviceGetHandleByUUID", uuid))?;
        let mode = device
            .compute_mode()
            .map_err(dev_err("nvmlDeviceGetComputeMode", uuid))?;
        Ok(match mode {
            Nvml::Default => ComputeMode::Default,
            Nvml::ExclusiveProcess => ComputeMode::ExclusiveProcess,
            Nvml::Prohibited => ComputeMode::Prohibited,
            Nvml::ExclusiveThread => ComputeMode::Other,
        })
    }

    /// Sets the compute mode of the GPU `uuid` (`nvmlDeviceSetComputeMode`, what `nvidia-smi -c`
    /// does; needs root, and does not survive a driver reload). [`ComputeMode::Other`] is
    /// refused as an invalid argument.
    pub fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), GpuError> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
        let mut device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(dev_err("nvmlDeviceGetHandleByUUID", uuid))?;
        let mode = match mode {
            ComputeMode::Default => Nvml::Default,
            ComputeMode::ExclusiveProcess => Nvml::ExclusiveProcess,
            ComputeMode::Prohibited => Nvml::Prohibited,
            ComputeMode::Other => {
                return Err(GpuError::Device {
                    call: "nvmlDeviceSetComputeMode".into(),
                    gpu: uuid.into(),
                    source: NvmlError::InvalidArg,
                });
            }
        };
        device
            .set_compute_mode(mode)
            .map_err(dev_err("nvmlDeviceSetComputeMode", uuid))
    }
}

/// What the health watcher reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthEvent {
    /// A critical Xid on the GPU `uuid`; `gi_id`/`ci_id` are [`NO_INSTANCE`] unless NVML
    /// attributed it to a MIG device.
    Xid {
        uuid: String,
        xid: u64,
        gi_id: u32,
        ci_id: u32,
    },
    /// NVML stopped answering for the GPU (fallen off the bus, GPU_IS_LOST).
    Lost { uuid: String },
    /// NVML answers for a GPU again after it was lost.
    Answering { uuid: String },
}

/// Raw NVML calls for the MIG facts nvml-wrapper does not wrap.
struct RawMig<'a> {
    nvml: &'a Nvml,
    parent: &'a Device<'a>,
    mig: &'a Device<'a>,
    uuid: &'a str,
}

impl RawMig<'_> {
    fn sym<T: Copy>(&self, sym: &Result<T, libloading::Error>, name: &str) -> Result<T, GpuError> {
        sym.as_ref().copied().map_err(|_| GpuError::Device {
            call: name.to_string(),
            gpu: self.uuid.to_string(),
            source: NvmlError::FunctionNotFound,
        })
    }

    fn check(&self, rc: sys::nvmlReturn_t, name: &str) -> Result<(), GpuError> {
        if rc == sys::nvmlReturn_enum_NVML_SUCCESS {
            Ok(())
        } else {
            Err(GpuError::Device {
                call: name.into(),
                gpu: self.uuid.into(),
                source: NvmlError::from(rc),
            })
        }
    }

    fn instance_ids(&self) -> Result<(u32, u32), GpuError> {
        let lib = self.nvml.lib();
        let gi = self.sym(&lib.nvmlDeviceGetGpuInstanceId, "nvmlDeviceGetGpuInstanceId")?;
        let ci = self.sym(&lib.nvmlDeviceGetComputeInstanceId, "nvmlDeviceGetComputeInstanceId")?;
        let (mut gi_id, mut ci_id) = (0u32, 0u32);
        // SAFETY: the MIG handle is live (we hold the Nvml and just got it); the out-pointers are
        // valid u32s on our stack.
        unsafe {
            self.check(gi(self.mig.handle(), &mut gi_id), "nvmlDeviceGetGpuInstanceId")?;
            self.check(ci(self.mig.handle(), &mut ci_id), "nvmlDeviceGetComputeInstanceId")?;
        }
        Ok((gi_id, ci_id))
    }

    /// The profile name NVML gives the device: the GPU instance profile when the compute instance
    /// spans it (`3g.20gb`), else the compute instance profile (`1c.3g.20gb`); and its GPU
    /// instance's profile id and placement.
    fn profile_name(&self, gi_id: u32, ci_id: u32) -> Result<(String, GiPlacement), GpuError> {
        let lib = self.nvml.lib();
        let by_id = self.sym(&lib.nvmlDeviceGetGpuInstanceById, "nvmlDeviceGetGpuInstanceById")?;
        let gi_info = self.sym(&lib.nvmlGpuInstanceGetInfo, "nvmlGpuInstanceGetInfo")?;
        let gi_profile = self.sym(
            &lib.nvmlDeviceGetGpuInstanceProfileInfoV,
            "nvmlDeviceGetGpuInstanceProfileInfoV",
        )?;
        let ci_by_id = self.sym(
            &lib.nvmlGpuInstanceGetComputeInstanceById,
            "nvmlGpuInstanceGetComputeInstanceById",
        )?;
        let ci_info = self.sym(&lib.nvmlComputeInstanceGetInfo_v2, "nvmlComputeInstanceGetInfo_v2")?;
        let ci_profile = self.sym(
            &lib.nvmlGpuInstanceGetComputeInstanceProfileInfoV,
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        )?;
        // SAFETY: every handle passed is live (parent device held, instance handles just returned
        // by NVML); every out-pointer is a zeroed C struct on our stack with its version word set
        // as NVML requires for the V variants.
        unsafe {
            let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
            self.check(
                by_id(self.parent.handle(), gi_id, &mut gi),
                "nvmlDeviceGetGpuInstanceById",
            )?;
            let mut info: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
            self.check(gi_info(gi, &mut info), "nvmlGpuInstanceGetInfo")?;
            let gi_name = self.find_profile_name("nvmlDeviceGetGpuInstanceProfileInfoV", info.profileId, |idx| {
                let mut p: sys::nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
                p.version = struct_version(std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>(), 2);
                let rc = gi_profile(self.parent.handle(), idx, &mut p);
                (rc, p.id, p.sliceCount, c_name(&p.name))
            })?;
            let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
            self.check(ci_by_id(gi, ci_id, &mut ci), "nvmlGpuInstanceGetComputeInstanceById")?;
            let mut cinfo: sys::nvmlComputeInstanceInfo_t = std::mem::zeroed();
            self.check(ci_info(ci, &mut cinfo), "nvmlComputeInstanceGetInfo_v2")?;
            let mut gi_slices = 0;
            let ci_name = self.find_profile_name(
                "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
                cinfo.profileId,
                |idx| {
                    let mut p: sys::nvmlComputeInstanceProfileInfo_v2_t = std::mem::zeroed();
                    p.version = struct_version(std::mem::size_of::<sys::nvmlComputeInstanceProfileInfo_v2_t>(), 2);
                    let rc = ci_profile(gi, idx, sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut p);
                    gi_slices = gi_slices.max(p.sliceCount);
                    (rc, p.id, p.sliceCount, c_name(&p.name))
                },
            )?;
            // The compute instance spanning the whole GPU instance is the GPU instance's profile.
            let name = if ci_name.1 >= gi_name.1 { gi_name.0 } else { ci_name.0 };
            let placement = GiPlacement {
                profile_id: info.profileId,
                start: info.placement.start,
                size: info.placement.size,
            };
            Ok((name.trim_start_matches("MIG ").to_string(), placement))
        }
    }

    /// Walks profile indices until NVML says INVALID_ARGUMENT (forward compatible: newer drivers
    /// add indices) and returns the name and slice count of the profile with id `want`.
    fn find_profile_name(
        &self,
        call: &str,
        want: u32,
        mut query: impl FnMut(u32) -> (sys::nvmlReturn_t, u32, u32, String),
    ) -> Result<(String, u32), GpuError> {
        for idx in 0..64 {
            let (rc, id, slices, name) = query(idx);
            match rc {
                sys::nvmlReturn_enum_NVML_SUCCESS if id == want => return Ok((name, slices)),
                sys::nvmlReturn_enum_NVML_SUCCESS | sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => {}
                sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => break,
                other => self.check(other, call)?,
            }
        }
        Err(GpuError::Device {
            call: format!("{call} (profile id {want})"),
            gpu: self.uuid.into(),
            source: NvmlError::NotFound,
        })
    }
}

/// NVML's `NVML_STRUCT_VERSION`: the struct size with the version in the top byte.
pub(crate) fn struct_version(size: usize, version: u32) -> u32 {
    size as u32 | (version << 24)
}

/// A NUL-terminated name NVML wrote into a fixed buffer.
pub(crate) fn c_name(buf: &[std::os::raw::c_char]) -> String {
    // SAFETY: reinterpreting c_char as u8 of the same size; NVML NUL-terminates names, and
    // `from_bytes_until_nul` stops at the buffer's end if it did not.
    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), buf.len()) };
    CStr::from_bytes_until_nul(bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned())
}

fn level_from_nvml(level: NvmlTopologyLevel) -> TopologyLevel {
    match level {
        NvmlTopologyLevel::Internal => TopologyLevel::Internal,
        NvmlTopologyLevel::Single => TopologyLevel::Single,
        NvmlTopologyLevel::Multiple => TopologyLevel::Multiple,
        NvmlTopologyLevel::HostBridge => TopologyLevel::HostBridge,
        NvmlTopologyLevel::Node => TopologyLevel::Node,
        NvmlTopologyLevel::System => TopologyLevel::System,
    }
}

/// NVML writes bus ids with an 8-digit domain (`00000000:07:00.0`), sysfs with 4 and lower
/// case (`0000:07:00.0`). Returns the sysfs form.
pub fn normalise_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => lower,
    }
}

/// NUMA node of a PCI device from `<sysfs>/bus/pci/devices/<bus id>/numa_node`; negative or
/// missing means none.
fn numa_from_sysfs(sysfs: &Path, bus_id: &str) -> Option<i64> {
    let path = sysfs
        .join("bus/pci/devices")
        .join(normalise_bus_id(bus_id))
        .join("numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    text.trim().parse::<i64>().ok().filter(|n| *n >= 0)
}

/// PCI class of a device from `<sysfs>/bus/pci/devices/<bus id>/class` (`0x030200`).
fn class_from_sysfs(sysfs: &Path, bus_id: &str) -> Option<u32> {
    let path = sysfs
        .join("bus/pci/devices")
        .join(normalise_bus_id(bus_id))
        .join("class");
    let text = std::fs::read_to_string(path).ok()?;
    crate::devices::parse_sysfs_hex(&text).filter(|c| *c <= 0xff_ffff)
}

/// Inventories for unit tests: one A100 builder the planners, labels and specs all start from,
/// adjusted with struct-update syntax where a test needs another value.
#[cfg(test)]
pub(crate) mod sample {
    use super::{GpuInfo, Inventory, MigDeviceInfo, MigState};

    /// An A100-SXM4-40GB at `index`: `GPU-<index>`, bus `00000000:<0x10 + index>:00.0`, minor
    /// `index`, no NUMA node, MIG capable with MIG off, no MIG devices.
    pub fn a100(index: u32) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA A100-SXM4-40GB".into(),
            memory_mib: 40960,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + index),
            pci_device_id: 0x20b0,
            minor: index,
            numa_node: None,
            compute_capability: Some((8, 0)),
            mig: Some(mig(false)),
            mig_devices: Vec::new(),
            fabric: None,
            pci_class: Some(0x030200),
        }
    }

    /// MIG mode, current and pending alike.
    pub fn mig(on: bool) -> MigState {
        MigState {
            current: on,
            pending: on,
        }
    }

    /// MIG devices of GPU `gpu` with these profiles in slots 0.., `MIG-<gpu>-<slot>`, GPU
    /// instance `slot + 1`, 4864 MiB each, no attributes.
    pub fn mig_devices(gpu: u32, profiles: &[&str]) -> Vec<MigDeviceInfo> {
        profiles
            .iter()
            .enumerate()
            .map(|(i, p)| MigDeviceInfo {
                index: i as u32,
                uuid: format!("MIG-{gpu}-{i}"),
                gi_id: i as u32 + 1,
                ci_id: 0,
                profile: (*p).into(),
                memory_mib: 4864,
                attributes: None,
                placement: None,
            })
            .collect()
    }

    /// Driver 550.54.15, CUDA 12.4.
    pub fn inventory(gpus: Vec<GpuInfo>) -> Inventory {
        Inventory {
            driver_version: "550.54.15".into(),
            cuda_driver_version: "12.4".into(),
            gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root laid out like a node: `files` created (empty) under it.
    fn node(files: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for file in files {
            let path = dir.path().join(file.trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, "").expect("write");
        }
        dir
    }

    #[test]
    fn nvml_is_found_in_the_node_architectures_library_folder() {
        let soname = Path::new("libnvidia-ml.so.1");
        // Debian/Ubuntu arm64 (Grace Hopper): the aarch64 multiarch folder; an x86_64 copy there
        // (a foreign-architecture package) is not taken.
        let debian = node(&[
            "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        ]);
        let root = HostRoot::new(debian.path());
        assert_eq!(
            library_path(soname, &root, &HostArch::Aarch64),
            debian.path().join("usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1")
        );
        assert_eq!(
            library_path(soname, &root, &HostArch::X86_64),
            debian.path().join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
        );
        // The RHEL family, either architecture: /usr/lib64.
        let rhel = node(&["/usr/lib64/libnvidia-ml.so.1"]);
        let root = HostRoot::new(rhel.path());
        for arch in [HostArch::Aarch64, HostArch::X86_64] {
            assert_eq!(
                library_path(soname, &root, &arch),
                rhel.path().join("usr/lib64/libnvidia-ml.so.1")
            );
        }
        // Only the other architecture's: left to the dynamic loader, which will not load it.
        let foreign = node(&["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]);
        assert_eq!(
            library_path(soname, &HostRoot::new(foreign.path()), &HostArch::Aarch64),
            soname
        );
    }

    #[test]
    fn nvml_paths_and_sonames_on_the_real_root() {
        let soname = Path::new("libnvidia-ml.so.1");
        assert_eq!(library_path(soname, &HostRoot::new("/"), &HostArch::Aarch64), soname);
        let absolute = Path::new("/opt/nvidia/lib/libnvidia-ml.so.1");
        assert_eq!(
            library_path(absolute, &HostRoot::new("/"), &HostArch::Aarch64),
            absolute
        );
        assert_eq!(
            library_path(absolute, &HostRoot::new("/tmp/r"), &HostArch::Aarch64),
            Path::new("/tmp/r/opt/nvidia/lib/libnvidia-ml.so.1")
        );
    }

    #[test]
    fn bus_ids_normalise_to_sysfs_form() {
        assert_eq!(normalise_bus_id("00000000:07:00.0"), "0000:07:00.0");
        assert_eq!(normalise_bus_id("0000:0A:00.0"), "0000:0a:00.0");
    }

    #[test]
    fn numa_node_from_sysfs_ignores_negative() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = dir.path().join("bus/pci/devices/0000:07:00.0");
        std::fs::create_dir_all(&dev).expect("mkdir");
        std::fs::write(dev.join("numa_node"), "1\n").expect("write");
        assert_eq!(numa_from_sysfs(dir.path(), "00000000:07:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").expect("write");
        assert_eq!(numa_from_sysfs(dir.path(), "00000000:07:00.0"), None);
        assert_eq!(numa_from_sysfs(dir.path(), "00000000:99:00.0"), None);
    }
}
