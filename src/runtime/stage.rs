//! The runtime stage: observe the engines' files, plan the edits (pure), apply them with
//! backups, check containerd's result, restart what changed and roll back what does not come
//! back; and the CDI spec.
//!
//! Backups live in `<state_dir>/runtime/`: for every file the agent ever changed, the bytes it
//! had before the first change (`<name>.orig`, or `<name>.absent` when there was no file) and
//! the digest of what the agent last wrote (`<name>.written`). `runtime unconfigure` puts the
//! original back when the file is still what the agent wrote, and otherwise removes only the
//! agent's entries, keeping the user's later edits.
//!
//! A config file that is a symbolic link (config management often keeps the real file elsewhere)
//! stays one: the link is followed under the root (see [`resolve`]) and its target is read,
//! backed up, written and restored; the backups are still named after the link.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::kubelet::{self, KubeletEndpoint};
use super::{DefaultRuntime, EditError, NvidiaRuntime, cdi, containerd, cri, crio, docker, facts_cache, toolkit};
use crate::config::{AnyEngineFiles, Config, DeviceListStrategy, Engine, RuntimeConfig, RuntimeMode, SetAsDefault};
use crate::host::command::{Cmd, Runner};
use crate::host::{HostRoot, WriteError, write_atomic};

/// Systemd unit directories searched to tell whether an engine is installed.
const UNIT_DIRS: [&str; 5] = [
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
];

/// Symbolic links followed, at most, to find one file (Linux's `MAXSYMLINKS`).
const MAX_LINKS: u32 = 40;

/// Why the runtime stage failed. Nothing is left half-written: files are restored first.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// `file` (a host path) is, or goes through, the symbolic link `link` to `target` (as the
    /// link says it), which cannot be followed.
    #[error(
        "{}: the symbolic link {} -> {} {why}; nothing was changed",
        file.display(),
        link.display(),
        target.display()
    )]
    Link {
        file: PathBuf,
        link: PathBuf,
        target: PathBuf,
        why: &'static str,
    },
    #[error("{0}; nothing was changed")]
    Edit(#[from] EditError),
    #[error(
        "the runtime binary {} ([runtime] runtime_binary) is not installed: install the NVIDIA Container Toolkit \
         (package nvidia-container-toolkit), or set [runtime] mode = \"cdi-only\"; nothing was changed",
        binary.display()
    )]
    MissingRuntime { binary: PathBuf },
    #[error("{0}")]
    Write(#[from] WriteError),
    #[error("cannot keep a backup of {path} in {}: {source}", dir.display())]
    Backup {
        path: PathBuf,
        dir: PathBuf,
        source: io::Error,
    },
    #[error("containerd rejects the new configuration ({reason}); the previous files were put back")]
    Check { reason: String },
    #[error(
        "{engine} did not come back after the restart ({reason}); the previous files were put back{}",
        restored(again)
    )]
    Restart {
        engine: &'static str,
        reason: String,
        again: Option<String>,
    },
    #[error("CDI spec: {0}")]
    Cdi(#[from] cdi::CdiError),
    /// The engine's files could not be planned (parse or shape error); nothing was written to it.
    #[error("{message}")]
    Engine { engine: &'static str, message: String },
}

fn restored(again: &Option<String>) -> String {
    match again {
        None => " and it was restarted with them".into(),
        Some(e) => format!(", but restarting it with them failed too: {e}"),
    }
}

/// An engine's files as they are now.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedEngine {
    pub engine: Engine,
    pub files: AnyEngineFiles,
    /// Its binary or systemd unit exists.
    pub installed: bool,
    /// Listed in `[runtime] engines`, or found (when the list is empty).
    pub selected: bool,
    /// Text of the main config (`None`: no file).
    pub main: Option<String>,
    /// Text of the agent's drop-in (`None`: no file, or docker).
    pub drop_in: Option<String>,
    /// Host path of the main config's bytes: `files.config`, or where its symbolic links lead.
    pub main_target: PathBuf,
    /// The same for the drop-in (empty for docker).
    pub drop_in_target: PathBuf,
    /// The engine's binary (host path) where it was found: the configured path, or the same
    /// name in another standard directory (`/usr/local/bin` for upstream tarballs).
    pub binary: Option<PathBuf>,
    /// containerd's version (major, minor) from `containerd --version`, when known.
    pub version: Option<(u32, u32)>,
    /// containerd: the other files it loads through `imports` once the agent's entry is there,
    /// in its load order, without the agent's drop-in (see [`containerd_imports`]). CRI-O: the
    /// other files of its drop-in directory, in name order (see [`crio_drop_ins`]).
    pub imported: Vec<containerd::ImportedFile>,
    /// containerd: `containerd config dump` of the configured top-level file without the
    /// agent's drop-in (see [`containerd_effective`]); `None` without the binary, or when the
    /// dump failed (logged; the files are read instead).
    pub effective: Option<String>,
    /// containerd: `effective` is also what containerd loads now without the agent's drop-in,
    /// because the top-level config already has the agent's `imports` entry or that entry would
    /// load no other file. Only then can the plan tell from `effective` that the agent's files
    /// would change nothing (see [`plan`]).
    pub effective_is_current: bool,
    /// The engine's CRI socket (host path): containerd's `[grpc] address`, CRI-O's default;
    /// `None` for docker, which serves no CRI itself.
    pub cri_socket: Option<PathBuf>,
}

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

/// One file's change: `after == None` removes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileChange {
    /// Host path (the configured one, which names the backups).
    pub path: PathBuf,
    /// Host path written or removed: `path`, or where its symbolic links lead.
    pub target: PathBuf,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// What happens to one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnginePlan {
    pub engine: Engine,
    pub unit: String,
    pub installed: bool,
    /// Only files whose bytes change.
    pub changes: Vec<FileChange>,
    /// The engine must restart to load `changes`: false when they change nothing it runs with
    /// (containerd: the agent's earlier drop-in goes because containerd's own configuration
    /// already has all it set).
    pub restart: bool,
    /// The engine the kubelet uses (its failure holds the device plugin back).
    pub kubelet: bool,
    /// The runtimes as this engine gets them (its default-runtime choice, CDI where supported).
    pub runtime: NvidiaRuntime,
    /// Its CRI socket (host path), asked after a restart.
    pub cri_socket: Option<PathBuf>,
    /// Its binary (host path), where found.
    pub binary: Option<PathBuf>,
    /// Why the engine is left alone (containerd with its CRI plugin disabled).
    pub skipped: Option<String>,
    /// Why the engine cannot be configured (its files do not parse, ...): nothing is written to
    /// it; the other engines go on.
    pub error: Option<String>,
    /// What was left out and why (containerd 1.6 has no CDI).
    pub warnings: Vec<String>,
}

/// Configure (the agent's own entries in) or unconfigure (back to the originals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Configure,
    Unconfigure,
}

/// The runtime stage's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimePlan {
    pub purpose: Purpose,
    pub engines: Vec<EnginePlan>,
    /// Why nothing is planned, when that is the case (cdi-only, no engine found).
    pub note: Option<String>,
    /// The NVIDIA Container Toolkit's config, when it changes (see [`super::toolkit`]); no engine
    /// restarts for it: the toolkit reads it for every container.
    pub toolkit: Vec<FileChange>,
}

impl RuntimePlan {
    /// No file changes.
    pub fn is_empty(&self) -> bool {
        self.engines.iter().all(|e| e.changes.is_empty()) && self.toolkit.is_empty()
    }

    /// One line for status: what is configured or what would change.
    pub fn summary(&self) -> String {
        match &self.note {
            Some(note) => note.clone(),
            None => self.engine_names(true),
        }
    }

    /// What the engines have, for status: `nvidia runtime in containerd (default)`, or under
    /// `cdi-only` `CDI, no runtime, in containerd`.
    pub fn describe(&self, runtime_name: &str) -> String {
        match &self.note {
            Some(note) => note.clone(),
            None if self.engines.iter().any(|e| !e.runtime.runtimes) => {
                format!("CDI, no runtime, in {}", self.engine_names(false))
            }
            None => format!("{runtime_name} runtime in {}", self.engine_names(false)),
        }
    }

    /// The configured engines, `(default)` after one whose default the runtime becomes and,
    /// with `cdi_mark`, `(CDI only)` after one that gets no runtime.
    fn engine_names(&self, cdi_mark: bool) -> String {
        let names: Vec<String> = self
            .engines
            .iter()
            .filter(|e| e.skipped.is_none() && e.error.is_none())
            .map(|e| {
                let engine = e.engine.as_str();
                if !e.runtime.runtimes && cdi_mark {
                    format!("{engine} (CDI only)")
                } else if e.runtime.default == DefaultRuntime::Set && e.runtime.runtimes {
                    format!("{engine} (default)")
                } else {
                    engine.to_owned()
                }
            })
            .collect();
        names.join(", ")
    }

    /// The engines left alone, with why, and their warnings: lines for status and the log.
    pub fn remarks(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in &self.engines {
            if let Some(why) = &e.skipped {
                out.push(format!("{} left alone: {why}", e.engine.as_str()));
            }
            out.extend(e.warnings.iter().map(|w| format!("{}: {w}", e.engine.as_str())));
        }
        out
    }
}

/// The runtimes the config describes, with the default-runtime choice of `set_as_default` for
/// an engine that is (`kubelet`) or is not the kubelet's.
pub fn nvidia_runtime(config: &RuntimeConfig, kubelet: bool, also: &[(String, PathBuf)]) -> NvidiaRuntime {
    NvidiaRuntime {
        name: config.runtime_name.clone(),
        binary: config.runtime_binary.clone(),
        default: match config.set_as_default {
            SetAsDefault::Always => DefaultRuntime::Set,
            SetAsDefault::Never => DefaultRuntime::Unset,
            SetAsDefault::Auto if kubelet => DefaultRuntime::Set,
            SetAsDefault::Auto => DefaultRuntime::Keep,
        },
        enable_cdi: config.enable_cdi,
        also: also.to_vec(),
        runtimes: true,
    }
}

pub(super) fn read_optional(path: &Path) -> Result<Option<String>, RuntimeError> {
    match crate::host::read_text(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RuntimeError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The backup directory under the root.
fn backup_dir(config: &Config, root: &HostRoot) -> PathBuf {
    root.join(config.agent.state_dir.join("runtime"))
}

/// A host path as one file name: `/etc/docker/daemon.json` → `%2Fetc%2Fdocker%2Fdaemon.json`.
fn backup_name(path: &Path) -> String {
    path.to_string_lossy().replace('%', "%25").replace('/', "%2F")
}

fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes()).iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Reads the engines' files and the backups, finds the kubelet's engine, and asks an installed
/// containerd for its version and its effective configuration (`config dump`).
pub fn observe(config: &Config, root: &HostRoot, runner: &Runner) -> Result<Observed, RuntimeError> {
    let rc = &config.runtime;
    let mut engines = Vec::new();
    let mut backups = BTreeMap::new();
    let dir = backup_dir(config, root);
    for engine in Engine::ALL {
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
        let containerd = engine == Engine::Containerd && selected;
        let imported = if containerd {
            containerd_imports(root, &files, main.as_deref())
        } else if engine == Engine::Crio && selected {
            crio_drop_ins(root, &files)
        } else {
            Vec::new()
        };
        let (version, effective) = match &binary {
            Some(binary) if containerd => {
                containerd_facts(config, root, runner, &files, binary, main.as_deref(), &imported)
            }
            // Docker has CDI from 25 on: asked only where the agent relies on it.
            Some(binary) if engine == Engine::Docker && selected && rc.mode == RuntimeMode::CdiOnly => {
                (engine_version(runner, binary), None)
            }
            _ => (None, None),
        };
        let effective_is_current = containerd && containerd_imports_now(root, &files, main.as_deref(), &imported);
        let cri_socket = match engine {
            Engine::Containerd => Some(PathBuf::from(
                effective
                    .as_deref()
                    .map(containerd::dump_address)
                    .unwrap_or_else(|| containerd::DEFAULT_ADDRESS.to_owned()),
            )),
            Engine::Crio => Some(PathBuf::from(CRIO_SOCKET)),
            Engine::Docker => None,
        };
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
            version,
            imported,
            effective_is_current,
            effective,
            cri_socket,
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

/// What the backup dir `dir` knows about the host file `path`; `None` when the agent never
/// changed it.
fn read_backup(dir: &Path, path: &Path) -> Result<Option<Backup>, RuntimeError> {
    let name = backup_name(path);
    let original = read_optional(&dir.join(format!("{name}.orig")))?;
    if original.is_none() && !dir.join(format!("{name}.absent")).exists() {
        return Ok(None);
    }
    let written = read_optional(&dir.join(format!("{name}.written")))?.map(|s| s.trim().to_string());
    Ok(Some(Backup { original, written }))
}

/// CRI-O's CRI socket (its `listen` default).
const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";

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

/// containerd's version and effective configuration (see [`containerd_effective`]), asked
/// again only when the binary or one of the files it reads changed: every pass observes, and
/// the two commands cost about 100 ms together.
fn containerd_facts(
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    files: &AnyEngineFiles,
    binary: &Path,
    main: Option<&str>,
    imported: &[containerd::ImportedFile],
) -> (Option<(u32, u32)>, Option<String>) {
    type Facts = (String, Option<(u32, u32)>, Option<String>);
    static LAST: std::sync::Mutex<Option<Facts>> = std::sync::Mutex::new(None);
    let mut key = format!(
        "{}\0{}\0{}\0{}",
        root.path().display(),
        binary.display(),
        facts_cache::identity(&root.join(binary)),
        main.map(digest).unwrap_or_default()
    );
    for f in imported {
        key.push_str(&format!("\0{}={}", f.file, digest(&f.text)));
    }
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((k, version, dump)) = last.as_ref()
        && *k == key
    {
        return (*version, dump.clone());
    }
    // What an earlier run of the agent was told (a restart where nothing changed asks nothing).
    let dir = backup_dir(config, root);
    let stored_key = facts_cache::key(&key);
    if let Some((version, dump)) = facts_cache::load(&dir, &stored_key) {
        *last = Some((key, version, Some(dump.clone())));
        return (version, Some(dump));
    }
    let version = engine_version(runner, binary);
    let dump = match containerd_effective(config, root, runner, files, binary, main, version) {
        Ok(dump) => {
            facts_cache::store(&dir, &stored_key, version, &dump);
            Some(dump)
        }
        Err(e) => {
            tracing::warn!("containerd's effective configuration: {e}; reading its files instead");
            None
        }
    };
    // A failed dump is tried again next time.
    *last = dump.as_ref().map(|d| (key, version, Some(d.clone())));
    (version, dump)
}

/// `<engine> --version` → (major, minor) (`containerd github.com/containerd/containerd
/// v1.7.20 ...` → (1, 7), `Docker version 26.1.5+dfsg1, build a72d7cd` → (26, 1)). `None` when
/// it cannot be told (logged).
fn engine_version(runner: &Runner, binary: &Path) -> Option<(u32, u32)> {
    let cmd = Cmd::new(binary).arg("--version").timeout(Duration::from_secs(10));
    match runner.run(&cmd) {
        Ok(out) => parse_version(&out.stdout),
        Err(e) => {
            tracing::warn!("cannot tell the version of {}: {e}", binary.display());
            None
        }
    }
}

/// What containerd itself makes of its files once the agent's import is there but without the
/// agent's drop-in: `containerd --config <copy> config dump`, the copy being the top-level
/// config as [`containerd::configured_main`] leaves it, with every `imports` entry made an
/// absolute path under the root and the drop-in left out of its glob. The copy is a private
/// temp file, removed afterwards.
fn containerd_effective(
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    files: &AnyEngineFiles,
    binary: &Path,
    main: Option<&str>,
    version: Option<(u32, u32)>,
) -> Result<String, String> {
    let main_file = files.config.to_string_lossy();
    let drop_in = files.drop_in.to_string_lossy();
    let (_, configured) =
        containerd::configured_main(main, &main_file, &drop_in, version.map(|v| v.0)).map_err(|e| e.to_string())?;
    let entries = containerd::imports(&configured, &main_file).map_err(|e| e.to_string())?;
    let mut paths = Vec::new();
    for path in import_paths(root, &files.config, &entries) {
        if path != files.drop_in {
            paths.push(root.join(&path).to_string_lossy().into_owned());
        }
    }
    let copy_text = containerd::with_imports(&configured, &main_file, &paths).map_err(|e| e.to_string())?;
    let dir = backup_dir(config, root);
    let copy = dir.join(format!(".containerd-effective-{}.toml", std::process::id()));
    write_atomic(&copy, copy_text.as_bytes(), 0o600).map_err(|e| e.to_string())?;
    let cmd = Cmd::new(binary)
        .arg("--config")
        .arg(&copy)
        .args(["config", "dump"])
        .timeout(Duration::from_secs(30));
    let result = runner.run(&cmd);
    let _ = std::fs::remove_file(&copy);
    Ok(result.map_err(|e| e.to_string())?.stdout)
}

fn parse_version(version_output: &str) -> Option<(u32, u32)> {
    version_output.split_whitespace().find_map(|word| {
        let v = word.strip_prefix('v').unwrap_or(word);
        let mut parts = v.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some((major, minor.parse().ok()?))
    })
}

/// Where the host path `path` really is: every symbolic link on the way followed as the kernel
/// would with the root as `/` (a relative target against the link's directory, an absolute one
/// under the root, `..` never above the root). Returns a host path; components that do not
/// exist are kept as they are (a file still to be created). A link whose target does not exist,
/// or a loop, is [`RuntimeError::Link`] naming `path` and that link.
pub fn resolve(root: &HostRoot, path: &Path) -> Result<PathBuf, RuntimeError> {
    let mut links = 0;
    follow(root, PathBuf::from("/"), path, path, &mut links)
}

/// Resolves `rel` from the link-free host directory `at`, counting the links followed.
fn follow(root: &HostRoot, mut at: PathBuf, rel: &Path, file: &Path, links: &mut u32) -> Result<PathBuf, RuntimeError> {
    for component in rel.components() {
        let name = match component {
            Component::RootDir | Component::Prefix(_) => {
                at = PathBuf::from("/");
                continue;
            }
            Component::CurDir => continue,
            Component::ParentDir => {
                at.pop();
                continue;
            }
            Component::Normal(name) => name,
        };
        let next = at.join(name);
        let on_disk = root.join(&next);
        match std::fs::symlink_metadata(&on_disk) {
            Ok(meta) if meta.file_type().is_symlink() => {}
            Ok(_) => {
                at = next;
                continue;
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {
                at = next;
                continue;
            }
            Err(source) => return Err(RuntimeError::Read { path: on_disk, source }),
        }
        let target = std::fs::read_link(&on_disk).map_err(|source| RuntimeError::Read {
            path: on_disk.clone(),
            source,
        })?;
        let cannot = |why| RuntimeError::Link {
            file: file.to_path_buf(),
            link: next.clone(),
            target: target.clone(),
            why,
        };
        *links += 1;
        if *links > MAX_LINKS {
            return Err(cannot("is part of a loop (too many levels of symbolic links)"));
        }
        let resolved = follow(root, at.clone(), &target, file, links)?;
        if std::fs::symlink_metadata(root.join(&resolved)).is_err() {
            return Err(cannot("points to nothing (the target does not exist)"));
        }
        at = resolved;
    }
    Ok(at)
}

/// The files containerd loads through the `imports` of the top-level config (`main`, with the
/// agent's entry added as [`containerd::configure`] adds it) in its order: breadth first, each
/// entry relative to the file that names it, one with `*` globbed (matches sorted), every file
/// once; without the top-level config itself and the agent's drop-in. Files that cannot be read
/// are left out (containerd's own check of the result reports them); one that does not parse is
/// kept, for the edit to report, but its own imports are not followed.
fn containerd_imports(root: &HostRoot, files: &AnyEngineFiles, main: Option<&str>) -> Vec<containerd::ImportedFile> {
    let main_file = files.config.to_string_lossy();
    let Ok(entries) = containerd::imports_after_configure(main, &main_file, &files.drop_in.to_string_lossy()) else {
        return Vec::new();
    };
    imported_files(root, files, &entries)
}

/// Whether containerd loads the files `imported` ([`containerd_imports`] of `main`) now, without
/// the `imports` entry the agent adds: the top-level config has it already, or it loads no
/// other file than the agent's drop-in.
fn containerd_imports_now(
    root: &HostRoot,
    files: &AnyEngineFiles,
    main: Option<&str>,
    imported: &[containerd::ImportedFile],
) -> bool {
    let main_file = files.config.to_string_lossy();
    let entries = match main {
        Some(text) => match containerd::imports(text, &main_file) {
            Ok(entries) => entries,
            Err(_) => return false,
        },
        None => Vec::new(),
    };
    let now = imported_files(root, files, &entries);
    now.len() == imported.len() && now.iter().zip(imported).all(|(a, b)| a.file == b.file)
}

/// The files the top-level config's `imports` `entries` load, in containerd's order (see
/// [`containerd_imports`]).
fn imported_files(root: &HostRoot, files: &AnyEngineFiles, entries: &[String]) -> Vec<containerd::ImportedFile> {
    let mut queue: VecDeque<PathBuf> = import_paths(root, &files.config, entries).into();
    let mut seen = BTreeSet::from([files.config.clone(), files.drop_in.clone()]);
    let mut out = Vec::new();
    while let Some(path) = queue.pop_front() {
        if !seen.insert(path.clone()) {
            continue;
        }
        let text = match resolve(root, &path).and_then(|target| read_optional(&root.join(target))) {
            Ok(Some(text)) => text,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!("containerd import {}: {e}", path.display());
                continue;
            }
        };
        let file = path.to_string_lossy().into_owned();
        if let Ok(more) = containerd::imports(&text, &file) {
            queue.extend(import_paths(root, &path, &more));
        }
        out.push(containerd::ImportedFile { file, text });
    }
    out
}

/// The files of CRI-O's drop-in directory (the agent's drop-in's directory, `crio.conf.d/`) in
/// the name order CRI-O reads them, without the agent's own; unreadable ones are left out
/// (logged).
fn crio_drop_ins(root: &HostRoot, files: &AnyEngineFiles) -> Vec<containerd::ImportedFile> {
    let Some(dir) = files.drop_in.parent() else {
        return Vec::new();
    };
    let Some(entries) = resolve(root, dir)
        .ok()
        .and_then(|real| std::fs::read_dir(root.join(real)).ok())
    else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let path = dir.join(&name);
        if path == files.drop_in {
            continue;
        }
        match resolve(root, &path).and_then(|target| read_optional(&root.join(target))) {
            Ok(Some(text)) => out.push(containerd::ImportedFile {
                file: path.to_string_lossy().into_owned(),
                text,
            }),
            Ok(None) => {}
            Err(e) => tracing::warn!("CRI-O drop-in {}: {e}", path.display()),
        }
    }
    out
}

/// containerd's `resolveImports`: each entry made absolute against the directory of `parent` (the
/// host path of the file that names it) and cleaned; one with `*` becomes its glob's matches.
fn import_paths(root: &HostRoot, parent: &Path, entries: &[String]) -> Vec<PathBuf> {
    let dir = parent.parent().unwrap_or(Path::new("/"));
    let mut out = Vec::new();
    for entry in entries {
        let path = clean(&dir.join(entry));
        if entry.contains('*') {
            out.extend(glob(root, &path));
        } else {
            out.push(path);
        }
    }
    out
}

/// `path` without `.` and `..` (lexically, as Go's `filepath.Clean`).
fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

/// Go's `filepath.Glob` of the absolute host path `pattern` under the root: the existing paths it
/// matches, directory by directory in sorted order.
fn glob(root: &HostRoot, pattern: &Path) -> Vec<PathBuf> {
    let mut matches = vec![PathBuf::from("/")];
    for component in pattern.components() {
        let Component::Normal(name) = component else { continue };
        let name = name.to_string_lossy();
        if !name.contains(['*', '?', '[', '\\']) {
            matches.iter_mut().for_each(|m| m.push(&*name));
            continue;
        }
        let mut next = Vec::new();
        for dir in &matches {
            let Ok(real) = resolve(root, dir) else { continue };
            let Ok(entries) = std::fs::read_dir(root.join(real)) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| containerd::glob_component_matches(&name, n))
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        matches = next;
    }
    matches.retain(|m| resolve(root, m).is_ok_and(|real| std::fs::symlink_metadata(root.join(real)).is_ok()));
    matches
}

fn change(path: &Path, target: &Path, before: &Option<String>, after: Option<String>) -> Option<FileChange> {
    (before != &after).then(|| FileChange {
        path: path.to_path_buf(),
        target: target.to_path_buf(),
        before: before.clone(),
        after,
    })
}

/// The edits that put the agent's runtime into every selected engine. Pure.
///
/// An engine whose files cannot be edited gets an [`EnginePlan::error`] and no changes; the
/// others are planned as usual (one engine's failure is that engine's). A containerd whose CRI
/// plugin is disabled (Docker's `containerd.io` package) is [`EnginePlan::skipped`]: no kubelet
/// can be using it.
pub fn plan(observed: &Observed, config: &RuntimeConfig) -> Result<RuntimePlan, RuntimeError> {
    let mut out = RuntimePlan {
        purpose: Purpose::Configure,
        engines: Vec::new(),
        note: None,
        toolkit: Vec::new(),
    };
    let cdi_only = config.mode == RuntimeMode::CdiOnly;
    let selected: Vec<&ObservedEngine> = observed.engines.iter().filter(|e| e.selected).collect();
    if selected.is_empty() {
        out.note = Some(
            "no container engine found (containerd, docker, crio: neither binary nor systemd unit); nothing to configure"
                .into(),
        );
        return Ok(out);
    }
    if !cdi_only && !observed.runtime_binary_present {
        return Err(RuntimeError::MissingRuntime {
            binary: config.runtime_binary.clone(),
        });
    }
    if observed.volume_mounts && !cdi_only {
        let (path, target, text) = &observed.toolkit;
        let after = toolkit::configure(text.as_deref(), &path.to_string_lossy())?;
        out.toolkit.extend(change(path, target, text, Some(after)));
    }
    let kubelet_engine = observed.kubelet.engine();
    for e in selected {
        let kubelet = kubelet_engine == Some(e.engine);
        let mut rt = nvidia_runtime(config, kubelet, &observed.also);
        if cdi_only {
            rt = rt.cdi_only();
        }
        let mut warnings = Vec::new();
        let mut error = None;
        if let Some((major, minor)) = e.version {
            let first = match e.engine {
                Engine::Containerd => (1, 7),
                Engine::Docker => (25, 0),
                Engine::Crio => (0, 0),
            };
            if rt.enable_cdi && (major, minor) < first {
                let name = e.engine.as_str();
                if cdi_only {
                    error = Some(format!(
                        "{name} {major}.{minor} has no CDI ({}.{} and later do), so under [runtime] mode = \"cdi-only\" \
                         its containers would get no GPU: install the NVIDIA Container Toolkit (its runtime), or a newer {name}; \
                         nothing was changed",
                        first.0, first.1
                    ));
                } else {
                    rt.enable_cdi = false;
                    warnings.push(format!(
                        "[runtime] enable_cdi is left out: {name} {major}.{minor} has no CDI ({}.{} and later do)",
                        first.0, first.1
                    ));
                }
            }
        }
        let mut plan = EnginePlan {
            engine: e.engine,
            unit: e.files.unit.clone(),
            installed: e.installed,
            changes: Vec::new(),
            restart: true,
            kubelet,
            runtime: rt,
            cri_socket: e.cri_socket.clone(),
            binary: e.binary.clone(),
            skipped: None,
            error,
            warnings,
        };
        if plan.error.is_none() {
            match engine_changes(e, observed, &plan.runtime) {
                Ok(Changes::Files(changes)) => plan.changes = changes,
                Ok(Changes::Skip(why)) => plan.skipped = Some(why),
                Ok(Changes::Needless {
                    changes,
                    restart,
                    remark,
                }) => {
                    plan.changes = changes;
                    plan.restart = restart;
                    plan.warnings.push(remark);
                }
                Err(err) => plan.error = Some(err.to_string()),
            }
        }
        out.engines.push(plan);
    }
    Ok(out)
}

/// What one engine needs.
enum Changes {
    Files(Vec<FileChange>),
    /// Left alone, with why.
    Skip(String),
    /// The engine's own configuration already has everything the agent's files would add
    /// (containerd): none is written, an earlier drop-in of the agent's goes (`changes`), and
    /// `restart` says whether that drop-in changed anything the engine runs with.
    Needless {
        changes: Vec<FileChange>,
        restart: bool,
        remark: String,
    },
}

fn engine_changes(e: &ObservedEngine, observed: &Observed, rt: &NvidiaRuntime) -> Result<Changes, RuntimeError> {
    let main_file = e.files.config.to_string_lossy().into_owned();
    let mut changes = Vec::new();
    match e.engine {
        Engine::Containerd => {
            let disabled = match &e.effective {
                Some(dump) => containerd::cri_disabled(dump),
                None => e.main.as_deref().is_some_and(containerd::cri_disabled),
            };
            if disabled {
                return Ok(Changes::Skip(format!(
                    "its CRI plugin is disabled (disabled_plugins in {main_file}), so no kubelet uses this containerd"
                )));
            }
            let drop_in_path = e.files.drop_in.to_string_lossy().into_owned();
            let input = containerd::Input {
                main: e.main.as_deref(),
                main_file: &main_file,
                drop_in_path: &drop_in_path,
                binary_major: e.version.map(|v| v.0),
                imported: &e.imported,
                effective: e.effective.as_deref(),
                cdi_dir: observed.cdi_dir.to_str(),
            };
            let files = containerd::configure_input(&input, rt)?;
            if let Some(needless) = containerd_needless(e, observed, &files.drop_in) {
                return Ok(needless);
            }
            changes.extend(change(&e.files.config, &e.main_target, &e.main, Some(files.main)));
            changes.extend(change(
                &e.files.drop_in,
                &e.drop_in_target,
                &e.drop_in,
                Some(files.drop_in),
            ));
        }
        Engine::Docker => {
            let text = docker::configure(e.main.as_deref(), &main_file, rt)?;
            changes.extend(change(&e.files.config, &e.main_target, &e.main, Some(text)));
        }
        // CRI-O reads CDI specs (from /etc/cdi and /var/run/cdi) whatever its configuration:
        // the agent's drop-in, which only ever holds its runtimes, goes.
        Engine::Crio if !rt.runtimes => {
            changes.extend(change(&e.files.drop_in, &e.drop_in_target, &e.drop_in, None));
        }
        Engine::Crio => {
            let drop_ins: Vec<(String, String)> = e.imported.iter().map(|f| (f.file.clone(), f.text.clone())).collect();
            let text = crio::configure_with_drop_ins(e.main.as_deref(), &main_file, &drop_ins, rt)?;
            changes.extend(change(&e.files.drop_in, &e.drop_in_target, &e.drop_in, Some(text)));
        }
    }
    Ok(Changes::Files(changes))
}

/// containerd's own configuration already has what the agent's drop-in `drop_in` would add:
/// `containerd config dump` without the agent's files is the same with it (see
/// [`containerd::drop_in_changes_nothing`]), and CDI, when on, reads the agent's spec directory
/// (the drop-in would add it otherwise). Then the top-level config keeps its bytes (no `imports`
/// entry is added) and no drop-in is written; an earlier drop-in of the agent's (its backup says
/// so) goes, with a restart only when it changed something containerd runs with.
///
/// `None` (files as usual) when containerd could not be asked, when the dump is not what it
/// loads now (the agent's `imports` entry would load other files too), or when a file the agent
/// did not write is at the drop-in's path.
fn containerd_needless(e: &ObservedEngine, observed: &Observed, drop_in: &str) -> Option<Changes> {
    let dump = e.effective.as_deref()?;
    let ours = e.drop_in.is_none() || observed.backups.contains_key(&e.files.drop_in);
    if !e.effective_is_current || !ours || !containerd::drop_in_changes_nothing(dump, drop_in) {
        return None;
    }
    let mut remark = "its own configuration already has all the agent would add (containerd config dump)".to_owned();
    let restart = match &e.drop_in {
        None => {
            remark.push_str(": no drop-in and no restart");
            false
        }
        Some(old) if containerd::drop_in_changes_nothing(dump, old) => {
            remark.push_str(": the agent's earlier drop-in, which changed nothing, goes, without a restart");
            false
        }
        Some(_) => {
            remark.push_str(": the agent's earlier drop-in goes, and a restart drops what it set");
            true
        }
    };
    Some(Changes::Needless {
        changes: change(&e.files.drop_in, &e.drop_in_target, &e.drop_in, None)
            .into_iter()
            .collect(),
        restart,
        remark,
    })
}

/// The edits that take the agent's runtime out of every engine: a file still as the agent
/// wrote it gets its original back (or goes, if there was none); a file edited since loses only
/// the agent's entries; the agent's drop-ins go. Pure.
pub fn plan_unconfigure(observed: &Observed, config: &RuntimeConfig) -> Result<RuntimePlan, RuntimeError> {
    let mut out = RuntimePlan {
        purpose: Purpose::Unconfigure,
        engines: Vec::new(),
        note: None,
        toolkit: Vec::new(),
    };
    for e in &observed.engines {
        let main_file = e.files.config.to_string_lossy().into_owned();
        let mut changes = Vec::new();
        let restore = |path: &Path, now: &Option<String>| -> Option<Option<String>> {
            let backup = observed.backups.get(path)?;
            let untouched = now.as_deref().map(digest) == backup.written;
            untouched.then(|| backup.original.clone())
        };
        // The main file: only one the agent changed (a backup exists) is touched.
        let names = [
            config.runtime_name.clone(),
            format!("{}-cdi", config.runtime_name),
            format!("{}-legacy", config.runtime_name),
        ];
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let original = observed.backups.get(&e.files.config).map(|b| b.original.as_deref());
        let main_after = match (restore(&e.files.config, &e.main), original) {
            (Some(original), _) => original,
            (None, None) => e.main.clone(),
            (None, Some(original)) => match (&e.main, e.engine) {
                (Some(text), Engine::Containerd) => Some(containerd::unconfigure(
                    text,
                    &main_file,
                    &e.files.drop_in.to_string_lossy(),
                    original,
                )?),
                (Some(text), Engine::Docker) => Some(docker::unconfigure(text, &main_file, &names, original)?),
                (other, _) => other.clone(),
            },
        };
        changes.extend(change(&e.files.config, &e.main_target, &e.main, main_after));
        // The drop-in: the agent's own file.
        if !e.files.drop_in.as_os_str().is_empty() {
            let after = restore(&e.files.drop_in, &e.drop_in).unwrap_or(None);
            changes.extend(change(&e.files.drop_in, &e.drop_in_target, &e.drop_in, after));
        }
        if !changes.is_empty() {
            out.engines.push(EnginePlan {
                engine: e.engine,
                unit: e.files.unit.clone(),
                installed: e.installed,
                changes,
                restart: true,
                kubelet: observed.kubelet.engine() == Some(e.engine),
                runtime: nvidia_runtime(config, false, &[]),
                cri_socket: e.cri_socket.clone(),
                binary: e.binary.clone(),
                skipped: None,
                error: None,
                warnings: Vec::new(),
            });
        }
    }
    // The toolkit's config, when the agent changed it.
    let (path, target, text) = &observed.toolkit;
    if let (Some(backup), Some(now)) = (observed.backups.get(path), text) {
        let after = if Some(digest(now)) == backup.written {
            backup.original.clone()
        } else {
            Some(toolkit::unconfigure(
                now,
                &path.to_string_lossy(),
                backup.original.as_deref(),
            )?)
        };
        out.toolkit.extend(change(path, target, text, after));
    }
    if out.engines.is_empty() && out.toolkit.is_empty() {
        out.note = Some("no container engine has the agent's runtime; nothing to undo".into());
    }
    Ok(out)
}

/// The plan as a unified diff, file by file (`/dev/null` for a file that is created or
/// removed).
pub fn diff(plan: &RuntimePlan) -> String {
    let mut out = String::new();
    for c in plan.engines.iter().flat_map(|e| &e.changes).chain(&plan.toolkit) {
        let path = c.path.to_string_lossy();
        let (a, b) = (c.before.as_deref().unwrap_or(""), c.after.as_deref().unwrap_or(""));
        let old = if c.before.is_some() {
            format!("a{path}")
        } else {
            "/dev/null".into()
        };
        let new = if c.after.is_some() {
            format!("b{path}")
        } else {
            "/dev/null".into()
        };
        let text = similar::TextDiff::from_lines(a, b);
        let _ = write!(out, "{}", text.unified_diff().context_radius(3).header(&old, &new));
    }
    out
}

/// How the apply may touch services.
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// Restart engines whose files changed (false under `--no-restart` or a `--root` prefix).
    pub restart: bool,
}

/// What an apply did.
#[derive(Debug, Default)]
pub struct Applied {
    /// Host paths written or removed.
    pub files: Vec<PathBuf>,
    /// Units restarted.
    pub restarted: Vec<String>,
    /// The engines that failed, each rolled back on its own; the others were applied.
    pub failures: Vec<EngineFailure>,
}

impl PartialEq for Applied {
    /// Files and restarts; failures compare by their messages.
    fn eq(&self, other: &Applied) -> bool {
        let messages = |a: &Applied| {
            a.failures
                .iter()
                .map(|f| (f.engine, f.error.to_string()))
                .collect::<Vec<_>>()
        };
        self.files == other.files && self.restarted == other.restarted && messages(self) == messages(other)
    }
}

/// One engine's failure.
#[derive(Debug)]
pub struct EngineFailure {
    pub engine: Engine,
    /// The engine the kubelet uses.
    pub kubelet: bool,
    pub error: RuntimeError,
}

impl Applied {
    /// The failure of the kubelet's engine, which holds the device plugin back.
    pub fn kubelet_failure(&self) -> Option<&EngineFailure> {
        self.failures.iter().find(|f| f.kubelet)
    }
}

/// The name of the intent record: the changes of the engine being applied, written before its
/// files and removed once they are checked, restarted and recorded (see [`recover`]).
const INTENT: &str = "intent.json";

/// A test hook: a process whose `GNA_TEST_KILL_AT` names `point` kills itself there with
/// SIGKILL, so tests can stop the apply at each step as `kill -9` would.
fn kill_point(point: &str) {
    if std::env::var_os("GNA_TEST_KILL_AT").is_some_and(|v| v == point) {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// Finishes an apply that was interrupted (the agent was killed, the node lost power): the files
/// its intent record lists that still hold what it was writing get their previous bytes back
/// (the files were never checked or the engine never restarted with them), so the next plan
/// sees the change again and applies it with its check and restart. A file someone changed
/// since is left as it is. Returns what was put back, for the log; `None` when there was no
/// record.
pub fn recover(config: &Config, root: &HostRoot) -> Result<Option<String>, RuntimeError> {
    let dir = backup_dir(config, root);
    let record = dir.join(INTENT);
    let Some(text) = read_optional(&record)? else {
        return Ok(None);
    };
    let changes: Vec<FileChange> = match serde_json::from_str(&text) {
        Ok(changes) => changes,
        Err(e) => {
            tracing::warn!("{}: unreadable ({e}); removed", record.display());
            Vec::new()
        }
    };
    let mut restored = Vec::new();
    for c in &changes {
        let now = read_optional(&root.join(&c.target))?;
        if now == c.after && c.after != c.before {
            write_changes(root, std::slice::from_ref(c), |c| c.before.as_deref())?;
            if c.before.is_none() {
                remove_created_dirs(root, &dir, &c.path)?;
            }
            restored.push(c.path.display().to_string());
        }
    }
    std::fs::remove_file(&record).map_err(backup_err(&dir, &record))?;
    Ok(Some(if restored.is_empty() {
        "an interrupted runtime change left nothing to undo".to_owned()
    } else {
        format!(
            "an interrupted runtime change was undone: {} put back as they were; it is applied again now",
            restored.join(", ")
        )
    }))
}

/// Applies `plan`: per engine, backups first (configure), the intent record, the files,
/// containerd's own check of the result, then a restart when the engine is installed and
/// restarts are allowed, and the engine's CRI asked whether it serves the runtimes. A failed
/// check or restart puts that engine's previous files back (and restarts it with them); the
/// other engines go on. The first failure is the error; [`apply_all`] returns them all.
pub fn apply(
    plan: &RuntimePlan,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
) -> Result<Applied, RuntimeError> {
    let mut applied = apply_all(plan, config, root, runner, opts);
    if applied.failures.is_empty() {
        Ok(applied)
    } else {
        Err(applied.failures.remove(0).error)
    }
}

/// [`apply`], every engine's failure in [`Applied::failures`].
pub fn apply_all(
    plan: &RuntimePlan,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
) -> Applied {
    let mut applied = Applied::default();
    if !plan.toolkit.is_empty() {
        match apply_files(&plan.toolkit, plan.purpose, config, root) {
            Ok(()) => applied.files.extend(plan.toolkit.iter().map(|c| c.path.clone())),
            // Read by the toolkit for each container, whatever the engine: it counts as the
            // kubelet's engine's.
            Err(error) => applied.failures.push(EngineFailure {
                engine: plan
                    .engines
                    .iter()
                    .find(|e| e.kubelet)
                    .map_or(Engine::Containerd, |e| e.engine),
                kubelet: true,
                error,
            }),
        }
    }
    for e in &plan.engines {
        let failed = match &e.error {
            Some(message) => Err(RuntimeError::Engine {
                engine: e.engine.as_str(),
                message: message.clone(),
            }),
            None if e.changes.is_empty() => continue,
            None => apply_engine(e, plan.purpose, config, root, runner, opts, &mut applied),
        };
        if let Err(error) = failed {
            applied.failures.push(EngineFailure {
                engine: e.engine,
                kubelet: e.kubelet,
                error,
            });
        }
    }
    applied
}

fn apply_engine(
    e: &EnginePlan,
    purpose: Purpose,
    config: &Config,
    root: &HostRoot,
    runner: &Runner,
    opts: &ApplyOptions,
    applied: &mut Applied,
) -> Result<(), RuntimeError> {
    let dir = backup_dir(config, root);
    begin(&e.changes, purpose, root, &dir)?;
    let rollback = || -> Result<(), RuntimeError> {
        write_changes(root, &e.changes, |c| c.before.as_deref())?;
        e.changes
            .iter()
            .filter(|c| c.before.is_none())
            .try_for_each(|c| remove_created_dirs(root, &dir, &c.path))?;
        remove_intent(&dir)
    };
    if e.engine == Engine::Containerd
        && purpose == Purpose::Configure
        && let Err(reason) = check_containerd(config, root, runner, e)
    {
        rollback()?;
        return Err(RuntimeError::Check { reason });
    }
    kill_point("check");
    if opts.restart && e.installed && e.restart {
        let wanted: Vec<&str> = match purpose {
            Purpose::Configure => e.runtime.all().map(|(name, _)| name).collect(),
            Purpose::Unconfigure => Vec::new(),
        };
        if let Err(reason) = restart(config, root, runner, e, &wanted) {
            rollback()?;
            let again = restart(config, root, runner, e, &[]).err();
            return Err(RuntimeError::Restart {
                engine: e.engine.as_str(),
                reason,
                again,
            });
        }
        applied.restarted.push(e.unit.clone());
    }
    kill_point("restart");
    finish(&e.changes, purpose, root, &dir)?;
    applied.files.extend(e.changes.iter().map(|c| c.path.clone()));
    Ok(())
}

/// The first steps of applying `changes`: backups (configure), the intent record, the files.
fn begin(changes: &[FileChange], purpose: Purpose, root: &HostRoot, dir: &Path) -> Result<(), RuntimeError> {
    if purpose == Purpose::Configure {
        for c in changes {
            keep_original(root, dir, c)?;
        }
    }
    kill_point("backup");
    let intent = serde_json::to_string(changes).unwrap_or_default();
    write_atomic(&dir.join(INTENT), intent.as_bytes(), 0o600)?;
    kill_point("intent");
    write_changes(root, changes, |c| c.after.as_deref())?;
    kill_point("write");
    Ok(())
}

/// The last steps, once the files are accepted: what was written is recorded (or the backups
/// go, after an unconfigure, with the directories the agent created), then the intent record.
fn finish(changes: &[FileChange], purpose: Purpose, root: &HostRoot, dir: &Path) -> Result<(), RuntimeError> {
    for c in changes {
        if purpose == Purpose::Unconfigure && c.after.is_none() {
            remove_created_dirs(root, dir, &c.path)?;
        }
        record(dir, c, purpose)?;
    }
    kill_point("record");
    remove_intent(dir)
}

/// Files no engine restart depends on (the toolkit's config): backups, intent, write, record.
fn apply_files(changes: &[FileChange], purpose: Purpose, config: &Config, root: &HostRoot) -> Result<(), RuntimeError> {
    let dir = backup_dir(config, root);
    begin(changes, purpose, root, &dir)?;
    finish(changes, purpose, root, &dir)
}

fn remove_intent(dir: &Path) -> Result<(), RuntimeError> {
    let path = dir.join(INTENT);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(backup_err(dir, &path)(e)),
        _ => Ok(()),
    }
}

fn backup_err(dir: &Path, path: &Path) -> impl FnOnce(io::Error) -> RuntimeError {
    let (dir, path) = (dir.to_path_buf(), path.to_path_buf());
    move |source| RuntimeError::Backup { path, dir, source }
}

/// Saves the file's bytes before the agent changes it, unless the file is still exactly what
/// the agent last wrote (then the backup from before the agent's first change stays). A file
/// someone else rewrote since, or one whose last change was rolled back, gets a new backup: an
/// unconfigure must not bring back text older than the user's own. For a file that did not
/// exist, the `.absent` marker lists the directories the write will create (deepest first), so
/// that putting the absence back removes them again.
fn keep_original(root: &HostRoot, dir: &Path, c: &FileChange) -> Result<(), RuntimeError> {
    let name = backup_name(&c.path);
    let (orig, absent) = (dir.join(format!("{name}.orig")), dir.join(format!("{name}.absent")));
    let written = read_optional(&dir.join(format!("{name}.written")))?.map(|s| s.trim().to_string());
    let ours = written.is_some() && c.before.as_deref().map(digest) == written;
    if ours && (orig.exists() || absent.exists()) {
        return Ok(());
    }
    // A backup that already holds `before` stays (an apply interrupted and undone, then tried
    // again): the `.absent` marker keeps the directories the first write created.
    let same = match &c.before {
        Some(text) => read_optional(&orig)?.as_deref() == Some(text.as_str()),
        None => absent.exists() && !orig.exists(),
    };
    if same {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(backup_err(dir, &c.path))?;
    let stale = |p: &Path| match std::fs::remove_file(p) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(backup_err(dir, &c.path)(e)),
        _ => Ok(()),
    };
    match &c.before {
        Some(text) => {
            write_atomic(&orig, text.as_bytes(), 0o600)?;
            stale(&absent)?;
        }
        None => {
            let missing: String = c
                .target
                .ancestors()
                .skip(1)
                .take_while(|d| d.parent().is_some() && !root.join(d).exists())
                .map(|d| format!("{}\n", d.display()))
                .collect();
            write_atomic(&absent, missing.as_bytes(), 0o600)?;
            stale(&orig)?;
        }
    }
    Ok(())
}

/// After a file whose backup is `.absent` was removed again: the directories its write
/// created, deepest first, removed while they are empty (anything someone put there since
/// stays, and so does its directory).
fn remove_created_dirs(root: &HostRoot, dir: &Path, file: &Path) -> Result<(), RuntimeError> {
    let marker = dir.join(format!("{}.absent", backup_name(file)));
    let Some(listed) = read_optional(&marker)? else {
        return Ok(());
    };
    for created in listed.lines().map(str::trim).filter(|l| l.starts_with('/')) {
        let path = root.join(created);
        match std::fs::remove_dir(&path) {
            Ok(()) => tracing::debug!("removed {}, created for {}", path.display(), file.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // Not empty (or not ours to remove): it stays, and so do its parents.
            Err(_) => break,
        }
    }
    Ok(())
}

/// After a configure: the digest of what was written. After an unconfigure: the backup is done
/// with.
fn record(dir: &Path, c: &FileChange, purpose: Purpose) -> Result<(), RuntimeError> {
    let name = backup_name(&c.path);
    match purpose {
        Purpose::Configure => {
            let written = c.after.as_deref().map(digest).unwrap_or_default();
            write_atomic(&dir.join(format!("{name}.written")), written.as_bytes(), 0o600)?;
        }
        Purpose::Unconfigure => {
            for ext in ["orig", "absent", "written"] {
                match std::fs::remove_file(dir.join(format!("{name}.{ext}"))) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(backup_err(dir, &c.path)(e)),
                }
            }
        }
    }
    Ok(())
}

fn write_changes<'a>(
    root: &HostRoot,
    changes: &'a [FileChange],
    text: impl Fn(&'a FileChange) -> Option<&'a str>,
) -> Result<(), RuntimeError> {
    for c in changes {
        let path = root.join(&c.target);
        match text(c) {
            Some(t) => write_atomic(&path, t.as_bytes(), 0o644)?,
            None => match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(RuntimeError::Write(WriteError {
                        action: "remove",
                        path,
                        source,
                    }));
                }
            },
        }
    }
    Ok(())
}

/// `containerd --config <main> config dump` must succeed and show the runtimes, with the
/// default runtime defined. Under a root prefix the main file's absolute imports are pointed
/// into the root first (a copy in the backup dir is checked). Skipped (Ok) when containerd is
/// not installed.
fn check_containerd(config: &Config, root: &HostRoot, runner: &Runner, e: &EnginePlan) -> Result<(), String> {
    let files = config.runtime.files(Engine::Containerd);
    let Some(binary) = &e.binary else {
        return Ok(());
    };
    let main_path = root.join(&files.config);
    let checked = if root.is_real() {
        main_path
    } else {
        // Through its links under the root, as everything else here.
        let real = resolve(root, &files.config).map_err(|e| e.to_string())?;
        let text = crate::host::read_text(&root.join(real)).map_err(|e| format!("{}: {e}", main_path.display()))?;
        let rebased = containerd::rebase_imports(&text, &main_path.to_string_lossy(), |p| {
            if p.starts_with('/') {
                root.join(p).to_string_lossy().into_owned()
            } else {
                p.to_string()
            }
        })
        .map_err(|e| e.to_string())?;
        // Next to the original, so relative imports resolve the same way.
        let copy = main_path.with_file_name(".gpu-node-agent-check.toml");
        write_atomic(&copy, rebased.as_bytes(), 0o600).map_err(|e| e.to_string())?;
        copy
    };
    let cmd = Cmd::new(binary)
        .arg("--config")
        .arg(&checked)
        .args(["config", "dump"])
        .timeout(Duration::from_secs(30));
    let result = runner.run(&cmd).map_err(|e| e.to_string());
    if !root.is_real() {
        let _ = std::fs::remove_file(&checked);
    }
    let dump = result?.stdout;
    containerd::dump_has_runtime(&dump, &e.runtime)
}

/// `systemctl restart <unit>`, then waits for `systemctl is-active` up to the restart timeout,
/// then asks the engine's CRI (containerd, CRI-O) whether it serves the runtime handlers
/// `wanted` and its default: an engine can be active without its CRI (containerd keeps running
/// when its CRI plugin fails to load). For containerd the CRI plugin's own load error is quoted
/// (`ctr plugins ls --detailed`).
fn restart(config: &Config, root: &HostRoot, runner: &Runner, e: &EnginePlan, wanted: &[&str]) -> Result<(), String> {
    let systemctl = &config.runtime.systemctl;
    let unit = e.unit.as_str();
    tracing::info!("restarting {unit}: its configuration changed");
    runner
        .run(
            &Cmd::new(systemctl)
                .args(["restart", unit])
                .timeout(config.runtime.restart_timeout),
        )
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + config.runtime.restart_timeout;
    loop {
        let out = runner
            .output(
                &Cmd::new(systemctl)
                    .args(["is-active", unit])
                    .timeout(Duration::from_secs(10)),
            )
            .map_err(|e| e.to_string())?;
        let state = out.stdout.trim().to_string();
        if out.success() && state == "active" {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{unit} is {} {}s after the restart",
                if state.is_empty() { "not active" } else { &state },
                config.runtime.restart_timeout.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let Some(socket) = &e.cri_socket else {
        return Ok(());
    };
    let socket = root.join(socket);
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    let status = cri::status_blocking(&socket, wait).map_err(|err| {
        let own = match (&err, e.engine) {
            (cri::CriError::NoCri { .. }, Engine::Containerd) => ctr_cri_error(runner, e, &socket),
            _ => None,
        };
        match own {
            Some(text) => format!("{unit} is active but its CRI plugin did not load: {text}"),
            None => format!("{unit} is active but {err}"),
        }
    })?;
    let mut wanted: Vec<&str> = wanted.to_vec();
    if let Some(default) = status.default_handler.as_deref().filter(|d| !d.is_empty()) {
        wanted.push(default);
    }
    match status.missing(&wanted) {
        None => {
            tracing::info!(
                "{unit} is back: {} serves the runtime handlers {}",
                status.runtime,
                status.handlers.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            Ok(())
        }
        Some(why) => Err(format!("{unit} is active but {why}")),
    }
}

/// The CRI plugin's load error as containerd reports it: `ctr --address <socket> plugins ls
/// --detailed`, with the `ctr` next to the containerd binary.
fn ctr_cri_error(runner: &Runner, e: &EnginePlan, socket: &Path) -> Option<String> {
    let ctr = e.binary.as_deref()?.with_file_name("ctr");
    let cmd = Cmd::new(&ctr)
        .arg("--address")
        .arg(socket)
        .args(["plugins", "ls", "--detailed"])
        .timeout(Duration::from_secs(10));
    match runner.run(&cmd) {
        Ok(out) => cri::ctr_cri_errors(&out.stdout),
        Err(err) => {
            tracing::warn!("cannot read containerd's plugin errors: {err}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_versions_are_read_from_its_version_line() {
        assert_eq!(
            parse_version("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1\n"),
            Some((1, 6))
        );
        assert_eq!(
            parse_version("containerd containerd.io v2.0.4 1a43cb6a1035441f9aca8f5666a9b3ef9e70ab20\n"),
            Some((2, 0))
        );
        assert_eq!(
            parse_version("containerd github.com/containerd/containerd/v2 v2.1.1 cb1076646\n"),
            Some((2, 1))
        );
        assert_eq!(parse_version("nonsense"), None);
    }

    /// A temp root with `files` (host path, text) and `links` (host path, target).
    fn host(files: &[(&str, &str)], links: &[(&str, &str)]) -> (tempfile::TempDir, HostRoot) {
        let tmp = tempfile::tempdir().unwrap();
        let root = HostRoot::new(tmp.path());
        for (path, text) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        for (path, target) in links {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, path).unwrap();
        }
        (tmp, root)
    }

    fn resolved(root: &HostRoot, path: &str) -> String {
        resolve(root, Path::new(path)).unwrap().to_string_lossy().into_owned()
    }

    #[test]
    fn links_are_followed_under_the_root() {
        let (_tmp, root) = host(
            &[("/srv/cfg/config.toml", "x"), ("/etc/x.toml", "y")],
            &[
                ("/etc/containerd/config.toml", "../../srv/cfg/config.toml"),
                ("/etc/docker/daemon.json", "/srv/cfg/daemon.json"),
                ("/etc/crio", "/srv/cfg"),
                ("/etc/up/x.toml", "../../../../../../etc/x.toml"),
                ("/etc/chain.toml", "containerd/config.toml"),
            ],
        );
        assert_eq!(resolved(&root, "/etc/containerd/config.toml"), "/srv/cfg/config.toml");
        assert_eq!(resolved(&root, "/etc/chain.toml"), "/srv/cfg/config.toml");
        assert_eq!(
            resolved(&root, "/etc/up/x.toml"),
            "/etc/x.toml",
            "`..` stops at the root"
        );
        // A directory link, and a file still to be created in it.
        assert_eq!(
            resolved(&root, "/etc/crio/crio.conf.d/99-nvidia.toml"),
            "/srv/cfg/crio.conf.d/99-nvidia.toml"
        );
        assert_eq!(resolved(&root, "/etc/none/config.toml"), "/etc/none/config.toml");
        // Absolute targets are host paths: under the root, never the machine's own /srv.
        let err = resolve(&root, Path::new("/etc/docker/daemon.json")).unwrap_err();
        assert!(
            matches!(&err, RuntimeError::Link { link, target, .. }
                if link == Path::new("/etc/docker/daemon.json") && target == Path::new("/srv/cfg/daemon.json")),
            "{err}"
        );
        assert!(err.to_string().contains("points to nothing"), "{err}");
    }

    #[test]
    fn a_link_loop_is_an_error_naming_the_file() {
        let (_tmp, root) = host(&[], &[("/etc/a.toml", "b.toml"), ("/etc/b.toml", "/etc/a.toml")]);
        let err = resolve(&root, Path::new("/etc/a.toml")).unwrap_err();
        let RuntimeError::Link { file, why, .. } = &err else {
            panic!("{err}");
        };
        assert_eq!(file, Path::new("/etc/a.toml"));
        assert!(why.contains("loop"), "{err}");
    }

    #[test]
    fn containerd_imports_follow_its_load_order() {
        let (_tmp, root) = host(
            &[
                (
                    "/etc/containerd/config.toml",
                    "version = 2\nimports = [\"site.toml\", \"/etc/containerd/conf.d/*.toml\"]\n",
                ),
                (
                    "/etc/containerd/site.toml",
                    "version = 2\nimports = [\"/etc/containerd/nested.toml\"]\n",
                ),
                ("/etc/containerd/nested.toml", "version = 2\n"),
                (
                    "/etc/containerd/conf.d/60-b.toml",
                    "version = 2\nimports = [\"../site.toml\"]\n",
                ),
                ("/etc/containerd/conf.d/50-a.toml", "version = 2\n"),
                ("/etc/containerd/conf.d/99-nvidia.toml", "version = 2\n"),
                ("/etc/containerd/conf.d/README", "not imported"),
                ("/srv/managed/70-c.toml", "version = 2\n"),
            ],
            &[("/etc/containerd/conf.d/70-c.toml", "/srv/managed/70-c.toml")],
        );
        let files = Config::default().runtime.files(Engine::Containerd);
        let main = std::fs::read_to_string(root.join("/etc/containerd/config.toml")).unwrap();
        let order: Vec<String> = containerd_imports(&root, &files, Some(&main))
            .into_iter()
            .map(|f| f.file)
            .collect();
        assert_eq!(
            order,
            [
                "/etc/containerd/site.toml",
                "/etc/containerd/conf.d/50-a.toml",
                "/etc/containerd/conf.d/60-b.toml",
                "/etc/containerd/conf.d/70-c.toml",
                "/etc/containerd/nested.toml",
            ]
        );
    }

    /// The dump the plan judges "nothing to add" by is what containerd loads now only when the
    /// agent's `imports` entry is there already or would load no file but its drop-in: a file in
    /// `conf.d/` the top-level config does not import yet makes it something else.
    #[test]
    fn the_effective_dump_is_current_only_when_the_agents_import_loads_nothing_else() {
        let files = Config::default().runtime.files(Engine::Containerd);
        let main = "version = 3\n";
        let imported_main = "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
        let current = |entries: &[(&str, &str)], main: Option<&str>| {
            let (_tmp, root) = host(entries, &[]);
            let imported = containerd_imports(&root, &files, main);
            containerd_imports_now(&root, &files, main, &imported)
        };
        let ours = ("/etc/containerd/conf.d/99-nvidia.toml", "version = 3\n");
        let other = ("/etc/containerd/conf.d/50-registry.toml", "version = 3\n");
        assert!(current(&[], None));
        assert!(current(&[], Some(main)));
        assert!(current(&[ours], Some(main)));
        assert!(!current(&[other], Some(main)));
        assert!(!current(&[other], None));
        assert!(current(&[other, ours], Some(imported_main)));
    }

    #[test]
    fn backup_names_are_one_file_per_path() {
        assert_eq!(
            backup_name(Path::new("/etc/docker/daemon.json")),
            "%2Fetc%2Fdocker%2Fdaemon.json"
        );
        assert_ne!(backup_name(Path::new("/a/b%2Fc")), backup_name(Path::new("/a/b/c")));
    }
}
