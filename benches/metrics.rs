//! `cargo bench --bench metrics`: the cost of one readings interval and of one scrape on 8 GPUs
//! (fake-nvml's `dgx-a100.toml`, each GPU held by a pod through the test kubelet's
//! pod-resources API), and the same with every GPU split into 7 MIG devices; then the same
//! machine with H100s, whose GPM gives the profiling series (per GPU and per GPU instance).
//! Printed as a table of p50 and max, with the sampler's CPU time: per interval, and while it
//! runs with no interval due (idle).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_node_agent::metrics::{GpmSampler, Metrics, MetricsServer, Sampler, SamplerConfig, attribution, sample};
use gpu_node_agent::nvml::Gpus;
use test_kubelet::{KubeletOptions, PodContainer, TestKubelet};
use tokio::sync::watch;

const ROUNDS: usize = 200;

fn dgx_a100() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-nvml/machines/dgx-a100.toml");
    std::fs::read_to_string(path).expect("dgx-a100.toml")
}

/// dgx-a100.toml with every GPU in MIG mode, split into 7× 1g.5gb.
fn dgx_a100_mig() -> String {
    split(&dgx_a100(), "1g.5gb")
}

/// dgx-a100.toml with H100s (GPM: the profiling series).
fn hgx_h100() -> String {
    dgx_a100().replace("A100-SXM4-40GB", "H100-80GB-HBM3")
}

/// `machine` with every GPU in MIG mode, split into 7× `profile`.
fn split(machine: &str, profile: &str) -> String {
    let mut text = String::new();
    for line in machine.lines() {
        text.push_str(line);
        text.push('\n');
        if line.starts_with("nvlink_peers") {
            text.push_str("mig_mode = true\n");
            text.push_str(&format!("[[gpu.mig_device]]\nprofile = \"{profile}\"\n").repeat(7));
        }
    }
    text
}

/// CPU time this process has used (user + system).
fn cpu_time() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).expect("getrusage");
    let tv = |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
    tv(usage.user_time()) + tv(usage.system_time())
}

/// The sampler's CPU use on one machine.
struct Cpu {
    /// CPU time per readings interval (Sampler::tick, averaged over ROUNDS).
    per_interval: Duration,
    /// CPU time of a running sampler over IDLE with no interval due (after its first).
    idle: Duration,
}

/// How long the idle sampler runs.
const IDLE: Duration = Duration::from_secs(2);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs `f` ROUNDS times; (p50, max) in microseconds.
async fn time<F, Fut>(mut f: F) -> (f64, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut us = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        f().await;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    (percentile(&us, 0.5), percentile(&us, 1.0))
}

fn scrape(addr: SocketAddr) -> usize {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: application/openmetrics-text;version=1.0.0\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    assert!(raw.starts_with(b"HTTP/1.1 200"), "scrape failed");
    raw.len()
}

struct Row {
    what: &'static str,
    p50_us: f64,
    max_us: f64,
}

/// Loads the fake NVML with `machine` (a fresh state) and times every step on it.
async fn bench(name: &str, machine: &str, node: &common::Node, rows: &mut Vec<(String, Vec<Row>, Cpu)>) {
    std::fs::write(&node.machine, machine).expect("machine");
    let _ = std::fs::remove_dir_all(&node.state);
    // Each call opens NVML afresh (the previous call dropped its handles), so the fake reads
    // the machine file written above.
    let gpus = &Gpus::open(&common::fake_nvml_library()).expect("fake NVML");
    let inventory = Arc::new(gpus.inventory(&node.root.join("sys")).expect("inventory"));
    let instances: usize = inventory.gpus.iter().map(|g| g.mig_devices.len()).sum();

    // The kubelet: every GPU (or its first MIG device) held by a pod of its own.
    let root = node.root.join("var/lib/kubelet");
    let kubelet = TestKubelet::start(&root.join("device-plugins"), KubeletOptions::default())
        .await
        .expect("kubelet");
    let socket = kubelet.serve_pod_resources(&root).expect("pod-resources");
    for (i, gpu) in inventory.gpus.iter().enumerate() {
        let id = gpu.mig_devices.first().map_or(gpu.uuid.as_str(), |m| m.uuid.as_str());
        kubelet.assign(
            "nvidia.com/gpu",
            &[id],
            &PodContainer::new("bench", &format!("pod-{i}"), "main"),
        );
    }

    let metrics = Metrics::new();
    for i in 0..20 {
        metrics.allocation("nvidia.com/gpu");
        metrics.set_stage(&format!("stage-{}", i % 6), "ready", Some(Duration::from_millis(i)));
    }
    let (_tx, rx) = watch::channel(Some(inventory.clone()));
    let mut sampler = Sampler::new(
        gpus.clone(),
        metrics.clone(),
        rx,
        SamplerConfig {
            interval: Duration::from_secs(30),
            hostname: "gpu-node-1".into(),
            pod_resources_socket: Some(socket.clone()),
        },
    );
    assert!(sampler.tick().await);

    let mut table = Vec::new();
    let (p50_us, max_us) = time(|| {
        let (gpus, inventory) = (gpus.clone(), inventory.clone());
        async move {
            std::hint::black_box(sample(&gpus, &inventory));
        }
    })
    .await;
    table.push(Row {
        what: "NVML readings (sample)",
        p50_us,
        max_us,
    });
    let (p50_us, max_us) = time(|| {
        let socket = socket.clone();
        async move {
            let a = attribution(&socket).await.expect("attribution");
            assert!(!a.is_empty());
        }
    })
    .await;
    table.push(Row {
        what: "pod-resources List (attribution)",
        p50_us,
        max_us,
    });
    let readings = sample(gpus, &inventory);
    let pods = attribution(&socket).await.expect("attribution");
    let (p50_us, max_us) = time(|| {
        metrics.update(&readings, &pods, "gpu-node-1");
        async {}
    })
    .await;
    table.push(Row {
        what: "series update (update)",
        p50_us,
        max_us,
    });
    let mut gpm = GpmSampler::new();
    gpm.sample(gpus, &inventory);
    let mut gpm_devices = 0;
    let (p50_us, max_us) = time(|| {
        gpm_devices = gpm.sample(gpus, &inventory).len();
        async {}
    })
    .await;
    table.push(Row {
        what: "GPM samples + metrics (GpmSampler)",
        p50_us,
        max_us,
    });
    drop(gpm);
    let cpu_before = cpu_time();
    let mut sampler_rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        assert!(sampler.tick().await);
        sampler_rounds.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let per_interval = (cpu_time() - cpu_before) / ROUNDS as u32;
    sampler_rounds.sort_by(f64::total_cmp);
    table.push(Row {
        what: "one readings interval (Sampler::tick)",
        p50_us: percentile(&sampler_rounds, 0.5),
        max_us: percentile(&sampler_rounds, 1.0),
    });

    let mut size = 0;
    let (p50_us, max_us) = time(|| {
        size = metrics.encode().expect("encode").len();
        async {}
    })
    .await;
    table.push(Row {
        what: "scrape: encode",
        p50_us,
        max_us,
    });
    let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), metrics.clone(), "/metrics")
        .await
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let (p50_us, max_us) = time(|| async move {
        tokio::task::spawn_blocking(move || scrape(addr)).await.expect("scrape");
    })
    .await;
    table.push(Row {
        what: "scrape: GET /metrics over HTTP",
        p50_us,
        max_us,
    });
    let _ = stop.send(());
    let _ = serving.await;

    // Idle: a running sampler (default interval) after its first interval, nothing due.
    let (_tx, rx) = watch::channel(Some(inventory.clone()));
    let idle_sampler = Sampler::new(
        gpus.clone(),
        metrics.clone(),
        rx,
        SamplerConfig {
            interval: Duration::from_secs(30),
            hostname: "gpu-node-1".into(),
            pod_resources_socket: Some(socket.clone()),
        },
    );
    let running = tokio::spawn(idle_sampler.run(tokio::time::sleep(IDLE + Duration::from_millis(500))));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_before = cpu_time();
    let _ = running.await;
    let idle = cpu_time() - idle_before;

    kubelet.stop().await;
    rows.push((
        format!(
            "{name}: {} GPUs, {instances} MIG GPU instances, {gpm_devices} devices with GPM series, {size} bytes per scrape",
            inventory.gpus.len()
        ),
        table,
        Cpu { per_interval, idle },
    ));
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let node = common::Node::new(&dgx_a100(), "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: no other thread reads the environment yet.
    unsafe {
        std::env::set_var("FAKE_NVML_MACHINE", &node.machine);
        std::env::set_var("FAKE_NVML_STATE_DIR", &node.state);
    }
    let mut rows = Vec::new();
    bench("dgx-a100.toml", &dgx_a100(), &node, &mut rows).await;
    bench("dgx-a100.toml, 7x 1g.5gb each", &dgx_a100_mig(), &node, &mut rows).await;
    bench("dgx-a100.toml as H100s (GPM)", &hgx_h100(), &node, &mut rows).await;
    bench(
        "dgx-a100.toml as H100s (GPM), 7x 1g.10gb each",
        &split(&hgx_h100(), "1g.10gb"),
        &node,
        &mut rows,
    )
    .await;
    println!("metrics on the fake NVML, {ROUNDS} rounds each (µs)\n");
    for (title, table, cpu) in rows {
        println!("{title}");
        println!("  {:<40} {:>10} {:>10}", "step", "p50", "max");
        for r in table {
            println!("  {:<40} {:>10.1} {:>10.1}", r.what, r.p50_us, r.max_us);
        }
        let per = cpu.per_interval.as_secs_f64();
        println!(
            "  CPU per readings interval: {:.2} ms ({:.4} % of one core at the 10 s default interval)",
            per * 1e3,
            per / 10.0 * 100.0
        );
        println!(
            "  CPU while idle (no interval due) for {} s: {:.2} ms ({:.4} % of one core)",
            IDLE.as_secs(),
            cpu.idle.as_secs_f64() * 1e3,
            cpu.idle.as_secs_f64() / IDLE.as_secs_f64() * 100.0
        );
        println!();
    }
}
