//! Layouts over several GPUs: which GPUs a layout changes and the plans it gives
//! ([`plan_layout`], [`gpus_to_change`]), on the hardware tables of `planner`'s tests.

use super::*;
use crate::mig::planner::tests::{a100_40gb, p, unread};
use crate::mig::state::ObservedGi;
use crate::mig_layout::{DeviceSelector, LayoutEntry, MigLayout};
use crate::nvml::MigState;

/// One layout entry: devices, MIG enabled, profiles.
type Entry<'a> = (DeviceSelector, bool, &'a [(&'a str, u32)]);

fn layout(entries: &[Entry]) -> MigLayout {
    MigLayout::new(
        entries
            .iter()
            .map(|(devices, mig_enabled, profiles)| LayoutEntry {
                devices: devices.clone(),
                device_filter: Vec::new(),
                mig_enabled: *mig_enabled,
                profiles: profiles.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
                generated: None,
            })
            .collect(),
    )
}

fn node(gpus: Vec<ObservedGpu>) -> Vec<ObservedGpu> {
    gpus.into_iter()
        .enumerate()
        .map(|(i, mut g)| {
            g.index = i as u32;
            g.uuid = format!("GPU-{i}");
            g
        })
        .collect()
}

fn t4() -> ObservedGpu {
    ObservedGpu {
        index: 0,
        uuid: "GPU-t4".into(),
        pci_device_id: 0x1eb8,
        pci_subsystem_id: 0x12A2_10DE,
        mode: None,
        profiles: Vec::new(),
        gpu_instances: Vec::new(),
    }
}

#[test]
fn errors_on_any_gpu_win_over_unread_compute_instance_profiles() {
    use DeviceSelector::Indices;
    let gpus = node(vec![unread(a100_40gb()), unread(a100_40gb())]);
    let fine: &[(&str, u32)] = &[("1c.4g.20gb", 1)];
    let unknown: &[(&str, u32)] = &[("2g.20gb", 1)];
    let too_many: &[(&str, u32)] = &[("1g.5gb", 8)];
    for (first, second) in [(fine, unknown), (unknown, fine), (fine, too_many), (too_many, fine)] {
        let l = layout(&[(Indices(vec![0]), true, first), (Indices(vec![1]), true, second)]);
        let err = plan_layout(&gpus, &l).unwrap_err();
        assert!(
            matches!(err, PlanError::UnknownProfile { .. } | PlanError::DoesNotFit { .. }),
            "{err:?}"
        );
        assert_eq!(gpus_to_change(&gpus, &l).unwrap_err(), err);
    }
    let l = layout(&[(DeviceSelector::All, true, fine)]);
    assert!(matches!(
        plan_layout(&gpus, &l),
        Err(PlanError::CiProfilesUnknown { index: 0, .. })
    ));
    assert_eq!(gpus_to_change(&gpus, &l).unwrap(), ["GPU-0", "GPU-1"]);
}

#[test]
fn a_mig_gpu_no_entry_covers_is_left_alone_or_an_error_when_strict() {
    use crate::mig_layout::Uncovered;
    use DeviceSelector::Indices;
    let gpus = node(vec![a100_40gb(), a100_40gb(), t4()]);
    let mut l = layout(&[(Indices(vec![0]), true, &[("1g.5gb", 7)])]);
    // By default GPU 1 is left as it is.
    let plans = plan_layout(&gpus, &l).unwrap();
    assert_eq!(plans.iter().map(|p| p.index).collect::<Vec<_>>(), [0]);
    l.uncovered = Uncovered::Fail;
    let err = plan_layout(&gpus, &l).unwrap_err();
    assert_eq!(
        err,
        PlanError::NotCovered {
            index: 1,
            uuid: "GPU-1".into(),
            model: None,
            pci_device_id: 0x20b0,
        }
    );
    assert!(
        err.to_string().starts_with("no entry for GPU 1 (GPU-1, device 0x20B0)"),
        "{err}"
    );
    assert_eq!(gpus_to_change(&gpus, &l).unwrap_err(), err);
    // Covered by a device filter for another model: not covered either.
    let mut l = layout(&[(DeviceSelector::All, true, &[])]);
    l.uncovered = Uncovered::Fail;
    l.entries[0].device_filter = vec![0x2330.into()];
    assert!(matches!(
        plan_layout(&gpus, &l),
        Err(PlanError::NotCovered { index: 0, .. })
    ));
    // The GPU without MIG needs no entry.
    let l = layout(&[(Indices(vec![0, 1]), true, &[("1g.5gb", 7)])]);
    let plans = plan_layout(&gpus, &l).unwrap();
    assert_eq!(plans.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(gpus_to_change(&gpus, &l).unwrap(), ["GPU-0", "GPU-1"]);
}

#[test]
fn a_gpu_without_mig_is_skipped_under_devices_all_or_mig_disabled() {
    use DeviceSelector::{All, Indices};
    let gpus = node(vec![a100_40gb(), t4()]);
    for l in [
        layout(&[(All, true, &[])]),
        layout(&[(All, true, &[("1g.5gb", 7)])]),
        layout(&[(Indices(vec![0]), true, &[]), (Indices(vec![1]), false, &[])]),
        layout(&[(All, false, &[])]),
    ] {
        let plans = plan_layout(&gpus, &l).unwrap();
        assert!(plans.iter().all(|p| p.index == 0), "{plans:?}");
        assert_eq!(
            gpus_to_change(&gpus, &l).unwrap().len(),
            usize::from(l.entries[0].mig_enabled)
        );
    }
    // Named explicitly with MIG on: an error naming it.
    for l in [
        layout(&[(Indices(vec![0, 1]), true, &[])]),
        layout(&[(All, true, &[]), (Indices(vec![1]), true, &[])]),
    ] {
        let err = plan_layout(&gpus, &l).unwrap_err();
        assert_eq!(
            err,
            PlanError::NotMigCapable {
                gpu: "1 (GPU-1)".into()
            }
        );
        assert_eq!(gpus_to_change(&gpus, &l).unwrap_err(), err);
    }
}

/// A GPU whose driver lists no GPU instance profiles while MIG mode is off (R535 class).
fn profiles_hidden(mut model: ObservedGpu) -> ObservedGpu {
    model.profiles.clear();
    model
}

#[test]
fn gpus_listing_no_profiles_with_mig_off_are_read_only_when_the_layout_needs_them() {
    use crate::mig::stage::{changes_mode, reads_first};
    use crate::mig_layout::defaults;
    let gpus = node(vec![profiles_hidden(a100_40gb())]);
    let hidden = |l: &MigLayout| {
        matches!(
            plan_layout(&gpus, l),
            Err(PlanError::GiProfilesUnknown { index: 0, .. })
        )
    };
    // MIG devices wanted (a user layout, or a built-in one the Operator's table gives the
    // model): read first, by enabling MIG mode, which counts as a change of GPU and mode.
    let user = layout(&[(DeviceSelector::All, true, &[("1g.5gb", 7)])]);
    let built_in = defaults::layout("all-1g.10gb").expect("built in");
    for l in [&user, &built_in] {
        assert!(hidden(l));
        assert_eq!(gpus_to_change(&gpus, l).unwrap(), ["GPU-0"]);
        assert!(changes_mode(&gpus, l).unwrap());
        let lines = reads_first(&gpus, l).unwrap();
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].contains("applying enables MIG mode on GPU 0 to read them"),
            "{lines:?}"
        );
    }
    // No MIG devices wanted: nothing to read.
    let off = plan_layout(&gpus, &defaults::layout("all-disabled").expect("built in")).unwrap();
    assert!(off[0].ops.is_empty());
    let on = plan_layout(&gpus, &layout(&[(DeviceSelector::All, true, &[])])).unwrap();
    assert_eq!(on[0].ops, [MigOp::SetMode { enabled: true }]);
    // The Operator's table says the model has no 1g.20gb: not covered, nothing read.
    let none = defaults::layout("all-1g.20gb").expect("built in");
    assert!(matches!(
        plan_layout(&gpus, &none),
        Err(PlanError::NoGpuHasProfile { .. })
    ));
    // A model the table does not know: only reading can tell.
    let mut unknown_model = profiles_hidden(a100_40gb());
    unknown_model.pci_device_id = 0x1234;
    let gpus = node(vec![unknown_model]);
    assert!(matches!(
        plan_layout(&gpus, &none),
        Err(PlanError::GiProfilesUnknown { .. })
    ));
    // Once MIG mode is on, an empty listing is what the GPU has: nothing more to read.
    let mut on_but_empty = profiles_hidden(a100_40gb());
    on_but_empty.mode = Some(MigState {
        current: true,
        pending: true,
    });
    let gpus = node(vec![on_but_empty]);
    assert!(matches!(
        plan_layout(&gpus, &user),
        Err(PlanError::UnknownProfile { .. })
    ));
}

#[test]
fn reading_compute_instance_profiles_on_a_full_gpu_says_its_instances_are_destroyed_first() {
    use crate::mig::stage::reads_first;
    let mut full = unread(a100_40gb());
    full.mode = Some(MigState {
        current: true,
        pending: true,
    });
    full.gpu_instances.push(ObservedGi {
        id: 0,
        profile_id: 0,
        placement: p(0, 8),
        compute_instances: Vec::new(),
    });
    let seven_g = full.profiles.iter().find(|g| g.name == "7g.40gb").map(|g| g.id);
    full.gpu_instances[0].profile_id = seven_g.expect("7g.40gb");
    let l = layout(&[(DeviceSelector::All, true, &[("1c.4g.20gb", 1)])]);
    let mut with_room = full.clone();
    let gpus = node(vec![full]);
    let lines = reads_first(&gpus, &l).unwrap();
    assert!(
        lines.len() == 1 && lines[0].contains("no room for one: its 1 GPU instance(s) are destroyed first"),
        "{lines:?}"
    );
    // A 1g.5gb in the last slice leaves room for a 4g.20gb at slice 0.
    with_room.gpu_instances[0].profile_id = with_room.profiles.iter().find(|g| g.name == "1g.5gb").expect("1g").id;
    with_room.gpu_instances[0].placement = p(6, 1);
    let gpus = node(vec![with_room]);
    let lines = reads_first(&gpus, &l).unwrap();
    assert!(
        lines.len() == 1 && lines[0].ends_with("from a short-lived 4g.20gb GPU instance on GPU 0"),
        "{lines:?}"
    );
}
