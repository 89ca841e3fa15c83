//! What a fleet bench reads and drives: load statistics, the request-log switch, the
//! max-in-flight limit and a restart.

mod common;

use std::time::Duration;

use common::{TOKEN, USER, Watch, client, client_with_cert, get, patch, server};
use futures_util::StreamExt as _;
use serde_json::{Value, json};
use test_apiserver::{Failure, Load, TestApiServer};

const T: Duration = Duration::from_secs(10);
const NODE: &str = "/api/v1/nodes/gpu-1";
const NODE_TOKEN: &str = "node-token";
const NODE_USER: &str = "system:node:gpu-1";

/// A watch read as raw bytes, to compare with what the server counted.
struct RawWatch {
    stream: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: Vec<u8>,
    /// Bytes received so far.
    received: u64,
}

impl RawWatch {
    async fn open(client: &reqwest::Client, server: &TestApiServer, query: &str) -> RawWatch {
        let resp = get(client, server, &format!("/api/v1/nodes?watch=true&{query}")).await;
        assert_eq!(resp.status(), 200);
        RawWatch {
            stream: resp.bytes_stream().boxed(),
            buf: Vec::new(),
            received: 0,
        }
    }

    /// The next line as JSON.
    async fn next(&mut self) -> Value {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return serde_json::from_slice(&line).expect("watch line is JSON");
            }
            let chunk = tokio::time::timeout(T, self.stream.next())
                .await
                .expect("watch event within timeout")
                .expect("stream open")
                .expect("chunk");
            self.received += chunk.len() as u64;
            self.buf.extend_from_slice(&chunk);
        }
    }
}

#[tokio::test]
async fn stats_count_requests_bytes_429s_and_users() {
    let server = server().await;
    server.add_token(NODE_TOKEN, NODE_USER);
    let client = client(&server);
    assert_eq!(
        server.stats().total(),
        Load::default(),
        "nothing before the first request"
    );

    // Two GETs by the agent's user: bytes out are the bodies the client got.
    let mut body_bytes = 0;
    for _ in 0..2 {
        let resp = get(&client, &server, NODE).await;
        assert_eq!(resp.status(), 200);
        body_bytes += resp.bytes().await.expect("body").len() as u64;
    }
    // One merge patch by the node: bytes in are its body.
    let patch_body = json!({"metadata": {"labels": {"x": "1"}}}).to_string();
    let resp = client
        .patch(format!("{}{NODE}", server.url()))
        .bearer_auth(NODE_TOKEN)
        .header("Content-Type", "application/merge-patch+json")
        .body(patch_body.clone())
        .send()
        .await
        .expect("patch");
    assert_eq!(resp.status(), 200);
    let patch_answer = resp.bytes().await.expect("body").len() as u64;
    // An unauthenticated GET counts as a request of no user.
    let resp = client.get(format!("{}{NODE}", server.url())).send().await.expect("get");
    assert_eq!(resp.status(), 401);
    let unauthorized = resp.bytes().await.expect("body").len() as u64;
    // An injected 429 counts as one.
    server.fail_next_matching(1, "list", "nodes", Failure::TooManyRequests { retry_after_secs: 2 });
    let resp = get(&client, &server, "/api/v1/nodes").await;
    assert_eq!(resp.status(), 429);
    let list_429 = resp.bytes().await.expect("body").len() as u64;

    let stats = server.stats();
    assert_eq!(
        stats.load("get", "nodes"),
        Load {
            requests: 3,
            response_bytes: body_bytes + unauthorized,
            ..Load::default()
        }
    );
    assert_eq!(
        stats.load("patch", "nodes"),
        Load {
            requests: 1,
            request_bytes: patch_body.len() as u64,
            response_bytes: patch_answer,
            ..Load::default()
        }
    );
    assert_eq!(
        stats.load("list", "nodes"),
        Load {
            requests: 1,
            response_bytes: list_429,
            too_many_requests: 1,
            ..Load::default()
        }
    );
    assert_eq!(stats.total().requests, 5);
    assert_eq!(stats.by_user.len(), 2, "{:?}", stats.by_user);
    assert_eq!((stats.by_user[USER], stats.by_user[NODE_USER]), (3, 1));
    assert_eq!(stats.busiest_user(), Some((USER, 3)));
    let table = stats.to_string();
    assert!(table.contains("patch") && table.contains(USER), "{table}");

    server.clear_stats();
    let stats = server.stats();
    assert_eq!(stats.total(), Load::default());
    assert!(stats.by_user.is_empty() && stats.busiest_user().is_none());
}

#[tokio::test]
async fn watch_bytes_grow_as_they_stream_and_open_watches_peak() {
    let server = server().await;
    let client = client(&server);
    let mut first = RawWatch::open(
        &client,
        &server,
        "fieldSelector=metadata.name%3Dgpu-1&resourceVersion=0",
    )
    .await;
    assert_eq!(first.next().await["type"], "ADDED");
    let load = server.stats().load("watch", "nodes");
    assert_eq!((load.requests, load.open_watches, load.peak_watches), (1, 1, 1));
    assert_eq!(load.response_bytes, first.received, "the ADDED line");

    server.set_label("gpu-1", "x", Some("1"));
    assert_eq!(first.next().await["type"], "MODIFIED");
    assert!(
        server
            .wait_for(T, |s| s.stats().load("watch", "nodes").response_bytes == first.received)
            .await,
        "counted as it streams: {} sent, {} received",
        server.stats().load("watch", "nodes").response_bytes,
        first.received
    );

    let second = Watch::open(&client, &server, "labelSelector=x%3D1").await;
    assert_eq!(second.status, 200);
    let stats = server.stats();
    assert_eq!((stats.open_watches, stats.peak_watches), (2, 2));
    drop(second);
    assert!(
        server.wait_for(T, |s| s.stats().open_watches == 1).await,
        "a watch the client closed is no longer open"
    );
    assert_eq!(server.stats().peak_watches, 2);

    server.clear_stats();
    let stats = server.stats();
    let load = stats.load("watch", "nodes");
    assert_eq!(
        (load.requests, load.response_bytes, load.open_watches, load.peak_watches),
        (0, 0, 1, 1),
        "the open watch stays counted; the peak starts from it"
    );
    assert_eq!((stats.open_watches, stats.peak_watches), (1, 1));

    server.drop_watches();
    assert!(server.wait_for(T, |s| s.stats().open_watches == 0).await);
}

#[tokio::test]
async fn request_log_can_be_switched_off_while_stats_count() {
    let server = server().await;
    let client = client(&server);
    server.set_request_log(false);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
    let body = json!({"metadata": {"labels": {"x": "1"}}});
    let background = {
        let (client, server) = (client.clone(), server.clone());
        tokio::spawn(async move {
            patch(&client, &server, NODE, "application/merge-patch+json", &body)
                .await
                .status()
        })
    };
    assert!(
        server
            .wait_for(T, |s| s.labels("gpu-1").get("x").map(String::as_str) == Some("1"))
            .await
    );
    assert_eq!(background.await.expect("patch task"), 200);
    assert!(server.requests().is_empty());
    assert_eq!(server.count("GET", "/"), 0);
    let stats = server.stats();
    assert_eq!(
        (
            stats.load("get", "nodes").requests,
            stats.load("patch", "nodes").requests
        ),
        (1, 1)
    );

    server.set_request_log(true);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
    assert_eq!(server.count("GET", NODE), 1);
}

/// A request that waits on the server until the connection is cut: it holds its in-flight
/// place meanwhile.
fn held(client: &reqwest::Client, server: &TestApiServer, method: reqwest::Method, path: &str) {
    let req = client
        .request(method, format!("{}{path}", server.url()))
        .bearer_auth(TOKEN)
        .header("Content-Type", "application/merge-patch+json")
        .body("{}")
        .timeout(Duration::from_secs(3600));
    tokio::spawn(async move {
        let _ = req.send().await;
    });
}

#[tokio::test]
async fn max_inflight_answers_429_like_kube_apiserver() {
    let server = server().await;
    let client = client(&server);
    server.set_max_inflight(Some(1), Some(1));
    server.fail_next_matching(1, "get", "nodes", Failure::Delay(Duration::from_secs(3600)));
    held(&client, &server, reqwest::Method::GET, NODE);
    assert!(server.wait_for(T, |s| s.stats().readonly_in_flight == 1).await);

    // The read-only budget is spent: a GET and a LIST get upstream's plain-text 429.
    for path in [NODE, "/api/v1/nodes"] {
        let resp = get(&client, &server, path).await;
        assert_eq!(resp.status(), 429, "{path}");
        assert_eq!(resp.headers()["retry-after"], "1");
        assert_eq!(resp.headers()["content-type"], "text/plain; charset=utf-8");
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff");
        assert_eq!(
            resp.text().await.expect("body"),
            "Too many requests, please try again later.\n"
        );
    }
    // Not counted against it: writes (their own budget) and watches (long-running).
    let resp = patch(
        &client,
        &server,
        NODE,
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"w": "1"}}}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut watch = Watch::open(&client, &server, "fieldSelector=metadata.name%3Dgpu-1").await;
    assert_eq!(watch.next(T).await.expect("event")["type"], "ADDED");
    // Authentication comes first: no credentials is still a 401.
    let resp = client.get(format!("{}{NODE}", server.url())).send().await.expect("get");
    assert_eq!(resp.status(), 401);
    // system:masters is always served.
    let (cert, key) = server.issue_client_cert("admin", &["system:masters"]);
    let admin = client_with_cert(&server, &cert, &key);
    let resp = admin.get(format!("{}{NODE}", server.url())).send().await.expect("get");
    assert_eq!(resp.status(), 200);

    // The mutating budget, likewise.
    server.fail_next_matching(1, "patch", "nodes", Failure::Delay(Duration::from_secs(3600)));
    held(&client, &server, reqwest::Method::PATCH, NODE);
    assert!(server.wait_for(T, |s| s.stats().mutating_in_flight == 1).await);
    let event = json!({
        "metadata": {"generateName": "gpu-1."},
        "involvedObject": {"kind": "Node", "name": "gpu-1"},
        "reason": "Test", "message": "m", "type": "Normal",
    });
    let resp = client
        .post(format!("{}/api/v1/namespaces/default/events", server.url()))
        .bearer_auth(TOKEN)
        .json(&event)
        .send()
        .await
        .expect("post");
    assert_eq!(resp.status(), 429);

    let stats = server.stats();
    assert_eq!(
        (
            stats.load("get", "nodes").too_many_requests,
            stats.load("list", "nodes").too_many_requests,
            stats.load("create", "events").too_many_requests,
            stats.load("patch", "nodes").too_many_requests,
        ),
        (1, 1, 1, 0)
    );
    assert_eq!(
        server.count("GET", NODE),
        3,
        "logged: the 429, the 401 and the admin's GET; the held GET has no answer yet"
    );
    assert!(server.requests().iter().any(|r| r.status == 429 && r.verb == "create"));

    // Cutting the connections frees the places of the requests on them.
    server.set_down(true);
    server.set_down(false);
    assert!(
        server
            .wait_for(T, |s| {
                let stats = s.stats();
                (stats.readonly_in_flight, stats.mutating_in_flight) == (0, 0)
            })
            .await
    );
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
    server.set_max_inflight(None, None);
    server.fail_next_matching(1, "get", "nodes", Failure::Delay(Duration::from_secs(3600)));
    held(&client, &server, reqwest::Method::GET, NODE);
    assert!(server.wait_for(T, |s| s.stats().readonly_in_flight == 1).await);
    assert_eq!(get(&client, &server, NODE).await.status(), 200, "no limit");
}

#[tokio::test]
async fn restart_drops_everything_refuses_then_answers_without_history() {
    let server = server().await;
    let client = client(&server);
    let old = server.node_resource_version("gpu-1").expect("gpu-1");
    let mut watch = Watch::open(&client, &server, "fieldSelector=metadata.name%3Dgpu-1").await;
    assert_eq!(watch.next(T).await.expect("event")["type"], "ADDED");
    let logged = server.requests().len();

    server.restart(Duration::from_millis(300));
    assert!(server.is_down());
    assert!(watch.next(T).await.is_none(), "the watch is cut");
    let err = client
        .get(format!("{}{NODE}", server.url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect_err("refused while down");
    assert!(err.is_connect() || err.is_request(), "{err:?}");
    assert_eq!(server.requests().len(), logged, "nothing reaches the handler");
    assert_eq!(server.open_watches(), 0);

    assert!(server.wait_for(T, |s| !s.is_down()).await, "it comes back");
    let resp = get(&client, &server, NODE).await;
    assert_eq!(resp.status(), 200, "objects are kept");
    let node: Value = resp.json().await.expect("node");
    assert_eq!(node["metadata"]["resourceVersion"], old.as_str());

    // The watch history is gone: any earlier RV is expired, the current one works.
    let current = server.resource_version();
    let mut watch = Watch::open(
        &client,
        &server,
        &format!("fieldSelector=metadata.name%3Dgpu-1&resourceVersion={old}"),
    )
    .await;
    assert_eq!(watch.status, 200);
    let error = watch.next(T).await.expect("ERROR event");
    assert_eq!(error["type"], "ERROR");
    assert_eq!(error["object"]["code"], 410);
    assert_eq!(error["object"]["reason"], "Expired");
    assert_eq!(
        error["object"]["message"],
        format!("too old resource version: {old} ({current})")
    );
    assert!(watch.next(T).await.is_none());
    let mut watch = Watch::open(
        &client,
        &server,
        &format!("fieldSelector=metadata.name%3Dgpu-1&resourceVersion={current}"),
    )
    .await;
    server.set_label("gpu-1", "x", Some("1"));
    assert_eq!(watch.next(T).await.expect("event")["type"], "MODIFIED");
}

#[tokio::test]
async fn set_down_during_a_restart_cancels_its_coming_back() {
    let server = server().await;
    server.restart(Duration::from_millis(50));
    server.set_down(true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(server.is_down(), "the test took over: it stays down");
    server.set_down(false);
    let client = client(&server);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);

    // And a restart coming back compacts at that moment: changes made while it was down are
    // behind the new floor too.
    server.restart(Duration::from_secs(1));
    let during = server.resource_version();
    server.set_label("gpu-1", "x", Some("while-down"));
    assert!(server.wait_for(T, |s| !s.is_down()).await);
    let mut watch = Watch::open(
        &client,
        &server,
        &format!("fieldSelector=metadata.name%3Dgpu-1&resourceVersion={during}"),
    )
    .await;
    assert_eq!(watch.next(T).await.expect("event")["object"]["code"], 410);
}
