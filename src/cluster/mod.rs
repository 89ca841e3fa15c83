//! The agent's link to whatever tells it what to do and hears what it did: its Node through the
//! API server (labels read by watch or poll; state and feature labels, and Events, written
//! back), a labels file for hosts outside Kubernetes, or nothing (the config's defaults).

pub mod events;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::desired::{Source, parse_labels_file};
use crate::host::HostRoot;
use crate::host::backoff::Backoff;
use crate::kube::{self, EventType, KubeClient, NodeView};
use crate::labels::report::{OwnedLabels, label_patch};
use crate::metrics::Metrics;

/// The labels the agent wants on its Node; `None` until it has said once.
type WantedLabels = Option<BTreeMap<String, String>>;
/// An Event to post: type, reason, message (the node is filled in when posting).
type EventRequest = (EventType, String, String);

/// How often the labels file is checked for changes (one `stat`).
const LABELS_FILE_CHECK: Duration = Duration::from_secs(1);

/// The labels the desired state is read from, and the state of the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelsView {
    pub source: Source,
    /// Where from, for a person: `node gpu-1 (kubeconfig /etc/kubernetes/kubelet.conf)`, a
    /// file path, or why there is no source.
    pub detail: String,
    pub labels: BTreeMap<String, String>,
    /// The source answers (the API server is reachable, the file is readable).
    pub connected: bool,
    /// The last error talking to the source.
    pub error: Option<String>,
}

/// The running link.
pub struct Link {
    pub view: watch::Receiver<LabelsView>,
    /// Labels the agent wants on its Node; `None` when there is no Node to write to.
    report: Option<watch::Sender<WantedLabels>>,
    events: Option<mpsc::UnboundedSender<EventRequest>>,
    /// The runtime handlers the agent wants RuntimeClasses for.
    classes: Option<watch::Sender<Vec<String>>>,
    /// What is missing when the agent may not create them, for status.
    classes_note: Option<watch::Receiver<Option<String>>>,
    /// Keeps a fixed view's sender alive, so `view.changed()` waits instead of failing.
    _fixed: Option<watch::Sender<LabelsView>>,
}

impl Link {
    /// Asks for these labels on the Node (sent only when they differ from what is there).
    pub fn report(&self, labels: BTreeMap<String, String>) {
        if let Some(tx) = &self.report {
            tx.send_if_modified(|current| {
                let changed = current.as_ref() != Some(&labels);
                *current = Some(labels);
                changed
            });
        }
    }

    /// Asks for a RuntimeClass per handler (`nvidia`, `nvidia-cdi`, ...), created once the API
    /// server is reachable unless it exists; see [`ensure_runtime_classes`].
    pub fn runtime_classes(&self, handlers: Vec<String>) {
        if let Some(tx) = &self.classes {
            tx.send_if_modified(|current| {
                let changed = *current != handlers;
                *current = handlers;
                changed
            });
        }
    }

    /// The RuntimeClasses the agent may not create, in words for status; `None` when there is
    /// nothing to say.
    pub fn runtime_class_note(&self) -> Option<String> {
        self.classes_note.as_ref().and_then(|rx| rx.borrow().clone())
    }

    /// Posts a Kubernetes Event on the Node (best effort; dropped without a Node). Repeats are
    /// aggregated as the kubelet's are: one Event object per type and reason for 10 minutes,
    /// whose `count` the repeats raise, with writes rate-limited per node (see [`events`]).
    pub fn event(&self, kind: EventType, reason: &str, message: String) {
        if let Some(tx) = &self.events {
            let _ = tx.send((kind, reason.to_string(), message));
        }
    }
}

/// How often credentials are looked for again while there are none (a node that joins the
/// cluster after the agent started: cloud-init, `kubeadm join` after the package install).
const DISCOVER_AGAIN: Duration = Duration::from_secs(10);

/// Starts the link the config asks for. Never fails: without a source the agent runs on its
/// config and the view says why. With `[kubernetes] enabled` but no credentials yet (or broken
/// ones), they are looked for again every [`DISCOVER_AGAIN`]; once found, the Node becomes the
/// source (unless a labels file is) and reporting starts, without a restart.
pub fn start(config: &Config, root: &HostRoot, metrics: Option<Metrics>) -> Link {
    start_with(config, root, metrics, Timing::default())
}

/// The link's own intervals (those not in the config): the defaults in production; the fleet
/// bench divides them all by its time scale, with the `[kubernetes]` ones, to run a simulated
/// hour in a minute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Every interval is divided by this (1 in production).
    pub scale: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing { scale: 1.0 }
    }
}

impl Timing {
    /// Every interval divided by `scale`.
    pub fn scaled(scale: f64) -> Timing {
        Timing { scale }
    }

    /// `d` at this time scale.
    pub fn of(&self, d: Duration) -> Duration {
        d.div_f64(self.scale)
    }
}

/// [`start`] with the link's own intervals given (see [`Timing`]): the Kubernetes side of one
/// node as a component with its inputs injected (its config, its root, its timing), so that a
/// process can run many (`cargo bench --bench fleet` runs thousands against one API server).
pub fn start_with(config: &Config, root: &HostRoot, metrics: Option<Metrics>, timing: Timing) -> Link {
    let k = &config.kubernetes;
    let labels_file = !config.desired.labels_file.as_os_str().is_empty();
    if !k.enabled && !labels_file {
        let why = "[kubernetes] enabled = false and no [desired] labels_file: running on the config's defaults";
        tracing::warn!("{why}");
        return none_link(why.to_string());
    }
    let client = if k.enabled {
        discover_client(config, root, &metrics)
    } else {
        Err(String::new())
    };
    let (view_tx, view_rx) = watch::channel(match (&client, labels_file) {
        (_, true) => LabelsView {
            source: Source::File,
            detail: config.desired.labels_file.display().to_string(),
            labels: BTreeMap::new(),
            connected: false,
            error: None,
        },
        (Ok(_), false) => LabelsView {
            source: Source::Node,
            detail: String::new(),
            labels: BTreeMap::new(),
            connected: false,
            error: None,
        },
        (Err(why), false) => LabelsView {
            source: Source::None,
            detail: format!("{why}; looking again every {DISCOVER_AGAIN:?}, running on the config's defaults"),
            labels: BTreeMap::new(),
            connected: false,
            error: None,
        },
    });
    if labels_file {
        let path = root.join(&config.desired.labels_file);
        let shown = config.desired.labels_file.display().to_string();
        tokio::spawn(watch_labels_file(path, shown, view_tx.clone()));
    }
    if !k.enabled {
        return Link {
            view: view_rx,
            report: None,
            events: None,
            classes: None,
            classes_note: None,
            _fixed: Some(view_tx),
        };
    }
    // Labels and Events wait in their channels until a Node can take them.
    let (report_tx, report_rx) = watch::channel(None);
    let (event_tx, event_rx) = mpsc::unbounded_channel();
    let (classes_tx, classes_rx) = watch::channel(Vec::new());
    let (note_tx, note_rx) = watch::channel(None);
    let node_view = (!labels_file).then(|| view_tx.clone());
    let reporting = Reporting {
        report_rx,
        event_rx,
        classes_rx,
        class_events: event_tx.clone(),
        class_note: note_tx,
        timing,
    };
    match client {
        Ok(client) => connect(client, config, root, node_view, reporting),
        Err(why) => {
            tracing::warn!("{why}; looking for Kubernetes credentials again every {DISCOVER_AGAIN:?}");
            tokio::spawn(discover_later(
                config.clone(),
                root.clone(),
                why,
                node_view,
                reporting,
                metrics,
            ));
        }
    }
    Link {
        view: view_rx,
        report: Some(report_tx),
        events: Some(event_tx),
        classes: Some(classes_tx),
        classes_note: Some(note_rx),
        _fixed: Some(view_tx),
    }
}

/// The API client from the credentials found now, or why there is none.
fn discover_client(config: &Config, root: &HostRoot, metrics: &Option<Metrics>) -> Result<KubeClient, String> {
    let k = &config.kubernetes;
    match kube::discover(k, root) {
        Ok(Some(credentials)) => KubeClient::new(credentials, k)
            .map(|client| match metrics.clone() {
                // Every API response is counted in the agent's metrics, when they are on.
                Some(m) => client.with_response_observer(Arc::new(move |verb, code| m.api_request(verb, code))),
                None => client,
            })
            .map_err(|e| format!("cannot build the Kubernetes API client: {e}")),
        Ok(None) => Err(
            "no Kubernetes credentials found (no [kubernetes] kubeconfig, $KUBECONFIG, kubelet \
                         kubeconfig or in-cluster service account)"
                .to_string(),
        ),
        Err(e) => Err(format!("Kubernetes credentials: {e}")),
    }
}

/// What the agent asked to be written to its Node, waiting for a client.
struct Reporting {
    /// The link's own intervals.
    timing: Timing,
    report_rx: watch::Receiver<WantedLabels>,
    event_rx: mpsc::UnboundedReceiver<EventRequest>,
    classes_rx: watch::Receiver<Vec<String>>,
    /// Where [`ensure_runtime_classes`] posts its Warning.
    class_events: mpsc::UnboundedSender<EventRequest>,
    /// Where it says, for status, which RuntimeClasses it may not create.
    class_note: watch::Sender<Option<String>>,
}

/// Watches the Node (forwarding its labels into `node_view` when the Node is the source) and
/// starts writing labels and Events to it.
fn connect(
    client: KubeClient,
    config: &Config,
    root: &HostRoot,
    node_view: Option<watch::Sender<LabelsView>>,
    reporting: Reporting,
) {
    let k = &config.kubernetes;
    let node_name = kube::node_name(k, root);
    let (node_rx, _task) = kube::spawn_node_watcher(client.clone(), node_name.clone(), k);
    if let Some(tx) = node_view {
        let detail = format!("node {node_name} ({})", client.credentials().summary());
        tx.send_replace(node_labels_view(&node_rx.borrow(), &detail));
        tokio::spawn(forward_node_view(node_rx.clone(), detail, tx));
    }
    start_reporter(client, node_name, node_rx, config, root, reporting);
}

/// Looks for credentials every [`DISCOVER_AGAIN`] until some work, then connects. Says each
/// new reason once.
async fn discover_later(
    config: Config,
    root: HostRoot,
    mut why: String,
    node_view: Option<watch::Sender<LabelsView>>,
    reporting: Reporting,
    metrics: Option<Metrics>,
) {
    loop {
        tokio::time::sleep(reporting.timing.of(DISCOVER_AGAIN)).await;
        if node_view.as_ref().is_some_and(|tx| tx.is_closed()) {
            return;
        }
        match discover_client(&config, &root, &metrics) {
            Ok(client) => {
                tracing::info!(
                    "Kubernetes credentials found ({}): the Node is now in the loop",
                    client.credentials().summary()
                );
                return connect(client, &config, &root, node_view, reporting);
            }
            Err(now) if now != why => {
                tracing::warn!("{now}; looking again every {DISCOVER_AGAIN:?}");
                if let Some(tx) = &node_view {
                    tx.send_modify(|view| {
                        view.detail =
                            format!("{now}; looking again every {DISCOVER_AGAIN:?}, running on the config's defaults")
                    });
                }
                why = now;
            }
            Err(_) => {}
        }
    }
}

fn none_link(why: String) -> Link {
    let (tx, rx) = watch::channel(LabelsView {
        source: Source::None,
        detail: why,
        labels: BTreeMap::new(),
        connected: false,
        error: None,
    });
    Link {
        view: rx,
        report: None,
        events: None,
        classes: None,
        classes_note: None,
        _fixed: Some(tx),
    }
}

fn node_labels_view(node: &NodeView, detail: &str) -> LabelsView {
    LabelsView {
        source: Source::Node,
        detail: detail.to_string(),
        labels: node.node.as_ref().map(|n| n.labels.clone()).unwrap_or_default(),
        connected: node.connected,
        error: node.error.clone(),
    }
}

async fn forward_node_view(mut node_rx: watch::Receiver<NodeView>, detail: String, tx: watch::Sender<LabelsView>) {
    while node_rx.changed().await.is_ok() {
        let view = node_labels_view(&node_rx.borrow_and_update(), &detail);
        tx.send_if_modified(|current| {
            let changed = *current != view;
            *current = view;
            changed
        });
    }
}

/// Re-reads the labels file whenever its size, mtime or inode change.
async fn watch_labels_file(path: PathBuf, shown: String, tx: watch::Sender<LabelsView>) {
    use std::os::unix::fs::MetadataExt;
    let mut seen: Option<(u64, u64, SystemTime)> = None;
    let mut first = true;
    loop {
        let stamp = std::fs::metadata(&path)
            .ok()
            .map(|m| (m.ino(), m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)));
        if stamp != seen || first {
            first = false;
            seen = stamp;
            let update = match crate::host::read_text(&path) {
                Ok(text) => match parse_labels_file(&shown, &text) {
                    Ok(labels) => Ok(labels),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(format!("cannot read the labels file {shown}: {e}")),
            };
            tx.send_modify(|view| match update {
                Ok(labels) => {
                    tracing::info!("labels file {shown}: {} label(s)", labels.len());
                    view.labels = labels;
                    view.connected = true;
                    view.error = None;
                }
                Err(e) => {
                    // Keep the last good labels: a half-written file must not undo anything.
                    tracing::warn!("{e}; keeping the labels read before");
                    view.connected = false;
                    view.error = Some(e);
                }
            });
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(LABELS_FILE_CHECK).await;
    }
}

/// Writes the wanted labels to the Node whenever they, or the Node's own labels, change, and
/// posts Events. Sends nothing when the Node already carries the wanted labels.
fn start_reporter(
    client: KubeClient,
    node_name: String,
    node_rx: watch::Receiver<NodeView>,
    config: &Config,
    root: &HostRoot,
    reporting: Reporting,
) {
    let owned = OwnedLabels::load(&root.join(&config.agent.state_dir));
    let backoff = Backoff::new(config.kubernetes.backoff_min, config.kubernetes.backoff_max);
    tokio::spawn(report_labels(
        client.clone(),
        node_name.clone(),
        node_rx.clone(),
        reporting.report_rx,
        owned,
        backoff,
    ));
    tokio::spawn(ensure_runtime_classes(
        reporting.timing.of(RUNTIME_CLASS_RETRY),
        client.clone(),
        reporting.classes_rx,
        reporting.class_events,
        reporting.class_note,
    ));
    if config.kubernetes.events {
        let backoff = Backoff::new(config.kubernetes.backoff_min, config.kubernetes.backoff_max);
        let policy = events::Policy::default().scaled(reporting.timing.scale);
        tokio::spawn(post_events(
            client,
            node_name,
            node_rx,
            reporting.event_rx,
            policy,
            backoff,
        ));
    }
}

/// How long after a failure (other than 403) creating RuntimeClasses is tried again (plus up to
/// a fifth, at random, so that a fleet's retries do not line up).
const RUNTIME_CLASS_RETRY: Duration = Duration::from_secs(60);

/// The manifest of a RuntimeClass per handler, for a cluster admin to apply.
pub fn runtime_class_manifest(handlers: &[String]) -> String {
    handlers
        .iter()
        .map(|h| format!("apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata:\n  name: {h}\nhandler: {h}\n"))
        .collect::<Vec<_>>()
        .join("---\n")
}

/// Creates a RuntimeClass for each handler the agent asks for, unless one of that name exists
/// (pods that name `runtimeClassName: nvidia` need it; pods without one get the engine's
/// default runtime). Node credentials usually may not create RuntimeClasses: then a Warning
/// Event on the Node says exactly what to apply, once per set of handlers. Other failures are
/// tried again a minute later.
async fn ensure_runtime_classes(
    retry_in: Duration,
    client: KubeClient,
    mut wanted: watch::Receiver<Vec<String>>,
    events: mpsc::UnboundedSender<EventRequest>,
    note: watch::Sender<Option<String>>,
) {
    let mut done: Vec<String> = Vec::new();
    loop {
        let handlers = wanted.borrow_and_update().clone();
        let mut forbidden = Vec::new();
        // When to try again after a failure: the retry period plus up to a fifth (so a fleet's
        // retries do not line up), or the server's Retry-After when longer.
        let mut retry: Option<Duration> = None;
        let todo: Vec<&String> = handlers.iter().filter(|h| !done.contains(h)).collect();
        for handler in todo {
            match client.create_runtime_class(handler).await {
                Ok(created) => {
                    if created {
                        tracing::info!("created the RuntimeClass {handler}");
                    }
                    done.push(handler.clone());
                }
                Err(e) if e.status_code() == Some(403) => forbidden.push(handler.clone()),
                Err(e) => {
                    let delay = retry_in
                        .mul_f64(1.0 + fastrand::f64() / 5.0)
                        .max(e.retry_after().unwrap_or_default());
                    tracing::warn!("{e}; trying again in {}s", delay.as_secs());
                    retry = Some(retry.map_or(delay, |d| d.max(delay)));
                }
            }
        }
        if !forbidden.is_empty() {
            let manifest = runtime_class_manifest(&forbidden);
            tracing::warn!(
                "the agent's credentials may not create RuntimeClasses; pods that name runtimeClassName {} need \
                 them: apply\n{manifest}",
                forbidden.join(", ")
            );
            let _ = events.send((
                EventType::Warning,
                "RuntimeClassMissing".to_owned(),
                format!(
                    "pods that name runtimeClassName {} need RuntimeClasses the agent may not create; apply \
                     (kubectl apply -f -):\n{manifest}",
                    forbidden.join(", ")
                ),
            ));
            note.send_modify(|n| {
                *n = Some(format!(
                    "RuntimeClass {} missing: the agent may not create it; apply the manifest of the \
                     RuntimeClassMissing Event on this Node",
                    forbidden.join(", ")
                ));
            });
            done.extend(forbidden);
        }
        let again = async {
            if let Some(delay) = retry {
                tokio::time::sleep(delay).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            r = wanted.changed() => if r.is_err() { return },
            () = again => {}
        }
    }
}

async fn report_labels(
    client: KubeClient,
    node_name: String,
    mut node_rx: watch::Receiver<NodeView>,
    mut wanted_rx: watch::Receiver<WantedLabels>,
    mut owned: OwnedLabels,
    mut backoff: Backoff,
) {
    // Nothing is written before the agent has said what it wants once.
    if wanted_rx.changed().await.is_err() {
        return;
    }
    // After a failed write, nothing is sent before this (the backoff or the server's
    // Retry-After), however often the Node view changes meanwhile.
    let mut not_before: Option<tokio::time::Instant> = None;
    // The Node's resourceVersion a write was made from, and what it asked for: until the view
    // has seen a newer Node (the write's own change, or anyone's), a view change (the
    // connection state, say) must not send the same write again.
    let mut written: Option<(String, BTreeMap<String, String>)> = None;
    loop {
        let wanted = wanted_rx.borrow_and_update().clone().unwrap_or_default();
        let current = node_rx
            .borrow_and_update()
            .node
            .as_ref()
            .map(|n| (n.labels.clone(), n.resource_version.clone()));
        let mut retry_in = None;
        let held = not_before.filter(|t| *t > tokio::time::Instant::now());
        let in_flight = |rv: &String| {
            written
                .as_ref()
                .is_some_and(|(from, asked)| from == rv && *asked == wanted)
        };
        if let Some(at) = held {
            retry_in = Some(at.saturating_duration_since(tokio::time::Instant::now()));
        } else if let Some((current, rv)) = current.filter(|(_, rv)| !in_flight(rv)) {
            let patch = label_patch(&current, &wanted, owned.keys());
            if !patch.is_empty() {
                // Record the union first: a crash after the patch still knows every key written.
                let mut union = owned.keys().clone();
                union.extend(wanted.keys().cloned());
                if let Err(e) = owned.set(union) {
                    tracing::warn!("cannot record owned labels: {e}");
                }
                match client.patch_node_metadata(&node_name, &patch, &BTreeMap::new()).await {
                    Ok(_) => {
                        tracing::info!("node {node_name}: wrote {} label change(s)", patch.len());
                        backoff.reset();
                        not_before = None;
                        written = Some((rv, wanted.clone()));
                        if let Err(e) = owned.set(wanted.keys().cloned().collect()) {
                            tracing::warn!("cannot record owned labels: {e}");
                        }
                    }
                    Err(e) => {
                        let delay = backoff.next_with(e.retry_after());
                        tracing::warn!("node {node_name}: cannot write labels ({e}); retrying in {delay:?}");
                        not_before = Some(tokio::time::Instant::now() + delay);
                        retry_in = Some(delay);
                    }
                }
            }
        }
        let retry = async {
            match retry_in {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = wanted_rx.changed() => if r.is_err() { return },
            r = node_rx.changed() => if r.is_err() { return },
            () = retry => {}
        }
    }
}

/// Posts the Events asked for, aggregated into counts and rate-limited per node with the
/// kubelet's limits ([`events::Policy::default`], at the link's time scale).
async fn post_events(
    client: KubeClient,
    node_name: String,
    node_rx: watch::Receiver<NodeView>,
    requests: mpsc::UnboundedReceiver<EventRequest>,
    policy: events::Policy,
    backoff: Backoff,
) {
    events::run(client, node_name, node_rx, requests, policy, backoff).await;
}
