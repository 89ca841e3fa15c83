//! The MIG stage: the pure planner that turns observed state + a layout into NVML operations per
//! GPU, the applier that performs them through NVML, and the import of mig-parted files. The
//! layouts themselves (the config's `[mig.layouts]`, the built-in ones) are the leaf
//! [`crate::mig_layout`], below the config.

pub mod apply;
pub mod clients;
pub mod import;
pub mod planner;
pub mod stage;
pub mod state;
