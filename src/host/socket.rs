//! Unix sockets at paths someone else may serve: whether a process listens on one (and which,
//! by `SO_PEERCRED`), and binding one in place without ever unlinking a live socket.
//!
//! The agent serves at paths NVIDIA's own operands use too (`nvidia-gpu.sock` in the kubelet's
//! device-plugin directory, the DRA driver's sockets). A socket file left by a process that died
//! refuses connections (`ECONNREFUSED`) and may be replaced; one that accepts belongs to a live
//! server and is left alone. The check and the replacement must not race a server that binds
//! the path in between, so [`bind_in_place`] binds under a staging name first and then:
//! - nothing at the path: `renameat2(RENAME_NOREPLACE)` (fails if something appeared);
//! - a dead socket: `renameat2(RENAME_EXCHANGE)`, then the file now under the staging name is
//!   removed only if it is the very inode probed dead; anything else that was swapped out is
//!   probed again, and a live one is swapped straight back.
//!
//! Every name is resolved against the directory's descriptor (`*at` calls, no symlinks
//! followed); only `bind` and `connect` take the path, as `sockaddr_un` requires.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags, open, renameat2};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, getsockopt, socket, sockopt};
use nix::sys::stat::{Mode, SFlag, fstatat};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// The process listening on a socket, as the kernel tells a client (`SO_PEERCRED`): the pid is
/// in the agent's pid namespace; `None` when the kernel gave none (a full backlog answers
/// `EAGAIN` before any credentials are exchanged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
}

/// What a path holds, for someone about to serve there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Nothing at the path.
    Absent,
    /// A socket nobody listens on (connect refused): left by a process that is gone. The
    /// (device, inode) it had when probed.
    Dead((u64, u64)),
    /// Not a socket (a regular file, a symlink, a directory): nobody can serve on it.
    NotSocket((u64, u64)),
    /// A live server accepts connections there.
    Live(Listener),
}

/// Why a socket could not be bound in place.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// A live server holds the path: it was left alone.
    #[error("{} is served by another process ({}); it was left alone", socket.display(), holder_words(holder))]
    InUse { socket: PathBuf, holder: Listener },
    #[error("{}: {source}", socket.display())]
    Io { socket: PathBuf, source: io::Error },
}

impl BindError {
    /// The live server's credentials, for a [`BindError::InUse`].
    pub fn holder(&self) -> Option<Listener> {
        match self {
            BindError::InUse { holder, .. } => Some(*holder),
            BindError::Io { .. } => None,
        }
    }
}

fn holder_words(holder: &Listener) -> String {
    match holder.pid {
        Some(pid) => format!("pid {pid}"),
        None => "pid unknown".to_string(),
    }
}

/// How often [`bind_in_place`] looks again when the path changes under it.
const ATTEMPTS: usize = 3;

/// Splits a socket path into its directory (opened, `O_PATH`, its last component not followed:
/// a pod that can write the kubelet's plugin folder must not send the agent's socket, and the
/// replacing of a dead one, into another folder through a link) and file name.
fn open_dir(path: &Path) -> io::Result<(OwnedFd, &std::ffi::OsStr)> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a socket path"));
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let fd = match open(
        dir,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOTDIR | Errno::ELOOP) => {
            return Err(io::Error::other(format!(
                "{} is a symbolic link or not a folder: refused (the agent's sockets are made only in \
                 a real folder)",
                dir.display()
            )));
        }
        Err(e) => return Err(e.into()),
    };
    Ok((fd, name))
}

/// `name` in the folder `dir` is open on, as a path that reaches it through the descriptor
/// (`/proc/self/fd/<fd>/<name>`): bind and connect take paths, and this one cannot be redirected
/// by a link put where the folder was.
fn in_dir(dir: &OwnedFd, name: &std::ffi::OsStr) -> PathBuf {
    Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

fn stat_at(dir: &OwnedFd, name: &std::ffi::OsStr) -> io::Result<Option<(SFlag, (u64, u64))>> {
    match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        #[allow(clippy::unnecessary_cast)]
        Ok(st) => Ok(Some((
            SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT,
            (st.st_dev as u64, st.st_ino as u64),
        ))),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Connects to the socket at `path` (nonblocking, closed at once) and says who listens.
/// `Ok(None)`: nobody does (refused, or the file went away).
fn listener_at(path: &Path) -> io::Result<Option<Listener>> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
    let addr = UnixAddr::new(path).map_err(io::Error::from)?;
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => {
            let cred = getsockopt(&fd, sockopt::PeerCredentials).ok();
            Ok(Some(Listener {
                pid: cred.map(|c| c.pid()).filter(|p| *p > 0),
                uid: cred.map(|c| c.uid()),
            }))
        }
        // A full backlog: somebody listens, too busy to say who.
        Err(Errno::EAGAIN) => Ok(Some(Listener { pid: None, uid: None })),
        Err(Errno::ECONNREFUSED | Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn probe_at(dir: &OwnedFd, name: &std::ffi::OsStr) -> io::Result<Probe> {
    let Some((kind, id)) = stat_at(dir, name)? else {
        return Ok(Probe::Absent);
    };
    if kind != SFlag::S_IFSOCK {
        return Ok(Probe::NotSocket(id));
    }
    Ok(match listener_at(&in_dir(dir, name))? {
        Some(listener) => Probe::Live(listener),
        None => Probe::Dead(id),
    })
}

/// (device, inode) of a file, not following a link: what [`bind_in_place`] returns for the socket
/// it bound, so that a server removes its socket only while it is still the one it made.
pub fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// What `path` holds: nothing, a dead socket, something else, or a live server (and its pid).
/// Reads only: one `lstat` and, for a socket, one connection that is closed at once.
pub fn probe(path: &Path) -> io::Result<Probe> {
    let (dir, name) = open_dir(path)?;
    probe_at(&dir, name)
}

/// Binds a listening socket at `path` without ever removing a live one: nothing there or a dead
/// socket (or a stray non-socket file, but not a directory) is replaced; a live server's socket
/// or a directory is left alone and
/// the answer is [`BindError::InUse`] with its credentials. Returns the listener and the
/// (device, inode) of the socket file now at `path`. See the module docs for the steps.
pub fn bind_in_place(path: &Path) -> Result<(UnixListener, (u64, u64)), BindError> {
    let io_err = |source: io::Error| BindError::Io {
        socket: path.to_path_buf(),
        source,
    };
    let (dir, name) = open_dir(path).map_err(io_err)?;
    let staging_name = format!(".{}.binding", name.to_string_lossy());
    let staging = in_dir(&dir, std::ffi::OsStr::new(&staging_name));
    // Our own staging name: whatever a crash left there is ours to remove.
    match unlinkat(&dir, staging_name.as_str(), UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(io_err(e.into())),
    }
    let listener = UnixListener::bind(&staging).map_err(io_err)?;
    let ours = match stat_at(&dir, std::ffi::OsStr::new(&staging_name)) {
        Ok(Some((_, id))) => id,
        Ok(None) => {
            return Err(io_err(io::Error::new(
                io::ErrorKind::NotFound,
                "the staging socket vanished",
            )));
        }
        Err(e) => return Err(io_err(e)),
    };
    let result = place(&dir, path, name, &staging_name, ours);
    // Only our own socket is removed: after a swap whose undo failed, the staging name may hold
    // what was at the path (a live socket of someone else's).
    if result.is_err()
        && stat_at(&dir, std::ffi::OsStr::new(&staging_name))
            .ok()
            .flatten()
            .map(|(_, id)| id)
            == Some(ours)
    {
        let _ = unlinkat(&dir, staging_name.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    result.map(|id| (listener, id)).map_err(|e| match e {
        Placed::InUse(holder) => BindError::InUse {
            socket: path.to_path_buf(),
            holder,
        },
        Placed::Io(source) => io_err(source),
    })
}

enum Placed {
    InUse(Listener),
    Io(io::Error),
}

impl From<Errno> for Placed {
    fn from(e: Errno) -> Placed {
        Placed::Io(e.into())
    }
}

impl From<io::Error> for Placed {
    fn from(e: io::Error) -> Placed {
        Placed::Io(e)
    }
}

/// Moves the bound socket at `staging` to `name` unless a live server holds `name`.
fn place(
    dir: &OwnedFd,
    path: &Path,
    name: &std::ffi::OsStr,
    staging: &str,
    ours: (u64, u64),
) -> Result<(u64, u64), Placed> {
    for _ in 0..ATTEMPTS {
        match probe_at(dir, name)? {
            Probe::Live(holder) => return Err(Placed::InUse(holder)),
            Probe::Absent => match renameat2(dir.as_fd(), staging, dir.as_fd(), name, RenameFlags::RENAME_NOREPLACE) {
                Ok(()) => return Ok(ours),
                // Something appeared in between: look again.
                Err(Errno::EEXIST) => continue,
                Err(Errno::EINVAL | Errno::ENOSYS) => {
                    // A filesystem without renameat2's flags: link(2) also fails on an existing name.
                    match nix::unistd::linkat(dir, staging, dir, name, AtFlags::empty()) {
                        Ok(()) => {
                            let _ = unlinkat(dir, staging, UnlinkatFlags::NoRemoveDir);
                            return Ok(ours);
                        }
                        Err(Errno::EEXIST) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            },
            Probe::Dead(old) | Probe::NotSocket(old) => {
                match renameat2(dir.as_fd(), staging, dir.as_fd(), name, RenameFlags::RENAME_EXCHANGE) {
                    Ok(()) => {}
                    Err(Errno::ENOENT) => continue,
                    Err(Errno::EINVAL | Errno::ENOSYS) => {
                        return Err(Placed::Io(io::Error::other(
                            "a file is in the way and this filesystem cannot swap names atomically \
                             (renameat2 RENAME_EXCHANGE); remove it if nothing serves on it",
                        )));
                    }
                    Err(e) => return Err(e.into()),
                }
                // Ours is in place; what was there is now under the staging name.
                let swapped = stat_at(dir, std::ffi::OsStr::new(staging))?;
                match swapped {
                    // Nobody serves on a directory, but it is not the agent's to move or empty:
                    // it gets its name back.
                    Some((kind, _)) if kind == SFlag::S_IFDIR => {
                        renameat2(dir.as_fd(), staging, dir.as_fd(), name, RenameFlags::RENAME_EXCHANGE)?;
                        return Err(Placed::Io(io::Error::other(
                            "a directory is in the way: it was left alone; remove it if nothing needs it",
                        )));
                    }
                    Some((_, id)) if id == old => {
                        let _ = unlinkat(dir, staging, UnlinkatFlags::NoRemoveDir);
                        return Ok(ours);
                    }
                    None => return Ok(ours),
                    Some((kind, _)) => {
                        // Replaced between the probe and the swap: a live newcomer gets its name back.
                        let staging_path = in_dir(dir, std::ffi::OsStr::new(staging));
                        let live = if kind == SFlag::S_IFSOCK {
                            listener_at(&staging_path)?
                        } else {
                            None
                        };
                        match live {
                            Some(holder) => {
                                renameat2(dir.as_fd(), staging, dir.as_fd(), name, RenameFlags::RENAME_EXCHANGE)?;
                                return Err(Placed::InUse(holder));
                            }
                            None => {
                                let _ = unlinkat(dir, staging, UnlinkatFlags::NoRemoveDir);
                                return Ok(ours);
                            }
                        }
                    }
                }
            }
        }
    }
    Err(Placed::Io(io::Error::other(format!(
        "{} kept changing while the agent bound it",
        path.display()
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_id(path: &Path) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
    }

    #[test]
    fn absent_dead_and_live_sockets_are_told_apart() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("x.sock");
        assert_eq!(probe(&path).expect("probe"), Probe::Absent);
        let live = UnixListener::bind(&path).expect("bind");
        match probe(&path).expect("probe") {
            Probe::Live(l) => assert_eq!(l.pid, Some(std::process::id() as i32)),
            other => panic!("expected live, got {other:?}"),
        }
        drop(live);
        assert!(matches!(probe(&path).expect("probe"), Probe::Dead(_)));
        std::fs::remove_file(&path).expect("rm");
        std::fs::write(&path, "x").expect("file");
        assert!(matches!(probe(&path).expect("probe"), Probe::NotSocket(_)));
    }

    #[test]
    fn a_live_socket_is_never_replaced() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("nvidia-gpu.sock");
        let theirs = UnixListener::bind(&path).expect("bind");
        let id = file_id(&path);
        let err = bind_in_place(&path).expect_err("refused");
        assert_eq!(err.holder().and_then(|h| h.pid), Some(std::process::id() as i32));
        assert!(err.to_string().contains("left alone"), "{err}");
        // Still theirs, still served, and no staging file left behind.
        assert_eq!(file_id(&path), id);
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
        drop(theirs);
    }

    #[test]
    fn a_dead_socket_or_nothing_is_replaced_by_a_listening_one() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("nvidia-gpu.sock");
        let (first, id) = bind_in_place(&path).expect("bind on nothing");
        assert_eq!(file_id(&path), Some(id));
        drop(first);
        let (second, id2) = bind_in_place(&path).expect("replaces the dead one");
        assert_ne!(id, id2);
        assert_eq!(file_id(&path), Some(id2));
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        drop(second);
        std::fs::remove_file(&path).expect("rm");
        std::fs::write(&path, "stray").expect("file");
        let (_third, id3) = bind_in_place(&path).expect("replaces a stray file");
        assert_eq!(file_id(&path), Some(id3));
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("ls").count(),
            1,
            "no staging file left"
        );
    }

    /// The socket's folder is not followed when it is a link: nothing is bound or replaced in the
    /// folder it points to.
    #[test]
    fn a_socket_folder_that_is_a_link_is_refused_and_its_target_untouched() {
        // A pod that can write the kubelet's plugin folder replaces the agent's socket folder with
        // a link to another folder holding a file named like the socket.
        let tmp = tempfile::tempdir().expect("tmp");
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        std::fs::write(elsewhere.join("plugin.sock"), "precious").expect("file");
        let folder = tmp.path().join("gpu.nvidia.com");
        std::os::unix::fs::symlink(&elsewhere, &folder).expect("link");
        let path = folder.join("plugin.sock");
        let err = bind_in_place(&path).expect_err("refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(
            std::fs::read_to_string(elsewhere.join("plugin.sock")).expect("kept"),
            "precious"
        );
        assert_eq!(
            std::fs::read_dir(&elsewhere).expect("ls").count(),
            1,
            "no staging file there"
        );
        assert!(probe(&path).is_err(), "probing through the link is refused too");
    }

    /// A directory at the socket's name (made by anyone who can write the kubelet's folder) is
    /// neither moved aside under the staging name nor emptied, and a later bind is not wedged.
    #[test]
    fn a_directory_in_the_way_keeps_its_name_and_contents() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("nvidia-gpu.sock");
        std::fs::create_dir(&path).expect("mkdir");
        std::fs::write(path.join("data"), "theirs").expect("file");
        let id = file_id(&path);
        let err = bind_in_place(&path).expect_err("refused");
        assert!(err.to_string().contains("directory"), "{err}");
        assert_eq!(file_id(&path), id);
        assert_eq!(std::fs::read_to_string(path.join("data")).expect("kept"), "theirs");
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("ls").count(),
            1,
            "nothing moved aside, no staging file left"
        );
        // Once it is gone, the socket is bound.
        std::fs::remove_dir_all(&path).expect("rm");
        let (_listener, id) = bind_in_place(&path).expect("bound");
        assert_eq!(file_id(&path), Some(id));
    }
}
