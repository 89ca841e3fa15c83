//! The pod-resources API of the stand-in, called like a monitoring agent calls the kubelet's.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use common::{FakePlugin, RESOURCE, two_gpus};
use test_kubelet::api::DevicePluginOptions;
use test_kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use test_kubelet::podresources::{AllocatableResourcesRequest, GetPodResourcesRequest, ListPodResourcesRequest};
use test_kubelet::{KubeletOptions, PodContainer, TestKubelet, unix_channel};
use tonic::Code;

const T: Duration = Duration::from_secs(5);

/// (namespace, pod, container, resource, device IDs) of every device entry in a List answer.
fn flatten(pods: &[test_kubelet::podresources::PodResources]) -> Vec<(String, String, String, String, Vec<String>)> {
    let mut out = Vec::new();
    for p in pods {
        for c in &p.containers {
            for d in &c.devices {
                out.push((
                    p.namespace.clone(),
                    p.name.clone(),
                    c.name.clone(),
                    d.resource_name.clone(),
                    d.device_ids.clone(),
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_reports_the_allocations_for_the_named_pods() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(&dir.path().join("device-plugins"), KubeletOptions::default())
        .await
        .unwrap();
    let socket = kubelet.serve_pod_resources(dir.path()).unwrap();
    assert_eq!(socket, dir.path().join("pod-resources/kubelet.sock"));
    assert!(std::fs::metadata(&socket).unwrap().file_type().is_socket());
    let mode = std::fs::metadata(dir.path().join("pod-resources"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o027, 0, "pod-resources dir mode {mode:o}");
    assert_eq!(kubelet.pod_resources_socket(), Some(socket.clone()));

    let options = DevicePluginOptions::default();
    let plugin = FakePlugin::serve(&kubelet.dir().join("gpu.sock"), options, two_gpus()).await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();

    let trainer = PodContainer::new("ml", "trainer-0", "worker");
    kubelet.allocate_for(RESOURCE, &["GPU-1"], &trainer).await.unwrap();
    // A failed Allocate holds nothing.
    let err = kubelet
        .allocate_for(RESOURCE, &["GPU-9"], &PodContainer::new("ml", "bad", "x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    kubelet.allocate(RESOURCE, &["GPU-0"]).await.unwrap();
    kubelet.assign(
        "nvidia.com/mig-1g.10gb",
        &["MIG-aaaa"],
        &PodContainer::new("infer", "server", "main"),
    );

    let mut client = PodResourcesListerClient::new(unix_channel(&socket).await.unwrap());
    let listed = client.list(ListPodResourcesRequest {}).await.unwrap().into_inner();
    let s = |v: &str| v.to_string();
    assert_eq!(
        flatten(&listed.pod_resources),
        vec![
            (s("default"), s("test-pod-1"), s("main"), s(RESOURCE), vec![s("GPU-0")]),
            (
                s("infer"),
                s("server"),
                s("main"),
                s("nvidia.com/mig-1g.10gb"),
                vec![s("MIG-aaaa")]
            ),
            (s("ml"), s("trainer-0"), s("worker"), s(RESOURCE), vec![s("GPU-1")]),
        ]
    );
    assert_eq!(listed.pod_resources, kubelet.pod_resources());

    let one = client
        .get(GetPodResourcesRequest {
            pod_name: "trainer-0".into(),
            pod_namespace: "ml".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(one.pod_resources.map(|p| p.containers.len()), Some(1));
    let missing = client
        .get(GetPodResourcesRequest {
            pod_name: "nope".into(),
            pod_namespace: "ml".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    let allocatable = client
        .get_allocatable_resources(AllocatableResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<(String, Vec<String>, Option<i64>)> = allocatable
        .devices
        .iter()
        .map(|d| {
            (
                d.resource_name.clone(),
                d.device_ids.clone(),
                d.topology.as_ref().and_then(|t| t.nodes.first()).map(|n| n.id),
            )
        })
        .collect();
    assert_eq!(
        ids,
        vec![
            (s(RESOURCE), vec![s("GPU-0")], Some(0)),
            (s(RESOURCE), vec![s("GPU-1")], Some(1)),
        ]
    );

    // The pod ends: its devices are no longer reported.
    kubelet.release("ml", "trainer-0");
    let listed = client.list(ListPodResourcesRequest {}).await.unwrap().into_inner();
    assert_eq!(listed.pod_resources.len(), 2);

    kubelet.stop().await;
    assert!(!socket.exists(), "stop removes the pod-resources socket");
}
