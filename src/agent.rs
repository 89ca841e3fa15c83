//! The reconcile loop: stages in order (driver, runtime, MIG, device plugin; a failed stage
//! stops the ones after it until the next pass), health events, periodic
//! resync, status reporting, and a clean stop on SIGTERM.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::cluster::LabelsView;
use crate::config::{Config, DevicePluginConfig};
use crate::desired::{Desired, ProfileOutcome, ProfileState, choose_profile};
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::host::arch::HostArch;
use crate::kube::EventType;
use crate::nvml::{GpuError, Gpus, HealthEvent, Inventory};
use crate::plugin::manager::{Command, PluginStatus};
use crate::plugin::server::PluginContext;
use crate::plugin::sharing::SharingError;
use crate::plugin::strategy::StrategyError;
use crate::status::{StageId, StageState};

mod device_plugin;
mod devnodes;
mod driver;
mod health;
mod memlimit;
mod metrics;
mod mig;
mod mps;
mod operator;
mod pass;
pub mod plan;
mod report;
mod runtime;
mod setup;
mod stage;
mod validation;

pub use device_plugin::{advertised_resources, allocate_options, health_policy, summary};
pub use driver::driver_command;
pub use mig::mig_command;
pub use operator::migrate_command;
use pass::{Note, Outbox, Pass};
pub use runtime::{cdi_generate, runtime_command};
use stage::Stages;

/// `run --once` exit code when a stage waits (GPU work holds a MIG or driver change):
/// EX_TEMPFAIL, try again later.
pub const EXIT_PENDING: i32 = Exit::TryLater as i32;

/// Why the agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Nvml(#[from] GpuError),
    #[error("{0}")]
    Strategy(#[from] StrategyError),
    #[error("{0}")]
    Sharing(#[from] SharingError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("cannot start the NVML health watcher thread: {0}")]
    HealthThread(std::io::Error),
}

impl AgentError {
    /// Exit code: 69 (EX_UNAVAILABLE) when NVML is missing, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Nvml(_) => Exit::NoNvml.code(),
            _ => Exit::Failed.code(),
        }
    }
}

/// The NVML library to load ([`crate::nvml::library_path`]): a path under the root; a soname
/// as-is on the real root, else found in the node's library folders for its architecture.
pub fn nvml_library(config: &Config, root: &HostRoot) -> PathBuf {
    crate::nvml::library_path(&config.nvml.library, root, &HostArch::read(root))
}

/// How often a long step before READY asks systemd for more start time (without a watchdog;
/// with one, at its ping interval).
const EXTEND_START_EVERY: Duration = Duration::from_secs(60);

/// A stage's step: runs the stage once, and answers whether the stages that need it may run.
type Step = for<'a> fn(&'a mut Agent) -> Pin<Box<dyn Future<Output = bool> + 'a>>;

/// The pipeline, in pass order (the order of [`StageId::ALL`]): each stage's id, the stages that
/// must have passed in this pass for it to run (the gating rules, as data: the driver stage also
/// passes with a failed upgrade while the old driver still serves), and its step. A stage is a
/// row here and a file in `agent/` with its step (ARCHITECTURE.md, "Adding a stage").
const PIPELINE: [(StageId, &[StageId], Step); 5] = [
    (StageId::Driver, &[], |a| Box::pin(a.driver_step())),
    (StageId::Runtime, &[StageId::Driver], |a| Box::pin(a.runtime_step())),
    (StageId::Mig, &[StageId::Driver, StageId::Runtime], |a| {
        Box::pin(a.mig_step())
    }),
    (StageId::DevicePlugin, &[StageId::Driver, StageId::Runtime], |a| {
        Box::pin(a.device_plugin_step())
    }),
    (
        StageId::Validation,
        &[StageId::Driver, StageId::Runtime, StageId::DevicePlugin],
        |a| Box::pin(a.validation_step()),
    ),
];

/// The pass as `agent` sees it now, for a stage's step ([`Pass`]): borrows the fields one by
/// one, so the stage stepped (another field) can be borrowed mutably beside it.
macro_rules! pass {
    ($a:expr) => {
        Pass {
            config: &$a.config,
            root: &$a.root,
            once: $a.once,
            stop: &$a.stop,
            gpus: $a.gpus.as_ref(),
            inventory: $a.inventory.as_ref(),
            view: &$a.view,
            desired: &$a.desired_sel,
            dp: &$a.dp,
            stages: &$a.stages,
            withdrawn: &$a.withdrawn,
            plugin: &$a.plugin_status,
            advertised: &$a.desired,
            plan_error: $a.plan_error.as_deref(),
            runtime_plan: $a.runtime_plan.as_ref(),
            held: &$a.held,
            services: &$a.services,
        }
    };
}

/// Calls a stage's entry point with the pass ([`pass!`]) and an outbox, then routes what the
/// stage said ([`Agent::route`]); answers what the entry point answered. `await` after the call
/// for an async one.
macro_rules! stepped {
    ($a:expr, $stage:ident . $method:ident ( $($arg:expr),* ) await) => {{
        let mut out = Outbox::default();
        let answer = $a.$stage.$method(&pass!($a), $($arg,)* &mut out).await;
        $a.route(&mut out);
        answer
    }};
    ($a:expr, $stage:ident . $method:ident ( $($arg:expr),* )) => {{
        let mut out = Outbox::default();
        let answer = $a.$stage.$method(&pass!($a), $($arg,)* &mut out);
        $a.route(&mut out);
        answer
    }};
}

/// The running agent's state.
struct Agent {
    config: Config,
    root: HostRoot,
    once: bool,
    gpus: Option<Gpus>,
    inventory: Option<Inventory>,
    /// Cancelled at SIGTERM/SIGINT: every long step stops at its next safe point.
    stop: CancellationToken,
    /// Every stage's status and retry state, by id.
    stages: Stages,
    plugin_status: PluginStatus,
    /// The plugin manager's status as it changes, for [`Agent::await_registration`].
    plugin_watch: Option<watch::Receiver<PluginStatus>>,
    health_tx: mpsc::UnboundedSender<HealthEvent>,
    health_stop: Option<Arc<AtomicBool>>,
    watched: BTreeSet<String>,
    base_ctx: PluginContext,
    /// Names of the resources last handed to the plugin manager.
    desired: Vec<String>,
    /// Why the device-plugin stage cannot advertise what it should (inventory or strategy).
    plan_error: Option<String>,
    /// The effective `[device_plugin]` settings: the config with the selected profile applied.
    dp: DevicePluginConfig,
    /// How the device plugin profile was chosen, for labels, Events and status.
    profile: ProfileOutcome,
    /// The labels last read from the link.
    view: LabelsView,
    /// What those labels ask for.
    desired_sel: Desired,
    /// What the runtime stage keeps between passes.
    runtime: runtime::RuntimeStage,
    /// The runtime stage's last good plan ([`Note::RuntimePlan`]).
    runtime_plan: Option<crate::runtime::stage::RuntimePlan>,
    /// What the GPU Operator holds ([`Note::Held`]).
    held: pass::Held,
    /// The validation stage.
    validation: validation::ValidationStage,
    /// The memory-limit enforcer.
    memory: memlimit::MemoryLimits,
    /// What the MIG stage keeps between passes.
    mig: mig::MigStage,
    /// The MPS control daemons (`strategy = "mps"`).
    mps: mps::MpsState,
    /// The status file, the Node's labels and Events, systemd's `STATUS=`.
    reporter: report::Reporter,
    /// What the stages share: the cluster link, the plugin manager's channel, the metrics, the
    /// health tracker, the DRA driver.
    services: pass::Services,
    /// GPUs (UUIDs) withdrawn from the kubelet while their MIG layout changes.
    withdrawn: BTreeSet<String>,
    /// What the driver stage keeps between passes.
    driver: driver::DriverStage,
    /// NVIDIA's GPU Operator on this node, as the last pass saw it.
    operator: operator::OperatorState,
    /// The device nodes and `/dev/char` links.
    devnodes: devnodes::DevNodes,
    /// Set on a node with no NVIDIA GPU (none on the PCI bus, and NVML cannot load): why. The
    /// agent idles, every stage skipped, and looks again every `nvml.retry_interval`.
    no_gpu: Option<String>,
}

/// Runs the agent until SIGTERM/SIGINT (or one pass with `once`). Returns the process exit code.
pub async fn run(config: Config, root: HostRoot, once: bool) -> Result<i32, AgentError> {
    let sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(AgentError::Signals)?;
    // SIGTERM and SIGINT cancel `stop`, whatever the agent is doing: every wait below races it,
    // and the long steps (MIG apply, driver build, engine restart, CUDA check) stop at their
    // next safe point.
    let stop = CancellationToken::new();
    tokio::spawn(setup::stop_on_signals(sigterm, sigint, stop.clone()));

    let setup::Started {
        mut agent,
        mut view_rx,
        mut plugin_rx,
        manager_task,
        relay_task,
        mut health_changed,
    } = setup::start(config, root, once, &stop).await;
    // Until READY, a long step (a driver install or build) extends systemd's start timeout while
    // it runs.
    let extend_start = (!once && agent.reporter.notifier().enabled()).then(|| {
        let every = agent
            .reporter
            .notifier()
            .watchdog_interval()
            .unwrap_or(EXTEND_START_EVERY);
        tokio::spawn(crate::notify::extend_start(every, agent.services.long_step.clone()))
    });
    // The driver first: on a fresh node NVML only loads once the driver stage installed it.
    if agent.config.driver.enabled && agent.config.driver.source != crate::config::DriverSource::None {
        or_stop(&stop, agent.driver_step()).await;
    }
    // NVML: fatal when fail_on_init_error, else retried in the loop below. A node with no NVIDIA
    // GPU at all (a CPU node of a fleet that installs the package everywhere) idles instead.
    if agent.gpus.is_none()
        && let Err(e) = agent.open_nvml()
    {
        if let Some(why) = agent.without_gpus(&e) {
            tracing::info!(
                "{why}: idle, nothing is configured; looking for a GPU every {:?}",
                agent.config.nvml.retry_interval
            );
            agent.idle(why);
        } else if (agent.config.nvml.fail_on_init_error || once) && !stop.is_cancelled() {
            agent.stages[StageId::DevicePlugin].set(StageState::Failed, Some(e.to_string()), None);
            agent.write_status("stopped");
            return Err(e);
        } else {
            tracing::error!(
                "{e}; running with no devices and retrying every {:?} ([nvml] fail_on_init_error = false)",
                agent.config.nvml.retry_interval
            );
        }
    }
    if !stop.is_cancelled() {
        or_stop(&stop, agent.reconcile()).await;
    }

    if once {
        if stop.is_cancelled() {
            // Not done: the bootstrap may run it again (75, "try again later").
            agent.write_status("stopped");
            return Ok(EXIT_PENDING);
        }
        agent.write_status("once");
        // Pending counts as not done: the bootstrap should not go on as if MIG were applied. It
        // is EX_TEMPFAIL (75, "try again later": GPU work holds a change), a failure is 1.
        let states: Vec<StageState> = agent.stages.iter().map(|s| s.status.state).collect();
        return Ok(if states.contains(&StageState::Failed) {
            1
        } else if states.contains(&StageState::Pending) {
            EXIT_PENDING
        } else {
            0
        });
    }

    let mut resync = tokio::time::interval_at(
        tokio::time::Instant::now() + agent.config.agent.resync_interval,
        agent.config.agent.resync_interval,
    );
    let mut nvml_retry = tokio::time::interval(agent.config.nvml.retry_interval);
    nvml_retry.tick().await;
    // The first reconcile has finished (or reached a state it reports): systemd may go on.
    agent.notify_status();
    agent.reporter.notifier().send("READY=1");
    if let Some(task) = extend_start {
        task.abort();
    }
    // The watchdog: the main loop beats on every interval; a separate task tells systemd while
    // the beats are recent, or while a long step (a driver build, an engine restart) is known to
    // hold the loop.
    let watchdog_every = agent.reporter.notifier().watchdog_interval();
    let mut watchdog = tokio::time::interval(watchdog_every.unwrap_or(Duration::from_secs(3600)));
    if let Some(every) = watchdog_every {
        tokio::spawn(crate::notify::watchdog(
            every,
            agent.services.heartbeat.clone(),
            agent.services.long_step.clone(),
        ));
    }
    while !stop.is_cancelled() {
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            _ = watchdog.tick(), if watchdog_every.is_some() => crate::notify::beat(&agent.services.heartbeat),
            _ = sighup.recv() => {
                tracing::info!("SIGHUP: re-reading the inventory, every stage runs now");
                agent.retry_all_now();
                or_stop(&stop, agent.reconcile()).await;
            }
            () = sleep_until(agent.next_retry()) => { or_stop(&stop, agent.reconcile()).await; }
            Ok(()) = changed(&mut health_changed) => {
                // The relay has told the kubelet already; the reports follow.
                agent.update_stage();
                agent.write_status("running");
            }
            () = sleep_until(agent.mig.retry) => {
                agent.mig.retry = None;
                agent.stages[StageId::Mig].now();
                or_stop(&stop, agent.reconcile()).await;
            }
            _ = resync.tick() => { or_stop(&stop, agent.reconcile()).await; }
            _ = nvml_retry.tick(), if agent.gpus.is_none() => {
                if agent.no_gpu.is_some() {
                    if agent.gpu_appeared() {
                        // The driver stage first (it may install the driver), then NVML.
                        agent.retry_all_now();
                        or_stop(&stop, agent.reconcile()).await;
                        if agent.gpus.is_none() && agent.open_nvml().is_ok() {
                            agent.retry_all_now();
                            or_stop(&stop, agent.reconcile()).await;
                        }
                    }
                } else {
                    match agent.open_nvml() {
                        Ok(()) => {
                            agent.retry_all_now();
                            or_stop(&stop, agent.reconcile()).await;
                        }
                        Err(e) => tracing::warn!("NVML still unavailable: {e}"),
                    }
                }
            }
            Ok(view) = next_view(&mut view_rx) => {
                agent.view = view;
                agent.remember_desired();
                let desired = Desired::from_labels(&agent.view.labels, &agent.config.labels);
                let mig_changed = desired.mig_config != agent.desired_sel.mig_config;
                agent.desired_sel = desired.clone();
                or_stop(&stop, agent.apply_desired(&desired, mig_changed)).await;
            }
            Some(record) = agent.memory.next_record() => {
                memlimit::on_record(record, &agent.services);
            }
            Some(()) = agent.mps.changed.recv() => agent.report_mps(),
            Ok(()) = dra_status_changed(&mut agent.services.dra) => agent.write_status("running"),
            Ok(()) = plugin_rx.changed() => {
                agent.plugin_status = plugin_rx.borrow_and_update().clone();
                agent.update_stage();
                agent.show_validation();
                agent.write_status("running");
            }
        }
    }

    // Stop: the relay ends when its channel closes, and the manager (which stops every server
    // and removes its sockets) when the relay's closes.
    agent.reporter.notifier().send("STOPPING=1\nSTATUS=stopping");
    agent.services.commands = None;
    if let Some(task) = relay_task {
        let _ = task.await;
    }
    if let Some(task) = manager_task {
        let _ = task.await;
    }
    if let Some(dra) = agent.services.dra.take() {
        dra.join().await;
    }
    // After the plugin is gone: quit the MPS daemons, compute mode DEFAULT back.
    agent.mps.stop(agent.gpus.as_ref());
    if let Some(stop) = agent.health_stop.take() {
        stop.store(true, Ordering::Relaxed);
    }
    agent.plugin_status = plugin_rx.borrow().clone();
    agent.write_status("stopped");
    Ok(0)
}

/// Runs `work` until it ends or `stop` is cancelled, whichever comes first. A cancelled step is
/// dropped at its await point; what it runs off the loop (NVML calls, commands) looks at the same
/// token and ends at its next safe point.
async fn or_stop<T>(stop: &CancellationToken, work: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        done = work => Some(done),
    }
}

/// The next change of a watch channel, or never when there is none.
async fn changed<T>(rx: &mut Option<watch::Receiver<T>>) -> Result<(), watch::error::RecvError> {
    match rx {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}

/// The next labels view, or never when there is no link.
/// The DRA driver's status changed; pending forever without a driver.
async fn dra_status_changed(dra: &mut Option<crate::dra::DraHandle>) -> Result<(), watch::error::RecvError> {
    match dra {
        Some(d) => d.status.changed().await,
        None => std::future::pending().await,
    }
}

async fn next_view(rx: &mut Option<watch::Receiver<LabelsView>>) -> Result<LabelsView, watch::error::RecvError> {
    match rx {
        Some(rx) => {
            rx.changed().await?;
            Ok(rx.borrow_and_update().clone())
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

impl Agent {
    /// Routes what a stage said: statuses to the stage table, Events to the Node, a change of
    /// devices to the inventory and the validation stage.
    fn route(&mut self, out: &mut Outbox) {
        for note in out.take() {
            match note {
                Note::Status {
                    id,
                    state,
                    error,
                    detail,
                } => self.stages[id].set(state, error, detail),
                Note::Event { kind, reason, message } => self.event(kind, reason, message),
                Note::RuntimePlan(plan) => self.runtime_plan = plan,
                Note::Held(held) => self.held = held,
                Note::Restore => self.restore_withdrawn(),
                Note::DevicesChanged => {
                    self.inventory = None;
                    self.validation.devices_changed();
                    self.stages[StageId::Validation].now();
                }
            }
        }
    }

    /// Creates the device nodes and links the inventory needs, then reads the nodes the device
    /// plugin and the CDI spec hand out again.
    fn ensure_device_nodes(&mut self) {
        self.base_ctx.nodes = self.devnodes.ensure(&self.config, &self.root, self.inventory.as_ref());
    }

    /// Brings the MPS control daemons to what the effective settings ask for, and gives
    /// `Allocate` their folders and limits.
    fn update_mps(&mut self) {
        let serving = self.services.commands.is_some() && self.plan_error.is_none();
        let (allocate, looked_after) = self.mps.update(&pass!(self), serving);
        self.base_ctx.allocate.mps = allocate;
        if looked_after {
            self.report_mps();
        }
    }

    /// A daemon failed (a Warning Event, once) or changed: the device-plugin stage and the
    /// reports follow.
    fn report_mps(&mut self) {
        let mut out = Outbox::default();
        self.mps.report(&mut out);
        self.route(&mut out);
        self.update_stage();
        self.write_status("running");
    }

    /// Publishes the inventory to the metrics' readings loop.
    fn metrics_inventory(&mut self) {
        if let Some(m) = &mut self.services.metrics {
            let (config, node) = (&self.config.metrics, self.reporter.node());
            m.inventory(self.inventory.as_ref(), self.gpus.as_ref(), config, node, &self.root);
        }
    }

    /// The stage series (with `durations` of this pass's steps) and device health transitions.
    fn metrics_stages(&mut self, durations: &[(&str, Duration)]) {
        if let Some(m) = &mut self.services.metrics {
            m.stages(&self.stages, durations, self.inventory.as_ref(), &self.services.tracker);
        }
    }

    /// The runtime stage's step.
    async fn runtime_step(&mut self) -> bool {
        stepped!(self, runtime.step() await)
    }

    /// Rewrites the CDI spec for the inventory (the runtime stage's).
    fn cdi_step(&mut self) {
        stepped!(self, runtime.cdi(&self.base_ctx.nodes))
    }

    /// The driver stage: its plan, and a change applied with the GPUs withdrawn from the
    /// kubelet and NVML closed for an upgrade; NVML is (re)opened after, whether the change
    /// succeeded or not. `false` when the stages after it cannot run (no working driver; a
    /// failed upgrade with NVML back on the driver still loaded lets them re-read the inventory
    /// and advertise the GPUs again).
    async fn driver_step(&mut self) -> bool {
        let next = stepped!(self, driver.plan() await);
        let planned = match next {
            driver::DriverNext::Done(go_on) => return go_on,
            driver::DriverNext::Apply(planned) => planned,
        };
        let upgrade = driver::is_upgrade(&planned);
        if upgrade {
            let uuids: Vec<String> = self
                .inventory
                .iter()
                .flat_map(|i| i.gpus.iter().map(|g| g.uuid.clone()))
                .collect();
            tracing::info!(
                "driver: withdrawing {} GPU(s) from the kubelet for the driver change",
                uuids.len()
            );
            self.withdrawn.extend(uuids);
            self.push_resources().await;
            self.close_nvml();
        }
        let applied = stepped!(self, driver.apply(&planned) await);
        if let Err(e) = applied {
            tracing::error!("driver stage failed: {e}");
            // After a failed upgrade: NVML again, on whatever driver is still loaded, and the
            // GPUs withdrawn for the change given back. Without NVML nothing is advertised until
            // it loads (retried every `[nvml] retry_interval`).
            let go_on = upgrade && {
                if self.gpus.is_none()
                    && let Err(e) = self.open_nvml()
                {
                    tracing::error!("NVML after the failed driver change: {e}");
                }
                self.restore_withdrawn();
                self.inventory = None;
                self.gpus.is_some()
            };
            self.stages[StageId::Driver].set(StageState::Failed, Some(e.clone()), None);
            self.driver.failed(&planned, e);
            return go_on;
        }
        if self.gpus.is_none()
            && let Err(e) = self.open_nvml()
        {
            tracing::error!("NVML after the driver change: {e}");
        }
        if upgrade {
            self.withdrawn.clear();
            self.inventory = None;
        }
        stepped!(self, driver.applied(&planned) await)
    }

    /// The MIG stage, once NVML is up: its plan, then a change made with the GPUs it changes
    /// withdrawn from the kubelet first and `pending` (or `rebooting`) shown on the Node.
    async fn mig_step(&mut self) -> bool {
        let Some(gpus) = self.gpus.clone() else {
            return false;
        };
        let next = stepped!(self, mig.plan() await);
        let mig::MigNext::Change(change) = next else {
            return true;
        };
        if change.changing.iter().any(|u| !self.withdrawn.contains(u)) {
            tracing::info!(
                "MIG layout {}: withdrawing {} from the kubelet before changing them",
                change.name,
                change.changing.join(", ")
            );
            self.withdrawn.extend(change.changing.iter().cloned());
            self.push_resources().await;
        }
        let mut out = Outbox::default();
        if self.mig.announce(&change, &mut out) {
            self.route(&mut out);
            self.write_status_with_inventory(&gpus);
            let pending = crate::mig::stage::MigState::Pending.as_str();
            mig::wait_for_label_on_node(&pass!(self), pending, mig::PENDING_LABEL_WAIT).await;
        }
        let after = stepped!(self, mig.apply(*change) await);
        if let mig::MigAfter::Reboot = after {
            self.write_status_with_inventory(&gpus);
            let rebooting = crate::mig::stage::MigState::Rebooting.as_str();
            mig::wait_for_label_on_node(&pass!(self), rebooting, mig::REBOOT_LABEL_WAIT).await;
            mig::reboot(&pass!(self));
        }
        true
    }

    /// Writes the status and reports the labels now. Labels are only reported with an
    /// inventory (none means "nothing known yet"), and at boot the MIG stage runs before the
    /// inventory is read: one is read for this report and left for the device plugin stage to
    /// read again (which also starts the health watch).
    fn write_status_with_inventory(&mut self, gpus: &Gpus) {
        let borrowed = self.inventory.is_none();
        if borrowed {
            self.inventory = gpus.inventory(&self.root.join("/sys")).ok();
        }
        self.write_status("running");
        if borrowed {
            self.inventory = None;
        }
    }

    /// Gives withdrawn GPUs back to the kubelet (the next push advertises them).
    fn restore_withdrawn(&mut self) {
        if !self.withdrawn.is_empty() {
            tracing::info!(
                "advertising {} again",
                self.withdrawn.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            self.withdrawn.clear();
        }
    }

    /// The validation stage's step.
    async fn validation_step(&mut self) -> bool {
        stepped!(self, validation.step() await)
    }

    /// The validation stage's device plugin check follows the plugin's status.
    fn show_validation(&mut self) {
        stepped!(self, validation.show())
    }

    /// Drops NVML (before the driver under it is unloaded): the health watcher stops, the
    /// inventory is forgotten.
    fn close_nvml(&mut self) {
        if let Some(stop) = self.health_stop.take() {
            stop.store(true, Ordering::Relaxed);
        }
        self.watched.clear();
        self.gpus = None;
        // The enforcer holds the old NVML.
        self.memory.stop();
    }

    fn open_nvml(&mut self) -> Result<(), AgentError> {
        // NVML opens nvidiactl and nvidia<N>: on a host without nvidia-modprobe the driver stage's
        // load (or whoever loaded it) may have left them missing.
        self.ensure_device_nodes();
        let library = nvml_library(&self.config, &self.root);
        match Gpus::open(&library) {
            Ok(gpus) => {
                tracing::info!("NVML loaded from {}", library.display());
                self.gpus = Some(gpus);
                Ok(())
            }
            Err(e) => {
                let e = AgentError::from(e);
                // On a node with no GPU at all that is no failure: the caller idles.
                if self.without_gpus(&e).is_none() {
                    self.stages[StageId::DevicePlugin].set(StageState::Failed, Some(e.to_string()), None);
                    self.write_status("running");
                }
                Err(e)
            }
        }
    }

    /// Why this node has no NVIDIA GPU to manage, given that NVML failed with `nvml`: `None`
    /// when a GPU is on the PCI bus (then NVML's failure is an error) or the bus cannot be read.
    fn without_gpus(&self, nvml: &AgentError) -> Option<String> {
        match crate::driver::observe::nvidia_gpus(&self.root) {
            Ok(gpus) if gpus.is_empty() => Some(format!(
                "no NVIDIA GPU on this node (none on the PCI bus, and NVML: {nvml})"
            )),
            _ => None,
        }
    }

    /// Idles for `why`: every stage skipped, status and systemd say why.
    fn idle(&mut self, why: String) {
        for stage in self.stages.iter_mut() {
            stage.idle(&why);
        }
        self.no_gpu = Some(why);
        self.write_status("running");
    }

    /// While idle: whether a GPU has appeared (on the PCI bus, or NVML now loads: a driver
    /// loaded later on a host whose sysfs shows no bus). Quiet while nothing changed.
    fn gpu_appeared(&mut self) -> bool {
        let library = nvml_library(&self.config, &self.root);
        let found = match crate::driver::observe::nvidia_gpus(&self.root) {
            Ok(gpus) if !gpus.is_empty() => Some(format!(
                "NVIDIA GPU(s) on the PCI bus: {}",
                gpus.iter().map(|g| g.address.as_str()).collect::<Vec<_>>().join(", ")
            )),
            _ => match Gpus::open(&library) {
                Ok(gpus) => {
                    self.gpus = Some(gpus);
                    Some(format!("NVML loads from {}", library.display()))
                }
                Err(e) => {
                    tracing::debug!("still no NVIDIA GPU: {e}");
                    None
                }
            },
        };
        let Some(found) = found else {
            return false;
        };
        tracing::info!("{found}: no longer idle, every stage runs");
        self.no_gpu = None;
        for stage in self.stages.iter_mut() {
            stage.set(StageState::Pending, None, None);
        }
        true
    }

    /// One pass over the stages: re-read the inventory and advertise what it gives.
    async fn reconcile(&mut self) {
        if self.no_gpu.is_some() {
            self.write_status("running");
            return;
        }
        stepped!(self, operator.check());
        let now = Instant::now();
        let mut passed = Vec::new();
        let mut durations = Vec::new();
        for (id, needs, step) in PIPELINE {
            if !stage::may_run(needs, &passed) {
                continue;
            }
            if id == StageId::Validation && self.stages[id].due(now) {
                // The CUDA check (a child that loads the driver and makes a context) waits until
                // the kubelet has the devices: it must not compete with the registration.
                self.await_registration().await;
            }
            let started = Instant::now();
            let ok = if self.stages[id].due(now) {
                let ok = step(self).await;
                let ok = self.stages[id].ran(ok);
                if id == StageId::Mig && self.mig.gave_up.is_some() {
                    // A layout given up on looks again on its own timer, not the backoff's.
                    self.stages[id].now();
                }
                ok
            } else {
                self.stages[id].held()
            };
            durations.push((id.as_str(), started.elapsed()));
            if ok {
                passed.push(id);
            }
        }
        self.write_status("running");
        self.metrics_stages(&durations);
    }

    /// The soonest time a failed stage waits for (past ones are left to the next pass: a stage
    /// held back by an earlier failed one must not wake the loop).
    fn next_retry(&self) -> Option<Instant> {
        let now = Instant::now();
        self.stages
            .iter()
            .filter_map(|s| s.retry_at())
            .filter(|at| *at > now)
            .min()
    }

    /// Every stage runs at the next pass, whatever its backoff says.
    fn retry_all_now(&mut self) {
        for stage in self.stages.iter_mut() {
            stage.now();
        }
    }

    /// The device plugin stage: reads the inventory (also for the CDI spec and the GPU feature
    /// labels, with or without the device plugin) and advertises what it gives. `false` when
    /// there is nothing to validate: no NVML, no inventory, or the device plugin is off.
    async fn device_plugin_step(&mut self) -> bool {
        let Some(gpus) = self.gpus.clone() else {
            return false;
        };
        // The metrics hear of a new inventory after the kubelet does (their GPM probes and
        // first samples are not on the way to registration).
        let mut inventory_changed = false;
        match gpus.inventory(&self.root.join("/sys")) {
            Ok(inventory) => {
                if self.inventory.as_ref() != Some(&inventory) {
                    tracing::info!(
                        "inventory: driver {}, CUDA {}, {} GPU(s)",
                        inventory.driver_version,
                        inventory.cuda_driver_version,
                        inventory.gpus.len(),
                    );
                    self.base_ctx.topology = gpus.topology(&inventory);
                    self.inventory = Some(inventory);
                    // The new MIG devices' capability nodes exist before the spec names them.
                    self.ensure_device_nodes();
                    self.watch_health(&gpus);
                    self.cdi_step();
                    inventory_changed = true;
                } else if self.runtime.cdi_due(&pass!(self)) {
                    // A failed write is tried again, a removed spec written again.
                    self.cdi_step();
                }
            }
            Err(e) => {
                // Keep advertising the last good inventory (health marks what broke); say why.
                tracing::error!("cannot read the GPU inventory: {e}");
                self.plan_error = Some(e.to_string());
                self.update_stage();
                return false;
            }
        }
        if !self.config.device_plugin.enabled {
            self.stages[StageId::DevicePlugin].set(
                StageState::Disabled,
                None,
                Some("[device_plugin] enabled = false".into()),
            );
            if inventory_changed {
                self.metrics_inventory();
            }
            return false;
        }
        self.push_resources().await;
        if inventory_changed {
            self.metrics_inventory();
        }
        true
    }

    /// Waits until the plugin manager has settled the registration of what was last advertised
    /// (every resource registered or failed, or no kubelet), at most [`REGISTRATION_WAIT`] and
    /// never past SIGTERM. Without a manager (`run --once`, device plugin off) it returns at once.
    async fn await_registration(&mut self) {
        let (stop, desired) = (self.stop.clone(), self.desired.clone());
        let Some(rx) = self.plugin_watch.as_mut() else { return };
        let settled = rx.wait_for(|status| device_plugin::registration_settled(status, &desired));
        let _ = tokio::time::timeout(device_plugin::REGISTRATION_WAIT, or_stop(&stop, settled)).await;
    }

    /// Applies what the labels ask for: the device plugin profile (a changed profile swaps the
    /// advertised resources in place). A label naming nothing changes nothing and is reported.
    async fn apply_desired(&mut self, desired: &Desired, mig_changed: bool) {
        if mig_changed {
            // A new layout: the MIG stage runs now, then the inventory and resources follow.
            self.mig.pending_since = None;
            self.stages[StageId::Mig].now();
            self.reconcile().await;
        }
        let key = &self.config.labels.device_plugin_config;
        let (dp, outcome) = choose_profile(
            &self.config.device_plugin,
            &desired.device_plugin_config,
            self.profile.applied.as_deref(),
            key,
        );
        if outcome != self.profile {
            match (&outcome.state, &outcome.reason) {
                (ProfileState::Failed, Some(reason)) => tracing::warn!("device plugin profile: {reason}"),
                _ => tracing::info!(
                    "device plugin profile: {}",
                    outcome
                        .applied
                        .as_deref()
                        .unwrap_or("none (the [device_plugin] keys as configured)")
                ),
            }
            self.profile = outcome;
        }
        if dp != self.dp {
            self.dp = dp;
            self.base_ctx.allocate = allocate_options(&self.dp);
            self.base_ctx.shared_policy = self.dp.sharing.policy;
            self.push_resources().await;
        } else {
            self.write_status("running");
        }
    }

    /// (Re)starts the NVML health watcher when the set of GPUs changed.
    fn watch_health(&mut self, gpus: &Gpus) {
        if self.once {
            return;
        }
        let uuids: BTreeSet<String> = self
            .inventory
            .iter()
            .flat_map(|i| i.gpus.iter().map(|g| g.uuid.clone()))
            .collect();
        if uuids == self.watched && self.health_stop.is_some() {
            return;
        }
        if let Some(stop) = self.health_stop.take() {
            stop.store(true, Ordering::Relaxed);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let interval = self.config.health.lost_check_interval;
        match gpus.watch_health(
            uuids.iter().cloned().collect(),
            interval,
            self.health_tx.clone(),
            stop.clone(),
        ) {
            Ok(_) => {
                self.health_stop = Some(stop);
                self.watched = uuids;
            }
            Err(e) => tracing::error!("{}", AgentError::HealthThread(e)),
        }
    }

    /// Hands the DRA driver the inventory (without the GPUs whose MIG layout is changing).
    fn push_dra_inventory(&self) {
        let Some(tx) = self.services.dra.as_ref().map(|d| &d.inventory) else {
            return;
        };
        let inventory = self.inventory.as_ref().map(|inv| {
            let mut inv = inv.clone();
            inv.gpus.retain(|g| !self.withdrawn.contains(&g.uuid));
            Arc::new(inv)
        });
        tx.send_if_modified(|current| {
            let changed = *current != inventory;
            if changed {
                current.clone_from(&inventory);
            }
            changed
        });
    }

    async fn push_resources(&mut self) {
        self.push_dra_inventory();
        let resources = match device_plugin::resources(&pass!(self)) {
            Ok(r) => {
                self.plan_error = None;
                r
            }
            Err(e) => {
                // Nothing consistent to advertise: withdraw everything and say why.
                tracing::error!("device plugin stage failed: {e}");
                self.plan_error = Some(e.to_string());
                Vec::new()
            }
        };
        // The MPS daemons first: the replicas they serve are advertised next.
        self.update_mps();
        if self.once {
            if self.plan_error.is_none() {
                let detail = summary(&resources);
                let detail = format!("run --once does not serve the kubelet; would advertise {detail}");
                self.stages[StageId::DevicePlugin].set(StageState::Skipped, None, Some(detail));
            }
        } else if let Some(tx) = &self.services.commands {
            if self.plan_error.is_none() {
                tracing::info!("advertising {}", summary(&resources));
            }
            self.desired = resources.iter().map(|r| r.name.clone()).collect();
            let _ = tx
                .send(Command::Set {
                    resources,
                    ctx: Arc::new(self.base_ctx.clone()),
                })
                .await;
        }
        // The replicas' memory budgets follow what is advertised.
        self.memory.update(&pass!(self));
        self.update_stage();
        self.write_status("running");
    }

    /// The device-plugin stage state from what the manager reports.
    fn update_stage(&mut self) {
        let mut out = Outbox::default();
        device_plugin::show(&pass!(self), &self.mps, &mut out);
        self.route(&mut out);
    }

    /// `STATUS=` for systemd: each stage's state, with the first problem's reason.
    fn notify_status(&mut self) {
        self.reporter.notify(&self.stages, self.no_gpu.as_deref());
    }

    /// Writes the status file and reports to the Node and systemd what changed.
    fn write_status(&mut self, state: &str) {
        self.notify_status();
        self.metrics_stages(&[]);
        let mut out = Outbox::default();
        let operator = self
            .operator
            .status(&self.config, &self.root, &self.plugin_status, &mut out);
        self.route(&mut out);
        let report = report::Report {
            config: &self.config,
            root: &self.root,
            stages: &self.stages,
            inventory: self.inventory.as_ref(),
            tracker: &self.services.tracker,
            plugin: &self.plugin_status,
            link: self.services.link.as_ref(),
            view: &self.view,
            desired: &self.desired_sel,
            profile: &self.profile,
            dp: &self.dp,
            mig_state: self.mig.state,
            mps: self.mps.statuses(),
            dra: self.services.dra.as_ref().map(|d| d.status.borrow().clone()),
            dev_char: self.devnodes.dev_char.clone(),
            operator,
        };
        self.reporter.write(state, report);
    }
}

impl Agent {
    /// Posts an Event on the Node through the cluster link (under `run --once` too; nothing
    /// without a link or with `[kubernetes] events = false`).
    fn event(&self, kind: EventType, reason: &str, message: String) {
        if let Some(link) = &self.services.link {
            link.event(kind, reason, message);
        }
    }

    /// Keeps the desired-state labels the source gave last (the MIG layout and device plugin
    /// profile) in the state dir: at boot a source that does not answer in time (an API server
    /// still starting) must not mean whole GPUs advertised where a MIG layout was asked for.
    fn remember_desired(&self) {
        if !self.view.connected || self.view.source == crate::desired::Source::None {
            return;
        }
        let keys = [&self.config.labels.mig_config, &self.config.labels.device_plugin_config];
        let text: String = keys
            .iter()
            .filter_map(|k| self.view.labels.get(*k).map(|v| format!("{k}={v}\n")))
            .collect();
        let path = self
            .root
            .join(&self.config.agent.state_dir)
            .join(setup::LAST_DESIRED_FILE);
        if std::fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
            return;
        }
        if let Err(e) = crate::host::write_atomic(&path, text.as_bytes(), 0o644) {
            tracing::warn!("cannot keep the desired state for the next start: {e}");
        }
    }
}
