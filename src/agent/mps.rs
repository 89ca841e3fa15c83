//! MPS sharing inside the agent: the control daemons follow the effective device-plugin
//! settings (a profile switches MPS on or off), their states go into the device-plugin stage
//! (and so the status file), a daemon that cannot start or dies becomes a Warning Event, and
//! the agent stops them when it stops.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::Agent;
use crate::kube::EventType;
use crate::plugin::mps::{self, DaemonBoard, DaemonState, DaemonStatus, MpsAllocate, MpsDaemon, Supervisor};

/// What the agent keeps of its MPS daemons.
pub(super) struct MpsState {
    supervisor: Option<Supervisor>,
    changed_tx: mpsc::UnboundedSender<()>,
    /// Woken when a daemon's state changes.
    pub changed: mpsc::UnboundedReceiver<()>,
    /// The error last reported per resource (each posted once until it changes).
    reported: BTreeMap<String, String>,
    /// The daemons' states, which the device plugin reads straight from the supervisor's
    /// threads: replicas are healthy and allocatable only while their daemon answers.
    board: DaemonBoard,
}

impl MpsState {
    pub fn new() -> MpsState {
        let (changed_tx, changed) = mpsc::unbounded_channel();
        MpsState {
            supervisor: None,
            changed_tx,
            changed,
            reported: BTreeMap::new(),
            board: DaemonBoard::new(),
        }
    }
}

/// The daemons the effective settings ask for on `agent`'s inventory (none without one).
fn planned(agent: &Agent) -> Vec<MpsDaemon> {
    let Some(inventory) = &agent.inventory else {
        return Vec::new();
    };
    match mps::plan(inventory, &agent.dp.sharing, agent.dp.mig_strategy) {
        Ok(plans) => plans,
        Err(e) => {
            // The resources fail with the same reason; the stage says it.
            tracing::debug!("MPS: {e}");
            Vec::new()
        }
    }
}

impl Agent {
    /// Brings the control daemons to what the effective settings ask for, and gives `Allocate`
    /// their folders and limits. Not under `run --once` (which serves nothing).
    pub(super) fn update_mps(&mut self) {
        // No daemons while the plugin serves nothing (disabled, or a plan that failed).
        let plans = if self.commands.is_some() && self.plan_error.is_none() {
            planned(self)
        } else {
            Vec::new()
        };
        self.base_ctx.allocate.mps = MpsAllocate::new(&plans, self.mps.board.watch());
        if self.once {
            return;
        }
        let Some(gpus) = self.gpus.clone() else { return };
        if plans.is_empty() && self.mps.supervisor.is_none() {
            return;
        }
        let tx = self.mps.changed_tx.clone();
        let root = self.root.path().to_path_buf();
        let board = self.mps.board.clone();
        let supervisor = self.mps.supervisor.get_or_insert_with(|| {
            Supervisor::new(
                &root,
                board,
                Arc::new(move || {
                    let _ = tx.send(());
                }),
            )
        });
        supervisor.apply(&plans, &self.dp.driver_root, &gpus);
        self.report_mps();
    }

    /// Stops every daemon and sets compute mode DEFAULT back (agent shutdown).
    pub(super) fn stop_mps(&mut self) {
        let (Some(mut supervisor), Some(gpus)) = (self.mps.supervisor.take(), self.gpus.clone()) else {
            return;
        };
        supervisor.stop_all(&gpus);
    }

    /// The daemons' states.
    pub(super) fn mps_statuses(&self) -> Vec<DaemonStatus> {
        self.mps
            .supervisor
            .as_ref()
            .map(Supervisor::statuses)
            .unwrap_or_default()
    }

    /// A daemon that cannot run: why, for the device-plugin stage.
    pub(super) fn mps_error(&self) -> Option<String> {
        let errors: Vec<String> = self
            .mps_statuses()
            .into_iter()
            .filter(|s| matches!(s.state, DaemonState::Failed | DaemonState::Restarting))
            .filter_map(|s| s.error)
            .collect();
        (!errors.is_empty()).then(|| errors.join("; "))
    }

    /// One line per daemon for the stage detail: `MPS nvidia.com/gpu: running (pid 42)`.
    pub(super) fn mps_detail(&self) -> Option<String> {
        let statuses = self.mps_statuses();
        if statuses.is_empty() {
            return None;
        }
        let parts: Vec<String> = statuses
            .iter()
            .map(|s| {
                let state = serde_json::to_value(s.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                match s.pid {
                    Some(pid) => format!("MPS {}: {state} (pid {pid})", s.resource),
                    None => format!("MPS {}: {state}", s.resource),
                }
            })
            .collect();
        Some(parts.join(", "))
    }

    /// After a daemon's state changed: a Warning Event for a new error, and the reports.
    pub(super) fn report_mps(&mut self) {
        for status in self.mps_statuses() {
            let Some(error) = status.error.filter(|_| status.state != DaemonState::Running) else {
                self.mps.reported.remove(&status.resource);
                continue;
            };
            if self.mps.reported.get(&status.resource) == Some(&error) {
                continue;
            }
            if let Some(link) = &self.link {
                link.event(EventType::Warning, "MpsDaemonFailed", error.clone());
            }
            self.mps.reported.insert(status.resource, error);
        }
        self.update_stage();
        self.write_status("running");
    }
}
