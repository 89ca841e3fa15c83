//! The MIG stage inside the reconcile loop (the layout `nvidia.com/mig.config` names, with the
//! GPUs that change withdrawn from the kubelet first, `pending` while GPU work runs, a reboot
//! where a mode change needs one), and `gpu-node-agent mig …` outside the daemon.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::pass::{Note, Outbox, Pass};
use crate::cli::MigCommand;
use crate::config::Config;
use crate::config::MigConfig;
use crate::desired::Selection;
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::mig::clients::{self, HostClients};
use crate::mig::stage::{
    BeforeChange, LayoutPlan, MigState as MigLabelState, ResetGpu, Step, changes_mode, converge, converge_from, export,
    plan_layout,
};
use crate::mig::state::ObservedGpu;
use crate::mig::{import, planner};
use crate::mig_layout::MigLayout;
use crate::nvml::Gpus;
use crate::status::{StageId, StageState};

/// How often the MIG stage looks again while GPU work blocks a layout change.
const MIG_BUSY_RECHECK: Duration = Duration::from_secs(2);
/// How often a layout given up on looks whether the GPU work it waited for has ended.
const MIG_GAVE_UP_RECHECK: Duration = Duration::from_secs(10);
/// How often the MIG stage looks again while NVIDIA's mig-manager runs on the node.
const MIG_OPERATOR_RECHECK: Duration = Duration::from_secs(10);
/// How long to wait for `rebooting` to show on the Node before rebooting.
pub(super) const REBOOT_LABEL_WAIT: Duration = Duration::from_secs(10);
/// How long to wait for `pending` to show on the Node before a MIG change.
pub(super) const PENDING_LABEL_WAIT: Duration = Duration::from_secs(5);
/// Marker in the state dir: a reboot was requested to finish a MIG mode change for this
/// layout. Present at the next start with the change still pending means the reboot did not
/// help: fail instead of rebooting again.
const MIG_REBOOT_MARKER: &str = "mig-reboot-requested";

/// What the MIG stage keeps between passes.
#[derive(Debug, Default)]
pub(super) struct MigStage {
    /// `nvidia.com/mig.config.state`, when a layout is asked for.
    pub(super) state: Option<MigLabelState>,
    /// Since when the stage waits for GPU work to end.
    pub(super) pending_since: Option<Instant>,
    /// When to look again while waiting.
    pub(super) retry: Option<Instant>,
    /// The layout given up on after `[mig] process_wait_timeout`: it stays failed, with the GPUs
    /// advertised, until their work has ended (or another layout is asked for).
    pub(super) gave_up: Option<String>,
}

/// What the MIG stage's plan asks of the loop.
pub(super) enum MigNext {
    /// Nothing changes in this pass (the stage's status says why).
    Done,
    /// A change to make: the loop withdraws its GPUs from the kubelet, reports `pending` when
    /// [`MigStage::announce`] says so, then [`MigStage::apply`] makes it.
    Change(Box<Change>),
}

/// A layout change, planned on this pass's one reading of NVML.
pub(super) struct Change {
    pub name: String,
    layout: MigLayout,
    plan: LayoutPlan,
    /// The GPUs (UUIDs) that change: withdrawn from the kubelet first.
    pub changing: Vec<String>,
    mode_change: bool,
}

/// What the loop does once [`MigStage::apply`] is done.
pub(super) enum MigAfter {
    Done,
    /// A mode change needs a reboot: the loop reports `rebooting`, waits for the label on the
    /// Node, then [`reboot`]s.
    Reboot,
}

impl MigStage {
    /// The MIG stage's plan: brings the GPUs to the layout `nvidia.com/mig.config` names. With
    /// nothing to change, or nothing that may change now (NVIDIA's mig-manager runs, DRA claims
    /// hold a GPU, a layout given up on while GPU work still runs), the status says why and
    /// nothing is asked of the loop; a layout that cannot fit, or a name that is not defined,
    /// changes nothing and fails with the reason. Needs NVML (`pass.gpus`).
    pub(super) async fn plan(&mut self, pass: &Pass<'_>, out: &mut Outbox) -> MigNext {
        start_left_over_clients(pass).await;
        let Some(gpus) = pass.gpus.cloned() else {
            return MigNext::Done;
        };
        let key = pass.config.labels.mig_config.clone();
        // One reading of NVML's MIG state and one plan per pass: the default layout's check, what
        // would change and the converge's first round all use them.
        let (g, mig, selection) = (gpus.clone(), pass.config.mig.clone(), pass.desired.mig_config.clone());
        let has_mig = pass
            .inventory
            .map(|inventory| inventory.gpus.iter().any(|g| g.mig.is_some()));
        let decided = tokio::task::spawn_blocking(move || {
            decide(&mig, &selection, &key, has_mig, || {
                g.mig_observe().map_err(|e| e.to_string())
            })
        })
        .await
        .unwrap_or_else(|e| Decision::Failed(format!("MIG planning task failed: {e}")));
        let id = StageId::Mig;
        let (name, layout, plan) = match decided {
            Decision::Disabled => {
                out.status(id, StageState::Disabled, None, Some("[mig] enabled = false".into()));
                self.state = None;
                return MigNext::Done;
            }
            Decision::Unset(detail) => {
                out.status(id, StageState::Ok, None, Some(detail));
                self.state = None;
                out.push(Note::Restore);
                return MigNext::Done;
            }
            Decision::Failed(reason) => {
                self.failed(reason, out);
                return MigNext::Done;
            }
            Decision::Apply { name, layout, plan } => (name, layout, plan),
        };
        let (changing, mode_change) = (plan.changing(), plan.changes_mode());
        if changing.is_empty() {
            // The same observation converge would start from: nothing to do, nothing to read twice.
            self.done(pass, &name, format!("layout {name} in place"), out);
            return MigNext::Done;
        }
        // NVIDIA's mig-manager on the node applies layouts too: two appliers on one GPU undo
        // each other's work. No change while it runs; its state label is left as it is.
        if let Some(why) = &pass.held.mig {
            self.state = super::operator::mig_state_as_on_node(pass.config, pass.view);
            self.pending_since = None;
            self.retry = Some(Instant::now() + MIG_OPERATOR_RECHECK);
            out.status(
                id,
                StageState::Pending,
                Some(format!("layout {name}: not applied: {why}")),
                None,
            );
            return MigNext::Done;
        }
        // A GPU with devices prepared for DRA claims keeps its layout: changing it would pull
        // MIG devices from under claims the kubelet holds. The stage fails (and retries) until
        // the claims are unprepared.
        if let Some(held) = dra_held(pass.services.dra.as_ref(), &changing) {
            self.failed(format!("layout {name}: {held}; nothing changed"), out);
            return MigNext::Done;
        }
        if self.gave_up.as_deref() == Some(name.as_str()) {
            // Given up on while GPU work ran: stay failed, GPUs advertised, until the work ends.
            let (g, u) = (gpus.clone(), changing.clone());
            let busy = tokio::task::spawn_blocking(move || u.iter().any(|uuid| g.process_count(uuid) != Some(0)))
                .await
                .unwrap_or(true);
            if busy {
                self.retry = Some(Instant::now() + MIG_GAVE_UP_RECHECK);
                return MigNext::Done;
            }
            tracing::info!("MIG layout {name}: the GPU work it waited for has ended; applying it now");
            self.gave_up = None;
        }
        MigNext::Change(Box::new(Change {
            name,
            layout,
            plan,
            changing,
            mode_change,
        }))
    }

    /// `pending` while the change is made, as the GPU Operator's MIG manager reports it: a
    /// script waiting for `success` must not see the previous layout's. `true` when the state
    /// turns `pending` now: the loop reports it and gives the Node time to show it.
    pub(super) fn announce(&mut self, change: &Change, out: &mut Outbox) -> bool {
        if self.state == Some(MigLabelState::Pending) {
            return false;
        }
        self.state = Some(MigLabelState::Pending);
        out.status(
            StageId::Mig,
            StageState::Pending,
            None,
            Some(format!(
                "layout {}: changing {}",
                change.name,
                change.changing.join(", ")
            )),
        );
        true
    }

    /// Makes the change (its GPUs withdrawn from the kubelet), starting from this pass's reading
    /// and plan: withdrawing devices changes no MIG state, and GPU work is looked at again before
    /// any change.
    pub(super) async fn apply(&mut self, pass: &Pass<'_>, change: Change, out: &mut Outbox) -> MigAfter {
        let Some(gpus) = pass.gpus.cloned() else {
            return MigAfter::Done;
        };
        let Change {
            name,
            layout,
            plan,
            mode_change,
            ..
        } = change;
        let (g, l, n) = (gpus, layout, name.clone());
        let smi = pass.root.join(&pass.config.mig.nvidia_smi);
        let allow_reset = pass.config.mig.gpu_reset;
        let stop = pass.stop.clone();
        let (config, root) = (pass.config.clone(), pass.root.clone());
        let (step, clients_note) = tokio::task::spawn_blocking(move || {
            let reset = |uuid: &str| crate::host::command::reset_gpu(&smi, uuid);
            let reset = allow_reset.then_some(&reset as ResetGpu<'_>);
            with_host_clients(&config, &root, mode_change, Some(&stop), |before| {
                converge_from(&g, &n, &l, plan, reset, Some(&stop), Some(before))
            })
        })
        .await
        .unwrap_or_else(|e| {
            let reason = format!("MIG apply task failed: {e}");
            (Step::Failed { reason }, None)
        });
        let id = StageId::Mig;
        let note = clients_note.as_deref().map(|n| format!("; {n}")).unwrap_or_default();
        match with_note(step, clients_note.as_deref()) {
            Step::Converged => {
                self.done(pass, &name, format!("layout {name} in place{note}"), out);
            }
            Step::Applied {
                mutations,
                gpus: changed,
            } => {
                self.done(
                    pass,
                    &name,
                    format!(
                        "layout {name} applied to {} ({mutations} NVML operations){note}",
                        changed.join(", ")
                    ),
                    out,
                );
                // The MIG devices changed: read the inventory again before advertising, and run
                // the CUDA check again (on every device CUDA sees, the new MIG devices included)
                // rather than keep the day-old result of GPUs that no longer look that way.
                out.push(Note::DevicesChanged);
            }
            Step::Busy { reason, .. } => {
                let since = *self.pending_since.get_or_insert_with(Instant::now);
                let limit = pass.config.mig.process_wait_timeout;
                if !limit.is_zero() && since.elapsed() >= limit {
                    self.pending_since = None;
                    self.failed(
                        format!(
                            "layout {name}: gave up after {limit:?}: {reason}; nothing changed (applied once the work ends)"
                        ),
                        out,
                    );
                    self.gave_up = Some(name);
                    self.retry = Some(Instant::now() + MIG_GAVE_UP_RECHECK);
                    return MigAfter::Done;
                }
                self.state = Some(MigLabelState::Pending);
                out.status(id, StageState::Pending, Some(reason), Some(format!("layout {name}")));
                self.retry = Some(Instant::now() + MIG_BUSY_RECHECK);
            }
            Step::ModePending { reason, .. } => {
                let marker = pass.root.join(&pass.config.agent.state_dir).join(MIG_REBOOT_MARKER);
                let rebooted_for = std::fs::read_to_string(&marker).ok();
                if pass.config.mig.reboot_on_mode_change && rebooted_for.as_deref() != Some(name.as_str()) {
                    if let Err(e) = crate::host::write_atomic(&marker, name.as_bytes(), 0o644) {
                        self.failed(format!("{reason}; cannot record the reboot ({e}), not rebooting"), out);
                        return MigAfter::Done;
                    }
                    self.state = Some(MigLabelState::Rebooting);
                    out.status(
                        id,
                        StageState::Pending,
                        Some(format!("{reason}: rebooting the node")),
                        None,
                    );
                    return MigAfter::Reboot;
                }
                let hint = if rebooted_for.as_deref() == Some(name.as_str()) {
                    "a reboot for this layout did not finish it"
                } else {
                    "reset the GPU or reboot the node, or set [mig] reboot_on_mode_change = true"
                };
                self.failed(format!("{reason} ({hint})"), out);
            }
            Step::Failed { reason } => self.failed(reason, out),
            Step::Stopped { mutations } => {
                // The agent is stopping: the next start converges from what was left.
                out.status(
                    id,
                    StageState::Pending,
                    Some(format!(
                        "layout {name}: stopped after {mutations} NVML operation(s); the next start goes on"
                    )),
                    None,
                );
            }
        }
        MigAfter::Done
    }

    fn done(&mut self, pass: &Pass<'_>, name: &str, detail: String, out: &mut Outbox) {
        self.gave_up = None;
        self.pending_since = None;
        self.state = Some(MigLabelState::Success);
        out.status(StageId::Mig, StageState::Ok, None, Some(detail));
        let marker = pass.root.join(&pass.config.agent.state_dir).join(MIG_REBOOT_MARKER);
        let _ = std::fs::remove_file(marker);
        tracing::info!("MIG layout {name}: success");
        out.push(Note::Restore);
    }

    fn failed(&mut self, reason: String, out: &mut Outbox) {
        tracing::error!("MIG stage failed: {reason}");
        self.pending_since = None;
        self.state = Some(MigLabelState::Failed);
        out.status(StageId::Mig, StageState::Failed, Some(reason), None);
        out.push(Note::Restore);
    }
}

/// Starts the host GPU clients an interrupted MIG change left stopped (recorded in the state
/// dir), before anything else of the MIG stage.
async fn start_left_over_clients(pass: &Pass<'_>) {
    let journal = pass
        .root
        .join(pass.config.agent.state_dir.join(clients::STOPPED_UNITS_FILE));
    if !journal.exists() {
        return;
    }
    let (config, root) = (pass.config.clone(), pass.root.clone());
    match tokio::task::spawn_blocking(move || clients::start_left_over(&config, &root)).await {
        Ok((started, problems)) => {
            if !started.is_empty() {
                tracing::info!("started host GPU clients again: {}", started.join(", "));
            }
            for problem in problems {
                tracing::error!("{problem}");
            }
        }
        Err(e) => tracing::error!("starting the host GPU clients left stopped failed: {e}"),
    }
}

/// Gives the Node up to `wait` to show the MIG state label (when the Node is the source and
/// reachable), so the cluster sees `pending` before a change and `rebooting` before a reboot:
/// the reporter sends only the latest labels, and a quick change would hide them.
pub(super) async fn wait_for_label_on_node(pass: &Pass<'_>, state: &str, wait: Duration) {
    let Some(link) = pass.services.link.as_ref() else {
        return;
    };
    let mut rx = link.view.clone();
    let key = pass.config.labels.mig_config_state.clone();
    let shown = tokio::time::timeout(wait, async {
        loop {
            {
                let view = rx.borrow_and_update();
                if view.source != crate::desired::Source::Node || !view.connected {
                    return false;
                }
                if view.labels.get(&key).map(String::as_str) == Some(state) {
                    return true;
                }
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    })
    .await;
    if shown != Ok(true) {
        tracing::warn!("{key}={state} did not show on the Node within {wait:?}; going on");
    }
}

/// Which of `changing` hold devices prepared for DRA claims (by the DRA driver `dra`), as a
/// sentence; `None` if none.
fn dra_held(dra: Option<&crate::dra::DraHandle>, changing: &[String]) -> Option<String> {
    let dra = dra?;
    let withdrawn = dra.withdrawn.borrow().clone();
    let held: Vec<&str> = changing
        .iter()
        .filter(|u| withdrawn.touches_gpu(u))
        .map(String::as_str)
        .collect();
    if held.is_empty() {
        return None;
    }
    let claims = dra.status.borrow().prepared.join(", ");
    Some(format!(
        "GPU(s) {} hold devices prepared for DRA claims ({claims}); the layout waits until they are unprepared",
        held.join(", ")
    ))
}

/// Reboots the node to finish a MIG mode change (only on a real root; a --root run reports).
pub(super) fn reboot(pass: &Pass<'_>) {
    if !pass.root.is_real() {
        tracing::warn!(
            "MIG mode change needs a reboot; not rebooting under --root {}",
            pass.root.path().display()
        );
        return;
    }
    tracing::warn!("rebooting the node to finish a MIG mode change");
    let cmd = crate::host::command::Cmd::new(&pass.config.runtime.systemctl)
        .arg("reboot")
        .timeout(Duration::from_secs(60));
    if let Err(e) = crate::host::command::Runner::new(pass.root).run(&cmd) {
        tracing::error!("cannot reboot: {e}");
    }
}

/// What the MIG stage does in a pass, decided from the config, the label and one reading of
/// NVML's MIG state.
#[derive(Debug)]
enum Decision {
    /// `[mig] enabled = false`.
    Disabled,
    /// No layout asked for: the stage's detail.
    Unset(String),
    /// Nothing changes: why.
    Failed(String),
    /// The layout named, planned on this pass's reading.
    Apply {
        name: String,
        layout: MigLayout,
        plan: LayoutPlan,
    },
}

/// Which layout applies and its plan. `observe` reads NVML's MIG state; it is called at most
/// once (the default layout's check at boot, with no inventory yet, and the plan share the
/// reading), and the layout is planned at most once. `has_mig`: whether the inventory shows a
/// MIG-capable GPU, `None` before the first inventory. Blocking (`observe`).
fn decide(
    mig: &MigConfig,
    selection: &Selection,
    key: &str,
    has_mig: Option<bool>,
    mut observe: impl FnMut() -> Result<Vec<ObservedGpu>, String>,
) -> Decision {
    if !mig.enabled {
        return Decision::Disabled;
    }
    let mut observed = None;
    let mut read = || observed.get_or_insert_with(&mut observe).clone();
    // Without the label, `[mig] default_layout` (the Operator's `all-disabled`), but only on a
    // node with a MIG-capable GPU: the Operator runs no MIG manager elsewhere, and such a node
    // reports no MIG state.
    let default = &mig.default_layout;
    let unset = matches!(selection, Selection::Unset);
    let defaulted = unset
        && !default.is_empty()
        && mig.layout(default).is_some()
        && match has_mig {
            // The inventory says it without asking NVML; at boot (no inventory yet) ask.
            Some(has) => has,
            None => read().is_ok_and(|o| o.iter().any(|g| g.mode.is_some())),
        };
    let name = match selection.clone() {
        Selection::Unset if defaulted => default.clone(),
        Selection::Unset => return Decision::Unset(format!("no layout requested ({key} not set)")),
        Selection::Invalid { value, reason } => {
            return Decision::Failed(format!("label {key}={value:?} is not valid: {reason}; nothing changed"));
        }
        Selection::Name { name } => name,
    };
    let Some(layout) = mig.layout(&name) else {
        let defined = mig.layout_names().join(", ");
        return Decision::Failed(format!(
            "label {key}={name} names no MIG layout (defined: {defined}); nothing changed"
        ));
    };
    for warning in layout.overrides() {
        tracing::warn!("MIG layout {name}: {warning}");
    }
    // What would change: those GPUs are withdrawn from the kubelet before they are touched.
    let plan = read().and_then(|observed| LayoutPlan::new(observed, &layout).map_err(|e| e.to_string()));
    match plan {
        Ok(plan) => Decision::Apply { name, layout, plan },
        Err(e) => Decision::Failed(format!("layout {name}: {e}; nothing changed")),
    }
}

/// Runs `apply` (a converge, given the hook that stops the host GPU clients before its first
/// NVML change) with the host GPU clients of this change: the configured ones that are active
/// then, and the kubelet first for a `mode_change` with `[mig] stop_kubelet_on_mode_change`.
/// Whatever `apply` gives, every unit stopped is started again (the last stopped first).
/// Blocking. Returns the step and a note for the stage: the units stopped and started again,
/// or those that did not start again.
fn with_host_clients(
    config: &Config,
    root: &HostRoot,
    mode_change: bool,
    stop: Option<&tokio_util::sync::CancellationToken>,
    apply: impl FnOnce(BeforeChange<'_>) -> Step,
) -> (Step, Option<String>) {
    let units = clients::candidates(&config.mig, mode_change);
    let mut host = HostClients::new(config, root, units, stop);
    let step = apply(&mut || host.stop_all());
    let stopped = host.stopped().to_vec();
    let problems = host.start_all();
    let note = match (stopped.is_empty(), problems.is_empty()) {
        (true, _) => None,
        (false, true) => Some(format!(
            "host GPU clients stopped for the change and started again: {}",
            stopped.join(", ")
        )),
        (false, false) => Some(problems.join("; ")),
    };
    (step, note)
}

/// `step` with `note` added to its reason, where it has one.
fn with_note(step: Step, note: Option<&str>) -> Step {
    let Some(note) = note else { return step };
    match step {
        Step::Failed { reason } => Step::Failed {
            reason: format!("{reason}; {note}"),
        },
        Step::Busy { gpus, reason } => Step::Busy {
            gpus,
            reason: format!("{reason}; {note}"),
        },
        Step::ModePending { gpus, reason } => Step::ModePending {
            gpus,
            reason: format!("{reason}; {note}"),
        },
        other => other,
    }
}

/// `gpu-node-agent mig …`: the MIG stage's operations by themselves.
pub fn mig_command(config: &Config, root: &HostRoot, command: MigCommand) -> ExitCode {
    if let MigCommand::Import { file } = &command {
        let text = match crate::host::read_text(file) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("gpu-node-agent: cannot read {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
        };
        // Every config that can be imported is; each one that cannot is named on stderr (and
        // as a comment), and then the exit status says the output is not the whole file.
        return match import::import_what_fits(&text) {
            Ok((layouts, refused)) => {
                println!("# MIG layouts imported from {}", file.display());
                for e in &refused {
                    println!("# not imported: {e}");
                    eprintln!("gpu-node-agent: {}: not imported: {e}", file.display());
                }
                for (name, layout) in &layouts {
                    for warning in layout.overrides() {
                        println!("# warning: layout {name}: {warning}");
                    }
                }
                print!("{}", import::to_toml(&layouts));
                if refused.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    Exit::Usage.into()
                }
            }
            Err(e) => {
                eprintln!("gpu-node-agent: {}: {e}", file.display());
                Exit::Usage.into()
            }
        };
    }
    let layout_of = |name: &str| {
        config.mig.layout(name).ok_or_else(|| {
            format!(
                "no MIG layout named {name:?}; defined: {}",
                config.mig.layout_names().join(", ")
            )
        })
    };
    let gpus = match Gpus::open(&super::nvml::nvml_library(config, root)) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    match command {
        MigCommand::Import { .. } => ExitCode::SUCCESS,
        MigCommand::Export => match gpus.mig_observe() {
            Ok(observed) => {
                let layouts = std::iter::once(("current".to_string(), export(&observed))).collect();
                print!("{}", import::to_toml(&layouts));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpu-node-agent: {e}");
                ExitCode::FAILURE
            }
        },
        MigCommand::Assert { layout: name } => {
            let layout = match layout_of(&name) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("gpu-node-agent: {e}");
                    return Exit::Usage.into();
                }
            };
            let plans = gpus
                .mig_observe()
                .map_err(|e| e.to_string())
                .and_then(|o| plan_layout(&o, &layout).map_err(|e| e.to_string()));
            match plans {
                Ok(plans) if plans.iter().all(|p| p.ops.is_empty()) => {
                    println!("the GPUs match MIG layout {name}");
                    ExitCode::SUCCESS
                }
                Ok(plans) => {
                    println!("the GPUs do not match MIG layout {name}; applying it would do:");
                    for p in plans.iter().filter(|p| !p.ops.is_empty()) {
                        println!("{}", planner::describe(p));
                    }
                    ExitCode::FAILURE
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: MIG layout {name}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        MigCommand::Apply { layout: name } => {
            let layout = match layout_of(&name) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("gpu-node-agent: {e}");
                    return Exit::Usage.into();
                }
            };
            let smi = root.join(&config.mig.nvidia_smi);
            let reset = |uuid: &str| crate::host::command::reset_gpu(&smi, uuid);
            let reset: Option<ResetGpu<'_>> = config.mig.gpu_reset.then_some(&reset);
            let (_, problems) = clients::start_left_over(config, root);
            for problem in &problems {
                eprintln!("gpu-node-agent: warning: {problem}");
            }
            let mode_change = gpus
                .mig_observe()
                .ok()
                .and_then(|o| changes_mode(&o, &layout).ok())
                .unwrap_or(false);
            let (step, note) = with_host_clients(config, root, mode_change, None, |before| {
                converge(&gpus, &name, &layout, reset, None, Some(before))
            });
            let step = with_note(step, note.as_deref());
            let note = note.map(|n| format!("; {n}")).unwrap_or_default();
            match step {
                Step::Converged => {
                    println!("the GPUs already match MIG layout {name}: nothing to do{note}");
                    device_nodes_for(config, root, &gpus)
                }
                Step::Applied {
                    mutations,
                    gpus: changed,
                } => {
                    println!(
                        "applied MIG layout {name} to {} GPU(s) ({mutations} NVML operations){note}",
                        changed.len()
                    );
                    device_nodes_for(config, root, &gpus)
                }
                Step::Busy { reason, .. } => {
                    eprintln!("gpu-node-agent: {reason}; nothing changed");
                    Exit::TryLater.into()
                }
                Step::ModePending { reason, .. } | Step::Failed { reason } => {
                    eprintln!("gpu-node-agent: {reason}");
                    ExitCode::FAILURE
                }
                Step::Stopped { mutations } => {
                    eprintln!("gpu-node-agent: stopped after {mutations} NVML operations");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// After `mig apply`: the MIG devices' capability nodes, as the daemon creates them
/// (`[driver] create_device_nodes`). What cannot be made is a warning naming the path: the
/// layout itself is applied.
fn device_nodes_for(config: &Config, root: &HostRoot, gpus: &Gpus) -> ExitCode {
    if config.driver.create_device_nodes {
        match gpus.inventory(&root.join("/sys")) {
            Ok(inventory) => {
                super::devnodes::report(&super::devnodes::ensure_device_nodes(config, root, Some(&inventory)))
            }
            Err(e) => eprintln!("gpu-node-agent: warning: cannot read the GPU inventory for the device nodes: {e}"),
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::mig::stage::PLANS_MADE;

    /// A MIG-capable GPU with MIG mode off (and no profiles: nothing to read for a layout that
    /// keeps it off).
    fn mig_off() -> ObservedGpu {
        ObservedGpu {
            index: 0,
            uuid: "GPU-0".into(),
            pci_device_id: 0x20b0,
            pci_subsystem_id: 0,
            mode: Some(crate::nvml::MigState {
                current: false,
                pending: false,
            }),
            profiles: Vec::new(),
            gpu_instances: Vec::new(),
        }
    }

    /// `decide` with a reading that counts: (decision, NVML readings, plans made).
    fn counted(mig: &MigConfig, selection: Selection, has_mig: Option<bool>) -> (Decision, usize, usize) {
        let reads = Cell::new(0);
        PLANS_MADE.with(|n| n.set(0));
        let decision = decide(mig, &selection, "nvidia.com/mig.config", has_mig, || {
            reads.set(reads.get() + 1);
            Ok(vec![mig_off()])
        });
        (decision, reads.get(), PLANS_MADE.with(Cell::get))
    }

    #[test]
    fn the_default_layout_at_boot_reads_nvml_once_and_plans_once() {
        // No inventory yet: the default layout's check and the plan share one reading.
        let (decision, reads, plans) = counted(&MigConfig::default(), Selection::Unset, None);
        let Decision::Apply { name, plan, .. } = decision else {
            panic!("the default layout applies: {decision:?}")
        };
        assert_eq!(name, "all-disabled");
        assert!(plan.changing().is_empty(), "MIG is off already");
        assert!(!plan.changes_mode());
        assert_eq!((reads, plans), (1, 1));
    }

    #[test]
    fn a_named_layout_reads_nvml_once_and_plans_once() {
        let selection = Selection::Name {
            name: "all-disabled".into(),
        };
        let (decision, reads, plans) = counted(&MigConfig::default(), selection, Some(true));
        assert!(matches!(decision, Decision::Apply { .. }), "{decision:?}");
        assert_eq!((reads, plans), (1, 1));
    }

    #[test]
    fn nothing_asked_or_nothing_valid_reads_nothing_and_plans_nothing() {
        let off = MigConfig {
            enabled: false,
            ..MigConfig::default()
        };
        let (decision, reads, plans) = counted(&off, Selection::Unset, None);
        assert!(matches!(decision, Decision::Disabled), "{decision:?}");
        assert_eq!((reads, plans), (0, 0));

        let no_default = MigConfig {
            default_layout: String::new(),
            ..MigConfig::default()
        };
        let (decision, reads, plans) = counted(&no_default, Selection::Unset, None);
        assert!(matches!(decision, Decision::Unset(_)), "{decision:?}");
        assert_eq!((reads, plans), (0, 0));

        // The inventory says there is no MIG-capable GPU: no default layout, no reading.
        let (decision, reads, _) = counted(&MigConfig::default(), Selection::Unset, Some(false));
        assert!(matches!(decision, Decision::Unset(_)), "{decision:?}");
        assert_eq!(reads, 0);

        let unknown = Selection::Name { name: "no-such".into() };
        let (decision, reads, plans) = counted(&MigConfig::default(), unknown, Some(true));
        let Decision::Failed(reason) = decision else {
            panic!("an unknown layout fails: {decision:?}")
        };
        assert!(reason.contains("names no MIG layout"), "{reason}");
        assert_eq!((reads, plans), (0, 0));
    }

    /// The stage by itself, without the loop: with a layout planned, `pending` is announced
    /// once; a failure gives the withdrawn GPUs back; without NVML it plans nothing.
    #[tokio::test]
    async fn the_stage_steps_on_its_own() {
        use crate::agent::pass::{Fixture, Note, Outbox};
        let fixture = Fixture::new(Config::default());
        let mut stage = MigStage::default();
        let mut out = Outbox::default();
        assert!(matches!(stage.plan(&fixture.pass(), &mut out).await, MigNext::Done));
        assert!(out.take().is_empty(), "no NVML, nothing said");

        let layout = MigConfig::default().layout("all-disabled").expect("built in");
        let change = Change {
            name: "all-disabled".into(),
            plan: LayoutPlan::new(vec![mig_off()], &layout).expect("a plan"),
            layout,
            changing: vec!["GPU-0".into()],
            mode_change: false,
        };
        assert!(stage.announce(&change, &mut out), "pending is news");
        assert_eq!(
            out.last_status(StageId::Mig),
            Some((StageState::Pending, None, Some("layout all-disabled: changing GPU-0")))
        );
        assert!(!stage.announce(&change, &mut out), "and said once");

        let mut out = Outbox::default();
        stage.failed("layout all-disabled: no".into(), &mut out);
        assert_eq!(stage.state, Some(MigLabelState::Failed));
        assert_eq!(out.take().last(), Some(&Note::Restore));
    }
}
