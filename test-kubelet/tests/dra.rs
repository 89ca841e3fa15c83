//! The DRA side of the stand-in against a fake DRA plugin (tonic servers on Unix sockets):
//! `Registration` on `<registry>/<driver>-reg.sock`, the DRA node service v1 and v1beta1 on
//! `<plugins>/<driver>/dra.sock`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use test_kubelet::dra::{V1_SERVICE, V1BETA1_SERVICE};
use test_kubelet::dra_api::{v1, v1beta1};
use test_kubelet::registration_api::registration_server::{Registration, RegistrationServer};
use test_kubelet::registration_api::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};
use test_kubelet::{ClaimRef, DraError, DraKubelet, DraOptions, DraRegistration, PreparedDevice};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

const T: Duration = Duration::from_secs(10);
const DRIVER: &str = "gpu.example.com";

type PrepareFn = dyn Fn(&[v1::Claim]) -> Result<v1::NodePrepareResourcesResponse, Status> + Send + Sync;
type UnprepareFn = dyn Fn(&[v1::Claim]) -> Result<v1::NodeUnprepareResourcesResponse, Status> + Send + Sync;

/// One DRA call the fake received: which service package, which method, which claims.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    service: &'static str,
    method: &'static str,
    claims: Vec<v1::Claim>,
}

struct Behaviour {
    prepare: Mutex<Arc<PrepareFn>>,
    unprepare: Mutex<Arc<UnprepareFn>>,
    calls: Mutex<Vec<Call>>,
    /// How long each DRA call takes before it answers.
    delay: Mutex<Duration>,
}

/// The default prepare: one device per claim, request `gpu`, a CDI ID with the claim UID.
fn good_prepare(claims: &[v1::Claim]) -> Result<v1::NodePrepareResourcesResponse, Status> {
    let claims = claims
        .iter()
        .map(|c| {
            let dev = v1::Device {
                request_names: vec!["gpu".into()],
                pool_name: "node-a".into(),
                device_name: "gpu-0".into(),
                cdi_device_ids: vec![format!("k8s.gpu.example.com/claim={}-gpu-0", c.uid)],
                share_id: None,
            };
            (
                c.uid.clone(),
                v1::NodePrepareResourceResponse {
                    devices: vec![dev],
                    error: String::new(),
                },
            )
        })
        .collect();
    Ok(v1::NodePrepareResourcesResponse { claims })
}

fn good_unprepare(claims: &[v1::Claim]) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
    let claims = claims
        .iter()
        .map(|c| (c.uid.clone(), v1::NodeUnprepareResourceResponse::default()))
        .collect();
    Ok(v1::NodeUnprepareResourcesResponse { claims })
}

/// Same messages in both packages: re-encode.
fn transcode<A: Message, B: Message + Default>(a: &A) -> B {
    B::decode(a.encode_to_vec().as_slice()).expect("v1 and v1beta1 messages are wire-compatible")
}

#[derive(Clone)]
struct V1Svc(Arc<Behaviour>);
#[derive(Clone)]
struct V1beta1Svc(Arc<Behaviour>);

impl Behaviour {
    async fn pause(&self) {
        let d = *self.delay.lock().unwrap();
        tokio::time::sleep(d).await;
    }

    fn prepare(
        &self,
        service: &'static str,
        claims: Vec<v1::Claim>,
    ) -> Result<v1::NodePrepareResourcesResponse, Status> {
        let f = Arc::clone(&self.prepare.lock().unwrap());
        self.calls.lock().unwrap().push(Call {
            service,
            method: "NodePrepareResources",
            claims: claims.clone(),
        });
        f(&claims)
    }

    fn unprepare(
        &self,
        service: &'static str,
        claims: Vec<v1::Claim>,
    ) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
        let f = Arc::clone(&self.unprepare.lock().unwrap());
        self.calls.lock().unwrap().push(Call {
            service,
            method: "NodeUnprepareResources",
            claims: claims.clone(),
        });
        f(&claims)
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for V1Svc {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.0.pause().await;
        self.0.prepare("v1", req.into_inner().claims).map(Response::new)
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.0.pause().await;
        self.0.unprepare("v1", req.into_inner().claims).map(Response::new)
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for V1beta1Svc {
    async fn node_prepare_resources(
        &self,
        req: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        self.0.pause().await;
        let r: v1::NodePrepareResourcesRequest = transcode(&req.into_inner());
        self.0
            .prepare("v1beta1", r.claims)
            .map(|resp| Response::new(transcode(&resp)))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        self.0.pause().await;
        let r: v1::NodeUnprepareResourcesRequest = transcode(&req.into_inner());
        self.0
            .unprepare("v1beta1", r.claims)
            .map(|resp| Response::new(transcode(&resp)))
    }
}

#[derive(Clone)]
struct RegSvc {
    info: PluginInfo,
    get_info_calls: Arc<Mutex<u32>>,
    statuses: Arc<Mutex<Vec<RegistrationStatus>>>,
    /// GetInfo calls still to fail (a plugin not ready yet).
    fail_first: Arc<Mutex<u32>>,
}

#[tonic::async_trait]
impl Registration for RegSvc {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        *self.get_info_calls.lock().unwrap() += 1;
        let mut fail = self.fail_first.lock().unwrap();
        if *fail > 0 {
            *fail -= 1;
            return Err(Status::unavailable("not ready yet"));
        }
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        self.statuses.lock().unwrap().push(req.into_inner());
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// A fake DRA plugin: its DRA server first, then its registration socket (as the kubeletplugin
/// helper does).
struct FakeDra {
    reg_socket: PathBuf,
    dra_socket: PathBuf,
    get_info_calls: Arc<Mutex<u32>>,
    statuses: Arc<Mutex<Vec<RegistrationStatus>>>,
    behaviour: Arc<Behaviour>,
    servers: Vec<JoinHandle<()>>,
}

fn info(name: &str, endpoint: &Path, versions: &[&str]) -> PluginInfo {
    PluginInfo {
        r#type: "DRAPlugin".into(),
        name: name.into(),
        endpoint: endpoint.to_string_lossy().into_owned(),
        supported_versions: versions.iter().map(|s| s.to_string()).collect(),
    }
}

/// `<plugins>/<driver>/dra.sock`.
fn dra_socket(plugins: &Path, driver: &str) -> PathBuf {
    plugins.join(driver).join("dra.sock")
}

impl FakeDra {
    /// The usual layout: `<registry>/<driver>-reg.sock` and `<plugins>/<driver>/dra.sock`,
    /// advertising both services, v1 first.
    async fn start(registry: &Path, plugins: &Path, driver: &str) -> FakeDra {
        let dra = dra_socket(plugins, driver);
        let info = info(driver, &dra, &[V1_SERVICE, V1BETA1_SERVICE]);
        FakeDra::start_with(&registry.join(format!("{driver}-reg.sock")), Some(&dra), info).await
    }

    /// Serves `info` on `reg_socket`, and the DRA service on `dra` if given.
    async fn start_with(reg_socket: &Path, dra: Option<&Path>, info: PluginInfo) -> FakeDra {
        FakeDra::start_failing(reg_socket, dra, info, 0).await
    }

    /// [`FakeDra::start_with`], its first `fail_first` GetInfo calls answered `Unavailable`.
    async fn start_failing(reg_socket: &Path, dra: Option<&Path>, info: PluginInfo, fail_first: u32) -> FakeDra {
        let behaviour = Arc::new(Behaviour {
            prepare: Mutex::new(Arc::new(good_prepare)),
            unprepare: Mutex::new(Arc::new(good_unprepare)),
            calls: Mutex::new(Vec::new()),
            delay: Mutex::new(Duration::ZERO),
        });
        let mut servers = Vec::new();
        if let Some(dra) = dra {
            std::fs::create_dir_all(dra.parent().unwrap()).unwrap();
            let _ = std::fs::remove_file(dra);
            let listener = UnixListener::bind(dra).unwrap();
            let router = tonic::transport::Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(V1Svc(Arc::clone(
                    &behaviour,
                ))))
                .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1Svc(
                    Arc::clone(&behaviour),
                )));
            servers.push(tokio::spawn(async move {
                let _ = router.serve_with_incoming(UnixListenerStream::new(listener)).await;
            }));
        }
        let get_info_calls = Arc::new(Mutex::new(0));
        let statuses = Arc::new(Mutex::new(Vec::new()));
        let reg = RegSvc {
            info,
            get_info_calls: Arc::clone(&get_info_calls),
            statuses: Arc::clone(&statuses),
            fail_first: Arc::new(Mutex::new(fail_first)),
        };
        // Bound (and listening) under another name outside the watched folder, then renamed
        // into it: a kubelet that dials the socket the moment it appears must not find it
        // bound but not yet listening (Connection refused, a flaky registration).
        let _ = std::fs::remove_file(reg_socket);
        let folder = reg_socket.parent().unwrap();
        let staging = folder.parent().unwrap_or(folder).join(format!(
            ".staging-{}",
            reg_socket.file_name().unwrap().to_string_lossy()
        ));
        let _ = std::fs::remove_file(&staging);
        let listener = UnixListener::bind(&staging).unwrap();
        std::fs::rename(&staging, reg_socket).unwrap();
        let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(reg));
        servers.push(tokio::spawn(async move {
            let _ = router.serve_with_incoming(UnixListenerStream::new(listener)).await;
        }));
        FakeDra {
            reg_socket: reg_socket.to_path_buf(),
            dra_socket: dra.map(Path::to_path_buf).unwrap_or_default(),
            get_info_calls,
            statuses,
            behaviour,
            servers,
        }
    }

    /// Waits (generously) for the kubelet's NotifyRegistrationStatus.
    async fn wait_for_status(&self) -> RegistrationStatus {
        let deadline = Instant::now() + T;
        loop {
            if let Some(s) = self.statuses.lock().unwrap().first() {
                return s.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no NotifyRegistrationStatus at {:?}",
                self.reg_socket
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.behaviour.calls.lock().unwrap().clone()
    }

    fn set_prepare(
        &self,
        f: impl Fn(&[v1::Claim]) -> Result<v1::NodePrepareResourcesResponse, Status> + Send + Sync + 'static,
    ) {
        *self.behaviour.prepare.lock().unwrap() = Arc::new(f);
    }

    fn set_unprepare(
        &self,
        f: impl Fn(&[v1::Claim]) -> Result<v1::NodeUnprepareResourcesResponse, Status> + Send + Sync + 'static,
    ) {
        *self.behaviour.unprepare.lock().unwrap() = Arc::new(f);
    }
}

impl Drop for FakeDra {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

struct Dirs {
    _tmp: tempfile::TempDir,
    registry: PathBuf,
    plugins: PathBuf,
}

fn dirs() -> Dirs {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    let plugins = tmp.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    Dirs {
        registry,
        plugins,
        _tmp: tmp,
    }
}

/// Waits until `n` registration attempts have been recorded.
async fn wait_for_attempts(kubelet: &DraKubelet, n: usize) -> Vec<DraRegistration> {
    let deadline = Instant::now() + T;
    loop {
        let regs = kubelet.registrations();
        if regs.len() >= n {
            return regs;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} registration attempts: {regs:?}",
            regs.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_chooses_v1_on_a_1_34_kubelet() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    assert!(d.registry.is_dir(), "start creates the registry dir");
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;

    let rec = kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    assert!(rec.is_accepted(), "{rec:?}");
    assert_eq!(rec.driver, DRIVER);
    assert_eq!(rec.socket, plugin.reg_socket);
    assert_eq!(rec.endpoint, plugin.dra_socket);
    assert_eq!(rec.service.as_deref(), Some(V1_SERVICE));
    assert_eq!(kubelet.plugins(), vec![(DRIVER.to_string(), plugin.dra_socket.clone())]);

    let status = plugin.wait_for_status().await;
    assert!(status.plugin_registered, "{status:?}");
    assert_eq!(status.error, "");
    assert_eq!(*plugin.get_info_calls.lock().unwrap(), 1);
    assert_eq!(kubelet.violations(), Vec::<String>::new());
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chooses_v1beta1_on_a_kubelet_without_v1() {
    let d = dirs();
    let opts = DraOptions {
        services: vec![V1BETA1_SERVICE.to_string()],
        ..DraOptions::default()
    };
    let kubelet = DraKubelet::start(&d.registry, opts).await.unwrap();
    let _plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    let rec = kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    assert_eq!(rec.service.as_deref(), Some(V1BETA1_SERVICE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_endpoint_means_the_registration_socket() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let reg = d.registry.join("solo-reg.sock");
    let _plugin = FakeDra::start_with(&reg, None, info(DRIVER, Path::new(""), &[V1_SERVICE])).await;
    let rec = kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    assert_eq!(rec.endpoint, reg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_registrations_are_recorded_and_notified() {
    let d = dirs();
    let kubelet = DraKubelet::start(
        &d.registry,
        DraOptions {
            services: vec![V1BETA1_SERVICE.to_string()],
            ..DraOptions::default()
        },
    )
    .await
    .unwrap();
    let ep = dra_socket(&d.plugins, DRIVER);
    let mut wrong_type = info(DRIVER, &ep, &[V1_SERVICE]);
    wrong_type.r#type = "DevicePlugin".into();
    let cases = [
        (
            "type",
            wrong_type,
            "no handler registered for plugin type: DevicePlugin at socket",
        ),
        (
            "empty",
            info(DRIVER, &ep, &[]),
            "empty list of supported gRPC services (aka supported versions)",
        ),
        (
            "nomatch",
            info(DRIVER, &ep, &[V1_SERVICE]),
            "none of services supported by the plugin ([\"v1.DRAPlugin\"]) are supported by the kubelet \
             ([\"v1beta1.DRAPlugin\"])",
        ),
        (
            "name",
            info("GPU_Driver", &ep, &[V1BETA1_SERVICE]),
            "invalid DRA driver name \"GPU_Driver\"",
        ),
    ];
    let mut plugins = Vec::new();
    for (tag, info, _) in &cases {
        let reg = d.registry.join(format!("{tag}-reg.sock"));
        plugins.push(FakeDra::start_with(&reg, Some(&ep.with_file_name(format!("{tag}.sock"))), info.clone()).await);
    }
    let regs = wait_for_attempts(&kubelet, cases.len()).await;
    for ((tag, _, want), plugin) in cases.iter().zip(&plugins) {
        let rec = regs
            .iter()
            .find(|r| r.socket == plugin.reg_socket)
            .unwrap_or_else(|| panic!("{tag}: no record in {regs:?}"));
        let err = rec
            .error
            .as_deref()
            .unwrap_or_else(|| panic!("{tag}: accepted: {rec:?}"));
        assert!(err.contains(want), "{tag}: {err}");
        assert!(err.starts_with("RegisterPlugin error -- "), "{tag}: {err}");
        assert!(!rec.is_accepted());
        assert_eq!(rec.service, None);
        let status = plugin.wait_for_status().await;
        assert!(!status.plugin_registered, "{tag}");
        assert_eq!(status.error, err, "{tag}: the plugin is told the same error");
    }
    assert_eq!(kubelet.plugins(), vec![]);
    assert!(
        kubelet
            .wait_for_plugin(DRIVER, Duration::from_millis(50))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_registration_of_the_same_endpoint_is_rejected() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let first = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    let second = FakeDra::start_with(
        &d.registry.join("again-reg.sock"),
        None,
        info(DRIVER, &first.dra_socket, &[V1_SERVICE]),
    )
    .await;
    let regs = wait_for_attempts(&kubelet, 2).await;
    let err = regs[1].error.as_deref().unwrap_or_default();
    assert_eq!(
        err,
        format!(
            "RegisterPlugin error -- plugin registration failed with err: endpoint {} already registered for DRA \
             driver plugin {DRIVER}",
            first.dra_socket.display()
        )
    );
    assert!(!second.wait_for_status().await.plugin_registered);
    assert_eq!(kubelet.plugins().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_files_and_dot_dirs_are_ignored() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let ep = dra_socket(&d.plugins, DRIVER);
    let hidden = FakeDra::start_with(
        &d.registry.join(".hidden-reg.sock"),
        None,
        info("hidden.example.com", &ep, &[V1_SERVICE]),
    )
    .await;
    std::fs::create_dir_all(d.registry.join(".dir")).unwrap();
    let in_dot_dir = FakeDra::start_with(
        &d.registry.join(".dir").join("x-reg.sock"),
        None,
        info("dotdir.example.com", &ep, &[V1_SERVICE]),
    )
    .await;
    // A subdirectory without a dot is watched (the kubelet recurses).
    std::fs::create_dir_all(d.registry.join("sub")).unwrap();
    let nested = FakeDra::start_with(
        &d.registry.join("sub").join("n-reg.sock"),
        None,
        info("nested.example.com", &ep, &[V1_SERVICE]),
    )
    .await;
    // The visible plugin comes last; once it is in, every scan has passed the hidden ones.
    let _visible = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    kubelet.wait_for_plugin("nested.example.com", T).await.unwrap();
    assert_eq!(*hidden.get_info_calls.lock().unwrap(), 0);
    assert_eq!(*in_dot_dir.get_info_calls.lock().unwrap(), 0);
    assert_eq!(*nested.get_info_calls.lock().unwrap(), 1);
    assert!(
        kubelet.registrations().iter().all(|r| r
            .socket
            .strip_prefix(&d.registry)
            .unwrap()
            .components()
            .all(|c| !c.as_os_str().to_string_lossy().starts_with('.'))),
        "{:?}",
        kubelet.registrations()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_registration_socket_deregisters_and_a_new_one_registers_again() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    let first = kubelet.wait_for_plugin(DRIVER, T).await.unwrap();

    std::fs::remove_file(&plugin.reg_socket).unwrap();
    kubelet.wait_for_deregistration(DRIVER, T).await.unwrap();
    assert_eq!(kubelet.plugins(), vec![]);
    assert!(matches!(
        kubelet.prepare(DRIVER, &[claim("a")]).await,
        Err(DraError::NotRegistered { .. })
    ));
    drop(plugin);

    // The plugin comes back under the same file name: a new socket, a new registration.
    let back = Instant::now();
    let _plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    let again = kubelet.wait_for_plugin_since(DRIVER, Some(back), T).await.unwrap();
    assert!(again.at > first.at);
    assert_eq!(kubelet.plugins().len(), 1);
}

fn claim(uid: &str) -> ClaimRef {
    ClaimRef::new("default", &format!("claim-{uid}"), uid)
}

fn pb_claim(uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

async fn round_trip(services: &[&str], want_package: &'static str) {
    let d = dirs();
    let opts = DraOptions {
        services: services.iter().map(|s| s.to_string()).collect(),
        ..DraOptions::default()
    };
    let kubelet = DraKubelet::start(&d.registry, opts).await.unwrap();
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    // One claim fails on the plugin's side; the other is prepared.
    plugin.set_prepare(|claims| {
        let mut resp = good_prepare(claims)?;
        if let Some(r) = resp.claims.get_mut("u2") {
            r.error = "GPU gone".into();
        }
        Ok(resp)
    });

    let prepared = kubelet.prepare(DRIVER, &[claim("u1"), claim("u2")]).await.unwrap();
    assert_eq!(prepared.len(), 2);
    assert_eq!(
        prepared["u1"],
        Ok(vec![PreparedDevice {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["k8s.gpu.example.com/claim=u1-gpu-0".into()],
            share_id: None,
        }])
    );
    assert_eq!(prepared["u2"], Err("GPU gone".to_string()));

    let unprepared = kubelet.unprepare(DRIVER, &[claim("u1")]).await.unwrap();
    assert_eq!(
        unprepared.into_iter().collect::<Vec<_>>(),
        vec![("u1".to_string(), Ok(()))]
    );

    assert_eq!(
        plugin.calls(),
        vec![
            Call {
                service: want_package,
                method: "NodePrepareResources",
                claims: vec![pb_claim("u1"), pb_claim("u2")],
            },
            Call {
                service: want_package,
                method: "NodeUnprepareResources",
                claims: vec![pb_claim("u1")],
            },
        ]
    );
    assert_eq!(kubelet.violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_unprepare_through_v1() {
    round_trip(&[V1_SERVICE, V1BETA1_SERVICE], "v1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_unprepare_through_v1beta1() {
    round_trip(&[V1BETA1_SERVICE], "v1beta1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_error_fails_the_call() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    plugin.set_prepare(|_| Err(Status::unavailable("not ready")));
    plugin.set_unprepare(|_| Err(Status::internal("boom")));
    match kubelet.prepare(DRIVER, &[claim("u1")]).await {
        Err(DraError::Rpc(s)) => {
            assert_eq!(s.code(), tonic::Code::Unavailable);
            assert_eq!(s.message(), "not ready");
        }
        other => panic!("{other:?}"),
    }
    let err = kubelet.unprepare(DRIVER, &[claim("u1")]).await.unwrap_err();
    assert_eq!(err.to_string(), "rpc error: code = Internal desc = boom");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_outlasts_the_timeout_fails() {
    let d = dirs();
    let opts = DraOptions {
        call_timeout: Duration::from_millis(200),
        ..DraOptions::default()
    };
    let kubelet = DraKubelet::start(&d.registry, opts).await.unwrap();
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    *plugin.behaviour.delay.lock().unwrap() = Duration::from_secs(30);
    let err = kubelet.prepare(DRIVER, &[claim("u1")]).await.unwrap_err();
    // Either our deadline or the plugin's (tonic enforces grpc-timeout) ends it.
    assert!(
        matches!(&err, DraError::Timeout { .. })
            || matches!(&err, DraError::Rpc(s) if s.code() == tonic::Code::Cancelled || s.code() == tonic::Code::DeadlineExceeded),
        "{err:?}"
    );
}

/// A registered fake plugin and a 1.34 kubelet.
async fn registered() -> (Dirs, DraKubelet, FakeDra) {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let plugin = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    (d, kubelet, plugin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_claim_fails_prepare_and_unprepare() {
    let (_d, kubelet, plugin) = registered().await;
    plugin.set_prepare(|claims| {
        let mut resp = good_prepare(claims)?;
        resp.claims.remove("u2");
        Ok(resp)
    });
    plugin.set_unprepare(|claims| good_unprepare(&claims[..1]));
    let err = kubelet.prepare(DRIVER, &[claim("u1"), claim("u2")]).await.unwrap_err();
    assert!(matches!(&err, DraError::Invalid(_)), "{err:?}");
    assert_eq!(err.to_string(), "NodePrepareResources skipped 1 ResourceClaims");
    let err = kubelet
        .unprepare(DRIVER, &[claim("u1"), claim("u2"), claim("u3")])
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "NodeUnprepareResources skipped 2 ResourceClaims");
    // Skipping is an error the kubelet retries, not a protocol violation.
    assert_eq!(kubelet.violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_for_an_unknown_uid_fails_and_is_a_violation() {
    let (_d, kubelet, plugin) = registered().await;
    plugin.set_prepare(|claims| {
        let mut resp = good_prepare(claims)?;
        let r = resp.claims.remove("u1").unwrap_or_default();
        resp.claims.insert("other".into(), r);
        Ok(resp)
    });
    plugin.set_unprepare(|_| good_unprepare(&[pb_claim("stranger")]));
    let err = kubelet.prepare(DRIVER, &[claim("u1")]).await.unwrap_err();
    assert!(matches!(&err, DraError::Invalid(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "NodePrepareResources returned result for unknown claim UID other"
    );
    let err = kubelet.unprepare(DRIVER, &[claim("u1")]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "NodeUnprepareResources returned result for unknown claim UID stranger"
    );
    let v = kubelet.violations();
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(v[0].contains("NodePrepareResources") && v[0].contains("other"), "{v:?}");
    assert!(
        v[1].contains("NodeUnprepareResources") && v[1].contains("stranger"),
        "{v:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_devices_are_violations() {
    let (_d, kubelet, plugin) = registered().await;
    plugin.set_prepare(|claims| {
        let mut resp = good_prepare(claims)?;
        let r = resp.claims.get_mut("u1").unwrap();
        r.devices[0].cdi_device_ids = vec!["gpu-0".into(), "k8s.gpu.example.com/claim=ok".into()];
        r.devices.push(v1::Device {
            pool_name: String::new(),
            device_name: "gpu-1".into(),
            ..Default::default()
        });
        // A failed claim's devices are ignored, so they are not checked.
        if let Some(r) = resp.claims.get_mut("u2") {
            r.error = "failed".into();
            r.devices[0].cdi_device_ids = vec!["nonsense".into()];
        }
        Ok(resp)
    });
    let prepared = kubelet.prepare(DRIVER, &[claim("u1"), claim("u2")]).await.unwrap();
    assert_eq!(
        prepared["u1"].as_ref().map(Vec::len),
        Ok(2),
        "the devices still come back"
    );
    let v = kubelet.violations();
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(
        v[0].contains("default/claim-u1 (u1)") && v[0].contains("\"gpu-0\" is not a fully qualified CDI name"),
        "{v:?}"
    );
    assert!(v[1].contains("pool_name is empty"), "{v:?}");
}

fn dev(request_names: &[&str], cdi: &str) -> PreparedDevice {
    PreparedDevice {
        request_names: request_names.iter().map(|s| s.to_string()).collect(),
        pool_name: "node-a".into(),
        device_name: cdi.into(),
        cdi_device_ids: vec![format!("example.com/gpu={cdi}")],
        share_id: None,
    }
}

#[test]
fn cdi_devices_follow_request_names() {
    let prepared = vec![
        dev(&["gpu"], "a"),
        dev(&[], "all"),
        dev(&["other", "gpu"], "b"),
        dev(&["other"], "c"),
    ];
    assert_eq!(
        DraKubelet::cdi_devices_for(&prepared, "gpu"),
        vec!["example.com/gpu=a", "example.com/gpu=all", "example.com/gpu=b"]
    );
    assert_eq!(
        DraKubelet::cdi_devices_for(&prepared, "other"),
        vec!["example.com/gpu=all", "example.com/gpu=b", "example.com/gpu=c"]
    );
    // A request the driver did not name gets only the devices without request_names.
    assert_eq!(
        DraKubelet::cdi_devices_for(&prepared, "gpu-main"),
        vec!["example.com/gpu=all"]
    );
    assert_eq!(
        DraKubelet::cdi_devices_for(&prepared[..1], "gpu-main"),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_registration_socket_registers_again() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let old = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    kubelet.wait_for_plugin(DRIVER, T).await.unwrap();
    // The new instance unlinks the old socket and listens anew under the same name, at once.
    let back = Instant::now();
    let new = FakeDra::start(&d.registry, &d.plugins, DRIVER).await;
    drop(old);
    let again = kubelet.wait_for_plugin_since(DRIVER, Some(back), T).await.unwrap();
    assert!(again.is_accepted(), "{again:?}");
    assert_eq!(kubelet.plugins().len(), 1);
    assert!(new.wait_for_status().await.plugin_registered);
}

#[tokio::test]
async fn a_failed_registration_is_tried_again_with_backoff() {
    let d = dirs();
    let kubelet = DraKubelet::start(&d.registry, DraOptions::default()).await.unwrap();
    let ep = dra_socket(&d.plugins, DRIVER);
    let reg = d.registry.join(format!("{DRIVER}-reg.sock"));
    let plugin = FakeDra::start_failing(&reg, Some(&ep), info(DRIVER, &ep, &[V1_SERVICE]), 1).await;
    let accepted = kubelet
        .wait_for_plugin(DRIVER, T)
        .await
        .expect("registered on the second try");
    let attempts = kubelet.registrations();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert!(!attempts[0].is_accepted());
    assert!(accepted.at.duration_since(attempts[0].at) >= test_kubelet::dra::RETRY_FIRST);
    assert_eq!(*plugin.get_info_calls.lock().unwrap(), 2);
    assert!(plugin.wait_for_status().await.plugin_registered);
}
