//! The CDI specs of the opt-in injections (`gds`, `mofed`, `gdrcopy`, `imex-channel`), one per
//! class as NVIDIA's device plugin writes them (`/var/run/cdi/<vendor>-<class>.json`), built
//! from the device nodes the host has (pure). What each holds is what the NVIDIA Container
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

use super::generate::device_node;
use super::model::{ContainerEdits, Device, Mount, Spec, minimum_version};
use super::{CdiError, MOUNT_OPTIONS};
use crate::host::rooted;
use crate::plugin::devnodes::{ExtraNodes, imex_channel_path};
use crate::plugin::injections::{ALL_DEVICE, FLAG_CLASSES, IMEX_CLASS, Injections, class_nodes};

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
    let node = |path: &String| device_node(&opts.dev_root, path.clone());
    let mut out = Vec::new();
    for class in FLAG_CLASSES {
        let found = class_nodes(nodes, class);
        let mut spec = None;
        if opts.injections.flag(class) && !found.is_empty() {
            let mut edits = ContainerEdits {
                device_nodes: found.iter().map(node).collect::<Result<_, _>>()?,
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
            spec = Some(finish(
                &opts.vendor,
                class,
                vec![Device {
                    name: ALL_DEVICE.to_string(),
                    container_edits: edits,
                }],
            ));
        }
        out.push(ExtraSpec {
            kind: format!("{}/{class}", opts.vendor),
            spec,
        });
    }

    let channels = opts
        .injections
        .imex_channels(nodes, &opts.dev_root)
        .map_err(|path| CdiError::ImexChannelMissing { path })?;
    let mut devices = Vec::new();
    for id in channels {
        devices.push(Device {
            name: id.to_string(),
            container_edits: ContainerEdits {
                device_nodes: vec![device_node(&opts.dev_root, imex_channel_path(id))?],
                ..ContainerEdits::default()
            },
        });
    }
    out.push(ExtraSpec {
        kind: format!("{}/{IMEX_CLASS}", opts.vendor),
        spec: (!devices.is_empty()).then(|| finish(&opts.vendor, IMEX_CLASS, devices)),
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

fn finish(vendor: &str, class: &str, devices: Vec<Device>) -> Spec {
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: format!("{vendor}/{class}"),
        devices,
        container_edits: ContainerEdits::default(),
    };
    spec.cdi_version = minimum_version(&spec).to_string();
    spec
}

fn utf8(path: &Path) -> Result<String, CdiError> {
    path.to_str().map(str::to_string).ok_or_else(|| CdiError::NonUtf8Path {
        path: path.to_path_buf(),
    })
}
