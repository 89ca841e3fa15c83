//! containerd's version and effective configuration, kept across restarts of the agent.
//!
//! Asking containerd (`containerd --version`, then `containerd config dump` on a copy of its
//! files) runs its binary twice, about 100 ms on a real node, and the runtime stage gates the
//! device plugin's registration: a restarted agent on a node where nothing changed would pay it
//! on every start. The answer depends only on the binary and the files it reads, so it is kept
//! in the agent's state directory (`<state_dir>/runtime/containerd-facts.json`, root's, 0600)
//! under a key naming both (see [`key`]) and reused while the key is the same. A file that cannot
//! be read, parsed or is over [`MAX_BYTES`] is ignored (containerd is asked again); a failed write
//! only costs the next start the two runs.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The cache file's name in the runtime state directory.
pub const FILE: &str = "containerd-facts.json";

/// Larger files are not read: a dump is some tens of KiB.
pub const MAX_BYTES: u64 = 4 << 20;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Stored {
    key: String,
    version: Option<(u32, u32)>,
    dump: String,
}

/// The identity of `path` for the key: size, inode, modification and change times (a package
/// upgrade renames a new file into place, so the inode and ctime change even when size and
/// mtime are kept).
pub fn identity(path: &Path) -> String {
    match fs::metadata(path) {
        Ok(m) => format!(
            "{}:{}:{}.{}:{}.{}",
            m.len(),
            m.ino(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec()
        ),
        Err(_) => "-".into(),
    }
}

/// The stored key for what the answer depends on (`inputs`: the root, the binary, its
/// [`identity`] and the digests of the files containerd reads) and the agent build itself (a
/// new agent may build the dumped copy differently): a SHA-256 in hex.
pub fn key(inputs: &str) -> String {
    let agent = identity(Path::new("/proc/self/exe"));
    let agent = fs::read_link("/proc/self/exe")
        .map(|exe| identity(&exe))
        .unwrap_or(agent);
    let mut hash = Sha256::new();
    hash.update(env!("CARGO_PKG_VERSION").as_bytes());
    hash.update([0]);
    hash.update(agent.as_bytes());
    hash.update([0]);
    hash.update(inputs.as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// The stored version and dump when they were stored under `key`.
pub fn load(dir: &Path, key: &str) -> Option<(Option<(u32, u32)>, String)> {
    let file = path(dir);
    // Not through a link, and a FIFO put in its place does not block the open.
    let opened = fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits())
        .open(&file)
        .ok()?;
    let meta = opened.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_BYTES {
        tracing::debug!(
            "{}: not a regular file under {MAX_BYTES} bytes; ignored",
            file.display()
        );
        return None;
    }
    let mut text = String::new();
    if let Err(e) = opened.take(MAX_BYTES).read_to_string(&mut text) {
        tracing::debug!("{}: {e}; ignored", file.display());
        return None;
    }
    match serde_json::from_str::<Stored>(&text) {
        Ok(stored) if stored.key == key => Some((stored.version, stored.dump)),
        Ok(_) => None,
        Err(e) => {
            tracing::debug!("{}: {e}; ignored", file.display());
            None
        }
    }
}

/// Stores `version` and `dump` under `key` (replacing what was there).
pub fn store(dir: &Path, key: &str, version: Option<(u32, u32)>, dump: &str) {
    let stored = Stored {
        key: key.to_owned(),
        version,
        dump: dump.to_owned(),
    };
    let file = path(dir);
    let result = serde_json::to_vec(&stored)
        .map_err(|e| e.to_string())
        .and_then(|bytes| crate::host::write_atomic(&file, &bytes, 0o600).map_err(|e| e.to_string()));
    if let Err(e) = result {
        tracing::debug!("{}: {e}; containerd is asked again at the next start", file.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_answer_is_found_under_its_key_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (one, two) = (key("root\0/usr/bin/containerd\0a"), key("root\0/usr/bin/containerd\0b"));
        assert_ne!(one, two);
        assert_eq!(load(dir.path(), &one), None);
        store(dir.path(), &one, Some((2, 1)), "version = 3\n");
        assert_eq!(load(dir.path(), &one), Some((Some((2, 1)), "version = 3\n".to_owned())));
        assert_eq!(load(dir.path(), &two), None);
        let mode = fs::metadata(dir.path().join(FILE)).expect("stored").mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_binary_replaced_in_place_changes_the_identity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("containerd");
        fs::write(&bin, "one").expect("write");
        let before = identity(&bin);
        // Same size, then renamed over (as a package manager does).
        let new = dir.path().join("containerd.new");
        fs::write(&new, "two").expect("write");
        fs::rename(&new, &bin).expect("rename");
        assert_ne!(identity(&bin), before);
        assert_eq!(identity(&dir.path().join("missing")), "-");
    }

    #[test]
    fn unreadable_oversized_or_foreign_files_are_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let k = key("x");
        fs::write(dir.path().join(FILE), "not json").expect("write");
        assert_eq!(load(dir.path(), &k), None);
        fs::remove_file(dir.path().join(FILE)).expect("rm");
        fs::create_dir(dir.path().join(FILE)).expect("a directory in its place");
        assert_eq!(load(dir.path(), &k), None);
        fs::remove_dir(dir.path().join(FILE)).expect("rmdir");
        nix::unistd::mkfifo(&dir.path().join(FILE), nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("fifo");
        assert_eq!(load(dir.path(), &k), None, "a FIFO neither blocks nor counts");
        fs::remove_file(dir.path().join(FILE)).expect("rm fifo");
        let big = format!(
            "{{\"key\":\"{k}\",\"version\":null,\"dump\":\"{}\"}}",
            "a".repeat(MAX_BYTES as usize)
        );
        fs::write(dir.path().join(FILE), big).expect("write");
        assert_eq!(load(dir.path(), &k), None);
    }
}
