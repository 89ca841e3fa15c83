//! The memory-limit enforcer inside the agent: its policy follows the effective sharing profile
//! (per-replica budgets from `[device_plugin.sharing]`, action from
//! `[device_plugin.memory_limits]`), and what it does becomes a warning in the log and a
//! Kubernetes Event on the Node.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use super::pass::{Pass, Services};
use crate::config::MemoryAction;
use crate::kube::EventType;
use crate::plugin::memlimit::{self, Action, ActionRecord, KubeletLogNames, Policy, RecordKind};
use crate::plugin::sharing::replica_budgets;

/// The memory-limit enforcer, once it runs: its policy, and what it did.
#[derive(Default)]
pub(super) struct MemoryLimits {
    policy: Option<watch::Sender<Policy>>,
    records: Option<mpsc::Receiver<ActionRecord>>,
}

/// The enforcer's policy from the effective settings: budgets only for devices whose sharing
/// gives one.
fn memory_policy(pass: &Pass<'_>) -> Policy {
    let budgets = match pass.inventory {
        Some(inventory) => replica_budgets(&pass.dp.sharing, inventory, pass.dp.mig_strategy)
            .into_iter()
            .filter_map(|(uuid, mib)| Some((uuid, mib?)))
            .collect(),
        None => Default::default(),
    };
    let limits = &pass.config.device_plugin.memory_limits;
    Policy {
        budgets,
        action: match limits.action {
            MemoryAction::Log => Action::Log,
            MemoryAction::Kill => Action::Kill,
            MemoryAction::DryRun => Action::DryRun,
        },
        grace: limits.grace_period,
    }
}

impl MemoryLimits {
    /// Starts the enforcer once NVML is up (not under `run --once`), and hands it the current
    /// policy; it stays idle while no budget is set.
    pub(super) fn update(&mut self, pass: &Pass<'_>) {
        if pass.once {
            return;
        }
        let policy = memory_policy(pass);
        if let Some(tx) = &self.policy {
            tx.send_if_modified(|current| {
                let changed = *current != policy;
                *current = policy.clone();
                changed
            });
            return;
        }
        let Some(gpus) = pass.gpus.cloned() else { return };
        let (tx, rx) = watch::channel(policy);
        let (out_tx, out_rx) = mpsc::channel(64);
        tokio::spawn(memlimit::run(
            gpus,
            pass.root.clone(),
            rx,
            pass.config.device_plugin.memory_limits.interval,
            Arc::new(KubeletLogNames::new(pass.root)),
            out_tx,
        ));
        self.policy = Some(tx);
        self.records = Some(out_rx);
    }

    /// Stops the enforcer (it holds the NVML about to be dropped): dropping its policy channel
    /// stops it.
    pub(super) fn stop(&mut self) {
        self.policy = None;
        self.records = None;
    }

    /// The next enforcer record, or never when the enforcer is not running.
    pub(super) async fn next_record(&mut self) -> Option<ActionRecord> {
        match &mut self.records {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }
}

/// One enforcer action: logged, an Event on the Node (through the cluster link), counted in the
/// metrics.
pub(super) fn on_record(record: ActionRecord, services: &Services) {
    match record.kind {
        RecordKind::Warned | RecordKind::WouldKill => {
            tracing::warn!(pid = record.pid, gpu = %record.gpu_uuid, "{}", record.message)
        }
        RecordKind::Terminated | RecordKind::Killed => {
            tracing::error!(pid = record.pid, gpu = %record.gpu_uuid, "{}", record.message)
        }
    }
    if let Some(link) = &services.link {
        link.event(EventType::Warning, record.kind.reason(), record.message.clone());
    }
    if let Some(metrics) = &services.metrics {
        metrics.memory(record.kind.as_str());
    }
}
