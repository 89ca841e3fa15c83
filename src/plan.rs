//! `gpu-node-agent plan`: what the agent would do, printed for a person or as JSON.

use std::fmt::Write as _;

use serde::Serialize;

use crate::agent::DevicePluginPlan;
use crate::config::Config;
use crate::nvml::Inventory;

#[derive(Serialize)]
struct PlanJson<'a> {
    inventory: &'a Inventory,
    resources: Vec<ResourceJson<'a>>,
}

#[derive(Serialize)]
struct ResourceJson<'a> {
    name: &'a str,
    socket: String,
    devices: Vec<DeviceJson<'a>>,
}

#[derive(Serialize)]
struct DeviceJson<'a> {
    id: &'a str,
    index: &'a str,
    numa_node: Option<i64>,
}

pub fn to_json(plan: &DevicePluginPlan) -> String {
    let resources = plan
        .resources
        .iter()
        .map(|r| ResourceJson {
            name: &r.name,
            socket: r.socket_name(),
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
    serde_json::to_string_pretty(&PlanJson {
        inventory: &plan.inventory,
        resources,
    })
    .unwrap_or_default()
}

pub fn render(plan: &DevicePluginPlan, config: &Config) -> String {
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
        config.device_plugin.mig_strategy.as_str(),
        config
            .device_plugin
            .device_list_strategy
            .as_slice()
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
    if plan.resources.is_empty() {
        let _ = writeln!(out, "  nothing");
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
    out
}

/// Sorts `"2"` before `"10"` and `"1:0"` before `"1:1"`.
fn index_key(index: &str) -> Vec<u32> {
    index.split(':').map(|p| p.parse().unwrap_or(u32::MAX)).collect()
}
