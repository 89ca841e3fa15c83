//! The MIG observe/apply layer against the fake NVML library, in process: NVML's profile tables
//! and placements are read as the hardware reports them, and every mutation obeys its rules.
//! One test function: the fake library is a process-wide singleton.

mod common;

use gpu_node_agent::mig::state::{GiRef, GpuPlan, MigOp, Placement};

const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000000-1111-2222-3333-444455556666"
mig_mode = true

[[gpu.mig_device]]
profile = "3g.20gb"
placement = 4

[[gpu]]
model = "T4"
uuid = "GPU-00000001-1111-2222-3333-444455556666"
"#;

fn plan(ops: Vec<MigOp>) -> GpuPlan {
    GpuPlan {
        index: 0,
        uuid: "GPU-00000000-1111-2222-3333-444455556666".into(),
        ops,
    }
}

#[test]
fn observe_and_apply_follow_nvmls_tables_and_rules() {
    let node = common::Node::new(MACHINE, "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: this test binary has this one test, so no other thread reads the env.
    let gpus = unsafe { common::open_fake_nvml(&node) };

    let observed = gpus.mig_observe().expect("observe");
    assert_eq!(observed.len(), 2);
    let a100 = &observed[0];
    assert_eq!(a100.pci_device_id, 0x20b0);
    assert!(a100.mode.is_some_and(|m| m.current && m.pending));
    let names: Vec<&str> = a100.profiles.iter().map(|p| p.name.as_str()).collect();
    for name in [
        "1g.5gb",
        "1g.5gb+me",
        "1g.10gb",
        "2g.10gb",
        "3g.20gb",
        "4g.20gb",
        "7g.40gb",
    ] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    let p1g = a100.profiles.iter().find(|p| p.name == "1g.5gb").expect("1g.5gb");
    assert_eq!(
        (p1g.id, p1g.index, p1g.instance_count, p1g.placements.len()),
        (19, 0, 7, 7)
    );
    let p3g = a100.profiles.iter().find(|p| p.name == "3g.20gb").expect("3g.20gb");
    assert_eq!(
        p3g.placements,
        vec![Placement { start: 0, size: 4 }, Placement { start: 4, size: 4 }]
    );
    assert!(
        !p3g.ci_profiles.is_empty(),
        "compute instance profiles read from the existing 3g instance"
    );
    assert_eq!(a100.gpu_instances.len(), 1);
    let gi = &a100.gpu_instances[0];
    assert_eq!((gi.profile_id, gi.placement), (9, Placement { start: 4, size: 4 }));
    assert_eq!(gi.compute_instances.len(), 1);
    let t4 = &observed[1];
    assert!(t4.mode.is_none() && t4.profiles.is_empty());

    // Destroy what exists, then build 4g@0 + 3g@4 with explicit placements.
    let ci = gi.compute_instances[0].id;
    let ops = vec![
        MigOp::DestroyCi {
            gi_id: gi.id,
            ci_id: ci,
        },
        MigOp::DestroyGi { gi_id: gi.id },
        MigOp::CreateGi {
            profile_id: 5,
            placement: Placement { start: 0, size: 4 },
            name: "4g.20gb".into(),
        },
        MigOp::CreateGi {
            profile_id: 9,
            placement: Placement { start: 4, size: 4 },
            name: "3g.20gb".into(),
        },
        MigOp::CreateCi {
            gi: GiRef::New(0),
            profile_id: 0,
            placement: Placement { start: 0, size: 4 },
            name: "4g.20gb".into(),
        },
        MigOp::CreateCi {
            gi: GiRef::New(1),
            profile_id: 0,
            placement: Placement { start: 0, size: 3 },
            name: "3g.20gb".into(),
        },
    ];
    let applied = gpus.mig_apply(&plan(ops)).expect("apply");
    assert_eq!(applied.mutations, 6);
    assert!(!applied.mode_pending);
    let after = gpus.mig_observe().expect("observe again");
    let layout: Vec<(u32, Placement, usize)> = after[0]
        .gpu_instances
        .iter()
        .map(|g| (g.profile_id, g.placement, g.compute_instances.len()))
        .collect();
    assert_eq!(
        layout,
        vec![
            (5, Placement { start: 0, size: 4 }, 1),
            (9, Placement { start: 4, size: 4 }, 1)
        ]
    );

    // Overlap is refused by the hardware rules, naming the GPU and the operation.
    let overlap = vec![MigOp::CreateGi {
        profile_id: 14,
        placement: Placement { start: 2, size: 2 },
        name: "2g.10gb".into(),
    }];
    let err = gpus.mig_apply(&plan(overlap)).expect_err("overlap");
    let text = err.to_string();
    assert!(
        text.contains("GPU 0") && text.contains("create 2g.10gb GPU instance at 2:2"),
        "{text}"
    );

    // A GPU instance with compute instances cannot be destroyed: IN_USE.
    let gi4 = after[0].gpu_instances[0].id;
    let err = gpus
        .mig_apply(&plan(vec![MigOp::DestroyGi { gi_id: gi4 }]))
        .expect_err("in use");
    assert!(err.in_use(), "{err}");
}
