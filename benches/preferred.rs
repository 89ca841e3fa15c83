//! `cargo bench --bench preferred`: GetPreferredAllocation's policy time for whole GPUs
//! (go-gpuallocator's best-effort partition search) on 8 and 16 GPUs, every size, and for
//! time-sliced replicas, printed as a table (median and worst of repeated calls).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpu_node_agent::config::SharedPolicy;
use gpu_node_agent::devices::{Health, PluginDevice, Resource};
use gpu_node_agent::devices::{Topology, TopologyLevel, link_score};
use gpu_node_agent::plugin::preferred::preferred_allocation;

fn uuid(i: usize) -> String {
    format!("GPU-{i:08}-0000-0000-0000-000000000000")
}

fn gpu(i: usize) -> PluginDevice {
    PluginDevice {
        uuid: uuid(i),
        index: i.to_string(),
        minor: i as u32,
        numa_node: Some((i / 4) as i64),
        mig: None,
        health: Health::Healthy,
    }
}

/// `n` GPUs in DGX-1-like halves of 8: NVLink (1 or 2 links) inside a quad and to the GPU
/// opposite, PCIe switch pairs, host bridge quads, SYSTEM between halves of 4.
fn topology(n: usize) -> Topology {
    let mut t = Topology::new();
    for a in 0..n {
        for b in a + 1..n {
            let level = if a / 4 != b / 4 {
                TopologyLevel::System
            } else if a / 2 == b / 2 {
                TopologyLevel::Single
            } else {
                TopologyLevel::HostBridge
            };
            let links = if a / 4 == b / 4 {
                1 + u32::from((a + b) % 3 == 0)
            } else if b == a + 4 && a / 8 == b / 8 {
                2
            } else {
                0
            };
            t.set(&uuid(a), &uuid(b), link_score(links, Some(level)));
        }
    }
    t
}

fn time(mut f: impl FnMut()) -> (Duration, Duration) {
    let mut runs = Vec::new();
    let start = Instant::now();
    while runs.len() < 5 || (start.elapsed() < Duration::from_millis(300) && runs.len() < 200) {
        let t = Instant::now();
        f();
        runs.push(t.elapsed());
    }
    runs.sort();
    (runs[runs.len() / 2], runs[runs.len() - 1])
}

fn main() {
    println!("{:<34} {:>12} {:>12}", "case", "median", "worst");
    for n in [8usize, 16] {
        let res = Resource {
            name: "nvidia.com/gpu".into(),
            devices: (0..n).map(|i| (uuid(i), gpu(i))).collect(),
        };
        let topo = topology(n);
        let avail: Vec<String> = (0..n).map(uuid).collect();
        for size in 1..=n {
            let (median, worst) = time(|| {
                let got = preferred_allocation(&res, &avail, &[], size, &topo, SharedPolicy::Distributed);
                assert_eq!(got.map(|g| g.len()).ok(), Some(size));
            });
            println!(
                "{:<34} {:>12.3?} {:>12.3?}",
                format!("{n} GPUs, size {size}"),
                median,
                worst
            );
        }
        let must = [uuid(n - 1)];
        let (median, worst) = time(|| {
            let got = preferred_allocation(&res, &avail, &must, 3, &topo, SharedPolicy::Distributed);
            assert!(got.is_ok());
        });
        println!(
            "{:<34} {:>12.3?} {:>12.3?}",
            format!("{n} GPUs, size 3, 1 must-include"),
            median,
            worst
        );
    }
    let mut devices = BTreeMap::new();
    for g in 0..16 {
        for r in 0..16 {
            devices.insert(format!("{}::{r}", uuid(g)), gpu(g));
        }
    }
    let res = Resource {
        name: "nvidia.com/gpu".into(),
        devices,
    };
    let avail: Vec<String> = res.devices.keys().skip(3).cloned().collect();
    for policy in [SharedPolicy::Distributed, SharedPolicy::Packed, SharedPolicy::Spread] {
        let (median, worst) = time(|| {
            let got = preferred_allocation(&res, &avail, &[], 8, &Topology::new(), policy);
            assert!(got.is_ok());
        });
        println!(
            "{:<34} {:>12.3?} {:>12.3?}",
            format!("16x16 replicas, size 8, {policy}"),
            median,
            worst
        );
    }
}
