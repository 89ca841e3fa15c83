//! Observe: the engines' files (their symbolic links followed), the backups, the kubelet's
//! engine, the toolkit's config, and what each engine says of itself through the seam.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::journal::{backup_dir, read_backup};
use super::{RuntimeError, read_optional, registry, resolve};
use crate::config::{Config, DeviceListStrategy, RuntimeMode};
use crate::host::HostRoot;
use crate::host::command::Runner;
use crate::runtime::engine::{Host, ObservedEngine, Seen};
use crate::runtime::kubelet::{self, KubeletEndpoint};

/// Systemd unit directories searched to tell whether an engine is installed.
const UNIT_DIRS: [&str; 5] = [
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
];

/// What the agent knows about a file it changed before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    /// The bytes before the agent's first change; `None`: there was no file.
    pub original: Option<String>,
    /// sha256 (hex) of what the agent last wrote.
    pub written: Option<String>,
}

/// Everything the runtime plan is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub engines: Vec<ObservedEngine>,
    pub runtime_binary_present: bool,
    /// The GPU Operator's extra runtimes whose binaries the node has (`nvidia-cdi`,
    /// `nvidia-legacy`), when `[runtime] extra_runtimes` is on.
    pub also: Vec<(String, PathBuf)>,
    /// The kubelet's CRI endpoint.
    pub kubelet: KubeletEndpoint,
    /// The device plugin hands out `volume-mounts` (the config or one of its profiles).
    pub volume_mounts: bool,
    /// The NVIDIA Container Toolkit's config: host path, where its links lead, text (`None`: no
    /// file).
    pub toolkit: (PathBuf, PathBuf, Option<String>),
    /// Backups by host path.
    pub backups: BTreeMap<PathBuf, Backup>,
    /// The directory the agent writes its CDI spec to (`[cdi] dir`, host path), which an engine
    /// with CDI on must read.
    pub cdi_dir: PathBuf,
}

/// Reads the engines' files and the backups, finds the kubelet's engine, and asks each engine
/// for its own facts (`ContainerEngine::observe`: containerd's imports, version and effective
/// configuration, CRI-O's other drop-ins, docker's version under `cdi-only`).
pub fn observe(config: &Config, root: &HostRoot, runner: &Runner) -> Result<Observed, RuntimeError> {
    let rc = &config.runtime;
    let mut engines = Vec::new();
    let mut backups = BTreeMap::new();
    let dir = backup_dir(config, root);
    let host = Host {
        root,
        runner,
        state: &dir,
    };
    for imp in registry::ENGINES {
        let engine = imp.kind();
        let files = rc.files(engine);
        let binary = locate_binary(runner, &files.binary);
        let installed = binary.is_some()
            || UNIT_DIRS
                .iter()
                .any(|d| root.join(Path::new(d).join(&files.unit)).exists());
        let selected = if rc.engines.is_empty() {
            installed
        } else {
            rc.engines.contains(&engine)
        };
        for path in [&files.config, &files.drop_in] {
            if !path.as_os_str().is_empty()
                && let Some(backup) = read_backup(&dir, path)?
            {
                backups.insert(path.clone(), backup);
            }
        }
        // A link that cannot be followed fails the stage only where the agent would write: for
        // an engine it configures, or a file it changed before.
        let read_file = |path: &Path| -> Result<(Option<String>, PathBuf), RuntimeError> {
            if path.as_os_str().is_empty() {
                return Ok((None, PathBuf::new()));
            }
            match resolve(root, path) {
                Ok(target) => Ok((read_optional(&root.join(&target))?, target)),
                Err(e) if selected || backups.contains_key(path) => Err(e),
                Err(e) => {
                    tracing::debug!("{e}");
                    Ok((None, path.to_path_buf()))
                }
            }
        };
        let (main, main_target) = read_file(&files.config)?;
        let (drop_in, drop_in_target) = read_file(&files.drop_in)?;
        let seen = Seen {
            files: &files,
            binary: binary.as_deref(),
            main: main.as_deref(),
            selected,
            cdi_only: rc.mode == RuntimeMode::CdiOnly,
        };
        let facts = imp.observe(&host, &seen);
        engines.push(ObservedEngine {
            engine,
            files,
            installed,
            selected,
            main,
            drop_in,
            main_target,
            drop_in_target,
            binary,
            version: facts.version,
            imported: facts.imported,
            effective_is_current: facts.effective_is_current,
            effective: facts.effective,
            cri_socket: facts.cri_socket,
        });
    }
    let also = if rc.extra_runtimes {
        ["cdi", "legacy"]
            .iter()
            .filter_map(|suffix| {
                let mut binary = rc.runtime_binary.clone().into_os_string();
                binary.push(format!(".{suffix}"));
                let binary = PathBuf::from(binary);
                root.join(&binary)
                    .is_file()
                    .then(|| (format!("{}-{suffix}", rc.runtime_name), binary))
            })
            .collect()
    } else {
        Vec::new()
    };
    let dp = &config.device_plugin;
    let volume_mounts = dp.device_list_strategy.contains(DeviceListStrategy::VolumeMounts)
        || dp.profiles.values().any(|p| {
            p.device_list_strategy
                .as_ref()
                .is_some_and(|s| s.contains(DeviceListStrategy::VolumeMounts))
        });
    let toolkit = match resolve(root, &rc.toolkit_config) {
        Ok(target) => {
            let text = read_optional(&root.join(&target))?;
            (rc.toolkit_config.clone(), target, text)
        }
        Err(e) if volume_mounts => return Err(e),
        Err(_) => (rc.toolkit_config.clone(), rc.toolkit_config.clone(), None),
    };
    if let Some(backup) = read_backup(&dir, &rc.toolkit_config)? {
        backups.insert(rc.toolkit_config.clone(), backup);
    }
    Ok(Observed {
        engines,
        runtime_binary_present: root.join(&rc.runtime_binary).is_file(),
        volume_mounts,
        toolkit,
        also,
        kubelet: kubelet::detect(root, &rc.kubelet_runtime_endpoint),
        backups,
        cdi_dir: config.cdi.dir.clone(),
    })
}

/// Directories where an engine's binary may be when it is not where the config says: the
/// distributions' and the upstream tarballs' (`/usr/local/bin`).
const BINARY_DIRS: [&str; 5] = ["/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin", "/bin"];

/// The configured binary when it exists, else the same name in [`BINARY_DIRS`].
fn locate_binary(runner: &Runner, configured: &Path) -> Option<PathBuf> {
    if runner.exists(configured) {
        return Some(configured.to_path_buf());
    }
    let name = configured.file_name()?;
    BINARY_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| runner.exists(p))
}
