//! Profiles a driver of the R535 class hides while MIG is off are read once per NVML session:
//! a GPU the layout turns out not to cover, once its profiles were read by enabling MIG, is not
//! switched on and off again by every later converge of the daemon. In process, one test
//! function: the fake library is a process-wide singleton.

mod common;

use gpu_node_agent::mig::stage::{Step, converge};
use gpu_node_agent::mig_layout::defaults;

#[test]
fn hidden_profiles_are_read_once_per_session() {
    // GPU 0: an A100-PCIE-80GB, whose profile table has no 1g.20gb, so all-1g.20gb does not
    // cover it once its profiles are known; GPU 1: an H100, which it covers.
    let machine = format!(
        "profiles_need_mig = true\n{}\n[[gpu]]\nmodel = \"A100-PCIE-80GB\"\nuuid = \"{}\"\n\
         [[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\n",
        common::DGX_A100,
        common::gpu_uuid(0),
        common::gpu_uuid(1)
    );
    let node = common::Node::new(&machine, "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: this test binary has this one test, so no other thread reads the env.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let name = "all-1g.20gb";
    let layout = defaults::layout(name).expect("built in");
    let first = converge(&gpus, name, &layout, None, None, None);
    assert!(matches!(first, Step::Applied { .. }), "{first:?}");
    let observed = gpus.mig_observe().expect("observe");
    assert!(
        observed[0].mode.is_some_and(|m| !m.current),
        "GPU 0 is left with MIG off"
    );
    assert_eq!(common::gi_counts(&observed[1]).get("1g.20gb"), Some(&4));
    // GPU 0 lists no profiles again (MIG is off), but they are known: nothing to do.
    let again = converge(&gpus, name, &layout, None, None, None);
    assert_eq!(again, Step::Converged);
}
