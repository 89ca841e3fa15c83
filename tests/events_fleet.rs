//! Events at fleet scale: the agent's Event task against the test API server. Repeats of a
//! reason become one Event object whose `count` the repeats raise (client-go's correlator), not
//! one object each; a 429's `Retry-After` is honoured and the count survives it.

use std::time::Duration;

use gpu_node_agent::cluster::events::{self, EventRequest, Policy};
use gpu_node_agent::config::KubernetesConfig;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::backoff::Backoff;
use gpu_node_agent::kube::{EventType, FoundBy, KubeClient, NodeView, SyncMode, load_kubeconfig};
use serde_json::Value;
use test_apiserver::{Failure, KubeconfigAuth, TestApiServer};
use tokio::sync::{mpsc, watch};

const NODE: &str = "gpu-1";
const TOKEN: &str = "events-fleet-token";
/// Generous: these waits end as soon as the server has what the test waits for.
const T: Duration = Duration::from_secs(20);

/// The test API server with the node, and a client of it.
async fn setup(dir: &tempfile::TempDir) -> (TestApiServer, KubeClient) {
    let api = TestApiServer::start().await;
    api.add_token(TOKEN, &format!("system:node:{NODE}"));
    api.create_node(NODE, &[]);
    let kubeconfig = api.write_kubeconfig(dir.path(), KubeconfigAuth::Token(TOKEN.into()));
    let credentials = load_kubeconfig(&kubeconfig, FoundBy::Config, &HostRoot::new("/")).expect("kubeconfig");
    let client = KubeClient::new(credentials, &KubernetesConfig::default()).expect("client");
    (api, client)
}

/// Starts the Event task with `policy` and a backoff of 10 ms to 20 s; returns where to ask for
/// Events (the task ends when it is dropped).
fn start(client: KubeClient, policy: Policy) -> mpsc::UnboundedSender<EventRequest> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (node_tx, node_rx) = watch::channel(NodeView {
        node: None,
        connected: true,
        error: None,
        mode: SyncMode::Watch,
    });
    let backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(20));
    tokio::spawn(async move {
        events::run(client, NODE.into(), node_rx, rx, policy, backoff).await;
        drop(node_tx);
    });
    tx
}

/// The kubelet's limits with the time scale shrunk: after a burst of three, a patch per object
/// every 20 ms instead of a minute; a write per node every 20 ms instead of 5 minutes after the
/// burst of 25; an Event object per reason for an hour instead of 10 minutes.
fn shrunk() -> Policy {
    Policy {
        window: Duration::from_secs(3600),
        burst: 25,
        refill: Duration::from_millis(20),
        patch_interval: Duration::from_millis(20),
        patch_burst: 3,
        max_keys: 64,
    }
}

fn events_with(api: &TestApiServer, reason: &str) -> Vec<Value> {
    api.events().into_iter().filter(|e| e["reason"] == reason).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_repeats_are_one_event_object_counting_fifty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (api, client) = setup(&dir).await;
    let tx = start(client, shrunk());
    for i in 1..=50 {
        tx.send((
            EventType::Warning,
            "DriverFailed".into(),
            format!("attempt {i}: modprobe nvidia failed"),
        ))
        .expect("the task runs");
    }
    let counted = api
        .wait_for(T, |a| events_with(a, "DriverFailed").iter().any(|e| e["count"] == 50))
        .await;
    assert!(counted, "{:?}", api.events());
    let events = events_with(&api, "DriverFailed");
    assert_eq!(events.len(), 1, "one object, not one per repeat: {events:?}");
    let event = &events[0];
    assert_eq!(
        event["message"], "attempt 50: modprobe nvidia failed",
        "the latest message"
    );
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["name"], NODE);
    assert!(
        event["lastTimestamp"].as_str() >= event["firstTimestamp"].as_str(),
        "{event}"
    );
    // Another reason is an object of its own, posted at once.
    tx.send((EventType::Normal, "DriverInstalled".into(), "driver installed".into()))
        .expect("the task runs");
    // (The request log is written just after the object is stored: wait for both.)
    let posted = api
        .wait_for(T, |a| {
            events_with(a, "DriverInstalled").len() == 1 && a.count("POST", "/api/v1/namespaces/default/events") == 2
        })
        .await;
    assert!(
        posted,
        "two POSTs, one per reason: {:?}\n{:?}",
        api.events(),
        api.requests()
    );
    assert_eq!(events_with(&api, "DriverFailed")[0]["count"], 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_retried_after_its_retry_after_and_the_count_survives() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (api, client) = setup(&dir).await;
    let tx = start(client, shrunk());
    tx.send((EventType::Warning, "MigConfigFailed".into(), "first".into()))
        .expect("the task runs");
    let posted = api.wait_for(T, |a| events_with(a, "MigConfigFailed").len() == 1).await;
    assert!(posted, "{:?}", api.events());
    let name = events_with(&api, "MigConfigFailed")[0]["metadata"]["name"]
        .as_str()
        .expect("a name")
        .to_owned();

    api.fail_next_matching(1, "patch", "events", Failure::TooManyRequests { retry_after_secs: 1 });
    tx.send((EventType::Warning, "MigConfigFailed".into(), "second".into()))
        .expect("the task runs");
    tx.send((EventType::Warning, "MigConfigFailed".into(), "third".into()))
        .expect("the task runs");
    let counted = api
        .wait_for(T, |a| {
            events_with(a, "MigConfigFailed")
                .iter()
                .any(|e| e["count"] == 3 && e["message"] == "third")
                && a.requests().iter().any(|r| r.method == "PATCH" && r.status == 200)
        })
        .await;
    assert!(counted, "{:?}\n{:?}", api.events(), api.requests());
    assert_eq!(events_with(&api, "MigConfigFailed").len(), 1, "{:?}", api.events());

    let path = format!("/api/v1/namespaces/default/events/{name}");
    let patches: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH" && r.path == path)
        .collect();
    assert_eq!(patches[0].status, 429, "{patches:?}");
    let retry = patches
        .iter()
        .find(|r| r.status == 200)
        .expect("the retry went through");
    // The backoff alone would have tried again after 10 ms: the server's Retry-After won.
    assert!(
        retry.at.duration_since(patches[0].at) >= Duration::from_secs(1),
        "retried {:?} after the 429",
        retry.at.duration_since(patches[0].at)
    );
    assert_eq!(
        patches.iter().filter(|r| r.status == 429).count(),
        1,
        "no tight retries: {patches:?}"
    );
}
