//! The policy (budgets per GPU, the action, the grace period) and one pass's pure check: which
//! processes are over budget, and whether each is a pod's to act on.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::names::{PodName, PodNames};
use super::process::{PodRef, pod_of_cgroup};

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
pub(super) fn over_budget(p: &GpuProcess, policy: &Policy) -> Option<u64> {
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
