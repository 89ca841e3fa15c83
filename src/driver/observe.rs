//! What the node has, as far as the driver is concerned: the distribution, the kernel and its
//! headers, the NVIDIA GPUs on the PCI bus, the driver modules that are loaded (and which flavour),
//! nouveau, and Secure Boot. Reads files only; never runs a program.
//!
//! Parsers take text or bytes and are pure; the `fn`s taking a [`HostRoot`] read the files. Every
//! host path goes through the root prefix, and symlinks in host trees (`/lib/modules/<r>/build`,
//! `/etc/os-release`) are resolved inside the root, not against the agent's own `/`.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Serialize, Serializer};

use super::Flavour;
use crate::host::HostRoot;
use crate::host::arch::HostArch;

use crate::devices::{NVIDIA_VENDOR, parse_sysfs_hex};

/// PCI class (base class and subclass, the top 16 of the 24 bits) of a VGA controller.
const CLASS_VGA: u32 = 0x0300;

/// PCI class (base class and subclass) of a 3D controller: datacenter GPUs without a display.
const CLASS_3D: u32 = 0x0302;

/// The driver's kernel modules as `/sys/module` names them, in load order.
pub const DRIVER_MODULES: [&str; 5] = ["nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem"];

/// Kernel modules that grab NVIDIA GPUs before the NVIDIA driver can (nova is the new in-tree
/// driver for GSP GPUs, shipped by recent Ubuntu kernels).
pub const CONFLICTING_MODULES: [&str; 3] = ["nouveau", "nova_core", "nova_drm"];

/// The EFI variable that says whether Secure Boot is on (global variable GUID from the UEFI spec).
const SECURE_BOOT_VAR: &str = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c";

/// How many symlinks resolving one path may follow before it is taken as a loop (Linux: 40).
const MAX_SYMLINKS: usize = 40;

/// Why the host could not be observed.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot list {}: {source}", path.display())]
    List { path: PathBuf, source: io::Error },
    #[error("{}: expected {expected}, found {text:?}", path.display())]
    Parse {
        path: PathBuf,
        text: String,
        expected: &'static str,
    },
    #[error("cannot tell the kernel release: uname failed: {0}")]
    Uname(nix::errno::Errno),
}

/// The fields of os-release(5) the driver needs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OsRelease {
    /// `ID`, e.g. `ubuntu`, `rhel`, `amzn`; empty when unknown.
    pub id: String,
    /// `ID_LIKE`, split on whitespace, closest first.
    pub id_like: Vec<String>,
    /// `VERSION_ID`, e.g. `22.04`, `9.4`, `2023`.
    pub version_id: String,
    /// `VERSION_CODENAME`, e.g. `jammy`; empty on RHEL-family systems.
    pub version_codename: String,
    /// `PRETTY_NAME`, for messages.
    pub pretty_name: String,
}

/// The family of distributions whose packaging the driver stage knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Distro {
    Ubuntu,
    Debian,
    /// RHEL and its rebuilds, Fedora, Amazon Linux: dnf/yum, kernel-devel, `/usr/src/kernels`.
    RhelFamily,
    Unknown,
}

impl Distro {
    /// The family of one os-release `ID` or `ID_LIKE` word.
    fn of_word(word: &str) -> Option<Distro> {
        match word.to_ascii_lowercase().as_str() {
            "ubuntu" => Some(Distro::Ubuntu),
            "debian" => Some(Distro::Debian),
            "rhel" | "centos" | "rocky" | "almalinux" | "ol" | "fedora" | "amzn" => Some(Distro::RhelFamily),
            _ => None,
        }
    }
}

impl OsRelease {
    /// The family: `ID` decides when it is known, else the first known `ID_LIKE` word (closest
    /// first, so Pop!_OS or Mint with `ID_LIKE="ubuntu debian"` are Ubuntu, Raspberry Pi OS with
    /// `ID_LIKE=debian` is Debian).
    pub fn distro(&self) -> Distro {
        std::iter::once(self.id.as_str())
            .chain(self.id_like.iter().map(String::as_str))
            .find_map(Distro::of_word)
            .unwrap_or(Distro::Unknown)
    }
}

/// Parses os-release(5): `KEY=value` lines with shell-style quoting (`"..."` with backslash
/// escapes, `'...'` literal, unquoted words with backslash escapes), `#` comments and blank
/// lines. Unknown keys and malformed lines are ignored; a missing key is an empty value.
pub fn parse_os_release(text: &str) -> OsRelease {
    let mut os = OsRelease::default();
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let Some((key, raw)) = line.split_once('=') else {
            continue;
        };
        let value = shell_value(raw);
        match key.trim() {
            "ID" => os.id = value,
            "ID_LIKE" => os.id_like = value.split_whitespace().map(str::to_string).collect(),
            "VERSION_ID" => os.version_id = value,
            "VERSION_CODENAME" => os.version_codename = value,
            "PRETTY_NAME" => os.pretty_name = value,
            _ => {}
        }
    }
    os
}

/// One shell word: quoted and unquoted parts run together (`"a"'b'c` is `abc`); unquoted
/// whitespace ends it, and what follows (a comment) is dropped. An unterminated quote runs to
/// the end of the line.
fn shell_value(raw: &str) -> String {
    let mut out = String::new();
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        // In double quotes a backslash escapes only these (sh(1), os-release(5)).
                        '\\' => match chars.next() {
                            Some(e @ ('"' | '\\' | '$' | '`')) => out.push(e),
                            Some(e) => {
                                out.push('\\');
                                out.push(e);
                            }
                            None => out.push('\\'),
                        },
                        c => out.push(c),
                    }
                }
            }
            '\'' => {
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    out.push(c);
                }
            }
            '\\' => {
                if let Some(e) = chars.next() {
                    out.push(e);
                }
            }
            c if c.is_whitespace() => break,
            c => out.push(c),
        }
    }
    out
}

/// Reads `/etc/os-release`, else `/usr/lib/os-release`. With neither, the result has an empty
/// `id` ([`Distro::Unknown`]): not an error, since the driver can still be installed from a
/// `.run` file.
pub fn os_release(root: &HostRoot) -> Result<OsRelease, ObserveError> {
    for path in ["/etc/os-release", "/usr/lib/os-release"] {
        if let Some(text) = read_optional_in_root(root, Path::new(path))? {
            return Ok(parse_os_release(&text));
        }
    }
    Ok(OsRelease::default())
}

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PciDevice {
    /// Domain:bus:device.function, e.g. `0000:07:00.0`.
    pub address: String,
    #[serde(serialize_with = "hex4")]
    pub vendor: u16,
    #[serde(serialize_with = "hex4")]
    pub device: u16,
    /// Base class, subclass and programming interface, e.g. `0x030200`.
    #[serde(serialize_with = "hex6")]
    pub class: u32,
}

fn hex4<S: Serializer>(v: &u16, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#06x}"))
}

fn hex6<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#08x}"))
}

impl PciDevice {
    /// Whether this is an NVIDIA GPU: vendor 0x10de with class VGA or 3D controller. NVSwitches
    /// (bridge class 0x0680) and the GPUs' HDMI audio functions (0x0403) are not.
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == NVIDIA_VENDOR && matches!(self.class >> 8, CLASS_VGA | CLASS_3D)
    }
}

/// The NVIDIA GPUs on the PCI bus (`/sys/bus/pci/devices/*`, physical functions only), sorted
/// by address. No `/sys/bus/pci/devices` (a container without sysfs, a test root) is no GPU; an
/// attribute that cannot be read or parsed is an error naming it.
pub fn nvidia_gpus(root: &HostRoot) -> Result<Vec<PciDevice>, ObserveError> {
    let dir = root.join("/sys/bus/pci/devices");
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(ObserveError::List { path: dir, source }),
    };
    let mut gpus = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ObserveError::List {
            path: dir.clone(),
            source,
        })?;
        let path = entry.path();
        // Other vendors' attributes are not read at all: nothing of theirs can fail the scan.
        let vendor = read_hex(&path.join("vendor"), 0xffff)? as u16;
        // SR-IOV virtual functions (vGPU hosts) are slices of a GPU that NVML does not count.
        if vendor != NVIDIA_VENDOR || path.join("physfn").exists() {
            continue;
        }
        let device = PciDevice {
            address: entry.file_name().to_string_lossy().into_owned(),
            vendor,
            device: read_hex(&path.join("device"), 0xffff)? as u16,
            class: read_hex(&path.join("class"), 0xff_ffff)?,
        };
        if device.is_nvidia_gpu() {
            gpus.push(device);
        }
    }
    gpus.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(gpus)
}

fn read_hex(path: &Path, max: u32) -> Result<u32, ObserveError> {
    let text = read(path)?;
    parse_sysfs_hex(&text)
        .filter(|v| *v <= max)
        .ok_or_else(|| ObserveError::Parse {
            path: path.to_path_buf(),
            text: text.trim().to_string(),
            expected: "a hex number such as 0x10de",
        })
}

/// The NVIDIA driver modules as the kernel has them now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoadedDriver {
    /// `/sys/module/nvidia/version`, e.g. `550.54.15`.
    pub version: Option<String>,
    /// Which of [`DRIVER_MODULES`] are loaded (`/sys/module/<name>` exists), in that order.
    pub modules: Vec<String>,
    /// `/sys/module/nvidia/refcnt`: how many holders (dependent modules and open handles).
    pub refcnt: Option<u32>,
}

/// The loaded driver modules, or `None` when `nvidia` is not loaded (no `/sys/module/nvidia`).
pub fn loaded_driver(root: &HostRoot) -> Result<Option<LoadedDriver>, ObserveError> {
    if !root.join("/sys/module/nvidia").is_dir() {
        return Ok(None);
    }
    let version = read_optional(&root.join("/sys/module/nvidia/version"))?
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    let refcnt_path = root.join("/sys/module/nvidia/refcnt");
    let refcnt = match read_optional(&refcnt_path)? {
        None => None,
        Some(text) => Some(text.trim().parse::<u32>().map_err(|_| ObserveError::Parse {
            path: refcnt_path,
            text: text.trim().to_string(),
            expected: "a count",
        })?),
    };
    let modules = DRIVER_MODULES
        .iter()
        .filter(|m| module_loaded(root, m))
        .map(|m| m.to_string())
        .collect();
    Ok(Some(LoadedDriver {
        version,
        modules,
        refcnt,
    }))
}

/// Whether a kernel module is loaded (or built in): `/sys/module/<name>` exists.
pub fn module_loaded(root: &HostRoot, name: &str) -> bool {
    root.join(Path::new("/sys/module").join(name)).is_dir()
}

/// The modules compute needs (`/sys/module` names), with what each is for and the device node
/// that shows it loaded where `/sys/module` does not.
pub const COMPUTE_MODULES: [(&str, &str, &str); 2] = [
    ("nvidia", "the driver itself", "/dev/nvidiactl"),
    (
        "nvidia_uvm",
        "CUDA programs cannot start without /dev/nvidia-uvm",
        "/dev/nvidia-uvm",
    ),
];

/// Which of the device nodes that show the compute modules loaded
/// ([`COMPUTE_MODULES`]: `/dev/nvidiactl`, `/dev/nvidia-uvm`) are character
/// devices under `dev_base` (the root joined with `[device_plugin] dev_root`), as host paths.
/// A link or anything but a character device does not count; nothing is opened.
pub fn driver_nodes(dev_base: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    COMPUTE_MODULES
        .iter()
        .map(|(_, _, node)| *node)
        .filter(|node| {
            fs::symlink_metadata(crate::host::rooted(dev_base, Path::new(node)))
                .is_ok_and(|m| m.file_type().is_char_device())
        })
        .map(str::to_string)
        .collect()
}

/// Whether nouveau is loaded; it holds the GPUs, so the NVIDIA driver cannot bind them.
pub fn nouveau_loaded(root: &HostRoot) -> bool {
    module_loaded(root, "nouveau")
}

/// Which of [`CONFLICTING_MODULES`] are loaded.
pub fn conflicting_modules(root: &HostRoot) -> Vec<&'static str> {
    CONFLICTING_MODULES
        .into_iter()
        .filter(|m| module_loaded(root, m))
        .collect()
}

/// Parses `/proc/driver/nvidia/version`: the flavour and version of the loaded kernel module,
/// from the first line naming a kernel module:
/// - open: `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build ...`
/// - proprietary: `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ...`
pub fn parse_proc_version(text: &str) -> Option<(Flavour, String)> {
    let line = text.lines().find(|l| l.contains("Kernel Module"))?;
    let flavour = if line.contains("Open Kernel Module") {
        Flavour::Open
    } else {
        Flavour::Proprietary
    };
    let (_, after) = line.split_once("Kernel Module")?;
    let version = after.split_whitespace().find(|w| is_version(w))?;
    Some((flavour, version.to_string()))
}

/// `550.54.15`, `535.161.08`, `580.65`: digits in two or more dot-separated parts.
fn is_version(word: &str) -> bool {
    let mut parts = 0;
    for part in word.split('.') {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        parts += 1;
    }
    parts >= 2
}

/// The flavour of the loaded nvidia module, from `/proc/driver/nvidia/version`; `None` when the
/// file is missing (no driver loaded) or does not name a kernel module.
pub fn module_flavour_loaded(root: &HostRoot) -> Result<Option<Flavour>, ObserveError> {
    let text = read_optional(&root.join("/proc/driver/nvidia/version"))?;
    Ok(text.as_deref().and_then(parse_proc_version).map(|(flavour, _)| flavour))
}

/// The running kernel's release (`uname -r`). On the real root, uname(2). Under another root,
/// `<root>/proc/sys/kernel/osrelease` (the host's kernel when the host's `/proc` is there, a
/// fixture in tests), and uname(2) when that file is missing.
pub fn kernel_release(root: &HostRoot) -> Result<String, ObserveError> {
    if !root.is_real()
        && let Some(text) = read_optional(&root.join("/proc/sys/kernel/osrelease"))?
    {
        let release = text.trim();
        if !release.is_empty() {
            return Ok(release.to_string());
        }
    }
    let uts = nix::sys::utsname::uname().map_err(ObserveError::Uname)?;
    Ok(uts.release().to_string_lossy().into_owned())
}

/// The kernel headers for `release`, as a host path with symlinks resolved inside the root: the
/// first of `/lib/modules/<release>/build`, `/usr/src/linux-headers-<release>` (Debian, Ubuntu)
/// and `/usr/src/kernels/<release>` (RHEL family) that is a directory with a `Makefile`.
///
/// The resolved path is returned (`/usr/src/linux-headers-<release>` rather than the `build`
/// link) so that kbuild given `<root>/<path>` never follows an absolute link out of the root.
pub fn kernel_headers(root: &HostRoot, release: &str) -> Option<PathBuf> {
    if release.is_empty() || release.contains('/') || release == "." || release == ".." {
        return None;
    }
    let candidates = [
        Path::new("/lib/modules").join(release).join("build"),
        Path::new("/usr/src").join(format!("linux-headers-{release}")),
        Path::new("/usr/src/kernels").join(release),
    ];
    candidates.iter().find_map(|candidate| {
        let dir = resolve_in_root(root, candidate)?;
        let makefile = resolve_in_root(root, &dir.join("Makefile"))?;
        (root.join(&dir).is_dir() && root.join(&makefile).is_file()).then_some(dir)
    })
}

/// Resolves every symlink in the host path `path` the way the host's kernel would, with the root
/// prefix as `/`: absolute targets start again at the root, relative ones at the link's
/// directory, and `..` never climbs above the root. Returns the resolved host path; a component
/// that does not exist is kept as it is (the caller's existence check fails on it). `None` on a
/// symlink loop or an unreadable link.
pub fn resolve_in_root(root: &HostRoot, path: &Path) -> Option<PathBuf> {
    let mut todo: VecDeque<OsString> = VecDeque::new();
    push_front_components(&mut todo, path);
    let mut resolved = PathBuf::from("/");
    let mut links = 0;
    while let Some(part) = todo.pop_front() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&part);
        let on_disk = root.join(&candidate);
        match fs::symlink_metadata(&on_disk) {
            Ok(meta) if meta.file_type().is_symlink() => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return None;
                }
                let target = fs::read_link(&on_disk).ok()?;
                if target.is_absolute() {
                    resolved = PathBuf::from("/");
                }
                push_front_components(&mut todo, &target);
            }
            _ => resolved = candidate,
        }
    }
    Some(resolved)
}

/// Puts the normal and `..` components of `path` at the front of `todo`, in order.
fn push_front_components(todo: &mut VecDeque<OsString>, path: &Path) {
    let parts: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    for part in parts.into_iter().rev() {
        todo.push_front(part);
    }
}

/// Whether the firmware enforces signatures on kernel modules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SecureBoot {
    Enabled,
    Disabled,
    /// EFI firmware, but the variable could not be read (efivarfs not mounted, say).
    Unknown,
}

/// Parses the `SecureBoot` EFI variable as efivarfs gives it: 4 bytes of attributes, then the
/// value byte (1 enabled, 0 disabled).
pub fn parse_secure_boot_var(bytes: &[u8]) -> SecureBoot {
    secure_boot_value(bytes.get(4).copied())
}

fn secure_boot_value(value: Option<u8>) -> SecureBoot {
    match value {
        Some(1) => SecureBoot::Enabled,
        Some(0) => SecureBoot::Disabled,
        _ => SecureBoot::Unknown,
    }
}

/// Secure Boot from the firmware. No `/sys/firmware/efi` means a legacy BIOS boot, where there is
/// no Secure Boot: [`SecureBoot::Disabled`]. With EFI, the efivarfs variable, else the old sysfs
/// `vars/<name>/data` (the value byte alone); neither readable is [`SecureBoot::Unknown`].
pub fn secure_boot(root: &HostRoot) -> SecureBoot {
    if !root.join("/sys/firmware/efi").is_dir() {
        return SecureBoot::Disabled;
    }
    if let Ok(bytes) = fs::read(root.join(Path::new("/sys/firmware/efi/efivars").join(SECURE_BOOT_VAR))) {
        return parse_secure_boot_var(&bytes);
    }
    let legacy = Path::new("/sys/firmware/efi/vars").join(SECURE_BOOT_VAR).join("data");
    match fs::read(root.join(legacy)) {
        Ok(bytes) => secure_boot_value(bytes.first().copied()),
        Err(_) => SecureBoot::Unknown,
    }
}

/// Everything the driver stage plans from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostFacts {
    pub kernel_release: String,
    /// The machine architecture ([`HostArch::read`]): names the `.run` to download.
    pub arch: HostArch,
    pub os: OsRelease,
    pub gpus: Vec<PciDevice>,
    pub loaded: Option<LoadedDriver>,
    pub loaded_flavour: Option<Flavour>,
    pub nouveau: bool,
    /// Kernel headers for `kernel_release` (host path, resolved; see [`kernel_headers`]).
    pub headers: Option<PathBuf>,
    pub secure_boot: SecureBoot,
    /// Why the host's `/usr` cannot be written (an rpm-ostree or Flatcar host, or a read-only
    /// mount); `None` when it can ([`read_only_usr`]).
    pub read_only_usr: Option<String>,
}

/// Why `/usr` under `root` cannot take a driver's files: an rpm-ostree host
/// (`/run/ostree-booted`: Fedora CoreOS, RHEL for Edge), Flatcar Container Linux or
/// Bottlerocket (`ID=` in os-release), or `/usr` mounted read-only.
pub fn read_only_usr(root: &HostRoot, os: &OsRelease) -> Option<String> {
    if root.join("/run/ostree-booted").exists() {
        return Some(
            "/run/ostree-booted: an rpm-ostree host (Fedora CoreOS, RHEL for Edge), whose /usr is read-only".into(),
        );
    }
    match os.id.as_str() {
        "flatcar" => {
            return Some("ID=flatcar (/etc/os-release): Flatcar Container Linux, whose /usr is read-only".into());
        }
        "bottlerocket" => {
            return Some("ID=bottlerocket (/etc/os-release): Bottlerocket, whose /usr is read-only".into());
        }
        _ => {}
    }
    let usr = root.join("/usr");
    match nix::sys::statvfs::statvfs(&usr) {
        Ok(st) if st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY) => {
            Some(format!("{} is mounted read-only", usr.display()))
        }
        _ => None,
    }
}

/// Observes the host under `root`.
pub fn observe(root: &HostRoot) -> Result<HostFacts, ObserveError> {
    let kernel_release = kernel_release(root)?;
    let headers = kernel_headers(root, &kernel_release);
    let os = os_release(root)?;
    Ok(HostFacts {
        arch: HostArch::read(root),
        read_only_usr: read_only_usr(root, &os),
        os,
        gpus: nvidia_gpus(root)?,
        loaded: loaded_driver(root)?,
        loaded_flavour: module_flavour_loaded(root)?,
        nouveau: nouveau_loaded(root),
        headers,
        secure_boot: secure_boot(root),
        kernel_release,
    })
}

fn read(path: &Path) -> Result<String, ObserveError> {
    fs::read_to_string(path).map_err(|source| ObserveError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a file that may be missing (`None`); any other failure is an error naming it.
fn read_optional(path: &Path) -> Result<Option<String>, ObserveError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ObserveError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// [`read_optional`] of a host path whose symlinks are resolved inside the root.
fn read_optional_in_root(root: &HostRoot, host_path: &Path) -> Result<Option<String>, ObserveError> {
    match resolve_in_root(root, host_path) {
        Some(resolved) => read_optional(&root.join(resolved)),
        None => Err(ObserveError::Read {
            path: root.join(host_path),
            source: io::Error::other("symlink loop or unreadable symlink"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn write(root: &Path, host_path: &str, text: &str) {
        let path = crate::host::rooted(root, Path::new(host_path));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn mkdir(root: &Path, host_path: &str) {
        fs::create_dir_all(crate::host::rooted(root, Path::new(host_path))).unwrap();
    }

    fn link(root: &Path, host_path: &str, target: &str) {
        let path = crate::host::rooted(root, Path::new(host_path));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        symlink(target, path).unwrap();
    }

    const UBUNTU_2204: &str = r#"PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
HOME_URL="https://www.ubuntu.com/"
UBUNTU_CODENAME=jammy
"#;

    const DEBIAN_12: &str = r#"PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
"#;

    const RHEL_94: &str = r#"NAME="Red Hat Enterprise Linux"
VERSION="9.4 (Plow)"
ID="rhel"
ID_LIKE="fedora"
VERSION_ID="9.4"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Red Hat Enterprise Linux 9.4 (Plow)"
ANSI_COLOR="0;31"
CPE_NAME="cpe:/o:redhat:enterprise_linux:9::baseos"
"#;

    const ROCKY_93: &str = r#"NAME="Rocky Linux"
VERSION="9.3 (Blue Onyx)"
ID="rocky"
ID_LIKE="rhel centos fedora"
VERSION_ID="9.3"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Rocky Linux 9.3 (Blue Onyx)"
"#;

    const AMAZON_2023: &str = r#"NAME="Amazon Linux"
VERSION="2023"
ID="amzn"
ID_LIKE="fedora"
VERSION_ID="2023"
PLATFORM_ID="platform:al2023"
PRETTY_NAME="Amazon Linux 2023.4.20240528"
"#;

    #[test]
    fn os_release_ubuntu() {
        let os = parse_os_release(UBUNTU_2204);
        assert_eq!(
            os,
            OsRelease {
                id: "ubuntu".into(),
                id_like: vec!["debian".into()],
                version_id: "22.04".into(),
                version_codename: "jammy".into(),
                pretty_name: "Ubuntu 22.04.4 LTS".into(),
            }
        );
        assert_eq!(os.distro(), Distro::Ubuntu);
    }

    #[test]
    fn os_release_debian() {
        let os = parse_os_release(DEBIAN_12);
        assert_eq!((os.id.as_str(), os.version_id.as_str()), ("debian", "12"));
        assert_eq!(os.version_codename, "bookworm");
        assert!(os.id_like.is_empty());
        assert_eq!(os.distro(), Distro::Debian);
    }

    #[test]
    fn os_release_rhel_family() {
        let rhel = parse_os_release(RHEL_94);
        assert_eq!((rhel.id.as_str(), rhel.version_id.as_str()), ("rhel", "9.4"));
        assert_eq!(rhel.pretty_name, "Red Hat Enterprise Linux 9.4 (Plow)");
        assert_eq!(rhel.version_codename, "");
        assert_eq!(rhel.distro(), Distro::RhelFamily);

        let rocky = parse_os_release(ROCKY_93);
        assert_eq!(rocky.id_like, ["rhel", "centos", "fedora"]);
        assert_eq!(rocky.distro(), Distro::RhelFamily);

        let amzn = parse_os_release(AMAZON_2023);
        assert_eq!((amzn.id.as_str(), amzn.version_id.as_str()), ("amzn", "2023"));
        assert_eq!(amzn.distro(), Distro::RhelFamily);
    }

    #[test]
    fn os_release_derivatives_follow_id_like() {
        let pop = parse_os_release("ID=pop\nID_LIKE=\"ubuntu debian\"\n");
        assert_eq!(pop.distro(), Distro::Ubuntu);
        let raspbian = parse_os_release("ID=raspbian\nID_LIKE=debian\n");
        assert_eq!(raspbian.distro(), Distro::Debian);
        let alma = parse_os_release("ID=\"almalinux\"\nID_LIKE=\"rhel centos fedora\"\n");
        assert_eq!(alma.distro(), Distro::RhelFamily);
        let suse = parse_os_release("ID=\"sles\"\nID_LIKE=\"suse\"\n");
        assert_eq!(suse.distro(), Distro::Unknown);
        assert_eq!(parse_os_release("").distro(), Distro::Unknown);
    }

    #[test]
    fn os_release_quoting_and_comments() {
        let text = concat!(
            "# a comment\n",
            "\n",
            "  # indented comment\n",
            "PRETTY_NAME=\"Say \\\"hi\\\" for \\$5 \\\\ \\n\"\n",
            "ID='my distro' # trailing comment\n",
            "VERSION_ID=1\\ 2\n",
            "VERSION_CODENAME=\"a\"'b'c\n",
            "ID_LIKE=\"  ubuntu   debian \"\n",
            "not a key value line\n",
            "=orphan\n",
        );
        let os = parse_os_release(text);
        assert_eq!(os.pretty_name, "Say \"hi\" for $5 \\ \\n");
        assert_eq!(os.id, "my distro");
        assert_eq!(os.version_id, "1 2");
        assert_eq!(os.version_codename, "abc");
        assert_eq!(os.id_like, ["ubuntu", "debian"]);
    }

    #[test]
    fn os_release_unterminated_quote_runs_to_end_of_line() {
        let os = parse_os_release("PRETTY_NAME=\"Broken\nID=ubuntu\n");
        assert_eq!(os.pretty_name, "Broken");
        assert_eq!(os.id, "ubuntu");
    }

    #[test]
    fn os_release_file_fallback_and_absence() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path());
        assert_eq!(os_release(&root).unwrap(), OsRelease::default());
        write(dir.path(), "/usr/lib/os-release", DEBIAN_12);
        assert_eq!(os_release(&root).unwrap().id, "debian");
        // Ubuntu's /etc/os-release is a link into /usr/lib; an absolute one must stay in the root.
        link(dir.path(), "/etc/os-release", "/usr/lib/os-release");
        assert_eq!(os_release(&root).unwrap().id, "debian");
    }

    fn pci(root: &Path, address: &str, vendor: &str, device: &str, class: &str) {
        let base = format!("/sys/bus/pci/devices/{address}");
        write(root, &format!("{base}/vendor"), &format!("{vendor}\n"));
        write(root, &format!("{base}/device"), &format!("{device}\n"));
        write(root, &format!("{base}/class"), &format!("{class}\n"));
    }

    #[test]
    fn pci_scan_keeps_only_nvidia_gpus() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        pci(r, "0000:c1:00.0", "0x10de", "0x2330", "0x030200"); // H100 SXM, 3D controller
        pci(r, "0000:07:00.0", "0x10de", "0x2684", "0x030000"); // RTX 4090, VGA
        pci(r, "0000:07:00.1", "0x10de", "0x22ba", "0x040300"); // its HDMI audio
        pci(r, "0000:05:00.0", "0x10de", "0x22a3", "0x068000"); // NVSwitch
        pci(r, "0000:00:02.0", "0x8086", "0x4680", "0x030000"); // Intel iGPU
        pci(r, "0000:c1:00.4", "0x10de", "0x2330", "0x030200"); // an SR-IOV virtual function
        link(r, "/sys/bus/pci/devices/0000:c1:00.4/physfn", "../0000:c1:00.0");
        // Another vendor's unparsable attributes are never read.
        write(r, "/sys/bus/pci/devices/0000:00:1f.0/vendor", "0x8086\n");
        write(r, "/sys/bus/pci/devices/0000:00:1f.0/class", "garbage\n");

        let gpus = nvidia_gpus(&HostRoot::new(r)).unwrap();
        assert_eq!(
            gpus,
            [
                PciDevice {
                    address: "0000:07:00.0".into(),
                    vendor: 0x10de,
                    device: 0x2684,
                    class: 0x030000
                },
                PciDevice {
                    address: "0000:c1:00.0".into(),
                    vendor: 0x10de,
                    device: 0x2330,
                    class: 0x030200
                },
            ]
        );
        let json = serde_json::to_value(&gpus[1]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"address": "0000:c1:00.0", "vendor": "0x10de", "device": "0x2330", "class": "0x030200"})
        );
    }

    #[test]
    fn pci_scan_without_sysfs_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(nvidia_gpus(&HostRoot::new(dir.path())).unwrap(), []);
    }

    #[test]
    fn pci_scan_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        write(r, "/sys/bus/pci/devices/0000:07:00.0/vendor", "0x10de\n");
        write(r, "/sys/bus/pci/devices/0000:07:00.0/device", "0x2330\n");
        let err = nvidia_gpus(&HostRoot::new(r)).unwrap_err();
        assert!(matches!(err, ObserveError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains("0000:07:00.0/class"), "{err}");

        write(r, "/sys/bus/pci/devices/0000:07:00.0/class", "0x03zz00\n");
        let err = nvidia_gpus(&HostRoot::new(r)).unwrap_err().to_string();
        assert!(err.contains("0000:07:00.0/class") && err.contains("0x03zz00"), "{err}");
    }

    #[test]
    fn read_only_usr_names_the_immutable_host() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        std::fs::create_dir_all(r.join("usr")).unwrap();
        let debian = parse_os_release("ID=debian\n");
        assert_eq!(read_only_usr(&root, &debian), None, "a writable /usr");
        let flatcar = parse_os_release("ID=flatcar\nID_LIKE=coreos\n");
        let why = read_only_usr(&root, &flatcar).unwrap();
        assert!(why.contains("Flatcar"), "{why}");
        write(r, "/run/ostree-booted", "");
        let why = read_only_usr(&root, &parse_os_release("ID=fedora\nVARIANT_ID=coreos\n")).unwrap();
        assert!(
            why.contains("/run/ostree-booted") && why.contains("rpm-ostree"),
            "{why}"
        );
    }

    #[test]
    fn sysfs_hex() {
        assert_eq!(parse_sysfs_hex("0x10de\n"), Some(0x10de));
        assert_eq!(parse_sysfs_hex("10DE"), Some(0x10de));
        assert_eq!(parse_sysfs_hex("0x"), None);
        assert_eq!(parse_sysfs_hex("nope"), None);
    }

    #[test]
    fn loaded_driver_reads_sys_module() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        assert_eq!(loaded_driver(&root).unwrap(), None);

        write(r, "/sys/module/nvidia/version", "550.54.15\n");
        write(r, "/sys/module/nvidia/refcnt", "2\n");
        mkdir(r, "/sys/module/nvidia_uvm");
        mkdir(r, "/sys/module/nvidia_modeset");
        mkdir(r, "/sys/module/nvme");
        assert_eq!(
            loaded_driver(&root).unwrap(),
            Some(LoadedDriver {
                version: Some("550.54.15".into()),
                modules: vec!["nvidia".into(), "nvidia_uvm".into(), "nvidia_modeset".into()],
                refcnt: Some(2),
            })
        );

        write(r, "/sys/module/nvidia/refcnt", "many\n");
        let err = loaded_driver(&root).unwrap_err().to_string();
        assert!(err.contains("refcnt") && err.contains("many"), "{err}");
    }

    #[test]
    fn loaded_driver_without_version_or_refcnt() {
        let dir = tempfile::tempdir().unwrap();
        mkdir(dir.path(), "/sys/module/nvidia");
        let loaded = loaded_driver(&HostRoot::new(dir.path())).unwrap().unwrap();
        assert_eq!((loaded.version, loaded.refcnt), (None, None));
        assert_eq!(loaded.modules, ["nvidia"]);
    }

    #[test]
    fn driver_nodes_are_character_devices_under_the_dev_base() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        assert!(driver_nodes(r).is_empty());
        // A regular file and a link to a character device outside the tree do not count.
        write(r, "/dev/nvidiactl", "");
        std::os::unix::fs::symlink("/dev/null", r.join("dev/nvidia-uvm")).unwrap();
        assert!(driver_nodes(r).is_empty());
        // mknod needs CAP_MKNOD: the positive case runs where the tests run as root.
        if nix::unistd::Uid::effective().is_root() {
            fs::remove_file(r.join("dev/nvidia-uvm")).unwrap();
            nix::sys::stat::mknod(
                &r.join("dev/nvidia-uvm"),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(511, 0),
            )
            .unwrap();
            assert_eq!(driver_nodes(r), ["/dev/nvidia-uvm"]);
        }
    }

    #[test]
    fn nouveau_and_nova() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path());
        assert!(!nouveau_loaded(&root));
        assert!(conflicting_modules(&root).is_empty());
        mkdir(dir.path(), "/sys/module/nouveau");
        mkdir(dir.path(), "/sys/module/nova_core");
        assert!(nouveau_loaded(&root));
        assert_eq!(conflicting_modules(&root), ["nouveau", "nova_core"]);
    }

    const PROC_OPEN: &str = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  \
                             (dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 22:15:33 UTC 2024\n\
                             GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n";
    const PROC_PROPRIETARY: &str = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.161.08  \
                                    Tue Mar  5 22:42:18 UTC 2024\nGCC version:  gcc version 11.4.0\n";

    #[test]
    fn proc_version_flavours() {
        assert_eq!(parse_proc_version(PROC_OPEN), Some((Flavour::Open, "550.54.15".into())));
        assert_eq!(
            parse_proc_version(PROC_PROPRIETARY),
            Some((Flavour::Proprietary, "535.161.08".into()))
        );
        assert_eq!(
            parse_proc_version("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.65.06  Release Build"),
            Some((Flavour::Open, "580.65.06".into()))
        );
        assert_eq!(
            parse_proc_version("NVRM version: NVIDIA UNIX aarch64 Kernel Module  550.54.15  Tue"),
            Some((Flavour::Proprietary, "550.54.15".into()))
        );
        assert_eq!(parse_proc_version(""), None);
        assert_eq!(parse_proc_version("GCC version: gcc 12.3.0\n"), None);
        assert_eq!(
            parse_proc_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module garbled"),
            None
        );
    }

    #[test]
    fn flavour_from_proc() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path());
        assert_eq!(module_flavour_loaded(&root).unwrap(), None);
        write(dir.path(), "/proc/driver/nvidia/version", PROC_OPEN);
        assert_eq!(module_flavour_loaded(&root).unwrap(), Some(Flavour::Open));
    }

    #[test]
    fn kernel_release_under_a_test_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = HostRoot::new(dir.path());
        // No fixture: the agent's own kernel.
        let own = nix::sys::utsname::uname()
            .unwrap()
            .release()
            .to_string_lossy()
            .into_owned();
        assert_eq!(kernel_release(&root).unwrap(), own);
        write(dir.path(), "/proc/sys/kernel/osrelease", "5.15.0-118-generic\n");
        assert_eq!(kernel_release(&root).unwrap(), "5.15.0-118-generic");
    }

    #[test]
    fn headers_via_build_link_resolved_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        let release = "5.15.0-118-generic";
        assert_eq!(kernel_headers(&root, release), None);

        // Ubuntu: an absolute link, which must land under the root, not in the agent's /usr/src.
        link(
            r,
            "/lib/modules/5.15.0-118-generic/build",
            "/usr/src/linux-headers-5.15.0-118-generic",
        );
        assert_eq!(
            kernel_headers(&root, release),
            None,
            "the link's target has no Makefile yet"
        );
        write(r, "/usr/src/linux-headers-5.15.0-118-generic/Makefile", "# kbuild\n");
        assert_eq!(
            kernel_headers(&root, release),
            Some(PathBuf::from("/usr/src/linux-headers-5.15.0-118-generic"))
        );
    }

    #[test]
    fn headers_relative_link_and_rhel_layout() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        let release = "5.14.0-427.13.1.el9_4.x86_64";
        // RHEL: /usr/src/kernels/<r>, reached through a relative build link with `..` that would
        // climb above the root if not clamped.
        write(r, &format!("/usr/src/kernels/{release}/Makefile"), "");
        link(
            r,
            &format!("/lib/modules/{release}/build"),
            &format!("../../../../../../usr/src/kernels/{release}"),
        );
        assert_eq!(
            kernel_headers(&root, release),
            Some(PathBuf::from(format!("/usr/src/kernels/{release}")))
        );
        fs::remove_file(crate::host::rooted(
            r,
            Path::new(&format!("/lib/modules/{release}/build")),
        ))
        .unwrap();
        assert_eq!(
            kernel_headers(&root, release),
            Some(PathBuf::from(format!("/usr/src/kernels/{release}")))
        );
        assert_eq!(kernel_headers(&root, "../etc"), None);
        assert_eq!(kernel_headers(&root, ""), None);
    }

    #[test]
    fn headers_makefile_may_be_a_link_and_loops_fail() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        write(r, "/usr/src/common/Makefile", "");
        link(
            r,
            "/usr/src/linux-headers-6.1.0-18-amd64/Makefile",
            "/usr/src/common/Makefile",
        );
        assert_eq!(
            kernel_headers(&root, "6.1.0-18-amd64"),
            Some(PathBuf::from("/usr/src/linux-headers-6.1.0-18-amd64"))
        );
        link(r, "/lib/modules/loop/build", "/lib/modules/loop/build");
        assert_eq!(kernel_headers(&root, "loop"), None);
        assert_eq!(resolve_in_root(&root, Path::new("/lib/modules/loop/build/x")), None);
    }

    #[test]
    fn secure_boot_bytes() {
        assert_eq!(parse_secure_boot_var(&[0x06, 0, 0, 0, 1]), SecureBoot::Enabled);
        assert_eq!(parse_secure_boot_var(&[0x06, 0, 0, 0, 0]), SecureBoot::Disabled);
        assert_eq!(parse_secure_boot_var(&[0x06, 0, 0, 0]), SecureBoot::Unknown);
        assert_eq!(parse_secure_boot_var(&[0x06, 0, 0, 0, 7]), SecureBoot::Unknown);
        assert_eq!(parse_secure_boot_var(&[]), SecureBoot::Unknown);
    }

    #[test]
    fn secure_boot_from_firmware() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let root = HostRoot::new(r);
        assert_eq!(secure_boot(&root), SecureBoot::Disabled, "legacy BIOS");
        mkdir(r, "/sys/firmware/efi/efivars");
        assert_eq!(secure_boot(&root), SecureBoot::Unknown, "EFI, variable unreadable");
        write(r, &format!("/sys/firmware/efi/vars/{SECURE_BOOT_VAR}/data"), "\u{1}");
        assert_eq!(secure_boot(&root), SecureBoot::Enabled, "old sysfs vars");
        let var = crate::host::rooted(r, &Path::new("/sys/firmware/efi/efivars").join(SECURE_BOOT_VAR));
        fs::write(var, [0x06, 0, 0, 0, 0]).unwrap();
        assert_eq!(secure_boot(&root), SecureBoot::Disabled, "efivarfs wins");
    }

    #[test]
    fn observe_a_whole_host() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        write(r, "/etc/os-release", UBUNTU_2204);
        write(r, "/proc/sys/kernel/osrelease", "5.15.0-118-generic\n");
        write(r, "/usr/src/linux-headers-5.15.0-118-generic/Makefile", "");
        link(
            r,
            "/lib/modules/5.15.0-118-generic/build",
            "/usr/src/linux-headers-5.15.0-118-generic",
        );
        pci(r, "0000:07:00.0", "0x10de", "0x2330", "0x030200");
        write(r, "/sys/module/nvidia/version", "535.161.08\n");
        write(r, "/sys/module/nvidia/refcnt", "0\n");
        write(r, "/proc/driver/nvidia/version", PROC_PROPRIETARY);

        let facts = observe(&HostRoot::new(r)).unwrap();
        assert_eq!(facts.kernel_release, "5.15.0-118-generic");
        assert_eq!(facts.os.distro(), Distro::Ubuntu);
        assert_eq!(facts.gpus.len(), 1);
        assert_eq!(
            facts.loaded.as_ref().and_then(|l| l.version.as_deref()),
            Some("535.161.08")
        );
        assert_eq!(facts.loaded_flavour, Some(Flavour::Proprietary));
        assert!(!facts.nouveau);
        assert_eq!(
            facts.headers,
            Some(PathBuf::from("/usr/src/linux-headers-5.15.0-118-generic"))
        );
        assert_eq!(facts.secure_boot, SecureBoot::Disabled);

        let json = serde_json::to_value(&facts).unwrap();
        assert_eq!(json["loaded_flavour"], "proprietary");
        assert_eq!(json["secure_boot"], "disabled");
        assert_eq!(json["loaded"]["refcnt"], 0);
    }
}
