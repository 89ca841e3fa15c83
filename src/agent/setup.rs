//! Starting the agent: the stage values and their services (the metrics, the cluster link and
//! the desired state it gives first, the plugin manager, the health relay, the DRA driver),
//! before the loop's first pass.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::pass::Services;
use super::stage::Stages;
use super::{
    Agent, allocate_options, devnodes, driver, health, health_policy, memlimit, metrics, mig, mps, operator, report,
    runtime, validation,
};
use crate::cluster::{self, LabelsView, Link};
use crate::config::Config;
use crate::desired::{Desired, Selection, choose_profile};
use crate::devices::Topology;
use crate::edits::DeviceNodes;
use crate::host::HostRoot;
use crate::plugin::health::HealthTracker;
use crate::plugin::manager::{PluginManager, PluginStatus};
use crate::plugin::server::{PluginContext, PluginStats};

/// How long the first reconcile waits for the desired-state source (the Node's labels).
const FIRST_VIEW_WAIT: Duration = Duration::from_secs(5);

/// The desired-state labels last seen, in the state dir (labels-file format).
pub(super) const LAST_DESIRED_FILE: &str = "desired-labels";

/// The agent, started, with what its loop waits on.
pub(super) struct Started {
    pub agent: Agent,
    /// The labels as the cluster link reads them.
    pub view_rx: Option<watch::Receiver<LabelsView>>,
    /// The plugin manager's status.
    pub plugin_rx: watch::Receiver<PluginStatus>,
    pub manager_task: Option<JoinHandle<()>>,
    pub relay_task: Option<JoinHandle<()>>,
    /// Health changed (the relay has told the kubelet already).
    pub health_changed: Option<watch::Receiver<u64>>,
}

/// Builds the agent and starts its services; the stages have not run yet.
pub(super) async fn start(config: Config, root: HostRoot, once: bool, stop: &CancellationToken) -> Started {
    let (health_tx, health_rx) = mpsc::unbounded_channel();
    let (dp, profile) = choose_profile(
        &config.device_plugin,
        &Selection::Unset,
        None,
        &config.labels.device_plugin_config,
    );
    let base_ctx = PluginContext {
        allocate: allocate_options(&dp),
        nodes: DeviceNodes::gather(&root.join(&config.device_plugin.dev_root), &root.join("/proc")),
        topology: Topology::new(),
        shared_policy: dp.sharing.policy,
    };
    let retry = (config.agent.retry_min, config.agent.retry_max);
    let reporter = report::Reporter::new(&root);
    let tracker = health::SharedTracker::new(HealthTracker::new(health_policy(&config)));
    let mut agent = Agent {
        stop: stop.clone(),
        stages: Stages::new(retry),
        config,
        root,
        once,
        gpus: None,
        inventory: None,
        plugin_status: PluginStatus::default(),
        plugin_watch: None,
        health_tx,
        health_stop: None,
        watched: BTreeSet::new(),
        base_ctx,
        desired: Vec::new(),
        plan_error: None,
        dp,
        profile,
        view: LabelsView {
            source: crate::desired::Source::None,
            detail: String::new(),
            labels: BTreeMap::new(),
            connected: false,
            error: None,
        },
        desired_sel: Desired::none(),
        runtime: runtime::RuntimeStage::default(),
        runtime_plan: None,
        held: super::pass::Held::default(),
        validation: validation::ValidationStage::default(),
        memory: memlimit::MemoryLimits::default(),
        mig: mig::MigStage::default(),
        mps: mps::MpsState::new(),
        withdrawn: BTreeSet::new(),
        reporter,
        services: Services {
            link: None,
            tracker,
            commands: None,
            metrics: None,
            dra: None,
            long_step: Arc::new(AtomicBool::new(false)),
            heartbeat: Arc::new(std::sync::atomic::AtomicU64::new(crate::notify::now_ms())),
        },
        driver: driver::DriverStage::default(),
        operator: operator::OperatorState::default(),
        devnodes: devnodes::DevNodes::default(),
        no_gpu: None,
    };

    // The cluster link: the desired state comes from it before the first reconcile. Under
    // `run --once` too: a bootstrap applies the MIG layout the labels ask for before the
    // kubelet joins.
    // The metrics first: the API client, the plugin servers and the health relay count in them.
    agent.services.metrics = metrics::start(&agent.config.metrics, once).await;
    let view_rx = {
        let link = cluster::start(
            &agent.config,
            &agent.root,
            agent.services.metrics.as_ref().map(|m| m.metrics.clone()),
        );
        let rx = link.view.clone();
        let (view, answered) = first_view(&agent.config, &agent.root, &link, stop).await;
        agent.view = view;
        if answered {
            agent.remember_desired();
        }
        agent.desired_sel = Desired::from_labels(&agent.view.labels, &agent.config.labels);
        let (dp, outcome) = choose_profile(
            &agent.config.device_plugin,
            &agent.desired_sel.device_plugin_config,
            None,
            &agent.config.labels.device_plugin_config,
        );
        agent.base_ctx.allocate = allocate_options(&dp);
        agent.base_ctx.shared_policy = dp.sharing.policy;
        agent.dp = dp;
        agent.profile = outcome;
        agent.services.link = Some(link);
        Some(rx)
    };

    // The plugin manager serves and registers; it runs for the whole life of the daemon.
    let stats = Arc::new(PluginStats {
        metrics: agent.services.metrics.as_ref().map(|m| m.metrics.clone()),
        ..PluginStats::default()
    });
    let (plugin_rx, manager) = if once || !agent.config.device_plugin.enabled {
        let (_tx, rx) = watch::channel(PluginStatus::default());
        (rx, None)
    } else {
        let dir = agent.root.join(&agent.config.kubelet.device_plugin_dir);
        let (manager, status_rx) = PluginManager::new(
            dir,
            agent.config.kubelet.register_timeout,
            Arc::new(agent.base_ctx.clone()),
            stats,
        );
        let (tx, rx) = mpsc::channel(16);
        (status_rx, Some((tokio::spawn(manager.run(rx)), tx)))
    };
    let (manager_task, manager_tx) = manager.unzip();
    agent.plugin_watch = manager_task.is_some().then(|| plugin_rx.clone());

    // The health relay: health events reach the manager from there, never waiting for a stage.
    let (relay_task, health_changed) = if once {
        (None, None)
    } else {
        let (relay, changed) = health::HealthRelay::new(
            agent.services.tracker.clone(),
            manager_tx,
            agent.services.metrics.as_ref().map(|m| m.metrics.clone()),
        );
        let (tx, rx) = mpsc::channel(16);
        agent.services.commands = Some(tx);
        // The DRA driver, beside the device plugin: what its claims hold is withdrawn there.
        let (_none, mut withdrawn) = watch::channel(crate::devices::Withdrawn::default());
        if agent.config.dra.enabled {
            let inputs = dra_inputs(&agent.services.tracker, changed.clone());
            match crate::dra::start(agent.config.clone(), agent.root.clone(), inputs, stop.clone()) {
                Ok(handle) => {
                    withdrawn = handle.withdrawn.clone();
                    agent.services.dra = Some(handle);
                }
                Err(e) => tracing::error!("{e}; the device plugin goes on without it"),
            }
        } else if crate::dra::was_on(&agent.config, &agent.root) {
            // It was on: its slices would announce devices nobody prepares.
            let (config, root) = (agent.config.clone(), agent.root.clone());
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
        agent,
        view_rx,
        plugin_rx,
        manager_task,
        relay_task,
        health_changed,
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

/// What [`Agent::remember_desired`] kept, `None` when nothing was (or it does not parse).
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
