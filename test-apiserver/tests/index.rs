//! The lookups that keep thousands of clients cheap give the same answers as a scan: watches
//! indexed by the node they name, ResourceSlices by `spec.nodeName`, Events by name.

mod common;

use std::time::Duration;

use common::{TOKEN, Watch, client, get, server};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(200);

fn name(event: &Value) -> (&str, &str) {
    (
        event["type"].as_str().expect("type"),
        event["object"]["metadata"]["name"].as_str().unwrap_or_default(),
    )
}

#[tokio::test]
async fn watches_by_name_and_the_rest_see_what_a_scan_would() {
    let server = server().await; // gpu-1 with a=1
    server.create_node("gpu-2", &[("a", "1")]);
    let client = client(&server);
    let open = |q: &'static str| Watch::open(&client, &server, q);
    // By name (indexed), by name and label, by name not yet created, by the watch path.
    let mut by_name = open("fieldSelector=metadata.name%3Dgpu-1&allowWatchBookmarks=true").await;
    let mut name_and_label = open("fieldSelector=metadata.name%3D%3Dgpu-1&labelSelector=a%3D1").await;
    let mut future = open("fieldSelector=metadata.name%3Dgpu-9").await;
    // Not indexed: a negated name, a label only, everything.
    let mut not_one = open("fieldSelector=metadata.name!%3Dgpu-1").await;
    let mut by_label = open("labelSelector=a%3D1&allowWatchBookmarks=true").await;
    let mut all = open("").await;
    let path = get(&client, &server, "/api/v1/watch/nodes/gpu-2").await;
    let mut by_path = Watch::from_response(path);

    assert_eq!(name(&by_name.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&name_and_label.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&not_one.next(T).await.unwrap()), ("ADDED", "gpu-2"));
    assert_eq!(name(&by_label.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&by_label.next(T).await.unwrap()), ("ADDED", "gpu-2"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("ADDED", "gpu-2"));
    assert_eq!(name(&by_path.next(T).await.unwrap()), ("ADDED", "gpu-2"));
    assert_eq!(server.open_watches(), 7);

    // gpu-1 leaves a=1: MODIFIED by name, DELETED where the label mattered.
    server.set_label("gpu-1", "a", Some("2"));
    assert_eq!(name(&by_name.next(T).await.unwrap()), ("MODIFIED", "gpu-1"));
    assert_eq!(name(&name_and_label.next(T).await.unwrap()), ("DELETED", "gpu-1"));
    assert_eq!(name(&by_label.next(T).await.unwrap()), ("DELETED", "gpu-1"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("MODIFIED", "gpu-1"));
    // ... and comes back: ADDED there again.
    server.set_label("gpu-1", "a", Some("1"));
    assert_eq!(name(&by_name.next(T).await.unwrap()), ("MODIFIED", "gpu-1"));
    assert_eq!(name(&name_and_label.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&by_label.next(T).await.unwrap()), ("ADDED", "gpu-1"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("MODIFIED", "gpu-1"));

    // gpu-2 changes: only the watches that can see gpu-2.
    server.set_label("gpu-2", "b", Some("1"));
    assert_eq!(name(&not_one.next(T).await.unwrap()), ("MODIFIED", "gpu-2"));
    assert_eq!(name(&by_label.next(T).await.unwrap()), ("MODIFIED", "gpu-2"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("MODIFIED", "gpu-2"));
    assert_eq!(name(&by_path.next(T).await.unwrap()), ("MODIFIED", "gpu-2"));

    // A node created and deleted under a watch that named it first.
    server.create_node("gpu-9", &[]);
    assert_eq!(name(&future.next(T).await.unwrap()), ("ADDED", "gpu-9"));
    assert_eq!(name(&not_one.next(T).await.unwrap()), ("ADDED", "gpu-9"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("ADDED", "gpu-9"));
    server.delete_node("gpu-9");
    assert_eq!(name(&future.next(T).await.unwrap()), ("DELETED", "gpu-9"));
    assert_eq!(name(&not_one.next(T).await.unwrap()), ("DELETED", "gpu-9"));
    assert_eq!(name(&all.next(T).await.unwrap()), ("DELETED", "gpu-9"));

    for (what, watch) in [
        ("by name", &mut by_name),
        ("by name and label", &mut name_and_label),
        ("by path", &mut by_path),
        ("gpu-9", &mut future),
        ("not gpu-1", &mut not_one),
        ("by label", &mut by_label),
        ("all", &mut all),
    ] {
        assert!(watch.try_next(QUIET).await.is_err(), "{what}: nothing more");
    }

    // Bookmarks reach indexed and other watches that allow them, and only those.
    server.send_bookmark();
    assert_eq!(by_name.next(T).await.unwrap()["type"], "BOOKMARK");
    assert_eq!(by_label.next(T).await.unwrap()["type"], "BOOKMARK");
    assert!(all.try_next(QUIET).await.is_err());

    // A watch its client closed stops counting, indexed or not; drop_watches ends the rest.
    drop(by_name);
    drop(all);
    assert!(server.wait_for(T, |s| s.open_watches() == 5).await);
    server.drop_watches();
    assert_eq!(server.open_watches(), 0);
    assert!(name_and_label.next(T).await.is_none());
    assert!(by_label.next(T).await.is_none());
    assert!(by_path.next(T).await.is_none());
}

#[tokio::test]
async fn watches_replay_from_a_resource_version_through_the_index() {
    let server = server().await;
    server.create_node("gpu-2", &[]);
    let from = server.resource_version();
    server.set_label("gpu-2", "x", Some("1"));
    server.set_label("gpu-1", "x", Some("1"));
    let client = client(&server);
    let mut watch = Watch::open(
        &client,
        &server,
        &format!("fieldSelector=metadata.name%3Dgpu-1&resourceVersion={from}"),
    )
    .await;
    assert_eq!(name(&watch.next(T).await.unwrap()), ("MODIFIED", "gpu-1"));
    assert!(watch.try_next(QUIET).await.is_err());
    server.set_label("gpu-2", "x", Some("2"));
    server.set_label("gpu-1", "x", Some("2"));
    let live = watch.next(T).await.unwrap();
    assert_eq!(name(&live), ("MODIFIED", "gpu-1"));
    assert_eq!(live["object"]["metadata"]["labels"]["x"], "2");
}

fn slice(name: &str, node: Option<&str>) -> Value {
    let mut spec = json!({
        "driver": "gpu.nvidia.com",
        "pool": {"name": node.unwrap_or("shared"), "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
    });
    match node {
        Some(n) => spec["nodeName"] = json!(n),
        None => spec["allNodes"] = json!(true),
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec})
}

#[tokio::test]
async fn slices_listed_and_deleted_by_node_follow_creates_and_deletes() {
    let server = server().await;
    let client = client(&server);
    let url = format!("{}/apis/resource.k8s.io/v1/resourceslices", server.url());
    let send = |method: reqwest::Method, url: String, body: Option<Value>| {
        let mut req = client.request(method, url).bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move {
            let resp = req.send().await.expect("send");
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.expect("JSON"))
        }
    };
    let names = |list: &Value| -> Vec<String> {
        list["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| i["metadata"]["name"].as_str().expect("name").to_owned())
            .collect()
    };
    let by_node = |node: &str| format!("{url}?fieldSelector=spec.nodeName%3D{node}");
    for (name, node) in [
        ("a1", Some("n1")),
        ("a2", Some("n1")),
        ("b1", Some("n2")),
        ("shared", None),
    ] {
        assert_eq!(
            send(reqwest::Method::POST, url.clone(), Some(slice(name, node)))
                .await
                .0,
            201
        );
    }
    let (_, list) = send(reqwest::Method::GET, by_node("n1"), None).await;
    assert_eq!(names(&list), ["a1", "a2"]);
    let (_, list) = send(
        reqwest::Method::GET,
        format!("{url}?fieldSelector=spec.nodeName%3D%3Dn1,metadata.name%3Da2"),
        None,
    )
    .await;
    assert_eq!(names(&list), ["a2"]);
    let (_, list) = send(
        reqwest::Method::GET,
        format!("{url}?fieldSelector=spec.nodeName!%3Dn1"),
        None,
    )
    .await;
    assert_eq!(names(&list), ["b1", "shared"]);
    let (_, list) = send(reqwest::Method::GET, by_node(""), None).await;
    assert_eq!(
        names(&list),
        ["shared"],
        "an empty nodeName selects the slices without one"
    );

    // Deleted, then the name reused on another node: the old node no longer lists it.
    assert_eq!(send(reqwest::Method::DELETE, format!("{url}/a2"), None).await.0, 200);
    assert_eq!(
        send(reqwest::Method::POST, url.clone(), Some(slice("a2", Some("n2"))))
            .await
            .0,
        201
    );
    let (_, list) = send(reqwest::Method::GET, by_node("n1"), None).await;
    assert_eq!(names(&list), ["a1"]);
    let (_, list) = send(reqwest::Method::GET, by_node("n2"), None).await;
    assert_eq!(names(&list), ["a2", "b1"]);

    // An update keeps it listed; deletecollection by node empties that node only.
    let (status, _) = send(
        reqwest::Method::PUT,
        format!("{url}/a1"),
        Some({
            let mut s = slice("a1", Some("n1"));
            s["metadata"]["labels"] = json!({"v": "2"});
            s
        }),
    )
    .await;
    assert_eq!(status, 200);
    let (_, list) = send(
        reqwest::Method::GET,
        format!("{}&labelSelector=v%3D2", by_node("n1")),
        None,
    )
    .await;
    assert_eq!(names(&list), ["a1"]);
    let (status, deleted) = send(reqwest::Method::DELETE, by_node("n2"), None).await;
    assert_eq!((status, names(&deleted)), (200, vec!["a2".to_owned(), "b1".to_owned()]));
    let (_, list) = send(reqwest::Method::GET, by_node("n2"), None).await;
    assert!(names(&list).is_empty());
    assert_eq!(server.resource_slices().keys().collect::<Vec<_>>(), ["a1", "shared"]);
    assert_eq!(server.delete_resource_slices("n1", None), 1);
    let (_, list) = send(reqwest::Method::GET, by_node("n1"), None).await;
    assert!(names(&list).is_empty());
}

#[tokio::test]
async fn events_are_found_by_namespace_and_name() {
    let server = server().await;
    let client = client(&server);
    let event = |ns: &str| {
        json!({
            "metadata": {"name": "gpu-1.same", "namespace": ns},
            "involvedObject": {"kind": "Node", "name": "gpu-1", "namespace": if ns == "default" { "" } else { ns }},
            "reason": "Test", "message": ns, "type": "Normal", "count": 1,
        })
    };
    let post = |ns: &'static str| {
        client
            .post(format!("{}/api/v1/namespaces/{ns}/events", server.url()))
            .bearer_auth(TOKEN)
            .json(&event(ns))
            .send()
    };
    assert_eq!(post("default").await.expect("post").status(), 201);
    assert_eq!(
        post("gpu").await.expect("post").status(),
        201,
        "same name, other namespace"
    );
    assert_eq!(post("default").await.expect("post").status(), 409);

    let resp = client
        .patch(format!("{}/api/v1/namespaces/gpu/events/gpu-1.same", server.url()))
        .bearer_auth(TOKEN)
        .header("Content-Type", "application/merge-patch+json")
        .body(json!({"count": 2}).to_string())
        .send()
        .await
        .expect("patch");
    assert_eq!(resp.status(), 200);
    let counts: Vec<(String, i64)> = server
        .events()
        .iter()
        .map(|e| {
            (
                e["metadata"]["namespace"].as_str().expect("namespace").to_owned(),
                e["count"].as_i64().expect("count"),
            )
        })
        .collect();
    assert_eq!(counts, [("default".to_owned(), 1), ("gpu".to_owned(), 2)]);
    let resp = get(&client, &server, "/api/v1/namespaces/gpu/events/gpu-1.same").await;
    assert_eq!(resp.json::<Value>().await.expect("event")["message"], "gpu");
    let resp = get(&client, &server, "/api/v1/namespaces/kube-system/events/gpu-1.same").await;
    assert_eq!(resp.status(), 404);
}
