//! The agent's status: written atomically to `<run_dir>/status.json` on every change, read by
//! `gpu-node-agent status` (for a person, or `--json` for scripts).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::desired::{ProfileOutcome, ProfileState, Selection, Source};
use crate::plugin::mps::DaemonStatus;

use crate::config::Config;
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::host::{WriteError, write_atomic};
use crate::plugin::manager::ResourceStatus;
use std::process::ExitCode;

/// Bumped when a field changes meaning; scripts check it.
pub const STATUS_VERSION: u32 = 1;

/// The file name under `[agent] run_dir`.
pub const STATUS_FILE: &str = "status.json";

/// The agent's stages, in the order a pass runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StageId {
    Driver,
    Runtime,
    Mig,
    DevicePlugin,
    Validation,
}

impl StageId {
    /// Every stage, in pass order.
    pub const ALL: [StageId; 5] = [
        StageId::Driver,
        StageId::Runtime,
        StageId::Mig,
        StageId::DevicePlugin,
        StageId::Validation,
    ];

    /// The name status.json, logs and metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            StageId::Driver => "driver",
            StageId::Runtime => "runtime",
            StageId::Mig => "mig",
            StageId::DevicePlugin => "device-plugin",
            StageId::Validation => "validation",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageState {
    /// Not run yet, or waiting for something outside the agent (kubelet, GPU work to finish).
    Pending,
    Ok,
    Failed,
    /// Turned off in the config.
    Disabled,
    /// Not applicable to this run (e.g. the device plugin under `run --once`).
    Skipped,
}

impl StageState {
    /// The word status.json and `status` use.
    pub fn as_str(self) -> &'static str {
        match self {
            StageState::Pending => "pending",
            StageState::Ok => "ok",
            StageState::Failed => "failed",
            StageState::Disabled => "disabled",
            StageState::Skipped => "skipped",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageStatus {
    pub name: String,
    pub state: StageState,
    /// Unix seconds of the last state change.
    pub since: u64,
    /// What went wrong, for `failed` (and why it waits, for `pending`).
    pub error: Option<String>,
    /// One line on what the stage did.
    pub detail: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_mib: u64,
    pub pci_bus_id: String,
    pub health: String,
    pub reason: Option<String>,
    pub mig_enabled: Option<bool>,
    pub mig_devices: Vec<MigStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigStatus {
    pub uuid: String,
    pub profile: String,
    pub gi_id: u32,
    pub ci_id: u32,
    pub health: String,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub version: u32,
    pub agent_version: String,
    pub node: String,
    pub pid: u32,
    /// `running`, `stopped`, or `once` for a `run --once` that finished.
    pub state: String,
    pub updated: u64,
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<String>,
    pub stages: Vec<StageStatus>,
    pub gpus: Vec<GpuStatus>,
    pub kubelet_present: bool,
    pub resources: Vec<ResourceStatus>,
    /// Where the desired state comes from and what it asks for.
    #[serde(default)]
    pub desired: Option<DesiredStatus>,
    /// The labels the agent reports on its Node (also shown when there is no Node).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The MPS control daemons the agent runs (`strategy = "mps"`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps: Vec<DaemonStatus>,
    /// The DRA driver (`[dra] enabled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<crate::dra::DraStatus>,
    /// The `/dev/char` links to the NVIDIA device nodes (`[driver] create_dev_char_links`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dev_char: Option<DevCharStatus>,
    /// NVIDIA's GPU Operator operands on this node, what the agent holds back for them, and
    /// the migration (`[kubernetes] withdraw_operator_operands`, `gpu-node-agent migrate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<OperatorStatus>,
}

/// The GPU Operator beside the agent ([`crate::host::operator`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OperatorStatus {
    /// One line per conflict: the operand, its program and pid, what the agent holds back, and
    /// what to do (or, while withdrawing, `waiting for ... to leave`).
    pub conflicts: Vec<String>,
    /// The same, as data.
    #[serde(default)]
    pub details: Vec<crate::host::operator::Conflict>,
    /// The agent withdraws the operands it replaces (`[kubernetes] withdraw_operator_operands`).
    #[serde(default)]
    pub withdrawing: bool,
    /// The deploy labels the agent set (`nvidia.com/gpu.deploy.<operand>=false`), with the
    /// value each had before (`migrate --undo` puts it back).
    #[serde(default)]
    pub withdrawn: BTreeMap<String, Option<String>>,
    /// The last failure to write the deploy labels.
    #[serde(default)]
    pub error: Option<String>,
}

/// The `/dev/char/<major>:<minor>` links to the NVIDIA device nodes, as last looked at.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DevCharStatus {
    /// Every link in place: `/dev/char/195:0 -> ../nvidia0`.
    pub links: Vec<String>,
    /// How many of them the agent made (removed by `runtime unconfigure`).
    pub made_by_agent: usize,
    /// What is left alone and why (a link pointing elsewhere, `/dev/char` not a directory, ...).
    #[serde(default)]
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DesiredStatus {
    pub source: Source,
    pub detail: String,
    pub connected: bool,
    pub error: Option<String>,
    pub mig_config: Selection,
    pub device_plugin_config: Selection,
    pub profile: ProfileOutcome,
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Status {
    pub fn write(&self, run_dir: &Path) -> Result<(), WriteError> {
        let mut json = serde_json::to_vec_pretty(self).unwrap_or_default();
        json.push(b'\n');
        write_atomic(&run_dir.join(STATUS_FILE), &json, 0o644)
    }

    /// Parses status.json text.
    pub fn parse(text: &str) -> Result<Status, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The human view of `gpu-node-agent status`, as the file says (see [`report`] for the view
    /// that checks the agent still runs).
    pub fn render(&self, now: u64) -> String {
        self.render_checked(now, None)
    }

    /// Why the agent that wrote this status is not running although the status says `running`
    /// (see [`agent_process`]; `proc` is the live `/proc`); `None` when it runs, or when the
    /// status does not say `running`.
    pub fn stale_reason(&self, proc: &Path) -> Option<String> {
        (self.state == "running")
            .then(|| agent_process(proc, self.pid).err())
            .flatten()
    }

    /// [`Status::render`]; `stale`: why the agent the status says is running is not.
    fn render_checked(&self, now: u64, stale: Option<&str>) -> String {
        let mut out = String::new();
        let age = |t: u64| ago(now.saturating_sub(t));
        match stale {
            None => {
                let _ = writeln!(
                    out,
                    "gpu-node-agent {} on {} — {} (pid {}, updated {})",
                    self.agent_version,
                    self.node,
                    self.state,
                    self.pid,
                    age(self.updated)
                );
            }
            Some(why) => {
                // `updated` comes from the file: one past what SystemTime holds is shown as it is.
                let written = UNIX_EPOCH
                    .checked_add(Duration::from_secs(self.updated))
                    .map_or_else(|| format!("{}s after 1970", self.updated), crate::kube::format_rfc3339);
                let _ = writeln!(
                    out,
                    "gpu-node-agent {} on {} — not running (status from {}, {}): {why}; what follows is what it last \
                     reported",
                    self.agent_version,
                    self.node,
                    written,
                    age(self.updated)
                );
            }
        }
        if let Some(driver) = &self.driver_version {
            let cuda = self.cuda_driver_version.as_deref().unwrap_or("?");
            let _ = writeln!(out, "driver {driver}, CUDA {cuda}");
        }
        let _ = writeln!(out, "\nSTAGE            STATE     SINCE        DETAIL");
        for s in &self.stages {
            let state = format!("{:?}", s.state).to_lowercase();
            let detail = s
                .error
                .as_deref()
                .map(|e| format!("error: {e}"))
                .or_else(|| s.detail.clone())
                .unwrap_or_default();
            let _ = writeln!(out, "{:<16} {:<9} {:<12} {}", s.name, state, age(s.since), detail);
        }
        let _ = writeln!(
            out,
            "\nGPU  UUID                                      NAME                      MEMORY     HEALTH"
        );
        if self.gpus.is_empty() {
            let _ = writeln!(out, "(none)");
        }
        for g in &self.gpus {
            let mig = match g.mig_enabled {
                Some(true) => " [MIG]",
                _ => "",
            };
            let reason = g.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
            let _ = writeln!(
                out,
                "{:<4} {:<41} {:<25} {:>6} MiB {}{}{}",
                g.index, g.uuid, g.name, g.memory_mib, g.health, reason, mig
            );
            for m in &g.mig_devices {
                let reason = m.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "  └ {:<40} {:<25} gi {} ci {} {}{}",
                    m.uuid, m.profile, m.gi_id, m.ci_id, m.health, reason
                );
            }
        }
        if let Some(d) = &self.desired {
            let link = match (d.connected, &d.error) {
                (_, Some(e)) => format!(" (error: {e})"),
                (true, None) => " (connected)".to_string(),
                // No source: the detail says why; there is nothing to connect to.
                (false, None) if d.source == Source::None => String::new(),
                (false, None) => " (connecting)".to_string(),
            };
            let source = match d.source {
                Source::Node => "node labels",
                Source::File => "labels file",
                Source::None => "none",
            };
            let _ = writeln!(out, "\nDESIRED STATE from {source}: {}{link}", d.detail);
            let show = |s: &Selection| match s {
                Selection::Unset => "(not set)".to_string(),
                Selection::Name { name } => name.clone(),
                Selection::Invalid { value, reason } => format!("{value:?} (invalid: {reason})"),
            };
            let state = match d.profile.state {
                ProfileState::None => "default".to_string(),
                ProfileState::Success => format!("success, applied {}", d.profile.applied.as_deref().unwrap_or("-")),
                ProfileState::Failed => format!("failed: {}", d.profile.reason.as_deref().unwrap_or("?")),
            };
            let _ = writeln!(
                out,
                "  device plugin profile  {}  [{state}]",
                show(&d.device_plugin_config)
            );
            let mig = self.stages.iter().find(|s| s.name == StageId::Mig.as_str()).map(|s| {
                let text = s.error.as_deref().or(s.detail.as_deref()).unwrap_or("-");
                format!("{}: {text}", s.state.as_str())
            });
            let _ = writeln!(
                out,
                "  MIG layout             {}  [{}]",
                show(&d.mig_config),
                mig.as_deref().unwrap_or("see the mig stage")
            );
        }
        if let Some(op) = &self.operator
            && (!op.conflicts.is_empty() || !op.withdrawn.is_empty() || op.error.is_some())
        {
            let _ = writeln!(out, "\nGPU OPERATOR on this node");
            for c in &op.conflicts {
                let _ = writeln!(out, "  {c}");
            }
            if !op.withdrawn.is_empty() {
                let keys: Vec<&str> = op.withdrawn.keys().map(String::as_str).collect();
                let _ = writeln!(out, "  withdrawn (=false): {}", keys.join(", "));
            }
            if let Some(e) = &op.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        if !self.labels.is_empty() {
            let _ = writeln!(out, "\nREPORTED LABELS ({})", self.labels.len());
            for (k, v) in &self.labels {
                let _ = writeln!(out, "  {k}={v}");
            }
        }
        let kubelet = if self.kubelet_present {
            "kubelet present"
        } else {
            "kubelet not found"
        };
        let _ = writeln!(
            out,
            "\nRESOURCE                    DEVICES  HEALTHY  STREAMS  LISTED  REGISTERED   ({kubelet})"
        );
        if self.resources.is_empty() {
            let _ = writeln!(out, "(none)");
        }
        for r in &self.resources {
            let registered = match (r.registered, r.registered_at) {
                (true, Some(t)) => age(t),
                (true, None) => "yes".into(),
                (false, _) => "no".into(),
            };
            // STREAMS: the kubelet's open ListAndWatch streams; LISTED: devices in the last message.
            let listed = r.devices_sent.map_or("-".to_string(), |n| n.to_string());
            let _ = writeln!(
                out,
                "{:<27} {:>7}  {:>7}  {:>7}  {:>6}  {}",
                r.name, r.devices, r.healthy, r.streams_open, listed, registered
            );
            if let Some(e) = &r.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        for d in &self.mps {
            let state = serde_json::to_value(d.state)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let pid = d.pid.map(|p| format!(", pid {p}")).unwrap_or_default();
            let _ = writeln!(
                out,
                "\nMPS control daemon {}: {state}{pid}, pipe {}, GPU(s) {}, {} restart(s)",
                d.resource,
                d.pipe_dir,
                d.gpus.join(","),
                d.restarts
            );
            if let Some(e) = &d.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        if let Some(d) = &self.dev_char {
            let _ = writeln!(
                out,
                "\n/dev/char links (systemd's device rules): {} to the NVIDIA device nodes, {} made by the agent",
                d.links.len(),
                d.made_by_agent
            );
            for p in &d.problems {
                let _ = writeln!(out, "  warning: {p}");
            }
        }
        if let Some(d) = &self.dra {
            let registered = match (d.registered, d.registered_at) {
                (true, Some(t)) => format!("registered {}", age(t)),
                (true, None) => "registered".into(),
                (false, _) => "not registered".into(),
            };
            let _ = writeln!(
                out,
                "\nDRA driver {}: {registered}, {} device(s) published (pool generation {}), {} claim(s) prepared",
                d.driver,
                d.published,
                d.generation,
                d.prepared.len()
            );
            if !d.prepared.is_empty() {
                let _ = writeln!(out, "  claims: {}", d.prepared.join(", "));
            }
            if let Some(e) = &d.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        out
    }
}

/// What `gpu-node-agent status` prints for status.json `text`, the agent's process looked for in
/// `proc` (the live `/proc`, never the one under `--root`: the pid in the file is a process of
/// this kernel, whatever root the agent was given): the human view,
/// or (`json`) the file as written with two fields added: `agent_running` (the file says
/// `running` and its pid is a live gpu-node-agent) and, when the file says `running` but the agent
/// is not, `stale_reason`. A status whose agent is gone shows as not running, with when it was
/// written.
pub fn report(text: &str, proc: &Path, json: bool, now: u64) -> Result<String, serde_json::Error> {
    if json {
        let value: serde_json::Value = serde_json::from_str(text)?;
        let state = value.get("state").and_then(|s| s.as_str()).unwrap_or_default();
        let pid = value.get("pid").and_then(|p| p.as_u64()).unwrap_or(0);
        let stale = match state {
            "running" => agent_process(proc, u32::try_from(pid).unwrap_or(0)).err(),
            _ => None,
        };
        let mut added = format!("\"agent_running\": {}", state == "running" && stale.is_none());
        if let Some(why) = &stale {
            added.push_str(&format!(
                ",\n  \"stale_reason\": {}",
                serde_json::Value::from(why.as_str())
            ));
        }
        // Spliced in before the closing brace: the file's own fields stay as written, in order.
        let body = text.trim_end();
        let Some(inner) = body.strip_suffix('}') else {
            return Ok(text.to_string());
        };
        let inner = inner.trim_end();
        let sep = if inner.ends_with('{') { "" } else { "," };
        return Ok(format!("{inner}{sep}\n  {added}\n}}\n"));
    }
    let status = Status::parse(text)?;
    let stale = status.stale_reason(proc);
    Ok(status.render_checked(now, stale.as_deref()))
}

/// Whether `pid` is a running gpu-node-agent, from `<proc>/<pid>` (`proc` is `/proc`, a temp dir
/// in tests): `Err` says why not (no such process, or the pid now belongs to another program).
/// Where `<proc>/<pid>` is there but neither `comm` nor `cmdline` can be read, it counts as
/// running.
pub fn agent_process(proc: &Path, pid: u32) -> Result<(), String> {
    if pid == 0 {
        return Err("the status records no pid".into());
    }
    let dir = proc.join(pid.to_string());
    if !dir.is_dir() {
        return Err(format!("no process {pid}"));
    }
    // The agent's own name, and this binary's where it was installed under another one.
    let mut names = vec!["gpu-node-agent".to_string()];
    if let Some(own) = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    {
        names.push(own);
    }
    // The kernel keeps the first 15 bytes of the name in `comm`.
    let comm = std::fs::read_to_string(dir.join("comm"))
        .ok()
        .map(|c| c.trim_end_matches('\n').to_string());
    let argv0 = std::fs::read(dir.join("cmdline")).ok().and_then(|b| {
        let first = b.split(|&c| c == 0).next().unwrap_or_default();
        let first = String::from_utf8_lossy(first).into_owned();
        (!first.is_empty()).then(|| {
            Path::new(&first)
                .file_name()
                .map_or(first.clone(), |n| n.to_string_lossy().into_owned())
        })
    });
    if comm.is_none() && argv0.is_none() {
        return Ok(());
    }
    let is_agent = |name: &str| {
        names.iter().any(|n| {
            let short: String = n.chars().take(15).collect();
            name == n || name == short
        })
    };
    if comm.as_deref().is_some_and(is_agent) || argv0.as_deref().is_some_and(is_agent) {
        return Ok(());
    }
    let other = comm.or(argv0).unwrap_or_default();
    Err(format!("pid {pid} is now another program ({other})"))
}

fn ago(secs: u64) -> String {
    match secs {
        0..=59 => format!("{secs}s ago"),
        60..=3599 => format!("{}m ago", secs / 60),
        3600..=86399 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

/// The kernel's process table: the pid in status.json is this kernel's, whatever `--root` says.
const LIVE_PROC: &str = "/proc";

/// `gpu-node-agent status`: the running agent's status file, for a person or as JSON. Exits 0
/// while the agent runs (or for a `run --once` report), 3 (not running) otherwise.
pub fn status_command(config: &Config, root: &HostRoot, json: bool) -> ExitCode {
    let path = root.join(&config.agent.run_dir).join(STATUS_FILE);
    let text = match crate::host::read_text(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!(
                "gpu-node-agent: no status at {} ({e}): is the agent running? (systemctl status gpu-node-agent)",
                path.display()
            );
            return Exit::NotRunning.into();
        }
    };
    match crate::status::report(&text, Path::new(LIVE_PROC), json, now_unix()) {
        Ok(out) => {
            print!("{out}");
            // LSB status codes: 3 for a daemon that is not running (stopped, or gone without
            // saying so); a `run --once` report is a finished run, not a stopped daemon.
            match Status::parse(&text) {
                Ok(s) if s.state == "running" && s.stale_reason(Path::new(LIVE_PROC)).is_none() => ExitCode::SUCCESS,
                Ok(s) if s.state == "once" => ExitCode::SUCCESS,
                _ => Exit::NotRunning.into(),
            }
        }
        Err(e) => {
            eprintln!(
                "gpu-node-agent: {} is not a status file this version understands: {e}",
                path.display()
            );
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Status {
        Status {
            version: STATUS_VERSION,
            agent_version: "0.1.0".into(),
            node: "gpu-1".into(),
            pid: 42,
            state: "running".into(),
            updated: 1000,
            driver_version: Some("550.54.15".into()),
            cuda_driver_version: Some("12.4".into()),
            stages: vec![StageStatus {
                name: "device-plugin".into(),
                state: StageState::Ok,
                since: 990,
                error: None,
                detail: Some("1 resource, 8 devices".into()),
            }],
            gpus: vec![GpuStatus {
                index: 0,
                uuid: "GPU-1".into(),
                name: "NVIDIA A100-SXM4-40GB".into(),
                memory_mib: 40960,
                pci_bus_id: "00000000:10:00.0".into(),
                health: "Unhealthy".into(),
                reason: Some("critical Xid 79".into()),
                mig_enabled: Some(false),
                mig_devices: vec![],
            }],
            kubelet_present: true,
            resources: vec![ResourceStatus {
                name: "nvidia.com/gpu".into(),
                socket: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".into(),
                registered: true,
                registered_at: Some(995),
                devices: 8,
                healthy: 7,
                error: None,
                streams_open: 1,
                devices_sent: Some(7),
            }],
            desired: None,
            labels: BTreeMap::new(),
            mps: Vec::new(),
            dra: None,
            dev_char: None,
            operator: None,
        }
    }

    #[test]
    fn round_trips_through_json_and_renders_for_a_person() {
        let status = sample();
        let dir = tempfile::tempdir().expect("tempdir");
        status.write(dir.path()).expect("write");
        let text = std::fs::read_to_string(dir.path().join(STATUS_FILE)).expect("read");
        assert_eq!(Status::parse(&text).expect("parse"), status);
        let view = status.render(1005);
        assert!(view.contains("device-plugin    ok"), "{view}");
        assert!(view.contains("Unhealthy (critical Xid 79)"), "{view}");
        assert!(view.contains("nvidia.com/gpu"), "{view}");
        assert!(view.contains("10s ago"), "{view}");
    }

    /// The `/dev/char` links (issue 33): how many are in place and how many the agent made, with
    /// what it left alone; older status files without the field still parse.
    #[test]
    fn the_dev_char_links_have_a_line() {
        let status = Status {
            dev_char: Some(DevCharStatus {
                links: vec![
                    "/dev/char/195:255 -> ../nvidiactl".into(),
                    "/dev/char/195:0 -> ../nvidia0".into(),
                ],
                made_by_agent: 1,
                problems: vec!["/dev/char/195:1 points to ../sdb, not to /dev/nvidia1: left as it is".into()],
            }),
            ..sample()
        };
        let view = status.render(1005);
        assert!(
            view.contains(
                "\n/dev/char links (systemd's device rules): 2 to the NVIDIA device nodes, 1 made by the agent\n  \
                 warning: /dev/char/195:1 points to ../sdb, not to /dev/nvidia1: left as it is\n"
            ),
            "{view}"
        );
        let json = serde_json::to_string(&status).expect("json");
        assert_eq!(Status::parse(&json).expect("parse"), status);
        let without = serde_json::to_string(&sample()).expect("json");
        assert!(!without.contains("dev_char"), "{without}");
        assert!(!sample().render(1005).contains("/dev/char"));
    }

    /// Found by the property tests (issue 15): a status file saying `running` for a process that
    /// is gone, with an `updated` past what `SystemTime` holds, made `gpu-node-agent status`
    /// panic ("overflow when adding duration to instant") instead of reporting it.
    #[test]
    fn a_stale_status_with_a_huge_timestamp_is_reported() {
        let proc = tempfile::tempdir().expect("tempdir");
        let status = Status {
            pid: 7,
            updated: u64::MAX,
            ..sample()
        };
        let text = serde_json::to_string(&status).expect("json");
        let view = report(&text, proc.path(), false, 1000).expect("report");
        assert!(
            view.contains("not running (status from 18446744073709551615s after 1970"),
            "{view}"
        );
        let fine = Status { updated: 990, ..status };
        let view = report(&serde_json::to_string(&fine).expect("json"), proc.path(), false, 1000).expect("report");
        assert!(view.contains("(status from 1970-01-01T00:16:30Z, 10s ago)"), "{view}");
    }

    #[test]
    fn the_desired_state_line_says_connecting_only_when_there_is_a_source() {
        let desired = |source: Source, connected: bool| DesiredStatus {
            source,
            detail: "why".into(),
            connected,
            error: None,
            mig_config: Selection::Unset,
            device_plugin_config: Selection::Unset,
            profile: ProfileOutcome {
                applied: None,
                state: ProfileState::None,
                reason: None,
            },
        };
        let line = |d: DesiredStatus| {
            let status = Status {
                desired: Some(d),
                ..sample()
            };
            let view = status.render(1005);
            view.lines()
                .find(|l| l.starts_with("DESIRED STATE"))
                .map(str::to_string)
                .unwrap_or_default()
        };
        assert_eq!(line(desired(Source::None, false)), "DESIRED STATE from none: why");
        assert_eq!(
            line(desired(Source::Node, false)),
            "DESIRED STATE from node labels: why (connecting)"
        );
        assert_eq!(
            line(desired(Source::Node, true)),
            "DESIRED STATE from node labels: why (connected)"
        );
    }

    #[test]
    fn resources_show_the_kubelet_streams() {
        let view = sample().render(1005);
        assert!(
            view.contains("RESOURCE                    DEVICES  HEALTHY  STREAMS  LISTED  REGISTERED"),
            "{view}"
        );
        assert!(
            view.contains("nvidia.com/gpu                    8        7        1       7  10s ago"),
            "{view}"
        );
        // A status.json from before the fields: no stream, nothing listed.
        let mut old: serde_json::Value = serde_json::to_value(sample()).unwrap();
        for key in ["streams_open", "devices_sent"] {
            old["resources"][0].as_object_mut().unwrap().remove(key);
        }
        let old = Status::parse(&old.to_string()).expect("older status.json parses");
        assert_eq!(
            (old.resources[0].streams_open, old.resources[0].devices_sent),
            (0, None)
        );
    }

    #[test]
    fn a_running_status_whose_pid_is_gone_or_reused_is_not_running() {
        let root = tempfile::tempdir().expect("tempdir");
        let text = serde_json::to_string_pretty(&sample()).unwrap();
        let json = |text: &str| -> serde_json::Value {
            serde_json::from_str(&report(text, root.path(), true, 1005).expect("report")).expect("json")
        };

        // No process 42 in this proc dir.
        let out = json(&text);
        assert_eq!(out["agent_running"], false);
        assert_eq!(out["stale_reason"], "no process 42");
        assert_eq!(out["state"], "running", "the file's fields are kept as written");
        assert_eq!(out["resources"][0]["devices_sent"], 7);
        let view = report(&text, root.path(), false, 1005).expect("report");
        assert!(
            view.starts_with(
                "gpu-node-agent 0.1.0 on gpu-1 — not running (status from 1970-01-01T00:16:40Z, 5s ago): no process 42"
            ),
            "{view}"
        );
        assert!(!view.contains("— running"), "{view}");

        // The pid now belongs to another program.
        let proc = root.path().join("42");
        std::fs::create_dir_all(&proc).unwrap();
        std::fs::write(proc.join("comm"), "bash\n").unwrap();
        std::fs::write(proc.join("cmdline"), "/bin/bash\0-l\0").unwrap();
        assert_eq!(json(&text)["stale_reason"], "pid 42 is now another program (bash)");

        // The agent itself.
        std::fs::write(proc.join("comm"), "gpu-node-agent\n").unwrap();
        std::fs::write(proc.join("cmdline"), "/usr/bin/gpu-node-agent\0run\0").unwrap();
        let out = json(&text);
        assert_eq!(out["agent_running"], true);
        assert!(out.get("stale_reason").is_none(), "{out}");
        let view = report(&text, root.path(), false, 1005).expect("report");
        assert!(
            view.starts_with("gpu-node-agent 0.1.0 on gpu-1 — running (pid 42, updated 5s ago)"),
            "{view}"
        );

        // A status that does not say running is not checked.
        let mut once = sample();
        once.state = "once".into();
        once.pid = 7;
        let out = json(&serde_json::to_string(&once).unwrap());
        assert_eq!(out["agent_running"], false);
        assert!(out.get("stale_reason").is_none(), "{out}");
    }
}
