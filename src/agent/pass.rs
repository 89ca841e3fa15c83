//! What the loop hands a stage, and what a stage hands back. A stage is a value with its own
//! state; the loop calls its step with a [`Pass`], a read-only view of what the pass knows (the
//! config, the root, the inventory, what the labels ask for, the other stages' statuses), and an
//! [`Outbox`] for what the stage tells the others ([`Note`]): its status, an Event to post, the
//! inventory to read again. The loop routes the notes after the step, so no stage writes into
//! state another one owns.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use tokio::sync::mpsc;

use tokio_util::sync::CancellationToken;

use super::health::SharedTracker;
use super::metrics::MetricsHandle;
use super::stage::Stages;
use crate::cluster::{LabelsView, Link};
use crate::config::{Config, DevicePluginConfig};
use crate::desired::Desired;
use crate::host::HostRoot;
use crate::kube::EventType;
use crate::nvml::{Gpus, Inventory};
use crate::plugin::manager::{Command, PluginStatus};
use crate::runtime::stage::RuntimePlan;
use crate::status::{StageId, StageState};

/// A read-only view of the pass, for a stage's step.
pub(super) struct Pass<'a> {
    pub config: &'a Config,
    pub root: &'a HostRoot,
    /// `run --once`: nothing is served, nothing is started that outlives the pass.
    pub once: bool,
    /// Cancelled at SIGTERM/SIGINT: a long step stops at its next safe point.
    pub stop: &'a CancellationToken,
    /// NVML, once it loads.
    pub gpus: Option<&'a Gpus>,
    /// The GPU inventory last read (none before the first, or while the MIG devices change).
    pub inventory: Option<&'a Inventory>,
    /// The labels last read from the cluster link.
    pub view: &'a LabelsView,
    /// What those labels ask for.
    pub desired: &'a Desired,
    /// The effective `[device_plugin]` settings (the selected profile applied).
    pub dp: &'a DevicePluginConfig,
    /// Every stage's status as it is now.
    pub stages: &'a Stages,
    /// GPUs (UUIDs) withdrawn from the kubelet while their MIG layout changes.
    pub withdrawn: &'a BTreeSet<String>,
    /// The plugin manager's status as last reported.
    pub plugin: &'a PluginStatus,
    /// The resources last handed to the plugin manager (their names).
    pub advertised: &'a [String],
    /// Why the device-plugin stage cannot advertise what it should.
    pub plan_error: Option<&'a str>,
    /// The runtime stage's last good plan (the engines hold the runtime).
    pub runtime_plan: Option<&'a RuntimePlan>,
    /// What NVIDIA's GPU Operator holds on this node, as the pass's first look saw it.
    pub held: &'a Held,
    /// What the stages share.
    pub services: &'a Services,
}

/// The services the stages share, started once (`agent/setup.rs`) and handed to each step.
pub(super) struct Services {
    /// The cluster link (labels in; labels, Events and RuntimeClasses out); none under
    /// `run --once` without one.
    pub link: Option<Link>,
    /// Device health, kept by the health relay task ([`super::health`]); read for reports.
    pub tracker: SharedTracker,
    /// To the health relay, which applies health and passes the resources to the plugin
    /// manager; none under `run --once`.
    pub commands: Option<mpsc::Sender<Command>>,
    /// Prometheus metrics, when served.
    pub metrics: Option<MetricsHandle>,
    /// The DRA driver (`[dra] enabled`): the inventory goes to it; its status and what its
    /// claims hold (the MIG stage leaves those GPUs alone) come back.
    pub dra: Option<crate::dra::DraHandle>,
    /// Set while a step that may hold the loop for long runs (systemd's watchdog and start
    /// timeout are kept up meanwhile): [`crate::notify::LongStep`].
    pub long_step: Arc<AtomicBool>,
    /// When the main loop last went round (for the watchdog task).
    pub heartbeat: Arc<AtomicU64>,
}

/// What NVIDIA's GPU Operator, found on the node, holds: the stage it holds back says why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Held {
    /// Its toolkit configured the engines: the runtime stage writes none.
    pub runtime: Option<String>,
    /// Its mig-manager runs: the MIG stage changes nothing.
    pub mig: Option<String>,
}

/// What a stage tells the loop (and through it, the other stages and the reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Note {
    /// A stage's status is now this.
    Status {
        id: StageId,
        state: StageState,
        error: Option<String>,
        detail: Option<String>,
    },
    /// An Event on the Node (through the cluster link, when there is one).
    Event {
        kind: EventType,
        reason: &'static str,
        message: String,
    },
    /// The MIG devices changed: the inventory is read again before anything is advertised, and
    /// validation runs again (its CUDA check too) at the next pass.
    DevicesChanged,
    /// The runtime stage's plan once the engines hold the runtime (none after a failure).
    RuntimePlan(Option<RuntimePlan>),
    /// What the GPU Operator holds, from the look at the start of the pass.
    Held(Held),
    /// The GPUs withdrawn from the kubelet for a MIG change are given back (the next push
    /// advertises them).
    Restore,
}

/// The notes of one step, in the order they were made.
#[derive(Debug, Default)]
pub(super) struct Outbox(Vec<Note>);

impl Outbox {
    pub(super) fn status(&mut self, id: StageId, state: StageState, error: Option<String>, detail: Option<String>) {
        self.0.push(Note::Status {
            id,
            state,
            error,
            detail,
        });
    }

    pub(super) fn event(&mut self, kind: EventType, reason: &'static str, message: String) {
        self.0.push(Note::Event { kind, reason, message });
    }

    pub(super) fn push(&mut self, note: Note) {
        self.0.push(note);
    }

    /// The notes, for the loop to route.
    pub(super) fn take(&mut self) -> Vec<Note> {
        std::mem::take(&mut self.0)
    }

    /// The last status this outbox holds for `id`, if any (for tests).
    #[cfg(test)]
    pub(super) fn last_status(&self, id: StageId) -> Option<(StageState, Option<&str>, Option<&str>)> {
        self.0.iter().rev().find_map(|n| match n {
            Note::Status {
                id: i,
                state,
                error,
                detail,
            } if *i == id => Some((*state, error.as_deref(), detail.as_deref())),
            _ => None,
        })
    }
}

/// What a [`Pass`] borrows, owned, for a stage's unit tests: a stage is stepped without the
/// loop. The root is a fresh temporary folder; nothing else is there.
#[cfg(test)]
pub(super) struct Fixture {
    pub config: Config,
    pub root: HostRoot,
    pub once: bool,
    pub stop: CancellationToken,
    pub inventory: Option<Inventory>,
    pub view: LabelsView,
    pub desired: Desired,
    pub dp: DevicePluginConfig,
    pub stages: Stages,
    pub withdrawn: BTreeSet<String>,
    pub plugin: PluginStatus,
    pub advertised: Vec<String>,
    pub plan_error: Option<String>,
    pub runtime_plan: Option<RuntimePlan>,
    pub held: Held,
    pub services: Services,
    _dir: tempfile::TempDir,
}

#[cfg(test)]
impl Fixture {
    pub(super) fn new(config: Config) -> Fixture {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let retry = (config.agent.retry_min, config.agent.retry_max);
        Fixture {
            root: HostRoot::new(dir.path()),
            dp: config.device_plugin.clone(),
            config,
            once: false,
            stop: CancellationToken::new(),
            inventory: None,
            view: LabelsView {
                source: crate::desired::Source::None,
                detail: String::new(),
                labels: Default::default(),
                connected: false,
                error: None,
            },
            desired: Desired::none(),
            stages: Stages::new(retry),
            withdrawn: BTreeSet::new(),
            plugin: PluginStatus::default(),
            advertised: Vec::new(),
            plan_error: None,
            runtime_plan: None,
            held: Held::default(),
            services: Services {
                link: None,
                tracker: SharedTracker::new(crate::plugin::health::HealthTracker::new(super::health::health_policy(
                    &Config::default(),
                ))),
                commands: None,
                metrics: None,
                dra: None,
                long_step: Arc::new(AtomicBool::new(false)),
                heartbeat: Arc::new(AtomicU64::new(0)),
            },
            _dir: dir,
        }
    }

    pub(super) fn pass(&self) -> Pass<'_> {
        Pass {
            config: &self.config,
            root: &self.root,
            once: self.once,
            stop: &self.stop,
            gpus: None,
            inventory: self.inventory.as_ref(),
            view: &self.view,
            desired: &self.desired,
            dp: &self.dp,
            stages: &self.stages,
            withdrawn: &self.withdrawn,
            plugin: &self.plugin,
            advertised: &self.advertised,
            plan_error: self.plan_error.as_deref(),
            runtime_plan: self.runtime_plan.as_ref(),
            held: &self.held,
            services: &self.services,
        }
    }

    /// Applies the statuses `out` holds to the fixture's stage table (as the loop does).
    pub(super) fn apply(&mut self, out: &Outbox) {
        for note in &out.0 {
            if let Note::Status {
                id,
                state,
                error,
                detail,
            } = note
            {
                self.stages[*id].set(*state, error.clone(), detail.clone());
            }
        }
    }
}
