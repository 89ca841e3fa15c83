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
    NotAvailable {
        reason: String,
    },
    /// Every GPU ran the kernel and gave the right result.
    Passed {
        driver_api: String,
        gpus: Vec<String>,
    },
    Failed {
        reason: String,
    },
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
        Err(reason) => return CudaCheck::Failed { reason },
    };
    match run(&api) {
        Ok((driver_api, gpus)) => CudaCheck::Passed { driver_api, gpus },
        Err(reason) => CudaCheck::Failed { reason },
    }
}

fn run(api: &Api) -> Result<(String, Vec<String>), String> {
    // SAFETY (all calls below): the driver API with valid out-params and handles it returned.
    unsafe {
        api.check("cuInit", (api.init)(0))?;
        let mut version = 0;
        api.check("cuDriverGetVersion", (api.driver_get_version)(&mut version))?;
        let mut count = 0;
        api.check("cuDeviceGetCount", (api.device_get_count)(&mut count))?;
        if count == 0 {
            return Err("CUDA sees no device".into());
        }
        let mut names = Vec::new();
        for ordinal in 0..count {
            let mut device = 0;
            api.check("cuDeviceGet", (api.device_get)(&mut device, ordinal))?;
            let mut name = [0 as c_char; 128];
            api.check("cuDeviceGetName", (api.device_get_name)(name.as_mut_ptr(), 128, device))?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut ctx: CuContext = std::ptr::null_mut();
            api.check(
                &format!("device {ordinal}: cuCtxCreate"),
                (api.ctx_create)(&mut ctx, 0, device),
            )?;
            let result = kernel_roundtrip(api);
            let destroyed = api.check("cuCtxDestroy", (api.ctx_destroy)(ctx));
            result.map_err(|e| format!("device {ordinal} ({name}): {e}"))?;
            destroyed?;
            names.push(format!("{ordinal}: {name}"));
        }
        Ok((format!("{}.{}", version / 1000, (version % 1000) / 10), names))
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
            CudaCheck::Failed { reason } => assert!(reason.contains("cannot load"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_ptx_is_nul_terminated_and_names_the_kernel() {
        assert!(PTX.ends_with('\0') && PTX.contains(".entry fill"));
    }
}
