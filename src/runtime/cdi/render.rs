//! The CDI renderer of the container-edits model ([`crate::edits`]): the node's spec from its
//! [`NodeEdits`] ([`render_node`]) and the spec of one DRA claim from the same edits
//! ([`claim_spec`]), so that a device has the same nodes, and every container the same driver
//! mounts and hooks (each with its `env`), whichever API handed it out. Only the format is
//! decided here: `NAME=value` env entries, a `hostPath` only where it differs, UTF-8 paths, the
//! `all` device, the spec's minimum version.

use std::path::Path;

use super::CdiError;
use super::model::{ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, minimum_version};
use crate::edits::{self, NodeEdits};

/// The name of the device that stands for all GPUs and MIG devices.
pub const ALL_DEVICE: &str = "all";

/// The node's spec of kind `kind`: each device by index (`0`, `1:0`) and by UUID, in the order of
/// `node.devices`, then [`ALL_DEVICE`] with every node of all of them; the common edits once.
pub fn render_node(node: &NodeEdits, kind: &str) -> Result<Spec, CdiError> {
    let mut devices = Vec::new();
    let mut all_nodes: Vec<DeviceNode> = Vec::new();
    for d in &node.devices {
        let container_edits = container_edits(&d.edits)?;
        for n in &container_edits.device_nodes {
            if !all_nodes.contains(n) {
                all_nodes.push(n.clone());
            }
        }
        for name in [&d.device.index, &d.device.uuid] {
            devices.push(Device {
                name: name.clone(),
                container_edits: container_edits.clone(),
            });
        }
    }
    devices.push(Device {
        name: ALL_DEVICE.to_string(),
        container_edits: ContainerEdits {
            device_nodes: all_nodes,
            ..ContainerEdits::default()
        },
    });
    Ok(finish(kind, devices, container_edits(&node.common)?))
}

/// The spec of one DRA claim, kind `claim_kind`: one device per entry of `devices` (its name in
/// the claim, its UUID), named `<uid>-<name>`, with exactly that device's edits, and the node's
/// common edits (driver files, control nodes, hooks). Returns the spec and, per device in
/// `devices` order, its CDI ID. A device the node's edits lack is an error naming `node_kind`.
pub fn claim_spec(
    node: &NodeEdits,
    node_kind: &str,
    claim_kind: &str,
    uid: &str,
    devices: &[(&str, &str)],
) -> Result<(Spec, Vec<String>), String> {
    let mut out = Vec::new();
    let mut ids = Vec::new();
    for (name, uuid) in devices {
        let found = node
            .device(uuid)
            .ok_or_else(|| format!("device {name} ({uuid}) is not in the node's CDI spec {node_kind}"))?;
        let cdi_name = format!("{uid}-{name}");
        ids.push(format!("{claim_kind}={cdi_name}"));
        out.push(Device {
            name: cdi_name,
            container_edits: container_edits(&found.edits).map_err(|e| e.to_string())?,
        });
    }
    let common = container_edits(&node.common).map_err(|e| e.to_string())?;
    Ok((finish(claim_kind, out, common), ids))
}

/// A spec of `kind` with `devices` and `common`, at the lowest CDI version it needs.
pub(super) fn finish(kind: &str, devices: Vec<Device>, common: ContainerEdits) -> Spec {
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: kind.to_string(),
        devices,
        container_edits: common,
    };
    spec.cdi_version = minimum_version(&spec).to_string();
    spec
}

/// The model's edits in CDI's format.
pub(super) fn container_edits(edits: &edits::ContainerEdits) -> Result<ContainerEdits, CdiError> {
    Ok(ContainerEdits {
        env: edits
            .env
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect(),
        device_nodes: edits.device_nodes.iter().map(device_node).collect::<Result<_, _>>()?,
        hooks: edits
            .hooks
            .iter()
            .map(|h| Hook {
                hook_name: edits::HOOK_STAGE.to_string(),
                path: h.path().to_string(),
                args: h.args().to_vec(),
                env: h.env().to_vec(),
            })
            .collect(),
        mounts: edits.mounts.iter().map(mount).collect::<Result<_, _>>()?,
    })
}

/// A device node, with a `hostPath` only when it differs from the path (a dev root other than
/// `/`).
pub(super) fn device_node(node: &edits::DeviceNode) -> Result<DeviceNode, CdiError> {
    let host_path = if node.host_path == Path::new(&node.path) {
        None
    } else {
        Some(utf8(&node.host_path)?.to_string())
    };
    Ok(DeviceNode {
        path: node.path.clone(),
        host_path,
    })
}

fn mount(m: &edits::Mount) -> Result<Mount, CdiError> {
    Ok(Mount {
        host_path: utf8(&m.host_path)?.to_string(),
        container_path: utf8(&m.container_path)?.to_string(),
        options: m.options.clone(),
    })
}

pub(super) fn utf8(path: &Path) -> Result<&str, CdiError> {
    path.to_str().ok_or_else(|| CdiError::NonUtf8Path {
        path: path.to_path_buf(),
    })
}
