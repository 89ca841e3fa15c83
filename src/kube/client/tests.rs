//! The client against a test API server: requests, errors, rotated and refreshed credentials,
//! patches and Events, watches, TLS material.

use super::*;
use crate::kube::credentials::{Auth, ExecApiVersion, ExecConfig, Material, Origin};
use crate::kube::error::ApiFailure;
use crate::kube::testserver::{Reply, TestServer};
use crate::kube::time::format_rfc3339;
use crate::kube::watch::WatchEvent;
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

const TOKEN: &str = "sekrit-token-4f9a8c";
const NODE: &str = r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"gpu-1","uid":"u-1","resourceVersion":"5","labels":{"a":"b"}}}"#;

fn creds(server: &str, auth: Auth) -> Credentials {
    Credentials {
        server: server.to_string(),
        origin: Origin::Kubeconfig {
            path: "/k".into(),
            found_by: crate::kube::credentials::FoundBy::Config,
        },
        ca: None,
        insecure_skip_tls_verify: false,
        tls_server_name: None,
        proxy_url: None,
        auth,
    }
}

fn token_file(path: &Path) -> Auth {
    Auth {
        token: Some(TokenSource::File {
            field: "tokenFile".into(),
            path: path.to_path_buf(),
        }),
        ..Auth::default()
    }
}

/// A client of the plain-http test server: these tests are about the protocol, so they allow
/// tokens over http (`plain_http_*` below test the refusal itself).
fn client(server: &TestServer, auth: Auth) -> KubeClient {
    let cfg = KubernetesConfig {
        allow_insecure_http: true,
        ..KubernetesConfig::default()
    };
    KubeClient::new(creds(&server.url(), auth), &cfg).expect("client")
}

fn bearer(req: &crate::kube::testserver::Request) -> String {
    req.header("authorization")
        .unwrap_or_default()
        .trim_start_matches("Bearer ")
        .to_string()
}

#[tokio::test]
async fn get_node_sends_token_and_parses() {
    let server = TestServer::start(|req| {
        assert_eq!(req.method, "GET");
        assert_eq!(req.path, "/api/v1/nodes/gpu-1?resourceVersion=0");
        assert_eq!(req.header("accept"), Some("application/json"));
        if bearer(req) != TOKEN {
            return Reply::status(401, "Unauthorized");
        }
        Reply::json(200, NODE)
    })
    .await;
    let auth = Auth {
        token: Some(TokenSource::Inline(Secret::new(TOKEN))),
        ..Auth::default()
    };
    let node = client(&server, auth).get_node("gpu-1", true).await.expect("get");
    assert_eq!((node.name.as_str(), node.uid.as_str()), ("gpu-1", "u-1"));
    assert_eq!(node.labels["a"], "b");
}

#[tokio::test]
async fn errors_carry_status_path_and_retry_after() {
    let server = TestServer::start(|req| match req.path.as_str() {
        "/api/v1/nodes/missing" => Reply::status(404, "NotFound"),
        "/api/v1/nodes/busy" => Reply::status(429, "TooManyRequests").with_header("Retry-After", "7"),
        _ => Reply::text(502, &format!("<html>bad gateway {TOKEN}</html>")),
    })
    .await;
    let auth = Auth {
        token: Some(TokenSource::Inline(Secret::new(TOKEN))),
        ..Auth::default()
    };
    let c = client(&server, auth);
    let err = c.get_node("missing", false).await.expect_err("404");
    assert!(err.is_not_found() && !err.is_transient());
    assert_eq!(
        err.to_string(),
        r#"get node "missing" (GET /api/v1/nodes/missing): HTTP 404 NotFound: test says NotFound"#
    );
    let err = c.get_node("busy", false).await.expect_err("429");
    assert!(err.is_transient());
    assert_eq!(err.retry_after(), Some(Duration::from_secs(7)));
    let err = c.get_node("proxy", false).await.expect_err("502");
    let text = err.to_string();
    assert!(
        text.contains("HTTP 502 Bad Gateway: <html>bad gateway <redacted></html>"),
        "{text}"
    );
    assert!(!format!("{err:?}").contains(TOKEN));
}

#[tokio::test]
async fn connection_refused_is_transient() {
    // Bound but not listening: connections are refused, and no other test can take the port.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = socket.local_addr().expect("addr");
    let c = KubeClient::new(
        creds(&format!("http://{addr}"), Auth::default()),
        &KubernetesConfig::default(),
    )
    .expect("client");
    let err = c.get_node("gpu-1", false).await.expect_err("refused");
    assert!(err.is_transient(), "{err}");
    assert!(matches!(err.failure(), Some(ApiFailure::Connect(_))), "{err:?}");
}

#[tokio::test]
async fn rotated_token_file_is_picked_up_before_the_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("token");
    fs::write(&path, "token-one\n").expect("write");
    let accepted = Arc::new(Mutex::new("token-one".to_string()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let server = {
        let (accepted, seen) = (accepted.clone(), seen.clone());
        TestServer::start(move |req| {
            seen.lock().unwrap().push(bearer(req));
            if bearer(req) == *accepted.lock().unwrap() {
                Reply::json(200, NODE)
            } else {
                Reply::status(401, "Unauthorized")
            }
        })
        .await
    };
    let c = client(&server, token_file(&path));
    c.get_node("gpu-1", false).await.expect("first");
    // The file rotates and the server stops accepting the old token.
    fs::write(&path, "token-two-longer\n").expect("rotate");
    *accepted.lock().unwrap() = "token-two-longer".into();
    c.get_node("gpu-1", false).await.expect("after rotation");
    assert_eq!(
        *seen.lock().unwrap(),
        ["token-one", "token-two-longer"],
        "no 401 round trip needed"
    );
}

#[tokio::test]
async fn a_401_rereads_the_token_file_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("token");
    fs::write(&path, "token-aaa").expect("write");
    let accepted = Arc::new(Mutex::new("token-aaa".to_string()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let server = {
        let (accepted, seen) = (accepted.clone(), seen.clone());
        TestServer::start(move |req| {
            seen.lock().unwrap().push(bearer(req));
            if bearer(req) == *accepted.lock().unwrap() {
                Reply::json(200, NODE)
            } else {
                Reply::status(401, "Unauthorized")
            }
        })
        .await
    };
    let c = client(&server, token_file(&path));
    c.get_node("gpu-1", false).await.expect("first");
    // Same size, same mtime: the stamp does not show the change, the 401 does.
    let mtime = fs::metadata(&path).expect("meta").modified().expect("mtime");
    fs::write(&path, "token-bbb").expect("rotate");
    fs::File::options()
        .write(true)
        .open(&path)
        .expect("open")
        .set_modified(mtime)
        .expect("set mtime");
    *accepted.lock().unwrap() = "token-bbb".into();
    c.get_node("gpu-1", false).await.expect("after 401 and refresh");
    assert_eq!(*seen.lock().unwrap(), ["token-aaa", "token-aaa", "token-bbb"]);

    // A token that stays rejected: one refresh, one retry, then the error.
    *accepted.lock().unwrap() = "nobody".into();
    seen.lock().unwrap().clear();
    let err = c.get_node("gpu-1", false).await.expect_err("401");
    assert!(err.is_unauthorized());
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert!(!err.to_string().contains("token-bbb") && !format!("{err:?}").contains("token-bbb"));
    assert!(!format!("{c:?}").contains("token-bbb"));
}

#[tokio::test]
async fn exec_credential_is_cached_until_401() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("plugin.sh");
    let counter = dir.path().join("runs");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\necho x >> '{}'\nn=$(wc -l < '{}' | tr -d ' ')\n\
             printf '{{\"apiVersion\":\"client.authentication.k8s.io/v1beta1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"exec-%s\"}}}}' \"$n\"\n",
            counter.display(),
            counter.display()
        ),
    )
    .expect("write");
    let accepted = Arc::new(Mutex::new("exec-1".to_string()));
    let server = {
        let accepted = accepted.clone();
        TestServer::start(move |req| {
            if bearer(req) == *accepted.lock().unwrap() {
                Reply::json(200, NODE)
            } else {
                Reply::status(401, "Unauthorized")
            }
        })
        .await
    };
    let auth = Auth {
        exec: Some(ExecConfig {
            api_version: ExecApiVersion::V1Beta1,
            command: "sh".into(),
            program: "sh".into(),
            args: vec![script.display().to_string()],
            env: vec![],
            provide_cluster_info: true,
            install_hint: None,
            kubeconfig: "/k".into(),
        }),
        ..Auth::default()
    };
    let c = client(&server, auth);
    let runs = || fs::read_to_string(&counter).map(|t| t.lines().count()).unwrap_or(0);
    assert_eq!(runs(), 0, "the plugin runs at the first request, not at construction");
    c.get_node("gpu-1", false).await.expect("first");
    c.get_node("gpu-1", false).await.expect("second");
    assert_eq!(runs(), 1, "no expiry: cached");
    *accepted.lock().unwrap() = "exec-2".into();
    c.get_node("gpu-1", false).await.expect("after 401");
    assert_eq!(runs(), 2, "re-run after a 401");
}

#[tokio::test]
async fn expired_exec_credential_is_renewed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("plugin.sh");
    let counter = dir.path().join("runs");
    let soon = format_rfc3339(SystemTime::now() + Duration::from_secs(10));
    fs::write(
        &script,
        format!(
            "#!/bin/sh\necho x >> '{}'\nprintf '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t\",\"expirationTimestamp\":\"{soon}\"}}}}'\n",
            counter.display()
        ),
    )
    .expect("write");
    let server = TestServer::start(|_| Reply::json(200, NODE)).await;
    let auth = Auth {
        exec: Some(ExecConfig {
            api_version: ExecApiVersion::V1,
            command: "sh".into(),
            program: "sh".into(),
            args: vec![script.display().to_string()],
            env: vec![],
            provide_cluster_info: false,
            install_hint: None,
            kubeconfig: "/k".into(),
        }),
        ..Auth::default()
    };
    let c = client(&server, auth);
    c.get_node("gpu-1", false).await.expect("first");
    c.get_node("gpu-1", false).await.expect("second");
    // Expiring within the margin: every request renews.
    assert_eq!(fs::read_to_string(&counter).expect("runs").lines().count(), 2);
}

#[tokio::test]
async fn patch_and_event_bodies() {
    let requests = Arc::new(Mutex::new(Vec::new()));
    let server = {
        let requests = requests.clone();
        TestServer::start(move |req| {
            requests.lock().unwrap().push(req.clone());
            match req.method.as_str() {
                "PATCH" => Reply::json(200, NODE),
                _ => Reply::json(201, "{}"),
            }
        })
        .await
    };
    let c = client(&server, Auth::default());
    let labels = BTreeMap::from([
        ("nvidia.com/mig.config.state".to_string(), Some("success".to_string())),
        ("old".to_string(), None),
    ]);
    c.patch_node_metadata("gpu-1", &labels, &BTreeMap::new())
        .await
        .expect("patch");
    let event = NodeEvent {
        node_name: "gpu-1".into(),
        node_uid: "u-1".into(),
        event_type: EventType::Warning,
        reason: "MigConfigFailed".into(),
        message: "x".repeat(2000),
    };
    c.create_event(&event).await.expect("event");

    let requests = requests.lock().unwrap();
    let patch = &requests[0];
    assert_eq!(
        (patch.method.as_str(), patch.path.as_str()),
        ("PATCH", "/api/v1/nodes/gpu-1")
    );
    assert_eq!(patch.header("content-type"), Some("application/merge-patch+json"));
    let body: serde_json::Value = serde_json::from_slice(&patch.body).expect("json");
    assert_eq!(
        body,
        serde_json::json!({"metadata": {"labels": {"nvidia.com/mig.config.state": "success", "old": null}}})
    );
    let post = &requests[1];
    assert_eq!(
        (post.method.as_str(), post.path.as_str()),
        ("POST", "/api/v1/namespaces/default/events")
    );
    let body: serde_json::Value = serde_json::from_slice(&post.body).expect("json");
    assert_eq!(
        body["involvedObject"],
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u-1"})
    );
    assert_eq!(body["metadata"]["generateName"], "gpu-1.");
    assert_eq!(body["type"], "Warning");
    assert_eq!(
        body["source"],
        serde_json::json!({"component": "gpu-node-agent", "host": "gpu-1"})
    );
    assert_eq!(body["count"], 1);
    assert_eq!(body["message"].as_str().map(str::len), Some(MAX_EVENT_MESSAGE));
    assert_eq!(body["firstTimestamp"], body["lastTimestamp"]);
}

#[tokio::test]
async fn watch_streams_events_split_across_chunks() {
    let server = TestServer::start(|req| {
        assert_eq!(
            req.path,
            "/api/v1/nodes?watch=1&fieldSelector=metadata.name%3Dgpu-1&resourceVersion=5\
             &allowWatchBookmarks=true&timeoutSeconds=300"
        );
        let modified = format!(r#"{{"type":"MODIFIED","object":{NODE}}}"#);
        let (a, b) = modified.split_at(40);
        Reply::chunks(vec![
            a.as_bytes().to_vec(),
            format!("{b}\n{{\"type\":\"BOOKMARK\",\"object\":{{\"kind\":\"Node\",\"metadata\":{{\"resourceVersion\":\"9\"}}}}}}\n{{\"type\":\"ERR")
                .into_bytes(),
            br#"OR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}}"#.to_vec(),
        ])
    })
    .await;
    let c = client(&server, Auth::default());
    let mut stream = c
        .watch_node("gpu-1", "5", Duration::from_secs(300))
        .await
        .expect("watch");
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        events.push(event.expect("event"));
    }
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(matches!(&events[0], WatchEvent::Modified(n) if n.resource_version == "5"));
    assert_eq!(
        events[1],
        WatchEvent::Bookmark {
            resource_version: "9".into()
        }
    );
    assert_eq!(events[2], WatchEvent::Gone);
}

#[tokio::test]
async fn watch_http_410_is_gone() {
    let server = TestServer::start(|_| Reply::status(410, "Expired")).await;
    let c = client(&server, Auth::default());
    let err = c
        .watch_node("gpu-1", "1", Duration::from_secs(1))
        .await
        .expect_err("410");
    assert!(err.is_gone(), "{err}");
}

#[tokio::test]
async fn tls_material_is_checked_at_construction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.crt");
    fs::write(&ca, "not a certificate").expect("write");
    let mut c = creds("https://127.0.0.1:6443", Auth::default());
    c.ca = Some(Material {
        field: "kubeconfig /k, cluster \"k\": certificate-authority".into(),
        source: MaterialSource::File(ca),
    });
    let err = KubeClient::new(c.clone(), &KubernetesConfig::default())
        .expect_err("bad CA")
        .to_string();
    assert!(
        err.contains("certificate-authority") && err.contains("no PEM certificate"),
        "{err}"
    );
    c.ca.as_mut().expect("ca").source = MaterialSource::File(dir.path().join("missing"));
    let err = KubeClient::new(c, &KubernetesConfig::default())
        .expect_err("missing CA")
        .to_string();
    assert!(err.contains("cannot read") && err.contains("missing"), "{err}");
}

#[tokio::test]
async fn plain_http_with_a_token_is_refused_unless_allowed() {
    let server = TestServer::start(|req| {
        if bearer(req) == TOKEN {
            Reply::json(200, NODE)
        } else {
            Reply::status(401, "Unauthorized")
        }
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("token");
    fs::write(&path, TOKEN).expect("write");
    let exec = ExecConfig {
        api_version: ExecApiVersion::V1,
        command: "/usr/bin/cred".into(),
        program: "/usr/bin/cred".into(),
        args: vec![],
        env: vec![],
        provide_cluster_info: false,
        install_hint: None,
        kubeconfig: "/k".into(),
    };
    let inline = Auth {
        token: Some(TokenSource::Inline(Secret::new(TOKEN))),
        ..Auth::default()
    };
    let exec = Auth {
        exec: Some(exec),
        ..Auth::default()
    };
    for (auth, what) in [
        (inline.clone(), "bearer token".to_string()),
        (token_file(&path), format!("bearer token from {}", path.display())),
        (exec, "credential of the exec plugin \"/usr/bin/cred\"".to_string()),
    ] {
        let err = KubeClient::new(creds(&server.url(), auth), &KubernetesConfig::default())
            .expect_err("token over http")
            .to_string();
        assert!(
            err.starts_with(&format!("kubeconfig /k: server {} is plain http://", server.url())),
            "{err}"
        );
        assert!(
            err.contains(&format!("the {what} would be sent in cleartext"))
                && err.contains("kubernetes.allow_insecure_http = true"),
            "{err}"
        );
        assert!(!err.contains(TOKEN), "{err}");
    }
    // Allowed: works as before.
    let node = client(&server, inline).get_node("gpu-1", false).await.expect("allowed");
    assert_eq!(node.name, "gpu-1");
}

#[tokio::test]
async fn plain_http_without_credentials_needs_no_permission() {
    let server = TestServer::start(|_| Reply::json(200, NODE)).await;
    let c = KubeClient::new(creds(&server.url(), Auth::default()), &KubernetesConfig::default())
        .expect("anonymous over http");
    assert_eq!(c.get_node("gpu-1", false).await.expect("get").name, "gpu-1");
}

/// A Node JSON of about `size` bytes (a padding annotation).
fn big_node(size: usize) -> String {
    let padding = "x".repeat(size);
    format!(
        r#"{{"kind":"Node","apiVersion":"v1","metadata":{{"name":"gpu-1","uid":"u-1","resourceVersion":"5","annotations":{{"pad":"{padding}"}}}}}}"#
    )
}

#[tokio::test]
async fn answers_over_the_limit_are_an_error_naming_the_path_and_limit() {
    let limit = crate::kube::limit::MAX_API_BODY;
    // Chunked, no Content-Length: read until one chunk past the limit.
    let server = TestServer::start(move |req| {
        let body = big_node(limit + 1).into_bytes();
        let chunks: Vec<Vec<u8>> = body.chunks(4 << 20).map(<[u8]>::to_vec).collect();
        match req.method.as_str() {
            "GET" if req.path.contains("exact") => Reply::json(200, &big_node(limit - 200)),
            "GET" if req.path.contains("declared") => Reply::json(200, &big_node(limit)),
            _ => Reply::chunks(chunks),
        }
    })
    .await;
    let c = client(&server, Auth::default());
    let err = c.get_node("gpu-1", false).await.expect_err("too large");
    assert_eq!(
        err.to_string(),
        "get node \"gpu-1\" (GET /api/v1/nodes/gpu-1): the API server's answer is over the 16 MiB limit \
         (reading stopped there)"
    );
    assert!(matches!(err.failure(), Some(ApiFailure::TooLarge { .. })), "{err:?}");
    // Content-Length over the limit: refused before reading.
    let err = c.get_node("declared", false).await.expect_err("declared too large");
    let text = err.to_string();
    assert!(
        text.starts_with("get node \"declared\" (GET /api/v1/nodes/declared): the API server's answer is over the 16 MiB limit (Content-Length "),
        "{text}"
    );
    // Under it: read as usual.
    let node = c.get_node("exact", false).await.expect("under the limit");
    assert_eq!(node.name, "gpu-1");
    // A PATCH answer is limited the same way.
    let err = c
        .patch_node_metadata(
            "gpu-1",
            &BTreeMap::from([("a".into(), Some("b".into()))]),
            &BTreeMap::new(),
        )
        .await
        .expect_err("patch answer too large")
        .to_string();
    assert!(
        err.starts_with(
            "patch node \"gpu-1\" (PATCH /api/v1/nodes/gpu-1): the API server's answer is over the 16 MiB limit"
        ),
        "{err}"
    );
}

#[tokio::test]
async fn a_watch_event_over_the_limit_ends_the_stream_with_an_error() {
    let limit = crate::kube::limit::MAX_WATCH_EVENT;
    let server = TestServer::start(move |_| {
        let event = format!(r#"{{"type":"MODIFIED","object":{}}}"#, big_node(limit));
        let mut chunks = vec![format!("{{\"type\":\"MODIFIED\",\"object\":{NODE}}}\n").into_bytes()];
        chunks.extend(event.as_bytes().chunks(4 << 20).map(<[u8]>::to_vec));
        Reply::chunks(chunks)
    })
    .await;
    let c = client(&server, Auth::default());
    let mut stream = c
        .watch_node("gpu-1", "5", Duration::from_secs(300))
        .await
        .expect("watch");
    assert!(matches!(stream.next().await, Some(Ok(WatchEvent::Modified(_)))));
    let err = stream.next().await.expect("an item").expect_err("too long");
    let text = err.to_string();
    assert!(
        text.starts_with("watch node \"gpu-1\" (GET /api/v1/nodes?watch=1&")
            && text.ends_with("a watch event line is over the 16 MiB limit (reading stopped there)"),
        "{text}"
    );
    assert!(stream.next().await.is_none());
}

#[tokio::test]
async fn credential_files_over_the_limit_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("token");
    fs::write(
        &path,
        vec![b'a'; (crate::kube::limit::MAX_CREDENTIAL_FILE + 1) as usize],
    )
    .expect("write");
    let err = KubeClient::new(
        creds("https://127.0.0.1:6443", token_file(&path)),
        &KubernetesConfig::default(),
    )
    .expect_err("huge token file")
    .to_string();
    assert_eq!(
        err,
        format!(
            "tokenFile: cannot read {}: the file is over the 1 MiB limit (1048577 bytes)",
            path.display()
        )
    );
}
