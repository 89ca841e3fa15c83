//! The pure MIG planner: from one GPU's observed MIG state and the state a layout wants for it,
//! the NVML operations that get it there ([`GpuPlan`]), or why the layout cannot be applied —
//! found before anything is touched.
//!
//! - **Names** resolve against the GPU's own profiles (NVML's names: `1g.5gb` on an A100-40GB,
//!   `1g.10gb` on an H100-80GB). `<G>` (a GPU instance profile, `+me` ones included) asks for
//!   GPU instances with one compute instance spanning each. `<C>c.<G>` asks for compute
//!   instances of that compute instance profile inside GPU instances of `<G>`; `<C>c.<G>` with
//!   `C` the slice count of `<G>` is `<G>` itself. A count of 0 is no entry.
//! - **Compute instance forms are pooled per GPU instance profile.** All the `<C>c.<G>` entries of
//!   one `<G>` become one list (one element per compute instance, biggest first, then by NVML
//!   profile index), and each goes into the first of the pool's GPU instances where the compute
//!   instances still have non-overlapping placements within their instance counts, else into a
//!   new GPU instance. So `1c.3g.20gb: 3` is one 3g.20gb with three 1c CIs, `1c.3g.20gb: 4` is two
//!   (3 + 1), and `2c.3g.20gb: 1` + `1c.3g.20gb: 1` is one (2c at 0:2, 1c at 2:1). The GPU
//!   instances of a plain `<G>: n` never take pooled compute instances (their CI spans them). This
//!   is what mig-parted's "reuse the previous GPU instance until a compute instance no longer
//!   fits" loop yields, computed up front.
//! - **Compute instance profiles not read yet.** NVML lists the compute instance profiles of a
//!   GPU instance profile only inside an instance of it. Until they are read, a `<C>c.<G>` name
//!   (`0 < C <` the slices of `<G>`) counts as the fewest GPU instances of `<G>` its compute
//!   instances could need (their slices fill whole instances, and no instance holds two
//!   bigger than half of it), and every other check runs as usual: the other names, the counts,
//!   the exact GPU instance placement. Only when all of that holds is the answer
//!   [`PlanError::CiProfilesUnknown`], so a layout that cannot fit whatever those profiles are is
//!   refused before MIG mode is enabled to read them.
//! - **Already matching** (MIG mode current and pending as wanted, and the GPU instances, as a
//!   multiset of "GI profile + multiset of CI profiles", the wanted ones, whatever their ids and
//!   placements): no operations. Re-applying a layout touches nothing.
//! - **Otherwise everything is recreated**, as mig-parted does: every compute instance is
//!   destroyed, then every GPU instance, then the mode is set when current or pending differ,
//!   then each GPU instance is created at an explicit placement, followed by its compute instances
//!   at explicit placements, in memory slice order. The plan assumes that a `SetMode` NVML
//!   reports as done leaves the mode current (the applier stops when it stays pending).
//! - **Placement** is an exact backtracking search over the placements NVML lists (memory
//!   slices for GPU instances, compute slices inside a GPU instance for compute instances): no
//!   two overlap, per-profile instance counts hold. Items with the fewest candidate placements
//!   go first, then the largest; candidates are tried lowest start first, and interchangeable
//!   items (same profile) take increasing starts, so the first solution is deterministic and
//!   each distinct arrangement is visited once. Unlike mig-parted, which lets NVML pick
//!   placements and retries every ordering on the live GPU, a layout that cannot be placed is an
//!   error here, naming the profile that does not fit, before any mutation.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::state::{CiProfile, GiProfile, GiRef, GpuPlan, MigOp, ObservedGpu, Placement};

/// What a layout wants for one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredGpu {
    pub mig_enabled: bool,
    /// Profile name (`1g.5gb`, `1g.5gb+me`, `1c.3g.20gb`) → count, as in mig-parted's `mig-devices`.
    pub profiles: BTreeMap<String, u32>,
}

/// Why a layout cannot be applied to a GPU. `gpu` reads `<index> (<uuid>)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("GPU {gpu} does not support MIG, but the layout enables MIG on it")]
    NotMigCapable { gpu: String },
    /// No entry of the layout applies to a GPU that supports MIG, under `[mig] uncovered_gpus =
    /// "fail"` (see [`crate::mig_layout`]).
    #[error(
        "no entry for GPU {index} ({uuid}, {}device {}), which supports MIG: every MIG-capable GPU \
         must be covered ([mig] uncovered_gpus = \"fail\")",
        model.as_deref().map(|m| format!("{m}, ")).unwrap_or_default(),
        crate::mig_layout::format_device_id(*pci_device_id)
    )]
    NotCovered {
        index: u32,
        uuid: String,
        /// NVML's name of the GPU (`NVIDIA A100-SXM4-40GB`) where it was read.
        model: Option<String>,
        pci_device_id: u16,
    },
    /// A built-in layout for a profile (or a balanced layout) that no GPU of the node has.
    #[error("no GPU of this node has {wanted} ({})", gpus.join("; "))]
    NoGpuHasProfile { wanted: String, gpus: Vec<String> },
    #[error("the layout disables MIG on GPU {gpu} but asks for MIG devices ({layout})")]
    ProfilesWithMigDisabled { gpu: String, layout: String },
    #[error("GPU {gpu} has no MIG profile {profile:?}; its profiles are {}", available.join(", "))]
    UnknownProfile {
        gpu: String,
        profile: String,
        available: Vec<String>,
    },
    /// A compute instance form (`1c.4g.20gb`) of a GPU instance profile of which no instance
    /// exists yet: NVML lists compute instance profiles only inside a GPU instance, so they
    /// must be read from one first ([`super::stage::converge`] does, with a short-lived
    /// instance).
    #[error(
        "GPU {gpu}: compute instance profile {profile:?} can only be looked up inside a {gi_profile} GPU \
         instance, and none exists yet"
    )]
    CiProfilesUnknown {
        gpu: String,
        index: u32,
        uuid: String,
        profile: String,
        gi_profile: String,
        gi_profile_id: u32,
    },
    /// A GPU that must end with MIG enabled, whose NVML lists no GPU instance profiles while its
    /// MIG mode is off (drivers of the R535 class): they are read by enabling MIG mode first
    /// ([`super::stage::converge`] does, and disables it again when the layout then fails).
    #[error(
        "GPU {gpu}: NVML lists no GPU instance profiles while MIG mode is off, so the layout can only be \
         planned once MIG mode is enabled on GPU {index} to read them"
    )]
    GiProfilesUnknown { gpu: String, index: u32, uuid: String },
    #[error("MIG layout `{layout}` does not fit on GPU {gpu}: {profile}: {reason}")]
    DoesNotFit {
        gpu: String,
        layout: String,
        profile: String,
        reason: String,
    },
}

impl PlanError {
    /// The GPU (UUID) whose profiles NVML must be asked for before the layout can be planned in
    /// full ([`PlanError::CiProfilesUnknown`], [`PlanError::GiProfilesUnknown`]): everything
    /// else about the layout holds. `None` for the errors no read can lift.
    pub fn read_first(&self) -> Option<&str> {
        match self {
            PlanError::CiProfilesUnknown { uuid, .. } | PlanError::GiProfilesUnknown { uuid, .. } => Some(uuid),
            _ => None,
        }
    }
}

/// Plans one GPU: no operations when it already is as `desired` wants.
pub fn plan_gpu(observed: &ObservedGpu, desired: &DesiredGpu) -> Result<GpuPlan, PlanError> {
    let gpu = format!("{} ({})", observed.index, observed.uuid);
    let wanted: Vec<(&str, u32)> = desired
        .profiles
        .iter()
        .filter(|(_, count)| **count > 0)
        .map(|(name, count)| (name.as_str(), *count))
        .collect();
    let layout = if wanted.is_empty() {
        "no MIG devices".to_string()
    } else {
        let entries: Vec<String> = wanted.iter().map(|(name, count)| format!("{name}: {count}")).collect();
        entries.join(", ")
    };
    let mut plan = GpuPlan {
        index: observed.index,
        uuid: observed.uuid.clone(),
        ops: Vec::new(),
    };

    if !desired.mig_enabled {
        if !wanted.is_empty() {
            return Err(PlanError::ProfilesWithMigDisabled { gpu, layout });
        }
        if let Some(mode) = observed.mode {
            destroy_all(observed, &mut plan.ops);
            if mode.current || mode.pending {
                plan.ops.push(MigOp::SetMode { enabled: false });
            }
        }
        return Ok(plan);
    }
    let Some(mode) = observed.mode else {
        return Err(PlanError::NotMigCapable { gpu });
    };

    let ctx = Ctx {
        gpu: &gpu,
        layout: &layout,
    };
    let Wanted { instances, unknown } = build_instances(observed, &wanted, &ctx)?;
    let placed = place_instances(instances, &ctx)?;
    // Everything else holds: only NVML's compute instance profiles can still refuse the layout.
    if let Some(unknown) = unknown {
        return Err(unknown);
    }
    let mode_ok = mode.current && mode.pending;
    if mode_ok && matches(observed, &placed) {
        return Ok(plan);
    }

    destroy_all(observed, &mut plan.ops);
    if !mode_ok {
        plan.ops.push(MigOp::SetMode { enabled: true });
    }
    for (n, gi) in placed.iter().enumerate() {
        plan.ops.push(MigOp::CreateGi {
            profile_id: gi.profile.id,
            placement: gi.placement,
            name: gi.profile.name.clone(),
        });
        for (ci, placement) in &gi.cis {
            plan.ops.push(MigOp::CreateCi {
                gi: GiRef::New(n),
                profile_id: ci.id,
                placement: *placement,
                name: ci.name.clone(),
            });
        }
    }
    Ok(plan)
}

/// A plan in words, one line per operation under a line naming the GPU.
pub fn describe(plan: &GpuPlan) -> String {
    let mut lines = Vec::with_capacity(plan.ops.len() + 1);
    if plan.ops.is_empty() {
        lines.push(format!("GPU {} ({}): as desired, nothing to do", plan.index, plan.uuid));
    } else {
        let s = if plan.ops.len() == 1 { "" } else { "s" };
        lines.push(format!(
            "GPU {} ({}): {} operation{s}",
            plan.index,
            plan.uuid,
            plan.ops.len()
        ));
    }
    let mut created: Vec<&str> = Vec::new();
    for op in &plan.ops {
        lines.push(match op {
            MigOp::DestroyCi { gi_id, ci_id } => format!("  destroy compute instance {ci_id} of GPU instance {gi_id}"),
            MigOp::DestroyGi { gi_id } => format!("  destroy GPU instance {gi_id}"),
            MigOp::SetMode { enabled: true } => "  enable MIG mode".to_string(),
            MigOp::SetMode { enabled: false } => "  disable MIG mode".to_string(),
            MigOp::CreateGi {
                profile_id,
                placement,
                name,
            } => {
                created.push(name);
                format!(
                    "  create GPU instance #{} {name} (profile id {profile_id}) at memory slices {}",
                    created.len() - 1,
                    slices(*placement)
                )
            }
            MigOp::CreateCi {
                gi,
                profile_id,
                placement,
                name,
            } => {
                let target = match gi {
                    GiRef::New(n) => match created.get(*n) {
                        Some(gi_name) => format!("new GPU instance #{n} ({gi_name})"),
                        None => format!("new GPU instance #{n}"),
                    },
                    GiRef::Existing(id) => format!("GPU instance {id}"),
                };
                // CiProfile::UNREAD: NVML could not be asked yet (no instance of that profile existed);
                // the id is looked up in the new instance when it is created.
                let id = if *profile_id == CiProfile::UNREAD {
                    "id from the new instance".to_string()
                } else {
                    format!("profile id {profile_id}")
                };
                format!(
                    "  create compute instance {name} ({id}) at compute slices {} in {target}",
                    slices(*placement)
                )
            }
        });
    }
    lines.join("\n")
}

/// `start:size`, as `nvidia-smi mig -lgi` prints placements.
fn slices(p: Placement) -> String {
    format!("{}:{}", p.start, p.size)
}

/// What errors need to name.
struct Ctx<'a> {
    gpu: &'a str,
    layout: &'a str,
}

impl Ctx<'_> {
    fn does_not_fit(&self, profile: &str, reason: String) -> PlanError {
        PlanError::DoesNotFit {
            gpu: self.gpu.to_string(),
            layout: self.layout.to_string(),
            profile: profile.to_string(),
            reason,
        }
    }
}

/// A layout entry's name, resolved on this GPU.
enum Form<'a> {
    /// A GPU instance with one compute instance spanning it.
    Whole(&'a GiProfile),
    /// A compute instance of a smaller profile inside a GPU instance of the first.
    Part(&'a GiProfile, &'a CiProfile),
}

fn resolve<'a>(observed: &'a ObservedGpu, name: &str) -> Option<Form<'a>> {
    if let Some(gi) = observed.profiles.iter().find(|gi| gi.name == name) {
        return Some(Form::Whole(gi));
    }
    let (compute, gi_name) = name.split_once('.')?;
    let gi = observed.profiles.iter().find(|gi| gi.name == gi_name)?;
    if let Some(ci) = gi
        .ci_profiles
        .iter()
        .find(|ci| ci.name == name && ci.slice_count < gi.slice_count)
    {
        return Some(Form::Part(gi, ci));
    }
    (compute == format!("{}c", gi.slice_count)).then_some(Form::Whole(gi))
}

/// For a `<C>c.<gi>` name that does not resolve: the GPU instance profile `<gi>` and `C` when
/// its compute instance profiles have not been read from NVML yet and `C` could name one of
/// them (`0 < C <` its slice count; `C` equal to it is `<gi>` itself).
fn unread_ci_profiles<'a>(observed: &'a ObservedGpu, name: &str) -> Option<(&'a GiProfile, u32)> {
    let (compute, gi_name) = name.split_once('.')?;
    let digits = compute.strip_suffix('c')?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let slices = digits.parse::<u32>().ok()?;
    observed
        .profiles
        .iter()
        .find(|gi| gi.name == gi_name && !gi.ci_profiles_read())
        .filter(|gi| slices > 0 && slices < gi.slice_count)
        .map(|gi| (gi, slices))
}

/// The fewest GPU instances of `gi` that compute instances of these slice counts (slices,
/// count) can go into, whatever NVML's compute instance profiles turn out to be: their slices
/// fill whole instances at best, and no instance holds two that are bigger than half of it.
/// The pooling of [`build_instances`] never needs fewer, so a layout whose GPU instances do
/// not fit with this many cannot fit at all.
fn fewest_gis(gi: &GiProfile, cis: &[(u32, u32)]) -> usize {
    let slices: u64 = cis.iter().map(|&(c, n)| u64::from(c) * u64::from(n)).sum();
    let by_slices = slices.div_ceil(u64::from(gi.slice_count.max(1)));
    let big: u64 = cis
        .iter()
        .filter(|&&(c, _)| 2 * c > gi.slice_count)
        .map(|&(_, n)| u64::from(n))
        .sum();
    usize::try_from(by_slices.max(big)).unwrap_or(usize::MAX)
}

/// The names a layout may use on this GPU, in NVML's order.
fn available(observed: &ObservedGpu) -> Vec<String> {
    let mut names = Vec::new();
    for gi in &observed.profiles {
        names.push(gi.name.clone());
        for ci in gi.ci_profiles.iter().filter(|ci| ci.slice_count < gi.slice_count) {
            names.push(ci.name.clone());
        }
    }
    names
}

/// The compute instance profile spanning a whole GPU instance: the one named like it, else the
/// lowest index.
fn full_ci(gi: &GiProfile) -> Option<&CiProfile> {
    gi.ci_profiles
        .iter()
        .filter(|ci| ci.slice_count == gi.slice_count)
        .min_by_key(|ci| (ci.name != gi.name, ci.index, ci.id))
}

/// A GPU instance the layout wants, its compute instances already placed inside it.
struct WantedGi<'a> {
    profile: &'a GiProfile,
    cis: Vec<(&'a CiProfile, Placement)>,
    /// Made to hold `<C>c.<G>` compute instances (for error messages).
    pooled: bool,
}

/// A wanted GPU instance with its memory slice placement.
struct PlacedGi<'a> {
    profile: &'a GiProfile,
    placement: Placement,
    cis: Vec<(&'a CiProfile, Placement)>,
}

/// The GPU instances a layout wants, with their compute instances; `unknown` is set when some
/// are compute instance forms of a profile whose compute instance profiles are not read yet:
/// those count as the fewest GPU instances they could need ([`fewest_gis`], with no compute
/// instances), so that everything else is checked all the same.
struct Wanted<'a> {
    instances: Vec<WantedGi<'a>>,
    unknown: Option<PlanError>,
}

fn build_instances<'a>(observed: &'a ObservedGpu, wanted: &[(&str, u32)], ctx: &Ctx) -> Result<Wanted<'a>, PlanError> {
    let mut instances: Vec<WantedGi<'a>> = Vec::new();
    let mut pools: Vec<(&'a GiProfile, Vec<&'a CiProfile>)> = Vec::new();
    let mut unread: Vec<(&'a GiProfile, Vec<(u32, u32)>)> = Vec::new();
    let mut unknown = None;
    for &(name, count) in wanted {
        match resolve(observed, name) {
            None if let Some((gi, slices)) = unread_ci_profiles(observed, name) => {
                unknown.get_or_insert_with(|| PlanError::CiProfilesUnknown {
                    gpu: ctx.gpu.to_string(),
                    index: observed.index,
                    uuid: observed.uuid.clone(),
                    profile: name.to_string(),
                    gi_profile: gi.name.clone(),
                    gi_profile_id: gi.id,
                });
                match unread.iter_mut().find(|(p, _)| p.id == gi.id) {
                    Some((_, cis)) => cis.push((slices, count)),
                    None => unread.push((gi, vec![(slices, count)])),
                }
            }
            None => {
                return Err(PlanError::UnknownProfile {
                    gpu: ctx.gpu.to_string(),
                    profile: name.to_string(),
                    available: available(observed),
                });
            }
            Some(Form::Whole(gi)) => {
                if count > gi.instance_count {
                    return Err(too_many_gis(ctx, gi, count as usize, 0, false));
                }
                let full = full_ci(gi).ok_or_else(|| {
                    ctx.does_not_fit(
                        &gi.name,
                        "NVML lists no compute instance profile spanning a whole GPU instance of it".into(),
                    )
                })?;
                let placement = arrange_cis(gi, &[full])
                    .and_then(|p| p.first().copied())
                    .ok_or_else(|| {
                        ctx.does_not_fit(
                            &gi.name,
                            format!("NVML lists no usable placement for its compute instance {}", full.name),
                        )
                    })?;
                for _ in 0..count {
                    instances.push(WantedGi {
                        profile: gi,
                        cis: vec![(full, placement)],
                        pooled: false,
                    });
                }
            }
            Some(Form::Part(gi, ci)) => {
                let most = ci.instance_count.saturating_mul(gi.instance_count);
                if count > most {
                    return Err(ctx.does_not_fit(
                        &ci.name,
                        format!(
                            "{count} compute instances wanted, at most {most} fit ({} in each of at most {} {} GPU \
                             instances)",
                            ci.instance_count, gi.instance_count, gi.name
                        ),
                    ));
                }
                let pool = match pools.iter().position(|(p, _)| p.id == gi.id) {
                    Some(i) => &mut pools[i].1,
                    None => {
                        pools.push((gi, Vec::new()));
                        &mut pools.last_mut().expect("just pushed").1
                    }
                };
                pool.extend(std::iter::repeat_n(ci, count as usize));
            }
        }
    }

    for (gi, mut cis) in pools {
        cis.sort_by_key(|ci| (Reverse(ci.slice_count), ci.index, ci.id));
        let mut bins: Vec<(Vec<&CiProfile>, Vec<Placement>)> = Vec::new();
        for ci in cis {
            let mut fitted = false;
            for bin in bins.iter_mut() {
                let mut trial = bin.0.clone();
                trial.push(ci);
                if let Some(placements) = arrange_cis(gi, &trial) {
                    *bin = (trial, placements);
                    fitted = true;
                    break;
                }
            }
            if !fitted {
                let placements = arrange_cis(gi, &[ci]).ok_or_else(|| {
                    ctx.does_not_fit(
                        &ci.name,
                        format!(
                            "NVML lists no usable placement for it inside a {} GPU instance",
                            gi.name
                        ),
                    )
                })?;
                bins.push((vec![ci], placements));
            }
        }
        for (cis, placements) in bins {
            let mut cis: Vec<(&CiProfile, Placement)> = cis.into_iter().zip(placements).collect();
            cis.sort_by_key(|(ci, p)| (p.start, p.size, ci.id));
            instances.push(WantedGi {
                profile: gi,
                cis,
                pooled: true,
            });
        }
    }

    for (gi, cis) in unread {
        for _ in 0..fewest_gis(gi, &cis).min(gi.instance_count as usize + 1) {
            instances.push(WantedGi {
                profile: gi,
                cis: Vec::new(),
                pooled: true,
            });
        }
    }

    for gi in &observed.profiles {
        let of_gi = instances.iter().filter(|w| w.profile.id == gi.id);
        let needed = of_gi.clone().count();
        if needed > gi.instance_count as usize {
            let pooled = of_gi.clone().filter(|w| w.pooled).count();
            // Compute instance forms not read yet count as the fewest they could need.
            let at_least = of_gi.clone().any(|w| w.pooled && w.cis.is_empty());
            return Err(too_many_gis(ctx, gi, needed, pooled, at_least));
        }
    }
    Ok(Wanted { instances, unknown })
}

fn too_many_gis(ctx: &Ctx, gi: &GiProfile, needed: usize, pooled: usize, at_least: bool) -> PlanError {
    let detail = if pooled > 0 {
        format!(" ({pooled} of them to hold its compute instance profiles)")
    } else {
        String::new()
    };
    let at_least = if at_least { "at least " } else { "" };
    ctx.does_not_fit(
        &gi.name,
        format!(
            "{at_least}{needed} GPU instances of it are needed{detail}, at most {} fit on this GPU",
            gi.instance_count
        ),
    )
}

/// Places compute instances inside one GPU instance of `gi`: their placements in the order of
/// `cis`, or `None` when they do not fit together.
fn arrange_cis(gi: &GiProfile, cis: &[&CiProfile]) -> Option<Vec<Placement>> {
    for ci in cis {
        let same = cis.iter().filter(|other| other.id == ci.id).count();
        if same > ci.instance_count as usize {
            return None;
        }
    }
    let items: Vec<Item> = cis
        .iter()
        .map(|ci| Item {
            cands: usable(ci_placements(gi, ci)),
            class: ci.id,
            size: ci.slice_count,
        })
        .collect();
    arrange(&items).ok()
}

/// The placements of a compute instance profile inside a GPU instance. Where NVML lists none
/// (drivers without the placement query), aligned starts: multiples of the slice count.
fn ci_placements(gi: &GiProfile, ci: &CiProfile) -> Vec<Placement> {
    if !ci.placements.is_empty() {
        return ci.placements.clone();
    }
    if ci.slice_count == 0 {
        return Vec::new();
    }
    (0..gi.slice_count / ci.slice_count)
        .map(|k| Placement {
            start: k * ci.slice_count,
            size: ci.slice_count,
        })
        .collect()
}

fn place_instances<'a>(instances: Vec<WantedGi<'a>>, ctx: &Ctx) -> Result<Vec<PlacedGi<'a>>, PlanError> {
    let items: Vec<Item> = instances
        .iter()
        .map(|w| Item {
            cands: usable(w.profile.placements.iter().copied()),
            class: w.profile.id,
            size: w.profile.placements.iter().map(|p| p.size).max().unwrap_or(0),
        })
        .collect();
    match arrange(&items) {
        Ok(placements) => {
            let mut placed: Vec<PlacedGi> = instances
                .into_iter()
                .zip(placements)
                .map(|(w, placement)| PlacedGi {
                    profile: w.profile,
                    placement,
                    cis: w.cis,
                })
                .collect();
            placed.sort_by_key(|g| (g.placement.start, g.placement.size, g.profile.id));
            Ok(placed)
        }
        Err(stuck) => {
            let gi = instances[stuck.item].profile;
            let reason = if stuck.before.is_empty() {
                "NVML lists no usable placement for it".to_string()
            } else {
                let candidates: Vec<String> = items[stuck.item].cands.iter().map(|(p, _)| slices(*p)).collect();
                let mut others: Vec<(&str, usize)> = Vec::new();
                for &i in &stuck.before {
                    let name = instances[i].profile.name.as_str();
                    match others.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, count)) => *count += 1,
                        None => others.push((name, 1)),
                    }
                }
                let others: Vec<String> = others
                    .into_iter()
                    .map(|(name, count)| {
                        if count == 1 {
                            name.to_string()
                        } else {
                            format!("{name} x{count}")
                        }
                    })
                    .collect();
                format!(
                    "no arrangement of the memory slices leaves one of its placements ({}) free next to {}",
                    candidates.join(", "),
                    others.join(", ")
                )
            };
            Err(ctx.does_not_fit(&gi.name, reason))
        }
    }
}

/// Whether the GPU's instances are the wanted ones, by profile, whatever their ids and placements.
fn matches(observed: &ObservedGpu, placed: &[PlacedGi]) -> bool {
    let mut want: Vec<(u32, Vec<u32>)> = placed
        .iter()
        .map(|g| {
            let mut cis: Vec<u32> = g.cis.iter().map(|(ci, _)| ci.id).collect();
            cis.sort_unstable();
            (g.profile.id, cis)
        })
        .collect();
    let mut have: Vec<(u32, Vec<u32>)> = observed
        .gpu_instances
        .iter()
        .map(|g| {
            let mut cis: Vec<u32> = g.compute_instances.iter().map(|ci| ci.profile_id).collect();
            cis.sort_unstable();
            (g.profile_id, cis)
        })
        .collect();
    want.sort_unstable();
    have.sort_unstable();
    want == have
}

/// Every compute instance, then every GPU instance.
pub(crate) fn destroy_all(observed: &ObservedGpu, ops: &mut Vec<MigOp>) {
    for gi in &observed.gpu_instances {
        for ci in &gi.compute_instances {
            ops.push(MigOp::DestroyCi {
                gi_id: gi.id,
                ci_id: ci.id,
            });
        }
    }
    for gi in &observed.gpu_instances {
        ops.push(MigOp::DestroyGi { gi_id: gi.id });
    }
}

/// One thing to place: its candidate placements (lowest start first, with slice masks), the
/// profile it is of (items of one class are interchangeable and share their candidates), and
/// its size (bigger first among items with as many candidates).
struct Item {
    cands: Vec<(Placement, u64)>,
    class: u32,
    size: u32,
}

/// Where the search got stuck: `item` cannot be placed together with the items `before` it in
/// the search order (though those fit together).
struct Stuck {
    item: usize,
    before: Vec<usize>,
}

/// The placements of `items`, in their order, none overlapping.
fn arrange(items: &[Item]) -> Result<Vec<Placement>, Stuck> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| (items[i].cands.len(), Reverse(items[i].size), items[i].class, i));
    let mut picks = Vec::with_capacity(items.len());
    if search(items, &order, 0, &mut picks) {
        let mut out = vec![Placement { start: 0, size: 0 }; items.len()];
        for (&i, &c) in order.iter().zip(&picks) {
            out[i] = items[i].cands[c].0;
        }
        return Ok(out);
    }
    // Name the first item, in search order, that cannot join those before it.
    let mut stuck_at = order.len();
    for m in 1..order.len() {
        picks.clear();
        if !search(items, &order[..m], 0, &mut picks) {
            stuck_at = m;
            break;
        }
    }
    Err(Stuck {
        item: order[stuck_at - 1],
        before: order[..stuck_at - 1].to_vec(),
    })
}

/// Depth-first: places `order[picks.len()..]` around the slices in `used`.
fn search(items: &[Item], order: &[usize], used: u64, picks: &mut Vec<usize>) -> bool {
    let k = picks.len();
    let Some(&i) = order.get(k) else {
        return true;
    };
    let item = &items[i];
    // Interchangeable items take increasing candidates: each arrangement is tried once.
    let first = match k.checked_sub(1) {
        Some(prev) if items[order[prev]].class == item.class => picks[prev] + 1,
        _ => 0,
    };
    for (c, (_, mask)) in item.cands.iter().enumerate().skip(first) {
        if used & mask != 0 {
            continue;
        }
        picks.push(c);
        if search(items, order, used | mask, picks) {
            return true;
        }
        picks.pop();
    }
    false
}

/// Placements with their slice masks, lowest start first; empty or out-of-range ones dropped.
fn usable(placements: impl IntoIterator<Item = Placement>) -> Vec<(Placement, u64)> {
    let mut out: Vec<(Placement, u64)> = placements
        .into_iter()
        .filter_map(|p| {
            let end = p.start.checked_add(p.size)?;
            (p.size > 0 && end <= 64).then(|| (p, (u64::MAX >> (64 - p.size)) << p.start))
        })
        .collect();
    out.sort_by_key(|(p, _)| (p.start, p.size));
    out.dedup();
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, HashSet};

    use super::*;
    use crate::mig::state::{ObservedCi, ObservedGi};
    use crate::nvml::MigState;

    // ---- Fixtures: test-peers §1.6 (hardware `nvidia-smi mig -lgip/-lgipp/-lcip` tables) ----

    pub(crate) fn ci(name: &str, index: u32, slices: u32, inst: u32, starts: &[u32]) -> CiProfile {
        CiProfile {
            name: name.to_string(),
            index,
            // Compute instance profile ids equal their NVML index.
            id: index,
            slice_count: slices,
            instance_count: inst,
            placements: starts.iter().map(|&start| Placement { start, size: slices }).collect(),
        }
    }

    /// The compute instance profiles inside a GPU instance of `gi` (`-lcip`). 1g–4g are from the
    /// A100 listing with H100 placements; the 7g rows follow the same pattern (not in the table).
    pub(crate) fn ci_rows(gi: &str, slices: u32) -> Vec<CiProfile> {
        let part = |c: u32, index: u32, inst: u32, starts: &[u32]| ci(&format!("{c}c.{gi}"), index, c, inst, starts);
        match slices {
            1 => vec![ci(gi, 0, 1, 1, &[0])],
            2 => vec![part(1, 0, 2, &[0, 1]), ci(gi, 1, 2, 1, &[0])],
            3 => vec![part(1, 0, 3, &[0, 1, 2]), part(2, 1, 1, &[0]), ci(gi, 2, 3, 1, &[0])],
            4 => vec![
                part(1, 0, 4, &[0, 1, 2, 3]),
                part(2, 1, 2, &[0, 2]),
                ci(gi, 3, 4, 1, &[0]),
            ],
            7 => vec![
                part(1, 0, 7, &[0, 1, 2, 3, 4, 5, 6]),
                part(2, 1, 3, &[0, 2, 4]),
                part(3, 2, 2, &[0, 4]),
                part(4, 3, 1, &[0]),
                ci(gi, 4, 7, 1, &[0]),
            ],
            _ => unreachable!(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gi(
        name: &str,
        index: u32,
        id: u32,
        inst: u32,
        slices: u32,
        mem: u64,
        starts: &[u32],
        size: u32,
    ) -> GiProfile {
        GiProfile {
            name: name.to_string(),
            index,
            id,
            slice_count: slices,
            instance_count: inst,
            memory_mib: mem,
            placements: starts.iter().map(|&start| Placement { start, size }).collect(),
            ci_profiles: ci_rows(name, slices),
        }
    }

    pub(crate) fn gpu(uuid: &str, pci_device_id: u16, profiles: Vec<GiProfile>) -> ObservedGpu {
        ObservedGpu {
            index: 0,
            uuid: uuid.to_string(),
            pci_device_id,
            pci_subsystem_id: 0,
            mode: Some(MigState {
                current: false,
                pending: false,
            }),
            profiles,
            gpu_instances: Vec::new(),
        }
    }

    /// A100-SXM4-40GB, MIG disabled, profiles in NVML index order (0, 1, 2, 3, 4, 7, 9).
    pub(crate) fn a100_40gb() -> ObservedGpu {
        let all = [0, 1, 2, 3, 4, 5, 6];
        gpu(
            "GPU-a100-40gb",
            0x20b0,
            vec![
                gi("1g.5gb", 0, 19, 7, 1, 4864, &all, 1),
                gi("2g.10gb", 1, 14, 3, 2, 9856, &[0, 2, 4], 2),
                gi("3g.20gb", 2, 9, 2, 3, 19968, &[0, 4], 4),
                gi("4g.20gb", 3, 5, 1, 4, 19968, &[0], 4),
                gi("7g.40gb", 4, 0, 1, 7, 40192, &[0], 8),
                gi("1g.5gb+me", 7, 20, 1, 1, 4864, &all, 1),
                gi("1g.10gb", 9, 15, 4, 1, 9856, &[0, 2, 4, 6], 2),
            ],
        )
    }

    /// H100 80GB HBM3 (SXM5), MIG disabled.
    pub(crate) fn h100_80gb() -> ObservedGpu {
        let all = [0, 1, 2, 3, 4, 5, 6];
        gpu(
            "GPU-h100-80gb",
            0x2330,
            vec![
                gi("1g.10gb", 0, 19, 7, 1, 9984, &all, 1),
                gi("2g.20gb", 1, 14, 3, 2, 20096, &[0, 2, 4], 2),
                gi("3g.40gb", 2, 9, 2, 3, 40448, &[0, 4], 4),
                gi("4g.40gb", 3, 5, 1, 4, 40448, &[0], 4),
                gi("7g.80gb", 4, 0, 1, 7, 81152, &[0], 8),
                gi("1g.10gb+me", 7, 20, 1, 1, 9984, &all, 1),
                gi("1g.20gb", 9, 15, 4, 1, 20096, &[0, 2, 4, 6], 2),
            ],
        )
    }

    fn models() -> [ObservedGpu; 2] {
        [a100_40gb(), h100_80gb()]
    }

    fn enabled(profiles: &[(&str, u32)]) -> DesiredGpu {
        DesiredGpu {
            mig_enabled: true,
            profiles: profiles.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
        }
    }

    fn disabled() -> DesiredGpu {
        DesiredGpu::default()
    }

    pub(crate) fn p(start: u32, size: u32) -> Placement {
        Placement { start, size }
    }

    /// The `CreateGi`s of a plan: (name, placement).
    fn created_gis(plan: &GpuPlan) -> Vec<(String, Placement)> {
        plan.ops
            .iter()
            .filter_map(|op| match op {
                MigOp::CreateGi { name, placement, .. } => Some((name.clone(), *placement)),
                _ => None,
            })
            .collect()
    }

    /// The `CreateCi`s of a plan: (GPU instance #, name, placement).
    fn created_cis(plan: &GpuPlan) -> Vec<(usize, String, Placement)> {
        plan.ops
            .iter()
            .filter_map(|op| match op {
                MigOp::CreateCi {
                    gi: GiRef::New(n),
                    name,
                    placement,
                    ..
                } => Some((*n, name.clone(), *placement)),
                _ => None,
            })
            .collect()
    }

    fn does_not_fit(result: Result<GpuPlan, PlanError>) -> (String, String) {
        match result {
            Err(PlanError::DoesNotFit { profile, reason, .. }) => (profile, reason),
            other => panic!("expected DoesNotFit, got {other:?}"),
        }
    }

    // ---- A model of NVML's hardware rules (nvml-subset §4, test-peers §1.6) ----

    /// Applies ops to a copy of the observed state the way NVML would, refusing what NVML
    /// refuses. GPU instance ids are driver-assigned and not in creation order.
    struct Hardware {
        gpu: ObservedGpu,
        seq: u32,
    }

    impl Hardware {
        fn new(gpu: ObservedGpu) -> Self {
            Self { gpu, seq: 0 }
        }

        fn mode(&self) -> MigState {
            self.gpu.mode.expect("MIG-capable")
        }

        fn gi_profile(&self, id: u32) -> Result<&GiProfile, String> {
            self.gpu
                .profiles
                .iter()
                .find(|p| p.id == id)
                .ok_or(format!("INVALID_ARGUMENT: no GPU instance profile id {id}"))
        }

        fn next_gi_id(&mut self) -> u32 {
            loop {
                self.seq += 1;
                let id = (self.seq * 7 + 3) % 31 + 1;
                if !self.gpu.gpu_instances.iter().any(|g| g.id == id) {
                    return id;
                }
            }
        }

        fn apply(&mut self, ops: &[MigOp]) -> Result<(), String> {
            let overlaps = |a: Placement, b: Placement| a.start < b.start + b.size && b.start < a.start + a.size;
            let mut created: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    MigOp::DestroyCi { gi_id, ci_id } => {
                        if !self.mode().current {
                            return Err("NOT_SUPPORTED: DestroyCi with MIG disabled".into());
                        }
                        let gi = self.gpu.gpu_instances.iter_mut().find(|g| g.id == *gi_id);
                        let gi = gi.ok_or(format!("NOT_FOUND: GPU instance {gi_id}"))?;
                        let before = gi.compute_instances.len();
                        gi.compute_instances.retain(|c| c.id != *ci_id);
                        if gi.compute_instances.len() == before {
                            return Err(format!("NOT_FOUND: compute instance {ci_id} in {gi_id}"));
                        }
                    }
                    MigOp::DestroyGi { gi_id } => {
                        let at = self.gpu.gpu_instances.iter().position(|g| g.id == *gi_id);
                        let at = at.ok_or(format!("NOT_FOUND: GPU instance {gi_id}"))?;
                        if !self.gpu.gpu_instances[at].compute_instances.is_empty() {
                            return Err(format!("IN_USE: GPU instance {gi_id} has compute instances"));
                        }
                        self.gpu.gpu_instances.remove(at);
                    }
                    MigOp::SetMode { enabled } => {
                        if !self.gpu.gpu_instances.is_empty() {
                            return Err("IN_USE: SetMigMode with GPU instances present".into());
                        }
                        // Pending, then the applier's GPU reset makes it current.
                        self.gpu.mode = Some(MigState {
                            current: *enabled,
                            pending: *enabled,
                        });
                    }
                    MigOp::CreateGi {
                        profile_id,
                        placement,
                        name,
                    } => {
                        if !self.mode().current {
                            return Err("NOT_SUPPORTED: CreateGi with MIG mode not current".into());
                        }
                        let profile = self.gi_profile(*profile_id)?;
                        if profile.name != *name {
                            return Err(format!("op names {name} for profile {}", profile.name));
                        }
                        if !profile.placements.contains(placement) {
                            return Err(format!("INVALID_ARGUMENT: {name} cannot be at {placement:?}"));
                        }
                        let same = self
                            .gpu
                            .gpu_instances
                            .iter()
                            .filter(|g| g.profile_id == *profile_id)
                            .count();
                        if same >= profile.instance_count as usize {
                            return Err(format!("INSUFFICIENT_RESOURCES: instance count of {name}"));
                        }
                        if self.gpu.gpu_instances.iter().any(|g| overlaps(g.placement, *placement)) {
                            return Err(format!("INSUFFICIENT_RESOURCES: {name} at {placement:?} overlaps"));
                        }
                        let id = self.next_gi_id();
                        self.gpu.gpu_instances.push(ObservedGi {
                            id,
                            profile_id: *profile_id,
                            placement: *placement,
                            compute_instances: Vec::new(),
                        });
                        created.push(id);
                    }
                    MigOp::CreateCi {
                        gi,
                        profile_id,
                        placement,
                        name,
                    } => {
                        if !self.mode().current {
                            return Err("NOT_SUPPORTED: CreateCi with MIG mode not current".into());
                        }
                        let gi_id = match gi {
                            GiRef::New(n) => *created.get(*n).ok_or(format!("no CreateGi #{n} before"))?,
                            GiRef::Existing(id) => *id,
                        };
                        let instance = self.gpu.gpu_instances.iter().find(|g| g.id == gi_id);
                        let instance = instance.ok_or(format!("NOT_FOUND: GPU instance {gi_id}"))?;
                        let gi_profile = self.gi_profile(instance.profile_id)?;
                        let profile = gi_profile.ci_profiles.iter().find(|c| c.id == *profile_id);
                        let profile = profile.ok_or(format!("INVALID_ARGUMENT: CI profile {profile_id}"))?;
                        if profile.name != *name {
                            return Err(format!("op names {name} for CI profile {}", profile.name));
                        }
                        if !profile.placements.contains(placement) {
                            return Err(format!("INVALID_ARGUMENT: {name} cannot be at {placement:?}"));
                        }
                        let cis = &instance.compute_instances;
                        if cis.iter().filter(|c| c.profile_id == *profile_id).count() >= profile.instance_count as usize
                        {
                            return Err(format!("INSUFFICIENT_RESOURCES: instance count of {name}"));
                        }
                        if cis.iter().any(|c| overlaps(c.placement, *placement)) {
                            return Err(format!("INSUFFICIENT_RESOURCES: {name} at {placement:?} overlaps"));
                        }
                        let id = (0..).find(|i| !cis.iter().any(|c| c.id == *i)).expect("a free id");
                        let instance = self
                            .gpu
                            .gpu_instances
                            .iter_mut()
                            .find(|g| g.id == gi_id)
                            .expect("found above");
                        instance.compute_instances.push(ObservedCi {
                            id,
                            profile_id: *profile_id,
                            placement: *placement,
                        });
                    }
                }
            }
            Ok(())
        }
    }

    /// Plans, applies on the hardware model, and checks that planning again gives no operations.
    fn converge(hw: &mut Hardware, desired: &DesiredGpu) -> Result<GpuPlan, PlanError> {
        let plan = plan_gpu(&hw.gpu, desired)?;
        hw.apply(&plan.ops)
            .unwrap_or_else(|e| panic!("{desired:?}: hardware refused the plan: {e}\n{}", describe(&plan)));
        let again = plan_gpu(&hw.gpu, desired).expect("replan");
        assert!(
            again.ops.is_empty(),
            "{desired:?}: re-plan not empty:\n{}",
            describe(&again)
        );
        Ok(plan)
    }

    /// The GPU instance profile counts that exist on a GPU, by profile name.
    fn gi_counts(gpu: &ObservedGpu) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for g in &gpu.gpu_instances {
            let name = &gpu.profiles.iter().find(|p| p.id == g.profile_id).unwrap().name;
            *out.entry(name.clone()).or_insert(0) += 1;
        }
        out
    }

    // ---- test-peers §1.6 "Suggested layout test cases" ----

    #[test]
    fn seven_1g_fit_at_slices_0_to_6() {
        let plan = plan_gpu(&a100_40gb(), &enabled(&[("1g.5gb", 7)])).unwrap();
        assert_eq!(plan.ops[0], MigOp::SetMode { enabled: true });
        let want: Vec<(String, Placement)> = (0..7).map(|s| ("1g.5gb".to_string(), p(s, 1))).collect();
        assert_eq!(created_gis(&plan), want);
        let cis: Vec<_> = (0..7).map(|n| (n, "1g.5gb".to_string(), p(0, 1))).collect();
        assert_eq!(created_cis(&plan), cis);
        // Each GPU instance is followed by its compute instance.
        assert!(matches!(plan.ops[1], MigOp::CreateGi { profile_id: 19, .. }));
        assert!(matches!(
            plan.ops[2],
            MigOp::CreateCi {
                gi: GiRef::New(0),
                profile_id: 0,
                ..
            }
        ));
        assert_eq!(plan.ops.len(), 15);
    }

    #[test]
    fn eight_1g_do_not_fit() {
        for model in models() {
            let name = &model.profiles[0].name;
            let err = plan_gpu(&model, &enabled(&[(name, 8)])).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&model.uuid) && text.contains("at most 7"), "{text}");
            assert_eq!(does_not_fit(Err(err)).0, *name);
        }
    }

    #[test]
    fn four_g_and_three_g_whatever_the_order() {
        for model in models() {
            let (g4, g3) = (&model.profiles[3].name, &model.profiles[2].name);
            let plan = plan_gpu(&model, &enabled(&[(g3, 1), (g4, 1)])).unwrap();
            assert_eq!(created_gis(&plan), vec![(g4.clone(), p(0, 4)), (g3.clone(), p(4, 4))]);
            // Profile order on the GPU does not change the plan either.
            let mut reversed = model.clone();
            reversed.profiles.reverse();
            assert_eq!(plan_gpu(&reversed, &enabled(&[(g4, 1), (g3, 1)])).unwrap(), plan);
        }
    }

    #[test]
    fn two_g_does_not_take_the_three_g_slot() {
        let plan = plan_gpu(&a100_40gb(), &enabled(&[("2g.10gb", 1), ("3g.20gb", 1)])).unwrap();
        assert_eq!(
            created_gis(&plan),
            vec![("3g.20gb".to_string(), p(0, 4)), ("2g.10gb".to_string(), p(4, 2))]
        );
        let plan = plan_gpu(&a100_40gb(), &enabled(&[("2g.10gb", 2), ("3g.20gb", 1)])).unwrap();
        assert_eq!(
            created_gis(&plan),
            vec![
                ("2g.10gb".to_string(), p(0, 2)),
                ("2g.10gb".to_string(), p(2, 2)),
                ("3g.20gb".to_string(), p(4, 4))
            ]
        );
    }

    #[test]
    fn four_1g_10gb_leave_no_memory_slice_for_a_1g_5gb() {
        let ok = plan_gpu(&a100_40gb(), &enabled(&[("1g.10gb", 4)])).unwrap();
        assert_eq!(
            created_gis(&ok).iter().map(|g| g.1.start).collect::<Vec<_>>(),
            [0, 2, 4, 6]
        );
        let (profile, reason) = does_not_fit(plan_gpu(&a100_40gb(), &enabled(&[("1g.10gb", 4), ("1g.5gb", 1)])));
        assert_eq!(profile, "1g.5gb");
        assert!(reason.contains("1g.10gb x4"), "{reason}");
        let (profile, _) = does_not_fit(plan_gpu(&h100_80gb(), &enabled(&[("1g.20gb", 4), ("1g.10gb+me", 1)])));
        assert_eq!(profile, "1g.10gb+me");
    }

    #[test]
    fn seven_g_takes_the_whole_gpu() {
        for model in models() {
            let full = model.profiles[4].name.clone();
            let plan = plan_gpu(&model, &enabled(&[(&full, 1)])).unwrap();
            assert_eq!(created_gis(&plan), vec![(full.clone(), p(0, 8))]);
            for other in &model.profiles {
                let result = if other.name == full {
                    plan_gpu(&model, &enabled(&[(&full, 2)]))
                } else {
                    plan_gpu(&model, &enabled(&[(&full, 1), (&other.name, 1)]))
                };
                let (profile, _) = does_not_fit(result);
                assert!(profile == other.name || profile == full, "{profile}");
            }
        }
    }

    #[test]
    fn one_media_extension_instance_only() {
        let (profile, reason) = does_not_fit(plan_gpu(&a100_40gb(), &enabled(&[("1g.5gb+me", 2)])));
        assert_eq!(profile, "1g.5gb+me");
        assert!(reason.contains("at most 1"), "{reason}");
        let plan = plan_gpu(&a100_40gb(), &enabled(&[("1g.5gb+me", 1), ("1g.5gb", 6)])).unwrap();
        assert_eq!(created_gis(&plan).len(), 7);
    }

    // ---- The hardware model itself refuses what NVML refuses ----

    #[test]
    fn hardware_model_enforces_nvml_rules() {
        let create = |name: &str, profile_id, start, size| MigOp::CreateGi {
            profile_id,
            placement: p(start, size),
            name: name.into(),
        };
        let mut hw = Hardware::new(a100_40gb());
        // Create while MIG is disabled.
        assert!(
            hw.apply(&[create("3g.20gb", 9, 0, 4)])
                .unwrap_err()
                .starts_with("NOT_SUPPORTED")
        );
        hw.apply(&[MigOp::SetMode { enabled: true }]).unwrap();
        // 2g.10gb@2 overlaps 3g.20gb@0 (memory slices 2-3).
        let err = hw
            .apply(&[create("3g.20gb", 9, 0, 4), create("2g.10gb", 14, 2, 2)])
            .unwrap_err();
        assert!(err.starts_with("INSUFFICIENT_RESOURCES"), "{err}");
        // A second +me.
        let mut hw = Hardware::new(a100_40gb());
        let ops = [
            MigOp::SetMode { enabled: true },
            create("1g.5gb+me", 20, 0, 1),
            create("1g.5gb+me", 20, 1, 1),
        ];
        assert!(hw.apply(&ops).unwrap_err().starts_with("INSUFFICIENT_RESOURCES"));
        // Destroying a GPU instance with a live compute instance; changing mode with instances.
        let mut hw = Hardware::new(a100_40gb());
        converge(&mut hw, &enabled(&[("3g.20gb", 1)])).unwrap();
        let gi_id = hw.gpu.gpu_instances[0].id;
        assert!(
            hw.apply(&[MigOp::DestroyGi { gi_id }])
                .unwrap_err()
                .starts_with("IN_USE")
        );
        assert!(
            hw.apply(&[MigOp::SetMode { enabled: false }])
                .unwrap_err()
                .starts_with("IN_USE")
        );
    }

    // ---- Re-apply, mode changes, errors ----

    #[test]
    fn reapplying_a_layout_mutates_nothing_whatever_the_ids_and_placements() {
        let desired = enabled(&[("1g.5gb", 2), ("2g.10gb", 1), ("1c.3g.20gb", 2)]);
        let mut hw = Hardware::new(a100_40gb());
        converge(&mut hw, &desired).unwrap();
        // The same instances, set up by hand elsewhere and with other ids, match too.
        let mut by_hand = hw.gpu.clone();
        for (k, g) in by_hand.gpu_instances.iter_mut().enumerate() {
            g.id = 100 + k as u32;
            g.placement.start = 7 - k as u32;
        }
        by_hand.gpu_instances.reverse();
        assert!(plan_gpu(&by_hand, &desired).unwrap().ops.is_empty());
        // One compute instance fewer: everything is recreated.
        let mut fewer = hw.gpu.clone();
        let gi = fewer
            .gpu_instances
            .iter_mut()
            .find(|g| g.compute_instances.len() == 2)
            .unwrap();
        gi.compute_instances.pop();
        let plan = plan_gpu(&fewer, &desired).unwrap();
        assert_eq!(created_gis(&plan).len(), 4);
        assert!(!plan.ops.contains(&MigOp::SetMode { enabled: true }));
    }

    #[test]
    fn a_new_layout_destroys_compute_instances_then_gpu_instances_then_creates() {
        let mut hw = Hardware::new(a100_40gb());
        converge(&mut hw, &enabled(&[("1c.4g.20gb", 2), ("3g.20gb", 1)])).unwrap();
        let plan = converge(&mut hw, &enabled(&[("7g.40gb", 1)])).unwrap();
        let kinds: Vec<&str> = plan
            .ops
            .iter()
            .map(|op| match op {
                MigOp::DestroyCi { .. } => "dci",
                MigOp::DestroyGi { .. } => "dgi",
                MigOp::SetMode { .. } => "mode",
                MigOp::CreateGi { .. } => "cgi",
                MigOp::CreateCi { .. } => "cci",
            })
            .collect();
        assert_eq!(kinds, ["dci", "dci", "dci", "dgi", "dgi", "cgi", "cci"]);
    }

    #[test]
    fn pending_mode_is_set_again() {
        let mut hw = Hardware::new(a100_40gb());
        let desired = enabled(&[("4g.20gb", 1)]);
        converge(&mut hw, &desired).unwrap();
        // A disable is pending: the layout is right, the mode is not.
        hw.gpu.mode = Some(MigState {
            current: true,
            pending: false,
        });
        let plan = plan_gpu(&hw.gpu, &desired).unwrap();
        assert!(plan.ops.contains(&MigOp::SetMode { enabled: true }));
        // An enable is pending (no reset yet): no instances can exist; set it again, then create.
        let mut gpu = a100_40gb();
        gpu.mode = Some(MigState {
            current: false,
            pending: true,
        });
        let plan = plan_gpu(&gpu, &desired).unwrap();
        assert_eq!(plan.ops[0], MigOp::SetMode { enabled: true });
        assert_eq!(created_gis(&plan), vec![("4g.20gb".to_string(), p(0, 4))]);
    }

    #[test]
    fn disabling_mig() {
        let mut hw = Hardware::new(h100_80gb());
        converge(&mut hw, &enabled(&[("1g.10gb", 3), ("1c.3g.40gb", 2)])).unwrap();
        let plan = converge(&mut hw, &disabled()).unwrap();
        assert_eq!(plan.ops.len(), 5 + 4 + 1);
        assert_eq!(plan.ops.last(), Some(&MigOp::SetMode { enabled: false }));
        assert_eq!(
            hw.gpu.mode,
            Some(MigState {
                current: false,
                pending: false
            })
        );
        // Already disabled; counts of 0 are no entry.
        let zero = DesiredGpu {
            mig_enabled: false,
            profiles: [("1g.10gb".to_string(), 0)].into(),
        };
        assert!(plan_gpu(&hw.gpu, &zero).unwrap().ops.is_empty());
        // A pending enable is undone.
        hw.gpu.mode = Some(MigState {
            current: false,
            pending: true,
        });
        assert_eq!(
            plan_gpu(&hw.gpu, &disabled()).unwrap().ops,
            [MigOp::SetMode { enabled: false }]
        );
    }

    #[test]
    fn profiles_with_mig_disabled_are_an_error() {
        let desired = DesiredGpu {
            mig_enabled: false,
            profiles: [("1g.5gb".to_string(), 2)].into(),
        };
        let err = plan_gpu(&a100_40gb(), &desired).unwrap_err();
        assert!(matches!(err, PlanError::ProfilesWithMigDisabled { .. }), "{err}");
        assert!(err.to_string().contains("1g.5gb: 2"), "{err}");
    }

    #[test]
    fn gpu_without_mig() {
        let mut gpu = a100_40gb();
        gpu.mode = None;
        gpu.profiles.clear();
        gpu.uuid = "GPU-t4".into();
        let err = plan_gpu(&gpu, &enabled(&[])).unwrap_err();
        assert_eq!(
            err,
            PlanError::NotMigCapable {
                gpu: "0 (GPU-t4)".into()
            }
        );
        assert!(err.to_string().contains("GPU-t4"));
        assert!(plan_gpu(&gpu, &disabled()).unwrap().ops.is_empty());
    }

    #[test]
    fn mig_enabled_with_no_devices() {
        let mut hw = Hardware::new(a100_40gb());
        let plan = converge(&mut hw, &enabled(&[])).unwrap();
        assert_eq!(plan.ops, [MigOp::SetMode { enabled: true }]);
        converge(&mut hw, &enabled(&[("1g.5gb", 1)])).unwrap();
        let plan = converge(&mut hw, &enabled(&[])).unwrap();
        assert_eq!(plan.ops.len(), 2);
    }

    #[test]
    fn unknown_profiles_name_the_gpu_and_what_it_has() {
        for name in [
            "2g.20gb",
            "1c.2g.20gb",
            "5c.3g.20gb",
            "1c.1g.5gb+me.x",
            "3g",
            "",
            "1c.9g.20gb",
        ] {
            match plan_gpu(&a100_40gb(), &enabled(&[(name, 1)])) {
                Err(PlanError::UnknownProfile {
                    gpu,
                    profile,
                    available,
                }) => {
                    assert_eq!(gpu, "0 (GPU-a100-40gb)");
                    assert_eq!(profile, name);
                    assert_eq!(available[..4], ["1g.5gb", "2g.10gb", "1c.2g.10gb", "3g.20gb"]);
                    assert!(available.contains(&"2c.4g.20gb".to_string()));
                    assert!(available.contains(&"1g.5gb+me".to_string()));
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        // The H100 names are not the A100's.
        assert!(plan_gpu(&h100_80gb(), &enabled(&[("1g.5gb", 1)])).is_err());
        assert!(plan_gpu(&h100_80gb(), &enabled(&[("1g.10gb", 1)])).is_ok());
    }

    // ---- Compute instance forms ----

    #[test]
    fn compute_instance_forms_fill_gpu_instances() {
        let gpu = a100_40gb();
        let plan = plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 3)])).unwrap();
        assert_eq!(created_gis(&plan), vec![("3g.20gb".to_string(), p(0, 4))]);
        let one_c = |n, s| (n, "1c.3g.20gb".to_string(), p(s, 1));
        assert_eq!(created_cis(&plan), vec![one_c(0, 0), one_c(0, 1), one_c(0, 2)]);

        let plan = plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 4)])).unwrap();
        assert_eq!(created_gis(&plan).len(), 2);
        assert_eq!(
            created_cis(&plan),
            vec![one_c(0, 0), one_c(0, 1), one_c(0, 2), one_c(1, 0)]
        );

        let plan = plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 1), ("2c.3g.20gb", 1)])).unwrap();
        assert_eq!(created_gis(&plan).len(), 1);
        assert_eq!(
            created_cis(&plan),
            vec![(0, "2c.3g.20gb".to_string(), p(0, 2)), one_c(0, 2)]
        );

        let plan = plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 2), ("2c.3g.20gb", 2)])).unwrap();
        let cis = created_cis(&plan);
        assert_eq!(created_gis(&plan).len(), 2);
        for n in 0..2 {
            let names: Vec<&str> = cis.iter().filter(|c| c.0 == n).map(|c| c.1.as_str()).collect();
            assert_eq!(names, ["2c.3g.20gb", "1c.3g.20gb"]);
        }

        // A plain 3g.20gb keeps its own GPU instance: two in all.
        let plan = plan_gpu(&gpu, &enabled(&[("3g.20gb", 1), ("1c.3g.20gb", 1)])).unwrap();
        assert_eq!(created_gis(&plan).len(), 2);
        let (profile, reason) = does_not_fit(plan_gpu(&gpu, &enabled(&[("3g.20gb", 1), ("1c.3g.20gb", 4)])));
        assert_eq!(profile, "3g.20gb");
        assert!(
            reason.contains("3 GPU instances") && reason.contains("2 of them"),
            "{reason}"
        );
        let (profile, _) = does_not_fit(plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 7)])));
        assert_eq!(profile, "1c.3g.20gb");

        // mig-parted's own example: one 4g.20gb with four 1c compute instances, next to a 3g.20gb.
        let mut hw = Hardware::new(gpu.clone());
        let plan = converge(&mut hw, &enabled(&[("1c.4g.20gb", 4), ("3g.20gb", 1)])).unwrap();
        assert_eq!(
            created_gis(&plan),
            vec![("4g.20gb".to_string(), p(0, 4)), ("3g.20gb".to_string(), p(4, 4))]
        );

        // `3c.3g.20gb` is `3g.20gb`.
        assert_eq!(
            plan_gpu(&gpu, &enabled(&[("3c.3g.20gb", 2)])).unwrap(),
            plan_gpu(&gpu, &enabled(&[("3g.20gb", 2)])).unwrap()
        );
    }

    #[test]
    fn compute_instance_placements_default_to_aligned_slices() {
        let mut gpu = a100_40gb();
        for profile in &mut gpu.profiles {
            for ci in &mut profile.ci_profiles {
                ci.placements.clear();
            }
        }
        let plan = plan_gpu(&gpu, &enabled(&[("2c.4g.20gb", 1), ("1c.4g.20gb", 2), ("1g.5gb", 1)])).unwrap();
        assert_eq!(
            created_cis(&plan),
            vec![
                (0, "2c.4g.20gb".to_string(), p(0, 2)),
                (0, "1c.4g.20gb".to_string(), p(2, 1)),
                (0, "1c.4g.20gb".to_string(), p(3, 1)),
                (1, "1g.5gb".to_string(), p(0, 1)),
            ]
        );
    }

    #[test]
    fn describe_names_every_operation() {
        let mut gpu = a100_40gb();
        gpu.gpu_instances.push(ObservedGi {
            id: 7,
            profile_id: 19,
            placement: p(6, 1),
            compute_instances: vec![ObservedCi {
                id: 0,
                profile_id: 0,
                placement: p(0, 1),
            }],
        });
        gpu.mode = Some(MigState {
            current: true,
            pending: true,
        });
        let plan = plan_gpu(&gpu, &enabled(&[("1c.2g.10gb", 1)])).unwrap();
        assert_eq!(
            describe(&plan),
            "GPU 0 (GPU-a100-40gb): 4 operations\n\
             \x20 destroy compute instance 0 of GPU instance 7\n\
             \x20 destroy GPU instance 7\n\
             \x20 create GPU instance #0 2g.10gb (profile id 14) at memory slices 0:2\n\
             \x20 create compute instance 1c.2g.10gb (profile id 0) at compute slices 0:1 in new GPU instance #0 (2g.10gb)"
        );
        let mut off = gpu.clone();
        off.gpu_instances.clear();
        let plan = plan_gpu(&off, &disabled()).unwrap();
        assert_eq!(
            describe(&plan),
            "GPU 0 (GPU-a100-40gb): 1 operation\n  disable MIG mode"
        );
        off.mode = Some(MigState {
            current: false,
            pending: false,
        });
        let plan = plan_gpu(&off, &disabled()).unwrap();
        assert_eq!(describe(&plan), "GPU 0 (GPU-a100-40gb): as desired, nothing to do");
    }

    // ---- Exhaustive: every multiset of GPU instance profiles up to the instance counts ----

    /// Every count vector (per candidate group) reachable by choosing pairwise disjoint
    /// placements, at most `max` per group: a brute-force "fits" oracle independent of the
    /// planner's search.
    fn reachable(groups: &[(u32, Vec<Placement>)]) -> HashSet<Vec<u32>> {
        let candidates: Vec<(usize, u64)> = groups
            .iter()
            .enumerate()
            .flat_map(|(g, (_, ps))| {
                ps.iter()
                    .map(move |p| (g, (0..p.size).fold(0u64, |m, s| m | 1 << (p.start + s))))
            })
            .collect();
        fn walk(
            cands: &[(usize, u64)],
            groups: &[(u32, Vec<Placement>)],
            used: u64,
            counts: &mut Vec<u32>,
            out: &mut HashSet<Vec<u32>>,
        ) {
            let Some((&(g, mask), rest)) = cands.split_first() else {
                out.insert(counts.clone());
                return;
            };
            walk(rest, groups, used, counts, out);
            if used & mask == 0 && counts[g] < groups[g].0 {
                counts[g] += 1;
                walk(rest, groups, used | mask, counts, out);
                counts[g] -= 1;
            }
        }
        let mut out = HashSet::new();
        walk(&candidates, groups, 0, &mut vec![0; groups.len()], &mut out);
        out
    }

    /// All count vectors with `0 <= v[i] <= bounds[i]`.
    fn boxes(bounds: &[u32]) -> Vec<Vec<u32>> {
        let mut all = vec![Vec::new()];
        for &b in bounds {
            all = all
                .into_iter()
                .flat_map(|v| {
                    (0..=b).map(move |c| {
                        let mut v = v.clone();
                        v.push(c);
                        v
                    })
                })
                .collect();
        }
        all
    }

    fn exhaustive_gpu_instance_layouts(model: ObservedGpu) -> usize {
        let groups: Vec<(u32, Vec<Placement>)> = model
            .profiles
            .iter()
            .map(|g| (g.instance_count, g.placements.clone()))
            .collect();
        let fits = reachable(&groups);
        let bounds: Vec<u32> = model.profiles.iter().map(|g| g.instance_count).collect();
        let mut chained = Hardware::new(model.clone());
        let mut accepted = 0;
        for counts in boxes(&bounds) {
            let desired = DesiredGpu {
                mig_enabled: true,
                profiles: model
                    .profiles
                    .iter()
                    .zip(&counts)
                    .map(|(g, c)| (g.name.clone(), *c))
                    .collect(),
            };
            let result = plan_gpu(&model, &desired);
            assert_eq!(result.is_ok(), fits.contains(&counts), "{desired:?}: {result:?}");
            let Ok(plan) = result else {
                does_not_fit(result);
                continue;
            };
            accepted += 1;
            // From MIG disabled, and from whatever the previous layout left.
            for hw in [&mut Hardware::new(model.clone()), &mut chained] {
                converge(hw, &desired).unwrap();
                let want: BTreeMap<String, u32> =
                    desired.profiles.clone().into_iter().filter(|(_, c)| *c > 0).collect();
                assert_eq!(gi_counts(&hw.gpu), want);
            }
            assert_eq!(plan_gpu(&model, &desired).unwrap(), plan, "deterministic");
        }
        accepted
    }

    #[test]
    fn every_a100_40gb_gpu_instance_layout() {
        let accepted = exhaustive_gpu_instance_layouts(a100_40gb());
        assert_eq!(accepted, 128, "of 8 * 4 * 3 * 2 * 2 * 2 * 5 = 3840 multisets");
    }

    #[test]
    fn every_h100_80gb_gpu_instance_layout() {
        let accepted = exhaustive_gpu_instance_layouts(h100_80gb());
        assert_eq!(accepted, 128, "of 3840 multisets");
    }

    // ---- Exhaustive: compute instance forms of each GPU instance profile ----

    /// Whether `wanted` (counts per compute instance profile) splits into at most `bins` GPU
    /// instances, each holding a count vector that fits in one (`in_one`).
    fn packs(wanted: &[u32], in_one: &HashSet<Vec<u32>>, bins: u32) -> bool {
        if wanted.iter().all(|&c| c == 0) {
            return true;
        }
        bins > 0
            && in_one.iter().any(|v| {
                v.iter().any(|&c| c > 0)
                    && v.iter().zip(wanted).all(|(a, b)| a <= b)
                    && packs(
                        &wanted.iter().zip(v).map(|(b, a)| b - a).collect::<Vec<_>>(),
                        in_one,
                        bins - 1,
                    )
            })
    }

    /// For every GPU instance profile with compute instance profiles smaller than itself: every
    /// count of each of those (up to what all its GPU instances could hold) with every count of
    /// the plain profile. Returns (accepted, enumerated).
    fn exhaustive_compute_instance_layouts(model: ObservedGpu) -> (usize, usize) {
        let mut chained = Hardware::new(model.clone());
        let (mut accepted, mut enumerated) = (0, 0);
        for g in &model.profiles {
            let parts: Vec<&CiProfile> = g.ci_profiles.iter().filter(|c| c.slice_count < g.slice_count).collect();
            if parts.is_empty() {
                continue;
            }
            let groups: Vec<(u32, Vec<Placement>)> =
                parts.iter().map(|c| (c.instance_count, c.placements.clone())).collect();
            let in_one = reachable(&groups);
            let mut bounds: Vec<u32> = parts.iter().map(|c| c.instance_count * g.instance_count).collect();
            bounds.push(g.instance_count);
            for counts in boxes(&bounds) {
                enumerated += 1;
                let (ci_counts, plain) = counts.split_at(parts.len());
                let fits = packs(ci_counts, &in_one, g.instance_count - plain[0]);
                let mut profiles: BTreeMap<String, u32> =
                    parts.iter().zip(ci_counts).map(|(c, n)| (c.name.clone(), *n)).collect();
                profiles.insert(g.name.clone(), plain[0]);
                let desired = DesiredGpu {
                    mig_enabled: true,
                    profiles,
                };
                let result = plan_gpu(&model, &desired);
                assert_eq!(result.is_ok(), fits, "{desired:?}: {result:?}");
                if result.is_err() {
                    does_not_fit(result);
                    continue;
                }
                accepted += 1;
                for hw in [&mut Hardware::new(model.clone()), &mut chained] {
                    converge(hw, &desired).unwrap();
                    let cis: usize = hw.gpu.gpu_instances.iter().map(|g| g.compute_instances.len()).sum();
                    assert_eq!(cis as u32, ci_counts.iter().sum::<u32>() + plain[0], "{desired:?}");
                }
            }
        }
        (accepted, enumerated)
    }

    #[test]
    fn every_a100_40gb_compute_instance_layout() {
        assert_eq!(exhaustive_compute_instance_layouts(a100_40gb()), (87, 505));
    }

    #[test]
    fn every_h100_80gb_compute_instance_layout() {
        assert_eq!(exhaustive_compute_instance_layouts(h100_80gb()), (87, 505));
    }

    // ---- Compute instance profiles not read yet ----

    /// `model` as observation reports it before any GPU instance exists: each profile's compute
    /// instance profiles are only the unread one spanning it.
    pub(crate) fn unread(mut model: ObservedGpu) -> ObservedGpu {
        for g in &mut model.profiles {
            g.ci_profiles = vec![CiProfile {
                name: g.name.clone(),
                index: CiProfile::UNREAD,
                id: CiProfile::UNREAD,
                slice_count: g.slice_count,
                instance_count: 1,
                placements: vec![p(0, g.slice_count)],
            }];
        }
        model
    }

    fn ci_profiles_unknown(result: Result<GpuPlan, PlanError>) -> String {
        match result {
            Err(PlanError::CiProfilesUnknown { profile, .. }) => profile,
            other => panic!("expected CiProfilesUnknown, got {other:?}"),
        }
    }

    #[test]
    fn unread_compute_instance_forms_do_not_hide_other_errors() {
        let gpu = unread(a100_40gb());
        // Counts, names and the GPU instances' fit are checked all the same.
        let (profile, reason) = does_not_fit(plan_gpu(&gpu, &enabled(&[("1c.4g.20gb", 1), ("1g.5gb", 8)])));
        assert_eq!(profile, "1g.5gb", "{reason}");
        assert!(matches!(
            plan_gpu(&gpu, &enabled(&[("1c.4g.20gb", 1), ("2g.20gb", 1)])),
            Err(PlanError::UnknownProfile { profile, .. }) if profile == "2g.20gb"
        ));
        let (profile, reason) = does_not_fit(plan_gpu(&gpu, &enabled(&[("1c.4g.20gb", 1), ("4g.20gb", 1)])));
        assert_eq!(profile, "4g.20gb");
        assert!(reason.starts_with("at least 2 GPU instances"), "{reason}");
        let (profile, _) = does_not_fit(plan_gpu(&gpu, &enabled(&[("1c.4g.20gb", 1), ("7g.40gb", 1)])));
        assert_eq!(profile, "4g.20gb");
        // Slices: seven 1c compute instances need three 3g.20gb, two fit.
        let (profile, _) = does_not_fit(plan_gpu(&gpu, &enabled(&[("1c.3g.20gb", 7)])));
        assert_eq!(profile, "3g.20gb");
        // Bigger than half: no two 2c share a 3g.20gb.
        let (profile, _) = does_not_fit(plan_gpu(&gpu, &enabled(&[("2c.3g.20gb", 3)])));
        assert_eq!(profile, "3g.20gb");
        let (profile, _) = does_not_fit(plan_gpu(&gpu, &enabled(&[("2c.3g.20gb", 1), ("3g.20gb", 2)])));
        assert_eq!(profile, "3g.20gb");
        // More compute slices than the GPU instance has, or none: no such profile at all.
        for name in ["5c.4g.20gb", "4c.4g.20gb+me", "0c.4g.20gb", "+1c.4g.20gb"] {
            assert!(
                matches!(
                    plan_gpu(&gpu, &enabled(&[(name, 1)])),
                    Err(PlanError::UnknownProfile { .. })
                ),
                "{name}"
            );
        }
        // What only NVML's compute instance profiles can decide.
        for layout in [
            &[("1c.4g.20gb", 4), ("3g.20gb", 1)][..],
            &[("1c.3g.20gb", 6)],
            &[("2c.3g.20gb", 1), ("1g.5gb", 3)],
            &[("3c.4g.20gb", 1)],
            &[("1g.5gb", 3), ("1c.4g.20gb", 1)],
        ] {
            let first = layout
                .iter()
                .map(|(n, _)| *n)
                .filter(|n| n.contains("c."))
                .min()
                .unwrap();
            assert_eq!(
                ci_profiles_unknown(plan_gpu(&gpu, &enabled(layout))),
                first,
                "{layout:?}"
            );
        }
        // `4c.4g.20gb` is `4g.20gb`, whatever NVML lists.
        assert!(plan_gpu(&gpu, &enabled(&[("4c.4g.20gb", 1)])).is_ok());
    }

    /// Every compute instance layout that fits once NVML's compute instance profiles are known is
    /// let through before (to read them), and every one refused before is refused after.
    #[test]
    fn unread_compute_instance_forms_never_refuse_a_layout_that_fits() {
        for model in [a100_40gb(), h100_80gb()] {
            let before = unread(model.clone());
            let (mut let_through, mut refused) = (0, 0);
            for g in &model.profiles {
                let parts: Vec<&CiProfile> = g.ci_profiles.iter().filter(|c| c.slice_count < g.slice_count).collect();
                if parts.is_empty() {
                    continue;
                }
                let mut bounds: Vec<u32> = parts.iter().map(|c| c.instance_count * g.instance_count + 1).collect();
                bounds.push(g.instance_count);
                // And a 1g slice next to them, so that GPU instance placement counts too.
                bounds.push(2);
                for counts in boxes(&bounds) {
                    let (ci_counts, rest) = counts.split_at(parts.len());
                    if ci_counts.iter().all(|&c| c == 0) {
                        continue;
                    }
                    let mut profiles: BTreeMap<String, u32> =
                        parts.iter().zip(ci_counts).map(|(c, n)| (c.name.clone(), *n)).collect();
                    profiles.insert(g.name.clone(), rest[0]);
                    profiles.insert(model.profiles[0].name.clone(), rest[1]);
                    let desired = DesiredGpu {
                        mig_enabled: true,
                        profiles,
                    };
                    match (plan_gpu(&before, &desired), plan_gpu(&model, &desired)) {
                        (Err(PlanError::CiProfilesUnknown { .. }), _) => let_through += 1,
                        (Err(PlanError::DoesNotFit { .. }), Err(PlanError::DoesNotFit { .. })) => refused += 1,
                        (b, a) => panic!("{desired:?}: before {b:?}, after {a:?}"),
                    }
                }
            }
            assert!(let_through > 0 && refused > 0, "{let_through} {refused}");
        }
    }
}
