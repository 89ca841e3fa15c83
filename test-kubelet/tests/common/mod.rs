//! A tiny fake device plugin (tonic `DevicePlugin` server on a Unix socket) for the tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use test_kubelet::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use test_kubelet::api::registration_client::RegistrationClient;
use test_kubelet::api::{self, Device, DevicePluginOptions};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

pub const RESOURCE: &str = "example.com/gpu";

pub fn device(id: &str, healthy: bool, numa: Option<i64>) -> Device {
    Device {
        id: id.to_string(),
        health: if healthy { "Healthy" } else { "Unhealthy" }.to_string(),
        topology: numa.map(|n| api::TopologyInfo {
            nodes: vec![api::NumaNode { id: n }],
        }),
    }
}

pub fn two_gpus() -> Vec<Device> {
    vec![device("GPU-0", true, Some(0)), device("GPU-1", true, Some(1))]
}

#[derive(Clone)]
struct Plugin {
    options: DevicePluginOptions,
    devices: watch::Receiver<Vec<Device>>,
    known: Arc<Mutex<Vec<String>>>,
    authorities: Arc<Mutex<Vec<String>>>,
    allocations: Arc<Mutex<Vec<Vec<String>>>>,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<api::Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(self.options))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<api::Empty>) -> Result<Response<ListStream>, Status> {
        let stream = WatchStream::new(self.devices.clone()).map(|devices| Ok(api::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        // Prefer the highest IDs, after the must-include ones.
        let container_responses = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let mut ids = c.must_include_device_i_ds.clone();
                let mut rest: Vec<String> = c
                    .available_device_i_ds
                    .into_iter()
                    .filter(|d| !ids.contains(d))
                    .collect();
                rest.sort();
                rest.reverse();
                ids.extend(rest);
                ids.truncate(c.allocation_size.max(0) as usize);
                api::ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, req: Request<api::AllocateRequest>) -> Result<Response<api::AllocateResponse>, Status> {
        let known = self.known.lock().unwrap().clone();
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            for id in &c.devices_ids {
                if !known.contains(id) {
                    return Err(Status::invalid_argument(format!("unknown device: {id}")));
                }
            }
            self.allocations.lock().unwrap().push(c.devices_ids.clone());
            let mut r = api::ContainerAllocateResponse::default();
            r.envs.insert("VISIBLE_DEVICES".into(), c.devices_ids.join(","));
            r.devices = c
                .devices_ids
                .iter()
                .map(|id| api::DeviceSpec {
                    container_path: format!("/dev/{id}"),
                    host_path: format!("/dev/{id}"),
                    permissions: "rw".into(),
                })
                .collect();
            r.cdi_devices = c
                .devices_ids
                .iter()
                .map(|id| api::CdiDevice {
                    name: format!("example.com/gpu={id}"),
                })
                .collect();
            container_responses.push(r);
        }
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// A running fake plugin.
pub struct FakePlugin {
    pub socket: PathBuf,
    pub options: DevicePluginOptions,
    devices: watch::Sender<Vec<Device>>,
    known: Arc<Mutex<Vec<String>>>,
    /// `:authority` of every request the plugin received.
    pub authorities: Arc<Mutex<Vec<String>>>,
    /// Device IDs of every container allocation.
    pub allocations: Arc<Mutex<Vec<Vec<String>>>>,
    server: JoinHandle<()>,
}

impl FakePlugin {
    /// Serves on `socket` (tonic, stock h2: rejects a path as `:authority`).
    pub async fn serve(socket: &Path, options: DevicePluginOptions, devices: Vec<Device>) -> FakePlugin {
        let listener = UnixListener::bind(socket).expect("bind plugin socket");
        let known = Arc::new(Mutex::new(devices.iter().map(|d| d.id.clone()).collect()));
        let (tx, rx) = watch::channel(devices);
        let authorities = Arc::new(Mutex::new(Vec::new()));
        let allocations = Arc::new(Mutex::new(Vec::new()));
        let plugin = Plugin {
            options,
            devices: rx,
            known: Arc::clone(&known),
            authorities: Arc::clone(&authorities),
            allocations: Arc::clone(&allocations),
        };
        let seen = Arc::clone(&authorities);
        let svc = tower::ServiceBuilder::new()
            .map_request(move |req: tonic::codegen::http::Request<tonic::body::Body>| {
                let a = req.uri().authority().map(|a| a.to_string()).unwrap_or_default();
                seen.lock().unwrap().push(a);
                req
            })
            .service(DevicePluginServer::new(plugin));
        let svc = tonic::service::Routes::new(NamedSvc(svc));
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_routes(svc)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        FakePlugin {
            socket: socket.to_path_buf(),
            options,
            devices: tx,
            known,
            authorities,
            allocations,
            server,
        }
    }

    /// Sends a new device list on every open ListAndWatch stream.
    pub fn set_devices(&self, devices: Vec<Device>) {
        self.known.lock().unwrap().extend(devices.iter().map(|d| d.id.clone()));
        self.devices.send_replace(devices);
    }

    pub fn stop(&self) {
        self.server.abort();
    }

    /// Calls Register on `kubelet_socket` for this plugin.
    pub async fn register(&self, kubelet_socket: &Path, resource: &str) -> Result<(), Status> {
        let endpoint = self.socket.file_name().unwrap().to_string_lossy().into_owned();
        register(kubelet_socket, "v1beta1", resource, &endpoint, Some(self.options)).await
    }
}

impl Drop for FakePlugin {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A Register call as a plugin makes it.
pub async fn register(
    kubelet_socket: &Path,
    version: &str,
    resource: &str,
    endpoint: &str,
    options: Option<DevicePluginOptions>,
) -> Result<(), Status> {
    let channel = test_kubelet::unix_channel(kubelet_socket)
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    RegistrationClient::new(channel)
        .register(api::RegisterRequest {
            version: version.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options,
        })
        .await
        .map(|_| ())
}

/// Keeps the `NamedService` name of the wrapped DevicePlugin server for tonic's router.
#[derive(Clone)]
struct NamedSvc<S>(S);

impl<S> tonic::server::NamedService for NamedSvc<S> {
    const NAME: &'static str = "v1beta1.DevicePlugin";
}

impl<S, R> tower::Service<R> for NamedSvc<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.0.call(req)
    }
}
