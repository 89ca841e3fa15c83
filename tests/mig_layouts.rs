//! Every GPU-instance layout that fits an A100-SXM4-40GB and an H100 80GB HBM3, planned against
//! the profile tables the fake NVML reports, applied through NVML, read back equal, and
//! re-planned to zero operations. One test function: the fake library is process-wide.

mod common;

use std::collections::BTreeMap;

use gpu_node_agent::mig::planner::{DesiredGpu, PlanError, plan_gpu};
use gpu_node_agent::mig::state::ObservedGpu;

const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "A100-SXM4-40GB"
mig_mode = true

[[gpu]]
model = "H100-80GB-HBM3"
mig_mode = true
"#;

/// Every multiset of the GPU's instance profiles within their instance counts.
fn all_layouts(gpu: &ObservedGpu) -> Vec<BTreeMap<String, u32>> {
    let mut out = vec![BTreeMap::new()];
    for p in &gpu.profiles {
        let mut next = Vec::new();
        for layout in &out {
            for n in 0..=p.instance_count {
                let mut l = layout.clone();
                if n > 0 {
                    l.insert(p.name.clone(), n);
                }
                next.push(l);
            }
        }
        out = next;
    }
    out
}

#[test]
fn every_layout_that_fits_is_applied_on_the_fake_and_read_back_equal() {
    let node = common::Node::new(MACHINE, "");
    // SAFETY of set_var: this test binary has this one test, so no other thread reads the env.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let start = gpus.mig_observe().expect("observe");
    for index in 0..start.len() {
        let layouts = all_layouts(&start[index]);
        let (mut applied, mut refused) = (0, 0);
        for profiles in layouts {
            let observed = gpus.mig_observe().expect("observe");
            let gpu = &observed[index];
            let desired = DesiredGpu {
                mig_enabled: true,
                profiles: profiles.clone(),
            };
            let plan = match plan_gpu(gpu, &desired) {
                Ok(plan) => plan,
                Err(PlanError::DoesNotFit { .. }) => {
                    refused += 1;
                    continue;
                }
                Err(e) => panic!("GPU {index} {profiles:?}: {e}"),
            };
            gpus.mig_apply(&plan)
                .unwrap_or_else(|e| panic!("GPU {index} {profiles:?}: the fake refused the plan: {e}"));
            let after = gpus.mig_observe().expect("observe after");
            assert_eq!(
                common::gi_counts(&after[index]),
                profiles,
                "GPU {index}: read back equal"
            );
            let again = plan_gpu(&after[index], &desired).expect("re-plan");
            assert!(
                again.ops.is_empty(),
                "GPU {index} {profiles:?}: re-applying must do nothing: {:?}",
                again.ops
            );
            applied += 1;
        }
        // The real tables give 128 layouts that fit on both models (with the empty one).
        assert_eq!(applied, 128, "GPU {index}: layouts applied");
        assert!(refused > 0);
    }
}
