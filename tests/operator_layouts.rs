//! The GPU Operator's default MIG layout names on every MIG model the fake implements: each name
//! the Operator's file gives a model is generated from the GPU's own NVML profile table
//! ([`defaults::layout`]) with the counts the Operator's file lists for that model, applied
//! through NVML, read back equal, and re-planned to zero operations. One test function: the
//! fake library is process-wide.

mod common;

use gpu_node_agent::mig::stage::plan_layout;
use gpu_node_agent::mig_layout::defaults::{self, default_layouts};
use gpu_node_agent::nvml::Gpus;

/// One GPU of every MIG model the fake knows.
const MODELS: [&str; 6] = [
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-80GB-HBM3",
    "A30-24GB",
    "A100-PCIE-80GB",
    "H100-NVL",
];

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
    unsafe {
        std::env::set_var("FAKE_NVML_MACHINE", &node.machine);
        std::env::set_var("FAKE_NVML_STATE_DIR", &node.state);
    }
    let gpus = Gpus::open(&common::fake_nvml_library()).expect("fake NVML");
    let table = default_layouts();
    let (mut checked, mut absent, mut others) = (0, Vec::new(), 0);
    for (name, operators) in &table {
        let layout = defaults::layout(name).unwrap_or_else(|| panic!("{name}: not generated"));
        let before = gpus.mig_observe().expect("observe");
        if !before
            .iter()
            .any(|g| operators.entry_for(g.index, g.pci_ids()).is_some())
        {
            // Only for models the fake does not implement (H200, Blackwell): the name means
            // nothing on this node, and says so.
            let err = plan_layout(&before, &layout).expect_err(name).to_string();
            assert!(err.starts_with("no GPU of this node has"), "{name}: {err}");
            others += 1;
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
            let has_all = entry.profiles.keys().all(|p| gpu.profiles.iter().any(|g| &g.name == p));
            if !has_all {
                // The fake's table for this model comes from a driver without that profile
                // (A100-PCIE-80GB's listing predates 1g.20gb): the GPU is left as it is.
                assert!(!planned, "{name}: GPU {} lacks a profile but was planned", gpu.index);
                absent.push(format!("{name} on GPU {}", gpu.index));
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
        }
        let again = plan_layout(&after, &layout).expect("re-plan");
        assert!(
            again.iter().all(|p| p.ops.is_empty()),
            "{name}: re-applying must do nothing: {again:?}"
        );
    }
    // 6 GPUs × the names the Operator's file gives each model: A100-40GB 7 + balanced, the
    // three 80 GB parts 7 + balanced each (A100-PCIE-80GB's listing lacks 1g.20gb), A30 5 +
    // balanced, H100 NVL 7 + balanced; plus all-disabled and all-enabled on every GPU.
    assert_eq!(checked, 57, "(name, GPU) pairs checked; absent: {absent:?}");
    assert_eq!(absent, ["all-1g.20gb on GPU 4"]);
    assert!(
        others < table.len() / 2,
        "{others} names only for models the fake lacks"
    );
    eprintln!("{checked} (name, GPU) pairs as the Operator's file lists; not on the fake's tables: {absent:?}");
}
