//! `[mig]`: the MIG layouts a Node label selects; their defaults and validation.

use super::merge::KeyPath;
use super::values;
use super::values::UncoveredGpus;
use super::{Check, Invalid, absolute_path, invalid, positive};
use crate::mig_layout::defaults::{self, default_layouts};
use crate::mig_layout::{EntryField, Item, LayoutError, MigLayout, Uncovered};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `mig.enabled`: run the MIG stage (apply the layout a Node label names).
pub const DEFAULT_MIG_ENABLED: bool = true;
/// `mig.default_layouts`: offer the built-in layouts (`all-disabled`, `all-1g.10gb`, ...).
pub const DEFAULT_MIG_DEFAULT_LAYOUTS: bool = true;
/// `mig.process_wait_timeout`: how long a layout change waits in `pending` for processes on the
/// GPUs to end before it is `failed`; zero waits forever.
pub const DEFAULT_MIG_PROCESS_WAIT_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// `mig.reboot_on_mode_change`: reboot when a MIG mode change needs a GPU reset that cannot be
/// done (else fail with the reason).
pub const DEFAULT_MIG_REBOOT_ON_MODE_CHANGE: bool = false;
/// Reset an idle GPU to finish a pending MIG mode change.
pub const DEFAULT_MIG_GPU_RESET: bool = true;
/// `mig.uncovered_gpus`: a MIG-capable GPU no entry of the layout covers is left as it is.
pub const DEFAULT_MIG_UNCOVERED_GPUS: UncoveredGpus = UncoveredGpus::Leave;
/// `mig.default_layout`: what the GPU Operator labels a MIG-capable node with when the label is
/// absent.
pub const DEFAULT_MIG_DEFAULT_LAYOUT: &str = "all-disabled";
/// Where the driver's nvidia-smi is.
pub const DEFAULT_NVIDIA_SMI: &str = "/usr/bin/nvidia-smi";
/// `mig.host_gpu_clients`: the host's systemd units that hold the GPUs open, stopped (when
/// active) before a MIG change and started again after it: the GPU Operator's
/// `default-gpu-clients` list, which its MIG manager stops with a host driver.
pub const DEFAULT_MIG_HOST_GPU_CLIENTS: [&str; 9] = [
    "nvsm.service",
    "nvsm-mqtt.service",
    "nvsm-core.service",
    "nvsm-api-gateway.service",
    "nvsm-notifier.service",
    "nv_peer_mem.service",
    "nvidia-dcgm.service",
    "dcgm.service",
    "dcgm-exporter.service",
];
/// `mig.host_gpu_clients_stop_timeout`: how long one unit may take to stop (or start) before the
/// MIG change fails (the MIG manager's 30 s).
pub const DEFAULT_MIG_HOST_GPU_CLIENTS_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// `mig.stop_kubelet_on_mode_change`: stop the kubelet too for a MIG mode change.
pub const DEFAULT_MIG_STOP_KUBELET_ON_MODE_CHANGE: bool = false;
/// `mig.kubelet_unit`: the kubelet's systemd unit.
pub const DEFAULT_MIG_KUBELET_UNIT: &str = "kubelet.service";

/// `[mig]`: MIG layouts, named like mig-parted's configs and selected by the
/// `nvidia.com/mig.config` label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigConfig {
    /// Run the MIG stage at all.
    pub enabled: bool,
    /// Offer the built-in layouts ([`default_layouts`]); user layouts with the same name
    /// replace them.
    pub default_layouts: bool,
    /// How long to wait in `pending` for processes on the GPUs to end before `failed`; zero
    /// waits forever.
    #[serde(with = "values::duration")]
    pub process_wait_timeout: Duration,
    /// When a MIG mode change needs a GPU reset that cannot be done: report `rebooting` and
    /// reboot (`true`), or fail with the reason (`false`).
    pub reboot_on_mode_change: bool,
    /// When a MIG mode change waits for a GPU reset and nothing runs on the GPU, reset it with
    /// `nvidia_smi --gpu-reset -i <uuid>` before falling back to `reboot_on_mode_change`.
    pub gpu_reset: bool,
    /// The nvidia-smi binary used for GPU resets (host path).
    pub nvidia_smi: PathBuf,
    /// A MIG-capable GPU no entry of the layout covers: `leave` it as it is (the layout still
    /// succeeds, as under mig-manager) or `fail` the layout before anything changes.
    pub uncovered_gpus: UncoveredGpus,
    /// Host systemd units that hold the GPUs open (DCGM, NVSM, ...): those active are stopped,
    /// in this order, right before a MIG change and started again, the other way round, after
    /// it, whether it worked or not. Empty: none.
    pub host_gpu_clients: Vec<String>,
    /// How long one of them (or the kubelet) may take to stop or start; a unit that does not
    /// stop in time fails the MIG change before anything changed.
    #[serde(with = "values::duration")]
    pub host_gpu_clients_stop_timeout: Duration,
    /// For a MIG mode change (not for instance changes alone), stop `kubelet_unit` first, before
    /// the host GPU clients, and start it again last.
    pub stop_kubelet_on_mode_change: bool,
    /// The kubelet's systemd unit, for `stop_kubelet_on_mode_change`.
    pub kubelet_unit: String,
    /// The layout applied while the Node has no `nvidia.com/mig.config` label, on a node with a
    /// MIG-capable GPU: `all-disabled`, as the GPU Operator labels such nodes (empty: none, the
    /// GPUs are left as they booted). Lets a bootstrap apply a layout before the node joins.
    pub default_layout: String,
    /// User layouts by name (`[[mig.layouts.<name>]]`), each a list of entries.
    pub layouts: BTreeMap<String, MigLayout>,
}

impl Default for MigConfig {
    fn default() -> Self {
        MigConfig {
            enabled: DEFAULT_MIG_ENABLED,
            default_layouts: DEFAULT_MIG_DEFAULT_LAYOUTS,
            process_wait_timeout: DEFAULT_MIG_PROCESS_WAIT_TIMEOUT,
            reboot_on_mode_change: DEFAULT_MIG_REBOOT_ON_MODE_CHANGE,
            gpu_reset: DEFAULT_MIG_GPU_RESET,
            nvidia_smi: DEFAULT_NVIDIA_SMI.into(),
            uncovered_gpus: DEFAULT_MIG_UNCOVERED_GPUS,
            host_gpu_clients: DEFAULT_MIG_HOST_GPU_CLIENTS.iter().map(|u| u.to_string()).collect(),
            host_gpu_clients_stop_timeout: DEFAULT_MIG_HOST_GPU_CLIENTS_STOP_TIMEOUT,
            stop_kubelet_on_mode_change: DEFAULT_MIG_STOP_KUBELET_ON_MODE_CHANGE,
            kubelet_unit: DEFAULT_MIG_KUBELET_UNIT.into(),
            default_layout: DEFAULT_MIG_DEFAULT_LAYOUT.into(),
            layouts: BTreeMap::new(),
        }
    }
}

impl MigConfig {
    /// The layout a label value names: a user layout, else a built-in one when
    /// `default_layouts` is on; `None` when neither has it.
    ///
    /// A built-in one is generated per GPU from NVML's profiles ([`defaults::layout`]), so
    /// `all-<profile>` exists for any GPU instance profile name. Either way it carries
    /// `uncovered_gpus`.
    pub fn layout(&self, name: &str) -> Option<MigLayout> {
        let mut layout = match self.layouts.get(name) {
            Some(layout) => layout.clone(),
            None if self.default_layouts => defaults::layout(name)?,
            None => return None,
        };
        layout.uncovered = match self.uncovered_gpus {
            UncoveredGpus::Leave => Uncovered::Leave,
            UncoveredGpus::Fail => Uncovered::Fail,
        };
        Some(layout)
    }

    /// Every layout name a label may select, sorted.
    pub fn layout_names(&self) -> Vec<String> {
        self.all_layouts().into_keys().collect()
    }

    /// Every layout by name: the built-in ones (when `default_layouts`) with the user's over
    /// them.
    pub fn all_layouts(&self) -> BTreeMap<String, MigLayout> {
        let mut out = if self.default_layouts {
            default_layouts()
        } else {
            BTreeMap::new()
        };
        out.extend(self.layouts.iter().map(|(k, v)| (k.clone(), v.clone())));
        out
    }
}

impl MigConfig {
    pub(super) fn validate(&self) -> Check {
        absolute_path("mig.nvidia_smi", &self.nvidia_smi)?;
        let clients = KeyPath::dotted("mig.host_gpu_clients");
        for (i, unit) in self.host_gpu_clients.iter().enumerate() {
            check_unit_name(unit).map_err(|reason| Invalid {
                key: clients.clone().index(i),
                reason,
            })?;
            if self.host_gpu_clients[..i].contains(unit) {
                return Err(Invalid {
                    key: clients.clone().index(i),
                    reason: format!("{unit} is listed twice"),
                });
            }
        }
        positive("mig.host_gpu_clients_stop_timeout", self.host_gpu_clients_stop_timeout)?;
        check_unit_name(&self.kubelet_unit).map_err(|reason| invalid("mig.kubelet_unit", reason))?;
        // process_wait_timeout = 0s means wait forever.
        for (name, layout) in &self.layouts {
            let at = KeyPath::dotted("mig.layouts").key(name);
            if name.is_empty() {
                return Err(Invalid {
                    key: at,
                    reason: "a layout name cannot be empty".to_owned(),
                });
            }
            crate::names::check_label_value(name).map_err(|reason| Invalid {
                key: at.clone(),
                reason: format!("a layout name is selected by a label value: {reason}"),
            })?;
            layout.check().map_err(|e| match e {
                LayoutError::Entry {
                    entry,
                    field,
                    item,
                    reason,
                } => {
                    let key = at.clone().index(entry).key(field.config_key());
                    let key = match item {
                        Some(Item::Index(i)) => key.index(i),
                        Some(Item::Profile(p)) => key.key(&p),
                        None => key,
                    };
                    let reason = match field {
                        EntryField::Profiles => reason.replace("MIG enabled", "mig_enabled"),
                        _ => reason,
                    };
                    Invalid { key, reason }
                }
                other => Invalid {
                    key: at.clone(),
                    reason: other.to_string(),
                },
            })?;
        }
        // The default names a built-in layout; with `default_layouts = false` and no layout of
        // that name it means none.
        let defaulted = self.default_layout == DEFAULT_MIG_DEFAULT_LAYOUT && !self.default_layouts;
        if !self.default_layout.is_empty() && !defaulted && self.layout(&self.default_layout).is_none() {
            return Err(invalid(
                "mig.default_layout",
                format!("names no MIG layout (defined: {})", self.layout_names().join(", ")),
            ));
        }
        Ok(())
    }
}

/// The suffixes of the systemd unit types a host GPU client can be.
const UNIT_SUFFIXES: [&str; 6] = [".service", ".socket", ".target", ".timer", ".path", ".mount"];

/// A systemd unit name as `systemctl stop` takes it: `nvidia-dcgm.service`, never a path, an
/// option or a glob.
pub fn check_unit_name(unit: &str) -> Result<(), String> {
    let expected = "expected a systemd unit name such as \"nvidia-dcgm.service\"";
    let stem = UNIT_SUFFIXES.iter().find_map(|s| unit.strip_suffix(s));
    let allowed = |c: char| c.is_ascii_alphanumeric() || ":-_.\\@".contains(c);
    match stem {
        Some(stem) if !stem.is_empty() && !unit.starts_with('-') && unit.chars().all(allowed) => Ok(()),
        _ => Err(format!("{expected} (with one of {})", UNIT_SUFFIXES.join(", "))),
    }
}
