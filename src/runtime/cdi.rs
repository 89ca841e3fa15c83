//! The CDI spec for the node's GPUs: what `nvidia-ctk cdi generate --mode nvml` writes, built from
//! the agent's NVML inventory instead of a second NVML session, so that a CDI-aware runtime
//! (containerd with `enable_cdi`, CRI-O, docker with `features.cdi`) resolves every name the device
//! plugin hands out with the `cdi-cri` and `cdi-annotations` strategies.
//!
//! - [`discover`] looks at the driver's user-space files under the driver root. It only reads the
//!   filesystem (no commands), and what is missing is simply left out.
//! - [`spec`] is pure: inventory + device nodes + driver files in, [`Spec`] out. It builds the
//!   node's container edits ([`node_edits`], the model of [`crate::edits`]) and renders them
//!   ([`render_node`]); a DRA claim's spec is rendered from the same edits ([`claim_spec`]).
//! - [`to_json`] renders it; [`spec_file_name`] names the file (`nvidia.com-gpu.json`). Writing it
//!   under `/etc/cdi` or `/var/run/cdi` is the caller's job.
//!
//! Differences from `nvidia-ctk` (toolkit 1.17/1.18), all deliberate, are listed in README
//! ("Differences from `nvidia-ctk cdi generate`"). `golden.rs` checks them entry for entry against
//! the expected spec of NVIDIA's own generate test on its test driver root, among them:
//! - Each GPU is named by UUID as well as by index; a driver root without `libnvidia-ml` is an
//!   error ([`REQUIRED_LIBRARIES`]).
//! - With the toolkit's hook binary the hooks are `create-symlinks` and `update-ldcache` only:
//!   `enable-cuda-compat` and `disable-device-node-modification` need a recent
//!   `nvidia-cdi-hook`, and a hook subcommand the installed binary does not know fails every
//!   container start. The agent as hook ([`hook`]) runs all four.
//! - `create-symlinks` also recreates the host's soname links; every hook carries the same
//!   explicit `env` as NVIDIA's (`NVIDIA_CTK_DEBUG=false`), so no hook inherits the container's.
//! - No deprecated `chmod` hook for `/dev/nvidia-caps`.
//!
//! The opt-in injections (GDS, MOFED, GDRCopy, IMEX channels) get a spec per class, as NVIDIA's
//! device plugin writes them: `extra.rs` ([`extra_specs`]).
//!
//! The files: `driver_files.rs` ([`discover`] and the lists of what it looks for), `generate.rs`
//! ([`spec`], its options and what goes into every spec), `render.rs` (the model's edits in
//! CDI's format: the node's spec and a claim's), `model.rs` (the spec's types,
//! [`minimum_version`], [`to_json`], [`spec_file_name`]).

pub mod conflicts;
mod driver_files;
mod extra;
mod generate;
/// The hooks themselves: the `gpu-node-agent-cdi-hook` crate (statically linked program).
pub use cdi_hook as hook;
mod model;
mod render;

use std::path::PathBuf;

pub use driver_files::{
    BINARY_DIRS, CONFIG_DIRS, DEFAULT_HOOK_CANDIDATES, DRIVER_BINARIES, DRIVER_LIBRARIES, DriverFiles, FIRMWARE_DIR,
    GRAPHICS_CONFIGS, HookBinary, HookSearch, IPC_SOCKETS, LibraryLink, PCI_DEVICES, REQUIRED_LIBRARIES,
    XORG_MODULE_DIRS, discover, ld_so_conf_dirs, library_dirs,
};
pub use extra::{ExtraOptions, ExtraSpec, GDS_MOUNTS, extra_specs, gds_mounts};
pub use generate::{
    CdiOptions, DEFAULT_KIND, IPC_MOUNT_OPTIONS, LIBCUDA_DIR_ENV, MOUNT_OPTIONS, VISIBLE_DEVICES_VOID, node_edits, spec,
};
pub use model::{ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, minimum_version, spec_file_name, to_json};
pub use render::{ALL_DEVICE, claim_spec, render_node};

/// Why no spec could be generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiError {
    /// The kind is not `<vendor>/<class>`.
    #[error("CDI kind {kind:?} is not of the form <vendor>/<class>, e.g. \"nvidia.com/gpu\"")]
    InvalidKind { kind: String },
    /// The inventory has no GPU; a CDI spec must have at least one device, and every device at
    /// least one edit.
    #[error("no GPUs in the inventory: a CDI spec needs at least one device")]
    NoGpus,
    /// The driver's `mig-minors` table has no entry for a capability a MIG device needs (the same
    /// text as the device plugin's Allocate error).
    #[error("MIG device {device}: capability {key:?} not found in /proc/driver/nvidia-caps/mig-minors")]
    MissingMigCapability { device: String, key: String },
    /// `libcuda` or `libnvidia-ml` of the driver version was not found: a spec without them gives
    /// containers no CUDA (a wrong `device_plugin.driver_root`, or a driver whose user-space
    /// files are not installed).
    #[error(
        "the driver's {} not found in {} (device_plugin.driver_root): a CDI spec without them gives containers no CUDA",
        missing.join(" and "),
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    DriverLibrariesMissing {
        missing: Vec<String>,
        searched: Vec<PathBuf>,
    },
    /// A path that would go into the spec is not UTF-8; CDI specs are JSON text.
    #[error("path {} is not valid UTF-8 and cannot be written to a CDI spec", path.display())]
    NonUtf8Path { path: PathBuf },
    /// `[device_plugin.imex] required` and a listed IMEX channel's node does not exist (the
    /// same text as the device plugin's Allocate error).
    #[error("IMEX channel {path} does not exist and [device_plugin.imex] required = true")]
    ImexChannelMissing { path: String },
    /// serde_json refused the spec (it cannot for these types; kept so rendering never panics).
    #[error("cannot render the CDI spec as JSON: {message}")]
    Render { message: String },
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
