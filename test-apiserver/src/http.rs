//! The HTTPS listener, per-connection handling and the request handler.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Body as _, Frame, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

use crate::dra;
use crate::load::{Counted, LoadTable};
use crate::patch::{self, PatchType};
use crate::selector::{
    CLAIM_FIELDS, EVENT_FIELDS, FieldSelector, Filter, LabelSelector, NODE_FIELDS, SLICE_FIELDS, requires_equal,
};
use crate::status::{ApiError, go_quote};
use crate::store::{WatchFrom, new_uid};
use crate::tls::CertIdentity;
use crate::{Failure, RequestRecord, State};

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// How long a client has for its TLS handshake after the connection is accepted.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(32);

/// Accepts connections until shutdown. While the server is down, connections are reset at once.
pub(crate) async fn serve(state: Arc<State>, listener: TcpListener, acceptor: Option<TlsAcceptor>) {
    let mut shutdown = state.shutdown.subscribe();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if *state.down.borrow() {
            reset(tcp);
            continue;
        }
        let _ = tcp.set_nodelay(true);
        tokio::spawn(connection(state.clone(), acceptor.clone(), tcp));
    }
}

/// Closes with RST rather than FIN, as near to "connection refused" as an accepted socket gets.
fn reset(tcp: tokio::net::TcpStream) {
    let _ = tcp.set_zero_linger();
    drop(tcp);
}

async fn connection(state: Arc<State>, acceptor: Option<TlsAcceptor>, tcp: tokio::net::TcpStream) {
    // Going down bumps `cuts`; a connection ends at the first bump after it started, even if the
    // server is already up again by the time this task looks.
    let mut cuts = state.cuts.subscribe();
    let started = *cuts.borrow_and_update();
    let mut shutdown = state.shutdown.subscribe();
    if *state.down.borrow() {
        reset(tcp);
        return;
    }
    let serve = async {
        let Some(acceptor) = acceptor else {
            // Plain http: no certificate, bearer tokens only.
            return serve_io(state.clone(), None, tcp).await;
        };
        // kube-apiserver's `ReadHeaderTimeout` (32 s) is also Go's TLS handshake timeout; a
        // burst of thousands of handshakes on a small machine needs all of it.
        let Ok(Ok(tls)) = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await else {
            return;
        };
        let identity = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| state.pki.authenticate(chain));
        serve_io(state.clone(), identity, tls).await;
    };
    tokio::select! {
        _ = serve => {}
        _ = cuts.wait_for(|c| *c != started) => {}
        _ = shutdown.wait_for(|s| *s) => {}
    }
}

/// Serves HTTP/1.1 or HTTP/2 on one connection, as `identity` (the client certificate's).
async fn serve_io<I>(state: Arc<State>, identity: Option<CertIdentity>, io: I)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = Arc::new(identity);
    let service = hyper::service::service_fn(move |req| handle(state.clone(), conn.clone(), req));
    let builder = auto::Builder::new(TokioExecutor::new());
    let _ = builder.serve_connection(TokioIo::new(io), service).await;
}

/// What a request addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Version,
    Nodes,
    Node(String),
    Events(Option<String>),
    Event(String, String),
    RuntimeClasses,
    RuntimeClass(String),
    ResourceSlices,
    ResourceSlice(String),
    /// All namespaces (`None`) or one.
    ResourceClaims(Option<String>),
    ResourceClaim(String, String),
    Unknown,
}

struct Route {
    target: Target,
    /// The Kubernetes verb (`get`, `list`, `watch`, `patch`, ...), or the lower-cased method.
    verb: String,
    resource: &'static str,
    /// A watch through `/api/v1/watch/...`.
    watch_path: bool,
}

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(hi << 4 | lo);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> HashMap<String, String> {
    q.split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// Go's `strconv.ParseBool`.
fn parse_bool(query: &HashMap<String, String>, key: &str) -> Result<bool, ApiError> {
    match query.get(key).map(String::as_str) {
        None | Some("") => Ok(false),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(false),
        Some(other) => Err(ApiError::bad_request(format!(
            "{key}: strconv.ParseBool: parsing {other:?}: invalid syntax"
        ))),
    }
}

fn route(method: &Method, path: &str, query: &HashMap<String, String>) -> Route {
    let segments: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(percent_decode)
        .collect();
    let segs: Vec<&str> = segments.iter().map(String::as_str).collect();
    let (target, watch_path) = match segs.as_slice() {
        ["version"] => (Target::Version, false),
        ["api", "v1", "nodes"] => (Target::Nodes, false),
        ["api", "v1", "nodes", name] => (Target::Node((*name).to_owned()), false),
        ["api", "v1", "watch", "nodes"] => (Target::Nodes, true),
        ["api", "v1", "watch", "nodes", name] => (Target::Node((*name).to_owned()), true),
        ["api", "v1", "events"] => (Target::Events(None), false),
        ["api", "v1", "namespaces", ns, "events"] => (Target::Events(Some((*ns).to_owned())), false),
        ["api", "v1", "namespaces", ns, "events", name] => (Target::Event((*ns).to_owned(), (*name).to_owned()), false),
        ["apis", "node.k8s.io", "v1", "runtimeclasses"] => (Target::RuntimeClasses, false),
        ["apis", "node.k8s.io", "v1", "runtimeclasses", name] => (Target::RuntimeClass((*name).to_owned()), false),
        ["apis", "resource.k8s.io", "v1", "resourceslices"] => (Target::ResourceSlices, false),
        ["apis", "resource.k8s.io", "v1", "resourceslices", name] => (Target::ResourceSlice((*name).to_owned()), false),
        ["apis", "resource.k8s.io", "v1", "resourceclaims"] => (Target::ResourceClaims(None), false),
        ["apis", "resource.k8s.io", "v1", "namespaces", ns, "resourceclaims"] => {
            (Target::ResourceClaims(Some((*ns).to_owned())), false)
        }
        [
            "apis",
            "resource.k8s.io",
            "v1",
            "namespaces",
            ns,
            "resourceclaims",
            name,
        ] => (Target::ResourceClaim((*ns).to_owned(), (*name).to_owned()), false),
        _ => (Target::Unknown, false),
    };
    let watch = watch_path
        || matches!(
            query.get("watch").map(String::as_str),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        );
    let collection = matches!(
        target,
        Target::Nodes | Target::Events(_) | Target::RuntimeClasses | Target::ResourceSlices | Target::ResourceClaims(_)
    );
    let verb = match *method {
        Method::GET if watch_path || (collection && watch) => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if collection => "deletecollection",
        Method::DELETE => "delete",
        _ => "",
    };
    let verb = if verb.is_empty() {
        method.as_str().to_ascii_lowercase()
    } else {
        verb.to_owned()
    };
    let resource = match target {
        Target::Nodes | Target::Node(_) => "nodes",
        Target::Events(_) | Target::Event(..) => "events",
        Target::RuntimeClasses | Target::RuntimeClass(_) => "runtimeclasses",
        Target::ResourceSlices | Target::ResourceSlice(_) => "resourceslices",
        Target::ResourceClaims(_) | Target::ResourceClaim(..) => "resourceclaims",
        Target::Version | Target::Unknown => "",
    };
    Route {
        target,
        verb,
        resource,
        watch_path,
    }
}

fn base_response(code: u16) -> hyper::http::response::Builder {
    Response::builder()
        .status(code)
        .header(CONTENT_TYPE, "application/json")
        .header("Cache-Control", "no-cache, private")
        .header("Audit-Id", new_uid())
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    base_response(code)
        .body(Full::new(Bytes::from(body)).boxed_unsync())
        .expect("response")
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut resp = json_response(e.code, &e.to_status());
    if let Some(secs) = e.retry_after {
        resp.headers_mut().insert("Retry-After", HeaderValue::from(secs));
    }
    resp
}

/// A watch body: one line per message until the sender goes, or the deadline passes.
fn stream_response(rx: mpsc::UnboundedReceiver<Bytes>, timeout: Option<Duration>) -> Response<Body> {
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let stream = futures_util::stream::unfold(rx, move |mut rx| async move {
        let next = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, rx.recv()).await.ok().flatten(),
            None => rx.recv().await,
        };
        next.map(|line| (Ok::<_, Infallible>(Frame::data(line)), rx))
    });
    base_response(200)
        .body(StreamBody::new(stream).boxed_unsync())
        .expect("response")
}

/// [`Failure::Oversized`]: the Node as stored (or a bare one when there is none) with `padding`
/// bytes in an annotation (in a MODIFIED event line for a watch), generated 64 KiB at a time as
/// the client reads it.
fn oversized(
    state: &State,
    route: &Route,
    query: &HashMap<String, String>,
    padding: u64,
    declare_length: bool,
) -> Response<Body> {
    const CHUNK: usize = 64 << 10;
    const KEY: &str = "test-apiserver/padding";
    let name = match &route.target {
        Target::Node(name) => name.clone(),
        _ => query
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
            .map_or_else(|| "oversized".to_owned(), str::to_owned),
    };
    let mut node = state
        .store()
        .node(&name)
        .cloned()
        .unwrap_or_else(|| json!({"kind": "Node", "apiVersion": "v1", "metadata": {"name": name}}));
    node["metadata"]["annotations"][KEY] = json!("");
    let object = if route.verb == "watch" {
        json!({"type": "MODIFIED", "object": node})
    } else {
        node
    };
    let mut text = serde_json::to_string(&object).unwrap_or_default();
    if route.verb == "watch" {
        text.push('\n');
    }
    // Split inside the empty annotation value: the padding goes between the quotes.
    let marker = format!("{}:\"", json!(KEY));
    let at = text.find(&format!("{marker}\"")).map_or(0, |i| i + marker.len());
    let tail = text.split_off(at);
    let head = text;
    let length = head.len() as u64 + padding + tail.len() as u64;
    let filler = Bytes::from(vec![b'x'; CHUNK]);
    let pad = futures_util::stream::unfold(padding, move |left| {
        let filler = filler.clone();
        async move {
            let n = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
            (n > 0).then(|| (filler.slice(..n), left - n as u64))
        }
    });
    let stream = futures_util::stream::once(async move { Bytes::from(head) })
        .chain(pad)
        .chain(futures_util::stream::once(async move { Bytes::from(tail) }))
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    let mut builder = base_response(200);
    if declare_length {
        builder = builder.header(hyper::header::CONTENT_LENGTH, length);
    }
    builder.body(StreamBody::new(stream).boxed_unsync()).expect("response")
}

/// 403 from authorization: the RBAC message, plus `: reason` when the authorizer that said no
/// gave one (the Node authorizer does).
fn forbidden(route: &Route, user: &str, path: &str, reason: Option<&str>) -> ApiError {
    let (name, namespace) = match &route.target {
        Target::Node(n) => (Some(n.as_str()), None),
        Target::Event(ns, n) => (Some(n.as_str()), Some(ns.as_str())),
        Target::Events(ns) => (None, ns.as_deref()),
        Target::RuntimeClass(n) => (Some(n.as_str()), None),
        Target::ResourceSlice(n) => (Some(n.as_str()), None),
        Target::ResourceClaim(ns, n) => (Some(n.as_str()), Some(ns.as_str())),
        Target::ResourceClaims(ns) => (None, ns.as_deref()),
        _ => (None, None),
    };
    let group = match route.resource {
        "runtimeclasses" => "node.k8s.io",
        "resourceslices" | "resourceclaims" => dra::GROUP,
        _ => "",
    };
    if route.resource.is_empty() {
        return ApiError::forbidden(
            format!(
                "forbidden: User {} cannot {} path {}",
                go_quote(user),
                route.verb,
                go_quote(path)
            ),
            json!({}),
        );
    }
    let qualified = if group.is_empty() {
        route.resource.to_owned()
    } else {
        format!("{}.{group}", route.resource)
    };
    let subject = match name {
        Some(n) => format!("{qualified} {}", go_quote(n)),
        None => qualified,
    };
    let scope = match namespace {
        Some(ns) => format!("in the namespace {}", go_quote(ns)),
        None => "at the cluster scope".to_owned(),
    };
    let mut details = json!({"kind": route.resource});
    if let Some(n) = name {
        details["name"] = Value::String(n.to_owned());
    }
    if !group.is_empty() {
        details["group"] = Value::String(group.to_owned());
    }
    let because = reason.map(|r| format!(": {r}")).unwrap_or_default();
    ApiError::forbidden(
        format!(
            "{subject} is forbidden: User {} cannot {} resource {} in API group {} {scope}{because}",
            go_quote(user),
            route.verb,
            go_quote(route.resource),
            go_quote(group)
        ),
        details,
    )
}

/// The node a node credential (`system:node:<name>`) stands for. Upstream also wants the group
/// `system:nodes`; bearer tokens here carry no groups, so the user name alone decides.
fn node_of(user: &str) -> Option<&str> {
    user.strip_prefix("system:node:").filter(|n| !n.is_empty())
}

/// The Node authorizer's decision on DRA objects for a node credential: `Some(reason)` denies.
/// Other users and other resources are not restricted here.
fn node_authorizer(state: &State, route: &Route, user: &str, query: &HashMap<String, String>) -> Option<String> {
    let node = node_of(user)?;
    match (&route.target, route.verb.as_str()) {
        (Target::ResourceSlices, "list" | "watch" | "deletecollection") => {
            let selector = query.get("fieldSelector").map(String::as_str).unwrap_or_default();
            (!requires_equal(selector, "spec.nodeName", node))
                .then(|| "can only list/watch/deletecollection resourceslices with nodeName field selector".to_owned())
        }
        // Allowed only through the graph edge slice -> node, which a missing slice does not have.
        (Target::ResourceSlice(name), _) => {
            let own = state
                .store()
                .resource_slice(name)
                .is_some_and(|s| s.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node));
            (!own).then(|| format!("no relationship found between node '{node}' and this object"))
        }
        // The graph edge claim -> pod -> node is not modelled: any claim may be read.
        (Target::ResourceClaim(..), "get") => None,
        (Target::ResourceClaims(_) | Target::ResourceClaim(..), _) => {
            Some("can only get individual resources of this type".to_owned())
        }
        _ => None,
    }
}

/// 403 from an admission plugin (NodeRestriction): `<resource> "<name>" is forbidden: <why>`.
fn admission_forbidden(resource: &str, name: &str, why: &str) -> ApiError {
    let (plural, group) = resource.split_once('.').unwrap_or((resource, ""));
    let message = if name.is_empty() {
        format!("{resource} is forbidden: {why}")
    } else {
        format!("{resource} {} is forbidden: {why}", go_quote(name))
    };
    ApiError::forbidden(message, json!({"name": name, "group": group, "kind": plural}))
}

/// Who sent the request: the client certificate wins (x509 comes first in kube-apiserver's
/// authenticator chain), then a known bearer token.
fn authenticate(state: &State, cert: &Option<CertIdentity>, authorization: Option<&str>) -> Option<String> {
    if let Some(id) = cert {
        return Some(id.user.clone());
    }
    let header = authorization?.trim();
    let (scheme, token) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    state.tokens.lock().expect("tokens").get(token.trim()).cloned()
}

enum Outcome {
    Respond(Response<Body>),
    Disconnect,
}

async fn handle(
    state: Arc<State>,
    cert: Arc<Option<CertIdentity>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, io::Error> {
    let at = Instant::now();
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(io::Error::other)?.to_bytes();
    let path = parts.uri.path();
    let raw_query = parts.uri.query().unwrap_or_default();
    let query = parse_query(raw_query);
    let route = route(&parts.method, path, &query);
    let header = |name| parts.headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let content_type = header(CONTENT_TYPE);
    let user = authenticate(&state, &cert, header(AUTHORIZATION));
    let slot = LoadTable::slot(&route.verb, route.resource);
    state.load.request(slot, body.len(), user.as_deref());
    let masters = cert
        .as_ref()
        .as_ref()
        .is_some_and(|id| id.groups.iter().any(|g| g == "system:masters"));
    let outcome = process(
        &state,
        &route,
        user.as_deref(),
        masters,
        path,
        &query,
        content_type,
        &body,
    )
    .await;
    let (status, result) = match outcome {
        Outcome::Respond(resp) => {
            let status = resp.status().as_u16();
            if status == 429 {
                state.load.too_many_requests(slot);
            }
            let resp = match resp.body().size_hint().exact() {
                Some(len) => {
                    state.load.sent(slot, usize::try_from(len).unwrap_or(usize::MAX));
                    resp
                }
                None => {
                    let watch = route.verb == "watch";
                    resp.map(|body| Counted::wrap(body, state.clone(), slot, watch))
                }
            };
            (status, Ok(resp))
        }
        Outcome::Disconnect => (0, Err(io::Error::other("test-apiserver: injected disconnect"))),
    };
    if state.logging.load(Ordering::Relaxed) {
        let record = RequestRecord {
            at,
            method: parts.method.as_str().to_owned(),
            path: path.to_owned(),
            query: raw_query.to_owned(),
            user,
            status,
            watch: route.verb == "watch",
            verb: route.verb.clone(),
            content_type: content_type.map(str::to_owned),
            body: String::from_utf8_lossy(&body).into_owned(),
        };
        state.log.lock().expect("log").push(record);
    }
    state.touch();
    result
}

/// The max-in-flight filter's 429: kube-apiserver writes it with Go's `http.Error`, so the body
/// is plain text, not a `Status`, and the only hint to wait is the `Retry-After` header.
fn too_many_in_flight() -> Response<Body> {
    Response::builder()
        .status(429)
        .header("Cache-Control", "no-cache, private")
        .header("Audit-Id", new_uid())
        .header(CONTENT_TYPE, "text/plain; charset=utf-8")
        .header("X-Content-Type-Options", "nosniff")
        .header("Retry-After", "1")
        .body(Full::new(Bytes::from_static(b"Too many requests, please try again later.\n")).boxed_unsync())
        .expect("response")
}

#[allow(clippy::too_many_arguments)]
async fn process(
    state: &State,
    route: &Route,
    user: Option<&str>,
    masters: bool,
    path: &str,
    query: &HashMap<String, String>,
    content_type: Option<&str>,
    body: &[u8],
) -> Outcome {
    let Some(user) = user else {
        return Outcome::Respond(error_response(&ApiError::unauthorized()));
    };
    // kube-apiserver's filter order: authentication, then max-in-flight, then authorization.
    // The place is held until the answer is ready (through an injected delay, too).
    let Some(_in_flight) = state.inflight.admit(&route.verb, masters) else {
        return Outcome::Respond(too_many_in_flight());
    };
    let mut fault = state.take_fault(&route.verb, route.resource);
    if let Some(Failure::Delay(d)) = fault {
        tokio::time::sleep(d).await;
        fault = None;
    }
    let injected = match fault {
        None | Some(Failure::Delay(_)) => None,
        Some(Failure::Disconnect) => return Outcome::Disconnect,
        Some(Failure::TooManyRequests { retry_after_secs }) => Some(ApiError::too_many_requests(retry_after_secs)),
        Some(Failure::Unauthorized) => Some(ApiError::unauthorized()),
        Some(Failure::Forbidden) => Some(forbidden(route, user, path, None)),
        Some(Failure::Internal) => Some(ApiError::internal("injected failure")),
        Some(Failure::Unavailable) => Some(ApiError::unavailable()),
        Some(Failure::Timeout) => Some(ApiError::timeout()),
        Some(Failure::Oversized {
            padding,
            declare_length,
        }) => {
            return Outcome::Respond(oversized(state, route, query, padding, declare_length));
        }
    };
    if let Some(e) = injected {
        return Outcome::Respond(error_response(&e));
    }
    if let Some(reason) = node_authorizer(state, route, user, query) {
        return Outcome::Respond(error_response(&forbidden(route, user, path, Some(&reason))));
    }
    if state.is_forbidden(user, &route.verb, route.resource) {
        return Outcome::Respond(error_response(&forbidden(route, user, path, None)));
    }
    let resp = match dispatch(state, route, user, query, content_type, body) {
        Ok(resp) => resp,
        Err(e) => error_response(&e),
    };
    Outcome::Respond(resp)
}

fn filter(query: &HashMap<String, String>, fields: &[&str], name: Option<&str>) -> Result<Filter, ApiError> {
    let mut field_selector = query.get("fieldSelector").cloned().unwrap_or_default();
    if let Some(name) = name {
        // `/api/v1/watch/nodes/NAME` is a watch with `metadata.name=NAME`.
        if !field_selector.is_empty() {
            field_selector.push(',');
        }
        field_selector.push_str(&format!("metadata.name={name}"));
    }
    Ok(Filter {
        fields: FieldSelector::parse(&field_selector, fields).map_err(ApiError::bad_request)?,
        labels: LabelSelector::parse(query.get("labelSelector").map(String::as_str).unwrap_or_default())
            .map_err(ApiError::bad_request)?,
    })
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("error decoding request body: {e}")))
}

fn dispatch(
    state: &State,
    route: &Route,
    user: &str,
    query: &HashMap<String, String>,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let verb = route.verb.as_str();
    let patch_type = || PatchType::from_content_type(content_type).ok_or_else(PatchType::unsupported);
    let resp = match (&route.target, verb) {
        (Target::Version, "get") => json_response(
            200,
            &json!({
                "major": "1", "minor": "31", "gitVersion": "v1.31.0", "gitCommit": "test-apiserver",
                "gitTreeState": "clean", "buildDate": "2024-08-13T07:28:49Z", "goVersion": "go1.22.5",
                "compiler": "gc", "platform": "linux/amd64",
            }),
        ),
        (Target::Nodes | Target::Node(_), "watch") => {
            let name = match &route.target {
                Target::Node(n) if route.watch_path => Some(n.as_str()),
                _ => None,
            };
            return watch(state, query, filter(query, NODE_FIELDS, name)?);
        }
        (Target::Nodes, "list") => json_response(200, &state.store().node_list(&filter(query, NODE_FIELDS, None)?)),
        (Target::Node(name), "get") => match state.store().node(name) {
            Some(node) => json_response(200, node),
            None => return Err(ApiError::not_found("nodes", name)),
        },
        (Target::Node(name), "patch") => {
            let kind = patch_type()?;
            let updated = {
                let mut store = state.store();
                let current = store.node(name).ok_or_else(|| ApiError::not_found("nodes", name))?;
                let patched = patch::apply(current, kind, body)?;
                store.update_node(name, patched)?
            };
            state.touch();
            json_response(200, &updated)
        }
        (Target::Node(name), "update") => {
            let new = parse_body(body)?;
            let updated = state.store().update_node(name, new)?;
            state.touch();
            json_response(200, &updated)
        }
        (Target::Events(_), "watch") => return Err(ApiError::method_not_allowed()),
        (Target::Events(ns), "list") => json_response(
            200,
            &state
                .store()
                .event_list(ns.as_deref(), &filter(query, EVENT_FIELDS, None)?),
        ),
        (Target::Events(Some(ns)), "create") => {
            let created = state.store().create_event(ns, parse_body(body)?)?;
            state.touch();
            json_response(201, &created)
        }
        (Target::Event(ns, name), "get") => match state.store().event(ns, name) {
            Some(ev) => json_response(200, ev),
            None => return Err(ApiError::not_found("events", name)),
        },
        (Target::Event(ns, name), "patch") => {
            let kind = patch_type()?;
            let updated = {
                let mut store = state.store();
                let current = store
                    .event(ns, name)
                    .ok_or_else(|| ApiError::not_found("events", name))?;
                let patched = patch::apply(current, kind, body)?;
                store.update_event(ns, name, patched)?
            };
            state.touch();
            json_response(200, &updated)
        }
        (Target::Event(ns, name), "update") => {
            let updated = state.store().update_event(ns, name, parse_body(body)?)?;
            state.touch();
            json_response(200, &updated)
        }
        (Target::RuntimeClasses, "list") => {
            let items: Vec<Value> = state.store().runtime_classes().values().cloned().collect();
            json_response(
                200,
                &json!({"kind": "RuntimeClassList", "apiVersion": "node.k8s.io/v1", "metadata": {}, "items": items}),
            )
        }
        (Target::RuntimeClasses, "create") => {
            let created = state.store().create_runtime_class(parse_body(body)?)?;
            state.touch();
            json_response(201, &created)
        }
        (Target::RuntimeClass(name), "get") => match state.store().runtime_classes().get(name) {
            Some(rc) => json_response(200, rc),
            None => return Err(ApiError::not_found("runtimeclasses.node.k8s.io", name)),
        },
        (Target::ResourceSlices | Target::ResourceClaims(_), "watch") => return Err(ApiError::method_not_allowed()),
        (Target::ResourceSlices, "list") => json_response(
            200,
            &state.store().resource_slice_list(&filter(query, SLICE_FIELDS, None)?),
        ),
        (Target::ResourceSlices, "create") => {
            let obj = parse_body(body)?;
            dra::decode_slice(&obj)?;
            // NodeRestriction admission: runs before validation.
            if let Some(node) = node_of(user)
                && obj.pointer("/spec/nodeName").and_then(Value::as_str) != Some(node)
            {
                let name = obj
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                return Err(admission_forbidden(
                    dra::SLICES,
                    name,
                    "can only create ResourceSlice with the same NodeName as the requesting node",
                ));
            }
            let created = state.store().create_resource_slice(obj)?;
            state.touch();
            json_response(201, &created)
        }
        (Target::ResourceSlices, "deletecollection") => {
            let filter = filter(query, SLICE_FIELDS, None)?;
            let list = {
                let mut store = state.store();
                let deleted = store.delete_matching_slices(&filter);
                store.dra_list("ResourceSliceList", deleted)
            };
            state.touch();
            json_response(200, &list)
        }
        (Target::ResourceSlice(name), "get") => match state.store().resource_slice(name) {
            Some(slice) => json_response(200, slice),
            None => return Err(ApiError::not_found(dra::SLICES, name)),
        },
        (Target::ResourceSlice(name), "update") => {
            let new = parse_body(body)?;
            dra::decode_slice(&new)?;
            let updated = state.store().update_resource_slice(name, new)?;
            state.touch();
            json_response(200, &updated)
        }
        (Target::ResourceSlice(name), "patch") => {
            let kind = patch_type()?;
            let updated = {
                let mut store = state.store();
                let current = store
                    .resource_slice(name)
                    .ok_or_else(|| ApiError::not_found(dra::SLICES, name))?;
                let patched = patch::apply(current, kind, body)?;
                dra::decode_slice(&patched)?;
                store.update_resource_slice(name, patched)?
            };
            state.touch();
            json_response(200, &updated)
        }
        (Target::ResourceSlice(name), "delete") => {
            let preconditions = delete_preconditions(body)?;
            let deleted = {
                let mut store = state.store();
                let current = store
                    .resource_slice(name)
                    .ok_or_else(|| ApiError::not_found(dra::SLICES, name))?;
                check_preconditions(dra::SLICES, name, current, &preconditions)?;
                store.delete_resource_slice(name)
            };
            state.touch();
            let uid = deleted
                .as_ref()
                .and_then(|d| d.pointer("/metadata/uid"))
                .cloned()
                .unwrap_or_default();
            json_response(
                200,
                &json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "group": dra::GROUP, "kind": "resourceslices", "uid": uid},
                }),
            )
        }
        (Target::ResourceClaims(ns), "list") => json_response(
            200,
            &state
                .store()
                .resource_claim_list(ns.as_deref(), &filter(query, CLAIM_FIELDS, None)?),
        ),
        (Target::ResourceClaim(ns, name), "get") => match state.store().resource_claim(ns, name) {
            Some(claim) => json_response(200, claim),
            None => return Err(ApiError::not_found(dra::CLAIMS, name)),
        },
        (Target::Unknown, _) => return Err(ApiError::no_route()),
        _ => return Err(ApiError::method_not_allowed()),
    };
    Ok(resp)
}

/// `DeleteOptions.preconditions` from a DELETE body: (uid, resourceVersion).
fn delete_preconditions(body: &[u8]) -> Result<(Option<String>, Option<String>), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok((None, None));
    }
    let options = parse_body(body)?;
    let field = |f: &str| {
        options
            .pointer(&format!("/preconditions/{f}"))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    Ok((field("uid"), field("resourceVersion")))
}

fn check_preconditions(
    resource: &str,
    name: &str,
    current: &Value,
    (uid, rv): &(Option<String>, Option<String>),
) -> Result<(), ApiError> {
    let meta = |f: &str| {
        current
            .pointer(&format!("/metadata/{f}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    if let Some(uid) = uid
        && *uid != meta("uid")
    {
        return Err(ApiError::conflict(
            resource,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta("uid")
            ),
        ));
    }
    if let Some(rv) = rv
        && *rv != meta("resourceVersion")
    {
        return Err(ApiError::conflict(
            resource,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                meta("resourceVersion")
            ),
        ));
    }
    Ok(())
}

fn watch(state: &State, query: &HashMap<String, String>, filter: Filter) -> Result<Response<Body>, ApiError> {
    let bookmarks = parse_bool(query, "allowWatchBookmarks")?;
    let send_initial_events = parse_bool(query, "sendInitialEvents")?;
    let timeout = match query.get("timeoutSeconds").map(String::as_str) {
        None | Some("") => None,
        Some(s) => {
            let secs: u64 = s
                .parse()
                .map_err(|_| ApiError::bad_request(format!("timeoutSeconds: invalid value {s:?}")))?;
            (secs > 0).then(|| Duration::from_secs(secs))
        }
    };
    let from = match query.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => WatchFrom::Now,
        Some(s) => WatchFrom::After(
            s.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {s:?}")))?,
        ),
    };
    let rx = match state.store().watch(filter, from, bookmarks, send_initial_events) {
        Ok(rx) => rx,
        Err(expired) => {
            // HTTP 200, then one ERROR event carrying the 410 Status, then the end.
            let (tx, rx) = mpsc::unbounded_channel();
            let mut line =
                serde_json::to_vec(&json!({"type": "ERROR", "object": expired.to_status()})).unwrap_or_default();
            line.push(b'\n');
            let _ = tx.send(Bytes::from(line));
            rx
        }
    };
    Ok(stream_response(rx, timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query("watch=1&fieldSelector=metadata.name%3Dgpu-1&labelSelector=a+in+(x%2Cy)&x");
        assert_eq!(q["fieldSelector"], "metadata.name=gpu-1");
        assert_eq!(q["labelSelector"], "a in (x,y)");
        assert_eq!(q["x"], "");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn routes() {
        let q = parse_query("watch=true");
        assert_eq!(route(&Method::GET, "/api/v1/nodes", &q).verb, "watch");
        assert_eq!(route(&Method::GET, "/api/v1/nodes", &HashMap::new()).verb, "list");
        assert_eq!(route(&Method::GET, "/api/v1/nodes/a", &HashMap::new()).verb, "get");
        assert_eq!(
            route(&Method::GET, "/api/v1/watch/nodes/a", &HashMap::new()).verb,
            "watch"
        );
        let r = route(&Method::POST, "/api/v1/namespaces/default/events", &HashMap::new());
        assert_eq!((r.verb.as_str(), r.resource), ("create", "events"));
        let r = route(&Method::POST, "/apis/node.k8s.io/v1/runtimeclasses", &HashMap::new());
        assert_eq!((r.verb.as_str(), r.resource), ("create", "runtimeclasses"));
        let r = route(
            &Method::GET,
            "/apis/node.k8s.io/v1/runtimeclasses/nvidia",
            &HashMap::new(),
        );
        assert!(matches!(r.target, Target::RuntimeClass(ref n) if n == "nvidia"));
        assert_eq!(route(&Method::GET, "/apis/x", &HashMap::new()).target, Target::Unknown);
        let none = HashMap::new();
        let r = route(&Method::DELETE, "/apis/resource.k8s.io/v1/resourceslices", &none);
        assert_eq!((r.verb.as_str(), r.resource), ("deletecollection", "resourceslices"));
        let r = route(&Method::DELETE, "/apis/resource.k8s.io/v1/resourceslices/s1", &none);
        assert_eq!(
            (r.verb.as_str(), &r.target),
            ("delete", &Target::ResourceSlice("s1".into()))
        );
        let r = route(&Method::GET, "/apis/resource.k8s.io/v1/resourceslices", &q);
        assert_eq!(r.verb, "watch");
        let r = route(
            &Method::GET,
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c",
            &none,
        );
        assert_eq!(
            (r.verb.as_str(), r.resource, &r.target),
            (
                "get",
                "resourceclaims",
                &Target::ResourceClaim("default".into(), "c".into())
            )
        );
        let r = route(
            &Method::GET,
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims",
            &none,
        );
        assert_eq!(r.verb, "list");
    }
}
