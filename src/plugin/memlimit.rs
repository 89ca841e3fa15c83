//! GPU memory limits for shared GPUs. Time-slicing gives replicas no memory isolation, so a
//! sharing profile may give each replica a memory budget; this enforcer compares every compute
//! process NVML reports on a budgeted GPU (or MIG device) with that budget, finds the process's
//! pod and container from its cgroup, and takes the configured [`Action`] on a process over
//! budget.
//!
//! Policy:
//! - only processes whose `/proc/<pid>/cgroup` names a Kubernetes pod (`kubepods`, cgroup v1 or
//!   v2, systemd or cgroupfs driver) are acted on; any other process (a host service, a user's
//!   shell, a process whose cgroup cannot be read) is reported at debug level and never touched;
//! - budgets are per process: each process is compared with the budget of the GPU it runs on
//!   (a container's processes are not summed, that would need the kubelet's allocation);
//! - `log` and `dry-run` report a process once each time it crosses its budget, not every
//!   interval: it is reported again only after it went under budget (or off the GPU) and back;
//! - `kill` sends SIGTERM, and SIGKILL when the same process is still on the GPU over budget
//!   `grace` later. "The same process" is checked by its start time (`/proc/<pid>/stat` field
//!   22), read before its cgroup and again right before each signal, so a reused PID is never
//!   signalled;
//! - PIDs are host PIDs (NVML reports them; the agent runs in the host's PID namespace). The
//!   cgroup is read under the root prefix (tests write one there), but liveness, start time and
//!   signals are the real process's ([`HostProcesses`]): the process is real even when the root
//!   prefix is a test directory.
//!
//! Each action is returned as an [`ActionRecord`] so the agent can log it, post a Kubernetes
//! Event and count it in a metric.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::sync::{mpsc, watch};
use tokio::time::MissedTickBehavior;

use crate::host::HostRoot;
use crate::nvml::{GpuError, Gpus};

/// The shortest interval [`run`] checks on; a shorter one is raised to this.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// Where the real processes are seen, whatever the root prefix (see the module docs).
const REAL_PROC: &str = "/proc";

// === cgroup → pod ===

/// A pod's Kubernetes quality-of-service class, as its cgroup path shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Qos {
    /// `kubepods/pod<uid>` or `kubepods-pod<uid>.slice`: no QoS level in the path.
    Guaranteed,
    Burstable,
    BestEffort,
}

/// The pod (and container) a process runs in, from its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef {
    /// The pod's UID with dashes (the systemd driver's `_` turned back into `-`).
    pub pod_uid: String,
    /// The container runtime's container ID; `None` for a process in the pod's own cgroup.
    pub container_id: Option<String>,
    pub qos: Qos,
}

/// The pod a process belongs to, from the text of its `/proc/<pid>/cgroup`; `None` when no line
/// names a Kubernetes pod. Every line is looked at (cgroup v2's `0::<path>`, or any cgroup v1
/// controller's `<id>:<controllers>:<path>`), and `kubepods` may sit anywhere in the path (kind
/// and other nested nodes put it under `kubelet.slice` or a node container's scope). Both kubelet
/// cgroup drivers are understood:
/// - systemd: `…/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/
///   cri-containerd-<id>.scope` (also `docker-<id>.scope`, `crio-<id>.scope`);
/// - cgroupfs: `…/kubepods/burstable/pod<uid>/<id>` (also `crio-<id>`).
pub fn pod_of_cgroup(text: &str) -> Option<PodRef> {
    text.lines().find_map(|line| {
        // `hierarchy-id:controllers:path`; only the path may contain ':'.
        let mut fields = line.splitn(3, ':');
        let (_, _, path) = (fields.next()?, fields.next()?, fields.next()?);
        pod_of_path(path.trim())
    })
}

fn pod_of_path(path: &str) -> Option<PodRef> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        // cgroupfs driver: kubepods[/burstable|/besteffort]/pod<uid>[/<container>]
        if *part == "kubepods" {
            let (qos, at) = match parts.get(i + 1) {
                Some(&"burstable") => (Qos::Burstable, i + 2),
                Some(&"besteffort") => (Qos::BestEffort, i + 2),
                _ => (Qos::Guaranteed, i + 1),
            };
            let uid = parts.get(at).and_then(|p| p.strip_prefix("pod"))?;
            if !is_pod_uid(uid) {
                return None;
            }
            return Some(PodRef {
                pod_uid: uid.to_string(),
                container_id: parts.get(at + 1).and_then(|p| container_of(p)),
                qos,
            });
        }
        // systemd driver: the pod's own slice names the QoS class and the escaped UID.
        if let Some(slice) = part.strip_suffix(".slice")
            && let Some((prefix, escaped)) = slice.rsplit_once("-pod")
            && let Some(qos) = systemd_qos(prefix)
        {
            let uid = escaped.replace('_', "-");
            if !is_pod_uid(&uid) {
                return None;
            }
            return Some(PodRef {
                pod_uid: uid,
                container_id: parts.get(i + 1).and_then(|p| container_of(p)),
                qos,
            });
        }
    }
    None
}

/// The QoS class of a systemd pod slice's prefix: `kubepods`, `kubepods-burstable`,
/// `kubepods-besteffort`, each possibly under a cgroup-root prefix (`kubelet-kubepods-…`).
fn systemd_qos(prefix: &str) -> Option<Qos> {
    let (base, qos) = if let Some(base) = prefix.strip_suffix("-burstable") {
        (base, Qos::Burstable)
    } else if let Some(base) = prefix.strip_suffix("-besteffort") {
        (base, Qos::BestEffort)
    } else {
        (prefix, Qos::Guaranteed)
    };
    (base == "kubepods" || base.ends_with("-kubepods")).then_some(qos)
}

/// A pod UID: an API-server UUID, or a static pod's hex hash.
fn is_pod_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

/// Container runtimes' cgroup name prefixes (systemd scopes, CRI-O's cgroupfs names).
const RUNTIME_PREFIXES: [&str; 4] = ["cri-containerd-", "docker-", "crio-", "libpod-"];

/// The container ID in a container's cgroup name, if it is one: `<runtime>-<id>.scope`
/// (systemd), `<id>` or `crio-<id>` (cgroupfs). CRI-O's `crio-conmon-<id>.scope` is the
/// container's monitor, not the container.
fn container_of(part: &str) -> Option<String> {
    let name = part.strip_suffix(".scope").unwrap_or(part);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = RUNTIME_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    let is_id = id.len() >= 12 && id.chars().all(|c| c.is_ascii_hexdigit());
    is_id.then(|| id.to_string())
}

// === names ===

/// A pod's and container's names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodName {
    pub namespace: String,
    pub pod: String,
    /// The container's name; `None` when only the pod is known.
    pub container: Option<String>,
}

/// Turns the pod UID and container ID a cgroup gives into names.
pub trait PodNames {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName>;
}

/// Knows no names: reports show the pod UID and container ID.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoNames;

impl PodNames for NoNames {
    fn lookup(&self, _pod_uid: &str, _container_id: Option<&str>) -> Option<PodName> {
        None
    }
}

/// Names from the kubelet's log layout on the node, which every CRI kubelet keeps:
/// `/var/log/pods/<namespace>_<pod>_<uid>/` names a pod by UID, and the symlink
/// `/var/log/containers/<pod>_<namespace>_<container>-<container ID>.log` names a container by
/// ID. Pod, namespace and container names are DNS labels or subdomains, so `_` only separates.
/// The names go into messages only; no decision depends on them.
#[derive(Debug, Clone)]
pub struct KubeletLogNames {
    /// `/var/log/pods` under the root.
    pub pods: PathBuf,
    /// `/var/log/containers` under the root.
    pub containers: PathBuf,
}

impl KubeletLogNames {
    pub fn new(root: &HostRoot) -> KubeletLogNames {
        KubeletLogNames {
            pods: root.join("/var/log/pods"),
            containers: root.join("/var/log/containers"),
        }
    }
}

/// The entry names of a directory; none when it cannot be read (no kubelet logs here).
fn entry_names(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `<pod>_<namespace>_<container>-<id>.log` → the names, when `id` is the container's.
pub fn parse_container_log_name(file: &str, container_id: &str) -> Option<PodName> {
    let rest = file
        .strip_suffix(".log")?
        .strip_suffix(container_id)?
        .strip_suffix('-')?;
    let mut parts = rest.splitn(3, '_');
    let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    if [pod, namespace, container]
        .iter()
        .any(|p| p.is_empty() || p.contains('_'))
    {
        return None;
    }
    Some(PodName {
        namespace: namespace.into(),
        pod: pod.into(),
        container: Some(container.into()),
    })
}

/// `<namespace>_<pod>_<uid>` → the pod's names, when `uid` is the pod's.
pub fn parse_pod_log_dir(dir: &str, pod_uid: &str) -> Option<PodName> {
    let rest = dir.strip_suffix(pod_uid)?.strip_suffix('_')?;
    let (namespace, pod) = rest.split_once('_')?;
    if namespace.is_empty() || pod.is_empty() || pod.contains('_') {
        return None;
    }
    Some(PodName {
        namespace: namespace.into(),
        pod: pod.into(),
        container: None,
    })
}

impl PodNames for KubeletLogNames {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName> {
        if let Some(id) = container_id {
            let found = entry_names(&self.containers)
                .iter()
                .find_map(|f| parse_container_log_name(f, id));
            if found.is_some() {
                return found;
            }
        }
        entry_names(&self.pods)
            .iter()
            .find_map(|d| parse_pod_log_dir(d, pod_uid))
    }
}

/// `pod <namespace>/<name> container <name>`, or with the UID and container ID when unnamed.
struct Who<'a>(&'a PodRef, Option<&'a PodName>);

impl fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Who(pod, name) = *self;
        match name {
            Some(n) => write!(f, "pod {}/{}", n.namespace, n.pod)?,
            None => write!(f, "pod UID {}", pod.pod_uid)?,
        }
        match (name.and_then(|n| n.container.as_deref()), pod.container_id.as_deref()) {
            (Some(container), _) => write!(f, " container {container}"),
            (None, Some(id)) => write!(f, " container ID {id}"),
            (None, None) => Ok(()),
        }
    }
}

// === one check ===

/// What to do with a pod's process over its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Log a warning (and report it).
    Log,
    /// SIGTERM, then SIGKILL after the grace period.
    Kill,
    /// Report what `Kill` would do, without signalling.
    DryRun,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Log => "log",
            Action::Kill => "kill",
            Action::DryRun => "dry-run",
        })
    }
}

/// What the enforcer enforces; swapped whole when the config changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// GPU or MIG UUID → MiB each process on it may use. GPUs not listed are not limited.
    pub budgets: BTreeMap<String, u64>,
    pub action: Action,
    /// How long after SIGTERM a process still over budget gets SIGKILL.
    pub grace: Duration,
}

/// One compute process on a GPU, as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// The GPU or MIG UUID it was reported on.
    pub gpu_uuid: String,
    /// Host PID.
    pub pid: u32,
    pub used_mib: u64,
}

/// A process over its budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub pid: u32,
    pub gpu_uuid: String,
    pub used_mib: u64,
    pub budget_mib: u64,
    pub decision: Decision,
}

/// What becomes of a process over its budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A pod's process: take `action`.
    Act {
        action: Action,
        pod: PodRef,
        name: Option<PodName>,
    },
    /// Never acted on, for this reason.
    Ignored(&'static str),
}

/// The budget `p` is over, if it is over one.
fn over_budget(p: &GpuProcess, policy: &Policy) -> Option<u64> {
    policy.budgets.get(&p.gpu_uuid).copied().filter(|&b| p.used_mib > b)
}

/// One pass over the processes, without side effects: every process over its GPU's budget, with
/// the pod its cgroup (`read_cgroup(pid)`, the text of `/proc/<pid>/cgroup`) names and what to
/// do. Processes under budget, or on GPUs without a budget, are not returned.
pub fn check(
    processes: &[GpuProcess],
    read_cgroup: impl Fn(u32) -> Option<String>,
    names: &dyn PodNames,
    policy: &Policy,
) -> Vec<Finding> {
    processes
        .iter()
        .filter_map(|p| {
            let budget_mib = over_budget(p, policy)?;
            let decision = match read_cgroup(p.pid).map(|text| pod_of_cgroup(&text)) {
                None => Decision::Ignored("its cgroup cannot be read"),
                Some(None) => Decision::Ignored("not in a Kubernetes pod"),
                Some(Some(pod)) => {
                    let name = names.lookup(&pod.pod_uid, pod.container_id.as_deref());
                    Decision::Act {
                        action: policy.action,
                        pod,
                        name,
                    }
                }
            };
            Some(Finding {
                pid: p.pid,
                gpu_uuid: p.gpu_uuid.clone(),
                used_mib: p.used_mib,
                budget_mib,
                decision,
            })
        })
        .collect()
}

// === processes ===

/// The real processes: their start time and signals. A trait so the enforcer's bookkeeping can
/// be tested without killing anything.
pub trait ProcessControl: Send {
    /// The process's start time (clock ticks after boot, `/proc/<pid>/stat` field 22); `None`
    /// when no live process has this PID (gone, or a zombie waiting for its parent).
    fn start_time(&self, pid: u32) -> Option<u64>;
    /// Sends `signal` to the process.
    fn signal(&self, pid: u32, signal: Signal) -> nix::Result<()>;
}

/// The host's processes through the real `/proc` and kill(2).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostProcesses;

impl ProcessControl for HostProcesses {
    fn start_time(&self, pid: u32) -> Option<u64> {
        let text = fs::read_to_string(format!("{REAL_PROC}/{pid}/stat")).ok()?;
        let (state, start) = parse_stat(&text)?;
        // Z: zombie, X: dead; neither can be signalled into doing anything.
        (!matches!(state, 'Z' | 'X')).then_some(start)
    }

    fn signal(&self, pid: u32, signal: Signal) -> nix::Result<()> {
        let pid = i32::try_from(pid).map_err(|_| Errno::ESRCH)?;
        nix::sys::signal::kill(Pid::from_raw(pid), signal)
    }
}

/// The state (field 3) and start time (field 22) from the text of `/proc/<pid>/stat`. The
/// command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
/// fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<(char, u64)> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 4..=21 lie between the state and the start time.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

// === the enforcer ===

/// What was done about a process, for logs, Kubernetes Events and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecordKind {
    /// Over budget, action `log`.
    Warned,
    /// Sent SIGTERM.
    Terminated,
    /// Sent SIGKILL, still over budget after the grace period.
    Killed,
    /// Over budget, action `dry-run`: it would have been killed.
    WouldKill,
}

impl RecordKind {
    /// The Kubernetes Event reason.
    pub fn reason(self) -> &'static str {
        match self {
            RecordKind::Warned => "GPUMemoryOverBudget",
            RecordKind::Terminated => "GPUMemoryOverBudgetTerminated",
            RecordKind::Killed => "GPUMemoryOverBudgetKilled",
            RecordKind::WouldKill => "GPUMemoryOverBudgetWouldKill",
        }
    }

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordKind::Warned => "warned",
            RecordKind::Terminated => "terminated",
            RecordKind::Killed => "killed",
            RecordKind::WouldKill => "would_kill",
        }
    }
}

/// One action the enforcer took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionRecord {
    pub kind: RecordKind,
    pub pid: u32,
    pub gpu_uuid: String,
    pub used_mib: u64,
    pub budget_mib: u64,
    pub pod: PodRef,
    pub name: Option<PodName>,
    /// A sentence for the log line and the Event message.
    pub message: String,
}

/// How far the enforcer went with a process during its current crossing of the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Warned,
    WouldKill,
    Terminated { at: Instant },
    Killed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    /// The process's start time, telling it apart from a later process with its PID.
    start: u64,
    step: Step,
}

/// Takes the policy's action on pods' processes over budget, remembering across passes what it
/// did to each process (once-per-crossing reports, SIGKILL after the grace period).
pub struct Enforcer {
    root: HostRoot,
    control: Box<dyn ProcessControl>,
    seen: BTreeMap<u32, Seen>,
}

impl fmt::Debug for Enforcer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Enforcer")
            .field("root", &self.root)
            .field("seen", &self.seen)
            .finish_non_exhaustive()
    }
}

impl Enforcer {
    /// An enforcer acting on the host's real processes; cgroups are read under `root`.
    pub fn new(root: HostRoot) -> Enforcer {
        Enforcer::with_control(root, Box::new(HostProcesses))
    }

    /// An enforcer acting through `control` (tests).
    pub fn with_control(root: HostRoot, control: Box<dyn ProcessControl>) -> Enforcer {
        Enforcer {
            root,
            control,
            seen: BTreeMap::new(),
        }
    }

    /// One pass over the processes NVML reports now: takes the action on pods' processes over
    /// budget and returns what it did. `now` times the grace period.
    pub fn pass(
        &mut self,
        processes: &[GpuProcess],
        names: &dyn PodNames,
        policy: &Policy,
        now: Instant,
    ) -> Vec<ActionRecord> {
        // Start times before cgroups, so the process whose cgroup is judged is the one that is
        // signalled (each signal re-checks the start time). No start time: gone or a zombie.
        let starts: BTreeMap<u32, u64> = processes
            .iter()
            .filter(|p| over_budget(p, policy).is_some())
            .filter_map(|p| Some((p.pid, self.control.start_time(p.pid)?)))
            .collect();
        let root = self.root.clone();
        let read_cgroup = |pid: u32| {
            if !starts.contains_key(&pid) {
                return None;
            }
            fs::read_to_string(root.join(format!("/proc/{pid}/cgroup"))).ok()
        };
        let findings = check(processes, read_cgroup, names, policy);

        let mut records = Vec::new();
        let mut over = BTreeSet::new();
        for finding in findings {
            let (action, pod, name) = match finding.decision {
                Decision::Act { action, pod, name } => (action, pod, name),
                Decision::Ignored(reason) => {
                    tracing::debug!(
                        pid = finding.pid,
                        gpu = %finding.gpu_uuid,
                        used_mib = finding.used_mib,
                        budget_mib = finding.budget_mib,
                        "process over its GPU memory budget left alone: {reason}"
                    );
                    continue;
                }
            };
            let Some(&start) = starts.get(&finding.pid) else {
                continue;
            };
            if finding.pid <= 1 || finding.pid == std::process::id() {
                continue;
            }
            // A process over budget on two GPUs is one process: one action.
            if !over.insert(finding.pid) {
                continue;
            }
            let target = Target {
                pid: finding.pid,
                start,
                gpu_uuid: finding.gpu_uuid,
                used_mib: finding.used_mib,
                budget_mib: finding.budget_mib,
                pod,
                name,
            };
            if let Some(record) = self.act(target, action, policy.grace, now) {
                records.push(record);
            }
        }
        // Whatever is no longer over budget ends its crossing.
        self.seen.retain(|pid, _| over.contains(pid));
        records
    }

    fn act(&mut self, t: Target, action: Action, grace: Duration, now: Instant) -> Option<ActionRecord> {
        let step = self.seen.get(&t.pid).filter(|s| s.start == t.start).map(|s| s.step);
        let (kind, next) = match (action, step) {
            (Action::Kill, Some(Step::Killed)) => return None,
            (Action::Kill, Some(Step::Terminated { at })) => {
                if now.saturating_duration_since(at) < grace {
                    return None;
                }
                self.send(&t, Signal::SIGKILL)?;
                (RecordKind::Killed, Step::Killed)
            }
            (Action::Kill, _) => {
                self.send(&t, Signal::SIGTERM)?;
                (RecordKind::Terminated, Step::Terminated { at: now })
            }
            (Action::Log, None) => (RecordKind::Warned, Step::Warned),
            (Action::DryRun, None | Some(Step::Warned)) => (RecordKind::WouldKill, Step::WouldKill),
            (Action::Log | Action::DryRun, Some(_)) => return None,
        };
        self.seen.insert(
            t.pid,
            Seen {
                start: t.start,
                step: next,
            },
        );
        let what = match kind {
            RecordKind::Warned => "action is log, left running".to_string(),
            RecordKind::Terminated => format!("sent SIGTERM, SIGKILL follows after {grace:?} if it stays over"),
            RecordKind::Killed => format!("sent SIGKILL, still over budget {grace:?} after SIGTERM"),
            RecordKind::WouldKill => "would kill it (action is dry-run)".to_string(),
        };
        let who = Who(&t.pod, t.name.as_ref());
        let message = format!(
            "process {} of {who} uses {} MiB on GPU {}, over its budget of {} MiB: {what}",
            t.pid, t.used_mib, t.gpu_uuid, t.budget_mib
        );
        let pod = match &t.name {
            Some(n) => format!("{}/{}", n.namespace, n.pod),
            None => t.pod.pod_uid.clone(),
        };
        let container = (t.name.as_ref().and_then(|n| n.container.as_deref()))
            .or(t.pod.container_id.as_deref())
            .unwrap_or("");
        tracing::warn!(
            pod = %pod,
            container = %container,
            gpu = %t.gpu_uuid,
            pid = t.pid,
            used_mib = t.used_mib,
            budget_mib = t.budget_mib,
            "GPU memory over budget: {message}"
        );
        Some(ActionRecord {
            kind,
            pid: t.pid,
            gpu_uuid: t.gpu_uuid,
            used_mib: t.used_mib,
            budget_mib: t.budget_mib,
            pod: t.pod,
            name: t.name,
            message,
        })
    }

    /// Signals the process if it is still the one judged; `None` when it was not signalled
    /// (gone, PID reused, or kill(2) failed: then the next pass tries again).
    fn send(&mut self, t: &Target, signal: Signal) -> Option<()> {
        if self.control.start_time(t.pid) != Some(t.start) {
            self.seen.remove(&t.pid);
            return None;
        }
        match self.control.signal(t.pid, signal) {
            Ok(()) => Some(()),
            Err(Errno::ESRCH) => {
                self.seen.remove(&t.pid);
                None
            }
            Err(err) => {
                tracing::warn!(
                    pid = t.pid,
                    gpu = %t.gpu_uuid,
                    "cannot send {signal} to process {} of {} over its GPU memory budget: {err}",
                    t.pid,
                    Who(&t.pod, t.name.as_ref())
                );
                None
            }
        }
    }
}

/// A pod's process over budget, as one pass sees it.
struct Target {
    pid: u32,
    start: u64,
    gpu_uuid: String,
    used_mib: u64,
    budget_mib: u64,
    pod: PodRef,
    name: Option<PodName>,
}

// === the task ===

/// Reads the compute processes of every budgeted GPU; a process whose memory NVML cannot tell
/// is left out (it cannot be judged). Returns the GPUs NVML failed for too.
fn read_processes<'a>(
    gpus: &Gpus,
    uuids: impl Iterator<Item = &'a String>,
) -> (Vec<GpuProcess>, Vec<(String, GpuError)>) {
    let mut processes = Vec::new();
    let mut failed = Vec::new();
    for uuid in uuids {
        match gpus.compute_processes(uuid) {
            Ok(list) => {
                for (pid, used) in list {
                    match used {
                        Some(used_mib) => processes.push(GpuProcess {
                            gpu_uuid: uuid.clone(),
                            pid,
                            used_mib,
                        }),
                        None => tracing::debug!(gpu = %uuid, pid, "NVML does not tell this process's GPU memory"),
                    }
                }
            }
            Err(err) => failed.push((uuid.clone(), err)),
        }
    }
    (processes, failed)
}

/// The enforcer task: every `interval` (at least [`MIN_INTERVAL`]) reads the compute processes of
/// the GPUs the current policy budgets (NVML and `/proc` on a blocking thread), takes the
/// policy's action, and sends what it did to `out`. The policy is re-read on every pass, so a
/// config change takes effect on the next one. Ends when the policy's sender or `out`'s receiver
/// is dropped.
pub async fn run(
    gpus: Gpus,
    root: HostRoot,
    mut policy: watch::Receiver<Policy>,
    interval: Duration,
    names: Arc<dyn PodNames + Send + Sync>,
    out: mpsc::Sender<ActionRecord>,
) {
    let mut ticker = tokio::time::interval(interval.max(MIN_INTERVAL));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut enforcer = None;
    let mut failing: BTreeSet<String> = BTreeSet::new();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            changed = policy.changed() => {
                if changed.is_err() {
                    return;
                }
                policy.borrow_and_update();
                continue;
            }
        }
        if out.is_closed() {
            return;
        }
        let current = policy.borrow_and_update().clone();
        if current.budgets.is_empty() {
            enforcer = None;
            continue;
        }
        let mut e = enforcer.take().unwrap_or_else(|| Enforcer::new(root.clone()));
        let (gpus, names) = (gpus.clone(), names.clone());
        let now = tokio::time::Instant::now().into_std();
        let job = tokio::task::spawn_blocking(move || {
            let (processes, failed) = read_processes(&gpus, current.budgets.keys());
            let records = e.pass(&processes, &*names, &current, now);
            (e, failed, records)
        });
        let (e, failed, records) = match job.await {
            Ok(done) => done,
            Err(err) => {
                tracing::error!("GPU memory limit pass failed: {err}; starting over");
                continue;
            }
        };
        enforcer = Some(e);
        let now_failing: BTreeSet<String> = failed.iter().map(|(uuid, _)| uuid.clone()).collect();
        for (uuid, err) in &failed {
            if !failing.contains(uuid) {
                tracing::warn!(gpu = %uuid, "GPU memory limits not enforced on this GPU: {err}");
            }
        }
        for uuid in failing.difference(&now_failing) {
            tracing::info!(gpu = %uuid, "GPU memory limits enforced on this GPU again");
        }
        failing = now_failing;
        for record in records {
            if out.send(record).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
        let crio =
            format!("0::/kubepods.slice/kubepods-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/crio-{CID}.scope");
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
        let text = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice";
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
}
