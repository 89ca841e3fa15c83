//! A minimal plain-HTTP/1.1 server for the client's unit tests: one request per connection,
//! answered by a closure, with optional chunked bodies to exercise stream parsing. (The
//! behavioural tests against a real-looking API server over TLS use the `test-apiserver`
//! crate.)

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A request as received.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// A header's value, by case-insensitive name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The answer to send.
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    chunks: Vec<Vec<u8>>,
    chunked: bool,
}

impl Reply {
    /// A JSON body.
    pub fn json(status: u16, body: &str) -> Reply {
        Reply {
            status,
            headers: vec![("Content-Type".into(), "application/json".into())],
            chunks: vec![body.as_bytes().to_vec()],
            chunked: false,
        }
    }

    /// A plain text body.
    pub fn text(status: u16, body: &str) -> Reply {
        Reply {
            status,
            headers: vec![("Content-Type".into(), "text/html".into())],
            chunks: vec![body.as_bytes().to_vec()],
            chunked: false,
        }
    }

    /// A Kubernetes Status body with this reason and message `test says <reason>`.
    pub fn status(status: u16, reason: &str) -> Reply {
        let body = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("test says {reason}"), "reason": reason, "code": status,
        });
        Reply::json(status, &body.to_string())
    }

    /// A 200 sent with chunked encoding, one chunk at a time with a pause between.
    pub fn chunks(chunks: Vec<Vec<u8>>) -> Reply {
        Reply {
            status: 200,
            headers: vec![("Content-Type".into(), "application/json".into())],
            chunks,
            chunked: true,
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }
}

type Handler = Arc<dyn Fn(&Request) -> Reply + Send + Sync>;

/// The server; it stops when dropped.
pub struct TestServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    /// Listens on a loopback port and answers every request with `handler`.
    pub async fn start(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handler: Handler = Arc::new(handler);
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let handler = handler.clone();
                tokio::spawn(async move {
                    let _ = serve(conn, handler).await;
                });
            }
        });
        TestServer { addr, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn serve(mut conn: TcpStream, handler: Handler) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_string();
    let path = first.next().unwrap_or_default().to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut request = Request {
        method,
        path,
        headers,
        body: buf[head_end + 4..].to_vec(),
    };
    let length: usize = request
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while request.body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        request.body.extend_from_slice(&chunk[..n]);
    }

    let reply = handler(&request);
    let mut head = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", reply.status);
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if reply.chunked {
        head.push_str("Transfer-Encoding: chunked\r\n\r\n");
        conn.write_all(head.as_bytes()).await?;
        conn.flush().await?;
        for chunk in &reply.chunks {
            conn.write_all(format!("{:x}\r\n", chunk.len()).as_bytes()).await?;
            conn.write_all(chunk).await?;
            conn.write_all(b"\r\n").await?;
            conn.flush().await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        conn.write_all(b"0\r\n\r\n").await?;
    } else {
        let body = reply.chunks.concat();
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        conn.write_all(head.as_bytes()).await?;
        conn.write_all(&body).await?;
    }
    conn.flush().await?;
    conn.shutdown().await
}
