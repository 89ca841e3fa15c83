//! The driver's user-space files on the host ([`discover`]): what is looked for (libraries,
//! programs, firmware, sockets, the CDI hook) and where.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::host::arch::HostArch;
use crate::host::rooted;

/// Where the toolkit's CDI hook binary is looked for, first match wins: the toolkit packages'
/// locations (`nvidia-cdi-hook` from 1.16 on, `nvidia-ctk hook` before) and the GPU Operator's
/// toolkit install directory. Host paths.
pub const DEFAULT_HOOK_CANDIDATES: [&str; 3] = [
    "/usr/bin/nvidia-cdi-hook",
    "/usr/bin/nvidia-ctk",
    "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
];

/// Driver libraries, without the `.so.<version>` suffix, that are also looked for outside the
/// folder of `libcuda` (installs that split them): the utility and compute lists of
/// libnvidia-container (`src/nvc_info.c`). Every `*.so.<version>` in `libcuda`'s folder and its
/// `vdpau/` is mounted whatever its name, as `nvidia-ctk` does. Libraries an older or newer
/// driver does not ship are simply not found.
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

/// Library directories searched on a node of `arch`, in order; a library found in an earlier
/// one wins: the architecture's Debian multiarch folder (`/usr/lib/x86_64-linux-gnu`,
/// `/usr/lib/aarch64-linux-gnu`), the RHEL family's `/usr/lib64` and `/lib64` (both
/// architectures), `/usr/lib`, and the multiarch folder under `/lib`. See
/// [`HostArch::library_dirs`]; another architecture's multiarch folder is never searched.
pub fn library_dirs(arch: &HostArch) -> Vec<PathBuf> {
    arch.library_dirs()
}

/// The libraries without which a spec gives containers no CUDA: their absence means a wrong
/// driver root or version, and is an error rather than a quiet, useless spec.
pub const REQUIRED_LIBRARIES: [&str; 2] = ["libcuda", "libnvidia-ml"];

/// Driver programs mounted into containers (libnvidia-container's utility and compute binaries,
/// and the IMEX daemon's, as `nvidia-ctk` 1.17.5 and later).
pub const DRIVER_BINARIES: [&str; 7] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
];

/// Graphics and video configuration files (EGL, Vulkan, X11, OptiX), relative to each of
/// [`CONFIG_DIRS`]; the first found of each is mounted at the same path.
pub const GRAPHICS_CONFIGS: [&str; 10] = [
    "glvnd/egl_vendor.d/10_nvidia.json",
    "egl/egl_external_platform.d/15_nvidia_gbm.json",
    "egl/egl_external_platform.d/10_nvidia_wayland.json",
    "vulkan/icd.d/nvidia_icd.json",
    "vulkan/icd.d/nvidia_layers.json",
    "vulkan/implicit_layer.d/nvidia_layers.json",
    // Per architecture (`{arch}`: `uname -m`), as Fedora and RHEL packages name it.
    "vulkan/icd.d/nvidia_icd.{arch}.json",
    "nvidia/nvoptix.bin",
    "X11/xorg.conf.d/10-nvidia.conf",
    "X11/xorg.conf.d/nvidia-drm-outputclass.conf",
];

/// Where [`GRAPHICS_CONFIGS`] are looked for, in order.
pub const CONFIG_DIRS: [&str; 3] = ["/etc", "/usr/local/share", "/usr/share"];

/// Folders of the X server modules (`nvidia_drv.so`, `libglxserver_nvidia.so.<version>`), in
/// order; `{lib}` is the folder of `libcuda`.
pub const XORG_MODULE_DIRS: [&str; 7] = [
    "{lib}/nvidia/xorg",
    "{lib}/xorg/modules/drivers",
    "{lib}/xorg/modules/extensions",
    "/usr/lib/xorg/modules/drivers",
    "/usr/lib/xorg/modules/extensions",
    "/usr/lib64/xorg/modules/drivers",
    "/usr/lib64/xorg/modules/extensions",
];

/// Program directories searched, in order; a program found in an earlier one wins.
pub const BINARY_DIRS: [&str; 3] = ["/usr/bin", "/usr/sbin", "/bin"];

/// GSP firmware lives in `<FIRMWARE_DIR>/<driver version>/gsp*.bin`.
pub const FIRMWARE_DIR: &str = "/lib/firmware/nvidia";

/// Sockets of the driver's daemons that tools in the container talk to, and the MPS control
/// daemon's pipe folder (a container with a GPU shared through MPS needs it).
pub const IPC_SOCKETS: [&str; 3] = [
    "/run/nvidia-persistenced/socket",
    "/run/nvidia-fabricmanager/socket",
    "/tmp/nvidia-mps",
];

/// The host's PCI devices in sysfs (on the host itself, not under the driver root).
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// Which hook program the spec's hooks run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookBinary {
    /// The NVIDIA Container Toolkit's `nvidia-cdi-hook` or `nvidia-ctk` (host path): the spec gets
    /// `create-symlinks` and `update-ldcache`, which every version of it has.
    Toolkit(PathBuf),
    /// This agent's hook program (`gpu-node-agent-cdi-hook …`, host path): all four hooks.
    Agent(PathBuf),
}

impl HookBinary {
    /// The program's host path.
    pub fn path(&self) -> &Path {
        match self {
            HookBinary::Toolkit(p) | HookBinary::Agent(p) => p,
        }
    }
}

/// Where the hook program is looked for: the first of `toolkit` that exists on the host, else
/// `agent` (a path that is used as it is: the running agent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookSearch {
    pub toolkit: Vec<PathBuf>,
    pub agent: Option<PathBuf>,
}

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
    /// Every `*.so.<version>` in the folder of `libcuda` and its `vdpau/`, sorted, then each of
    /// [`DRIVER_LIBRARIES`] found elsewhere.
    pub libraries: Vec<PathBuf>,
    /// The folder `libcuda.so.<version>` was found in (the first of `library_search` that has
    /// it), if any.
    pub libcuda_dir: Option<PathBuf>,
    /// The folders searched for libraries, in order (host paths): [`library_dirs`], then those
    /// the driver root's `/etc/ld.so.conf` names (see [`ld_so_conf_dirs`]).
    pub library_search: Vec<PathBuf>,
    /// The directories of `libraries`, sorted, without duplicates.
    pub library_dirs: Vec<PathBuf>,
    /// Symlinks next to the libraries that point straight at one of them, such as the soname link
    /// `libcuda.so.1 -> libcuda.so.<version>`, sorted by link path.
    pub library_links: Vec<LibraryLink>,
    /// Each of [`DRIVER_BINARIES`] found, in that order.
    pub binaries: Vec<PathBuf>,
    /// `gsp*.bin` of this driver version, sorted.
    pub firmware: Vec<PathBuf>,
    /// Graphics configuration files ([`GRAPHICS_CONFIGS`]) and X server modules found.
    pub graphics: Vec<PathBuf>,
    /// Each of [`IPC_SOCKETS`] that exists, in that order.
    pub ipc_sockets: Vec<PathBuf>,
    /// The DRM nodes of each PCI device (sysfs bus id such as `0000:07:00.0` → `/dev/dri/card1`,
    /// `/dev/dri/renderD128`), from `/sys/bus/pci/devices/<bus id>/drm/`.
    pub dri: BTreeMap<String, Vec<String>>,
    /// The hook program; without one the spec has no hooks.
    pub cdi_hook: Option<HookBinary>,
}

/// A symlink to a driver library, recreated in the container by the `create-symlinks` hook.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LibraryLink {
    /// Host path of the link, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1` (on arm64
    /// `/usr/lib/aarch64-linux-gnu/libcuda.so.1`).
    pub link: PathBuf,
    /// File name of the library it points at, e.g. `libcuda.so.550.54.15` (relative to the link's
    /// directory).
    pub target: String,
}

/// Finds the driver's files. `root` is the agent's host prefix (`/` in production, a tempdir in
/// tests); `driver_root` the host directory the driver is installed under; `version` the driver
/// version NVML reports; `hooks` where the hook program is (see [`HookSearch`]); `arch` the node's
/// architecture ([`HostArch::read`]), which names the library folders ([`library_dirs`]) and
/// the per-architecture Vulkan ICD file.
///
/// Libraries, binaries, firmware, graphics files and sockets are looked for under
/// `driver_root`, as `nvidia-ctk` does; the toolkit's hook is looked for on the host itself,
/// because the runtime runs it there. Nothing found is not an error here (the spec decides: see
/// [`REQUIRED_LIBRARIES`]). A version that is empty or not made of `[A-Za-z0-9._-]` matches no
/// library or firmware.
pub fn discover(root: &Path, driver_root: &Path, version: &str, hooks: &HookSearch, arch: &HostArch) -> DriverFiles {
    let look = |host: &Path| rooted(root, host);
    let host = |path: &str| rooted(driver_root, Path::new(path));
    let versioned = is_plain_version(version);
    if !versioned {
        tracing::warn!(
            version,
            "driver version is not a plain version string: no libraries or firmware mounted"
        );
    }
    let suffix = format!(".so.{version}");

    // A driver in a folder of its own (`/var/lib/nvidia/lib64`) is found the way the dynamic
    // linker finds it: through the folders ld.so.conf names.
    let mut library_search: Vec<PathBuf> = library_dirs(arch)
        .iter()
        .map(|dir| host(&dir.to_string_lossy()))
        .collect();
    for dir in ld_so_conf_dirs(
        &|p| std::fs::read_to_string(look(&host(&p.to_string_lossy()))).ok(),
        &|dir| dir_entries(&look(&host(&dir.to_string_lossy()))),
    ) {
        let dir = host(&dir.to_string_lossy());
        if !library_search.contains(&dir) {
            library_search.push(dir);
        }
    }
    let mut libraries: Vec<PathBuf> = Vec::new();
    let mut libcuda_dir = None;
    if versioned {
        libcuda_dir = library_search
            .iter()
            .find(|dir| look(&dir.join(format!("libcuda{suffix}"))).is_file())
            .cloned();
        if let Some(dir) = &libcuda_dir {
            for folder in [dir.clone(), dir.join("vdpau")] {
                for name in dir_entries(&look(&folder)) {
                    let path = folder.join(&name);
                    if name.ends_with(&suffix) && look(&path).is_file() && !is_symlink(&look(&path)) {
                        libraries.push(path);
                    }
                }
            }
        }
        for lib in DRIVER_LIBRARIES {
            let file = format!("{lib}{suffix}");
            if libraries
                .iter()
                .any(|l| l.file_name().is_some_and(|n| n == file.as_str()))
            {
                continue;
            }
            let found = library_search
                .iter()
                .map(|dir| dir.join(&file))
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

    let mut graphics: Vec<PathBuf> = GRAPHICS_CONFIGS
        .iter()
        .map(|file| file.replace("{arch}", arch.machine()))
        .filter_map(|file| {
            CONFIG_DIRS
                .iter()
                .map(|dir| host(dir).join(&file))
                .find(|path| look(path).is_file())
        })
        .collect();
    if versioned {
        let lib = libcuda_dir.as_ref().map(|d| d.to_string_lossy().into_owned());
        for module in ["nvidia_drv.so".to_string(), format!("libglxserver_nvidia{suffix}")] {
            let found = XORG_MODULE_DIRS
                .iter()
                .filter_map(|dir| match (dir.strip_prefix("{lib}"), &lib) {
                    (Some(rest), Some(lib)) => Some(PathBuf::from(format!("{lib}{rest}"))),
                    (Some(_), None) => None,
                    (None, _) => Some(host(dir)),
                })
                .map(|dir| dir.join(&module))
                .find(|path| look(path).is_file());
            graphics.extend(found);
        }
    }

    let ipc_sockets = IPC_SOCKETS
        .iter()
        .map(|s| host(s))
        .filter(|s| look(s).exists())
        .collect();
    let mut dri = BTreeMap::new();
    let pci = look(Path::new(PCI_DEVICES));
    for bus_id in dir_entries(&pci) {
        let names: Vec<String> = dir_entries(&pci.join(&bus_id).join("drm"))
            .into_iter()
            .filter(|n| n.starts_with("card") || n.starts_with("renderD"))
            .map(|n| format!("/dev/dri/{n}"))
            .collect();
        if !names.is_empty() {
            dri.insert(bus_id, names);
        }
    }
    let cdi_hook = hooks
        .toolkit
        .iter()
        .find(|c| look(c).is_file())
        .map(|p| HookBinary::Toolkit(p.clone()))
        .or_else(|| hooks.agent.clone().map(HookBinary::Agent));

    DriverFiles {
        driver_root: driver_root.to_path_buf(),
        library_search,
        version: version.to_string(),
        libraries,
        libcuda_dir,
        library_dirs,
        library_links,
        binaries,
        firmware,
        graphics,
        ipc_sockets,
        dri,
        cdi_hook,
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
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
/// Most `include` levels followed in ld.so.conf (glibc has no limit; a loop must end).
const LD_SO_CONF_DEPTH: u32 = 8;

/// The folders `/etc/ld.so.conf` names, in its order, `include` lines followed (a relative
/// pattern against the including file's folder; `*` and `?` in the file name, matches in name
/// order), as `ldconfig` reads it: `#` starts a comment, folders are separated by whitespace,
/// `:` or `,`, and `hwcap` lines are skipped. `read` gives a file's text (`None`: missing),
/// `list` a folder's entry names; both take paths as the driver root sees them.
pub fn ld_so_conf_dirs(read: &dyn Fn(&Path) -> Option<String>, list: &dyn Fn(&Path) -> Vec<String>) -> Vec<PathBuf> {
    fn walk(
        file: &Path,
        depth: u32,
        read: &dyn Fn(&Path) -> Option<String>,
        list: &dyn Fn(&Path) -> Vec<String>,
        out: &mut Vec<PathBuf>,
    ) {
        let Some(text) = read(file) else { return };
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if let Some(pattern) = line
                .strip_prefix("include")
                .filter(|p| p.starts_with(char::is_whitespace))
            {
                if depth == 0 {
                    continue;
                }
                for pattern in pattern.split_whitespace() {
                    let pattern = file.parent().unwrap_or(Path::new("/")).join(pattern);
                    let (Some(dir), Some(name)) = (pattern.parent(), pattern.file_name()) else {
                        continue;
                    };
                    let name = name.to_string_lossy();
                    for entry in list(dir).iter().filter(|e| glob_name(&name, e)) {
                        walk(&dir.join(entry), depth - 1, read, list, out);
                    }
                }
            } else if !line.starts_with("hwcap") {
                for dir in line.split(|c: char| c.is_whitespace() || c == ':' || c == ',') {
                    if dir.starts_with('/') && !out.iter().any(|d| d == Path::new(dir)) {
                        out.push(PathBuf::from(dir));
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(Path::new("/etc/ld.so.conf"), LD_SO_CONF_DEPTH, read, list, &mut out);
    out
}

/// Whether the file name `name` matches `pattern` with `*` (any run) and `?` (one character).
fn glob_name(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some(('*', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some(('?', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    !name.starts_with('.') && go(&p, &n)
}

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
