//! Bringing the GPUs to a named layout: plan every GPU (pure), refuse layouts that cannot fit
//! before touching anything, wait while GPU work runs, apply, and verify by planning again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::layout::MigLayout;
use super::planner::{DesiredGpu, PlanError, plan_gpu};
use super::state::{CiProfile, GpuPlan, ObservedGpu};
use crate::nvml::Gpus;

/// The plan for every GPU the layout covers (GPUs it does not cover are left alone). Pure.
pub fn plan_layout(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<GpuPlan>, PlanError> {
    observed.iter().filter_map(|gpu| plan_covered(gpu, layout)).collect()
}

/// The plan for one GPU, `None` when the layout does not cover it.
fn plan_covered(gpu: &ObservedGpu, layout: &MigLayout) -> Option<Result<GpuPlan, PlanError>> {
    let entry = layout.entry_for(gpu.index, gpu.pci_device_id)?;
    let desired = DesiredGpu {
        mig_enabled: entry.mig_enabled,
        profiles: entry.profiles.clone(),
    };
    Some(plan_gpu(gpu, &desired))
}

/// The GPUs (UUIDs) that converging to `layout` would change: those with operations in their
/// plan, and those whose compute instance profiles must first be read from NVML
/// ([`PlanError::CiProfilesUnknown`]: a change is certain there). Pure.
pub fn gpus_to_change(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<String>, PlanError> {
    let mut uuids = Vec::new();
    for gpu in observed {
        match plan_covered(gpu, layout) {
            None => {}
            Some(Ok(plan)) if plan.ops.is_empty() => {}
            Some(Ok(plan)) => uuids.push(plan.uuid),
            Some(Err(PlanError::CiProfilesUnknown { uuid, .. })) => uuids.push(uuid),
            Some(Err(e)) => return Err(e),
        }
    }
    Ok(uuids)
}

/// The GPU Operator's `nvidia.com/mig.config.state` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigState {
    Pending,
    Rebooting,
    Success,
    Failed,
}

impl MigState {
    pub fn as_str(self) -> &'static str {
        match self {
            MigState::Pending => "pending",
            MigState::Rebooting => "rebooting",
            MigState::Success => "success",
            MigState::Failed => "failed",
        }
    }
}

/// One pass toward a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Every covered GPU already matches: nothing was changed.
    Converged,
    /// Changes are needed on these GPUs (UUIDs), but processes run there: nothing was changed.
    Busy {
        gpus: Vec<String>,
        reason: String,
    },
    /// The plans were applied and the GPUs now match.
    Applied {
        mutations: usize,
        gpus: Vec<String>,
    },
    /// A mode change was accepted but waits for a GPU reset or reboot.
    ModePending {
        gpus: Vec<String>,
        reason: String,
    },
    Failed {
        reason: String,
    },
}

/// GPUs (UUIDs) a set of plans would change.
pub fn affected(plans: &[GpuPlan]) -> Vec<String> {
    plans
        .iter()
        .filter(|p| !p.ops.is_empty())
        .map(|p| p.uuid.clone())
        .collect()
}

/// Resets a GPU (by UUID) to finish a pending MIG mode change; `Err` says why it could not.
pub type ResetGpu<'a> = &'a dyn Fn(&str) -> Result<(), String>;

/// Blocking (NVML): observe, plan, check for GPU work, apply, verify. Never changes a GPU that
/// has processes on it, and never starts when the layout cannot fit. A mode change NVML leaves
/// pending is finished with `reset` when given (the GPU is idle: that was checked), then the
/// layout is applied again.
///
/// A compute instance form (`1c.4g.20gb`) of a GPU instance profile with no instance yet needs
/// NVML's compute instance profiles of it first; they are read from a short-lived instance
/// (after enabling MIG mode when it is off), and the layout is planned with them.
pub fn converge(gpus: &Gpus, name: &str, layout: &MigLayout, reset: Option<ResetGpu<'_>>) -> Step {
    converge_from(gpus, name, layout, reset, &mut Learned::new(), 0)
}

/// Compute instance profiles read from short-lived GPU instances: (GPU UUID, GPU instance
/// profile id) → profiles.
type Learned = BTreeMap<(String, u32), Vec<CiProfile>>;

/// How many times one converge may go back to observing (mode change, then reading compute
/// instance profiles of each GPU instance profile the layout needs): far more than a layout uses.
const MAX_ROUNDS: usize = 16;

fn observe(gpus: &Gpus, learned: &Learned) -> Result<Vec<ObservedGpu>, String> {
    let mut observed = gpus.mig_observe().map_err(|e| e.to_string())?;
    for gpu in &mut observed {
        for profile in gpu.profiles.iter_mut().filter(|p| !p.ci_profiles_read()) {
            if let Some(read) = learned.get(&(gpu.uuid.clone(), profile.id)) {
                profile.ci_profiles = read.clone();
            }
        }
    }
    Ok(observed)
}

fn converge_from(
    gpus: &Gpus,
    name: &str,
    layout: &MigLayout,
    reset: Option<ResetGpu<'_>>,
    learned: &mut Learned,
    round: usize,
) -> Step {
    let observed = match observe(gpus, learned) {
        Ok(o) => o,
        Err(e) => {
            return Step::Failed {
                reason: format!("cannot read the MIG state: {e}"),
            };
        }
    };
    let plans = match plan_layout(&observed, layout) {
        Ok(p) => p,
        Err(PlanError::CiProfilesUnknown {
            index,
            uuid,
            gi_profile,
            gi_profile_id,
            ..
        }) if round < MAX_ROUNDS => {
            let Some(gpu) = observed.iter().find(|g| g.index == index) else {
                return Step::Failed {
                    reason: format!("layout {name}: GPU {index} ({uuid}) went away while planning"),
                };
            };
            return match read_ci_profiles(gpus, name, gpu, &gi_profile, gi_profile_id, reset, learned) {
                Ok(mutations) => match converge_from(gpus, name, layout, reset, learned, round + 1) {
                    Step::Applied { mutations: more, gpus } => Step::Applied {
                        mutations: mutations + more,
                        gpus: merged(gpus, &uuid),
                    },
                    Step::Converged => Step::Applied {
                        mutations,
                        gpus: vec![uuid],
                    },
                    other => other,
                },
                Err(step) => step,
            };
        }
        Err(e) => {
            return Step::Failed {
                reason: format!("layout {name}: {e}; nothing changed"),
            };
        }
    };
    let changing = affected(&plans);
    if changing.is_empty() {
        return Step::Converged;
    }
    // A GPU whose processes NVML cannot list counts as busy: nothing is changed under work.
    let busy: BTreeMap<String, String> = changing
        .iter()
        .filter_map(|uuid| match gpus.process_count(uuid) {
            Some(0) => None,
            Some(n) => Some((uuid.clone(), n.to_string())),
            None => Some((uuid.clone(), "an unknown number of processes".into())),
        })
        .collect();
    if !busy.is_empty() {
        let list = busy
            .iter()
            .map(|(u, n)| format!("{n} on {u}"))
            .collect::<Vec<_>>()
            .join(", ");
        return Step::Busy {
            gpus: changing,
            reason: format!("waiting for GPU processes to end before changing MIG: {list}"),
        };
    }
    let mut mutations = 0;
    let mut pending = Vec::new();
    for plan in plans.iter().filter(|p| !p.ops.is_empty()) {
        tracing::info!("{}", super::planner::describe(plan));
        match gpus.mig_apply(plan) {
            Ok(applied) => {
                mutations += applied.mutations;
                if applied.mode_pending {
                    pending.push(plan.uuid.clone());
                }
            }
            Err(e) if e.in_use() => {
                return Step::Busy {
                    gpus: changing,
                    reason: format!("GPU in use: {e}"),
                };
            }
            Err(e) => {
                return Step::Failed {
                    reason: format!("layout {name}: {e}"),
                };
            }
        }
    }
    if !pending.is_empty() {
        let reason = format!(
            "the MIG mode change on {} is pending until the GPU is reset or the node reboots",
            pending.join(", ")
        );
        let Some(reset) = reset else {
            return Step::ModePending { gpus: pending, reason };
        };
        for uuid in &pending {
            tracing::info!(gpu = %uuid, "resetting {uuid} to finish its MIG mode change");
            if let Err(e) = reset(uuid) {
                return Step::ModePending {
                    gpus: pending.clone(),
                    reason: format!("{reason}; the reset failed: {e}"),
                };
            }
        }
        // Once more, without resetting again: the mode is current now, the instances follow.
        return match converge_from(gpus, name, layout, None, learned, round + 1) {
            Step::Applied { mutations: more, .. } => Step::Applied {
                mutations: mutations + more,
                gpus: changing,
            },
            Step::Converged => Step::Applied {
                mutations,
                gpus: changing,
            },
            other => other,
        };
    }
    // Verify: a second plan must be empty.
    match gpus
        .mig_observe()
        .map_err(|e| e.to_string())
        .and_then(|o| plan_layout(&o, layout).map_err(|e| e.to_string()))
    {
        Ok(again) if affected(&again).is_empty() => Step::Applied {
            mutations,
            gpus: changing,
        },
        Ok(again) => Step::Failed {
            reason: format!(
                "layout {name} applied but the GPUs do not match it: still {} to change",
                affected(&again).join(", ")
            ),
        },
        Err(e) => Step::Failed {
            reason: format!("layout {name}: verifying: {e}"),
        },
    }
}

/// Makes NVML's compute instance profiles of `gi_profile` on `gpu` known (into `learned`):
/// enables MIG mode first when it is not on (finishing it with `reset` when NVML leaves it
/// pending), then reads them from a short-lived GPU instance. Only on an idle GPU. `Ok` carries
/// the NVML mutations made; `Err` the step to report instead.
fn read_ci_profiles(
    gpus: &Gpus,
    name: &str,
    gpu: &ObservedGpu,
    gi_profile: &str,
    gi_profile_id: u32,
    reset: Option<ResetGpu<'_>>,
    learned: &mut Learned,
) -> Result<usize, Step> {
    let uuid = gpu.uuid.clone();
    match gpus.process_count(&uuid) {
        Some(0) => {}
        n => {
            let n = n.map_or("an unknown number of".to_string(), |n| n.to_string());
            return Err(Step::Busy {
                gpus: vec![uuid.clone()],
                reason: format!("waiting for GPU processes to end before changing MIG: {n} on {uuid}"),
            });
        }
    }
    let failed = |e: super::apply::MigCallError| {
        if e.in_use() {
            Step::Busy {
                gpus: vec![uuid.clone()],
                reason: format!("GPU in use: {e}"),
            }
        } else {
            Step::Failed {
                reason: format!("layout {name}: {e}"),
            }
        }
    };
    if !gpu.mode.is_some_and(|m| m.current) {
        let plan = GpuPlan {
            index: gpu.index,
            uuid: uuid.clone(),
            ops: vec![super::state::MigOp::SetMode { enabled: true }],
        };
        tracing::info!("{}", super::planner::describe(&plan));
        let applied = gpus.mig_apply(&plan).map_err(failed)?;
        if applied.mode_pending {
            let reason = format!("the MIG mode change on {uuid} is pending until the GPU is reset or the node reboots");
            let Some(reset) = reset else {
                return Err(Step::ModePending {
                    gpus: vec![uuid],
                    reason,
                });
            };
            tracing::info!(gpu = %uuid, "resetting {uuid} to finish its MIG mode change");
            if let Err(e) = reset(&uuid) {
                return Err(Step::ModePending {
                    gpus: vec![uuid],
                    reason: format!("{reason}; the reset failed: {e}"),
                });
            }
        }
        // Observe again: the compute instance profiles are read once the mode is current.
        return Ok(applied.mutations);
    }
    tracing::info!(
        gpu = %uuid,
        "reading NVML's compute instance profiles of {gi_profile} from a short-lived GPU instance on {uuid}"
    );
    match gpus.mig_read_ci_profiles(gpu.index, gi_profile_id).map_err(failed)? {
        Some(profiles) => {
            learned.insert((uuid, gi_profile_id), profiles);
            Ok(2)
        }
        None => Err(Step::Failed {
            reason: format!(
                "layout {name}: GPU {} ({uuid}) has no room for a {gi_profile} GPU instance, and NVML lists the \
                 compute instance profiles of {gi_profile} only inside one; apply a layout that frees room first \
                 (e.g. all-disabled); nothing changed",
                gpu.index
            ),
        }),
    }
}

fn merged(mut gpus: Vec<String>, uuid: &str) -> Vec<String> {
    if !gpus.iter().any(|g| g == uuid) {
        gpus.insert(0, uuid.to_string());
    }
    gpus
}

/// The current state of every MIG-capable GPU as a layout (`mig export`): one entry per GPU.
pub fn export(observed: &[ObservedGpu]) -> MigLayout {
    use super::layout::{DeviceSelector, LayoutEntry};
    let entries = observed
        .iter()
        .filter(|g| g.mode.is_some())
        .map(|g| {
            let enabled = g.mode.is_some_and(|m| m.current);
            let mut profiles = BTreeMap::new();
            for gi in &g.gpu_instances {
                let Some(p) = g.profiles.iter().find(|p| p.id == gi.profile_id) else {
                    continue;
                };
                for ci in &gi.compute_instances {
                    let ci_profile = p.ci_profiles.iter().find(|c| c.id == ci.profile_id);
                    let name = match ci_profile {
                        Some(c) if c.slice_count < p.slice_count => c.name.clone(),
                        _ => p.name.clone(),
                    };
                    *profiles.entry(name).or_insert(0) += 1;
                }
                if gi.compute_instances.is_empty() {
                    *profiles.entry(p.name.clone()).or_insert(0) += 1;
                }
            }
            LayoutEntry {
                devices: DeviceSelector::Indices(vec![g.index]),
                device_filter: Vec::new(),
                mig_enabled: enabled,
                profiles: if enabled { profiles } else { BTreeMap::new() },
            }
        })
        .collect();
    MigLayout::new(entries)
}
