//! The kubelet's DRA side: the plugin watcher's registration of DRA plugins and the DRA node
//! service client (`NodePrepareResources` / `NodeUnprepareResources`).
//!
//! [`DraKubelet`] watches a registry directory (the kubelet's `plugins_registry`) for Unix
//! sockets, runs the plugin watcher's registration sequence on each new one (dial, `GetInfo`
//! with a 1 s timeout, the DRA handler's checks, `NotifyRegistrationStatus`), and keeps one
//! client channel per registered plugin. Removing the registration socket deregisters the
//! plugin. Tests call [`DraKubelet::prepare`] / [`DraKubelet::unprepare`] as the kubelet does
//! before a pod starts and after it ends, with the kubelet's checks on the responses.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use crate::dra_api::{v1, v1beta1};
use crate::registration_api::registration_client::RegistrationClient;
use crate::registration_api::{InfoRequest, PluginInfo, RegistrationStatus};

/// `PluginInfo.type` of a DRA plugin.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
/// The `supported_versions` label of the DRA node service `v1` (Kubernetes 1.34+).
pub const V1_SERVICE: &str = "v1.DRAPlugin";
/// The `supported_versions` label of the DRA node service `v1beta1` (Kubernetes 1.32+).
pub const V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
/// The plugin watcher's timeout for `GetInfo`.
pub const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
/// The plugin watcher's dial timeout.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// The plugin watcher's timeout for `NotifyRegistrationStatus`.
pub const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// The DRA manager's timeout for each `NodePrepareResources` / `NodeUnprepareResources` call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// Longest DRA driver name (`DriverNameMaxLength`).
pub const MAX_DRIVER_NAME_LEN: usize = 63;
/// How often the registry directory is scanned (the kubelet uses inotify).
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// How the DRA side of the stand-in behaves.
#[derive(Debug, Clone)]
pub struct DraOptions {
    /// The DRA services this kubelet supports, in its order. The default,
    /// `["v1.DRAPlugin", "v1beta1.DRAPlugin"]`, is a 1.34+ kubelet; `["v1beta1.DRAPlugin"]`
    /// emulates 1.32/1.33.
    pub services: Vec<String>,
    /// Timeout of `GetInfo` during registration (1 s).
    pub get_info_timeout: Duration,
    /// Timeout of each prepare/unprepare call (45 s).
    pub call_timeout: Duration,
    /// Where the host's `/` is for this stand-in: an absolute `PluginInfo.endpoint` (a host
    /// path) is dialled under it. `None`: the real root. A simulated node (an agent run with
    /// `--root`) sets its root here, as a kubelet on that host would see the same paths.
    pub host_root: Option<PathBuf>,
}

impl Default for DraOptions {
    fn default() -> Self {
        DraOptions {
            services: vec![V1_SERVICE.to_string(), V1BETA1_SERVICE.to_string()],
            get_info_timeout: GET_INFO_TIMEOUT,
            call_timeout: CALL_TIMEOUT,
            host_root: None,
        }
    }
}

/// One registration attempt, accepted or not.
#[derive(Debug, Clone)]
pub struct DraRegistration {
    /// The registration socket.
    pub socket: PathBuf,
    /// `PluginInfo.name` (empty if `GetInfo` failed).
    pub driver: String,
    /// The endpoint the kubelet uses: `PluginInfo.endpoint`, or the registration socket when
    /// that is empty (empty if `GetInfo` failed).
    pub endpoint: PathBuf,
    /// The chosen service (`"v1.DRAPlugin"`, `"v1beta1.DRAPlugin"`), if accepted.
    pub service: Option<String>,
    /// Why the registration failed (what the plugin was told in `NotifyRegistrationStatus`,
    /// when it got that far).
    pub error: Option<String>,
    /// When the attempt started.
    pub at: Instant,
}

impl DraRegistration {
    pub fn is_accepted(&self) -> bool {
        self.error.is_none()
    }
}

/// A claim as the kubelet names it in prepare/unprepare calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    pub fn new(namespace: &str, name: &str, uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.to_string(),
        }
    }
}

/// A device of a prepared claim, as the kubelet stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    pub share_id: Option<String>,
}

/// Errors of [`DraKubelet`]'s calls and waits.
#[derive(Debug)]
pub enum DraError {
    /// No plugin of that driver is registered.
    NotRegistered {
        driver: String,
    },
    /// A wait or a call ran out of time; `what` says what was waited for.
    Timeout {
        what: String,
    },
    /// The call failed with this gRPC status.
    Rpc(tonic::Status),
    /// The response broke the kubelet's rules (the message is the kubelet's).
    Invalid(String),
    Io(io::Error),
}

impl fmt::Display for DraError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DraError::NotRegistered { driver } => write!(f, "DRA driver {driver} is not registered"),
            DraError::Timeout { what } => write!(f, "timed out: {what}"),
            DraError::Rpc(s) => write!(f, "rpc error: code = {:?} desc = {}", s.code(), s.message()),
            DraError::Invalid(m) => f.write_str(m),
            DraError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for DraError {}

impl From<io::Error> for DraError {
    fn from(e: io::Error) -> Self {
        DraError::Io(e)
    }
}

/// A registered plugin.
struct Plugin {
    driver: String,
    endpoint: PathBuf,
    service: String,
    channel: Channel,
    /// Index of its record in `State::registrations`.
    record: usize,
}

#[derive(Default)]
struct State {
    registrations: Vec<DraRegistration>,
    /// In the order they registered.
    plugins: Vec<Plugin>,
    violations: Vec<String>,
}

struct Shared {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn record(&self, rec: DraRegistration) {
        self.lock().registrations.push(rec);
        self.touch();
    }

    fn violation(&self, message: String) {
        self.lock().violations.push(message);
        self.touch();
    }
}

/// The kubelet's DRA plugin watcher and DRA manager, as far as plugins see them.
pub struct DraKubelet {
    dir: PathBuf,
    opts: DraOptions,
    shared: Arc<Shared>,
    watcher: JoinHandle<()>,
}

impl DraKubelet {
    /// Creates `registry_dir` if missing (mode 0750) and starts watching it.
    pub async fn start(registry_dir: &Path, opts: DraOptions) -> io::Result<DraKubelet> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(registry_dir)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: watch::channel(0).0,
        });
        let watcher = tokio::spawn(watch_dir(registry_dir.to_path_buf(), opts.clone(), Arc::clone(&shared)));
        Ok(DraKubelet {
            dir: registry_dir.to_path_buf(),
            opts,
            shared,
            watcher,
        })
    }

    /// The registry directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn options(&self) -> &DraOptions {
        &self.opts
    }

    /// Every registration attempt so far, accepted or not, in order.
    pub fn registrations(&self) -> Vec<DraRegistration> {
        self.shared.lock().registrations.clone()
    }

    /// The plugins registered now, `(driver, endpoint)`, in the order they registered.
    pub fn plugins(&self) -> Vec<(String, PathBuf)> {
        self.shared
            .lock()
            .plugins
            .iter()
            .map(|p| (p.driver.clone(), p.endpoint.clone()))
            .collect()
    }

    /// Protocol violations seen so far (tests should expect none).
    pub fn violations(&self) -> Vec<String> {
        self.shared.lock().violations.clone()
    }

    /// Waits until a plugin of `driver` is registered and returns the registration of the
    /// one the kubelet would call (the most recent).
    pub async fn wait_for_plugin(&self, driver: &str, timeout: Duration) -> Result<DraRegistration, DraError> {
        self.wait_for_plugin_since(driver, None, timeout).await
    }

    /// Like [`DraKubelet::wait_for_plugin`], but only for a registration that started at or
    /// after `since` (for example after a plugin restart).
    pub async fn wait_for_plugin_since(
        &self,
        driver: &str,
        since: Option<Instant>,
        timeout: Duration,
    ) -> Result<DraRegistration, DraError> {
        let found = self
            .wait(timeout, |st| {
                st.plugins
                    .iter()
                    .rev()
                    .filter(|p| p.driver == driver)
                    .filter_map(|p| st.registrations.get(p.record))
                    .find(|r| since.is_none_or(|s| r.at >= s))
                    .cloned()
            })
            .await;
        found.ok_or_else(|| {
            let st = self.shared.lock();
            let seen: Vec<String> = st
                .registrations
                .iter()
                .filter(|r| r.driver == driver || r.driver.is_empty())
                .map(|r| match &r.error {
                    None => format!("{}: accepted", r.socket.display()),
                    Some(e) => format!("{}: {e}", r.socket.display()),
                })
                .collect();
            DraError::Timeout {
                what: format!(
                    "DRA driver {driver} did not register within {timeout:?}; attempts seen: [{}]",
                    seen.join("; ")
                ),
            }
        })
    }

    /// Waits until no plugin of `driver` is registered.
    pub async fn wait_for_deregistration(&self, driver: &str, timeout: Duration) -> Result<(), DraError> {
        self.wait(timeout, |st| {
            (!st.plugins.iter().any(|p| p.driver == driver)).then_some(())
        })
        .await
        .ok_or_else(|| DraError::Timeout {
            what: format!("DRA driver {driver} still registered after {timeout:?}"),
        })
    }

    async fn wait<T>(&self, timeout: Duration, mut check: impl FnMut(&State) -> Option<T>) -> Option<T> {
        let mut rx = self.shared.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if let Some(v) = check(&self.shared.lock()) {
                return Some(v);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return check(&self.shared.lock()),
            }
        }
    }

    /// The plugin the kubelet would call for `driver`: the most recently registered one.
    fn pick(&self, driver: &str) -> Result<(String, Channel), DraError> {
        self.shared
            .lock()
            .plugins
            .iter()
            .rev()
            .find(|p| p.driver == driver)
            .map(|p| (p.service.clone(), p.channel.clone()))
            .ok_or_else(|| DraError::NotRegistered {
                driver: driver.to_string(),
            })
    }

    /// `NodePrepareResources` for `claims` on the most recently registered plugin of `driver`,
    /// through the service chosen at registration, with the call timeout. Returns each
    /// claim's devices, or the error the plugin reported for that claim.
    ///
    /// As the kubelet does, it fails as a whole on a gRPC error ([`DraError::Rpc`]), a result
    /// for a claim UID it did not ask for, and fewer results than claims
    /// ([`DraError::Invalid`], with the kubelet's message).
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<BTreeMap<String, Result<Vec<PreparedDevice>, String>>, DraError> {
        let (service, channel) = self.pick(driver)?;
        let req = v1::NodePrepareResourcesRequest {
            claims: claims.iter().map(to_claim).collect(),
        };
        let timeout = self.opts.call_timeout;
        let what = || format!("NodePrepareResources of DRA driver {driver} took longer than {timeout:?}");
        let resp: v1::NodePrepareResourcesResponse = if service == V1BETA1_SERVICE {
            let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            let req: v1beta1::NodePrepareResourcesRequest = transcode(&req)?;
            let resp = call(timeout, what, client.node_prepare_resources(timed(req, timeout))).await?;
            transcode(&resp)?
        } else {
            let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
            call(timeout, what, client.node_prepare_resources(timed(req, timeout))).await?
        };
        self.check_unknown("NodePrepareResources", driver, claims, resp.claims.keys())?;
        let mut out = BTreeMap::new();
        for (uid, result) in resp.claims {
            if result.error.is_empty() {
                let claim = claims.iter().find(|c| c.uid == uid);
                let who = match claim {
                    Some(c) => format!("{}/{} ({uid})", c.namespace, c.name),
                    None => uid.clone(),
                };
                for (i, d) in result.devices.iter().enumerate() {
                    for problem in device_problems(d) {
                        self.shared.violation(format!(
                            "DRA driver {driver}: NodePrepareResources, claim {who}, device #{i} ({}/{}): {problem}",
                            d.pool_name, d.device_name
                        ));
                    }
                }
            }
            let value = if result.error.is_empty() {
                Ok(result
                    .devices
                    .into_iter()
                    .map(|d| PreparedDevice {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                        share_id: d.share_id,
                    })
                    .collect())
            } else {
                Err(result.error)
            };
            out.insert(uid, value);
        }
        check_skipped("NodePrepareResources", claims, &out)?;
        Ok(out)
    }

    /// `NodeUnprepareResources` for `claims` on the most recently registered plugin of
    /// `driver`; each claim's result. The same whole-call failures as [`DraKubelet::prepare`].
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<BTreeMap<String, Result<(), String>>, DraError> {
        let (service, channel) = self.pick(driver)?;
        let req = v1::NodeUnprepareResourcesRequest {
            claims: claims.iter().map(to_claim).collect(),
        };
        let timeout = self.opts.call_timeout;
        let what = || format!("NodeUnprepareResources of DRA driver {driver} took longer than {timeout:?}");
        let resp: v1::NodeUnprepareResourcesResponse = if service == V1BETA1_SERVICE {
            let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            let req: v1beta1::NodeUnprepareResourcesRequest = transcode(&req)?;
            let resp = call(timeout, what, client.node_unprepare_resources(timed(req, timeout))).await?;
            transcode(&resp)?
        } else {
            let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
            call(timeout, what, client.node_unprepare_resources(timed(req, timeout))).await?
        };
        self.check_unknown("NodeUnprepareResources", driver, claims, resp.claims.keys())?;
        let out: BTreeMap<String, Result<(), String>> = resp
            .claims
            .into_iter()
            .map(|(uid, r)| (uid, if r.error.is_empty() { Ok(()) } else { Err(r.error) }))
            .collect();
        check_skipped("NodeUnprepareResources", claims, &out)?;
        Ok(out)
    }

    /// See the free function [`cdi_devices_for`].
    pub fn cdi_devices_for(prepared: &[PreparedDevice], request: &str) -> Vec<String> {
        cdi_devices_for(prepared, request)
    }

    /// A result for a UID that was not asked for: a violation, and the kubelet's error.
    fn check_unknown<'a>(
        &self,
        method: &str,
        driver: &str,
        claims: &[ClaimRef],
        uids: impl Iterator<Item = &'a String>,
    ) -> Result<(), DraError> {
        let asked: BTreeSet<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
        let unknown: BTreeSet<&String> = uids.filter(|u| !asked.contains(u.as_str())).collect();
        for uid in &unknown {
            self.shared.violation(format!(
                "DRA driver {driver}: {method} returned a result for claim UID {uid}, which was not in the request"
            ));
        }
        match unknown.first() {
            Some(uid) => Err(DraError::Invalid(format!(
                "{method} returned result for unknown claim UID {uid}"
            ))),
            None => Ok(()),
        }
    }

    /// Stops watching and drops every plugin connection.
    pub async fn stop(self) {
        self.watcher.abort();
        self.shared.lock().plugins.clear();
        self.shared.touch();
    }
}

impl Drop for DraKubelet {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// What the watcher knows about one socket path.
struct Known {
    /// `(dev, ino, ctime, ctime_nsec)`: a new file at the same path is a new socket.
    id: (u64, u64, i64, i64),
    /// The plugin it registered, `(driver, endpoint)`.
    plugin: Option<(String, PathBuf)>,
    /// A failed registration is tried again (the kubelet's reconciler retries the operation
    /// while the socket exists): when, and the wait after that.
    retry: Option<(Instant, Duration)>,
}

/// The kubelet's operation backoff: 500 ms, doubling, at most 2 min 2 s.
pub const RETRY_FIRST: Duration = Duration::from_millis(500);
/// See [`RETRY_FIRST`].
pub const RETRY_MAX: Duration = Duration::from_secs(122);

fn next_retry(failed: bool, wait: Duration) -> Option<(Instant, Duration)> {
    failed.then(|| (Instant::now() + wait, (wait * 2).min(RETRY_MAX)))
}

async fn watch_dir(dir: PathBuf, opts: DraOptions, shared: Arc<Shared>) {
    let mut known: BTreeMap<PathBuf, Known> = BTreeMap::new();
    loop {
        let mut found = BTreeMap::new();
        scan(&dir, &mut found);
        // Removed or replaced sockets deregister first, as the kubelet's reconciler does.
        let gone: Vec<PathBuf> = known
            .iter()
            .filter(|(path, k)| found.get(*path) != Some(&k.id))
            .map(|(path, _)| path.clone())
            .collect();
        for path in gone {
            if let Some(Known {
                plugin: Some((driver, endpoint)),
                ..
            }) = known.remove(&path)
            {
                deregister(&shared, &driver, &endpoint);
            }
        }
        for (path, id) in found {
            let wait = match known.get(&path) {
                None => RETRY_FIRST,
                Some(Known {
                    retry: Some((at, wait)),
                    ..
                }) if *at <= Instant::now() => *wait,
                Some(_) => continue,
            };
            let plugin = register(&path, &opts, &shared).await;
            let retry = next_retry(plugin.is_none(), wait);
            known.insert(path, Known { id, plugin, retry });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Unix sockets under `dir` (recursively), skipping names that start with `.`.
fn scan(dir: &Path, found: &mut BTreeMap<PathBuf, (u64, u64, i64, i64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        let ft = meta.file_type();
        if ft.is_dir() {
            scan(&entry.path(), found);
        } else if ft.is_socket() {
            found.insert(entry.path(), (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec()));
        }
    }
}

fn deregister(shared: &Shared, driver: &str, endpoint: &Path) {
    let mut st = shared.lock();
    st.plugins.retain(|p| !(p.driver == driver && p.endpoint == endpoint));
    drop(st);
    shared.touch();
}

/// A Unix-socket channel that connects on first use and reconnects after a failure, like
/// the kubelet's `grpc.NewClient("unix:" + endpoint)`.
fn lazy_unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Ok(
        Endpoint::try_from("http://localhost")?.connect_with_connector_lazy(tower::service_fn(
            move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            },
        )),
    )
}

/// The plugin watcher's registration sequence for one socket; returns the plugin it
/// registered.
async fn register(socket: &Path, opts: &DraOptions, shared: &Shared) -> Option<(String, PathBuf)> {
    let at = Instant::now();
    let mut rec = DraRegistration {
        socket: socket.to_path_buf(),
        driver: String::new(),
        endpoint: PathBuf::new(),
        service: None,
        error: None,
        at,
    };
    let sock = socket.display();
    let channel = match tokio::time::timeout(DIAL_TIMEOUT, crate::unix_channel(socket)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            rec.error = Some(format!(
                "RegisterPlugin error -- dial failed at socket {sock}, err: {}",
                crate::error_chain(&e)
            ));
            shared.record(rec);
            return None;
        }
        Err(_) => {
            rec.error = Some(format!(
                "RegisterPlugin error -- dial failed at socket {sock}, err: timed out after {DIAL_TIMEOUT:?}"
            ));
            shared.record(rec);
            return None;
        }
    };
    let mut client = RegistrationClient::new(channel);
    let mut req = tonic::Request::new(InfoRequest {});
    req.set_timeout(opts.get_info_timeout);
    let info: PluginInfo = match tokio::time::timeout(opts.get_info_timeout, client.get_info(req)).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(status)) => {
            rec.error = Some(format!(
                "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {sock}, err: \
                 rpc error: code = {:?} desc = {}",
                status.code(),
                status.message()
            ));
            shared.record(rec);
            return None;
        }
        Err(_) => {
            rec.error = Some(format!(
                "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {sock}, err: \
                 rpc error: code = DeadlineExceeded desc = context deadline exceeded (after {:?})",
                opts.get_info_timeout
            ));
            shared.record(rec);
            return None;
        }
    };
    rec.driver = info.name.clone();

    if info.r#type != DRA_PLUGIN_TYPE {
        let msg = format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {sock}",
            info.r#type
        );
        reject(&mut client, shared, rec, msg).await;
        return None;
    }

    let endpoint = if info.endpoint.is_empty() {
        socket.to_path_buf()
    } else {
        PathBuf::from(&info.endpoint)
    };
    rec.endpoint = endpoint.clone();
    let ep = endpoint.display();

    if let Err(e) = check_driver_name(&info.name) {
        let msg = format!(
            "RegisterPlugin error -- plugin validation failed with err: invalid DRA driver name {:?}: {e}",
            info.name
        );
        reject(&mut client, shared, rec, msg).await;
        return None;
    }
    let service = match choose_service(&info.supported_versions, &opts.services) {
        Ok(s) => s,
        Err(e) => {
            let msg = format!(
                "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of \
                 DRA driver plugin {} at endpoint {ep}: {e}",
                info.name
            );
            reject(&mut client, shared, rec, msg).await;
            return None;
        }
    };
    let already = shared
        .lock()
        .plugins
        .iter()
        .any(|p| p.driver == info.name && p.endpoint == endpoint);
    if already {
        let msg = format!(
            "RegisterPlugin error -- plugin registration failed with err: endpoint {ep} already registered for \
             DRA driver plugin {}",
            info.name
        );
        reject(&mut client, shared, rec, msg).await;
        return None;
    }
    let dialled = match (&opts.host_root, endpoint.strip_prefix("/")) {
        (Some(root), Ok(rel)) => root.join(rel),
        _ => endpoint.clone(),
    };
    let channel = match lazy_unix_channel(&dialled) {
        Ok(c) => c,
        Err(e) => {
            let msg = format!(
                "RegisterPlugin error -- plugin registration failed with err: create gRPC connection to DRA driver \
                 {} plugin at endpoint {ep}: {}",
                info.name,
                crate::error_chain(&e)
            );
            reject(&mut client, shared, rec, msg).await;
            return None;
        }
    };
    if !endpoint.is_absolute() {
        shared.violation(format!(
            "DRA driver {}: PluginInfo.endpoint {ep:?} (socket {sock}) is not an absolute path; the kubelet \
             resolves it against its own working directory",
            info.name
        ));
    }
    rec.service = Some(service.clone());
    {
        let mut st = shared.lock();
        let record = st.registrations.len();
        st.registrations.push(rec);
        st.plugins.push(Plugin {
            driver: info.name.clone(),
            endpoint: endpoint.clone(),
            service,
            channel,
            record,
        });
    }
    shared.touch();
    if let Err(e) = notify(&mut client, true, String::new()).await {
        // The kubelet keeps the plugin registered; it only logs this.
        shared.violation(format!(
            "DRA driver {}: NotifyRegistrationStatus{{plugin_registered: true}} at socket {sock} failed: {e}",
            info.name
        ));
    }
    Some((info.name, endpoint))
}

async fn reject(client: &mut RegistrationClient<Channel>, shared: &Shared, mut rec: DraRegistration, msg: String) {
    let sock = rec.socket.display().to_string();
    let driver = rec.driver.clone();
    rec.error = Some(msg.clone());
    shared.record(rec);
    if let Err(e) = notify(client, false, msg).await {
        shared.violation(format!(
            "DRA plugin {driver:?}: NotifyRegistrationStatus{{plugin_registered: false}} at socket {sock} failed: {e}"
        ));
    }
}

async fn notify(client: &mut RegistrationClient<Channel>, registered: bool, error: String) -> Result<(), String> {
    let mut req = tonic::Request::new(RegistrationStatus {
        plugin_registered: registered,
        error,
    });
    req.set_timeout(NOTIFY_TIMEOUT);
    match tokio::time::timeout(NOTIFY_TIMEOUT, client.notify_registration_status(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(format!("rpc error: code = {:?} desc = {}", s.code(), s.message())),
        Err(_) => Err(format!("timed out after {NOTIFY_TIMEOUT:?}")),
    }
}

fn to_claim(c: &ClaimRef) -> v1::Claim {
    v1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

/// The v1 and v1beta1 messages are the same on the wire.
fn transcode<A: prost::Message, B: prost::Message + Default>(a: &A) -> Result<B, DraError> {
    B::decode(a.encode_to_vec().as_slice())
        .map_err(|e| DraError::Invalid(format!("v1/v1beta1 message conversion failed: {e}")))
}

/// A request carrying the kubelet's deadline (`grpc-timeout`).
fn timed<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

/// Runs a unary call with the client-side deadline.
async fn call<T>(
    timeout: Duration,
    what: impl FnOnce() -> String,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, DraError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(DraError::Rpc(status)),
        Err(_) => Err(DraError::Timeout { what: what() }),
    }
}

/// Every claim of the request needs a result: the kubelet's "skipped" error otherwise.
fn check_skipped<V>(method: &str, claims: &[ClaimRef], out: &BTreeMap<String, V>) -> Result<(), DraError> {
    let asked: BTreeSet<&str> = claims.iter().map(|c| c.uid.as_str()).collect();
    let missing = asked.iter().filter(|u| !out.contains_key(**u)).count();
    if missing > 0 {
        return Err(DraError::Invalid(format!("{method} skipped {missing} ResourceClaims")));
    }
    Ok(())
}

/// The CDI device IDs the kubelet hands to the runtime for a container that uses `request`
/// of a claim: those of the devices whose `request_names` is empty or contains `request`.
/// A device whose `request_names` names other requests gives the container nothing.
pub fn cdi_devices_for(prepared: &[PreparedDevice], request: &str) -> Vec<String> {
    prepared
        .iter()
        .filter(|d| d.request_names.is_empty() || d.request_names.iter().any(|r| r == request))
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
        .collect()
}

/// What is wrong with a device of a successfully prepared claim: the proto requires the
/// pool and device names, and the runtime only resolves fully qualified CDI names.
fn device_problems(d: &v1::Device) -> Vec<String> {
    let mut out = Vec::new();
    if d.pool_name.is_empty() {
        out.push("pool_name is empty (required)".to_string());
    }
    if d.device_name.is_empty() {
        out.push("device_name is empty (required)".to_string());
    }
    for id in &d.cdi_device_ids {
        if let Err(e) = check_cdi_device_id(id) {
            out.push(format!("CDI device ID {id:?} is not a fully qualified CDI name: {e}"));
        }
    }
    out
}

/// A fully qualified CDI device name, `vendor/class=name`, by the CDI parser's rules:
/// vendor and class start with a letter, end with a letter or digit, and hold letters,
/// digits, `_`, `-` and `.`; the name starts and ends with a letter or digit and may also
/// hold `:`.
pub fn check_cdi_device_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.starts_with('/') {
        return Err("missing vendor".to_string());
    }
    let Some((kind, name)) = id.split_once('=') else {
        return Err("missing '=' before the device name".to_string());
    };
    let Some((vendor, class)) = kind.split_once('/') else {
        return Err("missing vendor (want vendor/class=name)".to_string());
    };
    if vendor.is_empty() {
        return Err("missing vendor".to_string());
    }
    if class.is_empty() {
        return Err("missing class".to_string());
    }
    if name.is_empty() {
        return Err("missing device name".to_string());
    }
    check_cdi_part("vendor", vendor, |c| c.is_ascii_alphabetic(), &['_', '-', '.'])?;
    check_cdi_part("class", class, |c| c.is_ascii_alphabetic(), &['_', '-', '.'])?;
    check_cdi_part(
        "device name",
        name,
        |c| c.is_ascii_alphanumeric(),
        &['_', '-', '.', ':'],
    )
}

fn check_cdi_part(what: &str, s: &str, first_ok: impl Fn(char) -> bool, extra: &[char]) -> Result<(), String> {
    let mut chars = s.chars();
    let first = chars.next().ok_or_else(|| format!("empty {what}"))?;
    if !first_ok(first) {
        return Err(format!("{what} {s:?} starts with {first:?}"));
    }
    if let Some(bad) = s.chars().find(|c| !c.is_ascii_alphanumeric() && !extra.contains(c)) {
        return Err(format!("invalid character {bad:?} in {what} {s:?}"));
    }
    if s.len() > 1 && !s.ends_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("{what} {s:?} should end with a letter or digit"));
    }
    Ok(())
}

/// The DRA manager's `validateSupportedServices`: the first of the plugin's services that the
/// kubelet supports.
pub fn choose_service(plugin: &[String], kubelet: &[String]) -> Result<String, String> {
    if plugin.is_empty() {
        return Err("empty list of supported gRPC services (aka supported versions)".to_string());
    }
    plugin.iter().find(|s| kubelet.contains(s)).cloned().ok_or_else(|| {
        format!(
            "none of services supported by the plugin ({}) are supported by the kubelet ({})",
            go_quoted(plugin),
            go_quoted(kubelet)
        )
    })
}

/// A string list as Go's `%q` prints it: `["a" "b"]`.
fn go_quoted(list: &[String]) -> String {
    let items: Vec<String> = list.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", items.join(" "))
}

/// A DRA driver name: a DNS-1123 subdomain of at most 63 characters.
pub fn check_driver_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the name is empty".to_string());
    }
    if name.len() > MAX_DRIVER_NAME_LEN {
        return Err(format!(
            "the name is {} characters long, at most {MAX_DRIVER_NAME_LEN} are allowed",
            name.len()
        ));
    }
    if !crate::validate::dns1123_labels(name) {
        return Err(
            "not a DNS-1123 subdomain (lowercase alphanumerics, '-' and '.', each label starting and \
             ending alphanumeric)"
                .to_string(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn service_choice_follows_the_plugins_order() {
        let k134 = strings(&[V1_SERVICE, V1BETA1_SERVICE]);
        let k133 = strings(&[V1BETA1_SERVICE]);
        assert_eq!(
            choose_service(&strings(&[V1_SERVICE, V1BETA1_SERVICE]), &k134).unwrap(),
            V1_SERVICE
        );
        assert_eq!(
            choose_service(&strings(&[V1BETA1_SERVICE, V1_SERVICE]), &k134).unwrap(),
            V1BETA1_SERVICE
        );
        assert_eq!(
            choose_service(&strings(&[V1_SERVICE, V1BETA1_SERVICE]), &k133).unwrap(),
            V1BETA1_SERVICE
        );
        assert_eq!(
            choose_service(&[], &k134).unwrap_err(),
            "empty list of supported gRPC services (aka supported versions)"
        );
        assert_eq!(
            choose_service(&strings(&[V1_SERVICE]), &k133).unwrap_err(),
            "none of services supported by the plugin ([\"v1.DRAPlugin\"]) are supported by the kubelet \
             ([\"v1beta1.DRAPlugin\"])"
        );
    }

    #[test]
    fn cdi_device_ids() {
        for ok in [
            "k8s.gpu.nvidia.com/device=gpu-0",
            "k8s.gpu.nvidia.com/claim=0b2c-uid-gpu-0",
            "nvidia.com/gpu=GPU-1234:0",
            "a/b=c",
            "vendor_x/class.y=0",
        ] {
            assert_eq!(check_cdi_device_id(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "gpu-0",
            "nvidia.com/gpu",
            "/dev/nvidia0",
            "nvidia.com=gpu-0",
            "/gpu=x",
            "nvidia.com/=x",
            "nvidia.com/gpu=",
            "1vendor/gpu=x",
            "vendor-/gpu=x",
            "vendor/gpu/x=y",
            "vendor/gpu=x/y",
            "vendor/gpu=-x",
            "vendor/gpu=x:",
            "vendor/gpu=a b",
        ] {
            assert!(check_cdi_device_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn driver_names() {
        for ok in ["gpu.nvidia.com", "a", "x-1.example.com", &"a".repeat(63)] {
            assert_eq!(check_driver_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "GPU.nvidia.com",
            "-a.com",
            "a..b",
            "a_b.com",
            "a.com.",
            &"a".repeat(64),
        ] {
            assert!(check_driver_name(bad).is_err(), "{bad}");
        }
    }
}
