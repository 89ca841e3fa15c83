//! Prometheus metrics: what dcgm-exporter reports of the GPUs (as far as NVML gives it), with
//! its metric and label names, plus the agent's own metrics.
//!
//! - [`sample`] reads NVML into a plain [`Readings`] value; [`attribution`] asks the kubelet's
//!   pod-resources API which pod holds which device; [`Metrics::update`] turns both into the
//!   GPU series, replacing the previous ones (series of GPUs and MIG devices that are gone
//!   disappear). [`Sampler`] does this on an interval: readings are taken on the interval,
//!   never per scrape.
//! - The agent reports its own work through the [`Metrics`] methods (`set_stage`,
//!   `reconcile_error`, `registration`, `allocation`, `health_transition`, `api_request`,
//!   `memory_action`, `xid`), as `gpu_node_agent_*` series.
//! - [`MetricsServer`] serves everything on `GET /metrics` (the path is configurable) in the
//!   OpenMetrics text format, encoded by prometheus-client.
//!
//! The GPU series and their labels are described in [`dcgm`]. Effects: NVML reads, one
//! pod-resources `List` per interval, and a TCP listener.

pub mod dcgm;
pub mod gpm;
mod http;
pub mod pods;
pub mod readings;
mod sampler;

/// The kubelet pod-resources API, v1 (client), generated from the vendored proto.
pub mod podresources {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

pub use dcgm::{FIELDS, GpuCollector, Snapshot, XID_ERRORS};
pub use gpm::{GpmSampler, PROF_FIELDS, ProfValues, Profiling};
pub use http::{MetricsServer, serve};
pub use pods::{Attribution, AttributionError, PodRef, attribution};
pub use readings::{GpuReadings, InstanceReadings, Readings, Values, sample};
pub use sampler::{DEFAULT_INTERVAL, MIN_INTERVAL, Sampler, SamplerConfig, run_sampler};

use crate::nvml::HealthEvent;

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The port dcgm-exporter listens on, and so the default of this endpoint.
pub const DEFAULT_PORT: u16 = 9400;
/// The default path of the endpoint.
pub const DEFAULT_PATH: &str = "/metrics";
/// The prefix of the agent's own metrics.
pub const PREFIX: &str = "gpu_node_agent";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageStateLabels {
    stage: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    to: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiLabels {
    verb: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

type DurationFamily = Family<StageLabels, Histogram, fn() -> Histogram>;

/// Stage runs take from milliseconds (a converged check) to tens of minutes (a driver build):
/// 10 ms × 4ⁿ, up to about 44 minutes.
fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 4.0, 10))
}

struct Inner {
    registry: Registry,
    gpu: Arc<GpuCollector>,
    /// The current state of each stage (only that state's series exists).
    stage_states: Mutex<HashMap<String, String>>,
    stage_state: Family<StageStateLabels, Gauge>,
    stage_duration: DurationFamily,
    reconcile_errors: Family<StageLabels, Counter>,
    registrations: Family<ResourceLabels, Counter>,
    allocations: Family<ResourceLabels, Counter>,
    health_transitions: Family<TransitionLabels, Counter>,
    api_requests: Family<ApiLabels, Counter>,
    memory_actions: Family<ActionLabels, Counter>,
}

/// The agent's metrics registry: the GPU series and the agent's own. Cheap to clone; every
/// clone shares the same series, and every method may be called from any thread.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// An empty registry: no GPU series until the first [`update`](Self::update).
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let gpu = Arc::new(GpuCollector::default());
        registry.register_collector(Box::new(gpu.clone()));
        let stage_state = Family::<StageStateLabels, Gauge>::default();
        let stage_duration: DurationFamily = Family::new_with_constructor(stage_histogram);
        let reconcile_errors = Family::<StageLabels, Counter>::default();
        let registrations = Family::<ResourceLabels, Counter>::default();
        let allocations = Family::<ResourceLabels, Counter>::default();
        let health_transitions = Family::<TransitionLabels, Counter>::default();
        let api_requests = Family::<ApiLabels, Counter>::default();
        let memory_actions = Family::<ActionLabels, Counter>::default();
        let agent = registry.sub_registry_with_prefix(PREFIX);
        agent.register(
            "stage_state",
            "1 for the state each stage is in (only the current state has a series)",
            stage_state.clone(),
        );
        agent.register_with_unit(
            "stage_duration",
            "How long each run of a stage took",
            Unit::Seconds,
            stage_duration.clone(),
        );
        agent.register(
            "reconcile_errors",
            "Stage runs that ended in an error",
            reconcile_errors.clone(),
        );
        agent.register(
            "plugin_registrations",
            "Device plugin registrations with the kubelet, by resource",
            registrations.clone(),
        );
        agent.register(
            "plugin_allocations",
            "Device plugin Allocate calls answered, by resource",
            allocations.clone(),
        );
        agent.register(
            "health_transitions",
            "GPU and MIG device health changes, by the health changed to (to: Healthy, Unhealthy) and why \
             (reason: xid or lost into Unhealthy; recovered or answering back to Healthy)",
            health_transitions.clone(),
        );
        agent.register(
            "api_requests",
            "Kubernetes API requests, by verb (get, watch, patch, create) and HTTP status code",
            api_requests.clone(),
        );
        agent.register(
            "memory_limit_actions",
            "Actions taken by the GPU memory-limit enforcement, by action (warned, would_kill, terminated, \
             killed)",
            memory_actions.clone(),
        );
        Metrics {
            inner: Arc::new(Inner {
                registry,
                gpu,
                stage_states: Mutex::new(HashMap::new()),
                stage_state,
                stage_duration,
                reconcile_errors,
                registrations,
                allocations,
                health_transitions,
                api_requests,
                memory_actions,
            }),
        }
    }

    /// Replaces the GPU series with those of `readings`, labelled with `hostname` (the
    /// `Hostname` label; none when empty) and the pods of `attribution`.
    pub fn update(&self, readings: &Readings, attribution: &Attribution, hostname: &str) {
        self.inner.gpu.replace(Snapshot::build(readings, attribution, hostname));
    }

    /// Everything, in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut text = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut text, &self.inner.registry)?;
        Ok(text)
    }

    /// Stage `stage` is now in `state` (e.g. `ready`, `failed`); `duration` is how long the run
    /// that got there took, when there was one.
    pub fn set_stage(&self, stage: &str, state: &str, duration: Option<Duration>) {
        let mut states = self.inner.stage_states.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = states.insert(stage.to_string(), state.to_string())
            && old != state
        {
            self.inner.stage_state.remove(&StageStateLabels {
                stage: stage.to_string(),
                state: old,
            });
        }
        self.inner
            .stage_state
            .get_or_create(&StageStateLabels {
                stage: stage.to_string(),
                state: state.to_string(),
            })
            .set(1);
        if let Some(d) = duration {
            self.inner
                .stage_duration
                .get_or_create(&StageLabels {
                    stage: stage.to_string(),
                })
                .observe(d.as_secs_f64());
        }
    }

    /// A run of stage `stage` ended in an error.
    pub fn reconcile_error(&self, stage: &str) {
        self.inner
            .reconcile_errors
            .get_or_create(&StageLabels {
                stage: stage.to_string(),
            })
            .inc();
    }

    /// The device plugin registered `resource` with the kubelet.
    pub fn registration(&self, resource: &str) {
        self.inner
            .registrations
            .get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            })
            .inc();
    }

    /// The device plugin answered an Allocate call for `resource`.
    pub fn allocation(&self, resource: &str) {
        self.inner
            .allocations
            .get_or_create(&ResourceLabels {
                resource: resource.to_string(),
            })
            .inc();
    }

    /// A GPU or MIG device's health changed to `to` (`Healthy`, `Unhealthy`) because of `reason`
    /// (`xid`, `lost` into `Unhealthy`; `recovered`, `answering` back to `Healthy`).
    pub fn health_transition(&self, to: &str, reason: &str) {
        self.inner
            .health_transitions
            .get_or_create(&TransitionLabels {
                to: to.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// A Kubernetes API request with `verb` (the Kubernetes verb in lower case: `get`, `watch`,
    /// `patch`, `create`) was answered with the HTTP status `code`.
    pub fn api_request(&self, verb: &str, code: impl fmt::Display) {
        self.inner
            .api_requests
            .get_or_create(&ApiLabels {
                verb: verb.to_string(),
                code: code.to_string(),
            })
            .inc();
    }

    /// The GPU memory-limit enforcement took `action`: `warned` (action `log`), `would_kill`
    /// (`dry-run`), `terminated` (SIGTERM), `killed` (SIGKILL after the grace period).
    pub fn memory_action(&self, action: &str) {
        self.inner
            .memory_actions
            .get_or_create(&ActionLabels {
                action: action.to_string(),
            })
            .inc();
    }

    /// Xid `xid` happened on the GPU or MIG device `uuid`: `DCGM_FI_DEV_XID_ERRORS` shows it
    /// (the last Xid, as dcgm-exporter does) from now on.
    pub fn xid(&self, uuid: &str, xid: u64) {
        self.inner.gpu.xid(uuid, xid);
    }

    /// Records what a health event says for the metrics: an Xid (on the GPU, and on the MIG
    /// GPU instance NVML attributed it to). Other events change no metric here.
    pub fn health_event(&self, event: &HealthEvent) {
        if let HealthEvent::Xid { uuid, xid, gi_id, .. } = event {
            self.inner.gpu.xid_on(uuid, Some(*gi_id), *xid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_metrics_are_prefixed_and_stage_state_keeps_one_state() {
        let m = Metrics::new();
        m.set_stage("driver", "pending", None);
        m.set_stage("driver", "ready", Some(Duration::from_millis(1500)));
        m.reconcile_error("mig");
        m.registration("nvidia.com/gpu");
        m.allocation("nvidia.com/gpu");
        m.health_transition("Unhealthy", "xid");
        m.api_request("patch", 200);
        m.memory_action("terminated");
        let text = m.encode().expect("encode");
        for line in [
            "gpu_node_agent_stage_state{stage=\"driver\",state=\"ready\"} 1",
            "gpu_node_agent_stage_duration_seconds_count{stage=\"driver\"} 1",
            "gpu_node_agent_stage_duration_seconds_sum{stage=\"driver\"} 1.5",
            "gpu_node_agent_reconcile_errors_total{stage=\"mig\"} 1",
            "gpu_node_agent_plugin_registrations_total{resource=\"nvidia.com/gpu\"} 1",
            "gpu_node_agent_plugin_allocations_total{resource=\"nvidia.com/gpu\"} 1",
            "gpu_node_agent_health_transitions_total{to=\"Unhealthy\",reason=\"xid\"} 1",
            "gpu_node_agent_api_requests_total{verb=\"patch\",code=\"200\"} 1",
            "gpu_node_agent_memory_limit_actions_total{action=\"terminated\"} 1",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert!(!text.contains("state=\"pending\""), "{text}");
        assert!(text.ends_with("# EOF\n"));
        assert!(!text.contains("DCGM_"), "no GPU series before the first update");
    }
}
