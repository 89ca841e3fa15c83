//! The driver's device nodes (`[driver] create_device_nodes`): created where `/dev` lacks them
//! when NVML is opened (after the driver stage has loaded or found the driver; NVML needs
//! `nvidiactl` and `nvidia<N>`) and whenever the inventory changes (after every MIG change,
//! before the CDI spec that names the new MIG devices' capability nodes is written). Right after
//! them, their `/dev/char/<major>:<minor>` links (`[driver] create_dev_char_links`,
//! [`crate::host::devchar`]), which `runtime unconfigure` removes again.

use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::config::Config;
use crate::edits::DeviceNodes;
use crate::host::HostRoot;
use crate::host::devchar::{self, Link, Record};
use crate::host::devnodes::{self, MigDevice, Node};
use crate::nvml::Inventory;
use crate::status::DevCharStatus;

/// What one look at the device nodes did.
#[derive(Debug, Default)]
pub(crate) struct Ensured {
    pub(crate) dirs: Vec<String>,
    pub(crate) created: Vec<Node>,
    /// Nodes that hold other numbers, capabilities the driver's table lacks, and failures, one
    /// line each, naming the path.
    pub(crate) problems: Vec<String>,
    /// The `/dev/char` links, with `[driver] create_dev_char_links`.
    pub(crate) links: Option<Links>,
}

/// What one look at the `/dev/char` links did.
#[derive(Debug, Default)]
pub(crate) struct Links {
    /// Every link to an NVIDIA device node in place after it (whoever made it).
    pub(crate) links: Vec<Link>,
    /// The ones made now.
    pub(crate) created: Vec<Link>,
    /// How many of `links` the agent made (its record says so).
    pub(crate) made_by_agent: usize,
    /// What was left alone and why, and failures, one line each naming the path.
    pub(crate) problems: Vec<String>,
}

impl Links {
    /// One line for the log: what was created.
    pub(crate) fn created_line(&self) -> Option<String> {
        (!self.created.is_empty()).then(|| {
            let made: Vec<String> = self.created.iter().map(ToString::to_string).collect();
            format!("created /dev/char link(s) {}", made.join(", "))
        })
    }

    /// What `status` shows.
    pub(crate) fn status(&self) -> DevCharStatus {
        DevCharStatus {
            links: self.links.iter().map(ToString::to_string).collect(),
            made_by_agent: self.made_by_agent,
            problems: self.problems.clone(),
        }
    }
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

/// The device nodes the loaded driver has and `<dev_root>/dev` lacks, for the GPUs and MIG
/// devices of `inventory` (and the GPUs `/proc/driver/nvidia/gpus` lists).
fn device_node_plan(config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> devnodes::Plan {
    let dev_base = root.join(&config.device_plugin.dev_root);
    let mig_minors = DeviceNodes::gather(&dev_base, &root.join("/proc")).mig_minors;
    let (gpu_minors, mig_devices) = devices_of(inventory);
    devnodes::plan(&devnodes::observe(root, &dev_base, mig_minors, gpu_minors, mig_devices))
}

/// Creates the device nodes (with `[driver] create_device_nodes`) the loaded driver has and
/// `<dev_root>/dev` lacks, for the GPUs and MIG devices of `inventory` (and the GPUs
/// `/proc/driver/nvidia/gpus` lists), then (with `[driver] create_dev_char_links`) the
/// `/dev/char` links of every NVIDIA node there; never removes anything but a dangling NVIDIA
/// link in `/dev/char`.
pub(crate) fn ensure_device_nodes(config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> Ensured {
    let mut ensured = if config.driver.create_device_nodes {
        make_device_nodes(config, root, inventory)
    } else {
        Ensured::default()
    };
    if config.driver.create_dev_char_links {
        ensured.links = Some(ensure_dev_char_links(config, root));
    }
    ensured
}

fn make_device_nodes(config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> Ensured {
    let dev_base = root.join(&config.device_plugin.dev_root);
    let plan = device_node_plan(config, root, inventory);
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
        links: None,
    }
}

/// The agent's record of the `/dev/char` links it made (under `[agent] state_dir`).
fn record_path(config: &Config, root: &HostRoot) -> PathBuf {
    root.join(config.agent.state_dir.join(devchar::RECORD_FILE))
}

/// The `/dev/char` links `plan` would have in place: for the NVIDIA nodes under the dev root now
/// and, with `[driver] create_device_nodes`, the ones the agent would create first (for
/// `inventory`'s GPUs and MIG devices). Pure but for reading the host.
pub(crate) fn dev_char_plan(config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> devchar::Plan {
    let dev_base = root.join(&config.device_plugin.dev_root);
    let mut inputs = devchar::observe(&dev_base, &BTreeSet::new());
    if config.driver.create_device_nodes {
        let found: BTreeSet<&str> = inputs.nodes.iter().map(|n| n.path.as_str()).collect();
        let extra: Vec<devchar::Found> = device_node_plan(config, root, inventory)
            .create
            .iter()
            .filter(|n| !found.contains(n.path.as_str()))
            .map(|n| devchar::Found {
                path: n.path.clone(),
                major: n.major,
                minor: n.minor,
            })
            .collect();
        // What /dev/char holds for the numbers of the nodes still to be made.
        let names: BTreeSet<String> = extra.iter().map(devchar::Found::link_name).collect();
        let seen = devchar::observe(&dev_base, &names);
        inputs.entries.extend(seen.entries);
        inputs.nodes.extend(extra);
    }
    devchar::plan(&inputs)
}

/// Makes the `/dev/char` links the NVIDIA nodes under the dev root lack, and records the ones it
/// made. At steady state (every link in place) it writes nothing.
pub(crate) fn ensure_dev_char_links(config: &Config, root: &HostRoot) -> Links {
    let dev_base = root.join(&config.device_plugin.dev_root);
    let plan = devchar::plan(&devchar::observe(&dev_base, &BTreeSet::new()));
    let mut problems = plan.problems.clone();
    let applied = if plan.is_noop() {
        devchar::Applied::default()
    } else {
        devchar::apply(&dev_base, &plan)
    };
    problems.extend(applied.errors.iter().map(ToString::to_string));
    let path = record_path(config, root);
    let mut record = Record::read(&path);
    if !applied.created.is_empty() {
        for link in &applied.created {
            record.0.insert(link.name.clone(), link.target.clone());
        }
        if let Err(e) = record.write(&path) {
            problems.push(format!("the record of the links made: {e}"));
        }
    }
    let mut links = plan.present.clone();
    links.extend(applied.created.iter().cloned());
    let made_by_agent = links
        .iter()
        .filter(|l| record.0.get(&l.name) == Some(&l.target))
        .count();
    Links {
        links,
        created: applied.created,
        made_by_agent,
        problems,
    }
}

/// `runtime unconfigure`: removes the `/dev/char` links the agent made, each only while it still
/// points where the agent put it; prints what it removed, and what it left as a warning. The
/// record keeps only the links that could not be removed.
pub(crate) fn remove_dev_char_links(config: &Config, root: &HostRoot) {
    let path = record_path(config, root);
    let record = Record::read(&path);
    if record.0.is_empty() {
        return;
    }
    let dev_base = root.join(&config.device_plugin.dev_root);
    let names = record.0.keys().cloned().collect();
    let plan = devchar::plan_remove(&record, &devchar::observe(&dev_base, &names));
    let removed = devchar::remove(&dev_base, &plan);
    if !removed.removed.is_empty() {
        let links: Vec<String> = removed.removed.iter().map(ToString::to_string).collect();
        println!("removed the /dev/char link(s) the agent made: {}", links.join(", "));
    }
    for left in &plan.left {
        eprintln!("gpu-node-agent: warning: /dev/char links: {left}");
    }
    let mut kept = Record::default();
    for e in &removed.errors {
        eprintln!("gpu-node-agent: warning: /dev/char links: {e}");
    }
    for link in plan.remove.iter().filter(|l| !removed.removed.contains(l)) {
        kept.0.insert(link.name.clone(), link.target.clone());
    }
    if let Err(e) = kept.write(&path) {
        eprintln!("gpu-node-agent: warning: /dev/char links: {e}");
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
    if let Some(links) = &ensured.links {
        if let Some(line) = links.created_line() {
            println!("{line}");
        }
        for problem in &links.problems {
            eprintln!("gpu-node-agent: warning: /dev/char links: {problem}");
        }
    }
}

/// What the agent keeps of the device nodes between passes.
#[derive(Debug, Default)]
pub(super) struct DevNodes {
    /// The problems last reported (each logged once until it changes).
    problems: BTreeSet<String>,
    /// The `/dev/char` links as last looked at, for status.
    pub(super) dev_char: Option<crate::status::DevCharStatus>,
}

impl DevNodes {
    /// [`ensure_device_nodes`] for `inventory` (when `[driver] create_device_nodes` or
    /// `create_dev_char_links`), logged: what was created at info, a problem at warn once (until
    /// it changes); the links are kept for status. Answers the device nodes the device plugin
    /// and the CDI spec hand out, read again.
    pub(super) fn ensure(&mut self, config: &Config, root: &HostRoot, inventory: Option<&Inventory>) -> DeviceNodes {
        let driver = &config.driver;
        if driver.create_device_nodes || driver.create_dev_char_links {
            let ensured = ensure_device_nodes(config, root, inventory);
            if let Some(line) = ensured.created_line() {
                tracing::info!("{line}");
            }
            let mut problems: Vec<String> = ensured.problems.iter().map(|p| format!("device nodes: {p}")).collect();
            if let Some(links) = &ensured.links {
                if let Some(line) = links.created_line() {
                    tracing::info!("{line}");
                }
                problems.extend(links.problems.iter().map(|p| format!("/dev/char links: {p}")));
            }
            for problem in &problems {
                if !self.problems.contains(problem) {
                    tracing::warn!("{problem}");
                }
            }
            self.problems = problems.into_iter().collect();
            self.dev_char = ensured.links.as_ref().map(Links::status);
        }
        DeviceNodes::gather(&root.join(&config.device_plugin.dev_root), &root.join("/proc"))
    }
}
