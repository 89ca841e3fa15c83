//! dcgm-exporter compatibility of the metrics endpoint, against a simulated node (an H100 and a
//! T4 on the fake NVML library), scraped over HTTP and read with a Prometheus text parser
//! (prometheus-parse):
//!
//! - every series of dcgm-exporter's `etc/default-counters.csv` is served for the H100 with
//!   dcgm-exporter's name, type, HELP text and labels, and the ones NVML cannot give on a T4
//!   (no HBM, no NVLink, no row remapping before Ampere, no vGPU) are absent there, not zero;
//! - NVIDIA's Grafana dashboard (`tests/fixtures/grafana/`) finds, for each panel, the series and
//!   labels its PromQL and its template variables use.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use common::scrape::{get_metrics, parse, series};
use gpu_node_agent::metrics::{Metrics, MetricsServer, XID_ERRORS};
use prometheus_parse::{Scrape, Value};
use tokio::sync::oneshot;

const H100: &str = "GPU-00000000-1111-2222-3333-444455556666";
const T4: &str = "GPU-00000001-1111-2222-3333-444455556666";
const HOST: &str = "gpu-node-1";

/// GPU 0: an H100 in a vGPU guest (unlicensed), so that every default counter has a value;
/// GPU 1: a T4 on bare metal, with the fake's defaults.
const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "H100-80GB-HBM3"
uuid = "GPU-00000000-1111-2222-3333-444455556666"
pci_bus_id = "00000000:18:00.0"
[gpu.readings]
nvlink_data_tx_kib = 1800
nvlink_data_rx_kib = 3600
vgpu_licensed = false

[[gpu]]
model = "T4"
uuid = "GPU-00000001-1111-2222-3333-444455556666"
pci_bus_id = "00000000:3B:00.0"
"#;

/// dcgm-exporter's `etc/default-counters.csv` (NVIDIA/dcgm-exporter, commit b54068a9): every
/// uncommented line as (field, Prometheus type, HELP text).
const DEFAULT_COUNTERS: &[(&str, &str, &str)] = &[
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    (
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "counter",
        "Total number of bytes transmitted through PCIe TX (in KB) via NVML.",
    ),
    (
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "counter",
        "Total number of bytes received through PCIe RX (in KB) via NVML.",
    ),
    (
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
    ),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    (
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error encountered.",
    ),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes",
    ),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
    ),
    (
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
    ),
];

/// What a T4 on bare metal cannot give, by the rules of real NVML: HBM temperature (GDDR6),
/// NVLink (none), remapped rows (Turing retires pages instead), the vGPU license (no vGPU).
const ABSENT_ON_T4: &[&str] = &[
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
];

/// Labels Prometheus adds to every series of a target at scrape time (not the exporter's).
const TARGET_LABELS: &[&str] = &["instance", "job"];

/// The labels dcgm-exporter puts on a whole-GPU series without a pod.
const GPU_LABELS: &[&str] = &[
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "DCGM_FI_DRIVER_VERSION",
];

/// One scrape of the simulated node: (OpenMetrics body, Prometheus text format body).
fn scrape() -> &'static (String, String) {
    static SCRAPE: OnceLock<(String, String)> = OnceLock::new();
    SCRAPE.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(scrape_node())
    })
}

async fn scrape_node() -> (String, String) {
    let node = common::Node::new(MACHINE, "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: runs once, before this process loads NVML, under the OnceLock.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let inventory = gpus.inventory(&node.root.join("sys")).expect("inventory");
    let metrics = Metrics::new();
    let (mut sampler, _inventory_tx) = common::scrape::hand_ticked_sampler(&gpus, &metrics, inventory, HOST, None);
    // Two readings intervals: GPM's profiling series need two samples.
    assert!(sampler.tick().await, "one readings interval");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(sampler.tick().await, "a second readings interval");
    let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), metrics, "/metrics")
        .await
        .expect("bind");
    let addr = server.local_addr().expect("local addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let bodies = tokio::task::spawn_blocking(move || {
        (
            get_metrics(addr, Some("application/openmetrics-text;version=1.0.0")),
            get_metrics(addr, None),
        )
    })
    .await
    .expect("scrapes");
    let _ = stop.send(());
    serving.await.expect("server stops");
    bodies
}

#[test]
fn every_default_counter_is_served_for_an_h100_and_absent_by_rule_on_a_t4() {
    let (openmetrics, text) = scrape();
    let text_scrape = parse(text);
    let om_scrape = parse(openmetrics);
    for &(name, kind, help) in DEFAULT_COUNTERS {
        // HELP and type: the text format has dcgm-exporter's types; OpenMetrics has a
        // cumulative field as `unknown` (its counters must end in `_total`, see dcgm.rs).
        assert_eq!(text_scrape.docs.get(name).map(String::as_str), Some(help), "{name}");
        assert_eq!(om_scrape.docs.get(name).map(String::as_str), Some(help), "{name}");
        assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name} {kind}");
        let om_kind = if kind == "counter" { "unknown" } else { kind };
        assert!(openmetrics.contains(&format!("# TYPE {name} {om_kind}\n")), "{name}");
        for sample in text_scrape.samples.iter().filter(|s| s.metric == name) {
            let typed = matches!(
                (kind, &sample.value),
                ("gauge", Value::Gauge(_)) | ("counter", Value::Counter(_))
            );
            assert!(typed, "{name}: {:?} is not a {kind}", sample.value);
        }

        let on = |uuid: &str| -> Vec<BTreeMap<String, String>> {
            series(&text_scrape, name)
                .into_iter()
                .filter(|l| l.get("UUID").map(String::as_str) == Some(uuid))
                .collect()
        };
        let h100 = on(H100);
        assert_eq!(h100.len(), 1, "one {name} series for the H100 in:\n{text}");
        let mut want: BTreeSet<&str> = GPU_LABELS.iter().copied().collect();
        if name == XID_ERRORS {
            want.extend(["err_code", "err_msg"]);
        }
        let got: BTreeSet<&str> = h100[0].keys().map(String::as_str).collect();
        assert_eq!(got, want, "{name}'s labels");
        assert_eq!(h100[0]["gpu"], "0");
        assert_eq!(h100[0]["device"], "nvidia0");
        assert_eq!(h100[0]["modelName"], "NVIDIA H100 80GB HBM3");
        assert_eq!(h100[0]["pci_bus_id"], "00000000:18:00.0");
        assert_eq!(h100[0]["Hostname"], HOST);
        assert_eq!(h100[0]["DCGM_FI_DRIVER_VERSION"], "550.54.15");

        let t4 = on(T4);
        if ABSENT_ON_T4.contains(&name) {
            assert!(t4.is_empty(), "{name} on the T4: {t4:?}");
        } else {
            assert_eq!(t4.len(), 1, "{name} on the T4 in:\n{text}");
        }
    }
    // No Xid yet: dcgm-exporter's 0 with its message.
    let xid = &series(&text_scrape, XID_ERRORS)[0];
    assert_eq!((xid["err_code"].as_str(), xid["err_msg"].as_str()), ("0", "No Error"));
    // Values that tell a real reading from a default: NVLink TX + RX, the unlicensed vGPU.
    let value = |name: &str| {
        text_scrape
            .samples
            .iter()
            .find(|s| s.metric == name && s.labels.get("UUID") == Some(H100))
            .map(|s| match s.value {
                Value::Gauge(v) | Value::Counter(v) | Value::Untyped(v) => v,
                ref other => panic!("{name}: {other:?}"),
            })
    };
    assert_eq!(value("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), Some(5400.0));
    assert_eq!(value("DCGM_FI_DEV_VGPU_LICENSE_STATUS"), Some(0.0));
    assert_eq!(value("DCGM_FI_DEV_ROW_REMAP_FAILURE"), Some(0.0));
}

/// What a PromQL expression reads: metric names and label names.
#[derive(Debug, Default)]
struct Refs {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
}

/// Keywords and functions that are followed by a label list.
const LABEL_LIST_KEYWORDS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
/// Operators and aggregations (which may put `by (...)` before their parenthesis).
const OPERATOR_KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];

/// Reads the metric and label names of PromQL `expr` (selectors, label matchers, `by`/`without`
/// lists). String literals, range brackets and Grafana variables (`$x`) are skipped.
fn promql_refs(expr: &str, refs: &mut Refs) {
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut in_braces = false;
    let next_non_space = |from: usize| chars[from..].iter().copied().find(|c| !c.is_whitespace());
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '[' => {
                while i < chars.len() && chars[i] != ']' {
                    i += 1;
                }
                i += 1;
            }
            '{' => {
                in_braces = true;
                i += 1;
            }
            '}' => {
                in_braces = false;
                i += 1;
            }
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || "_{}".contains(chars[i])) {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                if in_braces {
                    refs.labels.insert(word);
                } else if LABEL_LIST_KEYWORDS.contains(&word.as_str()) {
                    if next_non_space(i) == Some('(') {
                        let open = i + chars[i..].iter().position(|&c| c == '(').unwrap_or(0);
                        let close = open + chars[open..].iter().position(|&c| c == ')').unwrap_or(0);
                        let list: String = chars[open + 1..close].iter().collect();
                        refs.labels.extend(
                            list.split(',')
                                .map(str::trim)
                                .filter(|l| !l.is_empty())
                                .map(String::from),
                        );
                        i = close + 1;
                    }
                } else if next_non_space(i) != Some('(') && !OPERATOR_KEYWORDS.contains(&word.as_str()) {
                    refs.metrics.insert(word);
                }
            }
            c if c.is_ascii_digit() => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
}

/// What a Grafana template variable query reads: `label_values(<selector>, <label>)` or PromQL.
fn template_refs(query: &str, refs: &mut Refs) {
    match query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
    {
        Some(args) => {
            let (selector, label) = args.rsplit_once(',').unwrap_or(("", args));
            promql_refs(selector, refs);
            refs.labels.insert(label.trim().to_string());
        }
        None => promql_refs(query, refs),
    }
}

/// `{{label}}` names of a legend format.
fn legend_labels(format: &str, refs: &mut Refs) {
    for part in format.split("{{").skip(1) {
        if let Some((label, _)) = part.split_once("}}") {
            refs.labels.insert(label.trim().to_string());
        }
    }
}

/// Whether the scrape has, for every metric of `refs`, a series with every label of `refs`
/// (target labels aside); the reason when not.
fn check(scrape: &Scrape, refs: &Refs) -> Result<(), String> {
    if refs.metrics.is_empty() {
        return Err("no metric found in the expressions".into());
    }
    for metric in &refs.metrics {
        let all = series(scrape, metric);
        if all.is_empty() {
            return Err(format!("no series {metric}"));
        }
        let has_labels = all.iter().any(|l| {
            refs.labels
                .iter()
                .filter(|n| !TARGET_LABELS.contains(&n.as_str()))
                .all(|n| l.contains_key(n))
        });
        if !has_labels {
            return Err(format!("no {metric} series with labels {:?}", refs.labels));
        }
    }
    Ok(())
}

fn panels(value: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
    for panel in value["panels"].as_array().into_iter().flatten() {
        if panel["type"] == "row" {
            panels(panel, out);
        } else {
            out.push(panel.clone());
        }
    }
}

#[test]
fn grafana_dashboard_panels_find_their_series() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/grafana/dcgm-exporter-dashboard.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let (openmetrics, _) = scrape();
    let scrape = parse(openmetrics);

    // Template variables (`$instance`, `$gpu`): their queries' series and labels.
    let mut variables = 0;
    for var in dashboard["templating"]["list"].as_array().expect("templating") {
        if var["type"] != "query" {
            continue;
        }
        let query = var["query"]
            .as_str()
            .or_else(|| var["query"]["query"].as_str())
            .expect("a query");
        let mut refs = Refs::default();
        template_refs(query, &mut refs);
        if let Err(why) = check(&scrape, &refs) {
            panic!("variable {}: {why}", var["name"]);
        }
        variables += 1;
    }
    assert_eq!(variables, 2, "the instance and gpu variables");

    let mut all = Vec::new();
    panels(&dashboard, &mut all);
    let mut titles = Vec::new();
    for panel in &all {
        let title = panel["title"].as_str().expect("title").to_string();
        let mut refs = Refs::default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            promql_refs(target["expr"].as_str().unwrap_or_default(), &mut refs);
            legend_labels(target["legendFormat"].as_str().unwrap_or_default(), &mut refs);
        }
        // "Tensor Core Utilization" reads DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, from NVML GPM on the
        // H100 (two readings intervals make it).
        if let Err(why) = check(&scrape, &refs) {
            panic!("panel {title:?}: {why}");
        }
        titles.push(title);
    }
    assert_eq!(
        titles,
        [
            "GPU Temperature",
            "GPU Avg. Temp",
            "GPU Power Usage",
            "GPU Power Total",
            "GPU SM Clocks",
            "GPU Utilization",
            "GPU Framebuffer Mem Used",
            "Tensor Core Utilization",
        ],
        "every panel of the dashboard is checked"
    );
}

#[test]
fn promql_references_are_read() {
    let mut refs = Refs::default();
    promql_refs(
        r#"sum by (gpu, Hostname) (rate(DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", UUID!="x"}[$__rate_interval])) * 100 / on(gpu) group_left DCGM_FI_DEV_FB_USED"#,
        &mut refs,
    );
    assert_eq!(
        refs.metrics.iter().collect::<Vec<_>>(),
        ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL"]
    );
    assert_eq!(
        refs.labels.iter().collect::<Vec<_>>(),
        ["Hostname", "UUID", "gpu", "instance"]
    );
    let mut refs = Refs::default();
    template_refs("label_values(DCGM_FI_DEV_GPU_TEMP, gpu)", &mut refs);
    assert_eq!(refs.metrics.iter().collect::<Vec<_>>(), ["DCGM_FI_DEV_GPU_TEMP"]);
    assert_eq!(refs.labels.iter().collect::<Vec<_>>(), ["gpu"]);
}
