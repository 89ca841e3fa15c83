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
//!
//! This file holds the enforcer (what it did to each process, the signals) and its task;
//! `process.rs` reads a process (the pod its cgroup names, its start time) and signals it,
//! `names.rs` turns a pod UID and container ID into names, `policy.rs` is the policy and the
//! pure check of one pass.

mod names;
mod policy;
mod process;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::MissedTickBehavior;

use crate::host::HostRoot;
use crate::nvml::{GpuError, Gpus};
use policy::over_budget;

pub use names::{KubeletLogNames, NoNames, PodName, PodNames, parse_container_log_name, parse_pod_log_dir};
pub use policy::{Action, Decision, Finding, GpuProcess, Policy, check};
pub use process::{HostProcesses, PodRef, ProcessControl, Qos, parse_stat, pod_of_cgroup};

/// The shortest interval [`run`] checks on; a shorter one is raised to this.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

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
mod tests;
