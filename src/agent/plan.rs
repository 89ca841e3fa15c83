//! `gpu-node-agent plan`: what `run` would do on this node now, built from the same inputs the
//! daemon uses (the config, the desired-state labels from the Node, the labels file or the ones
//! last seen, and the observed host) with the same functions, and nothing applied.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use super::device_plugin::advertised_resources;
use super::error::AgentError;
use super::nvml::nvml_library;
use super::report::{NodeLabels, machine_name, node_labels};
use super::setup::first_view;
use crate::cluster;
use crate::config::{Config, DevicePluginConfig};
use crate::desired::{Desired, ProfileOutcome, Selection, choose_profile};
use crate::devices::Resource;
use crate::driver::plan::DriverPlan;
use crate::driver::stage as drv;
use crate::edits::DeviceNodes;
use crate::host::HostRoot;
use crate::host::command::Runner;
use crate::mig::clients;
use crate::mig::stage::{MigState, changes_mode, plan_layout, predict_inventory, reads_first};
use crate::mig::state::GpuPlan;
use crate::nvml::{Gpus, Inventory};
use crate::plugin::mps::MpsDaemon;
use crate::runtime::node_spec;
use crate::runtime::stage::{self as rt, RuntimePlan};

/// Every stage's plan for this node.
#[derive(Debug, Clone)]
pub struct NodePlan {
    pub desired: DesiredPlan,
    /// `None` with `[driver] enabled = false`; `Err`: why the stage would fail.
    pub driver: Option<Result<DriverPlan, String>>,
    /// `None` with `[runtime] enabled = false`; `Err`: why the stage would fail.
    pub runtime: Option<Result<RuntimePlan, String>>,
    /// The GPUs as NVML reports them now.
    pub inventory: Inventory,
    /// `None` when no layout is asked for (or `[mig] enabled = false`).
    pub mig: Option<MigPlan>,
    /// `None` with `[cdi] enabled = false`.
    pub cdi: Option<CdiPlan>,
    /// The `/dev/char` links of the NVIDIA device nodes there now and of those the agent would
    /// create for the current GPUs and MIG devices (a MIG change's new devices get theirs once
    /// they exist); `None` with `[driver] create_dev_char_links = false`.
    pub dev_char: Option<crate::host::devchar::Plan>,
    /// The effective `[device_plugin]` settings (the selected profile applied).
    pub device_plugin: DevicePluginConfig,
    /// What the device plugin would advertise once the MIG plan is applied.
    pub resources: Vec<Resource>,
    /// The MPS control daemons the agent would run (`strategy = "mps"`); `Err`: why none can.
    pub mps: Result<Vec<MpsDaemon>, String>,
    /// The labels the agent would write on its Node (the validation state is left out: it
    /// comes from checks `plan` does not run).
    pub labels: BTreeMap<String, String>,
}

/// The desired state `plan` read.
#[derive(Debug, Clone)]
pub struct DesiredPlan {
    /// Where it came from, for a person.
    pub source: String,
    pub labels: BTreeMap<String, String>,
    pub profile: ProfileOutcome,
}

/// The MIG stage's plan.
#[derive(Debug, Clone)]
pub struct MigPlan {
    pub layout: String,
    /// The GPUs that change, with their NVML operations in order.
    pub gpus: Vec<GpuPlan>,
    /// NVML operations in all.
    pub operations: usize,
    /// Why the layout would fail, or why its plan is not complete yet: what applying reads from
    /// NVML first, one line per GPU (compute instance profiles NVML lists only inside a GPU
    /// instance; GPU instance profiles a driver lists only while MIG mode is on), and how.
    pub error: Option<String>,
    /// Whether `error` is the not-complete-yet case (applying would go on), not a failure.
    pub incomplete: bool,
    /// The host's GPU clients (systemd units, `[mig] host_gpu_clients`, the kubelet for a mode
    /// change with `stop_kubelet_on_mode_change`) active now that applying would stop first, in
    /// order, and start again after, the other way round.
    pub stop_units: Vec<String>,
}

/// The CDI spec's plan.
#[derive(Debug, Clone)]
pub struct CdiPlan {
    /// The spec's host path.
    pub path: PathBuf,
    /// Whether `run` would write it (absent, different, or the MIG devices change).
    pub write: bool,
    /// Why it could not be made.
    pub error: Option<String>,
}

/// The node's plan. `mig_layout` overrides the layout the labels ask for (`plan --mig-layout`).
pub async fn node_plan(config: &Config, root: &HostRoot, mig_layout: Option<&str>) -> Result<NodePlan, AgentError> {
    let link = cluster::start(config, root, None);
    let (view, _) = first_view(config, root, &link, &CancellationToken::new()).await;
    let selected = Desired::from_labels(&view.labels, &config.labels);
    let (dp, profile) = choose_profile(
        &config.device_plugin,
        &selected.device_plugin_config,
        None,
        &config.labels.device_plugin_config,
    );
    let desired = DesiredPlan {
        source: view.detail.clone(),
        labels: view.labels.clone(),
        profile: profile.clone(),
    };
    let gpus = Gpus::open(&nvml_library(config, root));
    let processes = gpus.as_ref().ok().and_then(|g| gpu_processes(g, root));
    let driver = config.driver.enabled.then(|| {
        drv::plan_now(config, root, processes)
            .map(|p| p.plan)
            .map_err(|e| e.to_string())
    });
    let runtime = config.runtime.enabled.then(|| {
        let runner = Runner::new(root);
        rt::observe(config, root, &runner)
            .and_then(|o| rt::plan(&o, &config.runtime))
            .map_err(|e| e.to_string())
    });
    let gpus = gpus?;
    let inventory = gpus.inventory(&root.join("/sys"))?;
    let mig = mig_plan(config, root, &gpus, &selected.mig_config, mig_layout);
    let after = match &mig {
        Some((plan, observed)) if plan.error.is_none() => predict_inventory(&inventory, observed, &plan.gpus),
        _ => inventory.clone(),
    };
    let mig = mig.map(|(plan, _)| plan);
    let mig_changes = mig.as_ref().is_some_and(|m| m.operations > 0 && m.error.is_none());
    let cdi = config.cdi.enabled.then(|| {
        let nodes = DeviceNodes::gather(&root.join(&config.device_plugin.dev_root), &root.join("/proc"));
        let path = node_spec::cdi_path(config);
        // The injection specs (GDS, MOFED, GDRCopy, IMEX) are written in the same pass: a
        // change there is a write, a missing required IMEX channel the plan's error.
        let specs = node_spec::cdi_spec(config, root, &inventory, &nodes)
            .and_then(|text| Ok((text, node_spec::extra_cdi_specs(config, root, &nodes)?)));
        match specs {
            Ok((text, extra)) => CdiPlan {
                write: mig_changes
                    || std::fs::read_to_string(root.join(&path)).ok().as_deref() != Some(text.as_str())
                    || extra
                        .iter()
                        .any(|(p, t)| std::fs::read_to_string(root.join(p)).ok() != *t),
                path,
                error: None,
            },
            Err(e) => CdiPlan {
                path,
                write: false,
                error: Some(e.to_string()),
            },
        }
    });
    let dev_char = config
        .driver
        .create_dev_char_links
        .then(|| super::devnodes::dev_char_plan(config, root, Some(&inventory)));
    let resources = advertised_resources(&after, &dp)?;
    let mps = crate::plugin::mps::plan(&after, &dp.sharing, dp.mig_strategy).map_err(|e| e.to_string());
    let mig_state = mig.as_ref().map(|m| match &m.error {
        Some(_) if !m.incomplete => MigState::Failed,
        _ => MigState::Success,
    });
    let labels = node_labels(&NodeLabels {
        config,
        inventory: &after,
        dp: &dp,
        machine: machine_name(root).as_deref(),
        vgpu: crate::labels::vgpu::vgpu_present(root),
        profile: &profile,
        mig_state,
        validation: None,
    });
    Ok(NodePlan {
        desired,
        driver,
        runtime,
        inventory,
        mig,
        cdi,
        dev_char,
        device_plugin: dp,
        resources,
        mps,
        labels,
    })
}

/// Processes on the GPUs, when NVML loads and can tell.
pub(crate) fn gpu_processes_now(config: &Config, root: &HostRoot) -> Option<usize> {
    gpu_processes(&Gpus::open(&nvml_library(config, root)).ok()?, root)
}

/// Processes on the GPUs, when NVML can tell.
fn gpu_processes(gpus: &Gpus, root: &HostRoot) -> Option<usize> {
    let inventory = gpus.inventory(&root.join("/sys")).ok()?;
    inventory.gpus.iter().map(|g| gpus.process_count(&g.uuid)).sum()
}

/// The MIG stage's plan for the layout the labels (or `--mig-layout`) ask for, as the MIG stage
/// chooses it, with what was observed; `None` when no layout is asked for.
fn mig_plan(
    config: &Config,
    root: &HostRoot,
    gpus: &Gpus,
    selection: &Selection,
    chosen: Option<&str>,
) -> Option<(MigPlan, Vec<crate::mig::state::ObservedGpu>)> {
    let key = &config.labels.mig_config;
    let failed = |layout: String, error: String| {
        let plan = MigPlan {
            layout,
            gpus: Vec::new(),
            operations: 0,
            error: Some(error),
            incomplete: false,
            stop_units: Vec::new(),
        };
        Some((plan, Vec::new()))
    };
    let name = match (chosen, selection) {
        (Some(name), _) => name.to_string(),
        _ if !config.mig.enabled => return None,
        (None, Selection::Unset)
            if !config.mig.default_layout.is_empty()
                && config.mig.layout(&config.mig.default_layout).is_some()
                && gpus.mig_observe().is_ok_and(|o| o.iter().any(|g| g.mode.is_some())) =>
        {
            config.mig.default_layout.clone()
        }
        (None, Selection::Unset) => return None,
        (None, Selection::Invalid { value, reason }) => {
            return failed(value.clone(), format!("label {key}={value:?} is not valid: {reason}"));
        }
        (None, Selection::Name { name }) => name.clone(),
    };
    let Some(layout) = config.mig.layout(&name) else {
        let defined = config.mig.layout_names().join(", ");
        return failed(
            name.clone(),
            format!("no MIG layout named {name:?}; defined: {defined}"),
        );
    };
    let observed = match gpus.mig_observe() {
        Ok(o) => o,
        Err(e) => return failed(name, e.to_string()),
    };
    // The host GPU clients the change would stop: only when something changes.
    let stop_units = |changes: bool| {
        if !changes {
            return Vec::new();
        }
        let mode_change = changes_mode(&observed, &layout).unwrap_or(false);
        let units = clients::candidates(&config.mig, mode_change);
        clients::plan_clients(&units, &clients::observe_active(config, root, &units))
    };
    let plan = match plan_layout(&observed, &layout) {
        Ok(plans) => {
            let gpus: Vec<GpuPlan> = plans.into_iter().filter(|p| !p.ops.is_empty()).collect();
            MigPlan {
                operations: gpus.iter().map(|p| p.ops.len()).sum(),
                stop_units: stop_units(!gpus.is_empty()),
                layout: name,
                gpus,
                error: None,
                incomplete: false,
            }
        }
        Err(e) => {
            let incomplete = e.read_first().is_some();
            // Every read applying makes first, on every GPU, and how (MIG mode enabled, GPU
            // instances destroyed to make room).
            let error = match reads_first(&observed, &layout) {
                Ok(lines) if incomplete && !lines.is_empty() => lines.join("\n  "),
                _ => e.to_string(),
            };
            MigPlan {
                incomplete,
                stop_units: stop_units(incomplete),
                layout: name,
                gpus: Vec::new(),
                operations: 0,
                error: Some(error),
            }
        }
    };
    Some((plan, observed))
}
