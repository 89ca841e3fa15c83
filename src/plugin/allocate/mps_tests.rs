//! Allocate with MPS: what a replica's container gets while its control daemon runs, and the
//! refusal while it does not (the daemons' own tests are in `plugin::mps`).

use super::*;
use crate::api::ContainerAllocateRequest;
use crate::config::MigStrategy;
use crate::devices::Health;
use crate::edits::DeviceNodes;
use crate::plugin::mps::tests::{board, entry, mps, running, two_a100s};
use crate::plugin::mps::{DaemonState, DaemonWatch, MpsAllocate, plan};
use crate::plugin::sharing::apply_sharing;
use crate::plugin::strategy::build_resources;

fn allocate_ids(ids: &[&str], strategies: &[DeviceListStrategy]) -> ContainerAllocateResponse {
    let sharing = mps(vec![entry(4)]);
    let inv = two_a100s();
    let daemons = plan(&inv, &sharing, MigStrategy::None).expect("plan");
    let resources =
        apply_sharing(build_resources(&inv, MigStrategy::None).expect("resources"), &sharing).expect("sharing");
    let opts = AllocateOptions {
        strategies: strategies.to_vec(),
        mps: running(&daemons),
        ..AllocateOptions::default()
    };
    let req = ContainerAllocateRequest {
        devices_ids: ids.iter().map(|s| (*s).to_string()).collect(),
    };
    allocate(&resources[0], &req, &opts, &DeviceNodes::default()).expect("allocate")
}

#[test]
fn allocate_gives_the_pipe_shm_and_limits() {
    let resp = allocate_ids(&["GPU-1::2"], &[DeviceListStrategy::Envvar]);
    assert_eq!(
        sorted_envs(&resp),
        [
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=10240M"),
            ("CUDA_MPS_PIPE_DIRECTORY", "/mps/nvidia.com/gpu/pipe"),
            ("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
        ]
    );
    let mounts: Vec<(&str, &str, bool)> = resp
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.read_only))
        .collect();
    assert_eq!(
        mounts,
        [
            ("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe", false),
            ("/dev/shm", "/run/nvidia/mps/shm", false),
        ]
    );
    // With CDI the spec carries the devices, but MPS still comes with the answer.
    let resp = allocate_ids(&["GPU-0::0"], &[DeviceListStrategy::CdiCri]);
    assert_eq!(resp.envs["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");
    assert_eq!(resp.mounts.len(), 2);
}

/// Replicas whose daemon does not answer (no status yet, starting, restarting, failed) are
/// unhealthy and refused by `Allocate` with the resource, the GPU and the state; once it runs
/// they are healthy and allocated. Resources without a daemon are left alone.
#[test]
fn replicas_are_ready_only_while_their_daemon_runs() {
    let sharing = mps(vec![entry(4)]);
    let inv = two_a100s();
    let daemons = plan(&inv, &sharing, MigStrategy::None).expect("plan");
    let resources =
        apply_sharing(build_resources(&inv, MigStrategy::None).expect("resources"), &sharing).expect("sharing");
    let resource = &resources[0];
    let request = ContainerAllocateRequest {
        devices_ids: vec!["GPU-1::2".to_string()],
    };
    let cases = [
        (MpsAllocate::new(&daemons, DaemonWatch::default()), "state: not started"),
        (
            MpsAllocate::new(&daemons, board(&daemons, DaemonState::Starting, None).watch()),
            "state: starting)",
        ),
        (
            MpsAllocate::new(
                &daemons,
                board(&daemons, DaemonState::Restarting, Some("exited with signal: 9")).watch(),
            ),
            "state: restarting: exited with signal: 9)",
        ),
        (
            MpsAllocate::new(
                &daemons,
                board(&daemons, DaemonState::Failed, Some("nvidia-cuda-mps-control not found")).watch(),
            ),
            "state: failed: nvidia-cuda-mps-control not found)",
        ),
    ];
    for (mps, state) in cases {
        let mut advertised = resource.clone();
        mps.apply_health(&mut advertised);
        assert_eq!(advertised.devices.len(), 8);
        assert!(
            advertised.devices.values().all(|d| d.health == Health::Unhealthy),
            "{state}"
        );
        let opts = AllocateOptions {
            mps,
            ..AllocateOptions::default()
        };
        let err = allocate(resource, &request, &opts, &DeviceNodes::default()).expect_err(state);
        let text = err.to_string();
        for part in [
            "nvidia.com/gpu replica GPU-1::2 (GPU 1, GPU-1)",
            "MPS control daemon for nvidia.com/gpu does not answer on its pipe /run/nvidia/mps/nvidia.com/gpu/pipe",
            state,
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
    }
    let ready = running(&daemons);
    let mut advertised = resource.clone();
    ready.apply_health(&mut advertised);
    assert_eq!(&advertised, resource, "a running daemon leaves health as it was");
    let opts = AllocateOptions {
        mps: ready,
        ..AllocateOptions::default()
    };
    let resp = allocate(resource, &request, &opts, &DeviceNodes::default()).expect("allocate");
    assert_eq!(resp.envs["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");

    // A resource no daemon serves: untouched even while the daemon starts.
    let starting = MpsAllocate::new(&daemons, board(&daemons, DaemonState::Starting, None).watch());
    let whole = build_resources(&inv, MigStrategy::None).expect("resources");
    let mut other = whole[0].clone();
    other.name = "nvidia.com/other".into();
    let before = other.clone();
    starting.apply_health(&mut other);
    assert_eq!(other, before);
    let opts = AllocateOptions {
        mps: starting,
        ..AllocateOptions::default()
    };
    let request = ContainerAllocateRequest {
        devices_ids: vec!["GPU-0".to_string()],
    };
    allocate(&other, &request, &opts, &DeviceNodes::default()).expect("a device of another resource");
}
