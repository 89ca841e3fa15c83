//! `cargo bench --bench spine`: the device plugin's performance budget, measured end to end with
//! the real binary, the fake NVML library and the test kubelet, printed as a table.
//!
//! | what | budget |
//! | start → device plugin registered | ≤ 200 ms |
//! | Allocate latency / empty gRPC call on the same socket | ≤ 1.5× |
//! | Xid → ListAndWatch update | ≤ 50 ms |
//! | start → registered, containerd on the node, nothing to change | ≤ 200 ms |
//! | idle RSS | ≤ 12 MiB |
//! | idle CPU (8 GPUs registered, 10 s) | reference |
//!
//! `GNA_SPINE_BASELINE=<gpu-node-agent binary of an older build>` adds the start rows for that
//! binary, measured in the same rounds (alternated), for a before/after comparison.

#[path = "../tests/common/mod.rs"]
mod common;
mod table;

use std::path::{Path, PathBuf};
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

/// User + system CPU time of `pid`, in seconds.
fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100);
    Some(ticks as f64 / hz.max(1) as f64)
}

/// A node whose containerd is installed (the host's binary, linked into the root, so the
/// runtime stage asks it for its version and effective configuration as on a real node) and
/// configured for the agent already: a first start writes what the mode needs.
fn containerd_node(containerd: &Path) -> Node {
    let node = Node::new(&machine("A100-SXM4-40GB", 8), "[log]\nlevel = \"warn\"\n");
    let root = node.root.clone();
    for dir in ["etc/containerd", "lib/systemd/system", "usr/bin"] {
        std::fs::create_dir_all(root.join(dir)).expect("mkdir");
    }
    std::fs::write(
        root.join("lib/systemd/system/containerd.service"),
        "[Unit]\nDescription=containerd\n",
    )
    .expect("unit");
    std::fs::write(
        root.join("etc/containerd/config.toml"),
        "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n",
    )
    .expect("config");
    std::os::unix::fs::symlink(containerd, root.join("usr/bin/containerd")).expect("link containerd");
    // The toolkit's runtime (a stand-in: only its presence counts), so the runtime stage works
    // with any containerd the host has (1.6 has no CDI).
    let runtime = root.join("usr/bin/nvidia-container-runtime");
    std::fs::write(&runtime, "#!/bin/sh\n").expect("runtime");
    std::fs::set_permissions(&runtime, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    node
}

/// Starts `program` (this build's agent when `None`) on `node` with a kubelet present, and
/// answers how long it took to register, in ms.
async fn time_to_registered(node: &Node, program: Option<&Path>) -> f64 {
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let spawned = Instant::now();
    let agent = match program {
        Some(program) => node.spawn_program(program),
        None => node.spawn(),
    };
    let reg = kubelet.wait_for_registration(GPU, T).await.expect("registered");
    let ms = reg.at.duration_since(spawned).as_secs_f64() * 1000.0;
    agent.stop();
    ms
}

/// Idle RSS (MiB) 3 s after registration, and CPU seconds over the next 10 s, of `program`
/// (this build's agent when `None`) on a fresh 8×A100 node with a kubelet.
async fn idle(program: Option<&Path>) -> (f64, f64) {
    let node = Node::new(&machine("A100-SXM4-40GB", 8), "[log]\nlevel = \"warn\"\n");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = match program {
        Some(program) => node.spawn_program(program),
        None => node.spawn(),
    };
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("devices");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = agent.pid();
    let rss = rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
    let before = cpu_seconds(pid).unwrap_or(0.0);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let cpu = cpu_seconds(pid).unwrap_or(0.0) - before;
    agent.stop();
    (rss, cpu)
}

fn p50_max_row(what: &'static str, values: Vec<f64>, budget: Option<f64>) -> Row {
    let values = sorted(values);
    let max = values[values.len() - 1];
    Row {
        what,
        value: format!("{:.1} / {max:.1}", percentile(&values, 0.5)),
        budget: if budget.is_some() { "≤ 200 ms" } else { "reference" },
        ok: budget.is_none_or(|b| max <= b),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();

    let baseline = std::env::var_os("GNA_SPINE_BASELINE").map(PathBuf::from);

    // 1. Start to registered, 8×A100 (fresh process each time, kubelet already up); the
    // baseline's starts alternate with this build's.
    let (mut starts, mut before) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let node = Node::new(&machine("A100-SXM4-40GB", 8), "[log]\nlevel = \"warn\"\n");
        starts.push(time_to_registered(&node, None).await);
        if let Some(baseline) = &baseline {
            let node = Node::new(&machine("A100-SXM4-40GB", 8), "[log]\nlevel = \"warn\"\n");
            before.push(time_to_registered(&node, Some(baseline)).await);
        }
    }
    rows.push(p50_max_row(
        "start → registered (8×A100), ms p50 / max",
        starts,
        Some(200.0),
    ));
    if !before.is_empty() {
        rows.push(p50_max_row("  baseline build, same rounds", before, None));
    }

    // 1b. The same on a node with containerd installed and already configured (a restart of the
    // agent, nothing to change): the runtime stage asks containerd for its version and
    // effective configuration (two runs of the containerd binary) unless it knows the answer.
    let containerd = Path::new("/usr/bin/containerd");
    if containerd.is_file() {
        let (mut starts, mut before) = (Vec::new(), Vec::new());
        for _ in 0..10 {
            // The first start configures containerd, the second finds it configured (and asks
            // containerd about the files as they are now), the third is the measured restart.
            let node = containerd_node(containerd);
            time_to_registered(&node, None).await;
            time_to_registered(&node, None).await;
            starts.push(time_to_registered(&node, None).await);
            if let Some(baseline) = &baseline {
                let node = containerd_node(containerd);
                time_to_registered(&node, Some(baseline)).await;
                time_to_registered(&node, Some(baseline)).await;
                before.push(time_to_registered(&node, Some(baseline)).await);
            }
        }
        rows.push(p50_max_row(
            "restart → registered, containerd configured, ms p50 / max",
            starts,
            Some(200.0),
        ));
        if !before.is_empty() {
            rows.push(p50_max_row("  baseline build, same rounds", before, None));
        }
    } else {
        println!("(no /usr/bin/containerd: the containerd row is left out)");
    }

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

    agent.stop();

    // 4, 5. Idle RSS and CPU once settled (health polling, resync, metrics sampling), on a fresh
    // agent of this build and of the baseline.
    let mut programs: Vec<(&'static str, Option<PathBuf>)> = vec![("", None)];
    if let Some(baseline) = &baseline {
        programs.push(("  baseline build, ", Some(baseline.clone())));
    }
    for (prefix, program) in programs {
        let (rss, cpu) = idle(program.as_deref()).await;
        rows.push(Row {
            what: if prefix.is_empty() {
                "idle RSS (8 GPUs registered), MiB"
            } else {
                "  baseline build, idle RSS, MiB"
            },
            value: format!("{rss:.1}"),
            budget: if prefix.is_empty() { "≤ 12 MiB" } else { "reference" },
            ok: !prefix.is_empty() || rss <= 12.0,
        });
        rows.push(Row {
            what: if prefix.is_empty() {
                "idle CPU over 10 s (8 GPUs registered), s"
            } else {
                "  baseline build, idle CPU over 10 s, s"
            },
            value: format!("{cpu:.2}"),
            budget: "reference",
            ok: true,
        });
    }

    table::print(&rows, 60);
}
