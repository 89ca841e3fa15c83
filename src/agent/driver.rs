//! The driver stage inside the reconcile loop: first of all stages. It installs, builds or loads
//! the driver `[driver]` asks for (an upgrade only when no GPU work runs, with the GPUs withdrawn
//! from the kubelet first and NVML reopened after, also when the change failed), then validates
//! what NVML reports.

use super::pass::{Outbox, Pass};
use crate::cli::DriverCommand;
use crate::config::Config;
use crate::driver::stage::{self as drv, Planned};
use crate::driver::{observe, plan::Step, validate};
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::kube::EventType;
use crate::logging;
use crate::nvml::Gpus;
use crate::status::{StageId, StageState};
use std::process::ExitCode;

/// How long a failed driver upgrade waits before it is tried again.
const DRIVER_UPGRADE_RETRY: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// What the driver stage keeps between passes: its one memory of a change not to try again
/// for now (besides the backoff every stage has, which retries a failure soon).
#[derive(Debug, Default)]
pub(super) struct DriverStage {
    pub(super) held: Option<Held>,
}

/// A driver change that failed in a way retrying soon cannot fix.
#[derive(Debug)]
pub(super) enum Held {
    /// An upgrade (its plan's summary), when and why it failed: not tried again (withdrawing the
    /// GPUs each time) before [`DRIVER_UPGRADE_RETRY`] has passed.
    Upgrade {
        summary: String,
        at: std::time::Instant,
        error: String,
    },
    /// A package install that loaded another version than asked for: not tried again while the
    /// kernel stays the same (or until the agent restarts: a changed [driver] needs one).
    Install(drv::FailedInstall),
}

impl DriverStage {
    fn failed_install(&self) -> Option<&drv::FailedInstall> {
        match &self.held {
            Some(Held::Install(failed)) => Some(failed),
            _ => None,
        }
    }
}

/// What the driver stage's plan asks of the loop.
pub(super) enum DriverNext {
    /// Nothing to change (or nothing may change now): whether the stages after it may run.
    Done(bool),
    /// A change to apply ([`DriverStage::apply`]); with an upgrade (an unload) the loop first
    /// withdraws every GPU from the kubelet and closes NVML, and opens it again after.
    Apply(Box<Planned>),
}

impl DriverStage {
    /// Plans the driver stage's pass; with nothing to change, validates the driver in place.
    pub(super) async fn plan(&mut self, pass: &Pass<'_>, out: &mut Outbox) -> DriverNext {
        let id = StageId::Driver;
        if !pass.config.driver.enabled {
            out.status(id, StageState::Disabled, None, Some("[driver] enabled = false".into()));
            return DriverNext::Done(true);
        }
        let processes = gpu_processes(pass);
        let (config, root) = (pass.config.clone(), pass.root.clone());
        let failed = self.failed_install().cloned();
        let planned = tokio::task::spawn_blocking(move || drv::plan_with(&config, &root, processes, failed.as_ref()))
            .await
            .map_err(|e| format!("driver stage task failed: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        let planned: Planned = match planned {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("driver stage failed: {e}");
                out.status(id, StageState::Failed, Some(e), None);
                return DriverNext::Done(pass.gpus.is_some());
            }
        };
        if let Some(wait) = &planned.plan.wait {
            // The loaded driver keeps serving meanwhile.
            out.status(
                id,
                StageState::Pending,
                Some(wait.clone()),
                Some(planned.plan.summary.clone()),
            );
            return DriverNext::Done(pass.gpus.is_some());
        }
        let changed = !planned.plan.steps.is_empty();
        if is_upgrade(&planned)
            && let Some(Held::Upgrade { summary, at, error }) = &self.held
            && *summary == planned.plan.summary
            && at.elapsed() < DRIVER_UPGRADE_RETRY
        {
            // The GPUs stay with the kubelet on the driver still loaded.
            let left = DRIVER_UPGRADE_RETRY.saturating_sub(at.elapsed()).as_secs().div_ceil(60);
            let reason = format!("{error} (tried again in {left} min, or at `systemctl restart gpu-node-agent`)");
            out.status(id, StageState::Failed, Some(reason), Some(planned.plan.summary.clone()));
            return DriverNext::Done(pass.gpus.is_some());
        }
        if changed {
            return DriverNext::Apply(Box::new(planned));
        }
        self.held = None;
        // The host facts the plan was made from still hold: nothing changed.
        validate_driver(pass, &planned.plan.summary, Some(planned.facts), out).await;
        DriverNext::Done(pass.gpus.is_some())
    }

    /// Applies a driver plan (the loop has withdrawn the GPUs and closed NVML for an upgrade).
    /// `Err`: why it failed; the loop fails the stage with it ([`DriverStage::failed`]).
    pub(super) async fn apply(&mut self, pass: &Pass<'_>, planned: &Planned, out: &mut Outbox) -> Result<(), String> {
        tracing::info!("driver: {}", crate::driver::plan::describe(&planned.plan));
        let _long = crate::notify::LongStep::start(&pass.services.long_step);
        let (config, root, p, stop) = (
            pass.config.clone(),
            pass.root.clone(),
            planned.clone(),
            pass.stop.clone(),
        );
        let kernel = planned.facts.kernel_release.clone();
        let applied = tokio::task::spawn_blocking(move || drv::apply(&config, &root, &p, Some(&stop)))
            .await
            .map_err(|e| format!("driver stage task failed: {e}"))
            .and_then(|r| {
                r.map_err(|e| {
                    if let drv::DriverError::OtherVersion(message) = &e {
                        self.held = Some(Held::Install(drv::FailedInstall {
                            kernel_release: kernel,
                            message: message.clone(),
                        }));
                    }
                    e.to_string()
                })
            })?;
        for line in &applied.done {
            tracing::info!("driver: {line}");
        }
        let (reason, what) = if is_upgrade(planned) {
            ("DriverUpgraded", "driver upgraded")
        } else {
            ("DriverInstalled", "driver installed")
        };
        out.event(
            EventType::Normal,
            reason,
            format!("{what}: {}", crate::driver::plan::describe(&planned.plan)),
        );
        Ok(())
    }

    /// The applied change failed with `error`: an upgrade is not tried again (withdrawing the
    /// GPUs each time) before [`DRIVER_UPGRADE_RETRY`], unless an install loaded another version
    /// (held until the kernel changes).
    pub(super) fn failed(&mut self, planned: &Planned, error: String) {
        if is_upgrade(planned) && !matches!(self.held, Some(Held::Install(_))) {
            self.held = Some(Held::Upgrade {
                summary: planned.plan.summary.clone(),
                at: std::time::Instant::now(),
                error,
            });
        }
    }

    /// The change applied: validates the driver (the host observed again); whether the stages
    /// after it may run (NVML is up).
    pub(super) async fn applied(&mut self, pass: &Pass<'_>, planned: &Planned, out: &mut Outbox) -> bool {
        self.held = None;
        validate_driver(pass, &planned.plan.summary, None, out).await;
        pass.gpus.is_some()
    }
}

/// Whether `planned` unloads the loaded driver (an upgrade).
pub(super) fn is_upgrade(planned: &Planned) -> bool {
    planned.plan.steps.iter().any(|s| matches!(s, Step::Unload { .. }))
}

/// Processes on the GPUs NVML knows, `None` when NVML is not up or cannot tell.
fn gpu_processes(pass: &Pass<'_>) -> Option<usize> {
    let gpus = pass.gpus?;
    let inventory = pass.inventory?;
    inventory.gpus.iter().map(|g| gpus.process_count(&g.uuid)).sum()
}

/// Validation: NVML answers, one GPU per NVIDIA PCI device, the wanted version, the modules.
/// `facts`: the host as last observed, `None` to observe it again (after a change).
async fn validate_driver(pass: &Pass<'_>, summary: &str, facts: Option<observe::HostFacts>, out: &mut Outbox) {
    let id = StageId::Driver;
    let root = pass.root.clone();
    let observed = match facts {
        Some(f) => Ok(Ok(f)),
        None => tokio::task::spawn_blocking(move || observe::observe(&root)).await,
    };
    let facts = match observed {
        Ok(Ok(f)) if f.gpus.is_empty() => {
            out.status(id, StageState::Ok, None, Some(summary.to_string()));
            return;
        }
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            out.status(id, StageState::Failed, Some(e.to_string()), None);
            return;
        }
        Err(e) => {
            out.status(
                id,
                StageState::Failed,
                Some(format!("driver stage task failed: {e}")),
                None,
            );
            return;
        }
    };
    let view = match pass.gpus {
        Some(g) => drv::nvml_view(g, facts.gpus.len()),
        None => Err("NVML is not loaded".to_string()),
    };
    let checks = drv::validate_now(pass.config, pass.root, &facts, view);
    match validate::summary(&checks) {
        Ok(line) => out.status(id, StageState::Ok, None, Some(format!("{line}; {summary}"))),
        Err(e) => out.status(id, StageState::Failed, Some(e), Some(summary.to_string())),
    }
}

/// `gpu-node-agent driver …`: the driver stage by itself.
pub fn driver_command(config: &Config, root: &HostRoot, command: DriverCommand) -> ExitCode {
    logging::init(&config.log);
    let nvml_view = |pci_gpus: usize| {
        Gpus::open(&super::nvml::nvml_library(config, root))
            .map_err(|e| e.to_string())
            .and_then(|g| drv::nvml_view(&g, pci_gpus))
    };
    let planned = match drv::plan_now(config, root, crate::agent::plan::gpu_processes_now(config, root)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpu-node-agent: driver: {e}");
            return ExitCode::FAILURE;
        }
    };
    match command {
        DriverCommand::Status { json } => {
            let checks = drv::validate_now(config, root, &planned.facts, nvml_view(planned.facts.gpus.len()));
            if json {
                let value = serde_json::json!({
                    "host": planned.facts,
                    "plan": planned.plan,
                    "checks": checks,
                });
                println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
            } else {
                let f = &planned.facts;
                println!("kernel        {} ({})", f.kernel_release, f.arch);
                println!(
                    "distribution  {}",
                    if f.os.pretty_name.is_empty() {
                        &f.os.id
                    } else {
                        &f.os.pretty_name
                    }
                );
                println!("NVIDIA GPUs   {} on the PCI bus", f.gpus.len());
                let loaded = f.loaded.as_ref().map_or("none".to_string(), |l| {
                    format!("{} ({})", l.version.as_deref().unwrap_or("?"), l.modules.join(", "))
                });
                println!("loaded        {loaded}");
                println!("nouveau       {}", if f.nouveau { "loaded" } else { "not loaded" });
                println!(
                    "headers       {}",
                    f.headers
                        .as_ref()
                        .map_or("not installed".to_string(), |h| h.display().to_string())
                );
                println!("secure boot   {:?}", f.secure_boot);
                println!("\nplan: {}", crate::driver::plan::describe(&planned.plan));
                println!();
                for c in &checks {
                    println!("{} {:<10} {}", if c.ok { "ok  " } else { "FAIL" }, c.name, c.message);
                }
            }
            let failed: Vec<&str> = checks.iter().filter(|c| !c.ok).map(|c| c.name).collect();
            if failed.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!("gpu-node-agent: driver: failed check(s): {}", failed.join(", "));
                ExitCode::FAILURE
            }
        }
        DriverCommand::Install => {
            if let Some(wait) = &planned.plan.wait {
                eprintln!("gpu-node-agent: driver: {wait}; nothing changed");
                return Exit::TryLater.into();
            }
            match drv::apply(config, root, &planned, None) {
                Ok(applied) => {
                    if applied.done.is_empty() {
                        println!("{}: nothing to do", planned.plan.summary);
                    }
                    for line in &applied.done {
                        println!("{line}");
                    }
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: driver: {e}");
                    return ExitCode::FAILURE;
                }
            }
            let facts = match crate::driver::observe::observe(root) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("gpu-node-agent: driver: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if facts.gpus.is_empty() {
                return ExitCode::SUCCESS;
            }
            let checks = drv::validate_now(config, root, &facts, nvml_view(facts.gpus.len()));
            match crate::driver::validate::summary(&checks) {
                Ok(line) => {
                    println!("{line}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpu-node-agent: driver validation failed: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::pass::Fixture;

    /// The stage by itself, without the loop: off, it plans nothing and lets the stages after
    /// it run.
    #[tokio::test]
    async fn the_stage_steps_on_its_own_and_off_it_plans_nothing() {
        let mut config = Config::default();
        config.driver.enabled = false;
        let fixture = Fixture::new(config);
        let mut stage = DriverStage::default();
        let mut out = Outbox::default();
        assert!(matches!(
            stage.plan(&fixture.pass(), &mut out).await,
            DriverNext::Done(true)
        ));
        assert_eq!(
            out.last_status(StageId::Driver),
            Some((StageState::Disabled, None, Some("[driver] enabled = false")))
        );
        assert!(stage.held.is_none());
    }
}
