//! MPS sharing inside the agent: the control daemons follow the effective device-plugin
//! settings (a profile switches MPS on or off), their states go into the device-plugin stage
//! (and so the status file), a daemon that cannot start or dies becomes a Warning Event, and
//! the agent stops them when it stops.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::pass::{Outbox, Pass};
use crate::kube::EventType;
use crate::nvml::Gpus;
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

/// The daemons the effective settings ask for on the pass's inventory (none without one).
fn planned(pass: &Pass<'_>) -> Vec<MpsDaemon> {
    let Some(inventory) = pass.inventory else {
        return Vec::new();
    };
    match mps::plan(inventory, &pass.dp.sharing, pass.dp.mig_strategy) {
        Ok(plans) => plans,
        Err(e) => {
            // The resources fail with the same reason; the stage says it.
            tracing::debug!("MPS: {e}");
            Vec::new()
        }
    }
}

impl MpsState {
    /// Brings the control daemons to what the effective settings ask for (none unless the
    /// plugin is `serving`: disabled, or a plan that failed), and answers what `Allocate` gives
    /// their replicas (folders and limits), and whether the daemons were looked after (then the
    /// reports follow: [`MpsState::report`]). No daemon under `run --once` (which serves
    /// nothing).
    pub(super) fn update(&mut self, pass: &Pass<'_>, serving: bool) -> (MpsAllocate, bool) {
        let plans = if serving { planned(pass) } else { Vec::new() };
        let allocate = MpsAllocate::new(&plans, self.board.watch());
        if pass.once {
            return (allocate, false);
        }
        let Some(gpus) = pass.gpus else {
            return (allocate, false);
        };
        if plans.is_empty() && self.supervisor.is_none() {
            return (allocate, false);
        }
        let tx = self.changed_tx.clone();
        let root = pass.root.path().to_path_buf();
        let board = self.board.clone();
        let supervisor = self.supervisor.get_or_insert_with(|| {
            Supervisor::new(
                &root,
                board,
                Arc::new(move || {
                    let _ = tx.send(());
                }),
            )
        });
        supervisor.apply(&plans, &pass.dp.driver_root, gpus);
        (allocate, true)
    }

    /// Stops every daemon and sets compute mode DEFAULT back (agent shutdown).
    pub(super) fn stop(&mut self, gpus: Option<&Gpus>) {
        let (Some(mut supervisor), Some(gpus)) = (self.supervisor.take(), gpus) else {
            return;
        };
        supervisor.stop_all(gpus);
    }

    /// The daemons' states.
    pub(super) fn statuses(&self) -> Vec<DaemonStatus> {
        self.supervisor.as_ref().map(Supervisor::statuses).unwrap_or_default()
    }

    /// A daemon that cannot run: why, for the device-plugin stage.
    pub(super) fn error(&self) -> Option<String> {
        let errors: Vec<String> = self
            .statuses()
            .into_iter()
            .filter(|s| matches!(s.state, DaemonState::Failed | DaemonState::Restarting))
            .filter_map(|s| s.error)
            .collect();
        (!errors.is_empty()).then(|| errors.join("; "))
    }

    /// One line per daemon for the stage detail: `MPS nvidia.com/gpu: running (pid 42)`.
    pub(super) fn detail(&self) -> Option<String> {
        let statuses = self.statuses();
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
    pub(super) fn report(&mut self, out: &mut Outbox) {
        for status in self.statuses() {
            let Some(error) = status.error.filter(|_| status.state != DaemonState::Running) else {
                self.reported.remove(&status.resource);
                continue;
            };
            if self.reported.get(&status.resource) == Some(&error) {
                continue;
            }
            out.event(EventType::Warning, "MpsDaemonFailed", error.clone());
            self.reported.insert(status.resource, error);
        }
    }
}
