//! The reports: the status file, the Node's labels and Events, and systemd's `STATUS=`. The
//! reporter keeps what it reported last (to write only on change and post an Event for a
//! transition, not at every pass) and reads the stages' public state through a [`Report`].

use std::collections::BTreeMap;

use super::health::SharedTracker;
use super::stage::Stages;
use crate::cluster::{LabelsView, Link};
use crate::config::{Config, DevicePluginConfig};
use crate::desired::{Desired, ProfileOutcome, ProfileState};
use crate::devices::Health;
use crate::edits::{mig_plugin_devices, whole_gpu};
use crate::host::HostRoot;
use crate::kube::EventType;
use crate::labels::gfd::{FeatureInputs, feature_labels};
use crate::mig::stage::MigState as MigLabelState;
use crate::nvml::Inventory;
use crate::plugin::manager::PluginStatus;
use crate::plugin::mps::DaemonStatus;
use crate::plugin::sharing::feature_sharing;
use crate::status::{
    DesiredStatus, DevCharStatus, GpuStatus, MigStatus, OperatorStatus, STATUS_VERSION, StageId, StageState, Status,
    now_unix,
};

/// What the reports read, as it is now: the pass's inputs and every stage's public state.
pub(super) struct Report<'a> {
    pub config: &'a Config,
    pub root: &'a HostRoot,
    pub stages: &'a Stages,
    pub inventory: Option<&'a Inventory>,
    /// Device health, from the health relay's tracker.
    pub tracker: &'a SharedTracker,
    pub plugin: &'a PluginStatus,
    /// The cluster link; none under `run --once` without one.
    pub link: Option<&'a Link>,
    pub view: &'a LabelsView,
    pub desired: &'a Desired,
    pub profile: &'a ProfileOutcome,
    pub dp: &'a DevicePluginConfig,
    /// `nvidia.com/mig.config.state`, when a layout is asked for.
    pub mig_state: Option<MigLabelState>,
    pub mps: Vec<DaemonStatus>,
    pub dra: Option<crate::dra::DraStatus>,
    pub dev_char: Option<DevCharStatus>,
    pub operator: Option<OperatorStatus>,
}

/// The reporter: what it reported last, and where to.
pub(super) struct Reporter {
    /// This node's name, in the status file.
    node: String,
    /// systemd's notify socket (READY, STATUS, WATCHDOG), a no-op outside systemd.
    notifier: crate::notify::Notifier,
    /// The last `STATUS=` sent.
    notified: String,
    /// The last status written (without its timestamp).
    last: Option<Status>,
    /// The machine's DMI product name, for the `gpu.machine` label.
    machine: Option<String>,
    /// A vGPU guest, for the `vgpu.present` label ([`crate::labels::vgpu`]).
    vgpu: bool,
}

impl Reporter {
    pub(super) fn new(root: &HostRoot) -> Reporter {
        Reporter {
            node: crate::host::hostname(root),
            notifier: crate::notify::Notifier::from_env(),
            notified: String::new(),
            last: None,
            machine: machine_name(root),
            vgpu: crate::labels::vgpu::vgpu_present(root),
        }
    }

    /// systemd's notify socket.
    pub(super) fn notifier(&self) -> &crate::notify::Notifier {
        &self.notifier
    }

    /// This node's name.
    pub(super) fn node(&self) -> &str {
        &self.node
    }

    /// `STATUS=` for systemd: each stage's state, with the first problem's reason.
    pub(super) fn notify(&mut self, stages: &Stages, no_gpu: Option<&str>) {
        if !self.notifier.enabled() {
            return;
        }
        if let Some(why) = no_gpu {
            let line = crate::notify::status_line(why);
            if line != self.notified {
                self.notifier.send(&format!("STATUS={line}"));
                self.notified = line;
            }
            return;
        }
        let mut line = stages
            .iter()
            .map(|s| format!("{} {}", s.status.name, s.status.state.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(problem) = stages.iter().find_map(|s| s.status.error.as_deref()) {
            line.push_str(&format!(" — {problem}"));
        }
        let line = crate::notify::status_line(&line);
        if line != self.notified {
            self.notifier.send(&format!("STATUS={line}"));
            self.notified = line;
        }
    }

    /// Writes the status file from `r` as `state` (`running`, `once`, `stopped`), and sends what
    /// changed to the cluster; nothing when only the timestamp would change.
    pub(super) fn write(&mut self, state: &str, r: Report<'_>) {
        let tracker = r.tracker.lock();
        let gpus = r
            .inventory
            .iter()
            .flat_map(|i| i.gpus.iter())
            .map(|g| {
                let reason = tracker.reason(&whole_gpu(g));
                let mig_devices = mig_plugin_devices(g)
                    .filter_map(|d| {
                        let reason = tracker.reason(&d);
                        let mig = d.mig?;
                        Some(MigStatus {
                            uuid: d.uuid,
                            profile: mig.profile,
                            gi_id: mig.gi_id,
                            ci_id: mig.ci_id,
                            health: health_word(&reason).into(),
                            reason,
                        })
                    })
                    .collect();
                GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_mib: g.memory_mib,
                    pci_bus_id: g.pci_bus_id.clone(),
                    health: health_word(&reason).into(),
                    reason,
                    mig_enabled: g.mig.map(|m| m.current),
                    mig_devices,
                }
            })
            .collect();
        drop(tracker);
        let mut status = Status {
            version: STATUS_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            node: self.node.clone(),
            pid: std::process::id(),
            state: state.into(),
            updated: 0,
            driver_version: r.inventory.map(|i| i.driver_version.clone()),
            cuda_driver_version: r.inventory.map(|i| i.cuda_driver_version.clone()),
            stages: r.stages.iter().map(|s| s.status.clone()).collect(),
            gpus,
            kubelet_present: r.plugin.kubelet_present,
            resources: r.plugin.resources.clone(),
            desired: r.link.map(|_| DesiredStatus {
                source: r.view.source,
                detail: r.view.detail.clone(),
                connected: r.view.connected,
                error: r.view.error.clone(),
                mig_config: r.desired.mig_config.clone(),
                device_plugin_config: r.desired.device_plugin_config.clone(),
                profile: r.profile.clone(),
            }),
            labels: self.wanted_labels(&r).unwrap_or_default(),
            mps: r.mps.clone(),
            dra: r.dra.clone(),
            dev_char: r.dev_char.clone(),
            operator: r.operator.clone(),
        };
        // Skip the write when nothing but the timestamp would change.
        if self.last.as_ref() == Some(&status) {
            return;
        }
        self.publish(&r, &status);
        self.last = Some(status.clone());
        status.updated = now_unix();
        let run_dir = r.root.join(&r.config.agent.run_dir);
        if let Err(e) = status.write(&run_dir) {
            tracing::warn!("cannot write status: {e}");
        }
    }

    /// The labels the agent wants on its Node: the GPU feature labels and the profile state.
    /// `None` before the first inventory (nothing is known yet, so nothing is reported).
    fn wanted_labels(&self, r: &Report<'_>) -> Option<BTreeMap<String, String>> {
        let validation = match r.stages[StageId::Validation].status.state {
            StageState::Ok => Some("success"),
            StageState::Failed => Some("failed"),
            StageState::Pending => Some("pending"),
            StageState::Disabled | StageState::Skipped => None,
        };
        Some(node_labels(&NodeLabels {
            config: r.config,
            inventory: r.inventory?,
            dp: r.dp,
            machine: self.machine.as_deref(),
            vgpu: self.vgpu,
            profile: r.profile,
            mig_state: r.mig_state,
            validation,
        }))
    }

    /// Sends what changed to the cluster: the wanted labels, and Events for state transitions
    /// (device plugin stage, profile, GPU health) compared with the last published status.
    fn publish(&self, r: &Report<'_>, status: &Status) {
        let Some(link) = r.link else { return };
        // `status.labels` is what `wanted_labels` gave; before the first inventory it is empty
        // and means "nothing known yet", not "remove everything": report nothing then.
        if r.inventory.is_some() {
            link.report(status.labels.clone());
        }
        let before = self.last.as_ref();
        // MIG: an Event whenever the state label or its reason changes (a second failure with a
        // different reason is news too).
        if let (Some(state), Some(mig)) = (
            r.mig_state,
            status.stages.iter().find(|s| s.name == StageId::Mig.as_str()),
        ) {
            let text = mig.error.clone().or_else(|| mig.detail.clone()).unwrap_or_default();
            let was = before.and_then(|b| b.stages.iter().find(|s| s.name == StageId::Mig.as_str()));
            let was_text = was.map(|m| m.error.clone().or_else(|| m.detail.clone()).unwrap_or_default());
            let was_state = before
                .and_then(|b| b.labels.get(&r.config.labels.mig_config_state))
                .cloned();
            if was_state.as_deref() != Some(state.as_str()) || was_text.as_deref() != Some(text.as_str()) {
                match state {
                    MigLabelState::Success => link.event(EventType::Normal, "MigConfigApplied", text),
                    MigLabelState::Pending => link.event(EventType::Normal, "MigConfigPending", text),
                    MigLabelState::Rebooting => link.event(EventType::Warning, "MigConfigRebooting", text),
                    MigLabelState::Failed => link.event(EventType::Warning, "MigConfigFailed", text),
                }
            }
        }
        // Driver, runtime and validation: an Event when the stage turns failed (not at every
        // failed pass), and when validation passes again after failing. What the driver and
        // runtime stages change is posted where they change it.
        for (id, failed) in [
            (StageId::Driver, "DriverFailed"),
            (StageId::Runtime, "RuntimeFailed"),
            (StageId::Validation, "ValidationFailed"),
        ] {
            let Some(stage) = status.stages.iter().find(|s| s.name == id.as_str()) else {
                continue;
            };
            let was = before
                .and_then(|b| b.stages.iter().find(|s| s.name == id.as_str()))
                .map(|s| s.state);
            match stage.state {
                StageState::Failed if was != Some(StageState::Failed) => link.event(
                    EventType::Warning,
                    failed,
                    format!(
                        "{} stage failed: {}",
                        id.as_str(),
                        stage.error.as_deref().unwrap_or("-")
                    ),
                ),
                StageState::Ok if id == StageId::Validation && was == Some(StageState::Failed) => link.event(
                    EventType::Normal,
                    "ValidationRecovered",
                    format!(
                        "validation passes again: {}",
                        stage.detail.as_deref().unwrap_or("every check passed")
                    ),
                ),
                _ => {}
            }
        }
        let Some(stage) = status.stages.iter().find(|s| s.name == StageId::DevicePlugin.as_str()) else {
            return;
        };
        let stage_before = before
            .and_then(|b| b.stages.iter().find(|s| s.name == StageId::DevicePlugin.as_str()))
            .map(|s| &s.state);
        if stage_before != Some(&stage.state) {
            match stage.state {
                StageState::Ok => link.event(
                    EventType::Normal,
                    "DevicePluginReady",
                    format!(
                        "gpu-node-agent device plugin: {}",
                        stage.detail.as_deref().unwrap_or("ready")
                    ),
                ),
                StageState::Failed => link.event(
                    EventType::Warning,
                    "DevicePluginFailed",
                    format!(
                        "gpu-node-agent device plugin: {}",
                        stage.error.as_deref().unwrap_or("failed")
                    ),
                ),
                _ => {}
            }
        }
        let profile_before = before.and_then(|b| b.desired.as_ref()).map(|d| &d.profile);
        if let Some(d) = &status.desired
            && profile_before != Some(&d.profile)
        {
            match d.profile.state {
                ProfileState::Success => link.event(
                    EventType::Normal,
                    "DevicePluginProfileApplied",
                    format!(
                        "device plugin profile {} applied",
                        d.profile.applied.as_deref().unwrap_or("-")
                    ),
                ),
                ProfileState::Failed => link.event(
                    EventType::Warning,
                    "DevicePluginProfileRejected",
                    d.profile.reason.clone().unwrap_or_default(),
                ),
                ProfileState::None if profile_before.is_some_and(|p| p.state != ProfileState::None) => link.event(
                    EventType::Normal,
                    "DevicePluginProfileCleared",
                    "no device plugin profile selected: the [device_plugin] keys apply as configured".into(),
                ),
                ProfileState::None => {}
            }
        }
        for gpu in &status.gpus {
            let was = before
                .and_then(|b| b.gpus.iter().find(|g| g.uuid == gpu.uuid))
                .map(|g| g.health.as_str());
            if was.unwrap_or(Health::Healthy.as_str()) != gpu.health {
                let what = format!("GPU {} ({})", gpu.index, gpu.uuid);
                match &gpu.reason {
                    Some(reason) => link.event(
                        EventType::Warning,
                        "GpuUnhealthy",
                        format!("{what} is unhealthy: {reason}"),
                    ),
                    None => link.event(EventType::Normal, "GpuHealthy", format!("{what} is healthy again")),
                }
            }
        }
    }
}

/// What the labels the agent writes on its Node are made of.
pub(crate) struct NodeLabels<'a> {
    pub config: &'a Config,
    pub inventory: &'a Inventory,
    /// The effective `[device_plugin]` settings (the selected profile applied).
    pub dp: &'a DevicePluginConfig,
    /// The machine's DMI product name ([`machine_name`]).
    pub machine: Option<&'a str>,
    /// A vGPU guest ([`crate::labels::vgpu::vgpu_present`]).
    pub vgpu: bool,
    pub profile: &'a ProfileOutcome,
    pub mig_state: Option<MigLabelState>,
    /// The validation state label's value, when validation has an answer.
    pub validation: Option<&'a str>,
}

/// The labels the agent wants on its Node: the GPU feature labels and the states.
pub(crate) fn node_labels(n: &NodeLabels<'_>) -> BTreeMap<String, String> {
    let keys = &n.config.labels;
    let shared = feature_sharing(&n.dp.sharing);
    let mut labels = if keys.report_features {
        feature_labels(&FeatureInputs {
            inventory: n.inventory,
            mig_strategy: n.dp.mig_strategy,
            prefix: &keys.feature_prefix,
            machine: n.machine,
            vgpu: n.vgpu,
            sharing_strategy: n.dp.sharing.strategy.as_str(),
            shared: &shared,
        })
    } else {
        BTreeMap::new()
    };
    if let Some(state) = n.profile.state.as_str() {
        labels.insert(keys.device_plugin_config_state.clone(), state.to_string());
    }
    if let Some(state) = n.mig_state {
        labels.insert(keys.mig_config_state.clone(), state.as_str().to_string());
    }
    if let Some(state) = n.validation {
        labels.insert(keys.validation_state.clone(), state.to_string());
    }
    labels
}

/// The machine's DMI product name, for the `gpu.machine` label.
pub(crate) fn machine_name(root: &HostRoot) -> Option<String> {
    std::fs::read_to_string(root.join("/sys/class/dmi/id/product_name"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn health_word(reason: &Option<String>) -> &'static str {
    match reason {
        Some(_) => Health::Unhealthy.as_str(),
        None => Health::Healthy.as_str(),
    }
}
