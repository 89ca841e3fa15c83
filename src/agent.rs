//! The reconcile loop: stages in order (driver, runtime, MIG, device plugin; a failed stage
//! stops the ones after it until the next pass), health events, periodic
//! resync, status reporting, and a clean stop on SIGTERM.

use std::collections::BTreeSet;
use std::pin::Pin;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::cluster::LabelsView;
use crate::config::Config;
use crate::desired::Desired;
use crate::host::HostRoot;
use crate::nvml::{Gpus, Inventory};
use crate::plugin::manager::PluginStatus;
use crate::status::{StageId, StageState};

mod device_plugin;
mod devnodes;
mod driver;
mod error;
mod health;
mod memlimit;
mod metrics;
mod mig;
mod mps;
mod nvml;
mod operator;
mod pass;
pub mod plan;
mod report;
mod runtime;
mod setup;
mod stage;
mod validation;
mod wait;

use device_plugin::{DevicePluginStage, InventoryRead};
pub use device_plugin::{advertised_resources, allocate_options, summary};
pub use driver::driver_command;
pub use error::AgentError;
pub use health::health_policy;
pub use mig::mig_command;
pub use nvml::nvml_library;
pub use operator::migrate_command;
use pass::{Note, Outbox, Pass};
pub use runtime::{cdi_generate, runtime_command};
pub use stage::EXIT_PENDING;
use stage::Stages;
use wait::{changed, dra_status_changed, next_view, or_stop, sleep_until};

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
            gpus: $a.nvml.gpus.as_ref(),
            inventory: $a.inventory.as_ref(),
            view: &$a.view,
            desired: &$a.desired_sel,
            dp: &$a.device_plugin.dp,
            stages: &$a.stages,
            withdrawn: &$a.withdrawn,
            plugin: &$a.plugin_status,
            advertised: &$a.device_plugin.advertised,
            plan_error: $a.device_plugin.plan_error.as_deref(),
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
    /// NVML and its health watcher; why the node idles when it has no GPU.
    nvml: nvml::Nvml,
    inventory: Option<Inventory>,
    /// Cancelled at SIGTERM/SIGINT: every long step stops at its next safe point.
    stop: CancellationToken,
    /// Every stage's status and retry state, by id.
    stages: Stages,
    plugin_status: PluginStatus,
    /// The device plugin stage: the plugin context, the profile, what was advertised.
    device_plugin: DevicePluginStage,
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

    let started = setup::start(config, root, once, &stop).await;
    let (mut view_rx, mut plugin_rx, mut health_changed) = (started.view_rx, started.plugin_rx, started.health_changed);
    let (manager_task, relay_task) = (started.manager_task, started.relay_task);
    let mut agent = Agent {
        config: started.config,
        root: started.root,
        once,
        nvml: started.nvml,
        inventory: None,
        stop: stop.clone(),
        stages: started.stages,
        plugin_status: PluginStatus::default(),
        device_plugin: started.device_plugin,
        view: started.view,
        desired_sel: started.desired,
        runtime: runtime::RuntimeStage::default(),
        runtime_plan: None,
        held: pass::Held::default(),
        validation: validation::ValidationStage::default(),
        memory: memlimit::MemoryLimits::default(),
        mig: mig::MigStage::default(),
        mps: mps::MpsState::new(),
        reporter: started.reporter,
        services: started.services,
        withdrawn: BTreeSet::new(),
        driver: driver::DriverStage::default(),
        operator: operator::OperatorState::default(),
        devnodes: devnodes::DevNodes::default(),
    };
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
    if agent.nvml.gpus.is_none()
        && let Err(e) = agent.open_nvml()
    {
        if let Some(why) = nvml::without_gpus(&agent.root, &e) {
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
        return Ok(agent.stages.once_exit_code());
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
                agent.stages.all_now();
                or_stop(&stop, agent.reconcile()).await;
            }
            () = sleep_until(agent.stages.next_retry()) => { or_stop(&stop, agent.reconcile()).await; }
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
            _ = nvml_retry.tick(), if agent.nvml.gpus.is_none() => {
                if agent.nvml.no_gpu.is_some() {
                    if agent.nvml.gpu_appeared(&agent.config, &agent.root) {
                        for stage in agent.stages.iter_mut() {
                            stage.set(StageState::Pending, None, None);
                        }
                        // The driver stage first (it may install the driver), then NVML.
                        agent.stages.all_now();
                        or_stop(&stop, agent.reconcile()).await;
                        if agent.nvml.gpus.is_none() && agent.open_nvml().is_ok() {
                            agent.stages.all_now();
                            or_stop(&stop, agent.reconcile()).await;
                        }
                    }
                } else {
                    match agent.open_nvml() {
                        Ok(()) => {
                            agent.stages.all_now();
                            or_stop(&stop, agent.reconcile()).await;
                        }
                        Err(e) => tracing::warn!("NVML still unavailable: {e}"),
                    }
                }
            }
            Ok(view) = next_view(&mut view_rx) => {
                agent.view = view;
                setup::remember_desired(&agent.config, &agent.root, &agent.view);
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
    agent.mps.stop(agent.nvml.gpus.as_ref());
    agent.nvml.stop_health();
    agent.plugin_status = plugin_rx.borrow().clone();
    agent.write_status("stopped");
    Ok(0)
}

impl Agent {
    /// One pass over the stages: re-read the inventory and advertise what it gives.
    async fn reconcile(&mut self) {
        if self.nvml.no_gpu.is_some() {
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
                self.device_plugin.await_registration(&self.stop).await;
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
                Note::Event { kind, reason, message } => {
                    // Through the cluster link (under `run --once` too; nothing without a link
                    // or with `[kubernetes] events = false`).
                    if let Some(link) = &self.services.link {
                        link.event(kind, reason, message);
                    }
                }
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

    /// Idles for `why`: every stage skipped, status and systemd say why.
    fn idle(&mut self, why: String) {
        for stage in self.stages.iter_mut() {
            stage.idle(&why);
        }
        self.nvml.no_gpu = Some(why);
        self.write_status("running");
    }

    /// The device plugin stage: reads the inventory (also for the CDI spec and the GPU feature
    /// labels, with or without the device plugin) and advertises what it gives. `false` when
    /// there is nothing to validate: no NVML, no inventory, or the device plugin is off.
    async fn device_plugin_step(&mut self) -> bool {
        let Some(gpus) = self.nvml.gpus.clone() else {
            return false;
        };
        // The metrics hear of a new inventory after the kubelet does (their GPM probes and
        // first samples are not on the way to registration).
        let mut inventory_changed = false;
        match self
            .device_plugin
            .read_inventory(&gpus, &self.root, self.inventory.as_ref())
        {
            InventoryRead::New(inventory) => {
                self.inventory = Some(inventory);
                // The new MIG devices' capability nodes exist before the spec names them.
                self.ensure_device_nodes();
                if !self.once {
                    self.nvml.watch_health(&self.config, self.inventory.as_ref());
                }
                self.cdi_step();
                inventory_changed = true;
            }
            InventoryRead::Same => {
                if self.runtime.cdi_due(&pass!(self)) {
                    // A failed write is tried again, a removed spec written again.
                    self.cdi_step();
                }
            }
            InventoryRead::Failed => {
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

    /// Applies what the labels ask for: the MIG layout, and the device plugin profile (a changed
    /// profile swaps the advertised resources in place).
    async fn apply_desired(&mut self, desired: &Desired, mig_changed: bool) {
        if mig_changed {
            // A new layout: the MIG stage runs now, then the inventory and resources follow.
            self.mig.pending_since = None;
            self.stages[StageId::Mig].now();
            self.reconcile().await;
        }
        if self.device_plugin.switch_profile(&self.config, desired) {
            self.push_resources().await;
        } else {
            self.write_status("running");
        }
    }

    /// Hands the plugin manager (and the DRA driver) the resources the inventory gives now.
    async fn push_resources(&mut self) {
        device_plugin::push_dra_inventory(&pass!(self));
        let planned = device_plugin::resources(&pass!(self));
        let resources = self.device_plugin.planned(planned);
        // The MPS daemons first: the replicas they serve are advertised next.
        self.update_mps();
        let mut out = Outbox::default();
        let commands = self.services.commands.as_ref();
        self.device_plugin
            .hand_over(self.once, commands, resources, &mut out)
            .await;
        self.route(&mut out);
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
        self.reporter.notify(&self.stages, self.nvml.no_gpu.as_deref());
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
            profile: &self.device_plugin.profile,
            dp: &self.device_plugin.dp,
            mig_state: self.mig.state,
            mps: self.mps.statuses(),
            dra: self.services.dra.as_ref().map(|d| d.status.borrow().clone()),
            dev_char: self.devnodes.dev_char.clone(),
            operator,
        };
        self.reporter.write(state, report);
    }

    /// Creates the device nodes and links the inventory needs, then reads the nodes the device
    /// plugin and the CDI spec hand out again.
    fn ensure_device_nodes(&mut self) {
        self.device_plugin.ctx.nodes = self.devnodes.ensure(&self.config, &self.root, self.inventory.as_ref());
    }

    /// Brings the MPS control daemons to what the effective settings ask for, and gives
    /// `Allocate` their folders and limits.
    fn update_mps(&mut self) {
        let serving = self.services.commands.is_some() && self.device_plugin.plan_error.is_none();
        let (allocate, looked_after) = self.mps.update(&pass!(self), serving);
        self.device_plugin.ctx.allocate.mps = allocate;
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
            m.inventory(
                self.inventory.as_ref(),
                self.nvml.gpus.as_ref(),
                config,
                node,
                &self.root,
            );
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
        stepped!(self, runtime.cdi(&self.device_plugin.ctx.nodes))
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
                if self.nvml.gpus.is_none()
                    && let Err(e) = self.open_nvml()
                {
                    tracing::error!("NVML after the failed driver change: {e}");
                }
                self.restore_withdrawn();
                self.inventory = None;
                self.nvml.gpus.is_some()
            };
            self.stages[StageId::Driver].set(StageState::Failed, Some(e.clone()), None);
            self.driver.failed(&planned, e);
            return go_on;
        }
        if self.nvml.gpus.is_none()
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
        let Some(gpus) = self.nvml.gpus.clone() else {
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
        self.nvml.close();
        // The enforcer holds the old NVML.
        self.memory.stop();
    }

    /// Loads NVML; a failure on a node with a GPU fails the device plugin stage.
    fn open_nvml(&mut self) -> Result<(), AgentError> {
        // NVML opens nvidiactl and nvidia<N>: on a host without nvidia-modprobe the driver stage's
        // load (or whoever loaded it) may have left them missing.
        self.ensure_device_nodes();
        let Err(e) = self.nvml.open(&self.config, &self.root) else {
            return Ok(());
        };
        // On a node with no GPU at all that is no failure: the caller idles.
        if nvml::without_gpus(&self.root, &e).is_none() {
            self.stages[StageId::DevicePlugin].set(StageState::Failed, Some(e.to_string()), None);
            self.write_status("running");
        }
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gates_hold_back_what_needs_a_failed_stage() {
        let needs = |id: StageId| {
            PIPELINE
                .iter()
                .find(|(stage, _, _)| *stage == id)
                .map(|(_, needs, _)| *needs)
                .expect("every stage is in the pipeline")
        };
        assert!(stage::may_run(needs(StageId::Driver), &[]));
        assert!(!stage::may_run(needs(StageId::Runtime), &[]));
        assert!(stage::may_run(needs(StageId::Runtime), &[StageId::Driver]));
        assert!(!stage::may_run(needs(StageId::Mig), &[StageId::Driver]));
        assert!(stage::may_run(
            needs(StageId::DevicePlugin),
            &[StageId::Driver, StageId::Runtime]
        ));
        assert!(!stage::may_run(
            needs(StageId::Validation),
            &[StageId::Driver, StageId::Runtime]
        ));
        // Every stage is in the pipeline, in pass order, needing only stages before it.
        assert_eq!(PIPELINE.map(|(id, _, _)| id), StageId::ALL);
        for (i, (_, needs, _)) in PIPELINE.iter().enumerate() {
            assert!(needs.iter().all(|n| StageId::ALL[..i].contains(n)));
        }
        // Indexing by id finds that stage.
        let ms = Duration::from_millis(1);
        let stages = Stages::new((ms, ms));
        for id in StageId::ALL {
            assert_eq!(stages[id].id, id);
        }
    }
}
