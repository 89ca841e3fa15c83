//! The intent journal and the backups, in `<state_dir>/runtime/`: `<name>.orig` (the bytes
//! before the agent's first change) or `<name>.absent` (there was no file; it lists the
//! directories the write created), `<name>.written` (the digest of what the agent last wrote),
//! and `intent.json` (the changes being applied, while they are). [`recover`] puts back what an
//! interrupted apply left; `begin` and `finish` are an apply's first and last steps.

use std::io;
use std::path::{Path, PathBuf};

use super::observe::Backup;
use super::plan::{FileChange, Purpose};
use super::{RuntimeError, read_optional};
use crate::config::Config;
use crate::host::{HostRoot, WriteError, write_atomic};
use crate::runtime::engine::digest;

/// The backup directory under the root.
pub(super) fn backup_dir(config: &Config, root: &HostRoot) -> PathBuf {
    root.join(config.agent.state_dir.join("runtime"))
}

/// A host path as one file name: `/etc/docker/daemon.json` → `%2Fetc%2Fdocker%2Fdaemon.json`.
fn backup_name(path: &Path) -> String {
    path.to_string_lossy().replace('%', "%25").replace('/', "%2F")
}

/// What the backup dir `dir` knows about the host file `path`; `None` when the agent never
/// changed it.
pub(super) fn read_backup(dir: &Path, path: &Path) -> Result<Option<Backup>, RuntimeError> {
    let name = backup_name(path);
    let original = read_optional(&dir.join(format!("{name}.orig")))?;
    if original.is_none() && !dir.join(format!("{name}.absent")).exists() {
        return Ok(None);
    }
    let written = read_optional(&dir.join(format!("{name}.written")))?.map(|s| s.trim().to_string());
    Ok(Some(Backup { original, written }))
}

/// The name of the intent record: the changes of the engine being applied, written before its
/// files and removed once they are checked, restarted and recorded (see [`recover`]).
const INTENT: &str = "intent.json";

/// A test hook: a process whose `GNA_TEST_KILL_AT` names `point` kills itself there with
/// SIGKILL, so tests can stop the apply at each step as `kill -9` would.
pub(super) fn kill_point(point: &str) {
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

/// The first steps of applying `changes`: backups (configure), the intent record, the files.
pub(super) fn begin(changes: &[FileChange], purpose: Purpose, root: &HostRoot, dir: &Path) -> Result<(), RuntimeError> {
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
pub(super) fn finish(
    changes: &[FileChange],
    purpose: Purpose,
    root: &HostRoot,
    dir: &Path,
) -> Result<(), RuntimeError> {
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
pub(super) fn apply_files(
    changes: &[FileChange],
    purpose: Purpose,
    config: &Config,
    root: &HostRoot,
) -> Result<(), RuntimeError> {
    let dir = backup_dir(config, root);
    begin(changes, purpose, root, &dir)?;
    finish(changes, purpose, root, &dir)
}

pub(super) fn remove_intent(dir: &Path) -> Result<(), RuntimeError> {
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
pub(super) fn remove_created_dirs(root: &HostRoot, dir: &Path, file: &Path) -> Result<(), RuntimeError> {
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

pub(super) fn write_changes<'a>(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backup_names_are_one_file_per_path() {
        assert_eq!(
            backup_name(Path::new("/etc/docker/daemon.json")),
            "%2Fetc%2Fdocker%2Fdaemon.json"
        );
        assert_ne!(backup_name(Path::new("/a/b%2Fc")), backup_name(Path::new("/a/b/c")));
    }
}
