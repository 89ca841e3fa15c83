//! The `test-kubelet` binary with a fake plugin registering against it.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{FakePlugin, RESOURCE, device};
use test_kubelet::api::DevicePluginOptions;
use tokio::process::Command;

/// Waits until the socket accepts connections: the file appears at bind(), a moment before
/// listen(), and a connection in between is refused.
async fn wait_for_socket(path: &Path) {
    for _ in 0..200 {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{} did not appear", path.display());
}

#[tokio::test]
async fn once_with_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_test-kubelet"))
        .args(["--dir", dir.path().to_str().unwrap(), "--once", "--timeout", "20"])
        .args(["--allocate", &format!("{RESOURCE}=2")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let kubelet_sock = dir.path().join("kubelet.sock");
    wait_for_socket(&kubelet_sock).await;

    let options = DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    };
    let devices = vec![
        device("GPU-aaaa", true, Some(0)),
        device("GPU-bbbb", false, Some(0)),
        device("GPU-cccc", true, Some(1)),
        device("GPU-dddd", true, None),
    ];
    let plugin = FakePlugin::serve(&dir.path().join("gpu.sock"), options, devices).await;
    plugin.register(&kubelet_sock, RESOURCE).await.unwrap();

    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!(
        "Register {RESOURCE} endpoint=gpu.sock version=v1beta1: accepted"
    )));
    assert!(stdout.contains("RESOURCE"), "{stdout}");
    assert!(stdout.contains("GPU-bbbb") && stdout.contains("Unhealthy"));
    // The fake plugin prefers the highest IDs.
    assert!(stdout.contains("-> [GPU-dddd, GPU-cccc]"), "{stdout}");
    assert!(
        stdout.contains("Allocate example.com/gpu [GPU-dddd, GPU-cccc]: OK"),
        "{stdout}"
    );
    assert!(stdout.contains("VISIBLE_DEVICES=GPU-dddd,GPU-cccc"), "{stdout}");
    assert!(stdout.contains("example.com/gpu=GPU-cccc"), "{stdout}");
    assert!(stdout.contains("test-kubelet: done"), "{stdout}");
    assert!(!kubelet_sock.exists(), "kubelet.sock left behind");
    assert_eq!(plugin.allocations.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn once_times_out_without_plugins() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_test-kubelet"))
        .args(["--dir", dir.path().to_str().unwrap(), "--once", "--timeout", "1"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("timed out after 1s: no device plugin has registered"),
        "{stdout}"
    );
}

#[tokio::test]
async fn refuses_a_live_kubelet_socket() {
    let dir = tempfile::tempdir().unwrap();
    let _live = std::os::unix::net::UnixListener::bind(dir.path().join("kubelet.sock")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_test-kubelet"))
        .args(["--dir", dir.path().to_str().unwrap(), "--once", "--timeout", "1"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("refusing"));
}

/// Without --once: SIGHUP restarts the kubelet (plugin sockets removed, kubelet.sock
/// recreated), SIGINT stops it and removes kubelet.sock.
#[tokio::test]
async fn signals_restart_and_stop() {
    use tokio::io::{AsyncBufReadExt, BufReader};

    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_test-kubelet"))
        .args(["--dir", dir.path().to_str().unwrap()])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap().to_string();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut expect = async |needle: &str| {
        let found = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains(needle) {
                    return;
                }
            }
            panic!("stdout ended before {needle:?}");
        })
        .await;
        assert!(found.is_ok(), "no line with {needle:?}");
    };
    let kill = async |sig: &str| {
        let ok = Command::new("kill").args([sig, &pid]).status().await.unwrap().success();
        assert!(ok);
    };

    let kubelet_sock = dir.path().join("kubelet.sock");
    expect("serving Registration").await;
    let plugin_sock = dir.path().join("gpu.sock");
    let plugin = FakePlugin::serve(&plugin_sock, DevicePluginOptions::default(), common::two_gpus()).await;
    plugin.register(&kubelet_sock, RESOURCE).await.unwrap();
    expect("ListAndWatch example.com/gpu: 2 devices").await;

    kill("-HUP").await;
    expect("SIGHUP: restarting").await;
    expect("kubelet serving on").await;
    assert!(!plugin_sock.exists());
    assert!(kubelet_sock.exists());
    drop(plugin);
    let plugin = FakePlugin::serve(&plugin_sock, DevicePluginOptions::default(), common::two_gpus()).await;
    plugin.register(&kubelet_sock, RESOURCE).await.unwrap();
    expect("Register example.com/gpu endpoint=gpu.sock version=v1beta1: accepted").await;

    kill("-INT").await;
    expect("SIGINT: stopping").await;
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    assert!(!kubelet_sock.exists());
    assert!(plugin_sock.exists(), "plugin sockets are left alone on stop");
}
