//! NVIDIA's GPU Operator on this node: which of its operands run here (observed: live sockets at
//! the agent's paths and who holds them, processes by name, the toolkit's and the driver
//! container's marks), and, from those facts (pure), which of the agent's actions would
//! conflict with them, and the per-node `nvidia.com/gpu.deploy.<operand>` labels that withdraw
//! the operands the agent replaces.
//!
//! Observing reads only: `lstat`s, one connection per socket (closed at once), `/proc/<pid>`'s
//! `comm` and `cmdline` under the root, and the engines' config files (regular files, bounded).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::HostRoot;
use super::socket::{self, Probe};

/// What the agent does on this node (from its config; the agent fills it in): which of the
/// Operator's jobs are its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Roles {
    /// It installs the driver (`[driver]` on, `source` other than `none`).
    pub driver: bool,
    /// It configures the engines (`[runtime] enabled`).
    pub runtime: bool,
    /// It serves the device plugin.
    pub device_plugin: bool,
    /// It reports the GPU feature labels.
    pub features: bool,
    /// It applies MIG layouts.
    pub mig: bool,
    /// It serves DCGM-compatible metrics.
    pub metrics: bool,
    /// It validates the node.
    pub validation: bool,
    /// It runs the DRA driver.
    pub dra: bool,
}

/// The engine config files to look for the Operator's toolkit in (host paths): files, and
/// folders whose every file is looked at (drop-in folders).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineFiles {
    pub files: Vec<PathBuf>,
    pub folders: Vec<PathBuf>,
}

/// The prefix of the Operator's per-node operand switches.
pub const DEPLOY_LABEL_PREFIX: &str = "nvidia.com/gpu.deploy.";
/// Where the Operator's toolkit container installs the toolkit on the host.
pub const TOOLKIT_DIR: &str = "/usr/local/nvidia/toolkit";
/// The Operator's driver container's root on the host (mounted and populated while it runs).
pub const DRIVER_CONTAINER_ROOT: &str = "/run/nvidia/driver";
/// The Operator's validator's ready files.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";
/// How much of an engine config is read.
const READ_LIMIT: u64 = 1 << 20;
/// How much of a `/proc/<pid>/cmdline` is read: argv[0] is at its start, and any process on the
/// node (a pod's) chooses its length.
const CMDLINE_PREFIX: u64 = 4096;
/// The most characters of a process's name kept: any process chooses it, and it goes into
/// status, the log and Events.
const PROGRAM_MAX: usize = 64;

/// An operand of NVIDIA's GPU Operator the agent may conflict with or replace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Operand {
    Driver,
    ContainerToolkit,
    DevicePlugin,
    GpuFeatureDiscovery,
    MigManager,
    DcgmExporter,
    OperatorValidator,
    DraDriver,
}

impl Operand {
    pub const ALL: [Operand; 8] = [
        Operand::Driver,
        Operand::ContainerToolkit,
        Operand::DevicePlugin,
        Operand::GpuFeatureDiscovery,
        Operand::MigManager,
        Operand::DcgmExporter,
        Operand::OperatorValidator,
        Operand::DraDriver,
    ];

    /// The `<operand>` of its `nvidia.com/gpu.deploy.<operand>` label (the Operator's names).
    pub fn deploy_name(self) -> &'static str {
        match self {
            Operand::Driver => "driver",
            Operand::ContainerToolkit => "container-toolkit",
            Operand::DevicePlugin => "device-plugin",
            Operand::GpuFeatureDiscovery => "gpu-feature-discovery",
            Operand::MigManager => "mig-manager",
            Operand::DcgmExporter => "dcgm-exporter",
            Operand::OperatorValidator => "operator-validator",
            Operand::DraDriver => "dra-driver",
        }
    }

    /// Its deploy label key.
    pub fn deploy_label(self) -> String {
        format!("{DEPLOY_LABEL_PREFIX}{}", self.deploy_name())
    }

    /// In words, for status and Events.
    pub fn words(self) -> &'static str {
        match self {
            Operand::Driver => "NVIDIA's driver container",
            Operand::ContainerToolkit => "NVIDIA's container toolkit",
            Operand::DevicePlugin => "NVIDIA's device plugin",
            Operand::GpuFeatureDiscovery => "NVIDIA's GPU Feature Discovery",
            Operand::MigManager => "NVIDIA's mig-manager",
            Operand::DcgmExporter => "NVIDIA's DCGM exporter",
            Operand::OperatorValidator => "NVIDIA's operator validator",
            Operand::DraDriver => "NVIDIA's DRA driver",
        }
    }

    /// The operand a program name (a `comm`, which the kernel cuts at 15 bytes, or argv[0]'s
    /// file name) belongs to.
    pub fn of_program(name: &str) -> Option<Operand> {
        // Full names; a `comm` is their first 15 bytes.
        const PROGRAMS: &[(&str, Operand)] = &[
            ("nvidia-device-plugin", Operand::DevicePlugin),
            ("gpu-feature-discovery", Operand::GpuFeatureDiscovery),
            ("nvidia-mig-manager", Operand::MigManager),
            ("dcgm-exporter", Operand::DcgmExporter),
            ("nvidia-toolkit", Operand::ContainerToolkit),
            ("nvidia-ctk-installer", Operand::ContainerToolkit),
            ("nvidia-validator", Operand::OperatorValidator),
            ("gpu-kubelet-plugin", Operand::DraDriver),
        ];
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        PROGRAMS.iter().find_map(|(full, operand)| {
            let comm = &full[..full.len().min(15)];
            (name == *full || name == comm).then_some(*operand)
        })
    }
}

/// A socket path the agent serves, and what it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedPath {
    /// The host path (shown to people).
    pub host: PathBuf,
    /// What the agent serves there: a resource name, or "DRA driver gpu.nvidia.com".
    pub what: String,
}

/// A process found on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: i32,
    /// Its program's name (argv[0]'s file name, else `comm`); `None` when `/proc` did not say.
    pub program: Option<String>,
    /// The pod it runs in (`pod <namespace>/<name>`, else `pod uid <uid>`, else `cgroup <path>`),
    /// as its cgroup and the kubelet's log folders say; the agent fills it in. Any pod may run a
    /// program under an operand's name: this says which one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Where it runs, as its cgroup says (observed; the agent fills it in): what decides whether
    /// it can be the Operator's ([`Process::may_be_operators`]).
    #[serde(skip)]
    pub placement: Placement,
}

/// Where a process runs, from its `/proc/<pid>/cgroup` (which a process cannot choose) and the
/// kubelet's log folders (which only the kubelet writes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Placement {
    /// Outside Kubernetes' pods (a host service, e.g. mig-parted run by systemd), or its cgroup
    /// could not be read.
    #[default]
    Host,
    /// In a pod (its cgroup is under `kubepods`): its namespace when the kubelet's log folders
    /// name it, `None` when nothing does.
    Pod { namespace: Option<String> },
}

impl Process {
    /// Whether this process may be an operand of the GPU Operator installed in namespace
    /// `operator_namespace` (pure): one outside the pods always may (the Operator's operands are
    /// pods, but a host service doing their job conflicts all the same); one in a pod only when
    /// that pod is in the Operator's namespace. Any pod can run a program under an operand's name:
    /// one in another namespace, or whose namespace is not known, is a tenant's.
    pub fn may_be_operators(&self, operator_namespace: &str) -> bool {
        match &self.placement {
            Placement::Host => true,
            Placement::Pod { namespace } => namespace.as_deref() == Some(operator_namespace),
        }
    }
}

/// What was seen on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Each served path with a live server on it: the path, and the process holding it (`pid`
    /// `None` when the kernel did not say).
    pub live_sockets: Vec<(ServedPath, Option<Process>)>,
    /// Operand processes running on the node.
    pub processes: Vec<(Operand, Process)>,
    /// The toolkit's installation directory exists.
    pub toolkit_dir: bool,
    /// Engine config files that name the toolkit's runtime under [`TOOLKIT_DIR`].
    pub toolkit_configs: Vec<PathBuf>,
    /// The driver container's root is populated.
    pub driver_container: bool,
    /// The validator's ready files there (`driver-ready`, `toolkit-ready`, ...).
    pub validations: Vec<String>,
}

/// The program of `pid`, from `<root>/proc/<pid>`: argv[0]'s file name, else `comm`. Bounded
/// reads (the first [`CMDLINE_PREFIX`] bytes of `cmdline`); the process chose both, so the name
/// is cut to [`PROGRAM_MAX`] characters and anything but printable ASCII shows as `?` (no line
/// breaks or terminal escapes in status, the log or Events). `None` when neither is readable.
pub fn program_of(root: &HostRoot, pid: i32) -> Option<String> {
    let dir = root.join(format!("/proc/{pid}"));
    if let Ok(raw) = read_prefix(&dir.join("cmdline"), CMDLINE_PREFIX)
        && let Some(arg0) = raw.split(|b| *b == 0).next().filter(|a| !a.is_empty())
    {
        let arg0 = String::from_utf8_lossy(arg0);
        let name = printable(arg0.rsplit('/').next().unwrap_or(&arg0).trim());
        // Kernel threads and scripts run by an interpreter: argv[0] is the interpreter.
        if !name.is_empty() && !matches!(name.as_str(), "sh" | "bash" | "dash" | "python3" | "python") {
            return Some(name);
        }
    }
    super::read_file(&dir.join("comm"), 4096)
        .ok()
        .map(|c| printable(String::from_utf8_lossy(&c).trim()))
        .filter(|c| !c.is_empty())
}

/// The first `limit` bytes of a file (all of a shorter one).
fn read_prefix(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut data = Vec::new();
    std::fs::File::open(path)?.take(limit).read_to_end(&mut data)?;
    Ok(data)
}

/// A name a process chose, fit to show: at most [`PROGRAM_MAX`] characters (`...` when cut),
/// printable ASCII only (others are `?`).
pub fn printable(name: &str) -> String {
    let mut out: String = name
        .chars()
        .take(PROGRAM_MAX)
        .map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' })
        .collect();
    if name.chars().nth(PROGRAM_MAX).is_some() {
        out.push_str("...");
    }
    out
}

/// The operand processes under `<root>/proc` (by `comm`, confirmed by argv[0] when readable).
pub fn operand_processes(root: &HostRoot) -> Vec<(Operand, Process)> {
    let Ok(entries) = std::fs::read_dir(root.join("/proc")) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(comm) = super::read_file(&entry.path().join("comm"), 4096) else {
            continue;
        };
        let comm = String::from_utf8_lossy(&comm);
        let Some(operand) = Operand::of_program(&comm) else {
            continue;
        };
        let program = program_of(root, pid);
        // argv[0] disagrees (a process that only shares the first 15 bytes): not it.
        if let Some(p) = &program
            && Operand::of_program(p).is_some_and(|o| o != operand)
        {
            continue;
        }
        found.push((
            operand,
            Process {
                pid,
                program,
                pod: None,
                placement: Placement::Host,
            },
        ));
    }
    found.sort_by_key(|(o, p)| (*o, p.pid));
    found
}

/// Whether a text (an engine config) names the toolkit's runtime from [`TOOLKIT_DIR`].
pub fn names_toolkit(text: &str) -> bool {
    text.contains(&format!("{TOOLKIT_DIR}/nvidia-container-runtime"))
}

/// The engine config files that name the Operator's toolkit, of `engines` (regular files only,
/// bounded reads).
fn toolkit_configs(root: &HostRoot, engines: &EngineFiles) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = engines.files.clone();
    for dir in &engines.folders {
        if let Ok(entries) = std::fs::read_dir(root.join(dir)) {
            files.extend(entries.flatten().map(|e| dir.join(e.file_name())));
        }
    }
    files.sort();
    files.dedup();
    files
        .into_iter()
        .filter(|f| !f.as_os_str().is_empty())
        .filter(|f| {
            let path = root.join(f);
            std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file())
                && super::read_file(&path, READ_LIMIT).is_ok_and(|b| names_toolkit(&String::from_utf8_lossy(&b)))
        })
        .collect()
}

fn populated(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

/// Looks at the node: the live servers on `served` (host paths), the operand processes, the
/// toolkit's and driver container's marks. Reads only.
pub fn observe(root: &HostRoot, engines: &EngineFiles, served: &[ServedPath]) -> Facts {
    let mut live_sockets = Vec::new();
    for path in served {
        if let Ok(Probe::Live(listener)) = socket::probe(&root.join(&path.host)) {
            let process = listener.pid.map(|pid| Process {
                pid,
                program: program_of(root, pid),
                pod: None,
                placement: Placement::Host,
            });
            live_sockets.push((path.clone(), process));
        }
    }
    let mut validations: Vec<String> = std::fs::read_dir(root.join(VALIDATIONS_DIR))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    validations.sort();
    Facts {
        live_sockets,
        processes: operand_processes(root),
        toolkit_dir: root.join(TOOLKIT_DIR).is_dir(),
        toolkit_configs: toolkit_configs(root, engines),
        driver_container: populated(&root.join(DRIVER_CONTAINER_ROOT)),
        validations,
    }
}

/// What the agent holds back because of an operand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conflict {
    pub operand: Operand,
    /// The process, when known.
    pub process: Option<Process>,
    /// What was seen: `socket /var/lib/kubelet/device-plugins/nvidia-gpu.sock`, `process`, a
    /// file.
    pub seen: String,
    /// What the agent does not do meanwhile.
    pub held_back: String,
    /// What a person should do.
    pub advice: String,
}

impl Conflict {
    /// One line for status, logs and Events.
    pub fn line(&self, withdrawing: bool) -> String {
        let who = match &self.process {
            Some(p) => format!(
                "{} ({}, pid {}{})",
                self.operand.words(),
                p.program.as_deref().unwrap_or("program unknown"),
                p.pid,
                p.pod.as_deref().map(|pod| format!(", {pod}")).unwrap_or_default()
            ),
            None => self.operand.words().to_string(),
        };
        if withdrawing {
            format!(
                "waiting for {who} to leave ({}; {} set to false): {}",
                self.seen,
                self.operand.deploy_label(),
                self.held_back
            )
        } else {
            format!(
                "{who} runs on this node ({}): {}; {}",
                self.seen, self.held_back, self.advice
            )
        }
    }
}

/// The advice for an operand the agent would replace.
fn advice(operand: Operand) -> String {
    format!(
        "to hand it to the agent, label the Node {}=false (or set [kubernetes] withdraw_operator_operands = true, or \
         run `gpu-node-agent migrate`)",
        operand.deploy_label()
    )
}

/// The operand processes in `facts` that may be the Operator's, installed in
/// `operator_namespace` ([`Process::may_be_operators`]; pure).
pub fn operators_processes<'a>(
    facts: &'a Facts,
    operator_namespace: &'a str,
) -> impl Iterator<Item = &'a (Operand, Process)> + 'a {
    facts
        .processes
        .iter()
        .filter(move |(_, p)| p.may_be_operators(operator_namespace))
}

/// The operand processes in `facts` that run under an operand's name in a pod that is not the
/// Operator's (pure): ignored, and said so.
pub fn ignored_processes<'a>(
    facts: &'a Facts,
    operator_namespace: &'a str,
) -> impl Iterator<Item = &'a (Operand, Process)> + 'a {
    facts
        .processes
        .iter()
        .filter(move |(_, p)| !p.may_be_operators(operator_namespace))
}

/// The conflicts in `facts` (pure): each live socket at a path the agent serves, a running
/// mig-manager while MIG is the agent's, the Operator's toolkit in the engines' configs while
/// the runtime stage is on, a driver container while the agent installs the driver. Only the
/// processes that may be the Operator's (installed in `operator_namespace`) count.
pub fn conflicts(facts: &Facts, roles: &Roles, operator_namespace: &str) -> Vec<Conflict> {
    let mut out = Vec::new();
    for (path, process) in &facts.live_sockets {
        let operand = process
            .as_ref()
            .and_then(|p| p.program.as_deref())
            .and_then(Operand::of_program)
            .unwrap_or(if path.what.starts_with("DRA") {
                Operand::DraDriver
            } else {
                Operand::DevicePlugin
            });
        out.push(Conflict {
            operand,
            process: process.clone(),
            seen: format!("it serves {}", path.host.display()),
            held_back: format!("the agent does not serve {} while it does", path.what),
            advice: advice(operand),
        });
    }
    if roles.mig
        && let Some((_, p)) = operators_processes(facts, operator_namespace).find(|(o, _)| *o == Operand::MigManager)
    {
        out.push(Conflict {
            operand: Operand::MigManager,
            process: Some(p.clone()),
            seen: "process".into(),
            held_back: "the agent makes no MIG change while it runs (two MIG appliers on one GPU undo each \
                        other's work)"
                .into(),
            advice: advice(Operand::MigManager),
        });
    }
    // The config alone is not enough (the NVIDIA docs have people write that path by hand, and
    // a toolkit container killed without its cleanup leaves it): its container runs, or the
    // validator saw it ready.
    let toolkit_runs = operators_processes(facts, operator_namespace).any(|(o, _)| *o == Operand::ContainerToolkit)
        || facts.validations.iter().any(|v| v == "toolkit-ready");
    if roles.runtime && !facts.toolkit_configs.is_empty() && toolkit_runs {
        let files: Vec<String> = facts.toolkit_configs.iter().map(|f| f.display().to_string()).collect();
        out.push(Conflict {
            operand: Operand::ContainerToolkit,
            process: operators_processes(facts, operator_namespace)
                .find(|(o, _)| *o == Operand::ContainerToolkit)
                .map(|(_, p)| p.clone()),
            seen: format!("{} names {TOOLKIT_DIR}/nvidia-container-runtime", files.join(", ")),
            held_back: "the agent leaves the engines' configs to it (its runtime serves GPU containers) and \
                        writes none"
                .into(),
            advice: advice(Operand::ContainerToolkit),
        });
    }
    if roles.driver && facts.driver_container {
        out.push(Conflict {
            operand: Operand::Driver,
            process: None,
            seen: format!("{DRIVER_CONTAINER_ROOT} is populated"),
            held_back: "the agent's driver source is not used while the driver container provides the driver".into(),
            advice: advice(Operand::Driver),
        });
    }
    out
}

/// The operands the agent replaces with its config, whose deploy labels a migration sets to
/// `false`. The driver only when the agent installs it (`source` other than `none`: on a node
/// whose driver comes from the Operator's container, withdrawing it would take the driver
/// away); the validator only when the toolkit and the device plugin are both the agent's (the
/// Operator's other operands wait for its ready files).
pub fn replaced(roles: &Roles) -> Vec<Operand> {
    let mut out = Vec::new();
    for (on, operand) in [
        (roles.driver, Operand::Driver),
        (roles.runtime, Operand::ContainerToolkit),
        (roles.device_plugin, Operand::DevicePlugin),
        (roles.features, Operand::GpuFeatureDiscovery),
        (roles.mig, Operand::MigManager),
        (roles.metrics, Operand::DcgmExporter),
        (
            roles.validation && roles.runtime && roles.device_plugin,
            Operand::OperatorValidator,
        ),
        (roles.dra, Operand::DraDriver),
    ] {
        if on {
            out.push(operand);
        }
    }
    out
}

/// The value the agent sets on each replaced operand's deploy label.
pub const WITHDRAWN: &str = "false";

/// What a migration changed: each deploy label's value before (`None`: it was not set), kept in
/// the state dir so `migrate --undo` puts back exactly that.
pub type Previous = BTreeMap<String, Option<String>>;

/// File under the state dir with [`Previous`], `key=value` or `key` (was unset) per line.
pub const PREVIOUS_FILE: &str = "operator-deploy-labels";

/// What [`PREVIOUS_FILE`] keeps: the Node whose deploy labels were set, and their previous
/// values. Put back on that Node, whatever names the node where the undo runs (a package removal
/// may run with an admin shell's `NODE_NAME`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// The Node patched; `None` in a record written before it was kept.
    pub node: Option<String>,
    pub labels: Previous,
}

/// [`PREVIOUS_FILE`]'s line naming the Node (older versions skip it: not a deploy label).
const NODE_LINE: &str = "node=";

/// Parses [`PREVIOUS_FILE`]'s text, with or without its `node=` line (a name that is not a Node
/// name is not taken).
pub fn parse_record(text: &str) -> Record {
    let node = text
        .lines()
        .find_map(|l| l.trim().strip_prefix(NODE_LINE))
        .map(str::trim)
        .filter(|n| crate::names::is_dns_subdomain(n))
        .map(str::to_string);
    Record {
        node,
        labels: parse_previous(text),
    }
}

/// [`PREVIOUS_FILE`]'s text for `record`.
pub fn render_record(record: &Record) -> String {
    let node = record
        .node
        .as_deref()
        .map(|n| format!("{NODE_LINE}{n}\n"))
        .unwrap_or_default();
    node + &render_previous(&record.labels)
}

/// The record after withdrawing `operands` on Node `node` with `current` labels, and the patch
/// that does it (pure; [`withdraw_patch`]). An error when the record is another Node's (its
/// labels must go back there first).
pub fn withdraw_record(
    current: &BTreeMap<String, String>,
    operands: &[Operand],
    recorded: &Record,
    node: &str,
) -> Result<(BTreeMap<String, Option<String>>, Record), String> {
    if let Some(other) = recorded.node.as_deref().filter(|n| *n != node)
        && !recorded.labels.is_empty()
    {
        return Err(format!(
            "the deploy labels recorded in {PREVIOUS_FILE} were set on node {other}, not {node}: put them back \
             there first (`gpu-node-agent migrate --undo`)"
        ));
    }
    let (patch, labels) = withdraw_patch(current, operands, &recorded.labels);
    Ok((
        patch,
        Record {
            node: Some(node.to_string()),
            labels,
        },
    ))
}

/// Parses [`PREVIOUS_FILE`]'s text.
pub fn parse_previous(text: &str) -> Previous {
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with(DEPLOY_LABEL_PREFIX))
        .map(|l| match l.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (l.to_string(), None),
        })
        .collect()
}

/// [`PREVIOUS_FILE`]'s text for `previous`.
pub fn render_previous(previous: &Previous) -> String {
    previous
        .iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}\n"),
            None => format!("{k}\n"),
        })
        .collect()
}

/// The withdrawal (pure): the label patch that sets each of `operands`' deploy labels to
/// [`WITHDRAWN`] on a Node with `current` labels, and the record of previous values with the
/// new keys added (a key already recorded keeps its first value: a second run must not record
/// `false` as what was there).
pub fn withdraw_patch(
    current: &BTreeMap<String, String>,
    operands: &[Operand],
    recorded: &Previous,
) -> (BTreeMap<String, Option<String>>, Previous) {
    let mut patch = BTreeMap::new();
    let mut previous = recorded.clone();
    for operand in operands {
        let key = operand.deploy_label();
        let now = current.get(&key);
        if now.map(String::as_str) != Some(WITHDRAWN) {
            patch.insert(key.clone(), Some(WITHDRAWN.to_string()));
        }
        previous.entry(key).or_insert_with(|| now.cloned());
    }
    (patch, previous)
}

/// The undo (pure): each recorded key back to its previous value (removed when it was unset),
/// except where someone has since set it to something other than [`WITHDRAWN`] (theirs now).
pub fn restore_patch(current: &BTreeMap<String, String>, previous: &Previous) -> BTreeMap<String, Option<String>> {
    previous
        .iter()
        .filter(|(k, v)| current.get(*k).map(String::as_str) == Some(WITHDRAWN) && v.as_deref() != Some(WITHDRAWN))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn programs_are_known_by_full_name_and_by_their_cut_comm() {
        assert_eq!(Operand::of_program("nvidia-mig-manager"), Some(Operand::MigManager));
        assert_eq!(Operand::of_program("nvidia-mig-mana\n"), Some(Operand::MigManager));
        assert_eq!(Operand::of_program("nvidia-device-p"), Some(Operand::DevicePlugin));
        assert_eq!(Operand::of_program("nvidia-device-plugin"), Some(Operand::DevicePlugin));
        assert_eq!(Operand::of_program("gpu-node-agent"), None);
        assert_eq!(Operand::of_program(""), None);
        assert_eq!(Operand::MigManager.deploy_label(), "nvidia.com/gpu.deploy.mig-manager");
    }

    /// Any pod can run a process named like an operand, with whatever argv[0] it likes: the
    /// name that goes into status, the log and Events is cut short and has no line breaks or
    /// terminal escapes, and no more than the start of its `cmdline` is read.
    #[test]
    fn a_process_chosen_name_is_bounded_and_printable() {
        let dir = tempfile::tempdir().expect("tmp");
        let proc_dir = dir.path().join("proc/4242");
        std::fs::create_dir_all(&proc_dir).expect("mkdir");
        std::fs::write(proc_dir.join("comm"), "nvidia-mig-mana\n").expect("comm");
        let mut cmdline = b"/x/evil\nGPU Operator: all clear\x1b[2J".to_vec();
        cmdline.extend(std::iter::repeat_n(b'a', 2 << 20));
        cmdline.extend(b"\0--flag\0");
        std::fs::write(proc_dir.join("cmdline"), &cmdline).expect("cmdline");
        let found = operand_processes(&HostRoot::new(dir.path()));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, Operand::MigManager);
        let program = found[0].1.program.clone().expect("a name");
        assert!(program.starts_with("evil?GPU Operator: all clear?[2J"), "{program}");
        assert!(program.len() <= PROGRAM_MAX + 3, "{} bytes", program.len());
        assert!(
            program.bytes().all(|b| b.is_ascii_graphic() || b == b' '),
            "{program:?}"
        );
        // A comm set with prctl may hold control characters too.
        std::fs::write(proc_dir.join("cmdline"), "").expect("no cmdline");
        std::fs::write(proc_dir.join("comm"), "a\x1b]0;x\x07b\n").expect("comm");
        assert_eq!(
            program_of(&HostRoot::new(dir.path()), 4242).as_deref(),
            Some("a?]0;x?b")
        );
    }

    #[test]
    fn withdrawal_records_what_was_there_once_and_undo_puts_it_back() {
        let current = map(&[
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
            ("nvidia.com/gpu.deploy.driver", "pre-installed"),
        ]);
        let ops = [Operand::DevicePlugin, Operand::MigManager, Operand::Driver];
        let (patch, previous) = withdraw_patch(&current, &ops, &Previous::new());
        assert_eq!(patch.len(), 3);
        assert!(patch.values().all(|v| v.as_deref() == Some("false")));
        assert_eq!(previous["nvidia.com/gpu.deploy.device-plugin"].as_deref(), Some("true"));
        assert_eq!(previous["nvidia.com/gpu.deploy.mig-manager"], None);
        assert_eq!(parse_previous(&render_previous(&previous)), previous);
        // The record names the Node patched; one without (older) still reads.
        let record = Record {
            node: Some("gpu-node-1".into()),
            labels: previous.clone(),
        };
        let text = render_record(&record);
        assert!(text.starts_with("node=gpu-node-1\n"), "{text}");
        assert_eq!(parse_record(&text), record);
        assert_eq!(parse_previous(&text), previous, "what older versions read");
        let old = parse_record(&render_previous(&previous));
        assert_eq!(old.node, None);
        assert_eq!(old.labels, previous);
        let (p, r) = withdraw_record(&current, &ops, &old, "gpu-node-1").expect("an old record");
        assert_eq!((p, r), (patch.clone(), record.clone()));
        let e = withdraw_record(&current, &ops, &record, "gpu-node-2").expect_err("another node's");
        assert!(e.contains("set on node gpu-node-1, not gpu-node-2"), "{e}");
        // Applied: nothing more to do, and the record keeps the first values.
        let after: BTreeMap<String, String> = patch
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().unwrap_or_default()))
            .collect();
        let (again, kept) = withdraw_patch(&after, &ops, &previous);
        assert!(again.is_empty());
        assert_eq!(kept, previous);
        // Undo: the old values back, the unset one removed; a key someone changed since is theirs.
        let mut later = after.clone();
        later.insert("nvidia.com/gpu.deploy.driver".into(), "true".into());
        let undo = restore_patch(&later, &previous);
        assert_eq!(undo["nvidia.com/gpu.deploy.device-plugin"].as_deref(), Some("true"));
        assert_eq!(undo["nvidia.com/gpu.deploy.mig-manager"], None);
        assert!(!undo.contains_key("nvidia.com/gpu.deploy.driver"));
    }

    #[test]
    fn a_live_foreign_socket_and_a_mig_manager_are_conflicts() {
        let roles = Roles {
            mig: true,
            device_plugin: true,
            ..Roles::default()
        };
        let facts = Facts {
            live_sockets: vec![(
                ServedPath {
                    host: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".into(),
                    what: "nvidia.com/gpu".into(),
                },
                Some(Process {
                    pid: 42,
                    program: Some("nvidia-device-plugin".into()),
                    pod: None,
                    placement: Placement::Host,
                }),
            )],
            processes: vec![(
                Operand::MigManager,
                Process {
                    pid: 43,
                    program: Some("nvidia-mig-manager".into()),
                    pod: Some("pod gpu-operator/nvidia-mig-manager-x7k2p".into()),
                    placement: Placement::Pod {
                        namespace: Some("gpu-operator".into()),
                    },
                },
            )],
            ..Facts::default()
        };
        let found = conflicts(&facts, &roles, "gpu-operator");
        assert_eq!(found.len(), 2);
        let line = found[0].line(false);
        assert!(line.contains("nvidia-device-plugin, pid 42"), "{line}");
        assert!(line.contains("nvidia.com/gpu.deploy.device-plugin=false"), "{line}");
        assert!(found[0].line(true).starts_with("waiting for NVIDIA's device plugin"));
        assert_eq!(found[1].operand, Operand::MigManager);
        let line = found[1].line(false);
        assert!(
            line.contains("(nvidia-mig-manager, pid 43, pod gpu-operator/nvidia-mig-manager-x7k2p)"),
            "{line}"
        );
    }

    /// A process under an operand's name counts as the Operator's outside the pods (a host
    /// service), and in a pod only in the Operator's namespace: a tenant's pod, or one whose
    /// namespace is not known, holds back neither MIG nor the engine configs.
    #[test]
    fn only_the_operators_namespace_or_the_host_runs_its_operands() {
        let roles = Roles {
            mig: true,
            runtime: true,
            ..Roles::default()
        };
        let process = |pid: i32, program: &str, placement: Placement| Process {
            pid,
            program: Some(program.into()),
            pod: None,
            placement,
        };
        let in_ns = |ns: &str| Placement::Pod {
            namespace: Some(ns.into()),
        };
        let facts = |placement: Placement| Facts {
            processes: vec![
                (
                    Operand::ContainerToolkit,
                    process(10, "nvidia-toolkit", placement.clone()),
                ),
                (Operand::MigManager, process(11, "nvidia-mig-manager", placement)),
            ],
            toolkit_configs: vec!["/etc/containerd/config.toml".into()],
            ..Facts::default()
        };
        let operands =
            |f: &Facts, ns: &str| -> Vec<Operand> { conflicts(f, &roles, ns).iter().map(|c| c.operand).collect() };
        let both = vec![Operand::MigManager, Operand::ContainerToolkit];
        assert_eq!(operands(&facts(Placement::Host), "gpu-operator"), both);
        assert_eq!(operands(&facts(in_ns("gpu-operator")), "gpu-operator"), both);
        assert_eq!(
            operands(&facts(in_ns("nvidia-gpu-operator")), "nvidia-gpu-operator"),
            both
        );
        for tenant in [in_ns("tenant-a"), Placement::Pod { namespace: None }] {
            let f = facts(tenant.clone());
            assert!(operands(&f, "gpu-operator").is_empty(), "{tenant:?}");
            let ignored: Vec<i32> = ignored_processes(&f, "gpu-operator").map(|(_, p)| p.pid).collect();
            assert_eq!(ignored, vec![10, 11], "{tenant:?}");
            assert_eq!(operators_processes(&f, "gpu-operator").count(), 0);
        }
        // The validator's ready file still says the toolkit runs, whoever else does.
        let mut f = facts(in_ns("tenant-a"));
        f.validations = vec!["toolkit-ready".into()];
        let found = conflicts(&f, &roles, "gpu-operator");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].operand, Operand::ContainerToolkit);
        assert_eq!(
            found[0].process, None,
            "the tenant's process is not named as the toolkit"
        );
    }
}
