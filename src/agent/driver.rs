//! The driver stage inside the reconcile loop: first of all stages. It installs, builds or loads
//! the driver `[driver]` asks for (an upgrade only when no GPU work runs, with the GPUs withdrawn
//! from the kubelet first and NVML reopened after, also when the change failed), then validates
//! what NVML reports.

use super::{Agent, StageId, StageState};
use crate::cli::DriverCommand;
use crate::config::Config;
use crate::driver::stage::{self as drv, Planned};
use crate::driver::{observe, plan::Step, validate};
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::kube::EventType;
use crate::logging;
use crate::nvml::Gpus;
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

impl Agent {
    /// Processes on the GPUs NVML knows, `None` when NVML is not up or cannot tell.
    fn gpu_processes(&self) -> Option<usize> {
        let gpus = self.gpus.as_ref()?;
        let inventory = self.inventory.as_ref()?;
        inventory.gpus.iter().map(|g| gpus.process_count(&g.uuid)).sum()
    }

    /// Runs the driver stage; `false` when the stages after it cannot run (no working driver).
    pub(super) async fn driver_step(&mut self) -> bool {
        if !self.config.driver.enabled {
            self.stages[StageId::Driver].set(StageState::Disabled, None, Some("[driver] enabled = false".into()));
            return true;
        }
        let processes = self.gpu_processes();
        let (config, root) = (self.config.clone(), self.root.clone());
        let failed = self.driver.failed_install().cloned();
        let planned = tokio::task::spawn_blocking(move || drv::plan_with(&config, &root, processes, failed.as_ref()))
            .await
            .map_err(|e| format!("driver stage task failed: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        let planned: Planned = match planned {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("driver stage failed: {e}");
                self.stages[StageId::Driver].set(StageState::Failed, Some(e), None);
                return self.gpus.is_some();
            }
        };
        if let Some(wait) = &planned.plan.wait {
            // The loaded driver keeps serving meanwhile.
            self.stages[StageId::Driver].set(
                StageState::Pending,
                Some(wait.clone()),
                Some(planned.plan.summary.clone()),
            );
            return self.gpus.is_some();
        }
        let changed = !planned.plan.steps.is_empty();
        let upgrade = planned.plan.steps.iter().any(|s| matches!(s, Step::Unload { .. }));
        if upgrade
            && let Some(Held::Upgrade { summary, at, error }) = &self.driver.held
            && *summary == planned.plan.summary
            && at.elapsed() < DRIVER_UPGRADE_RETRY
        {
            // The GPUs stay with the kubelet on the driver still loaded.
            let left = DRIVER_UPGRADE_RETRY.saturating_sub(at.elapsed()).as_secs().div_ceil(60);
            let reason = format!("{error} (tried again in {left} min, or at `systemctl restart gpu-node-agent`)");
            self.stages[StageId::Driver].set(StageState::Failed, Some(reason), Some(planned.plan.summary.clone()));
            return self.gpus.is_some();
        }
        if changed && let Err(go_on) = self.apply_driver(&planned).await {
            if upgrade
                && !matches!(self.driver.held, Some(Held::Install(_)))
                && let Some(error) = self.stages[StageId::Driver].status.error.clone()
            {
                self.driver.held = Some(Held::Upgrade {
                    summary: planned.plan.summary.clone(),
                    at: std::time::Instant::now(),
                    error,
                });
            }
            return go_on;
        }
        self.driver.held = None;
        // The host facts the plan was made from still hold unless the plan changed something.
        let facts = if changed { None } else { Some(planned.facts) };
        self.validate_driver(&planned.plan.summary, facts).await;
        self.gpus.is_some()
    }

    /// Applies a driver plan; an upgrade withdraws every GPU from the kubelet and closes NVML
    /// first, and NVML is (re)opened after, whether the change succeeded or not. On failure the
    /// stage is failed with the reason, and the error says whether the stages after it can run
    /// (a failed upgrade with NVML back on the driver still loaded: they re-read the inventory
    /// and advertise the GPUs again).
    async fn apply_driver(&mut self, planned: &Planned) -> Result<(), bool> {
        let upgrade = planned.plan.steps.iter().any(|s| matches!(s, Step::Unload { .. }));
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
        tracing::info!("driver: {}", crate::driver::plan::describe(&planned.plan));
        let _long = crate::notify::LongStep::start(&self.long_step);
        let (config, root, p, stop) = (
            self.config.clone(),
            self.root.clone(),
            planned.clone(),
            self.stop.clone(),
        );
        let kernel = planned.facts.kernel_release.clone();
        let applied = tokio::task::spawn_blocking(move || drv::apply(&config, &root, &p, Some(&stop)))
            .await
            .map_err(|e| format!("driver stage task failed: {e}"))
            .and_then(|r| {
                r.map_err(|e| {
                    if let drv::DriverError::OtherVersion(message) = &e {
                        self.driver.held = Some(Held::Install(drv::FailedInstall {
                            kernel_release: kernel,
                            message: message.clone(),
                        }));
                    }
                    e.to_string()
                })
            });
        match applied {
            Ok(applied) => {
                for line in &applied.done {
                    tracing::info!("driver: {line}");
                }
                let (reason, what) = if upgrade {
                    ("DriverUpgraded", "driver upgraded")
                } else {
                    ("DriverInstalled", "driver installed")
                };
                self.event(
                    EventType::Normal,
                    reason,
                    format!("{what}: {}", crate::driver::plan::describe(&planned.plan)),
                );
            }
            Err(e) => {
                tracing::error!("driver stage failed: {e}");
                let go_on = upgrade && self.recover_from_failed_upgrade();
                self.stages[StageId::Driver].set(StageState::Failed, Some(e), None);
                return Err(go_on);
            }
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
        Ok(())
    }

    /// After a failed upgrade: NVML again, on whatever driver is still loaded, and the GPUs
    /// withdrawn for the change given back. `true` when NVML is up: the stages after the driver's
    /// then re-read the inventory (restarting the health watcher) and advertise the GPUs again.
    /// Without NVML nothing is advertised until it loads (retried every `[nvml] retry_interval`).
    fn recover_from_failed_upgrade(&mut self) -> bool {
        if self.gpus.is_none()
            && let Err(e) = self.open_nvml()
        {
            tracing::error!("NVML after the failed driver change: {e}");
        }
        self.restore_withdrawn();
        self.inventory = None;
        self.gpus.is_some()
    }

    /// Validation: NVML answers, one GPU per NVIDIA PCI device, the wanted version, the modules.
    /// `facts`: the host as last observed, `None` to observe it again (after a change).
    async fn validate_driver(&mut self, summary: &str, facts: Option<observe::HostFacts>) {
        let root = self.root.clone();
        let observed = match facts {
            Some(f) => Ok(Ok(f)),
            None => tokio::task::spawn_blocking(move || observe::observe(&root)).await,
        };
        let facts = match observed {
            Ok(Ok(f)) if f.gpus.is_empty() => {
                self.stages[StageId::Driver].set(StageState::Ok, None, Some(summary.to_string()));
                return;
            }
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                self.stages[StageId::Driver].set(StageState::Failed, Some(e.to_string()), None);
                return;
            }
            Err(e) => {
                self.stages[StageId::Driver].set(
                    StageState::Failed,
                    Some(format!("driver stage task failed: {e}")),
                    None,
                );
                return;
            }
        };
        let view = match &self.gpus {
            Some(g) => drv::nvml_view(g, facts.gpus.len()),
            None => Err("NVML is not loaded".to_string()),
        };
        let checks = drv::validate_now(&self.config, &self.root, &facts, view);
        match validate::summary(&checks) {
            Ok(line) => self.stages[StageId::Driver].set(StageState::Ok, None, Some(format!("{line}; {summary}"))),
            Err(e) => self.stages[StageId::Driver].set(StageState::Failed, Some(e), Some(summary.to_string())),
        }
    }
}

/// `gpu-node-agent driver …`: the driver stage by itself.
pub fn driver_command(config: &Config, root: &HostRoot, command: DriverCommand) -> ExitCode {
    logging::init(&config.log);
    let nvml_view = |pci_gpus: usize| {
        Gpus::open(&super::nvml_library(config, root))
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
