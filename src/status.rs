//! The agent's status: written atomically to `<run_dir>/status.json` on every change, read by
//! `gpu-node-agent status` (for a person, or `--json` for scripts).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::desired::{ProfileOutcome, ProfileState, Selection, Source};

use crate::host::{WriteError, write_atomic};
pub use crate::plugin::manager::ResourceStatus;

/// Bumped when a field changes meaning; scripts check it.
pub const STATUS_VERSION: u32 = 1;

/// The file name under `[agent] run_dir`.
pub const STATUS_FILE: &str = "status.json";

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

    /// The human view of `gpu-node-agent status`.
    pub fn render(&self, now: u64) -> String {
        let mut out = String::new();
        let age = |t: u64| ago(now.saturating_sub(t));
        let _ = writeln!(
            out,
            "gpu-node-agent {} on {} — {} (pid {}, updated {})",
            self.agent_version,
            self.node,
            self.state,
            self.pid,
            age(self.updated)
        );
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
                (_, Some(e)) => format!("error: {e}"),
                (true, None) => "connected".to_string(),
                (false, None) => "connecting".to_string(),
            };
            let source = match d.source {
                Source::Node => "node labels",
                Source::File => "labels file",
                Source::None => "none",
            };
            let _ = writeln!(out, "\nDESIRED STATE from {source}: {} ({link})", d.detail);
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
            let mig = self.stages.iter().find(|s| s.name == crate::agent::STAGE_MIG).map(|s| {
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
            "\nRESOURCE                    DEVICES  HEALTHY  REGISTERED   ({kubelet})"
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
            let _ = writeln!(out, "{:<27} {:>7}  {:>7}  {}", r.name, r.devices, r.healthy, registered);
            if let Some(e) = &r.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        out
    }
}

fn ago(secs: u64) -> String {
    match secs {
        0..=59 => format!("{secs}s ago"),
        60..=3599 => format!("{}m ago", secs / 60),
        3600..=86399 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
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
            }],
            desired: None,
            labels: BTreeMap::new(),
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
}
