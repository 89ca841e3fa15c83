//! The driver's user-space files on the host ([`discover`]): what is looked for (libraries,
//! programs, firmware, sockets, the CDI hook) and where.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::host::rooted;

/// Where the CDI hook binary is looked for, first match wins: the toolkit packages' locations
/// (`nvidia-cdi-hook` from 1.16 on, `nvidia-ctk hook` before) and the GPU Operator's toolkit
/// install directory. Host paths.
pub const DEFAULT_HOOK_CANDIDATES: [&str; 3] = [
    "/usr/bin/nvidia-cdi-hook",
    "/usr/bin/nvidia-ctk",
    "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
];

/// Driver user-space libraries mounted into containers, without the `.so.<version>` suffix: the
/// utility and compute lists of libnvidia-container (`src/nvc_info.c`), i.e. what
/// `NVIDIA_DRIVER_CAPABILITIES=compute,utility` (the Kubernetes default) gives a container.
/// Libraries an older or newer driver does not ship are simply not found.
pub const DRIVER_LIBRARIES: [&str; 15] = [
    // utility
    "libnvidia-ml",
    "libnvidia-cfg",
    "libnvidia-nscq",
    // compute
    "libcuda",
    "libcudadebugger",
    "libnvidia-opencl",
    "libnvidia-gpucomp",
    "libnvidia-ptxjitcompiler",
    "libnvidia-fatbinaryloader",
    "libnvidia-allocator",
    "libnvidia-compiler",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-nvvm",
    "libnvidia-tileiras",
];

/// Library directories searched, in order; a library found in an earlier one wins.
pub const LIBRARY_DIRS: [&str; 6] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
];

/// Driver programs mounted into containers (libnvidia-container's utility and compute binaries).
pub const DRIVER_BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Program directories searched, in order; a program found in an earlier one wins.
pub const BINARY_DIRS: [&str; 3] = ["/usr/bin", "/usr/sbin", "/bin"];

/// GSP firmware lives in `<FIRMWARE_DIR>/<driver version>/gsp*.bin`.
pub const FIRMWARE_DIR: &str = "/lib/firmware/nvidia";

/// Sockets of the driver's daemons that tools in the container talk to.
pub const IPC_SOCKETS: [&str; 2] = ["/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket"];

/// The driver's user-space files found on the host. All paths are host paths: under the driver
/// root, but not under the agent's `--root` prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFiles {
    /// Host directory the driver is installed under: `/` for a host install,
    /// `/run/nvidia/driver` for a driver container. Container paths are the host paths with this
    /// prefix removed.
    pub driver_root: PathBuf,
    /// Driver version the versioned files were matched against, e.g. `550.54.15`.
    pub version: String,
    /// `<dir>/<lib>.so.<version>` for each of [`DRIVER_LIBRARIES`] found, in that order.
    pub libraries: Vec<PathBuf>,
    /// The directories of `libraries`, sorted, without duplicates.
    pub library_dirs: Vec<PathBuf>,
    /// Symlinks next to the libraries that point straight at one of them, such as the soname link
    /// `libcuda.so.1 -> libcuda.so.<version>`, sorted by link path.
    pub library_links: Vec<LibraryLink>,
    /// Each of [`DRIVER_BINARIES`] found, in that order.
    pub binaries: Vec<PathBuf>,
    /// `gsp*.bin` of this driver version, sorted.
    pub firmware: Vec<PathBuf>,
    /// Each of [`IPC_SOCKETS`] that exists, in that order.
    pub ipc_sockets: Vec<PathBuf>,
    /// The CDI hook binary (`nvidia-cdi-hook` or `nvidia-ctk`); without one the spec has no hooks.
    pub cdi_hook: Option<PathBuf>,
}

/// A symlink to a driver library, recreated in the container by the `create-symlinks` hook.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LibraryLink {
    /// Host path of the link, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1`.
    pub link: PathBuf,
    /// File name of the library it points at, e.g. `libcuda.so.550.54.15` (relative to the link's
    /// directory).
    pub target: String,
}

/// Finds the driver's files. `root` is the agent's host prefix (`/` in production, a tempdir in
/// tests); `driver_root` the host directory the driver is installed under; `version` the driver
/// version NVML reports; `hook_candidates` host paths of hook binaries, the first that exists is
/// used (see [`DEFAULT_HOOK_CANDIDATES`]).
///
/// Libraries, binaries, firmware and sockets are looked for under `driver_root`, as `nvidia-ctk`
/// does; the hook is looked for on the host itself, because the runtime runs it there. Nothing
/// found is not an error: the spec then simply lacks it. A version that is empty or not made of
/// `[A-Za-z0-9._-]` matches no library or firmware.
pub fn discover(root: &Path, driver_root: &Path, version: &str, hook_candidates: &[PathBuf]) -> DriverFiles {
    let look = |host: &Path| rooted(root, host);
    let host = |path: &str| rooted(driver_root, Path::new(path));
    let versioned = is_plain_version(version);
    if !versioned {
        tracing::warn!(
            version,
            "driver version is not a plain version string: no libraries or firmware mounted"
        );
    }

    let mut libraries = Vec::new();
    if versioned {
        for lib in DRIVER_LIBRARIES {
            let file = format!("{lib}.so.{version}");
            let found = LIBRARY_DIRS
                .iter()
                .map(|dir| host(dir).join(&file))
                .find(|path| look(path).is_file());
            libraries.extend(found);
        }
    }
    let library_dirs: Vec<PathBuf> = libraries
        .iter()
        .filter_map(|lib| lib.parent().map(Path::to_path_buf))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let library_links = library_links(&library_dirs, &libraries, &look);

    let binaries = DRIVER_BINARIES
        .iter()
        .filter_map(|bin| {
            BINARY_DIRS
                .iter()
                .map(|dir| host(dir).join(bin))
                .find(|path| look(path).is_file())
        })
        .collect();

    let mut firmware = Vec::new();
    if versioned {
        let dir = host(FIRMWARE_DIR).join(version);
        for name in dir_entries(&look(&dir)) {
            if name.starts_with("gsp") && name.ends_with(".bin") && look(&dir.join(&name)).is_file() {
                firmware.push(dir.join(name));
            }
        }
    }

    let ipc_sockets = IPC_SOCKETS
        .iter()
        .map(|s| host(s))
        .filter(|s| look(s).exists())
        .collect();
    let cdi_hook = hook_candidates.iter().find(|c| look(c).is_file()).cloned();

    DriverFiles {
        driver_root: driver_root.to_path_buf(),
        version: version.to_string(),
        libraries,
        library_dirs,
        library_links,
        binaries,
        firmware,
        ipc_sockets,
        cdi_hook,
    }
}

/// A driver version safe to put in a file name: `550.54.15`, not `../x` or empty.
fn is_plain_version(version: &str) -> bool {
    !version.is_empty()
        && version != "."
        && version != ".."
        && version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// File names in a directory, sorted; empty when it cannot be read.
fn dir_entries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    names
}

/// Symlinks in the library directories whose target is one of the libraries in the same
/// directory (`libcuda.so.1 -> libcuda.so.550.54.15`), named after that library
/// (`libcuda.so*`). Chains (`libcuda.so -> libcuda.so.1`) are not followed.
fn library_links(dirs: &[PathBuf], libraries: &[PathBuf], look: &dyn Fn(&Path) -> PathBuf) -> Vec<LibraryLink> {
    let mut links = Vec::new();
    for dir in dirs {
        let here: Vec<&str> = libraries
            .iter()
            .filter(|lib| lib.parent() == Some(dir.as_path()))
            .filter_map(|lib| lib.file_name()?.to_str())
            .collect();
        for name in dir_entries(&look(dir)) {
            let link = dir.join(&name);
            let Ok(target) = std::fs::read_link(look(&link)) else {
                continue;
            };
            let same_dir = match target.parent() {
                None => true,
                Some(parent) => parent.as_os_str().is_empty() || parent == dir.as_path(),
            };
            let Some(target) = target.file_name().and_then(|t| t.to_str()) else {
                continue;
            };
            let Some(stem) = target.split_once(".so.").map(|(stem, _)| stem) else {
                continue;
            };
            if same_dir && name != target && here.contains(&target) && name.starts_with(&format!("{stem}.so")) {
                links.push(LibraryLink {
                    link,
                    target: target.to_string(),
                });
            }
        }
    }
    links.sort();
    links
}
