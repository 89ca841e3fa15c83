//! The device plugin stage: its value ([`DevicePluginStage`]: the plugin context, the profile
//! and settings in effect, what was advertised last and why it could not be), reading the
//! inventory, the resources it gives, the Allocate options the config describes, when the
//! registration has settled, and the stage's status from what the plugin manager reports. The
//! loop (`agent.rs`) puts the steps together: the inventory read here is every stage's input.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::error::AgentError;
use super::mps::MpsState;
use super::pass::{Outbox, Pass};
use super::wait::or_stop;
use crate::config::{Config, DevicePluginConfig};
use crate::desired::{Desired, ProfileOutcome, ProfileState, Selection, choose_profile};
use crate::devices::{Resource, Topology};
use crate::edits::DeviceNodes;
use crate::host::HostRoot;
use crate::nvml::{Gpus, Inventory};
use crate::plugin::allocate::AllocateOptions;
use crate::plugin::manager::{Command, PluginStatus};
use crate::plugin::server::PluginContext;
use crate::plugin::sharing::apply_sharing;
use crate::plugin::strategy::build_resources;
use crate::status::{StageId, StageState};

/// What the device plugin stage keeps between passes.
pub(super) struct DevicePluginStage {
    /// What every plugin server hands out with its devices (Allocate options, device nodes,
    /// topology).
    pub ctx: PluginContext,
    /// Names of the resources last handed to the plugin manager.
    pub advertised: Vec<String>,
    /// Why the stage cannot advertise what it should (inventory or strategy).
    pub plan_error: Option<String>,
    /// The effective `[device_plugin]` settings: the config with the selected profile applied.
    pub dp: DevicePluginConfig,
    /// How the device plugin profile was chosen, for labels, Events and status.
    pub profile: ProfileOutcome,
    /// The plugin manager's status as it changes, for [`DevicePluginStage::await_registration`].
    pub plugin_watch: Option<watch::Receiver<PluginStatus>>,
}

/// What reading the inventory gave.
pub(super) enum InventoryRead {
    /// The same inventory as before.
    Same,
    /// A new one (the topology is set for it already).
    New(Inventory),
    /// None could be read: the last good one stays advertised, [`DevicePluginStage::plan_error`]
    /// says why.
    Failed,
}

impl DevicePluginStage {
    /// The stage before the labels are read: the config's own settings.
    pub(super) fn new(config: &Config, root: &HostRoot) -> DevicePluginStage {
        let (dp, profile) = choose_profile(
            &config.device_plugin,
            &Selection::Unset,
            None,
            &config.labels.device_plugin_config,
        );
        DevicePluginStage {
            ctx: PluginContext {
                allocate: allocate_options(&dp),
                nodes: DeviceNodes::gather(&root.join(&config.device_plugin.dev_root), &root.join("/proc")),
                topology: Topology::new(),
                shared_policy: dp.sharing.policy,
            },
            advertised: Vec::new(),
            plan_error: None,
            dp,
            profile,
            plugin_watch: None,
        }
    }

    /// Starts with the profile the first labels select (nothing is served yet: nothing to say).
    pub(super) fn start_with(&mut self, config: &Config, desired: &Desired) {
        let (dp, outcome) = choose_profile(
            &config.device_plugin,
            &desired.device_plugin_config,
            None,
            &config.labels.device_plugin_config,
        );
        self.use_settings(dp);
        self.profile = outcome;
    }

    /// Switches to the profile the labels select (a label naming nothing changes nothing and is
    /// reported); `true` when the effective settings changed and the resources must be handed
    /// over again.
    pub(super) fn switch_profile(&mut self, config: &Config, desired: &Desired) -> bool {
        let key = &config.labels.device_plugin_config;
        let (dp, outcome) = choose_profile(
            &config.device_plugin,
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
        if dp == self.dp {
            return false;
        }
        self.use_settings(dp);
        true
    }

    fn use_settings(&mut self, dp: DevicePluginConfig) {
        self.ctx.allocate = allocate_options(&dp);
        self.ctx.shared_policy = dp.sharing.policy;
        self.dp = dp;
    }

    /// Waits until the plugin manager has settled the registration of what was last advertised
    /// (every resource registered or failed, or no kubelet), at most [`REGISTRATION_WAIT`] and
    /// never past SIGTERM. Without a manager (`run --once`, device plugin off) it returns at
    /// once.
    pub(super) async fn await_registration(&mut self, stop: &CancellationToken) {
        let desired = &self.advertised;
        let Some(rx) = self.plugin_watch.as_mut() else { return };
        let settled = rx.wait_for(|status| registration_settled(status, desired));
        let _ = tokio::time::timeout(REGISTRATION_WAIT, or_stop(stop, settled)).await;
    }

    /// Reads the inventory, and the topology of a new one.
    pub(super) fn read_inventory(&mut self, gpus: &Gpus, root: &HostRoot, last: Option<&Inventory>) -> InventoryRead {
        match gpus.inventory(&root.join("/sys")) {
            Ok(inventory) if last == Some(&inventory) => InventoryRead::Same,
            Ok(inventory) => {
                tracing::info!(
                    "inventory: driver {}, CUDA {}, {} GPU(s)",
                    inventory.driver_version,
                    inventory.cuda_driver_version,
                    inventory.gpus.len(),
                );
                self.ctx.topology = gpus.topology(&inventory);
                InventoryRead::New(inventory)
            }
            Err(e) => {
                // Keep advertising the last good inventory (health marks what broke); say why.
                tracing::error!("cannot read the GPU inventory: {e}");
                self.plan_error = Some(e.to_string());
                InventoryRead::Failed
            }
        }
    }

    /// The resources [`resources`] planned, or none (everything withdrawn) with the reason kept.
    pub(super) fn planned(&mut self, planned: Result<Vec<Resource>, AgentError>) -> Vec<Resource> {
        match planned {
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
        }
    }

    /// Hands `resources` to the plugin manager (`commands`); under `run --once` only says what
    /// it would advertise.
    pub(super) async fn hand_over(
        &mut self,
        once: bool,
        commands: Option<&mpsc::Sender<Command>>,
        resources: Vec<Resource>,
        out: &mut Outbox,
    ) {
        if once {
            if self.plan_error.is_none() {
                let detail = summary(&resources);
                let detail = format!("run --once does not serve the kubelet; would advertise {detail}");
                out.status(StageId::DevicePlugin, StageState::Skipped, None, Some(detail));
            }
        } else if let Some(tx) = commands {
            if self.plan_error.is_none() {
                tracing::info!("advertising {}", summary(&resources));
            }
            self.advertised = resources.iter().map(|r| r.name.clone()).collect();
            let _ = tx
                .send(Command::Set {
                    resources,
                    ctx: Arc::new(self.ctx.clone()),
                })
                .await;
        }
    }
}

/// Hands the DRA driver the inventory (without the GPUs whose MIG layout is changing).
pub(super) fn push_dra_inventory(pass: &Pass<'_>) {
    let Some(tx) = pass.services.dra.as_ref().map(|d| &d.inventory) else {
        return;
    };
    let inventory = pass.inventory.map(|inv| {
        let mut inv = inv.clone();
        inv.gpus.retain(|g| !pass.withdrawn.contains(&g.uuid));
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

/// The Allocate options the config describes, with host paths under the root.
pub fn allocate_options(dp: &DevicePluginConfig) -> AllocateOptions {
    AllocateOptions {
        strategies: dp.device_list_strategy.as_slice().to_vec(),
        id_strategy: dp.device_id_strategy,
        pass_device_specs: dp.pass_device_specs,
        cdi_annotation_prefix: dp.cdi_annotation_prefix.clone(),
        cdi_kind: dp.cdi_kind.clone(),
        // Device specs name paths on the host as the container runtime sees them: the real
        // dev_root, not our --root prefix (which only exists for building images and tests).
        dev_root: dp.dev_root.clone(),
        host_mounts_driver_dir: dp.host_mounts_driver_dir.clone(),
        host_mounts_container_dir: dp.host_mounts_container_dir.clone(),
        fail_requests_greater_than_one: dp.sharing.fails_requests_greater_than_one(),
        injections: crate::edits::Injections::from_config(dp),
        // Set with the inventory (`Agent::update_mps`).
        mps: Default::default(),
    }
}

/// The resources to advertise for an inventory: by MIG strategy, then time-slicing replicas.
/// Every device is healthy; health is applied later.
pub fn advertised_resources(inventory: &Inventory, dp: &DevicePluginConfig) -> Result<Vec<Resource>, AgentError> {
    let resources = build_resources(inventory, dp.mig_strategy)?;
    Ok(apply_sharing(resources, &dp.sharing)?)
}

/// How long the validation stage waits for the device plugin's registration to settle before it
/// starts its CUDA check anyway.
pub(super) const REGISTRATION_WAIT: Duration = Duration::from_secs(5);

/// Whether the manager's `status` has settled the registration of the `desired` resources: no
/// kubelet to register with, or each of them registered, failed, or not served because another
/// program holds its socket.
pub(super) fn registration_settled(status: &PluginStatus, desired: &[String]) -> bool {
    !status.kubelet_present
        || desired.iter().all(|name| {
            status.conflicts.iter().any(|c| &c.resource == name)
                || status
                    .resources
                    .iter()
                    .any(|r| &r.name == name && (r.registered || r.error.is_some()))
        })
}

/// The device-plugin stage state from what the manager reports.
pub(super) fn show(pass: &Pass<'_>, mps: &MpsState, out: &mut Outbox) {
    let id = StageId::DevicePlugin;
    if let Some(e) = pass.plan_error {
        out.status(id, StageState::Failed, Some(e.to_string()), None);
        return;
    }
    if let Some(e) = mps.error() {
        let detail = mps.detail();
        out.status(id, StageState::Failed, Some(e), detail);
        return;
    }
    if pass.once || pass.gpus.is_none() || pass.stages[id].status.state == StageState::Disabled {
        return;
    }
    let p = pass.plugin;
    let mut errors: Vec<String> = p.resources.iter().filter_map(|r| r.error.clone()).collect();
    // Sockets another plugin (NVIDIA's) serves: left alone, those resources not served.
    errors.extend(p.conflicts.iter().map(|c| {
        let pid = c.pid.map_or_else(|| "pid unknown".to_string(), |p| format!("pid {p}"));
        format!("{} not served: {} is another process's ({pid})", c.resource, c.socket)
    }));
    let registered = pass
        .advertised
        .iter()
        .filter(|name| p.resources.iter().any(|r| &r.name == *name && r.registered))
        .count();
    let devices: usize = p.resources.iter().map(|r| r.devices).sum();
    let mut detail = format!(
        "{registered}/{} resource(s) registered, {devices} device(s)",
        pass.advertised.len()
    );
    if let Some(mps) = mps.detail() {
        detail.push_str("; ");
        detail.push_str(&mps);
    }
    if !p.kubelet_present {
        let dir = pass.config.kubelet.device_plugin_dir.display();
        out.status(
            id,
            StageState::Pending,
            Some(format!("waiting for the kubelet ({dir}/kubelet.sock)")),
            Some(detail),
        );
    } else if !errors.is_empty() {
        out.status(id, StageState::Pending, Some(errors.join("; ")), Some(detail));
    } else if registered == pass.advertised.len() {
        out.status(id, StageState::Ok, None, Some(detail));
    } else {
        out.status(id, StageState::Pending, None, Some(detail));
    }
}

/// The resources from the current inventory (health is the relay's to apply: replicas
/// follow their device).
pub(super) fn resources(pass: &Pass<'_>) -> Result<Vec<Resource>, AgentError> {
    let Some(inventory) = pass.inventory else {
        return Ok(Vec::new());
    };
    let mut resources = advertised_resources(inventory, pass.dp)?;
    for resource in &mut resources {
        // GPUs whose MIG layout is changing are withdrawn from the kubelet first.
        resource
            .devices
            .retain(|_, d| !pass.withdrawn.contains(d.physical_uuid()));
    }
    resources.retain(|r| !r.devices.is_empty());
    Ok(resources)
}

/// `nvidia.com/gpu ×8, nvidia.com/mig-1g.5gb ×7`.
pub fn summary(resources: &[Resource]) -> String {
    if resources.is_empty() {
        return "no resources".into();
    }
    resources
        .iter()
        .map(|r| format!("{} ×{}", r.name, r.devices.len()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::pass::Fixture;

    /// The stage's status by itself, without the loop: a plan that failed says why; without
    /// NVML there is nothing to report on; no inventory advertises nothing.
    #[test]
    fn the_stage_status_follows_the_plan_and_nvml() {
        let mut fixture = Fixture::new(Config::default());
        let mps = MpsState::new();
        let mut out = Outbox::default();
        show(&fixture.pass(), &mps, &mut out);
        assert_eq!(out.last_status(StageId::DevicePlugin), None, "no NVML yet");
        assert_eq!(resources(&fixture.pass()).map(|r| r.len()).ok(), Some(0));

        fixture.plan_error = Some("MIG strategy single: GPUs differ".into());
        show(&fixture.pass(), &mps, &mut out);
        assert_eq!(
            out.last_status(StageId::DevicePlugin),
            Some((StageState::Failed, Some("MIG strategy single: GPUs differ"), None))
        );
        assert!(registration_settled(
            &PluginStatus::default(),
            &["nvidia.com/gpu".into()]
        ));
    }
}
