//! Bringing the GPUs to a named layout: plan every GPU (pure), refuse layouts that cannot fit
//! before touching anything, wait while GPU work runs, apply, and verify by planning again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::planner::{DesiredGpu, PlanError, plan_gpu};
use super::state::{CiProfile, GiRef, GpuPlan, MigOp, ObservedGpu};
use crate::mig_layout::defaults;
use crate::mig_layout::{DeviceSelector, Generated, LayoutEntry, MigLayout, ProfileFacts, Uncovered};
use crate::nvml::{Gpus, Inventory, MigDeviceInfo};

/// The plan for every GPU the layout covers. A MIG-capable GPU that no entry covers is left as
/// it is (mig-manager's behaviour), or with [`Uncovered::Fail`] an error
/// ([`PlanError::NotCovered`]); a GPU without MIG is left out when no entry covers it, or when
/// no entry naming it explicitly enables MIG (mig-parted skips it under `devices: all` and with
/// MIG disabled). A built-in layout ([`Generated`] entries) that covers no GPU of the node is an
/// error ([`PlanError::NoGpuHasProfile`]): its name means nothing here. Every GPU is planned
/// before answering, and an error that no read of NVML's compute instance profiles can lift
/// wins over [`PlanError::CiProfilesUnknown`] and [`PlanError::GiProfilesUnknown`] (profiles
/// converge reads from NVML first) on another GPU. Pure.
pub fn plan_layout(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<GpuPlan>, PlanError> {
    let planned = plan_all(observed, layout)?;
    match planned.unknown.into_iter().next() {
        Some(unknown) => Err(unknown),
        None => Ok(planned.plans),
    }
}

/// Every GPU planned: the plans, and the [`PlanError::CiProfilesUnknown`] and
/// [`PlanError::GiProfilesUnknown`] of the GPUs that need profiles read first (everything else
/// about them holds).
#[derive(Debug, Clone)]
struct Planned {
    plans: Vec<GpuPlan>,
    unknown: Vec<PlanError>,
}

impl Planned {
    /// The GPUs (UUIDs, in NVML order) that will change: operations planned, or profiles to
    /// read first.
    fn changing(&self, observed: &[ObservedGpu]) -> Vec<String> {
        let planned = affected(&self.plans);
        observed
            .iter()
            .map(|g| &g.uuid)
            .filter(|uuid| planned.contains(uuid) || self.unknown.iter().any(|e| e.read_first() == Some(uuid.as_str())))
            .cloned()
            .collect()
    }
}

fn plan_all(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Planned, PlanError> {
    #[cfg(test)]
    PLANS_MADE.with(|n| n.set(n.get() + 1));
    let mut planned = Planned {
        plans: Vec::new(),
        unknown: Vec::new(),
    };
    let mut covered = false;
    for gpu in observed {
        match plan_covered(gpu, layout) {
            None => {}
            Some(Ok(plan)) => {
                covered = true;
                planned.plans.push(plan)
            }
            Some(Err(e)) if e.read_first().is_some() => {
                covered = true;
                planned.unknown.push(e)
            }
            Some(Err(e)) => return Err(e),
        }
    }
    let generated = layout.entries.iter().find_map(|e| e.generated.as_ref());
    if let Some(generated) = generated
        && !covered
    {
        return Err(PlanError::NoGpuHasProfile {
            wanted: match generated {
                Generated::Max(profile) => format!("the profile {profile}"),
                Generated::Balanced => "a balanced layout (2 × 1g, 1 × 2g and on 7-slice GPUs 1 × 3g)".to_owned(),
            },
            gpus: observed
                .iter()
                .filter(|g| g.mode.is_some())
                .map(|g| {
                    let names: Vec<&str> = g.profiles.iter().map(|p| p.name.as_str()).collect();
                    format!("GPU {} has {}", g.index, names.join(", "))
                })
                .collect(),
        });
    }
    Ok(planned)
}

/// Whether NVML lists no GPU instance profiles for `gpu` while its MIG mode is off: drivers of
/// the R535 class list them only once MIG mode is enabled, so they are read by enabling it
/// ([`PlanError::GiProfilesUnknown`]).
fn profiles_unread(gpu: &ObservedGpu) -> bool {
    gpu.profiles.is_empty() && gpu.mode.is_some_and(|m| !m.current)
}

/// The profiles `entry` asks of `gpu`: its own, or those generated from the GPU's profile
/// table; `None` when a generated entry has nothing for this GPU (it does not cover it). When
/// NVML lists no profiles, the Operator's table for the GPU's model stands in; for a GPU whose
/// profiles are still to be read ([`profiles_unread`]) it only decides whether the entry covers
/// it (they are read, then planned with), and a model the table does not know is covered (an
/// empty placeholder): only the read can tell.
fn desired_profiles(gpu: &ObservedGpu, entry: &LayoutEntry) -> Option<BTreeMap<String, u32>> {
    let Some(generated) = &entry.generated else {
        return Some(entry.profiles.clone());
    };
    if gpu.profiles.is_empty() {
        let fallback = defaults::fallback(generated, gpu.pci_device_id);
        return match fallback {
            None if profiles_unread(gpu) && !defaults::knows(gpu.pci_device_id) => Some(BTreeMap::new()),
            fallback => fallback,
        };
    }
    let facts: Vec<ProfileFacts> = gpu
        .profiles
        .iter()
        .map(|p| ProfileFacts {
            name: &p.name,
            slices: p.slice_count,
            instances: p.instance_count,
        })
        .collect();
    generated.profiles_for(&facts)
}

/// The plan for one GPU, `None` when the layout leaves it alone (see [`plan_layout`]).
fn plan_covered(gpu: &ObservedGpu, layout: &MigLayout) -> Option<Result<GpuPlan, PlanError>> {
    // Each entry that applies, with what it asks of this GPU; a generated entry with nothing
    // for a MIG GPU does not apply to it.
    let entries: Vec<(&LayoutEntry, Option<BTreeMap<String, u32>>)> = layout
        .entries_for(gpu.index, gpu.pci_ids())
        .into_iter()
        .map(|e| (e, desired_profiles(gpu, e)))
        .filter(|(e, profiles)| !e.mig_enabled || gpu.mode.is_none() || profiles.is_some())
        .collect();
    let Some((entry, profiles)) = entries.last() else {
        return (gpu.mode.is_some() && layout.uncovered == Uncovered::Fail).then(|| {
            Err(PlanError::NotCovered {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: None,
                pci_device_id: gpu.pci_device_id,
            })
        });
    };
    let named_and_enabled = entries
        .iter()
        .any(|(e, _)| e.mig_enabled && matches!(e.devices, DeviceSelector::Indices(_)));
    if gpu.mode.is_none() && !named_and_enabled {
        return None;
    }
    let desired = DesiredGpu {
        mig_enabled: entry.mig_enabled,
        profiles: profiles.clone().unwrap_or_default(),
    };
    // Profiles are needed to plan MIG devices (and those of a generated entry come from them);
    // a GPU that ends with MIG disabled, or enabled with no MIG devices, needs none.
    let wants_devices = entry.generated.is_some() || desired.profiles.values().any(|&n| n > 0);
    if entry.mig_enabled && wants_devices && profiles_unread(gpu) {
        return Some(Err(PlanError::GiProfilesUnknown {
            gpu: format!("{} ({})", gpu.index, gpu.uuid),
            index: gpu.index,
            uuid: gpu.uuid.clone(),
        }));
    }
    Some(plan_gpu(gpu, &desired))
}

#[cfg(test)]
thread_local! {
    /// How many times a layout was planned on this thread ([`plan_all`]): the daemon's MIG
    /// stage plans once per pass, and its tests count.
    pub(crate) static PLANS_MADE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One reading of NVML's MIG state with the layout planned on it. The daemon's MIG stage reads
/// and plans once per pass: what would change, whether the mode changes, and the first round of
/// [`converge_from`] all come from it. Pure (the reading is the caller's).
#[derive(Debug, Clone)]
pub struct LayoutPlan {
    observed: Vec<ObservedGpu>,
    planned: Planned,
}

impl LayoutPlan {
    /// Plans `layout` on `observed`. Errors as [`plan_layout`]'s, less the profiles to read
    /// first (those GPUs count as changing).
    pub fn new(observed: Vec<ObservedGpu>, layout: &MigLayout) -> Result<Self, PlanError> {
        let planned = plan_all(&observed, layout)?;
        Ok(LayoutPlan { observed, planned })
    }

    /// As [`gpus_to_change`].
    pub fn changing(&self) -> Vec<String> {
        self.planned.changing(&self.observed)
    }

    /// As [`changes_mode`].
    pub fn changes_mode(&self) -> bool {
        mode_changes(&self.observed, &self.planned)
    }
}

/// The GPUs (UUIDs) that converging to `layout` would change: those with operations in their
/// plan, and those whose profiles must first be read from NVML ([`PlanError::read_first`]: a
/// change is certain there). Errors as [`plan_layout`]'s. Pure.
pub fn gpus_to_change(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<String>, PlanError> {
    let planned = plan_all(observed, layout)?;
    Ok(planned.changing(observed))
}

/// Whether converging to `layout` changes the MIG mode of a GPU: a plan sets it, or MIG must be
/// enabled first on a GPU whose profiles are to be read. Errors as [`plan_layout`]'s. Pure.
pub fn changes_mode(observed: &[ObservedGpu], layout: &MigLayout) -> Result<bool, PlanError> {
    let planned = plan_all(observed, layout)?;
    Ok(mode_changes(observed, &planned))
}

fn mode_changes(observed: &[ObservedGpu], planned: &Planned) -> bool {
    let sets_mode = |p: &GpuPlan| p.ops.iter().any(|op| matches!(op, MigOp::SetMode { .. }));
    let enables_first = |e: &PlanError| {
        e.read_first().is_some_and(|uuid| {
            observed
                .iter()
                .any(|g| g.uuid == uuid && !g.mode.is_some_and(|m| m.current))
        })
    };
    planned.plans.iter().any(sets_mode) || planned.unknown.iter().any(enables_first)
}

/// What converging to `layout` must read from NVML before it can plan the whole layout, one
/// line per GPU and read, for `plan`: empty when [`plan_layout`] plans it in full. Says which
/// GPUs get MIG mode enabled for it, and which have their GPU instances destroyed first to make
/// room for the short-lived instance compute instance profiles are read from (the layout
/// replaces them anyway; [`converge`] makes them again when the layout then fails). Errors as
/// [`plan_layout`]'s. Pure.
pub fn reads_first(observed: &[ObservedGpu], layout: &MigLayout) -> Result<Vec<String>, PlanError> {
    let planned = plan_all(observed, layout)?;
    let mut lines = Vec::new();
    for e in &planned.unknown {
        let Some(gpu) = observed.iter().find(|g| Some(g.uuid.as_str()) == e.read_first()) else {
            continue;
        };
        let index = gpu.index;
        let enable = if gpu.mode.is_some_and(|m| m.current) {
            String::new()
        } else {
            format!(", after enabling MIG mode on GPU {index}")
        };
        lines.push(match e {
            PlanError::GiProfilesUnknown { .. } => format!(
                "{e}: applying enables MIG mode on GPU {index} to read them (it is disabled again if the layout \
                 then fails)"
            ),
            PlanError::CiProfilesUnknown {
                gi_profile,
                gi_profile_id,
                ..
            } if !has_room(gpu, *gi_profile_id) => format!(
                "{e}: applying reads them from a short-lived {gi_profile} GPU instance on GPU {index}, which has no \
                 room for one: its {} GPU instance(s) are destroyed first (the layout replaces them; they are made \
                 again if it then fails)",
                gpu.gpu_instances.len()
            ),
            PlanError::CiProfilesUnknown { gi_profile, .. } => {
                format!("{e}: applying reads them from a short-lived {gi_profile} GPU instance on GPU {index}{enable}")
            }
            other => other.to_string(),
        });
    }
    Ok(lines)
}

/// Whether a GPU instance of profile `profile_id` has a placement on `gpu` that no existing GPU
/// instance overlaps (NVML would make one there). Pure.
fn has_room(gpu: &ObservedGpu, profile_id: u32) -> bool {
    let Some(profile) = gpu.profiles.iter().find(|p| p.id == profile_id) else {
        return false;
    };
    let overlaps = |a: &super::state::Placement, b: &super::state::Placement| {
        a.start < b.start + b.size && b.start < a.start + a.size
    };
    let existing = gpu
        .gpu_instances
        .iter()
        .filter(|gi| gi.profile_id == profile_id)
        .count();
    u32::try_from(existing).is_ok_and(|n| n < profile.instance_count)
        && profile
            .placements
            .iter()
            .any(|p| !gpu.gpu_instances.iter().any(|gi| overlaps(p, &gi.placement)))
}

/// Called once, right before a converge's first NVML change (the GPUs it changes were found
/// idle): stops the host's GPU clients. `Err` (why) ends the converge with nothing changed.
pub type BeforeChange<'a> = &'a mut dyn FnMut() -> Result<(), String>;

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
    /// The agent is stopping: the apply was left between two NVML operations after these many
    /// (the next start re-observes and converges from there).
    Stopped {
        mutations: usize,
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
/// NVML's compute instance profiles of it first. Everything else about the layout is checked on
/// every GPU before that ([`plan_layout`]); then they are read from a short-lived instance
/// (after enabling MIG mode when it is off), and the layout is planned with them. When it fails
/// before its own plans are applied, a MIG mode enabled only to read them is disabled again
/// (finished with `reset` where NVML leaves that pending), and the reason says so. A GPU with
/// MIG on and no room for that short-lived instance has its GPU instances destroyed first: the
/// layout replaces them anyway (it wants an instance of a profile the GPU has none of), and when
/// the layout then fails before its own plans are applied they are made again, with the same
/// profiles and placements (their MIG devices get new UUIDs), and the reason says so.
///
/// A GPU whose NVML lists no GPU instance profiles while MIG mode is off (drivers of the R535
/// class; [`PlanError::GiProfilesUnknown`]) and that must end with MIG devices gets MIG mode
/// enabled the same way, on the same conditions (idle, `before_change` first), to read them;
/// undone the same way. When the layout turns out not to cover that GPU once they are read (a
/// built-in layout whose profile its model lacks), MIG mode is disabled again there and the
/// rest of the layout applies.
///
/// `stop` (the daemon's SIGTERM) is looked at between NVML operations: once cancelled, the
/// converge returns [`Step::Stopped`] without starting another.
///
/// `before_change` runs once, after the idle check and before the first NVML change (never
/// when nothing is to change or the GPUs are busy); when it fails the converge fails with its
/// reason and nothing changed.
pub fn converge(
    gpus: &Gpus,
    name: &str,
    layout: &MigLayout,
    reset: Option<ResetGpu<'_>>,
    stop: Option<&CancellationToken>,
    before_change: Option<BeforeChange<'_>>,
) -> Step {
    converge_with(gpus, name, layout, None, reset, stop, before_change)
}

/// [`converge`] starting from `first`, read and planned by the caller on the same GPUs (the
/// daemon's MIG stage, once per pass): its first round neither reads NVML's MIG state nor plans
/// again. Later rounds (after a mode change, a profile read, the verify) read and plan anew.
pub fn converge_from(
    gpus: &Gpus,
    name: &str,
    layout: &MigLayout,
    first: LayoutPlan,
    reset: Option<ResetGpu<'_>>,
    stop: Option<&CancellationToken>,
    before_change: Option<BeforeChange<'_>>,
) -> Step {
    converge_with(gpus, name, layout, Some(first), reset, stop, before_change)
}

fn converge_with(
    gpus: &Gpus,
    name: &str,
    layout: &MigLayout,
    first: Option<LayoutPlan>,
    reset: Option<ResetGpu<'_>>,
    stop: Option<&CancellationToken>,
    before_change: Option<BeforeChange<'_>>,
) -> Step {
    let mut run = Run {
        gpus,
        name,
        layout,
        first,
        stop,
        before_change,
        learned: Learned::new(),
        listed: BTreeMap::new(),
        enabled: Vec::new(),
        cleared: Vec::new(),
        applying: false,
    };
    let step = run.step(reset, 0);
    run.undo_probes(step, reset)
}

/// Compute instance profiles read from short-lived GPU instances: (GPU UUID, GPU instance
/// profile id) → profiles.
type Learned = BTreeMap<(String, u32), Vec<CiProfile>>;

/// How many times one converge may go back to observing (mode change, then reading compute
/// instance profiles of each GPU instance profile the layout needs): far more than a layout uses.
const MAX_ROUNDS: usize = 16;

/// One converge.
struct Run<'a, 'b> {
    gpus: &'a Gpus,
    stop: Option<&'a CancellationToken>,
    name: &'a str,
    layout: &'a MigLayout,
    /// The caller's reading and plan, for the first round ([`converge_from`]).
    first: Option<LayoutPlan>,
    learned: Learned,
    /// The GPU instance profiles each GPU (UUID) listed in this converge: they stand in where
    /// the GPU lists none later (its MIG mode enabled to read them, then disabled again).
    listed: BTreeMap<String, Vec<super::state::GiProfile>>,
    /// GPUs on which this converge enabled MIG mode to read profiles.
    enabled: Vec<Probe>,
    /// GPUs whose GPU instances this converge destroyed to make room for a short-lived one, as
    /// they were.
    cleared: Vec<ObservedGpu>,
    /// Set once the layout's own plans are being applied: what changes from then on is the
    /// layout's doing, and stays.
    applying: bool,
    /// Runs before the first NVML change; taken when it has run.
    before_change: Option<BeforeChange<'b>>,
}

/// NVML's MIG state, with what this converge read before: GPU instance profiles a GPU listed
/// earlier where it lists none now, compute instance profiles read from short-lived instances.
fn observe(
    gpus: &Gpus,
    learned: &Learned,
    listed: &mut BTreeMap<String, Vec<super::state::GiProfile>>,
) -> Result<Vec<ObservedGpu>, String> {
    let mut observed = gpus.mig_observe().map_err(|e| e.to_string())?;
    remember(&mut observed, learned, listed);
    Ok(observed)
}

/// Completes `observed` with what this converge read before (see [`observe`]) and notes the GPU
/// instance profiles each GPU lists now.
fn remember(
    observed: &mut [ObservedGpu],
    learned: &Learned,
    listed: &mut BTreeMap<String, Vec<super::state::GiProfile>>,
) {
    for gpu in observed {
        if gpu.profiles.is_empty() {
            if let Some(profiles) = listed.get(&gpu.uuid) {
                gpu.profiles = profiles.clone();
            }
        } else {
            listed.insert(gpu.uuid.clone(), gpu.profiles.clone());
        }
        for profile in gpu.profiles.iter_mut().filter(|p| !p.ci_profiles_read()) {
            if let Some(read) = learned.get(&(gpu.uuid.clone(), profile.id)) {
                profile.ci_profiles = read.clone();
            }
        }
    }
}

/// A GPU on which a converge enabled MIG mode only to read profiles.
struct Probe {
    index: u32,
    uuid: String,
    /// What was read: `its GPU instance profiles`.
    what: String,
}

/// The plan that makes `gpu`'s GPU and compute instances again as they are, with the same
/// profiles and placements, on the GPU once they are gone. Pure.
fn rebuild(gpu: &ObservedGpu) -> GpuPlan {
    let mut ops = Vec::new();
    for (n, gi) in gpu.gpu_instances.iter().enumerate() {
        let profile = gpu.profiles.iter().find(|p| p.id == gi.profile_id);
        ops.push(MigOp::CreateGi {
            profile_id: gi.profile_id,
            placement: gi.placement,
            name: profile.map_or_else(|| format!("profile {}", gi.profile_id), |p| p.name.clone()),
        });
        for ci in &gi.compute_instances {
            let name = profile
                .and_then(|p| p.ci_profiles.iter().find(|c| c.id == ci.profile_id))
                .map_or_else(
                    || format!("compute instance profile {}", ci.profile_id),
                    |c| c.name.clone(),
                );
            ops.push(MigOp::CreateCi {
                gi: GiRef::New(n),
                profile_id: ci.profile_id,
                placement: ci.placement,
                name,
            });
        }
    }
    GpuPlan {
        index: gpu.index,
        uuid: gpu.uuid.clone(),
        ops,
    }
}

/// NVML's name of GPU `index` (`NVIDIA A100-SXM4-40GB`), when it answers.
fn model_name(gpus: &Gpus, index: u32) -> Option<String> {
    gpus.nvml().device_by_index(index).ok()?.name().ok()
}

impl Run<'_, '_> {
    /// Right before the first NVML change: runs `before_change` (once). `Err`: the step to
    /// report, nothing changed.
    fn prepare(&mut self) -> Result<(), Step> {
        match self.before_change.take() {
            Some(before) => before().map_err(|e| Step::Failed {
                reason: format!("layout {}: {e}; nothing changed", self.name),
            }),
            None => Ok(()),
        }
    }

    /// A layout refused by the planner; nothing changed (unless this converge read compute
    /// instance profiles first: [`Run::undo_probes`] says what then).
    fn refused(&self, e: PlanError) -> Step {
        let e = match e {
            PlanError::NotCovered {
                index,
                uuid,
                model: None,
                pci_device_id,
            } => PlanError::NotCovered {
                index,
                uuid,
                model: model_name(self.gpus, index),
                pci_device_id,
            },
            e => e,
        };
        Step::Failed {
            reason: format!("layout {}: {e}; nothing changed", self.name),
        }
    }

    fn step(&mut self, reset: Option<ResetGpu<'_>>, round: usize) -> Step {
        if self.stop.is_some_and(CancellationToken::is_cancelled) {
            return Step::Stopped { mutations: 0 };
        }
        let (gpus, name) = (self.gpus, self.name);
        let (observed, planned) = match self.first.take() {
            Some(LayoutPlan { mut observed, planned }) => {
                // Nothing learned yet in this converge: this only notes what the GPUs list.
                remember(&mut observed, &self.learned, &mut self.listed);
                (observed, planned)
            }
            None => {
                let observed = match observe(gpus, &self.learned, &mut self.listed) {
                    Ok(o) => o,
                    Err(e) => {
                        return Step::Failed {
                            reason: format!("cannot read the MIG state: {e}"),
                        };
                    }
                };
                match plan_all(&observed, self.layout) {
                    Ok(p) => (observed, p),
                    Err(e) => return self.refused(e),
                }
            }
        };
        // A GPU whose MIG mode was enabled only to read its GPU instance profiles, and that the
        // layout turns out not to cover: back as it was before the rest is applied.
        if !self.applying {
            let covered = |uuid: &str| {
                planned.plans.iter().any(|p| p.uuid == uuid)
                    || planned.unknown.iter().any(|e| e.read_first() == Some(uuid))
            };
            let (left, kept): (Vec<Probe>, Vec<Probe>) = std::mem::take(&mut self.enabled)
                .into_iter()
                .partition(|p| !covered(&p.uuid));
            self.enabled = kept;
            if !left.is_empty() {
                let (notes, mutations) = self.undo_enabled(&left, reset);
                tracing::warn!(
                    "layout {name} does not cover it once its profiles are read: {}",
                    notes.join("; ")
                );
                let gpus: Vec<String> = left.into_iter().map(|p| p.uuid).collect();
                return match self.step(reset, round + 1) {
                    Step::Converged => Step::Applied { mutations, gpus },
                    Step::Applied {
                        mutations: more,
                        gpus: also,
                    } => Step::Applied {
                        mutations: mutations + more,
                        gpus: gpus.iter().fold(also, |all, uuid| merged(all, uuid)),
                    },
                    other => other,
                };
            }
        }
        let changing = planned.changing(&observed);
        if changing.is_empty() {
            return Step::Converged;
        }
        // A GPU whose processes NVML cannot list counts as busy: nothing is changed under work,
        // not even to read compute instance profiles.
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
        if let Some(unknown) = planned.unknown.into_iter().next() {
            let uuid = match unknown.read_first() {
                Some(uuid) if round < MAX_ROUNDS => uuid.to_string(),
                _ => return self.refused(unknown),
            };
            let Some(gpu) = observed.iter().find(|g| g.uuid == uuid) else {
                return Step::Failed {
                    reason: format!("layout {name}: GPU {uuid} went away while planning"),
                };
            };
            let read = match &unknown {
                PlanError::CiProfilesUnknown {
                    gi_profile,
                    gi_profile_id,
                    ..
                } => self.read_ci_profiles(gpu, gi_profile, *gi_profile_id, reset),
                _ => self.read_gi_profiles(gpu, reset),
            };
            return match read {
                Ok(mutations) => match self.step(reset, round + 1) {
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
        if let Err(step) = self.prepare() {
            return step;
        }
        let plans = planned.plans;
        self.applying = true;
        let mut mutations = 0;
        let mut pending = Vec::new();
        let stop = self.stop;
        let stopped = move || stop.is_some_and(CancellationToken::is_cancelled);
        for plan in plans.iter().filter(|p| !p.ops.is_empty()) {
            tracing::info!("{}", super::planner::describe(plan));
            match gpus.mig_apply_until(plan, &stopped) {
                Ok(applied) if applied.stopped => {
                    tracing::warn!(
                        "layout {name}: stopping after {} NVML operation(s); the next start converges from here",
                        mutations + applied.mutations
                    );
                    return Step::Stopped {
                        mutations: mutations + applied.mutations,
                    };
                }
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
            return match self.step(None, round + 1) {
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
        match observe(gpus, &self.learned, &mut self.listed)
            .and_then(|o| plan_layout(&o, self.layout).map_err(|e| e.to_string()))
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

    /// Checks that `gpu` is idle (NVML lists no processes on it), then runs `before_change`
    /// (once): what every read does before its first change. `Err`: the step to report.
    fn idle_before_reading(&mut self, uuid: &str) -> Result<(), Step> {
        match self.gpus.process_count(uuid) {
            Some(0) => {}
            n => {
                let n = n.map_or("an unknown number of".to_string(), |n| n.to_string());
                return Err(Step::Busy {
                    gpus: vec![uuid.to_string()],
                    reason: format!("waiting for GPU processes to end before changing MIG: {n} on {uuid}"),
                });
            }
        }
        self.prepare()
    }

    /// How a failed NVML call during a read is reported: busy when NVML says the GPU is in use.
    fn read_failed(&self, uuid: &str, e: super::apply::MigCallError) -> Step {
        if e.in_use() {
            Step::Busy {
                gpus: vec![uuid.to_string()],
                reason: format!("GPU in use: {e}"),
            }
        } else {
            Step::Failed {
                reason: format!("layout {}: {e}", self.name),
            }
        }
    }

    /// Enables MIG mode on `gpu` (idle, `before_change` run) to read `what` (`its GPU instance
    /// profiles`), finishing it with `reset` when NVML leaves it pending, and notes it in
    /// `enabled` (unless a pending enable was there before: that is not this converge's doing).
    /// `Ok`: the NVML mutations made (observe again: the profiles are read once the mode is
    /// current).
    fn enable_to_read(&mut self, gpu: &ObservedGpu, what: &str, reset: Option<ResetGpu<'_>>) -> Result<usize, Step> {
        let uuid = gpu.uuid.clone();
        let plan = GpuPlan {
            index: gpu.index,
            uuid: uuid.clone(),
            ops: vec![MigOp::SetMode { enabled: true }],
        };
        tracing::info!("{} (to read {what})", super::planner::describe(&plan));
        let applied = self.gpus.mig_apply(&plan).map_err(|e| self.read_failed(&uuid, e))?;
        if !gpu.mode.is_some_and(|m| m.pending) {
            self.enabled.push(Probe {
                index: gpu.index,
                uuid: uuid.clone(),
                what: what.to_string(),
            });
        }
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
        Ok(applied.mutations)
    }

    /// Makes NVML's GPU instance profiles of `gpu` known, which its driver lists only while MIG
    /// mode is on ([`PlanError::GiProfilesUnknown`]): enables MIG mode on it (only when idle).
    /// `Ok` carries the NVML mutations made; `Err` the step to report instead.
    fn read_gi_profiles(&mut self, gpu: &ObservedGpu, reset: Option<ResetGpu<'_>>) -> Result<usize, Step> {
        self.idle_before_reading(&gpu.uuid)?;
        tracing::info!(
            gpu = %gpu.uuid,
            "NVML lists no GPU instance profiles for GPU {} while MIG mode is off: enabling it to read them",
            gpu.index
        );
        self.enable_to_read(gpu, "its GPU instance profiles", reset)
    }

    /// Makes NVML's compute instance profiles of `gi_profile` on `gpu` known (into `learned`):
    /// enables MIG mode first when it is not on ([`Run::enable_to_read`]), then reads them from a
    /// short-lived GPU instance. When the GPU has no room for one, its GPU instances are
    /// destroyed first (the layout replaces them: it wants an instance of a profile the GPU has
    /// none of), noted in `cleared`. Only on an idle GPU. `Ok` carries the NVML mutations made;
    /// `Err` the step to report instead.
    fn read_ci_profiles(
        &mut self,
        gpu: &ObservedGpu,
        gi_profile: &str,
        gi_profile_id: u32,
        reset: Option<ResetGpu<'_>>,
    ) -> Result<usize, Step> {
        let (gpus, name) = (self.gpus, self.name);
        let uuid = gpu.uuid.clone();
        self.idle_before_reading(&uuid)?;
        if !gpu.mode.is_some_and(|m| m.current) {
            return self.enable_to_read(gpu, &format!("its compute instance profiles of {gi_profile}"), reset);
        }
        tracing::info!(
            gpu = %uuid,
            "reading NVML's compute instance profiles of {gi_profile} from a short-lived GPU instance on {uuid}"
        );
        let read = gpus
            .mig_read_ci_profiles(gpu.index, gi_profile_id)
            .map_err(|e| self.read_failed(&uuid, e))?;
        if let Some(profiles) = read {
            self.learned.insert((uuid, gi_profile_id), profiles);
            return Ok(2);
        }
        if gpu.gpu_instances.is_empty() || self.applying || self.cleared.iter().any(|g| g.uuid == uuid) {
            return Err(Step::Failed {
                reason: format!(
                    "layout {name}: GPU {} ({uuid}) has no room for a {gi_profile} GPU instance, and NVML lists the \
                     compute instance profiles of {gi_profile} only inside one; nothing changed",
                    gpu.index
                ),
            });
        }
        // No room: the layout destroys every GPU instance of this GPU anyway. Destroy them now,
        // remembering them to make them again should the layout fail before it is applied.
        let mut plan = GpuPlan {
            index: gpu.index,
            uuid: uuid.clone(),
            ops: Vec::new(),
        };
        super::planner::destroy_all(gpu, &mut plan.ops);
        tracing::info!(
            "{} (no room for a short-lived {gi_profile} GPU instance to read its compute instance profiles from; \
             the layout replaces them)",
            super::planner::describe(&plan)
        );
        self.cleared.push(gpu.clone());
        let applied = gpus.mig_apply(&plan).map_err(|e| self.read_failed(&uuid, e))?;
        Ok(applied.mutations)
    }

    /// When the layout failed (or must wait) before its own plans were applied, after this
    /// converge changed GPUs only to read profiles: disables MIG mode again where it enabled it
    /// and those GPUs still have no instances (through the applier, finishing with `reset`
    /// where NVML leaves it pending), makes again the GPU instances it destroyed to make room,
    /// and says in the reason what was changed and undone, or left.
    fn undo_probes(&self, step: Step, reset: Option<ResetGpu<'_>>) -> Step {
        if (self.enabled.is_empty() && self.cleared.is_empty()) || self.applying {
            return step;
        }
        match step {
            Step::Failed { reason } => Step::Failed {
                reason: self.undo(&reason, reset),
            },
            Step::Busy { gpus, reason } => Step::Busy {
                reason: self.undo(&reason, reset),
                gpus,
            },
            other => other,
        }
    }

    fn undo(&self, reason: &str, reset: Option<ResetGpu<'_>>) -> String {
        let reason = reason.strip_suffix("; nothing changed").unwrap_or(reason);
        let (mut notes, _) = self.undo_enabled(&self.enabled, reset);
        notes.extend(self.cleared.iter().map(|before| self.restore(before)));
        tracing::warn!("{}", notes.join("; "));
        format!("{reason}; {}", notes.join("; "))
    }

    /// Disables MIG mode again on `probes` where they have no GPU instances. The notes say what
    /// was done on each; the count is of the GPUs disabled.
    fn undo_enabled(&self, probes: &[Probe], reset: Option<ResetGpu<'_>>) -> (Vec<String>, usize) {
        if probes.is_empty() {
            return (Vec::new(), 0);
        }
        let observed = self.gpus.mig_observe();
        let mut notes = Vec::new();
        let mut disabled = 0;
        for Probe { index, uuid, what } in probes {
            let what = format!("MIG mode had been enabled on GPU {index} ({uuid}) to read {what}");
            let gpu = observed.as_ref().map(|o| o.iter().find(|g| g.uuid == *uuid));
            notes.push(match gpu {
                Err(e) => format!("{what} and is left enabled: its state cannot be read again ({e})"),
                Ok(None) => format!("{what}; the GPU is gone now"),
                Ok(Some(g)) if !g.mode.is_some_and(|m| m.current || m.pending) => format!("{what}; it is off again"),
                Ok(Some(g)) if !g.gpu_instances.is_empty() => {
                    format!("{what} and is left enabled: it has GPU instances now")
                }
                Ok(Some(g)) => match self.disable(g, reset) {
                    Ok(how) => {
                        disabled += 1;
                        format!("{what} and was disabled again{how}")
                    }
                    Err(e) => format!("{what} and is left enabled: {e}"),
                },
            });
        }
        (notes, disabled)
    }

    /// Makes again the GPU instances of `before` (as observed before they were destroyed to make
    /// room for a short-lived one), when the GPU still has none. The note says what was done.
    fn restore(&self, before: &ObservedGpu) -> String {
        let (index, uuid) = (before.index, &before.uuid);
        let what = format!(
            "the {} GPU instance(s) of GPU {index} ({uuid}) had been destroyed to make room for reading compute \
             instance profiles",
            before.gpu_instances.len()
        );
        let now = self.gpus.mig_observe().map(|o| o.into_iter().find(|g| g.uuid == *uuid));
        match now {
            Err(e) => format!("{what} and were not made again: its state cannot be read ({e})"),
            Ok(None) => format!("{what}; the GPU is gone now"),
            Ok(Some(g)) if !g.gpu_instances.is_empty() => {
                format!("{what} and were not made again: it has GPU instances now")
            }
            Ok(Some(_)) => {
                let plan = rebuild(before);
                tracing::info!(
                    "{} (undoing what was destroyed to make room)",
                    super::planner::describe(&plan)
                );
                match self.gpus.mig_apply(&plan) {
                    Ok(_) => format!(
                        "{what} and were made again with the same profiles and placements (their MIG devices have \
                         new UUIDs)"
                    ),
                    Err(e) => format!("{what} and were not all made again: {e}"),
                }
            }
        }
    }

    /// Disables MIG mode on `gpu` (which has no instances). `Ok`: how ("" or " with a GPU
    /// reset"); `Err`: why it is not off.
    fn disable(&self, gpu: &ObservedGpu, reset: Option<ResetGpu<'_>>) -> Result<&'static str, String> {
        let plan = GpuPlan {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            ops: vec![MigOp::SetMode { enabled: false }],
        };
        tracing::info!(
            "{} (undoing the enable made to read compute instance profiles)",
            super::planner::describe(&plan)
        );
        let applied = self
            .gpus
            .mig_apply(&plan)
            .map_err(|e| format!("disabling it again failed: {e}"))?;
        if !applied.mode_pending {
            return Ok("");
        }
        let pending = "disabling it again is pending until the GPU is reset or the node reboots";
        let Some(reset) = reset else {
            return Err(pending.to_string());
        };
        tracing::info!(gpu = %gpu.uuid, "resetting {} to finish its MIG mode change", gpu.uuid);
        reset(&gpu.uuid).map_err(|e| format!("{pending}; the reset failed: {e}"))?;
        Ok(" with a GPU reset")
    }
}

fn merged(mut gpus: Vec<String>, uuid: &str) -> Vec<String> {
    if !gpus.iter().any(|g| g == uuid) {
        gpus.insert(0, uuid.to_string());
    }
    gpus
}

/// The inventory once `plans` are applied, as far as it can be known before (for `plan`): each
/// changed GPU's MIG devices as the plans leave them, named by their compute instance profile,
/// with their GPU instance's memory. NVML gives the new devices their UUIDs and attributes when
/// it creates them: `MIG-planned-<gpu>-<gpu instance>-<compute instance>` stands in, with no
/// attributes.
pub fn predict_inventory(inventory: &Inventory, observed: &[ObservedGpu], plans: &[GpuPlan]) -> Inventory {
    let mut out = inventory.clone();
    for plan in plans.iter().filter(|p| !p.ops.is_empty()) {
        let Some(gpu) = out.gpus.iter_mut().find(|g| g.uuid == plan.uuid) else {
            continue;
        };
        let seen = observed.iter().find(|o| o.uuid == plan.uuid);
        let memory_of = |profile_id: u32| {
            seen.and_then(|o| o.profiles.iter().find(|p| p.id == profile_id))
                .map_or(0, |p| p.memory_mib)
        };
        // New GPU instances get ids past any NVML could have given: their real ones are NVML's.
        let mut new_gis: Vec<(u32, u64)> = Vec::new();
        let first_new = seen
            .and_then(|o| o.gpu_instances.iter().map(|gi| gi.id).max())
            .unwrap_or(0)
            + 1;
        for op in &plan.ops {
            match op {
                MigOp::DestroyCi { gi_id, ci_id } => {
                    gpu.mig_devices.retain(|d| !(d.gi_id == *gi_id && d.ci_id == *ci_id));
                }
                MigOp::DestroyGi { gi_id } => gpu.mig_devices.retain(|d| d.gi_id != *gi_id),
                MigOp::SetMode { enabled } => {
                    if let Some(mode) = &mut gpu.mig {
                        mode.current = *enabled;
                        mode.pending = *enabled;
                    }
                    if !enabled {
                        gpu.mig_devices.clear();
                    }
                }
                MigOp::CreateGi { profile_id, .. } => {
                    let id = first_new + u32::try_from(new_gis.len()).unwrap_or(u32::MAX - first_new);
                    new_gis.push((id, memory_of(*profile_id)));
                }
                MigOp::CreateCi { gi, name, .. } => {
                    let (gi_id, memory_mib) = match gi {
                        GiRef::New(n) => new_gis.get(*n).copied().unwrap_or_default(),
                        GiRef::Existing(id) => {
                            let profile = seen
                                .and_then(|o| o.gpu_instances.iter().find(|g| g.id == *id))
                                .map_or(u32::MAX, |g| g.profile_id);
                            (*id, memory_of(profile))
                        }
                    };
                    let ci_id = gpu
                        .mig_devices
                        .iter()
                        .filter(|d| d.gi_id == gi_id)
                        .map(|d| d.ci_id + 1)
                        .max()
                        .unwrap_or(0);
                    let index = gpu.mig_devices.iter().map(|d| d.index + 1).max().unwrap_or(0);
                    gpu.mig_devices.push(MigDeviceInfo {
                        index,
                        uuid: format!("MIG-planned-{}-{gi_id}-{ci_id}", gpu.index),
                        gi_id,
                        ci_id,
                        profile: name.clone(),
                        memory_mib,
                        attributes: None,
                        placement: None,
                    });
                }
            }
        }
    }
    out
}

/// The current state of every MIG-capable GPU as a layout (`mig export`): one entry per GPU.
pub fn export(observed: &[ObservedGpu]) -> MigLayout {
    use crate::mig_layout::{DeviceSelector, LayoutEntry};
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
                generated: None,
            }
        })
        .collect();
    MigLayout::new(entries)
}

#[cfg(test)]
mod layout_tests;
