//! `cargo bench --bench spine`: the device plugin's performance budget, measured end to end with
//! the real binary, the fake NVML library and the test kubelet, printed as a table.
//!
//! | what | budget |
//! | start → device plugin registered | ≤ 200 ms |
//! | Allocate latency / empty gRPC call on the same socket | ≤ 1.5× |
//! | Xid → ListAndWatch update | ≤ 50 ms |
//! | idle RSS | ≤ 12 MiB |

#[path = "../tests/common/mod.rs"]
mod common;
mod table;

use std::time::{Duration, Instant};

use common::{Node, gpu_uuid, healthy, machine};
use table::{Row, percentile, sorted};
use test_kubelet::{KubeletOptions, TestKubelet};

const GPU: &str = "nvidia.com/gpu";
const T: Duration = Duration::from_secs(10);

fn rss_kib(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();

    // 1. Start to registered, 8×A100 (fresh process each time, kubelet already up).
    let mut starts = Vec::new();
    for _ in 0..10 {
        let node = Node::new(&machine("A100-SXM4-40GB", 8), "[log]\nlevel = \"warn\"\n");
        let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
            .await
            .expect("kubelet");
        let spawned = Instant::now();
        let agent = node.spawn();
        let reg = kubelet.wait_for_registration(GPU, T).await.expect("registered");
        starts.push(reg.at.duration_since(spawned).as_secs_f64() * 1000.0);
        agent.stop();
    }
    let starts = sorted(starts);
    let p50 = percentile(&starts, 0.5);
    rows.push(Row {
        what: "start → registered (8×A100), ms p50 / max",
        value: format!("{p50:.1} / {:.1}", starts[starts.len() - 1]),
        budget: "≤ 200 ms",
        ok: starts[starts.len() - 1] <= 200.0,
    });

    // 2..4 on one long-lived agent.
    let node = Node::new(
        &machine("A100-SXM4-40GB", 8),
        "[log]\nlevel = \"warn\"\n[health]\nrecovery_after = \"0s\"\n",
    );
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("devices");

    // 2. Allocate vs an empty call (GetDevicePluginOptions) over the same Unix socket connection.
    let id = gpu_uuid(0);
    const N: usize = 2000;
    for _ in 0..200 {
        kubelet.allocate(GPU, &[&id]).await.expect("warm-up allocate");
        kubelet.fetch_options(GPU).await.expect("warm-up options");
    }
    let mut empty = Vec::with_capacity(N);
    let mut alloc = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        kubelet.fetch_options(GPU).await.expect("options");
        empty.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        kubelet.allocate(GPU, &[&id]).await.expect("allocate");
        alloc.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (empty, alloc) = (sorted(empty), sorted(alloc));
    let (e50, a50) = (percentile(&empty, 0.5), percentile(&alloc, 0.5));
    rows.push(Row {
        what: "empty gRPC call (GetDevicePluginOptions), µs p50 / p99",
        value: format!("{e50:.0} / {:.0}", percentile(&empty, 0.99)),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "Allocate (1 GPU, envvar), µs p50 / p99",
        value: format!("{a50:.0} / {:.0}", percentile(&alloc, 0.99)),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "Allocate / empty call, p50 ratio",
        value: format!("{:.2}×", a50 / e50),
        budget: "≤ 1.5×",
        ok: a50 / e50 <= 1.5,
    });

    // 3. Xid → ListAndWatch update: one critical Xid per GPU, timed to the kubelet's receipt.
    let mut xids = Vec::new();
    for i in 0..8 {
        let uuid = gpu_uuid(i);
        let before = kubelet.updates(GPU).len();
        let t = Instant::now();
        node.inject("xid", &format!("{uuid} 79"));
        kubelet
            .wait_for_devices(GPU, T, |d| healthy(d, &uuid) == Some(false))
            .await
            .expect("unhealthy");
        let at = kubelet.updates(GPU)[before..]
            .iter()
            .find(|(_, d)| healthy(d, &uuid) == Some(false))
            .map(|(at, _)| *at)
            .expect("update");
        xids.push(at.duration_since(t).as_secs_f64() * 1000.0);
    }
    let xids = sorted(xids);
    rows.push(Row {
        what: "Xid → ListAndWatch update, ms p50 / max",
        value: format!("{:.1} / {:.1}", percentile(&xids, 0.5), xids[xids.len() - 1]),
        budget: "≤ 50 ms",
        ok: xids[xids.len() - 1] <= 50.0,
    });

    // 4. Idle RSS after things settle.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss = rss_kib(agent.pid()).unwrap_or(0);
    let mib = rss as f64 / 1024.0;
    rows.push(Row {
        what: "idle RSS (8 GPUs registered), MiB",
        value: format!("{mib:.1}"),
        budget: "≤ 12 MiB",
        ok: mib <= 12.0,
    });
    agent.stop();

    table::print(&rows, 56);
}
