//! The seam between the runtime stage and the container engines, in the spirit of the NVIDIA
//! Container Toolkit's `pkg/config/engine`: one [`ContainerEngine`] per engine, each in its
//! engine's module (`containerd::engine`, `docker::engine`, `crio::engine`), says what the engine
//! has (its files' facts), how its files change (configure and unconfigure), how to check the
//! result and how to tell a restarted engine has its CRI back.
//!
//! The stage (`runtime::stage`) does everything engines share: it reads the configured files and
//! the backups, turns an [`Edit`] into file changes, keeps the intent journal, writes, restarts
//! and rolls back; it asks the engines only through this trait, so it holds no `match` on the
//! engine kind. This module is below both: it imports no engine and no part of the stage.
//!
//! It also holds what both sides read the host with: [`resolve`] (symbolic links followed under
//! the root) and [`read_optional`], whose [`FileError`] the stage turns into its own error.

use std::fmt::Write as _;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{EditError, NvidiaRuntime};
use crate::config::{AnyEngineFiles, Engine};
use crate::host::HostRoot;
use crate::host::command::{Cmd, Runner};

/// Symbolic links followed, at most, to find one file (Linux's `MAXSYMLINKS`).
const MAX_LINKS: u32 = 40;

/// One container engine, as the runtime stage sees it. The methods with a default are what most
/// engines do not need: no facts beyond the files, CDI in every version, a main file left alone
/// by unconfigure, no check of their own, nothing to add when their CRI does not answer.
pub trait ContainerEngine: Sync {
    /// Which engine this is: its name, its `[runtime.<engine>]` files, its place in the order.
    fn kind(&self) -> Engine;

    /// What the engine has besides its two files, asked of every engine (selected or not) after
    /// the stage read them: the other files it loads, its version, what it says it runs with, its
    /// CRI socket.
    fn observe(&self, _host: &Host, _seen: &Seen) -> EngineFacts {
        EngineFacts::default()
    }

    /// The first version (major, minor) with CDI: an older one gets no `enable_cdi` (or, under
    /// `cdi-only`, an error).
    fn first_cdi(&self) -> (u32, u32) {
        (0, 0)
    }

    /// The edit that puts the runtimes `rt` into the engine observed as `e`. Pure.
    fn configure(&self, e: &ObservedEngine, cx: &PlanContext, rt: &NvidiaRuntime) -> Result<Edit, EditError>;

    /// The main file's text `main`, which the agent changed since its backup `original` (`None`:
    /// there was no file) was taken, without the agent's entries (the runtimes `names`). Pure.
    fn unconfigure(
        &self,
        _e: &ObservedEngine,
        main: &str,
        _names: &[&str],
        _original: Option<&str>,
    ) -> Result<String, EditError> {
        Ok(main.to_owned())
    }

    /// The engine's own check of its configured files (already written), before any restart:
    /// `Err` (why) rolls them back. `binary` is where the engine was found.
    fn check(
        &self,
        _host: &Host,
        _files: &AnyEngineFiles,
        _binary: Option<&Path>,
        _rt: &NvidiaRuntime,
    ) -> Result<(), String> {
        Ok(())
    }

    /// After a restart, when the engine is active but its CRI at `socket` serves no CRI: the
    /// engine's own words for why, if it has any.
    fn cri_load_error(&self, _runner: &Runner, _binary: Option<&Path>, _socket: &Path) -> Option<String> {
        None
    }
}

/// What an engine reads the node through.
pub struct Host<'a> {
    pub root: &'a HostRoot,
    pub runner: &'a Runner,
    /// The runtime stage's own folder (`<state_dir>/runtime`, under the root): the facts cache,
    /// scratch copies.
    pub state: &'a Path,
}

/// What the stage read of an engine before asking it for its facts.
pub struct Seen<'a> {
    pub files: &'a AnyEngineFiles,
    /// Where its binary was found.
    pub binary: Option<&'a Path>,
    /// The main config's text.
    pub main: Option<&'a str>,
    /// The agent configures it (listed, or found).
    pub selected: bool,
    /// `[runtime] mode = "cdi-only"`.
    pub cdi_only: bool,
}

/// An engine's facts beyond its two files (see [`ObservedEngine`] for each).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineFacts {
    pub imported: Vec<ImportedFile>,
    pub version: Option<(u32, u32)>,
    pub effective: Option<String>,
    pub effective_is_current: bool,
    pub cri_socket: Option<PathBuf>,
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
    /// in its load order, without the agent's drop-in. CRI-O: the other files of its drop-in
    /// directory, in name order.
    pub imported: Vec<ImportedFile>,
    /// containerd: `containerd config dump` of the configured top-level file without the
    /// agent's drop-in; `None` without the binary, or when the dump failed (logged; the files are
    /// read instead).
    pub effective: Option<String>,
    /// containerd: `effective` is also what containerd loads now without the agent's drop-in,
    /// because the top-level config already has the agent's `imports` entry or that entry would
    /// load no other file. Only then can the plan tell from `effective` that the agent's files
    /// would change nothing.
    pub effective_is_current: bool,
    /// The engine's CRI socket (host path): containerd's `[grpc] address`, CRI-O's default;
    /// `None` for docker, which serves no CRI itself.
    pub cri_socket: Option<PathBuf>,
}

/// A file an engine loads besides its main config and the agent's drop-in (containerd through
/// `imports`, CRI-O from its drop-in directory), with its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedFile {
    /// Its path (absolute host path), for error messages and the drop-in's header.
    pub file: String,
    pub text: String,
}

/// What the plan knows besides the engine's own observation.
#[derive(Debug, Clone, Copy)]
pub struct PlanContext<'a> {
    /// The directory the agent writes its CDI spec to (`[cdi] dir`, host path), which an engine
    /// with CDI on must read.
    pub cdi_dir: &'a Path,
    /// The agent has a backup of the drop-in: it wrote the file there now.
    pub drop_in_backed_up: bool,
}

/// One of an engine's two files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFile {
    /// `[runtime.<engine>] config`.
    Main,
    /// `[runtime.<engine>] drop_in`, the agent's own.
    DropIn,
}

/// What an engine's files become: `None` removes the file. A file left out, or given its
/// current text, does not change.
pub type Writes = Vec<(EngineFile, Option<String>)>;

/// What configuring one engine needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    Files(Writes),
    /// Left alone, with why.
    Skip(String),
    /// The engine's own configuration already has everything the agent's files would add
    /// (containerd): none is written, an earlier drop-in of the agent's goes (`files`), and
    /// `restart` says whether that drop-in changed anything the engine runs with.
    Needless {
        files: Writes,
        restart: bool,
        remark: String,
    },
}

/// A host file could not be read or found (see [`resolve`]).
#[derive(Debug, thiserror::Error)]
pub enum FileError {
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
}

/// The text of the file at `path` (on this machine); `None` when there is none.
pub fn read_optional(path: &Path) -> Result<Option<String>, FileError> {
    match crate::host::read_text(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(FileError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The text of the host file `path`, its symbolic links followed under the root.
pub fn read_resolved(root: &HostRoot, path: &Path) -> Result<Option<String>, FileError> {
    resolve(root, path).and_then(|target| read_optional(&root.join(target)))
}

/// sha256 of `text`, in hex.
pub fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes()).iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `<engine> --version` → (major, minor) (`containerd github.com/containerd/containerd
/// v1.7.20 ...` → (1, 7), `Docker version 26.1.5+dfsg1, build a72d7cd` → (26, 1)). `None` when
/// it cannot be told (logged).
pub fn engine_version(runner: &Runner, binary: &Path) -> Option<(u32, u32)> {
    let cmd = Cmd::new(binary).arg("--version").timeout(Duration::from_secs(10));
    match runner.run(&cmd) {
        Ok(out) => parse_version(&out.stdout),
        Err(e) => {
            tracing::warn!("cannot tell the version of {}: {e}", binary.display());
            None
        }
    }
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
/// or a loop, is [`FileError::Link`] naming `path` and that link.
pub fn resolve(root: &HostRoot, path: &Path) -> Result<PathBuf, FileError> {
    let mut links = 0;
    follow(root, PathBuf::from("/"), path, path, &mut links)
}

/// Resolves `rel` from the link-free host directory `at`, counting the links followed.
fn follow(root: &HostRoot, mut at: PathBuf, rel: &Path, file: &Path, links: &mut u32) -> Result<PathBuf, FileError> {
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
            Err(source) => return Err(FileError::Read { path: on_disk, source }),
        }
        let target = std::fs::read_link(&on_disk).map_err(|source| FileError::Read {
            path: on_disk.clone(),
            source,
        })?;
        let cannot = |why| FileError::Link {
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

#[cfg(test)]
pub(crate) mod tests {
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
    pub(crate) fn host(files: &[(&str, &str)], links: &[(&str, &str)]) -> (tempfile::TempDir, HostRoot) {
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

    /// An engine observed with `main` and `drop_in` at its configured files, and nothing else.
    pub(crate) fn observed(
        kind: Engine,
        files: AnyEngineFiles,
        main: Option<&str>,
        drop_in: Option<&str>,
    ) -> ObservedEngine {
        ObservedEngine {
            engine: kind,
            main_target: files.config.clone(),
            drop_in_target: files.drop_in.clone(),
            files,
            installed: true,
            selected: true,
            main: main.map(str::to_owned),
            drop_in: drop_in.map(str::to_owned),
            binary: None,
            version: None,
            imported: Vec::new(),
            effective: None,
            effective_is_current: false,
            cri_socket: None,
        }
    }
}
