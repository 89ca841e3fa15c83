//! [`KubeClient`]: the few API calls the agent makes on its own Node, over reqwest with rustls.
//!
//! Credentials are kept as sources and checked before every request, which costs one `stat`
//! per file (the agent sends about one request a minute):
//! - token files (kubeconfig `tokenFile`, the in-cluster token) are re-read when their size,
//!   mtime or inode changes, so a rotated projected token is used at once;
//! - certificate, key and CA files likewise; when the TLS material changes the HTTP client is
//!   rebuilt (kubelet client certificates rotate);
//! - an exec plugin's credential is cached until a little before its `expirationTimestamp`
//!   (without one: until the server answers 401).
//!
//! A 401 makes the client refresh everything refreshable once (re-read the files, re-run the
//! plugin) and retry the request once; a second 401 is returned.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::Method;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use serde::Serialize;

use crate::config::KubernetesConfig;

use super::credentials::{Credentials, Material, MaterialSource, Secret, TokenSource};
use super::error::{ApiFailure, ApiStatus, HttpFailure, KubeError, error_chain, request_failure};
use super::exec::{ClusterInfo, ExecOutput, identity_pem, run_plugin};
use super::node::Node;
use super::time::format_rfc3339;
use super::watch::WatchStream;

/// `source.component` of the Events the agent posts, and its User-Agent.
pub const COMPONENT: &str = "gpu-node-agent";
/// Namespace of Node Events (where the kubelet puts them too).
pub const EVENT_NAMESPACE: &str = "default";
/// A watch connection that sends nothing for its `timeoutSeconds` plus this is presumed dead.
pub const WATCH_IDLE_MARGIN: Duration = Duration::from_secs(30);
/// Longest Event message sent; longer ones are cut (the API limits them).
pub const MAX_EVENT_MESSAGE: usize = 1024;

const USER_AGENT: &str = concat!("gpu-node-agent/", env!("CARGO_PKG_VERSION"));

/// Told the Kubernetes verb and HTTP status code of every response the API server sends (see
/// [`KubeClient::with_response_observer`]).
pub type ResponseObserver = Arc<dyn Fn(&'static str, u16) + Send + Sync>;

/// An API client for the agent's own Node. Cheap to clone (shared state behind an `Arc`).
#[derive(Clone)]
pub struct KubeClient {
    inner: Arc<Inner>,
    observer: Option<ResponseObserver>,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClient")
            .field("credentials", &self.inner.creds)
            .finish_non_exhaustive()
    }
}

struct Inner {
    creds: Credentials,
    /// Where requests go: the server URL, with the host replaced by `tls-server-name` if set.
    base: String,
    /// `tls-server-name`: resolve this name to the server's real host.
    alias: Option<AliasResolver>,
    request_timeout: Duration,
    /// Whether a 401 can be cured by re-reading or re-running something.
    refreshable: bool,
    state: tokio::sync::Mutex<AuthState>,
}

/// Loaded credential material and the HTTP client built from it.
#[derive(Default)]
struct AuthState {
    /// Bumped by every forced refresh, so that concurrent 401s refresh once.
    generation: u64,
    http: Option<Built>,
    ca: FileCache,
    cert: FileCache,
    key: FileCache,
    token: FileCache,
    exec: Option<ExecOutput>,
}

struct Built {
    client: reqwest::Client,
    ca: Option<Vec<u8>>,
    identity: Option<Vec<u8>>,
}

/// A file's bytes and the stamp they were read at.
#[derive(Default)]
struct FileCache {
    stamp: Option<FileStamp>,
    data: Option<Vec<u8>>,
}

/// What changes when a file is rewritten or replaced (projected tokens are swapped in by
/// renaming a symlinked directory, which changes the inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
    dev: u64,
    ino: u64,
}

impl FileStamp {
    fn of(meta: &fs::Metadata) -> FileStamp {
        FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// What a request is sent with.
struct Prepared {
    http: reqwest::Client,
    token: Option<Secret>,
    generation: u64,
}

/// How long a request may take.
#[derive(Clone, Copy)]
enum Limit {
    /// The whole exchange, body included (normal requests).
    Total(Duration),
    /// Only until the response headers (watches, whose body lasts minutes).
    Headers(Duration),
}

/// Severity of an Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EventType {
    /// Things going as planned.
    Normal,
    /// Something an operator should look at.
    Warning,
}

/// An Event about the agent's Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    /// The Node's name (also `source.host`).
    pub node_name: String,
    /// The Node's uid, when known (empty: omitted).
    pub node_uid: String,
    /// Normal or Warning.
    pub event_type: EventType,
    /// UpperCamelCase reason, e.g. `MigConfigApplied`.
    pub reason: String,
    /// Human-readable message (cut at [`MAX_EVENT_MESSAGE`] bytes).
    pub message: String,
}

impl KubeClient {
    /// A client for these credentials. Reads the CA, client certificate and token files now,
    /// so that a broken setup is reported at start; an exec plugin runs at the first request.
    pub fn new(creds: Credentials, cfg: &KubernetesConfig) -> Result<KubeClient, KubeError> {
        let tls_err = |reason: String| KubeError::Tls {
            origin: creds.origin.to_string(),
            server: creds.server.clone(),
            reason,
        };
        let mut url = reqwest::Url::parse(&creds.server).map_err(|e| tls_err(format!("server is not a URL: {e}")))?;
        let alias = match &creds.tls_server_name {
            None => None,
            Some(name) => {
                let host = match url.host_str() {
                    Some(host) => host.trim_start_matches('[').trim_end_matches(']').to_string(),
                    None => return Err(tls_err("server has no host".into())),
                };
                let port = url.port_or_known_default().unwrap_or(443);
                url.set_host(Some(name))
                    .map_err(|e| tls_err(format!("tls-server-name {name:?}: {e}")))?;
                Some(AliasResolver {
                    alias: name.to_ascii_lowercase(),
                    host,
                    port,
                })
            }
        };
        let base = url.as_str().trim_end_matches('/').to_string();
        let refreshable = matches!(creds.auth.token, Some(TokenSource::File { .. }))
            || creds.auth.exec.is_some()
            || creds
                .auth
                .client_cert
                .as_ref()
                .is_some_and(|c| matches!(c.cert.source, MaterialSource::File(_)));
        let mut inner = Inner {
            creds,
            base,
            alias,
            request_timeout: cfg.request_timeout,
            refreshable,
            state: tokio::sync::Mutex::new(AuthState::default()),
        };
        let mut state = AuthState::default();
        let loaded = inner.load_files(&mut state, false)?;
        inner.ensure_http(&mut state, loaded.ca, loaded.identity)?;
        *inner.state.get_mut() = state;
        Ok(KubeClient {
            inner: Arc::new(inner),
            observer: None,
        })
    }

    /// This client, calling `observer` with the verb and status code of every response (the
    /// agent counts them in its metrics; the kube module knows nothing of metrics).
    pub fn with_response_observer(mut self, observer: ResponseObserver) -> KubeClient {
        self.observer = Some(observer);
        self
    }

    /// The credentials this client uses.
    pub fn credentials(&self) -> &Credentials {
        &self.inner.creds
    }

    /// Reads the Node. `from_cache` asks for `resourceVersion=0`: served from the API server's
    /// watch cache, cheap, possibly a moment stale.
    pub async fn get_node(&self, name: &str, from_cache: bool) -> Result<Node, KubeError> {
        let mut path = format!("/api/v1/nodes/{}", encode(name));
        if from_cache {
            path.push_str("?resourceVersion=0");
        }
        let fail = |failure| KubeError::GetNode {
            name: name.to_string(),
            path: path.clone(),
            failure,
        };
        let limit = Limit::Total(self.inner.request_timeout);
        let response = self.send("get", Method::GET, &path, None, limit).await.map_err(fail)?;
        let body = response.bytes().await.map_err(|e| fail(request_failure(e)))?;
        Node::from_json(&body).map_err(|e| fail(ApiFailure::Decode(e)))
    }

    /// Watches the Node from `resource_version` (empty: from now, starting with its current
    /// state). The server ends the stream after `timeout` (`timeoutSeconds`, at least 1 s);
    /// a connection silent for longer than that plus [`WATCH_IDLE_MARGIN`] ends it with an
    /// error. Bookmarks are requested.
    pub async fn watch_node(
        &self,
        name: &str,
        resource_version: &str,
        timeout: Duration,
    ) -> Result<WatchStream, KubeError> {
        let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
        let secs = secs.max(1);
        let mut path = format!("/api/v1/nodes?watch=1&fieldSelector=metadata.name%3D{}", encode(name));
        if !resource_version.is_empty() {
            path.push_str(&format!("&resourceVersion={}", encode(resource_version)));
        }
        path.push_str(&format!("&allowWatchBookmarks=true&timeoutSeconds={secs}"));
        let limit = Limit::Headers(self.inner.request_timeout);
        let response = self
            .send("watch", Method::GET, &path, None, limit)
            .await
            .map_err(|failure| KubeError::WatchNode {
                name: name.to_string(),
                path: path.clone(),
                failure,
            })?;
        let idle = Duration::from_secs(secs) + WATCH_IDLE_MARGIN;
        Ok(WatchStream::from_response(response, idle, name.to_string(), path))
    }

    /// Sets (`Some`) or removes (`None`) labels and annotations with a JSON merge patch, and
    /// returns the updated Node. Keys not named are left alone; there is no resourceVersion
    /// precondition (the agent owns the keys it writes). Empty maps are left out of the patch.
    pub async fn patch_node_metadata(
        &self,
        name: &str,
        labels: &BTreeMap<String, Option<String>>,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<Node, KubeError> {
        let path = format!("/api/v1/nodes/{}", encode(name));
        let fail = |failure| KubeError::PatchNode {
            name: name.to_string(),
            path: path.clone(),
            failure,
        };
        let body = metadata_patch(labels, annotations);
        let limit = Limit::Total(self.inner.request_timeout);
        let response = self
            .send(
                "patch",
                Method::PATCH,
                &path,
                Some(("application/merge-patch+json", body)),
                limit,
            )
            .await
            .map_err(fail)?;
        let body = response.bytes().await.map_err(|e| fail(request_failure(e)))?;
        Node::from_json(&body).map_err(|e| fail(ApiFailure::Decode(e)))
    }

    /// Posts an Event about the Node in namespace `default`.
    pub async fn create_event(&self, event: &NodeEvent) -> Result<(), KubeError> {
        let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events");
        let body = event_body(event, SystemTime::now()).to_string().into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        let response = self
            .send("create", Method::POST, &path, Some(("application/json", body)), limit)
            .await
            .map_err(|failure| KubeError::CreateEvent {
                name: event.node_name.clone(),
                reason: event.reason.clone(),
                path: path.clone(),
                failure,
            })?;
        // Drain the body so the connection can be reused.
        let _ = response.bytes().await;
        Ok(())
    }

    /// Creates the RuntimeClass `name` with the handler `name` (`node.k8s.io/v1`). `Ok(false)`:
    /// it exists already (409 AlreadyExists), whoever made it; it is not changed.
    pub async fn create_runtime_class(&self, name: &str) -> Result<bool, KubeError> {
        let path = "/apis/node.k8s.io/v1/runtimeclasses".to_owned();
        let body = serde_json::json!({
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": COMPONENT}},
            "handler": name,
        })
        .to_string()
        .into_bytes();
        let limit = Limit::Total(self.inner.request_timeout);
        match self
            .send("create", Method::POST, &path, Some(("application/json", body)), limit)
            .await
        {
            Ok(response) => {
                let _ = response.bytes().await;
                Ok(true)
            }
            Err(failure) if failure.http().is_some_and(|h| h.code == 409) => Ok(false),
            Err(failure) => Err(KubeError::CreateRuntimeClass {
                name: name.to_owned(),
                path,
                failure,
            }),
        }
    }

    /// Sends one request, refreshing the credentials and retrying once on 401. `verb` is the
    /// Kubernetes verb (`get`, `watch`, `patch`, `create`) the request metrics count it under.
    async fn send(
        &self,
        verb: &'static str,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
        limit: Limit,
    ) -> Result<reqwest::Response, ApiFailure> {
        let url = format!("{}{path}", self.inner.base);
        let mut refresh = None;
        loop {
            let prepared = self
                .prepare(refresh)
                .await
                .map_err(|e| ApiFailure::Credentials(Box::new(e)))?;
            let mut request = prepared
                .http
                .request(method.clone(), &url)
                .header(ACCEPT, "application/json");
            if let Limit::Total(total) = limit {
                request = request.timeout(total);
            }
            if let Some((content_type, bytes)) = &body {
                request = request.header(CONTENT_TYPE, *content_type).body(bytes.clone());
            }
            if let Some(token) = &prepared.token {
                let mut value = HeaderValue::from_str(&format!("Bearer {}", token.expose())).map_err(|_| {
                    ApiFailure::Credentials(Box::new(KubeError::Tls {
                        origin: self.inner.creds.origin.to_string(),
                        server: self.inner.creds.server.clone(),
                        reason: "the token contains characters not allowed in an HTTP header".into(),
                    }))
                })?;
                value.set_sensitive(true);
                request = request.header(AUTHORIZATION, value);
            }
            let headers_limit = match limit {
                Limit::Total(d) | Limit::Headers(d) => d,
            };
            let response = match tokio::time::timeout(headers_limit, request.send()).await {
                Err(_) => return Err(ApiFailure::Timeout),
                Ok(Err(e)) => return Err(request_failure(e)),
                Ok(Ok(response)) => response,
            };
            let status = response.status();
            if let Some(observer) = &self.observer {
                observer(verb, status.as_u16());
            }
            if status.is_success() {
                return Ok(response);
            }
            if status == reqwest::StatusCode::UNAUTHORIZED && refresh.is_none() && self.inner.refreshable {
                tracing::debug!("{method} {path}: 401 Unauthorized; refreshing the credentials and retrying once");
                refresh = Some(prepared.generation);
                continue;
            }
            return Err(http_failure(response, headers_limit, prepared.token.as_ref()).await);
        }
    }

    /// The HTTP client and token for the next request. `refresh`: the generation a request got
    /// a 401 with; if nobody refreshed since, re-read every file and re-run the exec plugin.
    async fn prepare(&self, refresh: Option<u64>) -> Result<Prepared, KubeError> {
        let inner = &self.inner;
        let mut state = inner.state.lock().await;
        let force = refresh.is_some_and(|g| g == state.generation);
        if force {
            state.generation += 1;
            state.exec = None;
        }
        let mut loaded = inner.load_files(&mut state, force)?;
        if let Some(exec) = &inner.creds.auth.exec {
            let now = SystemTime::now();
            let output = match state.exec.take() {
                Some(output) if output.is_fresh(now) => output,
                _ => {
                    let cluster = ClusterInfo {
                        server: inner.creds.server.clone(),
                        ca_pem: loaded.ca.clone(),
                        insecure_skip_tls_verify: inner.creds.insecure_skip_tls_verify,
                        tls_server_name: inner.creds.tls_server_name.clone(),
                    };
                    let output = run_plugin(exec, Some(&cluster)).await?;
                    match output.expires {
                        Some(at) => tracing::debug!(
                            "exec plugin {:?} gave a credential valid until {}",
                            exec.command,
                            format_rfc3339(at)
                        ),
                        None => tracing::debug!("exec plugin {:?} gave a credential without expiry", exec.command),
                    }
                    output
                }
            };
            if let Some(token) = &output.token {
                loaded.token = Some(token.clone());
            }
            if let Some(identity) = &output.identity {
                loaded.identity = Some(identity.clone());
            }
            state.exec = Some(output);
        }
        let http = inner.ensure_http(&mut state, loaded.ca, loaded.identity)?;
        Ok(Prepared {
            http,
            token: loaded.token,
            generation: state.generation,
        })
    }
}

/// Credential material read from its sources.
struct Loaded {
    ca: Option<Vec<u8>>,
    identity: Option<Vec<u8>>,
    token: Option<Secret>,
}

impl Inner {
    /// Reads (or takes from the cache) the CA, the client certificate and key, and the token.
    fn load_files(&self, state: &mut AuthState, force: bool) -> Result<Loaded, KubeError> {
        let creds = &self.creds;
        let ca = match &creds.ca {
            Some(m) => Some(load_material(m, &mut state.ca, force)?),
            None => None,
        };
        let identity = match &creds.auth.client_cert {
            None => None,
            Some(cc) => {
                let cert = load_material(&cc.cert, &mut state.cert, force)?;
                let key = if cc.key.source == cc.cert.source {
                    cert.clone()
                } else {
                    load_material(&cc.key, &mut state.key, force)?
                };
                Some(identity_pem(&key, &cert))
            }
        };
        let token = match &creds.auth.token {
            None => None,
            Some(TokenSource::Inline(token)) => Some(token.clone()),
            Some(TokenSource::File { field, path }) => {
                let data = load_file(&mut state.token, path, field, force)?;
                let text = String::from_utf8_lossy(&data);
                let token = text.trim();
                if token.is_empty() {
                    return Err(KubeError::ReadFile {
                        what: field.clone(),
                        path: path.clone(),
                        source: io::Error::new(io::ErrorKind::InvalidData, "the token file is empty"),
                    });
                }
                Some(Secret::new(token))
            }
        };
        Ok(Loaded { ca, identity, token })
    }

    /// The HTTP client for this TLS material, built anew when the material changed.
    fn ensure_http(
        &self,
        state: &mut AuthState,
        ca: Option<Vec<u8>>,
        identity: Option<Vec<u8>>,
    ) -> Result<reqwest::Client, KubeError> {
        if let Some(built) = &state.http
            && built.ca == ca
            && built.identity == identity
        {
            return Ok(built.client.clone());
        }
        if state.http.is_some() {
            tracing::info!(
                "{}: TLS material changed; reconnecting with the new one",
                self.creds.origin
            );
        }
        let client = self.build_http(ca.as_deref(), identity.as_deref())?;
        state.http = Some(Built {
            client: client.clone(),
            ca,
            identity,
        });
        Ok(client)
    }

    fn build_http(&self, ca: Option<&[u8]>, identity: Option<&[u8]>) -> Result<reqwest::Client, KubeError> {
        let creds = &self.creds;
        let tls_err = |reason: String| KubeError::Tls {
            origin: creds.origin.to_string(),
            server: creds.server.clone(),
            reason,
        };
        let builder = crate::net::direct_to_loopback(reqwest::Client::builder(), &creds.server);
        let mut builder = builder
            .user_agent(USER_AGENT)
            .connect_timeout(self.request_timeout)
            .tcp_keepalive(Duration::from_secs(30))
            .redirect(reqwest::redirect::Policy::none());
        if creds.insecure_skip_tls_verify {
            tracing::warn!(
                "{}: insecure-skip-tls-verify is set: the API server's certificate is NOT verified, so anyone \
                 on the network path can impersonate it and read the agent's credentials; configure \
                 certificate-authority(-data) instead",
                creds.origin
            );
            builder = builder.tls_danger_accept_invalid_certs(true);
        } else if let Some(ca) = ca {
            let field = creds.ca.as_ref().map_or("certificate authority", |m| m.field.as_str());
            let certs = reqwest::Certificate::from_pem_bundle(ca)
                .map_err(|e| tls_err(format!("{field}: not a PEM certificate bundle: {}", error_chain(&e))))?;
            if certs.is_empty() {
                return Err(tls_err(format!("{field}: no PEM certificate in it")));
            }
            builder = builder.tls_certs_only(certs);
        }
        if let Some(identity) = identity {
            let identity = reqwest::Identity::from_pem(identity)
                .map_err(|e| tls_err(format!("client certificate and key: {}", error_chain(&e))))?;
            builder = builder.identity(identity);
        }
        if let Some(proxy) = &creds.proxy_url {
            let proxy = reqwest::Proxy::all(proxy.as_str())
                .map_err(|e| tls_err(format!("proxy-url {proxy:?}: {}", error_chain(&e))))?;
            builder = builder.proxy(proxy);
        }
        if let Some(alias) = &self.alias {
            builder = builder.dns_resolver(Arc::new(alias.clone()));
        }
        if self.base.starts_with("http://") {
            tracing::warn!(
                "{}: server {} is plain http: requests and credentials are not encrypted",
                creds.origin,
                creds.server
            );
        }
        builder.build().map_err(|e| tls_err(error_chain(&e)))
    }
}

fn load_material(material: &Material, cache: &mut FileCache, force: bool) -> Result<Vec<u8>, KubeError> {
    match &material.source {
        MaterialSource::Inline(data) => Ok(data.clone()),
        MaterialSource::File(path) => load_file(cache, path, &material.field, force),
    }
}

/// A file's bytes, re-read only when its stamp changed (or `force`). When it cannot be read
/// but was read before, the old bytes are used (a rotation in progress) with a warning.
fn load_file(cache: &mut FileCache, path: &Path, what: &str, force: bool) -> Result<Vec<u8>, KubeError> {
    let read = fs::metadata(path).map(|m| FileStamp::of(&m)).and_then(|stamp| {
        if !force
            && cache.stamp == Some(stamp)
            && let Some(data) = &cache.data
        {
            return Ok(data.clone());
        }
        let data = fs::read(path)?;
        if cache.data.is_some() && cache.stamp != Some(stamp) {
            tracing::info!("{what}: {} changed; using the new contents", path.display());
        }
        cache.stamp = Some(stamp);
        cache.data = Some(data.clone());
        Ok(data)
    });
    match read {
        Ok(data) => Ok(data),
        Err(source) => match &cache.data {
            Some(data) => {
                tracing::warn!(
                    "{what}: cannot read {}: {source}; using the copy read before",
                    path.display()
                );
                Ok(data.clone())
            }
            None => Err(KubeError::ReadFile {
                what: what.to_string(),
                path: path.to_path_buf(),
                source,
            }),
        },
    }
}

/// The merge patch body: `{"metadata":{"labels":{k: v|null},"annotations":{...}}}`.
fn metadata_patch(
    labels: &BTreeMap<String, Option<String>>,
    annotations: &BTreeMap<String, Option<String>>,
) -> Vec<u8> {
    let mut metadata = serde_json::Map::new();
    if !labels.is_empty() {
        metadata.insert("labels".into(), serde_json::to_value(labels).unwrap_or_default());
    }
    if !annotations.is_empty() {
        metadata.insert(
            "annotations".into(),
            serde_json::to_value(annotations).unwrap_or_default(),
        );
    }
    serde_json::json!({ "metadata": metadata }).to_string().into_bytes()
}

/// The core/v1 Event for a NodeEvent at `now`.
fn event_body(event: &NodeEvent, now: SystemTime) -> serde_json::Value {
    let time = format_rfc3339(now);
    let mut involved = serde_json::json!({ "apiVersion": "v1", "kind": "Node", "name": event.node_name });
    if !event.node_uid.is_empty() {
        involved["uid"] = event.node_uid.clone().into();
    }
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": { "generateName": format!("{}.", event.node_name), "namespace": EVENT_NAMESPACE },
        "involvedObject": involved,
        "reason": event.reason,
        "message": truncate(&event.message, MAX_EVENT_MESSAGE),
        "type": event.event_type,
        "source": { "component": COMPONENT, "host": event.node_name },
        "firstTimestamp": time,
        "lastTimestamp": time,
        "count": 1,
        "reportingComponent": COMPONENT,
        "reportingInstance": event.node_name,
    })
}

fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn http_failure(response: reqwest::Response, limit: Duration, token: Option<&Secret>) -> ApiFailure {
    let code = response.status().as_u16();
    let header_retry = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = match tokio::time::timeout(limit, response.bytes()).await {
        Ok(Ok(body)) => body.to_vec(),
        _ => Vec::new(),
    };
    let status = ApiStatus::from_json(&body);
    let retry_after = header_retry.or_else(|| status.as_ref()?.retry_after_seconds.map(Duration::from_secs));
    let excerpt = if status.is_none() {
        excerpt(&body, token)
    } else {
        String::new()
    };
    ApiFailure::Http(Box::new(HttpFailure {
        code,
        status,
        retry_after,
        body: excerpt,
    }))
}

/// The start of a body for a message: one line, at most 200 characters, never the token.
fn excerpt(body: &[u8], token: Option<&Secret>) -> String {
    let text = String::from_utf8_lossy(body);
    let mut text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if let Some(token) = token
        && !token.expose().is_empty()
    {
        text = text.replace(token.expose(), "<redacted>");
    }
    match text.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

/// Resolves the `tls-server-name` to the server URL's real host, so that TLS verifies the
/// certificate against that name while connecting to the real address.
#[derive(Clone)]
struct AliasResolver {
    alias: String,
    host: String,
    port: u16,
}

impl reqwest::dns::Resolve for AliasResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let target = if name.as_str().eq_ignore_ascii_case(&self.alias) {
            self.host.clone()
        } else {
            name.as_str().to_string()
        };
        let port = self.port;
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.as_str(), port)).await?.collect();
            let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::credentials::{Auth, ExecApiVersion, ExecConfig, Origin};
    use crate::kube::testserver::{Reply, TestServer};
    use crate::kube::watch::WatchEvent;
    use futures_util::StreamExt;
    use std::sync::Mutex;

    const TOKEN: &str = "sekrit-token-4f9a8c";
    const NODE: &str = r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"gpu-1","uid":"u-1","resourceVersion":"5","labels":{"a":"b"}}}"#;

    fn creds(server: &str, auth: Auth) -> Credentials {
        Credentials {
            server: server.to_string(),
            origin: Origin::Kubeconfig {
                path: "/k".into(),
                found_by: crate::kube::credentials::FoundBy::Config,
            },
            ca: None,
            insecure_skip_tls_verify: false,
            tls_server_name: None,
            proxy_url: None,
            auth,
        }
    }

    fn token_file(path: &Path) -> Auth {
        Auth {
            token: Some(TokenSource::File {
                field: "tokenFile".into(),
                path: path.to_path_buf(),
            }),
            ..Auth::default()
        }
    }

    fn client(server: &TestServer, auth: Auth) -> KubeClient {
        KubeClient::new(creds(&server.url(), auth), &KubernetesConfig::default()).expect("client")
    }

    fn bearer(req: &crate::kube::testserver::Request) -> String {
        req.header("authorization")
            .unwrap_or_default()
            .trim_start_matches("Bearer ")
            .to_string()
    }

    #[tokio::test]
    async fn get_node_sends_token_and_parses() {
        let server = TestServer::start(|req| {
            assert_eq!(req.method, "GET");
            assert_eq!(req.path, "/api/v1/nodes/gpu-1?resourceVersion=0");
            assert_eq!(req.header("accept"), Some("application/json"));
            if bearer(req) != TOKEN {
                return Reply::status(401, "Unauthorized");
            }
            Reply::json(200, NODE)
        })
        .await;
        let auth = Auth {
            token: Some(TokenSource::Inline(Secret::new(TOKEN))),
            ..Auth::default()
        };
        let node = client(&server, auth).get_node("gpu-1", true).await.expect("get");
        assert_eq!((node.name.as_str(), node.uid.as_str()), ("gpu-1", "u-1"));
        assert_eq!(node.labels["a"], "b");
    }

    #[tokio::test]
    async fn errors_carry_status_path_and_retry_after() {
        let server = TestServer::start(|req| match req.path.as_str() {
            "/api/v1/nodes/missing" => Reply::status(404, "NotFound"),
            "/api/v1/nodes/busy" => Reply::status(429, "TooManyRequests").with_header("Retry-After", "7"),
            _ => Reply::text(502, &format!("<html>bad gateway {TOKEN}</html>")),
        })
        .await;
        let auth = Auth {
            token: Some(TokenSource::Inline(Secret::new(TOKEN))),
            ..Auth::default()
        };
        let c = client(&server, auth);
        let err = c.get_node("missing", false).await.expect_err("404");
        assert!(err.is_not_found() && !err.is_transient());
        assert_eq!(
            err.to_string(),
            r#"get node "missing" (GET /api/v1/nodes/missing): HTTP 404 NotFound: test says NotFound"#
        );
        let err = c.get_node("busy", false).await.expect_err("429");
        assert!(err.is_transient());
        assert_eq!(err.retry_after(), Some(Duration::from_secs(7)));
        let err = c.get_node("proxy", false).await.expect_err("502");
        let text = err.to_string();
        assert!(
            text.contains("HTTP 502 Bad Gateway: <html>bad gateway <redacted></html>"),
            "{text}"
        );
        assert!(!format!("{err:?}").contains(TOKEN));
    }

    #[tokio::test]
    async fn connection_refused_is_transient() {
        // Bound but not listening: connections are refused, and no other test can take the port.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = socket.local_addr().expect("addr");
        let c = KubeClient::new(
            creds(&format!("http://{addr}"), Auth::default()),
            &KubernetesConfig::default(),
        )
        .expect("client");
        let err = c.get_node("gpu-1", false).await.expect_err("refused");
        assert!(err.is_transient(), "{err}");
        assert!(matches!(err.failure(), Some(ApiFailure::Connect(_))), "{err:?}");
    }

    #[tokio::test]
    async fn rotated_token_file_is_picked_up_before_the_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        fs::write(&path, "token-one\n").expect("write");
        let accepted = Arc::new(Mutex::new("token-one".to_string()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let server = {
            let (accepted, seen) = (accepted.clone(), seen.clone());
            TestServer::start(move |req| {
                seen.lock().unwrap().push(bearer(req));
                if bearer(req) == *accepted.lock().unwrap() {
                    Reply::json(200, NODE)
                } else {
                    Reply::status(401, "Unauthorized")
                }
            })
            .await
        };
        let c = client(&server, token_file(&path));
        c.get_node("gpu-1", false).await.expect("first");
        // The file rotates and the server stops accepting the old token.
        fs::write(&path, "token-two-longer\n").expect("rotate");
        *accepted.lock().unwrap() = "token-two-longer".into();
        c.get_node("gpu-1", false).await.expect("after rotation");
        assert_eq!(
            *seen.lock().unwrap(),
            ["token-one", "token-two-longer"],
            "no 401 round trip needed"
        );
    }

    #[tokio::test]
    async fn a_401_rereads_the_token_file_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        fs::write(&path, "token-aaa").expect("write");
        let accepted = Arc::new(Mutex::new("token-aaa".to_string()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let server = {
            let (accepted, seen) = (accepted.clone(), seen.clone());
            TestServer::start(move |req| {
                seen.lock().unwrap().push(bearer(req));
                if bearer(req) == *accepted.lock().unwrap() {
                    Reply::json(200, NODE)
                } else {
                    Reply::status(401, "Unauthorized")
                }
            })
            .await
        };
        let c = client(&server, token_file(&path));
        c.get_node("gpu-1", false).await.expect("first");
        // Same size, same mtime: the stamp does not show the change, the 401 does.
        let mtime = fs::metadata(&path).expect("meta").modified().expect("mtime");
        fs::write(&path, "token-bbb").expect("rotate");
        fs::File::options()
            .write(true)
            .open(&path)
            .expect("open")
            .set_modified(mtime)
            .expect("set mtime");
        *accepted.lock().unwrap() = "token-bbb".into();
        c.get_node("gpu-1", false).await.expect("after 401 and refresh");
        assert_eq!(*seen.lock().unwrap(), ["token-aaa", "token-aaa", "token-bbb"]);

        // A token that stays rejected: one refresh, one retry, then the error.
        *accepted.lock().unwrap() = "nobody".into();
        seen.lock().unwrap().clear();
        let err = c.get_node("gpu-1", false).await.expect_err("401");
        assert!(err.is_unauthorized());
        assert_eq!(seen.lock().unwrap().len(), 2);
        assert!(!err.to_string().contains("token-bbb") && !format!("{err:?}").contains("token-bbb"));
        assert!(!format!("{c:?}").contains("token-bbb"));
    }

    #[tokio::test]
    async fn exec_credential_is_cached_until_401() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("plugin.sh");
        let counter = dir.path().join("runs");
        fs::write(
            &script,
            format!(
                "#!/bin/sh\necho x >> '{}'\nn=$(wc -l < '{}' | tr -d ' ')\n\
                 printf '{{\"apiVersion\":\"client.authentication.k8s.io/v1beta1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"exec-%s\"}}}}' \"$n\"\n",
                counter.display(),
                counter.display()
            ),
        )
        .expect("write");
        let accepted = Arc::new(Mutex::new("exec-1".to_string()));
        let server = {
            let accepted = accepted.clone();
            TestServer::start(move |req| {
                if bearer(req) == *accepted.lock().unwrap() {
                    Reply::json(200, NODE)
                } else {
                    Reply::status(401, "Unauthorized")
                }
            })
            .await
        };
        let auth = Auth {
            exec: Some(ExecConfig {
                api_version: ExecApiVersion::V1Beta1,
                command: "sh".into(),
                program: "sh".into(),
                args: vec![script.display().to_string()],
                env: vec![],
                provide_cluster_info: true,
                install_hint: None,
                kubeconfig: "/k".into(),
            }),
            ..Auth::default()
        };
        let c = client(&server, auth);
        let runs = || fs::read_to_string(&counter).map(|t| t.lines().count()).unwrap_or(0);
        assert_eq!(runs(), 0, "the plugin runs at the first request, not at construction");
        c.get_node("gpu-1", false).await.expect("first");
        c.get_node("gpu-1", false).await.expect("second");
        assert_eq!(runs(), 1, "no expiry: cached");
        *accepted.lock().unwrap() = "exec-2".into();
        c.get_node("gpu-1", false).await.expect("after 401");
        assert_eq!(runs(), 2, "re-run after a 401");
    }

    #[tokio::test]
    async fn expired_exec_credential_is_renewed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("plugin.sh");
        let counter = dir.path().join("runs");
        let soon = format_rfc3339(SystemTime::now() + Duration::from_secs(10));
        fs::write(
            &script,
            format!(
                "#!/bin/sh\necho x >> '{}'\nprintf '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t\",\"expirationTimestamp\":\"{soon}\"}}}}'\n",
                counter.display()
            ),
        )
        .expect("write");
        let server = TestServer::start(|_| Reply::json(200, NODE)).await;
        let auth = Auth {
            exec: Some(ExecConfig {
                api_version: ExecApiVersion::V1,
                command: "sh".into(),
                program: "sh".into(),
                args: vec![script.display().to_string()],
                env: vec![],
                provide_cluster_info: false,
                install_hint: None,
                kubeconfig: "/k".into(),
            }),
            ..Auth::default()
        };
        let c = client(&server, auth);
        c.get_node("gpu-1", false).await.expect("first");
        c.get_node("gpu-1", false).await.expect("second");
        // Expiring within the margin: every request renews.
        assert_eq!(fs::read_to_string(&counter).expect("runs").lines().count(), 2);
    }

    #[tokio::test]
    async fn patch_and_event_bodies() {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let server = {
            let requests = requests.clone();
            TestServer::start(move |req| {
                requests.lock().unwrap().push(req.clone());
                match req.method.as_str() {
                    "PATCH" => Reply::json(200, NODE),
                    _ => Reply::json(201, "{}"),
                }
            })
            .await
        };
        let c = client(&server, Auth::default());
        let labels = BTreeMap::from([
            ("nvidia.com/mig.config.state".to_string(), Some("success".to_string())),
            ("old".to_string(), None),
        ]);
        c.patch_node_metadata("gpu-1", &labels, &BTreeMap::new())
            .await
            .expect("patch");
        let event = NodeEvent {
            node_name: "gpu-1".into(),
            node_uid: "u-1".into(),
            event_type: EventType::Warning,
            reason: "MigConfigFailed".into(),
            message: "x".repeat(2000),
        };
        c.create_event(&event).await.expect("event");

        let requests = requests.lock().unwrap();
        let patch = &requests[0];
        assert_eq!(
            (patch.method.as_str(), patch.path.as_str()),
            ("PATCH", "/api/v1/nodes/gpu-1")
        );
        assert_eq!(patch.header("content-type"), Some("application/merge-patch+json"));
        let body: serde_json::Value = serde_json::from_slice(&patch.body).expect("json");
        assert_eq!(
            body,
            serde_json::json!({"metadata": {"labels": {"nvidia.com/mig.config.state": "success", "old": null}}})
        );
        let post = &requests[1];
        assert_eq!(
            (post.method.as_str(), post.path.as_str()),
            ("POST", "/api/v1/namespaces/default/events")
        );
        let body: serde_json::Value = serde_json::from_slice(&post.body).expect("json");
        assert_eq!(
            body["involvedObject"],
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u-1"})
        );
        assert_eq!(body["metadata"]["generateName"], "gpu-1.");
        assert_eq!(body["type"], "Warning");
        assert_eq!(
            body["source"],
            serde_json::json!({"component": "gpu-node-agent", "host": "gpu-1"})
        );
        assert_eq!(body["count"], 1);
        assert_eq!(body["message"].as_str().map(str::len), Some(MAX_EVENT_MESSAGE));
        assert_eq!(body["firstTimestamp"], body["lastTimestamp"]);
    }

    #[test]
    fn event_timestamps_are_rfc3339() {
        let event = NodeEvent {
            node_name: "n".into(),
            node_uid: String::new(),
            event_type: EventType::Normal,
            reason: "R".into(),
            message: "é".repeat(600),
        };
        let body = event_body(&event, SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        assert_eq!(body["firstTimestamp"], "2023-11-14T22:13:20Z");
        assert!(body["involvedObject"].get("uid").is_none());
        assert_eq!(body["message"].as_str().map(str::len), Some(1024));
    }

    #[tokio::test]
    async fn watch_streams_events_split_across_chunks() {
        let server = TestServer::start(|req| {
            assert_eq!(
                req.path,
                "/api/v1/nodes?watch=1&fieldSelector=metadata.name%3Dgpu-1&resourceVersion=5\
                 &allowWatchBookmarks=true&timeoutSeconds=300"
            );
            let modified = format!(r#"{{"type":"MODIFIED","object":{NODE}}}"#);
            let (a, b) = modified.split_at(40);
            Reply::chunks(vec![
                a.as_bytes().to_vec(),
                format!("{b}\n{{\"type\":\"BOOKMARK\",\"object\":{{\"kind\":\"Node\",\"metadata\":{{\"resourceVersion\":\"9\"}}}}}}\n{{\"type\":\"ERR")
                    .into_bytes(),
                br#"OR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}"#.to_vec(),
            ])
        })
        .await;
        let c = client(&server, Auth::default());
        let mut stream = c
            .watch_node("gpu-1", "5", Duration::from_secs(300))
            .await
            .expect("watch");
        let mut events = Vec::new();
        while let Some(event) = stream.next().await {
            events.push(event.expect("event"));
        }
        assert_eq!(events.len(), 3, "{events:?}");
        assert!(matches!(&events[0], WatchEvent::Modified(n) if n.resource_version == "5"));
        assert_eq!(
            events[1],
            WatchEvent::Bookmark {
                resource_version: "9".into()
            }
        );
        assert_eq!(events[2], WatchEvent::Gone);
    }

    #[tokio::test]
    async fn watch_http_410_is_gone() {
        let server = TestServer::start(|_| Reply::status(410, "Expired")).await;
        let c = client(&server, Auth::default());
        let err = c
            .watch_node("gpu-1", "1", Duration::from_secs(1))
            .await
            .expect_err("410");
        assert!(err.is_gone(), "{err}");
    }

    #[tokio::test]
    async fn tls_material_is_checked_at_construction() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("ca.crt");
        fs::write(&ca, "not a certificate").expect("write");
        let mut c = creds("https://127.0.0.1:6443", Auth::default());
        c.ca = Some(Material {
            field: "kubeconfig /k, cluster \"k\": certificate-authority".into(),
            source: MaterialSource::File(ca),
        });
        let err = KubeClient::new(c.clone(), &KubernetesConfig::default())
            .expect_err("bad CA")
            .to_string();
        assert!(
            err.contains("certificate-authority") && err.contains("no PEM certificate"),
            "{err}"
        );
        c.ca.as_mut().expect("ca").source = MaterialSource::File(dir.path().join("missing"));
        let err = KubeClient::new(c, &KubernetesConfig::default())
            .expect_err("missing CA")
            .to_string();
        assert!(err.contains("cannot read") && err.contains("missing"), "{err}");
    }

    #[test]
    fn encodes_query_values() {
        assert_eq!(encode("gpu-1.example_x~"), "gpu-1.example_x~");
        assert_eq!(encode("a b/c=d&e"), "a%20b%2Fc%3Dd%26e");
    }
}
