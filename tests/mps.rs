//! MPS sharing end to end: a device-plugin profile with `strategy = "mps"`, selected by the
//! `nvidia.com/device-plugin.config` label, makes the real binary run the MPS control daemon
//! (the fake `nvidia-cuda-mps-control`, built with the workspace) with NVIDIA's limits, set the
//! GPUs' compute mode (the fake NVML's state), advertise the replicas to the test kubelet and
//! hand containers the daemon's pipe folder; switching the profile off, or stopping the agent,
//! quits the daemon and sets compute mode DEFAULT back.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Node, gpu_uuid, machine};
use gpu_node_agent::plugin::mps::DaemonState;
use gpu_node_agent::status::{StageId, StageState};
use test_apiserver::TestApiServer;
use test_kubelet::TestKubelet;

const T: Duration = Duration::from_secs(20);
const NODE: &str = common::NODE_NAME;
const PROFILE: &str = "nvidia.com/device-plugin.config";
const GPU: &str = "nvidia.com/gpu";
/// The daemon's folders under the node's root (NVIDIA's `<mpsRoot>/<resource>/...`).
const PIPE: &str = "run/nvidia/mps/nvidia.com/gpu/pipe";
const LOG: &str = "run/nvidia/mps/nvidia.com/gpu/log";
const STARTED: &str = "run/nvidia/mps/nvidia.com/gpu/.started";

/// Profiles `mps` (4 MPS replicas per GPU) and `plain` (nothing shared).
const PROFILES: &str = "[device_plugin.profiles.mps.sharing]\nstrategy = \"mps\"\n\
     [[device_plugin.profiles.mps.sharing.resources]]\nname = \"gpu\"\nreplicas = 4\n\
     [device_plugin.profiles.plain.sharing]\nstrategy = \"none\"\n";

/// A node with two A100-40GB, the fake MPS control program installed, its API server (the Node
/// labelled `labels`) and kubelet.
async fn setup(config: &str, labels: &[(&str, &str)]) -> (TestApiServer, Node, TestKubelet) {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), config);
    let installed = fake_nvml::host::install_mps_control(&node.root).expect("install the MPS control program");
    assert!(
        installed,
        "fake-mps-control not found beside the test binary: build the workspace (cargo build --workspace)"
    );
    node.install_toolkit_runtime();
    let (api, kubelet) = common::api_server_and_kubelet(&node, labels).await;
    (api, node, kubelet)
}

/// Each GPU's compute mode as the fake NVML keeps it (0 DEFAULT, 3 EXCLUSIVE_PROCESS).
fn compute_modes(node: &Node) -> Vec<u64> {
    let text = std::fs::read_to_string(node.state.join("state.json")).unwrap_or_default();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    state["gpus"]
        .as_array()
        .map(|gpus| gpus.iter().map(|g| g["compute_mode"].as_u64().unwrap_or(0)).collect())
        .unwrap_or_default()
}

fn path(node: &Node, rel: &str) -> PathBuf {
    node.root.join(rel)
}

/// Waits (up to [`T`]) for `done`; panics saying `what` did not happen.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn log_text(node: &Node) -> String {
    std::fs::read_to_string(path(node, LOG).join("control.log")).unwrap_or_default()
}

/// The daemon's control socket answers (the fake listens on `<pipe>/control`).
fn daemon_listening(pipe: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(pipe.join("control")).is_ok()
}

/// The daemon runs in a mount namespace of its own (`<mps_root>/shm` as its `/dev/shm`), which
/// needs root; CI runs as root.
fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs the MPS control daemon in a mount namespace of its own and needs root (CI runs as root)"
    );
}

/// The shared-memory file the fake daemon keeps in its `/dev/shm` while it runs.
fn shm_segment(pipe: &Path) -> String {
    let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).unwrap_or_default();
    format!("cuda.shm.fake-mps.{}", pid.trim())
}

/// The device plugin stage's detail line (`""` without one).
fn device_plugin_detail(node: &Node) -> String {
    common::stage_detail(&node.status(), StageId::DevicePlugin)
        .unwrap_or_default()
        .to_string()
}

const HEALTHY: &str = "Healthy";
const UNHEALTHY: &str = "Unhealthy";

/// All 8 replicas (2 GPUs × 4) listed, every one with `health`.
fn all(devices: &[test_kubelet::api::Device], health: &str) -> bool {
    devices.len() == 8 && devices.iter().all(|d| d.health == health)
}

/// The fake daemon's knob (see `fake-mps-control`): while this file is in its pipe folder, a
/// daemon that starts does not answer.
fn hold_file(node: &Node) -> PathBuf {
    path(node, PIPE).join("fake-hold")
}

/// The daemon's pid from the device-plugin stage's detail, while it runs.
fn daemon_pid(node: &Node) -> Option<String> {
    let detail = device_plugin_detail(node);
    let rest = detail.split("MPS nvidia.com/gpu: running (pid ").nth(1)?;
    Some(rest.split(')').next()?.to_string())
}

/// Asserts that Allocate refuses replica 2 of GPU 1 naming the resource, the GPU and the
/// daemon's state (one of `states`), and returns the message.
async fn assert_refused_not_ready(kubelet: &TestKubelet, states: &[&str]) -> String {
    let one = format!("{}::2", gpu_uuid(1));
    let refused = kubelet
        .allocate(GPU, &[&one])
        .await
        .expect_err("a replica whose daemon does not answer");
    let message = refused.message().to_string();
    for part in [
        format!("nvidia.com/gpu replica {one} (GPU 1, {})", gpu_uuid(1)),
        "the MPS control daemon for nvidia.com/gpu does not answer on its pipe /run/nvidia/mps/nvidia.com/gpu/pipe"
            .to_string(),
    ] {
        assert!(message.contains(&part), "{part:?} not in {message}");
    }
    assert!(
        states.iter().any(|s| message.contains(&format!("(state: {s}"))),
        "none of the states {states:?} in {message}"
    );
    message
}

/// Waits (up to [`T`]) for a device list after the first `from` for which `pred` holds.
async fn wait_for_update(kubelet: &TestKubelet, from: usize, pred: impl Fn(&[test_kubelet::api::Device]) -> bool) {
    let deadline = Instant::now() + T;
    loop {
        let updates = kubelet.updates(GPU);
        if updates.iter().skip(from).any(|(_, d)| pred(d)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no such device list after the first {from}; lists since: {:?}",
            updates
                .iter()
                .skip(from)
                .map(|(_, d)| common::summary(d))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mps_profile_runs_the_control_daemon_and_allocate_points_at_it() {
    require_root();
    let (api, node, kubelet) = setup(PROFILES, &[(PROFILE, "mps")]).await;
    let agent = node.spawn();

    // 2 GPUs × 4 replicas under the resource's own name.
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    assert!(devices.iter().any(|d| d.id == format!("{}::3", gpu_uuid(1))));

    // The daemon: its pipe answers, its limits are NVIDIA's (40960 MiB / 4, 100 / 4), its GPUs
    // are in EXCLUSIVE_PROCESS, `.started` is there.
    let pipe = path(&node, PIPE);
    wait_until("the MPS control daemon listening", || daemon_listening(&pipe));
    // Its /dev/shm is the folder containers get as theirs, not the host's: MPS clients and
    // their server meet in shared memory there.
    let segment = shm_segment(&pipe);
    assert!(
        path(&node, "run/nvidia/mps/shm").join(&segment).exists(),
        "the daemon's shared memory is not in <mps_root>/shm"
    );
    assert!(
        !Path::new("/dev/shm").join(&segment).exists(),
        "the daemon's shared memory is in the host's /dev/shm"
    );
    wait_until("the limits in control.log", || {
        log_text(&node).contains("Cmd:set_default_active_thread_percentage 25")
    });
    let log = log_text(&node);
    for line in [
        "Cmd:set_default_device_pinned_mem_limit 0 10240M",
        "Cmd:set_default_device_pinned_mem_limit 1 10240M",
        "Cmd:set_default_active_thread_percentage 25",
    ] {
        assert!(log.contains(line), "{line} not in control.log:\n{log}");
    }
    wait_until("the .started file", || path(&node, STARTED).exists());
    assert_eq!(compute_modes(&node), [3, 3]);

    // Allocate: NVIDIA's pipe folder and /dev/shm, and the replica's limits (once the daemon
    // answers, which the replicas' health says).
    kubelet
        .wait_for_devices(GPU, T, |d| all(d, HEALTHY))
        .await
        .expect("8 healthy replicas");
    let one = format!("{}::2", gpu_uuid(1));
    let resp = kubelet.allocate(GPU, &[&one]).await.expect("one replica");
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], gpu_uuid(1));
    assert_eq!(resp.envs["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");
    assert_eq!(resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");
    assert_eq!(resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    let mounts: Vec<(&str, &str)> = resp
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.host_path.as_str()))
        .collect();
    assert_eq!(
        mounts,
        [
            ("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
            ("/dev/shm", "/run/nvidia/mps/shm"),
        ]
    );
    // MPS replicas are one per container, whatever the config says (NVIDIA forces it).
    let two = [format!("{}::0", gpu_uuid(0)), format!("{}::1", gpu_uuid(0))];
    let refused = kubelet
        .allocate(GPU, &[&two[0], &two[1]])
        .await
        .expect_err("two replicas");
    assert!(
        refused
            .message()
            .contains("maximum request size for shared resources is 1")
    );

    // The status says the daemon runs; the feature labels say MPS.
    // (The status file follows the daemon's state as the agent hears of it.)
    let status = node.wait_status(T, |s| {
        common::stage_detail(s, StageId::DevicePlugin).is_some_and(|d| d.contains("MPS nvidia.com/gpu: running (pid "))
    });
    let daemon = status.mps.first().expect("an MPS daemon in the status");
    assert_eq!(daemon.resource, "nvidia.com/gpu", "{daemon:?}");
    assert_eq!(daemon.state, DaemonState::Running, "{daemon:?}");
    assert_eq!(daemon.pipe_dir, "/run/nvidia/mps/nvidia.com/gpu/pipe");
    assert_eq!(daemon.gpus, [gpu_uuid(0), gpu_uuid(1)]);
    let shown = node.run(&["status"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("MPS control daemon nvidia.com/gpu: running, pid "),
        "{shown}"
    );
    for (key, value) in [
        ("nvidia.com/gpu.sharing-strategy", "mps"),
        ("nvidia.com/mps.capable", "true"),
        ("nvidia.com/gpu.replicas", "4"),
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB-SHARED"),
    ] {
        let ok = api
            .wait_for(T, |a| a.labels(NODE).get(key).map(String::as_str) == Some(value))
            .await;
        assert!(ok, "label {key} never became {value}; labels: {:?}", api.labels(NODE));
    }

    // The profile off: the daemon quits, compute mode DEFAULT again, whole GPUs advertised.
    api.set_label(NODE, PROFILE, Some("plain"));
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("2 GPUs");
    wait_until("the daemon quitting", || !daemon_listening(&pipe));
    wait_until("compute mode DEFAULT", || compute_modes(&node) == [0, 0]);
    assert!(!path(&node, STARTED).exists());
    assert!(log_text(&node).contains("Cmd:quit"));
    let resp = kubelet.allocate(GPU, &[&gpu_uuid(0)]).await.expect("a whole GPU");
    assert!(!resp.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{:?}", resp.envs);
    assert!(resp.mounts.is_empty(), "{:?}", resp.mounts);

    // On again, then the agent stops: the daemon quits with it and compute mode is DEFAULT.
    api.set_label(NODE, PROFILE, Some("mps"));
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas again");
    wait_until("the daemon listening again", || daemon_listening(&pipe));
    wait_until("compute mode EXCLUSIVE_PROCESS", || compute_modes(&node) == [3, 3]);
    assert_eq!(agent.stop(), 0);
    assert!(!daemon_listening(&pipe), "the daemon outlived the agent");
    assert_eq!(compute_modes(&node), [0, 0]);
    assert!(!path(&node, STARTED).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_dies_is_started_again() {
    require_root();
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    let pipe = path(&node, PIPE);
    wait_until("the MPS control daemon listening", || daemon_listening(&pipe));
    let pid_of = |node: &Node| -> Option<String> {
        let detail = device_plugin_detail(node);
        let rest = detail.split("MPS nvidia.com/gpu: running (pid ").nth(1)?;
        Some(rest.split(')').next()?.to_string())
    };
    wait_until("the daemon's pid in the status", || pid_of(&node).is_some());
    let first = pid_of(&node).expect("pid");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &first])
        .status()
        .expect("kill");
    assert!(killed.success());
    wait_until("a new daemon", || pid_of(&node).is_some_and(|pid| pid != first));
    wait_until("the new daemon listening", || daemon_listening(&pipe));
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Ok));
    assert_eq!(status.mps.first().map(|d| d.restarts), Some(1), "{:?}", status.mps);
    assert_eq!(agent.stop(), 0);
    assert_eq!(compute_modes(&node), [0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_control_program_the_stage_fails_naming_it() {
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (api, node, _kubelet) = setup(&config, &[]).await;
    std::fs::remove_file(node.root.join(fake_nvml::host::MPS_CONTROL_PATH)).expect("remove the program");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| {
        common::stage_error(s, StageId::DevicePlugin).is_some_and(|e| e.contains("nvidia-cuda-mps-control not found"))
    });
    let error = common::stage_error(&status, StageId::DevicePlugin)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("/usr/bin") && error.contains("nvidia.com/gpu"),
        "{error}"
    );
    assert_eq!(compute_modes(&node), [0, 0], "no GPU changed without a daemon");
    // One Warning Event says it, posted once.
    let posted = api
        .wait_for(T, |a| !common::events_with(a, "MpsDaemonFailed").is_empty())
        .await;
    assert!(posted, "no MpsDaemonFailed Event: {:?}", api.events());
    let events = common::events_with(&api, "MpsDaemonFailed");
    assert_eq!(events.len(), 1, "{events:?}");
    common::assert_event(
        &events[0],
        "Warning",
        &["nvidia-cuda-mps-control not found", "nvidia.com/gpu"],
    );
    assert_eq!(agent.stop(), 0);
}

/// Issue #33 (2): on a real H200 the kubelet got four healthy replicas, and made an Allocate,
/// before the daemon answered. Here the fake daemon is held before it listens: the replicas are
/// advertised, but unhealthy, and Allocate refuses them naming the daemon's state, until it
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_unhealthy_and_refused_until_the_daemon_answers() {
    require_root();
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    let pipe = path(&node, PIPE);
    std::fs::create_dir_all(&pipe).expect("pipe folder");
    std::fs::write(hold_file(&node), "").expect("hold the daemon");
    let agent = node.spawn();

    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    assert!(all(&devices, UNHEALTHY), "{:?}", common::summary(&devices));
    wait_until("the daemon started and held", || log_text(&node).contains("Held by"));
    assert!(!daemon_listening(&pipe));
    // Held past the supervisor's 30 s for a first answer, it would be restarting.
    assert_refused_not_ready(&kubelet, &["starting)", "restarting: "]).await;
    let status = node.status();
    assert_ne!(
        status.mps.first().map(|d| d.state),
        Some(DaemonState::Running),
        "{:?}",
        status.mps
    );
    let updates = kubelet.updates(GPU);
    assert!(
        updates.iter().all(|(_, d)| d.iter().all(|d| d.health == UNHEALTHY)),
        "a replica was advertised healthy before the daemon answered: {:?}",
        updates.iter().map(|(_, d)| common::summary(d)).collect::<Vec<_>>()
    );

    // The daemon answers: the replicas are healthy and allocated.
    std::fs::remove_file(hold_file(&node)).expect("release the daemon");
    kubelet
        .wait_for_devices(GPU, T, |d| all(d, HEALTHY))
        .await
        .expect("8 healthy replicas");
    assert!(daemon_listening(&pipe));
    let one = format!("{}::2", gpu_uuid(1));
    let resp = kubelet.allocate(GPU, &[&one]).await.expect("one replica");
    assert_eq!(resp.envs["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");
    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());
    assert_eq!(agent.stop(), 0);
}

/// Issue #33 (2): where the daemon cannot start at all, its replicas stayed advertised and
/// healthy while the stage failed. They are advertised unhealthy (the kubelet keeps them in the
/// node's capacity and schedules nothing there) and Allocate refuses them, until the program is
/// there and the daemon answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_control_program_the_replicas_are_unhealthy_until_it_can_start() {
    require_root();
    let config = format!(
        "[agent]\nretry_min = \"1s\"\nretry_max = \"2s\"\n[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}"
    );
    let (_api, node, kubelet) = setup(&config, &[]).await;
    std::fs::remove_file(node.root.join(fake_nvml::host::MPS_CONTROL_PATH)).expect("remove the program");
    let agent = node.spawn();
    node.wait_status(T, |s| {
        common::stage_error(s, StageId::DevicePlugin).is_some_and(|e| e.contains("nvidia-cuda-mps-control not found"))
    });
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    assert!(all(&devices, UNHEALTHY), "{:?}", common::summary(&devices));
    let message = assert_refused_not_ready(&kubelet, &["failed: "]).await;
    assert!(message.contains("nvidia-cuda-mps-control not found"), "{message}");

    // The driver's user space gets the program: the next attempt starts the daemon.
    let installed = fake_nvml::host::install_mps_control(&node.root).expect("install the MPS control program");
    assert!(installed);
    kubelet
        .wait_for_devices(GPU, T, |d| all(d, HEALTHY))
        .await
        .expect("8 healthy replicas");
    node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Ok));
    let one = format!("{}::2", gpu_uuid(1));
    kubelet.allocate(GPU, &[&one]).await.expect("one replica");
    assert_eq!(agent.stop(), 0);
    assert_eq!(compute_modes(&node), [0, 0]);
}

/// Issue #33 (2): a daemon that dies leaves its replicas unhealthy (and refused) until the
/// supervisor's restart answers. The restarted daemon is held so the test sees that state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_leaves_its_replicas_unhealthy_until_its_restart_answers() {
    require_root();
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| all(d, HEALTHY))
        .await
        .expect("8 healthy replicas");
    wait_until("the daemon's pid in the status", || daemon_pid(&node).is_some());
    let first = daemon_pid(&node).expect("pid");

    // Its restart will not answer until released.
    std::fs::write(hold_file(&node), "").expect("hold the next daemon");
    let seen = kubelet.updates(GPU).len();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &first])
        .status()
        .expect("kill");
    assert!(killed.success());
    wait_for_update(&kubelet, seen, |d| all(d, UNHEALTHY)).await;
    wait_until("the restarted daemon held", || {
        log_text(&node).matches("Held by").count() == 1
    });
    let message = assert_refused_not_ready(&kubelet, &["restarting: "]).await;
    assert!(message.contains("exited with signal: 9"), "{message}");

    let seen = kubelet.updates(GPU).len();
    std::fs::remove_file(hold_file(&node)).expect("release the daemon");
    wait_for_update(&kubelet, seen, |d| all(d, HEALTHY)).await;
    wait_until("the new daemon's pid in the status", || {
        daemon_pid(&node).is_some_and(|pid| pid != first)
    });
    assert!(daemon_listening(&path(&node, PIPE)));
    let one = format!("{}::2", gpu_uuid(1));
    kubelet.allocate(GPU, &[&one]).await.expect("one replica");
    let status = node.status();
    assert_eq!(status.mps.first().map(|d| d.restarts), Some(1), "{:?}", status.mps);
    assert_eq!(agent.stop(), 0);
}

#[test]
fn plan_shows_what_mps_would_do_and_does_nothing() {
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let node = Node::new(&machine("A100-SXM4-40GB", 2), &config);
    let out = node.run(&["plan"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "MPS control daemons (nvidia-cuda-mps-control -f, compute mode EXCLUSIVE_PROCESS):",
        &format!("  nvidia.com/gpu: GPU(s) 0 ({}), 1 ({})", gpu_uuid(0), gpu_uuid(1)),
        "    pipe /run/nvidia/mps/nvidia.com/gpu/pipe, log /run/nvidia/mps/nvidia.com/gpu/log",
        "    set_default_device_pinned_mem_limit 1 10240M",
        "    set_default_active_thread_percentage 25",
    ] {
        assert!(stdout.contains(line), "{line:?} not in:\n{stdout}");
    }
    let out = node.run(&["plan", "--json"]);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json parses");
    let daemon = &plan["mps"]["plan"][0];
    assert_eq!(daemon["resource"], "nvidia.com/gpu");
    assert_eq!(daemon["commands"][2], "set_default_active_thread_percentage 25");
    // Nothing was started or changed.
    assert!(!path(&node, PIPE).exists());
    assert_eq!(compute_modes(&node), [0, 0]);
}

/// Every file under `dir` with its content (links as `-> target`), to see that nothing changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let meta = std::fs::symlink_metadata(&p).expect("stat");
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&p).expect("readlink");
                out.push((p, format!("-> {}", target.display())));
            } else if meta.is_dir() {
                out.push((p.clone(), "dir".to_string()));
                todo.push(p);
            } else {
                out.push((p.clone(), std::fs::read_to_string(&p).unwrap_or_else(|_| "?".into())));
            }
        }
    }
    out.sort();
    out
}

/// Tenants get the pipe folder and `<mps_root>/shm` read-write: an entry planted where the agent
/// expects its folders or its `.started` file must not lead the agent (or its root daemon) to a
/// host folder outside the MPS root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_planted_in_the_mps_folders_are_not_followed() {
    require_root();
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    // The canary: a host folder outside the node's root.
    let canary = node.tmp.path().join("canary");
    std::fs::create_dir_all(&canary).expect("canary");
    std::fs::write(canary.join("keep"), "canary\n").expect("canary file");
    let before = snapshot(&canary);
    let resource_dir = path(&node, "run/nvidia/mps/nvidia.com/gpu");
    std::fs::create_dir_all(&resource_dir).expect("resource folder");
    std::os::unix::fs::symlink(&canary, path(&node, PIPE)).expect("plant the pipe folder");
    std::os::unix::fs::symlink(&canary, path(&node, "run/nvidia/mps/shm")).expect("plant the shm folder");
    std::os::unix::fs::symlink(canary.join("started"), path(&node, STARTED)).expect("plant .started");

    // The pipe folder a link: the daemon does not start, and the error names the folder.
    let agent = node.spawn();
    let status = node.wait_status(T, |s| {
        s.mps
            .first()
            .and_then(|d| d.error.as_deref())
            .is_some_and(|e| e.contains("/run/nvidia/mps/"))
    });
    let error = status
        .mps
        .first()
        .and_then(|d| d.error.as_deref())
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("symbolic link"), "{error}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(snapshot(&canary), before, "the canary folder changed");
    assert_ne!(
        status.mps.first().map(|d| d.state),
        Some(DaemonState::Running),
        "{:?}",
        status.mps
    );
    assert_eq!(agent.stop(), 0);
    assert_eq!(snapshot(&canary), before, "the canary folder changed");

    // The folders real again but `.started` still a link: the agent replaces the link with its
    // own file, and removes that at the end; the link's target is never created.
    std::fs::remove_file(path(&node, PIPE)).expect("unplant the pipe folder");
    std::fs::remove_file(path(&node, "run/nvidia/mps/shm")).expect("unplant the shm folder");
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    wait_until("the .started file", || {
        std::fs::symlink_metadata(path(&node, STARTED)).is_ok_and(|m| m.is_file())
    });
    wait_until("the MPS control daemon listening", || {
        daemon_listening(&path(&node, PIPE))
    });
    assert_eq!(agent.stop(), 0);
    assert!(
        std::fs::symlink_metadata(path(&node, STARTED)).is_err(),
        ".started left"
    );
    assert_eq!(snapshot(&canary), before, "the canary folder changed");
}

/// Waits for the contained fake daemon to listen and write `<log>/probe.log` (what it could
/// open of the paths `<pipe>/fake-probe` lists), and returns that log.
async fn probe_log(node: &Node, kubelet: &TestKubelet) -> String {
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    let pipe = path(node, PIPE);
    wait_until("the MPS control daemon listening", || daemon_listening(&pipe));
    let probe_log = path(node, LOG).join("probe.log");
    wait_until("probe.log", || probe_log.exists());
    std::fs::read_to_string(&probe_log).expect("probe.log")
}

/// What the probe log says of path `p`.
fn probe_result(log: &str, p: &str) -> String {
    log.lines()
        .find_map(|l| l.strip_prefix(p).and_then(|r| r.strip_prefix('\t')))
        .unwrap_or_else(|| panic!("{p} not in probe.log:\n{log}"))
        .to_string()
}

/// The daemon runs as root on what tenants write into its folders: it sees the driver's user
/// space, its pipe, log and shm folders, and nothing else of the host. The fake daemon tries
/// the paths the test lists in `<pipe>/fake-probe` and writes what happened to
/// `<log>/probe.log`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_cannot_read_the_hosts_files() {
    require_root();
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    let secret = node.tmp.path().join("secret");
    std::fs::write(&secret, "s3cret\n").expect("secret");
    // A driver library, as the daemon sees it: under the driver root (the node's root here).
    let libcuda = std::fs::read_dir(path(&node, "usr/lib"))
        .expect("usr/lib")
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcuda.so."))
        })
        .expect("libcuda in the node's usr/lib");
    let libcuda_inside = Path::new("/").join(libcuda.strip_prefix(&node.root).expect("under the root"));
    let program = path(&node, fake_nvml::host::MPS_CONTROL_PATH);
    let probes = [
        secret.display().to_string(),
        format!("/proc/1/root{}", secret.display()),
        program.display().to_string(),
        format!("/{}", fake_nvml::host::MPS_CONTROL_PATH),
        libcuda_inside.display().to_string(),
    ];
    std::fs::create_dir_all(path(&node, PIPE)).expect("pipe folder");
    std::fs::write(path(&node, PIPE).join("fake-probe"), probes.join("\n")).expect("probe list");

    let agent = node.spawn();
    let log = probe_log(&node, &kubelet).await;
    let result = |p: &str| probe_result(&log, p);
    // Nothing of the host outside its folders, not even through /proc.
    for p in &probes[..3] {
        assert!(result(p).starts_with("error: "), "the daemon read {p}:\n{log}");
    }
    // The driver's user space, read-only.
    for p in &probes[3..] {
        assert!(result(p).starts_with("read "), "the daemon cannot read {p}:\n{log}");
    }
    // Its pipe (it listens), log (control.log) and shm folders still work.
    wait_until("the limits in control.log", || {
        log_text(&node).contains("Cmd:set_default_active_thread_percentage 25")
    });
    assert!(
        path(&node, "run/nvidia/mps/shm")
            .join(shm_segment(&path(&node, PIPE)))
            .exists(),
        "the daemon's shared memory is not in <mps_root>/shm"
    );
    assert_eq!(agent.stop(), 0);
    assert_eq!(std::fs::read_to_string(&secret).expect("secret"), "s3cret\n");
}

/// Landlock's ABI version, or `None` where the kernel has it off or lacks it.
fn landlock_abi() -> Option<i64> {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) only answers.
    let abi = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    (abi > 0).then_some(abi)
}

/// Kills the host process it holds when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Unmounts what is mounted at its path when the test ends, however it ends (before the node's
/// temporary folder, which holds it, is removed).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Issue #32: root in the container, without `CAP_SYS_PTRACE`, can still switch its file system
/// uid to that of a dumpable host process without capabilities (here `nobody`), open that
/// process's `/proc/<pid>/root` (the ptrace check passes for the same uid), switch back to root
/// and read or create any host file below it. Landlock (its file system rules beneath the new
/// root, and its ptrace scoping) closes that path; the fake daemon plays the attack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_cannot_reach_the_host_through_another_processes_root() {
    use std::os::unix::process::CommandExt;
    require_root();
    let Some(abi) = landlock_abi() else {
        eprintln!(
            "SKIPPED: this kernel has Landlock off or lacks it (landlock_create_ruleset failed), and \
             without it the daemon's container does not close /proc/<pid>/root (issue #32)"
        );
        return;
    };
    eprintln!("Landlock ABI {abi}");
    let config = format!("[device_plugin]\ndefault_profile = \"mps\"\n{PROFILES}");
    let (_api, node, kubelet) = setup(&config, &[]).await;
    // A host file outside the node's root, and a host process of `nobody` (any dumpable one
    // without capabilities would do: daemons, other tenants' non-root pods).
    let secret = node.tmp.path().join("host-secret");
    std::fs::write(&secret, "s3cret\n").expect("secret");
    let written = node.tmp.path().join("host-secret.written");
    let mut nobody = std::process::Command::new("sleep")
        .arg("120")
        .uid(65534)
        .gid(65534)
        .spawn()
        .map(Killed)
        .expect("a host process of nobody (sleep as 65534:65534)");
    let rel = secret.strip_prefix("/").expect("an absolute temp path");
    let probe = format!("as-fsuid 65534 /proc/{}/root {}", nobody.0.id(), rel.display());
    // The process as MPS clients are seen, to show that the daemon's `/proc` is the host's.
    let status = format!("/proc/{}/status", nobody.0.id());
    std::fs::create_dir_all(path(&node, PIPE)).expect("pipe folder");
    std::fs::write(path(&node, PIPE).join("fake-probe"), format!("{probe}\n{status}\n")).expect("probe list");

    // The daemon's container binds the node's `/proc`, a folder of fake files in these tests:
    // here the host's own, as on a node, in a mount namespace of this thread's (the agent, which
    // this thread starts, inherits it; the host's mounts do not change).
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("a mount namespace for the test");
    let none: Option<&str> = None;
    nix::mount::mount(
        none,
        "/",
        none,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        none,
    )
    .expect("mounts private");
    nix::mount::mount(
        Some("/proc"),
        &path(&node, "proc"),
        none,
        nix::mount::MsFlags::MS_BIND,
        none,
    )
    .expect("the host's /proc as the node's");
    let _unmount = Unmount(path(&node, "proc"));

    let agent = node.spawn();
    let log = probe_log(&node, &kubelet).await;
    let result = |p: &str| probe_result(&log, p);
    let (seen, result) = (result(&status), result(&probe));
    eprintln!("{status}: {seen}\n{probe}: {result}");
    let alive = matches!(nobody.0.try_wait(), Ok(None));
    // The agent stops (and the daemon quits) before anything is asserted.
    assert_eq!(agent.stop(), 0);
    assert!(
        seen.starts_with("read "),
        "the daemon does not see the host's processes: the probe proves nothing: {seen}"
    );
    assert!(
        alive,
        "the nobody process ended before the probe: the probe proves nothing"
    );
    assert!(
        !result.contains(" bytes"),
        "the daemon read a host file through /proc/<pid>/root: {result}"
    );
    assert!(
        !result.contains("create: ok") && !written.exists(),
        "the daemon created a host file through /proc/<pid>/root: {result}"
    );
    assert_eq!(std::fs::read_to_string(&secret).expect("secret"), "s3cret\n");
}
