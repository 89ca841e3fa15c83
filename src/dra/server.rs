//! The kubelet side of the driver: the plugin-watcher registration service on
//! `<registry_dir>/<driver>-reg.sock` and the DRA node service (`v1`, and `v1beta1` for
//! kubelets 1.32 and 1.33) on `<plugins_dir>/<driver>/dra.sock`, both tonic on Unix sockets.
//! The DRA socket is bound first, so it answers by the time the kubelet sees the registration
//! socket; at stop the registration socket goes first (the kubelet deregisters the plugin).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::net::UnixListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::claims::ClaimRef;
use super::driver::Driver;
use crate::dra_api::registration::registration_server::{Registration, RegistrationServer};
use crate::dra_api::registration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};
use crate::dra_api::{v1, v1beta1};
use crate::host::socket::file_id;

/// The plugin type the kubelet's plugin watcher hands to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The services served, in the order the kubelet should prefer them.
pub const SUPPORTED_SERVICES: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

struct RegistrationService {
    driver: Arc<Driver>,
    endpoint: String,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: self.driver.config.dra.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_SERVICES.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("DRA: the kubelet registered driver {}", self.driver.config.dra.driver);
            self.driver.update_status(|s| {
                s.registered = true;
                s.registered_at = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs());
                s.error = None;
            });
            // A kubelet that just started has deleted the node's slices.
            self.driver.kubelet_registered();
        } else {
            tracing::error!(
                "DRA: the kubelet refused driver {}: {}",
                self.driver.config.dra.driver,
                status.error
            );
            self.driver.update_status(|s| {
                s.registered = false;
                s.error = Some(format!("the kubelet refused the registration: {}", status.error));
            });
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

fn claim_refs(claims: Vec<v1::Claim>) -> Vec<ClaimRef> {
    claims
        .into_iter()
        .map(|c| ClaimRef {
            namespace: c.namespace,
            name: c.name,
            uid: c.uid,
        })
        .collect()
}

async fn prepare(driver: &Driver, request: v1::NodePrepareResourcesRequest) -> v1::NodePrepareResourcesResponse {
    let refs = claim_refs(request.claims);
    let answers = driver.prepare(&refs).await;
    let claims = refs
        .iter()
        .zip(answers)
        .map(|(claim, answer)| {
            let response = match answer {
                Ok(devices) => v1::NodePrepareResourceResponse {
                    devices: devices
                        .into_iter()
                        .map(|d| v1::Device {
                            request_names: vec![d.request],
                            pool_name: d.pool,
                            device_name: d.device,
                            cdi_device_ids: d.cdi_ids,
                            share_id: d.share_id,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(error) => v1::NodePrepareResourceResponse {
                    devices: Vec::new(),
                    error,
                },
            };
            (claim.uid.clone(), response)
        })
        .collect();
    v1::NodePrepareResourcesResponse { claims }
}

async fn unprepare(driver: &Driver, request: v1::NodeUnprepareResourcesRequest) -> v1::NodeUnprepareResourcesResponse {
    let refs = claim_refs(request.claims);
    let answers = driver.unprepare(&refs).await;
    let claims = refs
        .iter()
        .zip(answers)
        .map(|(claim, answer)| {
            (
                claim.uid.clone(),
                v1::NodeUnprepareResourceResponse {
                    error: answer.err().unwrap_or_default(),
                },
            )
        })
        .collect();
    v1::NodeUnprepareResourcesResponse { claims }
}

struct DraV1(Arc<Driver>);

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(prepare(&self.0, request.into_inner()).await))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(unprepare(&self.0, request.into_inner()).await))
    }
}

/// v1beta1 has v1's messages field for field: translated through the wire format.
fn convert<A: Message, B: Message + Default>(a: &A) -> Result<B, Status> {
    B::decode(a.encode_to_vec().as_slice()).map_err(|e| Status::internal(format!("v1beta1 message: {e}")))
}

struct DraV1beta1(Arc<Driver>);

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let answer = prepare(&self.0, convert(request.get_ref())?).await;
        Ok(Response::new(convert(&answer)?))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let answer = unprepare(&self.0, convert(request.get_ref())?).await;
        Ok(Response::new(convert(&answer)?))
    }
}

/// One served socket.
struct Served {
    socket: PathBuf,
    id: Option<(u64, u64)>,
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Served {
    async fn stop(self) {
        let _ = self.shutdown.send(());
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(2), &mut task).await.is_err() {
            task.abort();
        }
        if self.id.is_some() && file_id(&self.socket) == self.id {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// Binds `socket` so that it appears already listening: bound (and listening) under a dot-name
/// the plugin watcher ignores, then moved into place. A watcher that dials the moment the name
/// appears would otherwise find it between `bind` and `listen` and be refused. A live socket of
/// another process there (NVIDIA's DRA driver) is never replaced: the error names its pid
/// ([`crate::host::socket::bind_in_place`]).
fn bind(socket: &Path) -> std::io::Result<(UnixListener, Option<(u64, u64)>)> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let (listener, id) = crate::host::socket::bind_in_place(socket).map_err(|e| match e {
        crate::host::socket::BindError::Io { source, .. } => source,
        in_use => std::io::Error::new(std::io::ErrorKind::AddrInUse, in_use.to_string()),
    })?;
    listener.set_nonblocking(true)?;
    Ok((UnixListener::from_std(listener)?, Some(id)))
}

/// Both sockets, served.
pub struct Sockets {
    dra: Served,
    registration: Served,
}

impl Sockets {
    /// Binds and serves the DRA socket, then the registration socket. `endpoint` is the DRA
    /// socket's path as the kubelet sees it (a host path).
    pub fn start(
        driver: Arc<Driver>,
        dra_socket: &Path,
        registration_socket: &Path,
        endpoint: String,
    ) -> std::io::Result<Sockets> {
        let (listener, id) = bind(dra_socket)?;
        let (shutdown, rx) = oneshot::channel::<()>();
        let d = driver.clone();
        let path = dra_socket.to_path_buf();
        let task = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(DraV1(d.clone())))
                .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(DraV1beta1(d)))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!("DRA service on {} stopped: {e}", path.display());
            }
        });
        let dra = Served {
            socket: dra_socket.to_path_buf(),
            id,
            shutdown,
            task,
        };
        let (listener, id) = match bind(registration_socket) {
            Ok(bound) => bound,
            Err(e) => {
                tokio::spawn(dra.stop());
                return Err(e);
            }
        };
        let (shutdown, rx) = oneshot::channel::<()>();
        let path = registration_socket.to_path_buf();
        let service = RegistrationService { driver, endpoint };
        let task = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!("DRA registration service on {} stopped: {e}", path.display());
            }
        });
        let registration = Served {
            socket: registration_socket.to_path_buf(),
            id,
            shutdown,
            task,
        };
        Ok(Sockets { dra, registration })
    }

    /// Whether both socket files are still the ones bound.
    pub fn intact(&self) -> bool {
        [&self.dra, &self.registration]
            .iter()
            .all(|s| s.id.is_some() && file_id(&s.socket) == s.id)
    }

    /// Stops serving: the registration socket first, so the kubelet deregisters the plugin.
    pub async fn stop(self) {
        self.registration.stop().await;
        self.dra.stop().await;
    }
}
