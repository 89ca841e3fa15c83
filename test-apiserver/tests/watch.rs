//! Watch streams: initial ADDED, replay from a resourceVersion, 410 after compaction, bookmarks,
//! label-selector transitions, timeoutSeconds and drop_watches.

mod common;

use std::time::{Duration, Instant};

use common::{Watch, client, patch, rv, server};
use serde_json::json;
use test_apiserver::{Options, TestApiServer};

const T: Duration = Duration::from_secs(5);
const SEL: &str = "fieldSelector=metadata.name%3Dgpu-1";

#[tokio::test]
async fn watch_from_zero_sends_added_then_modified() {
    let server = server().await;
    let client = client(&server);
    let mut watch = Watch::open(
        &client,
        &server,
        &format!("{SEL}&resourceVersion=0&allowWatchBookmarks=true"),
    )
    .await;
    assert_eq!(watch.status, 200);

    let added = watch.next(T).await.unwrap();
    assert_eq!(added["type"], "ADDED");
    assert_eq!(added["object"]["kind"], "Node");
    assert_eq!(added["object"]["metadata"]["name"], "gpu-1");
    let first = rv(&added["object"]);

    server.set_label("gpu-1", "nvidia.com/mig.config", Some("all-1g.5gb"));
    let modified = watch.next(T).await.unwrap();
    assert_eq!(modified["type"], "MODIFIED");
    assert_eq!(
        modified["object"]["metadata"]["labels"]["nvidia.com/mig.config"],
        "all-1g.5gb"
    );
    assert!(rv(&modified["object"]) > first);

    // A patch through the API is seen too; a no-op patch is not.
    let body = json!({"metadata": {"labels": {"b": "2"}}});
    patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(watch.next(T).await.unwrap()["object"]["metadata"]["labels"]["b"], "2");
    patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    server.set_label("gpu-1", "b", Some("2"));
    assert!(
        watch.try_next(Duration::from_millis(200)).await.is_err(),
        "no event for a no-op"
    );

    // Other nodes are filtered out; deletion is seen.
    server.create_node("gpu-2", &[]);
    server.delete_node("gpu-1");
    let deleted = watch.next(T).await.unwrap();
    assert_eq!(deleted["type"], "DELETED");
    assert_eq!(deleted["object"]["metadata"]["name"], "gpu-1");
    assert_eq!(server.open_watches(), 1);

    let log = server.requests();
    let w = log.iter().find(|r| r.watch).unwrap();
    assert_eq!((w.verb.as_str(), w.status, w.method.as_str()), ("watch", 200, "GET"));
}

#[tokio::test]
async fn watch_without_resource_version_starts_with_current_state() {
    let server = server().await;
    server.create_node("gpu-2", &[]);
    let client = client(&server);
    let mut watch = Watch::open(&client, &server, "").await;
    let a = watch.next(T).await.unwrap();
    let b = watch.next(T).await.unwrap();
    assert_eq!((a["type"].as_str(), b["type"].as_str()), (Some("ADDED"), Some("ADDED")));
    assert_eq!(b["object"]["metadata"]["name"], "gpu-2");
}

#[tokio::test]
async fn watch_from_resource_version_replays_later_changes_only() {
    let server = server().await;
    let client = client(&server);
    let from = server.node_resource_version("gpu-1").unwrap();
    server.set_label("gpu-1", "x", Some("1"));
    server.set_label("gpu-1", "x", Some("2"));

    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion={from}")).await;
    let e1 = watch.next(T).await.unwrap();
    let e2 = watch.next(T).await.unwrap();
    assert_eq!(
        (e1["type"].as_str(), e1["object"]["metadata"]["labels"]["x"].as_str()),
        (Some("MODIFIED"), Some("1"))
    );
    assert_eq!(
        (e2["type"].as_str(), e2["object"]["metadata"]["labels"]["x"].as_str()),
        (Some("MODIFIED"), Some("2"))
    );
    assert!(watch.try_next(Duration::from_millis(200)).await.is_err());

    // From the current RV: nothing to replay.
    let now = server.node_resource_version("gpu-1").unwrap();
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion={now}")).await;
    assert!(watch.try_next(Duration::from_millis(200)).await.is_err());
}

#[tokio::test]
async fn watch_from_compacted_resource_version_gets_410_error_event() {
    let server = server().await;
    let client = client(&server);
    let old = server.node_resource_version("gpu-1").unwrap();
    server.set_label("gpu-1", "x", Some("1"));
    server.compact();
    let current = server.resource_version();

    let mut watch = Watch::open(
        &client,
        &server,
        &format!("{SEL}&resourceVersion={old}&allowWatchBookmarks=true"),
    )
    .await;
    assert_eq!(watch.status, 200, "HTTP 200 first, as the watch cache answers");
    let err = watch.next(T).await.unwrap();
    assert_eq!(err["type"], "ERROR");
    assert_eq!(
        err["object"],
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {old} ({current})"),
            "reason": "Expired", "code": 410,
        })
    );
    assert!(watch.next(T).await.is_none(), "the stream ends after the ERROR");

    // From the current RV (what a re-list returns) the watch works again.
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion={current}")).await;
    server.set_label("gpu-1", "x", Some("2"));
    assert_eq!(watch.next(T).await.unwrap()["type"], "MODIFIED");
}

#[tokio::test]
async fn history_limit_expires_old_resource_versions() {
    let server = TestApiServer::start_with(Options {
        history_limit: 2,
        ..Options::default()
    })
    .await;
    server.add_token(common::TOKEN, common::USER);
    server.create_node("gpu-1", &[]);
    let from = server.node_resource_version("gpu-1").unwrap();
    for i in 0..3 {
        server.set_label("gpu-1", "i", Some(&i.to_string()));
    }
    let client = client(&server);
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion={from}")).await;
    assert_eq!(watch.next(T).await.unwrap()["object"]["code"], 410);
}

#[tokio::test]
async fn bookmarks_on_demand_and_on_interval() {
    let server = server().await;
    let client = client(&server);
    let mut with = Watch::open(
        &client,
        &server,
        &format!("{SEL}&resourceVersion=0&allowWatchBookmarks=true"),
    )
    .await;
    let mut without = Watch::open(&client, &server, &format!("{SEL}&resourceVersion=0")).await;
    assert_eq!(with.next(T).await.unwrap()["type"], "ADDED");
    assert_eq!(without.next(T).await.unwrap()["type"], "ADDED");

    server.send_bookmark();
    let bm = with.next(T).await.unwrap();
    assert_eq!(
        bm,
        json!({"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
            "metadata": {"resourceVersion": server.resource_version()}}})
    );
    assert!(
        without.try_next(Duration::from_millis(200)).await.is_err(),
        "no bookmarks unless allowed"
    );

    server.set_bookmark_interval(Some(Duration::from_millis(100)));
    let started = Instant::now();
    for _ in 0..3 {
        assert_eq!(with.next(T).await.unwrap()["type"], "BOOKMARK");
    }
    assert!(started.elapsed() >= Duration::from_millis(250));
    server.set_bookmark_interval(None);
    // Drain what may have been queued, then expect quiet.
    while with.try_next(Duration::from_millis(150)).await.is_ok() {}
    assert!(with.try_next(Duration::from_millis(300)).await.is_err());
}

#[tokio::test]
async fn send_initial_events_ends_with_marked_bookmark() {
    let server = server().await;
    let client = client(&server);
    let mut watch = Watch::open(
        &client,
        &server,
        "sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
    )
    .await;
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
    let bm = watch.next(T).await.unwrap();
    assert_eq!(bm["type"], "BOOKMARK");
    assert_eq!(
        bm["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
}

#[tokio::test]
async fn label_selector_watch_sees_objects_enter_and_leave() {
    let server = server().await;
    let client = client(&server);
    let mut watch = Watch::open(&client, &server, "labelSelector=a%3D1&resourceVersion=0").await;
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
    server.set_label("gpu-1", "a", Some("2"));
    assert_eq!(watch.next(T).await.unwrap()["type"], "DELETED");
    server.set_label("gpu-1", "a", Some("1"));
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
}

#[tokio::test]
async fn timeout_seconds_closes_the_stream() {
    let server = server().await;
    let client = client(&server);
    let started = Instant::now();
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion=0&timeoutSeconds=1")).await;
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
    assert!(watch.next(T).await.is_none());
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[tokio::test]
async fn drop_watches_ends_open_streams() {
    let server = server().await;
    let client = client(&server);
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion=0")).await;
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
    assert_eq!(server.open_watches(), 1);
    server.drop_watches();
    assert!(watch.next(T).await.is_none());
    assert_eq!(server.open_watches(), 0);
    // The legacy watch path works too.
    let resp = common::get(&client, &server, "/api/v1/watch/nodes/gpu-1?timeoutSeconds=1").await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert_eq!(text.lines().count(), 1);
    assert!(text.contains("\"ADDED\""));
}

#[tokio::test]
async fn watch_over_http1_is_chunked() {
    let server = TestApiServer::start_with(Options {
        http2: false,
        ..Options::default()
    })
    .await;
    server.add_token(common::TOKEN, common::USER);
    server.create_node("gpu-1", &[]);
    let client = client(&server);
    let resp = common::get(&client, &server, &format!("/api/v1/nodes?watch=1&{SEL}")).await;
    assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    drop(resp);
    let mut watch = Watch::open(&client, &server, &format!("{SEL}&resourceVersion=0")).await;
    assert_eq!(watch.next(T).await.unwrap()["type"], "ADDED");
    server.set_label("gpu-1", "k", Some("v"));
    assert_eq!(watch.next(T).await.unwrap()["type"], "MODIFIED");
}
