//! The kubelet's pod-resources API (`v1.PodResourcesLister`) for monitoring-agent tests.
//!
//! A real kubelet serves it on `<kubelet root>/pod-resources/kubelet.sock` and answers from its
//! device manager: which pod and container holds which device IDs of which resource. The
//! stand-in has no pods, so a test names them: [`TestKubelet::allocate_for`] calls `Allocate`
//! on the plugin and, when it succeeds, records the devices as held by the given container;
//! [`TestKubelet::assign`] records a holding without calling any plugin (for tests that run no
//! device plugin). A plain [`TestKubelet::allocate`] is recorded too, under a made-up pod
//! `default/test-pod-<n>`, container `main`, as every allocation a kubelet makes belongs to
//! some pod. `GetAllocatableResources` reports the latest device list of every registered
//! resource.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::Inner;
use crate::podresources::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};
use crate::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, NumaNode,
    PodResources, TopologyInfo,
};

/// Directory of the pod-resources socket under the kubelet's root directory.
pub const POD_RESOURCES_DIR: &str = "pod-resources";
/// File name of the pod-resources socket.
pub const POD_RESOURCES_SOCKET: &str = "kubelet.sock";

/// A container of a pod, as the pod-resources API names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodContainer {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

impl PodContainer {
    /// `namespace/pod`, container `container`.
    pub fn new(namespace: &str, pod: &str, container: &str) -> PodContainer {
        PodContainer {
            namespace: namespace.to_string(),
            pod: pod.to_string(),
            container: container.to_string(),
        }
    }
}

/// Devices of one resource held by one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) holder: PodContainer,
    pub(crate) resource: String,
    pub(crate) device_ids: Vec<String>,
}

/// The `List` answer for the holdings: pods sorted by namespace and name, containers by name,
/// one `ContainerDevices` per resource (IDs in the order they were recorded).
pub(crate) fn list(holdings: &[Holding]) -> Vec<PodResources> {
    /// Resource → device IDs.
    type Devices<'a> = BTreeMap<&'a str, Vec<String>>;
    let mut pods: BTreeMap<(&str, &str), BTreeMap<&str, Devices<'_>>> = BTreeMap::new();
    for h in holdings {
        pods.entry((h.holder.namespace.as_str(), h.holder.pod.as_str()))
            .or_default()
            .entry(h.holder.container.as_str())
            .or_default()
            .entry(h.resource.as_str())
            .or_default()
            .extend(h.device_ids.iter().cloned());
    }
    pods.into_iter()
        .map(|((namespace, name), containers)| PodResources {
            name: name.to_string(),
            namespace: namespace.to_string(),
            containers: containers
                .into_iter()
                .map(|(name, resources)| ContainerResources {
                    name: name.to_string(),
                    devices: resources
                        .into_iter()
                        .map(|(resource, device_ids)| ContainerDevices {
                            resource_name: resource.to_string(),
                            device_ids,
                            topology: None,
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
        })
        .collect()
}

struct Lister {
    inner: Arc<Inner>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(&self, _: Request<ListPodResourcesRequest>) -> Result<Response<ListPodResourcesResponse>, Status> {
        let pod_resources = list(&self.inner.lock().holdings);
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let st = self.inner.lock();
        let mut resources: Vec<&String> = st.endpoints.keys().collect();
        resources.sort();
        let mut devices = Vec::new();
        for resource in resources {
            let Some(latest) = st.updates.get(resource).and_then(|u| u.last()) else {
                continue;
            };
            for d in &latest.devices {
                devices.push(ContainerDevices {
                    resource_name: resource.clone(),
                    device_ids: vec![d.id.clone()],
                    topology: d.topology.as_ref().map(|t| TopologyInfo {
                        nodes: t.nodes.iter().map(|n| NumaNode { id: n.id }).collect(),
                    }),
                });
            }
        }
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(&self, req: Request<GetPodResourcesRequest>) -> Result<Response<GetPodResourcesResponse>, Status> {
        let req = req.into_inner();
        let found = list(&self.inner.lock().holdings)
            .into_iter()
            .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace);
        match found {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => Err(Status::not_found(format!(
                "pod {} not found in {} namespace",
                req.pod_name, req.pod_namespace
            ))),
        }
    }
}

/// The running pod-resources server.
pub(crate) struct PodResourcesServer {
    pub(crate) socket: PathBuf,
    pub(crate) task: JoinHandle<()>,
}

impl PodResourcesServer {
    /// Creates `<root>/pod-resources` (mode 0750), replaces a stale socket and serves.
    pub(crate) fn start(root: &Path, inner: Arc<Inner>) -> io::Result<PodResourcesServer> {
        let dir = root.join(POD_RESOURCES_DIR);
        std::fs::DirBuilder::new().recursive(true).mode(0o750).create(&dir)?;
        let socket = dir.join(POD_RESOURCES_SOCKET);
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(&socket)?;
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(Lister { inner }))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        Ok(PodResourcesServer { socket, task })
    }

    /// Stops serving and removes the socket.
    pub(crate) fn stop(self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(ns: &str, pod: &str, container: &str, resource: &str, ids: &[&str]) -> Holding {
        Holding {
            holder: PodContainer::new(ns, pod, container),
            resource: resource.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn holdings_group_by_pod_container_and_resource() {
        let pods = list(&[
            holding("ml", "train", "worker", "nvidia.com/gpu", &["GPU-a"]),
            holding("default", "infer", "main", "nvidia.com/mig-1g.10gb", &["MIG-x"]),
            holding("ml", "train", "worker", "nvidia.com/gpu", &["GPU-b"]),
            holding("ml", "train", "sidecar", "nvidia.com/gpu", &["GPU-c::1"]),
        ]);
        let flat: Vec<(String, String, String, String, Vec<String>)> = pods
            .iter()
            .flat_map(|p| {
                p.containers.iter().flat_map(move |c| {
                    c.devices.iter().map(move |d| {
                        (
                            p.namespace.clone(),
                            p.name.clone(),
                            c.name.clone(),
                            d.resource_name.clone(),
                            d.device_ids.clone(),
                        )
                    })
                })
            })
            .collect();
        let s = |v: &str| v.to_string();
        assert_eq!(
            flat,
            vec![
                (
                    s("default"),
                    s("infer"),
                    s("main"),
                    s("nvidia.com/mig-1g.10gb"),
                    vec![s("MIG-x")]
                ),
                (
                    s("ml"),
                    s("train"),
                    s("sidecar"),
                    s("nvidia.com/gpu"),
                    vec![s("GPU-c::1")]
                ),
                (
                    s("ml"),
                    s("train"),
                    s("worker"),
                    s("nvidia.com/gpu"),
                    vec![s("GPU-a"), s("GPU-b")]
                ),
            ]
        );
    }
}
