//! The Node watcher: keeps a [`NodeView`] of the agent's own Node current, for the reconcile
//! loop to read and wait on.
//!
//! With `kubernetes.watch` (the default):
//! 1. LIST the Node by name (`resourceVersion=0`, from the API server's cache) for its state and
//!    the list's resourceVersion (not the Node's own: after an API server restart that can be
//!    older than the new watch cache, and a watch from it would get 410 again and again);
//! 2. watch from that resourceVersion. ADDED/MODIFIED update the view, BOOKMARK only moves the
//!    resourceVersion; when the server ends the watch at `timeoutSeconds`, watch again from the
//!    last resourceVersion, without a GET. `timeoutSeconds` is random between `watch_timeout`
//!    and twice that (as client-go's reflectors do), so a fleet's renewals do not line up. At
//!    steady state that is one request per 1.5 `watch_timeout` on average (8 an hour with the
//!    default 5 minutes) and nothing else;
//! 3. 410 Gone (as an HTTP status or an ERROR event): LIST again (a quorum read, so the new
//!    resourceVersion is not stale) and watch from there. A 410 again before the new watch
//!    delivered anything backs off first: never a relist loop;
//! 4. any other failure: back off (jittered; a longer `Retry-After` wins) and watch again,
//!    and while the watch cannot be established poll with a GET every `poll_interval`. Every
//!    retry waits at least a random time of up to `reconnect_jitter` (and at least the
//!    backoff's step), so that the nodes of a fleet whose watches all broke at once (an API
//!    server restart) come back spread over that window after the server answers again, not
//!    piled up at the moment it does;
//! 5. DELETED, or a 404: the view loses the Node; GET with backoff until it is back.
//!
//! Without `kubernetes.watch`: a GET (`resourceVersion=0`) every `poll_interval` (plus up to a
//! fifth of it, at random, so that polls do not line up across nodes), backing off on errors.
//!
//! The view is published only when something the agent reacts to changes: the Node's name,
//! uid, labels or annotations, the connection state, the error text, or the mode. A status
//! update of the Node changes its resourceVersion only and wakes no one.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::KubernetesConfig;

use super::client::KubeClient;
use super::error::{ApiFailure, HttpFailure, KubeError};
use super::node::Node;
use super::watch::{WatchEvent, WatchStream};
use crate::host::backoff::Backoff;

/// A watch that lasted this long (or half the watch timeout, if shorter) was healthy: the
/// backoff starts over after it.
const HEALTHY_WATCH: Duration = Duration::from_secs(30);

/// What the agent knows about its Node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// The Node as last seen; `None` before the first successful read, or when it does not
    /// exist (deleted, or not registered yet).
    pub node: Option<Node>,
    /// Whether the last attempt to read or watch the Node worked, so `node` is current.
    pub connected: bool,
    /// The last problem, for status and logs. It can be set while `connected` (the watch
    /// failed, polling works).
    pub error: Option<String>,
    /// How the Node is followed right now.
    pub mode: SyncMode,
}

/// How the Node is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// A watch is established (or being re-established after its normal end).
    Watch,
    /// GET every `poll_interval` (configured, or while a watch cannot be established).
    Poll,
}

impl SyncMode {
    /// `watch` or `poll`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncMode::Watch => "watch",
            SyncMode::Poll => "poll",
        }
    }
}

impl std::fmt::Display for SyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl NodeView {
    /// Equal in everything the agent reacts to (not the resourceVersion).
    fn same_as(&self, other: &NodeView) -> bool {
        let nodes_same = match (&self.node, &other.node) {
            (Some(a), Some(b)) => a.same_metadata(b),
            (None, None) => true,
            _ => false,
        };
        nodes_same && self.connected == other.connected && self.error == other.error && self.mode == other.mode
    }
}

/// The reads the watcher needs; [`KubeClient`] is the real one, tests script a fake.
pub trait NodeApi: Send + Sync + 'static {
    /// See [`KubeClient::get_node`].
    fn get_node(&self, name: &str, from_cache: bool) -> impl Future<Output = Result<Node, KubeError>> + Send;
    /// See [`KubeClient::list_node`].
    fn list_node(&self, name: &str, from_cache: bool)
    -> impl Future<Output = Result<(Node, String), KubeError>> + Send;
    /// See [`KubeClient::watch_node`].
    fn watch_node(
        &self,
        name: &str,
        resource_version: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<WatchStream, KubeError>> + Send;
}

impl NodeApi for KubeClient {
    fn get_node(&self, name: &str, from_cache: bool) -> impl Future<Output = Result<Node, KubeError>> + Send {
        KubeClient::get_node(self, name, from_cache)
    }

    fn list_node(
        &self,
        name: &str,
        from_cache: bool,
    ) -> impl Future<Output = Result<(Node, String), KubeError>> + Send {
        KubeClient::list_node(self, name, from_cache)
    }

    fn watch_node(
        &self,
        name: &str,
        resource_version: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<WatchStream, KubeError>> + Send {
        KubeClient::watch_node(self, name, resource_version, timeout)
    }
}

/// Starts following the Node `name`. The receiver holds the current view; the task runs
/// until aborted.
pub fn spawn_node_watcher(
    client: KubeClient,
    name: String,
    cfg: &KubernetesConfig,
) -> (watch::Receiver<NodeView>, tokio::task::JoinHandle<()>) {
    spawn_node_watcher_with(client, name, cfg)
}

/// [`spawn_node_watcher`] over any [`NodeApi`].
pub fn spawn_node_watcher_with<A: NodeApi>(
    api: A,
    name: String,
    cfg: &KubernetesConfig,
) -> (watch::Receiver<NodeView>, tokio::task::JoinHandle<()>) {
    let mode = if cfg.watch { SyncMode::Watch } else { SyncMode::Poll };
    let (tx, rx) = watch::channel(NodeView {
        node: None,
        connected: false,
        error: None,
        mode,
    });
    let watcher = Watcher {
        api,
        name,
        watch: cfg.watch,
        poll_interval: cfg.poll_interval,
        watch_timeout: cfg.watch_timeout,
        backoff: Backoff::new(cfg.backoff_min, cfg.backoff_max),
        reconnect_jitter: cfg.reconnect_jitter.min(cfg.backoff_max),
        gone_streak: 0,
        tx,
        resource_version: String::new(),
        next_poll: None,
        last_logged: None,
    };
    let task = tokio::spawn(watcher.run());
    (rx, task)
}

/// What to do next.
enum Step {
    /// GET the Node; `quorum`: not from the cache (after a 410).
    List { quorum: bool },
    /// Watch from the last resourceVersion.
    Watch,
}

/// How a watch stream ended.
enum End {
    /// The server closed it (normally at `timeoutSeconds`).
    Closed,
    /// The resourceVersion expired.
    Gone,
    /// The Node was deleted.
    Deleted,
    /// An error event or a broken stream.
    Failed(KubeError),
}

struct Watcher<A> {
    api: A,
    name: String,
    watch: bool,
    poll_interval: Duration,
    watch_timeout: Duration,
    backoff: Backoff,
    /// The window every retry is spread over.
    reconnect_jitter: Duration,
    /// 410s in a row without a watch that delivered anything in between.
    gone_streak: u32,
    tx: watch::Sender<NodeView>,
    resource_version: String,
    /// When to poll next, while the watch cannot be established.
    next_poll: Option<Instant>,
    /// The last error logged at warn level (repeats go to debug), `None` while healthy.
    last_logged: Option<String>,
}

impl<A: NodeApi> Watcher<A> {
    async fn run(mut self) {
        if !self.watch {
            return self.poll_forever().await;
        }
        let mut step = Step::List { quorum: false };
        loop {
            step = match step {
                Step::List { quorum } => self.list(quorum).await,
                Step::Watch => self.watch_once().await,
            };
        }
    }

    async fn poll_forever(&mut self) {
        loop {
            match self.api.get_node(&self.name, true).await {
                Ok(node) => {
                    self.on_node(node);
                    self.healthy(SyncMode::Poll);
                    self.backoff.reset();
                    tokio::time::sleep(poll_delay(self.poll_interval)).await;
                }
                Err(e) => {
                    let delay = self.retry_delay(&e);
                    self.failed(&e, delay, None);
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn list(&mut self, quorum: bool) -> Step {
        match self.api.list_node(&self.name, !quorum).await {
            Ok((node, list_rv)) => {
                self.on_node(node);
                self.resource_version = list_rv;
                self.publish(|v| {
                    v.connected = true;
                    v.error = None;
                });
                Step::Watch
            }
            Err(e) => {
                let delay = self.retry_delay(&e);
                self.failed(&e, delay, None);
                tokio::time::sleep(delay).await;
                Step::List { quorum }
            }
        }
    }

    async fn watch_once(&mut self) -> Step {
        let started = Instant::now();
        let timeout = watch_timeout(self.watch_timeout);
        let mut stream = match self.api.watch_node(&self.name, &self.resource_version, timeout).await {
            Ok(stream) => stream,
            Err(e) if e.is_gone() => {
                tracing::debug!(node = %self.name, "resourceVersion {:?} expired; reading the Node again", self.resource_version);
                return self.relist_after_gone().await;
            }
            Err(e) => {
                self.fall_back(&e).await;
                return Step::Watch;
            }
        };
        self.healthy(SyncMode::Watch);
        let mut events = 0usize;
        let end = loop {
            match stream.next().await {
                None => break End::Closed,
                Some(Err(e)) => break End::Failed(e),
                Some(Ok(event)) => {
                    events += 1;
                    if !matches!(event, WatchEvent::Gone) {
                        self.gone_streak = 0;
                    }
                    match event {
                        WatchEvent::Added(node) | WatchEvent::Modified(node) => {
                            self.resource_version.clone_from(&node.resource_version);
                            self.on_node(node);
                        }
                        WatchEvent::Bookmark { resource_version } => self.resource_version = resource_version,
                        WatchEvent::Deleted(_) => break End::Deleted,
                        WatchEvent::Gone => break End::Gone,
                        WatchEvent::Error(status) => {
                            break End::Failed(KubeError::WatchNode {
                                name: self.name.clone(),
                                path: "(watch stream ERROR event)".into(),
                                failure: ApiFailure::Http(Box::new(HttpFailure {
                                    code: status.code,
                                    retry_after: status.retry_after_seconds.map(Duration::from_secs),
                                    status: Some(status),
                                    body: String::new(),
                                })),
                            });
                        }
                    }
                }
            }
        };
        let lasted = started.elapsed();
        if lasted >= HEALTHY_WATCH.min(self.watch_timeout / 2) {
            self.backoff.reset();
            self.gone_streak = 0;
        }
        match end {
            End::Closed if events == 0 && lasted < Duration::from_secs(1).min(self.watch_timeout / 2) => {
                // A server (or proxy) that ends watches at once would otherwise be hammered.
                let delay = self.backoff.next();
                tracing::debug!(node = %self.name, "watch ended at once; watching again in {}", secs(delay));
                tokio::time::sleep(delay).await;
                Step::Watch
            }
            End::Closed if lasted < timeout.mul_f64(0.9) => {
                // Ended cleanly but long before its timeoutSeconds: the API server going away
                // gracefully (a rolling restart) ends every node's watch at once. Come back
                // spread over the reconnect window, not together.
                let delay = spread(Duration::ZERO, self.reconnect_jitter);
                tracing::debug!(node = %self.name, "watch ended early; watching again in {}", secs(delay));
                tokio::time::sleep(delay).await;
                Step::Watch
            }
            End::Closed => Step::Watch,
            End::Gone => {
                tracing::debug!(node = %self.name, "watch: resourceVersion expired; reading the Node again");
                self.relist_after_gone().await
            }
            End::Deleted => {
                let delay = self.backoff.next();
                let text = format!(
                    "node {:?} was deleted; waiting for it to be registered again",
                    self.name
                );
                tracing::warn!(node = %self.name, "{text}");
                self.last_logged = Some(text.clone());
                self.publish(|v| {
                    v.node = None;
                    v.error = Some(text);
                });
                tokio::time::sleep(delay).await;
                Step::List { quorum: false }
            }
            End::Failed(e) => {
                self.fall_back(&e).await;
                Step::Watch
            }
        }
    }

    /// After a 410: one relist (a quorum GET). A second 410 before any watch delivered an event
    /// (a server that keeps expiring what it just served) waits out the backoff first.
    async fn relist_after_gone(&mut self) -> Step {
        self.gone_streak += 1;
        if self.gone_streak > 1 {
            let delay = self.backoff.next();
            tracing::debug!(node = %self.name, "410 again right after a relist; reading the Node again in {}", secs(delay));
            tokio::time::sleep(delay).await;
        }
        Step::List { quorum: true }
    }

    /// The delay before retrying after `e`: the backoff's next step (a longer `Retry-After`
    /// wins), or a random time of up to `reconnect_jitter` when that is longer.
    fn retry_delay(&mut self, e: &KubeError) -> Duration {
        spread(self.backoff.next_with(e.retry_after()), self.reconnect_jitter)
    }

    /// After a failed watch: wait out the backoff, polling every `poll_interval` meanwhile.
    async fn fall_back(&mut self, e: &KubeError) {
        let delay = self.retry_delay(e);
        let watch_error = self.failed(e, delay, Some(SyncMode::Poll));
        let resume_at = Instant::now() + delay;
        let poll_interval = self.poll_interval;
        // The first poll at a random point of the interval's last fifth, the next ones each an
        // interval plus up to a fifth: nodes whose watches broke together do not poll together.
        let mut poll_at = *self
            .next_poll
            .get_or_insert_with(|| Instant::now() + poll_delay(poll_interval));
        while poll_at <= resume_at {
            tokio::time::sleep_until(poll_at).await;
            self.poll_once(&watch_error).await;
            poll_at = Instant::now() + poll_delay(poll_interval);
            self.next_poll = Some(poll_at);
        }
        tokio::time::sleep_until(resume_at).await;
    }

    async fn poll_once(&mut self, watch_error: &str) {
        match self.api.get_node(&self.name, true).await {
            Ok(node) => {
                self.on_node(node);
                let error = format!("{watch_error}; polling every {}", secs(self.poll_interval));
                self.publish(|v| {
                    v.connected = true;
                    v.error = Some(error);
                });
            }
            Err(e) => {
                let delay = self.poll_interval;
                self.failed(&e, delay, None);
            }
        }
    }

    /// The Node as read: publish it if it changed in what the agent reacts to. The
    /// resourceVersion to watch from is not taken from here: only from a list, a watch event or
    /// a bookmark (a polled Node's own resourceVersion can be older than the API server's watch
    /// cache, and a watch from it would get 410).
    fn on_node(&mut self, node: Node) -> bool {
        self.publish(|v| v.node = Some(node))
    }

    /// A read or watch worked.
    fn healthy(&mut self, mode: SyncMode) {
        if mode == SyncMode::Watch {
            self.next_poll = None;
        }
        if self.last_logged.take().is_some() {
            tracing::info!(node = %self.name, "following the Node again ({mode})");
        }
        self.publish(|v| {
            v.connected = true;
            v.error = None;
            v.mode = mode;
        });
    }

    /// Logs a failure (warn the first time, debug for repeats) and publishes it. Returns the
    /// text shown.
    fn failed(&mut self, e: &KubeError, retry_in: Duration, mode: Option<SyncMode>) -> String {
        let text = self.describe(e);
        if self.last_logged.as_deref() == Some(text.as_str()) {
            tracing::debug!(node = %self.name, "{text}; retrying in {}", secs(retry_in));
        } else {
            tracing::warn!(node = %self.name, "{text}; retrying in {}", secs(retry_in));
            self.last_logged = Some(text.clone());
        }
        let not_found = e.is_not_found();
        let shown = text.clone();
        self.publish(|v| {
            v.connected = false;
            v.error = Some(shown);
            if not_found {
                v.node = None;
            }
            if let Some(mode) = mode {
                v.mode = mode;
            }
        });
        text
    }

    fn describe(&self, e: &KubeError) -> String {
        if e.is_not_found() {
            format!(
                "node {:?} not found: is kubernetes.node_name (or $NODE_NAME, or the hostname) this node's name, \
                 and has the kubelet registered it? ({e})",
                self.name
            )
        } else if e.is_unauthorized() {
            format!("{e} (the credentials were refreshed and are still rejected)")
        } else {
            e.to_string()
        }
    }

    /// Applies `change` to the view and wakes receivers only if it changed what they react to.
    fn publish(&self, change: impl FnOnce(&mut NodeView)) -> bool {
        self.tx.send_if_modified(|view| {
            let before = view.clone();
            change(view);
            !view.same_as(&before)
        })
    }
}

/// A retry delay: `backoff` (the backoff's step, or a longer `Retry-After`), or a uniformly
/// random time in `[0, jitter]` when that is longer. While the server is down every node keeps
/// drawing a fresh point in the window, so once it answers they arrive spread over the window
/// rather than all at the next backoff step.
pub(crate) fn spread(backoff: Duration, jitter: Duration) -> Duration {
    if jitter.is_zero() {
        return backoff;
    }
    let spread = Duration::from_nanos(fastrand::u64(..=u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX)));
    backoff.max(spread)
}

/// One watch request's `timeoutSeconds`: random in `[watch_timeout, 2 × watch_timeout)`, as
/// client-go's reflectors pick theirs, so that renewals spread out instead of following one
/// shared period across a fleet.
pub(crate) fn watch_timeout(watch_timeout: Duration) -> Duration {
    watch_timeout.mul_f64(1.0 + fastrand::f64())
}

/// The wait before the next poll: `poll_interval` plus up to a fifth of it, at random (never
/// shorter than configured, so the request budget holds).
fn poll_delay(poll_interval: Duration) -> Duration {
    poll_interval.mul_f64(1.0 + fastrand::f64() / 5.0)
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::error::ApiStatus;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Get { from_cache: bool },
        Watch { rv: String },
    }

    enum Item {
        Event(WatchEvent),
        Fail(KubeError),
        Sleep(Duration),
    }

    enum Script {
        Fail(KubeError),
        Stream(Vec<Item>),
    }

    #[derive(Default)]
    struct State {
        gets: VecDeque<Result<Node, KubeError>>,
        current: Option<Node>,
        watches: VecDeque<Script>,
        calls: Vec<(Instant, Call)>,
        /// The `timeoutSeconds` each watch asked for.
        timeouts: Vec<Duration>,
        /// The resourceVersion lists answer with; `None`: the Node's own.
        list_rv: Option<String>,
    }

    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<State>>);

    impl Fake {
        fn calls(&self) -> Vec<Call> {
            self.0.lock().unwrap().calls.iter().map(|(_, c)| c.clone()).collect()
        }
    }

    impl Fake {
        fn get_now(&self, name: &str, from_cache: bool) -> Result<Node, KubeError> {
            let mut st = self.0.lock().unwrap();
            st.calls.push((Instant::now(), Call::Get { from_cache }));
            match st.gets.pop_front() {
                Some(r) => r,
                None => st.current.clone().ok_or_else(|| http_error(name, 404)),
            }
        }
    }

    impl NodeApi for Fake {
        fn get_node(&self, name: &str, from_cache: bool) -> impl Future<Output = Result<Node, KubeError>> + Send {
            std::future::ready(self.get_now(name, from_cache))
        }

        fn list_node(
            &self,
            name: &str,
            from_cache: bool,
        ) -> impl Future<Output = Result<(Node, String), KubeError>> + Send {
            let list_rv = self.0.lock().unwrap().list_rv.clone();
            let got = self.get_now(name, from_cache);
            std::future::ready(got.map(|node| {
                let rv = list_rv.unwrap_or_else(|| node.resource_version.clone());
                (node, rv)
            }))
        }

        fn watch_node(
            &self,
            _name: &str,
            rv: &str,
            timeout: Duration,
        ) -> impl Future<Output = Result<WatchStream, KubeError>> + Send {
            let mut st = self.0.lock().unwrap();
            st.calls.push((Instant::now(), Call::Watch { rv: rv.to_string() }));
            st.timeouts.push(timeout);
            let result = match st.watches.pop_front() {
                None => Ok(WatchStream::new(futures_util::stream::pending())),
                Some(Script::Fail(e)) => Err(e),
                Some(Script::Stream(items)) => Ok(WatchStream::new(futures_util::stream::unfold(
                    items.into_iter(),
                    |mut items| async move {
                        loop {
                            match items.next()? {
                                Item::Sleep(d) => tokio::time::sleep(d).await,
                                Item::Event(e) => return Some((Ok(e), items)),
                                Item::Fail(e) => return Some((Err(e), items)),
                            }
                        }
                    },
                ))),
            };
            std::future::ready(result)
        }
    }

    fn http_error(name: &str, code: u16) -> KubeError {
        KubeError::WatchNode {
            name: name.to_string(),
            path: "/test".into(),
            failure: ApiFailure::Http(Box::new(HttpFailure {
                code,
                status: Some(ApiStatus {
                    code,
                    reason: format!("Reason{code}"),
                    message: format!("test error {code}"),
                    retry_after_seconds: None,
                }),
                retry_after: None,
                body: String::new(),
            })),
        }
    }

    fn node(rv: &str, label: &str) -> Node {
        Node {
            name: "gpu-1".into(),
            uid: "u-1".into(),
            resource_version: rv.into(),
            labels: [("nvidia.com/mig.config".to_string(), label.to_string())].into(),
            annotations: Default::default(),
        }
    }

    fn cfg() -> KubernetesConfig {
        KubernetesConfig {
            watch: true,
            poll_interval: Duration::from_millis(100),
            watch_timeout: Duration::from_millis(200),
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_millis(40),
            reconnect_jitter: Duration::ZERO,
            ..KubernetesConfig::default()
        }
    }

    async fn wait_for(rx: &mut watch::Receiver<NodeView>, what: &str, pred: impl Fn(&NodeView) -> bool) -> NodeView {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let view = rx.borrow_and_update();
                if pred(&view) {
                    return view.clone();
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => panic!("timed out waiting for {what}; view: {:?}", *rx.borrow()),
            }
        }
    }

    async fn wait_calls(fake: &Fake, what: &str, pred: impl Fn(&[Call]) -> bool) -> Vec<Call> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let calls = fake.calls();
            if pred(&calls) {
                return calls;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; calls: {calls:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn label(view: &NodeView) -> Option<&str> {
        view.node
            .as_ref()
            .and_then(|n| n.labels.get("nvidia.com/mig.config"))
            .map(String::as_str)
    }

    fn get(from_cache: bool) -> Call {
        Call::Get { from_cache }
    }

    fn watch(rv: &str) -> Call {
        Call::Watch { rv: rv.into() }
    }

    #[tokio::test]
    async fn lists_then_watches_and_follows_events_and_bookmarks() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.watches.push_back(Script::Stream(vec![
                Item::Event(WatchEvent::Modified(node("2", "b"))),
                Item::Event(WatchEvent::Modified(node("3", "b"))),
                Item::Event(WatchEvent::Bookmark {
                    resource_version: "4".into(),
                }),
            ]));
        }
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let view = wait_for(&mut rx, "label b", |v| label(v) == Some("b")).await;
        assert!(
            view.connected && view.error.is_none() && view.mode == SyncMode::Watch,
            "{view:?}"
        );
        // The stream ended (as at timeoutSeconds): watch again from the bookmark, no GET.
        let calls = wait_calls(&fake, "re-watch", |c| c.len() >= 3).await;
        assert_eq!(calls, [get(true), watch("1"), watch("4")]);
        assert_eq!(
            rx.borrow().node.as_ref().map(|n| n.resource_version.clone()).as_deref(),
            Some("3")
        );
        task.abort();
    }

    #[tokio::test]
    async fn gone_event_relists_with_a_quorum_read() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.gets.push_back(Ok(node("10", "c")));
            st.watches
                .push_back(Script::Stream(vec![Item::Event(WatchEvent::Gone)]));
        }
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        wait_for(&mut rx, "label c", |v| label(v) == Some("c")).await;
        let calls = wait_calls(&fake, "watch from 10", |c| c.len() >= 4).await;
        assert_eq!(calls, [get(true), watch("1"), get(false), watch("10")]);
        task.abort();
    }

    #[tokio::test]
    async fn http_410_relists() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.gets.push_back(Ok(node("10", "a")));
            st.watches.push_back(Script::Fail(http_error("gpu-1", 410)));
        }
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let calls = wait_calls(&fake, "watch from 10", |c| c.len() >= 4).await;
        assert_eq!(calls, [get(true), watch("1"), get(false), watch("10")]);
        task.abort();
    }

    #[tokio::test]
    async fn failing_watch_falls_back_to_polling_until_it_works() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            // Later GETs (polls) see a change the watch never delivers.
            st.current = Some(node("7", "polled"));
            for _ in 0..12 {
                st.watches.push_back(Script::Fail(http_error("gpu-1", 500)));
            }
        }
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let view = wait_for(&mut rx, "a failed watch", |v| !v.connected && v.error.is_some()).await;
        assert_eq!(view.mode, SyncMode::Poll);
        assert!(
            view.error.as_deref().unwrap_or_default().contains("HTTP 500"),
            "{view:?}"
        );
        let view = wait_for(&mut rx, "watching again", |v| v.mode == SyncMode::Watch && v.connected).await;
        assert_eq!(label(&view), Some("polled"), "the polls kept the view current");
        assert_eq!(view.error, None);
        let calls = fake.calls();
        let polls = calls.iter().filter(|c| **c == get(true)).count();
        assert!(polls >= 2, "initial GET plus at least one poll: {calls:?}");
        assert_eq!(
            calls.last(),
            Some(&watch("1")),
            "watches from the last listed resourceVersion, not the polled Node's own: {calls:?}"
        );
        task.abort();
    }

    #[tokio::test]
    async fn error_event_and_broken_stream_rewatch_from_the_last_version() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.watches.push_back(Script::Stream(vec![
                Item::Event(WatchEvent::Modified(node("2", "b"))),
                Item::Event(WatchEvent::Error(ApiStatus {
                    code: 500,
                    reason: "InternalError".into(),
                    message: "etcd hiccup".into(),
                    retry_after_seconds: None,
                })),
            ]));
            st.watches
                .push_back(Script::Stream(vec![Item::Fail(http_error("gpu-1", 503))]));
        }
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let calls = wait_calls(&fake, "third watch", |c| c.len() >= 4).await;
        assert_eq!(calls, [get(true), watch("1"), watch("2"), watch("2")]);
        task.abort();
    }

    #[tokio::test]
    async fn steady_state_is_one_watch_per_timeout_and_no_gets() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            for _ in 0..100 {
                st.watches
                    .push_back(Script::Stream(vec![Item::Sleep(Duration::from_millis(100))]));
            }
        }
        let mut cfg = cfg();
        cfg.watch_timeout = Duration::from_millis(100);
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        task.abort();
        let calls = fake.calls();
        let gets = calls.iter().filter(|c| matches!(c, Call::Get { .. })).count();
        let watches = calls.iter().filter(|c| matches!(c, Call::Watch { .. })).count();
        assert_eq!(gets, 1, "{calls:?}");
        assert!((4..=11).contains(&watches), "about one watch per 100 ms: {watches}");
        assert!(calls[1..].iter().all(|c| *c == watch("1")));
    }

    #[tokio::test]
    async fn watches_that_end_at_once_back_off() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            for _ in 0..6 {
                st.watches.push_back(Script::Stream(vec![]));
            }
        }
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        wait_calls(&fake, "seven watches", |c| c.len() >= 8).await;
        task.abort();
        let st = fake.0.lock().unwrap();
        let times: Vec<Instant> = st.calls[1..8].iter().map(|(t, _)| *t).collect();
        // Backoff 10, 20, 40, 40, 40, 40 ms with equal jitter: at least 95 ms in all.
        let spread = times[6] - times[0];
        assert!(spread >= Duration::from_millis(95), "{spread:?}");
    }

    #[tokio::test]
    async fn missing_node_is_retried_and_said() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Err(http_error("gpu-1", 404)));
            st.gets.push_back(Err(http_error("gpu-1", 404)));
            st.gets.push_back(Ok(node("3", "a")));
        }
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let view = wait_for(&mut rx, "not found", |v| v.error.is_some()).await;
        let error = view.error.unwrap_or_default();
        assert!(
            error.contains("not found") && error.contains("kubernetes.node_name"),
            "{error}"
        );
        assert!(!view.connected && view.node.is_none());
        let view = wait_for(&mut rx, "the node", |v| v.node.is_some()).await;
        assert!(view.connected && view.error.is_none(), "{view:?}");
        let calls = wait_calls(&fake, "watch", |c| c.len() >= 4).await;
        assert_eq!(calls[..4], [get(true), get(true), get(true), watch("3")]);
        task.abort();
    }

    #[tokio::test]
    async fn deleted_node_is_dropped_and_read_again() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.gets.push_back(Err(http_error("gpu-1", 404)));
            st.watches
                .push_back(Script::Stream(vec![Item::Event(WatchEvent::Deleted(node("2", "a")))]));
            let mut again = node("5", "a");
            again.uid = "u-2".into();
            st.current = Some(again);
        }
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        wait_for(&mut rx, "deleted", |v| v.node.is_none() && v.error.is_some()).await;
        let view = wait_for(&mut rx, "re-registered", |v| {
            v.node.as_ref().is_some_and(|n| n.uid == "u-2")
        })
        .await;
        assert!(view.connected);
        let calls = wait_calls(&fake, "watch from 5", |c| c.contains(&watch("5"))).await;
        assert_eq!(calls, [get(true), watch("1"), get(true), get(true), watch("5")]);
        task.abort();
    }

    #[tokio::test]
    async fn polls_when_watch_is_off() {
        let fake = Fake::default();
        fake.0.lock().unwrap().current = Some(node("1", "a"));
        let mut cfg = cfg();
        cfg.watch = false;
        cfg.poll_interval = Duration::from_millis(50);
        let (mut rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        let view = wait_for(&mut rx, "the node", |v| v.node.is_some()).await;
        assert_eq!(view.mode, SyncMode::Poll);
        assert!(view.connected);
        tokio::time::sleep(Duration::from_millis(300)).await;
        task.abort();
        let calls = fake.calls();
        assert!(calls.iter().all(|c| *c == get(true)), "{calls:?}");
        assert!((3..=8).contains(&calls.len()), "{calls:?}");
    }

    #[tokio::test]
    async fn only_relevant_changes_are_published() {
        let (tx, mut rx) = watch::channel(NodeView {
            node: None,
            connected: false,
            error: None,
            mode: SyncMode::Watch,
        });
        let mut w = Watcher {
            api: Fake::default(),
            name: "gpu-1".into(),
            watch: true,
            poll_interval: Duration::from_secs(60),
            watch_timeout: Duration::from_secs(300),
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(1)),
            reconnect_jitter: Duration::ZERO,
            gone_streak: 0,
            tx,
            resource_version: String::new(),
            next_poll: None,
            last_logged: None,
        };
        assert!(w.on_node(node("1", "a")));
        rx.borrow_and_update();
        // A new resourceVersion alone: stored, nobody woken.
        assert!(!w.on_node(node("2", "a")));
        assert!(!rx.has_changed().expect("open"));
        assert_eq!(
            rx.borrow().node.as_ref().map(|n| n.resource_version.as_str()),
            Some("2")
        );
        assert_eq!(w.resource_version, "", "a read Node does not set where to watch from");
        // Labels, annotations, connection state: published.
        assert!(w.on_node(node("3", "b")));
        let mut annotated = node("4", "b");
        annotated.annotations.insert("k".into(), "v".into());
        assert!(w.on_node(annotated));
        w.healthy(SyncMode::Watch);
        assert!(rx.has_changed().expect("open"));
        rx.borrow_and_update();
        w.healthy(SyncMode::Watch);
        assert!(!rx.has_changed().expect("open"), "same state again is not news");
        w.failed(&http_error("gpu-1", 500), Duration::from_secs(1), None);
        assert!(rx.has_changed().expect("open"));
        assert!(!rx.borrow_and_update().connected);
    }

    #[tokio::test]
    async fn a_server_that_keeps_answering_410_is_relisted_with_backoff_not_in_a_loop() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.current = Some(node("1", "a"));
            for _ in 0..10_000 {
                st.watches.push_back(Script::Fail(http_error("gpu-1", 410)));
            }
        }
        let mut cfg = cfg();
        cfg.backoff_min = Duration::from_millis(50);
        cfg.backoff_max = Duration::from_millis(50);
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        tokio::time::sleep(Duration::from_millis(500)).await;
        task.abort();
        let calls = fake.calls();
        let relists = calls.iter().filter(|c| **c == get(false)).count();
        // The first 410 relists at once; every later one waits a backoff step (25..50 ms), so
        // at most ~21 in 500 ms. Without the guard it is thousands.
        assert!(
            (1..=25).contains(&relists),
            "{relists} relists: {:?}",
            &calls[..calls.len().min(12)]
        );
        assert_eq!(
            calls[..3],
            [get(true), watch("1"), get(false)],
            "one relist on the first 410"
        );
    }

    #[tokio::test]
    async fn a_410_after_a_watch_that_delivered_relists_at_once_again() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            st.gets.push_back(Ok(node("10", "a")));
            st.gets.push_back(Ok(node("20", "a")));
            st.watches.push_back(Script::Fail(http_error("gpu-1", 410)));
            st.watches.push_back(Script::Stream(vec![
                Item::Event(WatchEvent::Modified(node("11", "b"))),
                Item::Event(WatchEvent::Gone),
            ]));
        }
        let mut cfg = cfg();
        // A backoff step of a minute: a relist that waited for it would not come in time.
        cfg.backoff_min = Duration::from_secs(60);
        cfg.backoff_max = Duration::from_secs(60);
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        let calls = wait_calls(&fake, "watch from 20", |c| c.len() >= 6).await;
        assert_eq!(
            calls,
            [get(true), watch("1"), get(false), watch("10"), get(false), watch("20")]
        );
        task.abort();
    }

    #[tokio::test]
    async fn watch_requests_ask_for_a_random_length_between_one_and_two_timeouts() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            for _ in 0..60 {
                st.watches
                    .push_back(Script::Stream(vec![Item::Sleep(Duration::from_millis(2))]));
            }
        }
        let mut cfg = cfg();
        cfg.watch_timeout = Duration::from_secs(300);
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        let deadline = Instant::now() + Duration::from_secs(10);
        while fake.0.lock().unwrap().timeouts.len() < 50 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        task.abort();
        let timeouts = fake.0.lock().unwrap().timeouts.clone();
        assert!(timeouts.len() >= 50, "{} watches", timeouts.len());
        let (low, high) = (Duration::from_secs(300), Duration::from_secs(600));
        assert!(timeouts.iter().all(|t| *t >= low && *t < high), "{timeouts:?}");
        let min = timeouts.iter().min().copied().unwrap_or_default();
        let max = timeouts.iter().max().copied().unwrap_or_default();
        assert!(
            max - min > Duration::from_secs(60),
            "spread out, not one period: {min:?}..{max:?}"
        );
    }

    #[tokio::test]
    async fn retry_after_is_waited_out_before_watching_again() {
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.gets.push_back(Ok(node("1", "a")));
            let mut e = http_error("gpu-1", 429);
            if let KubeError::WatchNode {
                failure: ApiFailure::Http(h),
                ..
            } = &mut e
            {
                h.retry_after = Some(Duration::from_millis(300));
            }
            st.watches.push_back(Script::Fail(e));
        }
        let mut cfg = cfg();
        cfg.poll_interval = Duration::from_secs(60);
        // Retry-After is capped at backoff_max only.
        cfg.backoff_max = Duration::from_secs(5);
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
        wait_calls(&fake, "the watch after the 429", |c| c.len() >= 3).await;
        task.abort();
        let st = fake.0.lock().unwrap();
        let waited = st.calls[2].0 - st.calls[1].0;
        assert!(
            waited >= Duration::from_millis(300),
            "Retry-After 300 ms, backoff 10 ms: waited {waited:?}"
        );
    }

    #[test]
    fn retries_are_spread_over_the_jitter_window() {
        let jitter = Duration::from_secs(10);
        let step = Duration::from_millis(500);
        let first: Vec<Duration> = (0..2000).map(|_| spread(step, jitter)).collect();
        assert!(
            first.iter().all(|d| *d >= step && *d <= jitter),
            "in [backoff step, window]"
        );
        // Spread over the window: each tenth of it gets some of 2,000 nodes.
        for tenth in 1..10 {
            let (lo, hi) = (jitter * tenth / 10, jitter * (tenth + 1) / 10);
            let n = first.iter().filter(|d| **d >= lo && **d < hi).count();
            assert!(n > 100, "{n} of 2000 retries in {lo:?}..{hi:?}");
        }
        // No window: the backoff's step.
        assert_eq!(spread(step, Duration::ZERO), step);
        // A backoff step or Retry-After longer than the window is never cut short by it.
        assert!((0..100).all(|_| spread(Duration::from_secs(30), jitter) == Duration::from_secs(30)));
    }

    #[tokio::test]
    async fn after_a_broken_watch_the_retry_waits_within_the_jitter_window() {
        // 20 nodes lose their watch at once; their next watch comes spread over the window.
        let mut waits = Vec::new();
        let mut tasks = Vec::new();
        let mut fakes = Vec::new();
        for _ in 0..20 {
            let fake = Fake::default();
            {
                let mut st = fake.0.lock().unwrap();
                st.gets.push_back(Ok(node("1", "a")));
                st.watches
                    .push_back(Script::Stream(vec![Item::Fail(http_error("gpu-1", 503))]));
            }
            let mut cfg = cfg();
            cfg.reconnect_jitter = Duration::from_millis(400);
            // The window is cut to backoff_max: leave it room.
            cfg.backoff_max = Duration::from_secs(1);
            cfg.poll_interval = Duration::from_secs(60);
            let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
            tasks.push((task, _rx));
            fakes.push(fake);
        }
        for fake in &fakes {
            wait_calls(fake, "the second watch", |c| c.len() >= 3).await;
            let st = fake.0.lock().unwrap();
            waits.push(st.calls[2].0 - st.calls[1].0);
        }
        for (task, _) in tasks {
            task.abort();
        }
        assert!(waits.iter().all(|w| *w >= Duration::from_millis(5)), "{waits:?}");
        let min = waits.iter().min().copied().unwrap_or_default();
        let max = waits.iter().max().copied().unwrap_or_default();
        assert!(max - min >= Duration::from_millis(100), "not all at once: {waits:?}");
    }

    #[tokio::test]
    async fn after_a_410_the_watch_starts_from_the_lists_resource_version_not_the_nodes() {
        // An API server that restarted: its watch cache begins at 50, the Node last changed at
        // 1. Watching from the Node's own 1 would get 410 forever.
        let fake = Fake::default();
        {
            let mut st = fake.0.lock().unwrap();
            st.current = Some(node("1", "a"));
            st.list_rv = Some("50".into());
            st.watches.push_back(Script::Fail(http_error("gpu-1", 410)));
        }
        let (_rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg());
        let calls = wait_calls(&fake, "the watch after the relist", |c| c.len() >= 4).await;
        assert_eq!(calls[..4], [get(true), watch("50"), get(false), watch("50")]);
        task.abort();
    }

    #[tokio::test]
    async fn watches_that_end_early_but_cleanly_come_back_spread_over_the_window() {
        // A graceful API server shutdown ends every watch at once, cleanly, long before its
        // timeoutSeconds: the nodes must not all watch again at the same instant.
        let mut fakes = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let fake = Fake::default();
            {
                let mut st = fake.0.lock().unwrap();
                st.gets.push_back(Ok(node("1", "a")));
                st.watches
                    .push_back(Script::Stream(vec![Item::Event(WatchEvent::Modified(node("2", "a")))]));
            }
            let mut cfg = cfg();
            cfg.watch_timeout = Duration::from_secs(60);
            cfg.reconnect_jitter = Duration::from_millis(400);
            cfg.backoff_max = Duration::from_secs(1);
            let (rx, task) = spawn_node_watcher_with(fake.clone(), "gpu-1".into(), &cfg);
            tasks.push((task, rx));
            fakes.push(fake);
        }
        let mut waits = Vec::new();
        for fake in &fakes {
            wait_calls(fake, "the second watch", |c| c.len() >= 3).await;
            let st = fake.0.lock().unwrap();
            assert_eq!(st.calls[2].1, watch("2"), "resumed from the last event");
            waits.push(st.calls[2].0 - st.calls[1].0);
        }
        for (task, _) in tasks {
            task.abort();
        }
        let min = waits.iter().min().copied().unwrap_or_default();
        let max = waits.iter().max().copied().unwrap_or_default();
        assert!(max - min >= Duration::from_millis(100), "not all at once: {waits:?}");
    }
}
