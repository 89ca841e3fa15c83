//! A node that still runs NVIDIA's GPU Operator: stand-ins for its device plugin (another
//! process serving `nvidia-gpu.sock` in the simulated kubelet's directory) and its mig-manager
//! (a process named `nvidia-mig-manager`), the real binary beside them, the test kubelet and the
//! test API server. The agent leaves their socket and the MIG layout alone, says so (status,
//! `gpu-node-agent status`, a Warning Event naming the program), serves its other resources,
//! and with `[kubernetes] withdraw_operator_operands` sets the Operator's deploy labels and
//! takes over once the operand has gone (the test plays the Operator); `migrate --undo` puts
//! the labels back.

mod common;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Node, gpu_uuid};
use gpu_node_agent::status::{StageId, StageState, Status};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(20);
const NODE: &str = common::NODE_NAME;
const GPU: &str = "nvidia.com/gpu";
const MIG_1G: &str = "nvidia.com/mig-1g.10gb";
const STAND_IN_SOCKET: &str = "GNA_TEST_STAND_IN_SOCKET";
const STAND_IN: &str = "GNA_TEST_STAND_IN";

/// The stand-in's body, when this test binary runs as one (see [`StandIn::start`]): serves the
/// socket the environment names (accepting and dropping connections), or just waits.
#[test]
fn stand_in() {
    if std::env::var_os(STAND_IN).is_none() {
        return;
    }
    match std::env::var_os(STAND_IN_SOCKET) {
        Some(path) => {
            let listener = UnixListener::bind(PathBuf::from(path)).expect("stand-in: bind");
            for conn in listener.incoming() {
                drop(conn);
            }
        }
        None => loop {
            std::thread::sleep(Duration::from_secs(60));
        },
    }
}

/// Another process, run under a program name of NVIDIA's (this test binary through a symlink
/// of that name: its `comm` and argv[0] say so), seen in the node's `/proc` (a link to its
/// real `/proc/<pid>` under the root).
struct StandIn {
    child: Child,
    proc_link: PathBuf,
}

impl StandIn {
    fn start(node: &Node, program: &str, socket: Option<&Path>) -> StandIn {
        let bin = node.tmp.path().join("operand-bin");
        std::fs::create_dir_all(&bin).expect("mkdir bin");
        let exe = bin.join(program);
        if !exe.exists() {
            std::os::unix::fs::symlink(std::env::current_exe().expect("test exe"), &exe).expect("symlink");
        }
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", "stand_in", "--nocapture", "--test-threads=1"])
            .env(STAND_IN, "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(socket) = socket {
            cmd.env(STAND_IN_SOCKET, socket);
        }
        let child = cmd.spawn().expect("spawn the stand-in");
        let proc_dir = node.root.join("proc");
        std::fs::create_dir_all(&proc_dir).expect("mkdir proc");
        let proc_link = proc_dir.join(child.id().to_string());
        std::os::unix::fs::symlink(format!("/proc/{}", child.id()), &proc_link).expect("proc link");
        if let Some(socket) = socket {
            let deadline = Instant::now() + T;
            while UnixStream::connect(socket).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "the stand-in never served {}",
                    socket.display()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        StandIn { child, proc_link }
    }

    /// [`StandIn::start`] as a container of pod `<namespace>/<pod>` as the agent sees it: its
    /// `/proc/<pid>` under the root is a folder with its `comm` and `cmdline` and a `cgroup` in
    /// the pod's (cgroup v2, systemd driver, containerd), and the kubelet's log folder
    /// `/var/log/pods/<namespace>_<pod>_<uid>` names the pod.
    fn start_in_pod(node: &Node, program: &str, namespace: &str, pod: &str) -> StandIn {
        let mut stand_in = StandIn::start(node, program, None);
        let pid = stand_in.pid();
        std::fs::remove_file(&stand_in.proc_link).expect("unlink the proc link");
        let dir = &mut stand_in.proc_link;
        std::fs::create_dir_all(&*dir).expect("mkdir proc/<pid>");
        let comm = &program[..program.len().min(15)];
        std::fs::write(dir.join("comm"), format!("{comm}\n")).expect("comm");
        std::fs::write(dir.join("cmdline"), format!("/usr/bin/{program}\0")).expect("cmdline");
        let uid = format!("0a1b2c3d-0000-4000-8000-{pid:012}");
        let container = format!("{:064}", pid);
        std::fs::write(
            dir.join("cgroup"),
            format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{container}.scope\n",
                uid.replace('-', "_")
            ),
        )
        .expect("cgroup");
        std::fs::create_dir_all(node.root.join(format!("var/log/pods/{namespace}_{pod}_{uid}"))).expect("pod logs");
        stand_in
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// SIGKILL: gone without cleaning up (its socket file stays, dead).
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::fs::symlink_metadata(&self.proc_link).is_ok_and(|m| m.is_dir()) {
            let _ = std::fs::remove_dir_all(&self.proc_link);
        } else {
            let _ = std::fs::remove_file(&self.proc_link);
        }
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One H100 with MIG (one 1g.10gb) and one without: under `mixed`, `nvidia.com/gpu` and
/// `nvidia.com/mig-1g.10gb`.
fn mixed_machine() -> String {
    format!(
        "{}\n[[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\nmig_mode = true\n[[gpu.mig_device]]\nprofile = \
         \"1g.10gb\"\n\n[[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\n",
        common::DGX_A100,
        gpu_uuid(0),
        gpu_uuid(1)
    )
}

fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

fn operator_lines(status: &Status) -> Vec<String> {
    status
        .operator
        .as_ref()
        .map(|o| o.conflicts.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_live_device_plugin_socket_is_left_alone_reported_and_the_rest_served() {
    let node = Node::new(&mixed_machine(), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let (api, kubelet) = common::api_server_and_kubelet(&node, &[]).await;
    let socket = node.plugin_dir().join("nvidia-gpu.sock");
    let mut nvidia = StandIn::start(&node, "nvidia-device-plugin", Some(&socket));
    let theirs = file_id(&socket);
    let agent = node.spawn();

    // Its other resource is served and registered; NVIDIA's socket is still NVIDIA's.
    kubelet
        .wait_for_registration(MIG_1G, T)
        .await
        .expect("mig-1g.10gb registered");
    assert_eq!(file_id(&socket), theirs, "the agent replaced NVIDIA's socket");
    assert!(UnixStream::connect(&socket).is_ok(), "NVIDIA's socket no longer served");
    let pid = nvidia.pid();
    let status = node.wait_status(T, |s| {
        operator_lines(s)
            .iter()
            .any(|l| l.contains("nvidia-device-plugin") && l.contains(&format!("pid {pid}")))
    });
    let line = operator_lines(&status).remove(0);
    assert!(line.contains("NVIDIA's device plugin"), "{line}");
    assert!(
        line.contains("/var/lib/kubelet/device-plugins/nvidia-gpu.sock"),
        "{line}"
    );
    assert!(line.contains("nvidia.com/gpu.deploy.device-plugin=false"), "{line}");
    let dp = common::stage(&status, StageId::DevicePlugin);
    assert_eq!(dp.state, StageState::Pending, "{dp:?}");
    assert!(
        dp.error
            .as_deref()
            .unwrap_or_default()
            .contains("nvidia.com/gpu not served"),
        "{dp:?}"
    );

    // A Warning Event names the program, its pid and what to do.
    let event = common::event_posted(&api, "GpuOperatorConflict").await;
    common::assert_event(
        &event,
        "Warning",
        &[
            "nvidia-device-plugin",
            &format!("pid {pid}"),
            "nvidia.com/gpu.deploy.device-plugin=false",
        ],
    );
    // `gpu-node-agent status` says it too.
    let out = node.run(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GPU OPERATOR on this node"), "{text}");
    assert!(text.contains("nvidia-device-plugin"), "{text}");

    // A few passes later: its socket is still its own, still served; never registered by the
    // agent.
    common::another_pass(&agent).await;
    assert!(nvidia.running());
    assert_eq!(file_id(&socket), theirs, "the agent replaced NVIDIA's socket");
    assert!(UnixStream::connect(&socket).is_ok(), "NVIDIA's socket no longer served");
    assert!(
        kubelet.registrations().iter().all(|r| r.resource != GPU),
        "{:?}",
        kubelet.registrations()
    );
    assert_eq!(
        events_with_count(&api, "GpuOperatorConflict"),
        1,
        "one Event, not one per pass"
    );

    // Stopping the agent leaves it there too.
    assert_eq!(agent.stop(), 0);
    assert_eq!(file_id(&socket), theirs);
    assert!(UnixStream::connect(&socket).is_ok());
    assert!(nvidia.running());
}

/// The Node's labels, asserted to have the deploy labels back as they were before `migrate`:
/// the device plugin's `true` again, the mig-manager's unset again.
fn deploy_labels_handed_back(api: &test_apiserver::TestApiServer) -> std::collections::BTreeMap<String, String> {
    let labels = api.labels(NODE);
    assert_eq!(
        labels.get("nvidia.com/gpu.deploy.device-plugin").map(String::as_str),
        Some("true"),
        "{labels:?}"
    );
    assert!(!labels.contains_key("nvidia.com/gpu.deploy.mig-manager"), "{labels:?}");
    labels
}

fn events_with_count(api: &test_apiserver::TestApiServer, reason: &str) -> usize {
    common::events_with(api, reason).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawing_sets_the_deploy_labels_takes_over_once_the_operand_left_and_undo_puts_them_back() {
    let node = Node::new(
        &mixed_machine(),
        "[device_plugin]\nmig_strategy = \"mixed\"\n\n[kubernetes]\nwithdraw_operator_operands = true\n",
    );
    let (api, kubelet) = common::api_server_and_kubelet(
        &node,
        &[
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
            ("nvidia.com/gpu.deploy.driver", "pre-installed"),
        ],
    )
    .await;
    let socket = node.plugin_dir().join("nvidia-gpu.sock");
    let nvidia = StandIn::start(&node, "nvidia-device-plugin", Some(&socket));
    let theirs = file_id(&socket);
    let agent = node.spawn();

    // The Operator's deploy labels of what the agent replaces go to false.
    let withdrawn = api
        .wait_for(T, |a| {
            let l = a.labels(NODE);
            l.get("nvidia.com/gpu.deploy.device-plugin").map(String::as_str) == Some("false")
                && l.get("nvidia.com/gpu.deploy.mig-manager").map(String::as_str) == Some("false")
                && l.get("nvidia.com/gpu.deploy.gpu-feature-discovery").map(String::as_str) == Some("false")
        })
        .await;
    assert!(withdrawn, "{:?}", api.labels(NODE));
    // The driver is not the agent's here ([driver] source = "none"): its label is untouched.
    assert_eq!(
        api.labels(NODE).get("nvidia.com/gpu.deploy.driver").map(String::as_str),
        Some("pre-installed")
    );
    let pid = nvidia.pid();
    let status = node.wait_status(T, |s| {
        operator_lines(s).iter().any(|l| {
            l.starts_with("waiting for NVIDIA's device plugin (nvidia-device-plugin, pid ")
                && l.contains(&format!("pid {pid}"))
                && l.contains("to leave")
        })
    });
    let operator = status.operator.as_ref().expect("the operator in the status");
    assert!(operator.withdrawing, "{operator:?}");
    assert_eq!(
        operator.withdrawn.get("nvidia.com/gpu.deploy.device-plugin"),
        Some(&Some("true".to_string())),
        "the previous value is kept"
    );
    kubelet
        .wait_for_registration(MIG_1G, T)
        .await
        .expect("the other resource");
    assert!(kubelet.registrations().iter().all(|r| r.resource != GPU));
    assert_eq!(file_id(&socket), theirs);

    // The Operator sees the label and removes its plugin (killed: its socket file stays, dead).
    nvidia.kill();
    let reg = kubelet
        .wait_for_registration(GPU, T)
        .await
        .expect("the agent takes nvidia.com/gpu over");
    assert_eq!(reg.endpoint, "nvidia-gpu.sock");
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1 && d[0].id == gpu_uuid(1))
        .await
        .expect("the whole GPU");
    assert_ne!(file_id(&socket), theirs, "the dead socket was replaced by the agent's");
    node.wait_status(T, |s| {
        operator_lines(s).is_empty() && common::stage_is(s, StageId::DevicePlugin, StageState::Ok)
    });
    common::event_posted(&api, "GpuOperatorConflictResolved").await;
    assert_eq!(agent.stop(), 0);

    // Handing the node back: the labels as they were, the unset ones removed.
    let out = node.run(&["migrate", "--undo"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let labels = deploy_labels_handed_back(&api);
    assert_eq!(
        labels.get("nvidia.com/gpu.deploy.driver").map(String::as_str),
        Some("pre-installed")
    );
}

/// Two A100-40GB with MIG enabled and no MIG devices yet.
fn two_a100s() -> String {
    let mut m = common::DGX_A100.to_string();
    for i in 0..2 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            gpu_uuid(i)
        ));
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_mig_change_while_nvidias_mig_manager_runs() {
    let node = Node::new(&two_a100s(), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let api = common::api_server_for(&node, &[("nvidia.com/mig.config", "all-1g.5gb")]).await;
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let manager = StandIn::start(&node, "nvidia-mig-manager", None);
    let agent = node.spawn();
    let pid = manager.pid();
    let status = node.wait_status(T, |s| {
        let mig = common::stage(s, StageId::Mig);
        mig.state == StageState::Pending
            && mig.error.as_deref().is_some_and(|e| {
                e.contains("nvidia-mig-manager") && e.contains(&format!("pid {pid}")) && e.contains("no MIG change")
            })
    });
    assert!(
        operator_lines(&status)
            .iter()
            .any(|l| l.contains("NVIDIA's mig-manager")),
        "{status:?}"
    );
    let event = common::event_posted(&api, "GpuOperatorConflict").await;
    common::assert_event(
        &event,
        "Warning",
        &["nvidia-mig-manager", "nvidia.com/gpu.deploy.mig-manager=false"],
    );
    // Nothing applied, and mig-manager's state label is not the agent's to write meanwhile.
    common::another_pass(&agent).await;
    assert!(
        kubelet
            .registrations()
            .iter()
            .all(|r| r.resource != "nvidia.com/mig-1g.5gb")
    );
    assert!(
        !api.labels(NODE).contains_key("nvidia.com/mig.config.state"),
        "{:?}",
        api.labels(NODE)
    );

    // Gone: the layout is applied.
    manager.kill();
    let applied = api
        .wait_for(Duration::from_secs(40), |a| {
            a.labels(NODE).get("nvidia.com/mig.config.state").map(String::as_str) == Some("success")
        })
        .await;
    assert!(applied, "{:?}", api.labels(NODE));
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("7 per GPU");
    assert_eq!(agent.stop(), 0);
}

/// Any pod can run a program named `nvidia-mig-manager`: one in a tenant's namespace is not the
/// Operator's ([kubernetes] operator_namespace): the layout is applied, and the log says once why
/// it was ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_process_named_like_mig_manager_does_not_hold_mig_back() {
    let node = Node::new(&two_a100s(), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let api = common::api_server_for(&node, &[("nvidia.com/mig.config", "all-1g.5gb")]).await;
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let mut tenant = StandIn::start_in_pod(&node, "nvidia-mig-manager", "tenant-a", "evil");
    let agent = node.spawn();
    let applied = api
        .wait_for(Duration::from_secs(40), |a| {
            a.labels(NODE).get("nvidia.com/mig.config.state").map(String::as_str) == Some("success")
        })
        .await;
    assert!(applied, "{:?}\n{}", api.labels(NODE), agent.log_text());
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("7 per GPU");
    assert!(tenant.running());
    let status = node.status();
    assert_eq!(common::stage(&status, StageId::Mig).state, StageState::Ok, "{status:?}");
    assert!(
        operator_lines(&status).iter().all(|l| !l.contains("mig-manager")),
        "{status:?}"
    );
    // Said once, naming the pid, the program and the pod.
    common::another_pass(&agent).await;
    let log = agent.log_text();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("not the GPU Operator's: ignored"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    let pid = tenant.pid();
    assert!(
        said[0].contains(&format!("pid {pid} (nvidia-mig-manager, pod tenant-a/evil)")),
        "{}",
        said[0]
    );
    assert_eq!(agent.stop(), 0);
}

/// The same process in the Operator's namespace is its mig-manager: no MIG change while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_manager_in_the_operators_namespace_holds_mig_back() {
    let node = Node::new(&two_a100s(), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let api = common::api_server_for(&node, &[("nvidia.com/mig.config", "all-1g.5gb")]).await;
    let manager = StandIn::start_in_pod(&node, "nvidia-mig-manager", "gpu-operator", "nvidia-mig-manager-x7k2p");
    let agent = node.spawn();
    let pid = manager.pid();
    node.wait_status(T, |s| {
        let mig = common::stage(s, StageId::Mig);
        mig.state == StageState::Pending
            && mig.error.as_deref().is_some_and(|e| {
                e.contains(&format!("pid {pid}, pod gpu-operator/nvidia-mig-manager-x7k2p"))
                    && e.contains("no MIG change")
            })
    });
    common::another_pass(&agent).await;
    assert!(
        !api.labels(NODE).contains_key("nvidia.com/mig.config.state"),
        "{:?}",
        api.labels(NODE)
    );
    assert!(!agent.log_text().contains("not the GPU Operator's"));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_sets_the_deploy_labels_once_and_undo_restores_them() {
    let node = Node::new(&mixed_machine(), "[dra]\nenabled = false\n");
    let api = common::api_server_for(
        &node,
        &[
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
            ("nvidia.com/gpu.deploy.container-toolkit", "paused-for-driver-upgrade"),
        ],
    )
    .await;
    let out = node.run(&["migrate"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("nvidia.com/gpu.deploy.device-plugin=false"), "{text}");
    let labels = api.labels(NODE);
    for operand in [
        "device-plugin",
        "container-toolkit",
        "gpu-feature-discovery",
        "mig-manager",
        "dcgm-exporter",
        "operator-validator",
    ] {
        let key = format!("nvidia.com/gpu.deploy.{operand}");
        assert_eq!(labels.get(&key).map(String::as_str), Some("false"), "{key}: {labels:?}");
    }
    for untouched in ["nvidia.com/gpu.deploy.driver", "nvidia.com/gpu.deploy.dra-driver"] {
        assert!(!labels.contains_key(untouched), "{untouched}: {labels:?}");
    }
    // Again: nothing new recorded (the previous values stay those from before the first run).
    assert!(node.run(&["migrate"]).status.success());
    let out = node.run(&["migrate", "--undo"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let labels = api.labels(NODE);
    assert_eq!(
        labels.get("nvidia.com/gpu.deploy.device-plugin").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        labels
            .get("nvidia.com/gpu.deploy.container-toolkit")
            .map(String::as_str),
        Some("paused-for-driver-upgrade")
    );
    assert!(!labels.contains_key("nvidia.com/gpu.deploy.mig-manager"), "{labels:?}");
    assert!(!node.root.join("var/lib/gpu-node-agent/operator-deploy-labels").exists());
}

/// `runtime unconfigure` (what the package's removal runs) puts back the deploy labels a
/// migration set, so the GPU Operator serves the node again once the agent has gone; without an
/// API server it names the labels and the commands, and the removal goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfigure_puts_the_deploy_labels_back() {
    let node = Node::new(&mixed_machine(), "[dra]\nenabled = false\n");
    let api = common::api_server_for(&node, &[("nvidia.com/gpu.deploy.device-plugin", "true")]).await;
    assert!(node.run(&["migrate"]).status.success());
    let labels = api.labels(NODE);
    assert_eq!(
        labels.get("nvidia.com/gpu.deploy.device-plugin").map(String::as_str),
        Some("false")
    );
    let out = node.run(&["runtime", "unconfigure", "--no-restart"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    deploy_labels_handed_back(&api);
    assert!(!node.root.join("var/lib/gpu-node-agent/operator-deploy-labels").exists());

    // Withdrawn again, then the API server goes away: unconfigure still succeeds and says how.
    assert!(node.run(&["migrate"]).status.success());
    drop(api);
    let out = node.run(&["runtime", "unconfigure", "--no-restart"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("were not put back")
            && stderr.contains("gpu-node-agent migrate --undo")
            && stderr.contains("nvidia.com/gpu.deploy.device-plugin=true"),
        "{stderr}"
    );
}

/// The package's removal may run `runtime unconfigure` from an admin shell whose `NODE_NAME`
/// names another node: the labels go back on the Node they were set on, which the record names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfigure_puts_the_deploy_labels_back_on_the_node_they_were_set_on() {
    let node = Node::new(&mixed_machine(), "[dra]\nenabled = false\n");
    let api = common::api_server_for(&node, &[("nvidia.com/gpu.deploy.device-plugin", "true")]).await;
    api.create_node("gpu-node-2", &[("nvidia.com/gpu.deploy.device-plugin", "false")]);
    assert!(node.run(&["migrate"]).status.success());
    let record = node.root.join("var/lib/gpu-node-agent/operator-deploy-labels");
    let text = std::fs::read_to_string(&record).expect("the record");
    assert!(text.lines().any(|l| l == format!("node={NODE}")), "{text}");
    let out = node
        .command(&["runtime", "unconfigure", "--no-restart"])
        .env("NODE_NAME", "gpu-node-2")
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains(&format!("node {NODE}: nvidia.com/gpu.deploy.device-plugin=true")),
        "{stdout}"
    );
    deploy_labels_handed_back(&api);
    assert_eq!(
        api.labels("gpu-node-2")
            .get("nvidia.com/gpu.deploy.device-plugin")
            .map(String::as_str),
        Some("false"),
        "the other node is untouched"
    );
    assert!(!record.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_toolkit_keeps_the_engine_configs_and_the_device_plugin_goes_on() {
    let node = Node::new(&mixed_machine(), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    // What the Operator's toolkit container leaves while it runs: its runtime in containerd's
    // config, and the validator's ready file.
    let config = node.root.join("etc/containerd/config.toml");
    std::fs::create_dir_all(config.parent().expect("dir")).expect("mkdir");
    let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"nvidia\"\n\
                [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]\n  runtime_type = \
                \"io.containerd.runc.v2\"\n  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\n    \
                BinaryName = \"/usr/local/nvidia/toolkit/nvidia-container-runtime\"\n";
    std::fs::write(&config, text).expect("containerd config");
    let validations = node.root.join("run/nvidia/validations");
    std::fs::create_dir_all(&validations).expect("mkdir");
    std::fs::write(validations.join("toolkit-ready"), "").expect("toolkit-ready");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| {
        let rt = common::stage(s, StageId::Runtime);
        rt.state == StageState::Pending
            && rt
                .error
                .as_deref()
                .is_some_and(|e| e.contains("NVIDIA's container toolkit") && e.contains("/etc/containerd/config.toml"))
    });
    assert!(
        operator_lines(&status)
            .iter()
            .any(|l| l.contains("nvidia.com/gpu.deploy.container-toolkit=false")),
        "{status:?}"
    );
    // The device plugin goes on (the toolkit's runtime serves GPU containers meanwhile).
    kubelet.wait_for_registration(GPU, T).await.expect("nvidia.com/gpu");
    assert_eq!(
        std::fs::read_to_string(&config).expect("read"),
        text,
        "containerd's config was edited"
    );
    assert!(!node.root.join("etc/containerd/conf.d/99-nvidia.toml").exists());
    assert_eq!(agent.stop(), 0);
}
