//! The NVIDIA kernel driver for the running kernel: observe the host, plan (pure), install
//! (distribution packages, an NVIDIA `.run` built with kbuild, or prebuilt modules), cache built
//! modules per kernel, load them with their parameters, upgrade under no GPU work, validate.
//!
//! Every program runs through [`crate::host::command`]; every host path goes through the root
//! prefix.

pub mod build;
pub mod cache;
pub mod fetch;
pub mod observe;
pub mod plan;
pub mod stage;
pub mod validate;

/// Which kernel modules of the driver: NVIDIA's open modules or the proprietary ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    Open,
    Proprietary,
}

impl Flavour {
    pub fn as_str(self) -> &'static str {
        match self {
            Flavour::Open => "open",
            Flavour::Proprietary => "proprietary",
        }
    }
}

/// The driver's kernel modules in load order; unloading goes the other way (with `nvidia_drm`
/// first when a host install loaded it).
pub const MODULES: [&str; 3] = ["nvidia", "nvidia-uvm", "nvidia-modeset"];
