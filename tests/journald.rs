//! Logging to journald: the agent, told `[log] format = "journald"`, sends its records over
//! journald's native protocol to `/run/systemd/journal/socket`. The test owns that socket: the
//! agent runs in a private mount namespace (needs root, as CI has) where a socket the test bound
//! is mounted at that path, so the host's journal is never touched. The datagrams are parsed as
//! systemd's protocol defines them (`KEY=value` lines; `KEY\n<le64 length><bytes>\n` for values
//! with a newline).

mod common;

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Node;

/// In the new mount namespace: a tmpfs over /run (so nothing is created on the host), the
/// test's socket bound at /run/systemd/journal/socket, then the agent.
const IN_NAMESPACE: &str = r#"
set -e
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/journal
touch /run/systemd/journal/socket
mount --bind "$1" /run/systemd/journal/socket
shift
exec "$@"
"#;

/// One journal entry: its fields (a field given twice keeps the last value).
type Entry = BTreeMap<String, String>;

/// Parses one native-protocol datagram.
fn parse(mut data: &[u8]) -> Entry {
    let mut entry = Entry::new();
    while !data.is_empty() {
        let line_end = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
        let line = &data[..line_end];
        if let Some(eq) = line.iter().position(|&b| b == b'=') {
            let key = String::from_utf8_lossy(&line[..eq]).into_owned();
            entry.insert(key, String::from_utf8_lossy(&line[eq + 1..]).into_owned());
            data = data.get(line_end + 1..).unwrap_or_default();
        } else {
            // KEY\n, then the value's length as a little-endian u64, the value, and \n.
            let key = String::from_utf8_lossy(line).into_owned();
            let rest = &data[line_end + 1..];
            let len = u64::from_le_bytes(rest[..8].try_into().expect("length")) as usize;
            entry.insert(key, String::from_utf8_lossy(&rest[8..8 + len]).into_owned());
            data = rest.get(8 + len + 1..).unwrap_or_default();
        }
    }
    entry
}

#[test]
fn journald_records_carry_the_agents_structured_fields() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test mounts in a private namespace and needs root (CI runs as root)"
    );
    let node = Node::new(
        &common::machine("H100-80GB-HBM3", 2),
        "[kubernetes]\nenabled = false\n[log]\nformat = \"journald\"\n",
    );
    let socket_path = node.tmp.path().join("journal.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("bind the test journal socket");
    socket.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");

    // Read while the agent runs: a datagram socket whose queue is full blocks the sender.
    let reader = std::thread::spawn(move || {
        let mut entries = Vec::new();
        let mut buf = vec![0u8; 256 * 1024];
        while let Ok(n) = socket.recv(&mut buf) {
            entries.push(parse(&buf[..n]));
        }
        entries
    });
    let agent = node.command(&["run", "--once"]);
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c", IN_NAMESPACE, "sh"])
        .arg(&socket_path)
        .arg(agent.get_program())
        .args(agent.get_args());
    for (key, value) in agent.get_envs() {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.stdin(Stdio::null()).output().expect("run the agent in a namespace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        !stderr.contains("journald is not reachable"),
        "the agent fell back to stderr: {stderr}"
    );
    // The reader stops once nothing came for its timeout after the agent ended.
    let entries = reader.join().expect("reader");
    // tracing-journald checks the socket with an empty datagram first.
    let entries: Vec<Entry> = entries.into_iter().filter(|e| !e.is_empty()).collect();
    assert!(!entries.is_empty(), "no journal records; stderr: {stderr}");
    for e in &entries {
        assert_eq!(
            e.get("SYSLOG_IDENTIFIER").map(String::as_str),
            Some("gpu-node-agent"),
            "{e:?}"
        );
        assert!(
            e.get("PRIORITY")
                .is_some_and(|p| matches!(p.as_str(), "0" | "1" | "2" | "3" | "4" | "5" | "6" | "7")),
            "{e:?}"
        );
        let message = e.get("MESSAGE").unwrap_or_else(|| panic!("no MESSAGE: {e:?}"));
        assert!(!message.contains('\x1b'), "colour codes in the journal: {e:?}");
        assert!(e.contains_key("TARGET") && e.contains_key("CODE_FILE"), "{e:?}");
    }
    let find = |message: &str| {
        entries
            .iter()
            .find(|e| e.get("MESSAGE").is_some_and(|m| m.contains(message)))
            .unwrap_or_else(|| panic!("no record {message:?} in {entries:#?}"))
    };
    // A stage change carries the stage as a field of its own, at info level (journal NOTICE, 5,
    // as tracing-journald maps INFO).
    let driver = find("stage driver is now Ok");
    assert_eq!(driver.get("F_STAGE").map(String::as_str), Some("driver"), "{driver:?}");
    assert_eq!(driver.get("PRIORITY").map(String::as_str), Some("5"));
    // A warning is a journal WARNING (4).
    let warning = find("[kubernetes] enabled = false");
    assert_eq!(warning.get("PRIORITY").map(String::as_str), Some("4"));
    // Nothing went to stderr instead.
    assert!(!stderr.contains("stage driver is now"), "{stderr}");
}
