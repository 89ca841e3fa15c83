//! Every node and every restart: a CPU node of a fleet that installs the package everywhere, the
//! unit on it, kubelet restarts, many metrics clients, two writers.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{NVML_PATH, Node, NotifySocket, machine};
use gpu_node_agent::status::{StageId, StageState};

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Takes the node's GPU away: its PCI function and the driver's NVML library, kept aside under
/// the node's temp dir; [`give_gpu_back`] puts them back.
fn take_gpu_away(node: &Node) {
    std::fs::rename(node.root.join("sys/bus/pci"), node.tmp.path().join("pci")).expect("hide PCI bus");
    let nvml = node.root.join(NVML_PATH.trim_start_matches('/'));
    std::fs::rename(&nvml, node.tmp.path().join("libnvidia-ml.so.1")).expect("hide NVML");
}

fn give_gpu_back(node: &Node) {
    std::fs::rename(node.tmp.path().join("pci"), node.root.join("sys/bus/pci")).expect("PCI bus back");
    let nvml = node.root.join(NVML_PATH.trim_start_matches('/'));
    std::fs::rename(node.tmp.path().join("libnvidia-ml.so.1"), &nvml).expect("NVML back");
}

/// Restarts the stand-in kubelet and waits for the agent's registration with the new one: how
/// long that took.
async fn restart_and_reregister(kubelet: &test_kubelet::TestKubelet, resource: &str) -> Duration {
    let restarted = Instant::now();
    kubelet.restart().await.expect("restart kubelet");
    let reg = kubelet
        .wait_for_registration_since(resource, restarted, Duration::from_secs(10))
        .await
        .expect("re-registration");
    reg.at.duration_since(restarted)
}

const NO_GPU: &str = "no NVIDIA GPU on this node";

/// A CPU node (no NVIDIA function on the PCI bus, no driver): the agent stays up and idle — READY
/// with a STATUS saying why, every stage skipped, one log line, nothing configured — instead of
/// exiting 69 into the unit's restart loop. `run --once` (the cloud-init bootstrap) exits 0. A GPU
/// that appears later (hot-plug, a driver loaded later) is picked up without a restart.
#[test]
fn a_node_without_a_gpu_idles_quietly_and_notices_a_gpu_that_appears() {
    let node = Node::new(
        &machine("T4", 1),
        "[kubernetes]\nenabled = false\n[nvml]\nretry_interval = \"100ms\"\n",
    );
    take_gpu_away(&node);

    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status = node.status();
    for stage in &status.stages {
        assert_eq!(stage.state, StageState::Skipped, "{status:?}");
        assert!(
            stage.detail.as_deref().unwrap_or_default().starts_with(NO_GPU),
            "{status:?}"
        );
    }

    let socket = NotifySocket::new();
    let log = node.tmp.path().join("agent.log");
    let mut child = node
        .command(&["run"])
        .env("NOTIFY_SOCKET", &socket.path)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn");
    let got = socket.receive_until(Duration::from_secs(15), |m| m.iter().any(|x| x.contains("READY=1")));
    assert!(got.iter().any(|m| m.contains("READY=1")), "{got:?}");
    assert!(got.iter().any(|m| m.contains(&format!("STATUS={NO_GPU}"))), "{got:?}");
    // Twenty looks for a GPU later: still running, still one line, nothing configured.
    std::thread::sleep(Duration::from_secs(2));
    assert!(child.try_wait().expect("wait").is_none(), "the agent keeps running");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(logged.matches(NO_GPU).count(), 1, "{logged}");
    // (The one warning is the test's own: no cluster to read labels from.)
    let complaints: Vec<&str> = logged
        .lines()
        .filter(|l| (l.contains(" WARN ") || l.contains(" ERROR ")) && !l.contains("[kubernetes] enabled = false"))
        .collect();
    assert!(complaints.is_empty(), "{logged}");
    assert_eq!(node.status().state, "running");
    assert!(node.sockets().is_empty(), "no device plugin: {:?}", node.sockets());
    for never in ["etc/containerd", "var/run/cdi", "etc/modprobe.d"] {
        assert!(!node.root.join(never).exists(), "{never} was written on a CPU node");
    }

    // The GPU appears: the agent notices it on its own.
    give_gpu_back(&node);
    let status = node.wait_status(Duration::from_secs(15), |s| {
        s.gpus.len() == 1 && common::stage_is(s, StageId::Runtime, StageState::Ok)
    });
    assert_eq!(
        common::stage(&status, StageId::Driver).state,
        StageState::Ok,
        "{status:?}"
    );
    assert!(
        common::stage_detail(&status, StageId::DevicePlugin)
            .unwrap_or_default()
            .contains("0/1 resource(s) registered"),
        "waits for the kubelet with one resource: {status:?}"
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let code = child.wait().expect("wait");
    assert_eq!(
        code.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.contains("no longer idle"), "{logged}");
}

/// A GPU on the PCI bus whose NVML cannot load is still an error (exit 69), not an idle node.
#[test]
fn a_gpu_without_nvml_is_still_an_error() {
    let node = Node::new(&machine("T4", 1), "[kubernetes]\nenabled = false\n");
    let nvml = node.root.join(NVML_PATH.trim_start_matches('/'));
    std::fs::remove_file(nvml).expect("remove NVML");
    let out = node.run(&["run"]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains(NO_GPU), "{}", text(&out.stderr));
}

/// The packaged unit on a CPU-only root: `systemd-analyze verify` is clean there. (The agent
/// there idles, READY: [`a_node_without_a_gpu_idles_quietly_and_notices_a_gpu_that_appears`].)
#[test]
fn the_unit_verifies_on_a_cpu_only_root() {
    let Ok(version) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze not installed: skipped (scripts/deps installs it)");
        return;
    };
    assert!(version.status.success());
    let node = Node::new(&machine("T4", 1), "");
    take_gpu_away(&node);
    let unit_dir = node.root.join("etc/systemd/system");
    std::fs::create_dir_all(&unit_dir).expect("unit dir");
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/gpu-node-agent.service");
    std::fs::copy(&unit, unit_dir.join("gpu-node-agent.service")).expect("unit");
    std::fs::create_dir_all(node.root.join("usr/bin")).expect("usr/bin");
    std::fs::copy(
        env!("CARGO_BIN_EXE_gpu-node-agent"),
        node.root.join("usr/bin/gpu-node-agent"),
    )
    .expect("binary");
    let out = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no", "--recursive-errors=no"])
        .arg(format!("--root={}", node.root.display()))
        .arg("gpu-node-agent.service")
        .output()
        .expect("systemd-analyze");
    assert!(
        out.status.success() && !text(&out.stderr).contains("gpu-node-agent"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // The hardening the agent's job allows (the unit explains what stays exposed): 8.4 before
    // ProtectControlGroups= and RestrictNamespaces=~user.
    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(format!("--root={}", node.root.display()))
        .arg("gpu-node-agent.service")
        .output()
        .expect("systemd-analyze security");
    let report = text(&out.stdout);
    let score: f64 = report
        .lines()
        .find_map(|l| l.split("gpu-node-agent.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{report}{}", text(&out.stderr)));
    assert!(score <= 8.0, "exposure {score}:\n{report}");
}

/// The kubelet restarted 20 times (its cleanup deletes the sockets in whatever order the
/// directory lists them, then serves a new `kubelet.sock`): every restart gets exactly one
/// `Register` per resource, within a second, whatever order the agent saw the socket events in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_registration_per_kubelet_start() {
    use test_kubelet::{KubeletOptions, TestKubelet};
    const GPU: &str = "nvidia.com/gpu";
    const RESTARTS: usize = 20;
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("start test kubelet");
    let agent = node.spawn();
    kubelet
        .wait_for_registration(GPU, Duration::from_secs(10))
        .await
        .expect("first registration");
    for restart in 0..RESTARTS {
        let took = restart_and_reregister(&kubelet, GPU).await;
        assert!(
            took < Duration::from_secs(1),
            "restart {restart}: re-registered after {took:?}"
        );
        // Time for a second, needless registration to show up.
        tokio::time::sleep(Duration::from_millis(50 + 10 * (restart as u64 % 5))).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let records = kubelet.registrations();
    let mut per_instance = std::collections::BTreeMap::new();
    for r in records.iter().filter(|r| r.resource == GPU) {
        *per_instance.entry(r.kubelet_instance).or_insert(0usize) += 1;
    }
    assert_eq!(per_instance.len(), RESTARTS + 1, "{per_instance:?}");
    assert!(
        per_instance.values().all(|n| *n == 1),
        "registrations per kubelet start: {per_instance:?}"
    );
    assert_eq!(agent.stop(), 0);
}

/// The device plugin registers before the validation stage starts its CUDA check (a child that
/// loads the driver and makes a context: 0.6 s on an H200), so the check never competes with the
/// registration: in the agent's log, the registration comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cuda_check_starts_after_the_registration() {
    use test_kubelet::{KubeletOptions, TestKubelet};
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("start test kubelet");
    let agent = node.spawn();
    kubelet
        .wait_for_registration("nvidia.com/gpu", Duration::from_secs(10))
        .await
        .expect("registration");
    let deadline = Instant::now() + Duration::from_secs(20);
    let log = loop {
        let log = agent.log_text();
        if log.contains("validate cuda") {
            break log;
        }
        assert!(Instant::now() < deadline, "the CUDA check never started: {log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let registered = log.find("registered with the kubelet").expect("registration logged");
    let cuda = log.find("validate cuda").expect("CUDA check logged");
    assert!(
        registered < cuda,
        "the CUDA check started before the registration: {log}"
    );
    assert_eq!(agent.stop(), 0);
}

/// 2,000 clients connect to the metrics endpoint of an agent with the common 1,024-descriptor
/// soft limit and stay idle: the agent keeps descriptors for its own sockets, and a kubelet
/// restart still gets the device plugin re-registered within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_metrics_clients_do_not_starve_the_kubelet_sockets() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    use test_kubelet::{KubeletOptions, TestKubelet};
    const GPU: &str = "nvidia.com/gpu";
    const CLIENTS: u64 = 2_000;
    // This test's own process needs a descriptor per client.
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let want = (CLIENTS + 512).min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, want, hard).expect("raise the test's own soft limit");
    let clients = want.saturating_sub(512);
    assert!(
        clients >= 1_500,
        "the hard descriptor limit ({hard}) is too low for this test"
    );

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let node = Node::new(
        &machine("A100-SXM4-40GB", 2),
        &format!("[kubernetes]\nenabled = false\n[metrics]\naddress = \"127.0.0.1:{port}\"\n"),
    );
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("start test kubelet");
    let agent = node.spawn_with(|cmd| {
        use std::os::unix::process::CommandExt;
        // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
        unsafe {
            cmd.pre_exec(|| setrlimit(Resource::RLIMIT_NOFILE, 1024, 1024).map_err(std::io::Error::from));
        }
    });
    kubelet
        .wait_for_registration(GPU, Duration::from_secs(10))
        .await
        .expect("first registration");

    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let mut connects = tokio::task::JoinSet::new();
    for _ in 0..clients {
        connects.spawn(async move {
            tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
                .await
                .ok()
                .and_then(Result::ok)
        });
    }
    let mut open = Vec::new();
    while let Some(done) = connects.join_next().await {
        if let Ok(Some(stream)) = done {
            open.push(stream);
        }
    }
    // The agent serves 64 of them; the kernel's listen backlog holds some more and drops the
    // rest's SYNs (they retry). Without the cap the agent accepted until it ran out of
    // descriptors (over 1,000 here) and could not open the kubelet's sockets any more: no
    // re-registration within 10 s.
    assert!(open.len() >= 64, "only {} clients connected", open.len());

    for _ in 0..3 {
        let took = restart_and_reregister(&kubelet, GPU).await;
        assert!(
            took <= Duration::from_secs(1),
            "re-registered after {took:?} with {} metrics clients",
            open.len()
        );
    }
    drop(open);
    assert_eq!(agent.stop(), 0);
}

/// One writer per node: while the daemon runs, the commands that change the node refuse (exit
/// 75), naming the daemon's pid, and change nothing; reading commands and dry runs work. Once
/// the daemon is gone (however it ended) the lock is free.
#[test]
fn commands_that_would_fight_the_daemon_refuse_naming_it() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let agent = node.spawn();
    let pid = agent.pid();
    node.wait_status(Duration::from_secs(15), |s| s.state == "running");
    for args in [
        &["mig", "apply", "all-1g.5gb"][..],
        &["runtime", "configure", "--no-restart"],
        &["runtime", "unconfigure", "--no-restart"],
        &["driver", "install"],
        &["cdi", "generate"],
        &["run", "--once"],
    ] {
        let out = node.run(args);
        assert_eq!(out.status.code(), Some(75), "{args:?}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("gpu-node-agent run (pid {pid}) holds ")) && err.contains("systemctl stop"),
            "{args:?}: {err}"
        );
    }
    let mig = node.run(&["mig", "assert", "all-disabled"]);
    assert_eq!(mig.status.code(), Some(0), "{}", text(&mig.stderr));
    for args in [
        &["runtime", "configure", "--dry-run"][..],
        &["cdi", "generate", "--output", "-"],
        &["plan"],
    ] {
        let out = node.run(args);
        assert_ne!(
            out.status.code(),
            Some(75),
            "{args:?} only reads: {}",
            text(&out.stderr)
        );
    }
    // Killed without a chance to clean up: the kernel lock went with it.
    drop(agent);
    let out = node.run(&["mig", "apply", "all-1g.5gb"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}
