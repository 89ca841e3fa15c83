//! Apply: per engine, the journal's first steps (backups, intent, files), the engine's own check,
//! the restart and the wait for its CRI, the journal's last steps; a failed check or restart
//! rolls that engine back (and restarts it with its previous files). The engines are asked
//! through the seam ([`ContainerEngine`](crate::runtime::engine::ContainerEngine)).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::journal::{
    apply_files, backup_dir, begin, finish, kill_point, remove_created_dirs, remove_intent, write_changes,
};
use super::plan::{EnginePlan, Purpose, RuntimePlan};
use super::{RuntimeError, registry};
use crate::config::{Config, Engine};
use crate::host::HostRoot;
use crate::host::command::{Cmd, Runner};
use crate::runtime::cri;
use crate::runtime::engine::Host;

/// How the apply may touch services.
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// Restart engines whose files changed (false under `--no-restart` or a `--root` prefix).
    pub restart: bool,
}

/// What an apply did.
#[derive(Debug, Default)]
pub struct Applied {
    /// Host paths written or removed.
    pub files: Vec<PathBuf>,
    /// Units restarted.
    pub restarted: Vec<String>,
    /// The engines that failed, each rolled back on its own; the others were applied.
    pub failures: Vec<EngineFailure>,
}

impl PartialEq for Applied {
    /// Files and restarts; failures compare by their messages.
    fn eq(&self, other: &Applied) -> bool {
        let messages = |a: &Applied| {
            a.failures
                .iter()
                .map(|f| (f.engine, f.error.to_string()))
                .collect::<Vec<_>>()
        };
        self.files == other.files && self.restarted == other.restarted && messages(self) == messages(other)
    }
}

/// One engine's failure.
#[derive(Debug)]
pub struct EngineFailure {
    pub engine: Engine,
    /// The engine the kubelet uses.
    pub kubelet: bool,
    pub error: RuntimeError,
}

impl Applied {
    /// The failure of the kubelet's engine, which holds the device plugin back.
    pub fn kubelet_failure(&self) -> Option<&EngineFailure> {
        self.failures.iter().find(|f| f.kubelet)
    }
}

/// Applies `plan`: per engine, backups first (configure), the intent record, the files,
/// containerd's own check of the result, then a restart when the engine is installed and
/// restarts are allowed, and the engine's CRI asked whether it serves the runtimes. A failed
/// check or restart puts that engine's previous files back (and restarts it with them); the
/// other engines go on. The first failure is the error; [`apply_all`] returns them all.
pub fn apply(
    plan: &RuntimePlan,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
) -> Result<Applied, RuntimeError> {
    let mut applied = apply_all(plan, config, root, runner, opts);
    if applied.failures.is_empty() {
        Ok(applied)
    } else {
        Err(applied.failures.remove(0).error)
    }
}

/// [`apply`], every engine's failure in [`Applied::failures`].
pub fn apply_all(
    plan: &RuntimePlan,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
) -> Applied {
    let mut applied = Applied::default();
    if !plan.toolkit.is_empty() {
        match apply_files(&plan.toolkit, plan.purpose, config, root) {
            Ok(()) => applied.files.extend(plan.toolkit.iter().map(|c| c.path.clone())),
            // Read by the toolkit for each container, whatever the engine: it counts as the
            // kubelet's engine's.
            Err(error) => applied.failures.push(EngineFailure {
                engine: plan
                    .engines
                    .iter()
                    .find(|e| e.kubelet)
                    .map_or(registry::ENGINES[0].kind(), |e| e.engine),
                kubelet: true,
                error,
            }),
        }
    }
    for e in &plan.engines {
        let failed = match &e.error {
            Some(message) => Err(RuntimeError::Engine {
                engine: e.engine.as_str(),
                message: message.clone(),
            }),
            None if e.changes.is_empty() => continue,
            None => apply_engine(e, plan.purpose, config, root, runner, opts, &mut applied),
        };
        if let Err(error) = failed {
            applied.failures.push(EngineFailure {
                engine: e.engine,
                kubelet: e.kubelet,
                error,
            });
        }
    }
    applied
}

fn apply_engine(
    e: &EnginePlan,
    purpose: Purpose,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
    applied: &mut Applied,
) -> Result<(), RuntimeError> {
    let dir = backup_dir(config, root);
    begin(&e.changes, purpose, root, &dir)?;
    let rollback = || -> Result<(), RuntimeError> {
        write_changes(root, &e.changes, |c| c.before.as_deref())?;
        e.changes
            .iter()
            .filter(|c| c.before.is_none())
            .try_for_each(|c| remove_created_dirs(root, &dir, &c.path))?;
        remove_intent(&dir)
    };
    let host = Host {
        root,
        runner,
        state: &dir,
    };
    let files = config.runtime.files(e.engine);
    if purpose == Purpose::Configure
        && let Err(reason) = registry::of(e.engine).check(&host, &files, e.binary.as_deref(), &e.runtime)
    {
        rollback()?;
        return Err(RuntimeError::Check { reason });
    }
    kill_point("check");
    if opts.restart && e.installed && e.restart {
        let wanted: Vec<&str> = match purpose {
            Purpose::Configure => e.runtime.all().map(|(name, _)| name).collect(),
            Purpose::Unconfigure => Vec::new(),
        };
        if let Err(reason) = restart(config, root, runner, e, &wanted) {
            rollback()?;
            let again = restart(config, root, runner, e, &[]).err();
            return Err(RuntimeError::Restart {
                engine: e.engine.as_str(),
                reason,
                again,
            });
        }
        applied.restarted.push(e.unit.clone());
    }
    kill_point("restart");
    finish(&e.changes, purpose, root, &dir)?;
    applied.files.extend(e.changes.iter().map(|c| c.path.clone()));
    Ok(())
}

/// `systemctl restart <unit>`, then waits for `systemctl is-active` up to the restart timeout,
/// then asks the engine's CRI (containerd, CRI-O) whether it serves the runtime handlers
/// `wanted` and its default: an engine can be active without its CRI (containerd keeps running
/// when its CRI plugin fails to load). The engine's own words for a CRI that does not answer are
/// quoted (`ContainerEngine::cri_load_error`: containerd's `ctr plugins ls --detailed`).
fn restart(config: &Config, root: &HostRoot, runner: &Runner, e: &EnginePlan, wanted: &[&str]) -> Result<(), String> {
    let systemctl = &config.runtime.systemctl;
    let unit = e.unit.as_str();
    tracing::info!("restarting {unit}: its configuration changed");
    runner
        .run(
            &Cmd::new(systemctl)
                .args(["restart", unit])
                .timeout(config.runtime.restart_timeout),
        )
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + config.runtime.restart_timeout;
    loop {
        let out = runner
            .output(
                &Cmd::new(systemctl)
                    .args(["is-active", unit])
                    .timeout(Duration::from_secs(10)),
            )
            .map_err(|e| e.to_string())?;
        let state = out.stdout.trim().to_string();
        if out.success() && state == "active" {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{unit} is {} {}s after the restart",
                if state.is_empty() { "not active" } else { &state },
                config.runtime.restart_timeout.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let Some(socket) = &e.cri_socket else {
        return Ok(());
    };
    let socket = root.join(socket);
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    let status = cri::status_blocking(&socket, wait).map_err(|err| {
        let own = match &err {
            cri::CriError::NoCri { .. } => registry::of(e.engine).cri_load_error(runner, e.binary.as_deref(), &socket),
            _ => None,
        };
        match own {
            Some(text) => format!("{unit} is active but its CRI plugin did not load: {text}"),
            None => format!("{unit} is active but {err}"),
        }
    })?;
    let mut wanted: Vec<&str> = wanted.to_vec();
    if let Some(default) = status.default_handler.as_deref().filter(|d| !d.is_empty()) {
        wanted.push(default);
    }
    match status.missing(&wanted) {
        None => {
            tracing::info!(
                "{unit} is back: {} serves the runtime handlers {}",
                status.runtime,
                status.handlers.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            Ok(())
        }
        Some(why) => Err(format!("{unit} is active but {why}")),
    }
}
