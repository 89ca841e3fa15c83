//! The spec's model: the subset of the CDI JSON format written, the lowest CDI version a spec
//! needs, its JSON text and its file name.

use serde::Serialize;

use super::CdiError;

/// A CDI spec (the subset of the CDI JSON format this generator writes). Field order follows the
/// CDI Go types, so the JSON reads like `nvidia-ctk`'s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// The CDI spec version the document needs; see [`spec`].
    ///
    /// [`spec`]: super::spec
    pub cdi_version: String,
    /// `<vendor>/<class>`.
    pub kind: String,
    /// One entry per name a container can ask for.
    pub devices: Vec<Device>,
    /// Edits applied once to any container that gets at least one device of this spec.
    #[serde(skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// A named device of the spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// `0`, `GPU-…`, `1:0`, `MIG-…` or `all`.
    pub name: String,
    /// What requesting this device adds to a container.
    pub container_edits: ContainerEdits,
}

/// Changes to the container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// OCI hooks to add.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    /// Bind mounts to add.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    /// Whether there is nothing to edit.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.hooks.is_empty() && self.mounts.is_empty()
    }
}

/// A device node; type, major and minor are read from the host node by the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container, e.g. `/dev/nvidia0`.
    pub path: String,
    /// Host path when it differs from `path` (a `dev_root` other than `/`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Host path, under the driver root.
    pub host_path: String,
    /// Path in the container: the host path without the driver root.
    pub container_path: String,
    /// Mount options, [`MOUNT_OPTIONS`] or [`IPC_MOUNT_OPTIONS`].
    ///
    /// [`MOUNT_OPTIONS`]: super::MOUNT_OPTIONS
    /// [`IPC_MOUNT_OPTIONS`]: super::IPC_MOUNT_OPTIONS
    pub options: Vec<String>,
}

/// An OCI hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// OCI hook stage, always `createContainer` here.
    pub hook_name: String,
    /// Host path of the hook binary.
    pub path: String,
    /// Full argv, starting with the binary's base name.
    pub args: Vec<String>,
    /// The hook's whole environment. Never empty: a runtime starts a hook without `env` with the
    /// container's environment, and an image's `LD_PRELOAD` then runs in the hook as host root
    /// (CVE-2025-23266).
    pub env: Vec<String>,
}

/// The lowest CDI spec version that has every feature `spec` uses, by the rules of the CDI
/// library's `MinimumRequiredVersion` (`specs-go/version.go`) for the fields [`Spec`] can hold:
/// - 0.3.0 is the floor (the earliest version the library still accepts);
/// - 0.4.0: a mount `type` (never written here);
/// - 0.5.0: a device name that does not start with a letter, or a device node `hostPath`;
/// - 0.6.0: spec or device `annotations` (never written here), or a `.` in the kind's class;
/// - 0.7.0: `intelRdt` or `additionalGids` (never written here); 0.8.0 added no spec field.
pub fn minimum_version(spec: &Spec) -> &'static str {
    let class_has_dot = spec.kind.split_once('/').is_some_and(|(_, class)| class.contains('.'));
    if class_has_dot {
        return "0.6.0";
    }
    let digit_name = spec
        .devices
        .iter()
        .any(|d| d.name.chars().next().is_some_and(|c| !c.is_alphabetic()));
    let host_path = spec
        .devices
        .iter()
        .map(|d| &d.container_edits)
        .chain([&spec.container_edits])
        .any(|e| e.device_nodes.iter().any(|n| n.host_path.is_some()));
    if digit_name || host_path { "0.5.0" } else { "0.3.0" }
}

/// The spec's file name by the CDI convention `<vendor>-<class>.json`: `nvidia.com/gpu` →
/// `nvidia.com-gpu.json`.
pub fn spec_file_name(kind: &str) -> String {
    format!("{}.json", kind.replace('/', "-"))
}

/// The spec as pretty-printed JSON with a trailing newline. Deterministic: the same spec always
/// gives the same bytes, so the caller can skip rewriting an unchanged file.
pub fn to_json(spec: &Spec) -> Result<String, CdiError> {
    let mut text = serde_json::to_string_pretty(spec).map_err(|err| CdiError::Render {
        message: err.to_string(),
    })?;
    text.push('\n');
    Ok(text)
}
