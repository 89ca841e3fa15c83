//! One kubelet device plugin gRPC server per resource, on a Unix socket, and the `Register`
//! call to the kubelet.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status};

use super::allocate::{AllocateOptions, allocate};
use super::preferred::preferred_allocation;
use crate::api;
use crate::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::api::registration_client::RegistrationClient;
use crate::config::SharedPolicy;
use crate::devices::Resource;
use crate::devices::Topology;
use crate::edits::DeviceNodes;
use crate::host::socket::{BindError, bind_in_place, file_id};

/// The device plugin API version the kubelet speaks.
pub const API_VERSION: &str = "v1beta1";

/// What every server of this agent needs to answer Allocate and GetPreferredAllocation.
#[derive(Debug, Clone)]
pub struct PluginContext {
    pub allocate: AllocateOptions,
    pub nodes: DeviceNodes,
    pub topology: Topology,
    pub shared_policy: SharedPolicy,
}

/// Counters the status and metrics read.
#[derive(Debug, Default)]
pub struct PluginStats {
    pub allocations: AtomicU64,
    pub allocation_errors: AtomicU64,
    /// The agent's metrics, when they are on: registrations and Allocate calls are counted there.
    pub metrics: Option<crate::metrics::Metrics>,
}

/// The options this agent registers with and returns from `GetDevicePluginOptions` (the kubelet
/// uses the latter; both agree).
pub fn plugin_options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// What the kubelet's `ListAndWatch` streams of one server look like now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamStatus {
    /// How many `ListAndWatch` streams are open (the kubelet keeps one per registration; more
    /// only for a moment while it replaces one).
    pub open: usize,
    /// How many devices the last message on any stream of this server listed; `None` before
    /// the first.
    pub devices_sent: Option<usize>,
}

/// Counts a server's `ListAndWatch` streams and what they sent, and wakes `changed` (the
/// manager, which republishes its status) on every change.
#[derive(Debug)]
pub struct StreamTracker {
    state: Mutex<StreamStatus>,
    changed: Arc<Notify>,
}

impl StreamTracker {
    pub fn new(changed: Arc<Notify>) -> StreamTracker {
        StreamTracker {
            state: Mutex::new(StreamStatus::default()),
            changed,
        }
    }

    pub fn status(&self) -> StreamStatus {
        *self.lock()
    }

    fn lock(&self) -> MutexGuard<'_, StreamStatus> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn change(&self, f: impl FnOnce(&mut StreamStatus)) {
        let changed = {
            let mut state = self.lock();
            let before = *state;
            f(&mut state);
            *state != before
        };
        if changed {
            self.changed.notify_one();
        }
    }
}

/// One open stream: counted while it lives (the stream is dropped when the kubelet hangs up or
/// the server stops).
struct OpenStream(Arc<StreamTracker>);

impl OpenStream {
    fn open(tracker: Arc<StreamTracker>) -> OpenStream {
        tracker.change(|s| s.open += 1);
        OpenStream(tracker)
    }

    fn sent(&self, devices: usize) {
        self.0.change(|s| s.devices_sent = Some(devices));
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.change(|s| s.open = s.open.saturating_sub(1));
    }
}

struct DevicePluginService {
    devices: watch::Receiver<Arc<Resource>>,
    ctx: watch::Receiver<Arc<PluginContext>>,
    stats: Arc<PluginStats>,
    streams: Arc<StreamTracker>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send + 'static>>;

/// The kubelet's view of a resource's devices.
pub fn list_response(resource: &Resource) -> api::ListAndWatchResponse {
    let devices = resource
        .devices
        .iter()
        .map(|(id, d)| api::Device {
            id: id.clone(),
            health: d.health.as_str().to_string(),
            topology: d.numa_node.map(|n| api::TopologyInfo {
                nodes: vec![api::NumaNode { id: n }],
            }),
        })
        .collect();
    api::ListAndWatchResponse { devices }
}

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = DeviceStream;

    /// Sends the full device list now and again on every change; ends when the server stops.
    /// The stream is counted (see [`StreamTracker`]) from now until it is dropped.
    async fn list_and_watch(&self, _: Request<api::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let open = OpenStream::open(self.streams.clone());
        let stream = WatchStream::new(self.devices.clone()).map(move |resource| {
            open.sent(resource.devices.len());
            Ok(list_response(&resource))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let resource = self.devices.borrow().clone();
        let ctx = self.ctx.borrow().clone();
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("allocation_size {} is negative", req.allocation_size))
            })?;
            let ids = preferred_allocation(
                &resource,
                &req.available_device_i_ds,
                &req.must_include_device_i_ds,
                size,
                &ctx.topology,
                ctx.shared_policy,
            )
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", resource.name)))?;
            container_responses.push(api::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let resource = self.devices.borrow().clone();
        let ctx = self.ctx.borrow().clone();
        let mut container_responses = Vec::new();
        for req in &request.get_ref().container_requests {
            match allocate(&resource, req, &ctx.allocate, &ctx.nodes) {
                Ok(resp) => container_responses.push(resp),
                Err(e) => {
                    self.stats.allocation_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(resource = %resource.name, "Allocate refused: {e}");
                    return Err(Status::invalid_argument(e.to_string()));
                }
            }
        }
        self.stats.allocations.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = &self.stats.metrics {
            metrics.allocation(&resource.name);
        }
        tracing::info!(resource = %resource.name, devices = ?request.get_ref().container_requests.iter().map(|r| &r.devices_ids).collect::<Vec<_>>(), "Allocate");
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// A running gRPC server for one resource.
pub struct ServedPlugin {
    pub socket: PathBuf,
    /// Identity of the socket file we bound, to notice when someone else removed or replaced it.
    pub socket_id: Option<(u64, u64)>,
    devices: watch::Sender<Arc<Resource>>,
    streams: Arc<StreamTracker>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl ServedPlugin {
    /// Binds `dir/<socket>` and starts serving `resource` on it. A dead socket file (left by a
    /// process that is gone) is replaced; a live one (another device plugin, NVIDIA's, serving
    /// the same resource) is never touched: [`BindError::InUse`] names its pid
    /// ([`crate::host::socket::bind_in_place`]). The socket accepts connections as soon as this
    /// returns, so `Register` may follow at once. `streams_changed` is woken whenever a
    /// `ListAndWatch` stream opens, sends or ends.
    pub fn start(
        dir: &Path,
        resource: Resource,
        ctx: watch::Receiver<Arc<PluginContext>>,
        stats: Arc<PluginStats>,
        streams_changed: Arc<Notify>,
    ) -> Result<ServedPlugin, BindError> {
        let socket = dir.join(resource.socket_name());
        let (listener, id) = bind_in_place(&socket)?;
        let listener = listener
            .set_nonblocking(true)
            .and_then(|()| UnixListener::from_std(listener))
            .map_err(|source| BindError::Io {
                socket: socket.clone(),
                source,
            })?;
        let socket_id = Some(id);
        let name = resource.name.clone();
        let (devices, devices_rx) = watch::channel(Arc::new(resource));
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let streams = Arc::new(StreamTracker::new(streams_changed));
        let service = DevicePluginService {
            devices: devices_rx,
            ctx,
            stats,
            streams: streams.clone(),
        };
        let incoming = UnixListenerStream::new(listener);
        let path = socket.clone();
        let task = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = shutdown_rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!(resource = %name, "device plugin server on {} stopped: {e}", path.display());
            }
        });
        Ok(ServedPlugin {
            socket,
            socket_id,
            devices,
            streams,
            shutdown: Some(shutdown),
            task,
        })
    }

    /// Publishes a new device list; `ListAndWatch` streams send it only if it differs.
    pub fn update(&self, resource: Resource) {
        self.devices.send_if_modified(|current| {
            if **current == resource {
                false
            } else {
                *current = Arc::new(resource);
                true
            }
        });
    }

    pub fn resource(&self) -> Arc<Resource> {
        self.devices.borrow().clone()
    }

    /// The kubelet's `ListAndWatch` streams on this server.
    pub fn streams(&self) -> StreamStatus {
        self.streams.status()
    }

    /// Whether our socket file is still the one we bound (the kubelet deletes plugin sockets
    /// when it restarts).
    pub fn socket_intact(&self) -> bool {
        self.socket_id.is_some() && file_id(&self.socket) == self.socket_id
    }

    /// Stops serving (open `ListAndWatch` streams end) and removes our socket if it is still ours.
    pub async fn stop(self) {
        let ServedPlugin {
            socket,
            socket_id,
            devices,
            streams: _,
            shutdown,
            mut task,
        } = self;
        if let Some(tx) = shutdown {
            let _ = tx.send(());
        }
        // Dropping the device sender ends the ListAndWatch streams, which lets the graceful
        // shutdown finish instead of waiting for the kubelet to hang up.
        drop(devices);
        if tokio::time::timeout(Duration::from_secs(2), &mut task).await.is_err() {
            task.abort();
        }
        if socket_id.is_some() && file_id(&socket) == socket_id {
            let _ = std::fs::remove_file(&socket);
        }
    }
}

/// Why `Register` failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("cannot connect to the kubelet at {socket}: {source}")]
    Connect {
        socket: String,
        source: tonic::transport::Error,
    },
    #[error("the kubelet at {socket} refused to register {resource}: {status}")]
    Refused {
        socket: String,
        resource: String,
        status: String,
    },
    #[error("the kubelet at {socket} did not answer Register for {resource} within {timeout:?}")]
    Timeout {
        socket: String,
        resource: String,
        timeout: Duration,
    },
}

/// Calls `Register` on the kubelet socket for one resource served at `endpoint` (a file name in
/// the kubelet's device-plugin directory). The kubelet dials back and calls
/// `GetDevicePluginOptions` before answering, so the server must be serving already.
pub async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource: &str,
    timeout: Duration,
) -> Result<(), RegisterError> {
    let socket = kubelet_socket.display().to_string();
    let path = kubelet_socket.to_path_buf();
    let call = async {
        // The URI is a placeholder: the connector below always opens the Unix socket, and
        // "localhost" is the authority current kubelets also use on Unix sockets.
        let channel = Endpoint::from_static("http://localhost")
            .connect_timeout(timeout)
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|source| RegisterError::Connect {
                socket: socket.clone(),
                source,
            })?;
        let request = api::RegisterRequest {
            version: API_VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(plugin_options()),
        };
        RegistrationClient::new(channel)
            .register(request)
            .await
            .map_err(|status| RegisterError::Refused {
                socket: socket.clone(),
                resource: resource.into(),
                status: status.message().to_string(),
            })?;
        Ok(())
    };
    tokio::time::timeout(timeout, call).await.unwrap_or_else(|_| {
        Err(RegisterError::Timeout {
            socket: kubelet_socket.display().to_string(),
            resource: resource.into(),
            timeout,
        })
    })
}
