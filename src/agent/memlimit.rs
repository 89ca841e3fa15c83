//! The memory-limit enforcer inside the agent: its policy follows the effective sharing profile
//! (per-replica budgets from `[device_plugin.sharing]`, action from
//! `[device_plugin.memory_limits]`), and what it does becomes a warning in the log and a
//! Kubernetes Event on the Node.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use super::Agent;
use crate::config::MemoryAction;
use crate::kube::EventType;
use crate::plugin::memlimit::{self, Action, ActionRecord, KubeletLogNames, Policy, RecordKind};
use crate::plugin::sharing::replica_budgets;

impl Agent {
    /// The enforcer's policy from the effective settings: budgets only for devices whose
    /// sharing gives one.
    fn memory_policy(&self) -> Policy {
        let budgets = match &self.inventory {
            Some(inventory) => replica_budgets(&self.dp.sharing, inventory, self.dp.mig_strategy)
                .into_iter()
                .filter_map(|(uuid, mib)| Some((uuid, mib?)))
                .collect(),
            None => Default::default(),
        };
        let limits = &self.config.device_plugin.memory_limits;
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

    /// Starts the enforcer once NVML is up (not under `run --once`), and hands it the current
    /// policy; it stays idle while no budget is set.
    pub(super) fn update_memory_limits(&mut self) {
        if self.once {
            return;
        }
        let policy = self.memory_policy();
        if let Some(tx) = &self.memory_policy {
            tx.send_if_modified(|current| {
                let changed = *current != policy;
                *current = policy.clone();
                changed
            });
            return;
        }
        let Some(gpus) = self.gpus.clone() else { return };
        let (tx, rx) = watch::channel(policy);
        let (out_tx, out_rx) = mpsc::channel(64);
        tokio::spawn(memlimit::run(
            gpus,
            self.root.clone(),
            rx,
            self.config.device_plugin.memory_limits.interval,
            Arc::new(KubeletLogNames::new(&self.root)),
            out_tx,
        ));
        self.memory_policy = Some(tx);
        self.memory_records = Some(out_rx);
    }

    /// One enforcer action: logged, and an Event on the Node when connected.
    pub(super) fn on_memory_record(&self, record: ActionRecord) {
        match record.kind {
            RecordKind::Warned | RecordKind::WouldKill => {
                tracing::warn!(pid = record.pid, gpu = %record.gpu_uuid, "{}", record.message)
            }
            RecordKind::Terminated | RecordKind::Killed => {
                tracing::error!(pid = record.pid, gpu = %record.gpu_uuid, "{}", record.message)
            }
        }
        if let Some(link) = &self.link {
            link.event(EventType::Warning, record.kind.reason(), record.message.clone());
        }
        self.metrics_memory(record.kind.as_str());
    }
}

/// The next enforcer record, or never when the enforcer is not running.
pub(super) async fn next_record(rx: &mut Option<mpsc::Receiver<ActionRecord>>) -> Option<ActionRecord> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
