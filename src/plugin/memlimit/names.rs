//! A pod's and container's names for the messages, from the kubelet's log layout on the node.

use std::fs;
use std::path::{Path, PathBuf};

use crate::host::HostRoot;

/// A pod's and container's names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodName {
    pub namespace: String,
    pub pod: String,
    /// The container's name; `None` when only the pod is known.
    pub container: Option<String>,
}

/// Turns the pod UID and container ID a cgroup gives into names.
pub trait PodNames {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName>;
}

/// Knows no names: reports show the pod UID and container ID.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoNames;

impl PodNames for NoNames {
    fn lookup(&self, _pod_uid: &str, _container_id: Option<&str>) -> Option<PodName> {
        None
    }
}

/// Names from the kubelet's log layout on the node, which every CRI kubelet keeps:
/// `/var/log/pods/<namespace>_<pod>_<uid>/` names a pod by UID, and the symlink
/// `/var/log/containers/<pod>_<namespace>_<container>-<container ID>.log` names a container by
/// ID. Pod, namespace and container names are DNS labels or subdomains, so `_` only separates.
/// The memory limits use the names in messages only. The GPU Operator guards
/// (`host::operator`) decide on the namespace: the kubelet writes these folders, a pod cannot
/// choose them, and a pod whose namespace cannot be told counts as a tenant's.
#[derive(Debug, Clone)]
pub struct KubeletLogNames {
    /// `/var/log/pods` under the root.
    pub pods: PathBuf,
    /// `/var/log/containers` under the root.
    pub containers: PathBuf,
}

impl KubeletLogNames {
    pub fn new(root: &HostRoot) -> KubeletLogNames {
        KubeletLogNames {
            pods: root.join("/var/log/pods"),
            containers: root.join("/var/log/containers"),
        }
    }
}

/// The entry names of a directory; none when it cannot be read (no kubelet logs here).
fn entry_names(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `<pod>_<namespace>_<container>-<id>.log` → the names, when `id` is the container's.
pub fn parse_container_log_name(file: &str, container_id: &str) -> Option<PodName> {
    let rest = file
        .strip_suffix(".log")?
        .strip_suffix(container_id)?
        .strip_suffix('-')?;
    let mut parts = rest.splitn(3, '_');
    let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    if [pod, namespace, container]
        .iter()
        .any(|p| p.is_empty() || p.contains('_'))
    {
        return None;
    }
    Some(PodName {
        namespace: namespace.into(),
        pod: pod.into(),
        container: Some(container.into()),
    })
}

/// `<namespace>_<pod>_<uid>` → the pod's names, when `uid` is the pod's.
pub fn parse_pod_log_dir(dir: &str, pod_uid: &str) -> Option<PodName> {
    let rest = dir.strip_suffix(pod_uid)?.strip_suffix('_')?;
    let (namespace, pod) = rest.split_once('_')?;
    if namespace.is_empty() || pod.is_empty() || pod.contains('_') {
        return None;
    }
    Some(PodName {
        namespace: namespace.into(),
        pod: pod.into(),
        container: None,
    })
}

impl PodNames for KubeletLogNames {
    fn lookup(&self, pod_uid: &str, container_id: Option<&str>) -> Option<PodName> {
        if let Some(id) = container_id {
            let found = entry_names(&self.containers)
                .iter()
                .find_map(|f| parse_container_log_name(f, id));
            if found.is_some() {
                return found;
            }
        }
        entry_names(&self.pods)
            .iter()
            .find_map(|d| parse_pod_log_dir(d, pod_uid))
    }
}
