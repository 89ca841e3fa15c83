//! A kubelet stand-in for device plugin tests.
//!
//! [`TestKubelet`] reproduces what the kubelet's device manager does with device plugins
//! (API `v1beta1`): it serves `Registration` on `<dir>/kubelet.sock`, validates each
//! `Register` call, dials the plugin back synchronously inside `Register` and calls
//! `GetDevicePluginOptions`, then consumes `ListAndWatch` and records every device list.
//! Tests drive `Allocate` / `GetPreferredAllocation` through it, restart it (which deletes
//! every socket in the directory, as a real kubelet restart does) and inspect what it saw.
//!
//! With [`KubeletOptions::legacy_authority`] every call to the plugin carries the HTTP/2
//! `:authority` that kubelets before 1.26 sent (the plugin socket's full path), using the
//! raw HTTP/2 client in [`rawh2`].
//!
//! Its servers take any `:authority` from clients, as the kubelet's grpc-go servers do:
//! grpc-go plugins that dial `kubelet.sock` by path send the path, percent-encoded since
//! grpc-go 1.57, which stock h2 refuses. The workspace's h2 (`vendor/h2`) treats an
//! `:authority` that is not a URI authority as absent, so the stand-in's tonic/hyper servers
//! take them as the agent's do; [`grpcgo`] is a client that sends them as grpc-go does.
//!
//! [`TestKubelet::serve_pod_resources`] also serves the pod-resources API (`v1`) on
//! `<root>/pod-resources/kubelet.sock`, reporting the allocations it made for the pods and
//! containers the test names (see [`pod_resources`]).
//!
//! [`DraKubelet`] (module [`dra`]) is the kubelet's DRA side: it registers DRA plugins through
//! a `plugins_registry` directory as the plugin watcher does, and calls `NodePrepareResources`
//! / `NodeUnprepareResources` (v1 or v1beta1) with the kubelet's checks on the responses.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use prost::Message;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{broadcast, watch};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

pub mod dra;
pub mod grpcgo;
pub mod pod_resources;
pub mod rawh2;
pub mod validate;

/// The generated device plugin API (`v1beta1`), client and server.
pub mod api {
    tonic::include_proto!("v1beta1");
}

/// The generated pod-resources API (`v1`), client and server.
pub mod podresources {
    tonic::include_proto!("v1");
}

/// The plugin-watcher registration API (`pluginregistration`), client and server.
pub mod registration_api {
    tonic::include_proto!("pluginregistration");
}

/// The DRA node service, `v1` and `v1beta1`, client and server.
pub mod dra_api {
    /// `k8s.io.kubelet.pkg.apis.dra.v1`.
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1`.
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

pub use dra::{ClaimRef, DraError, DraKubelet, DraOptions, DraRegistration, PreparedDevice, cdi_devices_for};
use pod_resources::{Holding, PodResourcesServer};
pub use pod_resources::{POD_RESOURCES_DIR, POD_RESOURCES_SOCKET, PodContainer};

use api::device_plugin_client::DevicePluginClient;
use api::registration_server::{Registration, RegistrationServer};

/// File name of the kubelet's registration socket.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// The one file `CleanupPluginDirectory` keeps.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";
/// The kubelet's dial-back timeout inside `Register`.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// `KubeletPreStartContainerRPCTimeoutInSecs`.
pub const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest device ID the API allows.
pub const MAX_DEVICE_ID_LEN: usize = 63;

/// How the stand-in behaves.
#[derive(Debug, Clone)]
pub struct KubeletOptions {
    /// Send the plugin socket's full path as HTTP/2 `:authority` on every call to a plugin
    /// (kubelets before 1.26); otherwise `localhost` (1.26 and later).
    pub legacy_authority: bool,
    /// Reject every `Register` call with this message (after the request checks).
    pub reject_registration: Option<String>,
    /// Timeout for the dial-back + `GetDevicePluginOptions` inside `Register` (10 s).
    pub dial_timeout: Duration,
}

impl Default for KubeletOptions {
    fn default() -> Self {
        KubeletOptions {
            legacy_authority: false,
            reject_registration: None,
            dial_timeout: DIAL_TIMEOUT,
        }
    }
}

/// What became of a `Register` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    /// The error message returned to the plugin.
    Rejected(String),
}

/// One `Register` call, accepted or rejected.
#[derive(Debug, Clone)]
pub struct RegistrationRecord {
    pub resource: String,
    pub endpoint: String,
    pub version: String,
    /// `RegisterRequest.options` as sent by the plugin.
    pub options: Option<api::DevicePluginOptions>,
    /// What `GetDevicePluginOptions` returned on the dial-back (what the kubelet uses);
    /// `None` if the call was rejected before or during the dial-back.
    pub plugin_options: Option<api::DevicePluginOptions>,
    /// When the `Register` call arrived.
    pub at: Instant,
    pub outcome: Outcome,
    /// Which kubelet instance saw it: 1 for the first, +1 per restart.
    pub kubelet_instance: u64,
}

impl RegistrationRecord {
    pub fn is_accepted(&self) -> bool {
        self.outcome == Outcome::Accepted
    }
}

/// Something the stand-in saw, in order (see [`TestKubelet::subscribe`]).
#[derive(Debug, Clone)]
pub enum Event {
    /// A kubelet instance started serving `socket`.
    Serving {
        socket: PathBuf,
        at: Instant,
    },
    /// The kubelet stopped (or is restarting); every plugin connection was dropped.
    Stopped {
        at: Instant,
    },
    Registration(RegistrationRecord),
    /// A `ListAndWatch` message (the full device list).
    Devices {
        resource: String,
        at: Instant,
        devices: Vec<api::Device>,
    },
    /// The `ListAndWatch` stream of `resource` ended.
    Disconnected {
        resource: String,
        at: Instant,
        reason: String,
    },
    /// A protocol violation by a plugin (see [`TestKubelet::violations`]).
    Violation {
        at: Instant,
        message: String,
    },
}

/// Errors of the `wait_for_*` methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Nothing matching arrived in time; the message says what was seen instead.
    Timeout(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Timeout(m) => write!(f, "timed out: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// How the stand-in talks to one plugin.
#[derive(Clone)]
enum PluginClient {
    /// tonic, `:authority` = `localhost`.
    Tonic(DevicePluginClient<Channel>),
    /// Raw HTTP/2 with the given `:authority` (one connection per call).
    Raw { socket: PathBuf, authority: String },
}

/// The HTTP/2 `:path` of a DevicePlugin method.
fn method_path(method: &str) -> String {
    format!("/v1beta1.DevicePlugin/{method}")
}

impl PluginClient {
    async fn dial(socket: &Path, legacy: bool) -> Result<PluginClient, String> {
        if legacy {
            // Calls open their own connections; check now that one can be opened, as the
            // kubelet's blocking dial does.
            UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
            return Ok(PluginClient::Raw {
                socket: socket.to_path_buf(),
                authority: socket.to_string_lossy().into_owned(),
            });
        }
        let channel = unix_channel(socket).await.map_err(|e| error_chain(&e))?;
        Ok(PluginClient::Tonic(DevicePluginClient::new(channel)))
    }

    async fn options(&self) -> Result<api::DevicePluginOptions, Status> {
        match self {
            PluginClient::Tonic(c) => Ok(c.clone().get_device_plugin_options(api::Empty {}).await?.into_inner()),
            PluginClient::Raw { socket, authority } => {
                rawh2::unary(
                    socket,
                    authority,
                    &method_path("GetDevicePluginOptions"),
                    &api::Empty {},
                )
                .await
            }
        }
    }

    async fn allocate(&self, req: api::AllocateRequest) -> Result<api::AllocateResponse, Status> {
        match self {
            PluginClient::Tonic(c) => Ok(c.clone().allocate(req).await?.into_inner()),
            PluginClient::Raw { socket, authority } => {
                rawh2::unary(socket, authority, &method_path("Allocate"), &req).await
            }
        }
    }

    async fn preferred(
        &self,
        req: api::PreferredAllocationRequest,
    ) -> Result<api::PreferredAllocationResponse, Status> {
        match self {
            PluginClient::Tonic(c) => Ok(c.clone().get_preferred_allocation(req).await?.into_inner()),
            PluginClient::Raw { socket, authority } => {
                rawh2::unary(socket, authority, &method_path("GetPreferredAllocation"), &req).await
            }
        }
    }

    async fn pre_start(&self, req: api::PreStartContainerRequest) -> Result<api::PreStartContainerResponse, Status> {
        match self {
            PluginClient::Tonic(c) => Ok(c.clone().pre_start_container(req).await?.into_inner()),
            PluginClient::Raw { socket, authority } => {
                rawh2::unary(socket, authority, &method_path("PreStartContainer"), &req).await
            }
        }
    }

    /// Consumes `ListAndWatch`, calling `on_list` for each message, until the stream ends.
    async fn list_and_watch(&self, mut on_list: impl FnMut(Vec<api::Device>)) -> Result<(), Status> {
        match self {
            PluginClient::Tonic(c) => {
                let mut stream = c.clone().list_and_watch(api::Empty {}).await?.into_inner();
                while let Some(msg) = stream.message().await? {
                    on_list(msg.devices);
                }
            }
            PluginClient::Raw { socket, authority } => {
                let mut call = rawh2::RawCall::start(socket, authority, &method_path("ListAndWatch"), &[])
                    .await
                    .map_err(|e| Status::unavailable(format!("dialing {}: {e}", socket.display())))?;
                while let Some(bytes) = call.message().await? {
                    let msg = api::ListAndWatchResponse::decode(bytes.as_slice())
                        .map_err(|e| Status::internal(format!("decoding a ListAndWatch message: {e}")))?;
                    on_list(msg.devices);
                }
            }
        }
        Ok(())
    }
}

/// A tonic channel to a gRPC server on a Unix socket, with `:authority` `localhost` (what
/// kubelets since 1.26 send). Connects eagerly. Also handy for test plugins that need to
/// call `Register` on `kubelet.sock`.
pub async fn unix_channel(path: impl AsRef<Path>) -> Result<Channel, tonic::transport::Error> {
    let path = path.as_ref().to_path_buf();
    Endpoint::try_from("http://localhost")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// An error and its sources on one line (tonic's transport errors say little on their own).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let t = src.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = src.source();
    }
    s
}

struct Update {
    at: Instant,
    devices: Vec<api::Device>,
    stream: u64,
}

struct PluginEndpoint {
    options: api::DevicePluginOptions,
    client: PluginClient,
    stream: u64,
    connected: bool,
    closed_reason: Option<String>,
    task: Option<AbortHandle>,
}

#[derive(Default)]
struct State {
    /// The kubelet instance now serving, if any.
    instance: Option<u64>,
    instances: u64,
    registrations: Vec<RegistrationRecord>,
    wait_cursor: HashMap<String, usize>,
    wait_floor: usize,
    endpoints: HashMap<String, PluginEndpoint>,
    updates: HashMap<String, Vec<Update>>,
    violations: Vec<String>,
    streams: u64,
    /// Devices held by pods' containers, what the pod-resources API reports.
    holdings: Vec<Holding>,
    /// Pods made up for plain `allocate` calls.
    pods_made: u64,
}

struct Inner {
    dir: PathBuf,
    opts: KubeletOptions,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    events: broadcast::Sender<Event>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self, event: Event) {
        let _ = self.events.send(event);
        self.changed.send_modify(|n| *n += 1);
    }

    fn violation(&self, st: &mut State, message: String) {
        st.violations.push(message.clone());
        let _ = self.events.send(Event::Violation {
            at: Instant::now(),
            message,
        });
    }

    fn record_rejection(&self, instance: u64, mut rec: RegistrationRecord, msg: &str) -> Status {
        rec.outcome = Outcome::Rejected(msg.to_string());
        let mut st = self.lock();
        if st.instance == Some(instance) {
            st.registrations.push(rec.clone());
            drop(st);
            self.notify(Event::Registration(rec));
        }
        // The kubelet returns a plain Go error, which gRPC turns into code Unknown.
        Status::unknown(msg)
    }

    async fn register(self: Arc<Self>, instance: u64, req: api::RegisterRequest) -> Result<(), Status> {
        let rec = RegistrationRecord {
            resource: req.resource_name.clone(),
            endpoint: req.endpoint.clone(),
            version: req.version.clone(),
            options: req.options,
            plugin_options: None,
            at: Instant::now(),
            outcome: Outcome::Accepted,
            kubelet_instance: instance,
        };
        let checks = validate::check_version(&req.version)
            .and_then(|()| validate::check_extended_resource_name(&req.resource_name))
            .and_then(|()| validate::check_endpoint(&req.endpoint))
            .and_then(|()| match &self.opts.reject_registration {
                Some(msg) => Err(msg.clone()),
                None => Ok(()),
            });
        if let Err(msg) = checks {
            return Err(self.record_rejection(instance, rec, &msg));
        }

        // Synchronously dial the plugin back and ask for its options, as the kubelet does.
        let socket = self.dir.join(&req.endpoint);
        let legacy = self.opts.legacy_authority;
        let dial = async {
            let client = PluginClient::dial(&socket, legacy).await.map_err(|e| {
                format!(
                    "cannot connect to {}: {e} (a plugin must be serving its socket before it \
                     calls Register)",
                    socket.display()
                )
            })?;
            let options = client.options().await.map_err(|s| {
                format!(
                    "GetDevicePluginOptions on {} failed: {} ({:?})",
                    socket.display(),
                    s.message(),
                    s.code()
                )
            })?;
            Ok::<_, String>((client, options))
        };
        let (client, plugin_options) = match tokio::time::timeout(self.opts.dial_timeout, dial).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                let msg = format!("failed to dial device plugin: dial-back failed: {e}");
                return Err(self.record_rejection(instance, rec, &msg));
            }
            Err(_) => {
                let msg = format!(
                    "failed to dial device plugin: dial-back to {} and GetDevicePluginOptions \
                     did not complete within {:?} (a plugin must serve its socket before it \
                     calls Register)",
                    socket.display(),
                    self.opts.dial_timeout
                );
                return Err(self.record_rejection(instance, rec, &msg));
            }
        };

        let mut rec = rec;
        rec.plugin_options = Some(plugin_options);
        let resource = req.resource_name.clone();
        let mut st = self.lock();
        if st.instance != Some(instance) {
            return Err(Status::unavailable("kubelet stopped during registration"));
        }
        let sent = req.options.unwrap_or_default();
        if sent != plugin_options {
            self.violation(
                &mut st,
                format!(
                    "{resource}: RegisterRequest.options {sent:?} differ from \
                     GetDevicePluginOptions {plugin_options:?} (the kubelet uses the latter)"
                ),
            );
        }
        let mut replaced = None;
        if let Some(old) = st.endpoints.remove(&resource) {
            if let Some(t) = &old.task {
                t.abort();
            }
            if old.connected {
                replaced = Some(Event::Disconnected {
                    resource: resource.clone(),
                    at: Instant::now(),
                    reason: format!("replaced by a new registration (endpoint {})", req.endpoint),
                });
            }
        }
        st.streams += 1;
        let stream = st.streams;
        let task = tokio::spawn(self.clone().watch(resource.clone(), stream, client.clone()));
        st.endpoints.insert(
            resource,
            PluginEndpoint {
                options: plugin_options,
                client,
                stream,
                connected: true,
                closed_reason: None,
                task: Some(task.abort_handle()),
            },
        );
        st.registrations.push(rec.clone());
        drop(st);
        if let Some(ev) = replaced {
            self.notify(ev);
        }
        self.notify(Event::Registration(rec));
        Ok(())
    }

    /// The kubelet's ListAndWatch goroutine for one registration.
    async fn watch(self: Arc<Self>, resource: String, stream: u64, client: PluginClient) {
        let result = client
            .list_and_watch(|devices| self.record_devices(&resource, stream, devices))
            .await;
        let reason = match result {
            Ok(()) => "the plugin ended the ListAndWatch stream".to_string(),
            Err(s) => format!("ListAndWatch failed: {} ({:?})", s.message(), s.code()),
        };
        let mut st = self.lock();
        let Some(ep) = st.endpoints.get_mut(&resource).filter(|e| e.stream == stream) else {
            return;
        };
        ep.connected = false;
        ep.closed_reason = Some(reason.clone());
        ep.task = None;
        drop(st);
        self.notify(Event::Disconnected {
            resource,
            at: Instant::now(),
            reason,
        });
    }

    fn record_devices(&self, resource: &str, stream: u64, devices: Vec<api::Device>) {
        let at = Instant::now();
        let mut st = self.lock();
        if st.endpoints.get(resource).map(|e| e.stream) != Some(stream) {
            return;
        }
        for v in list_violations(resource, &devices) {
            self.violation(&mut st, v);
        }
        st.updates.entry(resource.to_string()).or_default().push(Update {
            at,
            devices: devices.clone(),
            stream,
        });
        drop(st);
        self.notify(Event::Devices {
            resource: resource.to_string(),
            at,
            devices,
        });
    }

    /// The connection to a registered, connected plugin.
    fn client_for(&self, resource: &str) -> Result<(PluginClient, api::DevicePluginOptions), Status> {
        let st = self.lock();
        match st.endpoints.get(resource) {
            None => Err(Status::failed_precondition(format!(
                "no device plugin is registered for resource {resource}"
            ))),
            Some(ep) if !ep.connected => Err(Status::unavailable(format!(
                "endpoint for resource {resource} has been stopped: {}",
                ep.closed_reason.as_deref().unwrap_or("stream closed")
            ))),
            Some(ep) => Ok((ep.client.clone(), ep.options)),
        }
    }
}

/// What a ListAndWatch message breaks of the API's rules.
fn list_violations(resource: &str, devices: &[api::Device]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for d in devices {
        if d.id.is_empty() {
            out.push(format!("{resource}: ListAndWatch sent a device with an empty ID"));
        }
        if d.id.len() > MAX_DEVICE_ID_LEN {
            out.push(format!(
                "{resource}: device ID {:?} is {} characters long; the API allows at most {MAX_DEVICE_ID_LEN}",
                d.id,
                d.id.len()
            ));
        }
        if !seen.insert(d.id.as_str()) {
            out.push(format!(
                "{resource}: device ID {:?} appears more than once in one ListAndWatch message",
                d.id
            ));
        }
        if d.health != "Healthy" && d.health != "Unhealthy" {
            out.push(format!(
                "{resource}: device {:?} has health {:?}; the API knows \"Healthy\" and \"Unhealthy\"",
                d.id, d.health
            ));
        }
    }
    out
}

struct RegistrationSvc {
    inner: Arc<Inner>,
    instance: u64,
    cancel: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl Registration for RegistrationSvc {
    async fn register(&self, request: Request<api::RegisterRequest>) -> Result<Response<api::Empty>, Status> {
        let mut cancel = self.cancel.clone();
        let work = self.inner.clone().register(self.instance, request.into_inner());
        tokio::select! {
            r = work => r.map(|()| Response::new(api::Empty {})),
            _ = cancel.wait_for(|stopped| *stopped) => {
                Err(Status::unavailable("kubelet is shutting down"))
            }
        }
    }
}

/// One serving kubelet instance.
struct Server {
    accept: JoinHandle<()>,
    cancel: watch::Sender<bool>,
}

/// The kubelet stand-in. Dropping it stops it like [`TestKubelet::stop`].
pub struct TestKubelet {
    inner: Arc<Inner>,
    server: Mutex<Option<Server>>,
    pod_resources: Mutex<Option<PodResourcesServer>>,
}

impl TestKubelet {
    /// Like the kubelet's device manager start: creates `dir` (mode 0750, subject to the
    /// umask), removes every socket in it (the checkpoint file and anything that is not a
    /// socket stay), binds `dir/kubelet.sock` and serves `Registration`.
    pub async fn start(dir: &Path, opts: KubeletOptions) -> io::Result<TestKubelet> {
        let (changed, _) = watch::channel(0);
        let (events, _) = broadcast::channel(4096);
        let inner = Arc::new(Inner {
            dir: dir.to_path_buf(),
            opts,
            state: Mutex::new(State::default()),
            changed,
            events,
        });
        let kubelet = TestKubelet {
            inner,
            server: Mutex::new(None),
            pod_resources: Mutex::new(None),
        };
        kubelet.serve()?;
        Ok(kubelet)
    }

    fn server(&self) -> MutexGuard<'_, Option<Server>> {
        self.server.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn serve(&self) -> io::Result<()> {
        let mut server = self.server();
        if server.is_some() {
            drop(server);
            self.halt("kubelet restarted");
            server = self.server();
        }
        let dir = &self.inner.dir;
        std::fs::DirBuilder::new().recursive(true).mode(0o750).create(dir)?;
        cleanup_plugin_directory(dir)?;
        let socket = self.socket_path();
        let listener = UnixListener::bind(&socket)?;
        let instance = {
            let mut st = self.inner.lock();
            st.instances += 1;
            st.instance = Some(st.instances);
            st.instances
        };
        let (cancel, cancel_rx) = watch::channel(false);
        let routes = tonic::service::Routes::new(RegistrationServer::new(RegistrationSvc {
            inner: self.inner.clone(),
            instance,
            cancel: cancel_rx,
        }));
        let accept = tokio::spawn(async move {
            // Connections live in this set, so aborting this task drops them all at once,
            // as a dying kubelet process would.
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            let svc = TowerToHyperService::new(routes.clone());
                            conns.spawn(async move {
                                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(stream), svc)
                                    .await;
                            });
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        *server = Some(Server { accept, cancel });
        drop(server);
        self.inner.notify(Event::Serving {
            socket,
            at: Instant::now(),
        });
        Ok(())
    }

    /// Stops serving and drops every plugin connection and stream.
    fn halt(&self, reason: &str) {
        let Some(server) = self.server().take() else {
            return;
        };
        let _ = server.cancel.send(true);
        server.accept.abort();
        let now = Instant::now();
        let mut closed = Vec::new();
        {
            let mut st = self.inner.lock();
            st.instance = None;
            for (resource, ep) in st.endpoints.drain() {
                if let Some(t) = ep.task {
                    t.abort();
                }
                if ep.connected {
                    closed.push(resource);
                }
            }
        }
        closed.sort();
        for resource in closed {
            self.inner.notify(Event::Disconnected {
                resource,
                at: now,
                reason: reason.to_string(),
            });
        }
        self.inner.notify(Event::Stopped { at: now });
    }

    /// The device plugin directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// `dir/kubelet.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.inner.dir.join(KUBELET_SOCKET)
    }

    /// The options this stand-in runs with.
    pub fn kubelet_options(&self) -> &KubeletOptions {
        &self.inner.opts
    }

    /// Every `Register` call seen (accepted or rejected), in order, across restarts.
    pub fn registrations(&self) -> Vec<RegistrationRecord> {
        self.inner.lock().registrations.clone()
    }

    /// Waits for the next accepted registration of `resource`: the earliest one not yet
    /// returned by this method and not from before the last [`restart`](Self::restart).
    pub async fn wait_for_registration(&self, resource: &str, timeout: Duration) -> Result<RegistrationRecord, Error> {
        self.wait_registration(resource, timeout, None).await
    }

    /// Waits for the first accepted registration of `resource` that arrived at or after
    /// `since` (does not move the cursor of [`wait_for_registration`](Self::wait_for_registration)).
    pub async fn wait_for_registration_since(
        &self,
        resource: &str,
        since: Instant,
        timeout: Duration,
    ) -> Result<RegistrationRecord, Error> {
        self.wait_registration(resource, timeout, Some(since)).await
    }

    async fn wait_registration(
        &self,
        resource: &str,
        timeout: Duration,
        since: Option<Instant>,
    ) -> Result<RegistrationRecord, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.inner.changed.subscribe();
        loop {
            {
                let mut st = self.inner.lock();
                let from = match since {
                    Some(_) => 0,
                    None => st.wait_cursor.get(resource).copied().unwrap_or(0).max(st.wait_floor),
                };
                let found = st
                    .registrations
                    .iter()
                    .enumerate()
                    .skip(from)
                    .find(|(_, r)| r.resource == resource && r.is_accepted() && since.is_none_or(|s| r.at >= s));
                if let Some((i, r)) = found {
                    let r = r.clone();
                    if since.is_none() {
                        st.wait_cursor.insert(resource.to_string(), i + 1);
                    }
                    return Ok(r);
                }
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(Error::Timeout(self.describe_registrations(resource, timeout)));
            }
        }
    }

    fn describe_registrations(&self, resource: &str, timeout: Duration) -> String {
        let st = self.inner.lock();
        let mut s = format!("no new accepted registration of {resource} within {timeout:?}");
        let seen: Vec<String> = st
            .registrations
            .iter()
            .map(|r| match &r.outcome {
                Outcome::Accepted => format!("{} accepted (endpoint {})", r.resource, r.endpoint),
                Outcome::Rejected(m) => format!("{} rejected: {m}", r.resource),
            })
            .collect();
        if seen.is_empty() {
            s.push_str("; no Register call was seen at all");
        } else {
            s.push_str("; Register calls seen: ");
            s.push_str(&seen.join("; "));
        }
        s
    }

    /// The latest device list `resource` sent on ListAndWatch (even if its stream has since
    /// closed; see [`is_connected`](Self::is_connected)); `None` if none was received.
    pub fn devices(&self, resource: &str) -> Option<Vec<api::Device>> {
        let st = self.inner.lock();
        st.updates
            .get(resource)
            .and_then(|u| u.last())
            .map(|u| u.devices.clone())
    }

    /// Every device list `resource` sent, with the time it arrived, across restarts.
    pub fn updates(&self, resource: &str) -> Vec<(Instant, Vec<api::Device>)> {
        let st = self.inner.lock();
        st.updates
            .get(resource)
            .map(|u| u.iter().map(|u| (u.at, u.devices.clone())).collect())
            .unwrap_or_default()
    }

    /// Waits for a device list of `resource` for which `pred` holds: the latest list if it
    /// came on the stream that is open now, or any list arriving while waiting.
    pub async fn wait_for_devices(
        &self,
        resource: &str,
        timeout: Duration,
        pred: impl Fn(&[api::Device]) -> bool,
    ) -> Result<Vec<api::Device>, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.inner.changed.subscribe();
        let mut checked: Option<usize> = None;
        loop {
            // Copy the candidates out: `pred` runs without the lock held.
            let candidates: Vec<Vec<api::Device>> = {
                let st = self.inner.lock();
                let ups: &[Update] = st.updates.get(resource).map(|u| &u[..]).unwrap_or(&[]);
                let c = match checked {
                    None => {
                        let open = st.endpoints.get(resource).filter(|e| e.connected).map(|e| e.stream);
                        ups.last()
                            .filter(|u| Some(u.stream) == open)
                            .map(|u| vec![u.devices.clone()])
                            .unwrap_or_default()
                    }
                    Some(n) => ups[n..].iter().map(|u| u.devices.clone()).collect(),
                };
                checked = Some(ups.len());
                c
            };
            if let Some(found) = candidates.into_iter().find(|d| pred(d)) {
                return Ok(found);
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                let latest = match self.devices(resource) {
                    Some(d) => format!("latest list: {}", summarize(&d)),
                    None => "no list received".to_string(),
                };
                return Err(Error::Timeout(format!(
                    "no matching device list for {resource} within {timeout:?} (stream {}; {latest})",
                    if self.is_connected(resource) {
                        "open"
                    } else {
                        "not open"
                    }
                )));
            }
        }
    }

    /// Waits until the ListAndWatch stream of `resource` is not open (never registered,
    /// ended, or dropped by a restart).
    pub async fn wait_for_disconnect(&self, resource: &str, timeout: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.inner.changed.subscribe();
        loop {
            if !self.is_connected(resource) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(Error::Timeout(format!(
                    "the ListAndWatch stream of {resource} was still open after {timeout:?}"
                )));
            }
        }
    }

    /// Registered resources whose ListAndWatch stream is open, sorted.
    pub fn resources(&self) -> Vec<String> {
        let st = self.inner.lock();
        let mut v: Vec<String> = st
            .endpoints
            .iter()
            .filter(|(_, e)| e.connected)
            .map(|(r, _)| r.clone())
            .collect();
        v.sort();
        v
    }

    /// Whether `resource` is registered with this kubelet instance and its ListAndWatch
    /// stream is open.
    pub fn is_connected(&self, resource: &str) -> bool {
        self.inner.lock().endpoints.get(resource).is_some_and(|e| e.connected)
    }

    /// Why the stream of `resource` closed, if it is registered and closed.
    pub fn disconnect_reason(&self, resource: &str) -> Option<String> {
        self.inner
            .lock()
            .endpoints
            .get(resource)
            .and_then(|e| e.closed_reason.clone())
    }

    /// Protocol violations seen (device IDs over 63 characters, empty or duplicate IDs,
    /// health other than `Healthy`/`Unhealthy`, `RegisterRequest.options` that differ from
    /// `GetDevicePluginOptions`, more than one container response for one container).
    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().violations.clone()
    }

    /// Everything seen from now on, in order. The receiver lags (drops) past 4096 events.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    /// `Allocate` for one container with `device_ids`, as the kubelet does at container
    /// creation (no timeout). The IDs are passed through unchecked. On success the pod-resources
    /// API reports the devices as held by a made-up container `default/test-pod-<n>`, `main`.
    pub async fn allocate(
        &self,
        resource: &str,
        device_ids: &[&str],
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let resp = self.allocate_one(resource, device_ids).await?;
        let holder = {
            let mut st = self.inner.lock();
            st.pods_made += 1;
            PodContainer::new("default", &format!("test-pod-{}", st.pods_made), "main")
        };
        self.assign(resource, device_ids, &holder);
        Ok(resp)
    }

    /// [`allocate`](Self::allocate) for the container `holder`: on success the pod-resources
    /// API reports `device_ids` of `resource` as held by it.
    pub async fn allocate_for(
        &self,
        resource: &str,
        device_ids: &[&str],
        holder: &PodContainer,
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let resp = self.allocate_one(resource, device_ids).await?;
        self.assign(resource, device_ids, holder);
        Ok(resp)
    }

    /// Records `device_ids` of `resource` as held by `holder` without calling any plugin (for
    /// tests of pod-resources clients that run no device plugin).
    pub fn assign(&self, resource: &str, device_ids: &[&str], holder: &PodContainer) {
        self.inner.lock().holdings.push(Holding {
            holder: holder.clone(),
            resource: resource.to_string(),
            device_ids: device_ids.iter().map(|s| s.to_string()).collect(),
        });
    }

    /// The pod `namespace/pod` ended: its containers hold nothing any more.
    pub fn release(&self, namespace: &str, pod: &str) {
        self.inner
            .lock()
            .holdings
            .retain(|h| h.holder.namespace != namespace || h.holder.pod != pod);
    }

    /// What the pod-resources `List` call answers now.
    pub fn pod_resources(&self) -> Vec<podresources::PodResources> {
        pod_resources::list(&self.inner.lock().holdings)
    }

    /// Serves the pod-resources API on `<root>/pod-resources/kubelet.sock` (the directory is
    /// created with mode 0750, a stale socket replaced) and returns the socket's path. `root`
    /// plays the kubelet's root directory (`/var/lib/kubelet`). The server keeps serving across
    /// [`restart`](Self::restart); a second call moves it to the new root.
    pub fn serve_pod_resources(&self, root: &Path) -> io::Result<PathBuf> {
        let mut slot = self.pod_resources.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = slot.take() {
            old.stop();
        }
        let server = PodResourcesServer::start(root, self.inner.clone())?;
        let socket = server.socket.clone();
        *slot = Some(server);
        Ok(socket)
    }

    /// The pod-resources socket, while it is served.
    pub fn pod_resources_socket(&self) -> Option<PathBuf> {
        let slot = self.pod_resources.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|s| s.socket.clone())
    }

    fn stop_pod_resources(&self) {
        let mut slot = self.pod_resources.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(server) = slot.take() {
            server.stop();
        }
    }

    async fn allocate_one(
        &self,
        resource: &str,
        device_ids: &[&str],
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let req = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: device_ids.iter().map(|s| s.to_string()).collect(),
            }],
        };
        let resp = self.allocate_raw(resource, req).await?;
        let n = resp.container_responses.len();
        if n > 1 {
            let mut st = self.inner.lock();
            self.inner.violation(
                &mut st,
                format!("{resource}: Allocate returned {n} container responses for 1 container request"),
            );
        }
        resp.container_responses
            .into_iter()
            .next()
            .ok_or_else(|| Status::unknown("no containers return in allocation response"))
    }

    /// `Allocate` with any request.
    pub async fn allocate_raw(
        &self,
        resource: &str,
        req: api::AllocateRequest,
    ) -> Result<api::AllocateResponse, Status> {
        let (client, _) = self.inner.client_for(resource)?;
        client.allocate(req).await
    }

    /// `GetPreferredAllocation` for one container; fails without calling the plugin if it did
    /// not set `get_preferred_allocation_available` (the kubelet would not call it).
    pub async fn preferred_allocation(
        &self,
        resource: &str,
        available: &[&str],
        must_include: &[&str],
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let (client, options) = self.inner.client_for(resource)?;
        if !options.get_preferred_allocation_available {
            return Err(Status::failed_precondition(format!(
                "the plugin for {resource} did not set get_preferred_allocation_available, so \
                 the kubelet does not call GetPreferredAllocation"
            )));
        }
        let req = api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.iter().map(|s| s.to_string()).collect(),
                must_include_device_i_ds: must_include.iter().map(|s| s.to_string()).collect(),
                allocation_size: size,
            }],
        };
        let resp = client.preferred(req).await?;
        resp.container_responses
            .into_iter()
            .next()
            .map(|c| c.device_i_ds)
            .ok_or_else(|| Status::unknown("no containers in the preferred allocation response"))
    }

    /// `PreStartContainer` (30 s timeout); fails without calling the plugin if it did not set
    /// `pre_start_required`.
    pub async fn pre_start_container(&self, resource: &str, device_ids: &[&str]) -> Result<(), Status> {
        let (client, options) = self.inner.client_for(resource)?;
        if !options.pre_start_required {
            return Err(Status::failed_precondition(format!(
                "the plugin for {resource} did not set pre_start_required, so the kubelet does \
                 not call PreStartContainer"
            )));
        }
        let req = api::PreStartContainerRequest {
            devices_ids: device_ids.iter().map(|s| s.to_string()).collect(),
        };
        match tokio::time::timeout(PRE_START_TIMEOUT, client.pre_start(req)).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(Status::deadline_exceeded("PreStartContainer took longer than 30 s")),
        }
    }

    /// The options `GetDevicePluginOptions` returned when `resource` registered with this
    /// kubelet instance (what the kubelet acts on).
    pub async fn options(&self, resource: &str) -> Option<api::DevicePluginOptions> {
        self.inner.lock().endpoints.get(resource).map(|e| e.options)
    }

    /// Calls `GetDevicePluginOptions` on the registered plugin again.
    pub async fn fetch_options(&self, resource: &str) -> Result<api::DevicePluginOptions, Status> {
        let (client, _) = self.inner.client_for(resource)?;
        client.options().await
    }

    /// A kubelet restart: stops serving, drops every plugin connection and stream, then, as
    /// the new kubelet's `CleanupPluginDirectory` does, deletes every socket in the
    /// directory (the old `kubelet.sock` and the plugins' sockets) and serves a new
    /// `kubelet.sock`. Plugins must re-register; earlier records stay.
    pub async fn restart(&self) -> io::Result<()> {
        self.restart_with_downtime(Duration::ZERO).await
    }

    /// [`restart`](Self::restart) with `downtime` between the old kubelet dying (its
    /// `kubelet.sock` stays, refusing connections) and the new one cleaning up and serving.
    pub async fn restart_with_downtime(&self, downtime: Duration) -> io::Result<()> {
        self.halt("kubelet restarted");
        {
            let mut st = self.inner.lock();
            st.wait_floor = st.registrations.len();
        }
        if !downtime.is_zero() {
            tokio::time::sleep(downtime).await;
        }
        self.serve()
    }

    /// Stops serving, drops every plugin connection and stream and removes `kubelet.sock` (and
    /// the pod-resources socket); the plugins' sockets are left alone.
    pub async fn stop(self) {
        self.halt("kubelet stopped");
        let _ = std::fs::remove_file(self.socket_path());
        self.stop_pod_resources();
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        if self.server().is_some() {
            self.halt("kubelet stopped");
            let _ = std::fs::remove_file(self.socket_path());
        }
        self.stop_pod_resources();
    }
}

/// Removes every socket in `dir` except the checkpoint file, as newer kubelets'
/// `CleanupPluginDirectory` does; returns the removed paths.
pub fn cleanup_plugin_directory(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name() == CHECKPOINT_FILE {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.file_type().is_socket() {
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// "3 devices (2 Healthy, 1 Unhealthy)".
pub fn summarize(devices: &[api::Device]) -> String {
    let healthy = devices.iter().filter(|d| d.health == "Healthy").count();
    format!(
        "{} devices ({healthy} Healthy, {} not)",
        devices.len(),
        devices.len() - healthy
    )
}

/// NUMA node IDs of a device, e.g. `0` or `0,1`; `-` if none.
pub fn numa_nodes(device: &api::Device) -> String {
    match &device.topology {
        Some(t) if !t.nodes.is_empty() => t.nodes.iter().map(|n| n.id.to_string()).collect::<Vec<_>>().join(","),
        _ => "-".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, health: &str) -> api::Device {
        api::Device {
            id: id.into(),
            health: health.into(),
            topology: None,
        }
    }

    #[test]
    fn violations_in_a_list() {
        assert!(list_violations("r/x", &[dev("a", "Healthy"), dev("b", "Unhealthy")]).is_empty());
        let long = "G".repeat(64);
        let v = list_violations(
            "r/x",
            &[
                dev(&long, "Healthy"),
                dev("a", "healthy"),
                dev("a", "Healthy"),
                dev("", "Healthy"),
            ],
        );
        assert_eq!(v.len(), 4, "{v:?}");
        assert!(v[0].contains("64 characters"));
        assert!(list_violations("r/x", &[dev(&"G".repeat(63), "Healthy")]).is_empty());
    }

    #[test]
    fn cleanup_keeps_checkpoint_and_plain_files() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("plugin.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let ck = dir.path().join(CHECKPOINT_FILE);
        std::fs::write(&ck, "{}").unwrap();
        std::fs::write(dir.path().join("DEPRECATION"), "").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let removed = cleanup_plugin_directory(dir.path()).unwrap();
        assert_eq!(removed, vec![sock.clone()]);
        assert!(!sock.exists());
        assert!(ck.exists());
        assert!(dir.path().join("DEPRECATION").exists());
    }

    #[test]
    fn numa_and_summary() {
        let mut d = dev("a", "Healthy");
        assert_eq!(numa_nodes(&d), "-");
        d.topology = Some(api::TopologyInfo {
            nodes: vec![api::NumaNode { id: 0 }, api::NumaNode { id: 1 }],
        });
        assert_eq!(numa_nodes(&d), "0,1");
        assert_eq!(summarize(&[d, dev("b", "Unhealthy")]), "2 devices (1 Healthy, 1 not)");
    }
}
