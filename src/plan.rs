//! `gpu-node-agent plan`: the node's plan ([`NodePlan`]: what `run` would do), printed for a
//! person or as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::agent::plan::{MigPlan, NodePlan};
use crate::agent::summary;
use crate::driver::plan::DriverPlan;
use crate::host::devchar::Plan as DevCharPlan;
use crate::mig::planner;
use crate::mig::state::GpuPlan;
use crate::nvml::Inventory;
use crate::plugin::mps::MpsDaemon;
use crate::runtime::stage::{self as rt, RuntimePlan};

#[derive(Serialize)]
struct PlanJson<'a> {
    desired: DesiredJson<'a>,
    driver: Option<StageJson<&'a DriverPlan>>,
    runtime: Option<StageJson<RuntimeJson>>,
    inventory: &'a Inventory,
    mig: Option<MigJson<'a>>,
    cdi: Option<CdiJson<'a>>,
    /// The `/dev/char` links (`null` with `[driver] create_dev_char_links = false`).
    dev_char: Option<DevCharJson>,
    resources: Vec<ResourceJson<'a>>,
    /// The MPS control daemons, with the control commands each would get.
    mps: StageJson<Vec<MpsJson<'a>>>,
    labels: &'a BTreeMap<String, String>,
}

#[derive(Serialize)]
struct MpsJson<'a> {
    #[serde(flatten)]
    daemon: &'a MpsDaemon,
    commands: Vec<String>,
}

#[derive(Serialize)]
struct DesiredJson<'a> {
    source: &'a str,
    labels: &'a BTreeMap<String, String>,
    device_plugin_profile: Option<&'a str>,
    device_plugin_profile_error: Option<&'a str>,
}

/// A stage's plan, or why it would fail.
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum StageJson<T> {
    Plan(T),
    Error(String),
}

#[derive(Serialize)]
struct RuntimeJson {
    summary: String,
    changes: bool,
    /// The unified diff of every file it would write.
    diff: String,
    remarks: Vec<String>,
    /// Engines that would fail, with why.
    errors: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct MigJson<'a> {
    layout: &'a str,
    /// NVML operations in all.
    operations: usize,
    gpus: &'a [GpuPlan],
    error: Option<&'a str>,
    incomplete: bool,
    /// Host GPU clients (systemd units) stopped first, in order, and started again after.
    stop_units: &'a [String],
}

#[derive(Serialize)]
struct CdiJson<'a> {
    path: &'a std::path::Path,
    write: bool,
    error: Option<&'a str>,
}

#[derive(Serialize)]
struct DevCharJson {
    /// Links that `run` would make: `/dev/char/195:0 -> ../nvidia0`.
    create: Vec<String>,
    /// Dangling links to an NVIDIA path it would replace, with their old target.
    replace: Vec<String>,
    /// Links in place already.
    present: Vec<String>,
    /// What it would leave alone, and why.
    problems: Vec<String>,
}

impl DevCharJson {
    fn new(p: &DevCharPlan) -> DevCharJson {
        let shown = |links: &[crate::host::devchar::Link]| links.iter().map(ToString::to_string).collect();
        DevCharJson {
            create: shown(&p.create),
            replace: p.replace.iter().map(|(l, old)| format!("{l} (was {old})")).collect(),
            present: shown(&p.present),
            problems: p.problems.clone(),
        }
    }
}

#[derive(Serialize)]
struct ResourceJson<'a> {
    name: &'a str,
    socket: String,
    count: usize,
    devices: Vec<DeviceJson<'a>>,
}

#[derive(Serialize)]
struct DeviceJson<'a> {
    id: &'a str,
    index: &'a str,
    numa_node: Option<i64>,
}

fn stage_json<'a, T, U>(r: &'a Option<Result<T, String>>, f: impl FnOnce(&'a T) -> U) -> Option<StageJson<U>> {
    r.as_ref().map(|r| match r {
        Ok(p) => StageJson::Plan(f(p)),
        Err(e) => StageJson::Error(e.clone()),
    })
}

pub fn to_json(plan: &NodePlan) -> String {
    let resources = plan
        .resources
        .iter()
        .map(|r| ResourceJson {
            name: &r.name,
            socket: r.socket_name(),
            count: r.devices.len(),
            devices: r
                .devices
                .iter()
                .map(|(id, d)| DeviceJson {
                    id,
                    index: &d.index,
                    numa_node: d.numa_node,
                })
                .collect(),
        })
        .collect();
    let json = PlanJson {
        desired: DesiredJson {
            source: &plan.desired.source,
            labels: &plan.desired.labels,
            device_plugin_profile: plan.desired.profile.applied.as_deref(),
            device_plugin_profile_error: plan.desired.profile.reason.as_deref(),
        },
        driver: stage_json(&plan.driver, |p| p),
        runtime: stage_json(&plan.runtime, |p| RuntimeJson {
            summary: p.note.clone().unwrap_or_else(|| p.summary()),
            changes: !p.is_empty(),
            diff: if p.is_empty() { String::new() } else { rt::diff(p) },
            remarks: p.remarks(),
            errors: p
                .engines
                .iter()
                .filter_map(|e| e.error.as_ref().map(|err| (e.engine.as_str().to_string(), err.clone())))
                .collect(),
        }),
        inventory: &plan.inventory,
        mig: plan.mig.as_ref().map(|m| MigJson {
            layout: &m.layout,
            operations: m.operations,
            gpus: &m.gpus,
            error: m.error.as_deref(),
            incomplete: m.incomplete,
            stop_units: &m.stop_units,
        }),
        cdi: plan.cdi.as_ref().map(|c| CdiJson {
            path: &c.path,
            write: c.write,
            error: c.error.as_deref(),
        }),
        dev_char: plan.dev_char.as_ref().map(DevCharJson::new),
        resources,
        mps: match &plan.mps {
            Ok(daemons) => StageJson::Plan(
                daemons
                    .iter()
                    .map(|daemon| MpsJson {
                        daemon,
                        commands: daemon.control_commands(),
                    })
                    .collect(),
            ),
            Err(e) => StageJson::Error(e.clone()),
        },
        labels: &plan.labels,
    };
    serde_json::to_string_pretty(&json).unwrap_or_default()
}

/// The driver stage's plan, for a person.
fn render_driver(out: &mut String, driver: &Option<Result<DriverPlan, String>>) {
    match driver {
        None => {
            let _ = writeln!(out, "Driver: [driver] enabled = false\n");
        }
        Some(Ok(p)) => {
            let _ = writeln!(out, "Driver: {}\n", crate::driver::plan::describe(p));
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "Driver: the stage would fail: {e}\n");
        }
    }
}

/// The runtime stage's plan as a unified diff, for a person.
fn render_runtime(out: &mut String, runtime: &Option<Result<RuntimePlan, String>>) {
    let p = match runtime {
        None => {
            let _ = writeln!(out, "Container runtimes: [runtime] enabled = false\n");
            return;
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "Container runtimes: the stage would fail: {e}\n");
            return;
        }
        Some(Ok(p)) => p,
    };
    if p.is_empty() {
        let what = p
            .note
            .clone()
            .unwrap_or_else(|| format!("{} already configured", p.summary()));
        let _ = writeln!(out, "Container runtimes: {what}: no changes");
    } else {
        let _ = writeln!(out, "Container runtimes: would change\n{}", rt::diff(p));
    }
    for remark in p.remarks() {
        let _ = writeln!(out, "  {remark}");
    }
    for e in &p.engines {
        if let Some(error) = &e.error {
            let _ = writeln!(out, "  {} would fail: {error}", e.engine.as_str());
        }
    }
    let _ = writeln!(out);
}

/// The host GPU clients a MIG change stops first, for a person.
fn render_stop_units(out: &mut String, units: &[String]) {
    if !units.is_empty() {
        let _ = writeln!(
            out,
            "  first stop the host GPU clients {} (started again after the change, the other way round)",
            units.join(", ")
        );
    }
}

/// The MIG stage's plan, for a person.
fn render_mig(out: &mut String, mig: &MigPlan) {
    let name = &mig.layout;
    match &mig.error {
        None if mig.gpus.is_empty() => {
            let _ = writeln!(out, "MIG plan for layout {name}: in place, nothing to change\n");
        }
        None => {
            let _ = writeln!(out, "MIG plan for layout {name} ({} NVML operations):", mig.operations);
            render_stop_units(out, &mig.stop_units);
            for p in &mig.gpus {
                let _ = writeln!(out, "{}", planner::describe(p));
            }
            let _ = writeln!(out);
        }
        Some(e) if mig.incomplete => {
            let _ = writeln!(
                out,
                "MIG plan for layout {name}: not complete yet:\n  {e}\n  (applying reads those profiles from NVML \
                 first, only on idle GPUs, then plans and applies the whole layout; should the layout fail before \
                 it is applied, what was changed only to read them is undone)"
            );
            render_stop_units(out, &mig.stop_units);
            let _ = writeln!(out);
        }
        Some(e) => {
            let _ = writeln!(out, "MIG plan for layout {name}: would fail: {e}\n");
        }
    }
}

pub fn render(plan: &NodePlan) -> String {
    let mut out = String::new();
    let d = &plan.desired;
    let labels = if d.labels.is_empty() {
        "no labels".to_string()
    } else {
        d.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(out, "Desired state: {labels} ({})", d.source);
    let profile = match (&d.profile.applied, &d.profile.reason) {
        (_, Some(reason)) => format!("rejected: {reason}"),
        (Some(name), None) => name.clone(),
        (None, None) => "none (the [device_plugin] keys as configured)".into(),
    };
    let _ = writeln!(out, "Device plugin profile: {profile}\n");
    render_driver(&mut out, &plan.driver);
    render_runtime(&mut out, &plan.runtime);
    if let Some(mig) = &plan.mig {
        render_mig(&mut out, mig);
    }
    out.push_str(&render_inventory(plan));
    if let Some(cdi) = &plan.cdi {
        let what = match (&cdi.error, cdi.write) {
            (Some(e), _) => format!("cannot be made: {e}"),
            (None, true) => "would be written".into(),
            (None, false) => "unchanged".into(),
        };
        let _ = writeln!(out, "\nCDI spec {}: {what}", cdi.path.display());
    }
    render_dev_char(&mut out, plan.dev_char.as_ref());
    let _ = writeln!(out, "\nNode labels ({}):", summary_of_labels(&plan.labels));
    for (k, v) in &plan.labels {
        let _ = writeln!(out, "  {k}={v}");
    }
    out
}

/// The `/dev/char` links, for a person.
fn render_dev_char(out: &mut String, plan: Option<&DevCharPlan>) {
    let Some(p) = plan else {
        let _ = writeln!(out, "\n/dev/char links: [driver] create_dev_char_links = false");
        return;
    };
    let changes = p.create.len() + p.replace.len();
    let head = match (changes, p.present.len()) {
        (0, 0) if p.problems.is_empty() => "no NVIDIA device nodes".to_string(),
        (0, 0) => "none in place".to_string(),
        (0, n) => format!("all {n} in place"),
        (c, n) => format!("{c} would be made, {n} in place"),
    };
    let _ = writeln!(out, "\n/dev/char links (systemd's device rules): {head}");
    for link in &p.create {
        let _ = writeln!(out, "  create {link}");
    }
    for (link, old) in &p.replace {
        let _ = writeln!(out, "  replace {link} (dangling, was {old})");
    }
    for problem in &p.problems {
        let _ = writeln!(out, "  warning: {problem}");
    }
}

fn summary_of_labels(labels: &BTreeMap<String, String>) -> String {
    format!("{} label(s)", labels.len())
}

fn render_inventory(plan: &NodePlan) -> String {
    let config = &plan.device_plugin;
    let inv = &plan.inventory;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "NVIDIA driver {}, CUDA {}, {} GPU(s)\n",
        inv.driver_version,
        inv.cuda_driver_version,
        inv.gpus.len()
    );
    let _ = writeln!(
        out,
        "GPU  UUID                                      NAME                      MEMORY     PCI               NUMA  MIG"
    );
    for g in &inv.gpus {
        let mig = match g.mig {
            None => "n/a".to_string(),
            Some(m) if m.current == m.pending => (if m.current { "enabled" } else { "disabled" }).to_string(),
            Some(m) => format!(
                "{} (pending {})",
                if m.current { "enabled" } else { "disabled" },
                if m.pending { "enabled" } else { "disabled" }
            ),
        };
        let numa = g.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<4} {:<41} {:<25} {:>6} MiB {:<17} {:<5} {}",
            g.index, g.uuid, g.name, g.memory_mib, g.pci_bus_id, numa, mig
        );
        for m in &g.mig_devices {
            let _ = writeln!(
                out,
                "  └ {:<40} {:<12} gi {} ci {} ({} MiB)",
                m.uuid, m.profile, m.gi_id, m.ci_id, m.memory_mib
            );
        }
    }
    let _ = writeln!(
        out,
        "\nWould advertise (mig_strategy = {}, device_list_strategy = {}):",
        config.mig_strategy.as_str(),
        config
            .device_list_strategy
            .as_slice()
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
    if plan.resources.is_empty() {
        let _ = writeln!(out, "  nothing");
    } else if plan.mig.as_ref().is_some_and(|m| m.operations > 0 && m.error.is_none()) {
        let _ = writeln!(
            out,
            "  ({}, once the MIG plan is applied: NVML names the new MIG devices)",
            summary(&plan.resources)
        );
    }
    for r in &plan.resources {
        let _ = writeln!(
            out,
            "  {} ({} device(s), socket {})",
            r.name,
            r.devices.len(),
            r.socket_name()
        );
        let mut devices: Vec<_> = r.devices.iter().collect();
        devices.sort_by_key(|(_, d)| index_key(&d.index));
        for (id, d) in devices {
            let _ = writeln!(out, "    {id}  index {}", d.index);
        }
    }
    render_mps(&mut out, &plan.mps);
    out
}

/// The MPS control daemons, for a person.
fn render_mps(out: &mut String, mps: &Result<Vec<MpsDaemon>, String>) {
    let daemons = match mps {
        Ok(d) if d.is_empty() => return,
        Ok(d) => d,
        Err(e) => {
            let _ = writeln!(out, "\nMPS: {e}");
            return;
        }
    };
    let _ = writeln!(
        out,
        "\nMPS control daemons (nvidia-cuda-mps-control -f, compute mode EXCLUSIVE_PROCESS):"
    );
    for d in daemons {
        let gpus: Vec<String> = d.gpus.iter().map(|g| format!("{} ({})", g.index, g.uuid)).collect();
        let _ = writeln!(out, "  {}: GPU(s) {}", d.resource, gpus.join(", "));
        let _ = writeln!(out, "    pipe {}, log {}", d.pipe_dir.display(), d.log_dir.display());
        for command in d.control_commands() {
            let _ = writeln!(out, "    {command}");
        }
    }
}

/// Sorts `"2"` before `"10"` and `"1:0"` before `"1:1"`.
fn index_key(index: &str) -> Vec<u32> {
    index.split(':').map(|p| p.parse().unwrap_or(u32::MAX)).collect()
}
