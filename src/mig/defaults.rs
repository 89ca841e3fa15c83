//! The built-in MIG layouts moved to the leaf [`crate::mig_layout::defaults`], below the config
//! that uses them. This re-export keeps `config/mod.rs` compiling until it imports from
//! `crate::mig_layout::defaults` (issue 14); delete this file then.

pub use crate::mig_layout::defaults::default_layouts;
