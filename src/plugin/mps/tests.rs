use std::collections::BTreeMap;

use super::*;
use crate::config::{SharedDevices, SharedResource};
use crate::nvml::GpuInfo;
use crate::nvml::sample::{self, inventory};
use crate::plugin::sharing::{SharingError, apply_sharing};

pub(crate) fn entry(replicas: u32) -> SharedResource {
    SharedResource::new("gpu", replicas)
}

pub(crate) fn mps(resources: Vec<SharedResource>) -> Sharing {
    Sharing {
        strategy: SharingStrategy::Mps,
        resources,
        ..Sharing::default()
    }
}

pub(crate) fn two_a100s() -> Inventory {
    inventory(vec![sample::a100(0), sample::a100(1)])
}

#[test]
fn one_daemon_per_shared_resource_with_nvidias_defaults() {
    let plans = plan(&two_a100s(), &mps(vec![entry(4)]), MigStrategy::None).expect("plan");
    assert_eq!(plans.len(), 1);
    let d = &plans[0];
    assert_eq!(d.resource, "nvidia.com/gpu");
    // NVIDIA's Root.PipeDir: the full resource name is the folder path.
    assert_eq!(d.pipe_dir, Path::new("/run/nvidia/mps/nvidia.com/gpu/pipe"));
    assert_eq!(d.log_dir, Path::new("/run/nvidia/mps/nvidia.com/gpu/log"));
    assert_eq!(d.started_file, Path::new("/run/nvidia/mps/nvidia.com/gpu/.started"));
    assert_eq!(d.shm_dir, Path::new("/run/nvidia/mps/shm"));
    assert_eq!(d.active_thread_percentage, 25);
    // 40960 MiB / 4 replicas, per GPU by its ordinal under CUDA_VISIBLE_DEVICES.
    assert_eq!(
        d.control_commands(),
        [
            "set_default_device_pinned_mem_limit 0 10240M",
            "set_default_device_pinned_mem_limit 1 10240M",
            "set_default_active_thread_percentage 25",
        ]
    );
    let env = d.env(Path::new("/tmp/r"));
    assert_eq!(
        env,
        [
            (
                PIPE_ENV.to_string(),
                "/tmp/r/run/nvidia/mps/nvidia.com/gpu/pipe".to_string()
            ),
            (
                LOG_ENV.to_string(),
                "/tmp/r/run/nvidia/mps/nvidia.com/gpu/log".to_string()
            ),
            ("CUDA_VISIBLE_DEVICES".to_string(), "GPU-0,GPU-1".to_string()),
        ]
    );
    assert_eq!(d.container_pipe_dir(), "/mps/nvidia.com/gpu/pipe");
}

#[test]
fn limits_from_the_config_and_per_gpu_counts() {
    let mut e = entry(2);
    e.devices = SharedDevices::List(vec!["1".into()]);
    e.memory_per_replica = Some(MemoryBudget::Mib(8000));
    e.active_thread_percentage = Some(30);
    e.rename = "gpu-mps".into();
    let sharing = Sharing {
        mps_root: "/var/mps".into(),
        ..mps(vec![e])
    };
    let plans = plan(&two_a100s(), &sharing, MigStrategy::None).expect("plan");
    let d = &plans[0];
    assert_eq!(d.resource, "nvidia.com/gpu-mps");
    assert_eq!(d.pipe_dir, Path::new("/var/mps/nvidia.com/gpu-mps/pipe"));
    // Only GPU 1 is shared; it is ordinal 0 to its daemon.
    assert_eq!(d.gpus.len(), 1);
    assert_eq!((d.gpus[0].index, d.gpus[0].ordinal), (1, 0));
    assert_eq!(
        d.control_commands(),
        [
            "set_default_device_pinned_mem_limit 0 8000M",
            "set_default_active_thread_percentage 30",
        ]
    );

    // Per-GPU counts: each GPU's own limit, the daemon's default the smallest share.
    let mut e = entry(2);
    e.replicas_per_gpu.insert("GPU-1".into(), 5);
    let d = plan(&two_a100s(), &mps(vec![e]), MigStrategy::None)
        .expect("plan")
        .remove(0);
    assert_eq!(d.gpus[0].memory_limit_mib, Some(20480));
    assert_eq!(d.gpus[1].memory_limit_mib, Some(8192));
    assert_eq!(d.gpus[1].active_thread_percentage, 20);
    assert_eq!(d.active_thread_percentage, 20);
}

#[test]
fn nothing_without_mps_or_without_replicas() {
    let time_slicing = Sharing {
        strategy: SharingStrategy::TimeSlicing,
        ..mps(vec![entry(4)])
    };
    assert!(
        plan(&two_a100s(), &time_slicing, MigStrategy::None)
            .expect("plan")
            .is_empty()
    );
    assert!(
        plan(&two_a100s(), &mps(vec![entry(1)]), MigStrategy::None)
            .expect("plan")
            .is_empty()
    );
}

#[test]
fn mig_devices_are_refused() {
    let gpu = GpuInfo {
        mig: Some(sample::mig(true)),
        mig_devices: sample::mig_devices(0, &["1g.5gb", "1g.5gb"]),
        ..sample::a100(0)
    };
    let inv = inventory(vec![gpu]);
    let err = plan(&inv, &mps(vec![entry(2)]), MigStrategy::Single).expect_err("MIG");
    assert!(
        err.to_string()
            .contains("sharing using MPS is not supported for MIG devices"),
        "{err}"
    );
    // The advertised resources fail alike, so nothing is advertised.
    let resources = build_resources(&inv, MigStrategy::Single).expect("resources");
    let err = apply_sharing(resources, &mps(vec![entry(2)])).expect_err("MIG");
    assert!(matches!(err, SharingError::MpsOnMig { .. }), "{err}");
    assert!(err.to_string().contains("MIG-0-0"), "{err}");
}

/// A board with `daemons` in `state` (and `error`).
pub(crate) fn board(daemons: &[MpsDaemon], state: DaemonState, error: Option<&str>) -> DaemonBoard {
    let board = DaemonBoard::new();
    for d in daemons {
        board.insert(DaemonStatus {
            resource: d.resource.clone(),
            state,
            pid: None,
            pipe_dir: d.pipe_dir.display().to_string(),
            gpus: d.gpus.iter().map(|g| g.uuid.clone()).collect(),
            restarts: 0,
            error: error.map(str::to_string),
        });
    }
    board
}

pub(crate) fn running(daemons: &[MpsDaemon]) -> MpsAllocate {
    MpsAllocate::new(daemons, board(daemons, DaemonState::Running, None).watch())
}

#[test]
fn allocate_leaves_other_resources_alone() {
    let resource = Resource {
        name: "nvidia.com/other".into(),
        devices: BTreeMap::new(),
    };
    let daemons = plan(&two_a100s(), &mps(vec![entry(4)]), MigStrategy::None).expect("plan");
    let edits = mps_edits(&running(&daemons), &resource, &["GPU-0::0".into()]);
    assert_eq!(edits, ContainerEdits::default());
}

/// The Landlock rights handled are every file system right of the kernel's ABI.
#[test]
fn landlock_handles_every_file_system_right_of_the_abi() {
    use super::contain::landlock_access_for;
    assert_eq!(landlock_access_for(1), 0x1fff);
    assert_eq!(landlock_access_for(2), 0x3fff, "and REFER");
    assert_eq!(landlock_access_for(3), 0x7fff, "and TRUNCATE");
    assert_eq!(landlock_access_for(4), 0x7fff, "ABI 4 brought network rights only");
    assert_eq!(landlock_access_for(5), 0xffff, "and IOCTL_DEV");
    assert_eq!(
        landlock_access_for(7),
        0xffff,
        "ABIs 6 and 7 brought no file system right"
    );
}
