//! gpu-node-agent's CDI hooks: what a node without the NVIDIA Container Toolkit needs so that a
//! container given a GPU through CDI gets a working CUDA.
//!
//! The agent's CDI spec names these as OCI `createContainer` hooks of the program
//! `gpu-node-agent-cdi-hook`. runc and crun run them as **host root**, with every capability, in
//! the container's mount namespace **before `pivot_root`** (the host's files still visible), with
//! the container's root file system as the working directory and the OCI state
//! (`{"bundle": …}`) on standard input — while that root file system is an untrusted image. So:
//!
//! - **No inherited environment.** The spec gives every hook an explicit `env`, and this program
//!   is linked statically (the packages build it with `crt-static`): there is no dynamic loader
//!   to honour an image's `LD_PRELOAD` or `LD_LIBRARY_PATH` even when a runtime ignores the
//!   spec's `env`. The program reads no environment variable, and starts nothing with one.
//! - **Nothing of the image is executed.** `update-ldcache` runs the *host's* statically linked
//!   `ldconfig`, opened from a root-owned host path before the container is looked at, executed
//!   from that descriptor inside a sandbox: new mount, PID, network, IPC and UTS namespaces,
//!   `pivot_root` into the container's root, no capabilities, `no_new_privs`, a seccomp filter,
//!   resource limits and a time limit ([`sandbox`]).
//! - **Paths resolve inside the root, by descriptor** ([`inroot`]): no path in the container is
//!   walked as a string on the host; creates, writes, links and renames act on folder handles.
//! - **Only regular files are read**, without blocking and with a size cap; nothing is written
//!   through a FIFO or a device: files are replaced by rename.
//! - **Bounded.** Each hook ends within [`HOOK_TIMEOUT`]; a hook that cannot do its job exits 1
//!   with a message naming the file and the reason, and the runtime then refuses the container.
//!
//! The hooks:
//! - `create-symlinks --link <target>::<path>`: the soname links the driver's libraries need in
//!   the container (`libcuda.so.1 -> libcuda.so.<version>`): CDI bind-mounts files, not links.
//! - `update-ldcache --folder <dir>`: the folders into the container's `ld.so.conf.d`, then the
//!   host's `ldconfig` in the sandbox over the container's root, so `dlopen("libcuda.so.1")`
//!   finds them (also in images that ship no `ldconfig`).
//! - `enable-cuda-compat --host-driver-version <v>`: when the image ships CUDA
//!   forward-compatibility libraries (`/usr/local/cuda/compat/libcuda.so.<v>`) newer than the host
//!   driver, that folder goes first in the container's library search.
//! - `disable-device-node-modification`: the container sees `ModifyDeviceFiles: 0` in
//!   `/proc/driver/nvidia/params` (a read-only bind mount of a copy), so CUDA in the container
//!   does not try to create device nodes it was not given.

pub mod inroot;
pub mod ldcache;
pub mod sandbox;

use std::ffi::OsString;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use inroot::{InRoot, Kind};

/// The program's name, as the spec's hooks name it.
pub const PROGRAM: &str = "gpu-node-agent-cdi-hook";

/// The longest a hook may take, all of it; then it fails (`SIGALRM` in the program).
pub const HOOK_TIMEOUT: Duration = Duration::from_secs(45);

/// How long the host's `ldconfig` may run in its sandbox before it is killed and the hook fails.
pub const LDCONFIG_TIMEOUT: Duration = Duration::from_secs(30);

/// The most bytes read of the OCI state on standard input (it is a few hundred).
pub const MAX_STATE: u64 = 1024 * 1024;

/// The most bytes read of the bundle's `config.json`.
pub const MAX_BUNDLE_CONFIG: u64 = 16 * 1024 * 1024;

/// The most bytes read of a small text file in the container (`ld.so.conf` files, the driver's
/// parameters).
pub const MAX_TEXT: u64 = 1024 * 1024;

/// The `ld.so.conf.d` file `update-ldcache` writes in the container, so a later `ldconfig` in the
/// container keeps the driver's folders.
pub const LDCACHE_CONF: &str = "/etc/ld.so.conf.d/00-gpu-node-agent.conf";

/// The `ld.so.conf.d` file `enable-cuda-compat` writes; it sorts before [`LDCACHE_CONF`], and
/// `update-ldcache` puts its folders first.
pub const CUDA_COMPAT_CONF: &str = "/etc/ld.so.conf.d/00-gpu-node-agent-cuda-compat.conf";

/// The CUDA forward-compatibility folder of NVIDIA's CUDA images.
pub const CUDA_COMPAT_DIR: &str = "/usr/local/cuda/compat";

/// The driver's parameters, read by CUDA to decide whether it may create device nodes.
pub const DRIVER_PARAMS: &str = "/proc/driver/nvidia/params";

/// The environment every hook in the agent's specs gets (the spec's `env`), so that no hook
/// inherits the container's: exactly what NVIDIA's own specs give their hooks since the fix for
/// CVE-2025-23266, so the toolkit's hooks behave as under NVIDIA's spec. This program reads no
/// variable at all.
pub const HOOK_ENV: [&str; 1] = ["NVIDIA_CTK_DEBUG=false"];

/// A hook and its arguments, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hook {
    /// `create-symlinks`: `(target, link path)` pairs.
    CreateSymlinks { links: Vec<(String, PathBuf)> },
    /// `update-ldcache`: the folders, and optionally the host's `ldconfig` to use.
    UpdateLdcache {
        folders: Vec<PathBuf>,
        ldconfig: Option<PathBuf>,
    },
    /// `enable-cuda-compat`: the host driver's version.
    EnableCudaCompat { host_driver_version: String },
    /// `disable-device-node-modification`.
    DisableDeviceNodeModification,
}

impl Hook {
    /// The hook's name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Hook::CreateSymlinks { .. } => "create-symlinks",
            Hook::UpdateLdcache { .. } => "update-ldcache",
            Hook::EnableCudaCompat { .. } => "enable-cuda-compat",
            Hook::DisableDeviceNodeModification => "disable-device-node-modification",
        }
    }
}

/// Why a hook failed. Each names the path or input it is about.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("{0}")]
    Usage(String),
    #[error("reading the OCI state from standard input: {0}")]
    ReadState(io::Error),
    #[error("the OCI state on standard input is not valid: {0}")]
    BadState(String),
    #[error("{}: {reason}", path.display())]
    At { path: PathBuf, reason: String },
    #[error("--link {0:?}: expected <target>::<absolute path in the container>")]
    BadLink(String),
    #[error("{}: expected an absolute path in the container", .0.display())]
    NotAbsolute(PathBuf),
    #[error("{} is a folder in the container; no link to {target:?} made", path.display())]
    LinkExists { path: PathBuf, target: String },
    #[error("the host's {} failed: {message}", ldconfig.display())]
    Ldconfig { ldconfig: PathBuf, message: String },
    #[error("--host-driver-version {0:?}: expected a driver version such as 550.54.15")]
    BadVersion(String),
    #[error("mounting over {}: {reason}", path.display())]
    Mount { path: PathBuf, reason: String },
}

impl HookError {
    /// An error about `path`.
    pub fn at(path: &Path, reason: String) -> HookError {
        HookError::At {
            path: path.to_path_buf(),
            reason,
        }
    }
}

/// Parses one `--link <target>::<path>` argument.
pub fn parse_link(arg: &str) -> Result<(String, PathBuf), HookError> {
    let bad = || HookError::BadLink(arg.to_string());
    let (target, path) = arg.split_once("::").ok_or_else(bad)?;
    if target.is_empty() || target.contains('\0') || !path.starts_with('/') || path.ends_with('/') {
        return Err(bad());
    }
    Ok((target.to_string(), PathBuf::from(path)))
}

/// The usage text of the program.
pub const USAGE: &str = "usage: gpu-node-agent-cdi-hook <hook> [options] < OCI state
hooks:
  create-symlinks --link <target>::<path in the container> ...
  update-ldcache --folder <folder in the container> ... [--ldconfig-path <host path>]
  enable-cuda-compat --host-driver-version <version>
  disable-device-node-modification
Run by the container runtime as a CDI createContainer hook of gpu-node-agent's spec.
Exit 0: done; 1: failed (the runtime refuses the container); 2: usage.";

/// Parses the command line after the program name: `<hook> [options]`. Options take their value
/// as the next argument or after `=`.
pub fn parse_args(args: &[OsString]) -> Result<Hook, HookError> {
    let usage = |what: String| HookError::Usage(format!("{what}\n{USAGE}"));
    let mut args = args.iter().map(|a| {
        a.to_str()
            .map(str::to_string)
            .ok_or_else(|| usage(format!("argument {a:?} is not UTF-8")))
    });
    let name = args.next().ok_or_else(|| usage("no hook named".into()))??;
    let mut options: Vec<(String, String)> = Vec::new();
    while let Some(arg) = args.next() {
        let arg = arg?;
        let Some(flag) = arg.strip_prefix("--") else {
            return Err(usage(format!("unexpected argument {arg:?}")));
        };
        let (key, value) = match flag.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => {
                let value = args.next().ok_or_else(|| usage(format!("--{flag} needs a value")))??;
                (flag.to_string(), value)
            }
        };
        options.push((key, value));
    }
    let allowed: &[&str] = match name.as_str() {
        "create-symlinks" => &["link"],
        "update-ldcache" => &["folder", "ldconfig-path"],
        "enable-cuda-compat" => &["host-driver-version"],
        "disable-device-node-modification" => &[],
        other => return Err(usage(format!("unknown hook {other:?}"))),
    };
    if let Some((key, _)) = options.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
        return Err(usage(format!("{name}: unknown option --{key}")));
    }
    let all = |key: &'static str| options.iter().filter(move |(k, _)| k == key).map(|(_, v)| v.clone());
    Ok(match name.as_str() {
        "create-symlinks" => Hook::CreateSymlinks {
            links: all("link").map(|l| parse_link(&l)).collect::<Result<_, _>>()?,
        },
        "update-ldcache" => Hook::UpdateLdcache {
            folders: all("folder").map(PathBuf::from).collect(),
            ldconfig: all("ldconfig-path").next_back().map(PathBuf::from),
        },
        "enable-cuda-compat" => Hook::EnableCudaCompat {
            host_driver_version: all("host-driver-version")
                .next_back()
                .ok_or_else(|| usage("enable-cuda-compat needs --host-driver-version".into()))?,
        },
        _ => Hook::DisableDeviceNodeModification,
    })
}

/// Runs `hook` for the container whose OCI state is read from `state`.
pub fn run(hook: &Hook, state: impl Read) -> Result<(), HookError> {
    let root = container_root(state)?;
    run_in(hook, &root)
}

/// Runs `hook` on the container root file system at `root` (a host path).
pub fn run_in(hook: &Hook, root: &Path) -> Result<(), HookError> {
    // Arguments are checked before anything is opened.
    match hook {
        Hook::EnableCudaCompat { host_driver_version } if major(host_driver_version).is_none() => {
            return Err(HookError::BadVersion(host_driver_version.clone()));
        }
        Hook::UpdateLdcache { folders, .. } => {
            if let Some(bad) = folders.iter().find(|f| !f.is_absolute()) {
                return Err(HookError::NotAbsolute(bad.clone()));
            }
        }
        _ => {}
    }
    match hook {
        Hook::UpdateLdcache { folders, ldconfig } => {
            // The host's ldconfig is opened before the container is looked at.
            let program = ldcache::host_ldconfig(ldconfig.as_deref())?;
            let rootfs = InRoot::open(root)?;
            ldcache::update(&rootfs, root, folders, &program)
        }
        Hook::CreateSymlinks { links } => {
            let rootfs = InRoot::open(root)?;
            for (target, link) in links {
                rootfs.symlink(target, link)?;
            }
            Ok(())
        }
        Hook::EnableCudaCompat { host_driver_version } => enable_cuda_compat(&InRoot::open(root)?, host_driver_version),
        Hook::DisableDeviceNodeModification => disable_device_node_modification(&InRoot::open(root)?),
    }
}

#[derive(Deserialize)]
struct State {
    bundle: String,
}

#[derive(Deserialize)]
struct BundleConfig {
    root: Option<BundleRoot>,
}

#[derive(Deserialize)]
struct BundleRoot {
    path: String,
}

/// The container's root file system (a host path): `root.path` of `<bundle>/config.json`,
/// relative to the bundle unless absolute. The state comes from the runtime and the bundle from
/// the engine (both trusted), but both are read with a size cap.
pub fn container_root(state: impl Read) -> Result<PathBuf, HookError> {
    let mut text = String::new();
    state
        .take(MAX_STATE)
        .read_to_string(&mut text)
        .map_err(HookError::ReadState)?;
    let state: State = serde_json::from_str(&text).map_err(|e| HookError::BadState(e.to_string()))?;
    if !state.bundle.starts_with('/') {
        return Err(HookError::BadState(format!(
            "bundle {:?} is not an absolute path",
            state.bundle
        )));
    }
    let bundle = PathBuf::from(&state.bundle);
    let config_path = bundle.join("config.json");
    let bytes = read_host_file(&config_path, MAX_BUNDLE_CONFIG)?;
    let config: BundleConfig =
        serde_json::from_slice(&bytes).map_err(|e| HookError::at(&config_path, e.to_string()))?;
    let Some(root) = config.root.filter(|r| !r.path.is_empty()) else {
        return Err(HookError::at(&config_path, "no root.path".to_string()));
    };
    Ok(bundle.join(root.path))
}

/// A regular host file (no FIFO or device is opened for reading), at most `cap` bytes.
fn read_host_file(path: &Path, cap: u64) -> Result<Vec<u8>, HookError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| HookError::at(path, e.to_string()))?;
    inroot::read_capped(file, path, cap)
}

/// The major version of a driver version (`550` of `550.54.15`).
fn major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// `enable-cuda-compat`: if the container has `libcuda.so.<v>` in [`CUDA_COMPAT_DIR`] with a
/// major version above the host driver's, writes [`CUDA_COMPAT_CONF`] naming that folder (which
/// `update-ldcache` then puts first). Otherwise nothing: an older compat library must never
/// shadow the host driver.
fn enable_cuda_compat(root: &InRoot, host_driver_version: &str) -> Result<(), HookError> {
    let host_major = major(host_driver_version).ok_or_else(|| HookError::BadVersion(host_driver_version.into()))?;
    let Some(names) = root.list(Path::new(CUDA_COMPAT_DIR))? else {
        return Ok(());
    };
    let newest = names
        .iter()
        .filter_map(|name| name.to_str())
        .filter_map(|name| name.strip_prefix("libcuda.so.").and_then(major))
        .max();
    match newest {
        Some(compat) if compat > host_major => root.write(
            Path::new(CUDA_COMPAT_CONF),
            format!("# CUDA forward compatibility (libcuda {compat} over driver {host_driver_version}), added by gpu-node-agent.\n{CUDA_COMPAT_DIR}\n").as_bytes(),
            0o644,
        ),
        _ => Ok(()),
    }
}

/// `disable-device-node-modification`: when the container sees the driver's parameters, a copy
/// with `ModifyDeviceFiles: 0` is bind-mounted read-only over them. The target is resolved inside
/// the root and mounted on through its descriptor (`/proc/self/fd/<n>`), so a link or a swapped
/// folder cannot move the mount onto a host file. The copy is written to a small tmpfs on a
/// private temporary folder, made read-only before it is bound, and detached again once the bind
/// mount holds the file, so nothing is left on disk. A container without them (no driver) is
/// left alone.
fn disable_device_node_modification(root: &InRoot) -> Result<(), HookError> {
    use rustix::mount::{MountFlags, UnmountFlags};
    let params = Path::new(DRIVER_PARAMS);
    let Some((target, kind)) = root.resolve(params)? else {
        return Ok(());
    };
    if kind != Kind::File {
        return Err(HookError::at(
            params,
            format!(
                "expected the driver's parameters file, found {}",
                inroot::describe(kind)
            ),
        ));
    }
    let text = String::from_utf8_lossy(&inroot::read_handle(&target, params, MAX_TEXT)?).into_owned();
    if !text.lines().any(|l| l.trim() == "ModifyDeviceFiles: 1") {
        return Ok(());
    }
    let changed: String = text
        .lines()
        .map(|l| {
            if l.trim() == "ModifyDeviceFiles: 1" {
                "ModifyDeviceFiles: 0"
            } else {
                l
            }
        })
        .flat_map(|l| [l, "\n"])
        .collect();
    let mount_err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: rustix::io::Errno| HookError::Mount {
            path,
            reason: io::Error::from(e).to_string(),
        }
    };
    let scratch = scratch_dir()?;
    let dir = scratch.path.as_path();
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    rustix::mount::mount("tmpfs", dir, "tmpfs", flags, c"size=64k,mode=0755").map_err(mount_err(dir))?;
    let copy = dir.join("params");
    let target_fd = format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(&target))
    );
    let bound = std::fs::write(&copy, changed)
        .map_err(|e| HookError::at(&copy, e.to_string()))
        .and_then(|()| {
            // Read-only at the superblock, so the bind mount of the copy is read-only too.
            rustix::mount::mount_remount(dir, flags | MountFlags::RDONLY, c"").map_err(mount_err(dir))
        })
        .and_then(|()| rustix::mount::mount_bind(&copy, target_fd.as_str()).map_err(mount_err(params)));
    // The bind mount keeps the file; the tmpfs itself goes (the folder with `scratch`).
    let detached = rustix::mount::unmount(dir, UnmountFlags::DETACH).map_err(mount_err(dir));
    bound.and(detached)
}

/// A private folder (mode 0700, a new random name) in the host's `/tmp`, removed on drop.
struct Scratch {
    path: PathBuf,
}

fn scratch_dir() -> Result<Scratch, HookError> {
    for attempt in 0..16u32 {
        let path = PathBuf::from(format!(
            "/tmp/gpu-node-agent-params-{}-{}-{attempt}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        ));
        match rustix::fs::mkdir(&path, rustix::fs::Mode::from_raw_mode(0o700)) {
            Ok(()) => return Ok(Scratch { path }),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(HookError::at(&path, io::Error::from(e).to_string())),
        }
    }
    Err(HookError::at(
        Path::new("/tmp"),
        "no scratch folder could be made".into(),
    ))
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.path);
    }
}

#[cfg(test)]
mod tests;
