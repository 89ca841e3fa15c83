//! The agent's configuration: typed sections with documented defaults, read from
//! `/etc/gpu-node-agent/config.toml` and then `config.d/*.toml` beside it, merged key by key,
//! and validated so that every error names the file, the line and the dotted key.
//!
//! Parsing is pure: [`Config::from_sources`] takes `(name, text)` pairs. Only [`Config::load`]
//! touches the filesystem, and it reads every default path through the `--root` prefix
//! ([`rooted`]).
//!
//! Adding a section: a struct with `#[serde(default, deny_unknown_fields)]`, a `Default` impl
//! built from `DEFAULT_*` consts, a `validate` method returning [`Check`]s keyed by dotted
//! names, a field on [`Config`] and a call in [`Config::validate`], and its keys in
//! `config/gpu-node-agent.toml` (a test keeps that file complete).

mod error;
mod merge;
mod sharing;
mod values;

use crate::host::rooted;
use crate::mig_layout::defaults::default_layouts;
use crate::mig_layout::{EntryField, Item, LayoutError, MigLayout};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use error::{ConfigError, EXIT_CONFIG, Location};
pub use sharing::{MemoryBudget, RESOURCE_PREFIX, SharedDevices, SharedResource, Sharing};
pub use values::{
    DeviceIdStrategy, DeviceListStrategies, DeviceListStrategy, LogFormat, MemoryAction, MigStrategy,
    ParseDurationError, ParseEnumError, SetAsDefault, SharedPolicy, SharingStrategy, format_duration, parse_duration,
};

use merge::{KeyPath, Merged};

/// The main config file, as a host path (read under `--root`).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/gpu-node-agent/config.toml";
/// Directory of drop-in files, next to the main file.
pub const DROP_IN_DIR: &str = "config.d";

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

/// `kubelet.device_plugin_dir`: where `kubelet.sock` is and plugin sockets go.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// `kubelet.register_timeout`: limit on one `Register` call.
pub const DEFAULT_REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// `device_plugin.enabled`: serve the kubelet device plugin.
pub const DEFAULT_DEVICE_PLUGIN_ENABLED: bool = true;
/// `device_plugin.mig_strategy`.
pub const DEFAULT_MIG_STRATEGY: MigStrategy = MigStrategy::None;
/// `device_plugin.device_list_strategy`.
pub const DEFAULT_DEVICE_LIST_STRATEGY: &[DeviceListStrategy] = &[DeviceListStrategy::Envvar];
/// `device_plugin.device_id_strategy`.
pub const DEFAULT_DEVICE_ID_STRATEGY: DeviceIdStrategy = DeviceIdStrategy::Uuid;
/// `device_plugin.pass_device_specs`: add `/dev/nvidia*` device specs to `Allocate` responses.
pub const DEFAULT_PASS_DEVICE_SPECS: bool = false;
/// `device_plugin.cdi_annotation_prefix`: annotation key prefix of the `cdi-annotations`
/// strategy.
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// `device_plugin.cdi_kind`: CDI `vendor/class` of the devices.
/// The agent writes the CDI spec for this kind itself (`[cdi]`), so the names it hands out
/// always resolve.
pub const DEFAULT_CDI_KIND: &str = "nvidia.com/gpu";
/// `device_plugin.driver_root`: where the driver's files are on the host.
pub const DEFAULT_DRIVER_ROOT: &str = "/";
/// `device_plugin.dev_root`: host root of `/dev/nvidia*` for device specs.
pub const DEFAULT_DEV_ROOT: &str = "/";
/// `device_plugin.host_mounts_driver_dir`: host dir with the driver's `lib64/` and `bin/`.
pub const DEFAULT_HOST_MOUNTS_DRIVER_DIR: &str = "/usr/local/nvidia";
/// `device_plugin.host_mounts_container_dir`: where that dir is mounted in the container.
pub const DEFAULT_HOST_MOUNTS_CONTAINER_DIR: &str = "/usr/local/nvidia";
/// `device_plugin.memory_limits.action`: a process over its replica's memory budget is logged.
pub const DEFAULT_MEMORY_ACTION: MemoryAction = MemoryAction::Log;
/// `device_plugin.memory_limits.interval`: how often GPU processes' memory is checked.
pub const DEFAULT_MEMORY_INTERVAL: Duration = Duration::from_secs(5);
/// `device_plugin.memory_limits.grace_period`: SIGTERM to SIGKILL under `action = "kill"`.
pub const DEFAULT_MEMORY_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// `mig.enabled`: run the MIG stage (apply the layout a Node label names).
pub const DEFAULT_MIG_ENABLED: bool = true;
/// `mig.default_layouts`: offer the built-in layouts (`all-disabled`, `all-1g.10gb`, ...).
pub const DEFAULT_MIG_DEFAULT_LAYOUTS: bool = true;
/// `mig.process_wait_timeout`: how long a layout change waits in `pending` for processes on the
/// GPUs to end before it is `failed`; zero waits forever.
pub const DEFAULT_MIG_PROCESS_WAIT_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// `mig.reboot_on_mode_change`: reboot when a MIG mode change needs a GPU reset that cannot be
/// done (else fail with the reason).
pub const DEFAULT_MIG_REBOOT_ON_MODE_CHANGE: bool = false;
/// Reset an idle GPU to finish a pending MIG mode change.
pub const DEFAULT_MIG_GPU_RESET: bool = true;
/// Where the driver's nvidia-smi is.
pub const DEFAULT_NVIDIA_SMI: &str = "/usr/bin/nvidia-smi";

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

/// `driver.enabled`: run the driver stage.
pub const DEFAULT_DRIVER_ENABLED: bool = true;
/// `driver.runfile_url`: NVIDIA's download site for data center drivers.
pub const DEFAULT_RUNFILE_URL: &str =
    "https://us.download.nvidia.com/tesla/{version}/NVIDIA-Linux-{arch}-{version}.run";
/// `driver.modprobe_conf`: the module options and nouveau blacklist the agent owns.
pub const DEFAULT_MODPROBE_CONF: &str = "/etc/modprobe.d/gpu-node-agent.conf";
/// `driver.package_names.ubuntu`: Canonical's signed precompiled modules for the running kernel
/// and the matching user space (`{branch}` is the version's first component, `{-open}` is
/// `-open` for the open flavour).
pub const DEFAULT_PACKAGES_UBUNTU: &[&str] = &[
    "linux-modules-nvidia-{branch}-server{-open}-{kernel}",
    "nvidia-headless-no-dkms-{branch}-server{-open}",
    "nvidia-utils-{branch}-server",
];
/// `driver.package_names.debian`: Debian's DKMS packages (built for the running kernel on
/// install; they need the kernel headers).
pub const DEFAULT_PACKAGES_DEBIAN: &[&str] = &[
    "linux-headers-{kernel}",
    "nvidia{-open}-kernel-dkms",
    "nvidia-driver",
    "nvidia-smi",
];
/// `driver.package_names.rhel`: NVIDIA's CUDA repository packages (DKMS flavour).
pub const DEFAULT_PACKAGES_RHEL: &[&str] = &["kernel-devel-{kernel}", "kmod-nvidia{-open}-dkms", "nvidia-driver-cuda"];

/// `runtime.enabled`: run the container runtime stage.
pub const DEFAULT_RUNTIME_ENABLED: bool = true;
/// `runtime.runtime_name`: the runtime (handler) name the engines get.
pub const DEFAULT_RUNTIME_NAME: &str = "nvidia";
/// `runtime.runtime_binary`: the NVIDIA Container Toolkit's runtime.
pub const DEFAULT_RUNTIME_BINARY: &str = "/usr/bin/nvidia-container-runtime";
/// `runtime.toolkit_config`: the NVIDIA Container Toolkit's config file.
pub const DEFAULT_TOOLKIT_CONFIG: &str = "/etc/nvidia-container-runtime/config.toml";
/// `runtime.restart_timeout`: how long a restarted engine has to become active again.
pub const DEFAULT_RUNTIME_RESTART_TIMEOUT: Duration = Duration::from_secs(30);
/// `runtime.systemctl`.
pub const DEFAULT_SYSTEMCTL: &str = "/usr/bin/systemctl";
/// `runtime.containerd.config`.
pub const DEFAULT_CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
/// `runtime.containerd.drop_in`.
pub const DEFAULT_CONTAINERD_DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";
/// `runtime.containerd.binary`.
pub const DEFAULT_CONTAINERD_BINARY: &str = "/usr/bin/containerd";
/// `runtime.docker.config`.
pub const DEFAULT_DOCKER_CONFIG: &str = "/etc/docker/daemon.json";
/// `runtime.docker.binary`.
pub const DEFAULT_DOCKER_BINARY: &str = "/usr/bin/dockerd";
/// `runtime.crio.config`.
pub const DEFAULT_CRIO_CONFIG: &str = "/etc/crio/crio.conf";
/// `runtime.crio.drop_in`.
pub const DEFAULT_CRIO_DROP_IN: &str = "/etc/crio/crio.conf.d/99-nvidia.toml";
/// `runtime.crio.binary`.
pub const DEFAULT_CRIO_BINARY: &str = "/usr/bin/crio";

/// `cdi.enabled`: write the CDI spec.
pub const DEFAULT_CDI_ENABLED: bool = true;
/// `cdi.dir`: the CDI directory for generated specs.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// `cdi.hook_paths`: the CDI hook binaries tried, in order; hooks go into the spec only when
/// one exists.
pub const DEFAULT_CDI_HOOK_PATHS: &[&str] = &["/usr/bin/nvidia-cdi-hook", "/usr/bin/nvidia-ctk"];

/// Talk to the Kubernetes API server at all.
pub const DEFAULT_KUBERNETES_ENABLED: bool = true;
/// Watch the Node (else poll it).
pub const DEFAULT_KUBERNETES_WATCH: bool = true;
/// Poll period when watching is off or failing.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(60);
/// Server-side length of one watch request (`timeoutSeconds`); a reconnect follows.
pub const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Limit on one API request (not on a watch stream).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// First retry delay after an API error; doubles, with jitter, up to `backoff_max`.
pub const DEFAULT_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest retry delay after API errors.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// Kubeconfigs tried, in order, when neither `kubeconfig` nor `$KUBECONFIG` names one: the
/// kubelet's own on kubeadm, EKS (AL2 and AL2023), GKE, k3s and RKE2 nodes.
pub const DEFAULT_KUBECONFIG_SEARCH: &[&str] = &[
    "/etc/kubernetes/kubelet.conf",
    "/var/lib/kubelet/kubeconfig",
    "/etc/kubernetes/kubelet/kubeconfig",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
    "/var/lib/rancher/rke2/agent/kubelet.kubeconfig",
];
/// The in-cluster service account directory (token, ca.crt, namespace).
pub const DEFAULT_IN_CLUSTER_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Post Kubernetes Events on the Node for state transitions.
pub const DEFAULT_EVENTS: bool = true;

/// Label naming the desired MIG layout.
pub const DEFAULT_LABEL_MIG_CONFIG: &str = "nvidia.com/mig.config";
/// Label the agent writes with the MIG layout's state.
pub const DEFAULT_LABEL_MIG_CONFIG_STATE: &str = "nvidia.com/mig.config.state";
/// Label naming the desired device plugin profile.
pub const DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG: &str = "nvidia.com/device-plugin.config";
/// Label the agent writes with the device plugin profile's state (its own addition).
pub const DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG_STATE: &str = "nvidia.com/device-plugin.config.state";
/// Label the agent writes with the validation stage's state (its own addition).
pub const DEFAULT_LABEL_VALIDATION_STATE: &str = "nvidia.com/gpu-node-agent.validation.state";
/// `validation.enabled`: run the validation stage.
pub const DEFAULT_VALIDATION_ENABLED: bool = true;
/// `validation.cuda`: run the CUDA check (a kernel on every GPU, in a child process).
pub const DEFAULT_VALIDATION_CUDA: bool = true;
/// `metrics.enabled`: serve Prometheus metrics.
pub const DEFAULT_METRICS_ENABLED: bool = true;
/// `metrics.address`: dcgm-exporter's port.
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:9400";
/// `metrics.path`.
pub const DEFAULT_METRICS_PATH: &str = "/metrics";
/// `metrics.interval`: how often GPU readings are taken (dcgm-exporter's default collect
/// interval is 30 s).
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(10);
/// `metrics.pod_resources_socket`: the kubelet's pod-resources API.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// Prefix of the reported GPU feature labels (GPU Feature Discovery's).
pub const DEFAULT_FEATURE_PREFIX: &str = "nvidia.com/";
/// Report the GPU feature labels.
pub const DEFAULT_REPORT_FEATURES: bool = true;

/// One config file's text, with the name messages use for it (its path as the user knows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Path as shown to the user, e.g. `/etc/gpu-node-agent/config.d/10-mig.toml`.
    pub name: String,
    /// The file's contents.
    pub text: String,
}

impl Source {
    /// A source from a name and text.
    pub fn new(name: impl Into<String>, text: impl Into<String>) -> Self {
        Source {
            name: name.into(),
            text: text.into(),
        }
    }
}

/// The whole configuration. Build it with [`Config::load`] or [`Config::from_sources`], which
/// validate; deserializing it directly skips validation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[log]`
    pub log: LogConfig,
    /// `[agent]`
    pub agent: AgentConfig,
    /// `[nvml]`
    pub nvml: NvmlConfig,
    /// `[kubelet]`
    pub kubelet: KubeletConfig,
    /// `[device_plugin]`
    pub device_plugin: DevicePluginConfig,
    /// `[driver]`
    pub driver: DriverConfig,
    /// `[runtime]`
    pub runtime: RuntimeConfig,
    /// `[cdi]`
    pub cdi: CdiConfig,
    /// `[mig]`
    pub mig: MigConfig,
    /// `[validation]`
    pub validation: ValidationConfig,
    /// `[metrics]`
    pub metrics: MetricsConfig,
    /// `[health]`
    pub health: HealthConfig,
    /// `[kubernetes]`
    pub kubernetes: KubernetesConfig,
    /// `[desired]`
    pub desired: DesiredConfig,
    /// `[labels]`
    pub labels: LabelsConfig,
}

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

/// `[nvml]`: loading and initialising NVML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NvmlConfig {
    /// A soname without '/' (searched by the dynamic loader, not root-prefixed) or an
    /// absolute host path (root-prefixed). Resolve with [`NvmlConfig::library_path`].
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
    /// What to hand the dynamic loader: a soname unchanged, an absolute path under `root`.
    pub fn library_path(&self, root: &Path) -> PathBuf {
        if self.library.is_absolute() {
            rooted(root, &self.library)
        } else {
            self.library.clone()
        }
    }
}

/// `[kubelet]`: talking to the kubelet's device-plugin API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeletConfig {
    /// Directory with `kubelet.sock`, where plugin sockets are created (host path).
    pub device_plugin_dir: PathBuf,
    /// Limit on one `Register` call.
    #[serde(with = "values::duration")]
    pub register_timeout: Duration,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        KubeletConfig {
            device_plugin_dir: DEFAULT_DEVICE_PLUGIN_DIR.into(),
            register_timeout: DEFAULT_REGISTER_TIMEOUT,
        }
    }
}

/// `[device_plugin]`: what is advertised to the kubelet and how devices reach containers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// Serve the device plugin.
    pub enabled: bool,
    /// How MIG devices are advertised.
    pub mig_strategy: MigStrategy,
    /// How allocated devices are passed to containers; non-empty, no duplicates,
    /// `host-mounts` not combined with a `cdi-*` strategy.
    pub device_list_strategy: DeviceListStrategies,
    /// How devices are named in responses.
    pub device_id_strategy: DeviceIdStrategy,
    /// Add `/dev/nvidia*` device specs to `Allocate` responses.
    pub pass_device_specs: bool,
    /// Annotation key prefix for `cdi-annotations`; ends with '/'.
    pub cdi_annotation_prefix: String,
    /// CDI device kind, `<vendor>/<class>`.
    pub cdi_kind: String,
    /// Where the driver's files are on the host (host path).
    pub driver_root: PathBuf,
    /// Host root of `/dev/nvidia*` for device specs (host path).
    pub dev_root: PathBuf,
    /// `host-mounts`: host dir with the driver's `lib64/` and `bin/` (host path; GKE:
    /// `/home/kubernetes/bin/nvidia`).
    pub host_mounts_driver_dir: PathBuf,
    /// `host-mounts`: where that dir is mounted in the container.
    pub host_mounts_container_dir: PathBuf,
    /// Profile applied when the Node has no `nvidia.com/device-plugin.config` label; empty:
    /// none (the keys above apply as they are).
    pub default_profile: String,
    /// Named profiles a Node label selects (`[device_plugin.profiles.<name>]`): each overrides
    /// some of the keys above. Labels only name profiles; what they do is defined here.
    pub profiles: BTreeMap<String, DevicePluginProfile>,
    /// `[device_plugin.sharing]`: time-slicing (none by default).
    pub sharing: Sharing,
    /// `[device_plugin.memory_limits]`: what happens to a process over its replica's memory
    /// budget (`sharing.resources[].memory_per_replica`).
    pub memory_limits: MemoryLimitsConfig,
}

/// `[device_plugin.memory_limits]`: the memory-limit enforcer's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryLimitsConfig {
    /// `log`, `kill` or `dry-run`.
    pub action: MemoryAction,
    /// How often the GPU processes' memory use is compared with the budgets.
    #[serde(with = "values::duration")]
    pub interval: Duration,
    /// Under `kill`: how long after SIGTERM a process still over its budget gets SIGKILL.
    #[serde(with = "values::duration")]
    pub grace_period: Duration,
}

impl Default for MemoryLimitsConfig {
    fn default() -> Self {
        MemoryLimitsConfig {
            action: DEFAULT_MEMORY_ACTION,
            interval: DEFAULT_MEMORY_INTERVAL,
            grace_period: DEFAULT_MEMORY_GRACE_PERIOD,
        }
    }
}

/// `[device_plugin.profiles.<name>]`: overrides of `[device_plugin]` keys, selected by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginProfile {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_strategy: Option<MigStrategy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<DeviceListStrategies>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_id_strategy: Option<DeviceIdStrategy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_device_specs: Option<bool>,
    /// Replaces the whole `[device_plugin.sharing]` table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

impl DevicePluginConfig {
    /// The effective `[device_plugin]` keys with the profile `name` applied; `None` when no
    /// such profile is defined.
    pub fn with_profile(&self, name: &str) -> Option<DevicePluginConfig> {
        let p = self.profiles.get(name)?;
        let mut out = self.clone();
        if let Some(v) = p.mig_strategy {
            out.mig_strategy = v;
        }
        if let Some(v) = &p.device_list_strategy {
            out.device_list_strategy = v.clone();
        }
        if let Some(v) = p.device_id_strategy {
            out.device_id_strategy = v;
        }
        if let Some(v) = p.pass_device_specs {
            out.pass_device_specs = v;
        }
        if let Some(v) = &p.sharing {
            out.sharing = v.clone();
        }
        Some(out)
    }
}

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            enabled: DEFAULT_DEVICE_PLUGIN_ENABLED,
            mig_strategy: DEFAULT_MIG_STRATEGY,
            device_list_strategy: DeviceListStrategies(DEFAULT_DEVICE_LIST_STRATEGY.to_vec()),
            device_id_strategy: DEFAULT_DEVICE_ID_STRATEGY,
            pass_device_specs: DEFAULT_PASS_DEVICE_SPECS,
            cdi_annotation_prefix: DEFAULT_CDI_ANNOTATION_PREFIX.to_owned(),
            cdi_kind: DEFAULT_CDI_KIND.to_owned(),
            driver_root: DEFAULT_DRIVER_ROOT.into(),
            dev_root: DEFAULT_DEV_ROOT.into(),
            host_mounts_driver_dir: DEFAULT_HOST_MOUNTS_DRIVER_DIR.into(),
            host_mounts_container_dir: DEFAULT_HOST_MOUNTS_CONTAINER_DIR.into(),
            default_profile: String::new(),
            profiles: BTreeMap::new(),
            sharing: Sharing::default(),
            memory_limits: MemoryLimitsConfig::default(),
        }
    }
}

/// Where the driver comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverSource {
    /// Installed by other means: only validated.
    None,
    /// The distribution's packages (apt or dnf).
    Package,
    /// An NVIDIA `.run` file, its modules built with kbuild for the running kernel.
    Runfile,
    /// A tarball of modules built for this kernel.
    Prebuilt,
}

/// Which kernel modules: `auto` picks open where the GPUs support it (Turing and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlavourChoice {
    Auto,
    Open,
    Proprietary,
}

/// `[driver]`: the NVIDIA kernel driver for the running kernel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DriverConfig {
    /// Run the driver stage.
    pub enabled: bool,
    /// `none` (validate only), `package`, `runfile` or `prebuilt`.
    pub source: DriverSource,
    /// The driver version wanted, e.g. `550.54.15`; required unless `source = "none"` (where it
    /// is only checked when set).
    pub version: String,
    /// `auto`, `open` or `proprietary`.
    pub flavour: FlavourChoice,
    /// Module parameters by module (`nvidia`, `nvidia-uvm`, `nvidia-modeset`, ...), e.g.
    /// `{ nvidia = ["NVreg_EnableGpuFirmware=1"] }`, written to `modprobe_conf` and passed when
    /// loading.
    pub module_params: BTreeMap<String, Vec<String>>,
    /// Modules loaded after the three core ones, e.g. `["nvidia-peermem"]`.
    pub extra_modules: Vec<String>,
    /// Turn persistence mode on after loading.
    pub persistence_mode: bool,
    /// The `.run` URL template (`{version}`, `{arch}`).
    pub runfile_url: String,
    /// sha256 of the `.run` file; required with `source = "runfile"` (no checksum, no download).
    pub runfile_sha256: String,
    /// URL template of the prebuilt modules tarball (`{version}`, `{kernel}`, `{flavour}`,
    /// `{arch}`).
    pub prebuilt_url: String,
    /// sha256 of the prebuilt tarball per kernel release.
    pub prebuilt_sha256: BTreeMap<String, String>,
    /// Package name templates per distribution family (`ubuntu`, `debian`, `rhel`), with
    /// `{version}`, `{branch}`, `{kernel}`, `{-open}`.
    pub package_names: BTreeMap<String, Vec<String>>,
    /// Module options and the nouveau blacklist the agent owns (host path).
    pub modprobe_conf: PathBuf,
}

impl Default for DriverConfig {
    fn default() -> Self {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        DriverConfig {
            enabled: DEFAULT_DRIVER_ENABLED,
            source: DriverSource::None,
            version: String::new(),
            flavour: FlavourChoice::Auto,
            module_params: BTreeMap::new(),
            extra_modules: Vec::new(),
            persistence_mode: true,
            runfile_url: DEFAULT_RUNFILE_URL.into(),
            runfile_sha256: String::new(),
            prebuilt_url: String::new(),
            prebuilt_sha256: BTreeMap::new(),
            package_names: BTreeMap::from([
                ("debian".to_string(), names(DEFAULT_PACKAGES_DEBIAN)),
                ("rhel".to_string(), names(DEFAULT_PACKAGES_RHEL)),
                ("ubuntu".to_string(), names(DEFAULT_PACKAGES_UBUNTU)),
            ]),
            modprobe_conf: DEFAULT_MODPROBE_CONF.into(),
        }
    }
}

/// A container engine the runtime stage configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Containerd,
    Docker,
    Crio,
}

impl Engine {
    /// Every engine, in the order they are configured.
    pub const ALL: [Engine; 3] = [Engine::Containerd, Engine::Docker, Engine::Crio];

    /// The name used in the config, status and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Containerd => "containerd",
            Engine::Docker => "docker",
            Engine::Crio => "crio",
        }
    }
}

/// How containers get GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuntimeMode {
    /// The engines get the `nvidia` runtime (NVIDIA Container Toolkit), and the CDI spec is written.
    Runtime,
    /// Only the CDI spec: the engines are not touched (containerd 2.x and CRI-O read CDI specs by
    /// default); the device plugin should use a `cdi-*` device list strategy.
    CdiOnly,
}

/// `[runtime]`: the `nvidia` runtime in containerd, docker and CRI-O.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Run the runtime stage.
    pub enabled: bool,
    /// `runtime` or `cdi-only`.
    pub mode: RuntimeMode,
    /// Engines to configure; empty: those found on the node (binary or systemd unit present).
    pub engines: Vec<Engine>,
    /// Runtime (handler) name, the RuntimeClass handler pods use.
    pub runtime_name: String,
    /// The runtime binary (host path); must exist in `runtime` mode.
    pub runtime_binary: PathBuf,
    /// Make it the default runtime: `"auto"` in the engine the kubelet uses, `true` in every
    /// engine, `false` in none.
    pub set_as_default: SetAsDefault,
    /// The kubelet's CRI endpoint (`unix:///run/containerd/containerd.sock`); empty: found on
    /// the node (the running kubelet's flags, kubeadm's flags file, the kubelet config).
    pub kubelet_runtime_endpoint: String,
    /// Also add the GPU Operator's `nvidia-cdi` and `nvidia-legacy` runtimes, for the
    /// `<runtime_binary>.cdi` and `.legacy` binaries the node has.
    pub extra_runtimes: bool,
    /// The NVIDIA Container Toolkit's config file (host path): with the `volume-mounts` device
    /// list strategy the agent sets its two `accept-nvidia-visible-devices-*` keys there, so
    /// unprivileged pods that request no GPU see none.
    pub toolkit_config: PathBuf,
    /// Turn on CDI in containerd (`enable_cdi`) and docker (`features.cdi`); CRI-O always has it.
    pub enable_cdi: bool,
    /// Restart an engine (`systemctl restart`) when its files changed; `--no-restart` and a
    /// `--root` other than `/` never restart.
    pub restart: bool,
    /// How long a restarted engine has to be active again before its files are rolled back.
    #[serde(with = "values::duration")]
    pub restart_timeout: Duration,
    /// The systemctl binary (host path).
    pub systemctl: PathBuf,
    /// `[runtime.containerd]`
    pub containerd: EngineFiles<Containerd>,
    /// `[runtime.docker]`
    pub docker: EngineFiles<Docker>,
    /// `[runtime.crio]`
    pub crio: EngineFiles<Crio>,
}

/// Which engine an [`EngineFiles`] section is for: its standard locations are the defaults.
pub trait EngineKind: Clone + std::fmt::Debug + PartialEq {
    const ENGINE: Engine;
}

macro_rules! engine_kinds {
    ($($name:ident),*) => {$(
        #[doc = concat!("[`EngineFiles`] of [`Engine::", stringify!($name), "`].")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name;
        impl EngineKind for $name {
            const ENGINE: Engine = Engine::$name;
        }
    )*};
}
engine_kinds!(Containerd, Docker, Crio);

/// Any engine's files (see [`RuntimeConfig::files`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnyEngine;
impl EngineKind for AnyEngine {
    const ENGINE: Engine = Engine::Containerd;
}

/// `[runtime.<engine>]`: where an engine's files, binary and unit are; keys left out are the
/// engine's standard locations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, bound = "")]
pub struct EngineFiles<E: EngineKind> {
    /// The engine's main config file (host path).
    pub config: PathBuf,
    /// The drop-in the agent owns (host path; docker has none: empty).
    #[serde(skip_serializing_if = "is_empty_path")]
    pub drop_in: PathBuf,
    /// The engine's binary (host path), for detection and checks.
    pub binary: PathBuf,
    /// Its systemd unit.
    pub unit: String,
    #[serde(skip)]
    kind: std::marker::PhantomData<E>,
}

fn is_empty_path(p: &Path) -> bool {
    p.as_os_str().is_empty()
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            enabled: DEFAULT_RUNTIME_ENABLED,
            mode: RuntimeMode::Runtime,
            engines: Vec::new(),
            runtime_name: DEFAULT_RUNTIME_NAME.into(),
            runtime_binary: DEFAULT_RUNTIME_BINARY.into(),
            set_as_default: SetAsDefault::Auto,
            kubelet_runtime_endpoint: String::new(),
            extra_runtimes: true,
            toolkit_config: DEFAULT_TOOLKIT_CONFIG.into(),
            enable_cdi: false,
            restart: true,
            restart_timeout: DEFAULT_RUNTIME_RESTART_TIMEOUT,
            systemctl: DEFAULT_SYSTEMCTL.into(),
            containerd: EngineFiles::default(),
            docker: EngineFiles::default(),
            crio: EngineFiles::default(),
        }
    }
}

impl<E: EngineKind> EngineFiles<E> {
    /// The same files, for code that handles every engine alike.
    pub fn erased(&self) -> EngineFiles<AnyEngine> {
        EngineFiles {
            config: self.config.clone(),
            drop_in: self.drop_in.clone(),
            binary: self.binary.clone(),
            unit: self.unit.clone(),
            kind: std::marker::PhantomData,
        }
    }
}

impl<E: EngineKind> Default for EngineFiles<E> {
    /// The engine's standard locations.
    fn default() -> Self {
        let (config, drop_in, binary, unit) = match E::ENGINE {
            Engine::Containerd => (
                DEFAULT_CONTAINERD_CONFIG,
                DEFAULT_CONTAINERD_DROP_IN,
                DEFAULT_CONTAINERD_BINARY,
                "containerd.service",
            ),
            Engine::Docker => (DEFAULT_DOCKER_CONFIG, "", DEFAULT_DOCKER_BINARY, "docker.service"),
            Engine::Crio => (
                DEFAULT_CRIO_CONFIG,
                DEFAULT_CRIO_DROP_IN,
                DEFAULT_CRIO_BINARY,
                "crio.service",
            ),
        };
        EngineFiles {
            config: config.into(),
            drop_in: drop_in.into(),
            binary: binary.into(),
            unit: unit.into(),
            kind: std::marker::PhantomData,
        }
    }
}

/// An engine's files without the engine in the type.
pub type AnyEngineFiles = EngineFiles<AnyEngine>;

impl RuntimeConfig {
    /// The files of `engine`.
    pub fn files(&self, engine: Engine) -> AnyEngineFiles {
        match engine {
            Engine::Containerd => self.containerd.erased(),
            Engine::Docker => self.docker.erased(),
            Engine::Crio => self.crio.erased(),
        }
    }
}

/// `[cdi]`: the CDI spec for the node's GPUs (kind `device_plugin.cdi_kind`, driver files from
/// `device_plugin.driver_root`, device nodes from `device_plugin.dev_root`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CdiConfig {
    /// Write the spec (at start and after every MIG change).
    pub enabled: bool,
    /// Directory of the generated spec (host path); the file is `<vendor>-<class>.json`.
    pub dir: PathBuf,
    /// CDI hook binaries tried in order (host paths); without one the spec has no hooks.
    pub hook_paths: Vec<PathBuf>,
}

impl Default for CdiConfig {
    fn default() -> Self {
        CdiConfig {
            enabled: DEFAULT_CDI_ENABLED,
            dir: DEFAULT_CDI_DIR.into(),
            hook_paths: DEFAULT_CDI_HOOK_PATHS.iter().map(PathBuf::from).collect(),
        }
    }
}

/// `[mig]`: MIG layouts, named like mig-parted's configs and selected by the
/// `nvidia.com/mig.config` label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigConfig {
    /// Run the MIG stage at all.
    pub enabled: bool,
    /// Offer the built-in layouts ([`default_layouts`]); user layouts with the same name
    /// replace them.
    pub default_layouts: bool,
    /// How long to wait in `pending` for processes on the GPUs to end before `failed`; zero
    /// waits forever.
    #[serde(with = "values::duration")]
    pub process_wait_timeout: Duration,
    /// When a MIG mode change needs a GPU reset that cannot be done: report `rebooting` and
    /// reboot (`true`), or fail with the reason (`false`).
    pub reboot_on_mode_change: bool,
    /// When a MIG mode change waits for a GPU reset and nothing runs on the GPU, reset it with
    /// `nvidia_smi --gpu-reset -i <uuid>` before falling back to `reboot_on_mode_change`.
    pub gpu_reset: bool,
    /// The nvidia-smi binary used for GPU resets (host path).
    pub nvidia_smi: PathBuf,
    /// The layout applied while the Node has no `nvidia.com/mig.config` label (empty: none,
    /// the GPUs are left as they are). Lets a bootstrap apply a layout before the node joins.
    pub default_layout: String,
    /// User layouts by name (`[[mig.layouts.<name>]]`), each a list of entries.
    pub layouts: BTreeMap<String, MigLayout>,
}

impl Default for MigConfig {
    fn default() -> Self {
        MigConfig {
            enabled: DEFAULT_MIG_ENABLED,
            default_layouts: DEFAULT_MIG_DEFAULT_LAYOUTS,
            process_wait_timeout: DEFAULT_MIG_PROCESS_WAIT_TIMEOUT,
            reboot_on_mode_change: DEFAULT_MIG_REBOOT_ON_MODE_CHANGE,
            gpu_reset: DEFAULT_MIG_GPU_RESET,
            nvidia_smi: DEFAULT_NVIDIA_SMI.into(),
            default_layout: String::new(),
            layouts: BTreeMap::new(),
        }
    }
}

impl MigConfig {
    /// The layout a label value names: a user layout, else a built-in one when
    /// `default_layouts` is on; `None` when neither has it.
    pub fn layout(&self, name: &str) -> Option<MigLayout> {
        if let Some(layout) = self.layouts.get(name) {
            return Some(layout.clone());
        }
        if self.default_layouts {
            return default_layouts().remove(name);
        }
        None
    }

    /// Every layout name a label may select, sorted.
    pub fn layout_names(&self) -> Vec<String> {
        self.all_layouts().into_keys().collect()
    }

    /// Every layout by name: the built-in ones (when `default_layouts`) with the user's over
    /// them.
    pub fn all_layouts(&self) -> BTreeMap<String, MigLayout> {
        let mut out = if self.default_layouts {
            default_layouts()
        } else {
            BTreeMap::new()
        };
        out.extend(self.layouts.iter().map(|(k, v)| (k.clone(), v.clone())));
        out
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
            path: DEFAULT_METRICS_PATH.into(),
            interval: DEFAULT_METRICS_INTERVAL,
            pod_resources_socket: DEFAULT_POD_RESOURCES_SOCKET.into(),
        }
    }
}

impl MetricsConfig {
    fn validate(&self) -> Check {
        self.address
            .parse::<std::net::SocketAddr>()
            .map_err(|_| invalid("metrics.address", "expected host:port, e.g. \"0.0.0.0:9400\""))?;
        if !self.path.starts_with('/') {
            return Err(invalid("metrics.path", "expected a path starting with '/'"));
        }
        positive("metrics.interval", self.interval)?;
        absolute_path("metrics.pod_resources_socket", &self.pod_resources_socket)
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

/// `[kubernetes]`: the API server connection used to read the Node's labels and report back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Talk to the API server; `false` runs on the labels file or the config alone.
    pub enabled: bool,
    /// Kubeconfig to use (host path); empty: `$KUBECONFIG`, then `kubeconfig_search`, then the
    /// in-cluster service account.
    pub kubeconfig: PathBuf,
    /// Kubeconfigs tried in order when none is named (host paths).
    pub kubeconfig_search: Vec<PathBuf>,
    /// In-cluster service account directory (host path), used with
    /// `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`.
    pub in_cluster_dir: PathBuf,
    /// This node's name; empty: `$NODE_NAME`, then the hostname.
    pub node_name: String,
    /// Watch the Node; `false` polls every `poll_interval`.
    pub watch: bool,
    /// Poll period when not watching (and while a watch cannot be established).
    #[serde(with = "values::duration")]
    pub poll_interval: Duration,
    /// Length of one watch request before it is renewed.
    #[serde(with = "values::duration")]
    pub watch_timeout: Duration,
    /// Limit on one request.
    #[serde(with = "values::duration")]
    pub request_timeout: Duration,
    /// First retry delay after an error; doubles with jitter up to `backoff_max`.
    #[serde(with = "values::duration")]
    pub backoff_min: Duration,
    /// Longest retry delay.
    #[serde(with = "values::duration")]
    pub backoff_max: Duration,
    /// Post Events on the Node for state transitions.
    pub events: bool,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            enabled: DEFAULT_KUBERNETES_ENABLED,
            kubeconfig: PathBuf::new(),
            kubeconfig_search: DEFAULT_KUBECONFIG_SEARCH.iter().map(PathBuf::from).collect(),
            in_cluster_dir: DEFAULT_IN_CLUSTER_DIR.into(),
            node_name: String::new(),
            watch: DEFAULT_KUBERNETES_WATCH,
            poll_interval: DEFAULT_POLL_INTERVAL,
            watch_timeout: DEFAULT_WATCH_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            backoff_min: DEFAULT_BACKOFF_MIN,
            backoff_max: DEFAULT_BACKOFF_MAX,
            events: DEFAULT_EVENTS,
        }
    }
}

/// `[desired]`: where the desired state comes from when not from the Node's labels.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DesiredConfig {
    /// A file of `key=value` label lines (host path), re-read when it changes, used instead of
    /// the Node's labels; empty: none.
    pub labels_file: PathBuf,
}

/// `[labels]`: the label keys read and written (GPU Operator compatible by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LabelsConfig {
    /// Desired MIG layout.
    pub mig_config: String,
    /// Reported MIG layout state: pending | rebooting | success | failed.
    pub mig_config_state: String,
    /// Desired device plugin profile.
    pub device_plugin_config: String,
    /// Reported device plugin profile state: success | failed.
    pub device_plugin_config_state: String,
    /// Reported validation stage state: success | failed | pending.
    pub validation_state: String,
    /// Prefix of the GPU feature labels (`<prefix>gpu.product`, ...).
    pub feature_prefix: String,
    /// Report the GPU feature labels.
    pub report_features: bool,
}

impl Default for LabelsConfig {
    fn default() -> Self {
        LabelsConfig {
            mig_config: DEFAULT_LABEL_MIG_CONFIG.into(),
            mig_config_state: DEFAULT_LABEL_MIG_CONFIG_STATE.into(),
            device_plugin_config: DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG.into(),
            device_plugin_config_state: DEFAULT_LABEL_DEVICE_PLUGIN_CONFIG_STATE.into(),
            validation_state: DEFAULT_LABEL_VALIDATION_STATE.into(),
            feature_prefix: DEFAULT_FEATURE_PREFIX.into(),
            report_features: DEFAULT_REPORT_FEATURES,
        }
    }
}

// === impl Config ===

impl Config {
    /// Merges and validates config texts given in order (main file first, then drop-ins in
    /// name order). Later sources override earlier ones key by key: tables merge recursively,
    /// a scalar or an array replaces. No sources gives the defaults. Pure: reads no files.
    pub fn from_sources(sources: &[Source]) -> Result<Config, ConfigError> {
        let mut merged = Merged::default();
        for source in sources {
            merged.add(&source.name, &source.text)?;
        }
        let config: Config =
            serde_path_to_error::deserialize(merged.to_value()).map_err(|e| deserialize_error(&merged, e))?;
        config.validate().map_err(|invalid| invalid.resolve(&merged, &config))?;
        Ok(config)
    }

    /// Reads the main file and its drop-ins and returns the config with the names of the files
    /// read, in order.
    ///
    /// The main file is `explicit` as given (a real path, not prefixed), or
    /// [`DEFAULT_CONFIG_PATH`] under `root`; a missing default file means defaults, a missing
    /// explicit one is an error. Drop-ins are the `*.toml` files in [`DROP_IN_DIR`] next to the
    /// main file, in byte order of their names; hidden files, other names and directories are
    /// skipped, and a missing directory is fine.
    pub fn load(root: &Path, explicit: Option<&Path>) -> Result<(Config, Vec<String>), ConfigError> {
        let main = match explicit {
            Some(path) => path.to_path_buf(),
            None => rooted(root, Path::new(DEFAULT_CONFIG_PATH)),
        };
        let mut sources = Vec::new();
        match read(&main) {
            Ok(source) => sources.push(source),
            Err(ConfigError::ReadFile { source, .. })
                if explicit.is_none() && source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let dir = main.parent().unwrap_or(Path::new("")).join(DROP_IN_DIR);
        for path in drop_ins(&dir)? {
            sources.push(read(&path)?);
        }
        let config = Config::from_sources(&sources)?;
        Ok((config, sources.into_iter().map(|s| s.name).collect()))
    }

    /// Checks the rules serde cannot: paths, ranges, formats, and rules across keys.
    fn validate(&self) -> Check {
        self.log.validate()?;
        self.agent.validate()?;
        self.nvml.validate()?;
        self.kubelet.validate()?;
        self.device_plugin.validate()?;
        self.driver.validate()?;
        self.runtime.validate()?;
        self.cdi.validate()?;
        self.mig.validate()?;
        self.metrics.validate()?;
        self.health.validate()?;
        self.kubernetes.validate()?;
        self.desired.validate()?;
        self.labels.validate()?;
        Ok(())
    }
}

fn read(path: &Path) -> Result<Source, ConfigError> {
    let text = fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Source::new(path.display().to_string(), text))
}

/// The drop-in files of `dir`, sorted by name.
fn drop_ins(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let read_dir_error = |source| ConfigError::ReadDir {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(read_dir_error(e)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(read_dir_error)?;
        let name = entry.file_name();
        let name = name.as_encoded_bytes();
        if name.starts_with(b".") || !name.ends_with(b".toml") {
            continue;
        }
        let path = entry.path();
        // Follows symlinks; a dangling one is left for `read` to report.
        if fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        files.push(path);
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

// === validation ===

/// A rule broken by the key at `key`; [`Invalid::resolve`] adds where that key was set and
/// its value.
#[derive(Debug)]
struct Invalid {
    key: KeyPath,
    reason: String,
}

/// The result of one validation rule.
type Check = Result<(), Invalid>;

fn invalid(key: &str, reason: impl Into<String>) -> Invalid {
    Invalid {
        key: KeyPath::dotted(key),
        reason: reason.into(),
    }
}

impl Invalid {
    fn resolve(self, merged: &Merged, config: &Config) -> ConfigError {
        // A key no file set is shown with its effective (default) value.
        let value = merged.value(&self.key).or_else(|| {
            toml::Value::try_from(config)
                .ok()
                .and_then(|v| merge::value_in(&v, &self.key))
        });
        ConfigError::InvalidValue {
            at: merged.origin(&self.key, true).cloned(),
            key: self.key.to_string(),
            value: value.map_or_else(|| "?".to_owned(), |v| v.to_string()),
            reason: self.reason,
        }
    }
}

fn absolute_path(key: &str, path: &Path) -> Check {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(invalid(key, "expected an absolute path"))
    }
}

fn positive(key: &str, d: Duration) -> Check {
    if d.is_zero() {
        Err(invalid(key, "expected a duration greater than 0s"))
    } else {
        Ok(())
    }
}

impl LogConfig {
    fn validate(&self) -> Check {
        values::check_log_filter(&self.level).map_err(|reason| invalid("log.level", reason))
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl DriverConfig {
    fn validate(&self) -> Check {
        let version_ok = |v: &str| {
            !v.is_empty()
                && v.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        };
        if !self.version.is_empty() && !version_ok(&self.version) {
            return Err(invalid(
                "driver.version",
                "expected a driver version such as \"550.54.15\"",
            ));
        }
        if self.source != DriverSource::None && self.version.is_empty() {
            return Err(invalid(
                "driver.source",
                "installing a driver needs [driver] version (e.g. \"550.54.15\")",
            ));
        }
        if self.source == DriverSource::Runfile && !is_sha256(&self.runfile_sha256) {
            return Err(invalid(
                "driver.runfile_sha256",
                "source = \"runfile\" needs the .run file's sha256 (64 hex digits): nothing is downloaded without one",
            ));
        }
        if self.source == DriverSource::Prebuilt && self.prebuilt_url.is_empty() {
            return Err(invalid(
                "driver.prebuilt_url",
                "source = \"prebuilt\" needs a URL template",
            ));
        }
        for (kernel, sum) in &self.prebuilt_sha256 {
            if !is_sha256(sum) {
                return Err(Invalid {
                    key: KeyPath::dotted("driver.prebuilt_sha256").key(kernel),
                    reason: "expected a sha256 (64 hex digits)".into(),
                });
            }
        }
        for distro in self.package_names.keys() {
            if !["debian", "rhel", "ubuntu"].contains(&distro.as_str()) {
                return Err(Invalid {
                    key: KeyPath::dotted("driver.package_names").key(distro),
                    reason: "expected one of debian, rhel, ubuntu".into(),
                });
            }
        }
        for module in self.module_params.keys().chain(self.extra_modules.iter()) {
            if module.is_empty()
                || !module
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid(
                    "driver.module_params",
                    format!("{module:?} is not a kernel module name"),
                ));
            }
        }
        for (module, params) in &self.module_params {
            for p in params {
                let ok = p.split_once('=').is_some_and(|(k, _)| !k.is_empty()) && !p.contains(char::is_whitespace);
                if !ok {
                    return Err(Invalid {
                        key: KeyPath::dotted("driver.module_params").key(module),
                        reason: format!("{p:?} is not a module parameter (name=value, no spaces)"),
                    });
                }
            }
        }
        absolute_path("driver.modprobe_conf", &self.modprobe_conf)
    }
}

impl RuntimeConfig {
    fn validate(&self) -> Check {
        crate::names::check_label_value(&self.runtime_name)
            .map_err(|reason| invalid("runtime.runtime_name", format!("a runtime handler name: {reason}")))?;
        absolute_path("runtime.runtime_binary", &self.runtime_binary)?;
        absolute_path("runtime.systemctl", &self.systemctl)?;
        absolute_path("runtime.toolkit_config", &self.toolkit_config)?;
        if !self.kubelet_runtime_endpoint.is_empty() && !self.kubelet_runtime_endpoint.starts_with("unix:///") {
            return Err(invalid(
                "runtime.kubelet_runtime_endpoint",
                "expected a unix:// endpoint such as \"unix:///run/containerd/containerd.sock\", or \"\" to find it",
            ));
        }
        positive("runtime.restart_timeout", self.restart_timeout)?;
        for (i, engine) in self.engines.iter().enumerate() {
            if self.engines[..i].contains(engine) {
                return Err(invalid(
                    "runtime.engines",
                    format!("{} is listed twice", engine.as_str()),
                ));
            }
        }
        for engine in Engine::ALL {
            let files = self.files(engine);
            let key = |k: &str| format!("runtime.{}.{k}", engine.as_str());
            absolute_path(&key("config"), &files.config)?;
            absolute_path(&key("binary"), &files.binary)?;
            if engine == Engine::Docker {
                if !files.drop_in.as_os_str().is_empty() {
                    return Err(invalid(&key("drop_in"), "docker reads no drop-in files; leave it out"));
                }
            } else {
                absolute_path(&key("drop_in"), &files.drop_in)?;
            }
            if files.unit.is_empty() || files.unit.contains('/') {
                return Err(invalid(
                    &key("unit"),
                    "expected a systemd unit name such as \"containerd.service\"",
                ));
            }
        }
        Ok(())
    }
}

impl CdiConfig {
    fn validate(&self) -> Check {
        absolute_path("cdi.dir", &self.dir)?;
        for (i, p) in self.hook_paths.iter().enumerate() {
            absolute_path(&format!("cdi.hook_paths[{i}]"), p)?;
        }
        Ok(())
    }
}

impl AgentConfig {
    fn validate(&self) -> Check {
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

impl NvmlConfig {
    fn validate(&self) -> Check {
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

impl KubeletConfig {
    fn validate(&self) -> Check {
        absolute_path("kubelet.device_plugin_dir", &self.device_plugin_dir)?;
        positive("kubelet.register_timeout", self.register_timeout)
    }
}

impl DevicePluginConfig {
    fn validate(&self) -> Check {
        check_strategies(
            KeyPath::dotted("device_plugin.device_list_strategy"),
            &self.device_list_strategy,
        )?;
        for (name, profile) in &self.profiles {
            let at = KeyPath::dotted("device_plugin.profiles").key(name);
            crate::names::check_label_value(name).map_err(|reason| Invalid {
                key: at.clone(),
                reason: format!("a profile name is selected by a label value: {reason}"),
            })?;
            if let Some(strategies) = &profile.device_list_strategy {
                check_strategies(at.clone().key("device_list_strategy"), strategies)?;
            }
            if let Some(sharing) = &profile.sharing {
                sharing.validate(&at.key("sharing"))?;
            }
        }
        self.sharing.validate(&KeyPath::dotted("device_plugin.sharing"))?;
        positive("device_plugin.memory_limits.interval", self.memory_limits.interval)?;
        if !self.default_profile.is_empty() && !self.profiles.contains_key(&self.default_profile) {
            return Err(invalid(
                "device_plugin.default_profile",
                "names no profile defined under [device_plugin.profiles]",
            ));
        }

        let prefix = &self.cdi_annotation_prefix;
        let prefix_ok = prefix.strip_suffix('/').is_some_and(crate::names::is_dns_subdomain);
        if !prefix_ok {
            return Err(invalid(
                "device_plugin.cdi_annotation_prefix",
                "expected a DNS name followed by '/', e.g. \"cdi.k8s.io/\"",
            ));
        }
        values::check_cdi_kind(&self.cdi_kind).map_err(|reason| invalid("device_plugin.cdi_kind", reason))?;

        absolute_path("device_plugin.driver_root", &self.driver_root)?;
        absolute_path("device_plugin.dev_root", &self.dev_root)?;
        absolute_path("device_plugin.host_mounts_driver_dir", &self.host_mounts_driver_dir)?;
        absolute_path(
            "device_plugin.host_mounts_container_dir",
            &self.host_mounts_container_dir,
        )
    }
}

impl MigConfig {
    fn validate(&self) -> Check {
        absolute_path("mig.nvidia_smi", &self.nvidia_smi)?;
        // process_wait_timeout = 0s means wait forever.
        for (name, layout) in &self.layouts {
            let at = KeyPath::dotted("mig.layouts").key(name);
            if name.is_empty() {
                return Err(Invalid {
                    key: at,
                    reason: "a layout name cannot be empty".to_owned(),
                });
            }
            crate::names::check_label_value(name).map_err(|reason| Invalid {
                key: at.clone(),
                reason: format!("a layout name is selected by a label value: {reason}"),
            })?;
            layout.check().map_err(|e| match e {
                LayoutError::Entry {
                    entry,
                    field,
                    item,
                    reason,
                } => {
                    let key = at.clone().index(entry).key(field.config_key());
                    let key = match item {
                        Some(Item::Index(i)) => key.index(i),
                        Some(Item::Profile(p)) => key.key(&p),
                        None => key,
                    };
                    let reason = match field {
                        EntryField::Profiles => reason.replace("MIG enabled", "mig_enabled"),
                        _ => reason,
                    };
                    Invalid { key, reason }
                }
                other => Invalid {
                    key: at.clone(),
                    reason: other.to_string(),
                },
            })?;
        }
        if !self.default_layout.is_empty() && self.layout(&self.default_layout).is_none() {
            return Err(invalid(
                "mig.default_layout",
                format!("names no MIG layout (defined: {})", self.layout_names().join(", ")),
            ));
        }
        Ok(())
    }
}

impl KubernetesConfig {
    fn validate(&self) -> Check {
        if !self.kubeconfig.as_os_str().is_empty() {
            absolute_path("kubernetes.kubeconfig", &self.kubeconfig)?;
        }
        for (i, p) in self.kubeconfig_search.iter().enumerate() {
            absolute_path(&format!("kubernetes.kubeconfig_search[{i}]"), p)?;
        }
        absolute_path("kubernetes.in_cluster_dir", &self.in_cluster_dir)?;
        if !self.node_name.is_empty() && !crate::names::is_dns_subdomain(&self.node_name) {
            return Err(invalid(
                "kubernetes.node_name",
                "expected a DNS subdomain name, as Node names are",
            ));
        }
        positive("kubernetes.poll_interval", self.poll_interval)?;
        positive("kubernetes.watch_timeout", self.watch_timeout)?;
        positive("kubernetes.request_timeout", self.request_timeout)?;
        positive("kubernetes.backoff_min", self.backoff_min)?;
        if self.backoff_max < self.backoff_min {
            return Err(invalid(
                "kubernetes.backoff_max",
                "expected at least kubernetes.backoff_min",
            ));
        }
        Ok(())
    }
}

impl DesiredConfig {
    fn validate(&self) -> Check {
        if self.labels_file.as_os_str().is_empty() {
            return Ok(());
        }
        absolute_path("desired.labels_file", &self.labels_file)
    }
}

impl LabelsConfig {
    fn validate(&self) -> Check {
        for (key, value) in [
            ("labels.mig_config", &self.mig_config),
            ("labels.mig_config_state", &self.mig_config_state),
            ("labels.device_plugin_config", &self.device_plugin_config),
            ("labels.device_plugin_config_state", &self.device_plugin_config_state),
            ("labels.validation_state", &self.validation_state),
        ] {
            crate::names::check_label_key(value).map_err(|reason| invalid(key, reason))?;
        }
        let prefix_ok = self
            .feature_prefix
            .strip_suffix('/')
            .is_some_and(crate::names::is_dns_subdomain);
        if !prefix_ok {
            return Err(invalid(
                "labels.feature_prefix",
                "expected a DNS name followed by '/', e.g. \"nvidia.com/\"",
            ));
        }
        Ok(())
    }
}

impl HealthConfig {
    fn validate(&self) -> Check {
        // Xids are u32 by type; recovery_after = 0s means never recover.
        positive("health.lost_check_interval", self.lost_check_interval)
    }
}

/// `device_list_strategy` rules: non-empty, no duplicates, host-mounts not with CDI.
fn check_strategies(key: KeyPath, strategies: &DeviceListStrategies) -> Check {
    let at = |reason: String| Invalid {
        key: key.clone(),
        reason,
    };
    let list = strategies.as_slice();
    if list.is_empty() {
        return Err(at(format!(
            "expected at least one of {}",
            DeviceListStrategy::expected()
        )));
    }
    for (i, s) in list.iter().enumerate() {
        if list[..i].contains(s) {
            return Err(at(format!("{s} is listed twice")));
        }
    }
    if strategies.contains(DeviceListStrategy::HostMounts)
        && let Some(cdi) = list.iter().find(|s| s.is_cdi())
    {
        return Err(at(format!("host-mounts cannot be combined with {cdi}")));
    }
    Ok(())
}

// === deserialization errors ===

/// Turns a serde error at some path of the merged tree into a message naming the file, line,
/// key and value.
fn deserialize_error(merged: &Merged, err: serde_path_to_error::Error<toml::de::Error>) -> ConfigError {
    let key = KeyPath::from_serde(err.path());
    let at = merged.origin(&key, false).cloned();
    let message = err.inner().message();
    // serde's `unknown_field` message: "unknown field `x`, expected one of `a`, `b`" (or
    // "expected `a`", "expected `a` or `b`", "there are no fields"); the allowed keys are the
    // back-quoted words after the first.
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let allowed: Vec<&str> = rest.split('`').skip(2).step_by(2).collect();
        let expected = match allowed.as_slice() {
            [] => "no keys are allowed here".to_owned(),
            [one] => format!("expected {one}"),
            many => format!("expected one of {}", many.join(", ")),
        };
        return ConfigError::UnknownKey {
            at,
            key: key.to_string(),
            expected,
        };
    }
    ConfigError::InvalidValue {
        at,
        key: key.to_string(),
        value: merged.value(&key).map_or_else(|| "?".to_owned(), |v| v.to_string()),
        reason: tidy_reason(message),
    }
}

/// Rewrites serde's "invalid type: string \"x\", expected a boolean" as "expected a boolean"
/// (the message shows the value already) and spells Rust type names the way a config author
/// reads them.
fn tidy_reason(message: &str) -> String {
    let expected = ["invalid type: ", "invalid value: ", "invalid length "]
        .iter()
        .any(|p| message.starts_with(p))
        .then(|| message.split_once(", expected "))
        .flatten()
        .map(|(_, expected)| expected);
    let Some(expected) = expected else {
        return message.to_owned();
    };
    let spelled = match expected {
        "u8" => "an integer in 0..=255".to_owned(),
        "u16" => "an integer in 0..=65535".to_owned(),
        "u32" => "an integer in 0..=4294967295".to_owned(),
        "u64" | "usize" => "a non-negative integer".to_owned(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "an integer".to_owned(),
        "a sequence" => "an array".to_owned(),
        "a map" => "a table".to_owned(),
        "path string" => "a path (a string)".to_owned(),
        other if other.starts_with("struct ") => "a table".to_owned(),
        other => other.to_owned(),
    };
    format!("expected {spelled}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../config/gpu-node-agent.toml");

    fn parse(files: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let sources: Vec<Source> = files.iter().map(|(n, t)| Source::new(*n, *t)).collect();
        Config::from_sources(&sources)
    }

    fn err(files: &[(&str, &str)]) -> String {
        parse(files).expect_err("config accepted").to_string()
    }

    #[test]
    fn defaults() {
        let config = parse(&[]).unwrap();
        assert_eq!(config, Config::default());
        assert_eq!(parse(&[("c.toml", "")]).unwrap(), Config::default());
        assert_eq!(config.log.level, "info");
        assert_eq!(config.agent.resync_interval, Duration::from_secs(60));
        assert_eq!(config.nvml.library, Path::new("libnvidia-ml.so.1"));
        assert_eq!(
            config.device_plugin.device_list_strategy.as_slice(),
            &[DeviceListStrategy::Envvar]
        );
        assert_eq!(config.health.ignored_xids, [13, 31, 43, 45, 68, 109]);
        assert_eq!(config.health.recovery_after, Duration::from_secs(300));
    }

    #[test]
    fn example_file_is_the_defaults() {
        let config = parse(&[("config/gpu-node-agent.toml", EXAMPLE)]).unwrap();
        assert_eq!(config, Config::default());
    }

    /// Every key of the config is set in the example file, so a new key cannot go
    /// undocumented.
    #[test]
    fn example_file_sets_every_key() {
        fn keys(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
            if let toml::Value::Table(t) = v {
                for (k, v) in t {
                    let key = format!("{prefix}{k}");
                    keys(&format!("{key}."), v, out);
                    out.push(key);
                }
            }
        }
        let mut want = Vec::new();
        keys("", &toml::Value::try_from(Config::default()).unwrap(), &mut want);
        let mut have = Vec::new();
        keys("", &toml::from_str::<toml::Value>(EXAMPLE).unwrap(), &mut have);
        want.sort();
        have.sort();
        assert_eq!(have, want);
    }

    #[test]
    fn later_sources_override_earlier() {
        let config = parse(&[
            ("main.toml", "[device_plugin]\nmig_strategy = \"single\"\n"),
            ("10-a.toml", "[device_plugin]\nmig_strategy = \"mixed\"\n"),
            ("20-b.toml", "device_plugin.mig_strategy = \"none\"\n"),
        ])
        .unwrap();
        assert_eq!(config.device_plugin.mig_strategy, MigStrategy::None);
    }

    #[test]
    fn tables_merge_across_files() {
        let config = parse(&[
            (
                "main.toml",
                "log = { level = \"debug\" }\n[device_plugin]\nmig_strategy = \"mixed\"\n",
            ),
            (
                "10-a.toml",
                "[log]\nformat = \"text\"\n[device_plugin]\npass_device_specs = true\n",
            ),
        ])
        .unwrap();
        assert_eq!(config.log.level, "debug");
        assert_eq!(config.log.format, LogFormat::Text);
        assert_eq!(config.device_plugin.mig_strategy, MigStrategy::Mixed);
        assert!(config.device_plugin.pass_device_specs);
    }

    #[test]
    fn arrays_replace() {
        let config = parse(&[
            ("main.toml", "[health]\nignored_xids = [1, 2, 3]\n"),
            ("10-a.toml", "[health]\nignored_xids = [4]\n"),
        ])
        .unwrap();
        assert_eq!(config.health.ignored_xids, [4]);
    }

    #[test]
    fn runtime_engine_sections_default_per_engine_and_check_their_keys() {
        let c = parse(&[(
            "c.toml",
            "[runtime.crio]\nunit = \"cri-o.service\"\n[runtime.docker]\nconfig = \"/srv/daemon.json\"\n",
        )])
        .unwrap();
        assert_eq!(c.runtime.crio.unit, "cri-o.service");
        assert_eq!(
            c.runtime.crio.drop_in,
            Path::new(DEFAULT_CRIO_DROP_IN),
            "keys left out keep the engine's defaults"
        );
        assert_eq!(c.runtime.docker.config, Path::new("/srv/daemon.json"));
        assert_eq!(c.runtime.files(Engine::Docker).binary, Path::new(DEFAULT_DOCKER_BINARY));
        assert_eq!(
            err(&[("c.toml", "[runtime.docker]\ndrop_in = \"/etc/docker/x.json\"\n")]),
            "c.toml:2: runtime.docker.drop_in = \"/etc/docker/x.json\" is not valid: docker reads no drop-in files; leave it out"
        );
        assert_eq!(
            err(&[("c.toml", "[runtime]\nengines = [\"docker\", \"docker\"]\n")]),
            "c.toml:2: runtime.engines = [\"docker\", \"docker\"] is not valid: docker is listed twice"
        );
        assert!(err(&[("c.toml", "[runtime]\nengines = [\"podman\"]\n")]).contains("podman"));
        assert!(err(&[("c.toml", "[runtime]\nmode = \"hook\"\n")]).contains("cdi-only"));
        assert!(err(&[("c.toml", "[cdi]\ndir = \"cdi\"\n")]).contains("cdi.dir"));
    }

    #[test]
    fn unknown_keys_name_file_line_and_key() {
        assert_eq!(
            err(&[("main.toml", "# top\n\nbogus = 1\n")]),
            "main.toml:3: unknown key bogus: expected one of log, agent, nvml, kubelet, \
             device_plugin, driver, runtime, cdi, mig, validation, metrics, health, kubernetes, desired, labels"
        );
        assert_eq!(
            err(&[("main.toml", "[log]\nlevel = \"info\"\nformt = \"text\"\n")]),
            "main.toml:3: unknown key log.formt: expected one of level, format"
        );
        assert_eq!(
            err(&[
                ("main.toml", "[device_plugin]\nenabled = true\n"),
                (
                    "/etc/gpu-node-agent/config.d/10-x.toml",
                    "[device_plugin]\n\nmig_stratgy = \"mixed\"\n"
                ),
            ]),
            "/etc/gpu-node-agent/config.d/10-x.toml:3: unknown key device_plugin.mig_stratgy: \
             expected one of enabled, mig_strategy, device_list_strategy, device_id_strategy, \
             pass_device_specs, cdi_annotation_prefix, cdi_kind, driver_root, dev_root, \
             host_mounts_driver_dir, host_mounts_container_dir, default_profile, profiles, sharing, \
             memory_limits"
        );
        // A section name typo is reported at its header.
        let e = err(&[("main.toml", "[log]\n[helth]\nenabled = false\n")]);
        assert!(e.starts_with("main.toml:2: unknown key helth: "), "{e}");
    }

    #[test]
    fn bad_enum_value() {
        let e = parse(&[(
            "/etc/gpu-node-agent/config.d/10-mig.toml",
            "# MIG\n[device_plugin]\nmig_strategy = \"mixd\"\n",
        )])
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "/etc/gpu-node-agent/config.d/10-mig.toml:3: device_plugin.mig_strategy = \"mixd\" \
             is not valid: expected one of none, single, mixed"
        );
        assert_eq!(e.exit_code(), 64);
        assert_eq!(e.key(), Some("device_plugin.mig_strategy"));
        assert_eq!(e.location().map(|l| l.line), Some(3));

        assert_eq!(
            err(&[("c.toml", "[log]\nformat = 1\n")]),
            "c.toml:2: log.format = 1 is not valid: expected one of auto, journald, text"
        );
    }

    #[test]
    fn wrong_types() {
        assert_eq!(
            err(&[("c.toml", "[health]\nenabled = \"yes\"\n")]),
            "c.toml:2: health.enabled = \"yes\" is not valid: expected a boolean"
        );
        assert_eq!(
            err(&[("c.toml", "[log]\nlevel = \"debug\"\n"), ("d.toml", "log = 5\n")]),
            "d.toml:1: log = 5 is not valid: expected a table"
        );
    }

    #[test]
    fn xids_out_of_range() {
        assert_eq!(
            err(&[("c.toml", "[health]\nignored_xids = [\n  13,\n  -1,\n]\n")]),
            "c.toml:4: health.ignored_xids[1] = -1 is not valid: expected an integer in \
             0..=4294967295"
        );
        let e = err(&[("c.toml", "health.critical_xids = [4294967296]\n")]);
        assert!(
            e.starts_with("c.toml:1: health.critical_xids[0] = 4294967296 is not valid"),
            "{e}"
        );
        let config = parse(&[("c.toml", "health.critical_xids = [0, 4294967295]\n")]).unwrap();
        assert_eq!(config.health.critical_xids, [0, u32::MAX]);
    }

    #[test]
    fn durations() {
        let config = parse(&[(
            "c.toml",
            "[agent]\nresync_interval = \"1h30m\"\n[health]\nrecovery_after = \"0s\"\n\
             lost_check_interval = \"500ms\"\n",
        )])
        .unwrap();
        assert_eq!(config.agent.resync_interval, Duration::from_secs(5400));
        assert_eq!(config.health.recovery_after, Duration::ZERO);
        assert_eq!(config.health.lost_check_interval, Duration::from_millis(500));

        assert_eq!(
            err(&[("c.toml", "[agent]\nresync_interval = \"5 minutes\"\n")]),
            "c.toml:2: agent.resync_interval = \"5 minutes\" is not valid: expected a duration \
             such as \"500ms\", \"5s\", \"2m\", \"1h\" or \"1h30m\""
        );
        let e = err(&[("c.toml", "[nvml]\nretry_interval = 30\n")]);
        assert!(
            e.starts_with("c.toml:2: nvml.retry_interval = 30 is not valid: expected a duration"),
            "{e}"
        );
        assert_eq!(
            err(&[("c.toml", "[kubelet]\nregister_timeout = \"0s\"\n")]),
            "c.toml:2: kubelet.register_timeout = \"0s\" is not valid: expected a duration \
             greater than 0s"
        );
    }

    #[test]
    fn relative_paths_rejected() {
        assert_eq!(
            err(&[("c.toml", "[agent]\nstate_dir = \"var/lib/gpu-node-agent\"\n")]),
            "c.toml:2: agent.state_dir = \"var/lib/gpu-node-agent\" is not valid: expected an \
             absolute path"
        );
        for key in [
            "kubelet.device_plugin_dir",
            "device_plugin.driver_root",
            "device_plugin.host_mounts_driver_dir",
        ] {
            let e = err(&[("c.toml", &format!("{key} = \"relative\"\n"))]);
            assert_eq!(
                e,
                format!("c.toml:1: {key} = \"relative\" is not valid: expected an absolute path")
            );
        }
    }

    #[test]
    fn nvml_library_soname_or_absolute() {
        let config = parse(&[("c.toml", "nvml.library = \"libnvidia-ml.so\"\n")]).unwrap();
        assert_eq!(
            config.nvml.library_path(Path::new("/tmp/r")),
            Path::new("libnvidia-ml.so")
        );
        let config = parse(&[("c.toml", "nvml.library = \"/usr/lib/libnvidia-ml.so.1\"\n")]).unwrap();
        assert_eq!(
            config.nvml.library_path(Path::new("/tmp/r")),
            Path::new("/tmp/r/usr/lib/libnvidia-ml.so.1")
        );
        for bad in ["lib/libnvidia-ml.so.1", ""] {
            let e = err(&[("c.toml", &format!("nvml.library = {bad:?}\n"))]);
            assert!(
                e.starts_with(&format!("c.toml:1: nvml.library = {bad:?} is not valid: ")),
                "{e}"
            );
        }
    }

    #[test]
    fn device_list_strategy_string_or_list() {
        use DeviceListStrategy::*;
        let one = parse(&[("c.toml", "device_plugin.device_list_strategy = \"cdi-cri\"\n")]).unwrap();
        assert_eq!(one.device_plugin.device_list_strategy.as_slice(), &[CdiCri]);
        let many = parse(&[(
            "c.toml",
            "device_plugin.device_list_strategy = [\"envvar\", \"volume-mounts\", \
             \"cdi-annotations\"]\n",
        )])
        .unwrap();
        assert_eq!(
            many.device_plugin.device_list_strategy.as_slice(),
            &[Envvar, VolumeMounts, CdiAnnotations]
        );
        let mounts = parse(&[(
            "c.toml",
            "device_plugin.device_list_strategy = [\"host-mounts\", \"envvar\"]\n",
        )])
        .unwrap();
        assert!(mounts.device_plugin.device_list_strategy.contains(HostMounts));

        assert_eq!(
            err(&[(
                "c.toml",
                "[device_plugin]\ndevice_list_strategy = [\"envvar\",\n  \"bogus\"]\n"
            )]),
            "c.toml:3: device_plugin.device_list_strategy[1] = \"bogus\" is not valid: expected \
             one of envvar, volume-mounts, cdi-annotations, cdi-cri, host-mounts"
        );
        let e = err(&[("c.toml", "device_plugin.device_list_strategy = 1\n")]);
        assert!(
            e.starts_with(
                "c.toml:1: device_plugin.device_list_strategy = 1 is not valid: expected a \
                 strategy or an array of strategies"
            ),
            "{e}"
        );
    }

    #[test]
    fn device_list_strategy_rules() {
        assert_eq!(
            err(&[("c.toml", "[device_plugin]\ndevice_list_strategy = []\n")]),
            "c.toml:2: device_plugin.device_list_strategy = [] is not valid: expected at least \
             one of envvar, volume-mounts, cdi-annotations, cdi-cri, host-mounts"
        );
        assert_eq!(
            err(&[(
                "c.toml",
                "[device_plugin]\ndevice_list_strategy = [\"envvar\", \"envvar\"]\n"
            )]),
            "c.toml:2: device_plugin.device_list_strategy = [\"envvar\", \"envvar\"] is not \
             valid: envvar is listed twice"
        );
        // The rule breaks in the drop-in that set the key, and the message points there.
        assert_eq!(
            err(&[
                ("main.toml", "[device_plugin]\ndevice_list_strategy = \"host-mounts\"\n"),
                (
                    "10-cdi.toml",
                    "\n[device_plugin]\ndevice_list_strategy = [\"host-mounts\", \"cdi-cri\"]\n"
                ),
            ]),
            "10-cdi.toml:3: device_plugin.device_list_strategy = [\"host-mounts\", \"cdi-cri\"] \
             is not valid: host-mounts cannot be combined with cdi-cri"
        );
    }

    #[test]
    fn cdi_settings() {
        assert_eq!(
            err(&[("c.toml", "device_plugin.cdi_annotation_prefix = \"cdi.k8s.io\"\n")]),
            "c.toml:1: device_plugin.cdi_annotation_prefix = \"cdi.k8s.io\" is not valid: \
             expected a DNS name followed by '/', e.g. \"cdi.k8s.io/\""
        );
        let e = err(&[("c.toml", "device_plugin.cdi_kind = \"gpu\"\n")]);
        assert!(
            e.starts_with("c.toml:1: device_plugin.cdi_kind = \"gpu\" is not valid: expected"),
            "{e}"
        );
        let config = parse(&[("c.toml", "device_plugin.cdi_kind = \"nvidia.com/gpu\"\n")]);
        assert_eq!(config.unwrap().device_plugin.cdi_kind, "nvidia.com/gpu");
    }

    #[test]
    fn log_level() {
        let config = parse(&[("c.toml", "log.level = \"info,gpu_node_agent::plugin=trace\"\n")]);
        assert_eq!(config.unwrap().log.level, "info,gpu_node_agent::plugin=trace");
        let e = err(&[("c.toml", "[log]\nlevel = \"verbose\"\n")]);
        assert!(
            e.starts_with("c.toml:2: log.level = \"verbose\" is not valid: \"verbose\": expected a level"),
            "{e}"
        );
    }

    #[test]
    fn syntax_errors_name_file_and_line() {
        let e = parse(&[("ok.toml", ""), ("bad.toml", "[log]\nlevel = \n")]).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }));
        let text = e.to_string();
        assert!(text.starts_with("bad.toml:2: TOML syntax error: "), "{text}");
        assert_eq!(e.exit_code(), 64);

        let e = err(&[("dup.toml", "[log]\nlevel = \"info\"\nlevel = \"debug\"\n")]);
        assert!(e.starts_with("dup.toml:3: TOML syntax error: "), "{e}");
    }

    #[test]
    fn effective_config_round_trips() {
        let config = parse(&[(
            "c.toml",
            "[device_plugin]\ndevice_list_strategy = \"cdi-cri\"\nmig_strategy = \"mixed\"\n\
             [health]\nrecovery_after = \"90s\"\n",
        )])
        .unwrap();
        let text = toml::to_string(&config).unwrap();
        assert_eq!(parse(&[("effective", &text)]).unwrap(), config);
        let json = serde_json::to_value(&config).unwrap();
        assert_eq!(json["device_plugin"]["device_list_strategy"][0], "cdi-cri");
        assert_eq!(json["health"]["recovery_after"], "90s");
    }

    #[test]
    fn rooted_paths() {
        let p = Path::new("/etc/gpu-node-agent/config.toml");
        assert_eq!(rooted(Path::new("/"), p), p);
        assert_eq!(
            rooted(Path::new("/tmp/r"), p),
            Path::new("/tmp/r/etc/gpu-node-agent/config.toml")
        );
        assert_eq!(rooted(Path::new("/tmp/r"), Path::new("/")), Path::new("/tmp/r"));
    }

    // === load ===

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    #[test]
    fn load_without_files_gives_defaults() {
        let root = tempfile::tempdir().unwrap();
        let (config, files) = Config::load(root.path(), None).unwrap();
        assert_eq!(config, Config::default());
        assert!(files.is_empty());
    }

    #[test]
    fn load_explicit_missing_file_is_an_error() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("nope.toml");
        let e = Config::load(Path::new("/"), Some(&path)).unwrap_err();
        assert!(matches!(e, ConfigError::ReadFile { .. }));
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("{}: cannot read config file: ", path.display())),
            "{text}"
        );
        assert!(text.contains("No such file"), "{text}");
        assert_eq!(e.exit_code(), 64);
    }

    #[test]
    fn load_reads_main_and_drop_ins_in_name_order() {
        let root = tempfile::tempdir().unwrap();
        let etc = root.path().join("etc/gpu-node-agent");
        let d = etc.join("config.d");
        write(
            &etc.join("config.toml"),
            "[device_plugin]\nmig_strategy = \"single\"\npass_device_specs = true\n",
        );
        // Written in reverse order so directory order cannot pass for name order.
        write(&d.join("20-b.toml"), "[device_plugin]\nmig_strategy = \"mixed\"\n");
        write(
            &d.join("10-a.toml"),
            "[device_plugin]\nmig_strategy = \"none\"\n[log]\nformat = \"text\"\n",
        );
        write(&d.join("30-c.toml.bak"), "this is not toml");
        write(&d.join("README"), "this is not toml");
        write(&d.join(".40-hidden.toml"), "this is not toml");
        fs::create_dir_all(d.join("50-dir.toml")).unwrap();

        let (config, files) = Config::load(root.path(), None).unwrap();
        assert_eq!(config.device_plugin.mig_strategy, MigStrategy::Mixed);
        assert!(config.device_plugin.pass_device_specs);
        assert_eq!(config.log.format, LogFormat::Text);
        let shown = |p: PathBuf| p.display().to_string();
        assert_eq!(
            files,
            [
                shown(etc.join("config.toml")),
                shown(d.join("10-a.toml")),
                shown(d.join("20-b.toml")),
            ]
        );
    }

    #[test]
    fn load_drop_ins_without_main_file() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("etc/gpu-node-agent/config.d");
        write(&d.join("10-a.toml"), "health.enabled = false\n");
        let (config, files) = Config::load(root.path(), None).unwrap();
        assert!(!config.health.enabled);
        assert_eq!(files.len(), 1);
    }

    #[test]
    fn load_explicit_path_is_not_rooted_and_brings_its_drop_ins() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("custom/agent.toml");
        write(&main, "log.level = \"debug\"\n");
        write(&dir.path().join("custom/config.d/10-a.toml"), "log.format = \"text\"\n");
        // A root that does not contain the file: the explicit path is used as given.
        let elsewhere = tempfile::tempdir().unwrap();
        let (config, files) = Config::load(elsewhere.path(), Some(&main)).unwrap();
        assert_eq!(config.log.level, "debug");
        assert_eq!(config.log.format, LogFormat::Text);
        assert_eq!(files.len(), 2);
    }

    #[test]
    fn load_errors_name_the_drop_in() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("etc/gpu-node-agent/config.d");
        let bad = d.join("10-mig.toml");
        write(&bad, "[device_plugin]\nmig_strategy = \"mixd\"\n");
        let e = Config::load(root.path(), None).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}:2: device_plugin.mig_strategy = \"mixd\" is not valid",
                bad.display()
            )),
            "{e}"
        );
    }

    #[test]
    fn load_unreadable_main_file_is_an_error() {
        let root = tempfile::tempdir().unwrap();
        // A directory where the main file should be: reading it fails even as root.
        fs::create_dir_all(root.path().join("etc/gpu-node-agent/config.toml")).unwrap();
        let e = Config::load(root.path(), None).unwrap_err();
        assert!(matches!(e, ConfigError::ReadFile { .. }), "{e}");
        assert!(e.to_string().contains("config.toml: cannot read config file: "), "{e}");
    }
    #[test]
    fn mig_layouts_parse_and_merge_with_defaults() {
        use crate::mig_layout::DeviceSelector;
        let config = parse(&[(
            "10-mig.toml",
            "[mig]\nprocess_wait_timeout = \"0s\"\n\n[[mig.layouts.custom-1]]\ndevices = \"all\"\n\
             device_filter = [\"0x20B0\", \"0x20B210DE\", 0x2330]\nmig_enabled = true\n\
             profiles = { \"1g.5gb\" = 7 }\n\n[[mig.layouts.custom-1]]\ndevices = [4, 5]\ndevice_filter = 0x20B5\nmig_enabled = false\n\n\
             [[mig.layouts.all-balanced]]\ndevices = \"all\"\ndevice_filter = \"0x20B0\"\nmig_enabled = true\n\
             profiles = {}\n",
        )])
        .unwrap();
        assert_eq!(config.mig.process_wait_timeout, Duration::ZERO);
        let custom = config.mig.layout("custom-1").unwrap();
        assert_eq!(custom.entries.len(), 2);
        assert_eq!(custom.entries[0].device_filter, [0x20B0, 0x20B2, 0x2330]);
        assert_eq!(custom.entries[0].profiles["1g.5gb"], 7);
        assert_eq!(custom.entries[1].devices, DeviceSelector::Indices(vec![4, 5]));
        assert!(custom.entries[1].profiles.is_empty());
        // A user layout replaces the built-in one of the same name; the others stay.
        assert_eq!(config.mig.layout("all-balanced").unwrap().entries.len(), 1);
        assert!(config.mig.layout("all-1g.10gb").is_some());
        assert!(config.mig.layout("nope").is_none());
        let names = config.mig.layout_names();
        assert!(names.contains(&"custom-1".to_owned()) && names.contains(&"all-disabled".to_owned()));
        assert!(names.windows(2).all(|w| w[0] < w[1]));

        let only_mine = parse(&[(
            "c.toml",
            "[mig]\ndefault_layouts = false\n[[mig.layouts.x]]\ndevices = \"all\"\nmig_enabled = false\n",
        )])
        .unwrap();
        assert_eq!(only_mine.mig.layout_names(), ["x"]);
        assert!(only_mine.mig.layout("all-disabled").is_none());
        assert_eq!(
            Config::default().mig.layout_names().len(),
            crate::mig_layout::defaults::default_layouts().len()
        );
    }

    #[test]
    fn mig_layout_errors_name_file_line_and_key() {
        let e = |text: &str| err(&[("m.toml", text)]);
        const HEAD: &str = "[[mig.layouts.x]]\ndevices = \"all\"\n";
        assert_eq!(
            e(&format!(
                "{HEAD}mig_enabled = true\nprofiles = {{ \"1g.5gb\" = 7, \"1x.5gb\" = 1 }}\n"
            )),
            "m.toml:4: mig.layouts.x[0].profiles.\"1x.5gb\" = 1 is not valid: \"1x.5gb\" is not a MIG profile name: \
             \"1x\" does not end in \"g\" (expected [<C>c.]<G>g.<GB>gb with an optional +attr[,attr] or -attr \
             suffix, e.g. 1g.5gb, 1c.4g.20gb, 1g.5gb+me, 1g.24gb-me)"
        );
        assert_eq!(
            e(&format!("{HEAD}mig_enabled = true\nprofiles = {{ \"1g.5gb\" = 0 }}\n")),
            "m.toml:4: mig.layouts.x[0].profiles.\"1g.5gb\" = 0 is not valid: expected a count of at least 1; \
             leave the profile out instead"
        );
        assert_eq!(
            e(&format!("{HEAD}mig_enabled = false\nprofiles = {{ \"1g.5gb\" = 7 }}\n")),
            "m.toml:4: mig.layouts.x[0].profiles = { \"1g.5gb\" = 7 } is not valid: MIG devices need mig_enabled; \
             leave the profiles out or set mig_enabled"
        );
        let missing = e(&format!("{HEAD}mig_enabled = true\n"));
        assert!(
            missing.starts_with("m.toml:1: mig.layouts.x[0] = ")
                && missing.ends_with(
                    "is not valid: missing field `profiles` (required when mig_enabled = true; {} for none)"
                ),
            "{missing}"
        );
        let missing = e("[[mig.layouts.x]]\nmig_enabled = false\n");
        assert!(
            missing.starts_with("m.toml:1: mig.layouts.x[0] = ") && missing.ends_with("missing field `devices`"),
            "{missing}"
        );
        assert_eq!(
            e("[[mig.layouts.x]]\ndevices = [0, 1,\n  0]\nmig_enabled = false\n"),
            "m.toml:3: mig.layouts.x[0].devices[2] = 0 is not valid: GPU 0 is listed twice"
        );
        assert_eq!(
            e("[[mig.layouts.x]]\ndevices = []\nmig_enabled = false\n"),
            "m.toml:2: mig.layouts.x[0].devices = [] is not valid: an empty list selects no GPU; expected \"all\" \
             or GPU indices"
        );
        assert_eq!(
            e("[[mig.layouts.x]]\ndevices = \"some\"\nmig_enabled = false\n"),
            "m.toml:2: mig.layouts.x[0].devices = \"some\" is not valid: expected \"all\" or an array of GPU indices"
        );
        assert_eq!(
            e("[[mig.layouts.x]]\ndevices = [-1]\nmig_enabled = false\n"),
            "m.toml:2: mig.layouts.x[0].devices[0] = -1 is not valid: expected an integer in 0..=4294967295"
        );
        assert_eq!(
            e(&format!(
                "{HEAD}device_filter = [\"0x20B0\", \"0x20B01002\"]\nmig_enabled = false\n"
            )),
            "m.toml:3: mig.layouts.x[0].device_filter[1] = \"0x20B01002\" is not valid: 0x20B01002 has vendor id \
             0x1002, not NVIDIA's 0x10DE; expected 0x<device id>10DE, e.g. \"0x20B010DE\""
        );
        let bad_id = e(&format!("{HEAD}device_filter = \"A100\"\nmig_enabled = false\n"));
        assert!(
            bad_id.starts_with(
                "m.toml:3: mig.layouts.x[0].device_filter = \"A100\" is not valid: expected a PCI device id"
            ),
            "{bad_id}"
        );
        assert_eq!(
            e(&format!("{HEAD}mig_enabled = false\nmig_devices = {{}}\n")),
            "m.toml:4: unknown key mig.layouts.x[0].mig_devices: expected one of devices, device_filter, \
             mig_enabled, profiles"
        );
        assert_eq!(
            e("[mig.layouts]\nx = []\n"),
            "m.toml:2: mig.layouts.x = [] is not valid: a layout needs at least one entry"
        );
        let table = e("[mig.layouts.x]\ndevices = \"all\"\nmig_enabled = false\n");
        assert!(
            table.starts_with("m.toml:1: mig.layouts.x = ")
                && table.ends_with("is not valid: expected an array of layout entries, written [[mig.layouts.<name>]]"),
            "{table}"
        );
        let name = e("[[mig.layouts.\"-x\"]]\ndevices = \"all\"\nmig_enabled = false\n");
        assert!(
            name.starts_with("m.toml:1: mig.layouts.-x = ")
                && name.contains("a layout name is selected by a label value"),
            "{name}"
        );
        assert_eq!(
            e(
                "[[mig.layouts.x]]\ndevices = \"all\"\nmig_enabled = false\n\n[[mig.layouts.x]]\ndevices = [1]\n\
               mig_enabled = true\nprofiles = {}\n"
            ),
            "m.toml:6: mig.layouts.x[1].devices = [1] is not valid: entry 1 can apply to the same GPUs as entry 0 \
             (their devices and device filters overlap) but asks for a different MIG state; make them disjoint"
        );
        assert_eq!(
            e("[mig]\nprocess_wait_timeout = \"10 minutes\"\n"),
            "m.toml:2: mig.process_wait_timeout = \"10 minutes\" is not valid: expected a duration such as \
             \"500ms\", \"5s\", \"2m\", \"1h\" or \"1h30m\""
        );
        assert_eq!(
            e("[mig]\nreboot = true\n"),
            "m.toml:2: unknown key mig.reboot: expected one of enabled, default_layouts, process_wait_timeout, \
             reboot_on_mode_change, gpu_reset, nvidia_smi, default_layout, layouts"
        );
    }

    #[test]
    fn device_plugin_profiles_override_keys_and_are_validated() {
        let config = parse(&[(
            "main.toml",
            "[device_plugin]\ndefault_profile = \"mig-mixed\"\n\n[device_plugin.profiles.mig-mixed]\nmig_strategy = \"mixed\"\n\n[device_plugin.profiles.\"cdi.only\"]\ndevice_list_strategy = \"cdi-cri\"\n",
        )])
        .unwrap();
        let mixed = config.device_plugin.with_profile("mig-mixed").expect("profile");
        assert_eq!(mixed.mig_strategy, MigStrategy::Mixed);
        assert_eq!(mixed.device_list_strategy, config.device_plugin.device_list_strategy);
        let cdi = config.device_plugin.with_profile("cdi.only").expect("dotted name");
        assert_eq!(cdi.device_list_strategy.as_slice(), [DeviceListStrategy::CdiCri]);
        assert!(config.device_plugin.with_profile("nope").is_none());

        assert_eq!(
            err(&[("main.toml", "[device_plugin]\ndefault_profile = \"x\"\n")]),
            "main.toml:2: device_plugin.default_profile = \"x\" is not valid: names no profile defined under [device_plugin.profiles]"
        );
        let e = err(&[(
            "main.toml",
            "[device_plugin.profiles.\"a.b\"]\ndevice_list_strategy = []\n",
        )]);
        assert!(
            e.starts_with("main.toml:2: device_plugin.profiles.\"a.b\".device_list_strategy"),
            "{e}"
        );
        let e = err(&[(
            "main.toml",
            "[device_plugin.profiles.\"-bad\"]\nmig_strategy = \"mixed\"\n",
        )]);
        assert!(e.contains("label value"), "{e}");
        let e = err(&[("main.toml", "[device_plugin.profiles.p]\nmig_stratgy = \"mixed\"\n")]);
        assert!(
            e.starts_with("main.toml:2: unknown key device_plugin.profiles.p.mig_stratgy"),
            "{e}"
        );
    }
}
