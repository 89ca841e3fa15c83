//! The node's OS surface: the root prefix every host path goes through, atomic file writes, and
//! running host programs ([`command`]), the machine architecture ([`arch`]).

pub mod arch;
pub mod backoff;
pub mod command;
pub mod devchar;
pub mod devnodes;
pub mod lock;
pub mod operator;
pub mod socket;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The prefix under which every host path is resolved (`--root`, `/` on a real node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoot(PathBuf);

impl HostRoot {
    pub fn new(root: impl Into<PathBuf>) -> HostRoot {
        HostRoot(root.into())
    }

    /// The root itself.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Resolves an absolute host path under the root: `/etc/x` with root `/tmp/r` is
    /// `/tmp/r/etc/x`.
    pub fn join(&self, host_path: impl AsRef<Path>) -> PathBuf {
        rooted(&self.0, host_path.as_ref())
    }

    /// Whether this is the real root (`/`), where services may be restarted and so on.
    pub fn is_real(&self) -> bool {
        self.0 == Path::new("/")
    }
}

/// Joins an absolute host path under the root prefix: `rooted("/tmp/r", "/etc/x")` is
/// `/tmp/r/etc/x`, and with root `/` the path is returned unchanged. A relative path is joined
/// under the root too. `..` components are kept: this maps trusted config paths, it is not a
/// confinement boundary.
pub fn rooted(root: &Path, path: &Path) -> PathBuf {
    if root == Path::new("/") || root.as_os_str().is_empty() {
        return path.to_path_buf();
    }
    let rel: PathBuf = path
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::Prefix(_)))
        .collect();
    if rel.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    }
}

/// Why a file could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {path}: {source}")]
pub struct WriteError {
    pub action: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename over the
/// target, fsync of the directory. Readers see the old or the new content, never a mix. The
/// parent directory is created if missing. An existing regular file's mode and owner are kept; a
/// new one, or one where a symlink was, gets `mode` and the agent's user (the symlink itself is
/// replaced, its target neither written nor consulted).
///
/// The temp file has a random name and is created with `O_CREAT|O_EXCL` (which never follows a
/// symlink) and mode 0600 until it is complete: nobody who can write to the directory can point
/// the agent's write at another file or read a half-written one.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    let err = |action: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| WriteError {
            action,
            path: p,
            source,
        }
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(err("create directory", dir))?;
    // Not following a symlink: its target's mode and owner are not the agent's to copy.
    let existing = fs::symlink_metadata(path).ok().filter(|m| m.file_type().is_file());
    let mode = existing
        .as_ref()
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(mode);
    let owner = existing.as_ref().map(|m| (m.uid(), m.gid()));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)
        .map_err(err("create a temp file in", dir))?;
    let write = |file: &mut File| -> io::Result<()> {
        file.write_all(bytes)?;
        if let Some((uid, gid)) = owner {
            let (euid, egid) = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
            if (uid, gid) != (euid, egid) {
                std::os::unix::fs::fchown(&*file, Some(uid), Some(gid))?;
            }
        }
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()
    };
    if let Err(source) = write(tmp.as_file_mut()) {
        return Err(WriteError {
            action: "write",
            path: tmp.path().to_path_buf(),
            source,
        });
    }
    // On failure the temp file is removed when `tmp` drops.
    tmp.persist(path).map_err(|e| WriteError {
        action: "rename into place",
        path: path.to_path_buf(),
        source: e.error,
    })?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The most bytes the agent reads of a text file a user or the host hands it (config files and
/// drop-ins, the labels file, container engine and kubelet configs, status.json): the largest
/// real ones are a few hundred KiB.
pub const MAX_TEXT_FILE: u64 = 4 * 1024 * 1024;

/// A size for messages: `16 MiB`, `64 KiB`, `100 bytes`.
pub fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

/// Reads a whole file of at most `limit` bytes. A larger one is refused (by its length when it
/// has one, else after reading `limit + 1` bytes) with an [`io::ErrorKind::FileTooLarge`]
/// error naming the limit; the caller's error names the file.
pub fn read_file(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    if len > limit {
        return Err(too_large_file(limit, Some(len)));
    }
    let mut data = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut data)?;
    if data.len() as u64 > limit {
        // Grew since, or a file without a length (a pipe, a device).
        return Err(too_large_file(limit, None));
    }
    Ok(data)
}

fn too_large_file(limit: u64, len: Option<u64>) -> io::Error {
    let found = len.map(|n| format!(" ({n} bytes)")).unwrap_or_default();
    io::Error::new(
        io::ErrorKind::FileTooLarge,
        format!("the file is over the {} limit{found}", size(limit)),
    )
}

/// `fs::read_to_string` that refuses a file over `limit` bytes (a `FileTooLarge` error saying
/// so; the caller names the file) without reading more than `limit + 1` of it.
pub fn read_text_limited(path: &Path, limit: u64) -> io::Result<String> {
    let bytes = read_file(path, limit)?;
    String::from_utf8(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// [`read_text_limited`] at [`MAX_TEXT_FILE`].
pub fn read_text(path: &Path) -> io::Result<String> {
    read_text_limited(path, MAX_TEXT_FILE)
}

/// The node's name for logs and status: `/etc/hostname` under the root, else the kernel's.
pub fn hostname(root: &HostRoot) -> String {
    if !root.is_real()
        && let Ok(text) = fs::read_to_string(root.join("/etc/hostname"))
        && !text.trim().is_empty()
    {
        return text.trim().to_string();
    }
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_prefixes_absolute_paths() {
        assert_eq!(HostRoot::new("/").join("/etc/x"), PathBuf::from("/etc/x"));
        assert_eq!(HostRoot::new("/tmp/r").join("/etc/x"), PathBuf::from("/tmp/r/etc/x"));
        assert_eq!(HostRoot::new("/tmp/r").join("etc/x"), PathBuf::from("/tmp/r/etc/x"));
        assert_eq!(HostRoot::new("/tmp/r").join("/"), PathBuf::from("/tmp/r"));
    }

    #[test]
    fn write_atomic_replaces_and_keeps_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/status.json");
        write_atomic(&path, b"one", 0o640).expect("first write");
        assert_eq!(fs::read(&path).expect("read"), b"one");
        assert_eq!(fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o640);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");
        write_atomic(&path, b"two", 0o644).expect("second write");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        assert_eq!(fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o600);
        let leftovers: Vec<_> = fs::read_dir(path.parent().expect("parent")).expect("ls").collect();
        assert_eq!(leftovers.len(), 1, "no temp files left behind");
    }

    #[test]
    fn text_reads_stop_at_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.toml");
        fs::write(&path, "x".repeat(1024)).expect("write");
        assert_eq!(read_text_limited(&path, 1024).expect("at the limit").len(), 1024);
        let err = read_text_limited(&path, 512).expect_err("over");
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge);
        assert_eq!(err.to_string(), "the file is over the 512 bytes limit (1024 bytes)");
        fs::write(&path, [0xff, 0xfe]).expect("write");
        assert_eq!(read_text(&path).expect_err("binary").to_string(), "not UTF-8 text");
    }

    /// Someone who can write to the output directory plants symlinks where the agent writes:
    /// at the temp name the agent used to use (`.<name>.tmp-<pid>`) and at the target itself.
    /// Neither link's target (a 0600 file standing for /etc/shadow) is written, chmod-ed or
    /// consulted: the new file is the agent's own, with the mode asked for.
    #[test]
    fn write_atomic_follows_no_planted_symlink() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        fs::write(&victim, b"secret").expect("victim");
        fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).expect("chmod");
        let out = dir.path().join("out");
        fs::create_dir(&out).expect("out dir");
        fs::set_permissions(&out, fs::Permissions::from_mode(0o777)).expect("world-writable");
        let path = out.join("spec.json");
        std::os::unix::fs::symlink(&victim, out.join(format!(".spec.json.tmp-{}", std::process::id())))
            .expect("plant temp link");
        write_atomic(&path, b"{}", 0o644).expect("write");
        assert_eq!(fs::read(&victim).expect("victim"), b"secret");
        assert_eq!(fs::metadata(&victim).expect("meta").permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read(&path).expect("written"), b"{}");

        // The target itself a link to a world-writable file: replaced, its mode not copied.
        let lure = dir.path().join("lure");
        fs::write(&lure, b"mine").expect("lure");
        fs::set_permissions(&lure, fs::Permissions::from_mode(0o666)).expect("chmod");
        fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink(&lure, &path).expect("plant target link");
        write_atomic(&path, b"{\"a\":1}", 0o644).expect("write");
        let meta = fs::symlink_metadata(&path).expect("meta");
        assert!(meta.file_type().is_file(), "the link was replaced by a file");
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        assert_eq!(fs::read(&lure).expect("lure"), b"mine");
        assert_eq!(fs::read(&path).expect("written"), b"{\"a\":1}");
    }
}
