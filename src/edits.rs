//! The container-edits model: what a container that gets a GPU is given (device nodes, mounts,
//! env, hooks) and what the opt-in injections add, built once from the inventory and the host
//! facts ([`DeviceNodes`]), and rendered by three small renderers, each keeping only its format:
//! the device plugin's Allocate response (`plugin::allocate`), the CDI specs, of the node and of
//! one DRA claim (`runtime::cdi`), and the DRA prepare answer (`dra`).
//!
//! Building the edits once is what keeps the three in step: a GPU's nodes, a MIG device's
//! capability nodes and an IMEX channel's node are the same whichever API hands the device out,
//! and the rule that protects the host from an image holds in one place: every [`Hook`] has an
//! explicit `env` ([`Hook::new`] is the only way to make one), so no runtime starts a hook with
//! the container's environment (`LD_PRELOAD` as host root, CVE-2025-23266).
//!
//! - [`nodes`]: which device nodes the host has (the host facts).
//! - [`device_nodes`], [`control_nodes`]: the nodes of one device and of every container.
//! - [`node_devices`]: every GPU and MIG device of the inventory with its edits ([`NodeEdits`]
//!   holds them with the edits every container gets).
//! - [`injections`]: GDS, MOFED, GDRCopy and the IMEX channels.
//! - [`whole_gpu`], [`mig_plugin_devices`]: the inventory's devices as the device plugin and
//!   the DRA driver name them.

pub mod injections;
pub mod nodes;

pub use injections::{InjectionEdits, Injections};
pub use nodes::{DeviceNodes, ExtraNodes};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::devices::{Health, MigInfo, PluginDevice};
use crate::host::devnodes::{ci_access_key, gi_access_key};
use crate::host::rooted;
use crate::nvml::{GpuInfo, Inventory, MigDeviceInfo, normalise_bus_id};

/// The OCI stage every hook runs at.
pub const HOOK_STAGE: &str = "createContainer";

/// A device node a container gets. The runtime reads its type, major and minor from the host
/// node; the permissions are the renderer's (`rw` in a device plugin `DeviceSpec`, the runtime's
/// default in a CDI spec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// Path in the container, e.g. `/dev/nvidia0`.
    pub path: String,
    /// The node on the host: `path` under the dev root.
    pub host_path: PathBuf,
}

impl DeviceNode {
    /// The node at `path` in the container, on the host under `dev_root` (`/` or empty: none).
    pub fn new(path: String, dev_root: &Path) -> DeviceNode {
        let host_path = rooted(dev_root, Path::new(&path));
        DeviceNode { path, host_path }
    }
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    /// Mount options; a device plugin `Mount` carries only whether `ro` is among them.
    pub options: Vec<String>,
}

impl Mount {
    /// Whether the mount is read-only.
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// An OCI hook ([`HOOK_STAGE`]) with its whole environment. The fields are private so that no
/// hook exists without its explicit `env`: a runtime starts a hook that has none with the
/// container's environment, and an image's `LD_PRELOAD` then runs in it as host root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    path: String,
    args: Vec<String>,
    env: Vec<String>,
}

impl Hook {
    /// The hook program at `path` (a host path) with its full argv; its env is
    /// [`cdi_hook::HOOK_ENV`], what NVIDIA's own specs give their hooks.
    pub fn new(path: String, args: Vec<String>) -> Hook {
        Hook {
            path,
            args,
            env: cdi_hook::HOOK_ENV.iter().map(|e| e.to_string()).collect(),
        }
    }

    /// Host path of the program.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Full argv, starting with the program's base name.
    pub fn args(&self) -> &[String] {
        &self.args
    }

    /// The hook's whole environment; never empty.
    pub fn env(&self) -> &[String] {
        &self.env
    }
}

/// Changes to a container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    /// `(name, value)` pairs, in order.
    pub env: Vec<(String, String)>,
    pub device_nodes: Vec<DeviceNode>,
    pub mounts: Vec<Mount>,
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    /// Whether there is nothing to edit.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty() && self.hooks.is_empty()
    }
}

/// One GPU or MIG device of the node and what it adds to a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEdits {
    /// The device; its `index` (`0`, `1:0`) and `uuid` are the names it is handed out by.
    pub device: PluginDevice,
    pub edits: ContainerEdits,
}

/// The node's edits: each device's, and those every container with any of them gets (the
/// driver's files, the control nodes, the hooks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeEdits {
    pub common: ContainerEdits,
    pub devices: Vec<DeviceEdits>,
}

impl NodeEdits {
    /// The device with this UUID.
    pub fn device(&self, uuid: &str) -> Option<&DeviceEdits> {
        self.devices.iter().find(|d| d.device.uuid == uuid)
    }
}

/// The driver's `mig-minors` table has no entry for a capability a MIG device needs: without it
/// CUDA cannot open the instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingMigCapability {
    /// The table's key, e.g. `gpu1/gi2/ci0/access`.
    pub key: String,
    /// The MIG device's UUID.
    pub device: String,
}

/// The control nodes the host has (`nodes.control`, in its order).
pub fn control_nodes(nodes: &DeviceNodes, dev_root: &Path) -> Vec<DeviceNode> {
    nodes
        .control
        .iter()
        .map(|path| DeviceNode::new(path.clone(), dev_root))
        .collect()
}

/// The nodes of one device: `/dev/nvidia<minor>` (for a MIG device its GPU's), and for a MIG
/// device the capability nodes `/dev/nvidia-caps/nvidia-cap<N>` of its GPU instance
/// (`gpu<minor>/gi<gi>/access`) then its compute instance (`gpu<minor>/gi<gi>/ci<ci>/access`),
/// `N` from the driver's `mig-minors` table, which keys GPUs by their device minor.
pub fn device_nodes(
    device: &PluginDevice,
    nodes: &DeviceNodes,
    dev_root: &Path,
) -> Result<Vec<DeviceNode>, MissingMigCapability> {
    let mut paths = vec![format!("/dev/nvidia{}", device.minor)];
    if let Some(mig) = &device.mig {
        for key in [
            gi_access_key(device.minor, mig.gi_id),
            ci_access_key(device.minor, mig.gi_id, mig.ci_id),
        ] {
            match nodes.mig_minors.get(&key) {
                Some(n) => paths.push(format!("/dev/nvidia-caps/nvidia-cap{n}")),
                None => {
                    return Err(MissingMigCapability {
                        key,
                        device: device.uuid.clone(),
                    });
                }
            }
        }
    }
    Ok(paths.into_iter().map(|path| DeviceNode::new(path, dev_root)).collect())
}

/// Every device of the inventory with its edits: each GPU by index order (its node and its DRM
/// nodes, `dri` keyed by normalised PCI bus id), then each GPU's MIG devices by MIG index (see
/// [`device_nodes`]).
pub fn node_devices(
    inventory: &Inventory,
    nodes: &DeviceNodes,
    dev_root: &Path,
    dri: &BTreeMap<String, Vec<String>>,
) -> Result<Vec<DeviceEdits>, MissingMigCapability> {
    let mut gpus: Vec<&GpuInfo> = inventory.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    let mut out = Vec::new();
    let mut add = |device: PluginDevice, device_nodes: Vec<DeviceNode>| {
        out.push(DeviceEdits {
            device,
            edits: ContainerEdits {
                device_nodes,
                ..ContainerEdits::default()
            },
        });
    };
    for gpu in &gpus {
        let device = whole_gpu(gpu);
        let mut found = device_nodes(&device, nodes, dev_root)?;
        let drm = dri.get(&normalise_bus_id(&gpu.pci_bus_id));
        found.extend(drm.into_iter().flatten().map(|p| DeviceNode::new(p.clone(), dev_root)));
        add(device, found);
    }
    for gpu in &gpus {
        let mut migs: Vec<&MigDeviceInfo> = gpu.mig_devices.iter().collect();
        migs.sort_by_key(|m| m.index);
        for mig in migs {
            let device = mig_device(gpu, mig);
            let found = device_nodes(&device, nodes, dev_root)?;
            add(device, found);
        }
    }
    Ok(out)
}

/// A whole GPU as a device.
pub fn whole_gpu(gpu: &GpuInfo) -> PluginDevice {
    PluginDevice {
        uuid: gpu.uuid.clone(),
        index: gpu.index.to_string(),
        minor: gpu.minor,
        numa_node: gpu.numa_node,
        mig: None,
        health: Health::Healthy,
    }
}

/// The MIG devices that exist on a GPU, as devices, in the inventory's order.
pub fn mig_plugin_devices(gpu: &GpuInfo) -> impl Iterator<Item = PluginDevice> + '_ {
    gpu.mig_devices.iter().map(move |m| mig_device(gpu, m))
}

/// One MIG device of `gpu` as a device: named `<gpu index>:<mig index>`, its GPU's minor.
fn mig_device(gpu: &GpuInfo, m: &MigDeviceInfo) -> PluginDevice {
    PluginDevice {
        uuid: m.uuid.clone(),
        index: format!("{}:{}", gpu.index, m.index),
        minor: gpu.minor,
        numa_node: gpu.numa_node,
        mig: Some(MigInfo {
            parent_uuid: gpu.uuid.clone(),
            parent_index: gpu.index,
            gi_id: m.gi_id,
            ci_id: m.ci_id,
            profile: m.profile.clone(),
        }),
        health: Health::Healthy,
    }
}

#[cfg(test)]
mod tests;
