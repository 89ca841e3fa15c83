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
//!
//! This file holds the client, its state and its construction; `calls.rs` the API calls (with the
//! patch and Event bodies), `dra.rs` the DRA driver's ResourceSlice and ResourceClaim calls,
//! `http.rs` sending one request (the reqwest client from the TLS
//! material, the time limits, the retry after a 401, what a failed response says), `auth.rs`
//! keeping the credentials current (file caches, the exec plugin's credential, the HTTP client
//! rebuilt when the TLS material changes).

mod auth;
mod calls;
mod dra;
mod http;

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::config::KubernetesConfig;

use super::credentials::{Credentials, MaterialSource, Secret, TokenSource};
use super::error::KubeError;
use super::exec::ExecOutput;

pub use calls::{COMPONENT, EVENT_NAMESPACE, EventType, MAX_EVENT_MESSAGE, NodeEvent, WATCH_IDLE_MARGIN};

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
        if url.scheme() == "http" {
            plain_http(&creds, cfg.allow_insecure_http)?;
        }
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
}

/// A plain `http://` server: refused when a bearer token would be sent over it (an inline
/// token, a token file, an exec plugin's token) unless `kubernetes.allow_insecure_http`; else
/// one warning per client. A client certificate is never sent without TLS, so it alone leaks
/// nothing (and authenticates nothing).
fn plain_http(creds: &Credentials, allowed: bool) -> Result<(), KubeError> {
    let credential = match (&creds.auth.token, &creds.auth.exec) {
        (Some(TokenSource::Inline(_)), _) => Some("bearer token".to_string()),
        (Some(TokenSource::File { path, .. }), _) => Some(format!("bearer token from {}", path.display())),
        (None, Some(exec)) => Some(format!("credential of the exec plugin {:?}", exec.command)),
        (None, None) => None,
    };
    match credential {
        Some(credential) if !allowed => Err(KubeError::InsecureHttp {
            origin: creds.origin.to_string(),
            server: creds.server.clone(),
            credential,
        }),
        Some(credential) => {
            tracing::warn!(
                "{}: server {} is plain http: the {credential} is sent in cleartext, readable by anyone on \
                 the network path (allowed by kubernetes.allow_insecure_http)",
                creds.origin,
                creds.server
            );
            Ok(())
        }
        None => {
            tracing::warn!(
                "{}: server {} is plain http: requests and answers are not encrypted",
                creds.origin,
                creds.server
            );
            Ok(())
        }
    }
}

/// Credential material read from its sources.
struct Loaded {
    ca: Option<Vec<u8>>,
    identity: Option<Vec<u8>>,
    token: Option<Secret>,
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
mod tests;
