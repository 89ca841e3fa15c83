//! The exported NVML C ABI.
//!
//! Every function here converts pointers and handles, then calls into [`crate::runtime`].
//! Panics are caught and reported as `NVML_ERROR_UNKNOWN`; they never unwind into C.
//!
//! Safety contract (the NVML one, for every function): pointer arguments are NULL or valid
//! for the access NVML documents (string buffers for `length` bytes, arrays for the count
//! the caller states or NVML requires), and correctly aligned. Handles may be anything:
//! they are looked up, never dereferenced.
#![allow(clippy::missing_safety_doc)]
#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::mem::size_of;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::thread::sleep;
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX, NVML_GPU_INSTANCE_PROFILE_CAPS_GFX, nvmlComputeInstance_t,
    nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t, nvmlComputeInstanceProfileInfo_v3_t, nvmlDevice_t, nvmlDeviceArchitecture_t,
    nvmlDeviceAttributes_t, nvmlEnableState_t, nvmlEventData_t, nvmlEventSet_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlGpuTopologyLevel_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t,
    nvmlProcessInfo_t, nvmlReturn_t, nvmlTemperatureSensors_t, nvmlUtilization_t,
};
use nvml_wrapper_sys::bindings::{
    field_id::NVML_FI_DEV_MEMORY_TEMP, nvmlClockType_t, nvmlEccCounterType_t, nvmlFieldValue_t, nvmlMemoryErrorType_t,
    nvmlValue_t, nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT,
};
use nvml_wrapper_sys::bindings::{
    field_id::{NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX},
    nvmlGridLicensableFeatures_t, nvmlGridLicenseFeatureCode_t_NVML_GRID_LICENSE_FEATURE_CODE_VGPU,
    nvmlPcieUtilCounter_t, nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
};
use nvml_wrapper_sys::bindings::{nvmlGpmMetricsGet_t, nvmlGpmSample_t, nvmlGpmSupport_t};

use crate::error::{NvmlError, NvmlResult, SUCCESS, error_string};
use crate::models::{CiProfile, GiProfile};
use crate::runtime::{Cx, Dev, NO_ID, START, fill_chars, lock};

/// How often `nvmlEventSetWait` re-checks the injection files while waiting.
const WAIT_POLL: Duration = Duration::from_millis(2);
/// `NVML_NVLINK_MAX_LINKS` in the nvml-wrapper-sys 0.10 header.
const NVLINK_MAX_LINKS: c_uint = 18;

// === plumbing ===

fn guard(f: impl FnOnce() -> NvmlResult<()>) -> nvmlReturn_t {
    let rc = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(e)) => e.code(),
        Err(_) => NvmlError::Unknown.code(),
    };
    // A slowed state change takes its time here, with the library unlocked.
    if let Some(delay) = crate::runtime::take_mutation_delay() {
        sleep(delay);
    }
    rc
}

/// Runs `f` with the library locked; UNINITIALIZED before init.
fn run(f: impl FnOnce(&mut Cx<'_>) -> NvmlResult<()>) -> nvmlReturn_t {
    guard(|| {
        let mut g = lock();
        let mut cx = g.cx()?;
        f(&mut cx)
    })
}

fn nonnull<T>(p: *const T) -> NvmlResult<()> {
    if p.is_null() {
        Err(NvmlError::InvalidArgument)
    } else {
        Ok(())
    }
}

/// Writes `v` through `p` (checked for NULL).
unsafe fn put<T>(p: *mut T, v: T) -> NvmlResult<()> {
    nonnull(p)?;
    // SAFETY: non-NULL, and valid for writes per the module's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// Copies `s` plus a NUL into `buf` of `len` bytes; INSUFFICIENT_SIZE if it does not fit.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> NvmlResult<()> {
    nonnull(buf)?;
    if (len as usize) < s.len() + 1 {
        return Err(NvmlError::InsufficientSize);
    }
    // SAFETY: buf is valid for `len` bytes and we write s.len() + 1 <= len of them.
    unsafe {
        ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// Reads a NUL-terminated UTF-8 input string.
unsafe fn get_str<'a>(p: *const c_char) -> NvmlResult<&'a str> {
    nonnull(p)?;
    // SAFETY: non-NULL and NUL-terminated per the contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| NvmlError::InvalidArgument)
}

/// Reads the leading `version` word of a versioned struct.
unsafe fn version_of(p: *const c_uint) -> NvmlResult<c_uint> {
    nonnull(p)?;
    // SAFETY: every versioned NVML struct starts with an unsigned int version.
    Ok(unsafe { p.read() })
}

fn struct_version<T>(v: u32) -> u32 {
    size_of::<T>() as u32 | (v << 24)
}

/// Count protocol for arrays whose `*count` is the capacity on input: NULL array -> count
/// only; a capacity below the number -> INSUFFICIENT_SIZE with the needed count.
unsafe fn put_array<T: Copy>(items: &[T], out: *mut T, count: *mut c_uint) -> NvmlResult<()> {
    nonnull(count)?;
    let n = items.len() as c_uint;
    // SAFETY: count is non-NULL and valid for reads and writes.
    let cap = unsafe { count.read() };
    unsafe { count.write(n) };
    if out.is_null() {
        return Ok(());
    }
    if cap < n {
        return Err(NvmlError::InsufficientSize);
    }
    // SAFETY: out holds at least `cap >= n` elements.
    unsafe { ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(())
}

/// For arrays NVML sizes itself (`instanceCount` entries): `*count` is output only.
unsafe fn put_handles<T>(handles: &[usize], out: *mut *mut T, count: *mut c_uint) -> NvmlResult<()> {
    nonnull(count)?;
    nonnull(out)?;
    for (i, h) in handles.iter().enumerate() {
        // SAFETY: the caller allocated instanceCount entries, and handles.len() never
        // exceeds the profile's instanceCount.
        unsafe { out.add(i).write(*h as *mut T) };
    }
    // SAFETY: non-NULL.
    unsafe { count.write(handles.len() as c_uint) };
    Ok(())
}

fn addr<T>(p: *mut T) -> usize {
    p as usize
}

/// Resolves a device handle that must not be a MIG device (NOT_SUPPORTED otherwise).
fn physical_or_not_supported(cx: &mut Cx<'_>, device: nvmlDevice_t) -> NvmlResult<usize> {
    match cx.dev(addr(device))? {
        Dev::Gpu(g) => Ok(g),
        Dev::Mig { .. } => Err(NvmlError::NotSupported),
    }
}

// === init / shutdown ===

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard(|| lock().init())
}

/// `nvmlInit` (legacy name).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    nvmlInit_v2()
}

/// `nvmlInitWithFlags`: flags are accepted and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

/// `nvmlShutdown`: ref-counted; extra calls are harmless.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(|| {
        lock().shutdown();
        Ok(())
    })
}

/// `nvmlErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    error_string(result).as_ptr()
}

// === system ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    run(|cx| unsafe { put_str(version, length, &cx.lib.machine.driver_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    run(|cx| unsafe { put_str(version, length, &cx.lib.machine.nvml_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t {
    run(|cx| unsafe { put(v, cx.lib.machine.cuda_driver_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> nvmlReturn_t {
    unsafe { nvmlSystemGetCudaDriverVersion_v2(v) }
}

// === device enumeration ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    run(|cx| unsafe { put(count, cx.count() as c_uint) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetCount_v2(count) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    run(|cx| {
        nonnull(device)?;
        if index as usize >= cx.count() {
            return Err(NvmlError::InvalidArgument);
        }
        let h = cx.gpu_handle(index as usize);
        unsafe { put(device, h as nvmlDevice_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    run(|cx| {
        let uuid = unsafe { get_str(uuid) }?;
        nonnull(device)?;
        let h = cx.handle_by_uuid(uuid)?;
        unsafe { put(device, h as nvmlDevice_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    run(|cx| {
        let bus = unsafe { get_str(bus) }?;
        nonnull(device)?;
        let h = cx.handle_by_bus_id(bus)?;
        unsafe { put(device, h as nvmlDevice_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(bus: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(bus, device) }
}

// === device identity ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        unsafe { put_str(uuid, length, &cx.uuid(d)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        unsafe { put_str(name, length, &cx.name(d)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        let s = crate::ids::serial_for(&cx.lib.state.gpus[g].uuid);
        unsafe { put_str(serial, length, &s) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        unsafe { put(index, g as c_uint) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        unsafe { put(minor, cx.lib.machine.gpus[g].minor) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        nonnull(memory)?;
        // The v1 struct has no `reserved`: the driver's reserve counts as used.
        let (total, used) = cx.memory(d);
        let used = (used + cx.memory_reserved(d)).min(total);
        unsafe {
            put(
                memory,
                nvmlMemory_t {
                    total,
                    free: total - used,
                    used,
                },
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        let version = unsafe { version_of(memory.cast()) }?;
        if version != struct_version::<nvmlMemory_v2_t>(2) {
            return Err(NvmlError::ArgumentVersionMismatch);
        }
        let (total, used) = cx.memory(d);
        let reserved = cx.memory_reserved(d).min(total);
        let used = used.min(total - reserved);
        let v = nvmlMemory_v2_t {
            version,
            total,
            reserved,
            free: total - reserved - used,
            used,
        };
        unsafe { put(memory, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        unsafe { put(pci, cx.pci_info(g)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetPciInfo_v3(device, pci) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetPciInfo_v3(device, pci) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        nonnull(major)?;
        nonnull(minor)?;
        let (a, b) = cx.lib.machine.gpus[g].model.compute_capability;
        unsafe { put(major, a) }?;
        unsafe { put(minor, b) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        unsafe { put(arch, cx.lib.machine.gpus[g].model.architecture) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(device: nvmlDevice_t, brand: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        unsafe { put(brand, cx.lib.machine.gpus[g].model.brand) }
    })
}

/// `nvmlDeviceGetNumaNodeId`: the machine file's `numa_node` (a MIG handle answers with its
/// parent's); NOT_SUPPORTED when the GPU has none.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        nonnull(node)?;
        let numa = cx.lib.machine.gpus[g].numa_node.ok_or(NvmlError::NotSupported)?;
        unsafe { put(node, numa) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        unsafe { put(attributes, cx.attributes(d)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetAttributes_v2(device, attributes) }
}

// === sensors and counters (physical GPUs only; MIG handles answer NOT_SUPPORTED) ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        if sensor != 0 {
            return Err(NvmlError::InvalidArgument);
        }
        let t = cx.temperature(g);
        unsafe { put(temp, t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        nonnull(power)?;
        let mw = cx.power_mw(g);
        unsafe { put(power, mw) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        nonnull(energy)?;
        let mj = cx.energy_mj(g);
        unsafe { put(energy, mj) }
    })
}

/// `nvmlDeviceGetUtilizationRates`: NOT_SUPPORTED on MIG handles and, as on real GPUs, on a GPU
/// whose MIG mode is enabled.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        if cx.mig_enabled(g) {
            return Err(NvmlError::NotSupported);
        }
        nonnull(utilization)?;
        let (gpu, memory) = cx.utilization(g);
        unsafe { put(utilization, nvmlUtilization_t { gpu, memory }) }
    })
}

/// `nvmlDeviceGetClockInfo`: graphics (0), SM (1), memory (2) and video (3) clocks in MHz.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    clock_type: nvmlClockType_t,
    clock: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        nonnull(clock)?;
        let mhz = cx.clock_mhz(g, clock_type).ok_or(NvmlError::InvalidArgument)?;
        unsafe { put(clock, mhz) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(device: nvmlDevice_t, value: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        unsafe { put(value, cx.pcie_replay(g)) }
    })
}

/// `nvmlDeviceGetTotalEccErrors`: error type corrected (0) or uncorrected (1), counter type
/// volatile (0) or aggregate (1); both counter types answer the same count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        if error_type > 1 || counter_type > 1 {
            return Err(NvmlError::InvalidArgument);
        }
        unsafe { put(count, cx.ecc_errors(g, error_type == 0)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        nonnull(reasons)?;
        let bits = cx.throttle_reasons(g);
        unsafe { put(reasons, bits) }
    })
}

/// `nvmlDeviceGetCurrentClocksEventReasons` (the newer name of the throttle reasons).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetCurrentClocksThrottleReasons(device, reasons) }
}

/// `nvmlDeviceGetFieldValues`: `NVML_FI_DEV_MEMORY_TEMP` (82) and the NVLink data throughput
/// counters `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`/`_RX` (138/139; `scopeId` a link, or
/// `UINT_MAX` for all links; NOT_SUPPORTED without NVLink) are known; every other field gets
/// NOT_SUPPORTED in its own `nvmlReturn`, and the call itself succeeds. On a MIG handle the call
/// is NOT_SUPPORTED.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        let n = usize::try_from(count).map_err(|_| NvmlError::InvalidArgument)?;
        if n == 0 {
            return Ok(());
        }
        nonnull(values)?;
        // SAFETY: the caller passes an array of `count` field values (the NVML contract).
        let values = unsafe { std::slice::from_raw_parts_mut(values, n) };
        let micros = START.elapsed().as_micros() as i64;
        for v in values {
            let reading = match v.fieldId {
                NVML_FI_DEV_MEMORY_TEMP => cx.memory_temperature(g).map(|t| Ok(Reading::U32(t))),
                NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX | NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX => cx
                    .nvlink_data_kib(g, v.fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, v.scopeId)
                    .map(|r| r.map(Reading::U64)),
                _ => None,
            };
            v.timestamp = micros;
            v.latencyUsec = 0;
            match reading {
                Some(Ok(Reading::U32(value))) => {
                    v.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT;
                    v.nvmlReturn = SUCCESS;
                    v.value = nvmlValue_t { uiVal: value };
                }
                Some(Ok(Reading::U64(value))) => {
                    v.valueType = nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                    v.nvmlReturn = SUCCESS;
                    v.value = nvmlValue_t { ullVal: value };
                }
                Some(Err(e)) => v.nvmlReturn = e.code(),
                None => v.nvmlReturn = NvmlError::NotSupported.code(),
            }
        }
        Ok(())
    })
}

// === dcgm-exporter's default counters: PCIe throughput, codecs, remapped rows, vGPU license ===
// (physical GPUs only; MIG handles answer NOT_SUPPORTED, as for the other sensors)

/// `nvmlDeviceGetPcieThroughput`: KB/s over NVML's last 20 ms window; counter TX_BYTES (0) or
/// RX_BYTES (1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    device: nvmlDevice_t,
    counter: nvmlPcieUtilCounter_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        if counter > 1 {
            return Err(NvmlError::InvalidArgument);
        }
        nonnull(value)?;
        let kbps = cx.pcie_throughput_kbps(g, counter == 1);
        unsafe { put(value, kbps) }
    })
}

/// Encoder or decoder utilization and its sampling period; NOT_SUPPORTED while MIG mode is on,
/// like the other utilization rates.
unsafe fn codec_utilization(
    device: nvmlDevice_t,
    decoder: bool,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        if cx.mig_enabled(g) {
            return Err(NvmlError::NotSupported);
        }
        nonnull(utilization)?;
        nonnull(sampling_period_us)?;
        let u = cx.codec_utilization(g, decoder);
        unsafe {
            put(utilization, u)?;
            put(sampling_period_us, 167_000)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> nvmlReturn_t {
    unsafe { codec_utilization(device, false, utilization, sampling_period_us) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> nvmlReturn_t {
    unsafe { codec_utilization(device, true, utilization, sampling_period_us) }
}

/// `nvmlDeviceGetRemappedRows`: Ampere and later; NOT_SUPPORTED on older GPUs (T4).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: nvmlDevice_t,
    corr_rows: *mut c_uint,
    unc_rows: *mut c_uint,
    is_pending: *mut c_uint,
    failure_occurred: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        let (corr, unc, pending, failure) = cx.remapped_rows(g).ok_or(NvmlError::NotSupported)?;
        for p in [corr_rows, unc_rows, is_pending, failure_occurred] {
            nonnull(p)?;
        }
        unsafe {
            put(corr_rows, corr)?;
            put(unc_rows, unc)?;
            put(is_pending, c_uint::from(pending))?;
            put(failure_occurred, c_uint::from(failure))
        }
    })
}

/// `nvmlDeviceGetGridLicensableFeatures_v4`: in a vGPU guest (`readings.vgpu_licensed`), one
/// licensable feature, vGPU, licensed or not; NOT_SUPPORTED on bare metal.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGridLicensableFeatures_v4(
    device: nvmlDevice_t,
    features: *mut nvmlGridLicensableFeatures_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        let licensed = cx.vgpu_licensed(g).ok_or(NvmlError::NotSupported)?;
        nonnull(features)?;
        // SAFETY: an all-zero nvmlGridLicensableFeatures_t is valid (integers and char arrays).
        let mut v: nvmlGridLicensableFeatures_t = unsafe { std::mem::zeroed() };
        v.isGridLicenseSupported = 1;
        v.licensableFeaturesCount = 1;
        v.gridLicensableFeatures[0].featureCode = nvmlGridLicenseFeatureCode_t_NVML_GRID_LICENSE_FEATURE_CODE_VGPU;
        v.gridLicensableFeatures[0].featureState = c_uint::from(licensed);
        v.gridLicensableFeatures[0].featureEnabled = 1;
        crate::runtime::fill_chars(
            &mut v.gridLicensableFeatures[0].productName,
            "NVIDIA Virtual Compute Server",
        );
        unsafe { put(features, v) }
    })
}

/// A field value's payload.
enum Reading {
    U32(u32),
    U64(u64),
}

// === topology ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path_info: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    run(|cx| {
        let a = cx.gpu(addr(device1))?;
        let b = cx.gpu(addr(device2))?;
        unsafe { put(path_info, cx.topology(a, b)) }
    })
}

fn nvlink_gpu(cx: &mut Cx<'_>, device: nvmlDevice_t, link: c_uint) -> NvmlResult<usize> {
    let g = cx.gpu(addr(device))?;
    if cx.lib.machine.gpus[g].model.nvlink_links == 0 {
        return Err(NvmlError::NotSupported);
    }
    if link >= NVLINK_MAX_LINKS {
        return Err(NvmlError::InvalidArgument);
    }
    Ok(g)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = nvlink_gpu(cx, device, link)?;
        let active = (link as usize) < cx.lib.machine.gpus[g].nvlink_peers.len();
        unsafe { put(is_active, nvmlEnableState_t::from(active)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = nvlink_gpu(cx, device, link)?;
        let info = cx.nvlink_remote(g, link as usize).ok_or(NvmlError::NotSupported)?;
        unsafe { put(pci, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    unsafe { nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci) }
}

// === processes ===

unsafe fn running_processes(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        nonnull(count)?;
        let procs = cx.processes_of(d);
        let list: Vec<nvmlProcessInfo_t> = procs
            .iter()
            .map(|p| {
                let (gi, ci) = p.mig.map_or((NO_ID, NO_ID), |(gi, ci)| cx.mig_ids(p.gpu, gi, ci));
                nvmlProcessInfo_t {
                    pid: p.pid,
                    usedGpuMemory: p.used_mib * 1024 * 1024,
                    gpuInstanceId: gi,
                    computeInstanceId: ci,
                }
            })
            .collect();
        // SAFETY: count is non-NULL.
        let cap = unsafe { count.read() };
        if (cap as usize) < list.len() {
            unsafe { count.write(list.len() as c_uint) };
            return Err(NvmlError::InsufficientSize);
        }
        if !list.is_empty() {
            nonnull(infos)?;
            // SAFETY: infos holds `cap >= list.len()` entries.
            unsafe { ptr::copy_nonoverlapping(list.as_ptr(), infos, list.len()) };
        }
        unsafe { count.write(list.len() as c_uint) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe { running_processes(device, info_count, infos) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe { running_processes(device, info_count, infos) }
}

// === MIG mode ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(current)?;
        nonnull(pending)?;
        cx.apply_resets();
        let (c, p) = cx.mig_mode(g)?;
        unsafe { put(current, c) }?;
        unsafe { put(pending, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(activation_status)?;
        let status = cx.set_mig_mode(g, mode)?;
        unsafe { put(activation_status, status.err().map_or(SUCCESS, NvmlError::code)) }
    })
}

// === GPU-instance profiles ===

fn gi_info_v1(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.instance_count,
        multiprocessorCount: p.sm,
        copyEngineCount: p.engines.ce,
        decoderCount: p.engines.dec,
        encoderCount: p.engines.enc,
        jpegCount: p.engines.jpeg,
        ofaCount: p.engines.ofa,
        memorySizeMB: p.memory_mib,
    }
}

/// Fills a `nvmlGpuInstanceProfileInfo_v2_t` or `_v3_t` according to its version word.
unsafe fn put_gi_info_versioned(info: *mut nvmlGpuInstanceProfileInfo_v2_t, p: &GiProfile) -> NvmlResult<()> {
    let version = unsafe { version_of(info.cast()) }?;
    let name = format!("MIG {}", p.name);
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
        let mut v = nvmlGpuInstanceProfileInfo_v2_t {
            version,
            id: p.id,
            isP2pSupported: 0,
            sliceCount: p.slices,
            instanceCount: p.instance_count,
            multiprocessorCount: p.sm,
            copyEngineCount: p.engines.ce,
            decoderCount: p.engines.dec,
            encoderCount: p.engines.enc,
            jpegCount: p.engines.jpeg,
            ofaCount: p.engines.ofa,
            memorySizeMB: p.memory_mib,
            name: [0; 96],
        };
        fill_chars(&mut v.name, &name);
        unsafe { put(info, v) }
    } else if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
        let mut v = nvmlGpuInstanceProfileInfo_v3_t {
            version,
            id: p.id,
            sliceCount: p.slices,
            instanceCount: p.instance_count,
            multiprocessorCount: p.sm,
            copyEngineCount: p.engines.ce,
            decoderCount: p.engines.dec,
            encoderCount: p.engines.enc,
            jpegCount: p.engines.jpeg,
            ofaCount: p.engines.ofa,
            memorySizeMB: p.memory_mib,
            name: [0; 96],
            capabilities: if p.gfx() { NVML_GPU_INSTANCE_PROFILE_CAPS_GFX } else { 0 },
        };
        fill_chars(&mut v.name, &name);
        unsafe { put(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), v) }
    } else {
        Err(NvmlError::InvalidArgument)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(info)?;
        let p = cx.gi_profile_by_index(g, profile)?;
        unsafe { put(info, gi_info_v1(p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(info)?;
        let p = cx.gi_profile_by_index(g, profile)?;
        unsafe { put_gi_info_versioned(info, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(info)?;
        let p = cx.gi_profile_by_id(g, profile_id)?;
        unsafe { put_gi_info_versioned(info, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(count)?;
        let p = cx.gi_profile_by_id(g, profile_id)?;
        let list: Vec<nvmlGpuInstancePlacement_t> = p
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.mem_size,
            })
            .collect();
        unsafe { put_array(&list, placements, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(count)?;
        let n = cx.gi_remaining(g, profile_id)?;
        unsafe { put(count, n) }
    })
}

// === GPU instances ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(gpu_instance)?;
        let h = cx.create_gi(g, profile_id, None)?;
        unsafe { put(gpu_instance, h as nvmlGpuInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(placement)?;
        nonnull(gpu_instance)?;
        // SAFETY: non-NULL input struct.
        let pl = unsafe { placement.read() };
        let h = cx.create_gi(g, profile_id, Some(pl))?;
        unsafe { put(gpu_instance, h as nvmlGpuInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(count)?;
        nonnull(gpu_instances)?;
        let list = cx.gi_list(g, profile_id)?;
        unsafe { put_handles(&list, gpu_instances, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(gpu_instance)?;
        let h = cx.gi_by_id(g, id)?;
        unsafe { put(gpu_instance, h as nvmlGpuInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(info)?;
        let device = cx.gpu_handle(g) as nvmlDevice_t;
        let p = cx.gi_profile_of(g, gi);
        let s = &cx.lib.state.gpus[g].gpu_instances[gi];
        let v = nvmlGpuInstanceInfo_t {
            device,
            id: s.id,
            profileId: s.profile_id,
            placement: nvmlGpuInstancePlacement_t {
                start: s.start,
                size: p.mem_size,
            },
        };
        unsafe { put(info, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        cx.destroy_gi(g, gi)
    })
}

// === compute-instance profiles ===

fn ci_info_v1(gp: &GiProfile, c: &CiProfile) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: c.index,
        sliceCount: c.slices,
        instanceCount: c.instance_count,
        multiprocessorCount: c.sm,
        sharedCopyEngineCount: gp.engines.ce,
        sharedDecoderCount: gp.engines.dec,
        sharedEncoderCount: gp.engines.enc,
        sharedJpegCount: gp.engines.jpeg,
        sharedOfaCount: gp.engines.ofa,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(info)?;
        let c = cx.ci_profile(g, gi, profile, eng_profile)?;
        unsafe { put(info, ci_info_v1(cx.gi_profile_of(g, gi), &c)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        let version = unsafe { version_of(info.cast()) }?;
        let c = cx.ci_profile(g, gi, profile, eng_profile)?;
        let b = ci_info_v1(cx.gi_profile_of(g, gi), &c);
        let name = format!("MIG {}", c.name);
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            let mut v = nvmlComputeInstanceProfileInfo_v2_t {
                version,
                id: b.id,
                sliceCount: b.sliceCount,
                instanceCount: b.instanceCount,
                multiprocessorCount: b.multiprocessorCount,
                sharedCopyEngineCount: b.sharedCopyEngineCount,
                sharedDecoderCount: b.sharedDecoderCount,
                sharedEncoderCount: b.sharedEncoderCount,
                sharedJpegCount: b.sharedJpegCount,
                sharedOfaCount: b.sharedOfaCount,
                name: [0; 96],
            };
            fill_chars(&mut v.name, &name);
            unsafe { put(info, v) }
        } else if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            let mut v = nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: b.id,
                sliceCount: b.sliceCount,
                instanceCount: b.instanceCount,
                multiprocessorCount: b.multiprocessorCount,
                sharedCopyEngineCount: b.sharedCopyEngineCount,
                sharedDecoderCount: b.sharedDecoderCount,
                sharedEncoderCount: b.sharedEncoderCount,
                sharedJpegCount: b.sharedJpegCount,
                sharedOfaCount: b.sharedOfaCount,
                name: [0; 96],
                capabilities: if cx.gi_profile_of(g, gi).gfx() {
                    NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX
                } else {
                    0
                },
            };
            fill_chars(&mut v.name, &name);
            unsafe { put(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(), v) }
        } else {
            Err(NvmlError::InvalidArgument)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(count)?;
        let n = cx.ci_remaining(g, gi, profile_id)?;
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(count)?;
        let list: Vec<nvmlComputeInstancePlacement_t> = cx
            .ci_placements(g, gi, profile_id)?
            .into_iter()
            .map(|(start, size)| nvmlComputeInstancePlacement_t { start, size })
            .collect();
        unsafe { put_array(&list, placements, count) }
    })
}

// === compute instances ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(compute_instance)?;
        let h = cx.create_ci(g, gi, profile_id, None)?;
        unsafe { put(compute_instance, h as nvmlComputeInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(placement)?;
        nonnull(compute_instance)?;
        // SAFETY: non-NULL input struct.
        let pl = unsafe { placement.read() };
        let h = cx.create_ci(g, gi, profile_id, Some((pl.start, pl.size)))?;
        unsafe { put(compute_instance, h as nvmlComputeInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(count)?;
        nonnull(compute_instances)?;
        let list = cx.ci_list(g, gi, profile_id)?;
        unsafe { put_handles(&list, compute_instances, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi) = cx.gi(addr(gpu_instance))?;
        nonnull(compute_instance)?;
        let h = cx.ci_by_id(g, gi, id)?;
        unsafe { put(compute_instance, h as nvmlComputeInstance_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(compute_instance: nvmlComputeInstance_t) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi, ci) = cx.ci(addr(compute_instance))?;
        cx.destroy_ci(g, gi, ci)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        let (g, gi, ci) = cx.ci(addr(compute_instance))?;
        nonnull(info)?;
        let device = cx.gpu_handle(g) as nvmlDevice_t;
        let gpu_instance = cx.gi_handle(g, gi) as nvmlGpuInstance_t;
        let gp = cx.gi_profile_of(g, gi);
        let c = &cx.lib.state.gpus[g].gpu_instances[gi].compute_instances[ci];
        let size = crate::models::ci_profile_by_index(gp, c.profile_index).map_or(1, |p| p.slices);
        let v = nvmlComputeInstanceInfo_t {
            device,
            gpuInstance: gpu_instance,
            id: c.id,
            profileId: c.profile_index,
            placement: nvmlComputeInstancePlacement_t { start: c.start, size },
        };
        unsafe { put(info, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    unsafe { nvmlComputeInstanceGetInfo_v2(compute_instance, info) }
}

// === MIG devices ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let d = cx.dev(addr(device))?;
        unsafe { put(is_mig, c_uint::from(matches!(d, Dev::Mig { .. }))) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t {
    run(|cx| match cx.dev(addr(device))? {
        Dev::Mig { gpu, gi, ci } => unsafe { put(id, cx.mig_ids(gpu, gi, ci).0) },
        Dev::Gpu(_) => Err(NvmlError::NotSupported),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t {
    run(|cx| match cx.dev(addr(device))? {
        Dev::Mig { gpu, gi, ci } => unsafe { put(id, cx.mig_ids(gpu, gi, ci).1) },
        Dev::Gpu(_) => Err(NvmlError::NotSupported),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        unsafe { put(count, cx.max_mig_devices(g)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(mig_device)?;
        let h = cx.mig_by_slot(g, index)?;
        unsafe { put(mig_device, h as nvmlDevice_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    run(|cx| match cx.dev(addr(mig_device))? {
        Dev::Mig { gpu, .. } => {
            nonnull(device)?;
            let h = cx.gpu_handle(gpu);
            unsafe { put(device, h as nvmlDevice_t) }
        }
        Dev::Gpu(_) => Err(NvmlError::InvalidArgument),
    })
}

// === events ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    run(|cx| {
        nonnull(set)?;
        let h = cx.create_set();
        unsafe { put(set, h as nvmlEventSet_t) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    run(|cx| cx.free_set(addr(set)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        unsafe { put(event_types, cx.supported_events(g)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = physical_or_not_supported(cx, device)?;
        cx.register(g, event_types, addr(set))
    })
}

/// Waits without holding the lock: one poll, then sleeps of [`WAIT_POLL`] until an event,
/// a lost GPU, or the timeout.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeoutms));
    loop {
        let mut got = None;
        let rc = run(|cx| {
            nonnull(data)?;
            got = cx.poll_set(addr(set))?;
            Ok(())
        });
        if rc != SUCCESS {
            return rc;
        }
        if let Some(ev) = got {
            let e = ev.to_c();
            return guard(|| unsafe { put(data, e) });
        }
        let now = Instant::now();
        if now >= deadline {
            return NvmlError::Timeout.code();
        }
        sleep(WAIT_POLL.min(deadline - now));
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    unsafe { nvmlEventSetWait_v2(set, data, timeoutms) }
}

// === GPU fabric (the machine file's `[gpu.fabric]`, see crate::fabric) ===

/// The GPU's fabric, NOT_SUPPORTED for a GPU without one (and for MIG handles).
fn fabric_of(cx: &mut Cx<'_>, device: nvmlDevice_t) -> NvmlResult<crate::fabric::Fabric> {
    let g = physical_or_not_supported(cx, device)?;
    cx.lib.machine.gpus[g].fabric.ok_or(NvmlError::NotSupported)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    device: nvmlDevice_t,
    info: *mut nvml_wrapper_sys::bindings::nvmlGpuFabricInfo_t,
) -> nvmlReturn_t {
    run(|cx| {
        nonnull(info)?;
        let f = fabric_of(cx, device)?;
        let v = nvml_wrapper_sys::bindings::nvmlGpuFabricInfo_t {
            clusterUuid: f.cluster_uuid,
            status: f.status,
            cliqueId: f.clique_id,
            state: f.state,
        };
        unsafe { put(info, v) }
    })
}

/// `nvmlDeviceGetGpuFabricInfoV`: the v2 struct (health mask 0) or v3 (health summary
/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY` once the fabric is up, NOT_SUPPORTED before);
/// any other version word is ARGUMENT_VERSION_MISMATCH.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    device: nvmlDevice_t,
    info: *mut nvml_wrapper_sys::bindings::nvmlGpuFabricInfoV_t,
) -> nvmlReturn_t {
    use nvml_wrapper_sys::bindings::{nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t};
    run(|cx| {
        let version = unsafe { version_of(info.cast()) }?;
        let v2 = struct_version::<nvmlGpuFabricInfo_v2_t>(2);
        let v3 = struct_version::<nvmlGpuFabricInfo_v3_t>(3);
        if version != v2 && version != v3 {
            return Err(NvmlError::ArgumentVersionMismatch);
        }
        let f = fabric_of(cx, device)?;
        if version == v2 {
            let v = nvmlGpuFabricInfo_v2_t {
                version,
                clusterUuid: f.cluster_uuid,
                status: f.status,
                cliqueId: f.clique_id,
                state: f.state,
                healthMask: 0,
            };
            return unsafe { put(info.cast::<nvmlGpuFabricInfo_v2_t>(), v) };
        }
        let healthy = f.state == crate::fabric::STATE_COMPLETED && f.status == SUCCESS;
        let v = nvmlGpuFabricInfo_v3_t {
            version,
            clusterUuid: f.cluster_uuid,
            status: f.status,
            cliqueId: f.clique_id,
            state: f.state,
            healthMask: 0,
            healthSummary: u8::from(healthy),
        };
        unsafe { put(info, v) }
    })
}

// === GPM (Hopper and newer; logic in crate::gpm) ===

/// `nvmlGpmQueryDeviceSupport`: `isSupportedDevice` 1 on Hopper and newer, 0 before; a MIG
/// handle answers for its GPU. The version word must be `NVML_GPM_SUPPORT_VERSION`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    support: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.dev(addr(device))?.gpu();
        nonnull(support)?;
        // SAFETY: non-NULL and valid for reads and writes per the module's contract.
        let support = unsafe { &mut *support };
        support.isSupportedDevice = crate::gpm::query_support(cx, g, support.version)?;
        Ok(())
    })
}

/// `nvmlGpmSampleAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    run(|_| {
        nonnull(sample)?;
        unsafe { put(sample, crate::gpm::alloc() as nvmlGpmSample_t) }
    })
}

/// `nvmlGpmSampleFree`: INVALID_ARGUMENT for anything but an allocated sample.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> nvmlReturn_t {
    run(|_| crate::gpm::free(addr(sample)))
}

/// `nvmlGpmSampleGet`: a physical GPU only (INVALID_ARGUMENT for a MIG handle).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(device: nvmlDevice_t, sample: nvmlGpmSample_t) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        crate::gpm::sample(cx, g, None, addr(sample))
    })
}

/// `nvmlGpmMigSampleGet`: GPU instance `gpu_instance_id` of a physical GPU in MIG mode.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpu_instance_id: c_uint,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        crate::gpm::sample(cx, g, Some(gpu_instance_id), addr(sample))
    })
}

/// `nvmlGpmMetricsGet`: metrics from two samples of one device (see `crate::gpm::metrics`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(metrics_get: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    run(|_| {
        nonnull(metrics_get)?;
        // SAFETY: non-NULL and valid for reads and writes per the module's contract.
        crate::gpm::metrics(unsafe { &mut *metrics_get })
    })
}

// === compute mode ===

/// `nvmlDeviceGetComputeMode`: the mode the state file keeps (DEFAULT until set).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        nonnull(mode)?;
        let current = cx.compute_mode(g);
        unsafe { put(mode, current) }
    })
}

/// `nvmlDeviceSetComputeMode`: kept in the state file, so the next process sees it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetComputeMode(device: nvmlDevice_t, mode: c_uint) -> nvmlReturn_t {
    run(|cx| {
        let g = cx.gpu(addr(device))?;
        cx.set_compute_mode(g, mode)
    })
}
