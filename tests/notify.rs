//! The systemd notify protocol, as `Type=notify` with `WatchdogSec=` sees it: the real binary
//! under a notify socket of the test's own.

mod common;

use std::time::Duration;

use common::{Node, NotifySocket};

#[test]
fn ready_status_watchdog_and_stopping_reach_systemd() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let socket = NotifySocket::new();
    let mut child = node
        .command(&["run"])
        .env("NOTIFY_SOCKET", &socket.path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let got = socket.receive_until(Duration::from_secs(15), |m| {
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
    let after = socket.receive_until(Duration::from_secs(10), |m| m.iter().any(|x| x.contains("STOPPING=1")));
    assert!(after.iter().any(|m| m.contains("STOPPING=1")), "{after:?}");
    assert!(child.wait().expect("wait").success());
}

#[test]
fn run_once_is_not_a_service_and_never_says_ready() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "[kubernetes]\nenabled = false\n");
    let socket = NotifySocket::new();
    let out = node
        .command(&["run", "--once"])
        .env("NOTIFY_SOCKET", &socket.path)
        .output()
        .expect("run --once");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let got = socket.receive_until(Duration::from_millis(300), |_| false);
    assert!(
        got.iter().all(|m| !m.contains("READY=1")),
        "a one-shot run is not a service: {got:?}"
    );
}
