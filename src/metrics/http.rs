//! The metrics endpoint: HTTP/1.1 (hyper), `GET` or `HEAD` on the metrics path answers the
//! encoded registry (OpenMetrics when the `Accept` header asks for it, as Prometheus does, else
//! the Prometheus text format); any other path is 404, any other method on the path 405.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ACCEPT, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::{CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics};

/// How long a client may take to send its request headers (a stalled client must not hold a
/// connection open forever).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection is served (Prometheus opens another at its next scrape).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// The most bytes a request's head may take (hyper's read buffer): a scrape's request is a few
/// hundred bytes.
const MAX_REQUEST_HEAD: usize = 16 * 1024;

/// Connections served at once unless [`MetricsServer::with_max_connections`] says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// A bound metrics endpoint, not yet serving.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    metrics: Metrics,
    path: Arc<str>,
    max_connections: usize,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)).
    pub async fn bind(addr: SocketAddr, metrics: Metrics, path: &str) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr).await?;
        Ok(MetricsServer {
            listener,
            metrics,
            path: Arc::from(path),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        })
    }

    /// Serves at most `max` connections at once; more wait in the kernel's listen backlog (they
    /// hold none of the agent's file descriptors) until one ends. However many clients connect,
    /// the agent keeps descriptors for the kubelet, the API server and the GPUs.
    pub fn with_max_connections(mut self, max: usize) -> MetricsServer {
        self.max_connections = max.max(1);
        self
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` completes; open connections are then dropped.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let MetricsServer {
            listener,
            metrics,
            path,
            max_connections,
        } = self;
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept(), if connections.len() < max_connections => match accepted {
                    Ok((stream, _)) => {
                        let (metrics, path) = (metrics.clone(), path.clone());
                        connections.spawn(async move {
                            let service = hyper::service::service_fn(move |req| {
                                let response = respond(&metrics, &path, &req);
                                async move { Ok::<_, Infallible>(response) }
                            });
                            let served = hyper::server::conn::http1::Builder::new()
                                .timer(TokioTimer::new())
                                .header_read_timeout(HEADER_TIMEOUT)
                                .max_buf_size(MAX_REQUEST_HEAD)
                                .serve_connection(TokioIo::new(stream), service);
                            // A kept-alive connection gives its place up after a while, so
                            // idle clients cannot hold every place for good.
                            match tokio::time::timeout(CONNECTION_LIFETIME, served).await {
                                Ok(Err(e)) => tracing::debug!("metrics connection ended: {e}"),
                                Err(_) => tracing::debug!("metrics connection closed after {CONNECTION_LIFETIME:?}"),
                                Ok(Ok(())) => {}
                            }
                        });
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: wait instead of spinning.
                        tracing::warn!("metrics endpoint cannot accept a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        connections.shutdown().await;
    }
}

/// Binds `addr` and serves `metrics` on `path` until `shutdown` completes.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    path: String,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let server = MetricsServer::bind(addr, metrics, &path).await?;
    tracing::info!("serving metrics on http://{}{path}", server.local_addr()?);
    server.run(shutdown).await;
    Ok(())
}

fn respond(metrics: &Metrics, path: &str, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() != path {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        response
            .headers_mut()
            .insert(ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let openmetrics = req
        .headers()
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    match metrics.encode() {
        Ok(text) => {
            let (body, content_type) = if openmetrics {
                (text, METRICS_CONTENT_TYPE)
            } else {
                (to_text_format(&text, &cumulative_names()), TEXT_CONTENT_TYPE)
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
            response
        }
        Err(e) => {
            tracing::error!("cannot encode the metrics: {e}");
            plain(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics\n")
        }
    }
}

/// The Prometheus text format's content type (version 0.0.4).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The DCGM fields dcgm-exporter types `counter` under their own names.
fn cumulative_names() -> Vec<&'static str> {
    super::dcgm::FIELDS
        .iter()
        .filter(|f| f.kind == super::dcgm::Kind::Cumulative)
        .map(|f| f.name)
        .collect()
}

/// OpenMetrics text → the Prometheus text format (0.0.4), for scrapers that do not ask for
/// OpenMetrics (Prometheus does, in its `Accept` header): no `# EOF` or `# UNIT`; a counter
/// family `x` (samples `x_total`) is declared as `x_total`, its `x_created` samples dropped;
/// `unknown` is `untyped`, except the `cumulative` families, which are `counter` under their
/// own names as dcgm-exporter has them. Pure.
pub fn to_text_format(openmetrics: &str, cumulative: &[&str]) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let renamed = if counters.contains(name) {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            let tail = match (prefix, tail) {
                ("# TYPE ", "unknown") if cumulative.contains(&name) => "counter",
                ("# TYPE ", "unknown") => "untyped",
                _ => tail,
            };
            out.push_str(prefix);
            out.push_str(&renamed);
            if !tail.is_empty() {
                out.push(' ');
                out.push_str(tail);
            }
        } else {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            if name.strip_suffix("_created").is_some_and(|f| counters.contains(f)) {
                continue;
            }
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_becomes_the_text_format() {
        let om = "# HELP requests Requests.\n# TYPE requests counter\n# UNIT requests requests\n\
                  requests_total{code=\"200\"} 3\nrequests_created{code=\"200\"} 1.7e9\n\
                  # HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).\n\
                  # TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n\
                  DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu=\"0\"} 42\n\
                  # HELP other Something.\n# TYPE other unknown\nother 1\n\
                  # HELP temp Temperature.\n# TYPE temp gauge\ntemp 30\n# EOF\n";
        let text = to_text_format(om, &["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]);
        assert_eq!(
            text,
            "# HELP requests_total Requests.\n# TYPE requests_total counter\nrequests_total{code=\"200\"} 3\n\
             # HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).\n\
             # TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n\
             DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu=\"0\"} 42\n\
             # HELP other Something.\n# TYPE other untyped\nother 1\n\
             # HELP temp Temperature.\n# TYPE temp gauge\ntemp 30\n"
        );
    }
}
