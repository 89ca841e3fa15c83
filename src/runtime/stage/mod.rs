//! The runtime stage: observe the engines' files, plan the edits (pure), apply them with
//! backups, have each engine check its result, restart what changed and roll back what does not
//! come back.
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
//!
//! The stage asks the engines only through the seam ([`crate::runtime::engine`]), in the order
//! of its registry (`registry.rs`), and holds no `match` on the engine kind: the files here are
//! `observe.rs`, `plan.rs`, `journal.rs` (intent record, backups, recover) and `apply.rs` (with
//! the restart); this file holds the stage's error and the facade the callers import.

mod apply;
mod journal;
mod observe;
mod plan;
mod registry;

use std::io;
use std::path::{Path, PathBuf};

pub use apply::{Applied, ApplyOptions, EngineFailure, apply, apply_all};
pub use journal::recover;
pub use observe::{Backup, Observed, observe};
pub use plan::{EnginePlan, FileChange, Purpose, RuntimePlan, diff, nvidia_runtime, plan, plan_unconfigure};

use super::engine::{self, FileError};
use super::{EditError, cdi};
use crate::host::{HostRoot, WriteError};

/// Why the runtime stage failed. Nothing is left half-written: files are restored first.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A host file could not be read, or a link on its way cannot be followed.
    #[error(transparent)]
    File(#[from] FileError),
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

/// The text of the file at `path`; `None` when there is none.
pub(super) fn read_optional(path: &Path) -> Result<Option<String>, RuntimeError> {
    Ok(engine::read_optional(path)?)
}

/// Where the host path `path` really is: every symbolic link on the way followed as the kernel
/// would with the root as `/` (a relative target against the link's directory, an absolute one
/// under the root, `..` never above the root). Returns a host path; components that do not
/// exist are kept as they are (a file still to be created). A link whose target does not exist,
/// or a loop, is [`FileError::Link`] naming `path` and that link.
pub fn resolve(root: &HostRoot, path: &Path) -> Result<PathBuf, RuntimeError> {
    Ok(engine::resolve(root, path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::engine::tests::host;

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
            matches!(&err, RuntimeError::File(FileError::Link { link, target, .. })
                if link == Path::new("/etc/docker/daemon.json") && target == Path::new("/srv/cfg/daemon.json")),
            "{err}"
        );
        assert!(err.to_string().contains("points to nothing"), "{err}");
    }

    #[test]
    fn a_link_loop_is_an_error_naming_the_file() {
        let (_tmp, root) = host(&[], &[("/etc/a.toml", "b.toml"), ("/etc/b.toml", "/etc/a.toml")]);
        let err = resolve(&root, Path::new("/etc/a.toml")).unwrap_err();
        let RuntimeError::File(FileError::Link { file, why, .. }) = &err else {
            panic!("{err}");
        };
        assert_eq!(file, Path::new("/etc/a.toml"));
        assert!(why.contains("loop"), "{err}");
    }

    /// The stage asks the engines through the seam only: no file of it names an engine kind
    /// (the enum's path to a variant: anything but its `ALL`), so it can hold no `match` on one, no
    /// `if engine == …` either. Every file in `src/runtime/stage/` is read, new ones included.
    #[test]
    fn the_stage_names_no_engine_kind() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/runtime/stage");
        let needle = concat!("Engine", "::");
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in text.lines().enumerate() {
                for (i, _) in line.match_indices(needle) {
                    let named = line[..i]
                        .chars()
                        .next_back()
                        .is_none_or(|c| !c.is_alphanumeric() && c != '_');
                    if named && !line[i + needle.len()..].starts_with("ALL") {
                        found.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                    }
                }
            }
        }
        assert!(
            found.is_empty(),
            "engine kinds named in the stage:\n{}",
            found.join("\n")
        );
    }
}
