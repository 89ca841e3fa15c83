//! Objects: GET, LIST, PATCH flavours, preconditions, validation, Events, the request log.

mod common;

use common::{TOKEN, USER, client, get, patch, rv, server};
use serde_json::{Value, json};
use test_apiserver::{Options, TestApiServer};

#[tokio::test]
async fn get_node_and_not_found() {
    let server = server().await;
    let client = client(&server);

    let resp = get(&client, &server, "/api/v1/nodes/gpu-1").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.version(),
        reqwest::Version::HTTP_2,
        "ALPN offers h2 like kube-apiserver"
    );
    assert_eq!(resp.headers()["content-type"], "application/json");
    let node: Value = resp.json().await.unwrap();
    assert_eq!(node["kind"], "Node");
    assert_eq!(node["apiVersion"], "v1");
    assert_eq!(node["metadata"]["name"], "gpu-1");
    assert_eq!(node["metadata"]["labels"], json!({"a": "1"}));
    assert!(node["metadata"]["uid"].as_str().unwrap().len() == 36);
    assert_eq!(
        node["metadata"]["resourceVersion"].as_str().unwrap(),
        server.resource_version()
    );

    let cached: Value = get(&client, &server, "/api/v1/nodes/gpu-1?resourceVersion=0")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(cached, node);

    let resp = get(&client, &server, "/api/v1/nodes/nope").await;
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let status: Value = resp.json().await.unwrap();
    assert_eq!(
        status,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "nodes \"nope\" not found", "reason": "NotFound",
            "details": {"name": "nope", "kind": "nodes"}, "code": 404,
        })
    );

    let status: Value = get(&client, &server, "/apis/apps/v1/deployments")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (status["code"].as_u64(), status["reason"].as_str()),
        (Some(404), Some("NotFound"))
    );
}

#[tokio::test]
async fn list_nodes_with_selectors() {
    let server = server().await;
    server.create_node("gpu-2", &[("a", "2")]);
    let client = client(&server);

    let list: Value = get(&client, &server, "/api/v1/nodes").await.json().await.unwrap();
    assert_eq!(list["kind"], "NodeList");
    assert_eq!(
        list["metadata"]["resourceVersion"].as_str().unwrap(),
        server.resource_version()
    );
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    assert!(
        list["items"][0].get("kind").is_none(),
        "list items carry no kind, as upstream"
    );

    let list: Value = get(&client, &server, "/api/v1/nodes?fieldSelector=metadata.name%3Dgpu-2")
        .await
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpu-2"]);

    let list: Value = get(&client, &server, "/api/v1/nodes?labelSelector=a%3D1")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["items"][0]["metadata"]["name"], "gpu-1");
    assert_eq!(list["items"].as_array().unwrap().len(), 1);

    let resp = get(&client, &server, "/api/v1/nodes?fieldSelector=spec.foo%3Dx").await;
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn merge_patch_adds_and_deletes_labels() {
    let server = server().await;
    server.set_label("gpu-1", "b", Some("2"));
    let client = client(&server);
    let before = rv(&server.node("gpu-1").unwrap());

    let body = json!({"metadata": {"labels": {"nvidia.com/gpu.present": "true", "a": null}}});
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let node: Value = resp.json().await.unwrap();
    assert!(rv(&node) > before);
    assert_eq!(
        node["metadata"]["labels"],
        json!({"b": "2", "nvidia.com/gpu.present": "true"})
    );
    assert_eq!(
        server.labels("gpu-1").get("nvidia.com/gpu.present").map(String::as_str),
        Some("true")
    );
    assert!(!server.labels("gpu-1").contains_key("a"));

    // The same patch again changes nothing: 200, same resourceVersion.
    let again: Value = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(rv(&again), rv(&node));

    // Strategic merge behaves the same for labels and annotations.
    let body = json!({"metadata": {"labels": {"b": null}, "annotations": {"nvidia.com/state": "ready"}}});
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/strategic-merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        server.labels("gpu-1").keys().collect::<Vec<_>>(),
        ["nvidia.com/gpu.present"]
    );
    assert_eq!(server.annotations("gpu-1")["nvidia.com/state"], "ready");

    // Removing the last label drops the map, as Go's omitempty does.
    let body = json!({"metadata": {"labels": {"nvidia.com/gpu.present": null}}});
    let node: Value = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await
    .json()
    .await
    .unwrap();
    assert!(node["metadata"].get("labels").is_none());

    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/nope",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn json_patch_with_escaped_keys() {
    let server = server().await;
    let client = client(&server);
    let body = json!([
        {"op": "add", "path": "/metadata/labels/nvidia.com~1gpu.count", "value": "8"},
        {"op": "replace", "path": "/metadata/labels/a", "value": "9"},
    ]);
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/json-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(server.labels("gpu-1")["nvidia.com/gpu.count"], "8");
    assert_eq!(server.labels("gpu-1")["a"], "9");

    let body = json!([{"op": "remove", "path": "/metadata/labels/nvidia.com~1gpu.count"}]);
    assert_eq!(
        patch(
            &client,
            &server,
            "/api/v1/nodes/gpu-1",
            "application/json-patch+json",
            &body
        )
        .await
        .status(),
        200
    );
    assert!(!server.labels("gpu-1").contains_key("nvidia.com/gpu.count"));

    // Removing what is not there does not apply.
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/json-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 422);
    let status: Value = resp.json().await.unwrap();
    assert_eq!(status["reason"], "Invalid");
}

#[tokio::test]
async fn stale_resource_version_conflicts() {
    let server = server().await;
    let client = client(&server);
    let stale = server.node_resource_version("gpu-1").unwrap();
    server.set_label("gpu-1", "someone", Some("else"));

    let body = json!({"metadata": {"resourceVersion": stale, "labels": {"x": "y"}}});
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 409);
    let status: Value = resp.json().await.unwrap();
    assert_eq!(status["reason"], "Conflict");
    assert_eq!(
        status["message"],
        "Operation cannot be fulfilled on nodes \"gpu-1\": the object has been modified; please apply your \
         changes to the latest version and try again"
    );
    assert_eq!(status["details"], json!({"name": "gpu-1", "kind": "nodes"}));
    assert!(!server.labels("gpu-1").contains_key("x"));

    // With the current resourceVersion it applies.
    let current = server.node_resource_version("gpu-1").unwrap();
    let body = json!({"metadata": {"resourceVersion": current, "labels": {"x": "y"}}});
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(server.labels("gpu-1")["x"], "y");

    // A JSON patch that writes a stale resourceVersion conflicts too.
    let body = json!([{"op": "replace", "path": "/metadata/resourceVersion", "value": stale}]);
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/json-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 409);
}

#[tokio::test]
async fn unsupported_patch_type_is_415() {
    let server = server().await;
    let client = client(&server);
    let body = json!({"metadata": {"labels": {"x": "y"}}});
    for ct in ["application/json", "application/apply-patch+yaml", "text/plain"] {
        let resp = patch(&client, &server, "/api/v1/nodes/gpu-1", ct, &body).await;
        assert_eq!(resp.status(), 415, "{ct}");
        let status: Value = resp.json().await.unwrap();
        assert_eq!(status["reason"], "UnsupportedMediaType");
    }
    assert!(!server.labels("gpu-1").contains_key("x"));
}

#[tokio::test]
async fn invalid_labels_are_422() {
    let server = server().await;
    let client = client(&server);
    let before = server.node_resource_version("gpu-1");
    let cases = [
        ("bad key", "v"),
        ("nvidia.com/", "v"),
        ("Nvidia.COM/x", "v"),
        ("a/b/c", "v"),
        ("ok", "-bad"),
        ("ok", &"v".repeat(64)),
    ];
    for (key, value) in cases {
        let body = json!({"metadata": {"labels": {key: value}}});
        let resp = patch(
            &client,
            &server,
            "/api/v1/nodes/gpu-1",
            "application/merge-patch+json",
            &body,
        )
        .await;
        assert_eq!(resp.status(), 422, "{key}={value}");
        let status: Value = resp.json().await.unwrap();
        assert_eq!(status["reason"], "Invalid");
        assert_eq!(status["details"]["kind"], "Node");
        assert_eq!(status["details"]["causes"][0]["field"], "metadata.labels");
        let message = status["message"].as_str().unwrap();
        assert!(
            message.starts_with("Node \"gpu-1\" is invalid: metadata.labels: Invalid value: "),
            "{message}"
        );
    }
    let body = json!({"metadata": {"labels": {"bad key": "v"}}});
    let status: Value = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        status["message"],
        "Node \"gpu-1\" is invalid: metadata.labels: Invalid value: \"bad key\": name part must consist of \
         alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. \
         'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
    );
    // A non-string value is a decoding error.
    let body = json!({"metadata": {"labels": {"n": 1}}});
    let resp = patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(server.node_resource_version("gpu-1"), before);
}

#[tokio::test]
async fn put_replaces_with_precondition() {
    let server = server().await;
    let client = client(&server);
    let mut node = server.node("gpu-1").unwrap();
    node["metadata"]["labels"] = json!({"only": "this"});
    let url = format!("{}/api/v1/nodes/gpu-1", server.url());
    let resp = client.put(&url).bearer_auth(TOKEN).json(&node).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(server.labels("gpu-1").len(), 1);
    // The same body again carries a now stale resourceVersion.
    let resp = client.put(&url).bearer_auth(TOKEN).json(&node).send().await.unwrap();
    assert_eq!(resp.status(), 409);
}

fn node_event(name: Option<&str>, generate_name: Option<&str>, ns: &str) -> Value {
    let mut ev = json!({
        "metadata": {"namespace": ns},
        "involvedObject": {"kind": "Node", "name": "gpu-1", "apiVersion": "v1"},
        "reason": "MigConfigApplied",
        "message": "applied all-1g.5gb",
        "type": "Normal",
        "source": {"component": "gpu-node-agent", "host": "gpu-1"},
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:00:00Z",
        "count": 1,
    });
    if let Some(n) = name {
        ev["metadata"]["name"] = json!(n);
    }
    if let Some(g) = generate_name {
        ev["metadata"]["generateName"] = json!(g);
    }
    ev
}

#[tokio::test]
async fn events_create_list_patch() {
    let server = server().await;
    let client = client(&server);
    let url = format!("{}/api/v1/namespaces/default/events", server.url());

    let resp = client
        .post(&url)
        .bearer_auth(TOKEN)
        .json(&node_event(None, Some("gpu-1."), "default"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let created: Value = resp.json().await.unwrap();
    let name = created["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(name.starts_with("gpu-1.") && name.len() == "gpu-1.".len() + 5, "{name}");
    assert_eq!(created["metadata"]["namespace"], "default");
    assert_eq!(created["kind"], "Event");
    assert!(created["metadata"]["uid"].is_string() && created["metadata"]["resourceVersion"].is_string());

    let resp = client
        .post(&url)
        .bearer_auth(TOKEN)
        .json(&node_event(Some("fixed"), None, "default"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let resp = client
        .post(&url)
        .bearer_auth(TOKEN)
        .json(&node_event(Some("fixed"), None, "default"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    assert_eq!(resp.json::<Value>().await.unwrap()["reason"], "AlreadyExists");

    let list: Value = client
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["kind"], "EventList");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    let list: Value = client
        .get(format!(
            "{url}?fieldSelector=involvedObject.name%3Dgpu-1,reason%3DMigConfigApplied"
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 2);

    // Count bump, as client-go's event correlator does.
    let body = json!({"count": 2, "lastTimestamp": "2026-01-01T00:01:00Z"});
    let resp = patch(
        &client,
        &server,
        "/api/v1/namespaces/default/events/fixed",
        "application/strategic-merge-patch+json",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let events = server.events();
    assert_eq!(events.len(), 2);
    assert_eq!(events[1]["count"], 2);
    assert_eq!(events[1]["reason"], "MigConfigApplied");

    // A Node (cluster-scoped) event without eventTime must go to "default" (or "").
    let other = format!("{}/api/v1/namespaces/gpu-operator/events", server.url());
    let resp = client
        .post(&other)
        .bearer_auth(TOKEN)
        .json(&node_event(Some("x"), None, "gpu-operator"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    let status: Value = resp.json().await.unwrap();
    assert_eq!(
        status["message"],
        "Event \"x\" is invalid: involvedObject.namespace: Invalid value: \"\": does not match event.namespace"
    );
    // Namespace in the body must match the URL.
    let resp = client
        .post(&url)
        .bearer_auth(TOKEN)
        .json(&node_event(Some("y"), None, "kube-system"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    // No name at all.
    let resp = client
        .post(&url)
        .bearer_auth(TOKEN)
        .json(&node_event(None, None, "default"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    assert_eq!(server.events().len(), 2);
}

#[tokio::test]
async fn request_log_records_requests() {
    let server = server().await;
    let client = client(&server);
    server.clear_requests();
    get(&client, &server, "/api/v1/nodes/gpu-1").await;
    let body = json!({"metadata": {"labels": {"b": "2"}}});
    patch(
        &client,
        &server,
        "/api/v1/nodes/gpu-1",
        "application/merge-patch+json",
        &body,
    )
    .await;
    client
        .get(format!("{}/api/v1/nodes/gpu-1", server.url()))
        .send()
        .await
        .unwrap();

    let log = server.requests();
    assert_eq!(log.len(), 3);
    assert_eq!(
        (log[0].method.as_str(), log[0].path.as_str(), log[0].status),
        ("GET", "/api/v1/nodes/gpu-1", 200)
    );
    assert_eq!(log[0].user.as_deref(), Some(USER));
    assert_eq!((log[0].verb.as_str(), log[0].watch), ("get", false));
    assert_eq!(
        (log[1].method.as_str(), log[1].verb.as_str(), log[1].status),
        ("PATCH", "patch", 200)
    );
    assert_eq!(log[1].content_type.as_deref(), Some("application/merge-patch+json"));
    assert_eq!(log[1].body_json(), Some(body));
    assert_eq!((log[2].user.as_deref(), log[2].status), (None, 401));
    assert!(log[0].at <= log[1].at && log[1].at <= log[2].at);
    assert_eq!(server.count("get", "/api/v1/nodes"), 2);
    assert_eq!(server.count("PATCH", "/api/v1/nodes/gpu-1"), 1);

    get(
        &client,
        &server,
        "/api/v1/nodes?fieldSelector=metadata.name%3Dgpu-1&limit=500",
    )
    .await;
    let last = server.requests().pop().unwrap();
    assert_eq!(last.query, "fieldSelector=metadata.name%3Dgpu-1&limit=500");
    assert_eq!(
        last.query_param("fieldSelector").as_deref(),
        Some("metadata.name=gpu-1")
    );
    assert_eq!(last.verb, "list");

    server.clear_requests();
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn http1_only_server() {
    let server = TestApiServer::start_with(Options {
        http2: false,
        ..Options::default()
    })
    .await;
    server.add_token(TOKEN, USER);
    server.create_node("gpu-1", &[]);
    let client = client(&server);
    let resp = get(&client, &server, "/api/v1/nodes/gpu-1").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), reqwest::Version::HTTP_11);
    let node: Value = resp.json().await.unwrap();
    assert!(
        node["metadata"].get("labels").is_none(),
        "no labels: the map is left out"
    );
}

#[tokio::test]
async fn version_endpoint_and_wait_for() {
    let server = server().await;
    let client = client(&server);
    let v: Value = get(&client, &server, "/version").await.json().await.unwrap();
    assert_eq!(v["major"], "1");

    let s2 = server.clone();
    let waiter = tokio::spawn(async move {
        s2.wait_for(std::time::Duration::from_secs(5), |s| {
            s.labels("gpu-1").contains_key("late")
        })
        .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    server.set_label("gpu-1", "late", Some("yes"));
    assert!(waiter.await.unwrap());
    assert!(
        !server
            .wait_for(std::time::Duration::from_millis(100), |s| s
                .labels("gpu-1")
                .contains_key("never"))
            .await
    );
}

#[tokio::test]
async fn plain_http_server() {
    let server = TestApiServer::start_with(Options {
        plain_http: true,
        ..Options::default()
    })
    .await;
    assert!(server.url().starts_with("http://127.0.0.1:"), "{}", server.url());
    server.add_token(TOKEN, USER);
    server.create_node("gpu-1", &[]);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let resp = get(&client, &server, "/api/v1/nodes/gpu-1").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(server.requests()[0].user.as_deref(), Some(USER));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = server.write_kubeconfig(dir.path(), test_apiserver::KubeconfigAuth::Token(TOKEN.into()));
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    assert!(
        text.contains(&server.url()) && !text.contains("certificate-authority"),
        "{text}"
    );
}

#[tokio::test]
async fn oversized_answers_are_streamed() {
    use futures_util::StreamExt as _;
    use test_apiserver::Failure;
    let server = server().await;
    let client = client(&server);
    let padding = 5 << 20;
    for declare_length in [false, true] {
        server.fail_next(
            1,
            Failure::Oversized {
                padding,
                declare_length,
            },
        );
        let resp = get(&client, &server, "/api/v1/nodes/gpu-1").await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.content_length().is_some(), declare_length);
        let declared = resp.content_length();
        let body = resp.bytes().await.unwrap();
        if let Some(n) = declared {
            assert_eq!(n, body.len() as u64);
        }
        let node: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(node["metadata"]["name"], "gpu-1");
        assert_eq!(node["metadata"]["labels"]["a"], "1", "the stored Node, padded");
        let pad = node["metadata"]["annotations"]["test-apiserver/padding"]
            .as_str()
            .unwrap();
        assert_eq!(pad.len() as u64, padding);
    }
    // A watch: one MODIFIED line with the padded Node, then the end.
    server.fail_next(
        1,
        Failure::Oversized {
            padding: 1000,
            declare_length: false,
        },
    );
    let resp = get(
        &client,
        &server,
        "/api/v1/nodes?watch=1&fieldSelector=metadata.name%3Dgpu-1",
    )
    .await;
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    assert!(body.ends_with(b"\n"));
    let event: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(event["type"], "MODIFIED");
    assert_eq!(event["object"]["metadata"]["name"], "gpu-1");
    assert_eq!(
        event["object"]["metadata"]["annotations"]["test-apiserver/padding"]
            .as_str()
            .map(str::len),
        Some(1000)
    );
}
