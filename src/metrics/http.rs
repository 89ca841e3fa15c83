//! The metrics endpoint: HTTP/1.1 (hyper), `GET` or `HEAD` on the metrics path answers the
//! encoded registry; any other path is 404, any other method on the path 405.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::{CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics};

/// How long a client may take to send its request headers (a stalled client must not hold a
/// connection open forever).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound metrics endpoint, not yet serving.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    metrics: Metrics,
    path: Arc<str>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)).
    pub async fn bind(addr: SocketAddr, metrics: Metrics, path: &str) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr).await?;
        Ok(MetricsServer {
            listener,
            metrics,
            path: Arc::from(path),
        })
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
        } = self;
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
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
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                            if let Err(e) = served {
                                tracing::debug!("metrics connection ended: {e}");
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
    match metrics.encode() {
        Ok(text) => {
            let mut response = Response::new(Full::new(Bytes::from(text)));
            response.headers_mut().insert(
                CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(METRICS_CONTENT_TYPE),
            );
            response
        }
        Err(e) => {
            tracing::error!("cannot encode the metrics: {e}");
            plain(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics\n")
        }
    }
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
