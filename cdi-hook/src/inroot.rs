//! File operations inside a container's root file system, by file descriptor.
//!
//! The root is an untrusted image, and while the hooks run a sibling container that shares a
//! volume with it can change it. So a path is never walked as a string on the host: it is
//! resolved inside the root by `pathrs` (`openat2` with `RESOLVE_IN_ROOT`, or its checked
//! fallback), which yields a handle to the folder; every create, write, link and rename is then
//! an `*at` call relative to that handle on one name, with `O_NOFOLLOW`/`O_EXCL`. A symlink or a
//! folder swapped in between can only point the operation at another place inside the root.
//! Files are read only when they are regular files (checked on the handle before opening, so a
//! FIFO or device is never opened), with `O_NONBLOCK` and a size cap.

use std::ffi::{OsStr, OsString};
use std::fs::{File, Permissions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path};

use pathrs::flags::OpenFlags;
use pathrs::{Handle, Root};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::HookError;

/// How many entries of one folder are looked at.
pub const MAX_ENTRIES: usize = 4096;

/// A container's root file system, opened once.
pub struct InRoot {
    root: Root,
}

/// What is at a path in the root, by its type (links inside the root followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Missing,
    File,
    Directory,
    /// A FIFO, socket or device.
    Special(&'static str),
}

fn kind_of(file_type: FileType) -> Kind {
    match file_type {
        FileType::RegularFile => Kind::File,
        FileType::Directory => Kind::Directory,
        FileType::Fifo => Kind::Special("a FIFO"),
        FileType::Socket => Kind::Special("a socket"),
        FileType::CharacterDevice => Kind::Special("a character device"),
        FileType::BlockDevice => Kind::Special("a block device"),
        FileType::Symlink => Kind::Special("a symbolic link"),
        FileType::Unknown => Kind::Special("an unknown kind of file"),
    }
}

fn not_found(e: &pathrs::error::Error) -> bool {
    matches!(
        e.kind(),
        pathrs::error::ErrorKind::OsError(Some(libc::ENOENT | libc::ENOTDIR))
    )
}

impl InRoot {
    /// Opens the root (a host path the runtime gave, trusted).
    pub fn open(root: &Path) -> Result<InRoot, HookError> {
        let root = Root::open(root).map_err(|e| HookError::at(root, why(&e)))?;
        Ok(InRoot { root })
    }

    /// The folder at `path`, created with its parents (mode 0755) where missing; an error names
    /// `path` when something that is not a folder is in the way.
    pub fn dir(&self, path: &Path) -> Result<Handle, HookError> {
        absolute(path)?;
        let handle = self.root.mkdir_all(path, &Permissions::from_mode(0o755)).map_err(|e| {
            // pathrs does not create through a link that points nowhere (it could be swapped).
            let dangling = self.root.readlink(path).is_ok();
            let why = if dangling {
                format!(
                    "a symbolic link to a folder that does not exist in the container ({})",
                    why(&e)
                )
            } else {
                why(&e)
            };
            HookError::at(path, why)
        })?;
        match kind_of(stat(&handle, path)?) {
            Kind::Directory => Ok(handle),
            other => Err(HookError::at(
                path,
                format!("expected a folder, found {}", describe(other)),
            )),
        }
    }

    /// The folder at `path` if there is one (nothing is created).
    pub fn existing_dir(&self, path: &Path) -> Result<Option<Handle>, HookError> {
        match self.resolve(path)? {
            Some((handle, Kind::Directory)) => Ok(Some(handle)),
            Some((_, other)) => Err(HookError::at(
                path,
                format!("expected a folder, found {}", describe(other)),
            )),
            None => Ok(None),
        }
    }

    /// What `path` is (links followed inside the root), and a handle to it.
    pub fn resolve(&self, path: &Path) -> Result<Option<(Handle, Kind)>, HookError> {
        absolute(path)?;
        match self.root.resolve(path) {
            Ok(handle) => {
                let kind = kind_of(stat(&handle, path)?);
                Ok(Some((handle, kind)))
            }
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(HookError::at(path, why(&e))),
        }
    }

    /// The kind of `path` (links followed inside the root).
    pub fn kind(&self, path: &Path) -> Result<Kind, HookError> {
        Ok(self.resolve(path)?.map_or(Kind::Missing, |(_, kind)| kind))
    }

    /// The bytes of the regular file at `path`, at most `cap` of them; `None` when nothing is
    /// there. A FIFO, socket or device is refused without being opened; a larger file too.
    pub fn read_regular(&self, path: &Path, cap: u64) -> Result<Option<Vec<u8>>, HookError> {
        let Some((handle, kind)) = self.resolve(path)? else {
            return Ok(None);
        };
        if kind != Kind::File {
            return Err(HookError::at(
                path,
                format!("expected a regular file, found {}", describe(kind)),
            ));
        }
        read_handle(&handle, path, cap).map(Some)
    }

    /// The names in the folder at `path`, or `None` when there is no folder there; a folder of
    /// more than [`MAX_ENTRIES`] is an error.
    pub fn list(&self, path: &Path) -> Result<Option<Vec<OsString>>, HookError> {
        let Some(handle) = self.existing_dir(path)? else {
            return Ok(None);
        };
        let dir = handle
            .reopen(OpenFlags::O_RDONLY | OpenFlags::O_DIRECTORY | OpenFlags::O_CLOEXEC)
            .map_err(|e| HookError::at(path, why(&e)))?;
        let mut names = Vec::new();
        let entries = rustix::fs::Dir::read_from(dir.as_fd()).map_err(|e| HookError::at(path, e.to_string()))?;
        for entry in entries {
            let entry = entry.map_err(|e| HookError::at(path, e.to_string()))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            if names.len() == MAX_ENTRIES {
                // Refused rather than cut: a name past the cut would go unchecked.
                return Err(HookError::at(path, format!("more than {MAX_ENTRIES} entries")));
            }
            names.push(OsStr::from_bytes(name).to_os_string());
        }
        names.sort();
        Ok(Some(names))
    }

    /// Writes `bytes` to the file at `path`: a new file under a temporary name in the resolved
    /// folder (`O_CREAT|O_EXCL|O_NOFOLLOW`), renamed over whatever entry was there (a file, a link,
    /// a FIFO or a device is replaced without being opened; a folder is an error).
    pub fn write(&self, path: &Path, bytes: &[u8], mode: u32) -> Result<(), HookError> {
        let (parent, name) = split(path)?;
        let dir = self.dir(parent)?;
        refuse_dir(&dir, name, path)?;
        let temp = temp_name(name);
        let fd = rustix::fs::openat(
            &dir,
            temp.as_os_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| HookError::at(path, format!("creating {}: {e}", temp.to_string_lossy())))?;
        let mut file = File::from(fd);
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        drop(file);
        if let Err(e) = written {
            let _ = rustix::fs::unlinkat(&dir, temp.as_os_str(), AtFlags::empty());
            return Err(HookError::at(path, e.to_string()));
        }
        rename_into(&dir, &temp, name, path)
    }

    /// Creates the file at `path` with `bytes` unless an entry of that name exists (of any kind:
    /// it is left as it is, and a later check decides whether it may be used).
    pub fn create_if_missing(&self, path: &Path, bytes: &[u8]) -> Result<(), HookError> {
        let (parent, name) = split(path)?;
        let dir = self.dir(parent)?;
        match rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        ) {
            Ok(fd) => File::from(fd)
                .write_all(bytes)
                .map_err(|e| HookError::at(path, e.to_string())),
            Err(rustix::io::Errno::EXIST) => Ok(()),
            Err(e) => Err(HookError::at(path, e.to_string())),
        }
    }

    /// Removes the entry at `path` (not followed) unless it is a regular file or missing: a FIFO,
    /// device, socket or link where a program will create a file with `O_TRUNC` (ldconfig's
    /// temporary cache) would block it or redirect it. A folder there is an error.
    pub fn remove_unless_file(&self, path: &Path) -> Result<(), HookError> {
        let (parent, name) = split(path)?;
        let Some(dir) = self.existing_dir(parent)? else {
            return Ok(());
        };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => Ok(()),
                FileType::Directory => Err(HookError::at(path, "is a folder".to_string())),
                _ => rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                    .map_err(|e| HookError::at(path, io::Error::from(e).to_string())),
            },
            Err(_) => Ok(()),
        }
    }

    /// A symlink at `path` to `target`: left alone when it is already that link; otherwise made
    /// under a temporary name and renamed over the entry (a folder there is an error).
    pub fn symlink(&self, target: &str, path: &Path) -> Result<(), HookError> {
        let (parent, name) = split(path)?;
        let dir = self.dir(parent)?;
        if let Ok(current) = rustix::fs::readlinkat(&dir, name, Vec::new())
            && current.as_bytes() == target.as_bytes()
        {
            return Ok(());
        }
        if refuse_dir(&dir, name, path).is_err() {
            return Err(HookError::LinkExists {
                path: path.to_path_buf(),
                target: target.to_string(),
            });
        }
        let temp = temp_name(name);
        rustix::fs::symlinkat(target, &dir, temp.as_os_str())
            .map_err(|e| HookError::at(path, format!("creating {}: {e}", temp.to_string_lossy())))?;
        rename_into(&dir, &temp, name, path)
    }
}

/// Reads at most `cap` bytes of the regular file behind `handle` (opened `O_NONBLOCK`, checked
/// again on the open file); more is an error.
pub fn read_handle(handle: &Handle, path: &Path, cap: u64) -> Result<Vec<u8>, HookError> {
    let file = handle
        .reopen(OpenFlags::O_RDONLY | OpenFlags::O_NONBLOCK | OpenFlags::O_NOCTTY | OpenFlags::O_CLOEXEC)
        .map_err(|e| HookError::at(path, why(&e)))?;
    read_capped(file, path, cap)
}

/// The bytes of `file` (opened without blocking), at most `cap` of them, when it is a regular
/// file: a FIFO, socket or device is refused before it is read; more than `cap` is an error.
pub fn read_capped(file: File, path: &Path, cap: u64) -> Result<Vec<u8>, HookError> {
    let st = rustix::fs::fstat(&file).map_err(|e| HookError::at(path, io::Error::from(e).to_string()))?;
    let kind = kind_of(FileType::from_raw_mode(st.st_mode));
    if kind != Kind::File {
        return Err(HookError::at(
            path,
            format!("expected a regular file, found {}", describe(kind)),
        ));
    }
    let mut bytes = Vec::new();
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| HookError::at(path, e.to_string()))?;
    if bytes.len() as u64 > cap {
        return Err(HookError::at(path, format!("larger than {cap} bytes")));
    }
    Ok(bytes)
}

/// An error with its causes, innermost last (pathrs's own message alone often leaves out the
/// system call's error).
fn why(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

fn stat(handle: &Handle, path: &Path) -> Result<FileType, HookError> {
    let st = rustix::fs::fstat(handle).map_err(|e| HookError::at(path, e.to_string()))?;
    Ok(FileType::from_raw_mode(st.st_mode))
}

/// "a regular file", "a folder", "a FIFO", ...
pub fn describe(kind: Kind) -> &'static str {
    match kind {
        Kind::Missing => "nothing",
        Kind::File => "a regular file",
        Kind::Directory => "a folder",
        Kind::Special(what) => what,
    }
}

fn absolute(path: &Path) -> Result<(), HookError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(HookError::NotAbsolute(path.to_path_buf()))
    }
}

/// The folder and the last name of `path`, which must be absolute and end in a name.
fn split(path: &Path) -> Result<(&Path, &OsStr), HookError> {
    absolute(path)?;
    match (path.parent(), path.components().next_back()) {
        (Some(parent), Some(Component::Normal(name))) => Ok((parent, name)),
        _ => Err(HookError::NotAbsolute(path.to_path_buf())),
    }
}

/// An error when the entry `name` of `dir` (not followed) is a folder.
fn refuse_dir(dir: &Handle, name: &OsStr, path: &Path) -> Result<(), HookError> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
            Err(HookError::at(path, "is a folder".to_string()))
        }
        _ => Ok(()),
    }
}

fn temp_name(name: &OsStr) -> OsString {
    let mut temp = OsString::from(".");
    temp.push(name);
    temp.push(format!(".gpu-node-agent-{}-{}", std::process::id(), nanos()));
    temp
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

fn rename_into(dir: &Handle, temp: &OsStr, name: &OsStr, path: &Path) -> Result<(), HookError> {
    rustix::fs::renameat(dir, temp, dir, name).map_err(|e| {
        let _ = rustix::fs::unlinkat(dir, temp, AtFlags::empty());
        HookError::at(path, io::Error::from(e).to_string())
    })
}
