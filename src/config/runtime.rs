//! `[runtime]` (with `[runtime.<engine>]`) and `[cdi]`: the `nvidia` runtime in the container
//! engines and the CDI spec; their defaults and validation.

use super::values::{self, SetAsDefault};
use super::{Check, absolute_path, invalid, positive};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
/// `cdi.hook_paths`: the NVIDIA Container Toolkit's CDI hook binaries tried, in order (with
/// `cdi.hook = "auto"` the agent's own hook is used when none exists).
pub const DEFAULT_CDI_HOOK_PATHS: &[&str] = &["/usr/bin/nvidia-cdi-hook", "/usr/bin/nvidia-ctk"];

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
    /// `runtime` when the NVIDIA Container Toolkit's runtime (`runtime_binary`) is installed,
    /// else `cdi-only` (decided once when the agent starts; see [`super::Config::resolve_auto`]).
    Auto,
    /// The engines get the `nvidia` runtime (NVIDIA Container Toolkit), and the CDI spec is written.
    Runtime,
    /// Only the CDI spec and the engines' CDI switches (containerd `enable_cdi`, docker
    /// `features.cdi`), no `nvidia` runtime; the device plugin hands out CDI names.
    CdiOnly,
}

/// `[runtime]`: the `nvidia` runtime in containerd, docker and CRI-O.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Run the runtime stage.
    pub enabled: bool,
    /// `auto`, `runtime` or `cdi-only`.
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
    /// `[runtime.<engine>] config` by default.
    const CONFIG: &'static str;
    /// `drop_in` by default (empty: the engine reads none).
    const DROP_IN: &'static str;
    /// `binary` by default.
    const BINARY: &'static str;
    /// `unit` by default.
    const UNIT: &'static str;
}

macro_rules! engine_kinds {
    ($($name:ident: $config:expr, $drop_in:expr, $binary:expr, $unit:expr;)*) => {$(
        #[doc = concat!("[`EngineFiles`] of [`Engine::", stringify!($name), "`].")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name;
        impl EngineKind for $name {
            const ENGINE: Engine = Engine::$name;
            const CONFIG: &'static str = $config;
            const DROP_IN: &'static str = $drop_in;
            const BINARY: &'static str = $binary;
            const UNIT: &'static str = $unit;
        }
    )*};
}
engine_kinds! {
    Containerd: DEFAULT_CONTAINERD_CONFIG, DEFAULT_CONTAINERD_DROP_IN, DEFAULT_CONTAINERD_BINARY, "containerd.service";
    Docker: DEFAULT_DOCKER_CONFIG, "", DEFAULT_DOCKER_BINARY, "docker.service";
    Crio: DEFAULT_CRIO_CONFIG, DEFAULT_CRIO_DROP_IN, DEFAULT_CRIO_BINARY, "crio.service";
}

/// Any engine's files (see [`RuntimeConfig::files`]); by default containerd's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnyEngine;
impl EngineKind for AnyEngine {
    const ENGINE: Engine = Containerd::ENGINE;
    const CONFIG: &'static str = Containerd::CONFIG;
    const DROP_IN: &'static str = Containerd::DROP_IN;
    const BINARY: &'static str = Containerd::BINARY;
    const UNIT: &'static str = Containerd::UNIT;
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
            mode: RuntimeMode::Auto,
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
        EngineFiles {
            config: E::CONFIG.into(),
            drop_in: E::DROP_IN.into(),
            binary: E::BINARY.into(),
            unit: E::UNIT.into(),
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

impl RuntimeConfig {
    pub(super) fn validate(&self) -> Check {
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

/// `cdi.hook`: which program the spec's hooks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CdiHook {
    /// The NVIDIA Container Toolkit's hook (the first of `hook_paths` that exists), else the
    /// agent's own.
    Auto,
    /// Always the agent's own (`gpu-node-agent-cdi-hook …`).
    Agent,
    /// Only the toolkit's; without one the spec has no hooks (containers then get no
    /// `libcuda.so.1` unless their runtime makes it).
    Toolkit,
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
    /// The NVIDIA Container Toolkit's hook binaries tried in order (host paths).
    pub hook_paths: Vec<PathBuf>,
    /// `auto`, `agent` or `toolkit`: which program the spec's hooks run.
    pub hook: CdiHook,
    /// The agent's hook program (host path); empty: `gpu-node-agent-cdi-hook` beside the running
    /// agent.
    pub agent_path: PathBuf,
}

impl Default for CdiConfig {
    fn default() -> Self {
        CdiConfig {
            enabled: DEFAULT_CDI_ENABLED,
            dir: DEFAULT_CDI_DIR.into(),
            hook_paths: DEFAULT_CDI_HOOK_PATHS.iter().map(PathBuf::from).collect(),
            hook: CdiHook::Auto,
            agent_path: PathBuf::new(),
        }
    }
}

impl CdiConfig {
    pub(super) fn validate(&self) -> Check {
        absolute_path("cdi.dir", &self.dir)?;
        for (i, p) in self.hook_paths.iter().enumerate() {
            absolute_path(&format!("cdi.hook_paths[{i}]"), p)?;
        }
        if !self.agent_path.as_os_str().is_empty() {
            absolute_path("cdi.agent_path", &self.agent_path)?;
        }
        Ok(())
    }
}
