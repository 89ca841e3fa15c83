//! Plan: what changes in each engine's files, configure or unconfigure, from what was observed
//! (pure). Each engine says through the seam how its files change ([`ContainerEngine`](crate::runtime::engine::ContainerEngine)); the
//! plan turns that into file changes, and adds the toolkit's config and the CDI version rule.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::observe::Observed;
use super::{RuntimeError, registry};
use crate::config::{Engine, RuntimeConfig, RuntimeMode, SetAsDefault};
use crate::runtime::engine::{Edit, EngineFile, ObservedEngine, PlanContext, Writes, digest};
use crate::runtime::{DefaultRuntime, NvidiaRuntime, toolkit};

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
    /// The NVIDIA Container Toolkit's config, when it changes (see [`crate::runtime::toolkit`]);
    /// no engine restarts for it: the toolkit reads it for every container.
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
        let engine = registry::of(e.engine);
        let kubelet = kubelet_engine == Some(e.engine);
        let mut rt = nvidia_runtime(config, kubelet, &observed.also);
        if cdi_only {
            rt = rt.cdi_only();
        }
        let mut warnings = Vec::new();
        let mut error = None;
        if let Some((major, minor)) = e.version {
            let first = engine.first_cdi();
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
            let cx = PlanContext {
                cdi_dir: &observed.cdi_dir,
                drop_in_backed_up: observed.backups.contains_key(&e.files.drop_in),
            };
            match engine.configure(e, &cx, &plan.runtime) {
                Ok(Edit::Files(writes)) => plan.changes = file_changes(e, writes),
                Ok(Edit::Skip(why)) => plan.skipped = Some(why),
                Ok(Edit::Needless { files, restart, remark }) => {
                    plan.changes = file_changes(e, files);
                    plan.restart = restart;
                    plan.warnings.push(remark);
                }
                Err(err) => plan.error = Some(RuntimeError::Edit(err).to_string()),
            }
        }
        out.engines.push(plan);
    }
    Ok(out)
}

/// An engine's [`Writes`] as changes of its configured files, those whose bytes change.
fn file_changes(e: &ObservedEngine, writes: Writes) -> Vec<FileChange> {
    writes
        .into_iter()
        .filter_map(|(file, after)| match file {
            EngineFile::Main => change(&e.files.config, &e.main_target, &e.main, after),
            EngineFile::DropIn => change(&e.files.drop_in, &e.drop_in_target, &e.drop_in, after),
        })
        .collect()
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
        let engine = registry::of(e.engine);
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
            (None, Some(original)) => match &e.main {
                Some(text) => Some(engine.unconfigure(e, text, &names, original)?),
                None => None,
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
