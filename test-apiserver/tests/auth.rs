//! Authentication (tokens, client certificates), authorization, injected failures, the server
//! going down, kubeconfig files and the exec credential plugin.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use common::{TOKEN, USER, Watch, client, client_with_cert, get, patch, server};
use serde_json::{Value, json};
use test_apiserver::{Failure, KubeconfigAuth, KubeconfigOptions};

const NODE: &str = "/api/v1/nodes/gpu-1";

#[tokio::test]
async fn tokens_authenticate_and_rotate() {
    let server = server().await;
    let client = client(&server);
    let url = format!("{}{NODE}", server.url());

    let resp = client.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(
        resp.json::<Value>().await.unwrap(),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Unauthorized", "reason": "Unauthorized", "code": 401})
    );
    assert_eq!(
        client.get(&url).bearer_auth("unknown").send().await.unwrap().status(),
        401
    );
    assert_eq!(
        client
            .get(&url)
            .basic_auth("u", Some("p"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(client.get(&url).bearer_auth(TOKEN).send().await.unwrap().status(), 200);

    // Rotation: the new token works, the old one stops working on the same connection.
    server.add_token("new-token", USER);
    server.remove_token(TOKEN);
    assert_eq!(client.get(&url).bearer_auth(TOKEN).send().await.unwrap().status(), 401);
    assert_eq!(
        client.get(&url).bearer_auth("new-token").send().await.unwrap().status(),
        200
    );
    let users: Vec<Option<String>> = server.requests().into_iter().map(|r| r.user).collect();
    assert_eq!(users[..3], [None, None, None]);
    assert_eq!(users[3].as_deref(), Some(USER));
    assert_eq!(users[5].as_deref(), Some(USER));
}

#[tokio::test]
async fn client_certificates_authenticate_by_cn() {
    let server = server().await;
    let (cert, key) = server.issue_client_cert("system:node:gpu-1", &["system:nodes"]);
    let client = client_with_cert(&server, &cert, &key);
    let resp = client.get(format!("{}{NODE}", server.url())).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        server.requests().last().unwrap().user.as_deref(),
        Some("system:node:gpu-1")
    );

    // A certificate from another CA: the handshake succeeds, the request is 401.
    let (cert, key) = server.issue_untrusted_client_cert("mallory", &[]);
    let client = client_with_cert(&server, &cert, &key);
    let resp = client.get(format!("{}{NODE}", server.url())).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(server.requests().last().unwrap().user, None);
    // ... unless a valid token comes with it.
    let resp = client
        .get(format!("{}{NODE}", server.url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn forbid_gives_rbac_403() {
    let server = server().await;
    let client = client(&server);
    server.forbid(USER, "patch", "nodes");
    let body = json!({"metadata": {"labels": {"x": "y"}}});
    let resp = patch(&client, &server, NODE, "application/merge-patch+json", &body).await;
    assert_eq!(resp.status(), 403);
    let status: Value = resp.json().await.unwrap();
    assert_eq!(status["reason"], "Forbidden");
    assert_eq!(
        status["message"],
        format!(
            "nodes \"gpu-1\" is forbidden: User \"{USER}\" cannot patch resource \"nodes\" in API group \"\" at the \
             cluster scope"
        )
    );
    assert_eq!(status["details"], json!({"name": "gpu-1", "kind": "nodes"}));
    assert_eq!(get(&client, &server, NODE).await.status(), 200, "get is still allowed");
    assert!(!server.labels("gpu-1").contains_key("x"));

    server.forbid("*", "create", "events");
    let resp = client
        .post(format!("{}/api/v1/namespaces/default/events", server.url()))
        .bearer_auth(TOKEN)
        .json(&json!({"metadata": {"name": "e"}}))
        .send()
        .await
        .unwrap();
    let status: Value = resp.json().await.unwrap();
    assert_eq!(
        status["message"],
        format!(
            "events is forbidden: User \"{USER}\" cannot create resource \"events\" in API group \"\" in the \
             namespace \"default\""
        )
    );
    server.clear_forbidden();
    assert_eq!(
        patch(&client, &server, NODE, "application/merge-patch+json", &body)
            .await
            .status(),
        200
    );
}

#[tokio::test]
async fn injected_failures() {
    let server = server().await;
    let client = client(&server);

    server.fail_next(2, Failure::TooManyRequests { retry_after_secs: 3 });
    for _ in 0..2 {
        let resp = get(&client, &server, NODE).await;
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "3");
        let status: Value = resp.json().await.unwrap();
        assert_eq!(status["reason"], "TooManyRequests");
        assert_eq!(status["details"]["retryAfterSeconds"], 3);
    }
    assert_eq!(get(&client, &server, NODE).await.status(), 200);

    // Unauthenticated requests get their 401 and leave the fault queued.
    server.fail_next(1, Failure::Internal);
    assert_eq!(
        client
            .get(format!("{}{NODE}", server.url()))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let resp = get(&client, &server, NODE).await;
    assert_eq!(resp.status(), 500);
    assert_eq!(resp.json::<Value>().await.unwrap()["reason"], "InternalError");

    for (failure, code, reason) in [
        (Failure::Unauthorized, 401, "Unauthorized"),
        (Failure::Forbidden, 403, "Forbidden"),
        (Failure::Unavailable, 503, "ServiceUnavailable"),
        (Failure::Timeout, 504, "Timeout"),
    ] {
        server.fail_next(1, failure);
        let resp = get(&client, &server, NODE).await;
        assert_eq!(resp.status(), code);
        assert_eq!(resp.json::<Value>().await.unwrap()["reason"], reason);
    }

    // Only PATCHes of nodes fail; the GET in between is served.
    server.fail_next_matching(1, "patch", "nodes", Failure::Unavailable);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
    let body = json!({"metadata": {"labels": {"x": "y"}}});
    assert_eq!(
        patch(&client, &server, NODE, "application/merge-patch+json", &body)
            .await
            .status(),
        503
    );
    assert_eq!(
        patch(&client, &server, NODE, "application/merge-patch+json", &body)
            .await
            .status(),
        200
    );

    // A dropped connection is a transport error and is logged with status 0.
    server.fail_next(1, Failure::Disconnect);
    assert!(
        client
            .get(format!("{}{NODE}", server.url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .is_err()
    );
    assert_eq!(server.requests().last().unwrap().status, 0);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);

    server.fail_next(1, Failure::Delay(Duration::from_millis(300)));
    let started = std::time::Instant::now();
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(300));

    server.fail_next(5, Failure::Internal);
    server.clear_failures();
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
}

#[tokio::test]
async fn down_server_refuses_and_drops_watches() {
    let server = server().await;
    let client = client(&server);
    let mut watch = Watch::open(&client, &server, "fieldSelector=metadata.name%3Dgpu-1").await;
    assert_eq!(watch.next(Duration::from_secs(5)).await.unwrap()["type"], "ADDED");

    server.set_down(true);
    assert!(server.is_down());
    assert!(watch.next(Duration::from_secs(5)).await.is_none(), "the watch is cut");
    let before = server.requests().len();
    for _ in 0..3 {
        let err = client
            .get(format!("{}{NODE}", server.url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap_err();
        assert!(err.is_connect() || err.is_request(), "{err:?}");
    }
    assert_eq!(server.requests().len(), before, "nothing reaches the handler");

    server.set_down(false);
    assert_eq!(get(&client, &server, NODE).await.status(), 200);

    // Down and up again at once still cuts what was open.
    let mut watch = Watch::open(&client, &server, "fieldSelector=metadata.name%3Dgpu-1").await;
    assert_eq!(watch.next(Duration::from_secs(5)).await.unwrap()["type"], "ADDED");
    server.set_down(true);
    server.set_down(false);
    assert!(watch.next(Duration::from_secs(5)).await.is_none());
    assert_eq!(get(&client, &server, NODE).await.status(), 200);
}

fn yaml(path: &Path) -> Value {
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).expect("kubeconfig is YAML")
}

fn unb64(v: &Value) -> String {
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test]
async fn kubeconfig_variants() {
    let server = server().await;
    let dir = tempfile::tempdir().unwrap();

    let path = server.write_kubeconfig(dir.path(), KubeconfigAuth::Token("t1".into()));
    assert_eq!(path, dir.path().join("kubeconfig"));
    let kc = yaml(&path);
    assert_eq!(
        (kc["apiVersion"].as_str(), kc["kind"].as_str()),
        (Some("v1"), Some("Config"))
    );
    assert_eq!(kc["current-context"], "test");
    let cluster = &kc["clusters"][0]["cluster"];
    assert_eq!(cluster["server"], server.url());
    assert_eq!(unb64(&cluster["certificate-authority-data"]), server.ca_pem());
    assert_eq!(
        kc["contexts"][0]["context"],
        json!({"cluster": "test-apiserver", "user": "test-user"})
    );
    assert_eq!(kc["users"][0], json!({"name": "test-user", "user": {"token": "t1"}}));

    let kc = yaml(&server.write_kubeconfig(dir.path(), KubeconfigAuth::TokenFile("tok".into())));
    assert_eq!(kc["users"][0]["user"], json!({"tokenFile": "tok"}));

    let (cert, key) = server.issue_client_cert("u", &[]);
    let auth = KubeconfigAuth::ClientCert {
        cert_pem: cert.clone(),
        key_pem: key.clone(),
        inline: true,
    };
    let kc = yaml(&server.write_kubeconfig(dir.path(), auth));
    assert_eq!(unb64(&kc["users"][0]["user"]["client-certificate-data"]), cert);
    assert_eq!(unb64(&kc["users"][0]["user"]["client-key-data"]), key);

    let sub = dir.path().join("files");
    let auth = KubeconfigAuth::ClientCert {
        cert_pem: cert.clone(),
        key_pem: key.clone(),
        inline: false,
    };
    let options = KubeconfigOptions {
        ca_file: true,
        namespace: Some("gpu".into()),
        ..KubeconfigOptions::default()
    };
    let kc = yaml(&server.write_kubeconfig_with(&sub, auth, &options));
    assert_eq!(
        kc["users"][0]["user"],
        json!({"client-certificate": "client.crt", "client-key": "client.key"})
    );
    assert_eq!(std::fs::read_to_string(sub.join("client.crt")).unwrap(), cert);
    assert_eq!(std::fs::read_to_string(sub.join("client.key")).unwrap(), key);
    assert_eq!(kc["clusters"][0]["cluster"]["certificate-authority"], "ca.crt");
    assert_eq!(std::fs::read_to_string(sub.join("ca.crt")).unwrap(), server.ca_pem());
    assert_eq!(kc["contexts"][0]["context"]["namespace"], "gpu");

    let auth = KubeconfigAuth::Exec {
        command: "/x/plugin".into(),
        args: vec!["--a".into(), "b c".into()],
        api_version: "client.authentication.k8s.io/v1".into(),
    };
    let kc = yaml(&server.write_kubeconfig(dir.path(), auth));
    assert_eq!(
        kc["users"][0]["user"]["exec"],
        json!({"apiVersion": "client.authentication.k8s.io/v1", "command": "/x/plugin", "args": ["--a", "b c"],
            "interactiveMode": "Never", "provideClusterInfo": false})
    );
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SSZ`.
fn epoch_of(ts: &str) -> i64 {
    assert_eq!((ts.len(), &ts[10..11], &ts[19..]), (20, "T", "Z"), "{ts}");
    let n = |r: std::ops::Range<usize>| ts[r].parse::<i64>().unwrap();
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    days * 86_400 + n(11..13) * 3600 + n(14..16) * 60 + n(17..19)
}

fn run_plugin(path: &Path, info: &str) -> std::process::Output {
    std::process::Command::new(path)
        .env("KUBERNETES_EXEC_INFO", info)
        .output()
        .expect("run plugin")
}

#[tokio::test]
async fn exec_plugin_prints_credentials_and_counts_calls() {
    let server = server().await;
    let dir = tempfile::tempdir().unwrap();
    let plugin = server.write_exec_plugin(
        dir.path(),
        "exec-token-1",
        Some(Duration::from_secs(600)),
        "client.authentication.k8s.io/v1",
    );
    assert_eq!(server.exec_calls(dir.path()), 0);

    let info =
        r#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"interactive":false}}"#;
    let out = run_plugin(&plugin, info);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cred: Value = serde_json::from_slice(&out.stdout).expect("ExecCredential JSON");
    assert_eq!(cred["apiVersion"], "client.authentication.k8s.io/v1");
    assert_eq!(cred["kind"], "ExecCredential");
    assert_eq!(cred["status"]["token"], "exec-token-1");
    let exp = cred["status"]["expirationTimestamp"].as_str().unwrap();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let in_secs = epoch_of(exp) - now;
    assert!((595..=605).contains(&in_secs), "{exp} is {in_secs}s from now");
    assert_eq!(server.exec_calls(dir.path()), 1);
    assert_eq!(server.exec_call_infos(dir.path()), [info]);

    server.set_exec_token(dir.path(), "exec-token-2");
    let cred: Value = serde_json::from_slice(&run_plugin(&plugin, "").stdout).unwrap();
    assert_eq!(cred["status"]["token"], "exec-token-2");

    server.set_exec_failing(dir.path(), true);
    let out = run_plugin(&plugin, "");
    assert!(!out.status.success());
    server.set_exec_failing(dir.path(), false);
    assert_eq!(server.exec_calls(dir.path()), 3);

    let plugin = server.write_exec_plugin(dir.path(), "t", None, "client.authentication.k8s.io/v1beta1");
    let cred: Value = serde_json::from_slice(&run_plugin(&plugin, "").stdout).unwrap();
    assert_eq!(
        cred,
        json!({"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential", "status": {"token": "t"}})
    );
}
