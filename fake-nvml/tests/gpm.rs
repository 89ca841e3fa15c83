//! GPM through raw calls (nvml-wrapper 0.13 does not wrap it): support by architecture, sample
//! buffers, metrics from two samples of one GPU or GPU instance, and the errors NVML documents.

mod common;

use std::thread::sleep;
use std::time::Duration;

use common::{Fake, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, SUCCESS, handle, sym};
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::{
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_SUPPORT_VERSION, nvmlDevice_t, nvmlGpmMetricsGet_t, nvmlGpmSample_t,
    nvmlGpmSupport_t, nvmlReturn_t,
};

const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "H100-80GB-HBM3"
nvlink_peers = ["00000000:11:00.0"]
[gpu.gpm]
graphics = 0.9
sm_active = 0.8
sm_occupancy = 0.3
tensor = 0.4
dram = 0.5
fp64 = 0.05
fp32 = 0.25
fp16 = 0.125
pcie_tx_bytes = 1048576000
pcie_rx_bytes = 524288000
nvlink_tx_bytes = 10485760000
nvlink_rx_bytes = 5242880000

[[gpu]]
model = "H100-80GB-HBM3"
mig_mode = true
[[gpu.mig_device]]
profile = "3g.40gb"
placement = 4
[[gpu.mig_device]]
profile = "1g.10gb"
placement = 0
[gpu.gpm.instance.2]
tensor = 0.7
sm_active = 0.6

[[gpu]]
model = "A100-SXM4-40GB"

[[gpu]]
model = "T4"

[[gpu]]
model = "B200"
"#;

const GR: u32 = 1;
const SM: u32 = 2;
const OCC: u32 = 3;
const TENSOR: u32 = 5;
const DRAM: u32 = 10;
const FP64: u32 = 11;
const FP32: u32 = 12;
const FP16: u32 = 13;
const PCIE_TX: u32 = 20;
const PCIE_RX: u32 = 21;
const NVLINK_RX: u32 = 60;
const NVLINK_TX: u32 = 61;

fn dev(nvml: &Nvml, i: u32) -> nvmlDevice_t {
    handle(&nvml.device_by_index(i).unwrap())
}

fn support(nvml: &Nvml, d: nvmlDevice_t, version: u32) -> (nvmlReturn_t, u32) {
    let mut s = nvmlGpmSupport_t {
        version,
        isSupportedDevice: 7,
    };
    let rc = unsafe { sym!(nvml, nvmlGpmQueryDeviceSupport)(d, &mut s) };
    (rc, s.isSupportedDevice)
}

fn alloc(nvml: &Nvml) -> nvmlGpmSample_t {
    let mut s: nvmlGpmSample_t = std::ptr::null_mut();
    assert_eq!(unsafe { sym!(nvml, nvmlGpmSampleAlloc)(&mut s) }, SUCCESS);
    assert!(!s.is_null());
    s
}

fn free(nvml: &Nvml, s: nvmlGpmSample_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlGpmSampleFree)(s) }
}

fn sample(nvml: &Nvml, d: nvmlDevice_t, s: nvmlGpmSample_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlGpmSampleGet)(d, s) }
}

fn mig_sample(nvml: &Nvml, d: nvmlDevice_t, gi: u32, s: nvmlGpmSample_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlGpmMigSampleGet)(d, gi, s) }
}

fn request(s1: nvmlGpmSample_t, s2: nvmlGpmSample_t, ids: &[u32]) -> Box<nvmlGpmMetricsGet_t> {
    // SAFETY: all-zero is a valid nvmlGpmMetricsGet_t (integers, floats and NULL pointers).
    let mut get: Box<nvmlGpmMetricsGet_t> = Box::new(unsafe { std::mem::zeroed() });
    get.version = NVML_GPM_METRICS_GET_VERSION;
    get.numMetrics = ids.len() as u32;
    get.sample1 = s1;
    get.sample2 = s2;
    for (m, id) in get.metrics.iter_mut().zip(ids) {
        m.metricId = *id;
    }
    get
}

fn metrics_get(nvml: &Nvml, get: &mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    unsafe { sym!(nvml, nvmlGpmMetricsGet)(get) }
}

/// (rc, value) per requested metric.
fn metrics(nvml: &Nvml, s1: nvmlGpmSample_t, s2: nvmlGpmSample_t, ids: &[u32]) -> Vec<(nvmlReturn_t, f64)> {
    let mut get = request(s1, s2, ids);
    assert_eq!(metrics_get(nvml, &mut get), SUCCESS);
    get.metrics[..ids.len()]
        .iter()
        .map(|m| (m.nvmlReturn, m.value))
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6 * b.abs().max(1.0)
}

#[test]
fn support_follows_the_architecture() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();
    for (i, want) in [(0, 1), (1, 1), (2, 0), (3, 0), (4, 1)] {
        assert_eq!(
            support(&nvml, dev(&nvml, i), NVML_GPM_SUPPORT_VERSION),
            (SUCCESS, want),
            "GPU {i}"
        );
    }
    assert_eq!(support(&nvml, dev(&nvml, 0), 2).0, INVALID_ARGUMENT);
    let rc = unsafe { sym!(nvml, nvmlGpmQueryDeviceSupport)(dev(&nvml, 0), std::ptr::null_mut()) };
    assert_eq!(rc, INVALID_ARGUMENT);

    // Sampling a GPU without GPM is NOT_SUPPORTED.
    let s = alloc(&nvml);
    assert_eq!(sample(&nvml, dev(&nvml, 2), s), NOT_SUPPORTED);
    assert_eq!(sample(&nvml, dev(&nvml, 3), s), NOT_SUPPORTED);
    assert_eq!(free(&nvml, s), SUCCESS);
    drop(nvml);
    drop(fake);
}

#[test]
fn two_samples_give_the_configured_activity() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();
    let h100 = dev(&nvml, 0);
    let (s1, s2) = (alloc(&nvml), alloc(&nvml));
    assert_eq!(sample(&nvml, h100, s1), SUCCESS);
    sleep(Duration::from_millis(5));
    assert_eq!(sample(&nvml, h100, s2), SUCCESS);
    let ids = [
        GR, SM, OCC, TENSOR, DRAM, FP64, FP32, FP16, PCIE_TX, PCIE_RX, NVLINK_RX, NVLINK_TX,
    ];
    let want = [
        90.0, 80.0, 30.0, 40.0, 50.0, 5.0, 25.0, 12.5, 1000.0, 500.0, 5000.0, 10000.0,
    ];
    let got = metrics(&nvml, s1, s2, &ids);
    for ((id, (rc, v)), w) in ids.iter().zip(&got).zip(want) {
        assert_eq!(*rc, SUCCESS, "metric {id}");
        assert!(close(*v, w), "metric {id}: {v} != {w}");
    }

    // The metric entries name the metric and its unit.
    let mut get = request(s1, s2, &[PCIE_TX]);
    assert_eq!(metrics_get(&nvml, &mut get), SUCCESS);
    let unit = unsafe { std::ffi::CStr::from_ptr(get.metrics[0].metricInfo.unit) };
    assert_eq!(unit.to_str().unwrap(), "MiB/sec");

    // An id NVML has but the fake does not model, and one outside the enum, fail on their own.
    let got = metrics(&nvml, s1, s2, &[30, TENSOR, 0, 500]);
    assert_eq!(got[0].0, NOT_SUPPORTED);
    assert_eq!(got[1].0, SUCCESS);
    assert_eq!(got[2].0, INVALID_ARGUMENT);
    assert_eq!(got[3].0, INVALID_ARGUMENT);

    assert_eq!(free(&nvml, s1), SUCCESS);
    assert_eq!(free(&nvml, s2), SUCCESS);
    drop(nvml);
    drop(fake);
}

#[test]
fn metrics_need_two_ordered_samples_of_one_device() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();
    let (a, b) = (dev(&nvml, 0), dev(&nvml, 4));
    let (s1, s2, empty, other) = (alloc(&nvml), alloc(&nvml), alloc(&nvml), alloc(&nvml));
    assert_eq!(sample(&nvml, a, s1), SUCCESS);
    sleep(Duration::from_millis(2));
    assert_eq!(sample(&nvml, b, other), SUCCESS);
    assert_eq!(sample(&nvml, a, s2), SUCCESS);

    let rc = |s1, s2, version, n| {
        let mut get = request(s1, s2, &[TENSOR]);
        get.version = version;
        get.numMetrics = n;
        metrics_get(&nvml, &mut get)
    };
    let v = NVML_GPM_METRICS_GET_VERSION;
    assert_eq!(rc(s1, s2, v, 1), SUCCESS);
    assert_eq!(rc(s1, s2, v + 1, 1), INVALID_ARGUMENT, "version");
    assert_eq!(rc(s1, s2, v, 211), INVALID_ARGUMENT, "more than NVML_GPM_METRIC_MAX");
    assert_eq!(rc(s2, s1, v, 1), INVALID_ARGUMENT, "second sample older");
    assert_eq!(rc(s1, s1, v, 1), INVALID_ARGUMENT, "no time between");
    assert_eq!(rc(s1, empty, v, 1), INVALID_ARGUMENT, "not filled");
    assert_eq!(rc(s1, other, v, 1), INVALID_ARGUMENT, "another GPU");
    let metrics_null = unsafe { sym!(nvml, nvmlGpmMetricsGet)(std::ptr::null_mut()) };
    assert_eq!(metrics_null, INVALID_ARGUMENT);

    for s in [s1, s2, empty, other] {
        assert_eq!(free(&nvml, s), SUCCESS);
    }
    // A freed sample is gone.
    assert_eq!(free(&nvml, s1), INVALID_ARGUMENT);
    assert_eq!(sample(&nvml, a, s1), INVALID_ARGUMENT);
    drop(nvml);
    drop(fake);
}

#[test]
fn gpu_instances_have_their_own_samples() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();
    let h100 = dev(&nvml, 1);
    // 3g.40gb@4 is GI 2 (configured), 1g.10gb@0 is GI 7 (idle: defaults).
    let (s1, s2, g1, g2, t1, t2) = (
        alloc(&nvml),
        alloc(&nvml),
        alloc(&nvml),
        alloc(&nvml),
        alloc(&nvml),
        alloc(&nvml),
    );
    assert_eq!(mig_sample(&nvml, h100, 2, s1), SUCCESS);
    assert_eq!(mig_sample(&nvml, h100, 7, t1), SUCCESS);
    assert_eq!(sample(&nvml, h100, g1), SUCCESS);
    sleep(Duration::from_millis(5));
    assert_eq!(mig_sample(&nvml, h100, 2, s2), SUCCESS);
    assert_eq!(mig_sample(&nvml, h100, 7, t2), SUCCESS);
    assert_eq!(sample(&nvml, h100, g2), SUCCESS);

    let got = metrics(&nvml, s1, s2, &[TENSOR, SM, GR, PCIE_TX, NVLINK_RX]);
    assert_eq!(got[0].0, SUCCESS);
    assert!(close(got[0].1, 70.0), "{got:?}");
    assert!(close(got[1].1, 60.0), "{got:?}");
    assert!(close(got[2].1, 0.0), "idle default: {got:?}");
    // PCIe and NVLink are per GPU.
    assert_eq!((got[3].0, got[4].0), (NOT_SUPPORTED, NOT_SUPPORTED));

    let idle = metrics(&nvml, t1, t2, &[TENSOR]);
    assert_eq!(idle[0].0, SUCCESS);
    assert!(close(idle[0].1, 0.0), "{idle:?}");

    // The whole GPU is its instances weighted by compute slices: 3 of 7 at 70 %.
    let whole = metrics(&nvml, g1, g2, &[TENSOR]);
    assert!(close(whole[0].1, 70.0 * 3.0 / 7.0), "{whole:?}");

    // Samples of an instance and of its GPU do not mix.
    let mut get = request(s1, g2, &[TENSOR]);
    assert_eq!(metrics_get(&nvml, &mut get), INVALID_ARGUMENT);

    // An instance id that does not exist, a GPU not in MIG mode, a GPU without GPM.
    assert_eq!(mig_sample(&nvml, h100, 5, s1), NOT_FOUND);
    assert_eq!(mig_sample(&nvml, dev(&nvml, 0), 0, s1), NOT_SUPPORTED);
    assert_eq!(mig_sample(&nvml, dev(&nvml, 2), 0, s1), NOT_SUPPORTED);
    // A MIG device handle is not a GPU for either call.
    let mig = nvml.device_by_index(1).unwrap().mig_device_by_index(0).unwrap();
    assert_eq!(sample(&nvml, handle(&mig), s1), INVALID_ARGUMENT);
    assert_eq!(mig_sample(&nvml, handle(&mig), 2, s1), INVALID_ARGUMENT);
    // ... but GPM support answers for its GPU.
    assert_eq!(support(&nvml, handle(&mig), NVML_GPM_SUPPORT_VERSION), (SUCCESS, 1));

    for s in [s1, s2, g1, g2, t1, t2] {
        assert_eq!(free(&nvml, s), SUCCESS);
    }
    drop(nvml);
    drop(fake);
}

#[test]
fn busy_devices_count_their_processes() {
    let fake = Fake::new(MACHINE);
    let nvml = fake.init();
    let gpu0 = nvml.device_by_index(0).unwrap().uuid().unwrap();
    let b200 = nvml.device_by_index(4).unwrap().uuid().unwrap();
    let mig = nvml.device_by_index(1).unwrap().mig_device_by_index(0).unwrap();
    let mig_uuid = mig.uuid().unwrap();
    let gi = unsafe { mig.handle() };
    let mut gi_id = 0;
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceId)(gi, &mut gi_id) },
        SUCCESS
    );
    fake_nvml::write_processes(
        &fake.state,
        &[
            (&gpu0, 10, 100),
            (&b200, 11, 100),
            (&b200, 12, 100),
            (&mig_uuid, 13, 100),
        ],
    )
    .unwrap();

    let (d, s1, s2) = (dev(&nvml, 4), alloc(&nvml), alloc(&nvml));
    assert_eq!(sample(&nvml, d, s1), SUCCESS);
    sleep(Duration::from_millis(2));
    assert_eq!(sample(&nvml, d, s2), SUCCESS);
    // Two processes: 60 % busy; tensor half of that; 2 × 256 MiB/s over PCIe, no NVLink peers.
    let got = metrics(&nvml, s1, s2, &[GR, TENSOR, PCIE_RX, NVLINK_TX]);
    assert!(close(got[0].1, 60.0), "{got:?}");
    assert!(close(got[1].1, 30.0), "{got:?}");
    assert!(close(got[2].1, 512.0), "{got:?}");
    assert!(close(got[3].1, 0.0), "{got:?}");

    // The machine file's values win over the load.
    let (d0, a, b) = (dev(&nvml, 0), alloc(&nvml), alloc(&nvml));
    assert_eq!(sample(&nvml, d0, a), SUCCESS);
    sleep(Duration::from_millis(2));
    assert_eq!(sample(&nvml, d0, b), SUCCESS);
    assert!(close(metrics(&nvml, a, b, &[TENSOR])[0].1, 40.0));

    // One process on a GPU instance with no configured activity: 30 % busy.
    let (m1, m2) = (alloc(&nvml), alloc(&nvml));
    assert_eq!(mig_sample(&nvml, dev(&nvml, 1), gi_id, m1), SUCCESS);
    sleep(Duration::from_millis(2));
    assert_eq!(mig_sample(&nvml, dev(&nvml, 1), gi_id, m2), SUCCESS);
    let got = metrics(&nvml, m1, m2, &[GR, TENSOR]);
    assert_eq!(
        gi_id, 7,
        "MIG slot 0 is the 1g.10gb instance, which has no [gpu.gpm.instance]"
    );
    assert!(close(got[0].1, 30.0), "{got:?}");
    assert!(close(got[1].1, 15.0), "{got:?}");
    for s in [s1, s2, a, b, m1, m2] {
        assert_eq!(free(&nvml, s), SUCCESS);
    }
    drop(nvml);
    drop(fake);
}

#[test]
fn invalid_gpm_values_make_the_machine_invalid() {
    let fake = Fake::new(
        r#"
driver_version = "550.54.15"
cuda_driver_version = 12040
[[gpu]]
model = "H100-80GB-HBM3"
[gpu.gpm]
tensor = 40
"#,
    );
    assert!(fake.try_init().is_err(), "tensor = 40 is not a fraction");
    drop(fake);
}
