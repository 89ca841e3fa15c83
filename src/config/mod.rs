//! The agent's configuration: typed sections with documented defaults, read from
//! `/etc/gpu-node-agent/config.toml` and then `config.d/*.toml` beside it, merged key by key,
//! and validated so that every error names the file, the line and the dotted key.
//!
//! Parsing is pure: [`Config::from_sources`] takes `(name, text)` pairs. Only [`Config::load`]
//! touches the filesystem, and it reads every default path through the `--root` prefix
//! ([`rooted`]).
//!
//! A section lives in its own file, beside the sections it belongs with: `agent.rs` (`[log]`,
//! `[agent]`, `[nvml]`, `[health]`, `[validation]`, `[metrics]`), `device_plugin.rs`
//! (`[kubelet]`, `[device_plugin]`), `driver.rs`, `runtime.rs` (`[runtime]`, `[cdi]`), `mig.rs`,
//! `kubernetes.rs` (`[kubernetes]`, `[desired]`, `[labels]`), `dra.rs`; this file re-exports them
//! (`pub use`) and holds [`Config`], loading, the validation helpers and the error messages.
//!
//! Adding a section: in its file, a struct with `#[serde(default, deny_unknown_fields)]`, a
//! `Default` impl built from `DEFAULT_*` consts and a `pub(super) validate` method returning
//! [`Check`]s keyed by dotted names; here, a field on [`Config`], a call in
//! [`Config::validate`] (and for a new file its `mod` and `pub use`); and its keys in
//! `config/gpu-node-agent.toml` (a test keeps that file complete).

mod agent;
mod device_plugin;
mod dra;
mod driver;
mod error;
mod kubernetes;
mod merge;
mod mig;
mod runtime;
mod sharing;
mod values;

use crate::host::rooted;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use agent::*;
pub use device_plugin::*;
pub use dra::*;
pub use driver::*;
pub use error::{ConfigError, EXIT_CONFIG, Location};
pub use kubernetes::*;
pub use mig::*;
pub use runtime::*;
pub use sharing::{MemoryBudget, RESOURCE_PREFIX, SharedDevices, SharedResource, Sharing};
pub use values::{
    DeviceIdStrategy, DeviceListStrategies, DeviceListStrategy, LogFormat, MemoryAction, MigStrategy,
    ParseDurationError, ParseEnumError, SetAsDefault, SharedPolicy, SharingStrategy, UncoveredGpus, format_duration,
    parse_duration,
};

use merge::{KeyPath, Merged};

/// The main config file, as a host path (read under `--root`).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/gpu-node-agent/config.toml";
/// Directory of drop-in files, next to the main file.
pub const DROP_IN_DIR: &str = "config.d";

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
    /// `[dra]`
    pub dra: DraConfig,
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
        self.dra.validate()?;
        self.desired.validate()?;
        self.labels.validate()?;
        self.delivers_gpus()
    }

    /// Refuses the combinations under which a container that was allocated a GPU gets none.
    fn delivers_gpus(&self) -> Check {
        let strategies = self.device_plugin.device_list_strategy.as_slice();
        let mode = self.runtime.mode;
        // `auto` hands out CDI names exactly when the engines get no runtime.
        let cdi_names =
            |s: &DeviceListStrategy| s.is_cdi() || (*s == DeviceListStrategy::Auto && mode == RuntimeMode::CdiOnly);
        if !self.cdi.enabled
            && let Some(cdi) = strategies.iter().find(|s| cdi_names(s))
        {
            let why = if *cdi == DeviceListStrategy::Auto {
                "auto (with [runtime] mode = \"cdi-only\") hands out CDI names".to_owned()
            } else {
                format!("{cdi} hands out CDI names")
            };
            return Err(invalid(
                "device_plugin.device_list_strategy",
                format!(
                    "{why}, but [cdi] enabled = false writes no spec for them to resolve in; \
                     turn [cdi] on or use envvar"
                ),
            ));
        }
        if self.runtime.enabled && mode == RuntimeMode::CdiOnly && strategies.iter().all(|s| s.needs_runtime()) {
            return Err(invalid(
                "runtime.mode",
                "cdi-only gives the engines no nvidia runtime, so the envvar and volume-mounts strategies \
                 deliver no GPU; set [device_plugin] device_list_strategy = \"cdi-cri\" (or \"auto\")",
            ));
        }
        Ok(())
    }

    /// Decides the `auto` values for a node on which the NVIDIA Container Toolkit's runtime
    /// (`runtime.runtime_binary`) is (`toolkit_runtime`) or is not installed, and returns what
    /// was decided, in words (`None` when nothing was `auto`). Pure.
    ///
    /// `runtime.mode = "auto"` becomes `runtime` with the toolkit, else `cdi-only`, unless the
    /// runtime stage is off (the engines are someone else's) or CDI cannot deliver a GPU under
    /// this config (`[cdi]` off, or a device list strategy of the top level or of a profile
    /// that only the runtime's hook reads): then it stays `runtime`, and the runtime stage says
    /// the runtime is missing. A device list strategy `auto`
    /// becomes `envvar` under `runtime` and `cdi-cri` under `cdi-only`.
    pub fn resolve_auto(&mut self, toolkit_runtime: bool) -> Option<String> {
        let dp = &self.device_plugin;
        let lists = std::iter::once(&dp.device_list_strategy)
            .chain(dp.profiles.values().filter_map(|p| p.device_list_strategy.as_ref()));
        let mut hook_only = None;
        for list in lists {
            if list.as_slice().iter().all(|s| s.needs_runtime()) {
                hook_only = Some(
                    list.as_slice()
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                );
                break;
            }
        }
        let mut said = Vec::new();
        if self.runtime.mode == RuntimeMode::Auto {
            let binary = self.runtime.runtime_binary.display();
            let (mode, why) = if toolkit_runtime {
                (RuntimeMode::Runtime, format!("{binary} is installed"))
            } else if !self.runtime.enabled {
                // The engines are configured by someone else (the GPU Operator's toolkit keeps
                // its runtime in /usr/local/nvidia/toolkit): NVIDIA's plugin's default.
                (
                    RuntimeMode::Runtime,
                    "[runtime] enabled = false: the engines are configured by other means".to_owned(),
                )
            } else if !self.cdi.enabled {
                (
                    RuntimeMode::Runtime,
                    format!("{binary} is not installed, but [cdi] is off"),
                )
            } else if let Some(list) = hook_only {
                (
                    RuntimeMode::Runtime,
                    format!("{binary} is not installed, but device_list_strategy {list} needs it"),
                )
            } else {
                (RuntimeMode::CdiOnly, format!("{binary} is not installed"))
            };
            self.runtime.mode = mode;
            said.push(format!("runtime.mode auto: {} ({why})", mode_name(mode)));
        }
        let strategy = match self.runtime.mode {
            RuntimeMode::CdiOnly => DeviceListStrategy::CdiCri,
            _ => DeviceListStrategy::Envvar,
        };
        let dp = &mut self.device_plugin;
        let lists = std::iter::once(&mut dp.device_list_strategy)
            .chain(dp.profiles.values_mut().filter_map(|p| p.device_list_strategy.as_mut()));
        let mut resolved = false;
        for list in lists {
            if list.as_slice() == [DeviceListStrategy::Auto] {
                *list = DeviceListStrategies(vec![strategy]);
                resolved = true;
            }
        }
        if resolved {
            said.push(format!("device_list_strategy auto: {strategy}"));
        }
        (!said.is_empty()).then(|| said.join("; "))
    }

    /// [`Config::resolve_auto`] for the node under `root`.
    pub fn resolve_auto_on(&mut self, root: &Path) -> Option<String> {
        let toolkit = rooted(root, &self.runtime.runtime_binary).is_file();
        self.resolve_auto(toolkit)
    }
}

/// `runtime.mode`'s value as the config spells it.
fn mode_name(mode: RuntimeMode) -> &'static str {
    match mode {
        RuntimeMode::Auto => "auto",
        RuntimeMode::Runtime => "runtime",
        RuntimeMode::CdiOnly => "cdi-only",
    }
}

fn read(path: &Path) -> Result<Source, ConfigError> {
    let text = crate::host::read_text(path).map_err(|source| ConfigError::ReadFile {
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
mod tests;
