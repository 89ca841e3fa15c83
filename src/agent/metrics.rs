//! The metrics endpoint inside the agent: the registry, the readings loop (on `[metrics]
//! interval`, with pod attribution from the kubelet's pod-resources socket), the HTTP server,
//! and the agent's own series (stage states and durations, errors, health transitions, memory
//! actions).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::health::SharedTracker;
use super::stage::Stages;
use crate::edits::{mig_plugin_devices, whole_gpu};
use crate::host::HostRoot;
use crate::metrics::{self, Metrics, MetricsServer, SamplerConfig};
use crate::nvml::Gpus;
use crate::nvml::Inventory;
use crate::status::StageState;

/// What the agent keeps of the metrics machinery.
pub(super) struct MetricsHandle {
    pub metrics: Metrics,
    /// The inventory the readings loop reads (published on every change).
    pub inventory: watch::Sender<Option<Arc<Inventory>>>,
    /// Whether the readings loop runs (it needs NVML).
    pub sampling: bool,
    /// Stage states last reported, to count transitions into `failed`.
    pub states: Vec<(String, StageState)>,
    /// Health last seen per GPU and MIG device (UUID): `None` healthy, else why it is not
    /// ([`unhealthy_cause`]), to count health transitions.
    pub health: BTreeMap<String, Option<&'static str>>,
}

/// Starts the registry and the HTTP server (`[metrics] enabled`, not under `run --once`). A bind
/// failure is logged, not fatal: the agent's job does not depend on being scraped.
pub(super) async fn start(config: &crate::config::MetricsConfig, once: bool) -> Option<MetricsHandle> {
    if !config.enabled || once {
        return None;
    }
    let registry = Metrics::new();
    match config.address.parse() {
        Ok(addr) => match MetricsServer::bind(addr, registry.clone(), &config.path).await {
            Ok(server) => {
                if let Ok(local) = server.local_addr() {
                    tracing::info!("metrics on http://{local}{}", config.path);
                }
                tokio::spawn(
                    server
                        .with_max_connections(config.max_connections)
                        .run(std::future::pending()),
                );
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
        health: BTreeMap::new(),
    })
}

impl MetricsHandle {
    /// Publishes the inventory to the readings loop, starting it once NVML is up (`gpus`).
    pub(super) fn inventory(
        &mut self,
        inventory: Option<&Inventory>,
        gpus: Option<&Gpus>,
        config: &crate::config::MetricsConfig,
        node: &str,
        root: &HostRoot,
    ) {
        let handle = self;
        handle.inventory.send_replace(inventory.cloned().map(Arc::new));
        if handle.sampling {
            return;
        }
        let Some(gpus) = gpus.cloned() else { return };
        handle.sampling = true;
        let config = SamplerConfig {
            interval: config.interval,
            hostname: node.to_string(),
            pod_resources_socket: Some(root.join(&config.pod_resources_socket)),
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
    /// reconcile error. Device health is compared here too (the `inventory`'s devices, from the
    /// `tracker`): this runs on every status write, which follows every change the health
    /// tracker reports (events and recoveries alike).
    pub(super) fn stages(
        &mut self,
        stages: &Stages,
        durations: &[(&str, Duration)],
        inventory: Option<&Inventory>,
        tracker: &SharedTracker,
    ) {
        self.device_health(inventory, tracker);
        let handle = self;
        for s in stages.iter().map(|s| &s.status) {
            let duration = durations.iter().find(|(n, _)| *n == s.name).map(|(_, d)| *d);
            handle.metrics.set_stage(&s.name, s.state.as_str(), duration);
            let before = handle.states.iter().find(|(n, _)| *n == s.name).map(|(_, st)| *st);
            if s.state == StageState::Failed && before != Some(StageState::Failed) {
                handle.metrics.reconcile_error(&s.name);
            }
        }
        handle.states = stages.iter().map(|s| (s.status.name.clone(), s.status.state)).collect();
    }

    /// Counts `gpu_node_agent_health_transitions_total{to,reason}`: every GPU and MIG device of
    /// the inventory whose health (from the health tracker) differs from the last time. `to` is
    /// `Healthy` or `Unhealthy`; `reason` is `xid` (a critical Xid) or `lost` (NVML stopped
    /// answering for the GPU) into `Unhealthy`, and `recovered` (no critical Xid for
    /// `recovery_after`) or `answering` (NVML answers again) back to `Healthy`. A device seen for
    /// the first time counts nothing.
    fn device_health(&mut self, inventory: Option<&Inventory>, tracker: &SharedTracker) {
        let Some(inventory) = inventory else { return };
        let tracker = tracker.lock();
        let now: Vec<(String, Option<&'static str>)> = inventory
            .gpus
            .iter()
            .flat_map(|g| std::iter::once(whole_gpu(g)).chain(mig_plugin_devices(g)))
            .map(|d| {
                let cause = tracker.reason(&d).map(|r| unhealthy_cause(&r));
                (d.uuid, cause)
            })
            .collect();
        drop(tracker);
        let handle = self;
        for (uuid, cause) in now {
            let Some(before) = handle.health.insert(uuid, cause) else {
                continue;
            };
            match (before, cause) {
                (Some(_), None) => {
                    let why = if before == Some("lost") {
                        "answering"
                    } else {
                        "recovered"
                    };
                    handle.metrics.health_transition("Healthy", why);
                }
                (None, Some(cause)) => handle.metrics.health_transition("Unhealthy", cause),
                _ => {}
            }
        }
    }

    /// A memory-limit action in the metrics.
    pub(super) fn memory(&self, action: &str) {
        self.metrics.memory_action(action);
    }
}

/// The cause of an unhealthy device from the health tracker's reason: `lost` when NVML does not
/// answer for its GPU, `xid` for a critical Xid.
fn unhealthy_cause(reason: &str) -> &'static str {
    if reason.starts_with("GPU lost") { "lost" } else { "xid" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_follow_the_health_trackers_reasons() {
        use crate::devices::{Health, PluginDevice};
        use crate::plugin::health::{HealthPolicy, HealthTracker};
        let mut tracker = HealthTracker::new(HealthPolicy {
            enabled: true,
            ignored_xids: Default::default(),
            critical_xids: Default::default(),
            recovery_after: None,
        });
        let device = PluginDevice {
            uuid: "GPU-0".into(),
            index: "0".into(),
            minor: 0,
            numa_node: None,
            mig: None,
            health: Health::Healthy,
        };
        let now = std::time::Instant::now();
        let lost = crate::nvml::HealthEvent::Lost { uuid: "GPU-0".into() };
        assert!(tracker.on_event(&lost, now));
        assert_eq!(tracker.reason(&device).map(|r| unhealthy_cause(&r)), Some("lost"));
        let answering = crate::nvml::HealthEvent::Answering { uuid: "GPU-0".into() };
        assert!(tracker.on_event(&answering, now));
        let xid = crate::nvml::HealthEvent::Xid {
            uuid: "GPU-0".into(),
            xid: 79,
            gi_id: crate::nvml::NO_INSTANCE,
            ci_id: crate::nvml::NO_INSTANCE,
        };
        assert!(tracker.on_event(&xid, now));
        assert_eq!(tracker.reason(&device).map(|r| unhealthy_cause(&r)), Some("xid"));
    }
}
