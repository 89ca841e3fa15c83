//! `cargo bench --bench fleet`: what a fleet of N GPU nodes does to one API server, measured.
//!
//! Each simulated node is the agent's own Kubernetes side, instantiated N times in this one
//! process: `cluster::start` with the node's own root (kubeconfig with its `system:node:<name>`
//! token, state dir), so its credentials discovery, API client (own TLS connection), Node
//! watcher (watch, resume, 410 relist, poll fallback, backoff), label reporter, RuntimeClass
//! writer and Event writer are the real ones. What is simulated is only what a node's stages
//! would tell the link: its GPU feature labels, the MIG layout state (`pending` while a layout is
//! applied, `success` after a simulated apply of `APPLY`), and stage failures (an Event and a
//! status label) in the fault storm. The API server is `test_apiserver::TestApiServer` over TLS
//! (HTTP/2), in the same process.
//!
//! Scenarios (each reported per node and in total, with the API server's view):
//! 1. steady state for a simulated hour;
//! 2. an API server restart: every connection drops, connections are refused for `DOWN`, then
//!    the server answers with its watch history compacted (410 for every old resourceVersion);
//! 3. a fleet-wide rollout: every node's `nvidia.com/mig.config` changes at once;
//! 4. a fault storm: every node fails a stage every 10 s for a simulated hour;
//! 5. DRA on: each node's DRA driver publishes its ResourceSlices (the agent's publisher and
//!    client) at start, after a kubelet restart wiped them, and at steady state.
//!
//! Time: scenarios 2 and 3 run in real time with the default settings (their budgets are about
//! seconds and bursts, which scaling would compress into a CPU-bound pile-up). Scenarios 1 and 4
//! run on a second fleet whose every interval is divided by `SCALE` (the `[kubernetes]` timings
//! and the link's own: Event aggregation windows, the RuntimeClass retry), so that a simulated
//! hour takes 3600/`SCALE` s; counts per simulated hour are what an hour at the default settings
//! sends.
//!
//! `GNA_FLEET_NODES=100,1000,5000` (the default) picks the fleet sizes; `GNA_FLEET_PARTS`
//! (`realtime`, `scaled`, `dra`, comma-separated; `all` by default) the fleets run;
//! `GNA_FLEET_SCALE` the scaled fleet's time scale (default ×60, less for large N so that this
//! 2-core machine keeps up: N × scale ≤ 60,000); `GNA_FLEET_LOG=<filter>` the agents' logs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use gpu_node_agent::cluster::{self, Link, Timing};
use gpu_node_agent::config::Config;
use gpu_node_agent::dra::{Driver, Inputs};
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::kube::{self, EventType, KubeClient};
use gpu_node_agent::nvml::{GpuInfo, Inventory, MigState};
use std::time::Instant;
use test_apiserver::{KubeconfigAuth, RequestRecord, TestApiServer};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use tokio::time::Instant as TokioInstant;

/// Largest time scale of the steady-state and fault-storm fleet.
const SCALE: f64 = 60.0;
/// What this machine carries of the scaled fleet: N × scale node-equivalents (at ×60, 5,000
/// nodes are the request rate of 300,000 real ones, and a 2-core machine falls behind: watches
/// not renewed in time, Events queued past the hour). Larger fleets get a smaller scale.
const SCALED_LOAD: f64 = 60_000.0;

/// The scaled fleet's time scale for `n` nodes: `GNA_FLEET_SCALE`, else [`SCALE`] or less so
/// that `n × scale` stays within [`SCALED_LOAD`].
fn scale_for(n: usize) -> f64 {
    std::env::var("GNA_FLEET_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 1.0)
        .unwrap_or_else(|| SCALE.min(SCALED_LOAD / n as f64).max(1.0))
}
/// How long a simulated MIG layout change takes on a node.
const APPLY: Duration = Duration::from_secs(2);
/// How long the restarted API server refuses connections.
const DOWN: Duration = Duration::from_secs(5);
const MIG_LABEL: &str = "nvidia.com/mig.config";
const MIG_STATE: &str = "nvidia.com/mig.config.state";
const VALIDATION_STATE: &str = "nvidia.com/gpu-node-agent.validation.state";
/// A fault every this often per node in the storm (simulated time).
const FAULT_EVERY: Duration = Duration::from_secs(10);

struct Row {
    what: String,
    value: String,
    budget: String,
    ok: Option<bool>,
}

fn row(what: impl Into<String>, value: impl Into<String>, budget: impl Into<String>, ok: Option<bool>) -> Row {
    Row {
        what: what.into(),
        value: value.into(),
        budget: budget.into(),
        ok,
    }
}

/// What the bench tells a simulated node.
enum Cmd {
    /// Fail a stage every `every` until `until`: a Warning Event and a `failed` status label.
    Storm { every: Duration, until: Instant },
}

struct Fleet {
    api: TestApiServer,
    names: Vec<String>,
    ctl: Vec<mpsc::UnboundedSender<Cmd>>,
    /// Faults raised by the simulated nodes (the Events' counts must add up to it).
    faults: Arc<std::sync::atomic::AtomicU64>,
    scale: f64,
    _dir: tempfile::TempDir,
}

/// GPU Feature Discovery's labels of an 8×H100 node, with the MIG layout's when one is on.
fn feature_labels(layout: &str) -> BTreeMap<String, String> {
    let mut l: BTreeMap<String, String> = [
        ("gpu.present", "true"),
        ("gpu.count", "8"),
        ("gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("gpu.memory", "81559"),
        ("gpu.family", "hopper"),
        ("gpu.compute.major", "9"),
        ("gpu.compute.minor", "0"),
        ("gpu.machine", "PowerEdge-XE9680"),
        ("gpu.mode", "compute"),
        ("vgpu.present", "false"),
        ("gpu.replicas", "1"),
        ("gpu.sharing-strategy", "none"),
        ("cuda.driver-version.full", "580.95.05"),
        ("cuda.driver-version.major", "580"),
        ("cuda.driver-version.minor", "95"),
        ("cuda.driver-version.revision", "05"),
        ("cuda.runtime-version.full", "13.0"),
        ("cuda.runtime-version.major", "13"),
        ("cuda.runtime-version.minor", "0"),
        ("mig.capable", "true"),
        ("mps.capable", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("nvidia.com/{k}"), v.to_string()))
    .collect();
    if layout != "all-disabled" {
        for (k, v) in [
            ("mig.strategy", "mixed"),
            ("mig-1g.10gb.count", "56"),
            ("mig-1g.10gb.memory", "9984"),
            ("mig-1g.10gb.multiprocessors", "16"),
            ("mig-1g.10gb.engines.copy", "1"),
        ] {
            l.insert(format!("nvidia.com/{k}"), v.to_string());
        }
    }
    l
}

/// A simulated node: its stages as far as the link sees them.
async fn run_node(
    link: Link,
    mut ctl: mpsc::UnboundedReceiver<Cmd>,
    apply: Duration,
    faults: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut view = link.view.clone();
    let mut applied: Option<String> = None;
    let mut validation = "success";
    let mut storm: Option<(tokio::time::Interval, Instant, u64)> = None;
    link.runtime_classes(vec!["nvidia".into(), "nvidia-cdi".into()]);
    let wanted = |layout: &str, state: &str, validation: &str| {
        let mut l = feature_labels(layout);
        l.insert(MIG_STATE.into(), state.into());
        l.insert(VALIDATION_STATE.into(), validation.into());
        l
    };
    loop {
        let (connected, desired) = {
            let v = view.borrow_and_update();
            (
                v.connected,
                v.labels
                    .get(MIG_LABEL)
                    .cloned()
                    .unwrap_or_else(|| "all-disabled".into()),
            )
        };
        if connected && applied.as_deref() != Some(desired.as_str()) {
            if let Some(old) = &applied {
                // As the MIG stage does: `pending` on the Node before the change is made.
                link.report(wanted(old, "pending", validation));
                let deadline = TokioInstant::now() + Duration::from_secs(10);
                while view.borrow().labels.get(MIG_STATE).map(String::as_str) != Some("pending")
                    && TokioInstant::now() < deadline
                {
                    if tokio::time::timeout_at(deadline, view.changed()).await.is_err() {
                        break;
                    }
                }
                tokio::time::sleep(apply).await;
            }
            link.report(wanted(&desired, "success", validation));
            applied = Some(desired);
            continue;
        }
        let tick = async {
            match &mut storm {
                Some((interval, _, _)) => {
                    interval.tick().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            r = view.changed() => if r.is_err() { return },
            cmd = ctl.recv() => match cmd {
                None => return,
                Some(Cmd::Storm { every, until }) => {
                    // Each node's failures come at its own phase, as real ones would.
                    let start = TokioInstant::now() + every.mul_f64(fastrand::f64());
                    storm = Some((tokio::time::interval_at(start, every), until, 0));
                }
            },
            () = tick => {
                if let Some((_, until, n)) = &mut storm {
                    if Instant::now() >= *until {
                        storm = None;
                        continue;
                    }
                    *n += 1;
                    faults.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    link.event(
                        EventType::Warning,
                        "ValidationFailed",
                        format!("CUDA validation failed (attempt {n}): cuInit returned 999 (CUDA_ERROR_UNKNOWN)"),
                    );
                    if validation != "failed" {
                        validation = "failed";
                        let layout = applied.clone().unwrap_or_else(|| "all-disabled".into());
                        link.report(wanted(&layout, "success", validation));
                    }
                }
            }
        }
    }
}

fn node_config(name: &str, scale: f64) -> Config {
    let mut c = Config::default();
    let k = &mut c.kubernetes;
    k.kubeconfig = "/kubeconfig".into();
    k.node_name = name.into();
    k.watch_timeout = k.watch_timeout.div_f64(scale);
    k.poll_interval = k.poll_interval.div_f64(scale);
    k.backoff_min = k.backoff_min.div_f64(scale);
    k.backoff_max = k.backoff_max.div_f64(scale);
    k.reconnect_jitter = k.reconnect_jitter.div_f64(scale);
    c
}

async fn start_fleet(n: usize, scale: f64) -> (Fleet, Duration) {
    let api = TestApiServer::start().await;
    api.set_request_log(true);
    let dir = tempfile::tempdir().expect("tempdir");
    let faults = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut names = Vec::new();
    let mut ctl = Vec::new();
    let t0 = Instant::now();
    for i in 0..n {
        let name = format!("gpu-{i:05}");
        api.create_node(&name, &[(MIG_LABEL, "all-disabled"), ("team", "ml")]);
        let token = format!("token-{i:05}-0123456789abcdef");
        api.add_token(&token, &format!("system:node:{name}"));
        let root = dir.path().join(&name);
        std::fs::create_dir_all(&root).expect("node root");
        api.write_kubeconfig(&root, KubeconfigAuth::Token(token));
        let link = cluster::start_with(
            &node_config(&name, scale),
            &HostRoot::new(&root),
            None,
            Timing::scaled(scale),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_node(link, rx, APPLY.div_f64(scale), faults.clone()));
        names.push(name);
        ctl.push(tx);
    }
    let fleet = Fleet {
        api,
        names,
        ctl,
        faults,
        scale,
        _dir: dir,
    };
    fleet
        .wait_all(Duration::from_secs(600), |l| {
            l.get(MIG_STATE).map(String::as_str) == Some("success")
        })
        .await;
    (fleet, t0.elapsed())
}

impl Fleet {
    /// Waits until every node's labels satisfy `pred` (checked every 200 ms); panics after
    /// `limit`.
    async fn wait_all(&self, limit: Duration, pred: impl Fn(&BTreeMap<String, String>) -> bool) {
        let deadline = Instant::now() + limit;
        let mut pending: Vec<&String> = self.names.iter().collect();
        loop {
            pending.retain(|n| !pred(&self.api.labels(n)));
            if pending.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} node(s) not there after {limit:?}, e.g. {}: {:?}",
                pending.len(),
                pending[0],
                self.api.labels(pending[0])
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn n(&self) -> usize {
        self.names.len()
    }
}

/// The node a request came from (`system:node:<name>`).
fn node_of(r: &RequestRecord) -> Option<&str> {
    r.user.as_deref().and_then(|u| u.strip_prefix("system:node:"))
}

/// `verb resource` of a request, e.g. `watch nodes`, `create events`.
fn verb_resource(r: &RequestRecord) -> String {
    let resource = if r.path.contains("/events") {
        "events"
    } else if r.path.contains("/runtimeclasses") {
        "runtimeclasses"
    } else if r.path.contains("/resourceslices") {
        "resourceslices"
    } else if r.path.contains("/nodes") {
        "nodes"
    } else {
        "other"
    };
    format!("{} {resource}", r.verb)
}

fn by_verb(requests: &[RequestRecord]) -> String {
    let mut m: BTreeMap<String, usize> = BTreeMap::new();
    for r in requests {
        *m.entry(verb_resource(r)).or_default() += 1;
    }
    m.iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn per_node(requests: &[RequestRecord], keep: impl Fn(&RequestRecord) -> bool) -> HashMap<&str, usize> {
    let mut m: HashMap<&str, usize> = HashMap::new();
    for r in requests.iter().filter(|r| keep(r)) {
        if let Some(n) = node_of(r) {
            *m.entry(n).or_default() += 1;
        }
    }
    m
}

fn max_of(m: &HashMap<&str, usize>) -> usize {
    m.values().copied().max().unwrap_or(0)
}

fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Scenario 1: a simulated hour with nothing happening.
async fn steady(fleet: &Fleet, rows: &mut Vec<Row>) {
    let n = fleet.n();
    // Let the start settle (RuntimeClass retries, first renewals).
    tokio::time::sleep(Duration::from_secs(5)).await;
    fleet.api.clear_requests();
    fleet.api.clear_stats();
    tokio::time::sleep(Duration::from_secs(3600).div_f64(fleet.scale)).await;
    let requests = fleet.api.requests();
    let stats = fleet.api.stats();
    let writes = requests.iter().filter(|r| r.method != "GET").count();
    let per = per_node(&requests, |_| true);
    let worst = max_of(&per);
    let per_min = requests.len() as f64 / n as f64 / 60.0;
    rows.push(row(
        "1 steady: requests per node per minute (mean / worst node)",
        format!("{per_min:.3} / {:.3}", worst as f64 / 60.0),
        "≤ 1",
        Some(worst <= 60),
    ));
    rows.push(row(
        "1 steady: writes in the hour",
        writes.to_string(),
        "0",
        Some(writes == 0),
    ));
    rows.push(row(
        "1 steady: requests in the hour, fleet total",
        format!("{} ({})", requests.len(), by_verb(&requests)),
        "",
        None,
    ));
    rows.push(row(
        "1 steady: API server body bytes in / out per node per hour",
        format!(
            "{:.1} KiB / {:.1} KiB",
            stats.total().request_bytes as f64 / n as f64 / 1024.0,
            stats.total().response_bytes as f64 / n as f64 / 1024.0
        ),
        "",
        None,
    ));
    rows.push(row(
        "1 steady: watches open (now / peak), 429s",
        format!(
            "{} / {}, {}",
            stats.open_watches,
            stats.peak_watches,
            stats.total().too_many_requests
        ),
        format!("peak {n}"),
        // A sample of "now" catches a few between a watch's end and its renewal.
        Some(stats.peak_watches == n as u64),
    ));
}

/// Scenario 4: every node fails a stage every 10 s for a simulated hour.
async fn storm(fleet: &Fleet, rows: &mut Vec<Row>) {
    let n = fleet.n();
    let hour = Duration::from_secs(3600).div_f64(fleet.scale);
    fleet.api.clear_requests();
    let before = fleet.faults.load(std::sync::atomic::Ordering::Relaxed);
    let until = Instant::now() + hour;
    for tx in &fleet.ctl {
        let _ = tx.send(Cmd::Storm {
            every: FAULT_EVERY.div_f64(fleet.scale),
            until,
        });
    }
    tokio::time::sleep_until(TokioInstant::from_std(until)).await;
    // What was held back is flushed within the aggregation's limits: give it ten minutes.
    tokio::time::sleep(Duration::from_secs(600).div_f64(fleet.scale)).await;
    let faults = fleet.faults.load(std::sync::atomic::Ordering::Relaxed) - before;
    let requests = fleet.api.requests();
    let event_writes: Vec<&RequestRecord> = requests.iter().filter(|r| r.path.contains("/events")).collect();
    let creates = per_node(&requests, |r| r.path.contains("/events") && r.method == "POST");
    let patches = per_node(&requests, |r| r.path.contains("/events") && r.method == "PATCH");
    let label_writes = per_node(&requests, |r| r.path.contains("/nodes/") && r.method == "PATCH");
    // New Event objects per node in any 10-minute window (simulated), from the POST times.
    let window = Duration::from_secs(600).div_f64(fleet.scale);
    let mut posts: HashMap<&str, Vec<Instant>> = HashMap::new();
    for r in requests
        .iter()
        .filter(|r| r.path.contains("/events") && r.method == "POST" && r.status == 201)
    {
        if let Some(node) = node_of(r) {
            posts.entry(node).or_default().push(r.at);
        }
    }
    let worst_window = posts
        .values()
        .map(|times| {
            times
                .iter()
                .map(|t| times.iter().filter(|u| **u >= *t && **u < *t + window).count())
                .max()
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    let counted: u64 = fleet
        .api
        .events()
        .iter()
        .filter(|e| e["reason"] == "ValidationFailed")
        .map(|e| e["count"].as_u64().unwrap_or(1))
        .sum();
    let per_node_hour = event_writes.len() as f64 / n as f64;
    rows.push(row(
        "4 storm: faults raised per node per hour",
        format!("{:.0}", faults as f64 / n as f64),
        "",
        None,
    ));
    rows.push(row(
        "4 storm: Event writes per node per hour (mean; worst: POST / PATCH)",
        format!("{per_node_hour:.1}; {} / {}", max_of(&creates), max_of(&patches)),
        "kubelet: ≤ 25 + 12/h",
        Some(max_of(&creates) + max_of(&patches) <= 25 + 12 + 2),
    ));
    rows.push(row(
        "4 storm: new Event objects per node per reason per 10 min (worst)",
        worst_window.to_string(),
        "≤ 1",
        Some(worst_window <= 1),
    ));
    rows.push(row(
        "4 storm: Event counts on the server / faults raised",
        format!("{counted} / {faults}"),
        "equal",
        Some(counted == faults),
    ));
    rows.push(row(
        "4 storm: status label writes per node (worst)",
        max_of(&label_writes).to_string(),
        "≤ 1",
        Some(max_of(&label_writes) <= 1),
    ));
}

/// Scenario 3: every node's MIG layout label changes at once.
async fn rollout(fleet: &Fleet, rows: &mut Vec<Row>) {
    let jitter = Config::default().kubernetes.reconnect_jitter;
    fleet.api.clear_requests();
    let t0 = Instant::now();
    for name in &fleet.names {
        fleet.api.set_label(name, MIG_LABEL, Some("all-1g.10gb"));
    }
    let labelled = t0.elapsed();
    fleet
        .wait_all(Duration::from_secs(300), |l| {
            l.get(MIG_STATE).map(String::as_str) == Some("success") && l.contains_key("nvidia.com/mig.strategy")
        })
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = fleet.api.requests();
    let patches: Vec<&RequestRecord> = requests
        .iter()
        .filter(|r| r.method == "PATCH" && r.path.starts_with("/api/v1/nodes/"))
        .collect();
    let last_success = patches
        .iter()
        .filter(|r| r.body.contains("\"success\""))
        .map(|r| r.at.duration_since(t0))
        .max()
        .unwrap_or_default();
    let writes = per_node(&requests, |r| r.method != "GET");
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for r in &patches {
        *per_second.entry(r.at.duration_since(t0).as_secs()).or_default() += 1;
    }
    let peak = per_second.values().copied().max().unwrap_or(0);
    let budget = jitter + Duration::from_secs(10);
    rows.push(row(
        "3 rollout: last node reports success after",
        format!(
            "{:.1} s (labels set in {:.1} s)",
            last_success.as_secs_f64(),
            labelled.as_secs_f64()
        ),
        format!("≤ {:.0} s", budget.as_secs_f64()),
        Some(last_success <= budget),
    ));
    rows.push(row(
        "3 rollout: writes per node for the change (worst)",
        max_of(&writes).to_string(),
        "≤ 3",
        Some(max_of(&writes) <= 3),
    ));
    rows.push(row(
        "3 rollout: label PATCHes per second, peak",
        format!("{peak} ({} in all, {})", patches.len(), by_verb(&requests)),
        "",
        None,
    ));
}

/// Scenario 2: the API server restarts.
async fn restart(fleet: &Fleet, rows: &mut Vec<Row>) {
    let n = fleet.n();
    let jitter = Config::default().kubernetes.reconnect_jitter;
    fleet.api.clear_requests();
    fleet.api.clear_stats();
    fleet.api.restart(DOWN);
    let t_down = Instant::now();
    tokio::time::sleep(DOWN).await;
    let t_up = Instant::now();
    let deadline = t_up + Duration::from_secs(180);
    let mut all_back = None;
    while Instant::now() < deadline {
        if fleet.api.open_watches() >= n && all_back.is_none() {
            all_back = Some(t_up.elapsed());
        }
        if all_back.is_some() && t_up.elapsed() >= Duration::from_secs(60) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let requests = fleet.api.requests();
    let after: Vec<&RequestRecord> = requests.iter().filter(|r| r.at >= t_down).collect();
    let first_minute = per_node(&requests, |r| r.at >= t_down && r.at < t_up + Duration::from_secs(60));
    let relists = per_node(&requests, |r| {
        // A relist: a quorum read of the Node (the list by name after a 410, or a GET).
        r.at >= t_down
            && (r.verb == "list" || r.verb == "get")
            && r.path.starts_with("/api/v1/nodes")
            && !r.query.contains("resourceVersion=0")
    });
    let mut first: HashMap<&str, Instant> = HashMap::new();
    for r in &after {
        if let Some(node) = node_of(r) {
            first.entry(node).or_insert(r.at);
        }
    }
    let firsts: Vec<Duration> = first.values().map(|t| t.duration_since(t_down)).collect();
    let (lo, hi) = (
        firsts.iter().min().copied().unwrap_or_default(),
        firsts.iter().max().copied().unwrap_or_default(),
    );
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for r in &after {
        *per_second.entry(r.at.duration_since(t_down).as_secs()).or_default() += 1;
    }
    let peak = per_second.values().copied().max().unwrap_or(0);
    let stats = fleet.api.stats();
    rows.push(row(
        "2 restart: first request per node after the drop, spread",
        format!("{:.1} – {:.1} s", lo.as_secs_f64(), hi.as_secs_f64()),
        format!("over ≥ {:.0} s window", jitter.as_secs_f64()),
        Some(hi - lo >= jitter.mul_f64(0.8)),
    ));
    rows.push(row(
        "2 restart: reconnect burst, requests per second (peak)",
        peak.to_string(),
        "",
        None,
    ));
    rows.push(row(
        "2 restart: requests per node in the first minute (worst)",
        max_of(&first_minute).to_string(),
        "≤ 3",
        Some(max_of(&first_minute) <= 3),
    ));
    rows.push(row(
        "2 restart: every node watching again after",
        all_back.map_or("never (3 min)".into(), |d| format!("{:.1} s", d.as_secs_f64())),
        "≤ 120 s",
        Some(all_back.is_some_and(|d| d <= Duration::from_secs(120))),
    ));
    rows.push(row(
        "2 restart: relists per node (worst)",
        max_of(&relists).to_string(),
        "≤ 1",
        Some(max_of(&relists) <= 1),
    ));
    rows.push(row(
        "2 restart: requests after the drop, fleet total",
        format!(
            "{} ({}); 429s {}",
            after.len(),
            by_verb(&requests),
            stats.total().too_many_requests
        ),
        "",
        None,
    ));
}

/// An 8×H100 node's inventory, as NVML would give it (MIG off).
fn h100_node(node: usize) -> Inventory {
    let gpus = (0..8u32)
        .map(|index| GpuInfo {
            index,
            uuid: format!("GPU-{node:05}-{index}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index * 0x10),
            pci_device_id: 0x2330,
            minor: index,
            numa_node: Some(i64::from(index / 4)),
            compute_capability: Some((9, 0)),
            mig: Some(MigState {
                current: false,
                pending: false,
            }),
            mig_devices: Vec::new(),
            fabric: None,
            pci_class: Some(0x030200),
        })
        .collect();
    Inventory {
        driver_version: "580.95.05".into(),
        cuda_driver_version: "13.0".into(),
        gpus,
    }
}

/// Scenario 5: DRA on. Each node runs the agent's DRA driver (its ResourceSlice publisher, with
/// its own API client) for an 8-GPU inventory: slices at start, after a kubelet restart wiped
/// every node's slices (the kubelet then registers the plugin again), and at steady state.
async fn dra(n: usize, rows: &mut Vec<Row>) {
    let api = TestApiServer::start().await;
    api.set_request_log(true);
    let dir = tempfile::tempdir().expect("tempdir");
    let stop = CancellationToken::new();
    let mut drivers = Vec::new();
    let mut keep = Vec::new();
    let t0 = Instant::now();
    for i in 0..n {
        let name = format!("gpu-{i:05}");
        api.create_node(&name, &[]);
        let token = format!("token-{i:05}-0123456789abcdef");
        api.add_token(&token, &format!("system:node:{name}"));
        let root_dir = dir.path().join(&name);
        std::fs::create_dir_all(&root_dir).expect("node root");
        api.write_kubeconfig(&root_dir, KubeconfigAuth::Token(token));
        let mut config = node_config(&name, 1.0);
        config.dra.enabled = true;
        // No kubelet here: nothing asks which GPUs the device plugin handed out.
        config.device_plugin.enabled = false;
        let root = HostRoot::new(&root_dir);
        let credentials = kube::discover(&config.kubernetes, &root)
            .expect("credentials")
            .expect("a kubeconfig");
        let client = KubeClient::new(credentials, &config.kubernetes).expect("client");
        let (health_tx, health_rx) = watch::channel(0u64);
        let inputs = Inputs {
            health: Arc::new(|_| true),
            health_changed: health_rx,
        };
        let (inventory_tx, inventory_rx) = watch::channel(Some(Arc::new(h100_node(i))));
        let (driver, withdrawn) = Driver::new(config, root, name, Some(client), inputs, inventory_rx);
        tokio::spawn(driver.clone().publish(stop.clone()));
        drivers.push(driver);
        keep.push((health_tx, inventory_tx, withdrawn));
    }
    let all_published = |api: &TestApiServer| {
        let slices = api.resource_slices();
        let mut nodes: BTreeMap<String, usize> = BTreeMap::new();
        for s in slices.values() {
            if let Some(node) = s.pointer("/spec/nodeName").and_then(|v| v.as_str()) {
                *nodes.entry(node.to_string()).or_default() += s
                    .pointer("/spec/devices")
                    .and_then(|d| d.as_array())
                    .map_or(0, Vec::len);
            }
        }
        nodes.len() == n && nodes.values().all(|d| *d == 8)
    };
    let wait_published = |api: TestApiServer| async move {
        let deadline = Instant::now() + Duration::from_secs(600);
        while !all_published(&api) {
            assert!(Instant::now() < deadline, "slices not all published in 10 min");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    wait_published(api.clone()).await;
    let started = t0.elapsed();
    let start_requests = api.requests();
    rows.push(row(
        "5 DRA: start, every node's slices published after",
        format!(
            "{:.1} s; {} requests, worst node {} ({})",
            started.as_secs_f64(),
            start_requests.len(),
            max_of(&per_node(&start_requests, |_| true)),
            by_verb(&start_requests)
        ),
        "",
        None,
    ));
    // Steady state: a real minute (the safety-net list is every 10-12 minutes).
    api.clear_requests();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let steady = api.requests();
    rows.push(row(
        "5 DRA: steady, requests in a minute (fleet)",
        format!("{} ({})", steady.len(), by_verb(&steady)),
        "0 (a list per 10–12 min)",
        Some(steady.is_empty()),
    ));
    // The kubelet restarts on every node: it deletes the node's slices, then registers the
    // plugin again.
    api.clear_requests();
    let t1 = Instant::now();
    for (i, driver) in drivers.iter().enumerate() {
        api.delete_resource_slices(&format!("gpu-{i:05}"), None);
        driver.kubelet_registered();
    }
    wait_published(api.clone()).await;
    let again = t1.elapsed();
    let requests = api.requests();
    let writes = per_node(&requests, |r| r.method != "GET");
    rows.push(row(
        "5 DRA: kubelet restart, slices back after",
        format!(
            "{:.1} s; {} requests, worst node {} writes ({})",
            again.as_secs_f64(),
            requests.len(),
            max_of(&writes),
            by_verb(&requests)
        ),
        "1 list + 1 create per node",
        Some(max_of(&writes) <= 1 && max_of(&per_node(&requests, |_| true)) <= 2),
    ));
    stop.cancel();
}

fn print(n: usize, rows: &[Row]) {
    println!("\n## N = {n}\n");
    println!("| measurement | value | budget | |");
    println!("|---|---|---|---|");
    for r in rows {
        let verdict = match r.ok {
            Some(true) => "ok",
            Some(false) => "OVER",
            None => "",
        };
        println!("| {} | {} | {} | {verdict} |", r.what, r.value, r.budget);
    }
}

/// Two sockets per node (the agent's and the server's end) need more than the usual 1024.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Says on stderr what the bench is doing (a fleet of thousands takes minutes per step).
fn phase(n: usize, what: &str) {
    eprintln!("[fleet N={n}] {what}");
}

async fn run(n: usize, parts: &str) {
    let mut rows = Vec::new();
    let part = |name: &str| parts.split(',').any(|p| p == "all" || p == name);
    if part("realtime") {
        realtime(n, &mut rows).await;
    }
    if part("scaled") {
        let scale = scale_for(n);
        phase(n, &format!("starting the scaled fleet (×{scale})"));
        // The scaled fleet: a simulated hour of steady state, then one of faults.
        let (fleet, _) = start_fleet(n, scale).await;
        phase(n, "steady hour");
        steady(&fleet, &mut rows).await;
        phase(n, "fault storm");
        storm(&fleet, &mut rows).await;
        rows.push(row(
            "1/4 time scale of the steady and storm fleet",
            format!("×{scale}"),
            "",
            None,
        ));
        drop(fleet);
    }
    if part("dra") {
        phase(n, "DRA");
        dra(n, &mut rows).await;
    }
    rows.sort_by(|a, b| a.what.cmp(&b.what));
    print(n, &rows);
}

/// The real-time fleet: start, rollout, restart.
async fn realtime(n: usize, rows: &mut Vec<Row>) {
    phase(n, "starting the real-time fleet");
    let (fleet, started) = start_fleet(n, 1.0).await;
    let (rss, _) = rss_mib();
    let start_requests = fleet.api.requests();
    rows.push(row(
        "0 start: every node labelled after",
        format!("{:.1} s", started.as_secs_f64()),
        "",
        None,
    ));
    rows.push(row(
        "0 start: requests per node (worst), fleet total",
        format!(
            "{}, {} ({})",
            max_of(&per_node(&start_requests, |_| true)),
            start_requests.len(),
            by_verb(&start_requests)
        ),
        "",
        None,
    ));
    rows.push(row(
        "0 start: process RSS (server + N agents' API side) per node",
        format!("{:.0} MiB, {:.1} KiB/node", rss, rss * 1024.0 / n as f64),
        "",
        None,
    ));
    phase(n, "rollout");
    rollout(&fleet, rows).await;
    phase(n, "API server restart");
    restart(&fleet, rows).await;
}

fn main() {
    raise_nofile();
    // GNA_FLEET_LOG=debug (an env filter) shows the agents' logs, all nodes interleaved.
    if let Ok(filter) = std::env::var("GNA_FLEET_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let sizes: Vec<usize> = std::env::var("GNA_FLEET_NODES")
        .unwrap_or_else(|_| "100,1000,5000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let parts = std::env::var("GNA_FLEET_PARTS").unwrap_or_else(|_| "all".into());
    println!("fleet bench: N = {sizes:?}; parts {parts}; restart: down {DOWN:?}");
    for n in sizes {
        runtime.block_on(run(n, &parts));
    }
}
