//! The raw HTTP/2 client and the legacy `:authority` mode.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{FakePlugin, RESOURCE, device, two_gpus};
use prost::Message;
use test_kubelet::api::{self, DevicePluginOptions};
use test_kubelet::rawh2::{self, Frame, HeaderDecoder, RawCall, flag, kind};
use test_kubelet::{KubeletOptions, TestKubelet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const T: Duration = Duration::from_secs(5);

fn legacy() -> KubeletOptions {
    KubeletOptions {
        legacy_authority: true,
        ..Default::default()
    }
}

/// A plugin that checks `:authority` the way stock h2 does (`http::uri::Authority`, which
/// a socket path fails) and answers a bad one with RST_STREAM PROTOCOL_ERROR, as h2's
/// `malformed!` does. This workspace patches h2 (vendor/h2) to treat such an authority as
/// absent, so a tonic plugin here cannot show the stock behaviour; this one reproduces it at
/// the frame level.
async fn strict_h2_plugin(listener: UnixListener, seen: Arc<Mutex<Vec<String>>>) {
    loop {
        let Ok((conn, _)) = listener.accept().await else { return };
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            let _ = strict_connection(conn, seen).await;
        });
    }
}

async fn strict_connection(mut conn: UnixStream, seen: Arc<Mutex<Vec<String>>>) -> std::io::Result<()> {
    let mut preface = [0u8; 24];
    conn.read_exact(&mut preface).await?;
    assert_eq!(&preface[..], rawh2::PREFACE);
    conn.write_all(&Frame::new(kind::SETTINGS, 0, 0, Vec::new()).encode())
        .await?;
    let mut decoder = HeaderDecoder::new();
    while let Some(frame) = rawh2::read_frame(&mut conn, rawh2::DEFAULT_MAX_FRAME_SIZE).await? {
        match frame.kind {
            kind::SETTINGS if !frame.has(flag::ACK) => {
                conn.write_all(&Frame::new(kind::SETTINGS, flag::ACK, 0, Vec::new()).encode())
                    .await?;
            }
            kind::HEADERS => {
                let headers = decoder.decode(frame.body().unwrap()).unwrap();
                let authority = headers
                    .iter()
                    .find(|(n, _)| n == ":authority")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                seen.lock().unwrap().push(authority.clone());
                assert!(
                    tonic::codegen::http::uri::Authority::try_from(authority.as_str()).is_err(),
                    "expected an authority stock h2 rejects, got {authority:?}"
                );
                let rst = rawh2::PROTOCOL_ERROR.to_be_bytes().to_vec();
                conn.write_all(&Frame::new(kind::RST_STREAM, 0, frame.stream_id, rst).encode())
                    .await?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Against a plugin with stock h2 behaviour, legacy mode fails the dial-back inside Register
/// with the PROTOCOL_ERROR message: what a plugin on unpatched h2 sees from a kubelet < 1.26.
#[tokio::test]
async fn legacy_authority_is_rejected_by_stock_h2_behaviour() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), legacy()).await.unwrap();
    let socket = dir.path().join("gpu.sock");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let server = tokio::spawn(strict_h2_plugin(
        UnixListener::bind(&socket).unwrap(),
        Arc::clone(&seen),
    ));

    let err = common::register(&kubelet.socket_path(), "v1beta1", RESOURCE, "gpu.sock", None)
        .await
        .unwrap_err();
    assert!(
        err.message().contains("failed to dial device plugin"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains(
            "plugin reset the stream: PROTOCOL_ERROR (the :authority kubelets before 1.26 send was rejected)"
        ),
        "{}",
        err.message()
    );
    assert!(!kubelet.registrations()[0].is_accepted());
    assert!(!kubelet.is_connected(RESOURCE));
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![socket.to_string_lossy().into_owned()]
    );
    server.abort();
}

/// Legacy mode against this workspace's tonic plugin. With the vendored h2 patch the call
/// succeeds; with stock h2 it must fail with the PROTOCOL_ERROR message. Which one applies is
/// probed with the raw client first, so the test holds either way and says which it saw.
#[tokio::test]
async fn legacy_authority_against_workspace_tonic() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), DevicePluginOptions::default(), two_gpus()).await;
    let path = plugin.socket.to_string_lossy().into_owned();
    let probe = rawh2::unary::<_, DevicePluginOptions>(
        &plugin.socket,
        &path,
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        &api::Empty {},
    )
    .await;
    let kubelet = TestKubelet::start(dir.path(), legacy()).await;
    // start() removed the plugin's socket (CleanupPluginDirectory); serve it again.
    drop(plugin);
    let kubelet = kubelet.unwrap();
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), DevicePluginOptions::default(), two_gpus()).await;
    let result = plugin.register(&kubelet.socket_path(), RESOURCE).await;
    match probe {
        Ok(_) => {
            eprintln!("h2 accepts a socket-path :authority (patched h2)");
            result.unwrap();
            kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
            kubelet.allocate(RESOURCE, &["GPU-0"]).await.unwrap();
        }
        Err(e) => {
            eprintln!("h2 rejects a socket-path :authority (stock h2)");
            assert!(e.message().contains("PROTOCOL_ERROR"), "{}", e.message());
            let err = result.unwrap_err();
            assert!(err.message().contains("PROTOCOL_ERROR"), "{}", err.message());
        }
    }
}

/// The raw client with a valid authority against tonic: unary calls, a gRPC error
/// status, a long server stream and responses larger than the flow-control windows.
#[tokio::test]
async fn raw_client_talks_to_tonic() {
    let dir = tempfile::tempdir().unwrap();
    let options = DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: true,
    };
    // ~2000 devices with 60-character IDs: every list is far over 64 KiB.
    let many: Vec<api::Device> = (0..2000)
        .map(|i| device(&format!("GPU-{i:056}"), true, Some(i % 2)))
        .collect();
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), options, many.clone()).await;
    let sock = plugin.socket.clone();

    let got: DevicePluginOptions = rawh2::unary(
        &sock,
        "localhost",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        &api::Empty {},
    )
    .await
    .unwrap();
    assert_eq!(got, options);

    // Unknown device: the plugin's status comes back through the trailers.
    let req = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: vec!["nope".into()],
        }],
    };
    let err = rawh2::unary::<_, api::AllocateResponse>(&sock, "localhost", "/v1beta1.DevicePlugin/Allocate", &req)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(err.message(), "unknown device: nope");

    // Unimplemented method.
    let err = rawh2::unary::<_, api::Empty>(&sock, "localhost", "/v1beta1.DevicePlugin/Nope", &api::Empty {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented);

    // A big request and response (> 64 KiB each way).
    let ids: Vec<String> = many.iter().map(|d| d.id.clone()).collect();
    let req = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: ids.clone(),
        }],
    };
    assert!(req.encoded_len() > 100_000);
    let resp: api::AllocateResponse = rawh2::unary(&sock, "localhost", "/v1beta1.DevicePlugin/Allocate", &req)
        .await
        .unwrap();
    assert_eq!(resp.container_responses[0].devices.len(), 2000);
    assert_eq!(resp.container_responses[0].envs["VISIBLE_DEVICES"], ids.join(","));

    // ListAndWatch: several large lists in a row on one stream.
    let mut call = RawCall::start(&sock, "localhost", "/v1beta1.DevicePlugin/ListAndWatch", &[])
        .await
        .unwrap();
    let first = api::ListAndWatchResponse::decode(call.message().await.unwrap().unwrap().as_slice()).unwrap();
    assert_eq!(first.devices, many);
    for round in 0..5 {
        let mut next = many.clone();
        next[round].health = "Unhealthy".into();
        plugin.set_devices(next.clone());
        let msg = api::ListAndWatchResponse::decode(call.message().await.unwrap().unwrap().as_slice()).unwrap();
        assert_eq!(msg.devices, next);
    }
}

/// Rewrites `:authority` to `localhost` on the way to a stock tonic plugin and records what
/// the client sent: a plugin that accepts the legacy authority.
async fn authority_rewriting_proxy(listener: UnixListener, upstream: PathBuf, seen: Arc<Mutex<Vec<String>>>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let upstream = upstream.clone();
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            let _ = proxy_connection(client, &upstream, seen).await;
        });
    }
}

async fn proxy_connection(client: UnixStream, upstream: &Path, seen: Arc<Mutex<Vec<String>>>) -> std::io::Result<()> {
    let server = UnixStream::connect(upstream).await?;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let down = tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
    let mut preface = [0u8; 24];
    cr.read_exact(&mut preface).await?;
    assert_eq!(&preface[..], rawh2::PREFACE);
    sw.write_all(&preface).await?;
    let mut decoder = HeaderDecoder::new();
    while let Some(frame) = rawh2::read_frame(&mut cr, rawh2::DEFAULT_MAX_FRAME_SIZE).await? {
        let frame = if frame.kind == kind::HEADERS {
            assert!(frame.has(flag::END_HEADERS), "the client sends one HEADERS frame");
            let headers = decoder.decode(frame.body().unwrap()).unwrap();
            let mut rewritten = Vec::new();
            for (name, value) in &headers {
                if name == ":authority" {
                    seen.lock().unwrap().push(value.clone());
                    rewritten.push((name.as_str(), "localhost"));
                } else {
                    rewritten.push((name.as_str(), value.as_str()));
                }
            }
            let flags = frame.flags & !(flag::PADDED | flag::PRIORITY);
            Frame::new(
                kind::HEADERS,
                flags,
                frame.stream_id,
                rawh2::encode_header_block(rewritten),
            )
        } else {
            frame
        };
        sw.write_all(&frame.encode()).await?;
    }
    sw.shutdown().await?;
    let _ = down.await;
    Ok(())
}

/// Legacy mode end to end: dial-back, ListAndWatch and Allocate all go out with the socket
/// path as `:authority`, and work against a plugin that accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_mode_works_against_a_plugin_that_accepts_the_path_authority() {
    let dir = tempfile::tempdir().unwrap();
    let backend = tempfile::tempdir().unwrap();
    let kubelet = TestKubelet::start(dir.path(), legacy()).await.unwrap();
    let options = DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: true,
    };
    let plugin = FakePlugin::serve(&backend.path().join("real.sock"), options, two_gpus()).await;
    let front = dir.path().join("gpu.sock");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let proxy = tokio::spawn(authority_rewriting_proxy(
        UnixListener::bind(&front).unwrap(),
        plugin.socket.clone(),
        Arc::clone(&seen),
    ));

    common::register(&kubelet.socket_path(), "v1beta1", RESOURCE, "gpu.sock", Some(options))
        .await
        .unwrap();
    let rec = kubelet.wait_for_registration(RESOURCE, T).await.unwrap();
    assert_eq!(rec.plugin_options, Some(options));
    kubelet.wait_for_devices(RESOURCE, T, |d| d.len() == 2).await.unwrap();
    plugin.set_devices(vec![device("GPU-0", false, Some(0)), device("GPU-1", true, Some(1))]);
    kubelet
        .wait_for_devices(RESOURCE, T, |d| d[0].health == "Unhealthy")
        .await
        .unwrap();
    let preferred = kubelet
        .preferred_allocation(RESOURCE, &["GPU-1"], &[], 1)
        .await
        .unwrap();
    assert_eq!(preferred, vec!["GPU-1".to_string()]);
    let resp = kubelet.allocate(RESOURCE, &["GPU-1"]).await.unwrap();
    assert_eq!(resp.envs["VISIBLE_DEVICES"], "GPU-1");
    kubelet.pre_start_container(RESOURCE, &["GPU-1"]).await.unwrap();
    let err = kubelet.allocate(RESOURCE, &["GPU-7"]).await.unwrap_err();
    assert_eq!(err.message(), "unknown device: GPU-7");

    let front_path = front.to_string_lossy().into_owned();
    let seen = seen.lock().unwrap().clone();
    // GetDevicePluginOptions, ListAndWatch, GetPreferredAllocation, Allocate x2, PreStartContainer
    assert_eq!(seen.len(), 6, "{seen:?}");
    assert!(seen.iter().all(|a| *a == front_path), "{seen:?}");
    assert!(plugin.authorities.lock().unwrap().iter().all(|a| a == "localhost"));
    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());

    // Stopping the kubelet drops the legacy ListAndWatch connection too.
    kubelet.stop().await;
    proxy.abort();
}
