//! A process on the host: the pod its `/proc/<pid>/cgroup` names, and, through the real `/proc`
//! and kill(2), its start time and signals.

use std::fs;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Where the real processes are seen, whatever the root prefix (see the module docs).
const REAL_PROC: &str = "/proc";

// === cgroup → pod ===

/// A pod's Kubernetes quality-of-service class, as its cgroup path shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Qos {
    /// `kubepods/pod<uid>` or `kubepods-pod<uid>.slice`: no QoS level in the path.
    Guaranteed,
    Burstable,
    BestEffort,
}

/// The pod (and container) a process runs in, from its cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef {
    /// The pod's UID with dashes (the systemd driver's `_` turned back into `-`).
    pub pod_uid: String,
    /// The container runtime's container ID; `None` for a process in the pod's own cgroup.
    pub container_id: Option<String>,
    pub qos: Qos,
}

/// The pod a process belongs to, from the text of its `/proc/<pid>/cgroup`; `None` when no line
/// names a Kubernetes pod. Every line is looked at (cgroup v2's `0::<path>`, or any cgroup v1
/// controller's `<id>:<controllers>:<path>`), and `kubepods` may sit anywhere in the path (kind
/// and other nested nodes put it under `kubelet.slice` or a node container's scope). Both kubelet
/// cgroup drivers are understood:
/// - systemd: `…/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/
///   cri-containerd-<id>.scope` (also `docker-<id>.scope`, `crio-<id>.scope`);
/// - cgroupfs: `…/kubepods/burstable/pod<uid>/<id>` (also `crio-<id>`).
pub fn pod_of_cgroup(text: &str) -> Option<PodRef> {
    text.lines().find_map(|line| {
        // `hierarchy-id:controllers:path`; only the path may contain ':'.
        let mut fields = line.splitn(3, ':');
        let (_, _, path) = (fields.next()?, fields.next()?, fields.next()?);
        pod_of_path(path.trim())
    })
}

fn pod_of_path(path: &str) -> Option<PodRef> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        // cgroupfs driver: kubepods[/burstable|/besteffort]/pod<uid>[/<container>]
        if *part == "kubepods" {
            let (qos, at) = match parts.get(i + 1) {
                Some(&"burstable") => (Qos::Burstable, i + 2),
                Some(&"besteffort") => (Qos::BestEffort, i + 2),
                _ => (Qos::Guaranteed, i + 1),
            };
            let uid = parts.get(at).and_then(|p| p.strip_prefix("pod"))?;
            if !is_pod_uid(uid) {
                return None;
            }
            return Some(PodRef {
                pod_uid: uid.to_string(),
                container_id: parts.get(at + 1).and_then(|p| container_of(p)),
                qos,
            });
        }
        // systemd driver: the pod's own slice names the QoS class and the escaped UID.
        if let Some(slice) = part.strip_suffix(".slice")
            && let Some((prefix, escaped)) = slice.rsplit_once("-pod")
            && let Some(qos) = systemd_qos(prefix)
        {
            let uid = escaped.replace('_', "-");
            if !is_pod_uid(&uid) {
                return None;
            }
            return Some(PodRef {
                pod_uid: uid,
                container_id: parts.get(i + 1).and_then(|p| container_of(p)),
                qos,
            });
        }
    }
    None
}

/// The QoS class of a systemd pod slice's prefix: `kubepods`, `kubepods-burstable`,
/// `kubepods-besteffort`, each possibly under a cgroup-root prefix (`kubelet-kubepods-…`).
fn systemd_qos(prefix: &str) -> Option<Qos> {
    let (base, qos) = if let Some(base) = prefix.strip_suffix("-burstable") {
        (base, Qos::Burstable)
    } else if let Some(base) = prefix.strip_suffix("-besteffort") {
        (base, Qos::BestEffort)
    } else {
        (prefix, Qos::Guaranteed)
    };
    (base == "kubepods" || base.ends_with("-kubepods")).then_some(qos)
}

/// A pod UID: an API-server UUID, or a static pod's hex hash.
fn is_pod_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

/// Container runtimes' cgroup name prefixes (systemd scopes, CRI-O's cgroupfs names).
const RUNTIME_PREFIXES: [&str; 4] = ["cri-containerd-", "docker-", "crio-", "libpod-"];

/// The container ID in a container's cgroup name, if it is one: `<runtime>-<id>.scope`
/// (systemd), `<id>` or `crio-<id>` (cgroupfs). CRI-O's `crio-conmon-<id>.scope` is the
/// container's monitor, not the container.
fn container_of(part: &str) -> Option<String> {
    let name = part.strip_suffix(".scope").unwrap_or(part);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = RUNTIME_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    let is_id = id.len() >= 12 && id.chars().all(|c| c.is_ascii_hexdigit());
    is_id.then(|| id.to_string())
}

// === processes ===

/// The real processes: their start time and signals. A trait so the enforcer's bookkeeping can
/// be tested without killing anything.
pub trait ProcessControl: Send {
    /// The process's start time (clock ticks after boot, `/proc/<pid>/stat` field 22); `None`
    /// when no live process has this PID (gone, or a zombie waiting for its parent).
    fn start_time(&self, pid: u32) -> Option<u64>;
    /// Sends `signal` to the process.
    fn signal(&self, pid: u32, signal: Signal) -> nix::Result<()>;
}

/// The host's processes through the real `/proc` and kill(2).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostProcesses;

impl ProcessControl for HostProcesses {
    fn start_time(&self, pid: u32) -> Option<u64> {
        let text = fs::read_to_string(format!("{REAL_PROC}/{pid}/stat")).ok()?;
        let (state, start) = parse_stat(&text)?;
        // Z: zombie, X: dead; neither can be signalled into doing anything.
        (!matches!(state, 'Z' | 'X')).then_some(start)
    }

    fn signal(&self, pid: u32, signal: Signal) -> nix::Result<()> {
        let pid = i32::try_from(pid).map_err(|_| Errno::ESRCH)?;
        nix::sys::signal::kill(Pid::from_raw(pid), signal)
    }
}

/// The state (field 3) and start time (field 22) from the text of `/proc/<pid>/stat`. The
/// command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
/// fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<(char, u64)> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 4..=21 lie between the state and the start time.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}
