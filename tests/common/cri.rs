//! A stand-in CRI endpoint for the restart tests: the RuntimeService's Version and Status on a
//! Unix socket, answering like containerd does (its verbose Status carries the configuration
//! as JSON in `info["config"]`, with the runtimes and the default), or answering Unimplemented
//! like a containerd whose CRI plugin did not load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpu_node_agent::runtime::cri::api::runtime_service_server::{RuntimeService, RuntimeServiceServer};
use gpu_node_agent::runtime::cri::api::{
    RuntimeCondition, RuntimeStatus, StatusRequest, StatusResponse, VersionRequest, VersionResponse,
};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// What the stand-in answers.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A CRI with these runtime handlers and this default.
    Serving { handlers: Vec<String>, default: String },
    /// No RuntimeService (containerd without its CRI plugin).
    NoCri,
    /// [`Answer::NoCri`] while this file exists (the drop-in containerd's CRI fails with),
    /// else the runtimes `runc` and `nvidia` with `runc` the default.
    NoCriWith(PathBuf),
    /// What containerd's CRI answers for a moment after it listens, until `until`: every call
    /// fails with Unknown "server is not initialized yet"; then `then`.
    Initializing {
        until: std::time::Instant,
        then: Box<Answer>,
    },
}

#[derive(Clone)]
struct Service(Arc<Mutex<Answer>>);

#[tonic::async_trait]
impl RuntimeService for Service {
    async fn version(
        &self,
        _: tonic::Request<VersionRequest>,
    ) -> Result<tonic::Response<VersionResponse>, tonic::Status> {
        self.check()?;
        Ok(tonic::Response::new(VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "containerd".into(),
            runtime_version: "stand-in".into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn status(&self, _: tonic::Request<StatusRequest>) -> Result<tonic::Response<StatusResponse>, tonic::Status> {
        let Answer::Serving { handlers, default } = self.check()? else {
            unreachable!("check returned an error for NoCri")
        };
        let runtimes: serde_json::Map<String, serde_json::Value> = handlers
            .iter()
            .map(|h| (h.clone(), serde_json::json!({"runtimeType": "io.containerd.runc.v2"})))
            .collect();
        let config = serde_json::json!({"containerd": {"defaultRuntimeName": default, "runtimes": runtimes}});
        Ok(tonic::Response::new(StatusResponse {
            status: Some(RuntimeStatus {
                conditions: vec![RuntimeCondition {
                    r#type: "RuntimeReady".into(),
                    status: true,
                    reason: String::new(),
                    message: String::new(),
                }],
            }),
            info: HashMap::from([("config".to_owned(), config.to_string())]),
            runtime_handlers: Vec::new(),
        }))
    }
}

impl Service {
    fn check(&self) -> Result<Answer, tonic::Status> {
        let mut answer = self.0.lock().expect("answer").clone();
        if let Answer::Initializing { until, then } = answer {
            if std::time::Instant::now() < until {
                return Err(tonic::Status::unknown("server is not initialized yet"));
            }
            answer = *then;
        }
        match answer {
            Answer::NoCriWith(file) if !file.exists() => Ok(serving(&["runc", "nvidia"])),
            Answer::NoCri | Answer::NoCriWith(_) => Err(tonic::Status::unimplemented(
                "unknown service runtime.v1.RuntimeService",
            )),
            serving => Ok(serving),
        }
    }
}

/// The stand-in, serving on its own thread until dropped.
pub struct TestCri {
    pub socket: PathBuf,
    answer: Arc<Mutex<Answer>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestCri {
    /// Serves on `socket` (its directory is created), answering `answer`.
    pub fn start(socket: &Path, answer: Answer) -> TestCri {
        std::fs::create_dir_all(socket.parent().expect("socket dir")).expect("mkdir socket dir");
        let _ = std::fs::remove_file(socket);
        let std_listener = std::os::unix::net::UnixListener::bind(socket).expect("bind CRI socket");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let answer = Arc::new(Mutex::new(answer));
        let service = Service(answer.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = UnixListener::from_std(std_listener).expect("listener");
                let _ = tonic::transport::Server::builder()
                    .add_service(RuntimeServiceServer::new(service))
                    .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        TestCri {
            socket: socket.to_path_buf(),
            answer,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Answers `answer` from now on.
    pub fn set(&self, answer: Answer) {
        *self.answer.lock().expect("answer") = answer;
    }
}

impl Drop for TestCri {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// containerd with these handlers and `runc` as its default.
pub fn serving(handlers: &[&str]) -> Answer {
    Answer::Serving {
        handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
        default: "runc".into(),
    }
}
