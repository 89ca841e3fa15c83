//! NVML return codes the fake produces, as a Rust error type.

use nvml_wrapper_sys::bindings::nvmlReturn_t;

/// The subset of `nvmlReturn_t` error codes the fake returns. The discriminants are the ABI
/// values from `nvml.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NvmlError {
    /// `NVML_ERROR_UNINITIALIZED`: called before `nvmlInit*` or after the last `nvmlShutdown`.
    Uninitialized = 1,
    /// `NVML_ERROR_INVALID_ARGUMENT`: NULL pointer, stale or wrong-kind handle, bad index.
    InvalidArgument = 2,
    /// `NVML_ERROR_NOT_SUPPORTED`: the device cannot do this (MIG on T4, MIG disabled, ...).
    NotSupported = 3,
    /// `NVML_ERROR_NOT_FOUND`: no such UUID, bus id, instance id or MIG slot.
    NotFound = 6,
    /// `NVML_ERROR_INSUFFICIENT_SIZE`: the caller's buffer or count is too small.
    InsufficientSize = 7,
    /// `NVML_ERROR_DRIVER_NOT_LOADED`: no usable machine file.
    DriverNotLoaded = 9,
    /// `NVML_ERROR_TIMEOUT`: `nvmlEventSetWait` saw no event in time.
    Timeout = 10,
    /// `NVML_ERROR_GPU_IS_LOST`: the GPU is listed in the `lost` injection file.
    GpuIsLost = 15,
    /// `NVML_ERROR_RESET_REQUIRED`: a MIG mode change waits for a GPU reset (activation status).
    ResetRequired = 16,
    /// `NVML_ERROR_IN_USE`: instances or processes still use the resource.
    InUse = 19,
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`: placement overlap or instance-count limit.
    InsufficientResources = 23,
    /// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`: wrong struct version word.
    ArgumentVersionMismatch = 25,
    /// `NVML_ERROR_UNKNOWN`: an internal failure (a panic caught at the FFI boundary).
    Unknown = 999,
}

impl NvmlError {
    /// The raw `nvmlReturn_t` value.
    pub fn code(self) -> nvmlReturn_t {
        self as nvmlReturn_t
    }
}

/// `NVML_SUCCESS`.
pub const SUCCESS: nvmlReturn_t = 0;

/// Result type used throughout the fake.
pub type NvmlResult<T> = Result<T, NvmlError>;

/// The text `nvmlErrorString` returns for a code (wording follows NVML's).
pub fn error_string(code: nvmlReturn_t) -> &'static std::ffi::CStr {
    match code {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt Request Issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, becasue ECC is enabled",
        23 => c"Insufficient resources",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Function is deprecated",
        27 => c"System is not ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        30 => c"Reset type not supported",
        _ => c"Unknown Error",
    }
}
