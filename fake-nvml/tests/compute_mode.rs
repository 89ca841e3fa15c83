//! Compute mode: set through NVML, read back, kept in the state file for the next process, and
//! the removed EXCLUSIVE_THREAD refused.

mod common;

use common::*;
use nvml_wrapper::enum_wrappers::device::ComputeMode;
use nvml_wrapper::error::NvmlError;

#[test]
fn compute_mode_is_set_read_and_kept() {
    let fake = Fake::new(&example("t4.toml"));
    {
        let nvml = fake.init();
        let mut d = nvml.device_by_index(0).unwrap();
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::Default);
        d.set_compute_mode(ComputeMode::ExclusiveProcess).unwrap();
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);
        assert!(matches!(
            d.set_compute_mode(ComputeMode::ExclusiveThread),
            Err(NvmlError::InvalidArg)
        ));
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);
    }
    let state = std::fs::read_to_string(fake.state.join("state.json")).unwrap();
    assert!(state.contains("\"compute_mode\": 3"), "{state}");

    // The next init (another process, as far as the fake knows) sees it.
    let nvml = fake.init();
    let mut d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);
    d.set_compute_mode(ComputeMode::Default).unwrap();
    drop(nvml);
    let state = std::fs::read_to_string(fake.state.join("state.json")).unwrap();
    assert!(!state.contains("compute_mode"), "DEFAULT is left out: {state}");
}
