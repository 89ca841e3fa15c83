//! The live library: machine + state + injection files behind one global mutex, the handle
//! arena, event sets, and the NVML operations in safe Rust. `ffi` only converts pointers.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::Instant;

use nvml_wrapper_sys::bindings::{nvmlDeviceAttributes_t, nvmlEventData_t, nvmlGpuInstancePlacement_t, nvmlPciInfo_t};

use crate::error::{NvmlError, NvmlResult};
use crate::ids::{BusId, mig_uuid};
use crate::inject::{Injections, note, write_atomic};
use crate::machine::{GpuSpec, Machine};
use crate::models::{CiProfile, GI_PROFILE_INDEX_COUNT, GiProfile, ci_profile_by_index};
use crate::state::State;

/// Environment variable naming the machine file.
pub const ENV_MACHINE: &str = "FAKE_NVML_MACHINE";
/// Environment variable naming the state directory.
pub const ENV_STATE_DIR: &str = "FAKE_NVML_STATE_DIR";
/// File name of the persisted state inside the state directory.
pub const STATE_FILE: &str = "state.json";

/// GI/CI id used in events and process entries that are not attributable to a MIG device.
pub const NO_ID: u32 = 0xFFFF_FFFF;
/// `nvmlEventTypeXidCriticalError`.
pub const EVENT_XID: u64 = 0x8;
const EVENT_SBE: u64 = 0x1;
const EVENT_DBE: u64 = 0x2;
const EVENT_MIG_CONFIG: u64 = 0x100;

/// When the library was loaded: the clock of the growing energy counter and of field-value
/// timestamps.
pub(crate) static START: LazyLock<Instant> = LazyLock::new(Instant::now);

/// What a device handle designates (positions are valid while the lock is held).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dev {
    /// A physical GPU, by index.
    Gpu(usize),
    /// A MIG device: GPU index, GI position, CI position.
    Mig { gpu: usize, gi: usize, ci: usize },
}

impl Dev {
    /// Index of the physical GPU.
    pub fn gpu(self) -> usize {
        match self {
            Dev::Gpu(g) | Dev::Mig { gpu: g, .. } => g,
        }
    }
}

/// Identity behind a handle address. Instance serials are never reused, so a handle to a
/// destroyed instance stays invalid even if an equal instance is created later.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Gpu(String),
    Mig(String, u64),
    Gi(String, u64),
    Ci(String, u64),
    Set(u64),
}

/// Stable addresses for handles: each distinct key gets one leaked 8-byte allocation,
/// for the life of the process (a few bytes per handle ever seen). The fake never
/// dereferences a handle; it only looks the address up here.
#[derive(Debug, Default)]
pub struct Arena {
    by_key: HashMap<Key, usize>,
    by_addr: HashMap<usize, Key>,
    sets_made: u64,
}

impl Arena {
    fn addr(&mut self, key: Key) -> usize {
        if let Some(&a) = self.by_key.get(&key) {
            return a;
        }
        let a = Box::into_raw(Box::new(0u64)) as usize;
        self.by_key.insert(key.clone(), a);
        self.by_addr.insert(a, key);
        a
    }

    fn key(&self, addr: usize) -> Option<&Key> {
        self.by_addr.get(&addr)
    }
}

/// Registration of one GPU in an event set.
#[derive(Debug)]
struct Registration {
    mask: u64,
    /// Xid lines starting before this file offset are not delivered.
    xid_from: u64,
}

#[derive(Debug)]
struct Queued {
    gpu_uuid: String,
    xid: u64,
    gi: u32,
    ci: u32,
}

/// An `nvmlEventSet_t`.
#[derive(Debug, Default)]
pub struct EventSet {
    regs: HashMap<String, Registration>,
    queue: VecDeque<Queued>,
    /// Xid file offset up to which lines were considered.
    cursor: u64,
    generation: u64,
}

/// The initialized library.
#[derive(Debug)]
pub struct Lib {
    /// The machine file.
    pub machine: Machine,
    /// The mutable state.
    pub state: State,
    state_dir: Option<PathBuf>,
    inj: Option<Injections>,
}

impl Lib {
    /// Loads the machine file and state named by the environment.
    fn from_env() -> Result<Lib, String> {
        let machine_path = std::env::var_os(ENV_MACHINE)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("{ENV_MACHINE} is not set; NVML reports no driver"))?;
        let machine_path = PathBuf::from(machine_path);
        let text = std::fs::read_to_string(&machine_path)
            .map_err(|e| format!("cannot read machine file {}: {e}", machine_path.display()))?;
        let machine = Machine::parse(&text).map_err(|e| format!("machine file {}: {e}", machine_path.display()))?;
        let initial =
            State::from_machine(&machine).map_err(|e| format!("machine file {}: {e}", machine_path.display()))?;
        let state_dir = std::env::var_os(ENV_STATE_DIR)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let mut lib = Lib {
            machine,
            state: initial,
            state_dir: None,
            inj: None,
        };
        if let Some(dir) = state_dir {
            std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create state dir {}: {e}", dir.display()))?;
            if let Some(saved) = load_state(&dir, &lib.machine) {
                lib.state = saved;
            }
            lib.inj = Some(Injections::new(&dir));
            lib.state_dir = Some(dir);
            lib.save();
        }
        Ok(lib)
    }

    /// Writes `state.json` (temp file + rename). Failures are noted, not fatal.
    fn save(&self) {
        let Some(dir) = &self.state_dir else { return };
        let path = dir.join(STATE_FILE);
        let result = serde_json::to_vec_pretty(&self.state)
            .map_err(std::io::Error::other)
            .and_then(|bytes| write_atomic(&path, &bytes));
        if let Err(e) = result {
            note(format!("cannot write {}: {e}", path.display()));
        }
        // `FAKE_NVML_MUTATION_DELAY_MS`: each state change takes this long, like MIG operations on
        // real GPUs (tenths of seconds), so a test can kill a process in the middle of an apply.
        // The caller waits once the library is unlocked again ([`take_mutation_delay`]): a MIG
        // operation on one thread does not hold the others' calls (health events, readings).
        if let Some(ms) = std::env::var("FAKE_NVML_MUTATION_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            MUTATION_DELAY.with(|d| d.set(Some(std::time::Duration::from_millis(ms))));
        }
    }

    fn spec(&self, gpu: usize) -> &GpuSpec {
        &self.machine.gpus[gpu]
    }
}

thread_local! {
    /// The delay the current call's state change asked for, served after the lock is released.
    static MUTATION_DELAY: std::cell::Cell<Option<std::time::Duration>> = const { std::cell::Cell::new(None) };
}

/// The delay this thread's last state change asked for (`FAKE_NVML_MUTATION_DELAY_MS`), once.
pub fn take_mutation_delay() -> Option<std::time::Duration> {
    MUTATION_DELAY.with(std::cell::Cell::take)
}

/// Loads `state.json` if it exists and fits the machine; otherwise `None` (with a note).
fn load_state(dir: &Path, machine: &Machine) -> Option<State> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).ok()?;
    let loaded: Result<State, String> = serde_json::from_str::<State>(&text)
        .map_err(|e| e.to_string())
        .and_then(|s| s.check_against(machine).map(|()| s));
    match loaded {
        Ok(mut s) => {
            s.fix_next_serial();
            Some(s)
        }
        Err(e) => {
            note(format!(
                "{} ignored ({e}); starting from the machine file",
                path.display()
            ));
            None
        }
    }
}

/// Process-wide library state.
#[derive(Debug, Default)]
pub struct Global {
    init_count: u32,
    lib: Option<Lib>,
    arena: Arena,
    sets: HashMap<usize, EventSet>,
}

static GLOBAL: LazyLock<Mutex<Global>> = LazyLock::new(|| Mutex::new(Global::default()));

/// Locks the global state (a panic while locked does not poison it for later calls).
pub fn lock() -> MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

impl Global {
    /// `nvmlInit*`: ref-counted; the first call loads machine + state.
    pub fn init(&mut self) -> NvmlResult<()> {
        if self.init_count > 0 {
            self.init_count += 1;
            return Ok(());
        }
        LazyLock::force(&START);
        match Lib::from_env() {
            Ok(lib) => {
                self.lib = Some(lib);
                self.sets.clear();
                self.init_count = 1;
                Ok(())
            }
            Err(msg) => {
                eprintln!("fake-nvml: {msg}");
                Err(NvmlError::DriverNotLoaded)
            }
        }
    }

    /// `nvmlShutdown`: the last one drops the library (state is already on disk).
    pub fn shutdown(&mut self) {
        if self.init_count == 0 {
            return;
        }
        self.init_count -= 1;
        if self.init_count == 0 {
            self.lib = None;
            self.sets.clear();
        }
    }

    /// The context for a call; UNINITIALIZED before init.
    pub fn cx(&mut self) -> NvmlResult<Cx<'_>> {
        let Global { lib, arena, sets, .. } = self;
        let lib = lib.as_mut().ok_or(NvmlError::Uninitialized)?;
        Ok(Cx { lib, arena, sets })
    }
}

/// One call's view of the library.
pub struct Cx<'a> {
    /// The library.
    pub lib: &'a mut Lib,
    arena: &'a mut Arena,
    sets: &'a mut HashMap<usize, EventSet>,
}

/// A running process, resolved against the current state.
#[derive(Debug, Clone)]
pub struct Proc {
    /// GPU index.
    pub gpu: usize,
    /// (GI position, CI position) for a process on a MIG device.
    pub mig: Option<(usize, usize)>,
    /// Process id.
    pub pid: u32,
    /// Used memory in MiB.
    pub used_mib: u64,
}

// === handles ===

impl Cx<'_> {
    /// Number of GPUs.
    pub fn count(&self) -> usize {
        self.lib.machine.gpus.len()
    }

    /// Handle of GPU `i`.
    pub fn gpu_handle(&mut self, i: usize) -> usize {
        let uuid = self.lib.state.gpus[i].uuid.clone();
        self.arena.addr(Key::Gpu(uuid))
    }

    /// Handle of a MIG device.
    pub fn mig_handle(&mut self, gpu: usize, gi: usize, ci: usize) -> usize {
        let g = &self.lib.state.gpus[gpu];
        let key = Key::Mig(g.uuid.clone(), g.gpu_instances[gi].compute_instances[ci].serial);
        self.arena.addr(key)
    }

    /// Handle of a GPU instance.
    pub fn gi_handle(&mut self, gpu: usize, gi: usize) -> usize {
        let g = &self.lib.state.gpus[gpu];
        let key = Key::Gi(g.uuid.clone(), g.gpu_instances[gi].serial);
        self.arena.addr(key)
    }

    /// Handle of a compute instance.
    pub fn ci_handle(&mut self, gpu: usize, gi: usize, ci: usize) -> usize {
        let g = &self.lib.state.gpus[gpu];
        let key = Key::Ci(g.uuid.clone(), g.gpu_instances[gi].compute_instances[ci].serial);
        self.arena.addr(key)
    }

    fn gpu_by_uuid(&self, uuid: &str) -> Option<usize> {
        self.lib.state.gpus.iter().position(|g| g.uuid == uuid)
    }

    fn find_ci_serial(&self, gpu: usize, serial: u64) -> Option<(usize, usize)> {
        self.lib.state.gpus[gpu]
            .gpu_instances
            .iter()
            .enumerate()
            .find_map(|(g, gi)| gi.ci_position(serial).map(|c| (g, c)))
    }

    /// Resolves a device handle without the lost check (handle lookups use this).
    pub fn resolve_dev(&self, addr: usize) -> NvmlResult<Dev> {
        match self.arena.key(addr) {
            Some(Key::Gpu(uuid)) => self.gpu_by_uuid(uuid).map(Dev::Gpu),
            Some(Key::Mig(uuid, serial)) => self.gpu_by_uuid(uuid).and_then(|gpu| {
                self.find_ci_serial(gpu, *serial)
                    .map(|(gi, ci)| Dev::Mig { gpu, gi, ci })
            }),
            _ => None,
        }
        .ok_or(NvmlError::InvalidArgument)
    }

    /// Resolves a device handle; GPU_IS_LOST if its GPU is lost.
    pub fn dev(&mut self, addr: usize) -> NvmlResult<Dev> {
        let d = self.resolve_dev(addr)?;
        self.check_lost(d.gpu())?;
        Ok(d)
    }

    /// Resolves a handle that must be a physical GPU (MIG handles are INVALID_ARGUMENT).
    pub fn gpu(&mut self, addr: usize) -> NvmlResult<usize> {
        match self.dev(addr)? {
            Dev::Gpu(g) => Ok(g),
            Dev::Mig { .. } => Err(NvmlError::InvalidArgument),
        }
    }

    /// Resolves a GPU-instance handle to (GPU, GI position).
    pub fn gi(&mut self, addr: usize) -> NvmlResult<(usize, usize)> {
        let found = match self.arena.key(addr) {
            Some(Key::Gi(uuid, serial)) => self
                .gpu_by_uuid(uuid)
                .and_then(|g| self.lib.state.gpus[g].gi_position(*serial).map(|i| (g, i))),
            _ => None,
        };
        let (g, i) = found.ok_or(NvmlError::InvalidArgument)?;
        self.check_lost(g)?;
        Ok((g, i))
    }

    /// Resolves a compute-instance handle to (GPU, GI position, CI position).
    pub fn ci(&mut self, addr: usize) -> NvmlResult<(usize, usize, usize)> {
        let found = match self.arena.key(addr) {
            Some(Key::Ci(uuid, serial)) => self
                .gpu_by_uuid(uuid)
                .and_then(|g| self.find_ci_serial(g, *serial).map(|(gi, ci)| (g, gi, ci))),
            _ => None,
        };
        let (g, gi, ci) = found.ok_or(NvmlError::InvalidArgument)?;
        self.check_lost(g)?;
        Ok((g, gi, ci))
    }

    /// Handle by UUID: a GPU UUID or a MIG UUID.
    pub fn handle_by_uuid(&mut self, uuid: &str) -> NvmlResult<usize> {
        if let Some(g) = self.gpu_by_uuid(uuid) {
            return Ok(self.gpu_handle(g));
        }
        let (g, gi, ci) = self.find_mig_uuid(uuid).ok_or(NvmlError::NotFound)?;
        Ok(self.mig_handle(g, gi, ci))
    }

    /// Handle by PCI bus id (any of the accepted spellings).
    pub fn handle_by_bus_id(&mut self, bus: &str) -> NvmlResult<usize> {
        let bus = BusId::parse(bus).ok_or(NvmlError::InvalidArgument)?;
        let g = self.lib.machine.gpu_by_bus_id(&bus).ok_or(NvmlError::NotFound)?;
        Ok(self.gpu_handle(g))
    }

    fn find_mig_uuid(&self, uuid: &str) -> Option<(usize, usize, usize)> {
        if !uuid.starts_with("MIG-") {
            return None;
        }
        for (g, gpu) in self.lib.state.gpus.iter().enumerate() {
            for (i, gi) in gpu.gpu_instances.iter().enumerate() {
                for (c, ci) in gi.compute_instances.iter().enumerate() {
                    if mig_uuid(&gpu.uuid, gi.id, ci.id) == uuid {
                        return Some((g, i, c));
                    }
                }
            }
        }
        None
    }
}

// === injection files ===

impl Cx<'_> {
    /// GPU_IS_LOST if GPU `g` is listed in the `lost` file.
    pub fn check_lost(&mut self, g: usize) -> NvmlResult<()> {
        if self.is_lost(g) {
            Err(NvmlError::GpuIsLost)
        } else {
            Ok(())
        }
    }

    fn is_lost(&mut self, g: usize) -> bool {
        let uuid = &self.lib.state.gpus[g].uuid;
        match self.lib.inj.as_mut() {
            Some(inj) => inj.lost().contains(uuid),
            None => false,
        }
    }

    /// Currently running processes whose UUID matches a GPU or an existing MIG device.
    pub fn processes(&mut self) -> Vec<Proc> {
        let (lines, path) = match self.lib.inj.as_mut() {
            Some(inj) => (inj.processes().to_vec(), inj.processes_path().to_path_buf()),
            None => return Vec::new(),
        };
        let mut out = Vec::with_capacity(lines.len());
        for l in lines {
            if let Some(g) = self.gpu_by_uuid(&l.uuid) {
                out.push(Proc {
                    gpu: g,
                    mig: None,
                    pid: l.pid,
                    used_mib: l.used_mib,
                });
            } else if let Some((g, gi, ci)) = self.find_mig_uuid(&l.uuid) {
                out.push(Proc {
                    gpu: g,
                    mig: Some((gi, ci)),
                    pid: l.pid,
                    used_mib: l.used_mib,
                });
            } else {
                note(format!(
                    "{}: unknown UUID {} ignored while it matches no device",
                    path.display(),
                    l.uuid
                ));
            }
        }
        out
    }

    /// Processes visible through device `d`: all of a GPU's (MIG ones included), or only a
    /// MIG device's own.
    pub fn processes_of(&mut self, d: Dev) -> Vec<Proc> {
        self.processes()
            .into_iter()
            .filter(|p| match d {
                Dev::Gpu(g) => p.gpu == g,
                Dev::Mig { gpu, gi, ci } => p.gpu == gpu && p.mig == Some((gi, ci)),
            })
            .collect()
    }
}

// === device queries ===

impl Cx<'_> {
    /// UUID of a device.
    pub fn uuid(&self, d: Dev) -> String {
        match d {
            Dev::Gpu(g) => self.lib.state.gpus[g].uuid.clone(),
            Dev::Mig { gpu, gi, ci } => {
                let s = &self.lib.state.gpus[gpu];
                let gi = &s.gpu_instances[gi];
                mig_uuid(&s.uuid, gi.id, gi.compute_instances[ci].id)
            }
        }
    }

    /// GI profile and CI profile of a MIG device.
    fn mig_profiles(&self, gpu: usize, gi: usize, ci: usize) -> (&'static GiProfile, CiProfile) {
        let model = self.lib.spec(gpu).model;
        let gi = &self.lib.state.gpus[gpu].gpu_instances[gi];
        // Both lookups succeed: the state was built and checked against this model.
        let gp = model.gi_profile_by_id(gi.profile_id).unwrap_or(&model.gi_profiles[0]);
        let cp = ci_profile_by_index(gp, gi.compute_instances[ci].profile_index)
            .unwrap_or_else(|| crate::models::ci_profiles(gp).remove(0));
        (gp, cp)
    }

    /// `nvmlDeviceGetName`.
    pub fn name(&self, d: Dev) -> String {
        let model = self.lib.spec(d.gpu()).model;
        match d {
            Dev::Gpu(_) => model.name.to_string(),
            Dev::Mig { gpu, gi, ci } => {
                let (_, cp) = self.mig_profiles(gpu, gi, ci);
                format!("{} MIG {}", model.name, cp.name)
            }
        }
    }

    /// Memory the driver reserves on GPU `g` (`nvmlMemory_v2_t.reserved`), in bytes: the machine
    /// file's, else the model's (roughly what `nvidia-smi -q` shows as "Reserved" on R535-R550
    /// drivers). A MIG device has none: the GPU's reserve is outside every GPU instance.
    pub fn memory_reserved(&self, d: Dev) -> u64 {
        const MIB: u64 = 1024 * 1024;
        let Dev::Gpu(g) = d else { return 0 };
        let spec = self.lib.spec(g);
        let mib = spec.readings.memory_reserved_mib.unwrap_or(match spec.model.key {
            "T4" => 259,
            "A30-24GB" => 482,
            "A100-SXM4-40GB" | "A100-PCIE-40GB" => 634,
            "A100-SXM4-80GB" | "A100-PCIE-80GB" => 656,
            "RTX-PRO-6000" => 512,
            _ => 576,
        });
        mib * MIB
    }

    /// (total, used) memory in bytes.
    pub fn memory(&mut self, d: Dev) -> (u64, u64) {
        const MIB: u64 = 1024 * 1024;
        let procs = self.processes();
        match d {
            Dev::Gpu(g) => {
                let used: u64 = procs.iter().filter(|p| p.gpu == g).map(|p| p.used_mib).sum();
                (self.lib.spec(g).model.memory_mib * MIB, used * MIB)
            }
            Dev::Mig { gpu, gi, ci } => {
                let (gp, _) = self.mig_profiles(gpu, gi, ci);
                let used: u64 = procs
                    .iter()
                    .filter(|p| p.gpu == gpu && p.mig.is_some_and(|(pg, _)| pg == gi))
                    .map(|p| p.used_mib)
                    .sum();
                (gp.memory_mib * MIB, used * MIB)
            }
        }
    }

    /// `nvmlPciInfo_t` of GPU `g`.
    pub fn pci_info(&self, g: usize) -> nvmlPciInfo_t {
        let spec = self.lib.spec(g);
        let mut info = pci_for_bus(&spec.bus_id);
        info.pciDeviceId = (u32::from(spec.model.pci_device_id) << 16) | 0x10DE;
        info.pciSubSystemId = spec.pci_subsystem_id;
        info
    }

    /// `nvmlDeviceGetAttributes_v2`.
    pub fn attributes(&self, d: Dev) -> nvmlDeviceAttributes_t {
        let model = self.lib.spec(d.gpu()).model;
        match d {
            Dev::Gpu(_) => {
                let slices = model.mig.compute_slices;
                nvmlDeviceAttributes_t {
                    multiprocessorCount: model.sm_count,
                    sharedCopyEngineCount: model.engines.ce,
                    sharedDecoderCount: model.engines.dec,
                    sharedEncoderCount: model.engines.enc,
                    sharedJpegCount: model.engines.jpeg,
                    sharedOfaCount: model.engines.ofa,
                    gpuInstanceSliceCount: slices,
                    computeInstanceSliceCount: slices,
                    memorySizeMB: model.memory_mib,
                }
            }
            Dev::Mig { gpu, gi, ci } => {
                let (gp, cp) = self.mig_profiles(gpu, gi, ci);
                nvmlDeviceAttributes_t {
                    multiprocessorCount: cp.sm,
                    sharedCopyEngineCount: gp.engines.ce,
                    sharedDecoderCount: gp.engines.dec,
                    sharedEncoderCount: gp.engines.enc,
                    sharedJpegCount: gp.engines.jpeg,
                    sharedOfaCount: gp.engines.ofa,
                    gpuInstanceSliceCount: gp.slices,
                    computeInstanceSliceCount: cp.slices,
                    memorySizeMB: gp.memory_mib,
                }
            }
        }
    }

    /// Number of compute processes on GPU `g` (itself and its MIG devices), the load the
    /// default readings follow.
    fn busy(&mut self, g: usize) -> u32 {
        self.processes_of(Dev::Gpu(g)).len() as u32
    }

    /// GPU temperature in °C: the machine file's, else 33 + index (mod 8) plus 12 per process
    /// (up to 3).
    pub fn temperature(&mut self, g: usize) -> u32 {
        if let Some(t) = self.lib.spec(g).readings.temperature {
            return t;
        }
        33 + g as u32 % 8 + 12 * self.busy(g).min(3)
    }

    /// HBM temperature in °C: the machine file's, else 4 °C above the GPU; `None` (NOT_SUPPORTED)
    /// on a model without HBM unless the machine file sets it.
    pub fn memory_temperature(&mut self, g: usize) -> Option<u32> {
        let spec = self.lib.spec(g);
        if let Some(t) = spec.readings.memory_temperature {
            return Some(t);
        }
        if !spec.model.hbm {
            return None;
        }
        Some(self.temperature(g) + 4)
    }

    /// Power draw in milliwatts: the machine file's, else idle plus 25 W per running process,
    /// capped.
    pub fn power_mw(&mut self, g: usize) -> u32 {
        if let Some(mw) = self.lib.spec(g).readings.power_mw {
            return mw;
        }
        let n = self.busy(g);
        (self.lib.spec(g).model.idle_power_mw + 25_000 * n).min(400_000)
    }

    /// Total energy in millijoules: the machine file's (fixed), else growing with the power
    /// draw since the process loaded the library (monotonic).
    pub fn energy_mj(&mut self, g: usize) -> u64 {
        if let Some(mj) = self.lib.spec(g).readings.energy_mj {
            return mj;
        }
        let ms = START.elapsed().as_millis() as u64;
        let mw = u64::from(self.power_mw(g));
        1_000_000 * (g as u64 + 1) + mw * ms / 1000
    }

    /// (gpu %, memory %) utilization: the machine file's, else 30 % per process and memory =
    /// used / total.
    pub fn utilization(&mut self, g: usize) -> (u32, u32) {
        let fixed = &self.lib.spec(g).readings;
        let (fixed_gpu, fixed_mem) = (fixed.gpu_utilization, fixed.memory_utilization);
        let n = self.busy(g);
        let (total, used) = self.memory(Dev::Gpu(g));
        let mem = (used * 100).checked_div(total).unwrap_or(0) as u32;
        (
            fixed_gpu.unwrap_or((30 * n).min(100)),
            fixed_mem.unwrap_or(mem.min(100)),
        )
    }

    /// `nvmlDeviceGetClockInfo` in MHz for clock type 0 (graphics), 1 (SM), 2 (memory) or 3
    /// (video): the machine file's, else the model's idle SM clock with no process and its boost
    /// clock with one; `None` for an unknown type.
    pub fn clock_mhz(&mut self, g: usize, clock: u32) -> Option<u32> {
        let fixed = self.lib.spec(g).readings.clone();
        let model = self.lib.spec(g).model;
        let sm = match fixed.sm_clock_mhz {
            Some(mhz) => mhz,
            None if self.busy(g) > 0 => model.sm_clock_mhz.1,
            None => model.sm_clock_mhz.0,
        };
        match clock {
            0 | 1 => Some(sm),
            2 => Some(fixed.memory_clock_mhz.unwrap_or(model.memory_clock_mhz)),
            3 => Some(sm * 9 / 10),
            _ => None,
        }
    }

    /// `nvmlDeviceGetPcieReplayCounter`: the machine file's, else 0.
    pub fn pcie_replay(&self, g: usize) -> u32 {
        self.lib.spec(g).readings.pcie_replay.unwrap_or(0)
    }

    /// ECC error count, corrected (single-bit) or uncorrected (double-bit): the machine file's,
    /// else 0. Volatile and aggregate counters answer the same.
    pub fn ecc_errors(&self, g: usize, corrected: bool) -> u64 {
        let r = &self.lib.spec(g).readings;
        if corrected { r.ecc_corrected } else { r.ecc_uncorrected }.unwrap_or(0)
    }

    /// Clock throttle reasons: the machine file's, else `GpuIdle` (0x1) with no process and none
    /// with one.
    pub fn throttle_reasons(&mut self, g: usize) -> u64 {
        if let Some(bits) = self.lib.spec(g).readings.throttle_reasons {
            return bits;
        }
        if self.busy(g) > 0 { 0 } else { 0x1 }
    }

    /// `nvmlDeviceGetPcieThroughput` in KB/s, TX (`rx` false) or RX: the machine file's, else
    /// 0 without processes and 250 MB/s per process.
    pub fn pcie_throughput_kbps(&mut self, g: usize, rx: bool) -> u32 {
        let r = &self.lib.spec(g).readings;
        let fixed = if rx { r.pcie_rx_kbps } else { r.pcie_tx_kbps };
        fixed.unwrap_or_else(|| 250_000 * self.busy(g).min(16))
    }

    /// Encoder (`decoder` false) or decoder utilization in %: the machine file's, else 0 (no
    /// process of the fake codes video).
    pub fn codec_utilization(&self, g: usize, decoder: bool) -> u32 {
        let r = &self.lib.spec(g).readings;
        if decoder {
            r.decoder_utilization
        } else {
            r.encoder_utilization
        }
        .unwrap_or(0)
    }

    /// NVLink data throughput counter (KiB, TX or RX) of link `scope`, or of all links for
    /// `u32::MAX`: `None` (NOT_SUPPORTED) on a model without NVLink, `Err` for a link the model
    /// does not have. The machine file's total is spread evenly over the links, the remainder on
    /// link 0; default 0.
    pub fn nvlink_data_kib(&self, g: usize, rx: bool, scope: u32) -> Option<NvmlResult<u64>> {
        let spec = self.lib.spec(g);
        let links = u64::from(spec.model.nvlink_links);
        if links == 0 {
            return None;
        }
        let r = &spec.readings;
        let total = if rx { r.nvlink_data_rx_kib } else { r.nvlink_data_tx_kib }.unwrap_or(0);
        Some(match scope {
            u32::MAX => Ok(total),
            0 => Ok(total / links + total % links),
            s if u64::from(s) < links => Ok(total / links),
            _ => Err(NvmlError::InvalidArgument),
        })
    }

    /// `nvmlDeviceGetRemappedRows` (correctable, uncorrectable, pending, failure): `None`
    /// (NOT_SUPPORTED) before Ampere, whose GPUs retire pages instead of remapping rows.
    pub fn remapped_rows(&self, g: usize) -> Option<(u32, u32, bool, bool)> {
        let spec = self.lib.spec(g);
        if spec.model.architecture < nvml_wrapper_sys::bindings::NVML_DEVICE_ARCH_AMPERE {
            return None;
        }
        let r = &spec.readings;
        Some((
            r.remapped_rows_correctable.unwrap_or(0),
            r.remapped_rows_uncorrectable.unwrap_or(0),
            r.row_remap_pending.unwrap_or(false),
            r.row_remap_failure.unwrap_or(false),
        ))
    }

    /// Whether the vGPU guest on GPU `g` holds a license; `None` on bare metal (no vGPU).
    pub fn vgpu_licensed(&self, g: usize) -> Option<bool> {
        self.lib.spec(g).readings.vgpu_licensed
    }

    /// Whether GPU `g` is in MIG mode now (NVML then answers utilization NOT_SUPPORTED).
    pub fn mig_enabled(&self, g: usize) -> bool {
        self.lib.state.gpus[g].mig_current
    }

    /// `nvmlDeviceGetTopologyCommonAncestor` level between two GPUs.
    pub fn topology(&self, a: usize, b: usize) -> u32 {
        if a == b {
            0
        } else {
            crate::machine::common_ancestor(self.lib.spec(a), self.lib.spec(b))
        }
    }

    /// The PCI info of the remote end of NVLink `link` of GPU `g`.
    pub fn nvlink_remote(&self, g: usize, link: usize) -> Option<nvmlPciInfo_t> {
        let peer = *self.lib.spec(g).nvlink_peers.get(link)?;
        if let Some(p) = self.lib.machine.gpu_by_bus_id(&peer) {
            return Some(self.pci_info(p));
        }
        let mut info = pci_for_bus(&peer);
        if let Some(switch) = self.lib.machine.nvswitch_by_bus_id(&peer) {
            info.pciDeviceId = (u32::from(switch.pci_device_id) << 16) | 0x10DE;
        }
        Some(info)
    }

    /// Event types GPU `g` supports.
    pub fn supported_events(&self, g: usize) -> u64 {
        let base = EVENT_SBE | EVENT_DBE | EVENT_XID;
        if self.lib.spec(g).model.has_mig() {
            base | EVENT_MIG_CONFIG
        } else {
            base
        }
    }
}

/// A `nvmlPciInfo_t` with only the address fields filled.
fn pci_for_bus(bus: &BusId) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: bus.domain,
        bus: u32::from(bus.bus),
        device: u32::from(bus.device),
        pciDeviceId: 0,
        pciSubSystemId: 0,
        busId: [0; 32],
    };
    fill_chars(&mut info.busIdLegacy, &bus.legacy());
    fill_chars(&mut info.busId, &bus.to_string());
    info
}

/// Copies `s` into a C char array, NUL-terminated and truncated to fit.
pub fn fill_chars(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    for d in dst.iter_mut().skip(n) {
        *d = 0;
    }
}

// === MIG ===

impl Cx<'_> {
    fn mig_model(&self, g: usize) -> NvmlResult<&'static crate::models::GpuModel> {
        let model = self.lib.spec(g).model;
        if model.has_mig() {
            Ok(model)
        } else {
            Err(NvmlError::NotSupported)
        }
    }

    /// NOT_SUPPORTED unless the model has MIG and MIG is currently enabled.
    fn mig_enabled_model(&self, g: usize) -> NvmlResult<&'static crate::models::GpuModel> {
        let model = self.mig_model(g)?;
        if self.lib.state.gpus[g].mig_current {
            Ok(model)
        } else {
            Err(NvmlError::NotSupported)
        }
    }

    /// Performs the GPU resets asked for in the `reset` injection file (lines `<uuid>`, what
    /// `nvidia-smi --gpu-reset` does): for a GPU with no processes, the pending MIG mode becomes
    /// current and its GPU and compute instances are gone. The file is emptied once read.
    pub fn apply_resets(&mut self) {
        let Some(dir) = self.lib.state_dir.clone() else { return };
        let path = dir.join("reset");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        if text.trim().is_empty() {
            return;
        }
        let _ = std::fs::write(&path, "");
        for uuid in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some(g) = self.lib.state.gpus.iter().position(|s| s.uuid == uuid) else {
                eprintln!("fake-nvml: {}: no GPU {uuid} to reset", path.display());
                continue;
            };
            if !self.processes_of(Dev::Gpu(g)).is_empty() {
                eprintln!("fake-nvml: reset of {uuid} refused: processes are running");
                continue;
            }
            let s = &mut self.lib.state.gpus[g];
            s.mig_current = s.mig_pending;
            s.gpu_instances.clear();
        }
        self.lib.save();
    }

    /// (current, pending) MIG mode.
    pub fn mig_mode(&self, g: usize) -> NvmlResult<(u32, u32)> {
        self.mig_model(g)?;
        let s = &self.lib.state.gpus[g];
        Ok((u32::from(s.mig_current), u32::from(s.mig_pending)))
    }

    /// `nvmlDeviceGetComputeMode`.
    pub fn compute_mode(&self, g: usize) -> u32 {
        self.lib.state.gpus[g].compute_mode
    }

    /// `nvmlDeviceSetComputeMode`: DEFAULT (0), PROHIBITED (2) or EXCLUSIVE_PROCESS (3), kept
    /// in the state file; the removed EXCLUSIVE_THREAD (1) and unknown values are
    /// INVALID_ARGUMENT, as the real library answers.
    pub fn set_compute_mode(&mut self, g: usize, mode: u32) -> NvmlResult<()> {
        if !matches!(mode, 0 | 2 | 3) {
            return Err(NvmlError::InvalidArgument);
        }
        self.lib.state.gpus[g].compute_mode = mode;
        self.lib.save();
        Ok(())
    }

    /// `nvmlDeviceSetMigMode`; returns the activation status.
    ///
    /// - mode already current: pending := mode, SUCCESS;
    /// - processes on the GPU: pending := mode, current unchanged, IN_USE;
    /// - disabling while GPU instances exist: nothing changes, IN_USE;
    /// - otherwise current := pending := mode, SUCCESS.
    pub fn set_mig_mode(&mut self, g: usize, mode: u32) -> NvmlResult<NvmlResult<()>> {
        self.mig_model(g)?;
        let enable = match mode {
            0 => false,
            1 => true,
            _ => return Err(NvmlError::InvalidArgument),
        };
        let busy = !self.processes_of(Dev::Gpu(g)).is_empty();
        let reset_required = self.lib.machine.gpus[g].mig_reset_required;
        let s = &mut self.lib.state.gpus[g];
        let status = if s.mig_current == enable {
            s.mig_pending = enable;
            Ok(())
        } else if busy {
            s.mig_pending = enable;
            Err(NvmlError::InUse)
        } else if !enable && !s.gpu_instances.is_empty() {
            Err(NvmlError::InUse)
        } else if reset_required {
            s.mig_pending = enable;
            Err(NvmlError::ResetRequired)
        } else {
            s.mig_current = enable;
            s.mig_pending = enable;
            Ok(())
        };
        self.lib.save();
        Ok(status)
    }

    /// The MIG model of GPU `g`, when the driver lists its GPU instance profiles now:
    /// NOT_SUPPORTED on a model without MIG, and under the machine's `profiles_need_mig` (R535
    /// class) while MIG mode is not current.
    fn listed_profiles_model(&self, g: usize) -> NvmlResult<&'static crate::models::GpuModel> {
        let model = self.mig_model(g)?;
        if self.lib.machine.profiles_need_mig && !self.lib.state.gpus[g].mig_current {
            return Err(NvmlError::NotSupported);
        }
        Ok(model)
    }

    /// GPU-instance profile by NVML index. INVALID_ARGUMENT at or past the newest header's
    /// COUNT ([`GI_PROFILE_INDEX_COUNT`]), NOT_SUPPORTED for an index below it the model lacks
    /// (or a non-MIG model), and for every index under `profiles_need_mig` while MIG mode is
    /// not current.
    pub fn gi_profile_by_index(&self, g: usize, index: u32) -> NvmlResult<&'static GiProfile> {
        let model = self.listed_profiles_model(g)?;
        if index >= GI_PROFILE_INDEX_COUNT {
            return Err(NvmlError::InvalidArgument);
        }
        model.gi_profile_by_index(index).ok_or(NvmlError::NotSupported)
    }

    /// GPU-instance profile by hardware id (INVALID_ARGUMENT when unknown; NOT_SUPPORTED as
    /// [`Cx::gi_profile_by_index`] under `profiles_need_mig`).
    pub fn gi_profile_by_id(&self, g: usize, id: u32) -> NvmlResult<&'static GiProfile> {
        self.listed_profiles_model(g)?
            .gi_profile_by_id(id)
            .ok_or(NvmlError::InvalidArgument)
    }

    /// Profile of an existing GPU instance.
    pub fn gi_profile_of(&self, g: usize, gi: usize) -> &'static GiProfile {
        let model = self.lib.spec(g).model;
        let id = self.lib.state.gpus[g].gpu_instances[gi].profile_id;
        model.gi_profile_by_id(id).unwrap_or(&model.gi_profiles[0])
    }

    /// `nvmlDeviceGetGpuInstanceRemainingCapacity`.
    pub fn gi_remaining(&self, g: usize, profile_id: u32) -> NvmlResult<u32> {
        let model = self.mig_enabled_model(g)?;
        let p = model.gi_profile_by_id(profile_id).ok_or(NvmlError::InvalidArgument)?;
        Ok(self.lib.state.gpus[g].gi_remaining(model, p))
    }

    /// Creates a GPU instance; returns its handle.
    pub fn create_gi(
        &mut self,
        g: usize,
        profile_id: u32,
        placement: Option<nvmlGpuInstancePlacement_t>,
    ) -> NvmlResult<usize> {
        let model = self.mig_enabled_model(g)?;
        let p = model.gi_profile_by_id(profile_id).ok_or(NvmlError::InvalidArgument)?;
        let start = match placement {
            Some(pl) if pl.size != p.mem_size => return Err(NvmlError::InvalidArgument),
            Some(pl) => Some(pl.start),
            None => None,
        };
        let serial = self.lib.state.take_serial();
        let at = self.lib.state.gpus[g].create_gi(model, profile_id, start, serial)?;
        self.lib.save();
        Ok(self.gi_handle(g, at))
    }

    /// GPU instances of a profile, by id.
    pub fn gi_list(&mut self, g: usize, profile_id: u32) -> NvmlResult<Vec<usize>> {
        let model = self.mig_enabled_model(g)?;
        model.gi_profile_by_id(profile_id).ok_or(NvmlError::InvalidArgument)?;
        let positions: Vec<usize> = self.lib.state.gpus[g]
            .gpu_instances
            .iter()
            .enumerate()
            .filter(|(_, gi)| gi.profile_id == profile_id)
            .map(|(i, _)| i)
            .collect();
        Ok(positions.into_iter().map(|i| self.gi_handle(g, i)).collect())
    }

    /// GPU instance by id.
    pub fn gi_by_id(&mut self, g: usize, id: u32) -> NvmlResult<usize> {
        self.mig_enabled_model(g)?;
        let at = self.lib.state.gpus[g]
            .gpu_instances
            .iter()
            .position(|gi| gi.id == id)
            .ok_or(NvmlError::NotFound)?;
        Ok(self.gi_handle(g, at))
    }

    /// Destroys a GPU instance (IN_USE with compute instances or processes).
    pub fn destroy_gi(&mut self, g: usize, gi: usize) -> NvmlResult<()> {
        if self
            .processes()
            .iter()
            .any(|p| p.gpu == g && p.mig.is_some_and(|(pg, _)| pg == gi))
        {
            return Err(NvmlError::InUse);
        }
        let serial = self.lib.state.gpus[g].gpu_instances[gi].serial;
        self.lib.state.gpus[g].destroy_gi(serial)?;
        self.lib.save();
        Ok(())
    }

    /// Compute-instance profile by NVML index inside a GI.
    pub fn ci_profile(&self, g: usize, gi: usize, index: u32, engine: u32) -> NvmlResult<CiProfile> {
        if engine != 0 || index >= 9 {
            return Err(NvmlError::InvalidArgument);
        }
        ci_profile_by_index(self.gi_profile_of(g, gi), index).ok_or(NvmlError::NotSupported)
    }

    fn ci_profile_for_id(&self, g: usize, gi: usize, id: u32) -> NvmlResult<CiProfile> {
        ci_profile_by_index(self.gi_profile_of(g, gi), id).ok_or(NvmlError::InvalidArgument)
    }

    /// Valid placements of a CI profile inside a GI.
    pub fn ci_placements(&self, g: usize, gi: usize, id: u32) -> NvmlResult<Vec<(u32, u32)>> {
        let p = self.ci_profile_for_id(g, gi, id)?;
        Ok(p.starts.iter().map(|&s| (s, p.slices)).collect())
    }

    /// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`.
    pub fn ci_remaining(&self, g: usize, gi: usize, id: u32) -> NvmlResult<u32> {
        self.ci_profile_for_id(g, gi, id)?;
        Ok(self.lib.state.gpus[g].gpu_instances[gi].ci_remaining(self.gi_profile_of(g, gi), id))
    }

    /// Creates a compute instance; returns its handle.
    pub fn create_ci(&mut self, g: usize, gi: usize, id: u32, placement: Option<(u32, u32)>) -> NvmlResult<usize> {
        self.mig_enabled_model(g)?;
        let p = self.ci_profile_for_id(g, gi, id)?;
        let start = match placement {
            Some((_, size)) if size != p.slices => return Err(NvmlError::InvalidArgument),
            Some((start, _)) => Some(start),
            None => None,
        };
        let gp = self.gi_profile_of(g, gi);
        let serial = self.lib.state.take_serial();
        let at = self.lib.state.gpus[g].gpu_instances[gi].create_ci(gp, id, start, serial)?;
        self.lib.save();
        Ok(self.ci_handle(g, gi, at))
    }

    /// Compute instances of a profile in a GI.
    pub fn ci_list(&mut self, g: usize, gi: usize, id: u32) -> NvmlResult<Vec<usize>> {
        self.ci_profile_for_id(g, gi, id)?;
        let positions: Vec<usize> = self.lib.state.gpus[g].gpu_instances[gi]
            .compute_instances
            .iter()
            .enumerate()
            .filter(|(_, c)| c.profile_index == id)
            .map(|(i, _)| i)
            .collect();
        Ok(positions.into_iter().map(|c| self.ci_handle(g, gi, c)).collect())
    }

    /// Compute instance by id.
    pub fn ci_by_id(&mut self, g: usize, gi: usize, id: u32) -> NvmlResult<usize> {
        let at = self.lib.state.gpus[g].gpu_instances[gi]
            .compute_instances
            .iter()
            .position(|c| c.id == id)
            .ok_or(NvmlError::NotFound)?;
        Ok(self.ci_handle(g, gi, at))
    }

    /// Destroys a compute instance (IN_USE with processes).
    pub fn destroy_ci(&mut self, g: usize, gi: usize, ci: usize) -> NvmlResult<()> {
        if self.processes().iter().any(|p| p.gpu == g && p.mig == Some((gi, ci))) {
            return Err(NvmlError::InUse);
        }
        self.lib.state.gpus[g].gpu_instances[gi].compute_instances.remove(ci);
        self.lib.save();
        Ok(())
    }

    /// `nvmlDeviceGetMaxMigDeviceCount`: the model's slot count (7, or 4 on A30) with MIG
    /// enabled, else 0.
    pub fn max_mig_devices(&self, g: usize) -> u32 {
        let model = self.lib.spec(g).model;
        if model.has_mig() && self.lib.state.gpus[g].mig_current {
            model.mig.max_mig_devices
        } else {
            0
        }
    }

    /// `nvmlDeviceGetMigDeviceHandleByIndex` (sparse slots, see `GpuState::mig_slots`).
    pub fn mig_by_slot(&mut self, g: usize, slot: u32) -> NvmlResult<usize> {
        let model = self.mig_enabled_model(g)?;
        if slot >= model.mig.max_mig_devices {
            return Err(NvmlError::InvalidArgument);
        }
        let (_, gi, ci) = self.lib.state.gpus[g]
            .mig_slots()
            .into_iter()
            .find(|s| s.0 == slot)
            .ok_or(NvmlError::NotFound)?;
        Ok(self.mig_handle(g, gi, ci))
    }

    /// (GI id, CI id) of a MIG device.
    pub fn mig_ids(&self, gpu: usize, gi: usize, ci: usize) -> (u32, u32) {
        let gi = &self.lib.state.gpus[gpu].gpu_instances[gi];
        (gi.id, gi.compute_instances[ci].id)
    }
}

// === events ===

/// One event ready for `nvmlEventSetWait`.
pub struct Event {
    /// Parent GPU handle.
    pub device: usize,
    /// `nvmlEventType*` bit.
    pub event_type: u64,
    /// Xid number.
    pub data: u64,
    /// GI id or [`NO_ID`].
    pub gi: u32,
    /// CI id or [`NO_ID`].
    pub ci: u32,
}

impl Event {
    /// As the C struct (the device pointer is the handle address).
    pub fn to_c(&self) -> nvmlEventData_t {
        nvmlEventData_t {
            device: self.device as _,
            eventType: self.event_type,
            eventData: self.data,
            gpuInstanceId: self.gi,
            computeInstanceId: self.ci,
        }
    }
}

impl Cx<'_> {
    /// `nvmlEventSetCreate`.
    pub fn create_set(&mut self) -> usize {
        self.arena.sets_made += 1;
        let n = self.arena.sets_made;
        let addr = self.arena.addr(Key::Set(n));
        let cursor = self.lib.inj.as_ref().map_or(0, |i| i.xid.current_len());
        let generation = self.lib.inj.as_ref().map_or(0, |i| i.xid.generation);
        self.sets.insert(
            addr,
            EventSet {
                cursor,
                generation,
                ..EventSet::default()
            },
        );
        addr
    }

    /// `nvmlEventSetFree`.
    pub fn free_set(&mut self, addr: usize) -> NvmlResult<()> {
        self.sets.remove(&addr).map(|_| ()).ok_or(NvmlError::InvalidArgument)
    }

    /// `nvmlDeviceRegisterEvents` for GPU `g`.
    pub fn register(&mut self, g: usize, types: u64, set: usize) -> NvmlResult<()> {
        if !self.sets.contains_key(&set) {
            return Err(NvmlError::InvalidArgument);
        }
        if types & !self.supported_events(g) != 0 {
            return Err(NvmlError::NotSupported);
        }
        if types == 0 {
            return Ok(());
        }
        let uuid = self.lib.state.gpus[g].uuid.clone();
        let from = self.lib.inj.as_ref().map_or(0, |i| i.xid.current_len());
        let set = self.sets.get_mut(&set).ok_or(NvmlError::InvalidArgument)?;
        set.regs
            .entry(uuid)
            .and_modify(|r| r.mask |= types)
            .or_insert(Registration {
                mask: types,
                xid_from: from,
            });
        Ok(())
    }

    /// One poll of an event set: a queued event, GPU_IS_LOST if a registered GPU is lost
    /// (after queued events are drained), or `None`.
    pub fn poll_set(&mut self, addr: usize) -> NvmlResult<Option<Event>> {
        if !self.sets.contains_key(&addr) {
            return Err(NvmlError::InvalidArgument);
        }
        self.pump_xid(addr);
        let next = self.sets.get_mut(&addr).and_then(|s| s.queue.pop_front());
        if let Some(q) = next {
            let device = self.arena.addr(Key::Gpu(q.gpu_uuid));
            return Ok(Some(Event {
                device,
                event_type: EVENT_XID,
                data: q.xid,
                gi: q.gi,
                ci: q.ci,
            }));
        }
        let registered: Vec<String> = self
            .sets
            .get(&addr)
            .map(|s| s.regs.keys().cloned().collect())
            .unwrap_or_default();
        for uuid in registered {
            if let Some(g) = self.gpu_by_uuid(&uuid) {
                self.check_lost(g)?;
            }
        }
        Ok(None)
    }

    /// Moves new `xid` lines into the queue of the set at `addr`.
    fn pump_xid(&mut self, addr: usize) {
        let Some(inj) = self.lib.inj.as_mut() else { return };
        inj.xid.refresh();
        let (generation, consumed) = (inj.xid.generation, inj.xid.consumed());
        let path = inj.xid.path().to_path_buf();
        let lines = {
            let Some(set) = self.sets.get_mut(&addr) else { return };
            if set.generation != generation {
                set.generation = generation;
                set.cursor = 0;
                for r in set.regs.values_mut() {
                    r.xid_from = 0;
                }
            }
            let first = inj.xid.lines.partition_point(|l| l.offset < set.cursor);
            set.cursor = consumed;
            inj.xid.lines[first..].to_vec()
        };
        for line in lines {
            let target = if let Some(g) = self.gpu_by_uuid(&line.uuid) {
                Some((self.lib.state.gpus[g].uuid.clone(), NO_ID, NO_ID))
            } else if let Some((g, gi, ci)) = self.find_mig_uuid(&line.uuid) {
                let (gi_id, ci_id) = self.mig_ids(g, gi, ci);
                Some((self.lib.state.gpus[g].uuid.clone(), gi_id, ci_id))
            } else {
                note(format!(
                    "{}:{}: unknown UUID {} ignored",
                    path.display(),
                    line.line_no,
                    line.uuid
                ));
                None
            };
            let Some((gpu_uuid, gi, ci)) = target else { continue };
            let Some(set) = self.sets.get_mut(&addr) else { return };
            let wanted = set
                .regs
                .get(&gpu_uuid)
                .is_some_and(|r| r.mask & EVENT_XID != 0 && line.offset >= r.xid_from);
            if wanted {
                set.queue.push_back(Queued {
                    gpu_uuid,
                    xid: line.xid,
                    gi,
                    ci,
                });
            }
        }
    }
}
