//! A Kubernetes API server stand-in for tests: Nodes, core/v1 Events, RuntimeClasses and the DRA
//! objects (resource.k8s.io/v1 ResourceSlices and ResourceClaims) over HTTPS on loopback.
//!
//! [`TestApiServer::start`] serves `https://127.0.0.1:PORT` with a fresh CA (or plain `http://`
//! with [`Options::plain_http`]). It answers like
//! kube-apiserver where the node agent can tell: `Status` error bodies, GET/LIST, merge,
//! strategic-merge and JSON patches, resourceVersion preconditions (409), label validation (422),
//! watch streams with bookmarks, timeouts and 410 `Expired`, bearer-token and client-certificate
//! authentication (401), per-user denials (403), injected failures (429 with `Retry-After`,
//! 500, 503, 504, dropped connections, an unreachable server), the max-in-flight limit and
//! restarts. Tests drive it through this handle and assert on the objects, the request log and
//! the load statistics; one server holds thousands of node clients at once (README.md, "Many
//! clients at once"). See README.md for what it leaves out.

mod dra;
mod http;
mod kubeconfig;
mod load;
mod patch;
mod selector;
mod status;
mod store;
mod time;
mod tls;
mod validate;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::net::TcpSocket;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

pub use kubeconfig::{KubeconfigAuth, KubeconfigOptions};
pub use load::{Load, Stats};

use load::{InflightLimits, LoadTable};
use store::Store;
use tls::Pki;

/// One request as the server saw it, logged when its answer (or watch stream) started.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    /// When the request arrived.
    pub at: Instant,
    /// HTTP method, upper case (`GET`, `PATCH`, ...).
    pub method: String,
    /// URL path, as sent (`/api/v1/nodes/gpu-1`).
    pub path: String,
    /// Raw query string, as sent, without `?` (empty if none).
    pub query: String,
    /// Authenticated user (client certificate CN or the token's user); `None` if neither.
    pub user: Option<String>,
    /// HTTP status of the answer; 0 when the connection was dropped ([`Failure::Disconnect`]).
    pub status: u16,
    /// A watch request (`watch=true|1` or `/api/v1/watch/...`).
    pub watch: bool,
    /// The Kubernetes verb: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, ...
    pub verb: String,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The request body (lossy UTF-8; empty for GET).
    pub body: String,
}

impl RequestRecord {
    /// The body parsed as JSON, if it is JSON.
    pub fn body_json(&self) -> Option<Value> {
        serde_json::from_str(&self.body).ok()
    }

    /// The decoded value of one query parameter (`fieldSelector` gives `metadata.name=x`).
    pub fn query_param(&self, key: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (http::percent_decode(k) == key).then(|| http::percent_decode(v))
        })
    }
}

/// An answer to inject instead of serving a request (see [`TestApiServer::fail_next`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// 429 `TooManyRequests`, header `Retry-After: N`, `details.retryAfterSeconds: N`.
    TooManyRequests { retry_after_secs: u64 },
    /// 401 `Unauthorized` (as for an expired token).
    Unauthorized,
    /// 403 `Forbidden` with the RBAC message for this request.
    Forbidden,
    /// 500 `InternalError`.
    Internal,
    /// 503 `ServiceUnavailable`.
    Unavailable,
    /// 504 `Timeout`.
    Timeout,
    /// No answer: the connection is closed (HTTP/1.1) or the stream reset (HTTP/2).
    Disconnect,
    /// Serve the request normally, but only after this delay.
    Delay(Duration),
    /// 200 with an object far larger than any real one: the Node (named by the path or the
    /// `metadata.name` field selector) as stored, plus an annotation `test-apiserver/padding`
    /// of `padding` bytes; for a watch, one `MODIFIED` event line with that Node, then the end. The
    /// body is generated as it is sent (the server never holds it), chunked, or with its
    /// `Content-Length` when `declare_length`.
    Oversized { padding: u64, declare_length: bool },
}

/// Server settings; [`Default`] is what [`TestApiServer::start`] uses.
#[derive(Clone, Debug)]
pub struct Options {
    /// Offer HTTP/2 in ALPN (as kube-apiserver does). Default true; false means HTTP/1.1 only.
    pub http2: bool,
    /// Send a BOOKMARK to watches that allow them this often. Default: never.
    pub bookmark_interval: Option<Duration>,
    /// Node changes kept for watch replay; older ones expire (410). Default 10 000.
    pub history_limit: usize,
    /// Serve plain `http://` (HTTP/1.1 and HTTP/2 prior knowledge), without TLS, as a server
    /// behind `kubectl proxy` or an old `--insecure-port` would. Bearer tokens still
    /// authenticate (client certificates cannot). Default false.
    pub plain_http: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            http2: true,
            bookmark_interval: None,
            history_limit: 10_000,
            plain_http: false,
        }
    }
}

/// The accept queue asked for (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 8192;

struct Fault {
    remaining: usize,
    verb: Option<String>,
    resource: Option<String>,
    failure: Failure,
}

/// Shared by the handle and the server tasks.
pub(crate) struct State {
    pki: Pki,
    store: Mutex<Store>,
    tokens: Mutex<HashMap<String, String>>,
    forbidden: Mutex<Vec<(String, String, String)>>,
    faults: Mutex<VecDeque<Fault>>,
    log: Mutex<Vec<RequestRecord>>,
    /// Whether requests go into `log` ([`TestApiServer::set_request_log`]).
    logging: AtomicBool,
    load: LoadTable,
    inflight: InflightLimits,
    down: watch::Sender<bool>,
    /// Bumped by every `set_down` and `restart`: a restart's coming back up happens only if
    /// nothing else changed the down state in the meantime.
    down_epoch: Mutex<u64>,
    /// Bumped each time the server goes down: open connections end.
    cuts: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    bookmark_interval: watch::Sender<Option<Duration>>,
    /// Bumped on every change and every logged request; [`TestApiServer::wait_for`] waits on it.
    changes: watch::Sender<u64>,
}

impl State {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().expect("store lock")
    }

    fn touch(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    fn take_fault(&self, verb: &str, resource: &str) -> Option<Failure> {
        let mut faults = self.faults.lock().expect("faults lock");
        let i = faults.iter().position(|f| {
            f.verb
                .as_deref()
                .is_none_or(|v| v == "*" || v.eq_ignore_ascii_case(verb))
                && f.resource.as_deref().is_none_or(|r| r == "*" || r == resource)
        })?;
        let failure = faults[i].failure.clone();
        faults[i].remaining -= 1;
        if faults[i].remaining == 0 {
            faults.remove(i);
        }
        Some(failure)
    }

    /// Drops every open connection and watch, and refuses new connections from now on.
    fn go_down(&self) {
        self.store().drop_watches();
        self.down.send_replace(true);
        self.cuts.send_modify(|n| *n += 1);
        self.touch();
    }

    fn go_up(&self) {
        self.down.send_replace(false);
        self.touch();
    }

    fn is_forbidden(&self, user: &str, verb: &str, resource: &str) -> bool {
        let wild = |rule: &str, actual: &str| rule == "*" || rule == actual;
        self.forbidden
            .lock()
            .expect("forbidden lock")
            .iter()
            .any(|(u, v, r)| wild(u, user) && wild(v, verb) && wild(r, resource))
    }
}

struct Handle {
    state: Arc<State>,
    addr: SocketAddr,
    /// `http` or `https`.
    scheme: &'static str,
    /// The runtime the server runs on (the one that called `start`), for the handle's own tasks.
    runtime: tokio::runtime::Handle,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.state.shutdown.send_replace(true);
    }
}

/// The running server. Clones share it; it stops when the last clone is dropped.
#[derive(Clone)]
pub struct TestApiServer {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for TestApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestApiServer")
            .field("addr", &self.handle.addr)
            .finish_non_exhaustive()
    }
}

fn map_of(obj: Option<&Value>) -> BTreeMap<String, String> {
    obj.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

impl TestApiServer {
    /// Starts on `127.0.0.1` on a free port with a fresh CA and default [`Options`].
    pub async fn start() -> TestApiServer {
        TestApiServer::start_with(Options::default()).await
    }

    /// Starts with the given [`Options`] (HTTP/1.1 only, bookmark interval, history size).
    pub async fn start_with(options: Options) -> TestApiServer {
        let pki = Pki::new();
        let acceptor = (!options.plain_http).then(|| TlsAcceptor::from(Arc::new(pki.server_config(options.http2))));
        let scheme = if options.plain_http { "http" } else { "https" };
        // A deep accept queue: thousands of clients connecting at once (a fleet bench) would
        // overflow tokio's default backlog of 1024, and each dropped SYN costs its client a
        // 1 s retransmission. The kernel caps it at net.core.somaxconn.
        let socket = TcpSocket::new_v4().expect("TCP socket for 127.0.0.1");
        socket
            .bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .expect("bind 127.0.0.1:0");
        let listener = socket.listen(LISTEN_BACKLOG).expect("listen on 127.0.0.1");
        let addr = listener.local_addr().expect("local address");
        let state = Arc::new(State {
            pki,
            store: Mutex::new(Store::new(options.history_limit)),
            tokens: Mutex::new(HashMap::new()),
            forbidden: Mutex::new(Vec::new()),
            faults: Mutex::new(VecDeque::new()),
            log: Mutex::new(Vec::new()),
            logging: AtomicBool::new(true),
            load: LoadTable::new(),
            inflight: InflightLimits::default(),
            down: watch::Sender::new(false),
            down_epoch: Mutex::new(0),
            cuts: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            bookmark_interval: watch::Sender::new(options.bookmark_interval),
            changes: watch::Sender::new(0),
        });
        tokio::spawn(http::serve(state.clone(), listener, acceptor));
        tokio::spawn(bookmark_ticker(state.clone()));
        TestApiServer {
            handle: Arc::new(Handle {
                state,
                addr,
                scheme,
                runtime: tokio::runtime::Handle::current(),
            }),
        }
    }

    fn state(&self) -> &State {
        &self.handle.state
    }

    /// `https://127.0.0.1:PORT` (`http://` with [`Options::plain_http`]).
    pub fn url(&self) -> String {
        format!("{}://{}", self.handle.scheme, self.handle.addr)
    }

    /// The listening address (`127.0.0.1:PORT`).
    pub fn addr(&self) -> SocketAddr {
        self.handle.addr
    }

    /// The CA certificate (PEM) that signed the server certificate and issues client certificates.
    /// The server certificate is valid for 127.0.0.1, ::1, localhost and kubernetes.default.svc.
    pub fn ca_pem(&self) -> String {
        self.state().pki.ca_pem.clone()
    }

    /// A client certificate from the server's CA: user = `cn`, groups = `groups` (O entries, at
    /// most two). Returns (certificate PEM, PKCS#8 key PEM).
    pub fn issue_client_cert(&self, cn: &str, groups: &[&str]) -> (String, String) {
        self.state().pki.issue_client_cert(cn, groups)
    }

    /// A client certificate from another, untrusted CA: requests with it alone get 401.
    pub fn issue_untrusted_client_cert(&self, cn: &str, groups: &[&str]) -> (String, String) {
        Pki::issue_untrusted_client_cert(cn, groups)
    }

    /// Accepts `Authorization: Bearer TOKEN` as `user` from the next request on.
    pub fn add_token(&self, token: &str, user: &str) {
        self.state()
            .tokens
            .lock()
            .expect("tokens")
            .insert(token.to_owned(), user.to_owned());
    }

    /// Stops accepting `token` (401 from the next request on, also on open connections).
    pub fn remove_token(&self, token: &str) {
        self.state().tokens.lock().expect("tokens").remove(token);
    }

    /// Writes `dir/kubeconfig` for this server with the given auth and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path, auth: KubeconfigAuth) -> PathBuf {
        self.write_kubeconfig_with(dir, auth, &KubeconfigOptions::default())
    }

    /// As [`write_kubeconfig`](Self::write_kubeconfig), with a CA file, another server URL, a
    /// namespace or another file name.
    pub fn write_kubeconfig_with(&self, dir: &Path, auth: KubeconfigAuth, options: &KubeconfigOptions) -> PathBuf {
        kubeconfig::write(dir, &self.url(), &self.ca_pem(), &auth, options)
    }

    /// Writes `dir/exec-plugin.sh`, an exec credential plugin that prints an `ExecCredential`
    /// (`apiVersion` = `api_version`) with the token from `dir/exec-plugin.token` and, with
    /// `expires_in`, an `expirationTimestamp` that far after each run. Each run appends one line
    /// (`KUBERNETES_EXEC_INFO`, or empty) to `dir/exec-plugin.calls`. Returns the script path.
    pub fn write_exec_plugin(
        &self,
        dir: &Path,
        token: &str,
        expires_in: Option<Duration>,
        api_version: &str,
    ) -> PathBuf {
        kubeconfig::write_exec_plugin(dir, token, expires_in, api_version)
    }

    /// Changes the token the plugin in `dir` prints from its next run on.
    pub fn set_exec_token(&self, dir: &Path, token: &str) {
        kubeconfig::set_exec_token(dir, token);
    }

    /// Makes the plugin in `dir` exit 1 (with a message on stderr), or work again.
    pub fn set_exec_failing(&self, dir: &Path, failing: bool) {
        kubeconfig::set_exec_failing(dir, failing);
    }

    /// How many times the plugin in `dir` has run.
    pub fn exec_calls(&self, dir: &Path) -> usize {
        kubeconfig::exec_calls(dir).len()
    }

    /// The `KUBERNETES_EXEC_INFO` each run of the plugin in `dir` got (empty string if none).
    pub fn exec_call_infos(&self, dir: &Path) -> Vec<String> {
        kubeconfig::exec_calls(dir)
    }

    // ----- nodes -----

    /// Creates a Node (as the kubelet would register it), announcing it to watches (ADDED).
    /// Panics if it exists or a label is invalid.
    pub fn create_node(&self, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::String((*v).to_owned())))
            .collect();
        let node = json!({
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"name": name, "labels": labels},
            "spec": {},
            "status": {"nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "v1.31.0"}},
        });
        let created = self.state().store().create_node(node);
        if let Err(e) = created {
            panic!("create_node {name}: {}", e.message);
        }
        self.state().touch();
    }

    /// Creates (ADDED) or replaces (MODIFIED, when different) a Node from a full object; the
    /// server keeps uid and creationTimestamp of an existing node and sets the resourceVersion.
    /// Panics on an invalid object.
    pub fn put_node(&self, obj: Value) {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .expect("metadata.name")
            .to_owned();
        {
            let mut store = self.state().store();
            let result = if store.node(&name).is_some() {
                let mut obj = obj;
                if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                    m.remove("uid");
                }
                store.update_node(&name, obj)
            } else {
                store.create_node(obj)
            };
            if let Err(e) = result {
                panic!("put_node {name}: {}", e.message);
            }
        }
        self.state().touch();
    }

    /// Deletes a Node (DELETED to watches). Returns whether it existed.
    pub fn delete_node(&self, name: &str) -> bool {
        let existed = self.state().store().delete_node(name).is_some();
        self.state().touch();
        existed
    }

    /// The node as a GET would return it.
    pub fn node(&self, name: &str) -> Option<Value> {
        self.state().store().node(name).cloned()
    }

    /// The node's labels (empty if the node or its labels are absent).
    pub fn labels(&self, name: &str) -> BTreeMap<String, String> {
        map_of(self.node(name).as_ref().and_then(|n| n.pointer("/metadata/labels")))
    }

    /// The node's annotations (empty if the node or its annotations are absent).
    pub fn annotations(&self, name: &str) -> BTreeMap<String, String> {
        map_of(
            self.node(name)
                .as_ref()
                .and_then(|n| n.pointer("/metadata/annotations")),
        )
    }

    /// The node's current `metadata.resourceVersion`.
    pub fn node_resource_version(&self, name: &str) -> Option<String> {
        self.node(name)?
            .pointer("/metadata/resourceVersion")?
            .as_str()
            .map(str::to_owned)
    }

    /// The server's current resourceVersion (the global counter; lists carry it).
    pub fn resource_version(&self) -> String {
        self.state().store().rv().to_string()
    }

    /// As `kubectl label node`: sets (`Some`) or removes (`None`) a label. A real change bumps the
    /// resourceVersion and sends MODIFIED to watches; setting the same value changes nothing.
    /// Panics if the node is missing or the label is invalid.
    pub fn set_label(&self, name: &str, key: &str, value: Option<&str>) {
        self.patch_node(name, &json!({"metadata": {"labels": {key: value}}}));
    }

    /// As `kubectl annotate node`; see [`set_label`](Self::set_label).
    pub fn set_annotation(&self, name: &str, key: &str, value: Option<&str>) {
        self.patch_node(name, &json!({"metadata": {"annotations": {key: value}}}));
    }

    /// Applies a merge patch to a node as another client would (preconditions and validation
    /// included) and returns the result. Panics on any error.
    pub fn patch_node(&self, name: &str, merge_patch: &Value) -> Value {
        let result = {
            let mut store = self.state().store();
            let current = store
                .node(name)
                .unwrap_or_else(|| panic!("patch_node: no node {name:?}"));
            let mut patched = current.clone();
            patch::merge(&mut patched, merge_patch);
            store.update_node(name, patched)
        };
        self.state().touch();
        result.unwrap_or_else(|e| panic!("patch_node {name}: {}", e.message))
    }

    // ----- RuntimeClasses -----

    /// The RuntimeClasses created, by name.
    pub fn runtime_classes(&self) -> BTreeMap<String, Value> {
        self.state().store().runtime_classes().clone()
    }

    // ----- DRA: resource.k8s.io/v1 ResourceSlices and ResourceClaims -----

    /// The ResourceSlices stored now, by name, as a GET returns them.
    pub fn resource_slices(&self) -> BTreeMap<String, Value> {
        self.state().store().resource_slices().clone()
    }

    /// What the kubelet does when it starts and when a DRA plugin has been gone for 30 s:
    /// deletes every ResourceSlice with `spec.nodeName == node` (and `spec.driver == driver`
    /// when given). Returns how many it deleted. Each deletion bumps the resourceVersion.
    pub fn delete_resource_slices(&self, node: &str, driver: Option<&str>) -> usize {
        let deleted = self.state().store().delete_resource_slices_where(|s| {
            let field = |f: &str| s.pointer(f).and_then(Value::as_str);
            field("/spec/nodeName") == Some(node) && driver.is_none_or(|d| field("/spec/driver") == Some(d))
        });
        self.state().touch();
        deleted.len()
    }

    /// Stores a ResourceClaim as the scheduler and the claim controller would leave it, with its
    /// `status` (e.g. `status.allocation.devices.results[]` of `{request, driver, pool, device}`)
    /// kept as given. `metadata.namespace` and `metadata.name` are required; a `uid` is added
    /// if absent; `resourceVersion` and `creationTimestamp` are set. A claim of the same name is
    /// replaced (give it a new uid to stand for a re-created claim). Returns the stored object.
    /// Nothing is validated.
    pub fn create_resource_claim(&self, claim: Value) -> Value {
        for field in ["namespace", "name"] {
            let ok = claim
                .pointer(&format!("/metadata/{field}"))
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty());
            assert!(ok, "create_resource_claim: metadata.{field} is required, got {claim}");
        }
        let stored = self.state().store().put_resource_claim(claim);
        self.state().touch();
        stored
    }

    /// The ResourceClaim as a GET returns it.
    pub fn resource_claim(&self, namespace: &str, name: &str) -> Option<Value> {
        self.state().store().resource_claim(namespace, name).cloned()
    }

    /// Deletes a ResourceClaim. Returns whether it existed.
    pub fn delete_resource_claim(&self, namespace: &str, name: &str) -> bool {
        let existed = self.state().store().delete_resource_claim(namespace, name).is_some();
        self.state().touch();
        existed
    }

    // ----- events -----

    /// Every stored Event (all namespaces), in creation order.
    pub fn events(&self) -> Vec<Value> {
        self.state().store().events().to_vec()
    }

    // ----- request log -----

    /// Every request since the start or the last [`clear_requests`](Self::clear_requests), in
    /// the order their answers started (only those logged while
    /// [`set_request_log`](Self::set_request_log) was on).
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.state().log.lock().expect("log").clone()
    }

    /// Empties the request log.
    pub fn clear_requests(&self) {
        self.state().log.lock().expect("log").clear();
    }

    /// Keeps a [`RequestRecord`] (with its body) of every request (`true`, the default), or
    /// none from now on. With thousands of clients the log grows large; [`stats`](Self::stats)
    /// count either way, and [`wait_for`](Self::wait_for) still wakes on every request.
    pub fn set_request_log(&self, on: bool) {
        self.state().logging.store(on, Ordering::Relaxed);
    }

    /// Load statistics since the start or the last [`clear_stats`](Self::clear_stats): per
    /// (verb, resource) the requests, body bytes in and out (a watch's as they stream), 429
    /// answers, open and peak watches; per user the requests; the requests in flight now.
    pub fn stats(&self) -> Stats {
        self.state().load.snapshot(&self.state().inflight)
    }

    /// Zeroes the counters of [`stats`](Self::stats). Watches still open stay counted as open,
    /// and the peaks start again from them.
    pub fn clear_stats(&self) {
        self.state().load.clear();
    }

    /// Logged requests with this HTTP method (any case) whose path starts with `path_prefix`.
    pub fn count(&self, method: &str, path_prefix: &str) -> usize {
        self.state()
            .log
            .lock()
            .expect("log")
            .iter()
            .filter(|r| r.method.eq_ignore_ascii_case(method) && r.path.starts_with(path_prefix))
            .count()
    }

    // ----- faults and policy -----

    /// The next `n` authenticated requests, whatever they are, get `failure` instead of their
    /// answer. Queued after earlier faults. Unauthenticated requests get their 401 and do not
    /// use up a fault.
    pub fn fail_next(&self, n: usize, failure: Failure) {
        self.push_fault(n, None, None, failure);
    }

    /// As [`fail_next`](Self::fail_next), for requests with this Kubernetes verb (`get`, `list`,
    /// `watch`, `patch`, `create`, `delete`, `deletecollection`, ... or `*`) on this resource
    /// (`nodes`, `events`, `runtimeclasses`, `resourceslices`, `resourceclaims` or `*`) only.
    pub fn fail_next_matching(&self, n: usize, verb: &str, resource: &str, failure: Failure) {
        self.push_fault(n, Some(verb.to_owned()), Some(resource.to_owned()), failure);
    }

    fn push_fault(&self, n: usize, verb: Option<String>, resource: Option<String>, failure: Failure) {
        if n > 0 {
            self.state().faults.lock().expect("faults").push_back(Fault {
                remaining: n,
                verb,
                resource,
                failure,
            });
        }
    }

    /// Drops every queued fault.
    pub fn clear_failures(&self) {
        self.state().faults.lock().expect("faults").clear();
    }

    /// Denies `verb` on `resource` to `user` (each may be `*`): 403 with the RBAC message.
    pub fn forbid(&self, user: &str, verb: &str, resource: &str) {
        self.state()
            .forbidden
            .lock()
            .expect("forbidden")
            .push((user.to_owned(), verb.to_owned(), resource.to_owned()));
    }

    /// Removes every [`forbid`](Self::forbid) rule.
    pub fn clear_forbidden(&self) {
        self.state().forbidden.lock().expect("forbidden").clear();
    }

    /// kube-apiserver's max-in-flight filter (`--max-requests-inflight`,
    /// `--max-mutating-requests-inflight`; what runs instead of API Priority and Fairness when
    /// that is off): at most `readonly` `get`/`list` and `mutating` other requests are served at
    /// once; one more gets 429 with `Retry-After: 1` and upstream's plain-text body. Watches are
    /// long-running and not counted. `None` (or 0, as upstream) is no limit, the default.
    /// Checked after authentication, before faults and authorization; a request delayed by
    /// [`Failure::Delay`] holds its place while it waits. Users in the `system:masters` group
    /// (by client certificate) are always served.
    pub fn set_max_inflight(&self, readonly: Option<usize>, mutating: Option<usize>) {
        self.state().inflight.set(readonly, mutating);
    }

    /// While down, new connections are reset right after accept, and going down drops every open
    /// connection (and so every watch stream) at once. Cancels the coming back of a
    /// [`restart`](Self::restart) in progress.
    pub fn set_down(&self, down: bool) {
        let mut epoch = self.state().down_epoch.lock().expect("down epoch");
        *epoch += 1;
        if down {
            self.state().go_down();
        } else {
            self.state().go_up();
        }
    }

    /// What a kube-apiserver restart looks like to its clients: every connection, and with it
    /// every watch, drops at once; new connections are reset right after accept for `down_for`;
    /// then it answers again with its watch history gone. At that moment the resourceVersion
    /// moves on by one (a real one writes its identity Lease at start, which moves etcd's
    /// revision) and the history is [compacted](Self::compact) there, so a watch from any
    /// resourceVersion a client holds gets HTTP 200 and one ERROR event (410 `Expired`), and a
    /// re-list gets the new one. Objects are kept (they live in etcd). Returns at once; the
    /// coming back is a task on the server's runtime, and a [`set_down`](Self::set_down) or
    /// another restart in the meantime cancels it.
    pub fn restart(&self, down_for: Duration) {
        let epoch = {
            let mut epoch = self.state().down_epoch.lock().expect("down epoch");
            *epoch += 1;
            self.state().go_down();
            *epoch
        };
        let state: Weak<State> = Arc::downgrade(&self.handle.state);
        self.handle.runtime.spawn(async move {
            tokio::time::sleep(down_for).await;
            let Some(state) = state.upgrade() else { return };
            let current = state.down_epoch.lock().expect("down epoch");
            if *current == epoch {
                state.store().restarted();
                state.go_up();
            }
        });
    }

    /// Whether [`set_down`](Self::set_down)`(true)` is in force.
    pub fn is_down(&self) -> bool {
        *self.state().down.borrow()
    }

    // ----- watches -----

    /// Forgets the watch history: a watch from any resourceVersion older than the current one
    /// gets HTTP 200 and one ERROR event (410 `Expired`).
    pub fn compact(&self) {
        self.state().store().compact();
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch that allows bookmarks.
    pub fn send_bookmark(&self) {
        self.state().store().send_bookmarks();
    }

    /// Ends every open watch stream cleanly (the response ends, as at `timeoutSeconds`).
    pub fn drop_watches(&self) {
        self.state().store().drop_watches();
    }

    /// Sends bookmarks on this interval from now on (`None`: never).
    pub fn set_bookmark_interval(&self, every: Option<Duration>) {
        self.state().bookmark_interval.send_replace(every);
    }

    /// Watch streams open now.
    pub fn open_watches(&self) -> usize {
        self.state().store().open_watches()
    }

    /// Waits until `pred` holds, re-checking after each change to the server (objects, request
    /// log, down state) and at least every 50 ms. Returns false on timeout.
    pub async fn wait_for(&self, timeout: Duration, mut pred: impl FnMut(&TestApiServer) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.state().changes.subscribe();
        loop {
            changes.borrow_and_update();
            if pred(self) {
                return true;
            }
            let wake = deadline.min(tokio::time::Instant::now() + Duration::from_millis(50));
            let _ = tokio::time::timeout_at(wake, changes.changed()).await;
            if tokio::time::Instant::now() >= deadline {
                return pred(self);
            }
        }
    }
}

async fn bookmark_ticker(state: Arc<State>) {
    let mut interval = state.bookmark_interval.subscribe();
    let mut shutdown = state.shutdown.subscribe();
    loop {
        let every = *interval.borrow_and_update();
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            changed = interval.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = async {
                match every {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            } => state.store().send_bookmarks(),
        }
    }
}
