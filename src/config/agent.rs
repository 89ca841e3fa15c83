//! The daemon's own sections: `[log]`, `[agent]` (its files and loop), `[nvml]`, `[health]`,
//! `[validation]` and `[metrics]`, each with its defaults and its validation.

use super::values::{self, LogFormat};
use super::{Check, absolute_path, invalid, positive};
use crate::host::rooted;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `log.level`: the default tracing filter.
pub const DEFAULT_LOG_LEVEL: &str = "info";
/// `log.format`: journald when stderr is the journal, text otherwise.
pub const DEFAULT_LOG_FORMAT: LogFormat = LogFormat::Auto;

/// `agent.state_dir`: driver cache, backups, applied digests, the runtime stage's intent record.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/gpu-node-agent";
/// `agent.run_dir`: `status.json` and other runtime files.
pub const DEFAULT_RUN_DIR: &str = "/run/gpu-node-agent";
/// `agent.resync_interval`: full reconcile even without events.
pub const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(60);
/// `agent.retry_min`: the first wait before a failed stage runs again.
pub const DEFAULT_RETRY_MIN: Duration = Duration::from_secs(5);
/// `agent.retry_max`: the longest wait between attempts of a failing stage.
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(300);

/// `nvml.library`: a soname, found by the dynamic loader.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// `nvml.fail_on_init_error`: exit non-zero when NVML cannot be loaded or initialised.
pub const DEFAULT_NVML_FAIL_ON_INIT_ERROR: bool = true;
/// `nvml.retry_interval`: NVML init retry period when not failing on init errors.
pub const DEFAULT_NVML_RETRY_INTERVAL: Duration = Duration::from_secs(30);

/// `health.enabled`: watch Xid events and lost GPUs.
pub const DEFAULT_HEALTH_ENABLED: bool = true;
/// `health.ignored_xids`: application errors that do not make a GPU unhealthy (NVIDIA's
/// device-plugin list).
pub const DEFAULT_IGNORED_XIDS: &[u32] = &[13, 31, 43, 45, 68, 109];
/// `health.critical_xids`: always critical, even when listed in `ignored_xids`.
pub const DEFAULT_CRITICAL_XIDS: &[u32] = &[];
/// `health.recovery_after`: quiet time before an Xid-unhealthy GPU is healthy again.
pub const DEFAULT_RECOVERY_AFTER: Duration = Duration::from_secs(5 * 60);
/// `health.lost_check_interval`: probe period for a lost GPU.
pub const DEFAULT_LOST_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// `validation.enabled`: run the validation stage.
pub const DEFAULT_VALIDATION_ENABLED: bool = true;
/// `validation.cuda`: run the CUDA check (a kernel on every GPU, in a child process).
pub const DEFAULT_VALIDATION_CUDA: bool = true;

/// `metrics.enabled`: serve Prometheus metrics.
pub const DEFAULT_METRICS_ENABLED: bool = true;
/// `metrics.address`: dcgm-exporter's port, on the node's loopback only: a scraper on the pod
/// network (Prometheus) needs `address` set to the node's address or `0.0.0.0:9400`.
pub const DEFAULT_METRICS_ADDRESS: &str = "127.0.0.1:9400";
/// `metrics.max_connections`: connections served at once; more wait in the listen backlog.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = 64;
/// `metrics.path`.
pub const DEFAULT_METRICS_PATH: &str = "/metrics";
/// `metrics.interval`: how often GPU readings are taken (dcgm-exporter's default collect
/// interval is 30 s).
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(10);
/// `metrics.pod_resources_socket`: the kubelet's pod-resources API.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// `[log]`: logging. `RUST_LOG` overrides `level` at runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// A level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or a tracing filter such as
    /// `info,gpu_node_agent=debug`.
    pub level: String,
    /// Output format.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: DEFAULT_LOG_LEVEL.to_owned(),
            format: DEFAULT_LOG_FORMAT,
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Check {
        values::check_log_filter(&self.level).map_err(|reason| invalid("log.level", reason))
    }
}

/// `[agent]`: the daemon's own files and loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Persistent state (host path).
    pub state_dir: PathBuf,
    /// Runtime files such as `status.json` (host path).
    pub run_dir: PathBuf,
    /// Period of the full reconcile that runs even without events.
    #[serde(with = "values::duration")]
    pub resync_interval: Duration,
    /// A failed stage runs again after this, then after twice as long each time it fails the
    /// same way (with jitter), up to `retry_max`; passes in between leave it be.
    #[serde(with = "values::duration")]
    pub retry_min: Duration,
    #[serde(with = "values::duration")]
    pub retry_max: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            state_dir: DEFAULT_STATE_DIR.into(),
            run_dir: DEFAULT_RUN_DIR.into(),
            resync_interval: DEFAULT_RESYNC_INTERVAL,
            retry_min: DEFAULT_RETRY_MIN,
            retry_max: DEFAULT_RETRY_MAX,
        }
    }
}

impl AgentConfig {
    pub(super) fn validate(&self) -> Check {
        absolute_path("agent.state_dir", &self.state_dir)?;
        absolute_path("agent.run_dir", &self.run_dir)?;
        positive("agent.resync_interval", self.resync_interval)?;
        positive("agent.retry_min", self.retry_min)?;
        if self.retry_max < self.retry_min {
            return Err(invalid(
                "agent.retry_max",
                format!(
                    "must not be shorter than agent.retry_min ({})",
                    values::format_duration(self.retry_min)
                ),
            ));
        }
        Ok(())
    }
}

/// `[nvml]`: loading and initialising NVML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NvmlConfig {
    /// A soname without '/' (searched by the dynamic loader; under a root other than `/` first
    /// in the node's library folders, as `nvml::library_path` resolves it) or an absolute host
    /// path (root-prefixed).
    pub library: PathBuf,
    /// When NVML is missing or fails to initialise: exit non-zero (`true`), or run with no
    /// devices and retry every `retry_interval` (`false`).
    pub fail_on_init_error: bool,
    /// NVML init retry period when `fail_on_init_error` is false.
    #[serde(with = "values::duration")]
    pub retry_interval: Duration,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            library: DEFAULT_NVML_LIBRARY.into(),
            fail_on_init_error: DEFAULT_NVML_FAIL_ON_INIT_ERROR,
            retry_interval: DEFAULT_NVML_RETRY_INTERVAL,
        }
    }
}

impl NvmlConfig {
    /// A soname unchanged, an absolute path under `root`: the configured value alone, without
    /// the search of the node's library folders the agent adds (`nvml::library_path`).
    pub fn library_path(&self, root: &Path) -> PathBuf {
        if self.library.is_absolute() {
            rooted(root, &self.library)
        } else {
            self.library.clone()
        }
    }
}

impl NvmlConfig {
    pub(super) fn validate(&self) -> Check {
        let lib = self.library.as_os_str().as_encoded_bytes();
        if lib.is_empty() || (lib.contains(&b'/') && !self.library.is_absolute()) {
            return Err(invalid(
                "nvml.library",
                "expected a library soname such as \"libnvidia-ml.so.1\" or an absolute path",
            ));
        }
        positive("nvml.retry_interval", self.retry_interval)
    }
}

/// `[health]`: Xid events and lost GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Watch health at all; when false every GPU is advertised healthy.
    pub enabled: bool,
    /// Xids that do not make a GPU unhealthy.
    pub ignored_xids: Vec<u32>,
    /// Xids that are always critical, even when also in `ignored_xids`.
    pub critical_xids: Vec<u32>,
    /// Quiet time (no new critical Xid, NVML answering) after which an Xid-unhealthy GPU is
    /// advertised healthy again; zero means never.
    #[serde(with = "values::duration")]
    pub recovery_after: Duration,
    /// Probe period for a lost GPU.
    #[serde(with = "values::duration")]
    pub lost_check_interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            enabled: DEFAULT_HEALTH_ENABLED,
            ignored_xids: DEFAULT_IGNORED_XIDS.to_vec(),
            critical_xids: DEFAULT_CRITICAL_XIDS.to_vec(),
            recovery_after: DEFAULT_RECOVERY_AFTER,
            lost_check_interval: DEFAULT_LOST_CHECK_INTERVAL,
        }
    }
}

impl HealthConfig {
    pub(super) fn validate(&self) -> Check {
        // Xids are u32 by type; recovery_after = 0s means never recover.
        positive("health.lost_check_interval", self.lost_check_interval)
    }
}

/// `[validation]`: the last stage's checks (driver, runtime, CUDA, device plugin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidationConfig {
    /// Run the validation stage.
    pub enabled: bool,
    /// Run the CUDA check (once per driver version and daily).
    pub cuda: bool,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            enabled: DEFAULT_VALIDATION_ENABLED,
            cuda: DEFAULT_VALIDATION_CUDA,
        }
    }
}

/// `[metrics]`: Prometheus metrics with dcgm-exporter's names, and the agent's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Serve them.
    pub enabled: bool,
    /// Listen address, `host:port`.
    pub address: String,
    /// Connections served at once.
    pub max_connections: usize,
    /// HTTP path.
    pub path: String,
    /// How often GPU readings are taken (never per scrape).
    #[serde(with = "values::duration")]
    pub interval: Duration,
    /// The kubelet's pod-resources socket, for `pod`/`namespace`/`container` labels (host path).
    pub pod_resources_socket: PathBuf,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: DEFAULT_METRICS_ENABLED,
            address: DEFAULT_METRICS_ADDRESS.into(),
            max_connections: DEFAULT_METRICS_MAX_CONNECTIONS,
            path: DEFAULT_METRICS_PATH.into(),
            interval: DEFAULT_METRICS_INTERVAL,
            pod_resources_socket: DEFAULT_POD_RESOURCES_SOCKET.into(),
        }
    }
}

impl MetricsConfig {
    pub(super) fn validate(&self) -> Check {
        self.address
            .parse::<std::net::SocketAddr>()
            .map_err(|_| invalid("metrics.address", "expected host:port, e.g. \"0.0.0.0:9400\""))?;
        if !self.path.starts_with('/') {
            return Err(invalid("metrics.path", "expected a path starting with '/'"));
        }
        if !(1..=4096).contains(&self.max_connections) {
            return Err(invalid("metrics.max_connections", "expected 1 to 4096"));
        }
        positive("metrics.interval", self.interval)?;
        absolute_path("metrics.pod_resources_socket", &self.pod_resources_socket)
    }
}
