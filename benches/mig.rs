//! `cargo bench --bench mig`: MIG planning time and label → success latency for 8 GPUs on the
//! fake NVML, printed as a table.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{Node, gpu_uuid};
use gpu_node_agent::config::Config;
use gpu_node_agent::mig::stage::plan_layout;
use gpu_node_agent::nvml::Gpus;
use test_apiserver::{KubeconfigAuth, KubeconfigOptions, TestApiServer};

const NODE: &str = "gpu-node-1";
const TOKEN: &str = "bench-token-0123456789";
const T: Duration = Duration::from_secs(30);

fn eight_a100s() -> String {
    let mut m = common::DGX_A100.to_string();
    for i in 0..8 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            gpu_uuid(i)
        ));
    }
    m
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let api = TestApiServer::start().await;
    api.create_node(NODE, &[]);
    api.add_token(TOKEN, "system:node:gpu-node-1");
    let node = Node::new(
        &eight_a100s(),
        "[log]\nlevel = \"warn\"\n[device_plugin]\nmig_strategy = \"mixed\"\n",
    );
    let options = KubeconfigOptions {
        file_name: "kubelet.conf".into(),
        ..KubeconfigOptions::default()
    };
    api.write_kubeconfig_with(&node.kubeconfig_dir(), KubeconfigAuth::Token(TOKEN.into()), &options);
    let agent = node.spawn();
    assert!(
        api.wait_for(T, |a| a.labels(NODE).contains_key("nvidia.com/gpu.present"))
            .await
    );

    // Label → success: alternate two layouts on all 8 GPUs.
    let mut latencies = Vec::new();
    for (round, layout) in [
        "all-1g.5gb",
        "all-balanced",
        "all-3g.20gb",
        "all-1g.5gb",
        "all-balanced",
        "all-7g.40gb",
    ]
    .iter()
    .enumerate()
    {
        let t = Instant::now();
        api.set_label(NODE, "nvidia.com/mig.config", Some(layout));
        let ok = api
            .wait_for(T, |a| {
                a.labels(NODE).get("nvidia.com/mig.config.state").map(String::as_str) == Some("success")
                    && a.requests().iter().rev().any(|r| r.method == "PATCH" && r.at > t)
            })
            .await;
        assert!(ok, "round {round}: {layout} did not reach success");
        latencies.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    agent.stop();

    // Planning alone, in process: observe the 8 GPUs and plan a layout against them.
    unsafe {
        // SAFETY: nothing else in this process reads the environment concurrently at this point.
        std::env::set_var("FAKE_NVML_MACHINE", &node.machine);
        std::env::set_var("FAKE_NVML_STATE_DIR", &node.state);
    }
    let gpus = Gpus::open(&common::fake_nvml_library()).expect("fake NVML");
    let config = Config::default();
    let layout = config.mig.layout("all-balanced").expect("built-in layout");
    let mut observe = Vec::new();
    let mut plan = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let observed = gpus.mig_observe().expect("observe");
        observe.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        let plans = plan_layout(&observed, &layout).expect("plan");
        plan.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(plans.len(), 8);
    }
    observe.sort_by(|a, b| a.total_cmp(b));
    plan.sort_by(|a, b| a.total_cmp(b));
    let mut lat = latencies.clone();
    lat.sort_by(|a, b| a.total_cmp(b));

    println!("\n{:<62} {:>16}", "measurement (8×A100-40GB, fake NVML)", "value");
    println!(
        "{:<62} {:>16}",
        "plan all-balanced for 8 GPUs (pure), µs p50 / max",
        format!("{:.0} / {:.0}", percentile(&plan, 0.5), plan[plan.len() - 1])
    );
    println!(
        "{:<62} {:>16}",
        "observe MIG state of 8 GPUs (NVML reads), ms p50 / max",
        format!("{:.2} / {:.2}", percentile(&observe, 0.5), observe[observe.len() - 1])
    );
    println!(
        "{:<62} {:>16}",
        "label → mig.config.state=success (re-layout all 8), ms p50 / max",
        format!("{:.0} / {:.0}", percentile(&lat, 0.5), lat[lat.len() - 1])
    );
    println!(
        "per round (ms): {}",
        latencies
            .iter()
            .map(|l| format!("{l:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
