//! Inventory, topology, init/shutdown and non-MIG behaviour through the real nvml-wrapper.

mod common;

use std::collections::HashSet;
use std::ffi::{CStr, c_uint};

use common::*;
use nvml_wrapper::enum_wrappers::device::{Brand, TemperatureSensor, TopologyLevel};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::PciInfo;
use nvml_wrapper_sys::bindings::{NvmlLib, nvmlMemory_t, nvmlMemory_v2_t};

#[test]
fn dgx_a100_inventory() {
    let fake = Fake::new(&example("dgx-a100.toml"));
    let nvml = fake.init();
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.550.54.15");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12040);
    assert_eq!(nvml.device_count().unwrap(), 8);

    let mut uuids = HashSet::new();
    for i in 0..8 {
        let d = nvml.device_by_index(i).unwrap();
        assert_eq!(d.name().unwrap(), "NVIDIA A100-SXM4-40GB");
        let uuid = d.uuid().unwrap();
        assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
        assert!(uuids.insert(uuid.clone()));
        assert_eq!(d.index().unwrap(), i);
        assert_eq!(d.minor_number().unwrap(), i);
        assert_eq!(d.numa_node_id().unwrap(), i / 4);
        let mem = d.memory_info().unwrap();
        assert_eq!(mem.total, 40960 * 1024 * 1024);
        // The driver's reserve (the model's, 634 MiB) is neither used nor free.
        assert_eq!(mem.reserved, 634 * 1024 * 1024);
        assert_eq!((mem.used, mem.free), (0, mem.total - mem.reserved));
        let cc = d.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), (8, 0));
        assert_eq!(d.architecture().unwrap(), DeviceArchitecture::Ampere);
        assert_eq!(d.brand().unwrap(), Brand::Nvidia);
        assert_eq!(d.serial().unwrap().len(), 13);
        assert!(d.temperature(TemperatureSensor::Gpu).unwrap() > 20);
        assert!(d.power_usage().unwrap() > 10_000);
        let u = d.utilization_rates().unwrap();
        assert_eq!((u.gpu, u.memory), (0, 0));
        assert!(d.total_energy_consumption().unwrap() > 0);
        assert_eq!(d.mig_mode().unwrap().current, 0);
        assert_eq!(d.mig_device_count().unwrap(), 0);
        assert!(!d.mig_is_mig_device_handle().unwrap());

        // handle lookups agree
        let by_uuid = nvml.device_by_uuid(uuid.as_str()).unwrap();
        assert_eq!(by_uuid.index().unwrap(), i);
        let pci = d.pci_info().unwrap();
        assert_eq!(pci.pci_device_id, 0x20B0_10DE);
        assert_eq!(pci.pci_sub_system_id, Some(0x134F_10DE));
        assert_eq!(
            nvml.device_by_pci_bus_id(pci.bus_id.as_str()).unwrap().index().unwrap(),
            i
        );

        // 7 NVLink peers (one link each), the rest disabled, 18+ invalid
        for link in 0..7 {
            let l = d.link_wrapper_for(link);
            assert!(l.is_active().unwrap());
            let remote: PciInfo = l.remote_pci_info().unwrap();
            assert_ne!(remote.bus_id, pci.bus_id);
            assert_eq!(remote.pci_device_id, 0x20B0_10DE);
        }
        assert!(!d.link_wrapper_for(7).is_active().unwrap());
        assert!(matches!(d.link_wrapper_for(18).is_active(), Err(NvmlError::InvalidArg)));
    }

    let first = nvml.device_by_index(0).unwrap();
    let pci = first.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:07:00.0");
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 7, 0));
    assert_eq!(nvml.device_by_pci_bus_id("0000:07:00.0").unwrap().index().unwrap(), 0);
    assert!(matches!(
        nvml.device_by_pci_bus_id("0000:99:00.0"),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(nvml.device_by_uuid("GPU-nope"), Err(NvmlError::NotFound)));
    assert!(matches!(nvml.device_by_index(8), Err(NvmlError::InvalidArg)));

    let level = |a: u32, b: u32| {
        let x = nvml.device_by_index(a).unwrap();
        let y = nvml.device_by_index(b).unwrap();
        x.topology_common_ancestor(y).unwrap()
    };
    assert_eq!(level(0, 0), TopologyLevel::Internal);
    assert_eq!(level(0, 1), TopologyLevel::Single);
    assert_eq!(level(0, 2), TopologyLevel::Node);
    assert_eq!(level(0, 4), TopologyLevel::System);
    assert_eq!(level(6, 7), TopologyLevel::Single);

    // MIG-capable but disabled: creation is NOT_SUPPORTED, profile info still answers.
    let info = first.profile_info(0).unwrap();
    assert_eq!((info.id, info.instance_count, info.memory_size_mb), (19, 7, 4864));
    assert_eq!(create_gi(&nvml, &first, 19).0, NOT_SUPPORTED);
    let (rc, list) = placements(&nvml, &first, 9);
    assert_eq!((rc, list), (SUCCESS, vec![(0, 4), (4, 4)]));
}

#[test]
fn pcie_paths_boards_and_nvswitch_links() {
    let machine = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040
[[nvswitch]]
pci_bus_id = "0000:c0:00.0"
pci_device_id = 0x22a3
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb0", "sw0", "sw1"]
nvlink_peers = ["0000:c0:00.0", "0000:c0:00.0", "0000:11:00.0"]
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb0", "sw0", "sw2"]
nvlink_peers = ["0000:10:00.0"]
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb0", "sw0", "sw1"]
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb0", "sw3"]
pcie_board = "b"
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb1"]
pcie_board = "b"
[[gpu]]
model = "H100-80GB-HBM3"
numa_node = 0
pcie_path = ["hb1"]
"#;
    let fake = Fake::new(machine);
    let nvml = fake.init();
    let level = |a: u32, b: u32| {
        let x = nvml.device_by_index(a).unwrap();
        let y = nvml.device_by_index(b).unwrap();
        x.topology_common_ancestor(y).unwrap()
    };
    assert_eq!(level(0, 2), TopologyLevel::Single);
    assert_eq!(level(0, 1), TopologyLevel::Multiple);
    assert_eq!(level(0, 3), TopologyLevel::HostBridge);
    assert_eq!(level(3, 4), TopologyLevel::Internal);
    assert_eq!(level(0, 5), TopologyLevel::Node);
    assert_eq!(level(4, 5), TopologyLevel::HostBridge);

    // Links into the NVSwitch report the switch: its address and its device id.
    let d = nvml.device_by_index(0).unwrap();
    for link in 0..2 {
        let remote: PciInfo = d.link_wrapper_for(link).remote_pci_info().unwrap();
        assert_eq!(remote.bus_id, "00000000:C0:00.0");
        assert_eq!(remote.pci_device_id, 0x22A3_10DE);
    }
    let remote: PciInfo = d.link_wrapper_for(2).remote_pci_info().unwrap();
    assert_eq!(remote.bus_id, "00000000:11:00.0");
    assert_eq!(
        remote.pci_device_id,
        nvml.device_by_index(1).unwrap().pci_info().unwrap().pci_device_id
    );
    assert!(!d.link_wrapper_for(3).is_active().unwrap());
}

#[test]
fn memory_info_v1_and_version_check() {
    let fake = Fake::new(&example("t4.toml"));
    let nvml = fake.init();
    let d = nvml.device_by_index(0).unwrap();
    let mut m1: nvmlMemory_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetMemoryInfo)(handle(&d), &mut m1) },
        SUCCESS
    );
    assert_eq!(m1.total, 15360 * 1024 * 1024);
    let mut m2: nvmlMemory_v2_t = unsafe { std::mem::zeroed() };
    m2.version = 1;
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetMemoryInfo_v2)(handle(&d), &mut m2) },
        25
    );
    // short string buffers
    let mut buf = [0 as std::ffi::c_char; 8];
    let rc = unsafe { sym!(nvml, nvmlDeviceGetUUID)(handle(&d), buf.as_mut_ptr(), buf.len() as c_uint) };
    assert_eq!(rc, INSUFFICIENT_SIZE);
    // bad handle
    let mut count: c_uint = 0;
    let bogus = 0x1234usize as nvml_wrapper_sys::bindings::nvmlDevice_t;
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetMaxMigDeviceCount)(bogus, &mut count) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { sym!(nvml, nvmlDeviceGetMaxMigDeviceCount)(handle(&d), std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
}

#[test]
fn t4_has_no_mig_and_no_nvlink() {
    let fake = Fake::new(&example("t4.toml"));
    let nvml = fake.init();
    assert_eq!(nvml.sys_driver_version().unwrap(), "535.183.01");
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.name().unwrap(), "Tesla T4");
    assert_eq!(d.uuid().unwrap(), "GPU-5a4b9c3e-0f1d-4e2a-8b7c-6d5e4f3a2b1c");
    assert_eq!(d.pci_info().unwrap().pci_device_id, 0x1EB8_10DE);
    assert_eq!(d.architecture().unwrap(), DeviceArchitecture::Turing);
    let cc = d.cuda_compute_capability().unwrap();
    assert_eq!((cc.major, cc.minor), (7, 5));
    assert!(matches!(d.numa_node_id(), Err(NvmlError::NotSupported)));
    assert!(matches!(d.mig_mode(), Err(NvmlError::NotSupported)));
    assert!(matches!(d.set_mig_mode(true), Err(NvmlError::NotSupported)));
    assert!(matches!(d.profile_info(0), Err(NvmlError::NotSupported)));
    assert_eq!(d.mig_device_count().unwrap(), 0);
    assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotSupported)));
    assert_eq!(create_gi(&nvml, &d, 19).0, NOT_SUPPORTED);
    assert_eq!(placements(&nvml, &d, 19).0, NOT_SUPPORTED);
    assert_eq!(gi_profile_v(&nvml, &d, 0).0, NOT_SUPPORTED);
    assert!(matches!(
        d.link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
    let events = d.supported_event_types().unwrap();
    assert_eq!(events.bits(), 0x8 | 0x1 | 0x2);
}

#[test]
fn missing_or_bad_machine_is_driver_not_loaded() {
    let fake = Fake::new("driver_version = \"1\"\ncuda_driver_version = 12040\n");
    fake.set_env(None, None);
    assert!(matches!(fake.try_init(), Err(NvmlError::DriverNotLoaded)));
    let missing = fake.dir.path().join("nope.toml");
    fake.set_env(Some(&missing), None);
    assert!(matches!(fake.try_init(), Err(NvmlError::DriverNotLoaded)));
    std::fs::write(
        &fake.machine,
        "driver_version = \"1\"\ncuda_driver_version = 12040\nbogus = true\n",
    )
    .unwrap();
    fake.set_env(Some(&fake.machine), None);
    assert!(matches!(fake.try_init(), Err(NvmlError::DriverNotLoaded)));
    // a good machine without a state dir works (state in memory only)
    std::fs::write(&fake.machine, example("t4.toml")).unwrap();
    let nvml = fake.init();
    assert_eq!(nvml.device_count().unwrap(), 1);
}

#[test]
fn init_is_ref_counted_and_calls_need_init() {
    let fake = Fake::new(&example("t4.toml"));
    // SAFETY: loading the fake runs no initializers with preconditions.
    let lib = unsafe { NvmlLib::new(lib_path()) }.unwrap();
    let count = lib.nvmlDeviceGetCount_v2.as_ref().unwrap();
    let init = lib.nvmlInit_v2.as_ref().unwrap();
    let shutdown = lib.nvmlShutdown.as_ref().unwrap();
    let error_string = lib.nvmlErrorString.as_ref().unwrap();
    let mut n: c_uint = 0;
    unsafe {
        assert_eq!(count(&mut n), 1); // UNINITIALIZED
        assert_eq!(init(), SUCCESS);
        assert_eq!(init(), SUCCESS);
        assert_eq!(shutdown(), SUCCESS);
        assert_eq!(count(&mut n), SUCCESS);
        assert_eq!(n, 1);
        assert_eq!(shutdown(), SUCCESS);
        assert_eq!(count(&mut n), 1);
        assert_eq!(shutdown(), SUCCESS);
        assert_eq!(
            CStr::from_ptr(error_string(GPU_IS_LOST)).to_str().unwrap(),
            "GPU is lost"
        );
    }
    drop(fake);
}
