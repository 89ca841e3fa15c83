//! The driver's device nodes (`[driver] create_device_nodes`): created where `/dev` lacks them
//! when NVML is opened (after the driver stage has loaded or found the driver; NVML needs
//! `nvidiactl` and `nvidia<N>`) and whenever the inventory changes (after every MIG change,
//! before the CDI spec that names the new MIG devices' capability nodes is written).

use std::collections::BTreeSet;

use super::Agent;
use crate::config::Config;
use crate::host::HostRoot;
use crate::host::devnodes::{self, MigDevice, Node};
use crate::nvml::Inventory;
use crate::plugin::devnodes::DeviceNodes;

/// What one look at the device nodes did.
#[derive(Debug, Default)]
pub(crate) struct Ensured {
    pub(crate) dirs: Vec<String>,
    pub(crate) created: Vec<Node>,
    /// Nodes that hold other numbers, capabilities the driver's table lacks, and failures, one
    /// line each, naming the path.
    pub(crate) problems: Vec<String>,
}

impl Ensured {
    /// One line for the log: what was created.
    pub(crate) fn created_line(&self) -> Option<String> {
        if self.created.is_empty() && self.dirs.is_empty() {
            return None;
        }
        let mut made: Vec<String> = self.dirs.iter().map(|d| format!("{d}/ (0755)")).collect();
        made.extend(self.created.iter().map(ToString::to_string));
        Some(format!("created device node(s) {}", made.join(", ")))
    }
}

/// The GPU minors and MIG devices an inventory has.
fn devices_of(inventory: Option<&Inventory>) -> (BTreeSet<u32>, BTreeSet<MigDevice>) {
    let gpus = inventory.map(|i| i.gpus.as_slice()).unwrap_or_default();
    let minors = gpus.iter().map(|g| g.minor).collect();
    let migs = gpus
        .iter()
        .flat_map(|g| {
            g.mig_devices.iter().map(|m| MigDevice {
                gpu_minor: g.minor,
                gi: m.gi_id,
                ci: m.ci_id,
            })
        })
        .collect();
    (minors, migs)
}

/// Creates the device nodes the loaded driver has and `<dev_root>/dev` lacks, for the GPUs and
/// MIG devices of `inventory` (and the GPUs `/proc/driver/nvidia/gpus` lists); never removes
/// anything.
pub(crate) fn ensure_device_nodes(config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> Ensured {
    let dev_base = root.join(&config.device_plugin.dev_root);
    let mig_minors = DeviceNodes::gather(&dev_base, &root.join("/proc")).mig_minors;
    let (gpu_minors, mig_devices) = devices_of(inventory);
    let inputs = devnodes::observe(root, &dev_base, mig_minors, gpu_minors, mig_devices);
    let plan = devnodes::plan(&inputs);
    let mut problems: Vec<String> = plan.conflicts.iter().map(ToString::to_string).collect();
    problems.extend(plan.unknown_caps.iter().map(|key| {
        format!("MIG capability {key} is not in /proc/driver/nvidia-caps/mig-minors: no /dev/nvidia-caps node for it")
    }));
    if plan.dirs.is_empty() && plan.create.is_empty() {
        return Ensured {
            problems,
            ..Ensured::default()
        };
    }
    let applied = devnodes::apply(&dev_base, &plan);
    problems.extend(applied.errors.iter().map(ToString::to_string));
    Ensured {
        dirs: applied.dirs,
        created: applied.created,
        problems,
    }
}

/// For the commands: what was created on stdout, problems as warnings on stderr.
pub(crate) fn report(ensured: &Ensured) {
    if let Some(line) = ensured.created_line() {
        println!("{line}");
    }
    for problem in &ensured.problems {
        eprintln!("gpu-node-agent: warning: device nodes: {problem}");
    }
}

impl Agent {
    /// [`ensure_device_nodes`] for the current inventory (when `[driver] create_device_nodes`),
    /// logged: what was created at info, a problem at warn once (until it changes). Then the
    /// device nodes the device plugin and the CDI spec hand out are read again.
    pub(super) fn ensure_device_nodes(&mut self) {
        if self.config.driver.create_device_nodes {
            let ensured = ensure_device_nodes(&self.config, &self.root, self.inventory.as_ref());
            if let Some(line) = ensured.created_line() {
                tracing::info!("{line}");
            }
            for problem in &ensured.problems {
                if !self.devnode_problems.contains(problem) {
                    tracing::warn!("device nodes: {problem}");
                }
            }
            self.devnode_problems = ensured.problems.into_iter().collect();
        }
        self.base_ctx.nodes = DeviceNodes::gather(
            &self.root.join(&self.config.device_plugin.dev_root),
            &self.root.join("/proc"),
        );
    }
}
