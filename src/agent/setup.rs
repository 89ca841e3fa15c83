//! Starting the agent: the stage values and their services (the metrics, the cluster link and
//! the desired state it gives first, the plugin manager, the health relay, the DRA driver),
//! before the loop's first pass.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::device_plugin::DevicePluginStage;
use super::health::health_policy;
use super::nvml::Nvml;
use super::pass::Services;
use super::stage::Stages;
use super::{health, metrics, report};
use crate::cluster::{self, LabelsView, Link};
use crate::config::Config;
use crate::desired::Desired;
use crate::host::HostRoot;
use crate::plugin::health::HealthTracker;
use crate::plugin::manager::{PluginManager, PluginStatus};
use crate::plugin::server::PluginStats;

/// How long the first reconcile waits for the desired-state source (the Node's labels).
const FIRST_VIEW_WAIT: Duration = Duration::from_secs(5);

/// The desired-state labels last seen, in the state dir (labels-file format).
const LAST_DESIRED_FILE: &str = "desired-labels";

/// What the agent starts with (the loop builds the agent from it), and what its loop waits on.
pub(super) struct Started {
    pub config: Config,
    pub root: HostRoot,
    pub stages: Stages,
    pub nvml: Nvml,
    pub device_plugin: DevicePluginStage,
    /// The labels first read, and what they ask for.
    pub view: LabelsView,
    pub desired: Desired,
    pub reporter: report::Reporter,
    pub services: Services,
    /// The labels as the cluster link reads them.
    pub view_rx: Option<watch::Receiver<LabelsView>>,
    /// The plugin manager's status.
    pub plugin_rx: watch::Receiver<PluginStatus>,
    pub manager_task: Option<JoinHandle<()>>,
    pub relay_task: Option<JoinHandle<()>>,
    /// Health changed (the relay has told the kubelet already).
    pub health_changed: Option<watch::Receiver<u64>>,
}

/// Starts the agent's services and reads the first labels; the stages have not run yet.
pub(super) async fn start(config: Config, root: HostRoot, once: bool, stop: &CancellationToken) -> Started {
    let (health_tx, health_rx) = mpsc::unbounded_channel();
    let mut device_plugin = DevicePluginStage::new(&config, &root);
    let retry = (config.agent.retry_min, config.agent.retry_max);
    let reporter = report::Reporter::new(&root);
    let tracker = health::SharedTracker::new(HealthTracker::new(health_policy(&config)));
    let mut services = Services {
        link: None,
        tracker,
        commands: None,
        metrics: None,
        dra: None,
        long_step: Arc::new(AtomicBool::new(false)),
        heartbeat: Arc::new(std::sync::atomic::AtomicU64::new(crate::notify::now_ms())),
    };

    // The cluster link: the desired state comes from it before the first reconcile. Under
    // `run --once` too: a bootstrap applies the MIG layout the labels ask for before the
    // kubelet joins.
    // The metrics first: the API client, the plugin servers and the health relay count in them.
    services.metrics = metrics::start(&config.metrics, once).await;
    let (view, desired, view_rx) = {
        let link = cluster::start(&config, &root, services.metrics.as_ref().map(|m| m.metrics.clone()));
        let rx = link.view.clone();
        let (view, answered) = first_view(&config, &root, &link, stop).await;
        if answered {
            remember_desired(&config, &root, &view);
        }
        let desired = Desired::from_labels(&view.labels, &config.labels);
        device_plugin.start_with(&config, &desired);
        services.link = Some(link);
        (view, desired, Some(rx))
    };

    // The plugin manager serves and registers; it runs for the whole life of the daemon.
    let stats = Arc::new(PluginStats {
        metrics: services.metrics.as_ref().map(|m| m.metrics.clone()),
        ..PluginStats::default()
    });
    let (plugin_rx, manager) = if once || !config.device_plugin.enabled {
        let (_tx, rx) = watch::channel(PluginStatus::default());
        (rx, None)
    } else {
        let dir = root.join(&config.kubelet.device_plugin_dir);
        let (manager, status_rx) = PluginManager::new(
            dir,
            config.kubelet.register_timeout,
            Arc::new(device_plugin.ctx.clone()),
            stats,
        );
        let (tx, rx) = mpsc::channel(16);
        (status_rx, Some((tokio::spawn(manager.run(rx)), tx)))
    };
    let (manager_task, manager_tx) = manager.unzip();
    device_plugin.plugin_watch = manager_task.is_some().then(|| plugin_rx.clone());

    // The health relay: health events reach the manager from there, never waiting for a stage.
    let (relay_task, health_changed) = if once {
        (None, None)
    } else {
        let (relay, changed) = health::HealthRelay::new(
            services.tracker.clone(),
            manager_tx,
            services.metrics.as_ref().map(|m| m.metrics.clone()),
        );
        let (tx, rx) = mpsc::channel(16);
        services.commands = Some(tx);
        // The DRA driver, beside the device plugin: what its claims hold is withdrawn there.
        let (_none, mut withdrawn) = watch::channel(crate::devices::Withdrawn::default());
        if config.dra.enabled {
            let inputs = dra_inputs(&services.tracker, changed.clone());
            match crate::dra::start(config.clone(), root.clone(), inputs, stop.clone()) {
                Ok(handle) => {
                    withdrawn = handle.withdrawn.clone();
                    services.dra = Some(handle);
                }
                Err(e) => tracing::error!("{e}; the device plugin goes on without it"),
            }
        } else if crate::dra::was_on(&config, &root) {
            // It was on: its slices would announce devices nobody prepares.
            let (config, root) = (config.clone(), root.clone());
            tokio::spawn(async move {
                match crate::dra::remove_slices(&config, &root).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(
                        "DRA is off: deleted {n} ResourceSlice(s) of driver {}",
                        config.dra.driver
                    ),
                    Err(e) => tracing::debug!("DRA is off; its ResourceSlices were not checked: {e}"),
                }
            });
        }
        (Some(tokio::spawn(relay.run(rx, health_rx, withdrawn))), Some(changed))
    };
    Started {
        stages: Stages::new(retry),
        nvml: Nvml::new(health_tx),
        config,
        root,
        device_plugin,
        view,
        desired,
        reporter,
        services,
        view_rx,
        plugin_rx,
        manager_task,
        relay_task,
        health_changed,
    }
}

/// Keeps the desired-state labels the source gave last (the MIG layout and device plugin
/// profile) in the state dir: at boot a source that does not answer in time (an API server
/// still starting) must not mean whole GPUs advertised where a MIG layout was asked for.
pub(super) fn remember_desired(config: &Config, root: &HostRoot, view: &LabelsView) {
    if !view.connected || view.source == crate::desired::Source::None {
        return;
    }
    let keys = [&config.labels.mig_config, &config.labels.device_plugin_config];
    let text: String = keys
        .iter()
        .filter_map(|k| view.labels.get(*k).map(|v| format!("{k}={v}\n")))
        .collect();
    let path = root.join(&config.agent.state_dir).join(LAST_DESIRED_FILE);
    if std::fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
        return;
    }
    if let Err(e) = crate::host::write_atomic(&path, text.as_bytes(), 0o644) {
        tracing::warn!("cannot keep the desired state for the next start: {e}");
    }
}

/// What the DRA driver reads of the agent: device health from its tracker.
fn dra_inputs(tracker: &health::SharedTracker, health_changed: watch::Receiver<u64>) -> crate::dra::Inputs {
    let tracker = tracker.clone();
    let health: crate::dra::HealthFn =
        Arc::new(move |device| tracker.lock().health(device) == crate::devices::Health::Healthy);
    crate::dra::Inputs { health, health_changed }
}

/// The desired-state labels to start from, and whether the source answered: the desired MIG
/// layout must be known before devices are advertised (layouts do not survive a reboot), so the
/// source gets [`FIRST_VIEW_WAIT`] to answer; one that does not gives way to what it asked for
/// last ([`LAST_DESIRED_FILE`]), else to the config's defaults. `run` and `plan` start alike.
pub(crate) async fn first_view(
    config: &Config,
    root: &HostRoot,
    link: &Link,
    stop: &CancellationToken,
) -> (LabelsView, bool) {
    let mut rx = link.view.clone();
    let first = tokio::time::timeout(FIRST_VIEW_WAIT, async {
        while !rx.borrow().connected && rx.borrow().source != crate::desired::Source::None {
            if rx.changed().await.is_err() {
                break;
            }
        }
    });
    let answered = tokio::select! {
        waited = first => waited.is_ok(),
        () = stop.cancelled() => false,
    };
    let mut view = rx.borrow().clone();
    if !answered {
        match last_desired(config, root, &view) {
            Some(labels) => {
                tracing::warn!(
                    "the desired state source did not answer within {FIRST_VIEW_WAIT:?}: starting with what it asked \
                     for last ({})",
                    labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                view.labels.extend(labels);
            }
            None => tracing::warn!(
                "the desired state source did not answer within {FIRST_VIEW_WAIT:?}: starting with the config's defaults"
            ),
        }
    }
    (view, answered)
}

/// What [`remember_desired`] kept, `None` when nothing was (or it does not parse).
fn last_desired(config: &Config, root: &HostRoot, view: &LabelsView) -> Option<BTreeMap<String, String>> {
    if view.source == crate::desired::Source::None {
        return None;
    }
    let path = root.join(&config.agent.state_dir).join(LAST_DESIRED_FILE);
    let text = crate::host::read_text(&path).ok()?;
    crate::desired::parse_labels_file(&path.display().to_string(), &text).ok()
}

/// Cancels `stop` at the first SIGTERM or SIGINT.
pub(super) async fn stop_on_signals(mut sigterm: Signal, mut sigint: Signal, stop: CancellationToken) {
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: stopping"),
        _ = sigint.recv() => tracing::info!("SIGINT: stopping"),
    }
    stop.cancel();
}
