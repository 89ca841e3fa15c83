//! The CDI specs of the opt-in injections (`gds`, `mofed`, `gdrcopy`, `imex-channel`), one per
//! class as NVIDIA's device plugin writes them (`/var/run/cdi/<vendor>-<class>.json`), rendered
//! from the injections' edits ([`crate::edits::injections`], the same Allocate hands out) and
//! the device nodes the host has (pure). What each holds is what the NVIDIA Container
//! Toolkit's `nvcdi` modes of the same names generate:
//! - `gds`: device `all` with every `/dev/nvidia-fs*` and, when present, read-only mounts of
//!   `/etc/cufile.json` and `/run/udev` from the driver root (`discover.NewGDSDiscoverer`);
//! - `mofed`: device `all` with `/dev/infiniband/uverbs*` and `/dev/infiniband/rdma_cm`;
//! - `gdrcopy`: device `all` with `/dev/gdrdrv`;
//! - `imex-channel`: device `<N>` per configured channel with
//!   `/dev/nvidia-caps-imex-channels/channel<N>`.
//!
//! A class that is off, or whose nodes the host lacks, gets no spec ([`ExtraSpec::spec`] is
//! `None`, and the caller removes a file left from before): NVIDIA drops an empty spec the same
//! way, and the device plugin then does not hand out its name.

use std::path::{Path, PathBuf};

use super::model::{ContainerEdits, Device, Mount, Spec};
use super::render::{device_node, finish};
use super::{CdiError, MOUNT_OPTIONS};
use crate::edits::injections::{ALL_DEVICE, FLAG_CLASSES, IMEX_CLASS};
use crate::edits::{ExtraNodes, Injections};
use crate::host::rooted;

/// Files the `gds` device mounts when the driver root has them.
pub const GDS_MOUNTS: [&str; 2] = ["/etc/cufile.json", "/run/udev"];

/// What the injection specs are built from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraOptions {
    /// The vendor of `[device_plugin] cdi_kind`.
    pub vendor: String,
    /// What is enabled.
    pub injections: Injections,
    /// Host root of `/dev` (the device plugin's `dev_root`).
    pub dev_root: PathBuf,
    /// Host paths of the [`GDS_MOUNTS`] that exist under the driver root.
    pub gds_mounts: Vec<PathBuf>,
    /// The driver root (host path), stripped from `gds_mounts` for the container path.
    pub driver_root: PathBuf,
}

/// One class's spec: `None` when nothing is to be written for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraSpec {
    /// `<vendor>/<class>`.
    pub kind: String,
    pub spec: Option<Spec>,
}

/// The specs of the four classes, in the order `gdrcopy`, `gds`, `mofed`, `imex-channel`.
/// `[device_plugin.imex] required` with a channel whose node is missing is
/// [`CdiError::ImexChannelMissing`], naming the node's host path.
pub fn extra_specs(nodes: &ExtraNodes, opts: &ExtraOptions) -> Result<Vec<ExtraSpec>, CdiError> {
    let injected = opts
        .injections
        .edits(nodes, &opts.dev_root)
        .map_err(|missing| CdiError::ImexChannelMissing { path: missing.path })?;
    let mut out = Vec::new();
    for class in FLAG_CLASSES {
        let mut spec = None;
        if let Some(flag) = injected.present_flags().find(|f| f.class == class) {
            let mut edits = ContainerEdits {
                device_nodes: flag.device_nodes.iter().map(device_node).collect::<Result<_, _>>()?,
                ..ContainerEdits::default()
            };
            if class == "gds" {
                for host in &opts.gds_mounts {
                    let container = match host.strip_prefix(&opts.driver_root) {
                        Ok(rel) => Path::new("/").join(rel),
                        Err(_) => host.clone(),
                    };
                    edits.mounts.push(Mount {
                        host_path: utf8(host)?,
                        container_path: utf8(&container)?,
                        options: MOUNT_OPTIONS.map(String::from).to_vec(),
                    });
                }
            }
            let device = Device {
                name: ALL_DEVICE.to_string(),
                container_edits: edits,
            };
            spec = Some(finish(
                &format!("{}/{class}", opts.vendor),
                vec![device],
                ContainerEdits::default(),
            ));
        }
        out.push(ExtraSpec {
            kind: format!("{}/{class}", opts.vendor),
            spec,
        });
    }

    let mut devices = Vec::new();
    for (id, node) in &injected.imex_channels {
        devices.push(Device {
            name: id.to_string(),
            container_edits: ContainerEdits {
                device_nodes: vec![device_node(node)?],
                ..ContainerEdits::default()
            },
        });
    }
    let kind = format!("{}/{IMEX_CLASS}", opts.vendor);
    out.push(ExtraSpec {
        spec: (!devices.is_empty()).then(|| finish(&kind, devices, ContainerEdits::default())),
        kind,
    });
    Ok(out)
}

/// The host paths of [`GDS_MOUNTS`] that exist under `driver_root`, read under the agent's
/// root prefix `root`.
pub fn gds_mounts(root: &Path, driver_root: &Path) -> Vec<PathBuf> {
    GDS_MOUNTS
        .iter()
        .map(|p| rooted(driver_root, Path::new(p)))
        .filter(|host| rooted(root, host).exists())
        .collect()
}

fn utf8(path: &Path) -> Result<String, CdiError> {
    path.to_str().map(str::to_string).ok_or_else(|| CdiError::NonUtf8Path {
        path: path.to_path_buf(),
    })
}
