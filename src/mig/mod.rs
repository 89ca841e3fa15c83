//! The MIG stage: the pure planner that turns observed state + a layout into NVML operations per
//! GPU, the applier that performs them through NVML, and the import of mig-parted files. The
//! layouts themselves (the config's `[mig.layouts]`, the built-in ones) are the leaf
//! [`crate::mig_layout`], below the config.

pub mod apply;
// Compatibility re-export of [`crate::mig_layout::defaults`] (issue 14: goes when
// `config/mod.rs` imports from there).
pub mod defaults;
pub mod import;
// Compatibility re-exports of [`crate::mig_layout`] (issue 14: goes when `config/mod.rs` and
// `mig/stage.rs` import from there).
pub mod layout;
pub mod planner;
pub mod stage;
pub mod state;
