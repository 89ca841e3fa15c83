//! The device plugin stage's rules: the resources an inventory gives, the health policy and
//! the Allocate options the config describes, when the registration has settled, and the
//! stage's status from what the plugin manager reports. The step that reads the inventory and
//! hands the resources to the manager is the loop's (`agent.rs`): the inventory it reads is
//! every stage's input.

use std::time::Duration;

use super::AgentError;
use super::mps::MpsState;
use super::pass::{Outbox, Pass};
use crate::config::{Config, DevicePluginConfig};
use crate::devices::Resource;
use crate::nvml::Inventory;
use crate::plugin::allocate::AllocateOptions;
use crate::plugin::health::HealthPolicy;
use crate::plugin::manager::PluginStatus;
use crate::plugin::sharing::apply_sharing;
use crate::plugin::strategy::build_resources;
use crate::status::{StageId, StageState};

/// The health policy the config describes.
pub fn health_policy(config: &Config) -> HealthPolicy {
    let h = &config.health;
    HealthPolicy {
        enabled: h.enabled,
        ignored_xids: h.ignored_xids.iter().map(|x| u64::from(*x)).collect(),
        critical_xids: h.critical_xids.iter().map(|x| u64::from(*x)).collect(),
        recovery_after: (!h.recovery_after.is_zero()).then_some(h.recovery_after),
    }
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
