//! Shared helpers for the integration tests.
//!
//! Every test loads the built `libfake_nvml.so` through the real nvml-wrapper. The library
//! keeps one global state per process and reads its configuration from environment variables
//! at `nvmlInit`, so each test holds [`Fake`]'s process-wide lock from before it sets the
//! variables until it has dropped every `Nvml` (declare the `Fake` first so it drops last).
#![allow(dead_code)]

use std::ffi::{CStr, c_uint};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_v2_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlReturn_t,
};

pub const SUCCESS: nvmlReturn_t = 0;
pub const INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NOT_FOUND: nvmlReturn_t = 6;
pub const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const TIMEOUT: nvmlReturn_t = 10;
pub const GPU_IS_LOST: nvmlReturn_t = 15;
pub const IN_USE: nvmlReturn_t = 19;
pub const INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;

static PROCESS_LOCK: Mutex<()> = Mutex::new(());

/// A test's private machine file + state dir, with the process-wide lock held.
pub struct Fake {
    pub dir: tempfile::TempDir,
    pub state: PathBuf,
    pub machine: PathBuf,
    _guard: MutexGuard<'static, ()>,
}

/// Path of the built library.
pub fn lib_path() -> PathBuf {
    fake_nvml::library_path().expect("libfake_nvml.so is built next to the test binary")
}

/// An example machine file from `fake-nvml/machines/`.
pub fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("machines").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

impl Fake {
    /// Writes `machine_toml` and points the environment at it and at a fresh state dir.
    pub fn new(machine_toml: &str) -> Fake {
        let guard = PROCESS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let machine = dir.path().join("machine.toml");
        std::fs::write(&machine, machine_toml).unwrap();
        let state = dir.path().join("state");
        let fake = Fake {
            dir,
            state,
            machine,
            _guard: guard,
        };
        fake.set_env(Some(&fake.machine), Some(&fake.state));
        fake
    }

    /// Sets or removes the two variables.
    pub fn set_env(&self, machine: Option<&Path>, state: Option<&Path>) {
        // SAFETY: every test that touches the environment holds PROCESS_LOCK, and the fake
        // library reads these variables only inside nvmlInit, which tests call under the lock.
        unsafe {
            match machine {
                Some(m) => std::env::set_var(fake_nvml::ENV_MACHINE, m),
                None => std::env::remove_var(fake_nvml::ENV_MACHINE),
            }
            match state {
                Some(s) => std::env::set_var(fake_nvml::ENV_STATE_DIR, s),
                None => std::env::remove_var(fake_nvml::ENV_STATE_DIR),
            }
        }
    }

    /// Loads the fake through nvml-wrapper.
    pub fn init(&self) -> Nvml {
        self.try_init().expect("fake NVML initializes")
    }

    pub fn try_init(&self) -> Result<Nvml, nvml_wrapper::error::NvmlError> {
        let path = lib_path();
        Nvml::builder().lib_path(path.as_os_str()).init()
    }
}

// === raw calls for what nvml-wrapper does not wrap ===

macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        $nvml
            .lib()
            .$name
            .as_ref()
            .expect(concat!(stringify!($name), " is exported"))
    };
}
// Not every test file makes raw calls.
#[allow(unused_imports)]
pub(crate) use sym;

pub fn handle(d: &Device<'_>) -> nvml_wrapper_sys::bindings::nvmlDevice_t {
    // SAFETY: the raw handle is only passed back to the same library.
    unsafe { d.handle() }
}

pub fn create_gi(nvml: &Nvml, d: &Device<'_>, profile_id: u32) -> (nvmlReturn_t, nvmlGpuInstance_t) {
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let rc = unsafe { sym!(nvml, nvmlDeviceCreateGpuInstance)(handle(d), profile_id, &mut gi) };
    (rc, gi)
}

pub fn create_gi_at(
    nvml: &Nvml,
    d: &Device<'_>,
    profile_id: u32,
    start: u32,
    size: u32,
) -> (nvmlReturn_t, nvmlGpuInstance_t) {
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let pl = nvmlGpuInstancePlacement_t { start, size };
    let rc = unsafe { sym!(nvml, nvmlDeviceCreateGpuInstanceWithPlacement)(handle(d), profile_id, &pl, &mut gi) };
    (rc, gi)
}

pub fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t) -> nvmlGpuInstanceInfo_t {
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { sym!(nvml, nvmlGpuInstanceGetInfo)(gi, &mut info) };
    assert_eq!(rc, SUCCESS);
    info
}

pub fn destroy_gi(nvml: &Nvml, gi: nvmlGpuInstance_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlGpuInstanceDestroy)(gi) }
}

pub fn create_ci(nvml: &Nvml, gi: nvmlGpuInstance_t, ci_profile: u32) -> (nvmlReturn_t, nvmlComputeInstance_t) {
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    let rc = unsafe { sym!(nvml, nvmlGpuInstanceCreateComputeInstance)(gi, ci_profile, &mut ci) };
    (rc, ci)
}

pub fn ci_info(nvml: &Nvml, ci: nvmlComputeInstance_t) -> nvmlComputeInstanceInfo_t {
    let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { sym!(nvml, nvmlComputeInstanceGetInfo_v2)(ci, &mut info) };
    assert_eq!(rc, SUCCESS);
    info
}

pub fn destroy_ci(nvml: &Nvml, ci: nvmlComputeInstance_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlComputeInstanceDestroy)(ci) }
}

/// All GPU instances of a profile.
pub fn gpu_instances(nvml: &Nvml, d: &Device<'_>, profile_id: u32) -> (nvmlReturn_t, Vec<nvmlGpuInstance_t>) {
    let mut buf = vec![std::ptr::null_mut(); 8];
    let mut count: c_uint = 0;
    let rc = unsafe { sym!(nvml, nvmlDeviceGetGpuInstances)(handle(d), profile_id, buf.as_mut_ptr(), &mut count) };
    buf.truncate(count as usize);
    (rc, buf)
}

/// GI profile info (V, version 2) by NVML profile index.
pub fn gi_profile_v(nvml: &Nvml, d: &Device<'_>, index: u32) -> (nvmlReturn_t, nvmlGpuInstanceProfileInfo_v2_t) {
    let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    info.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24);
    let rc = unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfoV)(handle(d), index, &mut info) };
    (rc, info)
}

/// CI profile info (V, version 2) by NVML CI profile index.
pub fn ci_profile_v(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    index: u32,
) -> (nvmlReturn_t, nvmlComputeInstanceProfileInfo_v2_t) {
    let mut info: nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    info.version = std::mem::size_of::<nvmlComputeInstanceProfileInfo_v2_t>() as u32 | (2 << 24);
    let rc = unsafe { sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfoV)(gi, index, 0, &mut info) };
    (rc, info)
}

/// Possible placements through the raw `_v2` symbol (the wrapper's method is buggy).
pub fn placements(nvml: &Nvml, d: &Device<'_>, profile_id: u32) -> (nvmlReturn_t, Vec<(u32, u32)>) {
    let f = sym!(nvml, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    let mut count: c_uint = 0;
    let rc = unsafe { f(handle(d), profile_id, std::ptr::null_mut(), &mut count) };
    if rc != SUCCESS {
        return (rc, Vec::new());
    }
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let rc = unsafe { f(handle(d), profile_id, buf.as_mut_ptr(), &mut count) };
    buf.truncate(count as usize);
    (rc, buf.iter().map(|p| (p.start, p.size)).collect())
}

/// A C char array as a String.
pub fn c_string(chars: &[std::ffi::c_char]) -> String {
    // SAFETY: the fake always NUL-terminates inside the array.
    unsafe { CStr::from_ptr(chars.as_ptr()) }.to_string_lossy().into_owned()
}
