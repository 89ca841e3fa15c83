//! One server, many node clients at once, as a fleet bench runs them: each node with its own
//! TLS connection and client certificate, a watch on its own Node, label patches and Events;
//! then a restart that every watch sees. Prints what it measured (not asserted: speed belongs
//! in benches).
//!
//! The 5,000-node run is ignored by default (about 30 s in a debug build on 2 idle cores):
//! `cargo nextest run -p test-apiserver --test scale --run-ignored only`.

mod common;

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use reqwest::{Certificate, Client, Identity};
use serde_json::{Value, json};
use test_apiserver::TestApiServer;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Resident memory of this process (server and clients together), from /proc/self/status.
fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// One line of a node's watch: (node index, type, object name, the object's RV or the code).
type Seen = (usize, String, String);

/// Opens node `i`'s watch on its own Node from `rv` and forwards each event to `events`; an
/// `END` when the stream ends.
fn watch(client: &Client, server: &TestApiServer, i: usize, rv: &str, events: &mpsc::UnboundedSender<Seen>) {
    let url = format!(
        "{}/api/v1/nodes?watch=true&fieldSelector=metadata.name%3Dgpu-{i}&resourceVersion={rv}",
        server.url()
    );
    let (client, events) = (client.clone(), events.clone());
    tokio::spawn(async move {
        // After a restart a pooled connection the client has not yet seen close fails the
        // first try (broken pipe, reset), as with any client; it tries again, as they do.
        let mut tries = 0;
        let resp = loop {
            match client.get(&url).send().await {
                Ok(resp) => break resp,
                Err(e) if tries < 20 => {
                    tries += 1;
                    eprintln!("node {i}: watch again after {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("node {i}: watch request: {e:?}"),
            }
        };
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let mut buf = Vec::new();
        while let Some(Ok(chunk)) = body.next().await {
            buf.extend_from_slice(&chunk);
            while let Some(end) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                let event: Value = serde_json::from_slice(&line).expect("watch line is JSON");
                let what = match event["type"].as_str() {
                    Some("ERROR") => event["object"]["code"].to_string(),
                    _ => event["object"]["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                };
                let _ = events.send((i, event["type"].as_str().unwrap_or_default().to_owned(), what));
            }
        }
        let _ = events.send((i, "END".to_owned(), String::new()));
    });
}

/// Waits for one event from each of `n` watches, checking each with `check`.
async fn one_each(events: &mut mpsc::UnboundedReceiver<Seen>, n: usize, check: impl Fn(usize, &str, &str)) {
    let mut seen = vec![false; n];
    for _ in 0..n {
        let (i, kind, what) = tokio::time::timeout(Duration::from_secs(120), events.recv())
            .await
            .expect("an event within 2 minutes")
            .expect("watch tasks alive");
        check(i, &kind, &what);
        assert!(!seen[i], "node {i}: a second event ({kind} {what})");
        seen[i] = true;
    }
}

async fn fleet(n: usize) {
    let server = TestApiServer::start().await;
    server.set_request_log(false);
    for i in 0..n {
        server.create_node(&format!("gpu-{i}"), &[]);
    }
    let ca = Certificate::from_pem(server.ca_pem().as_bytes()).expect("CA PEM");
    let base = vm_rss_kib();

    // One client per node, each with its own certificate (and so its own connection).
    let started = Instant::now();
    let clients: Vec<Client> = (0..n)
        .map(|i| {
            let (cert, key) = server.issue_client_cert(&format!("system:node:gpu-{i}"), &["system:nodes"]);
            let identity = Identity::from_pem(format!("{cert}{key}").as_bytes()).expect("identity");
            Client::builder()
                .no_proxy()
                .tls_certs_only([ca.clone()])
                .identity(identity)
                .build()
                .expect("client")
        })
        .collect();
    let built = vm_rss_kib();
    eprintln!(
        "{n} clients built in {:?}: {} KiB each",
        started.elapsed(),
        (built - base) / n as u64
    );

    // All connect at once: TLS handshake, HTTP/2, one GET of the node's own Node.
    let started = Instant::now();
    let mut gets = JoinSet::new();
    for (i, client) in clients.iter().enumerate() {
        let req = client.get(format!("{}/api/v1/nodes/gpu-{i}", server.url()));
        gets.spawn(async move {
            let resp = req.send().await.expect("GET own node");
            assert_eq!(resp.status(), 200);
            resp.bytes().await.expect("node body");
        });
    }
    while let Some(done) = gets.join_next().await {
        done.expect("GET task");
    }
    let connected = vm_rss_kib();
    eprintln!(
        "{n} connections (handshake + GET) in {:?}: {:?} each, {} KiB each (server and client side)",
        started.elapsed(),
        started.elapsed() / n as u32,
        (connected - built) / n as u64
    );

    // A watch per node on its own Node.
    let started = Instant::now();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    for (i, client) in clients.iter().enumerate() {
        watch(client, &server, i, "0", &events_tx);
    }
    one_each(&mut events, n, |i, kind, what| {
        assert_eq!((kind, what), ("ADDED", format!("gpu-{i}").as_str()));
    })
    .await;
    assert!(
        server
            .wait_for(Duration::from_secs(60), |s| s.open_watches() == n)
            .await
    );
    let watching = vm_rss_kib();
    eprintln!(
        "{n} watches open in {:?}: {} KiB each",
        started.elapsed(),
        (watching - connected) / n as u64
    );
    let stats = server.stats();
    assert_eq!((stats.open_watches, stats.peak_watches), (n as u64, n as u64));

    // Every node's label changes once: each watch sees its own node's change, and only that.
    let started = Instant::now();
    for i in 0..n {
        server.set_label(&format!("gpu-{i}"), "nvidia.com/mig.config", Some("all-1g.10gb"));
    }
    let stored = started.elapsed();
    one_each(&mut events, n, |i, kind, what| {
        assert_eq!((kind, what), ("MODIFIED", format!("gpu-{i}").as_str()));
    })
    .await;
    eprintln!(
        "{n} label changes: {stored:?} to store, {:?} until every watch had its own",
        started.elapsed()
    );

    // Every node patches its own label and posts an Event, all at once.
    let started = Instant::now();
    let mut writes = JoinSet::new();
    for (i, client) in clients.iter().enumerate() {
        let patch = client
            .patch(format!("{}/api/v1/nodes/gpu-{i}", server.url()))
            .header("Content-Type", "application/merge-patch+json")
            .body(json!({"metadata": {"labels": {"nvidia.com/mig.config.state": "success"}}}).to_string());
        let event = client
            .post(format!("{}/api/v1/namespaces/default/events", server.url()))
            .json(&json!({
                "metadata": {"generateName": format!("gpu-{i}.")},
                "involvedObject": {"kind": "Node", "name": format!("gpu-{i}")},
                "reason": "MigConfigApplied", "message": "all-1g.10gb", "type": "Normal",
            }));
        writes.spawn(async move {
            assert_eq!(patch.send().await.expect("PATCH").status(), 200);
            assert_eq!(event.send().await.expect("POST event").status(), 201);
        });
    }
    while let Some(done) = writes.join_next().await {
        done.expect("write task");
    }
    one_each(&mut events, n, |i, kind, what| {
        assert_eq!((kind, what), ("MODIFIED", format!("gpu-{i}").as_str()));
    })
    .await;
    eprintln!("{n} PATCHes and Event POSTs in {:?}", started.elapsed());

    let stats = server.stats();
    eprintln!("{stats}");
    for (verb, resource) in [
        ("get", "nodes"),
        ("watch", "nodes"),
        ("patch", "nodes"),
        ("create", "events"),
    ] {
        assert_eq!(stats.load(verb, resource).requests, n as u64, "{verb} {resource}");
    }
    assert_eq!(stats.by_user.len(), n);
    assert!(
        stats.by_user.values().all(|requests| *requests == 4),
        "each node: GET, watch, PATCH, POST"
    );
    assert!(server.requests().is_empty(), "the request log is off");
    assert_eq!(server.events().len(), n);

    // A restart: every watch ends; when it is back, every old RV is expired.
    let before = server.resource_version();
    let started = Instant::now();
    server.restart(Duration::from_millis(500));
    one_each(&mut events, n, |_, kind, _| assert_eq!(kind, "END")).await;
    eprintln!("restart: {n} watches ended in {:?}", started.elapsed());
    assert!(server.wait_for(Duration::from_secs(30), |s| !s.is_down()).await);
    let started = Instant::now();
    for (i, client) in clients.iter().enumerate() {
        watch(client, &server, i, &before, &events_tx);
    }
    let mut expired = 0;
    while expired < n {
        let (i, kind, code) = tokio::time::timeout(Duration::from_secs(120), events.recv())
            .await
            .expect("an event within 2 minutes")
            .expect("watch tasks alive");
        match kind.as_str() {
            "ERROR" => {
                assert_eq!(code, "410", "node {i}");
                expired += 1;
            }
            "END" => {} // the stream ends after its ERROR
            other => panic!("node {i}: {other} {code} instead of a 410"),
        }
    }
    eprintln!(
        "{n} reconnections and 410s in {:?}; VmRSS {} MiB",
        started.elapsed(),
        vm_rss_kib() / 1024
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_nodes() {
    fleet(200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "5,000 TLS clients: about 30 s of both cores in a debug build; run with --run-ignored only"]
async fn five_thousand_nodes() {
    fleet(5000).await;
}
