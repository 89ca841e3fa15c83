//! Pod attribution: which pod and container holds each GPU and MIG device, from the kubelet's
//! pod-resources API (`v1.PodResourcesLister/List`) on its Unix socket.
//!
//! Device IDs are those the device plugin advertised: GPU UUIDs, MIG UUIDs, and replica IDs
//! `<uuid>::<n>` of shared GPUs, which count for the device they replicate. When several
//! containers hold replicas of one device, the series carry one of them, the first by
//! (namespace, pod, container) — as dcgm-exporter by default labels a series with one pod.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::Endpoint;

use super::podresources::pod_resources_lister_client::PodResourcesListerClient;
use super::podresources::{ListPodResourcesRequest, PodResources};
use crate::devices::split_replica_id;

/// How long one `List` call (connect included) may take.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest `List` answer accepted (a node with many pods answers a lot; dcgm-exporter
/// allows the same).
pub const MAX_LIST_BYTES: usize = 16 * 1024 * 1024;

/// Whether the "no pod-resources socket" note was logged since the socket was last seen.
static MISSING_LOGGED: AtomicBool = AtomicBool::new(false);

/// A container of a pod (the `namespace`, `pod` and `container` labels).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

/// Device UUID → the container holding it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    by_device: HashMap<String, PodRef>,
}

impl Attribution {
    /// The attribution a `List` answer gives.
    pub fn from_pods(pods: &[PodResources]) -> Attribution {
        let mut attribution = Attribution::default();
        for pod in pods {
            for container in &pod.containers {
                let holder = PodRef {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                };
                for devices in &container.devices {
                    for id in &devices.device_ids {
                        attribution.insert(id, holder.clone());
                    }
                }
            }
        }
        attribution
    }

    /// Records that `holder` holds device `id` (a replica ID counts for its device). Of several
    /// holders of one device the first by (namespace, pod, container) stays.
    pub fn insert(&mut self, id: &str, holder: PodRef) {
        let uuid = split_replica_id(id).map_or(id, |(uuid, _)| uuid);
        match self.by_device.get_mut(uuid) {
            Some(current) if *current <= holder => {}
            Some(current) => *current = holder,
            None => {
                self.by_device.insert(uuid.to_string(), holder);
            }
        }
    }

    /// The container holding the GPU or MIG device with this UUID.
    pub fn get(&self, uuid: &str) -> Option<&PodRef> {
        self.by_device.get(uuid)
    }

    /// How many devices are attributed.
    pub fn len(&self) -> usize {
        self.by_device.len()
    }

    /// Whether no device is attributed.
    pub fn is_empty(&self) -> bool {
        self.by_device.is_empty()
    }
}

/// Why the pod-resources API could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AttributionError {
    #[error("cannot connect to the kubelet's pod-resources socket {socket}: {source}")]
    Connect {
        socket: String,
        source: tonic::transport::Error,
    },
    #[error("the kubelet's pod-resources List on {socket} failed: {status}")]
    List { socket: String, status: String },
    #[error("the kubelet's pod-resources List on {socket} did not answer within {timeout:?}")]
    Timeout { socket: String, timeout: Duration },
}

/// Calls `List` on the pod-resources socket (a fresh connection each time, so a restarted
/// kubelet is simply found again). A socket that does not exist (no kubelet, or one without
/// the API) is an empty attribution, noted in the log once until the socket appears.
pub async fn attribution(socket: &Path) -> Result<Attribution, AttributionError> {
    if !socket.exists() {
        if !MISSING_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "no kubelet pod-resources socket at {}: GPU metrics carry no pod labels until it appears",
                socket.display()
            );
        }
        return Ok(Attribution::default());
    }
    MISSING_LOGGED.store(false, Ordering::Relaxed);
    let name = socket.display().to_string();
    let path = socket.to_path_buf();
    let call = async {
        // The URI is a placeholder: the connector always opens the Unix socket.
        let channel = Endpoint::from_static("http://localhost")
            .connect_timeout(LIST_TIMEOUT)
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|source| AttributionError::Connect {
                socket: name.clone(),
                source,
            })?;
        let answer = PodResourcesListerClient::new(channel)
            .max_decoding_message_size(MAX_LIST_BYTES)
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|status| AttributionError::List {
                socket: name.clone(),
                status: format!("{} ({:?})", status.message(), status.code()),
            })?;
        Ok(Attribution::from_pods(&answer.into_inner().pod_resources))
    };
    tokio::time::timeout(LIST_TIMEOUT, call).await.unwrap_or_else(|_| {
        Err(AttributionError::Timeout {
            socket: socket.display().to_string(),
            timeout: LIST_TIMEOUT,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::podresources::{ContainerDevices, ContainerResources};

    fn pod(ns: &str, name: &str, containers: &[(&str, &[&str])]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers: containers
                .iter()
                .map(|(c, ids)| ContainerResources {
                    name: c.to_string(),
                    devices: vec![ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                        topology: None,
                    }],
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn holder(ns: &str, pod: &str, container: &str) -> PodRef {
        PodRef {
            namespace: ns.into(),
            pod: pod.into(),
            container: container.into(),
        }
    }

    #[test]
    fn uuids_mig_uuids_and_replicas_map_to_their_container() {
        let a = Attribution::from_pods(&[
            pod("ml", "train", &[("worker", &["GPU-a", "MIG-b"])]),
            pod("ml", "share-2", &[("main", &["GPU-c::3"])]),
            pod("ml", "share-1", &[("main", &["GPU-c::1"])]),
        ]);
        assert_eq!(a.len(), 3);
        assert_eq!(a.get("GPU-a"), Some(&holder("ml", "train", "worker")));
        assert_eq!(a.get("MIG-b"), Some(&holder("ml", "train", "worker")));
        // Two pods share GPU-c: the first by name is reported, whatever the list order.
        assert_eq!(a.get("GPU-c"), Some(&holder("ml", "share-1", "main")));
        assert_eq!(a.get("GPU-c::1"), None);
        assert!(Attribution::default().is_empty());
    }

    #[tokio::test]
    async fn a_missing_socket_is_an_empty_attribution() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = attribution(&dir.path().join("pod-resources/kubelet.sock"))
            .await
            .expect("no error for a missing socket");
        assert!(a.is_empty());
    }

    #[tokio::test]
    async fn a_dead_socket_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("kubelet.sock");
        drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
        let err = attribution(&socket).await.expect_err("nobody listens");
        assert!(err.to_string().contains("cannot connect"), "{err}");
    }
}
