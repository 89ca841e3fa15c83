//! grpc-go clients of the stand-in (NVIDIA's device plugin, GPU Feature Discovery, DCGM
//! exporter): what they send, byte for byte as grpc-go frames and HPACK-codes it, must be
//! accepted as the kubelet accepts it, and must meet the same checks as any other client.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{FakePlugin, RESOURCE, two_gpus};
use test_kubelet::api::{self, DevicePluginOptions};
use test_kubelet::grpcgo::{GrpcGoConn, GrpcGoVersion, NVIDIA_PLUGIN_USER_AGENT, bare_path_authority};
use test_kubelet::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
};
use test_kubelet::{KubeletOptions, PodContainer, TestKubelet, validate};
use tonic::Code;

const T: Duration = Duration::from_secs(5);
const REGISTER: &str = "/v1beta1.Registration/Register";

fn register_request(endpoint: &str, version: &str) -> api::RegisterRequest {
    api::RegisterRequest {
        version: version.into(),
        endpoint: endpoint.into(),
        resource_name: RESOURCE.into(),
        options: Some(DevicePluginOptions {
            get_preferred_allocation_available: true,
            ..Default::default()
        }),
    }
}

/// The `:authority` values a grpc-go client sends for a socket dialled by `socket`: the bare
/// path (NVIDIA's plugin) with grpc-go 1.57+ and before, and `unix://` targets (`localhost`).
fn authorities(socket: &Path) -> [String; 3] {
    [
        bare_path_authority(socket, GrpcGoVersion::Since1_57),
        bare_path_authority(socket, GrpcGoVersion::Before1_57),
        "localhost".to_string(),
    ]
}

/// NVIDIA's device plugin registers as grpc-go 1.63 sends it: `grpc.DialContext` of the bare
/// path of `kubelet.sock`, so `:authority` is the percent-encoded path. On stock h2 (and with
/// the `vendor/h2` patch before it covered this form) this failed with `stream terminated by
/// RST_STREAM with error code: PROTOCOL_ERROR`, as on the H200; the real kubelet accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_plugin_registers_with_the_authority_it_derives_from_the_socket_path() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let options = DevicePluginOptions {
        get_preferred_allocation_available: true,
        ..Default::default()
    };
    let plugin = FakePlugin::serve(&dir.path().join("nvidia-gpu.sock"), options, two_gpus()).await;
    let socket = kubelet.socket_path();
    let encoded = bare_path_authority(&socket, GrpcGoVersion::Since1_57);
    assert!(encoded.starts_with("%2F"), "{encoded}");

    let mut conn = GrpcGoConn::connect(&socket, &encoded, NVIDIA_PLUGIN_USER_AGENT)
        .await
        .unwrap();
    let _: api::Empty = conn
        .unary(REGISTER, &register_request("nvidia-gpu.sock", "v1beta1"))
        .await
        .expect("Register as NVIDIA's device plugin sends it");
    let rec = kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    assert!(rec.is_accepted(), "{rec:?}");
    assert_eq!(rec.endpoint, "nvidia-gpu.sock");
    assert_eq!(rec.plugin_options, Some(options));
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
    let resp = kubelet.allocate(RESOURCE, &["GPU-1"]).await.unwrap();
    assert_eq!(resp.envs["VISIBLE_DEVICES"], "GPU-1");

    // A second call on the same connection is coded against HPACK's dynamic table (all
    // its headers are indexed), as grpc-go codes every call after the first.
    let _: api::Empty = conn
        .unary(REGISTER, &register_request("nvidia-gpu.sock", "v1beta1"))
        .await
        .expect("a second Register on the same connection");
    kubelet.wait_for_registration(RESOURCE, T).await.unwrap();

    // The other forms grpc-go sends: the raw path (before 1.57), localhost (unix:// targets).
    for authority in &authorities(&socket)[1..] {
        let mut conn = GrpcGoConn::connect(&socket, authority, NVIDIA_PLUGIN_USER_AGENT)
            .await
            .unwrap();
        let _: api::Empty = conn
            .unary(REGISTER, &register_request("nvidia-gpu.sock", "v1beta1"))
            .await
            .unwrap_or_else(|s| panic!("Register with :authority {authority:?}: {s:?}"));
        kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    }
    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());
    drop(plugin);
}

/// The stand-in's checks of a RegisterRequest still apply to grpc-go clients, with the
/// kubelet's messages and code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_registrations_meet_the_kubelets_checks() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let socket = kubelet.socket_path();
    let encoded = bare_path_authority(&socket, GrpcGoVersion::Since1_57);
    let mut conn = GrpcGoConn::connect(&socket, &encoded, NVIDIA_PLUGIN_USER_AGENT)
        .await
        .unwrap();

    let err = conn
        .unary::<_, api::Empty>(REGISTER, &register_request("nvidia-gpu.sock", "v1alpha"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unknown, "{err:?}");
    assert_eq!(Err(err.message().to_string()), validate::check_version("v1alpha"));

    // Nothing serves the endpoint: the dial-back fails inside Register.
    let err = conn
        .unary::<_, api::Empty>(REGISTER, &register_request("nvidia-gpu.sock", "v1beta1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unknown, "{err:?}");
    assert!(
        err.message()
            .starts_with("failed to dial device plugin: dial-back failed:"),
        "{}",
        err.message()
    );
    let recs = kubelet.registrations();
    assert_eq!(recs.len(), 2);
    assert!(recs.iter().all(|r| !r.is_accepted()), "{recs:?}");
}

/// A monitoring agent on grpc-go (DCGM exporter) reads the pod-resources socket, dialled by
/// path, with several calls on one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_pod_resources_client_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(&dir.path().join("device-plugins"), KubeletOptions::default())
        .await
        .unwrap();
    let socket = kubelet.serve_pod_resources(dir.path()).unwrap();
    let plugin = FakePlugin::serve(
        &kubelet.dir().join("gpu.sock"),
        DevicePluginOptions::default(),
        two_gpus(),
    )
    .await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
    kubelet
        .allocate_for(RESOURCE, &["GPU-0"], &PodContainer::new("ml", "trainer", "worker"))
        .await
        .unwrap();

    for authority in authorities(&socket) {
        let mut conn = GrpcGoConn::connect(&socket, &authority, "grpc-go/1.72.0")
            .await
            .unwrap();
        for _ in 0..2 {
            let list: ListPodResourcesResponse = conn
                .unary("/v1.PodResourcesLister/List", &ListPodResourcesRequest {})
                .await
                .unwrap_or_else(|s| panic!("List with :authority {authority:?}: {s:?}"));
            assert_eq!(list.pod_resources.len(), 1);
            assert_eq!(list.pod_resources[0].name, "trainer");
            let alloc: AllocatableResourcesResponse = conn
                .unary(
                    "/v1.PodResourcesLister/GetAllocatableResources",
                    &AllocatableResourcesRequest {},
                )
                .await
                .unwrap();
            let ids: Vec<&str> = alloc
                .devices
                .iter()
                .flat_map(|d| d.device_ids.iter().map(String::as_str))
                .collect();
            assert_eq!(ids, ["GPU-0", "GPU-1"]);
        }
    }
}

/// The guarantee behind every test above: a tonic server in this workspace (h2 patched in
/// `vendor/h2` to treat an `:authority` that is not a URI authority as absent) answers all
/// three forms grpc-go sends to a socket, as grpc-go servers do: the path (before 1.57), the
/// percent-encoded path (1.57 and later, which stock h2 and the earlier patch for paths
/// starting with `/` reset with PROTOCOL_ERROR) and `localhost`. The stand-in's servers and the
/// agent's (device plugin, DRA registration and DRA service sockets) are such servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_tonic_accepts_every_authority_grpc_go_sends() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("plugin.sock");
    let options = DevicePluginOptions {
        pre_start_required: true,
        ..Default::default()
    };
    let _plugin = FakePlugin::serve(&socket, options, two_gpus()).await;
    let path = "/v1beta1.DevicePlugin/GetDevicePluginOptions";
    for authority in authorities(&socket) {
        let mut conn = GrpcGoConn::connect(&socket, &authority, NVIDIA_PLUGIN_USER_AGENT)
            .await
            .unwrap();
        // Twice: the second call's :authority is a dynamic-table reference.
        for _ in 0..2 {
            let got = conn.unary::<_, DevicePluginOptions>(path, &api::Empty {}).await;
            assert_eq!(got.unwrap_or_else(|s| panic!("{authority}: {s:?}")), options);
        }
    }
}
