//! The metrics endpoint inside the agent: the registry, the readings loop (on `[metrics]
//! interval`, with pod attribution from the kubelet's pod-resources socket), the HTTP server,
//! and the agent's own series (stage states and durations, errors, health transitions, memory
//! actions).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{Agent, StageState};
use crate::metrics::{self, Metrics, MetricsServer, SamplerConfig};
use crate::nvml::Inventory;

/// What the agent keeps of the metrics machinery.
pub(super) struct MetricsHandle {
    pub metrics: Metrics,
    /// The inventory the readings loop reads (published on every change).
    pub inventory: watch::Sender<Option<Arc<Inventory>>>,
    /// Whether the readings loop runs (it needs NVML).
    pub sampling: bool,
    /// Stage states last reported, to count transitions into `failed`.
    pub states: Vec<(String, StageState)>,
}

/// Starts the registry and the HTTP server (`[metrics] enabled`, not under `run --once`). A bind
/// failure is logged, not fatal: the agent's job does not depend on being scraped.
pub(super) async fn start(config: &crate::config::MetricsConfig, once: bool) -> Option<MetricsHandle> {
    if !config.enabled || once {
        return None;
    }
    let registry = Metrics::new();
    metrics::install(&registry);
    match config.address.parse() {
        Ok(addr) => match MetricsServer::bind(addr, registry.clone(), &config.path).await {
            Ok(server) => {
                if let Ok(local) = server.local_addr() {
                    tracing::info!("metrics on http://{local}{}", config.path);
                }
                tokio::spawn(server.run(std::future::pending()));
            }
            Err(e) => tracing::error!("cannot serve metrics on {}: {e} ([metrics] address)", config.address),
        },
        Err(e) => tracing::error!("[metrics] address {}: {e}", config.address),
    }
    let (inventory, _) = watch::channel(None);
    Some(MetricsHandle {
        metrics: registry,
        inventory,
        sampling: false,
        states: Vec::new(),
    })
}

impl Agent {
    /// Publishes the inventory to the readings loop, starting it once NVML is up.
    pub(super) fn metrics_inventory(&mut self) {
        let Some(handle) = &mut self.metrics else { return };
        let inventory = self.inventory.clone().map(Arc::new);
        handle.inventory.send_replace(inventory);
        if handle.sampling {
            return;
        }
        let Some(gpus) = self.gpus.clone() else { return };
        handle.sampling = true;
        let config = SamplerConfig {
            interval: self.config.metrics.interval,
            hostname: self.node.clone(),
            pod_resources_socket: Some(self.root.join(&self.config.metrics.pod_resources_socket)),
        };
        tokio::spawn(metrics::run_sampler(
            gpus,
            handle.metrics.clone(),
            handle.inventory.subscribe(),
            config,
            std::future::pending(),
        ));
    }

    /// The stage series from the stages as they are now; a stage entering `failed` counts as a
    /// reconcile error.
    pub(super) fn metrics_stages(&mut self, durations: &[(&str, Duration)]) {
        if self.metrics.is_none() {
            return;
        }
        let stages = self.stages().map(|s| s.status.clone());
        let Some(handle) = &mut self.metrics else { return };
        for s in &stages {
            let duration = durations.iter().find(|(n, _)| *n == s.name).map(|(_, d)| *d);
            handle.metrics.set_stage(&s.name, s.state.as_str(), duration);
            let before = handle.states.iter().find(|(n, _)| *n == s.name).map(|(_, st)| *st);
            if s.state == StageState::Failed && before != Some(StageState::Failed) {
                handle.metrics.reconcile_error(&s.name);
            }
        }
        handle.states = stages.iter().map(|s| (s.name.clone(), s.state)).collect();
    }

    /// A health event in the metrics: the Xid series and the health transitions.
    pub(super) fn metrics_health(&self, event: &crate::nvml::HealthEvent) {
        let Some(handle) = &self.metrics else { return };
        handle.metrics.health_event(event);
        handle.metrics.health_transition(match event {
            crate::nvml::HealthEvent::Xid { .. } => "xid",
            crate::nvml::HealthEvent::Lost { .. } => "lost",
            crate::nvml::HealthEvent::Answering { .. } => "answering",
        });
    }

    /// A memory-limit action in the metrics.
    pub(super) fn metrics_memory(&self, action: &str) {
        if let Some(handle) = &self.metrics {
            handle.metrics.memory_action(action);
        }
    }
}
