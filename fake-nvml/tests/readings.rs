//! The sensor and counter readings (what a metrics exporter reads) through the real nvml-wrapper:
//! fixed values from `[gpu.readings]`, the deterministic defaults, and NOT_SUPPORTED where real
//! NVML has nothing (MIG handles; utilization in MIG mode; memory temperature without HBM).

mod common;

use common::Fake;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_MEMORY_TEMP;

const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "A100-SXM4-40GB"
[gpu.readings]
gpu_utilization = 42
memory_utilization = 17
temperature = 51
memory_temperature = 60
power_mw = 123456
energy_mj = 987654321
sm_clock_mhz = 1300
memory_clock_mhz = 1200
pcie_replay = 3
ecc_corrected = 5
ecc_uncorrected = 1
throttle_reasons = 4

[[gpu]]
model = "T4"

[[gpu]]
model = "H100-80GB-HBM3"
mig_mode = true
[[gpu.mig_device]]
profile = "3g.40gb"
"#;

fn memory_temperature(d: &nvml_wrapper::Device<'_>) -> Result<u64, NvmlError> {
    let mut values = d.field_values_for(&[FieldId(NVML_FI_DEV_MEMORY_TEMP)])?;
    match values.remove(0)?.value? {
        SampleValue::U32(t) => Ok(u64::from(t)),
        other => panic!("memory temperature has an unexpected type: {other:?}"),
    }
}

#[test]
fn readings_come_from_the_machine_file_or_the_defaults() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();

    // Every key of [gpu.readings] is what NVML answers.
    let a100 = nvml.device_by_index(0).unwrap();
    let u = a100.utilization_rates().unwrap();
    assert_eq!((u.gpu, u.memory), (42, 17));
    assert_eq!(a100.temperature(TemperatureSensor::Gpu).unwrap(), 51);
    assert_eq!(memory_temperature(&a100).unwrap(), 60);
    assert_eq!(a100.power_usage().unwrap(), 123_456);
    assert_eq!(a100.total_energy_consumption().unwrap(), 987_654_321);
    assert_eq!(a100.clock_info(Clock::SM).unwrap(), 1300);
    assert_eq!(a100.clock_info(Clock::Graphics).unwrap(), 1300);
    assert_eq!(a100.clock_info(Clock::Memory).unwrap(), 1200);
    assert_eq!(a100.pcie_replay_counter().unwrap(), 3);
    let ecc = |e, c| a100.total_ecc_errors(e, c).unwrap();
    assert_eq!(ecc(MemoryError::Corrected, EccCounter::Volatile), 5);
    assert_eq!(ecc(MemoryError::Uncorrected, EccCounter::Volatile), 1);
    assert_eq!(ecc(MemoryError::Uncorrected, EccCounter::Aggregate), 1);
    assert_eq!(a100.current_throttle_reasons().unwrap(), ThrottleReasons::SW_POWER_CAP);

    // Defaults: deterministic, from the model and the load.
    let t4 = nvml.device_by_index(1).unwrap();
    assert_eq!(t4.temperature(TemperatureSensor::Gpu).unwrap(), 34);
    assert_eq!(t4.power_usage().unwrap(), 14_000);
    assert_eq!(t4.clock_info(Clock::SM).unwrap(), 300);
    assert_eq!(t4.clock_info(Clock::Memory).unwrap(), 5001);
    assert_eq!(t4.pcie_replay_counter().unwrap(), 0);
    assert_eq!(
        t4.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .unwrap(),
        0
    );
    assert_eq!(t4.current_throttle_reasons().unwrap(), ThrottleReasons::GPU_IDLE);
    assert!(
        matches!(memory_temperature(&t4), Err(NvmlError::NotSupported)),
        "T4 has GDDR6"
    );
    let e1 = t4.total_energy_consumption().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(
        t4.total_energy_consumption().unwrap() > e1,
        "the default energy counter grows"
    );

    // A busy GPU boosts its clock and is no longer idle.
    let u1 = t4.uuid().unwrap();
    fake_nvml::write_processes(&fake.state, &[(u1.as_str(), 7, 100)]).unwrap();
    assert_eq!(t4.clock_info(Clock::SM).unwrap(), 1590);
    assert_eq!(t4.current_throttle_reasons().unwrap(), ThrottleReasons::empty());
    assert_eq!(t4.utilization_rates().unwrap().gpu, 30);
    fake_nvml::write_processes(&fake.state, &[]).unwrap();

    // MIG mode: the GPU has no utilization; its MIG devices have memory and nothing else.
    let h100 = nvml.device_by_index(2).unwrap();
    assert!(matches!(h100.utilization_rates(), Err(NvmlError::NotSupported)));
    assert_eq!(h100.temperature(TemperatureSensor::Gpu).unwrap(), 35);
    assert_eq!(memory_temperature(&h100).unwrap(), 39);
    assert_eq!(h100.clock_info(Clock::SM).unwrap(), 345);
    let mig = h100.mig_device_by_index(0).unwrap();
    assert_eq!(mig.memory_info().unwrap().total, 40448 * 1024 * 1024);
    assert!(matches!(mig.utilization_rates(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        mig.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(mig.power_usage(), Err(NvmlError::NotSupported)));
    assert!(matches!(mig.total_energy_consumption(), Err(NvmlError::NotSupported)));
    assert!(matches!(mig.clock_info(Clock::SM), Err(NvmlError::NotSupported)));
    assert!(matches!(mig.pcie_replay_counter(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        mig.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(mig.current_throttle_reasons(), Err(NvmlError::NotSupported)));
    assert!(matches!(memory_temperature(&mig), Err(NvmlError::NotSupported)));
}

#[test]
fn readings_must_be_percentages() {
    let err = fake_nvml::machine::Machine::parse(
        "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n[[gpu]]\nmodel = \"T4\"\n[gpu.readings]\ngpu_utilization = 101\n",
    )
    .unwrap_err();
    assert!(err.contains("readings.gpu_utilization = 101"), "{err}");
    let err = fake_nvml::machine::Machine::parse(
        "driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n[[gpu]]\nmodel = \"T4\"\n[gpu.readings]\nfan = 1\n",
    )
    .unwrap_err();
    assert!(err.contains("unknown field"), "{err}");
}

/// `nvmlDeviceGetRemappedRows` through the raw symbol (nvml-wrapper has no method for it).
fn remapped_rows(d: &nvml_wrapper::Device<'_>) -> Result<[u32; 4], NvmlError> {
    let sym = d.nvml().lib().nvmlDeviceGetRemappedRows.as_ref().expect("symbol");
    let mut out = [0u32; 4];
    let [a, b, c, e] = &mut out;
    // SAFETY: live handle, four u32 out-pointers.
    nvml_wrapper::error::nvml_try(unsafe { sym(d.handle(), a, b, c, e) })?;
    Ok(out)
}

/// NVLink data counter `field` with `scope` (a link, or u32::MAX for all).
fn nvlink_data(d: &nvml_wrapper::Device<'_>, field: u32, scope: u32) -> Result<u64, NvmlError> {
    use nvml_wrapper_sys::bindings::nvmlFieldValue_t;
    let sym = d.nvml().lib().nvmlDeviceGetFieldValues.as_ref().expect("symbol");
    // SAFETY: all-zero is a valid field value.
    let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
    v.fieldId = field;
    v.scopeId = scope;
    // SAFETY: live handle, one field value.
    nvml_wrapper::error::nvml_try(unsafe { sym(d.handle(), 1, &mut v) })?;
    nvml_wrapper::error::nvml_try(v.nvmlReturn)?;
    // SAFETY: the fake answers these fields as unsigned long long.
    Ok(unsafe { v.value.ullVal })
}

/// `nvmlDeviceGetGridLicensableFeatures_v4`: (supported, vGPU feature state).
fn vgpu_license(d: &nvml_wrapper::Device<'_>) -> Result<(i32, u32, u32), NvmlError> {
    use nvml_wrapper_sys::bindings::nvmlGridLicensableFeatures_t;
    let sym = d
        .nvml()
        .lib()
        .nvmlDeviceGetGridLicensableFeatures_v4
        .as_ref()
        .expect("symbol");
    // SAFETY: all-zero is valid for this struct of integers and char arrays.
    let mut f: nvmlGridLicensableFeatures_t = unsafe { std::mem::zeroed() };
    // SAFETY: live handle, a valid struct.
    nvml_wrapper::error::nvml_try(unsafe { sym(d.handle(), &mut f) })?;
    let first = f.gridLicensableFeatures[0];
    Ok((f.isGridLicenseSupported, first.featureCode, first.featureState))
}

#[test]
fn dcgm_default_counter_calls_follow_the_hardware_rules() {
    use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;
    use nvml_wrapper_sys::bindings::field_id::{
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX as RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX as TX,
    };
    let fake = Fake::new(
        r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "H100-80GB-HBM3"
[gpu.readings]
memory_reserved_mib = 300
pcie_tx_kbps = 11
pcie_rx_kbps = 22
encoder_utilization = 3
decoder_utilization = 4
nvlink_data_tx_kib = 1801
nvlink_data_rx_kib = 36
remapped_rows_correctable = 5
remapped_rows_uncorrectable = 6
row_remap_pending = true
row_remap_failure = true
vgpu_licensed = true

[[gpu]]
model = "T4"

[[gpu]]
model = "A100-SXM4-40GB"
mig_mode = true
[[gpu.mig_device]]
profile = "3g.20gb"
"#,
    );
    let nvml = fake.init();
    let mib = 1024 * 1024;

    let h100 = nvml.device_by_index(0).unwrap();
    let m = h100.memory_info().unwrap();
    assert_eq!(
        (m.total / mib, m.reserved / mib, m.used, m.free / mib),
        (81559, 300, 0, 81559 - 300)
    );
    assert_eq!(h100.pcie_throughput(PcieUtilCounter::Send).unwrap(), 11);
    assert_eq!(h100.pcie_throughput(PcieUtilCounter::Receive).unwrap(), 22);
    assert_eq!(h100.encoder_utilization().unwrap().utilization, 3);
    assert_eq!(h100.decoder_utilization().unwrap().utilization, 4);
    // 18 links: 1801 KiB is 100 per link, the remainder on link 0; UINT_MAX sums them.
    assert_eq!(nvlink_data(&h100, TX, u32::MAX).unwrap(), 1801);
    assert_eq!(nvlink_data(&h100, TX, 0).unwrap(), 101);
    assert_eq!(nvlink_data(&h100, TX, 17).unwrap(), 100);
    assert_eq!(nvlink_data(&h100, RX, 1).unwrap(), 2);
    assert!(matches!(nvlink_data(&h100, TX, 18), Err(NvmlError::InvalidArg)));
    assert_eq!(remapped_rows(&h100).unwrap(), [5, 6, 1, 1]);
    assert_eq!(vgpu_license(&h100).unwrap(), (1, 1, 1));

    // A T4: GDDR6 with a reserve, no NVLink, no row remapping (Turing retires pages), bare metal.
    let t4 = nvml.device_by_index(1).unwrap();
    let m = t4.memory_info().unwrap();
    assert_eq!((m.total / mib, m.reserved / mib), (15360, 259));
    assert_eq!(t4.pcie_throughput(PcieUtilCounter::Send).unwrap(), 0);
    assert_eq!(t4.encoder_utilization().unwrap().utilization, 0);
    assert!(matches!(nvlink_data(&t4, TX, u32::MAX), Err(NvmlError::NotSupported)));
    assert!(matches!(remapped_rows(&t4), Err(NvmlError::NotSupported)));
    assert!(matches!(vgpu_license(&t4), Err(NvmlError::NotSupported)));
    // The v1 call has no reserve field: the reserve counts as used.
    let sym = nvml.lib().nvmlDeviceGetMemoryInfo.as_ref().expect("symbol");
    // SAFETY: all-zero nvmlMemory_t is valid; live handle.
    let mut v1: nvml_wrapper_sys::bindings::nvmlMemory_t = unsafe { std::mem::zeroed() };
    nvml_wrapper::error::nvml_try(unsafe { sym(t4.handle(), &mut v1) }).unwrap();
    assert_eq!((v1.used / mib, v1.free / mib), (259, 15360 - 259));

    // MIG mode: no codec utilization on the GPU; a MIG device has no sensors and no reserve.
    let a100 = nvml.device_by_index(2).unwrap();
    assert!(matches!(a100.encoder_utilization(), Err(NvmlError::NotSupported)));
    assert_eq!(remapped_rows(&a100).unwrap(), [0, 0, 0, 0]);
    let mig = a100.mig_device_by_index(0).unwrap();
    assert_eq!(mig.memory_info().unwrap().reserved, 0);
    assert!(matches!(
        mig.pcie_throughput(PcieUtilCounter::Send),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(mig.decoder_utilization(), Err(NvmlError::NotSupported)));
    assert!(matches!(remapped_rows(&mig), Err(NvmlError::NotSupported)));
}
