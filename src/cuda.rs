//! The CUDA check of the validation stage: load `libcuda.so.1` from the driver root, initialise
//! the driver API, and on every GPU allocate memory, run a tiny kernel (JIT-compiled from PTX)
//! and read its result back. It runs in a child process (`gpu-node-agent validate cuda`) so a
//! crash or hang in the driver cannot take the agent down and libcuda's memory does not stay in
//! the daemon.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where libcuda is looked for under the driver root, in order.
pub const LIBCUDA_CANDIDATES: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/lib/libcuda.so.1",
];

/// Threads of the check kernel; each writes `2 × its index`.
const THREADS: usize = 64;

/// The check kernel: `out[i] = 2 * i` for `i = threadIdx.x`. PTX ISA 6.0, `sm_50`: every GPU a
/// current driver supports can JIT it.
const PTX: &str = "\
.version 6.0
.target sm_50
.address_size 64
.visible .entry fill(.param .u64 out)
{
  .reg .b32 %r<3>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  shl.b32 %r2, %r1, 1;
  mul.wide.u32 %rd3, %r1, 4;
  add.s64 %rd2, %rd2, %rd3;
  st.global.u32 [%rd2], %r2;
  ret;
}
\0";

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "kebab-case")]
pub enum CudaCheck {
    /// No libcuda under the driver root: nothing to check (not a failure).
    NotAvailable { reason: String },
    /// Every GPU ran the kernel and gave the right result.
    Passed {
        driver_api: String,
        /// Every device CUDA enumerated, in ordinal order.
        gpus: CudaGpus,
    },
    Failed {
        /// What failed (`reason` in the JSON) and on which devices.
        #[serde(flatten)]
        reason: CudaFailure,
    },
}

/// One device as CUDA enumerates it. CUDA's ordinals follow `CUDA_DEVICE_ORDER` (fastest first
/// by default), not NVML's indices: the PCI bus id is what names the GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaDevice {
    pub ordinal: i32,
    /// `cuDeviceGetName`; empty when it failed.
    pub name: String,
    /// `cuDeviceGetPCIBusId` in sysfs form (`0000:07:00.0`); `None` when libcuda did not say.
    pub pci_bus_id: Option<String>,
}

impl CudaDevice {
    fn model(&self) -> &str {
        if self.name.is_empty() {
            "unknown model"
        } else {
            &self.name
        }
    }

    fn bus_id(&self) -> &str {
        self.pci_bus_id.as_deref().unwrap_or("bus id unknown")
    }
}

impl std::fmt::Display for CudaDevice {
    /// `CUDA device 0 (NVIDIA A100-SXM4-40GB, PCI 0000:07:00.0)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CUDA device {} ({}, PCI {})",
            self.ordinal,
            self.model(),
            self.bus_id()
        )
    }
}

/// The devices CUDA enumerated, in ordinal order (a slice by `Deref`; `join` gives the line
/// `validate cuda` prints).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CudaGpus(pub Vec<CudaDevice>);

impl CudaGpus {
    /// One line: each device as `0: NVIDIA A100-SXM4-40GB (0000:07:00.0)`, joined by `sep`.
    pub fn join(&self, sep: &str) -> String {
        self.0
            .iter()
            .map(|d| format!("{}: {} ({})", d.ordinal, d.model(), d.bus_id()))
            .collect::<Vec<_>>()
            .join(sep)
    }
}

impl std::ops::Deref for CudaGpus {
    type Target = [CudaDevice];
    fn deref(&self) -> &[CudaDevice] {
        &self.0
    }
}

/// Why the check failed: one line for a person (`Display`), and the devices that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaFailure {
    #[serde(rename = "reason")]
    pub message: String,
    /// The devices that failed, each with its error; empty when CUDA failed before any device
    /// (`cuInit`, no device).
    #[serde(default)]
    pub devices: Vec<DeviceFailure>,
}

impl CudaFailure {
    fn new(message: impl Into<String>) -> CudaFailure {
        CudaFailure {
            message: message.into(),
            devices: Vec::new(),
        }
    }
}

impl std::fmt::Display for CudaFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// One device that failed the check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceFailure {
    #[serde(flatten)]
    pub device: CudaDevice,
    pub error: String,
}

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuDevicePtr = u64;

/// The driver API entry points the check uses.
struct Api {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut CuContext, c_uint, CuDevice) -> CuResult,
    ctx_destroy: unsafe extern "C" fn(CuContext) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    launch_kernel: unsafe extern "C" fn(
        CuFunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

impl Api {
    /// # Safety
    /// `path` must be a CUDA driver library: its symbols are called with the driver API's
    /// documented signatures.
    unsafe fn load(path: &Path) -> Result<Api, String> {
        // SAFETY: loading runs the library's initialisers; it is NVIDIA's libcuda (the caller's
        // contract).
        let lib =
            unsafe { libloading::Library::new(path) }.map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the driver API's signature for this symbol (see the field's type).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: no {}: {e}", path.display(), $name))?
            };
        }
        Ok(Api {
            init: sym!("cuInit"),
            driver_get_version: sym!("cuDriverGetVersion"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            device_get_name: sym!("cuDeviceGetName"),
            device_get_pci_bus_id: sym!("cuDeviceGetPCIBusId"),
            ctx_create: sym!("cuCtxCreate_v2"),
            ctx_destroy: sym!("cuCtxDestroy_v2"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            module_load_data: sym!("cuModuleLoadData"),
            module_get_function: sym!("cuModuleGetFunction"),
            launch_kernel: sym!("cuLaunchKernel"),
            ctx_synchronize: sym!("cuCtxSynchronize"),
            get_error_string: sym!("cuGetErrorString"),
            _lib: lib,
        })
    }

    fn check(&self, what: &str, rc: CuResult) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: out-param; the string is static in libcuda when set.
        let name = if unsafe { (self.get_error_string)(rc, &mut text) } == 0 && !text.is_null() {
            // SAFETY: NUL-terminated static string from the driver.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        } else {
            "unknown error".into()
        };
        Err(format!("{what}: CUDA error {rc} ({name})"))
    }
}

/// The first libcuda under the driver root (`root` is the agent's `--root`).
pub fn find_libcuda(root: &Path, driver_root: &Path) -> Option<PathBuf> {
    let base = crate::host::rooted(root, driver_root);
    LIBCUDA_CANDIDATES
        .iter()
        .map(|c| crate::host::rooted(&base, Path::new(c)))
        .find(|p| p.exists())
}

/// Runs the check in this process (the child of `validate cuda`).
pub fn check(root: &Path, driver_root: &Path) -> CudaCheck {
    let Some(lib) = find_libcuda(root, driver_root) else {
        return CudaCheck::NotAvailable {
            reason: format!("no libcuda.so.1 under the driver root {}", driver_root.display()),
        };
    };
    // SAFETY: a file named libcuda.so.1 where the driver installs it.
    let api = match unsafe { Api::load(&lib) } {
        Ok(api) => api,
        Err(reason) => {
            return CudaCheck::Failed {
                reason: CudaFailure::new(reason),
            };
        }
    };
    match run(&api) {
        Ok((driver_api, gpus)) => CudaCheck::Passed {
            driver_api,
            gpus: CudaGpus(gpus),
        },
        Err(reason) => CudaCheck::Failed { reason },
    }
}

/// Every device is checked, also after one failed: the failure names each device that failed.
fn run(api: &Api) -> Result<(String, Vec<CudaDevice>), CudaFailure> {
    // SAFETY (all calls below): the driver API with valid out-params and handles it returned.
    unsafe {
        api.check("cuInit", (api.init)(0)).map_err(CudaFailure::new)?;
        let mut version = 0;
        api.check("cuDriverGetVersion", (api.driver_get_version)(&mut version))
            .map_err(CudaFailure::new)?;
        let mut count = 0;
        api.check("cuDeviceGetCount", (api.device_get_count)(&mut count))
            .map_err(CudaFailure::new)?;
        if count == 0 {
            return Err(CudaFailure::new("CUDA sees no device"));
        }
        let mut devices = Vec::new();
        let mut failed = Vec::new();
        for ordinal in 0..count {
            let mut info = CudaDevice {
                ordinal,
                name: String::new(),
                pci_bus_id: None,
            };
            match check_device(api, ordinal, &mut info) {
                Ok(()) => devices.push(info),
                Err(error) => failed.push(DeviceFailure { device: info, error }),
            }
        }
        if !failed.is_empty() {
            let message = failed
                .iter()
                .map(|f| format!("{}: {}", f.device, f.error))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(CudaFailure {
                message,
                devices: failed,
            });
        }
        Ok((format!("{}.{}", version / 1000, (version % 1000) / 10), devices))
    }
}

/// Identifies the device at `ordinal` (into `info`, also when the check fails), then runs the
/// kernel on it in a context of its own.
///
/// # Safety
/// `api` is libcuda, initialised.
unsafe fn check_device(api: &Api, ordinal: c_int, info: &mut CudaDevice) -> Result<(), String> {
    // SAFETY: the driver API with valid out-params and the handles it returned.
    unsafe {
        let mut device = 0;
        api.check("cuDeviceGet", (api.device_get)(&mut device, ordinal))?;
        let mut name = [0 as c_char; 128];
        if (api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, device) == 0 {
            info.name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        }
        // `0000:07:00.0` (13 bytes with the NUL); room for a longer domain.
        let mut bus = [0 as c_char; 64];
        if (api.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, device) == 0 {
            let bus = CStr::from_ptr(bus.as_ptr()).to_string_lossy();
            if !bus.trim().is_empty() {
                info.pci_bus_id = Some(crate::nvml::normalise_bus_id(&bus));
            }
        }
        let mut ctx: CuContext = std::ptr::null_mut();
        api.check("cuCtxCreate", (api.ctx_create)(&mut ctx, 0, device))?;
        let result = kernel_roundtrip(api);
        let destroyed = api.check("cuCtxDestroy", (api.ctx_destroy)(ctx));
        result?;
        destroyed
    }
}

/// In the current context: allocate, launch the kernel, copy back, compare, free.
unsafe fn kernel_roundtrip(api: &Api) -> Result<(), String> {
    let bytes = THREADS * std::mem::size_of::<u32>();
    // SAFETY: driver API calls on the current context with valid pointers.
    unsafe {
        let mut module: CuModule = std::ptr::null_mut();
        api.check(
            "cuModuleLoadData (JIT of the check kernel)",
            (api.module_load_data)(&mut module, PTX.as_ptr().cast()),
        )?;
        let mut function: CuFunction = std::ptr::null_mut();
        api.check(
            "cuModuleGetFunction",
            (api.module_get_function)(&mut function, module, c"fill".as_ptr()),
        )?;
        let mut out: CuDevicePtr = 0;
        api.check("cuMemAlloc", (api.mem_alloc)(&mut out, bytes))?;
        let mut arg: *mut c_void = (&mut out as *mut CuDevicePtr).cast();
        let launched = api.check(
            "cuLaunchKernel",
            (api.launch_kernel)(
                function,
                1,
                1,
                1,
                THREADS as c_uint,
                1,
                1,
                0,
                std::ptr::null_mut(),
                &mut arg,
                std::ptr::null_mut(),
            ),
        );
        let synced = launched.and_then(|()| api.check("cuCtxSynchronize", (api.ctx_synchronize)()));
        let mut host = vec![0u32; THREADS];
        let copied =
            synced.and_then(|()| api.check("cuMemcpyDtoH", (api.memcpy_dtoh)(host.as_mut_ptr().cast(), out, bytes)));
        let freed = api.check("cuMemFree", (api.mem_free)(out));
        copied?;
        freed?;
        if let Some(i) = (0..THREADS).find(|&i| host[i] != 2 * i as u32) {
            return Err(format!("the check kernel wrote {} at {i}, expected {}", host[i], 2 * i));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_libcuda_is_not_available_not_a_failure() {
        let root = tempfile::tempdir().unwrap();
        match check(root.path(), Path::new("/")) {
            CudaCheck::NotAvailable { reason } => assert!(reason.contains("no libcuda.so.1"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_library_that_is_not_libcuda_fails_cleanly() {
        let root = tempfile::tempdir().unwrap();
        let lib = root.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
        std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
        std::fs::write(&lib, b"not an ELF file").unwrap();
        match check(root.path(), Path::new("/")) {
            CudaCheck::Failed { reason } => assert!(reason.message.contains("cannot load"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_json_names_each_device_and_keeps_reason_a_line() {
        let device = CudaDevice {
            ordinal: 0,
            name: "NVIDIA A100-SXM4-40GB".into(),
            pci_bus_id: Some("0000:11:00.0".into()),
        };
        let failed = CudaCheck::Failed {
            reason: CudaFailure {
                message: format!("{device}: cuLaunchKernel: CUDA error 719 (unspecified launch failure)"),
                devices: vec![DeviceFailure {
                    device: device.clone(),
                    error: "cuLaunchKernel: CUDA error 719 (unspecified launch failure)".into(),
                }],
            },
        };
        let json = serde_json::to_value(&failed).unwrap();
        assert_eq!(
            json["reason"],
            "CUDA device 0 (NVIDIA A100-SXM4-40GB, PCI 0000:11:00.0): cuLaunchKernel: CUDA error 719 (unspecified \
             launch failure)"
        );
        assert_eq!(json["devices"][0]["pci_bus_id"], "0000:11:00.0");
        assert_eq!(json["devices"][0]["ordinal"], 0);
        assert_eq!(serde_json::from_value::<CudaCheck>(json).unwrap(), failed);
        // A failure without devices (cuInit) reads back too.
        let plain: CudaCheck =
            serde_json::from_str(r#"{"result":"failed","reason":"cuInit: CUDA error 100"}"#).unwrap();
        assert_eq!(
            plain,
            CudaCheck::Failed {
                reason: CudaFailure::new("cuInit: CUDA error 100")
            }
        );

        let passed = CudaCheck::Passed {
            driver_api: "12.4".into(),
            gpus: CudaGpus(vec![device]),
        };
        let CudaCheck::Passed { gpus, .. } = &passed else {
            unreachable!()
        };
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus.join(", "), "0: NVIDIA A100-SXM4-40GB (0000:11:00.0)");
        let json = serde_json::to_value(&passed).unwrap();
        assert_eq!(json["gpus"][0]["pci_bus_id"], "0000:11:00.0");
        assert_eq!(serde_json::from_value::<CudaCheck>(json).unwrap(), passed);
    }

    #[test]
    fn the_ptx_is_nul_terminated_and_names_the_kernel() {
        assert!(PTX.ends_with('\0') && PTX.contains(".entry fill"));
    }
}
