//! The NVIDIA device nodes under `/dev`, created the way `nvidia-modprobe` creates them, for hosts
//! without it (or with a driver the agent loaded with `insmod` from its cache). The CDI spec names
//! these nodes by host path, and a container engine fails a container whose node is missing.
//!
//! [`plan`] is pure: from the character majors in `/proc/devices`, the driver's MIG capability
//! minors, the GPU minors and MIG devices, whether `nvidia_modeset` is loaded, the permissions
//! the driver publishes, and the nodes already there, it lists the nodes to create and the ones
//! that are there with other numbers (reported, never removed or changed). [`observe`] reads
//! those inputs under the root; [`apply`] creates the nodes (`mknod`, then the mode and owner the
//! driver asks for) and removes nothing.
//!
//! What the driver publishes, and `nvidia-modprobe` follows:
//! - `nvidiactl` (minor 255), `nvidia<N>` per GPU and `nvidia-modeset` (254, only while the
//!   `nvidia_modeset` module is loaded) have the nvidia frontend's major (`nvidia-frontend` or
//!   `nvidia` in `/proc/devices`, normally 195), mode `DeviceFileMode` of
//!   `/proc/driver/nvidia/params` (0666 by default), owner `DeviceFileUID`/`DeviceFileGID`;
//!   `ModifyDeviceFiles: 0` there means the driver wants them left alone.
//! - `nvidia-uvm` (minor 0) and `nvidia-uvm-tools` (1) have the `nvidia-uvm` major, mode 0666.
//! - `/dev/nvidia-caps/nvidia-cap<N>` (directory 0755) have the `nvidia-caps` major and the minor
//!   of `/proc/driver/nvidia-caps/mig-minors`; their mode is the `DeviceFileMode` of the
//!   capability's file under `/proc/driver/nvidia/capabilities/` (0400 for `mig/config`, 0444
//!   for the others as the driver publishes them), `DeviceFileModify: 0` leaves them alone.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::stat::{Mode, SFlag, makedev, mknod};

use super::{HostRoot, rooted};

/// The kernel's registered device numbers.
pub const PROC_DEVICES: &str = "/proc/devices";
/// The nvidia module's parameters, with the device file mode, owner and whether to touch them.
pub const NVIDIA_PARAMS: &str = "/proc/driver/nvidia/params";
/// One file per capability, with its device file's minor and mode.
pub const CAPABILITIES_DIR: &str = "/proc/driver/nvidia/capabilities";
/// One directory per GPU (by PCI address) with an `information` file naming its device minor.
pub const GPUS_DIR: &str = "/proc/driver/nvidia/gpus";
/// Where the capability nodes are.
pub const CAPS_DIR: &str = "/dev/nvidia-caps";
/// `nvidiactl`'s minor.
pub const CTL_MINOR: u32 = 255;
/// `nvidia-modeset`'s minor.
pub const MODESET_MINOR: u32 = 254;
/// The `mig-minors` keys of the MIG config and monitor capabilities.
pub const CONFIG_CAP: &str = "config";
pub const MONITOR_CAP: &str = "monitor";

/// Mode of the nvidia and uvm nodes when the driver says nothing else.
const NVIDIA_MODE: u32 = 0o666;
/// Mode of a capability node whose capability file cannot be read: read-only for everyone (what
/// the driver publishes for `monitor` and the GI/CI access capabilities) ...
const CAP_MODE: u32 = 0o444;
/// ... but root only for `config`: whoever can open it may create and destroy MIG instances.
const CONFIG_CAP_MODE: u32 = 0o400;
const CAPS_DIR_MODE: u32 = 0o755;

/// The `mig-minors` key of a GPU instance's access capability.
pub fn gi_access_key(gpu_minor: u32, gi: u32) -> String {
    format!("gpu{gpu_minor}/gi{gi}/access")
}

/// The `mig-minors` key of a compute instance's access capability.
pub fn ci_access_key(gpu_minor: u32, gi: u32, ci: u32) -> String {
    format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access")
}

/// The capability's file under [`CAPABILITIES_DIR`] for a `mig-minors` key: `config` is
/// `mig/config`, `gpu0/gi1/access` is `gpu0/mig/gi1/access`.
pub fn cap_proc_path(key: &str) -> String {
    match key.split_once('/') {
        Some((gpu, rest)) if gpu.starts_with("gpu") => format!("{gpu}/mig/{rest}"),
        _ => format!("mig/{key}"),
    }
}

/// The character majors the driver registered, from `/proc/devices`; `None` when not registered
/// (the module is not loaded), and then nothing of that class is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Majors {
    /// `nvidia-frontend` (or `nvidia`): `nvidiactl`, `nvidia<N>`, `nvidia-modeset`.
    pub nvidia: Option<u32>,
    /// `nvidia-uvm`: `nvidia-uvm`, `nvidia-uvm-tools`.
    pub uvm: Option<u32>,
    /// `nvidia-caps`: `/dev/nvidia-caps/nvidia-cap<N>`.
    pub caps: Option<u32>,
}

/// Reads the `Character devices:` section of `/proc/devices` (`<major> <name>` per line, up to a
/// blank line or the next section). Lines that are not a decimal major and one name are skipped,
/// and so is everything outside that section: no section, no majors.
pub fn parse_proc_devices(text: &str) -> Majors {
    let mut in_chars = false;
    let mut majors: BTreeMap<&str, u32> = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() {
            in_chars = false;
            continue;
        }
        if line.ends_with(':') {
            in_chars = line == "Character devices:";
            continue;
        }
        if !in_chars {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(major), Some(name), None) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if let Ok(major) = major.parse::<u32>() {
            majors.entry(name).or_insert(major);
        }
    }
    Majors {
        nvidia: majors.get("nvidia-frontend").or_else(|| majors.get("nvidia")).copied(),
        uvm: majors.get("nvidia-uvm").copied(),
        caps: majors.get("nvidia-caps").copied(),
    }
}

/// The device file settings a driver file publishes (`Name: value` lines, decimal values), each
/// `None` when absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileParams {
    /// `DeviceFileMode` (permission bits only).
    pub mode: Option<u32>,
    /// `DeviceFileUID`.
    pub uid: Option<u32>,
    /// `DeviceFileGID`.
    pub gid: Option<u32>,
    /// `ModifyDeviceFiles` (params) or `DeviceFileModify` (capabilities): `false` when not 1.
    pub modify: Option<bool>,
}

/// Reads `DeviceFileMode`, `DeviceFileUID`, `DeviceFileGID` and `ModifyDeviceFiles` /
/// `DeviceFileModify` from a driver file; other lines, and values that are not a decimal number,
/// are skipped.
pub fn parse_file_params(text: &str) -> FileParams {
    let mut params = FileParams::default();
    for line in text.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<u32>() else {
            continue;
        };
        match name.trim() {
            "DeviceFileMode" => params.mode = Some(value & 0o777),
            "DeviceFileUID" => params.uid = Some(value),
            "DeviceFileGID" => params.gid = Some(value),
            "ModifyDeviceFiles" | "DeviceFileModify" => params.modify = Some(value == 1),
            _ => {}
        }
    }
    params
}

/// The GPU's device minor from its `/proc/driver/nvidia/gpus/<pci>/information` (the line
/// `Device Minor: <n>`), `None` without one.
pub fn parse_gpu_minor(information: &str) -> Option<u32> {
    information.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name.trim() == "Device Minor").then(|| value.trim().parse().ok())?
    })
}

/// A MIG device as its capabilities name it: the GPU's device minor, the GPU and compute
/// instance ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MigDevice {
    pub gpu_minor: u32,
    pub gi: u32,
    pub ci: u32,
}

/// What is at a node's path now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Existing {
    Char {
        major: u32,
        minor: u32,
    },
    Dir,
    /// Anything else, described: "a regular file", "a block device", "a dangling symlink", ...
    Other(&'static str),
}

impl fmt::Display for Existing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Existing::Char { major, minor } => write!(f, "character device {major}:{minor}"),
            Existing::Dir => f.write_str("a directory"),
            Existing::Other(what) => f.write_str(what),
        }
    }
}

/// Everything [`plan`] decides from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    pub majors: Majors,
    /// Whether the `nvidia_modeset` module is loaded.
    pub modeset_loaded: bool,
    /// The GPUs' device minors.
    pub gpu_minors: BTreeSet<u32>,
    /// The MIG devices that exist now.
    pub mig_devices: BTreeSet<MigDevice>,
    /// `/proc/driver/nvidia-caps/mig-minors`: capability key -> minor.
    pub mig_minors: BTreeMap<String, u32>,
    /// [`NVIDIA_PARAMS`], default when unreadable.
    pub nvidia_params: FileParams,
    /// The capability files read, by `mig-minors` key (absent: not readable).
    pub cap_params: BTreeMap<String, FileParams>,
    /// What is under `/dev` now, by host path (`/dev/nvidia0`, `/dev/nvidia-caps`, ...): the
    /// `nvidia*` entries of `/dev` and the entries of `/dev/nvidia-caps`.
    pub existing: BTreeMap<String, Existing>,
}

/// A character device node to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Host path, e.g. `/dev/nvidia-caps/nvidia-cap21`.
    pub path: String,
    pub major: u32,
    pub minor: u32,
    /// Permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}:{}, mode {:04o})",
            self.path, self.major, self.minor, self.mode
        )
    }
}

/// What a path should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    Char { major: u32, minor: u32 },
    Dir,
}

/// A path that holds something else than the driver's node: reported, left as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub path: String,
    pub want: Want,
    pub found: Existing,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.want {
            Want::Char { major, minor } => write!(
                f,
                "{} is {}, not character device {major}:{minor} as the driver has it; left as it is",
                self.path, self.found
            ),
            Want::Dir => write!(
                f,
                "{} is {}, not a directory; left as it is, its capability nodes not created",
                self.path, self.found
            ),
        }
    }
}

/// What [`apply`] does, and what it will not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Directories to create (mode 0755): [`CAPS_DIR`] when a capability node goes there.
    pub dirs: Vec<String>,
    pub create: Vec<Node>,
    /// Paths that hold something else: never removed.
    pub conflicts: Vec<Conflict>,
    /// Capabilities of existing MIG devices the `mig-minors` table does not list.
    pub unknown_caps: Vec<String>,
}

impl Plan {
    /// Nothing to create and nothing to report.
    pub fn is_empty(&self) -> bool {
        self.dirs.is_empty() && self.create.is_empty() && self.conflicts.is_empty() && self.unknown_caps.is_empty()
    }
}

/// The capability keys the nodes are wanted for: `config`, `monitor`, then each MIG device's GPU
/// instance and compute instance access, each once.
pub fn cap_keys(mig_devices: &BTreeSet<MigDevice>) -> Vec<String> {
    let mut keys = vec![CONFIG_CAP.to_string(), MONITOR_CAP.to_string()];
    for d in mig_devices {
        for key in [gi_access_key(d.gpu_minor, d.gi), ci_access_key(d.gpu_minor, d.gi, d.ci)] {
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    keys
}

/// The nodes the driver's classes in `/proc/devices` call for, the ones of them missing, and the
/// paths that hold something else. Pure.
pub fn plan(inputs: &Inputs) -> Plan {
    let mut wanted = Vec::new();
    let mut unknown_caps = Vec::new();
    let owner = |p: &FileParams| (p.uid.unwrap_or(0), p.gid.unwrap_or(0));
    let node = |path: String, major: u32, minor: u32, mode: u32, (uid, gid): (u32, u32)| Node {
        path,
        major,
        minor,
        mode,
        uid,
        gid,
    };

    let params = &inputs.nvidia_params;
    if let Some(major) = inputs.majors.nvidia
        && params.modify != Some(false)
    {
        let mode = params.mode.unwrap_or(NVIDIA_MODE);
        wanted.push(node("/dev/nvidiactl".into(), major, CTL_MINOR, mode, owner(params)));
        for &minor in inputs.gpu_minors.iter().filter(|m| **m < MODESET_MINOR) {
            wanted.push(node(format!("/dev/nvidia{minor}"), major, minor, mode, owner(params)));
        }
        if inputs.modeset_loaded {
            wanted.push(node(
                "/dev/nvidia-modeset".into(),
                major,
                MODESET_MINOR,
                mode,
                owner(params),
            ));
        }
    }
    if let Some(major) = inputs.majors.uvm {
        wanted.push(node("/dev/nvidia-uvm".into(), major, 0, NVIDIA_MODE, (0, 0)));
        wanted.push(node("/dev/nvidia-uvm-tools".into(), major, 1, NVIDIA_MODE, (0, 0)));
    }
    if let Some(major) = inputs.majors.caps {
        for key in cap_keys(&inputs.mig_devices) {
            let Some(&minor) = inputs.mig_minors.get(&key) else {
                // No config or monitor entry: a driver without MIG. A MIG device's is a gap.
                if key != CONFIG_CAP && key != MONITOR_CAP {
                    unknown_caps.push(key);
                }
                continue;
            };
            let p = inputs.cap_params.get(&key).copied().unwrap_or_default();
            if p.modify == Some(false) {
                continue;
            }
            let fallback = if key == CONFIG_CAP { CONFIG_CAP_MODE } else { CAP_MODE };
            let path = format!("{CAPS_DIR}/nvidia-cap{minor}");
            wanted.push(node(path, major, minor, p.mode.unwrap_or(fallback), owner(&p)));
        }
    }

    let mut plan = Plan {
        unknown_caps,
        ..Plan::default()
    };
    let in_caps_dir = |path: &str| path.starts_with(&format!("{CAPS_DIR}/"));
    let mut caps_dir_ok = true;
    if wanted.iter().any(|n| in_caps_dir(&n.path)) {
        match inputs.existing.get(CAPS_DIR) {
            None => plan.dirs.push(CAPS_DIR.to_string()),
            Some(Existing::Dir) => {}
            Some(other) => {
                caps_dir_ok = false;
                plan.conflicts.push(Conflict {
                    path: CAPS_DIR.to_string(),
                    want: Want::Dir,
                    found: other.clone(),
                });
            }
        }
    }
    let mut seen = BTreeSet::new();
    for n in wanted {
        if !seen.insert(n.path.clone()) || (!caps_dir_ok && in_caps_dir(&n.path)) {
            continue;
        }
        match inputs.existing.get(&n.path) {
            None => plan.create.push(n),
            Some(Existing::Char { major, minor }) if (*major, *minor) == (n.major, n.minor) => {}
            Some(found) => plan.conflicts.push(Conflict {
                path: n.path.clone(),
                want: Want::Char {
                    major: n.major,
                    minor: n.minor,
                },
                found: found.clone(),
            }),
        }
    }
    plan
}

/// Reads [`Inputs`] under `root`: `/proc` (majors, parameters, capability files, the GPUs'
/// minors, which are added to `gpu_minors`) and `/sys/module` under the host root, the nodes
/// under `<dev_base>/dev`. Never fails: what cannot be read counts as absent (a driver that is
/// not loaded has nothing to create).
pub fn observe(
    root: &HostRoot,
    dev_base: &Path,
    mig_minors: BTreeMap<String, u32>,
    mut gpu_minors: BTreeSet<u32>,
    mig_devices: BTreeSet<MigDevice>,
) -> Inputs {
    let read = |path: &str| fs::read_to_string(root.join(path)).ok();
    let majors = read(PROC_DEVICES).map(|t| parse_proc_devices(&t)).unwrap_or_default();
    let nvidia_params = read(NVIDIA_PARAMS).map(|t| parse_file_params(&t)).unwrap_or_default();
    let cap_params = cap_keys(&mig_devices)
        .into_iter()
        .filter_map(|key| {
            let path = root.join(CAPABILITIES_DIR).join(cap_proc_path(&key));
            let text = fs::read_to_string(path).ok()?;
            Some((key, parse_file_params(&text)))
        })
        .collect();
    if let Ok(dirs) = fs::read_dir(root.join(GPUS_DIR)) {
        for dir in dirs.flatten() {
            if let Ok(text) = fs::read_to_string(dir.path().join("information"))
                && let Some(minor) = parse_gpu_minor(&text)
            {
                gpu_minors.insert(minor);
            }
        }
    }
    let mut existing = BTreeMap::new();
    let dev = rooted(dev_base, Path::new("/dev"));
    for (dir, host_dir, all) in [
        (dev.clone(), "/dev", false),
        (rooted(dev_base, Path::new(CAPS_DIR)), CAPS_DIR, true),
    ] {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if all || name.starts_with("nvidia") {
                existing.insert(format!("{host_dir}/{name}"), classify(&entry.path()));
            }
        }
    }
    Inputs {
        majors,
        modeset_loaded: root.join("/sys/module/nvidia_modeset").is_dir(),
        gpu_minors,
        mig_devices,
        mig_minors,
        nvidia_params,
        cap_params,
        existing,
    }
}

/// What is at `path` (a symlink is followed, as the container engines follow it).
fn classify(path: &Path) -> Existing {
    let Ok(meta) = fs::metadata(path) else {
        return Existing::Other(if fs::symlink_metadata(path).is_ok() {
            "a dangling symlink"
        } else {
            "unreadable"
        });
    };
    let t = meta.file_type();
    if t.is_char_device() {
        let rdev = meta.rdev();
        Existing::Char {
            major: nix::sys::stat::major(rdev) as u32,
            minor: nix::sys::stat::minor(rdev) as u32,
        }
    } else if t.is_dir() {
        Existing::Dir
    } else if t.is_file() {
        Existing::Other("a regular file")
    } else if t.is_block_device() {
        Existing::Other("a block device")
    } else {
        Existing::Other("not a character device")
    }
}

/// A node or directory that could not be made, naming its path on disk.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot {action}: {source}", path.display())]
pub struct NodeError {
    pub path: PathBuf,
    pub action: String,
    pub source: io::Error,
}

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct Applied {
    pub dirs: Vec<String>,
    pub created: Vec<Node>,
    pub errors: Vec<NodeError>,
}

/// Creates the plan's directories and nodes under `dev_base` (the host root joined with the
/// device root): each node with `mknod`, then its exact mode (whatever the umask) and owner. A
/// failure is recorded and the others go on; nothing is ever removed, not even a node whose mode
/// or owner could not be set. A node that appeared meanwhile (udev, nvidia-modprobe) is left as
/// it is.
pub fn apply(dev_base: &Path, plan: &Plan) -> Applied {
    let mut applied = Applied::default();
    let error = |path: &Path, action: String, source: io::Error| NodeError {
        path: path.to_path_buf(),
        action,
        source,
    };
    for dir in &plan.dirs {
        let path = rooted(dev_base, Path::new(dir));
        match fs::DirBuilder::new().mode(CAPS_DIR_MODE).create(&path) {
            Ok(()) => {
                if let Err(e) = fs::set_permissions(&path, fs::Permissions::from_mode(CAPS_DIR_MODE)) {
                    applied.errors.push(error(&path, "set its mode to 0755".into(), e));
                }
                applied.dirs.push(dir.clone());
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => applied.errors.push(error(&path, "create the directory".into(), e)),
        }
    }
    for node in &plan.create {
        let path = rooted(dev_base, Path::new(&node.path));
        let dev = makedev(node.major.into(), node.minor.into());
        match mknod(&path, SFlag::S_IFCHR, Mode::from_bits_truncate(node.mode), dev) {
            Ok(()) => {}
            Err(Errno::EEXIST) => continue,
            Err(e) => {
                let action = format!("create character device {}:{}", node.major, node.minor);
                applied.errors.push(error(&path, action, e.into()));
                continue;
            }
        }
        if let Err(e) = fs::set_permissions(&path, fs::Permissions::from_mode(node.mode)) {
            applied
                .errors
                .push(error(&path, format!("set its mode to {:04o}", node.mode), e));
        }
        let owner = fs::symlink_metadata(&path).map(|m| (m.uid(), m.gid()));
        if owner.is_ok_and(|o| o != (node.uid, node.gid))
            && let Err(e) = std::os::unix::fs::chown(&path, Some(node.uid), Some(node.gid))
        {
            let action = format!("set its owner to {}:{}", node.uid, node.gid);
            applied.errors.push(error(&path, action, e));
        }
        applied.created.push(node.clone());
    }
    applied
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_DEVICES_TEXT: &str = "Character devices:\n  1 mem\n  4 /dev/vc/0\n  4 tty\n195 nvidia-frontend\n\
        226 drm\n508 nvidia-caps\n510 nvidia-nvswitch\n511 nvidia-uvm\n\nBlock devices:\n  7 loop\n259 blkext\n";

    fn minors() -> BTreeMap<String, u32> {
        let mut m = BTreeMap::from([("config".to_string(), 1), ("monitor".to_string(), 2)]);
        let mut minor = 3;
        for g in 0..2 {
            for i in 0..15 {
                m.insert(gi_access_key(g, i), minor);
                minor += 1;
                for c in 0..8 {
                    m.insert(ci_access_key(g, i, c), minor);
                    minor += 1;
                }
            }
        }
        m
    }

    fn inputs() -> Inputs {
        Inputs {
            majors: parse_proc_devices(PROC_DEVICES_TEXT),
            modeset_loaded: true,
            gpu_minors: BTreeSet::from([0, 1]),
            mig_minors: minors(),
            ..Inputs::default()
        }
    }

    fn paths(nodes: &[Node]) -> Vec<String> {
        nodes
            .iter()
            .map(|n| format!("{} {}:{} {:o}", n.path, n.major, n.minor, n.mode))
            .collect()
    }

    #[test]
    fn proc_devices_majors_come_from_the_character_section_only() {
        let m = parse_proc_devices(PROC_DEVICES_TEXT);
        assert_eq!(
            m,
            Majors {
                nvidia: Some(195),
                uvm: Some(511),
                caps: Some(508)
            }
        );
        // The older name of the frontend; a block device of the same name does not count.
        let m = parse_proc_devices("Character devices:\n195 nvidia\n\nBlock devices:\n300 nvidia-uvm\n");
        assert_eq!(
            m,
            Majors {
                nvidia: Some(195),
                uvm: None,
                caps: None
            }
        );
    }

    #[test]
    fn malformed_or_absent_proc_devices_gives_no_majors() {
        assert_eq!(parse_proc_devices(""), Majors::default());
        // No "Character devices:" header: nothing counts.
        assert_eq!(
            parse_proc_devices("195 nvidia-frontend\n511 nvidia-uvm\n"),
            Majors::default()
        );
        assert_eq!(
            parse_proc_devices("Block devices:\n195 nvidia-frontend\n"),
            Majors::default()
        );
        // Bad lines are skipped, the good ones still count; a partial name does not match.
        let m = parse_proc_devices(
            "Character devices:\nx nvidia-uvm\n-1 nvidia-caps\n195 nvidia-frontend extra\n\
             511 nvidia-uvm-x\n512 nvidia-caps\n195 nvidia-frontend\n",
        );
        assert_eq!(
            m,
            Majors {
                nvidia: Some(195),
                uvm: None,
                caps: Some(512)
            }
        );
        // A blank line ends the section.
        assert_eq!(
            parse_proc_devices("Character devices:\n  1 mem\n\n511 nvidia-uvm\n").uvm,
            None
        );
    }

    #[test]
    fn file_params_and_gpu_minor() {
        let p = parse_file_params("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n");
        assert_eq!(
            p,
            FileParams {
                mode: Some(0o400),
                uid: None,
                gid: None,
                modify: Some(true)
            }
        );
        let p = parse_file_params(
            "ResmanDebugLevel: 4294967295\nRegistryDwords: \"\"\nDeviceFileUID: 0\nDeviceFileGID: 44\n\
             DeviceFileMode: 432\nModifyDeviceFiles: 0\n",
        );
        assert_eq!(
            p,
            FileParams {
                mode: Some(0o660),
                uid: Some(0),
                gid: Some(44),
                modify: Some(false)
            }
        );
        assert_eq!(
            parse_file_params("garbage\n:\nDeviceFileMode: x\n"),
            FileParams::default()
        );

        let info = "Model: \t\t NVIDIA A100-SXM4-40GB\nBus Location: \t 0000:07:00.0\nDevice Minor: \t 3\n";
        assert_eq!(parse_gpu_minor(info), Some(3));
        assert_eq!(parse_gpu_minor("Device Minor: x\n"), None);
        assert_eq!(parse_gpu_minor("Model: A100\n"), None);
    }

    #[test]
    fn cap_keys_and_proc_paths() {
        assert_eq!(cap_proc_path("config"), "mig/config");
        assert_eq!(cap_proc_path("monitor"), "mig/monitor");
        assert_eq!(cap_proc_path("gpu0/gi1/access"), "gpu0/mig/gi1/access");
        assert_eq!(cap_proc_path("gpu3/gi1/ci0/access"), "gpu3/mig/gi1/ci0/access");
        // Two compute instances of one GPU instance share its GI capability.
        let devices = BTreeSet::from([
            MigDevice {
                gpu_minor: 0,
                gi: 1,
                ci: 0,
            },
            MigDevice {
                gpu_minor: 0,
                gi: 1,
                ci: 1,
            },
        ]);
        assert_eq!(
            cap_keys(&devices),
            [
                "config",
                "monitor",
                "gpu0/gi1/access",
                "gpu0/gi1/ci0/access",
                "gpu0/gi1/ci1/access"
            ]
        );
    }

    #[test]
    fn a_bare_dev_gets_every_node_of_the_loaded_classes() {
        let plan = plan(&inputs());
        assert_eq!(
            paths(&plan.create),
            [
                "/dev/nvidiactl 195:255 666",
                "/dev/nvidia0 195:0 666",
                "/dev/nvidia1 195:1 666",
                "/dev/nvidia-modeset 195:254 666",
                "/dev/nvidia-uvm 511:0 666",
                "/dev/nvidia-uvm-tools 511:1 666",
                "/dev/nvidia-caps/nvidia-cap1 508:1 400",
                "/dev/nvidia-caps/nvidia-cap2 508:2 444",
            ]
        );
        assert_eq!(plan.dirs, [CAPS_DIR]);
        assert!(plan.conflicts.is_empty() && plan.unknown_caps.is_empty());
    }

    #[test]
    fn missing_majors_and_modeset_create_nothing_of_their_class() {
        let mut i = inputs();
        i.majors = parse_proc_devices("Character devices:\n511 nvidia-uvm\n");
        let plan = plan(&i);
        assert_eq!(
            paths(&plan.create),
            ["/dev/nvidia-uvm 511:0 666", "/dev/nvidia-uvm-tools 511:1 666"]
        );
        assert!(plan.dirs.is_empty());

        let mut i = inputs();
        i.modeset_loaded = false;
        i.majors.uvm = None;
        i.majors.caps = None;
        assert_eq!(
            paths(&super::plan(&i).create),
            [
                "/dev/nvidiactl 195:255 666",
                "/dev/nvidia0 195:0 666",
                "/dev/nvidia1 195:1 666"
            ]
        );

        // No driver at all: nothing, and nothing to report.
        assert!(super::plan(&Inputs::default()).is_empty());
    }

    #[test]
    fn mig_devices_get_their_gi_and_ci_capabilities() {
        let mut i = inputs();
        i.majors.nvidia = None;
        i.majors.uvm = None;
        i.mig_devices = BTreeSet::from([
            MigDevice {
                gpu_minor: 0,
                gi: 1,
                ci: 0,
            },
            MigDevice {
                gpu_minor: 1,
                gi: 2,
                ci: 0,
            },
        ]);
        let m = minors();
        let (gi, ci) = (m["gpu0/gi1/access"], m["gpu0/gi1/ci0/access"]);
        let (gi2, ci2) = (m["gpu1/gi2/access"], m["gpu1/gi2/ci0/access"]);
        // The driver's published mode wins over the default.
        i.cap_params.insert(
            "gpu1/gi2/ci0/access".into(),
            parse_file_params("DeviceFileMinor: 0\nDeviceFileMode: 288\nDeviceFileModify: 1\n"),
        );
        let plan = plan(&i);
        assert_eq!(
            paths(&plan.create),
            [
                "/dev/nvidia-caps/nvidia-cap1 508:1 400".to_string(),
                "/dev/nvidia-caps/nvidia-cap2 508:2 444".to_string(),
                format!("/dev/nvidia-caps/nvidia-cap{gi} 508:{gi} 444"),
                format!("/dev/nvidia-caps/nvidia-cap{ci} 508:{ci} 444"),
                format!("/dev/nvidia-caps/nvidia-cap{gi2} 508:{gi2} 444"),
                format!("/dev/nvidia-caps/nvidia-cap{ci2} 508:{ci2} 440"),
            ]
        );

        // A capability the table does not list is reported; one the driver says not to touch is
        // left alone.
        i.mig_minors.remove("gpu1/gi2/access");
        i.cap_params
            .insert("config".into(), parse_file_params("DeviceFileModify: 0\n"));
        let plan = super::plan(&i);
        assert_eq!(plan.unknown_caps, ["gpu1/gi2/access"]);
        assert!(!plan.create.iter().any(|n| n.minor == 1 || n.minor == gi2));
        assert_eq!(plan.create.len(), 4);
    }

    #[test]
    fn existing_nodes_are_skipped_and_wrong_ones_reported() {
        let mut i = inputs();
        i.existing = BTreeMap::from([
            ("/dev/nvidiactl".into(), Existing::Char { major: 195, minor: 255 }),
            // Someone else's numbers: reported, never replaced.
            ("/dev/nvidia0".into(), Existing::Char { major: 195, minor: 3 }),
            ("/dev/nvidia-uvm".into(), Existing::Other("a regular file")),
            ("/dev/nvidia-caps".into(), Existing::Dir),
            (
                "/dev/nvidia-caps/nvidia-cap1".into(),
                Existing::Char { major: 508, minor: 1 },
            ),
        ]);
        let plan = plan(&i);
        assert_eq!(
            paths(&plan.create),
            [
                "/dev/nvidia1 195:1 666",
                "/dev/nvidia-modeset 195:254 666",
                "/dev/nvidia-uvm-tools 511:1 666",
                "/dev/nvidia-caps/nvidia-cap2 508:2 444",
            ]
        );
        assert!(plan.dirs.is_empty());
        let reports: Vec<String> = plan.conflicts.iter().map(ToString::to_string).collect();
        assert_eq!(
            reports,
            [
                "/dev/nvidia0 is character device 195:3, not character device 195:0 as the driver has it; \
                 left as it is",
                "/dev/nvidia-uvm is a regular file, not character device 511:0 as the driver has it; left as it is",
            ]
        );

        // /dev/nvidia-caps that is not a directory: reported, no capability node planned in it.
        i.existing
            .insert("/dev/nvidia-caps".into(), Existing::Other("a regular file"));
        let plan = super::plan(&i);
        assert!(!plan.create.iter().any(|n| n.path.starts_with(CAPS_DIR)));
        assert!(plan.dirs.is_empty());
        assert!(
            plan.conflicts
                .iter()
                .any(|c| c.path == CAPS_DIR && c.to_string().contains("not a directory")),
            "{:?}",
            plan.conflicts
        );
    }

    #[test]
    fn nvidia_params_set_mode_owner_or_forbid_changes() {
        let mut i = inputs();
        i.majors.uvm = None;
        i.majors.caps = None;
        i.nvidia_params = parse_file_params("DeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\n");
        let plan = plan(&i);
        assert!(plan.create.iter().all(|n| n.mode == 0o660 && n.gid == 44), "{plan:?}");
        i.nvidia_params.modify = Some(false);
        assert!(super::plan(&i).create.is_empty());
    }

    #[test]
    fn observe_reads_proc_sys_and_dev_under_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = HostRoot::new(tmp.path());
        let write = |path: &str, text: &str| {
            let p = root.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        };
        write(PROC_DEVICES, PROC_DEVICES_TEXT);
        write(NVIDIA_PARAMS, "DeviceFileMode: 438\n");
        write(
            "/proc/driver/nvidia/capabilities/mig/config",
            "DeviceFileMinor: 1\nDeviceFileMode: 256\n",
        );
        write(
            "/proc/driver/nvidia/gpus/0000:07:00.0/information",
            "Device Minor: \t 4\n",
        );
        write("/dev/nvidia-uvm", "");
        write("/dev/null-ish", "");
        fs::create_dir_all(root.join("/sys/module/nvidia_modeset")).unwrap();
        fs::create_dir_all(root.join(CAPS_DIR)).unwrap();
        std::os::unix::fs::symlink("/nonexistent", root.join("/dev/nvidia-caps/nvidia-cap9")).unwrap();

        let devices = BTreeSet::from([MigDevice {
            gpu_minor: 0,
            gi: 1,
            ci: 0,
        }]);
        let i = observe(&root, tmp.path(), minors(), BTreeSet::from([0]), devices.clone());
        assert_eq!(i.majors.caps, Some(508));
        assert!(i.modeset_loaded);
        assert_eq!(i.gpu_minors, BTreeSet::from([0, 4]));
        assert_eq!(i.mig_devices, devices);
        assert_eq!(i.nvidia_params.mode, Some(0o666));
        assert_eq!(i.cap_params.keys().collect::<Vec<_>>(), ["config"]);
        assert_eq!(i.cap_params["config"].mode, Some(0o400));
        assert_eq!(
            i.existing,
            BTreeMap::from([
                ("/dev/nvidia-uvm".to_string(), Existing::Other("a regular file")),
                ("/dev/nvidia-caps".to_string(), Existing::Dir),
                (
                    "/dev/nvidia-caps/nvidia-cap9".to_string(),
                    Existing::Other("a dangling symlink")
                ),
            ])
        );

        // Nothing there at all: empty inputs, no failure.
        let empty = tempfile::tempdir().unwrap();
        let i = observe(
            &HostRoot::new(empty.path()),
            empty.path(),
            BTreeMap::new(),
            BTreeSet::new(),
            BTreeSet::new(),
        );
        assert_eq!(i, Inputs::default());
    }

    #[test]
    fn apply_creates_char_devices_with_the_planned_mode() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("dev")).unwrap();
        let mut i = inputs();
        i.majors.nvidia = None;
        i.majors.uvm = None;
        let plan = plan(&i);
        let applied = apply(tmp.path(), &plan);
        if !nix::unistd::geteuid().is_root() {
            // mknod needs CAP_MKNOD: every node fails, naming its path; the directory is made.
            assert!(applied.created.is_empty());
            assert_eq!(applied.dirs, [CAPS_DIR]);
            assert_eq!(applied.errors.len(), plan.create.len());
            assert!(
                applied
                    .errors
                    .iter()
                    .all(|e| e.path.starts_with(tmp.path().join("dev/nvidia-caps")))
            );
            return;
        }
        assert!(applied.errors.is_empty(), "{:?}", applied.errors);
        assert_eq!(applied.created, plan.create);
        let dir = fs::metadata(tmp.path().join("dev/nvidia-caps")).unwrap();
        assert!(dir.is_dir() && dir.permissions().mode() & 0o7777 == 0o755);
        for (name, minor, mode) in [("nvidia-cap1", 1, 0o400), ("nvidia-cap2", 2, 0o444)] {
            let path = tmp.path().join("dev/nvidia-caps").join(name);
            assert_eq!(classify(&path), Existing::Char { major: 508, minor }, "{name}");
            let meta = fs::metadata(&path).unwrap();
            assert_eq!(meta.permissions().mode() & 0o7777, mode, "{name}");
        }
        // Applying again finds them: nothing left to do.
        let again = observe(
            &HostRoot::new(tmp.path()),
            tmp.path(),
            minors(),
            i.gpu_minors.clone(),
            BTreeSet::new(),
        );
        let mut again_inputs = i.clone();
        again_inputs.existing = again.existing;
        assert!(super::plan(&again_inputs).is_empty());
    }

    #[test]
    fn apply_errors_name_the_path_and_go_on() {
        // No /dev under the base: every node fails with its own path; the directory too.
        let tmp = tempfile::tempdir().unwrap();
        let plan = plan(&inputs());
        let applied = apply(tmp.path(), &plan);
        assert!(applied.created.is_empty());
        assert_eq!(applied.errors.len(), plan.create.len() + plan.dirs.len());
        let first = applied
            .errors
            .iter()
            .find(|e| e.path.ends_with("dev/nvidiactl"))
            .unwrap();
        let text = first.to_string();
        assert!(
            text.starts_with(&format!(
                "{}/dev/nvidiactl: cannot create character device 195:255: ",
                tmp.path().display()
            )),
            "{text}"
        );
        assert!(
            applied
                .errors
                .iter()
                .any(|e| e.path.ends_with("dev/nvidia-caps") && e.action == "create the directory")
        );
    }
}
