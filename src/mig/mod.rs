//! MIG layouts: the named layouts of the config (mig-parted compatible), the pure planner that
//! turns observed state + a layout into NVML operations per GPU, and the applier that performs
//! them through NVML.

pub mod apply;
pub mod defaults;
pub mod import;
pub mod layout;
pub mod planner;
pub mod stage;
pub mod state;
