//! Sending one request: the reqwest client built from the TLS material, the time limits, one
//! retry after a 401 with refreshed credentials, and what a failed response says.

use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};

use super::{Inner, KubeClient, Limit};
use crate::kube::credentials::Secret;
use crate::kube::error::{ApiFailure, ApiStatus, HttpFailure, KubeError, error_chain, request_failure};
use crate::kube::limit::{MAX_ERROR_BODY, read_body_prefix};

const USER_AGENT: &str = concat!("gpu-node-agent/", env!("CARGO_PKG_VERSION"));

impl KubeClient {
    /// Sends one request, refreshing the credentials and retrying once on 401. `verb` is the
    /// Kubernetes verb (`get`, `watch`, `patch`, `create`) the request metrics count it under.
    pub(super) async fn send(
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
}

impl Inner {
    pub(super) fn build_http(&self, ca: Option<&[u8]>, identity: Option<&[u8]>) -> Result<reqwest::Client, KubeError> {
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
        builder.build().map_err(|e| tls_err(error_chain(&e)))
    }
}

async fn http_failure(mut response: reqwest::Response, limit: Duration, token: Option<&Secret>) -> ApiFailure {
    let code = response.status().as_u16();
    let header_retry = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = match tokio::time::timeout(limit, read_body_prefix(&mut response, MAX_ERROR_BODY)).await {
        Ok(Ok(body)) => body,
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
