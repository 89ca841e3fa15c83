//! The MIG layout types moved to the leaf [`crate::mig_layout`], below the config that parses
//! them. These re-exports keep `config/mod.rs` and `mig/stage.rs` compiling until they import
//! from `crate::mig_layout` (issue 14); delete this file then.

pub use crate::mig_layout::{DeviceSelector, EntryField, Item, LayoutEntry, LayoutError, MigLayout};
