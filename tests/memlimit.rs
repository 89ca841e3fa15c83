//! The GPU memory-limit enforcer against the fake NVML library (in process) and real child
//! processes: the fake reports the children's PIDs with the GPU memory the test injects, their
//! cgroups are files the test writes under the node's root, and the signals are real.
//!
//! The fake NVML is a process-wide singleton configured by environment variables read at
//! `nvmlInit`: it is opened once for the whole binary, and the tests take turns (the `processes`
//! injection file is shared).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpu_node_agent::host::HostRoot;
use gpu_node_agent::nvml::Gpus;
use gpu_node_agent::plugin::memlimit::{
    self, Action, ActionRecord, Enforcer, GpuProcess, NoNames, PodName, PodNames, Policy, Qos, RecordKind,
};
use tokio::sync::{mpsc, watch};

const SIGTERM: i32 = 15;
const SIGKILL: i32 = 9;

/// GPU 0 is shared (budgeted); GPU 1 is in MIG mode with one 3g.20gb device.
const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000000-1111-2222-3333-444455556666"

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000001-1111-2222-3333-444455556666"
mig_mode = true
[[gpu.mig_device]]
profile = "3g.20gb"
placement = 4
"#;

const GPU: &str = "GPU-00000000-1111-2222-3333-444455556666";
const MIG_PARENT: &str = "GPU-00000001-1111-2222-3333-444455556666";
const BUDGET_MIB: u64 = 4000;

const POD_A: &str = "0f7ad5ba-1c2d-4e5f-8a9b-0c1d2e3f4a5b";
const CID_A: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
const POD_B: &str = "7c6b5a49-3827-4e5d-9c3b-2a1908f7e6d5";
const CID_B: &str = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";

struct Shared {
    node: common::Node,
    gpus: Gpus,
}

/// The node and its NVML, opened once; the guard serialises the tests.
fn shared() -> (MutexGuard<'static, ()>, &'static Shared) {
    static SERIAL: Mutex<()> = Mutex::new(());
    static SHARED: OnceLock<Shared> = OnceLock::new();
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shared = SHARED.get_or_init(|| {
        let node = common::Node::new(MACHINE, "");
        // SAFETY of set_var: it runs once, under SERIAL, before any NVML call; the other test
        // threads of this binary wait on SERIAL and read no environment meanwhile.
        let gpus = unsafe { common::open_fake_nvml(&node) };
        Shared { node, gpus }
    });
    (guard, shared)
}

/// The test's child processes, killed and reaped however the test ends.
#[derive(Default)]
struct Children(Vec<Child>);

impl Children {
    /// `sleep 60`.
    fn sleeper(&mut self) -> u32 {
        let child = Command::new("sleep")
            .arg("60")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        self.0.push(child);
        pid
    }

    /// `sleep 60` that ignores SIGTERM, returned once it does.
    fn stubborn(&mut self) -> u32 {
        let child = Command::new("sh")
            .args(["-c", "trap '' TERM; exec sleep 60"])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        self.0.push(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ignores_term(pid) {
            assert!(Instant::now() < deadline, "child {pid} never ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(5));
        }
        pid
    }

    fn child(&mut self, pid: u32) -> &mut Child {
        self.0.iter_mut().find(|c| c.id() == pid).expect("a child of this test")
    }

    /// Whether the child still runs (it is reaped if it ended).
    fn running(&mut self, pid: u32) -> bool {
        self.child(pid).try_wait().expect("try_wait").is_none()
    }

    /// Waits (up to 10 s) for the child to end.
    fn ended(&mut self, pid: u32) -> ExitStatus {
        let child = self.child(pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "child {pid} is still running");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether SIGTERM is in the process's ignored signals (`SigIgn` in `/proc/<pid>/status`).
fn ignores_term(pid: u32) -> bool {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (SIGTERM - 1)) != 0)
}

/// Writes `<root>/proc/<pid>/cgroup`.
fn write_cgroup(node: &common::Node, pid: u32, text: &str) {
    let path = node.root.join(format!("proc/{pid}/cgroup"));
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir proc");
    fs::write(path, text).expect("write cgroup");
}

/// The three processes of the acceptance scenario on GPU 0: A in a pod (cgroup v2, systemd
/// driver) over budget, B in a pod (cgroup v1, cgroupfs driver) under budget, C a host service
/// over budget.
struct Scenario {
    a: u32,
    b: u32,
    c: u32,
}

fn scenario(node: &common::Node, children: &mut Children, stubborn_a: bool) -> Scenario {
    let a = if stubborn_a {
        children.stubborn()
    } else {
        children.sleeper()
    };
    let (b, c) = (children.sleeper(), children.sleeper());
    let systemd_uid = POD_A.replace('-', "_");
    write_cgroup(
        node,
        a,
        &format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{CID_A}.scope\n"
        ),
    );
    write_cgroup(
        node,
        b,
        &format!(
            "12:memory:/kubepods/besteffort/pod{POD_B}/{CID_B}\n4:devices:/kubepods/besteffort/pod{POD_B}/{CID_B}\n1:name=systemd:/kubepods/besteffort/pod{POD_B}/{CID_B}\n"
        ),
    );
    write_cgroup(node, c, "0::/system.slice/ollama.service\n");
    node.set_injection(
        "processes",
        &format!("{GPU} {a} 9000\n{GPU} {b} 1000\n{GPU} {c} 9000\n"),
    );
    Scenario { a, b, c }
}

fn policy(action: Action) -> Policy {
    Policy {
        budgets: BTreeMap::from([(GPU.to_string(), BUDGET_MIB)]),
        action,
        grace: Duration::from_millis(200),
    }
}

/// What NVML reports now on the budgeted GPUs.
fn processes(gpus: &Gpus, policy: &Policy) -> Vec<GpuProcess> {
    let mut out = Vec::new();
    for uuid in policy.budgets.keys() {
        for (pid, used) in gpus.compute_processes(uuid).expect("compute processes") {
            out.push(GpuProcess {
                gpu_uuid: uuid.clone(),
                pid,
                used_mib: used.expect("the fake reports used memory"),
            });
        }
    }
    out
}

fn pass(e: &mut Enforcer, gpus: &Gpus, policy: &Policy) -> Vec<ActionRecord> {
    e.pass(&processes(gpus, policy), &NoNames, policy, Instant::now())
}

fn kinds(records: &[ActionRecord]) -> Vec<(u32, RecordKind)> {
    records.iter().map(|r| (r.pid, r.kind)).collect()
}

fn assert_pod_a(record: &ActionRecord) {
    assert_eq!(record.pod.pod_uid, POD_A);
    assert_eq!(record.pod.container_id.as_deref(), Some(CID_A));
    assert_eq!(record.pod.qos, Qos::Burstable);
    assert_eq!(
        (record.gpu_uuid.as_str(), record.used_mib, record.budget_mib),
        (GPU, 9000, BUDGET_MIB)
    );
    assert!(
        record.message.contains(POD_A) && record.message.contains(CID_A),
        "{}",
        record.message
    );
}

#[test]
fn kill_terminates_the_pods_process_over_budget_only() {
    let (_turn, s) = shared();
    let mut children = Children::default();
    let sc = scenario(&s.node, &mut children, false);
    let p = policy(Action::Kill);
    let mut e = Enforcer::new(HostRoot::new(&s.node.root));

    let records = pass(&mut e, &s.gpus, &p);
    assert_eq!(kinds(&records), [(sc.a, RecordKind::Terminated)]);
    assert_pod_a(&records[0]);
    assert_eq!(children.ended(sc.a).signal(), Some(SIGTERM));
    assert!(children.running(sc.b), "B is under budget");
    assert!(children.running(sc.c), "C is not in a pod");

    // A is gone although NVML still lists it (stale): nothing left to kill.
    std::thread::sleep(p.grace);
    assert!(pass(&mut e, &s.gpus, &p).is_empty());
    assert!(children.running(sc.b) && children.running(sc.c));
}

#[test]
fn kill_escalates_to_sigkill_after_the_grace_period() {
    let (_turn, s) = shared();
    let mut children = Children::default();
    let sc = scenario(&s.node, &mut children, true);
    let p = policy(Action::Kill);
    let mut e = Enforcer::new(HostRoot::new(&s.node.root));

    let terminated = Instant::now();
    let records = pass(&mut e, &s.gpus, &p);
    assert_eq!(kinds(&records), [(sc.a, RecordKind::Terminated)]);
    std::thread::sleep(Duration::from_millis(50));
    assert!(children.running(sc.a), "A ignores SIGTERM");
    if terminated.elapsed() < p.grace {
        assert!(
            pass(&mut e, &s.gpus, &p).is_empty(),
            "no SIGKILL within the grace period"
        );
    }
    // The enforcer's clock started a little after `terminated` (the pass read NVML first).
    std::thread::sleep(p.grace.saturating_sub(terminated.elapsed()) + Duration::from_millis(100));
    let records = pass(&mut e, &s.gpus, &p);
    assert_eq!(kinds(&records), [(sc.a, RecordKind::Killed)]);
    assert_eq!(records[0].kind.reason(), "GPUMemoryOverBudgetKilled");
    assert_pod_a(&records[0]);
    assert_eq!(children.ended(sc.a).signal(), Some(SIGKILL));
    assert!(children.running(sc.b) && children.running(sc.c));
}

#[test]
fn dry_run_and_log_report_and_kill_nobody() {
    let (_turn, s) = shared();
    let mut children = Children::default();
    let sc = scenario(&s.node, &mut children, false);
    let mut e = Enforcer::new(HostRoot::new(&s.node.root));

    let dry = policy(Action::DryRun);
    let records = pass(&mut e, &s.gpus, &dry);
    assert_eq!(kinds(&records), [(sc.a, RecordKind::WouldKill)]);
    assert_eq!(records[0].kind.reason(), "GPUMemoryOverBudgetWouldKill");
    assert_pod_a(&records[0]);
    std::thread::sleep(dry.grace);
    assert!(pass(&mut e, &s.gpus, &dry).is_empty(), "reported once per crossing");

    let mut e = Enforcer::new(HostRoot::new(&s.node.root));
    let log = policy(Action::Log);
    let records = pass(&mut e, &s.gpus, &log);
    assert_eq!(kinds(&records), [(sc.a, RecordKind::Warned)]);
    assert_eq!(records[0].kind.reason(), "GPUMemoryOverBudget");
    assert_pod_a(&records[0]);
    assert!(pass(&mut e, &s.gpus, &log).is_empty(), "reported once per crossing");

    for pid in [sc.a, sc.b, sc.c] {
        assert!(children.running(pid), "{pid} still runs");
    }
}

struct Named;

impl PodNames for Named {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName> {
        (pod_uid == POD_A && container_id == Some(CID_A)).then(|| PodName {
            namespace: "ml".into(),
            pod: "train-0".into(),
            container: Some("worker".into()),
        })
    }
}

async fn next(rx: &mut mpsc::Receiver<ActionRecord>) -> ActionRecord {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a record within 10 s")
        .expect("the task runs")
}

#[test]
fn the_task_follows_policy_changes_and_stops_with_its_sender() {
    let (_turn, s) = shared();
    let mut children = Children::default();
    let sc = scenario(&s.node, &mut children, true);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (policy_tx, policy_rx) = watch::channel(policy(Action::Log));
        let (out_tx, mut out_rx) = mpsc::channel(16);
        let task = tokio::spawn(memlimit::run(
            s.gpus.clone(),
            HostRoot::new(&s.node.root),
            policy_rx,
            Duration::from_millis(50),
            Arc::new(Named),
            out_tx,
        ));
        let warned = next(&mut out_rx).await;
        assert_eq!((warned.pid, warned.kind), (sc.a, RecordKind::Warned));
        let name = warned.name.as_ref().expect("named");
        assert_eq!((name.namespace.as_str(), name.pod.as_str()), ("ml", "train-0"));
        assert!(
            warned.message.contains("pod ml/train-0 container worker"),
            "{}",
            warned.message
        );

        policy_tx.send(policy(Action::Kill)).expect("task listens");
        let terminated = next(&mut out_rx).await;
        assert_eq!((terminated.pid, terminated.kind), (sc.a, RecordKind::Terminated));
        let killed = next(&mut out_rx).await;
        assert_eq!((killed.pid, killed.kind), (sc.a, RecordKind::Killed));

        drop(policy_tx);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the task ends with its policy sender")
            .expect("the task did not panic");
    });
    assert_eq!(children.ended(sc.a).signal(), Some(SIGKILL));
    assert!(children.running(sc.b) && children.running(sc.c));
}

#[test]
fn compute_processes_of_a_mig_device_and_its_gpu() {
    let (_turn, s) = shared();
    let inventory = s.gpus.inventory(&s.node.root.join("sys")).expect("inventory");
    let parent = inventory.gpus.iter().find(|g| g.uuid == MIG_PARENT).expect("MIG GPU");
    let mig = parent.mig_devices.first().expect("a MIG device").uuid.clone();
    s.node
        .set_injection("processes", &format!("{mig} 4242 3000\n{GPU} 4343 100\n"));
    assert_eq!(s.gpus.compute_processes(&mig).expect("MIG"), [(4242, Some(3000))]);
    assert_eq!(
        s.gpus.compute_processes(MIG_PARENT).expect("parent"),
        [(4242, Some(3000))]
    );
    assert_eq!(s.gpus.compute_processes(GPU).expect("GPU"), [(4343, Some(100))]);
    s.node.set_injection("processes", "");
    assert!(s.gpus.compute_processes(&mig).expect("MIG").is_empty());
    assert!(s.gpus.compute_processes("GPU-nope").is_err());
}

/// The running agent enforces the budgets its sharing profile gives: a pod process over its
/// replica's fair share is terminated, end to end through the real binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_terminates_a_pod_process_over_its_replicas_fair_share() {
    let config = "[device_plugin.sharing]\nstrategy = \"time-slicing\"\nrename_by_default = true\n\
                  [[device_plugin.sharing.resources]]\nname = \"nvidia.com/gpu\"\nreplicas = 4\nmemory_per_replica = \"fair\"\n\
                  [device_plugin.memory_limits]\naction = \"kill\"\ninterval = \"100ms\"\ngrace_period = \"1s\"\n";
    let node = common::Node::new(&common::machine("A100-SXM4-40GB", 1), config);
    // The Node the agent reports to: the action becomes an Event on it.
    let api = common::api_server_for(&node, &[]).await;
    let mut child = node.pod_process();
    let pid = child.id();
    // The kubelet's log layout names the pod and container.
    let logs = node.root.join("var/log");
    std::fs::create_dir_all(logs.join(format!("pods/ml_train-0_{}/worker", common::POD_UID))).expect("mkdir");
    std::fs::create_dir_all(logs.join("containers")).expect("mkdir");
    std::os::unix::fs::symlink(
        format!("/var/log/pods/ml_train-0_{}/worker/0.log", common::POD_UID),
        logs.join(format!("containers/train-0_ml_worker-{}.log", common::CONTAINER_ID)),
    )
    .expect("symlink");
    // 40960 MiB / 4 replicas = 10240 MiB each; it uses 30000.
    node.set_injection("processes", &format!("{} {pid} 30000\n", common::gpu_uuid(0)));
    let agent = node.spawn();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = child.kill();
    let status = status.unwrap_or_else(|| panic!("not terminated: {}", agent.log_text()));
    assert_eq!(status.signal(), Some(15), "SIGTERM first");
    assert!(
        agent.log_text().contains("pod ml/train-0 container worker"),
        "{}",
        agent.log_text()
    );
    let posted = api
        .wait_for(std::time::Duration::from_secs(15), |a| {
            a.events().iter().any(|e| {
                e["reason"] == "GPUMemoryOverBudgetTerminated"
                    && e["type"] == "Warning"
                    && e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("pod ml/train-0 container worker"))
            })
        })
        .await;
    assert!(posted, "{:?}", api.events());
}

/// Under `dry-run` and `log` the running agent kills nobody and posts one Warning per crossing
/// (`GPUMemoryOverBudgetWouldKill`, `GPUMemoryOverBudget`) naming the pod, not one per
/// enforcer pass (every 100 ms here) while the process stays over its budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_posts_one_event_per_crossing_under_dry_run_and_log() {
    for (action, reason) in [
        ("dry-run", "GPUMemoryOverBudgetWouldKill"),
        ("log", "GPUMemoryOverBudget"),
    ] {
        let config = format!(
            "[device_plugin.sharing]\nstrategy = \"time-slicing\"\nrename_by_default = true\n\
             [[device_plugin.sharing.resources]]\nname = \"nvidia.com/gpu\"\nreplicas = 4\nmemory_per_replica = \"fair\"\n\
             [device_plugin.memory_limits]\naction = \"{action}\"\ninterval = \"100ms\"\ngrace_period = \"1s\"\n"
        );
        let node = common::Node::new(&common::machine("A100-SXM4-40GB", 1), &config);
        let api = common::api_server_for(&node, &[]).await;
        let mut child = node.pod_process();
        let pid = child.id();
        let logs = node.root.join("var/log");
        fs::create_dir_all(logs.join(format!("pods/ml_train-0_{}/worker", common::POD_UID))).expect("mkdir");
        fs::create_dir_all(logs.join("containers")).expect("mkdir");
        std::os::unix::fs::symlink(
            format!("/var/log/pods/ml_train-0_{}/worker/0.log", common::POD_UID),
            logs.join(format!("containers/train-0_ml_worker-{}.log", common::CONTAINER_ID)),
        )
        .expect("symlink");
        // 40960 MiB / 4 replicas = 10240 MiB each; it uses 30000.
        node.set_injection("processes", &format!("{} {pid} 30000\n", common::gpu_uuid(0)));
        let agent = node.spawn();
        let event = common::event_posted(&api, reason).await;
        common::assert_event(&event, "Warning", &["pod ml/train-0 container worker"]);
        // Ten more enforcer passes over budget: nothing more, and the process runs.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(
            common::events_with(&api, reason).len(),
            1,
            "{action}: {:?}\n{}",
            api.events(),
            agent.log_text()
        );
        assert!(child.try_wait().expect("try_wait").is_none(), "{action}: killed nobody");
        for other in ["GPUMemoryOverBudgetTerminated", "GPUMemoryOverBudgetKilled"] {
            assert!(
                common::events_with(&api, other).is_empty(),
                "{action}: {:?}",
                api.events()
            );
        }
        let _ = child.kill();
        let _ = child.wait();
        drop(agent);
    }
}
