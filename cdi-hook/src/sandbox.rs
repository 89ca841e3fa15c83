//! Runs a host program (the host's `ldconfig`) over a container's root without giving it
//! anything of the host.
//!
//! The hook runs as host root in the container's mount namespace before `pivot_root`. The
//! program is started like this, each step before the next:
//!
//! 1. a child leaves every namespace that could reach the host: new mount, PID, network, IPC and
//!    UTS namespaces (`unshare`), and forks the program's process, PID 1 of the new PID
//!    namespace (so it and anything it starts die together); both die with the hook
//!    (`PR_SET_PDEATHSIG`);
//! 2. mounts become private (nothing propagates back), the container's root is bound onto
//!    itself (with its volumes and the driver's bind mounts, which `ldconfig` must read) and
//!    made the root (`pivot_root`), the old root is detached: no host path exists any more;
//!    the container's kernel file systems are detached too (`proc`, `sysfs`, `cgroup`, the
//!    runtime's `/dev`, ...: at this point runc has mounted `/proc` read-write and not yet masked
//!    it, and a process without capabilities may still write a sysctl), and every mount left is
//!    made `noexec`, `nosuid`, `nodev` (`mount_setattr`, kernels 5.12 and later);
//! 3. resource limits (files, file size, memory, CPU time), standard input from the host's
//!    `/dev/null`, output to a pipe the hook reads (bounded), every other descriptor closed on
//!    exec;
//! 4. every capability dropped (bounding, ambient, effective, permitted and inheritable sets),
//!    `no_new_privs`, and a seccomp filter that refuses the calls a process with no business
//!    outside its root could use to get out or at the kernel (mounts, namespaces also through
//!    `clone` flags, `ptrace`, module loading, `bpf`, `keyctl`, file handles, `io_uring`,
//!    `memfd_create`, x32 system calls, any `exec` but the one that starts the program, ...);
//! 5. `execveat` of the descriptor the hook opened on the host, with an empty environment.
//!
//! The hook waits at most the given time, then kills it. Between `fork` and `exec` only system
//! calls are made on data prepared before the fork (no allocation, no lock).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// The most output of the program kept for an error message.
const MAX_OUTPUT: usize = 16 * 1024;

/// The most bytes of `/proc/self/mountinfo` read.
const MAX_MOUNTINFO: u64 = 8 * 1024 * 1024;

/// Limits of the sandboxed program: open files, bytes of one file it writes, address space,
/// seconds of CPU.
const RLIMIT_NOFILE: u64 = 1024;
const RLIMIT_FSIZE: u64 = 512 * 1024 * 1024;
const RLIMIT_AS: u64 = 4 * 1024 * 1024 * 1024;
const RLIMIT_CPU: u64 = 60;

/// File systems of the container's root that are detached in the sandbox: the kernel's
/// interfaces, none of which `ldconfig` needs and some of which (a read-write, unmasked `/proc`)
/// reach the host.
const DETACHED_TYPES: [&str; 16] = [
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "devpts",
    "devtmpfs",
    "mqueue",
    "securityfs",
    "debugfs",
    "tracefs",
    "bpf",
    "fusectl",
    "configfs",
    "pstore",
    "efivarfs",
    "binfmt_misc",
];

/// The magic numbers of `proc` and `sysfs` (`statfs`), to check they are gone.
const PROC_SUPER_MAGIC: i64 = 0x9fa0;
const SYSFS_MAGIC: i64 = 0x6265_6572;

/// The steps of the child, as reported through the error pipe.
const STEPS: [&str; 14] = [
    "set the parent-death signal",
    "unshare the namespaces",
    "fork into the new PID namespace",
    "make the mounts private",
    "bind the container's root",
    "enter the container's root",
    "pivot_root into the container's root",
    "detach the host's root",
    "set resource limits",
    "set up standard input and output",
    "drop capabilities and install the seccomp filter",
    "execute the program",
    "detach the container's kernel file systems",
    "make the container's mounts noexec, nosuid and nodev",
];

/// The system calls refused (`EPERM`) inside the sandbox: none of them is needed to build a
/// linker cache, and each is a way out of a root or into the kernel.
fn denied_syscalls() -> Vec<i64> {
    let mut calls = vec![
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kexec_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_userfaultfd,
        libc::SYS_open_tree,
        libc::SYS_move_mount,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_setdomainname,
        libc::SYS_sethostname,
        libc::SYS_pidfd_getfd,
        libc::SYS_memfd_create,
        libc::SYS_clone3,
        libc::SYS_execve,
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([libc::SYS_kexec_file_load, libc::SYS_iopl, libc::SYS_ioperm]);
    calls
}

/// The namespace flags `clone` may not be given.
const CLONE_NAMESPACES: [libc::c_int; 8] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWCGROUP,
    0x80, // CLONE_NEWTIME
];

/// The seccomp program: the calls of [`denied_syscalls`] fail with `EPERM`, so does `clone` with
/// a namespace flag; a call of another architecture kills the process (seccompiler's
/// architecture check), and so does an x32 call on x86_64 (same architecture number, bit 30 set
/// in the call number, which seccompiler does not look at); the rest are allowed. The filter is
/// installed right before the `execveat` that starts the program, so exactly that call is let
/// through: the program's descriptor, `AT_EMPTY_PATH`, and the address of the empty path string
/// the hook passes (with a path of its own, `execveat` would ignore the descriptor). Any other
/// `execve`/`execveat` is refused, so the program cannot start another (the mounts are `noexec`
/// as well, where the kernel has `mount_setattr`).
fn filter(program_fd: RawFd, empty_path: *const libc::c_char) -> Result<BpfProgram, String> {
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
    let arch = if cfg!(target_arch = "x86_64") {
        TargetArch::x86_64
    } else if cfg!(target_arch = "aarch64") {
        TargetArch::aarch64
    } else {
        return Err("no seccomp filter for this architecture".to_string());
    };
    let err = |e: seccompiler::BackendError| e.to_string();
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for call in denied_syscalls() {
        rules.insert(call, Vec::new());
    }
    let cond = |arg: u8, op: SeccompCmpOp, value: u64| SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value);
    // A rule matches when all its conditions hold, and the call is refused when any rule matches:
    // execveat is refused unless the descriptor, the path and the flags are all the hook's.
    rules.insert(
        libc::SYS_execveat,
        vec![
            SeccompRule::new(vec![cond(0, SeccompCmpOp::Ne, program_fd as u64).map_err(err)?]).map_err(err)?,
            SeccompRule::new(vec![cond(1, SeccompCmpOp::Ne, empty_path as u64).map_err(err)?]).map_err(err)?,
            SeccompRule::new(vec![
                cond(4, SeccompCmpOp::Ne, libc::AT_EMPTY_PATH as u64).map_err(err)?,
            ])
            .map_err(err)?,
        ],
    );
    let mut clone = Vec::new();
    for flag in CLONE_NAMESPACES {
        let flag = flag as u64;
        clone.push(SeccompRule::new(vec![cond(0, SeccompCmpOp::MaskedEq(flag), flag).map_err(err)?]).map_err(err)?);
    }
    rules.insert(libc::SYS_clone, clone);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| e.to_string())?;
    let compiled = BpfProgram::try_from(filter).map_err(|e| e.to_string())?;
    Ok(if cfg!(target_arch = "x86_64") {
        // Load the call number; at or above the x32 bit, kill; else go on with seccompiler's
        // program (which loads what it needs itself).
        let mut program = vec![
            bpf_stmt((libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, 0),
            bpf_jump((libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16, 0x4000_0000, 0, 1),
            bpf_stmt((libc::BPF_RET | libc::BPF_K) as u16, libc::SECCOMP_RET_KILL_PROCESS),
        ];
        program.extend(compiled);
        program
    } else {
        compiled
    })
}

fn bpf_stmt(code: u16, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter { code, jt: 0, jf: 0, k }
}

fn bpf_jump(code: u16, k: u32, jt: u8, jf: u8) -> seccompiler::sock_filter {
    seccompiler::sock_filter { code, jt, jf, k }
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    Ok((r, w))
}

/// `mountinfo`'s escapes (`\040` for a space, ...) undone.
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The mounts under `root` (a canonical host path) to detach in the sandbox, as paths in the
/// container, deepest first: those of [`DETACHED_TYPES`], and `/dev` with all below it (the
/// runtime's, holding the container's device nodes).
pub fn mounts_to_detach(mountinfo: &str, root: &[u8]) -> Vec<Vec<u8>> {
    let mut found: Vec<Vec<u8>> = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        let fstype = right.split(' ').next().unwrap_or("");
        let point = unescape(point);
        let Some(rest) = point.strip_prefix(root) else {
            continue;
        };
        if !rest.starts_with(b"/") {
            continue;
        }
        let dev = rest == b"/dev" || rest.starts_with(b"/dev/");
        if (dev || DETACHED_TYPES.contains(&fstype)) && !found.iter().any(|f| f.as_slice() == rest) {
            found.push(rest.to_vec());
        }
    }
    found.sort_by_key(|p| std::cmp::Reverse(p.iter().filter(|c| **c == b'/').count()));
    found
}

/// Everything the sandbox's processes use, prepared before the fork (nothing is allocated after
/// it).
struct Prepared<'a> {
    parent: i32,
    root: &'a CStr,
    detach: &'a [*const libc::c_char],
    program_fd: RawFd,
    empty_path: *const libc::c_char,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char; 1],
    prog: &'a libc::sock_fprog,
    null_fd: RawFd,
    out_fd: RawFd,
    err_fd: RawFd,
}

/// The empty path `execveat` gets; its address is what the seccomp filter lets through.
static EMPTY_PATH: &CStr = c"";

/// Runs `program` (an open host executable) with `args` (`args[0]` is its name) in the sandbox
/// over `rootfs` (the container's root, a host path), waiting at most `timeout`. An error says
/// which step failed, or how the program ended with the end of its output.
pub fn run(program: &File, args: &[OsString], rootfs: &Path, timeout: Duration) -> Result<(), String> {
    // Everything the child needs, prepared before the fork.
    let argv_c: Vec<CString> = args
        .iter()
        .map(|a| CString::new(a.as_bytes()).map_err(|_| format!("argument {a:?} has a NUL byte")))
        .collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let canonical = std::fs::canonicalize(rootfs).map_err(|e| format!("container root {}: {e}", rootfs.display()))?;
    let root_c = CString::new(canonical.as_os_str().as_bytes())
        .map_err(|_| format!("container root {} has a NUL byte", rootfs.display()))?;
    let mut mountinfo = String::new();
    File::open("/proc/self/mountinfo")
        .and_then(|f| f.take(MAX_MOUNTINFO).read_to_string(&mut mountinfo))
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let detach_c: Vec<CString> = mounts_to_detach(&mountinfo, canonical.as_os_str().as_bytes())
        .into_iter()
        .filter_map(|p| CString::new(p).ok())
        .collect();
    let mut detach: Vec<*const libc::c_char> = detach_c.iter().map(|p| p.as_ptr()).collect();
    detach.push(std::ptr::null());
    let program_fd = program.as_raw_fd();
    let empty_path = EMPTY_PATH.as_ptr();
    let bpf = filter(program_fd, empty_path)?;
    let prog = libc::sock_fprog {
        len: u16::try_from(bpf.len()).map_err(|_| "seccomp filter too long".to_string())?,
        filter: bpf.as_ptr() as *mut libc::sock_filter,
    };
    let null = File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    let (err_r, err_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let prepared = Prepared {
        parent: rustix::process::getpid().as_raw_nonzero().get(),
        root: &root_c,
        detach: &detach,
        program_fd,
        empty_path,
        argv: &argv,
        envp: &envp,
        prog: &prog,
        null_fd: null.as_raw_fd(),
        out_fd: out_w.as_raw_fd(),
        err_fd: err_w.as_raw_fd(),
    };

    // SAFETY: fork in a process of one thread (the hook program), or one whose other threads
    // take no lock the child needs: the child makes only system calls on the data above and
    // ends in exec or _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: see above; `child` never returns.
        unsafe { child(&prepared) }
    }
    drop(err_w);
    drop(out_w);
    drop(null);
    wait(pid, out_r, err_r, timeout)
}

/// Waits for the child `pid`, keeping the first [`MAX_OUTPUT`] bytes of its output, killing it
/// after `timeout`.
fn wait(pid: libc::pid_t, out_r: OwnedFd, err_r: OwnedFd, timeout: Duration) -> Result<(), String> {
    let _ = rustix::fs::fcntl_setfl(&out_r, rustix::fs::OFlags::NONBLOCK);
    let mut out = File::from(out_r);
    let mut output = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + timeout;
    let mut drain = |output: &mut Vec<u8>| {
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            let room = MAX_OUTPUT.saturating_sub(output.len());
            output.extend_from_slice(&buf[..n.min(room)]);
        }
    };
    let status = loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break status;
        }
        if r < 0 {
            return Err(format!("waiting for it: {}", std::io::Error::last_os_error()));
        }
        drain(&mut output);
        if Instant::now() >= deadline {
            // SAFETY: our own child; its child dies with it (parent-death signal, PID 1).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Err(format!("did not finish within {} s", timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    drain(&mut output);
    let mut report = [0u8; 8];
    let mut err = File::from(err_r);
    if err.read_exact(&mut report).is_ok() {
        let step = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]) as usize;
        let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
        return Err(format!(
            "the sandbox could not {}: {}",
            STEPS.get(step).copied().unwrap_or("start"),
            std::io::Error::from_raw_os_error(errno)
        ));
    }
    let text = String::from_utf8_lossy(&output);
    let text = text.trim();
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        return Ok(());
    }
    let how = if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status}")
    };
    // The PID-namespace child reports its program's death by a signal as 128 + the signal.
    Err(if text.is_empty() { how } else { format!("{how}: {text}") })
}

/// Reports `step` and the current errno on `err_fd`, then exits.
unsafe fn fail(err_fd: RawFd, step: u32) -> ! {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let mut report = [0u8; 8];
    report[..4].copy_from_slice(&step.to_ne_bytes());
    report[4..].copy_from_slice(&errno.to_ne_bytes());
    // SAFETY: write and _exit are async-signal-safe.
    unsafe {
        libc::write(err_fd, report.as_ptr().cast(), report.len());
        libc::_exit(127)
    }
}

/// The forked child: namespaces, then the program's process as PID 1 of the new PID namespace.
unsafe fn child(p: &Prepared) -> ! {
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            fail(p.err_fd, 0);
        }
        if libc::getppid() != p.parent {
            libc::_exit(126);
        }
        let flags =
            libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
        if libc::unshare(flags) != 0 {
            fail(p.err_fd, 1);
        }
        let inner = libc::fork();
        if inner < 0 {
            fail(p.err_fd, 2);
        }
        if inner > 0 {
            // The namespace holder: waits for the program and exits as it did.
            let mut status = 0;
            loop {
                let r = libc::waitpid(inner, &mut status, 0);
                if r == inner {
                    break;
                }
                if r < 0 && *libc::__errno_location() != libc::EINTR {
                    libc::_exit(125);
                }
            }
            if libc::WIFEXITED(status) {
                libc::_exit(libc::WEXITSTATUS(status));
            }
            libc::_exit(128 + libc::WTERMSIG(status));
        }
        program(p)
    }
}

/// Whether the file system at `path` has the magic number `magic`.
unsafe fn is_fs(path: &CStr, magic: i64) -> bool {
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(path.as_ptr(), &mut st) == 0 && st.f_type as i64 == magic
    }
}

/// PID 1 of the new namespaces: into the container's root, its kernel file systems detached,
/// every privilege dropped, exec.
unsafe fn program(p: &Prepared) -> ! {
    unsafe {
        let err_fd = p.err_fd;
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            fail(err_fd, 0);
        }
        let none: *const libc::c_char = std::ptr::null();
        if libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            fail(err_fd, 3);
        }
        if libc::mount(
            p.root.as_ptr(),
            p.root.as_ptr(),
            none,
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ) != 0
        {
            fail(err_fd, 4);
        }
        if libc::chdir(p.root.as_ptr()) != 0 {
            fail(err_fd, 5);
        }
        if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0 {
            fail(err_fd, 6);
        }
        if libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
            fail(err_fd, 7);
        }
        // The container's kernel file systems, deepest first. A mount already gone with its
        // parent is not there any more (EINVAL, ENOENT).
        let mut at = p.detach.as_ptr();
        while !(*at).is_null() {
            if libc::umount2(*at, libc::MNT_DETACH) != 0 {
                let errno = *libc::__errno_location();
                if errno != libc::EINVAL && errno != libc::ENOENT {
                    fail(err_fd, 12);
                }
            }
            at = at.add(1);
        }
        if is_fs(c"/proc", PROC_SUPER_MAGIC) || is_fs(c"/sys", SYSFS_MAGIC) {
            *libc::__errno_location() = libc::EBUSY;
            fail(err_fd, 12);
        }
        // Everything left noexec, nosuid, nodev. Kernels before 5.12 have no mount_setattr: the
        // seccomp filter still refuses every exec but the program's.
        #[repr(C)]
        struct MountAttr {
            attr_set: u64,
            attr_clr: u64,
            propagation: u64,
            userns_fd: u64,
        }
        const MOUNT_ATTR_NOSUID: u64 = 0x2;
        const MOUNT_ATTR_NODEV: u64 = 0x4;
        const MOUNT_ATTR_NOEXEC: u64 = 0x8;
        const AT_RECURSIVE: libc::c_int = 0x8000;
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        if libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        ) != 0
            && *libc::__errno_location() != libc::ENOSYS
        {
            fail(err_fd, 13);
        }
        for (resource, limit) in [
            (libc::RLIMIT_NOFILE, RLIMIT_NOFILE),
            (libc::RLIMIT_FSIZE, RLIMIT_FSIZE),
            (libc::RLIMIT_AS, RLIMIT_AS),
            (libc::RLIMIT_CPU, RLIMIT_CPU),
            (libc::RLIMIT_CORE, 0),
        ] {
            let rlim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(resource, &rlim) != 0 {
                fail(err_fd, 8);
            }
        }
        if libc::dup2(p.null_fd, 0) < 0 || libc::dup2(p.out_fd, 1) < 0 || libc::dup2(p.out_fd, 2) < 0 {
            fail(err_fd, 9);
        }
        // Every descriptor above 2 is closed on exec (the error pipe too: exec closes it, which
        // tells the hook the program started). ENOSYS on kernels before 5.11: the hook's own
        // descriptors are close-on-exec already.
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
        if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 {
            fail(err_fd, 10);
        }
        for cap in 0..64 {
            // EINVAL past the last capability the kernel knows.
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        #[repr(C)]
        struct CapHeader {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct CapData {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let header = CapHeader {
            version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
            pid: 0,
        };
        let data = [
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
            fail(err_fd, 10);
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            fail(err_fd, 10);
        }
        if libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            p.prog as *const libc::sock_fprog,
        ) != 0
        {
            fail(err_fd, 10);
        }
        libc::syscall(
            libc::SYS_execveat,
            p.program_fd,
            p.empty_path,
            p.argv.as_ptr(),
            p.envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
        fail(err_fd, 11)
    }
}
