//! The validation stage, last in the reconcile order: the driver (NVML answers, versions match:
//! the driver stage's own checks), the runtime (each configured engine's files hold the runtime,
//! and the engine is active), CUDA (a kernel run on every GPU through the driver API, in a child
//! process), and the device plugin (every expected resource registered with a kubelet that is
//! there, and that kubelet watching it: a `ListAndWatch` stream open that lists the resource's
//! devices). A failed check says which and why; nothing is withdrawn because of it: the device
//! plugin keeps serving healthy devices.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Agent, StageState};
use crate::cuda::CudaCheck;
use crate::host::command::{Cmd, Runner};
use crate::plugin::manager::PluginStatus;

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
        // GPUs the plugin should advertise something for (those whose MIG layout is changing are
        // withdrawn on purpose).
        let gpus = self
            .inventory
            .iter()
            .flat_map(|i| &i.gpus)
            .filter(|g| !self.withdrawn.contains(&g.uuid))
            .count();
        plugin_outcome(&self.plugin_status, &self.desired, self.plan_error.as_deref(), gpus)
    }
}

/// The device plugin check from what the plugin manager reports (`status`), the resources last
/// handed to it (`desired`), why nothing consistent could be advertised (`plan_error`), and how
/// many GPUs of the inventory should be advertised.
///
/// - failed: a registration error; no resource advertised at all while there are GPUs (the
///   plan failed); a resource whose `ListAndWatch` stream last listed 0 devices while its plan
///   has some (the kubelet would schedule nothing on them);
/// - pending: no kubelet; a resource not registered yet; a registered resource the kubelet has
///   no `ListAndWatch` stream open for (it has not started watching, or hung up);
/// - passed otherwise.
pub(super) fn plugin_outcome(
    status: &PluginStatus,
    desired: &[String],
    plan_error: Option<&str>,
    gpus: usize,
) -> Outcome {
    if !status.kubelet_present {
        return Outcome::Pending("the kubelet is not running (no kubelet.sock)".into());
    }
    let errors: Vec<String> = status.resources.iter().filter_map(|r| r.error.clone()).collect();
    if !errors.is_empty() {
        return Outcome::Failed(errors.join("; "));
    }
    if desired.is_empty() && gpus > 0 {
        let why = plan_error.map_or(String::new(), |e| format!(": {e}"));
        return Outcome::Failed(format!("no device advertised to the kubelet for {gpus} GPU(s){why}"));
    }
    let mut missing = Vec::new();
    let mut unwatched = Vec::new();
    let mut empty = Vec::new();
    let mut sent = 0;
    for name in desired {
        let Some(resource) = status.resources.iter().find(|r| &r.name == name && r.registered) else {
            missing.push(name.as_str());
            continue;
        };
        let stream = status.streams.get(name).copied().unwrap_or_default();
        if stream.devices_sent == Some(0) && resource.devices > 0 {
            empty.push(format!(
                "{name} lists 0 devices to the kubelet although {} are planned for it",
                resource.devices
            ));
        } else if stream.open == 0 {
            unwatched.push(name.as_str());
        } else {
            sent += stream.devices_sent.unwrap_or(0);
        }
    }
    if !empty.is_empty() {
        return Outcome::Failed(empty.join("; "));
    }
    if !missing.is_empty() {
        return Outcome::Pending(format!("not registered yet: {}", missing.join(", ")));
    }
    if !unwatched.is_empty() {
        return Outcome::Pending(format!(
            "registered, but the kubelet has no ListAndWatch stream open yet: {}",
            unwatched.join(", ")
        ));
    }
    Outcome::Passed(format!(
        "{} resource(s) registered, {sent} device(s) listed to the kubelet",
        desired.len()
    ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::manager::{ResourceStatus, StreamStatus};

    const GPU: &str = "nvidia.com/gpu";

    /// The kubelet is there and `nvidia.com/gpu` (`devices` planned) is registered; its stream,
    /// if any, is `stream`.
    fn status(devices: usize, stream: Option<StreamStatus>) -> PluginStatus {
        PluginStatus {
            kubelet_present: true,
            resources: vec![ResourceStatus {
                name: GPU.into(),
                socket: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".into(),
                registered: true,
                registered_at: Some(1),
                devices,
                healthy: devices,
                error: None,
            }],
            streams: stream.map(|s| (GPU.to_string(), s)).into_iter().collect(),
        }
    }

    fn open(devices_sent: Option<usize>) -> Option<StreamStatus> {
        Some(StreamStatus { open: 1, devices_sent })
    }

    #[test]
    fn the_plugin_passes_once_the_kubelet_watches_every_resource() {
        let desired = [GPU.to_string()];
        assert_eq!(
            plugin_outcome(&status(2, open(Some(2))), &desired, None, 2),
            Outcome::Passed("1 resource(s) registered, 2 device(s) listed to the kubelet".into())
        );
    }

    #[test]
    fn a_registered_resource_without_a_stream_is_pending() {
        let desired = [GPU.to_string()];
        let want = Outcome::Pending(format!(
            "registered, but the kubelet has no ListAndWatch stream open yet: {GPU}"
        ));
        // Never opened, and opened then closed.
        assert_eq!(plugin_outcome(&status(2, None), &desired, None, 2), want);
        let closed = Some(StreamStatus {
            open: 0,
            devices_sent: Some(2),
        });
        assert_eq!(plugin_outcome(&status(2, closed), &desired, None, 2), want);
        // Not registered yet says so first.
        let mut unregistered = status(2, None);
        unregistered.resources[0].registered = false;
        assert_eq!(
            plugin_outcome(&unregistered, &desired, None, 2),
            Outcome::Pending(format!("not registered yet: {GPU}"))
        );
    }

    #[test]
    fn zero_devices_listed_while_gpus_are_planned_fails() {
        let desired = [GPU.to_string()];
        assert_eq!(
            plugin_outcome(&status(2, open(Some(0))), &desired, None, 2),
            Outcome::Failed(format!(
                "{GPU} lists 0 devices to the kubelet although 2 are planned for it"
            ))
        );
        // Nothing advertised at all while the inventory has GPUs: the plan's error.
        let nothing = PluginStatus {
            kubelet_present: true,
            ..PluginStatus::default()
        };
        assert_eq!(
            plugin_outcome(&nothing, &[], Some("mixed MIG modes"), 2),
            Outcome::Failed("no device advertised to the kubelet for 2 GPU(s): mixed MIG modes".into())
        );
        // No GPUs (or all withdrawn for a MIG change): nothing to advertise is right.
        assert_eq!(
            plugin_outcome(&nothing, &[], None, 0),
            Outcome::Passed("0 resource(s) registered, 0 device(s) listed to the kubelet".into())
        );
    }
}
