//! The daemon's folders on the host, made and cleaned through directory handles.
//!
//! The pipe folder and `<mps_root>/shm` are mounted read-write into every MPS pod, so a tenant
//! decides what is in them; anything under `<mps_root>` may have been planted. The agent runs
//! as root, so it never resolves a path string below `<mps_root>`: it opens `<mps_root>` once
//! (that path is the admin's config, its parents root's) and walks down one component at a
//! time with `openat(O_DIRECTORY | O_NOFOLLOW)`, creating with `mkdirat` and removing with
//! `unlinkat` on the folder's handle. A component that is a symbolic link, or not a folder, is
//! refused with an error naming it: the layout under `<mps_root>` is the agent's, so anything
//! else there was put by someone else, and the agent neither follows it nor deletes what may
//! be someone's data. `.started` is the exception: it is the agent's own marker, so a link or
//! file there is replaced (`unlinkat` removes a link, never its target) and the marker created
//! with `O_CREAT | O_EXCL | O_NOFOLLOW`.

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};

use super::MpsDaemon;

/// The mode of the folders the agent creates (NVIDIA's `os.MkdirAll(dir, 0755)`).
const DIR_MODE: u32 = 0o755;

/// The daemon's folders, open.
pub(super) struct Folders {
    /// `<mps_root>/<resource>`, which holds `.started`.
    pub resource: OwnedFd,
    pub pipe: OwnedFd,
    pub log: OwnedFd,
    pub shm: OwnedFd,
}

impl Folders {
    /// Creates what is missing of the plan's pipe, log and shm folders under `root` (the
    /// agent's `--root`) and opens them; `Err` names the host path and why.
    pub fn open(root: &Path, plan: &MpsDaemon) -> Result<Folders, String> {
        let mps_root = open_mps_root(root, plan, true)?.ok_or_else(|| "no MPS root".to_string())?;
        let dir = |p: &Path| -> Result<OwnedFd, String> {
            walk(&mps_root, plan.mps_root(), p, true)?.ok_or_else(|| format!("{}: missing", p.display()))
        };
        let resource_dir = plan.started_file.parent().unwrap_or(plan.mps_root());
        Ok(Folders {
            resource: dir(resource_dir)?,
            pipe: dir(&plan.pipe_dir)?,
            log: dir(&plan.log_dir)?,
            shm: dir(&plan.shm_dir)?,
        })
    }

    /// Creates `.started` (the daemon answers with its limits set), replacing whatever is there
    /// under that name.
    pub fn mark_started(&self, plan: &MpsDaemon) -> Result<(), String> {
        let path = &plan.started_file;
        let name = file_name(path)?;
        match unlinkat(&self.resource, name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => return Err(format!("cannot replace {}: {}", path.display(), e.desc())),
        }
        openat(
            &self.resource,
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(drop)
        .map_err(|e| format!("cannot create {}: {}", path.display(), e.desc()))
    }
}

/// Removes the plan's `.started` (a link there is removed, never followed); nothing when it, or
/// a folder above it, is missing. `Err` names the path and why.
pub(super) fn remove_started(root: &Path, plan: &MpsDaemon) -> Result<(), String> {
    let path = &plan.started_file;
    let Some(mps_root) = open_mps_root(root, plan, false)? else {
        return Ok(());
    };
    let Some(parent) = path.parent() else {
        return Ok(());
    };
    let Some(dir) = walk(&mps_root, plan.mps_root(), parent, false)? else {
        return Ok(());
    };
    match unlinkat(&dir, file_name(path)?, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(format!("cannot remove {}: {}", path.display(), e.desc())),
    }
}

/// `<mps_root>` under `root`, created when `create` (the admin's path: its parents are
/// followed, the folder itself is not); `None` when missing and not `create`.
fn open_mps_root(root: &Path, plan: &MpsDaemon, create: bool) -> Result<Option<OwnedFd>, String> {
    let host = crate::host::rooted(root, plan.mps_root());
    if create {
        std::fs::create_dir_all(&host).map_err(|e| format!("cannot create {}: {e}", plan.mps_root().display()))?;
    }
    match nix::fcntl::open(&host, dir_flags(), Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::ENOENT) if !create => Ok(None),
        Err(e) => Err(refusal(plan.mps_root(), e, || std::fs::symlink_metadata(&host).ok())),
    }
}

/// Opens `path` (a host path under `base_path`, whose handle is `base`) one component at a
/// time without following links, creating the missing folders when `create`; `None` when a
/// folder is missing and not `create`.
fn walk(base: &OwnedFd, base_path: &Path, path: &Path, create: bool) -> Result<Option<OwnedFd>, String> {
    let rel = path
        .strip_prefix(base_path)
        .map_err(|_| format!("{} is not under the MPS root {}", path.display(), base_path.display()))?;
    let mut dir = base.try_clone().map_err(|e| format!("{}: {e}", base_path.display()))?;
    let mut at = base_path.to_path_buf();
    for c in rel.components() {
        let Component::Normal(name) = c else {
            return Err(format!(
                "{}: `{}` in an MPS folder path",
                path.display(),
                c.as_os_str().display()
            ));
        };
        at.push(name);
        let next = match openat(&dir, name, dir_flags(), Mode::empty()) {
            Err(Errno::ENOENT) if create => {
                match mkdirat(&dir, name, Mode::from_bits_truncate(DIR_MODE)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(format!("cannot create {}: {}", at.display(), e.desc())),
                }
                openat(&dir, name, dir_flags(), Mode::empty())
            }
            Err(Errno::ENOENT) => return Ok(None),
            other => other,
        };
        dir = next.map_err(|e| refusal(&at, e, || stat_at(&dir, name)))?;
    }
    Ok(Some(dir))
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn stat_at(dir: &OwnedFd, name: &OsStr) -> Option<FileStat> {
    fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW).ok()
}

/// Why `path` could not be opened as a folder: a link or something else there, said plainly.
fn refusal<M: IsLink>(path: &Path, e: Errno, stat: impl FnOnce() -> Option<M>) -> String {
    if matches!(e, Errno::ELOOP | Errno::ENOTDIR) {
        if stat().is_some_and(|m| m.is_link()) {
            return format!(
                "{} is a symbolic link, not a folder: refusing to follow it (it may have been planted by a pod that mounts the MPS folders; remove it)",
                path.display()
            );
        }
        return format!("{} is not a folder: refusing to use it (remove it)", path.display());
    }
    format!("cannot open {}: {}", path.display(), e.desc())
}

trait IsLink {
    fn is_link(&self) -> bool;
}

impl IsLink for FileStat {
    fn is_link(&self) -> bool {
        SFlag::from_bits_truncate(self.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK
    }
}

impl IsLink for std::fs::Metadata {
    fn is_link(&self) -> bool {
        self.file_type().is_symlink()
    }
}

fn file_name(path: &Path) -> Result<&OsStr, String> {
    path.file_name()
        .ok_or_else(|| format!("{}: no file name", path.display()))
}
