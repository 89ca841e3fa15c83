//! Everything mutable about the simulated GPUs (MIG mode, GPU instances, compute
//! instances) and the MIG placement engine that changes it.
//!
//! This module is pure: no files, no FFI. [`State`] is what `state.json` holds.

use serde::{Deserialize, Serialize};

use crate::error::{NvmlError, NvmlResult};
use crate::machine::{GpuSpec, Machine};
use crate::models::{GiProfile, GpuModel, ci_id_for, ci_profile_by_index, ci_profiles, gi_id_for};

/// Version of the `state.json` layout.
pub const STATE_FORMAT: u32 = 1;

/// The persisted state of all GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Layout version ([`STATE_FORMAT`]).
    pub format: u32,
    /// Next serial to hand out; serials identify instances across reloads (handles use them).
    pub next_serial: u64,
    /// One entry per GPU, in machine order.
    pub gpus: Vec<GpuState>,
}

/// Mutable state of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuState {
    /// The GPU's UUID (ties the entry to the machine file).
    pub uuid: String,
    /// Current MIG mode.
    pub mig_current: bool,
    /// Pending MIG mode (differs from current while a change waits for an idle GPU).
    pub mig_pending: bool,
    /// GPU instances, kept sorted by id.
    pub gpu_instances: Vec<GpuInstance>,
    /// Compute mode (`nvmlComputeMode_t`: 0 DEFAULT, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS); a
    /// state file without it is DEFAULT, as a GPU after a driver load.
    #[serde(default, skip_serializing_if = "is_default_mode")]
    pub compute_mode: u32,
}

fn is_default_mode(mode: &u32) -> bool {
    *mode == 0
}

/// One GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInstance {
    /// Unique serial (never reused), part of the handle identity.
    pub serial: u64,
    /// GI id as NVML reports it ([`gi_id_for`]).
    pub id: u32,
    /// Hardware GPU-instance profile id.
    pub profile_id: u32,
    /// Placement start, in memory slices.
    pub start: u32,
    /// Compute instances, kept sorted by id.
    pub compute_instances: Vec<ComputeInstance>,
}

/// One compute instance (= one MIG device).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeInstance {
    /// Unique serial (never reused), part of the handle identity.
    pub serial: u64,
    /// CI id as NVML reports it ([`ci_id_for`]).
    pub id: u32,
    /// Compute-instance profile index (= the CI profile id NVML reports).
    pub profile_index: u32,
    /// Placement start, in compute slices of the GPU instance.
    pub start: u32,
}

impl State {
    /// Builds the initial state from the machine file, creating its pre-existing MIG devices.
    pub fn from_machine(machine: &Machine) -> Result<State, String> {
        let mut state = State {
            format: STATE_FORMAT,
            next_serial: 1,
            gpus: Vec::with_capacity(machine.gpus.len()),
        };
        for (i, spec) in machine.gpus.iter().enumerate() {
            let mut gpu = GpuState {
                uuid: spec.uuid.clone(),
                mig_current: spec.mig_mode,
                mig_pending: spec.mig_mode,
                gpu_instances: Vec::new(),
                compute_mode: 0,
            };
            build_mig_devices(spec, &mut gpu, &mut state.next_serial).map_err(|e| format!("gpu[{i}]: {e}"))?;
            state.gpus.push(gpu);
        }
        Ok(state)
    }

    /// Checks that a loaded state fits the machine: same GPU UUIDs in order, and every
    /// instance valid for its model (replayed through the placement engine).
    pub fn check_against(&self, machine: &Machine) -> Result<(), String> {
        if self.format != STATE_FORMAT {
            return Err(format!("format {} is not {STATE_FORMAT}", self.format));
        }
        let ours: Vec<&str> = self.gpus.iter().map(|g| g.uuid.as_str()).collect();
        let theirs: Vec<&str> = machine.gpus.iter().map(|g| g.uuid.as_str()).collect();
        if ours != theirs {
            return Err("GPU UUIDs differ from the machine file".into());
        }
        let mut serials = std::collections::HashSet::new();
        let all = self
            .gpus
            .iter()
            .flat_map(|g| &g.gpu_instances)
            .flat_map(|gi| std::iter::once(gi.serial).chain(gi.compute_instances.iter().map(|c| c.serial)));
        for serial in all {
            if !serials.insert(serial) {
                return Err(format!("serial {serial} is used twice"));
            }
        }
        for (gpu, spec) in self.gpus.iter().zip(&machine.gpus) {
            let model = spec.model;
            if !model.has_mig() && (gpu.mig_current || gpu.mig_pending) {
                return Err(format!("{}: MIG mode set on a non-MIG model", gpu.uuid));
            }
            if !gpu.gpu_instances.is_empty() && !gpu.mig_current {
                return Err(format!("{}: GPU instances while MIG is disabled", gpu.uuid));
            }
            let mut replay = GpuState {
                uuid: gpu.uuid.clone(),
                mig_current: true,
                mig_pending: true,
                gpu_instances: Vec::new(),
                compute_mode: gpu.compute_mode,
            };
            for gi in &gpu.gpu_instances {
                let at = replay
                    .create_gi(model, gi.profile_id, Some(gi.start), gi.serial)
                    .map_err(|e| format!("{}: GI {} invalid: {e:?}", gpu.uuid, gi.id))?;
                if replay.gpu_instances[at].id != gi.id {
                    return Err(format!("{}: GI id {} does not match its placement", gpu.uuid, gi.id));
                }
                let profile = model
                    .gi_profile_by_id(gi.profile_id)
                    .ok_or_else(|| format!("{}: unknown profile", gpu.uuid))?;
                for ci in &gi.compute_instances {
                    let new = &mut replay.gpu_instances[at];
                    let c = new
                        .create_ci(profile, ci.profile_index, Some(ci.start), ci.serial)
                        .map_err(|e| format!("{}: CI {} invalid: {e:?}", gpu.uuid, ci.id))?;
                    if new.compute_instances[c].id != ci.id {
                        return Err(format!("{}: CI id {} does not match its placement", gpu.uuid, ci.id));
                    }
                }
            }
        }
        Ok(())
    }

    /// Hands out a fresh serial.
    pub fn take_serial(&mut self) -> u64 {
        let s = self.next_serial;
        self.next_serial += 1;
        s
    }

    /// Makes `next_serial` larger than every serial in use (after loading a file).
    pub fn fix_next_serial(&mut self) {
        let max = self
            .gpus
            .iter()
            .flat_map(|g| &g.gpu_instances)
            .flat_map(|gi| std::iter::once(gi.serial).chain(gi.compute_instances.iter().map(|c| c.serial)))
            .max()
            .unwrap_or(0);
        self.next_serial = self.next_serial.max(max + 1);
    }
}

/// Creates the machine file's `mig_device` entries on a fresh GPU.
fn build_mig_devices(spec: &GpuSpec, gpu: &mut GpuState, next_serial: &mut u64) -> Result<(), String> {
    let model = spec.model;
    let mut serial = || {
        let s = *next_serial;
        *next_serial += 1;
        s
    };
    for (k, dev) in spec.mig_devices.iter().enumerate() {
        let fail = |what: String| format!("mig_device[{k}] ({}): {what}", dev.profile);
        let (gi_profile, ci_slices) = parse_mig_profile(model, &dev.profile).map_err(fail)?;
        // Compute-instance form: reuse a GI of that profile (at the placement, if given)
        // with room for one more CI of that size.
        let ci_index = ci_profiles(gi_profile)
            .into_iter()
            .find(|c| c.slices == ci_slices)
            .map(|c| c.index)
            .ok_or_else(|| fail("no such compute-instance size".into()))?;
        let reuse = if ci_slices < gi_profile.slices {
            gpu.gpu_instances.iter().position(|gi| {
                gi.profile_id == gi_profile.id
                    && dev.placement.is_none_or(|p| p == gi.start)
                    && gi.clone().create_ci(gi_profile, ci_index, None, 0).is_ok()
            })
        } else {
            None
        };
        let at = match reuse {
            Some(at) => at,
            None => {
                let start = match dev.placement {
                    Some(p) => p,
                    None => gi_profile
                        .starts
                        .iter()
                        .copied()
                        .find(|&s| gpu.check_gi_placement(model, gi_profile, s).is_ok())
                        .ok_or_else(|| fail("no free placement left".into()))?,
                };
                gpu.create_gi(model, gi_profile.id, Some(start), serial())
                    .map_err(|e| fail(format!("cannot create GPU instance at placement {start}: {}", why(e))))?
            }
        };
        gpu.gpu_instances[at]
            .create_ci(gi_profile, ci_index, None, serial())
            .map_err(|e| fail(format!("cannot create compute instance: {}", why(e))))?;
    }
    Ok(())
}

fn why(e: NvmlError) -> &'static str {
    match e {
        NvmlError::InvalidArgument => "placement is not valid for this profile",
        NvmlError::InsufficientResources => "overlaps another instance or exceeds the instance count",
        _ => "not possible",
    }
}

/// Splits a machine-file profile name into (GPU-instance profile, compute slices of the CI).
/// `3g.20gb` means the full-size CI; `1c.3g.20gb` a 1-slice CI inside a 3g.20gb GI.
pub fn parse_mig_profile(model: &GpuModel, name: &str) -> Result<(&'static GiProfile, u32), String> {
    if let Some(p) = model.gi_profile_by_name(name) {
        return Ok((p, p.slices));
    }
    if let Some((c, rest)) = name.split_once("c.")
        && let (Ok(k), Some(p)) = (c.parse::<u32>(), model.gi_profile_by_name(rest))
        && k < p.slices
        && ci_profiles(p).iter().any(|ci| ci.slices == k)
    {
        return Ok((p, k));
    }
    let names: Vec<&str> = model.gi_profiles.iter().map(|p| p.name).collect();
    Err(format!(
        "unknown MIG profile for {}; GPU-instance profiles are {} (compute-instance form: 1c.<gi profile>)",
        model.key,
        names.join(", ")
    ))
}

impl GpuState {
    /// Bitmask of occupied memory slices.
    fn memory_mask(&self, model: &GpuModel) -> u32 {
        self.gpu_instances
            .iter()
            .filter_map(|gi| {
                model
                    .gi_profile_by_id(gi.profile_id)
                    .map(|p| mask(gi.start, p.mem_size))
            })
            .fold(0, |a, b| a | b)
    }

    fn compute_used(&self, model: &GpuModel) -> u32 {
        self.gpu_instances
            .iter()
            .filter_map(|gi| model.gi_profile_by_id(gi.profile_id).map(|p| p.slices))
            .sum()
    }

    /// Whether a GI of `profile` could be created at `start` now.
    /// INVALID_ARGUMENT for a start not in the profile's placements; INSUFFICIENT_RESOURCES
    /// for the instance-count limit, an overlap, or no compute slices left.
    pub fn check_gi_placement(&self, model: &GpuModel, profile: &GiProfile, start: u32) -> NvmlResult<()> {
        if !profile.starts.contains(&start) {
            return Err(NvmlError::InvalidArgument);
        }
        let same = self.gpu_instances.iter().filter(|g| g.profile_id == profile.id).count();
        if same >= profile.instance_count as usize {
            return Err(NvmlError::InsufficientResources);
        }
        if self.memory_mask(model) & mask(start, profile.mem_size) != 0 {
            return Err(NvmlError::InsufficientResources);
        }
        if self.compute_used(model) + profile.slices > model.mig.compute_slices {
            return Err(NvmlError::InsufficientResources);
        }
        Ok(())
    }

    /// Creates a GPU instance; returns its position in `gpu_instances`.
    ///
    /// Without a placement the highest free valid start is used (real H100 put the first 1g
    /// at slice 6, not 0).
    pub fn create_gi(
        &mut self,
        model: &GpuModel,
        profile_id: u32,
        start: Option<u32>,
        serial: u64,
    ) -> NvmlResult<usize> {
        let profile = model.gi_profile_by_id(profile_id).ok_or(NvmlError::InvalidArgument)?;
        let start = match start {
            Some(s) => {
                self.check_gi_placement(model, profile, s)?;
                s
            }
            None => profile
                .starts
                .iter()
                .rev()
                .copied()
                .find(|&s| self.check_gi_placement(model, profile, s).is_ok())
                .ok_or(NvmlError::InsufficientResources)?,
        };
        let id = gi_id_for(start, profile.mem_size, model.mig.memory_slices);
        self.gpu_instances.push(GpuInstance {
            serial,
            id,
            profile_id,
            start,
            compute_instances: Vec::new(),
        });
        self.gpu_instances.sort_by_key(|g| g.id);
        Ok(self.gi_position(serial).unwrap_or(0))
    }

    /// How many more GIs of `profile` fit now.
    pub fn gi_remaining(&self, model: &GpuModel, profile: &GiProfile) -> u32 {
        let mut trial = self.clone();
        let mut n = 0;
        while trial.create_gi(model, profile.id, None, 0).is_ok() {
            n += 1;
        }
        n
    }

    /// Position of the GI with this serial.
    pub fn gi_position(&self, serial: u64) -> Option<usize> {
        self.gpu_instances.iter().position(|g| g.serial == serial)
    }

    /// Destroys a GI; IN_USE while it has compute instances.
    pub fn destroy_gi(&mut self, serial: u64) -> NvmlResult<()> {
        let at = self.gi_position(serial).ok_or(NvmlError::InvalidArgument)?;
        if !self.gpu_instances[at].compute_instances.is_empty() {
            return Err(NvmlError::InUse);
        }
        self.gpu_instances.remove(at);
        Ok(())
    }

    /// MIG device slot of each compute instance: (slot, GI position, CI position).
    ///
    /// A slot is the CI's first absolute compute slice (GI start + CI start), which is
    /// unique and below the model's slot count (7, or 4 on A30), so slots are sparse and stable.
    pub fn mig_slots(&self) -> Vec<(u32, usize, usize)> {
        let mut v = Vec::new();
        for (g, gi) in self.gpu_instances.iter().enumerate() {
            for (c, ci) in gi.compute_instances.iter().enumerate() {
                v.push((gi.start + ci.start, g, c));
            }
        }
        v.sort();
        v
    }
}

impl GpuInstance {
    fn ci_mask(&self, gi: &GiProfile) -> u32 {
        self.compute_instances
            .iter()
            .filter_map(|c| ci_profile_by_index(gi, c.profile_index).map(|p| mask(c.start, p.slices)))
            .fold(0, |a, b| a | b)
    }

    /// Whether a CI of profile index `index` could be created at `start`.
    pub fn check_ci_placement(&self, gi: &GiProfile, index: u32, start: u32) -> NvmlResult<()> {
        let p = ci_profile_by_index(gi, index).ok_or(NvmlError::InvalidArgument)?;
        if !p.starts.contains(&start) {
            return Err(NvmlError::InvalidArgument);
        }
        let same = self
            .compute_instances
            .iter()
            .filter(|c| c.profile_index == index)
            .count();
        if same >= p.instance_count as usize || self.ci_mask(gi) & mask(start, p.slices) != 0 {
            return Err(NvmlError::InsufficientResources);
        }
        Ok(())
    }

    /// Creates a compute instance (lowest free start without a placement); returns its
    /// position in `compute_instances`.
    pub fn create_ci(&mut self, gi: &GiProfile, index: u32, start: Option<u32>, serial: u64) -> NvmlResult<usize> {
        let p = ci_profile_by_index(gi, index).ok_or(NvmlError::InvalidArgument)?;
        let start = match start {
            Some(s) => {
                self.check_ci_placement(gi, index, s)?;
                s
            }
            None => p
                .starts
                .iter()
                .copied()
                .find(|&s| self.check_ci_placement(gi, index, s).is_ok())
                .ok_or(NvmlError::InsufficientResources)?,
        };
        self.compute_instances.push(ComputeInstance {
            serial,
            id: ci_id_for(gi, p.slices, start),
            profile_index: index,
            start,
        });
        self.compute_instances.sort_by_key(|c| c.id);
        Ok(self.ci_position(serial).unwrap_or(0))
    }

    /// How many more CIs of profile index `index` fit now.
    pub fn ci_remaining(&self, gi: &GiProfile, index: u32) -> u32 {
        let mut trial = self.clone();
        let mut n = 0;
        while trial.create_ci(gi, index, None, 0).is_ok() {
            n += 1;
        }
        n
    }

    /// Position of the CI with this serial.
    pub fn ci_position(&self, serial: u64) -> Option<usize> {
        self.compute_instances.iter().position(|c| c.serial == serial)
    }
}

fn mask(start: u32, size: u32) -> u32 {
    ((1u32 << size) - 1) << start
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model_by_key;

    fn a100() -> &'static GpuModel {
        model_by_key("A100-SXM4-40GB").unwrap()
    }

    fn empty() -> GpuState {
        GpuState {
            uuid: "GPU-x".into(),
            mig_current: true,
            mig_pending: true,
            gpu_instances: Vec::new(),
            compute_mode: 0,
        }
    }

    #[test]
    fn seven_1g_then_eighth_fails() {
        let mut g = empty();
        for s in 0..7 {
            g.create_gi(a100(), 19, None, s).unwrap();
        }
        let mut starts: Vec<u32> = g.gpu_instances.iter().map(|gi| gi.start).collect();
        starts.sort();
        assert_eq!(starts, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(g.create_gi(a100(), 19, None, 99), Err(NvmlError::InsufficientResources));
        let ids: Vec<u32> = g.gpu_instances.iter().map(|gi| gi.id).collect();
        assert_eq!(ids, vec![7, 8, 9, 10, 11, 12, 13]);
    }

    #[test]
    fn first_auto_placement_is_highest() {
        let mut g = empty();
        let at = g.create_gi(a100(), 19, None, 1).unwrap();
        assert_eq!(g.gpu_instances[at].start, 6);
        assert_eq!(g.gpu_instances[at].id, 13);
    }

    #[test]
    fn layouts_from_the_reference() {
        // 4g then 3g
        let mut g = empty();
        g.create_gi(a100(), 5, None, 1).unwrap();
        g.create_gi(a100(), 9, None, 2).unwrap();
        // 2g@2 + 3g@0 overlap
        let mut g = empty();
        g.create_gi(a100(), 14, Some(2), 1).unwrap();
        assert_eq!(
            g.create_gi(a100(), 9, Some(0), 2),
            Err(NvmlError::InsufficientResources)
        );
        // 4x 1g.10gb + 1g.5gb impossible
        let mut g = empty();
        for s in 0..4 {
            g.create_gi(a100(), 15, None, s).unwrap();
        }
        assert_eq!(g.gi_remaining(a100(), a100().gi_profile_by_id(19).unwrap()), 0);
        // 7g + anything; +me twice
        let mut g = empty();
        g.create_gi(a100(), 0, None, 1).unwrap();
        assert_eq!(g.create_gi(a100(), 19, None, 2), Err(NvmlError::InsufficientResources));
        let mut g = empty();
        g.create_gi(a100(), 20, None, 1).unwrap();
        assert_eq!(g.create_gi(a100(), 20, None, 2), Err(NvmlError::InsufficientResources));
        // bad placement
        assert_eq!(g.create_gi(a100(), 9, Some(2), 3), Err(NvmlError::InvalidArgument));
        assert_eq!(g.create_gi(a100(), 77, None, 3), Err(NvmlError::InvalidArgument));
    }

    #[test]
    fn remaining_capacity_counts_free_placements() {
        let mut g = empty();
        let p3 = a100().gi_profile_by_id(9).unwrap();
        assert_eq!(g.gi_remaining(a100(), p3), 2);
        g.create_gi(a100(), 14, Some(0), 1).unwrap();
        assert_eq!(g.gi_remaining(a100(), p3), 1);
        assert_eq!(g.gi_remaining(a100(), a100().gi_profile_by_id(19).unwrap()), 5);
    }

    #[test]
    fn compute_instances_and_slots() {
        let mut g = empty();
        let p3 = a100().gi_profile_by_id(9).unwrap();
        let at = g.create_gi(a100(), 9, Some(4), 1).unwrap();
        let gi = &mut g.gpu_instances[at];
        for s in 0..3 {
            gi.create_ci(p3, 0, None, 10 + s).unwrap();
        }
        assert_eq!(gi.create_ci(p3, 0, None, 20), Err(NvmlError::InsufficientResources));
        assert_eq!(gi.ci_remaining(p3, 2), 0);
        let ids: Vec<u32> = gi.compute_instances.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![2, 3, 4]);
        let slots: Vec<u32> = g.mig_slots().iter().map(|s| s.0).collect();
        assert_eq!(slots, vec![4, 5, 6]);
        assert_eq!(g.destroy_gi(1), Err(NvmlError::InUse));
    }

    #[test]
    fn profile_names_with_suffixes_parse() {
        let rtx = model_by_key("RTX-PRO-6000").unwrap();
        let parsed = |name: &str| parse_mig_profile(rtx, name).map(|(p, k)| (p.name, k));
        assert_eq!(parsed("1g.24gb+me.all"), Ok(("1g.24gb+me.all", 1)));
        assert_eq!(parsed("2g.48gb-me"), Ok(("2g.48gb-me", 2)));
        assert_eq!(parsed("4g.96gb+gfx"), Ok(("4g.96gb+gfx", 4)));
        assert_eq!(parsed("1c.2g.48gb+me.all"), Ok(("2g.48gb+me.all", 1)));
        assert_eq!(parsed("1c.2g.48gb-me"), Ok(("2g.48gb-me", 1)));
        assert_eq!(parsed("2c.4g.96gb+gfx"), Ok(("4g.96gb+gfx", 2)));
        // No 3-slice CI in a 4g GI, no CI smaller than a 1g GI, no 7g on a 4-slice part.
        for bad in [
            "3c.4g.96gb+gfx",
            "1c.1g.24gb+gfx",
            "7g.96gb",
            "1g.24gb+gfx.all",
            "1c.2g.48gb+",
        ] {
            assert!(parsed(bad).is_err(), "{bad}");
        }
        let h200 = model_by_key("H200-141GB").unwrap();
        assert_eq!(
            parse_mig_profile(h200, "3c.7g.141gb").map(|(p, k)| (p.name, k)),
            Ok(("7g.141gb", 3))
        );
    }

    #[test]
    fn example_machines_build() {
        let examples = [
            include_str!("../machines/dgx-a100.toml"),
            include_str!("../machines/h100-mig.toml"),
            include_str!("../machines/t4.toml"),
            include_str!("../machines/a100-mig-single.toml"),
        ];
        for text in examples {
            let m = Machine::parse(text).unwrap();
            let s = State::from_machine(&m).unwrap();
            s.check_against(&m).unwrap();
        }
    }

    #[test]
    fn machine_mig_devices_and_state_check() {
        let text = r#"
            driver_version = "550.54.15"
            cuda_driver_version = 12040
            [[gpu]]
            model = "A100-SXM4-40GB"
            mig_mode = true
            [[gpu.mig_device]]
            profile = "1c.3g.20gb"
            [[gpu.mig_device]]
            profile = "1c.3g.20gb"
            [[gpu.mig_device]]
            profile = "2g.10gb"
            placement = 4
        "#;
        let m = Machine::parse(text).unwrap();
        let s = State::from_machine(&m).unwrap();
        let gis = &s.gpus[0].gpu_instances;
        assert_eq!(gis.len(), 2);
        let g3 = gis.iter().find(|g| g.profile_id == 9).unwrap();
        assert_eq!((g3.start, g3.compute_instances.len()), (0, 2));
        s.check_against(&m).unwrap();
        let mut bad = s.clone();
        bad.gpus[0].gpu_instances[0].id = 12;
        assert!(bad.check_against(&m).is_err());

        let overlap = format!("{text}[[gpu.mig_device]]\nprofile = \"3g.20gb\"\nplacement = 4\n");
        let err = State::from_machine(&Machine::parse(&overlap).unwrap()).unwrap_err();
        assert!(err.contains("mig_device[3]"), "{err}");
        let unknown = text.replace("2g.10gb", "2g.20gb");
        let err = State::from_machine(&Machine::parse(&unknown).unwrap()).unwrap_err();
        assert!(err.contains("unknown MIG profile"), "{err}");
    }
}
