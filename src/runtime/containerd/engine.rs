//! containerd behind the engine seam ([`ContainerEngine`]): what it loads (`imports`, in its
//! order), its version and what it says it runs with (`containerd config dump`), its CRI socket
//! (`[grpc] address`); the edit, with the "needless" rule (its own configuration already has
//! what the agent would add: no files); its own check of the result (`config dump`); and the CRI
//! plugin's load error after a restart (`ctr plugins ls`).

use std::collections::{BTreeSet, VecDeque};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use super::{DEFAULT_ADDRESS, Input};
use crate::config::{AnyEngineFiles, Engine};
use crate::host::command::{Cmd, Runner};
use crate::host::{HostRoot, write_atomic};
use crate::runtime::engine::{
    ContainerEngine, Edit, EngineFacts, EngineFile, Host, ImportedFile, ObservedEngine, PlanContext, Seen, digest,
    engine_version, read_resolved, resolve,
};
use crate::runtime::{EditError, NvidiaRuntime, cri, facts_cache};

/// containerd (config versions 2 and 3).
#[derive(Debug, Clone, Copy)]
pub struct ContainerdEngine;

impl ContainerEngine for ContainerdEngine {
    fn kind(&self) -> Engine {
        Engine::Containerd
    }

    /// For a selected containerd: the files its `imports` load, its version and effective
    /// configuration (asked only when the binary is there), and whether that dump is what it
    /// loads now. Its CRI socket in any case: the dump's `[grpc] address`, else containerd's.
    fn observe(&self, host: &Host, seen: &Seen) -> EngineFacts {
        let mut facts = EngineFacts::default();
        if seen.selected {
            facts.imported = containerd_imports(host.root, seen.files, seen.main);
            if let Some(binary) = seen.binary {
                (facts.version, facts.effective) =
                    containerd_facts(host, seen.files, binary, seen.main, &facts.imported);
            }
            facts.effective_is_current = containerd_imports_now(host.root, seen.files, seen.main, &facts.imported);
        }
        facts.cri_socket = Some(PathBuf::from(
            facts
                .effective
                .as_deref()
                .map(super::dump_address)
                .unwrap_or_else(|| DEFAULT_ADDRESS.to_owned()),
        ));
        facts
    }

    fn first_cdi(&self) -> (u32, u32) {
        (1, 7)
    }

    /// The top-level config's `imports` entry and the drop-in; nothing for a containerd whose
    /// CRI plugin is disabled (Docker's `containerd.io` package: no kubelet can be using it), and
    /// no files where its own configuration already has them (see `needless`).
    fn configure(&self, e: &ObservedEngine, cx: &PlanContext, rt: &NvidiaRuntime) -> Result<Edit, EditError> {
        let main_file = e.files.config.to_string_lossy().into_owned();
        let disabled = match &e.effective {
            Some(dump) => super::cri_disabled(dump),
            None => e.main.as_deref().is_some_and(super::cri_disabled),
        };
        if disabled {
            return Ok(Edit::Skip(format!(
                "its CRI plugin is disabled (disabled_plugins in {main_file}), so no kubelet uses this containerd"
            )));
        }
        let drop_in_path = e.files.drop_in.to_string_lossy().into_owned();
        let input = Input {
            main: e.main.as_deref(),
            main_file: &main_file,
            drop_in_path: &drop_in_path,
            binary_major: e.version.map(|v| v.0),
            imported: &e.imported,
            effective: e.effective.as_deref(),
            cdi_dir: cx.cdi_dir.to_str(),
        };
        let files = super::configure_input(&input, rt)?;
        if let Some(needless) = needless(e, cx, &files.drop_in) {
            return Ok(needless);
        }
        Ok(Edit::Files(vec![
            (EngineFile::Main, Some(files.main)),
            (EngineFile::DropIn, Some(files.drop_in)),
        ]))
    }

    /// The `imports` entry goes (the drop-in's own backup takes care of the drop-in).
    fn unconfigure(
        &self,
        e: &ObservedEngine,
        main: &str,
        _names: &[&str],
        original: Option<&str>,
    ) -> Result<String, EditError> {
        super::unconfigure(
            main,
            &e.files.config.to_string_lossy(),
            &e.files.drop_in.to_string_lossy(),
            original,
        )
    }

    /// `containerd --config <main> config dump` must succeed and show the runtimes, with the
    /// default runtime defined. Under a root prefix the main file's absolute imports are pointed
    /// into the root first (a copy next to it is checked). Skipped (Ok) when containerd is not
    /// installed.
    fn check(
        &self,
        host: &Host,
        files: &AnyEngineFiles,
        binary: Option<&Path>,
        rt: &NvidiaRuntime,
    ) -> Result<(), String> {
        let Some(binary) = binary else {
            return Ok(());
        };
        let root = host.root;
        let main_path = root.join(&files.config);
        let checked = if root.is_real() {
            main_path
        } else {
            // Through its links under the root, as everything else here.
            let real = resolve(root, &files.config).map_err(|e| e.to_string())?;
            let text = crate::host::read_text(&root.join(real)).map_err(|e| format!("{}: {e}", main_path.display()))?;
            let rebased = super::rebase_imports(&text, &main_path.to_string_lossy(), |p| {
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
        let result = host.runner.run(&cmd).map_err(|e| e.to_string());
        if !root.is_real() {
            let _ = std::fs::remove_file(&checked);
        }
        let dump = result?.stdout;
        super::dump_has_runtime(&dump, rt)
    }

    /// The CRI plugin's load error as containerd reports it: `ctr --address <socket> plugins ls
    /// --detailed`, with the `ctr` next to the containerd binary.
    fn cri_load_error(&self, runner: &Runner, binary: Option<&Path>, socket: &Path) -> Option<String> {
        let ctr = binary?.with_file_name("ctr");
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
}

/// containerd's own configuration already has what the agent's drop-in `drop_in` would add:
/// `containerd config dump` without the agent's files is the same with it (see
/// [`super::drop_in_changes_nothing`]), and CDI, when on, reads the agent's spec directory
/// (the drop-in would add it otherwise). Then the top-level config keeps its bytes (no `imports`
/// entry is added) and no drop-in is written; an earlier drop-in of the agent's (its backup says
/// so) goes, with a restart only when it changed something containerd runs with.
///
/// `None` (files as usual) when containerd could not be asked, when the dump is not what it
/// loads now (the agent's `imports` entry would load other files too), or when a file the agent
/// did not write is at the drop-in's path.
fn needless(e: &ObservedEngine, cx: &PlanContext, drop_in: &str) -> Option<Edit> {
    let dump = e.effective.as_deref()?;
    let ours = e.drop_in.is_none() || cx.drop_in_backed_up;
    if !e.effective_is_current || !ours || !super::drop_in_changes_nothing(dump, drop_in) {
        return None;
    }
    let mut remark = "its own configuration already has all the agent would add (containerd config dump)".to_owned();
    let restart = match &e.drop_in {
        None => {
            remark.push_str(": no drop-in and no restart");
            false
        }
        Some(old) if super::drop_in_changes_nothing(dump, old) => {
            remark.push_str(": the agent's earlier drop-in, which changed nothing, goes, without a restart");
            false
        }
        Some(_) => {
            remark.push_str(": the agent's earlier drop-in goes, and a restart drops what it set");
            true
        }
    };
    Some(Edit::Needless {
        files: vec![(EngineFile::DropIn, None)],
        restart,
        remark,
    })
}

/// containerd's version and effective configuration (see [`containerd_effective`]), asked
/// again only when the binary or one of the files it reads changed: every pass observes, and
/// the two commands cost about 100 ms together.
fn containerd_facts(
    host: &Host,
    files: &AnyEngineFiles,
    binary: &Path,
    main: Option<&str>,
    imported: &[ImportedFile],
) -> (Option<(u32, u32)>, Option<String>) {
    type Facts = (String, Option<(u32, u32)>, Option<String>);
    static LAST: std::sync::Mutex<Option<Facts>> = std::sync::Mutex::new(None);
    let root = host.root;
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
    let stored_key = facts_cache::key(&key);
    if let Some((version, dump)) = facts_cache::load(host.state, &stored_key) {
        *last = Some((key, version, Some(dump.clone())));
        return (version, Some(dump));
    }
    let version = engine_version(host.runner, binary);
    let dump = match containerd_effective(host, files, binary, main, version) {
        Ok(dump) => {
            facts_cache::store(host.state, &stored_key, version, &dump);
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

/// What containerd itself makes of its files once the agent's import is there but without the
/// agent's drop-in: `containerd --config <copy> config dump`, the copy being the top-level
/// config as [`super::configured_main`] leaves it, with every `imports` entry made an absolute
/// path under the root and the drop-in left out of its glob. The copy is a private temp file in
/// the stage's folder, removed afterwards.
fn containerd_effective(
    host: &Host,
    files: &AnyEngineFiles,
    binary: &Path,
    main: Option<&str>,
    version: Option<(u32, u32)>,
) -> Result<String, String> {
    let root = host.root;
    let main_file = files.config.to_string_lossy();
    let drop_in = files.drop_in.to_string_lossy();
    let (_, configured) =
        super::configured_main(main, &main_file, &drop_in, version.map(|v| v.0)).map_err(|e| e.to_string())?;
    let entries = super::imports(&configured, &main_file).map_err(|e| e.to_string())?;
    let mut paths = Vec::new();
    for path in import_paths(root, &files.config, &entries) {
        if path != files.drop_in {
            paths.push(root.join(&path).to_string_lossy().into_owned());
        }
    }
    let copy_text = super::with_imports(&configured, &main_file, &paths).map_err(|e| e.to_string())?;
    let copy = host
        .state
        .join(format!(".containerd-effective-{}.toml", std::process::id()));
    write_atomic(&copy, copy_text.as_bytes(), 0o600).map_err(|e| e.to_string())?;
    let cmd = Cmd::new(binary)
        .arg("--config")
        .arg(&copy)
        .args(["config", "dump"])
        .timeout(Duration::from_secs(30));
    let result = host.runner.run(&cmd);
    let _ = std::fs::remove_file(&copy);
    Ok(result.map_err(|e| e.to_string())?.stdout)
}

/// The files containerd loads through the `imports` of the top-level config (`main`, with the
/// agent's entry added as [`super::configure`] adds it) in its order: breadth first, each
/// entry relative to the file that names it, one with `*` globbed (matches sorted), every file
/// once; without the top-level config itself and the agent's drop-in. Files that cannot be read
/// are left out (containerd's own check of the result reports them); one that does not parse is
/// kept, for the edit to report, but its own imports are not followed.
fn containerd_imports(root: &HostRoot, files: &AnyEngineFiles, main: Option<&str>) -> Vec<ImportedFile> {
    let main_file = files.config.to_string_lossy();
    let Ok(entries) = super::imports_after_configure(main, &main_file, &files.drop_in.to_string_lossy()) else {
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
    imported: &[ImportedFile],
) -> bool {
    let main_file = files.config.to_string_lossy();
    let entries = match main {
        Some(text) => match super::imports(text, &main_file) {
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
fn imported_files(root: &HostRoot, files: &AnyEngineFiles, entries: &[String]) -> Vec<ImportedFile> {
    let mut queue: VecDeque<PathBuf> = import_paths(root, &files.config, entries).into();
    let mut seen = BTreeSet::from([files.config.clone(), files.drop_in.clone()]);
    let mut out = Vec::new();
    while let Some(path) = queue.pop_front() {
        if !seen.insert(path.clone()) {
            continue;
        }
        let text = match read_resolved(root, &path) {
            Ok(Some(text)) => text,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!("containerd import {}: {e}", path.display());
                continue;
            }
        };
        let file = path.to_string_lossy().into_owned();
        if let Ok(more) = super::imports(&text, &file) {
            queue.extend(import_paths(root, &path, &more));
        }
        out.push(ImportedFile { file, text });
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
                .filter(|n| super::glob_component_matches(&name, n))
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        matches = next;
    }
    matches.retain(|m| resolve(root, m).is_ok_and(|real| std::fs::symlink_metadata(root.join(real)).is_ok()));
    matches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::runtime::engine::tests::{host, observed};
    use crate::runtime::{DefaultRuntime, NvidiaRuntime};

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

    fn nvidia() -> NvidiaRuntime {
        NvidiaRuntime {
            name: "nvidia".into(),
            binary: "/usr/bin/nvidia-container-runtime".into(),
            default: DefaultRuntime::Keep,
            enable_cdi: true,
            also: Vec::new(),
            runtimes: true,
        }
    }

    /// Through the seam, without the stage: a plain containerd 2 gets the `imports` entry and a
    /// drop-in; one whose own configuration already has all of it (its dump, current) gets no
    /// files and no restart; one with its CRI plugin disabled is left alone.
    #[test]
    fn the_containerd_engine_plans_files_needless_or_nothing() {
        let engine: &dyn ContainerEngine = &ContainerdEngine;
        let files = Config::default().runtime.files(engine.kind());
        let cx = PlanContext {
            cdi_dir: Path::new("/var/run/cdi"),
            drop_in_backed_up: false,
        };
        let e = observed(engine.kind(), files.clone(), Some("version = 3\n"), None);
        let Edit::Files(writes) = engine.configure(&e, &cx, &nvidia()).unwrap() else {
            panic!("files expected");
        };
        let which: Vec<EngineFile> = writes.iter().map(|(f, _)| *f).collect();
        assert_eq!(which, [EngineFile::Main, EngineFile::DropIn]);
        let main = writes[0].1.as_deref().unwrap();
        assert!(main.contains("/etc/containerd/conf.d/*.toml"), "{main}");
        let drop_in = writes[1].1.clone().unwrap();
        assert!(
            drop_in.contains("BinaryName = \"/usr/bin/nvidia-container-runtime\""),
            "{drop_in}"
        );

        // Its dump with the drop-in's settings already in it: nothing to write, no restart.
        let mut current = observed(engine.kind(), files.clone(), Some("version = 3\n"), None);
        current.effective = Some(drop_in.clone());
        current.effective_is_current = true;
        match engine.configure(&current, &cx, &nvidia()).unwrap() {
            Edit::Needless { files, restart, .. } => {
                assert_eq!(files, [(EngineFile::DropIn, None)]);
                assert!(!restart);
            }
            other => panic!("needless expected: {other:?}"),
        }

        let disabled = observed(
            engine.kind(),
            files,
            Some("version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"),
            None,
        );
        assert!(matches!(
            engine.configure(&disabled, &cx, &nvidia()).unwrap(),
            Edit::Skip(_)
        ));
        assert_eq!(engine.first_cdi(), (1, 7));
    }
}
