//! Bringing the GPUs to a named layout: plan every GPU (pure), refuse layouts that cannot fit
//! before touching anything, wait while GPU work runs, apply, and verify by planning again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::layout::MigLayout;
use super::planner::{DesiredGpu, PlanError, plan_gpu};
use super::state::{GpuPlan, ObservedGpu};
use crate::nvml::Gpus;

/// The plan for every GPU the layout covers (GPUs it does not cover are left alone). Pure.
pub fn plan_layout(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<GpuPlan>, PlanError> {
    let mut plans = Vec::new();
    for gpu in observed {
        let Some(entry) = layout.entry_for(gpu.index, gpu.pci_device_id) else {
            continue;
        };
        let desired = DesiredGpu {
            mig_enabled: entry.mig_enabled,
            profiles: entry.profiles.clone(),
        };
        plans.push(plan_gpu(gpu, &desired)?);
    }
    Ok(plans)
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
pub fn converge(gpus: &Gpus, name: &str, layout: &MigLayout, reset: Option<ResetGpu<'_>>) -> Step {
    let observed = match gpus.mig_observe() {
        Ok(o) => o,
        Err(e) => {
            return Step::Failed {
                reason: format!("cannot read the MIG state: {e}"),
            };
        }
    };
    let plans = match plan_layout(&observed, layout) {
        Ok(p) => p,
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
        return match converge(gpus, name, layout, None) {
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
