//! Client helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use futures_util::StreamExt as _;
use reqwest::{Certificate, Client, Identity};
use serde_json::Value;
use test_apiserver::TestApiServer;

pub const TOKEN: &str = "agent-token";
pub const USER: &str = "system:serviceaccount:gpu:agent";

/// A server with `TOKEN` for `USER` and a node `gpu-1` labelled `a=1`.
pub async fn server() -> TestApiServer {
    let server = TestApiServer::start().await;
    server.add_token(TOKEN, USER);
    server.create_node("gpu-1", &[("a", "1")]);
    server
}

pub fn client(server: &TestApiServer) -> Client {
    builder(server).build().expect("client")
}

pub fn builder(server: &TestApiServer) -> reqwest::ClientBuilder {
    let ca = Certificate::from_pem(server.ca_pem().as_bytes()).expect("CA PEM");
    Client::builder()
        .no_proxy()
        .tls_certs_only([ca])
        .timeout(Duration::from_secs(10))
}

pub fn client_with_cert(server: &TestApiServer, cert_pem: &str, key_pem: &str) -> Client {
    let identity = Identity::from_pem(format!("{cert_pem}{key_pem}").as_bytes()).expect("identity");
    builder(server).identity(identity).build().expect("client")
}

pub async fn get(client: &Client, server: &TestApiServer, path: &str) -> reqwest::Response {
    client
        .get(format!("{}{path}", server.url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("send")
}

pub async fn patch(
    client: &Client,
    server: &TestApiServer,
    path: &str,
    content_type: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .patch(format!("{}{path}", server.url()))
        .bearer_auth(TOKEN)
        .header("Content-Type", content_type)
        .body(body.to_string())
        .send()
        .await
        .expect("send")
}

/// Reads newline-delimited JSON watch events from a streaming response.
pub struct Watch {
    stream: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: Vec<u8>,
    pub status: u16,
}

impl Watch {
    pub async fn open(client: &Client, server: &TestApiServer, query: &str) -> Watch {
        let resp = get(client, server, &format!("/api/v1/nodes?watch=true&{query}")).await;
        Watch::from_response(resp)
    }

    /// Reads the events of a watch response however it was requested.
    pub fn from_response(resp: reqwest::Response) -> Watch {
        let status = resp.status().as_u16();
        Watch {
            stream: resp.bytes_stream().boxed(),
            buf: Vec::new(),
            status,
        }
    }

    /// The next event; `None` when the stream ended. Panics after `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Value> {
        tokio::time::timeout(timeout, self.next_inner())
            .await
            .expect("watch event within timeout")
    }

    /// The next event, or `Err(())` if none came within `wait` (the stream is still open).
    pub async fn try_next(&mut self, wait: Duration) -> Result<Option<Value>, ()> {
        tokio::time::timeout(wait, self.next_inner()).await.map_err(|_| ())
    }

    async fn next_inner(&mut self) -> Option<Value> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return Some(serde_json::from_slice(&line).expect("watch line is JSON"));
            }
            match self.stream.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(_)) | None => {
                    assert!(self.buf.is_empty(), "partial line at end of stream");
                    return None;
                }
            }
        }
    }
}

pub fn rv(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .expect("resourceVersion")
        .parse()
        .expect("numeric RV")
}
