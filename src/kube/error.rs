//! [`KubeError`]: everything that can go wrong finding credentials and talking to the API
//! server, with the classification the retry loops need. Messages name files, fields, URL
//! paths, HTTP statuses and the server's `Status` reason and message; they never contain a
//! token or key material.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::limit::BodyError;
use crate::host::size;

/// A Kubernetes `Status` object, as sent with API errors and in watch `ERROR` events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiStatus {
    /// The HTTP status code the Status stands for (0 when the object has none).
    pub code: u16,
    /// Machine-readable reason, e.g. `NotFound`, `Expired`, `TooManyRequests`.
    pub reason: String,
    /// Human-readable message, e.g. `nodes "gpu-1" not found`.
    pub message: String,
    /// `details.retryAfterSeconds`, when the server suggested a delay.
    pub retry_after_seconds: Option<u64>,
}

impl ApiStatus {
    /// Parses a Status object from a response body; `None` when the body is not one.
    pub fn from_json(body: &[u8]) -> Option<ApiStatus> {
        let raw: RawStatus = serde_json::from_slice(body).ok()?;
        if raw.kind.as_deref() != Some("Status") {
            return None;
        }
        Some(raw.into_status())
    }
}

impl fmt::Display for ApiStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.reason.is_empty(), self.message.is_empty()) {
            (false, false) => write!(f, "{}: {}", self.reason, self.message),
            (false, true) => f.write_str(&self.reason),
            (true, false) => f.write_str(&self.message),
            (true, true) => write!(f, "status code {}", self.code),
        }
    }
}

/// The fields of a `Status` the agent reads; also the shape of a watch `ERROR` object.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RawStatus {
    pub kind: Option<String>,
    pub code: Option<u16>,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub details: Option<RawStatusDetails>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct RawStatusDetails {
    pub retry_after_seconds: Option<u64>,
}

impl RawStatus {
    pub(crate) fn into_status(self) -> ApiStatus {
        ApiStatus {
            code: self.code.unwrap_or(0),
            reason: self.reason.unwrap_or_default(),
            message: self.message.unwrap_or_default(),
            retry_after_seconds: self.details.and_then(|d| d.retry_after_seconds),
        }
    }
}

/// An HTTP error answer from the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpFailure {
    /// HTTP status code.
    pub code: u16,
    /// The `Status` object of the body, when there was one.
    pub status: Option<ApiStatus>,
    /// The `Retry-After` header, else `details.retryAfterSeconds`.
    pub retry_after: Option<Duration>,
    /// The start of a body that was not a Status (a proxy's error page, say), for the message.
    pub body: String,
}

impl fmt::Display for HttpFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HTTP {}", self.code)?;
        match &self.status {
            Some(status) if !status.reason.is_empty() || !status.message.is_empty() => write!(f, " {status}")?,
            _ => {
                if let Some(phrase) = reqwest::StatusCode::from_u16(self.code)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                {
                    write!(f, " {phrase}")?;
                }
                if !self.body.is_empty() {
                    write!(f, ": {}", self.body)?;
                }
            }
        }
        if let Some(after) = self.retry_after {
            write!(f, " (retry after {}s)", after.as_secs())?;
        }
        Ok(())
    }
}

/// Why one request to the API server failed.
#[derive(Debug)]
pub enum ApiFailure {
    /// No connection: refused, unreachable, DNS, or the TLS handshake failed.
    Connect(String),
    /// The request took longer than the request timeout.
    Timeout,
    /// The connection broke while sending or receiving, or a watch went silent.
    Transport(String),
    /// The server answered with an error status.
    Http(Box<HttpFailure>),
    /// The answer was not what the API promises.
    Decode(String),
    /// The answer (or one watch event line) is larger than the agent reads; see `kube::limit`.
    TooLarge {
        /// What was too large: `the API server's answer`, `a watch event line`.
        what: &'static str,
        /// The limit, in bytes.
        limit: usize,
        /// The `Content-Length` that was over it, when the answer declared one.
        declared: Option<u64>,
    },
    /// No usable credentials for the request (a token file that cannot be read, an exec plugin
    /// that failed, a certificate that does not parse).
    Credentials(Box<KubeError>),
}

impl fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiFailure::Connect(m) => write!(f, "cannot connect: {m}"),
            ApiFailure::Timeout => f.write_str("timed out"),
            ApiFailure::Transport(m) => f.write_str(m),
            ApiFailure::Http(h) => h.fmt(f),
            ApiFailure::Decode(m) => write!(f, "unexpected answer: {m}"),
            ApiFailure::TooLarge { what, limit, declared } => {
                write!(f, "{what} is over the {} limit", size(*limit as u64))?;
                match declared {
                    Some(n) => write!(f, " (Content-Length {n}; not read)"),
                    None => f.write_str(" (reading stopped there)"),
                }
            }
            ApiFailure::Credentials(e) => write!(f, "no usable credentials: {e}"),
        }
    }
}

impl std::error::Error for ApiFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ApiFailure::Credentials(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl ApiFailure {
    pub(crate) fn http(&self) -> Option<&HttpFailure> {
        match self {
            ApiFailure::Http(h) => Some(h),
            _ => None,
        }
    }

    fn is_transient(&self) -> bool {
        match self {
            ApiFailure::Connect(_) | ApiFailure::Timeout | ApiFailure::Transport(_) => true,
            ApiFailure::Http(h) => h.code == 429 || h.code >= 500,
            ApiFailure::Decode(_) => false,
            // Retried on the caller's backoff like any error, but not as is at once: an object
            // does not shrink by itself.
            ApiFailure::TooLarge { .. } => false,
            ApiFailure::Credentials(e) => e.is_transient(),
        }
    }
}

/// What a failed reqwest request (or body read) means to a caller: timed out, not connected,
/// or broken in transport. Here, not in the client, because watch streams read bodies too.
pub(crate) fn request_failure(e: reqwest::Error) -> ApiFailure {
    let e = e.without_url();
    if e.is_timeout() {
        ApiFailure::Timeout
    } else if e.is_connect() {
        ApiFailure::Connect(error_chain(&e))
    } else {
        ApiFailure::Transport(error_chain(&e))
    }
}

/// What a failed bounded body read ([`super::limit::read_body`]) means to a caller.
pub(crate) fn body_failure(e: BodyError) -> ApiFailure {
    match e {
        BodyError::TooLarge { limit, declared } => ApiFailure::TooLarge {
            what: "the API server's answer",
            limit,
            declared,
        },
        BodyError::Transport(e) => request_failure(e),
    }
}

/// An error and its sources, `: `-joined, skipping repeats.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = err.source();
    }
    parts.join(": ")
}

/// Everything the kube module can fail at. Variants are named after the failed operation; the
/// `Display` text is the whole message for the operator.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// A kubeconfig named by the config or the environment does not exist.
    #[error("kubeconfig {} (named by {named_by}) does not exist", path.display())]
    KubeconfigNotFound {
        /// The file as it was looked up (under the root).
        path: PathBuf,
        /// `kubernetes.kubeconfig` or `$KUBECONFIG`.
        named_by: &'static str,
    },

    /// `$KUBECONFIG` is set but none of its entries exists.
    #[error("$KUBECONFIG names no existing file (looked for {looked_for})")]
    KubeconfigEnvNotFound {
        /// The entries, as looked up under the root, comma separated.
        looked_for: String,
    },

    /// A file (kubeconfig, token, certificate, key, CA) could not be read.
    #[error("{what}: cannot read {}: {source}", path.display())]
    ReadFile {
        /// What the file is and who named it, e.g. `kubeconfig /etc/kubernetes/kubelet.conf,
        /// user "default-auth": client-certificate`.
        what: String,
        /// The file as it was opened.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A kubeconfig is malformed or lacks what the agent needs.
    #[error("kubeconfig {}: {field}: {reason}", path.display())]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// Where in it, e.g. `current-context` or `user "admin": client-key-data`.
        field: String,
        /// What is wrong.
        reason: String,
    },

    /// The in-cluster service account is unusable.
    #[error("in-cluster service account {}: {reason}", dir.display())]
    InCluster {
        /// The service account directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// An exec credential plugin could not be run or gave no usable credential.
    #[error("exec credential plugin {command:?} (kubeconfig {}): {reason}", kubeconfig.display())]
    ExecPlugin {
        /// The kubeconfig naming the plugin.
        kubeconfig: PathBuf,
        /// The command as written in the kubeconfig (never its arguments).
        command: String,
        /// What went wrong; never the plugin's output.
        reason: String,
    },

    /// The server URL is plain `http://` and a bearer token (or an exec plugin's credential)
    /// would be sent over it in cleartext, without `kubernetes.allow_insecure_http`.
    #[error(
        "{origin}: server {server} is plain http://, so the {credential} would be sent in cleartext: \
         refusing to connect; use the cluster's https:// URL, or set kubernetes.allow_insecure_http = true \
         in the agent's config to accept this"
    )]
    InsecureHttp {
        /// Where the credentials came from, e.g. `kubeconfig /etc/kubernetes/kubelet.conf`.
        origin: String,
        /// The API server URL.
        server: String,
        /// What would be sent: `bearer token`, `exec credential plugin's token`.
        credential: String,
    },

    /// The TLS material does not make a usable client.
    #[error("{origin}: cannot set up TLS for {server}: {reason}")]
    Tls {
        /// Where the credentials came from, e.g. `kubeconfig /etc/kubernetes/kubelet.conf`.
        origin: String,
        /// The API server URL.
        server: String,
        /// What is wrong.
        reason: String,
    },

    /// Reading the Node failed.
    #[error("get node {name:?} (GET {path}): {failure}{}", forbidden_hint(failure, "get nodes"))]
    GetNode {
        /// The Node's name.
        name: String,
        /// The URL path and query.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Listing the Node by name (the watcher's read, which gives the resourceVersion to watch
    /// from) failed.
    #[error(
        "list node {name:?} (GET {path}): {failure}{}",
        forbidden_hint(failure, "list nodes")
    )]
    ListNode {
        /// The Node's name.
        name: String,
        /// The URL path and query.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Starting or reading a watch of the Node failed.
    #[error(
        "watch node {name:?} (GET {path}): {failure}{}",
        forbidden_hint(failure, "list and watch nodes")
    )]
    WatchNode {
        /// The Node's name.
        name: String,
        /// The URL path and query.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Patching the Node's labels or annotations failed.
    #[error(
        "patch node {name:?} (PATCH {path}): {failure}{}",
        forbidden_hint(failure, "patch nodes")
    )]
    PatchNode {
        /// The Node's name.
        name: String,
        /// The URL path.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Posting an Event failed.
    #[error(
        "create event {reason:?} for node {name:?} (POST {path}): {failure}{}",
        forbidden_hint(failure, "create events in namespace default")
    )]
    CreateEvent {
        /// The Node's name.
        name: String,
        /// The Event's reason.
        reason: String,
        /// The URL path.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Updating an Event (its count, message and lastTimestamp) failed.
    #[error(
        "patch event {event:?} for node {name:?} (PATCH {path}): {failure}{}",
        forbidden_hint(failure, "patch events in namespace default")
    )]
    PatchEvent {
        /// The Node's name.
        name: String,
        /// The Event object's name.
        event: String,
        /// The URL path.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// Creating a RuntimeClass failed.
    #[error(
        "create RuntimeClass {name:?} (POST {path}): {failure}{}",
        forbidden_hint(failure, "create runtimeclasses.node.k8s.io")
    )]
    CreateRuntimeClass {
        /// The RuntimeClass's name (and handler).
        name: String,
        /// The URL path.
        path: String,
        /// Why.
        failure: ApiFailure,
    },

    /// A DRA call (ResourceSlices, ResourceClaims) failed.
    #[error("{verb} {what} ({method} {path}): {failure}{}", dra_forbidden_hint(failure))]
    Dra {
        /// The Kubernetes verb.
        verb: &'static str,
        /// The object, e.g. `ResourceClaim default/gpu-claim`.
        what: String,
        /// The HTTP method.
        method: &'static str,
        /// The URL path and query.
        path: String,
        /// Why.
        failure: ApiFailure,
    },
}

/// A 403 on a DRA call: what a node's credentials may do.
fn dra_forbidden_hint(failure: &ApiFailure) -> String {
    match failure.http() {
        Some(h) if h.code == 403 => " (with the kubelet's credentials the Node authorizer allows a node only \
             ResourceSlices with its own spec.nodeName, listed with that field selector, and only get on the \
             ResourceClaims of its own pods; another identity needs RBAC on resourceslices and resourceclaims \
             in resource.k8s.io)"
            .to_string(),
        _ => String::new(),
    }
}

/// A 403 says what permission is missing and the two usual causes.
fn forbidden_hint(failure: &ApiFailure, permission: &str) -> String {
    match failure.http() {
        Some(h) if h.code == 403 => format!(
            " (the agent's identity needs permission to {permission}: grant it with RBAC; with the kubelet's \
             own credentials the NodeRestriction admission plugin allows only this node's own Node and \
             forbids node-restriction.kubernetes.io/ labels)"
        ),
        _ => String::new(),
    }
}

impl KubeError {
    /// The request failure behind an API operation error.
    pub fn failure(&self) -> Option<&ApiFailure> {
        match self {
            KubeError::GetNode { failure, .. }
            | KubeError::ListNode { failure, .. }
            | KubeError::WatchNode { failure, .. }
            | KubeError::PatchNode { failure, .. }
            | KubeError::CreateEvent { failure, .. }
            | KubeError::PatchEvent { failure, .. }
            | KubeError::CreateRuntimeClass { failure, .. }
            | KubeError::Dra { failure, .. } => Some(failure),
            _ => None,
        }
    }

    /// The HTTP status of an API error answer.
    pub fn status_code(&self) -> Option<u16> {
        self.failure().and_then(ApiFailure::http).map(|h| h.code)
    }

    /// The server's `Status` object of an API error answer.
    pub fn api_status(&self) -> Option<&ApiStatus> {
        self.failure()
            .and_then(ApiFailure::http)
            .and_then(|h| h.status.as_ref())
    }

    /// How long the server asked the client to wait (`Retry-After` or
    /// `details.retryAfterSeconds`), typically with 429 and 503.
    pub fn retry_after(&self) -> Option<Duration> {
        self.failure().and_then(ApiFailure::http).and_then(|h| h.retry_after)
    }

    /// 401: the credentials were rejected (after one refresh, when they can be refreshed).
    pub fn is_unauthorized(&self) -> bool {
        self.status_code() == Some(401)
    }

    /// 403: the identity lacks a permission.
    pub fn is_forbidden(&self) -> bool {
        self.status_code() == Some(403)
    }

    /// 404: the object (or the API path) does not exist.
    pub fn is_not_found(&self) -> bool {
        self.status_code() == Some(404)
    }

    /// 409: a conflicting write.
    pub fn is_conflict(&self) -> bool {
        self.status_code() == Some(409)
    }

    /// 410: the resourceVersion is too old; list again.
    pub fn is_gone(&self) -> bool {
        self.status_code() == Some(410)
    }

    /// Worth retrying as is: connection errors, timeouts, 429 and 5xx.
    pub fn is_transient(&self) -> bool {
        self.failure().is_some_and(ApiFailure::is_transient)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(code: u16, status: Option<ApiStatus>, retry_after: Option<Duration>) -> ApiFailure {
        ApiFailure::Http(Box::new(HttpFailure {
            code,
            status,
            retry_after,
            body: String::new(),
        }))
    }

    #[test]
    fn status_parses_and_displays() {
        let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
            "message":"nodes \"x\" not found","reason":"NotFound","details":{"name":"x","kind":"nodes"},"code":404}"#;
        let status = ApiStatus::from_json(body).expect("a Status");
        assert_eq!(status.code, 404);
        assert_eq!(status.to_string(), r#"NotFound: nodes "x" not found"#);
        assert!(ApiStatus::from_json(br#"{"kind":"Node"}"#).is_none());
        assert!(ApiStatus::from_json(b"<html>").is_none());
    }

    #[test]
    fn classification() {
        let e = KubeError::GetNode {
            name: "gpu-1".into(),
            path: "/api/v1/nodes/gpu-1".into(),
            failure: http(429, None, Some(Duration::from_secs(3))),
        };
        assert!(e.is_transient());
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(
            e.to_string(),
            r#"get node "gpu-1" (GET /api/v1/nodes/gpu-1): HTTP 429 Too Many Requests (retry after 3s)"#
        );

        let e = KubeError::WatchNode {
            name: "gpu-1".into(),
            path: "/api/v1/nodes?watch=1".into(),
            failure: http(410, None, None),
        };
        assert!(e.is_gone() && !e.is_transient());

        let e = KubeError::PatchNode {
            name: "gpu-1".into(),
            path: "/api/v1/nodes/gpu-1".into(),
            failure: http(
                403,
                Some(ApiStatus {
                    code: 403,
                    reason: "Forbidden".into(),
                    message: "nodes \"gpu-1\" is forbidden".into(),
                    retry_after_seconds: None,
                }),
                None,
            ),
        };
        assert!(e.is_forbidden());
        let text = e.to_string();
        assert!(
            text.contains("HTTP 403 Forbidden: nodes \"gpu-1\" is forbidden"),
            "{text}"
        );
        assert!(
            text.contains("permission to patch nodes") && text.contains("NodeRestriction"),
            "{text}"
        );

        for (failure, transient) in [
            (ApiFailure::Connect("refused".into()), true),
            (ApiFailure::Timeout, true),
            (http(503, None, None), true),
            (http(404, None, None), false),
            (ApiFailure::Decode("x".into()), false),
        ] {
            let e = KubeError::GetNode {
                name: "n".into(),
                path: "/".into(),
                failure,
            };
            assert_eq!(e.is_transient(), transient, "{e}");
        }
    }
}
