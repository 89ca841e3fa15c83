//! `cargo bench --bench cluster`: the API server budget, measured with the real binary, the
//! test API server and the fake NVML, printed as a table.
//!
//! | what | budget |
//! | API requests per node per hour at steady state | ≤ 60, zero writes |
//! | label change → reaction (watch) | ≤ 1 s |
//!
//! An hour is simulated by scaling every interval down by `SCALE` (watch renewal 5m → 2.5s,
//! poll 60s → 0.5s) and counting requests over 3600/`SCALE` seconds: the count per simulated
//! hour is what an hour at the default settings sends.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{H100_MIG, Node};
use test_apiserver::{KubeconfigAuth, KubeconfigOptions, TestApiServer};

const SCALE: u64 = 120;
const NODE: &str = "gpu-node-1";
const TOKEN: &str = "bench-token-0123456789";
const T: Duration = Duration::from_secs(15);

struct Row {
    what: String,
    value: String,
    budget: &'static str,
    ok: bool,
}

async fn setup(extra: &str) -> (TestApiServer, Node) {
    let api = TestApiServer::start().await;
    api.create_node(NODE, &[("team", "ml")]);
    api.add_token(TOKEN, "system:node:gpu-node-1");
    let config =
        format!("[log]\nlevel = \"warn\"\n[device_plugin.profiles.mig-mixed]\nmig_strategy = \"mixed\"\n{extra}");
    let node = Node::new(H100_MIG, &config);
    let options = KubeconfigOptions {
        file_name: "kubelet.conf".into(),
        ..KubeconfigOptions::default()
    };
    api.write_kubeconfig_with(&node.kubeconfig_dir(), KubeconfigAuth::Token(TOKEN.into()), &options);
    (api, node)
}

/// Requests during one simulated hour after the agent has settled.
async fn steady_hour(extra: &str) -> (usize, usize) {
    let (api, node) = setup(extra).await;
    let agent = node.spawn();
    assert!(
        api.wait_for(T, |a| a.labels(NODE).contains_key("nvidia.com/gpu.present"))
            .await,
        "labels written"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    api.clear_requests();
    tokio::time::sleep(Duration::from_secs(3600 / SCALE)).await;
    let requests = api.requests();
    agent.stop();
    let writes = requests.iter().filter(|r| r.method != "GET").count();
    (requests.len(), writes)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();
    let watch = format!("[kubernetes]\nwatch_timeout = \"{}ms\"\n", 300_000 / SCALE);
    let poll = format!(
        "[kubernetes]\nwatch = false\npoll_interval = \"{}ms\"\n",
        60_000 / SCALE
    );
    for (mode, extra) in [("watch", watch.as_str()), ("poll", poll.as_str())] {
        let (requests, writes) = steady_hour(extra).await;
        rows.push(Row {
            what: format!("API requests per simulated hour, steady state ({mode})"),
            value: format!("{requests} ({writes} writes)"),
            budget: "≤ 60, 0 writes",
            ok: requests <= 60 && writes == 0,
        });
    }

    // Label change → reaction: the time from the label's change on the API server to the
    // agent's PATCH of the profile state label (after it swapped the advertised resources).
    let (api, node) = setup("").await;
    let agent = node.spawn();
    assert!(
        api.wait_for(T, |a| a.labels(NODE).contains_key("nvidia.com/gpu.present"))
            .await
    );
    let mut samples = Vec::new();
    for round in 0..10 {
        let (value, state) = if round % 2 == 0 {
            (Some("mig-mixed"), Some("success"))
        } else {
            (None, None)
        };
        let before = api.requests().len();
        let t = Instant::now();
        api.set_label(NODE, "nvidia.com/device-plugin.config", value);
        let done = api
            .wait_for(T, |a| {
                a.labels(NODE)
                    .get("nvidia.com/device-plugin.config.state")
                    .map(String::as_str)
                    == state
                    && a.requests()
                        .get(before..)
                        .is_some_and(|r| r.iter().any(|r| r.method == "PATCH"))
            })
            .await;
        assert!(done, "reaction {round}");
        let patch = api.requests()[before..]
            .iter()
            .find(|r| r.method == "PATCH")
            .map(|r| r.at)
            .expect("a PATCH followed");
        samples.push(patch.duration_since(t).as_secs_f64() * 1000.0);
    }
    agent.stop();
    samples.sort_by(|a, b| a.total_cmp(b));
    let max = samples[samples.len() - 1];
    rows.push(Row {
        what: "label change → reaction (watch), ms p50 / max".into(),
        value: format!("{:.1} / {max:.1}", samples[samples.len() / 2]),
        budget: "≤ 1000 ms",
        ok: max <= 1000.0,
    });

    println!("\n{:<60} {:>18}  {:<16}", "measurement", "value", "budget");
    for r in &rows {
        println!(
            "{:<60} {:>18}  {:<16} {}",
            r.what,
            r.value,
            r.budget,
            if r.ok { "ok" } else { "OVER" }
        );
    }
}
