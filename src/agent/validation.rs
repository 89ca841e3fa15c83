//! The validation stage, last in the reconcile order: the driver (NVML answers, versions match:
//! the driver stage's own checks), the runtime (each configured engine's files hold the runtime,
//! and the engine is active), CUDA (a kernel run on every GPU through the driver API, in a child
//! process), and the device plugin (every expected resource registered with a kubelet that is
//! there). A failed check says which and why; nothing is withdrawn because of it: the device
//! plugin keeps serving healthy devices.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Agent, StageState};
use crate::cuda::CudaCheck;
use crate::host::command::{Cmd, Runner};

/// How often the CUDA check runs again for the same driver.
const CUDA_RECHECK: Duration = Duration::from_secs(24 * 3600);
/// How long the CUDA check may take (JIT and a context per GPU).
const CUDA_TIMEOUT: Duration = Duration::from_secs(120);

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", content = "detail", rename_all = "kebab-case")]
pub enum Outcome {
    Passed(String),
    Failed(String),
    /// Not decided yet (e.g. the kubelet has not registered the plugin yet).
    Pending(String),
    /// Not applicable here (stage disabled, no libcuda, a `--root` prefix).
    Skipped(String),
}

/// The CUDA check's last result and when and for which driver it ran.
#[derive(Debug, Clone)]
pub(super) struct CudaRun {
    pub driver: String,
    pub at: Instant,
    pub outcome: Outcome,
}

impl Agent {
    /// Runs the checks and sets the stage; the checks' outcomes go into the stage detail (and
    /// error for failures).
    pub(super) async fn validation_step(&mut self) {
        if !self.config.validation.enabled {
            self.validation_stage
                .set(StageState::Disabled, None, Some("[validation] enabled = false".into()));
            return;
        }
        let driver = self.check_driver();
        let runtime = self.check_runtime().await;
        let cuda = self.check_cuda().await;
        self.validation_checks = vec![("driver", driver), ("runtime", runtime), ("cuda", cuda)];
        self.show_validation();
    }

    /// The device plugin check follows the plugin's status, which changes between passes.
    pub(super) fn show_validation(&mut self) {
        if self.validation_stage.status.state == StageState::Disabled || self.validation_checks.is_empty() {
            return;
        }
        let mut checks = self.validation_checks.clone();
        checks.retain(|(name, _)| *name != "device-plugin");
        checks.push(("device-plugin", self.check_plugin()));
        let failed: Vec<String> = checks
            .iter()
            .filter_map(|(name, o)| match o {
                Outcome::Failed(why) => Some(format!("{name}: {why}")),
                _ => None,
            })
            .collect();
        let summary = checks
            .iter()
            .map(|(name, o)| {
                let word = match o {
                    Outcome::Passed(_) => "ok",
                    Outcome::Failed(_) => "failed",
                    Outcome::Pending(_) => "pending",
                    Outcome::Skipped(_) => "skipped",
                };
                format!("{name} {word}")
            })
            .collect::<Vec<_>>()
            .join(", ");
        let pending = checks.iter().find_map(|(name, o)| match o {
            Outcome::Pending(why) => Some(format!("{name}: {why}")),
            _ => None,
        });
        if !failed.is_empty() {
            self.validation_stage
                .set(StageState::Failed, Some(failed.join("; ")), Some(summary));
        } else if let Some(why) = pending {
            self.validation_stage.set(StageState::Pending, Some(why), Some(summary));
        } else {
            self.validation_stage.set(StageState::Ok, None, Some(summary));
        }
        self.validation_detail = checks;
    }

    fn check_driver(&self) -> Outcome {
        let s = &self.driver_stage.status;
        match s.state {
            StageState::Ok => Outcome::Passed(s.detail.clone().unwrap_or_default()),
            StageState::Disabled => Outcome::Skipped("[driver] enabled = false".into()),
            StageState::Pending => Outcome::Pending(s.error.clone().unwrap_or_default()),
            StageState::Failed | StageState::Skipped => Outcome::Failed(s.error.clone().unwrap_or_default()),
        }
    }

    /// The runtime stage of this pass left every selected engine's files holding the runtime
    /// (it failed otherwise); here each engine's unit must also be active (`systemctl
    /// is-active`, where systemctl is installed).
    async fn check_runtime(&self) -> Outcome {
        if !self.config.runtime.enabled {
            return Outcome::Skipped("[runtime] enabled = false".into());
        }
        let Some(plan) = self.runtime_plan.clone() else {
            let s = &self.runtime_stage.status;
            return Outcome::Failed(
                s.error
                    .clone()
                    .unwrap_or_else(|| "the runtime stage has not succeeded".into()),
            );
        };
        if let Some(note) = &plan.note {
            return Outcome::Skipped(note.clone());
        }
        let (config, root) = (self.config.clone(), self.root.clone());
        let result = tokio::task::spawn_blocking(move || {
            let runner = Runner::new(&root);
            let mut inactive = Vec::new();
            // systemctl under the root: the node's own on a real root, a stand-in in tests.
            if runner.exists(&config.runtime.systemctl) {
                for e in plan.engines.iter().filter(|e| e.installed) {
                    let cmd = Cmd::new(&config.runtime.systemctl)
                        .args(["is-active", e.unit.as_str()])
                        .timeout(Duration::from_secs(10));
                    match runner.output(&cmd) {
                        Ok(out) if out.success() => {}
                        Ok(out) => inactive.push(format!("{} is {}", e.unit, out.stdout.trim())),
                        Err(err) => inactive.push(err.to_string()),
                    }
                }
            }
            if inactive.is_empty() {
                Outcome::Passed(format!("{} runtime in {}", config.runtime.runtime_name, plan.summary()))
            } else {
                Outcome::Failed(inactive.join("; "))
            }
        })
        .await;
        result.unwrap_or_else(|e| Outcome::Failed(format!("runtime check task failed: {e}")))
    }

    /// The CUDA check in a child process, once per driver version (and daily).
    async fn check_cuda(&mut self) -> Outcome {
        if !self.config.validation.cuda {
            return Outcome::Skipped("[validation] cuda = false".into());
        }
        let Some(driver) = self.inventory.as_ref().map(|i| i.driver_version.clone()) else {
            return Outcome::Pending("no GPU inventory yet".into());
        };
        if let Some(run) = &self.cuda_run
            && run.driver == driver
            && run.at.elapsed() < CUDA_RECHECK
        {
            return run.outcome.clone();
        }
        let (root, driver_root) = (
            self.root.path().to_path_buf(),
            self.config.device_plugin.driver_root.clone(),
        );
        let outcome = tokio::task::spawn_blocking(move || run_cuda_child(&root, &driver_root))
            .await
            .unwrap_or_else(|e| Outcome::Failed(format!("CUDA check task failed: {e}")));
        self.cuda_run = Some(CudaRun {
            driver,
            at: Instant::now(),
            outcome: outcome.clone(),
        });
        outcome
    }

    fn check_plugin(&self) -> Outcome {
        if !self.config.device_plugin.enabled {
            return Outcome::Skipped("[device_plugin] enabled = false".into());
        }
        if self.once {
            return Outcome::Skipped("run --once does not serve the kubelet".into());
        }
        let p = &self.plugin_status;
        if !p.kubelet_present {
            return Outcome::Pending("the kubelet is not running (no kubelet.sock)".into());
        }
        let missing: Vec<&str> = self
            .desired
            .iter()
            .filter(|name| !p.resources.iter().any(|r| &r.name == *name && r.registered))
            .map(String::as_str)
            .collect();
        let errors: Vec<String> = p.resources.iter().filter_map(|r| r.error.clone()).collect();
        if !errors.is_empty() {
            return Outcome::Failed(errors.join("; "));
        }
        if !missing.is_empty() {
            return Outcome::Pending(format!("not registered yet: {}", missing.join(", ")));
        }
        Outcome::Passed(format!("{} resource(s) registered", self.desired.len()))
    }
}

/// Runs `gpu-node-agent validate cuda` (this binary) and reads its JSON answer.
fn run_cuda_child(root: &std::path::Path, driver_root: &std::path::Path) -> Outcome {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(format!("cannot find the agent's own binary: {e}")),
    };
    let cmd = Cmd::new(exe)
        .arg("--root")
        .arg(root)
        .args(["validate", "cuda", "--json", "--driver-root"])
        .arg(driver_root)
        .timeout(CUDA_TIMEOUT);
    let out = match crate::host::command::run_unrooted(&cmd) {
        Ok(out) => out,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    match serde_json::from_str::<CudaCheck>(out.stdout.trim()) {
        Ok(CudaCheck::Passed { driver_api, gpus }) => {
            Outcome::Passed(format!("CUDA {driver_api}: a kernel ran on {} GPU(s)", gpus.len()))
        }
        Ok(CudaCheck::NotAvailable { reason }) => Outcome::Skipped(format!("not available: {reason}")),
        Ok(CudaCheck::Failed { reason }) => Outcome::Failed(reason),
        Err(_) => Outcome::Failed(format!(
            "the CUDA check ended with {} and no answer{}",
            out.status,
            if out.stderr.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", out.stderr.trim())
            }
        )),
    }
}
