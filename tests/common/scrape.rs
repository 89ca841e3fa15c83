//! Scraping `/metrics` as Prometheus does, and reading the samples: one HTTP/1.1 request, the
//! OpenMetrics text parsed with prometheus-parse, a sample found by name and exact labels.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use prometheus_parse::{Scrape, Value};

/// What Prometheus sends in `Accept`.
pub const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// A series' labels, name to value.
pub type LabelSet = BTreeMap<String, String>;

/// One request with this `Accept` header (none: like curl or an older scraper): the answer's
/// head and body; an error while nothing answers (or the answer has no head).
pub fn request(addr: SocketAddr, method: &str, path: &str, accept: Option<&str>) -> std::io::Result<(String, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{accept}Connection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("an answer without headers: {raw}")))?;
    Ok((head.to_string(), body.to_string()))
}

/// [`request`], asserted to be answered: (status, content type, body).
pub fn http(addr: SocketAddr, method: &str, path: &str, accept: Option<&str>) -> (u16, String, String) {
    let (head, body) =
        request(addr, method, path, accept).unwrap_or_else(|e| panic!("{method} {path} on the metrics endpoint: {e}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or_default()
        .to_string();
    (status, content_type, body)
}

/// `GET /metrics` with this `Accept`: the body of a 200 answer, `None` while nothing (or
/// something else) answers.
pub fn try_metrics(addr: SocketAddr, accept: Option<&str>) -> Option<String> {
    let (head, body) = request(addr, "GET", "/metrics", accept).ok()?;
    head.starts_with("HTTP/1.1 200").then_some(body)
}

/// `GET /metrics` with this `Accept`, asserted to be a 200 answer: its body.
pub fn get_metrics(addr: SocketAddr, accept: Option<&str>) -> String {
    let (head, body) = request(addr, "GET", "/metrics", accept).expect("GET /metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body
}

/// Parses a scrape with prometheus-parse (lenient: see [`parse_checked`]).
pub fn parse(body: &str) -> Scrape {
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("the scrape parses")
}

/// [`parse`], after checking what that lenient parser does not: every sample belongs to a
/// family declared by a `# TYPE` line (counters as `<name>_total`, histograms as
/// `_bucket`/`_sum`/`_count`), and `# EOF` ends the text.
pub fn parse_checked(body: &str) -> Scrape {
    let mut declared: HashMap<&str, &str> = HashMap::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            declared.insert(name, kind);
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let family_ok = |family: &str, kinds: &[&str]| declared.get(family).is_some_and(|k| kinds.contains(k));
            let ok = family_ok(name, &["gauge", "unknown"])
                || name.strip_suffix("_total").is_some_and(|f| family_ok(f, &["counter"]))
                || ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_suffix(s).is_some_and(|f| family_ok(f, &["histogram"])));
            assert!(ok, "sample {name} has no matching # TYPE line");
        }
    }
    assert_eq!(body.lines().last(), Some("# EOF"));
    parse(body)
}

/// Every sample of `name`: its labels and value (gauge, counter or untyped; another kind panics).
pub fn samples(scrape: &Scrape, name: &str) -> Vec<(LabelSet, f64)> {
    samples_where(scrape, name, |value| match *value {
        Value::Gauge(v) | Value::Counter(v) | Value::Untyped(v) => Some(v),
        _ => None,
    })
}

/// [`samples`] of a gauge: a counter's sample panics too.
pub fn gauges(scrape: &Scrape, name: &str) -> Vec<(LabelSet, f64)> {
    samples_where(scrape, name, |value| match *value {
        Value::Gauge(v) | Value::Untyped(v) => Some(v),
        _ => None,
    })
}

fn samples_where(scrape: &Scrape, name: &str, read: impl Fn(&Value) -> Option<f64>) -> Vec<(LabelSet, f64)> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| {
            let value = read(&s.value).unwrap_or_else(|| panic!("{name}: unexpected value {:?}", s.value));
            (label_set(&s.labels), value)
        })
        .collect()
}

/// The label sets of `name`'s samples (any kind of value).
pub fn series(scrape: &Scrape, name: &str) -> Vec<LabelSet> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| label_set(&s.labels))
        .collect()
}

fn label_set(labels: &prometheus_parse::Labels) -> LabelSet {
    labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// The value of `name` on the series whose labels are exactly `labels`.
pub fn value(scrape: &Scrape, name: &str, labels: &LabelSet) -> Option<f64> {
    samples(scrape, name)
        .into_iter()
        .find(|(l, _)| l == labels)
        .map(|(_, v)| v)
}

/// [`value`] of a gauge: a counter's sample panics.
pub fn gauge_value(scrape: &Scrape, name: &str, labels: &LabelSet) -> Option<f64> {
    gauges(scrape, name)
        .into_iter()
        .find(|(l, _)| l == labels)
        .map(|(_, v)| v)
}

/// A label set from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> LabelSet {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// What a sampler reads its GPUs from: the inventory, sent again when it changes.
pub type InventorySender = tokio::sync::watch::Sender<Option<std::sync::Arc<gpu_node_agent::nvml::Inventory>>>;

/// A sampler of `inventory` whose interval (an hour) never comes during a test: the test calls
/// `tick` itself. With the sender of its inventory (dropping it ends the sampler's watch).
pub fn hand_ticked_sampler(
    gpus: &gpu_node_agent::nvml::Gpus,
    metrics: &gpu_node_agent::metrics::Metrics,
    inventory: gpu_node_agent::nvml::Inventory,
    hostname: &str,
    pod_resources_socket: Option<std::path::PathBuf>,
) -> (gpu_node_agent::metrics::Sampler, InventorySender) {
    let (inventory_tx, inventory_rx) = tokio::sync::watch::channel(Some(std::sync::Arc::new(inventory)));
    let sampler = gpu_node_agent::metrics::Sampler::new(
        gpus.clone(),
        metrics.clone(),
        inventory_rx,
        gpu_node_agent::metrics::SamplerConfig {
            interval: Duration::from_secs(3600),
            hostname: hostname.into(),
            pod_resources_socket,
        },
    );
    (sampler, inventory_tx)
}

/// A test kubelet on the node's `/var/lib/kubelet` serving the pod-resources API: the kubelet
/// and the API's socket, for a sampler's pod labels.
pub async fn kubelet_with_pod_resources(node: &super::Node) -> (test_kubelet::TestKubelet, std::path::PathBuf) {
    let kubelet_root = node.root.join("var/lib/kubelet");
    let kubelet = test_kubelet::TestKubelet::start(
        &kubelet_root.join("device-plugins"),
        test_kubelet::KubeletOptions::default(),
    )
    .await
    .expect("test kubelet");
    let socket = kubelet.serve_pod_resources(&kubelet_root).expect("pod-resources");
    (kubelet, socket)
}
