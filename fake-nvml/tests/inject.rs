//! Injection files (`xid`, `processes`, `lost`) through the real nvml-wrapper.

mod common;

use std::ffi::c_uint;
use std::time::{Duration, Instant};

use common::*;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::high_level::event_loop::EventLoopProvider as _;
use nvml_wrapper_sys::bindings::{nvmlEventData_t, nvmlEventSet_t, nvmlProcessInfo_t};

const NO_ID: u32 = 0xFFFF_FFFF;

fn wait_raw(nvml: &Nvml, set: nvmlEventSet_t, timeout_ms: u32) -> (u32, nvmlEventData_t) {
    let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
    let rc = unsafe { sym!(nvml, nvmlEventSetWait_v2)(set, &mut data, timeout_ms) };
    (rc, data)
}

#[test]
fn xid_is_delivered_once_per_set_with_mig_ids() {
    let fake = Fake::new(&example("h100-mig.toml"));
    let nvml = fake.init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    let (u0, u1) = (gpu0.uuid().unwrap(), gpu1.uuid().unwrap());
    let mig4 = gpu0.mig_device_by_index(4).unwrap().uuid().unwrap(); // 3g.40gb: GI 2, CI 0
    let mig1_3 = gpu1.mig_device_by_index(3).unwrap().uuid().unwrap(); // GI 10, CI 0

    // A line written before registration is never delivered.
    fake_nvml::append_xid(&fake.state, &u0, 31).unwrap();
    let supported = gpu0.supported_event_types().unwrap();
    assert!(supported.contains(EventTypes::CRITICAL_XID_ERROR | EventTypes::MIG_CONFIG_CHANGE));
    let set = gpu0
        .register_events(EventTypes::CRITICAL_XID_ERROR, nvml.create_event_set().unwrap())
        .unwrap();
    let raw = unsafe { set.handle() };

    fake_nvml::append_xid(&fake.state, &u0, 79).unwrap();
    fake_nvml::append_xid(&fake.state, &mig4, 43).unwrap();
    fake_nvml::append_xid(&fake.state, &u1, 13).unwrap(); // GPU 1 is not registered in `set`
    fake_nvml::append_xid(&fake.state, "GPU-unknown", 48).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(fake.state.join("xid"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"not a line\n"))
        .unwrap();

    let (rc, ev) = wait_raw(&nvml, raw, 1000);
    assert_eq!(rc, SUCCESS);
    assert_eq!((ev.device, ev.eventType, ev.eventData), (handle(&gpu0), 0x8, 79));
    assert_eq!((ev.gpuInstanceId, ev.computeInstanceId), (NO_ID, NO_ID));
    let (rc, ev) = wait_raw(&nvml, raw, 1000);
    assert_eq!(rc, SUCCESS);
    assert_eq!(
        (ev.device, ev.eventData, ev.gpuInstanceId, ev.computeInstanceId),
        (handle(&gpu0), 43, 2, 0)
    );
    let started = Instant::now();
    assert_eq!(wait_raw(&nvml, raw, 50).0, TIMEOUT);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(50) && waited < Duration::from_secs(2),
        "{waited:?}"
    );

    // A second set registered now on both GPUs sees only what comes next; each set gets
    // each line once.
    let set2 = gpu0
        .register_events(EventTypes::CRITICAL_XID_ERROR, nvml.create_event_set().unwrap())
        .unwrap();
    let set2 = gpu1.register_events(EventTypes::CRITICAL_XID_ERROR, set2).unwrap();
    fake_nvml::append_xid(&fake.state, &mig1_3, 94).unwrap();
    fake_nvml::append_xid(&fake.state, &u0, 999).unwrap();
    let e = set2.wait(1000).unwrap();
    assert_eq!(e.device.uuid().unwrap(), u1);
    assert_eq!(e.event_data, Some(XidError::Value(94)));
    let (rc, ev) = wait_raw(&nvml, unsafe { set2.handle() }, 0);
    assert_eq!(rc, SUCCESS);
    assert_eq!(ev.eventData, 999);
    assert!(matches!(set2.wait(0), Err(NvmlError::Timeout)));
    // `set` gets only GPU 0's line.
    let e = set.wait(1000).unwrap();
    assert_eq!(
        (e.device.uuid().unwrap(), e.event_data),
        (u0.clone(), Some(XidError::Unknown))
    );
    assert!(matches!(set.wait(10), Err(NvmlError::Timeout)));

    // A line appended while a wait is blocked wakes it (polling every 2 ms).
    let dir = fake.state.clone();
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        fake_nvml::append_xid(&dir, &u0, 63).unwrap();
    });
    let started = Instant::now();
    let e = set.wait(5000).unwrap();
    assert_eq!(e.event_data, Some(XidError::Value(63)));
    assert!(started.elapsed() < Duration::from_secs(4));
    writer.join().unwrap();

    // The high-level event loop of nvml-wrapper works on top of it too.
    let mut event_loop = nvml.create_event_loop(vec![&gpu1]).unwrap();
    fake_nvml::append_xid(&fake.state, &mig1_3, 45).unwrap();
    let mut got = None;
    event_loop.run_forever(|event, state| {
        if let Ok(nvml_wrapper::high_level::event_loop::Event::CriticalXidError(d, xid)) = event {
            got = Some((d.uuid().unwrap(), xid));
        }
        state.interrupt();
    });
    assert_eq!(got, Some((u1, XidError::Value(45))));
}

#[test]
fn processes_are_listed_and_block_destroy() {
    let fake = Fake::new(&example("h100-mig.toml"));
    let nvml = fake.init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    let u0 = gpu0.uuid().unwrap();
    let m0 = gpu0.mig_device_by_index(0).unwrap(); // 2g: GI 3
    let m4 = gpu0.mig_device_by_index(4).unwrap(); // 3g: GI 2
    let (m0u, m4u) = (m0.uuid().unwrap(), m4.uuid().unwrap());
    fake_nvml::write_processes(
        &fake.state,
        &[
            (u0.as_str(), 100, 500),
            (m0u.as_str(), 200, 1000),
            (m4u.as_str(), 300, 2000),
            ("GPU-unknown", 1, 1),
        ],
    )
    .unwrap();

    let mut procs: Vec<(u32, Option<u32>, Option<u32>)> = gpu0
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| (p.pid, p.gpu_instance_id, p.compute_instance_id))
        .collect();
    procs.sort();
    assert_eq!(
        procs,
        vec![(100, None, None), (200, Some(3), Some(0)), (300, Some(2), Some(0))]
    );
    let own = m4.running_compute_processes().unwrap();
    assert_eq!(own.len(), 1);
    assert_eq!(own[0].pid, 300);
    assert_eq!(own[0].used_gpu_memory, UsedGpuMemory::Used(2000 * 1024 * 1024));
    assert_eq!(gpu1.running_compute_processes().unwrap().len(), 0);
    assert_eq!(gpu0.memory_info().unwrap().used, 3500 * 1024 * 1024);
    assert_eq!(m4.memory_info().unwrap().used, 2000 * 1024 * 1024);
    // GPU 0 is in MIG mode, where NVML has no utilization (as on real GPUs); its three
    // processes still raise the power draw (71 W idle + 25 W each).
    assert!(matches!(gpu0.utilization_rates(), Err(NvmlError::NotSupported)));
    assert_eq!(gpu0.power_usage().unwrap(), 146_000);

    // The count protocol.
    let f = sym!(nvml, nvmlDeviceGetComputeRunningProcesses_v3);
    let mut count: c_uint = 0;
    assert_eq!(
        unsafe { f(handle(&gpu0), &mut count, std::ptr::null_mut()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(count, 3);
    let mut buf: Vec<nvmlProcessInfo_t> = vec![unsafe { std::mem::zeroed() }; 2];
    let mut two: c_uint = 2;
    assert_eq!(
        unsafe { f(handle(&gpu0), &mut two, buf.as_mut_ptr()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(two, 3);
    let mut zero: c_uint = 0;
    assert_eq!(unsafe { f(handle(&gpu1), &mut zero, std::ptr::null_mut()) }, SUCCESS);
    assert_eq!(zero, 0);

    // Processes make destroy IN_USE, and SetMigMode's activation IN_USE.
    let mut gi = std::ptr::null_mut();
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceById)(handle(&gpu0), 2, &mut gi) },
        SUCCESS
    );
    let mut ci = std::ptr::null_mut();
    assert_eq!(
        unsafe { sym!(nvml, nvmlGpuInstanceGetComputeInstanceById)(gi, 0, &mut ci) },
        SUCCESS
    );
    assert_eq!(destroy_ci(&nvml, ci), IN_USE);
    assert_eq!(destroy_gi(&nvml, gi), IN_USE);
    assert_eq!(gpu0.set_mig_mode(false).unwrap(), IN_USE);
    assert_eq!(gpu0.mig_mode().unwrap().pending, 0);

    // Processes end: the CI and GI can go.
    fake_nvml::write_processes(&fake.state, &[(u0.as_str(), 100, 500), (m0u.as_str(), 200, 1000)]).unwrap();
    assert_eq!(destroy_ci(&nvml, ci), SUCCESS);
    assert_eq!(destroy_gi(&nvml, gi), SUCCESS);
    assert!(matches!(m4.uuid(), Err(NvmlError::InvalidArg)));
    assert_eq!(gpu0.running_compute_processes().unwrap().len(), 2);
}

#[test]
fn lost_gpu_answers_gpu_is_lost_until_the_line_is_removed() {
    let fake = Fake::new(&example("a100-mig-single.toml"));
    let nvml = fake.init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    let u1 = gpu1.uuid().unwrap();
    let mig1 = gpu1.mig_device_by_index(6).unwrap();
    let set = gpu1
        .register_events(EventTypes::CRITICAL_XID_ERROR, nvml.create_event_set().unwrap())
        .unwrap();
    let mut gi = std::ptr::null_mut();
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetGpuInstanceById)(handle(&gpu1), 13, &mut gi) },
        SUCCESS
    );

    fake_nvml::write_lost(&fake.state, &[u1.as_str()]).unwrap();
    // Handle lookups still work, so the agent can tell which GPU is lost.
    let again = nvml.device_by_index(1).unwrap();
    assert!(nvml.device_by_uuid(u1.as_str()).is_ok());
    assert!(matches!(again.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.name(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.mig_mode(), Err(NvmlError::GpuLost)));
    assert!(matches!(mig1.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.running_compute_processes(), Err(NvmlError::GpuLost)));
    assert_eq!(destroy_gi(&nvml, gi), GPU_IS_LOST);
    assert!(matches!(set.wait(100), Err(NvmlError::GpuLost)));
    assert!(gpu0.uuid().is_ok());

    // Recovery.
    fake_nvml::write_lost(&fake.state, &[]).unwrap();
    assert_eq!(gpu1.uuid().unwrap(), u1);
    assert_eq!(mig1.name().unwrap(), "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
    assert!(matches!(set.wait(10), Err(NvmlError::Timeout)));
}

#[test]
fn no_state_dir_means_no_injection() {
    let fake = Fake::new(&example("t4.toml"));
    fake.set_env(Some(&fake.machine), None);
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    let set = d
        .register_events(EventTypes::CRITICAL_XID_ERROR, nvml.create_event_set().unwrap())
        .unwrap();
    assert!(matches!(set.wait(5), Err(NvmlError::Timeout)));
    assert!(d.running_compute_processes().unwrap().is_empty());
    assert!(matches!(
        d.register_events(EventTypes::MIG_CONFIG_CHANGE, nvml.create_event_set().unwrap()),
        Err(e) if matches!(e.error, NvmlError::NotSupported)
    ));
}
