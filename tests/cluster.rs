//! The agent and its Node: desired state from labels (watch, poll, labels file), state and GPU
//! feature labels and Events written back, through the real binary, the test API server, the
//! fake NVML and the test kubelet.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Node, machine};
use gpu_node_agent::desired::{ProfileState, Source};
use test_apiserver::{Failure, KubeconfigAuth, KubeconfigOptions, Options, TestApiServer};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(15);
const NODE: &str = "gpu-node-1";
const TOKEN: &str = "agent-token-0123456789";
const GPU: &str = "nvidia.com/gpu";
const PROFILES: &str = "[device_plugin.profiles.mig-mixed]\nmig_strategy = \"mixed\"\n";

/// An API server with this node's Node object (and a label someone else owns) and a token.
async fn apiserver() -> TestApiServer {
    let api = TestApiServer::start().await;
    api.create_node(NODE, &[("team", "ml"), ("kubernetes.io/hostname", NODE)]);
    api.add_token(TOKEN, "system:serviceaccount:gpu:agent");
    api
}

/// Writes the kubelet kubeconfig where a kubeadm node has it, with `auth`.
fn install(node: &Node, api: &TestApiServer, auth: KubeconfigAuth) -> PathBuf {
    let options = KubeconfigOptions {
        file_name: "kubelet.conf".into(),
        ..KubeconfigOptions::default()
    };
    api.write_kubeconfig_with(&node.kubeconfig_dir(), auth, &options)
}

async fn kubelet(node: &Node) -> TestKubelet {
    TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("test kubelet")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_feature_labels_appear_on_the_node_and_others_are_left_alone() {
    let api = apiserver().await;
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "");
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    let labels = api.labels(NODE);
    for (k, v) in [
        ("nvidia.com/gpu.count", "2"),
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
        ("nvidia.com/gpu.memory", "40960"),
        ("nvidia.com/gpu.family", "ampere"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "0"),
        ("nvidia.com/cuda.driver-version.full", "550.54.15"),
        ("nvidia.com/cuda.driver-version.major", "550"),
        ("nvidia.com/cuda.runtime-version.full", "12.4"),
        ("nvidia.com/mig.capable", "true"),
        ("nvidia.com/gpu.replicas", "1"),
        ("nvidia.com/gpu.sharing-strategy", "none"),
        ("team", "ml"),
    ] {
        assert_eq!(labels.get(k).map(String::as_str), Some(v), "{k} in {labels:?}");
    }
    assert!(
        !labels.contains_key("nvidia.com/mig.strategy"),
        "no mig.strategy label with strategy none"
    );
    // The writes were merge patches by the agent's identity (the log entry follows the answer).
    assert!(api.wait_for(T, |a| a.count("PATCH", "/api/v1/nodes/") > 0).await);
    let patches: Vec<_> = api.requests().into_iter().filter(|r| r.method == "PATCH").collect();
    assert!(!patches.is_empty());
    assert!(
        patches
            .iter()
            .all(|r| r.content_type.as_deref() == Some("application/merge-patch+json"))
    );
    assert!(
        patches
            .iter()
            .all(|r| r.user.as_deref() == Some("system:serviceaccount:gpu:agent"))
    );
    // The status shows where the desired state comes from and what was reported.
    let status = node.wait_status(T, |s| common::desired_is(s, |d| d.connected));
    assert_eq!(common::desired(&status).source, Source::Node);
    assert_eq!(common::label(&status, "nvidia.com/gpu.count"), Some("2"));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_change_reaches_the_agent_by_watch_and_swaps_resources() {
    let api = apiserver().await;
    let node = Node::new(common::H100_MIG, PROFILES);
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("whole GPUs first");
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    assert!(
        api.wait_for(T, |a| a.open_watches() > 0).await,
        "the agent watches its Node"
    );

    let changed = Instant::now();
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("mig-mixed"));
    let reg = kubelet
        .wait_for_registration("nvidia.com/mig-1g.10gb", T)
        .await
        .expect("MIG resources registered");
    let took = reg.at.duration_since(changed);
    assert!(took < Duration::from_secs(1), "label → reaction took {took:?}");
    kubelet
        .wait_for_devices("nvidia.com/mig-3g.40gb", T, |d| d.len() == 1)
        .await
        .expect("3g device");
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", Some("success"), T).await;
    common::wait_label(&api, "nvidia.com/mig.strategy", Some("mixed"), T).await;
    common::wait_label(&api, "nvidia.com/mig-1g.10gb.count", Some("2"), T).await;
    // Swapped in place: the whole-GPU resource went away, the process did not restart.
    kubelet
        .wait_for_disconnect(GPU, T)
        .await
        .expect("nvidia.com/gpu withdrawn");
    let event = common::event_posted(&api, "DevicePluginProfileApplied").await;
    common::assert_event(&event, "Normal", &["device plugin profile mig-mixed applied"]);

    // Removing the label returns to the configured keys.
    api.set_label(NODE, "nvidia.com/device-plugin.config", None);
    kubelet.wait_for_registration(GPU, T).await.expect("whole GPUs again");
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", None, T).await;
    common::wait_label(&api, "nvidia.com/mig.strategy", None, T).await;
    let event = common::event_posted(&api, "DevicePluginProfileCleared").await;
    common::assert_event(&event, "Normal", &["no device plugin profile selected"]);
    // A pass without a change posts neither again.
    common::another_pass(&agent).await;
    for reason in ["DevicePluginProfileApplied", "DevicePluginProfileCleared"] {
        assert_eq!(common::events_with(&api, reason).len(), 1, "{:?}", api.events());
    }
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_profile_changes_nothing_and_is_reported() {
    let api = apiserver().await;
    let node = Node::new(&machine("T4", 1), PROFILES);
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("devices");
    let registrations = kubelet.registrations().len();
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("no-such-profile"));
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", Some("failed"), T).await;
    let ok = api
        .wait_for(T, |a| {
            a.events().iter().any(|e| e["reason"] == "DevicePluginProfileRejected")
        })
        .await;
    assert!(ok, "a Warning Event says why: {:?}", api.events());
    let event = api
        .events()
        .into_iter()
        .find(|e| e["reason"] == "DevicePluginProfileRejected")
        .expect("event");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["kind"], "Node");
    assert_eq!(event["involvedObject"]["name"], NODE);
    let message = event["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("no-such-profile") && message.contains("mig-mixed"),
        "{message}"
    );
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.state == ProfileState::Failed)
    });
    assert!(
        common::desired(&status)
            .profile
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("nothing changed")
    );
    // Rejected once: a pass with the same label posts nothing more.
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "DevicePluginProfileRejected").len(),
        1,
        "{:?}",
        api.events()
    );
    // Nothing changed for the kubelet.
    assert_eq!(kubelet.registrations().len(), registrations);
    assert!(kubelet.is_connected(GPU));
    assert_eq!(kubelet.resources(), vec![GPU.to_string()]);
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_watch_a_label_change_arrives_within_the_poll_interval() {
    let api = apiserver().await;
    let config = format!("[kubernetes]\nwatch = false\npoll_interval = \"500ms\"\n{PROFILES}");
    let node = Node::new(common::H100_MIG, &config);
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("devices");
    let changed = Instant::now();
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("mig-mixed"));
    let reg = kubelet
        .wait_for_registration("nvidia.com/mig-1g.10gb", T)
        .await
        .expect("reaction");
    let took = reg.at.duration_since(changed);
    assert!(
        took < Duration::from_millis(1500),
        "poll reaction took {took:?} with a 500ms interval"
    );
    let requests = api.requests();
    assert!(
        requests.iter().all(|r| !r.watch),
        "no watch requests with watch = false"
    );
    let gets: Vec<_> = requests
        .iter()
        .filter(|r| r.method == "GET" && r.path == format!("/api/v1/nodes/{NODE}"))
        .collect();
    assert!(gets.len() >= 2);
    assert!(
        gets.iter()
            .all(|r| r.query_param("resourceVersion").as_deref() == Some("0")),
        "polls read from the cache"
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_down_keeps_the_device_plugin_serving_and_the_agent_catches_up() {
    let api = apiserver().await;
    let config = format!(
        "[kubernetes]\nbackoff_min = \"100ms\"\nbackoff_max = \"500ms\"\npoll_interval = \"500ms\"\n{PROFILES}"
    );
    let node = Node::new(common::H100_MIG, &config);
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("devices");
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    node.wait_status(T, |s| common::desired_is(s, |d| d.connected) && !s.gpus.is_empty());

    api.set_down(true);
    let status = node.wait_status(T, |s| common::desired_is(s, |d| !d.connected));
    assert!(common::desired_error(&status).is_some(), "{status:?}");
    // The device plugin does not depend on the API server.
    let resp = kubelet
        .allocate(GPU, &[status.gpus.first().map(|g| g.uuid.as_str()).unwrap_or_default()])
        .await;
    assert!(resp.is_ok(), "Allocate while the API server is down: {resp:?}");
    // A change made while the agent cannot see it...
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("mig-mixed"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!kubelet.resources().contains(&"nvidia.com/mig-1g.10gb".to_string()));
    // ...is applied when the API server is back.
    api.set_down(false);
    kubelet
        .wait_for_registration("nvidia.com/mig-1g.10gb", T)
        .await
        .expect("caught up");
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", Some("success"), T).await;
    node.wait_status(T, |s| common::desired_is(s, |d| d.connected));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_requests_is_retried_after_retry_after() {
    let api = apiserver().await;
    // A short reconnect window: the wait measured is the Retry-After's, not the spread's.
    let node = Node::new(
        &machine("T4", 1),
        "[kubernetes]\nbackoff_min = \"100ms\"\nreconnect_jitter = \"200ms\"\n",
    );
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    api.fail_next(1, Failure::TooManyRequests { retry_after_secs: 2 });
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    let requests = api.requests();
    let throttled = requests.iter().position(|r| r.status == 429).expect("a 429 was served");
    let next = &requests[throttled + 1..];
    let next = next.first().expect("a request after the 429");
    let waited = next.at.duration_since(requests[throttled].at);
    assert!(
        waited >= Duration::from_millis(1900),
        "Retry-After: 2 honoured, waited {waited:?}"
    );
    assert_eq!(agent.stop(), 0);
}

/// A 429 on the label write holds further writes for its Retry-After even while the Node keeps
/// changing under the agent (each change wakes the label writer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_write_throttled_by_429_waits_out_retry_after_whatever_changes_meanwhile() {
    let api = apiserver().await;
    let node = Node::new(&machine("T4", 1), "[kubernetes]\nbackoff_min = \"100ms\"\n");
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    api.fail_next_matching(1, "patch", "nodes", Failure::TooManyRequests { retry_after_secs: 2 });
    let agent = node.spawn();
    assert!(
        api.wait_for(T, |a| a.requests().iter().any(|r| r.status == 429)).await,
        "the label write was throttled"
    );
    // Someone else annotates the Node five times within the Retry-After: each change reaches the
    // agent's view and wakes its label writer.
    for i in 0..5 {
        api.set_annotation(NODE, "example.com/touched", Some(&i.to_string()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    // The label is in the store a moment before the request that wrote it is in the log.
    assert!(
        api.wait_for(T, |a| a
            .requests()
            .iter()
            .any(|r| r.method == "PATCH" && r.status == 200))
            .await,
        "the write went through"
    );
    let requests = api.requests();
    let throttled = requests.iter().position(|r| r.status == 429).expect("a 429 was served");
    let next = requests[throttled + 1..]
        .iter()
        .find(|r| r.method == "PATCH")
        .expect("the write was sent again");
    let waited = next.at.duration_since(requests[throttled].at);
    assert!(
        waited >= Duration::from_millis(1900),
        "Retry-After: 2 honoured, waited {waited:?}"
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_is_a_clear_error_and_retried() {
    let api = TestApiServer::start().await;
    api.create_node(NODE, &[]);
    let node = Node::new(
        &machine("T4", 1),
        "[kubernetes]\nbackoff_min = \"100ms\"\nbackoff_max = \"300ms\"\npoll_interval = \"300ms\"\n",
    );
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let mut agent = node.spawn();
    let status = node.wait_status(T, |s| common::desired_error(s).is_some_and(|e| e.contains("401")));
    let error = common::desired_error(&status).unwrap_or_default().to_string();
    assert!(error.contains("Unauthorized"), "{error}");
    assert!(
        !error.contains(TOKEN) && !agent.log_text().contains(TOKEN),
        "the token never appears in errors or logs"
    );
    assert!(agent.running(), "a 401 is not fatal");
    // The credentials become valid (say, RBAC fixed): the agent carries on by itself.
    api.add_token(TOKEN, "system:node:gpu-node-1");
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_token_file_is_used() {
    let api = apiserver().await;
    // Watches dropped early come back within reconnect_jitter: a short one keeps the test short.
    let node = Node::new(
        &machine("T4", 1),
        &format!("[kubernetes]\nreconnect_jitter = \"200ms\"\n{PROFILES}"),
    );
    let dir = node.kubeconfig_dir();
    std::fs::write(dir.join("token"), TOKEN).expect("token file");
    install(&node, &api, KubeconfigAuth::TokenFile(PathBuf::from("token")));
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    // Rotate: the new token is written, the old one stops working.
    api.add_token("rotated-token-9876543210", "system:serviceaccount:gpu:agent");
    std::fs::write(dir.join("token.new"), "rotated-token-9876543210").expect("new token");
    std::fs::rename(dir.join("token.new"), dir.join("token")).expect("rotate");
    api.remove_token(TOKEN);
    api.drop_watches();
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("mig-mixed"));
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", Some("success"), T).await;
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("still serving");
    let after_rotation: Vec<_> = api.requests().into_iter().filter(|r| r.method == "PATCH").collect();
    assert!(after_rotation.iter().any(|r| r.status == 200));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_credential_plugin_is_run_and_cached() {
    let api = apiserver().await;
    let node = Node::new(&machine("T4", 1), "");
    let dir = node.kubeconfig_dir();
    api.write_exec_plugin(
        &dir,
        TOKEN,
        Some(Duration::from_secs(3600)),
        "client.authentication.k8s.io/v1",
    );
    install(
        &node,
        &api,
        KubeconfigAuth::Exec {
            // Relative to the kubeconfig's directory, as kubectl resolves it.
            command: PathBuf::from("./exec-plugin.sh"),
            args: vec![],
            api_version: "client.authentication.k8s.io/v1".into(),
        },
    );
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    assert!(
        api.wait_for(T, |a| a.open_watches() > 0).await,
        "the agent watches with the plugin's token"
    );
    assert!(api.requests().iter().all(|r| r.status != 401));
    assert_eq!(api.exec_calls(&dir), 1, "the credential is cached until it expires");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_file_mode_without_kubernetes() {
    let config =
        format!("[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{PROFILES}");
    let node = Node::new(common::H100_MIG, &config);
    let file = node.root.join("etc/gpu-node-agent/labels");
    std::fs::write(&file, "# desired state\n").expect("labels file");
    let kubelet = kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("whole GPUs");
    std::fs::write(&file, "nvidia.com/device-plugin.config=mig-mixed\n").expect("edit labels file");
    kubelet
        .wait_for_registration("nvidia.com/mig-2g.20gb", T)
        .await
        .expect("profile applied from the file");
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.state == ProfileState::Success)
    });
    assert_eq!(common::desired(&status).source, Source::File);
    assert_eq!(
        common::label(&status, "nvidia.com/device-plugin.config.state"),
        Some("success")
    );
    assert_eq!(common::label(&status, "nvidia.com/mig.strategy"), Some("mixed"));
    // A broken line keeps what was applied and says why.
    std::fs::write(&file, "nvidia.com/device-plugin.config\n").expect("break the file");
    let status = node.wait_status(T, |s| common::desired_error(s).is_some());
    assert!(
        common::desired_error(&status).unwrap_or_default().contains("labels:1"),
        "{status:?}"
    );
    assert!(kubelet.resources().contains(&"nvidia.com/mig-2g.20gb".to_string()));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credentials_and_no_labels_file_runs_on_the_config() {
    let node = Node::new(&machine("T4", 1), "");
    let kubelet = kubelet(&node).await;
    let mut agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("serves anyway");
    let status = node.wait_status(T, |s| common::desired_is(s, |d| d.source == Source::None));
    let detail = status.desired.as_ref().map(|d| d.detail.as_str()).unwrap_or_default();
    assert!(
        detail.contains("no Kubernetes credentials found") && detail.contains("defaults"),
        "{detail}"
    );
    assert!(agent.log_text().contains("no Kubernetes credentials found"));
    assert!(agent.running());
    assert_eq!(agent.stop(), 0);
}

/// cloud-init installs and starts the agent before `kubeadm join` writes the kubelet's
/// kubeconfig: the agent finds the credentials when they appear, and the Node's labels take
/// effect without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_that_appear_after_start_are_picked_up() {
    let api = apiserver().await;
    api.set_label(NODE, "nvidia.com/device-plugin.config", Some("shared"));
    let config = "[device_plugin.profiles.shared.sharing]\nstrategy = \"time-slicing\"\n\
                  [[device_plugin.profiles.shared.sharing.resources]]\nname = \"nvidia.com/gpu\"\nreplicas = 2\n";
    let node = Node::new(&machine("T4", 1), config);
    let kubelet = kubelet(&node).await;
    let mut agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("serves on the config's defaults");
    node.wait_status(T, |s| common::desired_is(s, |d| d.source == Source::None));

    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    // Looked for again every 10 s.
    let later = Duration::from_secs(30);
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), later).await;
    common::wait_label(&api, "nvidia.com/device-plugin.config.state", Some("success"), later).await;
    kubelet
        .wait_for_devices(GPU, later, |d| d.len() == 2)
        .await
        .expect("the Node's profile applies: 2 replicas");
    let status = node.wait_status(T, |s| common::desired_is(s, |d| d.connected));
    assert_eq!(common::desired(&status).source, Source::Node);
    assert!(agent.running(), "same process");
    assert!(agent.log_text().contains("Kubernetes credentials found"));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_owned_labels_are_removed_and_steady_state_writes_nothing() {
    let api = apiserver().await;
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nwatch_timeout = \"1s\"\n");
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    // A label under our prefix that the agent never wrote.
    api.set_label(NODE, "nvidia.com/custom", Some("keep-me"));
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.count", Some("2"), T).await;
    // Steady state: watches renew, nothing is written.
    tokio::time::sleep(Duration::from_millis(500)).await;
    api.clear_requests();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let requests = api.requests();
    assert!(
        requests.iter().all(|r| r.method == "GET"),
        "no writes at steady state: {requests:?}"
    );
    assert!(
        requests.iter().all(|r| r.watch),
        "only watch renewals at steady state: {requests:?}"
    );
    assert_eq!(agent.stop(), 0);

    // Restart with feature labels off: the agent removes what it wrote, and only that.
    node.write_config("[labels]\nreport_features = false\n");
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.count", None, T).await;
    let labels = api.labels(NODE);
    assert_eq!(labels.get("nvidia.com/custom").map(String::as_str), Some("keep-me"));
    assert_eq!(labels.get("team").map(String::as_str), Some("ml"));
    assert!(!labels.keys().any(|k| k.starts_with("nvidia.com/gpu.")), "{labels:?}");
    assert_eq!(agent.stop(), 0);
}

/// The agent's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib << 10
}

/// A Node of 64 MiB (a runaway annotation) from GET and from the watch: each is an error that
/// names the request and the 16 MiB limit, retried like any API error, and the agent's memory
/// stays far below the object's size; once the Node is normal again the agent carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_node_is_an_error_and_memory_stays_bounded() {
    const PADDING: u64 = 64 << 20;
    let api = apiserver().await;
    let node = Node::new(
        &machine("T4", 1),
        "[kubernetes]\nbackoff_min = \"100ms\"\nbackoff_max = \"200ms\"\npoll_interval = \"200ms\"\n",
    );
    install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let oversized = Failure::Oversized {
        padding: PADDING,
        declare_length: false,
    };
    // Every read of the Node for a while (the watcher's LIST by name), then the first watches.
    api.fail_next_matching(30, "list", "nodes", oversized.clone());
    api.fail_next_matching(3, "watch", "nodes", oversized);
    let agent = node.spawn();
    let status = node.wait_status(T, |s| {
        common::desired_error(s).is_some_and(|e| e.contains("over the 16 MiB limit"))
    });
    let error = common::desired_error(&status).unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "list node \"{NODE}\" (GET /api/v1/nodes?fieldSelector=metadata.name%3D{NODE}&resourceVersion=0): the API \
             server's answer is over the 16 MiB limit"
        )),
        "{error}"
    );
    // Retried until the faults are used up; then the watches get their oversized event.
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    assert!(
        api.wait_for(T, |a| a.count("GET", "/api/v1/nodes") > 33 && a.open_watches() > 0)
            .await,
        "watching after the oversized answers"
    );
    let log = agent.log_text();
    assert!(
        log.contains("a watch event line is over the 16 MiB limit"),
        "the watch's error is logged"
    );
    let served = api.requests().iter().filter(|r| r.method == "GET").count();
    assert!(served > 33, "{served} requests");
    // 33 answers of 64 MiB each: none was held whole.
    let peak = peak_rss(agent.pid());
    eprintln!("agent peak RSS after the oversized answers: {} MiB", peak >> 20);
    assert!(peak < 100 << 20, "peak RSS {} MiB", peak >> 20);
    assert_eq!(agent.stop(), 0);
}

/// An exec plugin that fails with a secret on stderr: status.json (world-readable) and the log at
/// the default level say which plugin failed and how, never what it printed; at debug level the
/// log has it, for whoever runs the agent with RUST_LOG=debug to find out why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_plugins_stderr_stays_out_of_status_and_the_default_log() {
    const SECRET: &str = "refresh-token-5ecr3t-b0d7e1";
    let api = apiserver().await;
    let node = Node::new(
        &machine("T4", 1),
        "[kubernetes]\nbackoff_min = \"100ms\"\nbackoff_max = \"300ms\"\npoll_interval = \"300ms\"\n",
    );
    let dir = node.kubeconfig_dir();
    let script = dir.join("leaky-plugin.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho \"login failed: POST https://idp.example/token?refresh={SECRET}\" >&2\nexit 1\n"),
    )
    .expect("plugin");
    install(
        &node,
        &api,
        KubeconfigAuth::Exec {
            // A bare name is looked up in PATH (an absolute one would be a host path under the
            // test's root).
            command: PathBuf::from("sh"),
            args: vec![script.display().to_string()],
            api_version: "client.authentication.k8s.io/v1".into(),
        },
    );
    // The default log level (the config's `info`), as the packaged unit runs it.
    let agent = node.spawn_with(|cmd| {
        cmd.env_remove("RUST_LOG");
    });
    let status = node.wait_status(T, |s| {
        common::desired_error(s).is_some_and(|e| e.contains("exec credential plugin"))
    });
    let status_text = std::fs::read_to_string(node.status_path()).expect("status.json");
    assert!(!status_text.contains(SECRET), "{status_text}");
    assert!(!status_text.contains("idp.example"), "{status_text}");
    let error = common::desired_error(&status).unwrap_or_default();
    assert!(
        error.contains("exec credential plugin \"sh\"") && error.contains("exited with status 1"),
        "{error}"
    );
    let log = agent.log_text();
    assert!(log.contains("exited with status 1"), "{log}");
    assert!(!log.contains(SECRET) && !log.contains("idp.example"), "{log}");
    assert_eq!(agent.stop(), 0);

    // At debug level the stderr is there.
    let agent = node.spawn();
    let ok = api.wait_for(T, |_| agent.log_text().contains(SECRET)).await;
    assert!(ok, "the plugin's stderr at debug level");
    assert_eq!(agent.stop(), 0);
}

/// A kubeconfig with a token for a plain http:// server: refused (nothing is sent) with an error
/// naming the kubeconfig and the config key; with `allow_insecure_http = true` it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_not_sent_to_a_plain_http_api_server_unless_allowed() {
    let api = TestApiServer::start_with(Options {
        plain_http: true,
        ..Options::default()
    })
    .await;
    api.create_node(NODE, &[]);
    api.add_token(TOKEN, "system:node:gpu-node-1");
    let node = Node::new(&machine("T4", 1), "");
    let kubeconfig = install(&node, &api, KubeconfigAuth::Token(TOKEN.into()));
    let agent = node.spawn();
    let status = node.wait_status(T, |s| common::desired_is(s, |d| d.source == Source::None));
    let detail = status.desired.as_ref().map(|d| d.detail.as_str()).unwrap_or_default();
    assert!(
        detail.contains(&format!(
            "kubeconfig {}: server {} is plain http://, so the bearer token would be sent in cleartext",
            kubeconfig.display(),
            api.url()
        )) && detail.contains("kubernetes.allow_insecure_http = true"),
        "{detail}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(api.requests().is_empty(), "nothing sent: {:?}", api.requests());
    assert!(!agent.log_text().contains(TOKEN));
    assert_eq!(agent.stop(), 0);

    node.write_config("[kubernetes]\nallow_insecure_http = true\n");
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    assert!(
        api.requests()
            .iter()
            .all(|r| r.user.as_deref() == Some("system:node:gpu-node-1")),
        "{:?}",
        api.requests()
    );
    let log = agent.log_text();
    assert_eq!(
        log.matches("the bearer token is sent in cleartext").count(),
        1,
        "warned once: {log}"
    );
    assert_eq!(agent.stop(), 0);
}
