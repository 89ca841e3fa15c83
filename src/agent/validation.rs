//! The validation stage, last in the reconcile order: the driver (NVML answers, versions match:
//! the driver stage's own checks), the runtime (each configured engine's files hold the runtime,
//! and the engine is active), CUDA (a kernel run on every GPU through the driver API, in a child
//! process), and the device plugin (every expected resource registered with a kubelet that is
//! there, and that kubelet watching it: a `ListAndWatch` stream open that lists the resource's
//! devices). A failed check says which and why; nothing is withdrawn because of it: the device
//! plugin keeps serving healthy devices.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::pass::{Outbox, Pass};
use crate::cuda::{CudaCheck, CudaDevice};
use crate::host::command::{Cmd, Runner};
use crate::nvml::{Inventory, normalise_bus_id};
use crate::plugin::manager::PluginStatus;
use crate::status::{StageId, StageState};

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
struct CudaRun {
    pub driver: String,
    pub at: Instant,
    pub outcome: Outcome,
}

/// The validation stage: the checks of its last run and the CUDA check's last result.
#[derive(Debug, Default)]
pub(super) struct ValidationStage {
    /// The last run's checks (the device plugin's is added as its status changes).
    checks: Vec<(&'static str, Outcome)>,
    /// The CUDA check's last run.
    cuda_run: Option<CudaRun>,
}

impl ValidationStage {
    /// Runs the checks and sets the stage; the checks' outcomes go into the stage detail (and
    /// error for failures). Always lets the stages after it run (there are none).
    pub(super) async fn step(&mut self, pass: &Pass<'_>, out: &mut Outbox) -> bool {
        if !pass.config.validation.enabled {
            out.status(
                StageId::Validation,
                StageState::Disabled,
                None,
                Some("[validation] enabled = false".into()),
            );
            return true;
        }
        let driver = check_driver(pass);
        let runtime = check_runtime(pass).await;
        let cuda = self.check_cuda(pass).await;
        self.checks = vec![("driver", driver), ("runtime", runtime), ("cuda", cuda)];
        self.show(pass, out);
        true
    }

    /// The device plugin check follows the plugin's status, which changes between passes.
    pub(super) fn show(&mut self, pass: &Pass<'_>, out: &mut Outbox) {
        if pass.stages[StageId::Validation].status.state == StageState::Disabled || self.checks.is_empty() {
            return;
        }
        self.checks.retain(|(name, _)| *name != "device-plugin");
        self.checks.push(("device-plugin", check_plugin(pass)));
        let checks = &self.checks;
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
        let id = StageId::Validation;
        if !failed.is_empty() {
            out.status(id, StageState::Failed, Some(failed.join("; ")), Some(summary));
        } else if let Some(why) = pending {
            out.status(id, StageState::Pending, Some(why), Some(summary));
        } else {
            out.status(id, StageState::Ok, None, Some(summary));
        }
    }

    /// The devices changed (a new MIG layout): the CUDA check runs again at the next pass, on
    /// every device CUDA sees, rather than keep the result of GPUs that no longer look that way.
    pub(super) fn devices_changed(&mut self) {
        self.cuda_run = None;
    }

    /// The CUDA check in a child process, once per driver version (and daily).
    async fn check_cuda(&mut self, pass: &Pass<'_>) -> Outcome {
        if !pass.config.validation.cuda {
            return Outcome::Skipped("[validation] cuda = false".into());
        }
        let Some(driver) = pass.inventory.map(|i| i.driver_version.clone()) else {
            return Outcome::Pending("no GPU inventory yet".into());
        };
        if let Some(run) = &self.cuda_run
            && run.driver == driver
            && run.at.elapsed() < CUDA_RECHECK
        {
            return run.outcome.clone();
        }
        let (root, driver_root, stop) = (
            pass.root.path().to_path_buf(),
            pass.config.device_plugin.driver_root.clone(),
            pass.stop.clone(),
        );
        let outcome = match tokio::task::spawn_blocking(move || run_cuda_child(&root, &driver_root, &stop)).await {
            Ok(Ok(check)) => cuda_outcome(check, pass.inventory),
            Ok(Err(why)) => Outcome::Failed(why),
            Err(e) => Outcome::Failed(format!("CUDA check task failed: {e}")),
        };
        self.cuda_run = Some(CudaRun {
            driver,
            at: Instant::now(),
            outcome: outcome.clone(),
        });
        outcome
    }
}

fn check_driver(pass: &Pass<'_>) -> Outcome {
    let s = &pass.stages[StageId::Driver].status;
    match s.state {
        StageState::Ok => Outcome::Passed(s.detail.clone().unwrap_or_default()),
        StageState::Disabled => Outcome::Skipped("[driver] enabled = false".into()),
        StageState::Pending => Outcome::Pending(s.error.clone().unwrap_or_default()),
        StageState::Failed | StageState::Skipped => Outcome::Failed(s.error.clone().unwrap_or_default()),
    }
}

/// The runtime stage of this pass left every selected engine's files holding the runtime (it
/// failed otherwise); here each engine's unit must also be active (`systemctl is-active`, where
/// systemctl is installed).
async fn check_runtime(pass: &Pass<'_>) -> Outcome {
    if !pass.config.runtime.enabled {
        return Outcome::Skipped("[runtime] enabled = false".into());
    }
    let Some(plan) = pass.runtime_plan.cloned() else {
        let s = &pass.stages[StageId::Runtime].status;
        return Outcome::Failed(
            s.error
                .clone()
                .unwrap_or_else(|| "the runtime stage has not succeeded".into()),
        );
    };
    if let Some(note) = &plan.note {
        return Outcome::Skipped(note.clone());
    }
    let (config, root, stop) = (pass.config.clone(), pass.root.clone(), pass.stop.clone());
    let result = tokio::task::spawn_blocking(move || {
        let runner = Runner::new(&root).with_stop(&stop);
        let mut inactive = Vec::new();
        // systemctl under the root: the node's own on a real root, a stand-in in tests.
        if runner.exists(&config.runtime.systemctl) {
            for e in plan
                .engines
                .iter()
                .filter(|e| e.installed && e.error.is_none() && e.skipped.is_none())
            {
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
            Outcome::Passed(plan.describe(&config.runtime.runtime_name))
        } else {
            Outcome::Failed(inactive.join("; "))
        }
    })
    .await;
    result.unwrap_or_else(|e| Outcome::Failed(format!("runtime check task failed: {e}")))
}

fn check_plugin(pass: &Pass<'_>) -> Outcome {
    if !pass.config.device_plugin.enabled {
        return Outcome::Skipped("[device_plugin] enabled = false".into());
    }
    if pass.once {
        return Outcome::Skipped("run --once does not serve the kubelet".into());
    }
    // GPUs the plugin should advertise something for (those whose MIG layout is changing are
    // withdrawn on purpose).
    let gpus = pass
        .inventory
        .iter()
        .flat_map(|i| &i.gpus)
        .filter(|g| !pass.withdrawn.contains(&g.uuid))
        .count();
    plugin_outcome(pass.plugin, pass.advertised, pass.plan_error, gpus)
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

/// The CUDA check's outcome, each device named as NVML knows it (`inventory`): CUDA's ordinals
/// follow `CUDA_DEVICE_ORDER` (fastest first by default), so a GPU is named by its NVML index,
/// UUID and PCI bus id, matched on the bus id libcuda reports. A check that passed still fails
/// when CUDA and NVML do not see the same GPUs (not on MIG nodes: CUDA sees MIG devices there,
/// not whole GPUs).
pub(super) fn cuda_outcome(check: CudaCheck, inventory: Option<&Inventory>) -> Outcome {
    match check {
        CudaCheck::NotAvailable { reason } => Outcome::Skipped(format!("not available: {reason}")),
        CudaCheck::Failed { reason } if reason.devices.is_empty() => Outcome::Failed(reason.message),
        CudaCheck::Failed { reason } => Outcome::Failed(
            reason
                .devices
                .iter()
                .map(|f| format!("{}: {}", name_cuda_device(&f.device, inventory), f.error))
                .collect::<Vec<_>>()
                .join("; "),
        ),
        CudaCheck::Passed { driver_api, gpus } => match cuda_nvml_mismatch(&gpus, inventory) {
            Some(why) => Outcome::Failed(why),
            None => Outcome::Passed(format!("CUDA {driver_api}: a kernel ran on {} GPU(s)", gpus.len())),
        },
    }
}

/// The NVML GPU at the CUDA device's PCI bus id, if NVML lists one.
fn nvml_gpu<'a>(device: &CudaDevice, inventory: Option<&'a Inventory>) -> Option<&'a crate::nvml::GpuInfo> {
    let bus = normalise_bus_id(device.pci_bus_id.as_deref()?);
    inventory?.gpus.iter().find(|g| normalise_bus_id(&g.pci_bus_id) == bus)
}

/// `GPU 1 (GPU-…, 00000000:11:00.0; CUDA device 0)`, or CUDA's own description where NVML
/// does not list the device (or there is no inventory).
fn name_cuda_device(device: &CudaDevice, inventory: Option<&Inventory>) -> String {
    match nvml_gpu(device, inventory) {
        Some(g) => format!(
            "GPU {} ({}, {}; CUDA device {})",
            g.index, g.uuid, g.pci_bus_id, device.ordinal
        ),
        None if inventory.is_some() && device.pci_bus_id.is_some() => {
            format!("{device}, which NVML does not list")
        }
        None => device.to_string(),
    }
}

/// Why CUDA's devices are not NVML's GPUs, naming those only one side sees; `None` when the
/// counts agree, without an inventory, or on a node with a MIG-enabled GPU.
fn cuda_nvml_mismatch(cuda: &[CudaDevice], inventory: Option<&Inventory>) -> Option<String> {
    let inventory = inventory?;
    if cuda.len() == inventory.gpus.len() || inventory.gpus.iter().any(|g| g.mig.is_some_and(|m| m.current)) {
        return None;
    }
    let cuda_buses: Option<Vec<String>> = cuda
        .iter()
        .map(|d| d.pci_bus_id.as_deref().map(normalise_bus_id))
        .collect();
    let mut why = format!(
        "CUDA sees {} device(s) but NVML sees {} GPU(s)",
        cuda.len(),
        inventory.gpus.len()
    );
    if let Some(buses) = &cuda_buses {
        let unseen: Vec<String> = inventory
            .gpus
            .iter()
            .filter(|g| !buses.contains(&normalise_bus_id(&g.pci_bus_id)))
            .map(|g| g.to_string())
            .collect();
        if !unseen.is_empty() {
            why.push_str(&format!(": not a CUDA device: {}", unseen.join(", ")));
        }
    }
    let unlisted: Vec<String> = cuda
        .iter()
        .filter(|d| d.pci_bus_id.is_some() && nvml_gpu(d, Some(inventory)).is_none())
        .map(|d| d.to_string())
        .collect();
    if !unlisted.is_empty() {
        why.push_str(&format!("; not an NVML GPU: {}", unlisted.join(", ")));
    }
    if cuda.len() < inventory.gpus.len() {
        why.push_str(
            " (is CUDA_VISIBLE_DEVICES set in the agent's environment? otherwise CUDA cannot initialise the GPU: \
             check `dmesg` for Xid errors)",
        );
    }
    Some(why)
}

/// Runs `gpu-node-agent validate cuda` (this binary) and reads its JSON answer.
fn run_cuda_child(
    root: &std::path::Path,
    driver_root: &std::path::Path,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<CudaCheck, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the agent's own binary: {e}"))?;
    let cmd = Cmd::new(exe)
        .arg("--root")
        .arg(root)
        .args(["validate", "cuda", "--json", "--driver-root"])
        .arg(driver_root)
        .timeout(CUDA_TIMEOUT);
    let out = crate::host::command::run_unrooted(&cmd, Some(stop)).map_err(|e| e.to_string())?;
    serde_json::from_str::<CudaCheck>(out.stdout.trim()).map_err(|_| {
        format!(
            "the CUDA check ended with {} and no answer{}",
            out.status,
            if out.stderr.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", out.stderr.trim())
            }
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::manager::ResourceStatus;
    use crate::plugin::server::StreamStatus;

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
                streams_open: stream.map_or(0, |s| s.open),
                devices_sent: stream.and_then(|s| s.devices_sent),
            }],
            streams: stream.map(|s| (GPU.to_string(), s)).into_iter().collect(),
            conflicts: Vec::new(),
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

    fn cuda_device(ordinal: i32, bus: Option<&str>) -> CudaDevice {
        CudaDevice {
            ordinal,
            name: "NVIDIA A100-SXM4-40GB".into(),
            pci_bus_id: bus.map(str::to_string),
        }
    }

    fn passed(devices: Vec<CudaDevice>) -> CudaCheck {
        CudaCheck::Passed {
            driver_api: "12.4".into(),
            gpus: crate::cuda::CudaGpus(devices),
        }
    }

    #[test]
    fn a_failed_cuda_device_is_named_by_its_nvml_index_uuid_and_bus_id() {
        use crate::cuda::{CudaFailure, DeviceFailure};
        use crate::nvml::sample::{a100, inventory};

        let inventory = inventory(vec![a100(0), a100(1)]);
        // CUDA's ordinal 0 is NVML's GPU 1 (fastest first is not PCI order).
        let failed = |bus: &str| CudaCheck::Failed {
            reason: CudaFailure {
                message: "…".into(),
                devices: vec![DeviceFailure {
                    device: cuda_device(0, Some(bus)),
                    error: "cuLaunchKernel: CUDA error 719 (unspecified launch failure)".into(),
                }],
            },
        };
        assert_eq!(
            cuda_outcome(failed("0000:11:00.0"), Some(&inventory)),
            Outcome::Failed(
                "GPU 1 (GPU-1, 00000000:11:00.0; CUDA device 0): cuLaunchKernel: CUDA error 719 (unspecified launch \
                 failure)"
                    .into()
            )
        );
        assert_eq!(
            cuda_outcome(failed("0000:c1:00.0"), Some(&inventory)),
            Outcome::Failed(
                "CUDA device 0 (NVIDIA A100-SXM4-40GB, PCI 0000:c1:00.0), which NVML does not list: cuLaunchKernel: \
                 CUDA error 719 (unspecified launch failure)"
                    .into()
            )
        );
        // Without an inventory, CUDA's own description (with the bus id).
        assert_eq!(
            cuda_outcome(failed("0000:11:00.0"), None),
            Outcome::Failed(
                "CUDA device 0 (NVIDIA A100-SXM4-40GB, PCI 0000:11:00.0): cuLaunchKernel: CUDA error 719 \
                 (unspecified launch failure)"
                    .into()
            )
        );
    }

    #[test]
    fn cuda_seeing_fewer_gpus_than_nvml_fails_naming_the_missing_one() {
        use crate::nvml::sample::{a100, inventory, mig, mig_devices};

        let two = inventory(vec![a100(0), a100(1)]);
        let one = passed(vec![cuda_device(0, Some("0000:11:00.0"))]);
        match cuda_outcome(one.clone(), Some(&two)) {
            Outcome::Failed(why) => assert!(
                why.starts_with(
                    "CUDA sees 1 device(s) but NVML sees 2 GPU(s): not a CUDA device: GPU 0 (GPU-0, 00000000:10:00.0) \
                     (is CUDA_VISIBLE_DEVICES set"
                ),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        // A device CUDA has and NVML does not is named too.
        let three = passed(vec![
            cuda_device(0, Some("0000:11:00.0")),
            cuda_device(1, Some("0000:10:00.0")),
            cuda_device(2, Some("0000:c1:00.0")),
        ]);
        assert_eq!(
            cuda_outcome(three, Some(&two)),
            Outcome::Failed(
                "CUDA sees 3 device(s) but NVML sees 2 GPU(s); not an NVML GPU: CUDA device 2 (NVIDIA \
                 A100-SXM4-40GB, PCI 0000:c1:00.0)"
                    .into()
            )
        );
        // Same count: passed. No inventory, or a MIG-enabled GPU: counts are not compared.
        let both = passed(vec![
            cuda_device(0, Some("0000:11:00.0")),
            cuda_device(1, Some("0000:10:00.0")),
        ]);
        assert_eq!(
            cuda_outcome(both, Some(&two)),
            Outcome::Passed("CUDA 12.4: a kernel ran on 2 GPU(s)".into())
        );
        assert!(matches!(cuda_outcome(one.clone(), None), Outcome::Passed(_)));
        let mut with_mig = two.clone();
        with_mig.gpus[1].mig = Some(mig(true));
        with_mig.gpus[1].mig_devices = mig_devices(1, &["3g.20gb"]);
        assert!(matches!(cuda_outcome(one, Some(&with_mig)), Outcome::Passed(_)));
    }

    /// The stage by itself, without the loop: stepped on a pass where nothing has run yet.
    #[tokio::test]
    async fn the_stage_steps_on_its_own_and_says_which_check_holds_it() {
        use crate::agent::pass::Fixture;
        let mut fixture = Fixture::new(crate::config::Config::default());
        let mut stage = ValidationStage::default();
        let mut out = Outbox::default();
        assert!(stage.step(&fixture.pass(), &mut out).await);
        let (state, error, detail) = out.last_status(StageId::Validation).expect("a status");
        assert_eq!(state, StageState::Failed);
        assert_eq!(error, Some("runtime: the runtime stage has not succeeded"));
        assert_eq!(
            detail,
            Some("driver pending, runtime failed, cuda pending, device-plugin pending")
        );

        // The plugin's status changes between passes: the device plugin check follows it.
        fixture.apply(&out);
        fixture.config.runtime.enabled = false;
        fixture.config.device_plugin.enabled = false;
        let mut out = Outbox::default();
        stage.show(&fixture.pass(), &mut out);
        let (_, _, detail) = out.last_status(StageId::Validation).expect("a status");
        assert_eq!(
            detail,
            Some("driver pending, runtime failed, cuda pending, device-plugin skipped"),
            "only the device plugin check is looked at again"
        );
        let mut out = Outbox::default();
        assert!(stage.step(&fixture.pass(), &mut out).await);
        let (state, error, detail) = out.last_status(StageId::Validation).expect("a status");
        assert_eq!(state, StageState::Pending);
        assert_eq!(error, Some("driver: "));
        assert_eq!(
            detail,
            Some("driver pending, runtime skipped, cuda pending, device-plugin skipped")
        );
    }

    #[tokio::test]
    async fn a_disabled_stage_says_so_and_shows_nothing_later() {
        use crate::agent::pass::Fixture;
        let mut config = crate::config::Config::default();
        config.validation.enabled = false;
        let mut fixture = Fixture::new(config);
        let mut stage = ValidationStage::default();
        let mut out = Outbox::default();
        assert!(stage.step(&fixture.pass(), &mut out).await);
        assert_eq!(
            out.last_status(StageId::Validation),
            Some((StageState::Disabled, None, Some("[validation] enabled = false")))
        );
        fixture.apply(&out);
        let mut out = Outbox::default();
        stage.show(&fixture.pass(), &mut out);
        assert_eq!(out.last_status(StageId::Validation), None);
    }
}
