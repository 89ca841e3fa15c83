//! The stand-in against a fake tonic device plugin.

mod common;

use std::os::unix::fs::FileTypeExt;
use std::time::Duration;

use common::{FakePlugin, RESOURCE, device, register, two_gpus};
use test_kubelet::api::DevicePluginOptions;
use test_kubelet::{Event, KubeletOptions, Outcome, TestKubelet};
use tonic::Code;

const T: Duration = Duration::from_secs(5);

fn opts_with_preferred() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_list_and_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let meta = std::fs::metadata(kubelet.socket_path()).unwrap();
    assert!(meta.file_type().is_socket());

    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), opts_with_preferred(), two_gpus()).await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();

    let rec = kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    assert_eq!(rec.endpoint, "gpu.sock");
    assert_eq!(rec.version, "v1beta1");
    assert_eq!(rec.outcome, Outcome::Accepted);
    assert_eq!(rec.plugin_options, Some(opts_with_preferred()));
    assert_eq!(kubelet.options(RESOURCE).await, Some(opts_with_preferred()));

    let first = kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
    assert_eq!(first, two_gpus());
    assert!(kubelet.is_connected(RESOURCE));
    assert_eq!(kubelet.resources(), vec![RESOURCE.to_string()]);

    // A health change arrives as a full new list.
    plugin.set_devices(vec![device("GPU-0", true, Some(0)), device("GPU-1", false, Some(1))]);
    let changed = kubelet
        .wait_for_devices(RESOURCE, T, |d| d.iter().any(|x| x.health == "Unhealthy"))
        .await
        .unwrap();
    assert_eq!(changed.len(), 2);
    let updates = kubelet.updates(RESOURCE);
    assert!(updates.len() >= 2);
    assert!(updates.windows(2).all(|w| w[0].0 <= w[1].0));
    assert_eq!(kubelet.devices(RESOURCE), Some(changed));

    let preferred = kubelet
        .preferred_allocation(RESOURCE, &["GPU-0", "GPU-1"], &[], 1)
        .await
        .unwrap();
    assert_eq!(preferred, vec!["GPU-1".to_string()]);

    let resp = kubelet.allocate(RESOURCE, &["GPU-0"]).await.unwrap();
    assert_eq!(resp.envs.get("VISIBLE_DEVICES").map(String::as_str), Some("GPU-0"));
    assert_eq!(resp.devices[0].host_path, "/dev/GPU-0");
    assert_eq!(resp.cdi_devices[0].name, "example.com/gpu=GPU-0");
    assert_eq!(
        plugin.allocations.lock().unwrap().clone(),
        vec![vec!["GPU-0".to_string()]]
    );

    // The plugin's error comes back as the gRPC status.
    let err = kubelet.allocate(RESOURCE, &["GPU-9"]).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("GPU-9"));

    // Kubelets since 1.26 send `localhost` as :authority.
    let auths = plugin.authorities.lock().unwrap().clone();
    assert!(auths.len() >= 4, "{auths:?}");
    assert!(auths.iter().all(|a| a == "localhost"), "{auths:?}");

    // PreStartContainer is not offered by this plugin.
    let err = kubelet.pre_start_container(RESOURCE, &["GPU-0"]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());
    kubelet.stop().await;
}

#[tokio::test]
async fn register_before_serving_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(
        dir.path(),
        KubeletOptions {
            dial_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .await
    .unwrap();

    // No socket at all.
    let err = register(&kubelet.socket_path(), "v1beta1", RESOURCE, "missing.sock", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(
        err.message().contains("failed to dial device plugin"),
        "{}",
        err.message()
    );
    assert!(err.message().contains("missing.sock"), "{}", err.message());

    // Socket bound but nobody serving it: the dial-back times out.
    let _bound = std::os::unix::net::UnixListener::bind(dir.path().join("bound.sock")).unwrap();
    let err = register(&kubelet.socket_path(), "v1beta1", RESOURCE, "bound.sock", None)
        .await
        .unwrap_err();
    assert!(
        err.message().contains("failed to dial device plugin"),
        "{}",
        err.message()
    );

    let recs = kubelet.registrations();
    assert_eq!(recs.len(), 2);
    assert!(recs.iter().all(|r| !r.is_accepted() && r.plugin_options.is_none()));
    assert!(!kubelet.is_connected(RESOURCE));
    let err = kubelet
        .wait_for_registration(RESOURCE, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("rejected"), "{err}");

    // Allocate for a resource that never registered fails.
    let err = kubelet.allocate(RESOURCE, &["GPU-0"]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn bad_requests_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), DevicePluginOptions::default(), two_gpus()).await;
    let sock = kubelet.socket_path();

    let cases = [
        ("v1alpha2", RESOURCE, "gpu.sock", "version"),
        ("", RESOURCE, "gpu.sock", "version"),
        ("v1beta1", "gpu", "gpu.sock", "domain prefix"),
        ("v1beta1", "kubernetes.io/gpu", "gpu.sock", "kubernetes.io/"),
        ("v1beta1", "requests.example.com/gpu", "gpu.sock", "requests."),
        ("v1beta1", "Example.com/gpu", "gpu.sock", "DNS-1123"),
        ("v1beta1", "example.com/-gpu", "gpu.sock", "alphanumeric"),
        ("v1beta1", RESOURCE, "../gpu.sock", "plain file name"),
        ("v1beta1", RESOURCE, "", "empty"),
    ];
    for (version, resource, endpoint, why) in cases {
        let err = register(&sock, version, resource, endpoint, None).await.unwrap_err();
        assert_eq!(err.code(), Code::Unknown);
        assert!(
            err.message().contains(why),
            "{version} {resource} {endpoint}: {}",
            err.message()
        );
    }
    let recs = kubelet.registrations();
    assert_eq!(recs.len(), cases.len());
    assert!(recs.iter().all(|r| matches!(r.outcome, Outcome::Rejected(_))));
    assert!(kubelet.resources().is_empty());
    // The plugin was never dialed.
    assert!(plugin.authorities.lock().unwrap().is_empty());
    drop(kubelet);

    // reject_registration rejects an otherwise valid registration.
    let dir2 = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(
        dir2.path(),
        KubeletOptions {
            reject_registration: Some("node is draining".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let plugin = FakePlugin::serve(
        &dir2.path().join("gpu.sock"),
        DevicePluginOptions::default(),
        two_gpus(),
    )
    .await;
    let err = plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap_err();
    assert_eq!(err.message(), "node is draining");
    assert_eq!(
        kubelet.registrations()[0].outcome,
        Outcome::Rejected("node is draining".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_removes_sockets_and_recreates_kubelet_sock() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("kubelet_internal_checkpoint");
    std::fs::write(&checkpoint, "{}").unwrap();
    // A stale socket from before the kubelet started is removed on start.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    assert!(!stale.exists());
    assert!(checkpoint.exists());

    let plugin_sock = dir.path().join("gpu.sock");
    let plugin = FakePlugin::serve(&plugin_sock, DevicePluginOptions::default(), two_gpus()).await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| !d.is_empty()).await.unwrap();
    let mut events = kubelet.subscribe();

    kubelet.restart().await.unwrap();
    assert!(!plugin_sock.exists(), "plugin socket survived the restart");
    assert!(checkpoint.exists());
    let meta = std::fs::metadata(kubelet.socket_path()).unwrap();
    assert!(meta.file_type().is_socket());
    // The old instance stopped, its stream was dropped, and a new one serves kubelet.sock.
    let mut seen = Vec::new();
    while let Ok(ev) = events.try_recv() {
        seen.push(match ev {
            Event::Disconnected { resource, reason, .. } => format!("disconnected {resource}: {reason}"),
            Event::Stopped { .. } => "stopped".into(),
            Event::Serving { socket, .. } => format!("serving {}", socket.display()),
            other => format!("{other:?}"),
        });
    }
    assert_eq!(
        seen,
        vec![
            format!("disconnected {RESOURCE}: kubelet restarted"),
            "stopped".to_string(),
            format!("serving {}", kubelet.socket_path().display()),
        ]
    );
    // A plugin can connect to the new kubelet.sock.
    assert!(std::os::unix::net::UnixStream::connect(kubelet.socket_path()).is_ok());
    assert!(!kubelet.is_connected(RESOURCE));
    assert!(kubelet.resources().is_empty());
    assert_eq!(kubelet.registrations().len(), 1, "records survive a restart");
    assert!(kubelet.allocate(RESOURCE, &["GPU-0"]).await.is_err());
    // No re-registration yet.
    assert!(
        kubelet
            .wait_for_registration(RESOURCE, Duration::from_millis(200))
            .await
            .is_err()
    );
    // Nor does the old list count as a list from the current stream.
    assert!(
        kubelet
            .wait_for_devices(RESOURCE, Duration::from_millis(200), |_| true)
            .await
            .is_err()
    );

    // The plugin notices, serves a fresh socket and registers again.
    drop(plugin);
    let plugin = FakePlugin::serve(&plugin_sock, DevicePluginOptions::default(), two_gpus()).await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    let rec = kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    assert_eq!(rec.kubelet_instance, 2);
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
    assert_eq!(kubelet.registrations().len(), 2);
    kubelet.allocate(RESOURCE, &["GPU-1"]).await.unwrap();

    // Stop removes kubelet.sock and leaves the plugin's socket alone.
    let kubelet_sock = kubelet.socket_path();
    kubelet.stop().await;
    assert!(!kubelet_sock.exists());
    assert!(plugin_sock.exists());
}

#[tokio::test]
async fn stream_end_disconnects_and_reregistration_replaces() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let a = FakePlugin::serve(&dir.path().join("a.sock"), DevicePluginOptions::default(), two_gpus()).await;
    a.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();

    // A second registration of the same resource replaces the first endpoint.
    let b = FakePlugin::serve(
        &dir.path().join("b.sock"),
        DevicePluginOptions::default(),
        vec![device("GPU-B", true, None)],
    )
    .await;
    b.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 1).await.unwrap();
    // Updates from the replaced plugin are no longer recorded.
    a.set_devices(vec![]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(kubelet.devices(RESOURCE).unwrap()[0].id, "GPU-B");
    let resp = kubelet.allocate(RESOURCE, &["GPU-B"]).await.unwrap();
    assert_eq!(resp.envs["VISIBLE_DEVICES"], "GPU-B");

    // The plugin going away ends the stream: disconnected, Allocate fails.
    b.stop();
    drop(b);
    kubelet.wait_for_disconnect(RESOURCE, T).await.unwrap();
    assert!(kubelet.disconnect_reason(RESOURCE).is_some());
    let err = kubelet.allocate(RESOURCE, &["GPU-B"]).await.unwrap_err();
    assert!(err.message().contains("stopped"), "{}", err.message());
    // The last list is still there.
    assert_eq!(kubelet.devices(RESOURCE).unwrap().len(), 1);
}

#[tokio::test]
async fn violations_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let long = format!("GPU-{}", "f".repeat(60));
    let plugin = FakePlugin::serve(
        &dir.path().join("gpu.sock"),
        DevicePluginOptions::default(),
        vec![device(&long, true, None)],
    )
    .await;
    // Options in RegisterRequest differ from GetDevicePluginOptions.
    register(
        &kubelet.socket_path(),
        "v1beta1",
        RESOURCE,
        "gpu.sock",
        Some(opts_with_preferred()),
    )
    .await
    .unwrap();
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 1).await.unwrap();
    let v = kubelet.violations();
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(v.iter().any(|m| m.contains("64 characters")), "{v:?}");
    assert!(v.iter().any(|m| m.contains("RegisterRequest.options")), "{v:?}");
    // preferred_allocation follows GetDevicePluginOptions, not RegisterRequest.options.
    let err = kubelet
        .preferred_allocation(RESOURCE, &[&long], &[], 1)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    drop(plugin);
}

#[tokio::test]
async fn events_are_published_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), KubeletOptions::default()).await.unwrap();
    let mut events = kubelet.subscribe();
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), DevicePluginOptions::default(), two_gpus()).await;
    plugin.register(&kubelet.socket_path(), RESOURCE).await.unwrap();
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        match tokio::time::timeout(T, events.recv()).await.unwrap().unwrap() {
            test_kubelet::Event::Registration(r) => kinds.push(format!("reg {}", r.resource)),
            test_kubelet::Event::Devices { devices, .. } => kinds.push(format!("list {}", devices.len())),
            _ => {}
        }
    }
    assert_eq!(kinds, vec![format!("reg {RESOURCE}"), "list 2".to_string()]);
}
