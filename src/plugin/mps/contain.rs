//! The control daemon, and each control client call, in a container of its own.
//!
//! The daemon runs as root and acts on what tenants write into its pipe folder and
//! `<mps_root>/shm` (both mounted read-write into every MPS pod), so it must not be able to
//! reach the host's files: NVIDIA runs it in a container of its own. The agent does the same
//! between fork and exec ([`Sandbox::apply`]):
//!
//! 1. new mount and UTS namespaces (not PID, IPC or network: MPS clients in pods, which run
//!    with the host's PIDs as NVIDIA's daemon pod does, meet the daemon through the pipe folder
//!    and `/dev/shm`, and the daemon looks their processes up), mount propagation private, so
//!    nothing below reaches the host;
//! 2. a fresh tmpfs as the new root (mounted on `/tmp` in the new namespace, then pivoted
//!    into), into which the agent binds, each from a path opened and checked by the agent
//!    first (below):
//!    - the driver root's `usr`, `bin`, `sbin`, `lib`, `lib32`, `lib64` read-only (or the same
//!      symbolic link where the driver root has one, as merged-/usr systems do) and its
//!      `etc/ld.so.cache`: the control program, the MPS server it starts and the libraries
//!      they load (`libc`, `libcuda` and what it loads);
//!    - the NVIDIA device nodes (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`,
//!      `/dev/nvidia<N>`, `/dev/nvidia-modeset`) and `/dev/{null,zero,full,random,urandom}`,
//!      each on its own, read-only (the nodes' metadata; opening a device for writing is not
//!      a write to the mount);
//!    - `/proc` and `/sys` read-only, without the file systems mounted below them (cgroups,
//!      debugfs, `binfmt_misc`: a recursive bind would leave those writable): the driver's
//!      `/proc/driver/nvidia`, the clients' `/proc/<pid>`, the GPUs' and modules' sysfs;
//!    - the pipe and log folders at their host paths and `<mps_root>/shm` as `/dev/shm`,
//!      read-write but `nosuid,nodev,noexec`;
//!    - a fresh `/tmp` (`nosuid,nodev,noexec`);
//! 3. `pivot_root` into it, the old root detached, the new root remounted read-only;
//! 4. the capability bounding set cut to [`KEEP_CAPS`] (and the inheritable and ambient sets
//!    emptied), so root in the container cannot undo the above: no `CAP_SYS_ADMIN` (mount),
//!    `CAP_SYS_PTRACE` (`/proc/<pid>/root` of the host's processes), `CAP_DAC_READ_SEARCH`
//!    (`open_by_handle_at` on the bound file systems), `CAP_MKNOD`, `CAP_SYS_MODULE`,
//!    `CAP_SYS_RAWIO`;
//! 5. `no_new_privs`;
//! 6. Landlock, where the kernel has it: file system access only beneath the new root (below).
//!
//! Why Landlock (issue #32). Steps 1 to 5 leave root in the container a way out: it keeps
//! `CAP_SETUID` (the daemon starts each MPS server as the client's user), so it can switch its
//! file system uid and gid to those of any dumpable host process without capabilities (a
//! daemon running as `nobody`, another tenant's non-root pod), open that process's
//! `/proc/<pid>/root` (the kernel's ptrace check passes for the same uid, `CAP_SYS_PTRACE` or
//! not), switch back to uid 0 (`CAP_DAC_OVERRIDE` is effective again) and read or create any
//! host file below it: `/proc` must be the host's, for the clients' `/proc/<pid>`. Landlock
//! closes it twice: a Landlock domain may not ptrace, nor pass ptrace's checks on, a process
//! outside it (so `/proc/<pid>/root` of a host process is refused), and its ruleset, one rule
//! granting every file system right of the kernel's ABI beneath the new root `/`, refuses any
//! path that does not lead up to that root (a host path reached through a magic link is in the
//! host's tree). Landlock is made here with its three system calls on stack structs, not with
//! the `landlock` crate: the rule needs a descriptor of the new root, which exists only after
//! `pivot_root` in the child, where nothing may allocate, and the crate's types (its errors,
//! its compatibility state) allocate; the calls are few and their ABI is stable. Best effort
//! as the crate's `CompatLevel::BestEffort` does it: the rights handled are those of the
//! kernel's ABI (asked once, in the agent); a kernel without Landlock (before 5.13, or with it
//! off in `lsm=`) gets a warning in the log, once, and the container without that layer.
//!
//! What Landlock changes for the daemon and the MPS servers it starts (they inherit it), and
//! for the control client calls: no file outside the container, and no ptrace-checked access
//! to host processes: `/proc/<pid>/{environ,maps,mem,fd,cwd,root,exe,ns}` of clients
//! (`status`, `stat`, `cmdline`, `cgroup` stay readable), `ptrace`, `process_vm_readv` and
//! `pidfd_getfd` on them. Before, a server running as a client's non-root user could do those
//! to that client. On ABI 1 kernels (5.13 to 5.18), which lack the right to link or rename
//! into another folder, such a link or rename is refused (`EXDEV`) even inside the container.
//!
//! Why not also seccomp, or fewer capabilities: what the attack needs, the daemon needs or
//! the attack gets another way. `CAP_SETUID` and `CAP_SETGID` start servers as the clients'
//! users; `CAP_DAC_OVERRIDE` and the other file capabilities hand them pipes and files;
//! `/proc` is the clients'. Refusing `setfsuid` and `setfsgid`, or every uid change that keeps
//! a way back to root (seccomp can compare `setresuid`'s arguments), would stop the reviewer's
//! program but not a forked child that becomes the target's user for good, opens
//! `/proc/<pid>/root` and hands the descriptor to its root parent over a Unix socket; and it
//! could break NVIDIA's daemon, which may take a user's ids for a while to make that user's
//! files. So without Landlock the hole stays open, and the warning says so.
//!
//! Why between fork and exec (`Command::pre_exec`) and not by re-executing the agent: the
//! agent's binary need not be reachable or the right one (the library's tests run the
//! supervisor from a test harness), and the steps are plain system calls. Everything the
//! child needs (C strings, flags, the expected device and inode of every source) is built
//! before the fork; the child only makes system calls on it, with no allocation, no locks and
//! nothing but async-signal-safe calls. Sources are re-opened by the child with
//! `O_PATH | O_NOFOLLOW` (they must be opened in the new mount namespace to be bind-mounted
//! from it) and refused unless they are the very inode the agent opened and checked before the
//! fork (the agent holds it open, so it cannot be reused): a link planted in between is not
//! followed. When a step fails, the child writes its number to a pipe, so the error names the
//! step and its paths.

use std::collections::BTreeSet;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{OFlag, open};
use nix::libc;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::stat::{Mode, fstat};

use super::MpsDaemon;
use super::folders::Folders;

/// Where the new root is mounted in the new namespace before `pivot_root` (any folder does:
/// the mount is private to the namespace and the folder is covered, not used).
const NEW_ROOT: &str = "/tmp";

/// The driver root's folders the daemon gets, read-only: the program, the MPS server and the
/// libraries they load.
const DRIVER_DIRS: [&str; 6] = ["usr", "bin", "sbin", "lib", "lib32", "lib64"];
/// The driver root's files the daemon gets, read-only: the loader's cache, for libraries in
/// folders that `/etc/ld.so.conf.d` names.
const DRIVER_FILES: [&str; 1] = ["etc/ld.so.cache"];
/// Device nodes other than the GPUs' own that programs expect.
const PLAIN_DEVICES: [&str; 5] = ["null", "zero", "full", "random", "urandom"];
/// The NVIDIA device nodes the CUDA driver opens (besides `/dev/nvidia<N>`).
const NVIDIA_DEVICES: [&str; 4] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

/// The capabilities root keeps in the container: Docker's default set (in which the MPS
/// control daemon runs in NVIDIA's examples) without `CAP_MKNOD`, `CAP_NET_RAW`,
/// `CAP_SYS_CHROOT`, `CAP_SETPCAP`, `CAP_SETFCAP` and `CAP_NET_BIND_SERVICE`, none of which MPS
/// uses, with `CAP_IPC_LOCK`, `CAP_SYS_NICE` and `CAP_SYS_RESOURCE` that a CUDA process may
/// (pinned memory, priorities, limits). The daemon starts each MPS server as the client's
/// user (`CAP_SETUID`, `CAP_SETGID`), hands it pipes and files (`CAP_CHOWN`, `CAP_FOWNER`,
/// `CAP_FSETID`, `CAP_DAC_OVERRIDE`) and stops servers (`CAP_KILL`).
const KEEP_CAPS: [u32; 11] = [
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    14, // CAP_IPC_LOCK
    23, // CAP_SYS_NICE
    24, // CAP_SYS_RESOURCE
    29, // CAP_AUDIT_WRITE
];

/// One step of the container's setup, as the child makes it.
enum Step {
    Unshare,
    Private,
    /// A tmpfs at `target`.
    Tmpfs {
        target: CString,
        flags: MsFlags,
        data: CString,
    },
    Mkdir(CString),
    /// An empty file, as the mount point of a file or device.
    Touch(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    /// `source` (a host path) bound at `target` (not recursively) if it is still the inode
    /// `(dev, ino)`; then remounted with `flags` (`MS_RDONLY`, `MS_NOSUID`, ...).
    Bind {
        source: CString,
        dev: u64,
        ino: u64,
        dir: bool,
        target: CString,
        flags: MsFlags,
    },
    Pivot,
    /// The new root (the tmpfs) read-only.
    RootReadOnly,
    DropCaps,
    NoNewPrivs,
    /// Landlock: file system access (the `handled` rights) only beneath the new root.
    Landlock {
        handled: u64,
    },
}

/// What the child does before it runs the control program, prepared in the agent.
pub(super) struct Sandbox {
    steps: Arc<Vec<Step>>,
    /// What each step does, for errors.
    described: Vec<String>,
    /// The sources the steps expect, held open so their inodes stay theirs.
    _held: Vec<OwnedFd>,
    /// The control program as the container sees it.
    program: PathBuf,
    /// The env of the daemon and its clients: the folders as the container sees them.
    env: Vec<(String, String)>,
}

impl Sandbox {
    /// The container for `plan`'s daemon: `root` is the agent's `--root`, `driver_root` and
    /// `program` (a host path under it) as the supervisor found them, `folders` the plan's
    /// folders as the agent opened them. `Err` names what could not be prepared.
    pub fn new(
        root: &Path,
        driver_root: &Path,
        program: &Path,
        plan: &MpsDaemon,
        folders: &Folders,
    ) -> Result<Sandbox, String> {
        let inside = program.strip_prefix(driver_root).map_err(|_| {
            format!(
                "{} is not under the driver root {}",
                program.display(),
                driver_root.display()
            )
        })?;
        let mut b = Builder {
            steps: Vec::new(),
            described: Vec::new(),
            held: Vec::new(),
            made: BTreeSet::new(),
        };
        b.push(Step::Unshare, "new mount and UTS namespaces".into());
        b.push(Step::Private, "mount propagation private".into());
        b.push(
            Step::Tmpfs {
                target: cstring(Path::new(NEW_ROOT))?,
                flags: MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                data: cstring(Path::new("mode=0755,size=1m"))?,
            },
            format!("tmpfs at {NEW_ROOT} (the new root)"),
        );
        let read_only = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        let driver = crate::host::rooted(root, driver_root);
        for dir in DRIVER_DIRS {
            let host = driver.join(dir);
            match std::fs::symlink_metadata(&host) {
                Ok(m) if m.file_type().is_symlink() => {
                    let target = std::fs::read_link(&host).map_err(|e| format!("{}: {e}", host.display()))?;
                    b.symlink(&target, Path::new("/").join(dir))?;
                }
                Ok(m) if m.is_dir() => b.bind(&host, &Path::new("/").join(dir), read_only)?,
                _ => {}
            }
        }
        for file in DRIVER_FILES {
            let host = driver.join(file);
            if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_file()) {
                b.bind(&host, &Path::new("/").join(file), read_only)?;
            }
        }
        let devices = crate::host::rooted(root, Path::new("/dev"));
        let device_flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
        let mut names: Vec<String> = PLAIN_DEVICES
            .iter()
            .chain(NVIDIA_DEVICES.iter())
            .map(|s| s.to_string())
            .collect();
        if let Ok(entries) = std::fs::read_dir(&devices) {
            let mut gpus: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.strip_prefix("nvidia")
                        .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()))
                })
                .collect();
            gpus.sort();
            names.extend(gpus);
        }
        b.mkdir_all(Path::new("/dev"))?;
        for name in names {
            let host = devices.join(&name);
            if std::fs::symlink_metadata(&host).is_ok_and(|m| !m.is_dir() && !m.file_type().is_symlink()) {
                b.bind(&host, &Path::new("/dev").join(&name), device_flags)?;
            }
        }
        let pseudo = read_only | MsFlags::MS_NOEXEC;
        for fs in ["/proc", "/sys"] {
            let host = crate::host::rooted(root, Path::new(fs));
            if host.is_dir() {
                b.bind(&host, Path::new(fs), pseudo)?;
            }
        }
        let scratch = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        b.mkdir_all(Path::new("/tmp"))?;
        b.push(
            Step::Tmpfs {
                target: b.inside(Path::new("/tmp"))?,
                flags: scratch,
                data: cstring(Path::new("mode=1777,size=64m"))?,
            },
            "tmpfs at /tmp".into(),
        );
        for (fd, host, inside) in [
            (&folders.pipe, &plan.pipe_dir, plan.pipe_dir.as_path()),
            (&folders.log, &plan.log_dir, plan.log_dir.as_path()),
            (&folders.shm, &plan.shm_dir, Path::new(super::CONTAINER_SHM)),
        ] {
            b.bind_opened(fd, &crate::host::rooted(root, host), inside, scratch)?;
        }
        b.push(Step::Pivot, "pivot_root into the new root, the old one detached".into());
        b.push(Step::RootReadOnly, "the new root read-only".into());
        b.push(Step::DropCaps, "capability bounding set cut".into());
        b.push(Step::NoNewPrivs, "no_new_privs".into());
        if let Some(handled) = landlock_access() {
            b.push(
                Step::Landlock { handled },
                "Landlock: file system access only beneath the new root".into(),
            );
        }
        Ok(Sandbox {
            steps: Arc::new(b.steps),
            described: b.described,
            _held: b.held,
            program: Path::new("/").join(inside),
            env: plan.env(Path::new("/")),
        })
    }

    /// A command that runs the control program in the container with only the env the daemon
    /// needs (its folders, its GPUs, a `PATH` for the MPS server it starts), and a pipe on
    /// which the child reports the step that failed.
    pub fn command(&self) -> Result<(Command, Report), String> {
        let (read, write) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("cannot create a pipe: {}", e.desc()))?;
        let mut command = Command::new(&self.program);
        command
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        let steps = self.steps.clone();
        let report = write.as_raw_fd();
        // The sources' descriptors in the child, one slot per step, allocated before the fork.
        let mut opened: Vec<RawFd> = vec![-1; steps.len()];
        // SAFETY: the closure runs between fork and exec; `run` makes only system calls on what
        // was built before the fork (see the module's doc) and allocates nothing.
        unsafe {
            command.pre_exec(move || run(&steps, &mut opened, report));
        }
        Ok((
            command,
            Report {
                read,
                write: Some(write),
            },
        ))
    }

    /// `error` (from spawning a command of [`Sandbox::command`]) with the step that failed.
    pub fn explain(&self, report: &mut Report, error: &io::Error) -> String {
        report.write = None;
        let mut buf = [0u8; 4];
        let _ = nix::fcntl::fcntl(&report.read, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
        match nix::unistd::read(&report.read, &mut buf) {
            Ok(4) => {
                let step = u32::from_ne_bytes(buf) as usize;
                let what = self.described.get(step).map_or("?", String::as_str);
                format!("cannot contain {}: {what}: {error}", self.program.display())
            }
            _ => format!("cannot run {} in its container: {error}", self.program.display()),
        }
    }
}

/// The read end of a command's report pipe; the write end is closed once the command spawned.
pub(super) struct Report {
    read: OwnedFd,
    write: Option<OwnedFd>,
}

impl Report {
    /// Closes the agent's copy of the write end (after the spawn).
    pub fn spawned(&mut self) {
        self.write = None;
    }
}

struct Builder {
    steps: Vec<Step>,
    described: Vec<String>,
    held: Vec<OwnedFd>,
    /// Folders and mount points already made in the new root.
    made: BTreeSet<PathBuf>,
}

impl Builder {
    fn push(&mut self, step: Step, what: String) {
        self.steps.push(step);
        self.described.push(what);
    }

    /// `inside` (a path in the container) as a path under [`NEW_ROOT`] before the pivot.
    fn inside(&self, inside: &Path) -> Result<CString, String> {
        let rel = inside.strip_prefix("/").unwrap_or(inside);
        cstring(&Path::new(NEW_ROOT).join(rel))
    }

    fn mkdir_all(&mut self, inside: &Path) -> Result<(), String> {
        let mut at = PathBuf::from("/");
        for c in inside.components().skip(1) {
            at.push(c);
            if self.made.insert(at.clone()) {
                let step = Step::Mkdir(self.inside(&at)?);
                self.push(step, format!("mkdir {}", at.display()));
            }
        }
        Ok(())
    }

    fn symlink(&mut self, target: &Path, inside: PathBuf) -> Result<(), String> {
        let step = Step::Symlink {
            target: cstring(target)?,
            link: self.inside(&inside)?,
        };
        self.push(step, format!("link {} -> {}", inside.display(), target.display()));
        self.made.insert(inside);
        Ok(())
    }

    /// Binds `host` (not a link) at `inside`, opening it now to learn its inode.
    fn bind(&mut self, host: &Path, inside: &Path, flags: MsFlags) -> Result<(), String> {
        let oflags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd =
            open(host, oflags, Mode::empty()).map_err(|e| format!("cannot open {}: {}", host.display(), e.desc()))?;
        self.bind_opened(&fd, host, inside, flags)
    }

    /// Binds the host folder or file open as `fd` (at `host`) at `inside`.
    fn bind_opened(&mut self, fd: &OwnedFd, host: &Path, inside: &Path, flags: MsFlags) -> Result<(), String> {
        let stat = fstat(fd.as_fd()).map_err(|e| format!("cannot stat {}: {}", host.display(), e.desc()))?;
        let dir = stat.st_mode & libc::S_IFMT == libc::S_IFDIR;
        if dir {
            self.mkdir_all(inside)?;
        } else {
            if let Some(parent) = inside.parent() {
                self.mkdir_all(parent)?;
            }
            if self.made.insert(inside.to_path_buf()) {
                let step = Step::Touch(self.inside(inside)?);
                self.push(step, format!("mount point {}", inside.display()));
            }
        }
        let held = fd.try_clone().map_err(|e| format!("{}: {e}", host.display()))?;
        self.held.push(held);
        let step = Step::Bind {
            source: cstring(host)?,
            dev: stat.st_dev,
            ino: stat.st_ino,
            dir,
            target: self.inside(inside)?,
            flags,
        };
        let how = if flags.contains(MsFlags::MS_RDONLY) {
            "read-only"
        } else {
            "read-write"
        };
        self.push(step, format!("bind {} {how} at {}", host.display(), inside.display()));
        Ok(())
    }
}

fn cstring(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("{}: a NUL byte in the path", p.display()))
}

/// The child's side: the namespaces, then every bind's source opened (and checked) before the
/// new root covers any of them, then the other steps in order. On failure the step's number
/// goes to `report`. `opened` has a slot per step (the sources' descriptors, `O_CLOEXEC`: exec
/// closes them).
fn run(steps: &[Step], opened: &mut [RawFd], report: RawFd) -> io::Result<()> {
    let fail = |i: usize, e: Errno| {
        let n = (i as u32).to_ne_bytes();
        // SAFETY: write(2) on a descriptor the agent opened for this; async-signal-safe.
        unsafe {
            libc::write(report, n.as_ptr().cast(), n.len());
        }
        io::Error::from_raw_os_error(e as i32)
    };
    let namespaces = steps
        .iter()
        .position(|s| !matches!(s, Step::Unshare | Step::Private))
        .unwrap_or(steps.len());
    for (i, step) in steps.iter().enumerate().take(namespaces) {
        apply(step, -1).map_err(|e| fail(i, e))?;
    }
    for (i, step) in steps.iter().enumerate() {
        if let Step::Bind {
            source, dev, ino, dir, ..
        } = step
        {
            opened[i] = open_source(source, *dev, *ino, *dir).map_err(|e| fail(i, e))?;
        }
    }
    for (i, step) in steps.iter().enumerate().skip(namespaces) {
        apply(step, opened[i]).map_err(|e| fail(i, e))?;
    }
    Ok(())
}

/// Opens `source` without following a link in its last component; refused (`ESTALE`) unless it
/// is still the inode `(dev, ino)` the agent checked.
fn open_source(source: &CStr, dev: u64, ino: u64, dir: bool) -> Result<RawFd, Errno> {
    let mut oflags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    if dir {
        oflags |= OFlag::O_DIRECTORY;
    }
    let fd = open(source, oflags, Mode::empty())?;
    let stat = fstat(fd.as_fd())?;
    if stat.st_dev != dev || stat.st_ino != ino {
        return Err(Errno::ESTALE);
    }
    Ok(std::os::fd::IntoRawFd::into_raw_fd(fd))
}

/// One step; `source` is the bind's source, opened by [`run`].
fn apply(step: &Step, source: RawFd) -> Result<(), Errno> {
    let none: Option<&CStr> = None;
    match step {
        Step::Unshare => unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS),
        Step::Private => mount(none, c"/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none),
        Step::Tmpfs { target, flags, data } => mount(
            Some(c"tmpfs"),
            target.as_c_str(),
            Some(c"tmpfs"),
            *flags,
            Some(data.as_c_str()),
        ),
        Step::Mkdir(path) => match nix::unistd::mkdir(path.as_c_str(), Mode::from_bits_truncate(0o755)) {
            Ok(()) | Err(Errno::EEXIST) => Ok(()),
            Err(e) => Err(e),
        },
        Step::Touch(path) => open(
            path.as_c_str(),
            OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(drop),
        Step::Symlink { target, link } => {
            nix::unistd::symlinkat(target.as_c_str(), nix::fcntl::AT_FDCWD, link.as_c_str())
        }
        Step::Bind { target, flags, .. } => {
            let mut buf = [0u8; 32];
            let via = proc_fd_path(&mut buf, source)?;
            mount(Some(via), target.as_c_str(), none, MsFlags::MS_BIND, none)?;
            mount(
                none,
                target.as_c_str(),
                none,
                MsFlags::MS_REMOUNT | MsFlags::MS_BIND | *flags,
                none,
            )
        }
        Step::Pivot => {
            nix::unistd::chdir(NEW_ROOT)?;
            nix::unistd::pivot_root(c".", c".")?;
            umount2(c".", MntFlags::MNT_DETACH)?;
            nix::unistd::chdir(c"/")
        }
        Step::RootReadOnly => mount(
            none,
            c"/",
            none,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            none,
        ),
        Step::DropCaps => drop_caps(),
        Step::NoNewPrivs => nix::sys::prctl::set_no_new_privs(),
        Step::Landlock { handled } => landlock(*handled),
    }
}

/// `landlock_create_ruleset`'s flag that asks for the ABI version.
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
/// `landlock_add_rule`'s rule type for a `struct landlock_path_beneath_attr`.
const LANDLOCK_RULE_PATH_BENEATH: u32 = 1;
/// The file system access rights of Landlock ABI 1 (Linux 5.13): execute, write, read, read a
/// folder, remove a folder or file, make a character device, folder, regular file, socket,
/// FIFO, block device or symbolic link.
const LANDLOCK_ACCESS_FS_V1: u64 = (1 << 13) - 1;
/// ABI 2 (Linux 5.19): link or rename a file into another folder.
const LANDLOCK_ACCESS_FS_REFER: u64 = 1 << 13;
/// ABI 3 (Linux 6.2): truncate a file.
const LANDLOCK_ACCESS_FS_TRUNCATE: u64 = 1 << 14;
/// ABI 5 (Linux 6.10): `ioctl` on a device.
const LANDLOCK_ACCESS_FS_IOCTL_DEV: u64 = 1 << 15;

/// Every file system access right Landlock ABI `abi` has (of those this agent knows; ABIs 4,
/// 6 and 7 brought network rights, scopes and log flags, none of which is used here).
pub(super) fn landlock_access_for(abi: i64) -> u64 {
    let mut access = LANDLOCK_ACCESS_FS_V1;
    if abi >= 2 {
        access |= LANDLOCK_ACCESS_FS_REFER;
    }
    if abi >= 3 {
        access |= LANDLOCK_ACCESS_FS_TRUNCATE;
    }
    if abi >= 5 {
        access |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
    }
    access
}

/// The file system access rights the container's Landlock ruleset handles on this kernel, or
/// `None` where the kernel lacks Landlock or has it off: asked once, and said once (a warning)
/// in the log then.
fn landlock_access() -> Option<u64> {
    static ACCESS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *ACCESS.get_or_init(|| {
        // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) reads nothing and only answers.
        let abi = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<u8>(),
                0usize,
                LANDLOCK_CREATE_RULESET_VERSION,
            )
        };
        if abi >= 1 {
            return Some(landlock_access_for(abi));
        }
        let why = match Errno::last() {
            Errno::ENOSYS => "this kernel lacks it (Linux 5.13 and later have it)".to_string(),
            Errno::EOPNOTSUPP => "this kernel has it off (add landlock to its lsm= list)".to_string(),
            e => format!("landlock_create_ruleset: {}", e.desc()),
        };
        tracing::warn!(
            "Landlock is unavailable ({why}): the MPS control daemon's container goes without \
             it, and a compromised daemon could reach the host's files through /proc/<pid>/root \
             of a host process"
        );
        None
    })
}

/// Restricts this process, and what it execs and forks, to file system access beneath the
/// current root (the container's, after `pivot_root`): a ruleset handling `handled`, one rule
/// granting all of it beneath `/`. System calls on the stack only, no allocation.
fn landlock(handled: u64) -> Result<(), Errno> {
    // `struct landlock_ruleset_attr` up to its first field, `handled_access_fs`: the kernel
    // takes the size given, so this is the same on every ABI.
    let attr: u64 = handled;
    // SAFETY: the attribute is a u64 on the stack, of the size given.
    let ruleset = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const u64,
            std::mem::size_of::<u64>(),
            0u32,
        )
    };
    let ruleset = RawFd::try_from(ruleset).map_err(|_| Errno::EBADF)?;
    if ruleset < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    let ruleset = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(ruleset) };
    let root = open(
        c"/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    /// `struct landlock_path_beneath_attr`.
    #[repr(C, packed)]
    struct PathBeneath {
        allowed_access: u64,
        parent_fd: i32,
    }
    let beneath = PathBeneath {
        allowed_access: handled,
        parent_fd: root.as_raw_fd(),
    };
    // SAFETY: the rule is a packed struct on the stack, as the kernel reads it.
    let added = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset.as_raw_fd(),
            LANDLOCK_RULE_PATH_BENEATH,
            &beneath as *const PathBeneath,
            0u32,
        )
    };
    if added != 0 {
        return Err(Errno::last());
    }
    // SAFETY: integers only.
    if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// `/proc/self/fd/<fd>` as a C string in `buf`, without allocating.
fn proc_fd_path(buf: &mut [u8; 32], fd: RawFd) -> Result<&CStr, Errno> {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let mut n = u32::try_from(fd).map_err(|_| Errno::EBADF)?;
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[PREFIX.len() + i] = digits[len - 1 - i];
    }
    buf[PREFIX.len() + len] = 0;
    CStr::from_bytes_with_nul(&buf[..=PREFIX.len() + len]).map_err(|_| Errno::EINVAL)
}

/// Cuts the bounding set to [`KEEP_CAPS`] and empties the inheritable and ambient sets, so the
/// program, exec'd as root, gets only those.
fn drop_caps() -> Result<(), Errno> {
    // Every capability the kernel knows, until it says there are no more.
    for cap in 0..64u32 {
        if KEEP_CAPS.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments; async-signal-safe.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        if r != 0 {
            match Errno::last() {
                Errno::EINVAL => break,
                e => return Err(e),
            }
        }
    }
    // SAFETY: as above.
    let r = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    if r != 0 && Errno::last() != Errno::EINVAL {
        return Err(Errno::last());
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capget/capset with a version-3 header and its two data structs, on the stack.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()) != 0 {
            return Err(Errno::last());
        }
        for d in &mut data {
            d.inheritable = 0;
        }
        if libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) != 0 {
            return Err(Errno::last());
        }
    }
    Ok(())
}
