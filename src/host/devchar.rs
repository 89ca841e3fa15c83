//! The `/dev/char/<major>:<minor>` links to the NVIDIA device nodes, as udev makes them for every
//! other character device and `nvidia-ctk system create-dev-char-symlinks` makes them for these.
//!
//! systemd, when it rebuilds a unit's device rules (every `systemctl daemon-reload`), turns each
//! allowed device path into `/dev/char/<major>:<minor>` and drops the rule when that link is
//! missing; with the systemd cgroup driver a container then loses access to its GPUs ("Failed to
//! initialize NVML: Unknown Error"). The NVIDIA nodes are often made without udev (by
//! `nvidia-modprobe` or the agent), so nothing made their links.
//!
//! [`plan`] is pure: from the NVIDIA character devices found under `/dev` (each keyed by the
//! numbers `lstat` gives it, never by its name), and what `/dev/char` holds for those numbers, it
//! lists the links to create (relative, as udev writes them: `../nvidia0`,
//! `../nvidia-caps/nvidia-cap1`), the ones in place, and what is left alone and reported: an entry
//! that is no symlink or points elsewhere (udev's or someone else's; only a dangling link to an
//! NVIDIA path is replaced), a `/dev/char` that is no directory (a symlink is never followed), a
//! path named like a node that is no character device. [`observe`] reads those under a dev root,
//! [`apply`] creates the links with `symlinkat` in the `/dev/char` directory it opened
//! (`O_NOFOLLOW`), and [`remove`] deletes the links [`Record`] says the agent made, and only while
//! they still point where the agent put them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, open, openat, readlinkat};
use nix::sys::stat::{Mode, SFlag, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, symlinkat, unlinkat};

use super::rooted;

/// Where the links are (host path, under the dev root).
pub const DEV_CHAR: &str = "/dev/char";
/// The agent's record of the links it made, under `[agent] state_dir`: one `<major>:<minor>
/// <target>` line each.
pub const RECORD_FILE: &str = "dev-char-links";
/// The most bytes of the record read.
const MAX_RECORD: u64 = 1024 * 1024;
const DEV_CHAR_MODE: u32 = 0o755;

/// Whether `name` (an entry of `/dev`) is one of the driver's nodes that containers are given:
/// `nvidiactl`, `nvidia<N>`, `nvidia-modeset`, `nvidia-uvm`, `nvidia-uvm-tools`.
pub fn is_dev_node_name(name: &str) -> bool {
    matches!(name, "nvidiactl" | "nvidia-modeset" | "nvidia-uvm" | "nvidia-uvm-tools")
        || name
            .strip_prefix("nvidia")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether `name` (an entry of `/dev/nvidia-caps`) is a capability node, `nvidia-cap<N>`.
pub fn is_cap_node_name(name: &str) -> bool {
    name.strip_prefix("nvidia-cap")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A character device found under `/dev`, with the numbers the kernel gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Host path: `/dev/nvidia0`, `/dev/nvidia-caps/nvidia-cap21`.
    pub path: String,
    pub major: u32,
    pub minor: u32,
}

impl Found {
    /// The entry's name under `/dev/char`: `195:0`.
    pub fn link_name(&self) -> String {
        format!("{}:{}", self.major, self.minor)
    }
}

/// What `/dev/char` is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CharDir {
    /// Absent: created (0755) when a link goes there.
    #[default]
    Missing,
    Dir,
    /// A symlink (its target as written): never followed, nothing made through it.
    Symlink(String),
    /// Anything else, described.
    Other(&'static str),
}

/// What a `/dev/char` entry is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A symlink: its target as written, and whether that target is missing (resolved under
    /// the dev root; only known for a target under `/dev`).
    Link { target: String, dangling: bool },
    /// Anything else, described ("a regular file", "a directory", ...).
    Other(&'static str),
}

/// Everything [`plan`] decides from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    pub dir: CharDir,
    /// The NVIDIA character devices under `/dev`, in a stable order.
    pub nodes: Vec<Found>,
    /// Paths named like an NVIDIA node that are no character device (skipped), described.
    pub not_devices: Vec<(String, &'static str)>,
    /// `/dev/char` entries by name (`195:0`), for the nodes' numbers (and the names asked for).
    pub entries: BTreeMap<String, Entry>,
}

/// One link: `/dev/char/<name>` -> `target`, for the device node `node`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Link {
    /// `195:0`.
    pub name: String,
    /// As written in the link, relative to `/dev/char`: `../nvidia0`.
    pub target: String,
    /// The node's host path: `/dev/nvidia0`.
    pub node: String,
}

impl Link {
    /// The link's host path: `/dev/char/195:0`.
    pub fn path(&self) -> String {
        format!("{DEV_CHAR}/{}", self.name)
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.path(), self.target)
    }
}

/// What [`apply`] does, and what it leaves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// `/dev/char` is missing and a link goes there.
    pub mkdir: bool,
    pub create: Vec<Link>,
    /// Dangling links to an NVIDIA path where a node's link goes, with their old target:
    /// replaced.
    pub replace: Vec<(Link, String)>,
    /// Links that point at their node already (by whoever made them): left alone.
    pub present: Vec<Link>,
    /// What is left alone and why, one line each naming the path.
    pub problems: Vec<String>,
}

impl Plan {
    /// Nothing to write.
    pub fn is_noop(&self) -> bool {
        !self.mkdir && self.create.is_empty() && self.replace.is_empty()
    }

    /// Every link in place once applied.
    pub fn links(&self) -> impl Iterator<Item = &Link> {
        self.present
            .iter()
            .chain(&self.create)
            .chain(self.replace.iter().map(|(l, _)| l))
    }
}

/// The relative target udev would write for a node's host path: `/dev/nvidia0` is
/// `../nvidia0`.
pub fn target_for(node: &str) -> String {
    format!("../{}", node.trim_start_matches("/dev/").trim_start_matches('/'))
}

/// The host path a `/dev/char` link's target names, `.` and `..` resolved lexically (as the
/// kernel resolves them when the directories on the way are no symlinks): `../nvidia0` is
/// `/dev/nvidia0`, `/dev/nvidia0` stays.
pub fn resolve_target(target: &str) -> String {
    let joined = if target.starts_with('/') {
        PathBuf::from(target)
    } else {
        Path::new(DEV_CHAR).join(target)
    };
    let mut parts: Vec<String> = Vec::new();
    for c in joined.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    format!("/{}", parts.join("/"))
}

/// Whether a resolved host path is an NVIDIA device path (`/dev/nvidia*`, the caps under it).
fn is_nvidia_path(path: &str) -> bool {
    path.strip_prefix("/dev/")
        .is_some_and(|rest| rest.starts_with("nvidia"))
}

/// The links the nodes call for, which of them are missing, and what is left alone. Pure.
pub fn plan(inputs: &Inputs) -> Plan {
    let mut plan = Plan::default();
    for (path, what) in &inputs.not_devices {
        plan.problems.push(format!(
            "{path} is {what}, not a character device: no {DEV_CHAR} link for it"
        ));
    }
    if inputs.nodes.is_empty() {
        return plan;
    }
    match &inputs.dir {
        CharDir::Dir => {}
        CharDir::Missing => plan.mkdir = true,
        CharDir::Symlink(target) => {
            plan.problems.push(format!(
                "{DEV_CHAR} is a symlink (to {target}), not a directory: left as it is, no links made through it"
            ));
            return plan;
        }
        CharDir::Other(what) => {
            plan.problems.push(format!(
                "{DEV_CHAR} is {what}, not a directory: left as it is, no links made"
            ));
            return plan;
        }
    }
    let mut claimed: BTreeMap<String, &str> = BTreeMap::new();
    for node in &inputs.nodes {
        let name = node.link_name();
        if let Some(first) = claimed.get(&name) {
            plan.problems.push(format!(
                "{} has the numbers {name} of {first}: {DEV_CHAR}/{name} is {first}'s",
                node.path
            ));
            continue;
        }
        claimed.insert(name.clone(), &node.path);
        let link = Link {
            target: target_for(&node.path),
            node: node.path.clone(),
            name,
        };
        match inputs.entries.get(&link.name) {
            None => plan.create.push(link),
            Some(Entry::Link { target, .. }) if resolve_target(target) == node.path => plan.present.push(link),
            Some(Entry::Link { target, dangling: true }) if is_nvidia_path(&resolve_target(target)) => {
                plan.replace.push((link, target.clone()))
            }
            Some(Entry::Link { target, dangling }) => plan.problems.push(format!(
                "{} points to {target}{}, not to {}: left as it is",
                link.path(),
                if *dangling { " (missing)" } else { "" },
                node.path
            )),
            Some(Entry::Other(what)) => plan.problems.push(format!(
                "{} is {what}, not a link to {}: left as it is",
                link.path(),
                node.path
            )),
        }
    }
    plan
}

/// The agent's record of the links it made: link name -> the target it wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record(pub BTreeMap<String, String>);

impl Record {
    /// Reads the record's text: `<major>:<minor> <target>` per line; `#` comments, blank lines and
    /// lines that are not such a pair (a name of two decimal numbers, a `../nvidia` target) are
    /// skipped.
    pub fn parse(text: &str) -> Record {
        let mut links = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(name), Some(target), None) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            let numbers = name.split_once(':').is_some_and(|(a, b)| {
                [a, b]
                    .iter()
                    .all(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
            });
            if numbers && target.starts_with("../nvidia") {
                links.insert(name.to_string(), target.to_string());
            }
        }
        Record(links)
    }

    /// The record's text.
    pub fn render(&self) -> String {
        let mut out = String::from("# /dev/char links made by gpu-node-agent (removed by `runtime unconfigure`)\n");
        for (name, target) in &self.0 {
            out.push_str(&format!("{name} {target}\n"));
        }
        out
    }

    /// Reads the record at `path`; absent or unreadable is empty.
    pub fn read(path: &Path) -> Record {
        super::read_text_limited(path, MAX_RECORD)
            .map(|t| Record::parse(&t))
            .unwrap_or_default()
    }

    /// Writes it at `path` (atomically), or removes the file when the record is empty.
    pub fn write(&self, path: &Path) -> Result<(), super::WriteError> {
        if self.0.is_empty() {
            return match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(super::WriteError {
                    action: "remove",
                    path: path.to_path_buf(),
                    source: e,
                }),
                _ => Ok(()),
            };
        }
        super::write_atomic(path, self.render().as_bytes(), 0o644)
    }
}

/// What [`remove`] would do with the recorded links. Pure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemovePlan {
    /// Links that still point where the agent put them.
    pub remove: Vec<Link>,
    /// Recorded links that are gone already.
    pub gone: Vec<String>,
    /// Recorded links that are something else now: left as they are, named with why.
    pub left: Vec<String>,
}

/// Which recorded links to delete: only one still pointing where the agent put it.
pub fn plan_remove(record: &Record, inputs: &Inputs) -> RemovePlan {
    let mut out = RemovePlan::default();
    if !matches!(inputs.dir, CharDir::Dir) {
        if !record.0.is_empty() && inputs.dir != CharDir::Missing {
            out.left
                .push(format!("{DEV_CHAR} is no directory now: nothing removed through it"));
        } else {
            out.gone.extend(record.0.keys().cloned());
        }
        return out;
    }
    for (name, target) in &record.0 {
        let path = format!("{DEV_CHAR}/{name}");
        match inputs.entries.get(name) {
            None => out.gone.push(name.clone()),
            Some(Entry::Link { target: now, .. }) if now == target => out.remove.push(Link {
                name: name.clone(),
                target: target.clone(),
                node: resolve_target(target),
            }),
            Some(Entry::Link { target: now, .. }) => out
                .left
                .push(format!("{path} points to {now} now, not {target}: left as it is")),
            Some(Entry::Other(what)) => out.left.push(format!("{path} is {what} now: left as it is")),
        }
    }
    out
}

/// Opens a directory without following a symlink at its last component.
fn open_dir(path: &Path) -> nix::Result<OwnedFd> {
    open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

fn open_dir_at(dir: &OwnedFd, name: &str) -> nix::Result<OwnedFd> {
    openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

/// What kind of file `st_mode` is, described.
fn describe(mode: u32) -> &'static str {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => "a regular file",
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFLNK => "a symlink",
        SFlag::S_IFBLK => "a block device",
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFCHR => "a character device",
        _ => "something else",
    }
}

fn is_kind(mode: u32, kind: SFlag) -> bool {
    mode & SFlag::S_IFMT.bits() == kind.bits()
}

/// The names in a directory (read by path; each one is then looked at through the directory's
/// descriptor).
fn names(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(path)
        .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    names.sort_by_key(|a| node_order(a));
    names
}

/// `nvidiactl` first, then `nvidia<N>` by number, then the rest by name; `nvidia-cap<N>` by
/// number.
fn node_order(name: &str) -> (u8, u64, String) {
    let number = |rest: &str| rest.parse::<u64>().ok();
    if name == "nvidiactl" {
        (0, 0, String::new())
    } else if let Some(n) = name.strip_prefix("nvidia-cap").and_then(number) {
        (1, n, String::new())
    } else if let Some(n) = name.strip_prefix("nvidia").and_then(number) {
        (1, n, String::new())
    } else {
        (2, 0, name.to_string())
    }
}

/// The NVIDIA character devices in one directory (`/dev`, or `/dev/nvidia-caps`), each looked at
/// with `lstat` through the directory's descriptor: a symlink or any other file is reported, not
/// followed.
fn scan(dir_fd: &OwnedFd, dir_path: &Path, host_dir: &str, wanted: fn(&str) -> bool, inputs: &mut Inputs) {
    for name in names(dir_path).into_iter().filter(|n| wanted(n)) {
        let host_path = format!("{host_dir}/{name}");
        match fstatat(dir_fd, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if is_kind(st.st_mode, SFlag::S_IFCHR) => inputs.nodes.push(Found {
                path: host_path,
                major: nix::sys::stat::major(st.st_rdev) as u32,
                minor: nix::sys::stat::minor(st.st_rdev) as u32,
            }),
            Ok(st) => inputs.not_devices.push((host_path, describe(st.st_mode))),
            Err(_) => {}
        }
    }
}

/// Reads [`Inputs`] under `dev_base` (the host root joined with the device root): the NVIDIA
/// nodes in `<dev_base>/dev` and `<dev_base>/dev/nvidia-caps`, and `/dev/char` with its entries
/// for their numbers and for `also` (the recorded links' names). Never fails: what cannot be read
/// counts as absent.
pub fn observe(dev_base: &Path, also: &BTreeSet<String>) -> Inputs {
    let mut inputs = Inputs::default();
    let dev_path = rooted(dev_base, Path::new("/dev"));
    let Ok(dev) = open_dir(&dev_path) else {
        return inputs;
    };
    scan(&dev, &dev_path, "/dev", is_dev_node_name, &mut inputs);
    match open_dir_at(&dev, "nvidia-caps") {
        Ok(caps) => scan(
            &caps,
            &dev_path.join("nvidia-caps"),
            "/dev/nvidia-caps",
            is_cap_node_name,
            &mut inputs,
        ),
        Err(Errno::ENOENT) => {}
        Err(_) => {
            let what = fstatat(&dev, "nvidia-caps", AtFlags::AT_SYMLINK_NOFOLLOW)
                .map(|st| describe(st.st_mode))
                .unwrap_or("unreadable");
            inputs.not_devices.push(("/dev/nvidia-caps".into(), what));
        }
    }
    inputs.dir = match fstatat(&dev, "char", AtFlags::AT_SYMLINK_NOFOLLOW) {
        Err(_) => CharDir::Missing,
        Ok(st) if is_kind(st.st_mode, SFlag::S_IFDIR) => CharDir::Dir,
        Ok(st) if is_kind(st.st_mode, SFlag::S_IFLNK) => CharDir::Symlink(
            readlinkat(&dev, "char")
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
        Ok(st) => CharDir::Other(describe(st.st_mode)),
    };
    if inputs.dir != CharDir::Dir {
        return inputs;
    }
    let Ok(chars) = open_dir_at(&dev, "char") else {
        inputs.dir = CharDir::Other("unreadable");
        return inputs;
    };
    let names: BTreeSet<String> = inputs
        .nodes
        .iter()
        .map(Found::link_name)
        .chain(also.iter().cloned())
        .collect();
    for name in names {
        let Ok(st) = fstatat(&chars, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
            continue;
        };
        let entry = if is_kind(st.st_mode, SFlag::S_IFLNK) {
            let target = readlinkat(&chars, name.as_str())
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            let resolved = resolve_target(&target);
            // Only a target under /dev is looked up, under the dev root.
            let dangling = resolved.starts_with("/dev/")
                && fs::symlink_metadata(rooted(dev_base, Path::new(&resolved)))
                    .is_err_and(|e| e.kind() == io::ErrorKind::NotFound);
            Entry::Link { target, dangling }
        } else {
            Entry::Other(describe(st.st_mode))
        };
        inputs.entries.insert(name, entry);
    }
    inputs
}

/// A link that could not be made or removed, naming its path on disk.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot {action}: {source}", path.display())]
pub struct LinkError {
    pub path: PathBuf,
    pub action: String,
    pub source: io::Error,
}

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct Applied {
    /// The links made (new ones and replacements).
    pub created: Vec<Link>,
    pub errors: Vec<LinkError>,
}

/// Opens `<dev_base>/dev/char`, making it (0755) first when `mkdir`; refuses a symlink there.
fn open_char_dir(dev_base: &Path, mkdir: bool) -> Result<OwnedFd, LinkError> {
    let dev_path = rooted(dev_base, Path::new("/dev"));
    let char_path = dev_path.join("char");
    let error = |path: &Path, action: &str, e: Errno| LinkError {
        path: path.to_path_buf(),
        action: action.into(),
        source: e.into(),
    };
    let dev = open_dir(&dev_path).map_err(|e| error(&dev_path, "open the directory", e))?;
    if mkdir {
        match mkdirat(&dev, "char", Mode::from_bits_truncate(DEV_CHAR_MODE)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(error(&char_path, "create the directory", e)),
        }
    }
    open_dir_at(&dev, "char").map_err(|e| match e {
        Errno::ELOOP | Errno::ENOTDIR => LinkError {
            path: char_path.clone(),
            action: "open the directory".into(),
            source: io::Error::other("it is not a directory (a symlink is not followed)"),
        },
        e => error(&char_path, "open the directory", e),
    })
}

/// Makes the plan's links in `<dev_base>/dev/char`, through the directory's descriptor (never a
/// path that could lead elsewhere). A link that appeared meanwhile is left as it is; a dangling one
/// is replaced only if it still points where it did when planned. A failure is recorded and the
/// others go on.
pub fn apply(dev_base: &Path, plan: &Plan) -> Applied {
    let mut applied = Applied::default();
    if plan.create.is_empty() && plan.replace.is_empty() {
        return applied;
    }
    let chars = match open_char_dir(dev_base, plan.mkdir) {
        Ok(fd) => fd,
        Err(e) => {
            applied.errors.push(e);
            return applied;
        }
    };
    let on_disk = |name: &str| rooted(dev_base, Path::new(DEV_CHAR)).join(name);
    for (link, old) in &plan.replace {
        let still = readlinkat(&chars, link.name.as_str()).is_ok_and(|t| t.to_string_lossy() == old.as_str());
        if !still {
            continue;
        }
        if let Err(e) = unlinkat(&chars, link.name.as_str(), UnlinkatFlags::NoRemoveDir) {
            applied.errors.push(LinkError {
                path: on_disk(&link.name),
                action: format!("remove the dangling link to {old}"),
                source: e.into(),
            });
            continue;
        }
        make(&chars, link, &on_disk, &mut applied);
    }
    for link in &plan.create {
        make(&chars, link, &on_disk, &mut applied);
    }
    applied
}

fn make(chars: &OwnedFd, link: &Link, on_disk: &dyn Fn(&str) -> PathBuf, applied: &mut Applied) {
    match symlinkat(link.target.as_str(), chars, link.name.as_str()) {
        Ok(()) => applied.created.push(link.clone()),
        // Made meanwhile (udev): the next look decides.
        Err(Errno::EEXIST) => {}
        Err(e) => applied.errors.push(LinkError {
            path: on_disk(&link.name),
            action: format!("create the link to {}", link.target),
            source: e.into(),
        }),
    }
}

/// What [`remove`] did.
#[derive(Debug, Default)]
pub struct Removed {
    pub removed: Vec<Link>,
    pub errors: Vec<LinkError>,
}

/// Deletes the planned links through `/dev/char`'s descriptor, each only if it still points where
/// the agent put it.
pub fn remove(dev_base: &Path, plan: &RemovePlan) -> Removed {
    let mut out = Removed::default();
    if plan.remove.is_empty() {
        return out;
    }
    let chars = match open_char_dir(dev_base, false) {
        Ok(fd) => fd,
        Err(e) => {
            out.errors.push(e);
            return out;
        }
    };
    for link in &plan.remove {
        let still = readlinkat(&chars, link.name.as_str()).is_ok_and(|t| t.to_string_lossy() == link.target.as_str());
        if !still {
            continue;
        }
        match unlinkat(&chars, link.name.as_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => out.removed.push(link.clone()),
            Err(e) => out.errors.push(LinkError {
                path: rooted(dev_base, Path::new(DEV_CHAR)).join(&link.name),
                action: "remove the link".into(),
                source: e.into(),
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn found(path: &str, major: u32, minor: u32) -> Found {
        Found {
            path: path.into(),
            major,
            minor,
        }
    }

    fn inputs() -> Inputs {
        Inputs {
            dir: CharDir::Dir,
            nodes: vec![
                found("/dev/nvidiactl", 195, 255),
                found("/dev/nvidia0", 195, 0),
                found("/dev/nvidia-uvm", 511, 0),
                found("/dev/nvidia-uvm-tools", 511, 1),
                found("/dev/nvidia-caps/nvidia-cap1", 508, 1),
            ],
            ..Inputs::default()
        }
    }

    fn shown(links: &[Link]) -> Vec<String> {
        links.iter().map(ToString::to_string).collect()
    }

    fn link(target: &str, dangling: bool) -> Entry {
        Entry::Link {
            target: target.into(),
            dangling,
        }
    }

    #[test]
    fn names_and_targets() {
        for name in [
            "nvidiactl",
            "nvidia0",
            "nvidia12",
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "nvidia-modeset",
        ] {
            assert!(is_dev_node_name(name), "{name}");
        }
        for name in [
            "nvidia",
            "nvidia-caps",
            "nvidia-nvswitch0",
            "nvidia0x",
            "nvidia-fs",
            "nvidiactl2",
            "sda",
        ] {
            assert!(!is_dev_node_name(name), "{name}");
        }
        assert!(is_cap_node_name("nvidia-cap21"));
        assert!(!is_cap_node_name("nvidia-cap") && !is_cap_node_name("nvidia-cap1a"));
        assert_eq!(target_for("/dev/nvidia0"), "../nvidia0");
        assert_eq!(target_for("/dev/nvidia-caps/nvidia-cap1"), "../nvidia-caps/nvidia-cap1");
        assert_eq!(resolve_target("../nvidia0"), "/dev/nvidia0");
        assert_eq!(
            resolve_target("../nvidia-caps/./nvidia-cap1"),
            "/dev/nvidia-caps/nvidia-cap1"
        );
        assert_eq!(resolve_target("/dev/nvidia0"), "/dev/nvidia0");
        assert_eq!(resolve_target("../../../../etc/shadow"), "/etc/shadow");
        assert_eq!(resolve_target("../sda"), "/dev/sda");
    }

    #[test]
    fn a_bare_dev_char_gets_a_relative_link_per_node() {
        let mut i = inputs();
        i.dir = CharDir::Missing;
        let plan = plan(&i);
        assert!(plan.mkdir);
        assert_eq!(
            shown(&plan.create),
            [
                "/dev/char/195:255 -> ../nvidiactl",
                "/dev/char/195:0 -> ../nvidia0",
                "/dev/char/511:0 -> ../nvidia-uvm",
                "/dev/char/511:1 -> ../nvidia-uvm-tools",
                "/dev/char/508:1 -> ../nvidia-caps/nvidia-cap1",
            ]
        );
        assert!(plan.present.is_empty() && plan.replace.is_empty() && plan.problems.is_empty());
        // No NVIDIA node: nothing at all, not even the directory.
        assert_eq!(super::plan(&Inputs::default()), Plan::default());
    }

    #[test]
    fn links_in_place_are_left_alone_and_nothing_is_written() {
        let mut i = inputs();
        for n in &i.nodes {
            i.entries.insert(n.link_name(), link(&target_for(&n.path), false));
        }
        // Made by someone else with an absolute target: it points at the node, that will do.
        i.entries.insert("195:0".into(), link("/dev/nvidia0", false));
        let plan = plan(&i);
        assert!(plan.is_noop(), "{plan:?}");
        assert_eq!(plan.present.len(), 5);
        assert!(plan.problems.is_empty());
    }

    /// Hostile and foreign entries: a link udev (or anyone) made to another device, a file where
    /// the link goes, a dangling link that is not to an NVIDIA path: all left as they are and
    /// reported. Only a dangling link to an NVIDIA path is replaced.
    #[test]
    fn foreign_entries_are_reported_never_replaced() {
        let mut i = inputs();
        i.entries.insert("195:255".into(), link("../sda", false));
        i.entries.insert("195:0".into(), Entry::Other("a regular file"));
        i.entries.insert("511:0".into(), link("../../etc/missing", true));
        i.entries.insert("511:1".into(), link("../nvidia-uvm-old", true));
        i.entries
            .insert("508:1".into(), link("../nvidia-caps/nvidia-cap9", false));
        let plan = plan(&i);
        assert!(plan.create.is_empty());
        assert_eq!(
            plan.replace,
            [(
                Link {
                    name: "511:1".into(),
                    target: "../nvidia-uvm-tools".into(),
                    node: "/dev/nvidia-uvm-tools".into()
                },
                "../nvidia-uvm-old".to_string()
            )]
        );
        assert_eq!(
            plan.problems,
            [
                "/dev/char/195:255 points to ../sda, not to /dev/nvidiactl: left as it is",
                "/dev/char/195:0 is a regular file, not a link to /dev/nvidia0: left as it is",
                "/dev/char/511:0 points to ../../etc/missing (missing), not to /dev/nvidia-uvm: left as it is",
                "/dev/char/508:1 points to ../nvidia-caps/nvidia-cap9, not to /dev/nvidia-caps/nvidia-cap1: left as \
                 it is",
            ]
        );
    }

    #[test]
    fn a_dev_char_that_is_no_directory_gets_nothing() {
        let mut i = inputs();
        i.dir = CharDir::Symlink("/tmp/elsewhere".into());
        let plan = plan(&i);
        assert!(plan.is_noop() && plan.present.is_empty());
        assert_eq!(
            plan.problems,
            ["/dev/char is a symlink (to /tmp/elsewhere), not a directory: left as it is, no links made through it"]
        );
        i.dir = CharDir::Other("a regular file");
        let plan = super::plan(&i);
        assert!(plan.is_noop());
        assert_eq!(plan.problems.len(), 1);
    }

    #[test]
    fn non_devices_and_number_clashes_are_reported() {
        let mut i = inputs();
        i.not_devices.push(("/dev/nvidia1".into(), "a regular file"));
        // A second node with nvidia0's numbers: the first one has the link.
        i.nodes.push(found("/dev/nvidia7", 195, 0));
        let plan = plan(&i);
        assert_eq!(plan.create.len(), 5);
        assert_eq!(
            plan.problems,
            [
                "/dev/nvidia1 is a regular file, not a character device: no /dev/char link for it",
                "/dev/nvidia7 has the numbers 195:0 of /dev/nvidia0: /dev/char/195:0 is /dev/nvidia0's",
            ]
        );
    }

    #[test]
    fn the_record_round_trips_and_skips_what_is_not_a_link_line() {
        let record = Record(BTreeMap::from([
            ("195:0".to_string(), "../nvidia0".to_string()),
            ("508:21".to_string(), "../nvidia-caps/nvidia-cap21".to_string()),
        ]));
        assert_eq!(Record::parse(&record.render()), record);
        let parsed = Record::parse("195:0 ../nvidia0\nx:1 ../nvidia1\n195:1 /etc/shadow\n195:2\n195:3 ../nvidia3 x\n");
        assert_eq!(parsed.0.keys().collect::<Vec<_>>(), ["195:0"]);
    }

    #[test]
    fn only_recorded_links_still_pointing_where_the_agent_put_them_are_removed() {
        let record = Record(BTreeMap::from([
            ("195:0".to_string(), "../nvidia0".to_string()),
            ("195:1".to_string(), "../nvidia1".to_string()),
            ("195:2".to_string(), "../nvidia2".to_string()),
            ("195:3".to_string(), "../nvidia3".to_string()),
        ]));
        let i = Inputs {
            dir: CharDir::Dir,
            entries: BTreeMap::from([
                ("195:0".to_string(), link("../nvidia0", false)),
                ("195:1".to_string(), link("../sdb", false)),
                ("195:2".to_string(), Entry::Other("a regular file")),
            ]),
            ..Inputs::default()
        };
        let plan = plan_remove(&record, &i);
        assert_eq!(shown(&plan.remove), ["/dev/char/195:0 -> ../nvidia0"]);
        assert_eq!(plan.gone, ["195:3"]);
        assert_eq!(
            plan.left,
            [
                "/dev/char/195:1 points to ../sdb now, not ../nvidia1: left as it is",
                "/dev/char/195:2 is a regular file now: left as it is",
            ]
        );
        // /dev/char a symlink now: nothing is removed through it.
        let i = Inputs {
            dir: CharDir::Symlink("/etc".into()),
            ..Inputs::default()
        };
        let plan = plan_remove(&record, &i);
        assert!(plan.remove.is_empty() && plan.left.len() == 1);
    }

    fn mknod(path: &Path, major: u64, minor: u64) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        nix::sys::stat::mknod(
            path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(major, minor),
        )
        .unwrap();
    }

    /// On disk: nodes found by their real numbers (a file named like a node is skipped), links
    /// made relative and found again at steady state, a `/dev/char` that is a symlink neither
    /// followed nor written through, and removal of only the agent's links.
    #[test]
    fn observe_apply_remove_on_disk() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mknod needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path();
        let dev = base.join("dev");
        mknod(&dev.join("nvidiactl"), 195, 255);
        // Named like GPU 3, numbered as GPU 5: the numbers count, not the name.
        mknod(&dev.join("nvidia3"), 195, 5);
        mknod(&dev.join("nvidia-caps/nvidia-cap2"), 508, 2);
        fs::write(dev.join("nvidia1"), "not a device").unwrap();
        symlink("nvidiactl", dev.join("nvidia2")).unwrap();
        mknod(&dev.join("sda"), 8, 0);

        let i = observe(base, &BTreeSet::new());
        assert_eq!(i.dir, CharDir::Missing);
        assert_eq!(
            i.nodes,
            [
                found("/dev/nvidiactl", 195, 255),
                found("/dev/nvidia3", 195, 5),
                found("/dev/nvidia-caps/nvidia-cap2", 508, 2),
            ]
        );
        assert_eq!(
            i.not_devices,
            [
                ("/dev/nvidia1".to_string(), "a regular file"),
                ("/dev/nvidia2".to_string(), "a symlink")
            ]
        );
        let p = plan(&i);
        let applied = apply(base, &p);
        assert!(applied.errors.is_empty(), "{:?}", applied.errors);
        assert_eq!(applied.created.len(), 3);
        assert_eq!(fs::read_link(dev.join("char/195:5")).unwrap(), Path::new("../nvidia3"));
        assert_eq!(
            fs::read_link(dev.join("char/508:2")).unwrap(),
            Path::new("../nvidia-caps/nvidia-cap2")
        );
        // The link leads to the node.
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(
            &fs::metadata(dev.join("char/195:255")).unwrap().file_type()
        ));

        // Steady state: all in place, nothing to write.
        let again = plan(&observe(base, &BTreeSet::new()));
        assert!(again.is_noop() && again.present.len() == 3, "{again:?}");

        // udev's link for another node is not the agent's: removal leaves it.
        symlink("../sda", dev.join("char/8:0")).unwrap();
        let record = Record(
            applied
                .created
                .iter()
                .map(|l| (l.name.clone(), l.target.clone()))
                .chain([("8:0".to_string(), "../nvidia9".to_string())])
                .collect(),
        );
        let i = observe(base, &record.0.keys().cloned().collect());
        let rp = plan_remove(&record, &i);
        assert_eq!(rp.remove.len(), 3);
        assert_eq!(
            rp.left,
            ["/dev/char/8:0 points to ../sda now, not ../nvidia9: left as it is"]
        );
        let removed = remove(base, &rp);
        assert!(removed.errors.is_empty(), "{:?}", removed.errors);
        assert_eq!(removed.removed.len(), 3);
        let left: Vec<_> = fs::read_dir(dev.join("char"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["8:0"]);

        // /dev/char a symlink to elsewhere: nothing is made there, and apply refuses it even if
        // the plan was made before the swap.
        let elsewhere = tmp.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        fs::remove_dir_all(dev.join("char")).unwrap();
        let stale = plan(&observe(base, &BTreeSet::new()));
        symlink(&elsewhere, dev.join("char")).unwrap();
        let i = observe(base, &BTreeSet::new());
        assert!(matches!(i.dir, CharDir::Symlink(_)), "{:?}", i.dir);
        assert!(plan(&i).is_noop());
        let applied = apply(base, &stale);
        assert!(applied.created.is_empty());
        assert_eq!(applied.errors.len(), 1);
        assert!(
            applied.errors[0]
                .to_string()
                .contains("not a directory (a symlink is not followed)"),
            "{}",
            applied.errors[0]
        );
        assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
    }
}
