//! One writer per node: the daemon and every command that changes the node (`mig apply`,
//! `runtime configure`/`unconfigure`, `driver install`, `cdi generate` into the CDI dir) take an
//! exclusive `flock(2)` on `<state_dir>/lock` for as long as they run. A second writer is refused
//! with the holder's pid and command instead of fighting it (two MIG applies interleaving NVML
//! operations, a `runtime configure` racing the daemon's rollback).
//!
//! The lock is the kernel's: it goes with the process, however it ends (no stale lock after a
//! crash or SIGKILL), and children never inherit it (the file is opened close-on-exec). The file
//! records who holds it, for the message only.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// The lock file's name in the state dir.
pub const LOCK_FILE: &str = "lock";

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{} holds {} (this node's state): stop it first (systemctl stop gpu-node-agent) or let it make the change",
        holder.as_deref().unwrap_or("another gpu-node-agent"),
        path.display()
    )]
    Held {
        path: PathBuf,
        /// "gpu-node-agent run (pid 1234)", as the holder recorded it.
        holder: Option<String>,
    },
    #[error("cannot lock {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{} is {why}: the driver module cache, the engine backups and the lock in it must be the agent's alone (chown root: {}; chmod go-w {})",
        path.display(), path.display(), path.display()
    )]
    NotPrivate { path: PathBuf, why: String },
}

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct StateLock {
    _file: Flock<File>,
}

impl StateLock {
    /// Takes the lock in `state_dir` (created if missing) for `command` (e.g. "mig apply"),
    /// without waiting.
    pub fn acquire(state_dir: &Path, command: &str) -> Result<StateLock, LockError> {
        let path = state_dir.join(LOCK_FILE);
        let io_err = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        // Created private (whatever the umask), and refused if someone else could write it.
        if let Some(parent) = state_dir.parent() {
            std::fs::create_dir_all(parent).map_err(io_err)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(state_dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(io_err(e)),
            _ => {}
        }
        private_dir(state_dir)?;
        // No symlink followed (O_NOFOLLOW), no descriptor left to the programs the agent runs.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err)?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = text.lines().next().map(str::trim).filter(|l| !l.is_empty());
                return Err(LockError::Held {
                    path,
                    holder: holder.map(str::to_owned),
                });
            }
            Err((_, errno)) => return Err(io_err(io::Error::from(errno))),
        };
        let record = format!("gpu-node-agent {command} (pid {})\n", std::process::id());
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(record.as_bytes()))
            .map_err(io_err)?;
        Ok(StateLock { _file: file })
    }
}

/// Refuses a state dir someone else could write to: its driver module cache is loaded into the
/// kernel, and its backups are put back into the engines' configuration.
fn private_dir(dir: &Path) -> Result<(), LockError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|source| LockError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let me = nix::unistd::geteuid().as_raw();
    let why = if meta.uid() != me {
        Some(format!("owned by uid {}, not the agent's ({me})", meta.uid()))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!("writable by others (mode {:o})", meta.mode() & 0o7777))
    } else {
        None
    };
    match why {
        Some(why) => Err(LockError::NotPrivate {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_with_the_holder_and_the_lock_goes_with_the_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("var/lib/gpu-node-agent");
        let held = StateLock::acquire(&state, "run").expect("first");
        let err = StateLock::acquire(&state, "mig apply").expect_err("second");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("gpu-node-agent run (pid {}) holds ", std::process::id())),
            "{text}"
        );
        assert!(text.contains("var/lib/gpu-node-agent/lock"), "{text}");
        drop(held);
        let again = StateLock::acquire(&state, "mig apply").expect("free again");
        drop(again);
    }

    #[test]
    fn a_state_dir_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        std::fs::create_dir(&state).expect("mkdir");
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let err = StateLock::acquire(&state, "run").expect_err("refused");
        assert!(err.to_string().contains("writable by others (mode 777)"), "{err}");
        assert!(!state.join(LOCK_FILE).exists(), "nothing written");
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        StateLock::acquire(&state, "run").expect("private");
    }

    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep\n").expect("victim");
        std::os::unix::fs::symlink(&victim, dir.path().join(LOCK_FILE)).expect("plant");
        let err = StateLock::acquire(dir.path(), "run").expect_err("refused");
        assert!(matches!(err, LockError::Io { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "keep\n");
    }
}
