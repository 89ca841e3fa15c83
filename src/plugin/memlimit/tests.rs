//! The enforcer's parts and passes: cgroups to pods, `/proc/<pid>/stat`, the kubelet's log
//! names, the check, and the enforcer against a fake process control.

use std::sync::Mutex;

use super::*;

const CID: &str = "8b1ff4f3f5b8c1a4e2d0f7c6b5a49382716e5d4c3b2a19087f6e5d4c3b2a1908";
const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";

fn pod(uid: &str, container: Option<&str>, qos: Qos) -> Option<PodRef> {
    Some(PodRef {
        pod_uid: uid.to_string(),
        container_id: container.map(str::to_string),
        qos,
    })
}

#[test]
fn cgroup_v2_systemd_driver() {
    let text = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-{CID}.scope\n"
    );
    assert_eq!(pod_of_cgroup(&text), pod(UID, Some(CID), Qos::Burstable));
    let docker = format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/docker-{CID}.scope"
    );
    assert_eq!(pod_of_cgroup(&docker), pod(UID, Some(CID), Qos::BestEffort));
    let crio = format!("0::/kubepods.slice/kubepods-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/crio-{CID}.scope");
    assert_eq!(pod_of_cgroup(&crio), pod(UID, Some(CID), Qos::Guaranteed));
    // crun under CRI-O with systemd puts the process in a `container` child of the scope.
    let nested = format!("{crio}/container");
    assert_eq!(pod_of_cgroup(&nested), pod(UID, Some(CID), Qos::Guaranteed));
}

#[test]
fn cgroup_v2_cgroupfs_driver() {
    let text = format!("0::/kubepods/burstable/pod{UID}/{CID}\n");
    assert_eq!(pod_of_cgroup(&text), pod(UID, Some(CID), Qos::Burstable));
    let guaranteed = format!("0::/kubepods/pod{UID}/{CID}");
    assert_eq!(pod_of_cgroup(&guaranteed), pod(UID, Some(CID), Qos::Guaranteed));
    let crio = format!("0::/kubepods/besteffort/pod{UID}/crio-{CID}");
    assert_eq!(pod_of_cgroup(&crio), pod(UID, Some(CID), Qos::BestEffort));
}

#[test]
fn cgroup_v1_any_controller_that_names_a_pod() {
    let text = format!(
        "12:hugetlb:/\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n10:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{CID}\n1:name=systemd:/kubepods/besteffort/pod{UID}/{CID}\n"
    );
    assert_eq!(pod_of_cgroup(&text), pod(UID, Some(CID), Qos::BestEffort));
    let systemd = format!(
        "13:rdma:/\n4:devices:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/docker-{CID}.scope\n1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/docker-{CID}.scope\n0::/\n"
    );
    assert_eq!(pod_of_cgroup(&systemd), pod(UID, Some(CID), Qos::Burstable));
}

#[test]
fn nested_nodes_and_static_pods() {
    // kind: the node is a container, the kubelet's cgroup root is /kubelet.
    let kind = format!(
        "0::/system.slice/docker-0123456789ab.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-{CID}.scope"
    );
    assert_eq!(pod_of_cgroup(&kind), pod(UID, Some(CID), Qos::BestEffort));
    // A static pod's UID is its config hash.
    let hash = "6a3c5e7f9b1d2c4e6f8a0b2c4d6e8f0a";
    let text = format!("0::/kubepods/burstable/pod{hash}/{CID}");
    assert_eq!(pod_of_cgroup(&text), pod(hash, Some(CID), Qos::Burstable));
}

#[test]
fn pod_without_container() {
    let text =
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice";
    assert_eq!(pod_of_cgroup(text), pod(UID, None, Qos::Burstable));
    let conmon = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/crio-conmon-{CID}.scope"
    );
    assert_eq!(pod_of_cgroup(&conmon), pod(UID, None, Qos::Burstable));
}

#[test]
fn not_a_pod() {
    for text in [
        "0::/system.slice/sshd.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "0::/\n",
        "0::/system.slice/containerd.service\n",
        "0::/kubepods.slice\n",
        "0::/kubepods.slice/kubepods-burstable.slice\n",
        "0::/kubepods/burstable\n",
        "0::/kubepods/burstable/notapod/abc\n",
        "0::/kubepods/podXYZ-not-hex/abc\n",
        "0::/system.slice/docker-8b1ff4f3f5b8c1a4e2d0f7c6b5a49382.scope\n",
        "12:memory:/user.slice\n1:name=systemd:/user.slice/user-0.slice/session-1.scope\n",
        "",
        "garbage",
    ] {
        assert_eq!(pod_of_cgroup(text), None, "{text:?}");
    }
}

#[test]
fn stat_fields() {
    let stat = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 8192000 200 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n";
    assert_eq!(parse_stat(stat), Some(('S', 987654)));
    assert_eq!(parse_stat("1 (x) Z 0"), None);
    assert_eq!(parse_stat("no parens"), None);
    let me = fs::read_to_string(format!("/proc/{}/stat", std::process::id())).expect("own stat");
    assert!(parse_stat(&me).is_some(), "{me}");
    assert!(HostProcesses.start_time(std::process::id()).is_some());
}

fn policy(action: Action) -> Policy {
    Policy {
        budgets: BTreeMap::from([("GPU-a".to_string(), 1000)]),
        action,
        grace: Duration::from_secs(5),
    }
}

fn proc(pid: u32, used_mib: u64) -> GpuProcess {
    GpuProcess {
        gpu_uuid: "GPU-a".into(),
        pid,
        used_mib,
    }
}

struct Names;

impl PodNames for Names {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName> {
        (pod_uid == UID && container_id == Some(CID)).then(|| PodName {
            namespace: "ml".into(),
            pod: "train-0".into(),
            container: Some("worker".into()),
        })
    }
}

#[test]
fn names_from_the_kubelets_log_layout() {
    let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let name = |ns: &str, pod: &str, c: Option<&str>| PodName {
        namespace: ns.into(),
        pod: pod.into(),
        container: c.map(Into::into),
    };
    assert_eq!(
        parse_container_log_name(&format!("train-0_ml-team_cuda-worker-{id}.log"), id),
        Some(name("ml-team", "train-0", Some("cuda-worker")))
    );
    for other in [
        format!("train-0_ml_worker-{}.log", "f".repeat(64)),
        format!("train-0_worker-{id}.log"),
        format!("a_b_c_d-{id}.log"),
        format!("train-0_ml_worker{id}.log"),
        format!("train-0_ml_worker-{id}"),
    ] {
        assert_eq!(parse_container_log_name(&other, id), None, "{other}");
    }
    assert_eq!(
        parse_pod_log_dir(&format!("kube-system_gpu-job.v2_{UID}"), UID),
        Some(name("kube-system", "gpu-job.v2", None))
    );
    assert_eq!(parse_pod_log_dir(&format!("ml_train-0_{UID}x"), UID), None);
    assert_eq!(parse_pod_log_dir(&format!("ml_{UID}"), UID), None);

    let dir = tempfile::tempdir().expect("tempdir");
    let root = HostRoot::new(dir.path());
    let names = KubeletLogNames::new(&root);
    assert_eq!(names.lookup(UID, Some(id)), None, "no kubelet logs: no names");
    fs::create_dir_all(dir.path().join(format!("var/log/pods/ml_train-0_{UID}/worker"))).expect("mkdir");
    assert_eq!(names.lookup(UID, Some(id)), Some(name("ml", "train-0", None)));
    fs::create_dir_all(dir.path().join("var/log/containers")).expect("mkdir");
    std::os::unix::fs::symlink(
        "/nowhere",
        dir.path()
            .join(format!("var/log/containers/train-0_ml_worker-{id}.log")),
    )
    .expect("symlink");
    assert_eq!(names.lookup(UID, Some(id)), Some(name("ml", "train-0", Some("worker"))));
    assert_eq!(names.lookup("other", None), None);
}

#[test]
fn check_judges_only_pods_over_budget() {
    let pod_cgroup = format!("0::/kubepods/burstable/pod{UID}/{CID}");
    let cgroups = BTreeMap::from([
        (10, pod_cgroup.clone()),
        (11, pod_cgroup.clone()),
        (12, "0::/system.slice/sshd.service".to_string()),
    ]);
    let mut other_gpu = proc(10, 5000);
    other_gpu.gpu_uuid = "GPU-unbudgeted".into();
    let processes = [
        proc(10, 1001),
        proc(11, 1000),
        proc(12, 4000),
        proc(13, 4000),
        other_gpu,
    ];
    let findings = check(
        &processes,
        |pid| cgroups.get(&pid).cloned(),
        &Names,
        &policy(Action::Kill),
    );
    let decisions: Vec<(u32, &Decision)> = findings.iter().map(|f| (f.pid, &f.decision)).collect();
    assert_eq!(decisions.len(), 3, "{decisions:?}");
    assert_eq!(
        decisions[0],
        (
            10,
            &Decision::Act {
                action: Action::Kill,
                pod: pod_of_cgroup(&pod_cgroup).expect("pod"),
                name: Names.lookup(UID, Some(CID)),
            }
        )
    );
    assert_eq!(decisions[1], (12, &Decision::Ignored("not in a Kubernetes pod")));
    assert_eq!(decisions[2], (13, &Decision::Ignored("its cgroup cannot be read")));
    assert_eq!((findings[0].used_mib, findings[0].budget_mib), (1001, 1000));
}

#[derive(Default)]
struct Fake {
    starts: BTreeMap<u32, u64>,
    sent: Vec<(u32, Signal)>,
}

#[derive(Clone, Default)]
struct FakeControl(Arc<Mutex<Fake>>);

impl FakeControl {
    fn set(&self, pid: u32, start: Option<u64>) {
        let mut fake = self.0.lock().expect("fake");
        match start {
            Some(s) => fake.starts.insert(pid, s),
            None => fake.starts.remove(&pid),
        };
    }

    fn sent(&self) -> Vec<(u32, Signal)> {
        std::mem::take(&mut self.0.lock().expect("fake").sent)
    }
}

impl ProcessControl for FakeControl {
    fn start_time(&self, pid: u32) -> Option<u64> {
        self.0.lock().expect("fake").starts.get(&pid).copied()
    }

    fn signal(&self, pid: u32, signal: Signal) -> nix::Result<()> {
        self.0.lock().expect("fake").sent.push((pid, signal));
        Ok(())
    }
}

/// An enforcer over a temp root where pids 100..=102 are in the pod and 200 is a host one.
fn enforcer() -> (Enforcer, FakeControl, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    for (pid, cgroup) in [
        (100, format!("0::/kubepods/burstable/pod{UID}/{CID}")),
        (101, format!("0::/kubepods/pod{UID}/{CID}")),
        (102, format!("0::/kubepods/pod{UID}/{CID}")),
        (200, "0::/system.slice/ollama.service".to_string()),
    ] {
        let path = dir.path().join(format!("proc/{pid}/cgroup"));
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, cgroup).expect("cgroup");
    }
    let control = FakeControl::default();
    for pid in [100, 101, 102, 200] {
        control.set(pid, Some(u64::from(pid) * 10));
    }
    let e = Enforcer::with_control(HostRoot::new(dir.path()), Box::new(control.clone()));
    (e, control, dir)
}

fn kinds(records: &[ActionRecord]) -> Vec<(u32, RecordKind)> {
    records.iter().map(|r| (r.pid, r.kind)).collect()
}

#[test]
fn kill_terminates_then_kills_after_the_grace_period() {
    let (mut e, control, _dir) = enforcer();
    let p = policy(Action::Kill);
    let t0 = Instant::now();
    let procs = [proc(100, 2000), proc(101, 500), proc(200, 9000)];
    let records = e.pass(&procs, &Names, &p, t0);
    assert_eq!(kinds(&records), [(100, RecordKind::Terminated)]);
    assert_eq!(records[0].name.as_ref().map(|n| n.pod.as_str()), Some("train-0"));
    assert!(
        records[0].message.contains("pod ml/train-0 container worker"),
        "{}",
        records[0].message
    );
    assert!(records[0].message.contains("2000 MiB"), "{}", records[0].message);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM)]);
    // Within the grace period nothing more happens.
    assert!(e.pass(&procs, &Names, &p, t0 + Duration::from_secs(4)).is_empty());
    assert!(control.sent().is_empty());
    let records = e.pass(&procs, &NoNames, &p, t0 + Duration::from_secs(5));
    assert_eq!(kinds(&records), [(100, RecordKind::Killed)]);
    assert!(
        records[0]
            .message
            .contains(&format!("pod UID {UID} container ID {CID}"))
    );
    assert_eq!(control.sent(), [(100, Signal::SIGKILL)]);
    // Once killed, never signalled again.
    assert!(e.pass(&procs, &NoNames, &p, t0 + Duration::from_secs(60)).is_empty());
    assert!(control.sent().is_empty());
}

#[test]
fn no_sigkill_for_a_process_that_went_under_budget_or_away() {
    let (mut e, control, _dir) = enforcer();
    let p = policy(Action::Kill);
    let t0 = Instant::now();
    e.pass(&[proc(100, 2000), proc(101, 2000)], &Names, &p, t0);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM), (101, Signal::SIGTERM)]);
    control.set(101, None); // exited (or a zombie)
    let records = e.pass(
        &[proc(100, 900), proc(101, 2000)],
        &Names,
        &p,
        t0 + Duration::from_secs(6),
    );
    assert!(records.is_empty(), "{records:?}");
    assert!(control.sent().is_empty());
    // Over budget again later: a new crossing starts with SIGTERM.
    let records = e.pass(&[proc(100, 2000)], &Names, &p, t0 + Duration::from_secs(7));
    assert_eq!(kinds(&records), [(100, RecordKind::Terminated)]);
}

#[test]
fn a_reused_pid_is_not_killed_for_its_predecessor() {
    let (mut e, control, _dir) = enforcer();
    let p = policy(Action::Kill);
    let t0 = Instant::now();
    e.pass(&[proc(100, 2000)], &Names, &p, t0);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM)]);
    // The process died and another took its PID (and its cgroup, say): no SIGKILL; the new
    // process starts its own crossing with SIGTERM.
    control.set(100, Some(7));
    let records = e.pass(&[proc(100, 2000)], &Names, &p, t0 + Duration::from_secs(6));
    assert_eq!(kinds(&records), [(100, RecordKind::Terminated)]);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM)]);
}

#[test]
fn log_and_dry_run_report_once_per_crossing_and_signal_nothing() {
    let (mut e, control, _dir) = enforcer();
    let t0 = Instant::now();
    let log = policy(Action::Log);
    let over = [proc(100, 2000), proc(200, 9000)];
    assert_eq!(kinds(&e.pass(&over, &Names, &log, t0)), [(100, RecordKind::Warned)]);
    assert!(e.pass(&over, &Names, &log, t0 + Duration::from_secs(60)).is_empty());
    assert!(e.pass(&[proc(100, 10)], &Names, &log, t0).is_empty());
    assert_eq!(kinds(&e.pass(&over, &Names, &log, t0)), [(100, RecordKind::Warned)]);
    let dry = policy(Action::DryRun);
    let records = e.pass(&over, &Names, &dry, t0);
    assert_eq!(kinds(&records), [(100, RecordKind::WouldKill)]);
    assert!(records[0].message.contains("dry-run"));
    assert!(e.pass(&over, &Names, &dry, t0 + Duration::from_secs(60)).is_empty());
    assert!(control.sent().is_empty());
    // Switched to kill: the process still over budget is terminated now.
    let records = e.pass(&over, &Names, &policy(Action::Kill), t0);
    assert_eq!(kinds(&records), [(100, RecordKind::Terminated)]);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM)]);
}

#[test]
fn one_action_per_process_and_never_on_the_agent_or_init() {
    let (mut e, control, _dir) = enforcer();
    let mut p = policy(Action::Kill);
    p.budgets.insert("GPU-b".into(), 1000);
    let mut on_b = proc(100, 3000);
    on_b.gpu_uuid = "GPU-b".into();
    let records = e.pass(&[proc(100, 2000), on_b], &Names, &p, Instant::now());
    assert_eq!(kinds(&records), [(100, RecordKind::Terminated)]);
    assert_eq!(control.sent(), [(100, Signal::SIGTERM)]);

    let me = std::process::id();
    let cgroup = e.root.join(format!("/proc/{me}/cgroup"));
    fs::create_dir_all(cgroup.parent().expect("parent")).expect("mkdir");
    fs::write(&cgroup, format!("0::/kubepods/pod{UID}/{CID}")).expect("cgroup");
    control.set(me, Some(1));
    assert!(e.pass(&[proc(me, 5000)], &Names, &p, Instant::now()).is_empty());
    assert!(control.sent().is_empty());
}
