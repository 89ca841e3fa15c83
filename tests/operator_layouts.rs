//! The GPU Operator's default MIG layout names on every MIG model the fake implements: each name
//! of the Operator's own file (`tests/fixtures/mig/gpu-operator-default-mig-parted-config.yaml`,
//! its ConfigMap as published, imported with `mig import`'s code) is generated from each GPU's
//! own NVML profile table ([`defaults::layout`]) and must give every GPU what the file gives
//! it, applied through NVML, read back equal, and re-planned to zero operations. A GPU the
//! file's entry does not fit (its profile is not on the GPU) is left as it is; a name that
//! fits no GPU of the node fails naming what they have. One test function: the fake library
//! is process-wide.

mod common;

use gpu_node_agent::mig::import::import_mig_parted;
use gpu_node_agent::mig::stage::plan_layout;
use gpu_node_agent::mig_layout::defaults;

/// One GPU of every MIG model the fake knows.
const MODELS: [&str; 11] = [
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-80GB-HBM3",
    "A30-24GB",
    "A100-PCIE-80GB",
    "H100-NVL",
    "H200-141GB",
    "GH200-144GB",
    "H100-96GB",
    "B200",
    "RTX-PRO-6000",
];

const OPERATOR_FILE: &str = include_str!("fixtures/mig/gpu-operator-default-mig-parted-config.yaml");

#[test]
fn every_operator_name_is_generated_with_the_operators_counts_and_applies() {
    let mut machine = String::from("driver_version = \"550.54.15\"\ncuda_driver_version = 12040\n");
    for (i, model) in MODELS.iter().enumerate() {
        machine.push_str(&format!(
            "\n[[gpu]]\nmodel = \"{model}\"\nuuid = \"{}\"\nmig_mode = true\n",
            common::gpu_uuid(i as u32)
        ));
    }
    let node = common::Node::new(&machine, "");
    // SAFETY of set_var: this test binary has this one test, so no other thread reads the env.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let table = import_mig_parted(OPERATOR_FILE).expect("the Operator's file imports");
    assert_eq!(table.len(), 68, "names in the Operator's file");
    let (mut checked, mut absent, mut others) = (0, Vec::new(), Vec::new());
    let mut per_model: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for (name, operators) in &table {
        let layout = defaults::layout(name).unwrap_or_else(|| panic!("{name}: not generated"));
        let before = gpus.mig_observe().expect("observe");
        if !before
            .iter()
            .any(|g| operators.entry_for(g.index, g.pci_ids()).is_some_and(|e| fits(e, g)))
        {
            // Only for models the fake does not implement (GB200): the name means nothing on
            // this node, and says so.
            let err = plan_layout(&before, &layout).expect_err(name).to_string();
            assert!(err.starts_with("no GPU of this node has"), "{name}: {err}");
            others.push(name.clone());
            continue;
        }
        let plans = plan_layout(&before, &layout).unwrap_or_else(|e| panic!("{name}: {e}"));
        for plan in &plans {
            gpus.mig_apply(plan)
                .unwrap_or_else(|e| panic!("{name}: the fake refused the plan for {}: {e}", plan.uuid));
        }
        let after = gpus.mig_observe().expect("observe after");
        for gpu in &after {
            let Some(entry) = operators.entry_for(gpu.index, gpu.pci_ids()) else {
                continue;
            };
            let planned = plans.iter().any(|p| p.uuid == gpu.uuid);
            if !fits(entry, gpu) {
                // The file's `devices: all` entries name one model's profile: on another model
                // mig-manager's generated layout has no entry for the GPU, and it is left as
                // it is (so is A100-PCIE-80GB for 1g.20gb: its listing predates the profile).
                assert!(!planned, "{name}: GPU {} lacks a profile but was planned", gpu.index);
                if MODELS[gpu.index as usize] == "A100-PCIE-80GB" && name == "all-1g.20gb" {
                    absent.push(format!("{name} on GPU {}", gpu.index));
                }
                continue;
            }
            assert!(
                entry.mig_enabled == gpu.mode.is_some_and(|m| m.current),
                "{name}: GPU {} mode",
                gpu.index
            );
            assert_eq!(
                common::gi_counts(gpu),
                entry.profiles,
                "{name}: GPU {} ({:#06x})",
                gpu.index,
                gpu.pci_device_id
            );
            checked += 1;
            per_model
                .entry(MODELS[gpu.index as usize])
                .or_default()
                .push(name.clone());
        }
        let again = plan_layout(&after, &layout).expect("re-plan");
        assert!(
            again.iter().all(|p| p.ops.is_empty()),
            "{name}: re-applying must do nothing: {again:?}"
        );
    }
    // Each GPU gets the names the Operator's file gives its model: its profiles' names,
    // all-balanced, all-disabled and all-enabled. A100-40GB also gets all-1g.10gb (4 of its
    // double-memory 1g); A100-PCIE-80GB lacks all-1g.20gb (its listing predates the profile);
    // the A30 has 5 profiles; the RTX PRO 6000 adds its +gfx, -me and +me.all forms.
    let counts: Vec<(&str, usize)> = per_model.iter().map(|(m, n)| (*m, n.len())).collect();
    assert_eq!(
        counts,
        [
            ("A100-PCIE-80GB", 9),
            ("A100-SXM4-40GB", 10),
            ("A100-SXM4-80GB", 10),
            ("A30-24GB", 8),
            ("B200", 10),
            ("GH200-144GB", 10),
            ("H100-80GB-HBM3", 10),
            ("H100-96GB", 10),
            ("H100-NVL", 10),
            ("H200-141GB", 10),
            ("RTX-PRO-6000", 14),
        ],
        "{per_model:#?}"
    );
    assert_eq!(checked, 111);
    assert_eq!(absent, ["all-1g.20gb on GPU 4"]);
    // The GB200-only names (1g.47gb … 7g.189gb): no fake GB200.
    assert_eq!(
        others,
        [
            "all-1g.47gb",
            "all-2g.47gb",
            "all-3g.93gb",
            "all-3g.95gb",
            "all-4g.93gb",
            "all-4g.95gb",
            "all-7g.186gb",
            "all-7g.189gb"
        ],
        "names no GPU of the fake has"
    );
    eprintln!("{checked} (name, GPU) pairs as the Operator's file lists; not on the fake's tables: {absent:?}");
}

/// Whether the Operator's entry can be applied to the GPU: every profile it names is one the
/// GPU's NVML lists (mig-parted would fail the GPU otherwise; the generator leaves it out).
fn fits(entry: &gpu_node_agent::mig_layout::LayoutEntry, gpu: &gpu_node_agent::mig::state::ObservedGpu) -> bool {
    gpu.mode.is_some() && entry.profiles.keys().all(|p| gpu.profiles.iter().any(|g| &g.name == p))
}
