//! The readings loop: on every interval (and at once when the inventory changes) read NVML, ask
//! the kubelet which pod holds which device, and replace the GPU series.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::MissedTickBehavior;

use super::Metrics;
use super::gpm::GpmSampler;
use super::pods::{Attribution, attribution};
use super::readings::sample;
use crate::nvml::{Gpus, Inventory};

/// dcgm-exporter's default collection interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// The shortest interval the loop runs at (a shorter one is raised to this).
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// What the readings loop needs besides NVML and the registry.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// Time between two readings.
    pub interval: Duration,
    /// The `Hostname` label (dcgm-exporter uses the node name); empty leaves it out.
    pub hostname: String,
    /// The kubelet's pod-resources socket (`/var/lib/kubelet/pod-resources/kubelet.sock` under
    /// the root); `None` gives no pod labels.
    pub pod_resources_socket: Option<PathBuf>,
}

/// The readings loop's state. [`tick`](Self::tick) is one interval; [`run`](Self::run) loops.
#[derive(Debug)]
pub struct Sampler {
    gpus: Gpus,
    metrics: Metrics,
    inventory: watch::Receiver<Option<Arc<Inventory>>>,
    config: SamplerConfig,
    /// The last attribution the kubelet gave: kept through a failed `List` (a kubelet
    /// restart), so the series do not lose and regain their pod labels.
    attribution: Attribution,
    /// Whether the last `List` failed (its error is logged once until it works again).
    attribution_failing: bool,
    /// The previous GPM samples (the profiling metrics are rates between two intervals).
    gpm: Arc<std::sync::Mutex<GpmSampler>>,
}

impl Sampler {
    /// A loop over the GPUs of the inventory `inventory` publishes (the agent sends a new one
    /// whenever the GPUs or MIG devices change; `None` while it has none).
    pub fn new(
        gpus: Gpus,
        metrics: Metrics,
        inventory: watch::Receiver<Option<Arc<Inventory>>>,
        config: SamplerConfig,
    ) -> Sampler {
        Sampler {
            gpus,
            metrics,
            inventory,
            config,
            attribution: Attribution::default(),
            attribution_failing: false,
            gpm: Arc::default(),
        }
    }

    /// One readings interval: NVML readings (on a blocking thread), the pod attribution, then
    /// the GPU series are replaced. Returns `false` (and changes nothing) while there is no
    /// inventory.
    pub async fn tick(&mut self) -> bool {
        let Some(inventory) = self.inventory.borrow_and_update().clone() else {
            return false;
        };
        let gpus = self.gpus.clone();
        let gpm = self.gpm.clone();
        let readings = match tokio::task::spawn_blocking(move || {
            let mut readings = sample(&gpus, &inventory);
            let mut gpm = gpm.lock().unwrap_or_else(|p| p.into_inner());
            readings.profiling = gpm.sample(&gpus, &inventory);
            readings
        })
        .await
        {
            Ok(readings) => readings,
            Err(e) => {
                tracing::error!("the GPU readings failed: {e}");
                return false;
            }
        };
        if let Some(socket) = &self.config.pod_resources_socket {
            match attribution(socket).await {
                Ok(found) => {
                    if self.attribution_failing {
                        tracing::info!("the kubelet's pod-resources API answers again");
                        self.attribution_failing = false;
                    }
                    self.attribution = found;
                }
                Err(e) => {
                    if !self.attribution_failing {
                        tracing::warn!("{e}; GPU metrics keep the last pod labels until it answers");
                        self.attribution_failing = true;
                    }
                }
            }
        }
        self.metrics.update(&readings, &self.attribution, &self.config.hostname);
        true
    }

    /// Takes readings every interval (the first at once) and whenever the inventory changes,
    /// until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.config.interval.max(MIN_INTERVAL));
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut inventory_open = true;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = ticker.tick() => {}
                changed = self.inventory.changed(), if inventory_open => {
                    if changed.is_err() {
                        // The agent dropped its sender: the last inventory stays.
                        inventory_open = false;
                        continue;
                    }
                    ticker.reset();
                }
            }
            self.tick().await;
        }
    }
}

/// Runs a [`Sampler`] until `shutdown` completes.
pub async fn run_sampler(
    gpus: Gpus,
    metrics: Metrics,
    inventory: watch::Receiver<Option<Arc<Inventory>>>,
    config: SamplerConfig,
    shutdown: impl Future<Output = ()>,
) {
    Sampler::new(gpus, metrics, inventory, config).run(shutdown).await;
}
