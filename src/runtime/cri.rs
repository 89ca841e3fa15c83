//! The engine's own word after a restart: the CRI `Status` call on its socket.
//!
//! `systemctl is-active` is not enough: a containerd whose CRI plugin failed to load (a default
//! runtime that names no runtime, say) keeps running without it, so the unit is active and
//! `containerd config dump` works while every pod on the node fails. The stage therefore asks the
//! engine over the CRI itself which runtime handlers it has, and for containerd reads the CRI
//! plugin's load error from `ctr plugins ls --detailed` when the call finds no CRI.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::Endpoint;

/// The generated CRI messages and services (`proto/cri/runtime/v1/api.proto`).
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::runtime_service_client::RuntimeServiceClient;
use api::{StatusRequest, VersionRequest};

/// What the engine says over the CRI.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CriStatus {
    /// `containerd 1.6.20`, `cri-o 1.30.0`.
    pub runtime: String,
    /// The runtime handlers it knows (RuntimeClass handlers): `runtime_handlers` of newer
    /// runtimes, and the runtimes of its verbose configuration.
    pub handlers: BTreeSet<String>,
    /// The handler a pod without a RuntimeClass gets, when the configuration says.
    pub default_handler: Option<String>,
    /// Conditions that are not true, as `Type: reason: message` (`NetworkReady` is false on a
    /// node without CNI configuration, which is normal before the CNI plugin is installed).
    pub not_ready: Vec<String>,
    /// The verbose status's `info["config"]` as the engine sent it (JSON), when it sent one.
    pub config: Option<String>,
}

impl CriStatus {
    /// Why this status does not serve pods with the handlers `wanted` (the agent's runtimes, the
    /// default): `None` when it does.
    pub fn missing(&self, wanted: &[&str]) -> Option<String> {
        let mut problems = Vec::new();
        let absent: Vec<&str> = wanted.iter().copied().filter(|h| !self.handlers.contains(*h)).collect();
        if !absent.is_empty() {
            problems.push(format!(
                "its CRI lists no runtime handler {} (it has: {})",
                absent.join(", "),
                self.handlers.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        if let Some(cond) = self.not_ready.iter().find(|c| c.starts_with("RuntimeReady")) {
            problems.push(format!("its CRI is not ready ({cond})"));
        }
        (!problems.is_empty()).then(|| problems.join("; "))
    }
}

/// Why the CRI could not be asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CriError {
    #[error("cannot connect to the CRI socket {socket}: {message}")]
    Connect { socket: PathBuf, message: String },
    /// The socket answers but serves no CRI RuntimeService: containerd without its CRI plugin.
    #[error("{socket} serves no CRI (the engine's CRI plugin is not loaded: {message})")]
    NoCri { socket: PathBuf, message: String },
    #[error("the CRI {call} call on {socket} failed: {message}")]
    Call {
        socket: PathBuf,
        call: &'static str,
        message: String,
    },
}

/// Asks the CRI on `socket` for its version and verbose status; connection failures, and a CRI
/// that says it is still starting, are tried again until `wait` has passed (an engine that was
/// just restarted may not listen yet, and containerd's CRI answers "server is not initialized
/// yet" for a moment after it listens). A socket that answers without the RuntimeService is
/// [`CriError::NoCri`] at once.
pub async fn status(socket: &Path, wait: Duration) -> Result<CriStatus, CriError> {
    let deadline = Instant::now() + wait;
    loop {
        match status_once(socket).await {
            Err(e) if starting(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// Whether the error is an engine still coming up: not listening yet, or containerd's CRI
/// before it has loaded (its interceptor answers every call with "server is not initialized
/// yet" until then).
fn starting(e: &CriError) -> bool {
    match e {
        CriError::Connect { .. } => true,
        CriError::Call { message, .. } => message.contains("not initialized yet"),
        CriError::NoCri { .. } => false,
    }
}

/// [`status`] from blocking code (the runtime stage runs on a blocking thread): a small
/// current-thread runtime on a thread of its own, so it works inside and outside Tokio.
pub fn status_blocking(socket: &Path, wait: Duration) -> Result<CriStatus, CriError> {
    let socket = socket.to_path_buf();
    let connect_error = |message: String| CriError::Connect {
        socket: socket.clone(),
        message,
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| connect_error(format!("cannot start the client: {e}")))?;
                runtime.block_on(status(&socket, wait))
            })
            .join()
            .unwrap_or_else(|_| Err(connect_error("the CRI client thread panicked".into())))
    })
}

/// One try of [`status`], each call with a time limit.
async fn status_once(socket: &Path) -> Result<CriStatus, CriError> {
    const CALL: Duration = Duration::from_secs(10);
    let path = socket.to_path_buf();
    let connect = |message: String| CriError::Connect {
        socket: socket.to_path_buf(),
        message,
    };
    // The URI is a placeholder: the connector always opens the Unix socket.
    let channel = Endpoint::from_static("http://localhost")
        .connect_timeout(CALL)
        .timeout(CALL)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| connect(crate::kube::error_chain(&e)))?;
    let mut client = RuntimeServiceClient::new(channel);
    let failed = |call: &'static str, status: tonic::Status| {
        let message = format!("{} ({:?})", status.message(), status.code());
        if status.code() == tonic::Code::Unimplemented {
            CriError::NoCri {
                socket: socket.to_path_buf(),
                message,
            }
        } else {
            CriError::Call {
                socket: socket.to_path_buf(),
                call,
                message,
            }
        }
    };
    let version = client
        .version(VersionRequest {
            version: "v1".to_owned(),
        })
        .await
        .map_err(|s| failed("Version", s))?
        .into_inner();
    let answer = client
        .status(StatusRequest { verbose: true })
        .await
        .map_err(|s| failed("Status", s))?
        .into_inner();
    let (mut handlers, default_handler) = answer
        .info
        .get("config")
        .map(|json| handlers_of_config(json))
        .unwrap_or_default();
    handlers.extend(
        answer
            .runtime_handlers
            .iter()
            .map(|h| h.name.clone())
            .filter(|n| !n.is_empty()),
    );
    let not_ready = answer
        .status
        .map(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| !c.status)
        .map(|c| format!("{}: {}: {}", c.r#type, c.reason, c.message))
        .collect();
    Ok(CriStatus {
        runtime: format!("{} {}", version.runtime_name, version.runtime_version),
        handlers,
        default_handler,
        not_ready,
        config: answer.info.get("config").cloned(),
    })
}

/// The runtimes and the default runtime of a verbose `Status`'s `info["config"]`: containerd
/// (1.6 to 2.x) has `{"containerd": {"defaultRuntimeName": "runc", "runtimes": {"runc": …}}}`.
/// Anything else gives nothing.
pub fn handlers_of_config(json: &str) -> (BTreeSet<String>, Option<String>) {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(json) else {
        return Default::default();
    };
    let containerd = &value["containerd"];
    let handlers = containerd["runtimes"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let default = containerd["defaultRuntimeName"].as_str().map(str::to_owned);
    (handlers, default)
}

/// The load errors of containerd's CRI plugins in the output of `ctr plugins ls --detailed`
/// (blocks of `Type:`, `ID:`, …, `Error:` with `Code:` and `Message:` lines): the message of
/// every plugin of a `cri` type or ID that has one, joined.
pub fn ctr_cri_errors(detailed: &str) -> Option<String> {
    let mut messages = Vec::new();
    let (mut kind, mut id, mut in_error) = (String::new(), String::new(), false);
    for line in detailed.lines() {
        let trimmed = line.trim();
        if let Some(v) = trimmed.strip_prefix("Type:") {
            (kind, id, in_error) = (v.trim().to_owned(), String::new(), false);
        } else if let Some(v) = trimmed.strip_prefix("ID:") {
            id = v.trim().to_owned();
        } else if trimmed.starts_with("Error:") {
            in_error = true;
        } else if let Some(message) = trimmed.strip_prefix("Message:")
            && in_error
            && (id == "cri" || kind.contains(".cri."))
        {
            messages.push(message.trim().to_owned());
        }
    }
    messages.dedup();
    (!messages.is_empty()).then(|| messages.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ctr plugins ls --detailed` of Debian's containerd 1.6.20 started with a drop-in that had
    /// only the `nvidia` runtime (the bug this check exists for), cut to two plugins.
    const CTR_DETAILED_1_6: &str = "\
Type:          io.containerd.snapshotter.v1
ID:            devmapper
Platforms:     linux/amd64
Error:
               Code:        Unknown
               Message:     devmapper not configured

Type:          io.containerd.grpc.v1
ID:            cri
Requires:
               io.containerd.event.v1
               io.containerd.service.v1
Platforms:     linux/amd64
Exports:
               CRIVersionAlpha      v1alpha2
               CRIVersion           v1
Error:
               Code:        Unknown
               Message:     invalid plugin config: no corresponding runtime configured in `containerd.runtimes` for `containerd` `default_runtime_name = \"runc\"
";

    #[test]
    fn the_cri_plugin_error_is_read_from_ctr() {
        assert_eq!(
            ctr_cri_errors(CTR_DETAILED_1_6).as_deref(),
            Some(
                "invalid plugin config: no corresponding runtime configured in `containerd.runtimes` for `containerd` \
                 `default_runtime_name = \"runc\""
            )
        );
        let ok = CTR_DETAILED_1_6.replace("ID:            cri", "ID:            other");
        assert_eq!(ctr_cri_errors(&ok), None, "a plugin that is not the CRI's");
        let v2 = "Type: io.containerd.cri.v1\nID: runtime\nError:\n Code: Unknown\n Message: bad runtime\n";
        assert_eq!(ctr_cri_errors(v2).as_deref(), Some("bad runtime"));
    }

    #[test]
    fn handlers_come_from_containerds_verbose_config() {
        let json = r#"{"containerd":{"snapshotter":"overlayfs","defaultRuntimeName":"nvidia",
            "runtimes":{"nvidia":{"runtimeType":"io.containerd.runc.v2"},"runc":{}}},"cni":{}}"#;
        let (handlers, default) = handlers_of_config(json);
        assert_eq!(handlers.into_iter().collect::<Vec<_>>(), ["nvidia", "runc"]);
        assert_eq!(default.as_deref(), Some("nvidia"));
        assert_eq!(handlers_of_config("{}"), (BTreeSet::new(), None));
        assert_eq!(handlers_of_config("not json"), (BTreeSet::new(), None));
    }

    #[test]
    fn missing_names_absent_handlers_and_a_runtime_not_ready() {
        let status = CriStatus {
            runtime: "containerd 1.6.20".into(),
            handlers: ["runc".to_owned(), "nvidia".to_owned()].into(),
            default_handler: Some("runc".into()),
            not_ready: vec!["NetworkReady: NetworkPluginNotReady: cni config uninitialized".into()],
            config: None,
        };
        assert_eq!(status.missing(&["nvidia", "runc"]), None, "NetworkReady does not count");
        let why = status.missing(&["nvidia", "nvidia-cdi"]).unwrap_or_default();
        assert!(
            why.contains("no runtime handler nvidia-cdi (it has: nvidia, runc)"),
            "{why}"
        );
        let mut down = status.clone();
        down.not_ready.push("RuntimeReady: x: y".into());
        assert!(down.missing(&[]).unwrap_or_default().contains("not ready"));
    }

    #[test]
    fn a_missing_socket_is_a_connect_error_after_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let err = status_blocking(&dir.path().join("none.sock"), Duration::from_millis(300)).unwrap_err();
        assert!(matches!(err, CriError::Connect { .. }), "{err}");
    }
}
