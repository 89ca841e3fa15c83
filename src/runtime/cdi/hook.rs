//! `gpu-node-agent cdi hook <name>`: the agent as its own CDI hook, so that a node without the
//! NVIDIA Container Toolkit still gives containers a working CUDA.
//!
//! The CDI spec names these as OCI `createContainer` hooks. The runtime (runc, crun) runs them
//! after the container's mounts are set up and before it pivots into the root file system, in
//! the container's mount namespace, with the OCI state (`{"bundle": …}`) on standard input. The
//! container's root is `root.path` of `<bundle>/config.json`. What each hook does:
//!
//! - `create-symlinks --link <target>::<path>`: the soname links the driver's libraries need in
//!   the container (`libcuda.so.1 -> libcuda.so.<version>`): CDI bind-mounts files, not links.
//! - `update-ldcache --folder <dir>`: runs the container's own `ldconfig`, chrooted into the
//!   container, over the mounted library folders, so `dlopen("libcuda.so.1")` finds them. Never
//!   the host's `ldconfig`: the cache must match the container's C library.
//! - `enable-cuda-compat --host-driver-version <v>`: when the image ships CUDA
//!   forward-compatibility libraries (`/usr/local/cuda/compat/libcuda.so.<v>`) newer than the host
//!   driver, puts that folder first in the container's library search.
//! - `disable-device-node-modification`: hides `ModifyDeviceFiles: 1` of
//!   `/proc/driver/nvidia/params` from the container (a read-only bind mount of a copy that says
//!   `0`), so CUDA in the container does not try to create device nodes it was not given.
//!
//! Every path in the container is resolved inside its root: a symlink in the image cannot point a
//! hook at a host file. A hook that cannot do its job exits non-zero with a message naming the
//! path, and the runtime then refuses to start the container (fail closed); the one exception is
//! a container with no `ldconfig` at all (distroless, static images): `update-ldcache` says so on
//! standard error and succeeds, because such images find libraries by their default paths only.

use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

/// The most bytes read of the OCI state on standard input (it is a few hundred).
const MAX_STATE: u64 = 1024 * 1024;

/// How many symlinks one path may pass through, as the kernel's `MAXSYMLINKS`.
const MAX_SYMLINKS: usize = 40;

/// How long the container's `ldconfig` may run before it is killed and the hook fails.
pub const LDCONFIG_TIMEOUT: Duration = Duration::from_secs(30);

/// Where `ldconfig` is looked for in the container, first match wins. Ubuntu's `/sbin/ldconfig` is
/// a shell wrapper around `ldconfig.real`, which is used directly when present.
pub const LDCONFIG_CANDIDATES: [&str; 4] = [
    "/sbin/ldconfig.real",
    "/sbin/ldconfig",
    "/usr/sbin/ldconfig.real",
    "/usr/sbin/ldconfig",
];

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

/// A hook and its arguments, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hook {
    /// `create-symlinks`: `(target, link path)` pairs.
    CreateSymlinks { links: Vec<(String, PathBuf)> },
    /// `update-ldcache`: the folders, and optionally the container's `ldconfig` to use.
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
    #[error("reading the OCI state from standard input: {0}")]
    ReadState(io::Error),
    #[error("the OCI state on standard input is not valid: {0}")]
    BadState(String),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
    #[error("--link {0:?}: expected <target>::<absolute path in the container>")]
    BadLink(String),
    #[error("{}: expected an absolute path in the container", .0.display())]
    NotAbsolute(PathBuf),
    #[error("{}: too many levels of symbolic links in the container", .0.display())]
    SymlinkLoop(PathBuf),
    #[error("{} is a directory in the container; no link to {target:?} made", path.display())]
    LinkExists { path: PathBuf, target: String },
    #[error("the container's {} failed: {message}", ldconfig.display())]
    Ldconfig { ldconfig: PathBuf, message: String },
    #[error("--host-driver-version {0:?}: expected a driver version such as 550.54.15")]
    BadVersion(String),
    #[error("mounting over {}: {source}", path.display())]
    Mount { path: PathBuf, source: nix::Error },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> HookError + '_ {
    move |source| HookError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Parses one `--link <target>::<path>` argument.
pub fn parse_link(arg: &str) -> Result<(String, PathBuf), HookError> {
    let bad = || HookError::BadLink(arg.to_string());
    let (target, path) = arg.split_once("::").ok_or_else(bad)?;
    if target.is_empty() || !path.starts_with('/') || path.ends_with('/') {
        return Err(bad());
    }
    Ok((target.to_string(), PathBuf::from(path)))
}

/// Runs `hook` for the container whose OCI state is read from `state`.
pub fn run(hook: &Hook, state: impl Read) -> Result<(), HookError> {
    let root = container_root(state)?;
    run_in(hook, &root)
}

/// Runs `hook` on the container root file system at `root` (a host path).
pub fn run_in(hook: &Hook, root: &Path) -> Result<(), HookError> {
    match hook {
        Hook::CreateSymlinks { links } => create_symlinks(root, links),
        Hook::UpdateLdcache { folders, ldconfig } => update_ldcache(root, folders, ldconfig.as_deref()),
        Hook::EnableCudaCompat { host_driver_version } => enable_cuda_compat(root, host_driver_version),
        Hook::DisableDeviceNodeModification => disable_device_node_modification(root),
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
/// relative to the bundle unless absolute.
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
    let text = crate::host::read_text(&config_path).map_err(io_at(&config_path))?;
    let config: BundleConfig = serde_json::from_str(&text).map_err(|e| HookError::Config {
        path: config_path.clone(),
        reason: e.to_string(),
    })?;
    let Some(root) = config.root.filter(|r| !r.path.is_empty()) else {
        return Err(HookError::Config {
            path: config_path,
            reason: "no root.path".to_string(),
        });
    };
    Ok(bundle.join(root.path))
}

/// `path` (absolute, in the container) as a host path under `root`, with every symlink on the way
/// followed inside the container: an absolute link target starts again at `root`, and `..` never
/// climbs above it. The parts that do not exist are appended as they are. This is what runc's
/// `securejoin` does; an image cannot make a hook write outside its root.
pub fn resolve_in(root: &Path, path: &Path) -> Result<PathBuf, HookError> {
    if !path.is_absolute() {
        return Err(HookError::NotAbsolute(path.to_path_buf()));
    }
    // Components still to walk, last first, so a link's target can be pushed in front.
    let mut todo: Vec<PathBuf> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(PathBuf::from(n)),
            Component::ParentDir => Some(PathBuf::from("..")),
            _ => None,
        })
        .collect();
    let mut done = PathBuf::new();
    let mut links = 0;
    while let Some(part) = todo.pop() {
        if part == Path::new("..") {
            done.pop();
            continue;
        }
        let candidate = root.join(&done).join(&part);
        match std::fs::symlink_metadata(&candidate) {
            Ok(meta) if meta.file_type().is_symlink() => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(HookError::SymlinkLoop(path.to_path_buf()));
                }
                let target = std::fs::read_link(&candidate).map_err(io_at(&candidate))?;
                if target.is_absolute() {
                    done = PathBuf::new();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => todo.push(PathBuf::from(n)),
                        Component::ParentDir => todo.push(PathBuf::from("..")),
                        _ => {}
                    }
                }
            }
            _ => done.push(part),
        }
    }
    Ok(root.join(done))
}

/// `create-symlinks`: each link at its path in the container, pointing at its target. A link
/// that is already there with the same target is left alone (the hook may run twice); anything
/// else at that path is replaced, as NVIDIA's hook does: an image that carries its own
/// `libnvidia-ml.so.1` (a driver package installed into it) must still get the host driver's,
/// because user-space libraries of another driver version do not work with the kernel module.
/// The new link is made under a temporary name and renamed over the old entry, so the path
/// never goes missing.
fn create_symlinks(root: &Path, links: &[(String, PathBuf)]) -> Result<(), HookError> {
    for (target, link) in links {
        let (Some(parent), Some(name)) = (link.parent(), link.file_name()) else {
            return Err(HookError::BadLink(format!("{target}::{}", link.display())));
        };
        let dir = resolve_in(root, parent)?;
        std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        let at = dir.join(name);
        if std::fs::read_link(&at).is_ok_and(|current| current.as_os_str() == OsStr::new(target)) {
            continue;
        }
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
            return Err(HookError::LinkExists {
                path: link.clone(),
                target: target.clone(),
            });
        }
        let mut temp_name = name.to_os_string();
        temp_name.push(format!(".gpu-node-agent-{}", std::process::id()));
        let temp = dir.join(temp_name);
        let _ = std::fs::remove_file(&temp);
        symlink(target, &temp).map_err(io_at(&temp))?;
        if let Err(e) = std::fs::rename(&temp, &at) {
            let _ = std::fs::remove_file(&temp);
            return Err(io_at(&at)(e));
        }
    }
    Ok(())
}

/// `update-ldcache`: the folders into [`LDCACHE_CONF`], then the container's `ldconfig`,
/// chrooted into the container, with the folders (CUDA compat first, when
/// `enable-cuda-compat` chose it) on its command line, so the cache has them whether or not the
/// image's `/etc/ld.so.conf` includes `ld.so.conf.d`.
fn update_ldcache(root: &Path, folders: &[PathBuf], ldconfig: Option<&Path>) -> Result<(), HookError> {
    for folder in folders {
        if !folder.is_absolute() {
            return Err(HookError::NotAbsolute(folder.clone()));
        }
    }
    let ldconfig = match ldconfig {
        Some(path) => {
            if !is_file_in(root, path)? {
                return Err(HookError::Io {
                    path: path.to_path_buf(),
                    source: io::Error::new(io::ErrorKind::NotFound, "no such ldconfig in the container"),
                });
            }
            path.to_path_buf()
        }
        None => {
            let mut found = None;
            for candidate in LDCONFIG_CANDIDATES {
                if is_file_in(root, Path::new(candidate))? {
                    found = Some(PathBuf::from(candidate));
                    break;
                }
            }
            let Some(found) = found else {
                eprintln!(
                    "gpu-node-agent cdi hook update-ldcache: the container has no ldconfig ({}); its library \
                     cache is left as it is",
                    LDCONFIG_CANDIDATES.join(", ")
                );
                return Ok(());
            };
            found
        }
    };

    let mut dirs: Vec<PathBuf> = Vec::new();
    let compat_conf = resolve_in(root, Path::new(CUDA_COMPAT_CONF))?;
    if let Ok(text) = std::fs::read_to_string(&compat_conf) {
        dirs.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| l.starts_with('/'))
                .map(PathBuf::from),
        );
    }
    for folder in folders {
        if !dirs.contains(folder) {
            dirs.push(folder.clone());
        }
    }
    if !folders.is_empty() {
        let mut text =
            String::from("# The NVIDIA driver's libraries, added by gpu-node-agent's update-ldcache hook.\n");
        for folder in folders {
            text.push_str(&folder.to_string_lossy());
            text.push('\n');
        }
        write_in(root, Path::new(LDCACHE_CONF), text.as_bytes())?;
        // An image without /etc/ld.so.conf (busybox, some minimal ones) gets the usual one, so a
        // later `ldconfig` in the container keeps the driver's folders.
        let conf = resolve_in(root, Path::new("/etc/ld.so.conf"))?;
        if std::fs::symlink_metadata(&conf).is_err() {
            std::fs::write(&conf, "include /etc/ld.so.conf.d/*.conf\n").map_err(io_at(&conf))?;
        }
    }
    run_chrooted(root, &ldconfig, &dirs)
}

/// Whether `path` is a regular file (or a link to one) in the container.
fn is_file_in(root: &Path, path: &Path) -> Result<bool, HookError> {
    Ok(resolve_in(root, path)?.is_file())
}

/// Writes a file at `path` in the container (parents created, resolved inside the root).
fn write_in(root: &Path, path: &Path, bytes: &[u8]) -> Result<(), HookError> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(HookError::NotAbsolute(path.to_path_buf()));
    };
    let dir = resolve_in(root, parent)?;
    std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
    let file = dir.join(name);
    if std::fs::symlink_metadata(&file).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(&file).map_err(io_at(&file))?;
    }
    std::fs::write(&file, bytes).map_err(io_at(&file))
}

/// Runs `program` (a container path) with `args`, chrooted into `root`, and waits at most
/// [`LDCONFIG_TIMEOUT`].
fn run_chrooted(root: &Path, program: &Path, dirs: &[PathBuf]) -> Result<(), HookError> {
    use std::os::unix::process::CommandExt;
    let fail = |message: String| HookError::Ldconfig {
        ldconfig: program.to_path_buf(),
        message,
    };
    let mut cmd = std::process::Command::new(program);
    cmd.args(dirs)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let root_dir = root.to_path_buf();
    // SAFETY: between fork and exec the closure only makes the chroot and chdir system calls,
    // which are async-signal-safe, and allocates nothing (the path was converted before).
    let c_root = std::ffi::CString::new(root_dir.as_os_str().as_encoded_bytes())
        .map_err(|_| fail(format!("container root {} contains a NUL byte", root.display())))?;
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::chroot(c_root.as_c_str()).map_err(io::Error::from)?;
            nix::unistd::chdir("/").map_err(io::Error::from)?;
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot start it in {}: {e}", root.display())))?;
    let deadline = Instant::now() + LDCONFIG_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!("did not finish within {} s", LDCONFIG_TIMEOUT.as_secs())));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = (&mut pipe).take(64 * 1024).read_to_string(&mut stderr);
    }
    Err(fail(format!("{status}: {}", stderr.trim())))
}

/// The major version of a driver version (`550` of `550.54.15`).
fn major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// `enable-cuda-compat`: if the container has `libcuda.so.<v>` in [`CUDA_COMPAT_DIR`] with a
/// major version above the host driver's, writes [`CUDA_COMPAT_CONF`] naming that folder (which
/// `update-ldcache` then puts first). Otherwise nothing: an older compat library must never
/// shadow the host driver.
fn enable_cuda_compat(root: &Path, host_driver_version: &str) -> Result<(), HookError> {
    let host_major = major(host_driver_version).ok_or_else(|| HookError::BadVersion(host_driver_version.into()))?;
    let dir = resolve_in(root, Path::new(CUDA_COMPAT_DIR))?;
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(());
    };
    let newest = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| name.strip_prefix("libcuda.so.").and_then(major))
        .max();
    match newest {
        Some(compat) if compat > host_major => write_in(
            root,
            Path::new(CUDA_COMPAT_CONF),
            format!("# CUDA forward compatibility (libcuda {compat} over driver {host_driver_version}), added by gpu-node-agent.\n{CUDA_COMPAT_DIR}\n").as_bytes(),
        ),
        _ => Ok(()),
    }
}

/// `disable-device-node-modification`: when the container sees the driver's parameters, a copy
/// with `ModifyDeviceFiles: 0` is bind-mounted read-only over them. The copy is written to a
/// small tmpfs mounted on a temporary folder, which is detached again once the bind mount holds
/// the file, so nothing is left on disk (a memory file cannot be the source: the kernel refuses
/// to bind a file from a mount outside the namespace). A container without them (no driver) is
/// left alone.
fn disable_device_node_modification(root: &Path) -> Result<(), HookError> {
    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    let target = resolve_in(root, Path::new(DRIVER_PARAMS))?;
    let Ok(text) = std::fs::read_to_string(&target) else {
        return Ok(());
    };
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
        move |source| HookError::Mount { path, source }
    };
    let scratch = tempfile::Builder::new()
        .prefix("gpu-node-agent-params")
        .tempdir()
        .map_err(io_at(Path::new("/tmp")))?;
    let dir = scratch.path();
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("tmpfs"), dir, Some("tmpfs"), flags, Some("size=64k,mode=0755")).map_err(mount_err(dir))?;
    let copy = dir.join("params");
    let bound = std::fs::write(&copy, changed)
        .map_err(io_at(&copy))
        .and_then(|()| {
            mount(Some(&copy), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(mount_err(&target))
        })
        .and_then(|()| {
            mount(
                None::<&str>,
                &target,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags,
                None::<&str>,
            )
            .map_err(mount_err(&target))
        });
    // The bind mount keeps the file; the tmpfs itself goes (the folder with `scratch`).
    let detached = umount2(dir, MntFlags::MNT_DETACH).map_err(mount_err(dir));
    bound.and(detached)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state_for(bundle: &Path) -> String {
        format!(
            r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1,"bundle":"{}"}}"#,
            bundle.display()
        )
    }

    #[test]
    fn the_root_is_root_path_of_the_bundle_config_relative_to_the_bundle() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"}}"#,
        )
        .unwrap();
        let root = container_root(state_for(dir.path()).as_bytes()).unwrap();
        assert_eq!(root, dir.path().join("rootfs"));
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"root":{"path":"/var/lib/x/merged"}}"#,
        )
        .unwrap();
        assert_eq!(
            container_root(state_for(dir.path()).as_bytes()).unwrap(),
            Path::new("/var/lib/x/merged")
        );
    }

    #[test]
    fn a_bad_state_or_bundle_is_an_error_naming_it() {
        let err = container_root(&b"not json"[..]).unwrap_err().to_string();
        assert!(err.contains("OCI state"), "{err}");
        let err = container_root(&br#"{"bundle":"rel"}"#[..]).unwrap_err().to_string();
        assert!(err.contains("\"rel\" is not an absolute path"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = container_root(state_for(dir.path()).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains("config.json"), "{err}");
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let err = container_root(state_for(dir.path()).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no root.path"), "{err}");
    }

    #[test]
    fn paths_resolve_inside_the_root_whatever_the_links_say() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("usr/lib64")).unwrap();
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        symlink("/etc", root.join("usr/lib/escape")).unwrap();
        symlink("../../../../..", root.join("usr/lib/up")).unwrap();
        symlink("usr/lib64", root.join("lib64")).unwrap();
        symlink("loop", root.join("loop")).unwrap();

        assert_eq!(
            resolve_in(root, Path::new("/usr/lib/escape/passwd")).unwrap(),
            root.join("etc/passwd")
        );
        assert_eq!(
            resolve_in(root, Path::new("/usr/lib/up/etc")).unwrap(),
            root.join("etc")
        );
        assert_eq!(resolve_in(root, Path::new("/../../etc")).unwrap(), root.join("etc"));
        assert_eq!(
            resolve_in(root, Path::new("/lib64/libcuda.so.1")).unwrap(),
            root.join("usr/lib64/libcuda.so.1")
        );
        assert!(matches!(
            resolve_in(root, Path::new("/loop/x")),
            Err(HookError::SymlinkLoop(_))
        ));
        assert!(matches!(
            resolve_in(root, Path::new("rel")),
            Err(HookError::NotAbsolute(_))
        ));
    }

    #[test]
    fn links_are_parsed_as_target_then_path() {
        assert_eq!(
            parse_link("libcuda.so.550.54.15::/usr/lib64/libcuda.so.1").unwrap(),
            (
                "libcuda.so.550.54.15".to_string(),
                PathBuf::from("/usr/lib64/libcuda.so.1")
            )
        );
        for bad in ["libcuda.so.1", "::/x", "t::rel", "t::/dir/"] {
            assert!(parse_link(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn create_symlinks_makes_the_links_inside_the_root_and_replaces_what_the_image_had() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        symlink("/etc", root.join("usr/lib/escape")).unwrap();
        let links = vec![
            (
                "libcuda.so.550.54.15".to_string(),
                PathBuf::from("/usr/lib64/libcuda.so.1"),
            ),
            ("libcuda.so.1".to_string(), PathBuf::from("/usr/lib/escape/libcuda.so")),
        ];
        let hook = Hook::CreateSymlinks { links: links.clone() };
        run_in(&hook, root).unwrap();
        assert_eq!(
            std::fs::read_link(root.join("usr/lib64/libcuda.so.1")).unwrap(),
            Path::new("libcuda.so.550.54.15")
        );
        // The link through `escape` stayed in the root.
        assert_eq!(
            std::fs::read_link(root.join("etc/libcuda.so")).unwrap(),
            Path::new("libcuda.so.1")
        );
        // Twice is fine.
        run_in(&hook, root).unwrap();
        // A file of the image (a driver library of another version) is replaced by the link.
        std::fs::write(root.join("usr/lib64/libnvidia-ml.so.1"), "image's own").unwrap();
        let ml = Hook::CreateSymlinks {
            links: vec![(
                "libnvidia-ml.so.550.54.15".into(),
                "/usr/lib64/libnvidia-ml.so.1".into(),
            )],
        };
        run_in(&ml, root).unwrap();
        assert_eq!(
            std::fs::read_link(root.join("usr/lib64/libnvidia-ml.so.1")).unwrap(),
            Path::new("libnvidia-ml.so.550.54.15")
        );
        // A directory is not.
        std::fs::create_dir_all(root.join("usr/lib64/libnvidia-cfg.so.1")).unwrap();
        let err = run_in(
            &Hook::CreateSymlinks {
                links: vec![(
                    "libnvidia-cfg.so.550.54.15".into(),
                    "/usr/lib64/libnvidia-cfg.so.1".into(),
                )],
            },
            root,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("/usr/lib64/libnvidia-cfg.so.1 is a directory"), "{err}");
        let names: Vec<_> = std::fs::read_dir(root.join("usr/lib64"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary links left: {names:?}");
    }

    #[test]
    fn cuda_compat_is_enabled_only_for_a_newer_compat_libcuda() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let compat = |r: &Path| r.join(CUDA_COMPAT_CONF.trim_start_matches('/'));
        // No compat folder: nothing.
        enable_cuda_compat(root, "550.54.15").unwrap();
        assert!(!compat(root).exists());
        std::fs::create_dir_all(root.join("usr/local/cuda/compat")).unwrap();
        std::fs::write(root.join("usr/local/cuda/compat/libcuda.so.545.23.08"), "").unwrap();
        enable_cuda_compat(root, "550.54.15").unwrap();
        assert!(
            !compat(root).exists(),
            "an older compat libcuda must not shadow the driver"
        );
        std::fs::write(root.join("usr/local/cuda/compat/libcuda.so.570.86.10"), "").unwrap();
        enable_cuda_compat(root, "550.54.15").unwrap();
        let text = std::fs::read_to_string(compat(root)).unwrap();
        assert!(text.lines().any(|l| l == CUDA_COMPAT_DIR), "{text}");
        assert!(matches!(enable_cuda_compat(root, "x"), Err(HookError::BadVersion(_))));
    }

    #[test]
    fn update_ldcache_without_ldconfig_in_the_container_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        run_in(
            &Hook::UpdateLdcache {
                folders: vec!["/usr/lib64".into()],
                ldconfig: None,
            },
            root,
        )
        .unwrap();
        assert!(!root.join("etc").exists());
        let err = run_in(
            &Hook::UpdateLdcache {
                folders: vec!["/usr/lib64".into()],
                ldconfig: Some("/sbin/ldconfig".into()),
            },
            root,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("/sbin/ldconfig"), "{err}");
    }
}
