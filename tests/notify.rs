//! The systemd notify protocol, as `Type=notify` with `WatchdogSec=` sees it: the real binary
//! under a notify socket of the test's own.

mod common;

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use common::Node;

fn receive_until(socket: &UnixDatagram, deadline: Duration, mut done: impl FnMut(&[String]) -> bool) -> Vec<String> {
    let mut got = Vec::new();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    while start.elapsed() < deadline && !done(&got) {
        if let Ok(n) = socket.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    got
}

#[test]
fn ready_status_watchdog_and_stopping_reach_systemd() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind notify socket");
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let mut child = node
        .command(&["run"])
        .env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let got = receive_until(&socket, Duration::from_secs(15), |m| {
        m.iter().any(|x| x.contains("READY=1")) && m.iter().filter(|x| x.as_str() == "WATCHDOG=1").count() >= 2
    });
    let ready = got.iter().position(|m| m.contains("READY=1")).expect("READY=1 sent");
    let status = got
        .iter()
        .position(|m| m.starts_with("STATUS=driver "))
        .expect("a STATUS= line with the stages");
    assert!(
        status < ready || got[ready].contains("STATUS="),
        "status before or with READY: {got:?}"
    );
    assert!(
        got.iter()
            .any(|m| m.contains("device-plugin pending") || m.contains("device-plugin ok")),
        "{got:?}"
    );
    assert!(
        got.iter().filter(|m| m.as_str() == "WATCHDOG=1").count() >= 2,
        "{got:?}"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let after = receive_until(&socket, Duration::from_secs(10), |m| {
        m.iter().any(|x| x.contains("STOPPING=1"))
    });
    assert!(after.iter().any(|m| m.contains("STOPPING=1")), "{after:?}");
    assert!(child.wait().expect("wait").success());
}

#[test]
fn run_once_is_not_a_service_and_never_says_ready() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "[kubernetes]\nenabled = false\n");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind");
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let out = node
        .command(&["run", "--once"])
        .env("NOTIFY_SOCKET", &path)
        .output()
        .expect("run --once");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let got = receive_until(&socket, Duration::from_millis(300), |_| false);
    assert!(
        got.iter().all(|m| !m.contains("READY=1")),
        "a one-shot run is not a service: {got:?}"
    );
}
