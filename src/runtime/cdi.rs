//! The CDI spec for the node's GPUs: what `nvidia-ctk cdi generate --mode nvml` writes, built from
//! the agent's NVML inventory instead of a second NVML session, so that a CDI-aware runtime
//! (containerd with `enable_cdi`, CRI-O, docker with `features.cdi`) resolves every name the device
//! plugin hands out with the `cdi-cri` and `cdi-annotations` strategies.
//!
//! - [`discover`] looks at the driver's user-space files under the driver root. It only reads the
//!   filesystem (no commands), and what is missing is simply left out.
//! - [`spec`] is pure: inventory + device nodes + driver files in, [`Spec`] out.
//! - [`to_json`] renders it; [`spec_file_name`] names the file (`nvidia.com-gpu.json`). Writing it
//!   under `/etc/cdi` or `/var/run/cdi` is the caller's job.
//!
//! Differences from `nvidia-ctk` (toolkit 1.17/1.18), all deliberate:
//! - Only the compute and utility libraries of libnvidia-container's list are mounted
//!   ([`DRIVER_LIBRARIES`]); `nvidia-ctk` mounts every `*.so.<version>` next to `libcuda`,
//!   graphics and video included.
//! - The hooks are `create-symlinks` and `update-ldcache` only. `enable-cuda-compat`,
//!   `disable-device-node-modification` and `update-application-profile` need a recent
//!   `nvidia-cdi-hook`, and a hook subcommand the installed binary does not know fails every
//!   container start.
//! - No deprecated `chmod` hook for `/dev/nvidia-caps`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::host::rooted;
use crate::nvml::{GpuInfo, Inventory};
use crate::plugin::allocate::mig_capability_nodes;
use crate::plugin::devnodes::DeviceNodes;

/// The CDI kind NVIDIA's own tools use (`nvidia-ctk cdi generate` defaults `--vendor nvidia.com
/// --class gpu`).
pub const DEFAULT_KIND: &str = "nvidia.com/gpu";

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

/// Options of every file mount: read-only, no setuid or device files through it.
pub const MOUNT_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// Sockets additionally get `noexec`, as `nvidia-ctk` gives them.
pub const IPC_MOUNT_OPTIONS: [&str; 6] = ["ro", "nosuid", "nodev", "rbind", "rprivate", "noexec"];

/// The environment of every container that gets a device from the spec. `void` tells an NVIDIA
/// runtime hook that may also be installed to leave the container alone: CDI did the injection.
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

/// The name of the device that stands for all GPUs and MIG devices.
pub const ALL_DEVICE: &str = "all";

/// Why no spec could be generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiError {
    /// The kind is not `<vendor>/<class>`.
    #[error("CDI kind {kind:?} is not of the form <vendor>/<class>, e.g. \"nvidia.com/gpu\"")]
    InvalidKind { kind: String },
    /// The inventory has no GPU; a CDI spec must have at least one device, and every device at
    /// least one edit.
    #[error("no GPUs in the inventory: a CDI spec needs at least one device")]
    NoGpus,
    /// The driver's `mig-minors` table has no entry for a capability a MIG device needs (the same
    /// text as the device plugin's Allocate error).
    #[error("MIG device {device}: capability {key:?} not found in /proc/driver/nvidia-caps/mig-minors")]
    MissingMigCapability { device: String, key: String },
    /// A path that would go into the spec is not UTF-8; CDI specs are JSON text.
    #[error("path {} is not valid UTF-8 and cannot be written to a CDI spec", path.display())]
    NonUtf8Path { path: PathBuf },
    /// serde_json refused the spec (it cannot for these types; kept so rendering never panics).
    #[error("cannot render the CDI spec as JSON: {message}")]
    Render { message: String },
}

// === Driver files ===

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

// === Spec ===

/// What the generated spec is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiOptions {
    /// CDI kind `<vendor>/<class>`; must equal the device plugin's `cdi_kind` for its names to
    /// resolve. Normally [`DEFAULT_KIND`].
    pub kind: String,
    /// Host path of the directory that contains `dev/`, normally `/`; any other value puts a
    /// `hostPath` under it on every device node (the device plugin's `dev_root`).
    pub dev_root: PathBuf,
}

impl Default for CdiOptions {
    fn default() -> Self {
        CdiOptions {
            kind: DEFAULT_KIND.to_string(),
            dev_root: PathBuf::from("/"),
        }
    }
}

/// A CDI spec (the subset of the CDI JSON format this generator writes). Field order follows the
/// CDI Go types, so the JSON reads like `nvidia-ctk`'s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// The CDI spec version the document needs; see [`spec`].
    pub cdi_version: String,
    /// `<vendor>/<class>`.
    pub kind: String,
    /// One entry per name a container can ask for.
    pub devices: Vec<Device>,
    /// Edits applied once to any container that gets at least one device of this spec.
    #[serde(skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// A named device of the spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// `0`, `GPU-…`, `1:0`, `MIG-…` or `all`.
    pub name: String,
    /// What requesting this device adds to a container.
    pub container_edits: ContainerEdits,
}

/// Changes to the container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=value` entries.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// OCI hooks to add.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    /// Bind mounts to add.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    /// Whether there is nothing to edit.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.hooks.is_empty() && self.mounts.is_empty()
    }
}

/// A device node; type, major and minor are read from the host node by the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container, e.g. `/dev/nvidia0`.
    pub path: String,
    /// Host path when it differs from `path` (a `dev_root` other than `/`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Host path, under the driver root.
    pub host_path: String,
    /// Path in the container: the host path without the driver root.
    pub container_path: String,
    /// Mount options, [`MOUNT_OPTIONS`] or [`IPC_MOUNT_OPTIONS`].
    pub options: Vec<String>,
}

/// An OCI hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// OCI hook stage, always `createContainer` here.
    pub hook_name: String,
    /// Host path of the hook binary.
    pub path: String,
    /// Full argv, starting with the binary's base name.
    pub args: Vec<String>,
}

/// Builds the spec `nvidia-ctk cdi generate --mode nvml` would write for this inventory.
///
/// Devices, in this order: each GPU by index (`"0"`) and by UUID, then each MIG device by
/// `"<gpu index>:<mig index>"` and by UUID (the names the device plugin hands out with
/// `device_id_strategy` `index` and `uuid`), then [`ALL_DEVICE`] with every node of all of them.
/// A GPU's edits are its `/dev/nvidia<minor>`; a MIG device's are its parent's node plus the
/// capability nodes of its GPU and compute instance (as Allocate hands out; a capability missing
/// from `nodes.mig_minors` is [`CdiError::MissingMigCapability`]).
///
/// Spec-level edits: `NVIDIA_VISIBLE_DEVICES=void`, the control nodes in `nodes.control`, the
/// driver's libraries, sockets, firmware and programs as read-only bind mounts, and, when
/// `files.cdi_hook` is set, two `createContainer` hooks: `create-symlinks` (`libcuda.so.1 ->
/// libcuda.so`, which many programs `dlopen`, plus the host's soname links of the mounted
/// libraries) and `update-ldcache` with each library directory.
///
/// `cdiVersion` is the lowest CDI spec version whose features the spec uses, computed the way
/// the CDI library's `MinimumRequiredVersion` does (see [`minimum_version`]). In practice it is
/// `0.5.0`: device names that start with a digit (`"0"`, `"1:0"`) and device-node `hostPath`
/// both arrived in 0.5.0, and nothing else used needs more (spec/device `annotations` and a `.`
/// in the class need 0.6.0, `intelRdt`/`additionalGids` 0.7.0; none is written). Writing the
/// minimum rather than the newest version matters: CDI libraries reject a spec whose
/// `cdiVersion` they do not know ("invalid version"), and CDI Go library v0.5.4, which
/// containerd 1.7.0/1.7.1 (as in k3s 1.27) and CRI-O 1.27 vendor, knows nothing newer than
/// 0.5.0, so a `0.8.0` spec would leave every device unresolvable there, while newer runtimes
/// accept `0.5.0` as well.
pub fn spec(
    inventory: &Inventory,
    nodes: &DeviceNodes,
    files: &DriverFiles,
    opts: &CdiOptions,
) -> Result<Spec, CdiError> {
    let valid_kind = opts
        .kind
        .split_once('/')
        .is_some_and(|(vendor, class)| !vendor.is_empty() && !class.is_empty() && !class.contains('/'));
    if !valid_kind {
        return Err(CdiError::InvalidKind {
            kind: opts.kind.clone(),
        });
    }
    if inventory.gpus.is_empty() {
        return Err(CdiError::NoGpus);
    }
    let mut gpus: Vec<&GpuInfo> = inventory.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);

    let node = |path: String| device_node(&opts.dev_root, path);
    let mut devices = Vec::new();
    let mut all_nodes: Vec<DeviceNode> = Vec::new();
    let mut add = |names: [String; 2], nodes: Vec<DeviceNode>| {
        for n in &nodes {
            if !all_nodes.contains(n) {
                all_nodes.push(n.clone());
            }
        }
        for name in names {
            devices.push(Device {
                name,
                container_edits: ContainerEdits {
                    device_nodes: nodes.clone(),
                    ..ContainerEdits::default()
                },
            });
        }
    };
    for gpu in &gpus {
        add(
            [gpu.index.to_string(), gpu.uuid.clone()],
            vec![node(format!("/dev/nvidia{}", gpu.minor))?],
        );
    }
    for gpu in &gpus {
        let mut migs: Vec<_> = gpu.mig_devices.iter().collect();
        migs.sort_by_key(|m| m.index);
        for mig in migs {
            let caps = mig_capability_nodes(gpu.minor, mig.gi_id, mig.ci_id, nodes).map_err(|key| {
                CdiError::MissingMigCapability {
                    device: mig.uuid.clone(),
                    key,
                }
            })?;
            let mut mig_nodes = vec![node(format!("/dev/nvidia{}", gpu.minor))?];
            for cap in caps {
                mig_nodes.push(node(cap)?);
            }
            add([format!("{}:{}", gpu.index, mig.index), mig.uuid.clone()], mig_nodes);
        }
    }
    devices.push(Device {
        name: ALL_DEVICE.to_string(),
        container_edits: ContainerEdits {
            device_nodes: all_nodes,
            ..ContainerEdits::default()
        },
    });

    let container_edits = ContainerEdits {
        env: vec![VISIBLE_DEVICES_VOID.to_string()],
        device_nodes: nodes
            .control
            .iter()
            .map(|path| node(path.clone()))
            .collect::<Result<_, _>>()?,
        hooks: hooks(files)?,
        mounts: mounts(files)?,
    };

    let mut spec = Spec {
        cdi_version: String::new(),
        kind: opts.kind.clone(),
        devices,
        container_edits,
    };
    spec.cdi_version = minimum_version(&spec).to_string();
    Ok(spec)
}

/// A device node at `path` in the container, with a `hostPath` under `dev_root` unless that is
/// `/` (or empty).
fn device_node(dev_root: &Path, path: String) -> Result<DeviceNode, CdiError> {
    let host = rooted(dev_root, Path::new(&path));
    let host_path = if host == Path::new(&path) {
        None
    } else {
        Some(utf8(&host)?.to_string())
    };
    Ok(DeviceNode { path, host_path })
}

/// Mounts of the driver files: libraries, sockets, firmware, programs (`nvidia-ctk`'s order).
fn mounts(files: &DriverFiles) -> Result<Vec<Mount>, CdiError> {
    let plain = MOUNT_OPTIONS.map(String::from).to_vec();
    let ipc = IPC_MOUNT_OPTIONS.map(String::from).to_vec();
    let groups = [
        (&files.libraries, &plain),
        (&files.ipc_sockets, &ipc),
        (&files.firmware, &plain),
        (&files.binaries, &plain),
    ];
    let mut mounts = Vec::new();
    for (paths, options) in groups {
        for host in paths {
            mounts.push(Mount {
                host_path: utf8(host)?.to_string(),
                container_path: utf8(&in_container(&files.driver_root, host))?.to_string(),
                options: options.clone(),
            });
        }
    }
    Ok(mounts)
}

/// The `create-symlinks` and `update-ldcache` hooks, when there is a hook binary and there are
/// libraries to link and cache.
fn hooks(files: &DriverFiles) -> Result<Vec<Hook>, CdiError> {
    let Some(binary) = &files.cdi_hook else {
        return Ok(Vec::new());
    };
    let path = utf8(binary)?;
    let base = binary.file_name().and_then(|n| n.to_str()).unwrap_or(path);
    let hook = |name: &str, args: Vec<String>| {
        let mut argv = vec![base.to_string()];
        // `nvidia-ctk` takes the hooks as `nvidia-ctk hook <name>`; `nvidia-cdi-hook` as `<name>`.
        if base == "nvidia-ctk" {
            argv.push("hook".to_string());
        }
        argv.push(name.to_string());
        argv.extend(args);
        Hook {
            hook_name: "createContainer".to_string(),
            path: path.to_string(),
            args: argv,
        }
    };

    // (link path in the container, target) pairs; the first for a link path wins.
    let mut links: Vec<(PathBuf, String)> = Vec::new();
    if let Some(libcuda) = files.libraries.iter().find(|l| {
        l.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libcuda.so."))
    }) {
        // Many programs dlopen "libcuda.so", which only the CUDA toolkit's dev package provides.
        let dir = in_container(&files.driver_root, libcuda.parent().unwrap_or(Path::new("/")));
        links.push((dir.join("libcuda.so"), "libcuda.so.1".to_string()));
    }
    for link in &files.library_links {
        let at = in_container(&files.driver_root, &link.link);
        if !links.iter().any(|(p, _)| *p == at) {
            links.push((at, link.target.clone()));
        }
    }

    let mut hooks = Vec::new();
    if !links.is_empty() {
        let mut args = Vec::new();
        for (at, target) in &links {
            args.push("--link".to_string());
            args.push(format!("{target}::{}", utf8(at)?));
        }
        hooks.push(hook("create-symlinks", args));
    }
    let folders: BTreeSet<PathBuf> = files
        .library_dirs
        .iter()
        .map(|d| in_container(&files.driver_root, d))
        .collect();
    if !folders.is_empty() {
        let mut args = Vec::new();
        for folder in &folders {
            args.push("--folder".to_string());
            args.push(utf8(folder)?.to_string());
        }
        hooks.push(hook("update-ldcache", args));
    }
    Ok(hooks)
}

/// Where a host path under the driver root appears in the container.
fn in_container(driver_root: &Path, host: &Path) -> PathBuf {
    match host.strip_prefix(driver_root) {
        Ok(rel) if driver_root != Path::new("/") && !driver_root.as_os_str().is_empty() => Path::new("/").join(rel),
        _ => host.to_path_buf(),
    }
}

fn utf8(path: &Path) -> Result<&str, CdiError> {
    path.to_str().ok_or_else(|| CdiError::NonUtf8Path {
        path: path.to_path_buf(),
    })
}

/// The lowest CDI spec version that has every feature `spec` uses, by the rules of the CDI
/// library's `MinimumRequiredVersion` (`specs-go/version.go`) for the fields [`Spec`] can hold:
/// - 0.3.0 is the floor (the earliest version the library still accepts);
/// - 0.4.0: a mount `type` (never written here);
/// - 0.5.0: a device name that does not start with a letter, or a device node `hostPath`;
/// - 0.6.0: spec or device `annotations` (never written here), or a `.` in the kind's class;
/// - 0.7.0: `intelRdt` or `additionalGids` (never written here); 0.8.0 added no spec field.
pub fn minimum_version(spec: &Spec) -> &'static str {
    let class_has_dot = spec.kind.split_once('/').is_some_and(|(_, class)| class.contains('.'));
    if class_has_dot {
        return "0.6.0";
    }
    let digit_name = spec
        .devices
        .iter()
        .any(|d| d.name.chars().next().is_some_and(|c| !c.is_alphabetic()));
    let host_path = spec
        .devices
        .iter()
        .map(|d| &d.container_edits)
        .chain([&spec.container_edits])
        .any(|e| e.device_nodes.iter().any(|n| n.host_path.is_some()));
    if digit_name || host_path { "0.5.0" } else { "0.3.0" }
}

/// The spec's file name by the CDI convention `<vendor>-<class>.json`: `nvidia.com/gpu` →
/// `nvidia.com-gpu.json`.
pub fn spec_file_name(kind: &str) -> String {
    format!("{}.json", kind.replace('/', "-"))
}

/// The spec as pretty-printed JSON with a trailing newline. Deterministic: the same spec always
/// gives the same bytes, so the caller can skip rewriting an unchanged file.
pub fn to_json(spec: &Spec) -> Result<String, CdiError> {
    let mut text = serde_json::to_string_pretty(spec).map_err(|err| CdiError::Render {
        message: err.to_string(),
    })?;
    text.push('\n');
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ContainerAllocateRequest;
    use crate::config::{DeviceIdStrategy, DeviceListStrategy, MigStrategy};
    use crate::nvml::{MigDeviceInfo, sample};
    use crate::plugin::allocate::{AllocateOptions, allocate};
    use crate::plugin::resources::Resource;
    use crate::plugin::strategy::{build_resources, whole_gpu};
    use std::collections::BTreeMap;
    use std::fs;

    const VERSION: &str = "550.54.15";
    const G0: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
    const G1: &str = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff";
    const M0: &str = "MIG-11111111-2222-3333-4444-555555555555";
    const M1: &str = "MIG-66666666-7777-8888-9999-000000000000";
    const LIB: &str = "/usr/lib/x86_64-linux-gnu";

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/cdi")
            .join(name)
    }

    fn gpu(index: u32, uuid: &str, minor: u32, mig: &[(u32, &str, u32)]) -> GpuInfo {
        GpuInfo {
            uuid: uuid.into(),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x07 + index),
            minor,
            numa_node: Some(0),
            mig: Some(sample::mig(!mig.is_empty())),
            mig_devices: mig
                .iter()
                .map(|&(index, uuid, gi_id)| MigDeviceInfo {
                    index,
                    uuid: uuid.into(),
                    gi_id,
                    ci_id: 0,
                    profile: "3g.20gb".into(),
                    memory_mib: 19968,
                    attributes: None,
                })
                .collect(),
            ..sample::a100(index)
        }
    }

    /// Two GPUs; the second (device minor 3, so index and minor differ) has two MIG devices.
    fn inventory() -> Inventory {
        sample::inventory(vec![gpu(0, G0, 0, &[]), gpu(1, G1, 3, &[(0, M0, 1), (1, M1, 2)])])
    }

    fn nodes() -> DeviceNodes {
        DeviceNodes {
            control: vec![
                "/dev/nvidiactl".into(),
                "/dev/nvidia-uvm".into(),
                "/dev/nvidia-uvm-tools".into(),
            ],
            mig_minors: [
                ("config", 1),
                ("monitor", 2),
                ("gpu3/gi1/access", 30),
                ("gpu3/gi1/ci0/access", 31),
                ("gpu3/gi2/access", 39),
                ("gpu3/gi2/ci0/access", 40),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        }
    }

    fn touch(root: &Path, path: &str) {
        let path = root.join(path.trim_start_matches('/'));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "").unwrap();
    }

    fn symlink(root: &Path, link: &str, target: &str) {
        std::os::unix::fs::symlink(target, root.join(link.trim_start_matches('/'))).unwrap();
    }

    /// A driver install under `root/<driver_root>` with decoys that must not be picked up.
    fn fake_driver(root: &Path) {
        for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"] {
            touch(root, &format!("{LIB}/{lib}.so.{VERSION}"));
        }
        symlink(root, &format!("{LIB}/libcuda.so.1"), &format!("libcuda.so.{VERSION}"));
        symlink(root, &format!("{LIB}/libcuda.so"), "libcuda.so.1"); // a chain: not a soname link
        symlink(
            root,
            &format!("{LIB}/libnvidia-ml.so.1"),
            &format!("{LIB}/libnvidia-ml.so.{VERSION}"),
        );
        symlink(
            root,
            &format!("{LIB}/libnvidia-nvvm.so.4"),
            &format!("libnvidia-nvvm.so.{VERSION}"),
        );
        symlink(root, &format!("{LIB}/libfoo.so.1"), &format!("libcuda.so.{VERSION}")); // wrong name
        touch(root, "/usr/lib64/libnvidia-cfg.so.550.54.15");
        symlink(root, "/usr/lib64/libnvidia-cfg.so.1", "libnvidia-cfg.so.550.54.15");
        // Decoys: another version, a graphics library, a copy in a later directory.
        touch(root, &format!("{LIB}/libnvidia-ml.so.535.161.08"));
        touch(root, &format!("{LIB}/libGLX_nvidia.so.{VERSION}"));
        touch(root, &format!("/usr/lib64/libcuda.so.{VERSION}"));

        touch(root, "/usr/bin/nvidia-smi");
        touch(root, "/bin/nvidia-smi");
        touch(root, "/usr/sbin/nvidia-persistenced");
        touch(root, "/usr/bin/nvidia-cuda-mps-control");
        touch(root, "/usr/bin/nvidia-modprobe");

        touch(root, &format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"));
        touch(root, &format!("/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"));
        touch(root, &format!("/lib/firmware/nvidia/{VERSION}/README"));
        touch(root, "/lib/firmware/nvidia/535.161.08/gsp_ga10x.bin");

        touch(root, "/run/nvidia-persistenced/socket");
    }

    fn hook_candidates() -> Vec<PathBuf> {
        DEFAULT_HOOK_CANDIDATES.iter().map(PathBuf::from).collect()
    }

    /// Driver files of [`fake_driver`] at driver root `/`, with `nvidia-cdi-hook` installed.
    fn files_with_hook() -> (tempfile::TempDir, DriverFiles) {
        let root = tempfile::tempdir().unwrap();
        fake_driver(root.path());
        touch(root.path(), "/usr/bin/nvidia-cdi-hook");
        let files = discover(root.path(), Path::new("/"), VERSION, &hook_candidates());
        (root, files)
    }

    fn paths(list: &[&str]) -> Vec<PathBuf> {
        list.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn discovery_finds_exactly_the_driver_files() {
        let (_root, files) = files_with_hook();
        let lib = |name: &str| PathBuf::from(format!("{LIB}/{name}.so.{VERSION}"));
        assert_eq!(
            files,
            DriverFiles {
                driver_root: "/".into(),
                version: VERSION.into(),
                libraries: vec![
                    lib("libnvidia-ml"),
                    PathBuf::from("/usr/lib64/libnvidia-cfg.so.550.54.15"),
                    lib("libcuda"),
                    lib("libnvidia-ptxjitcompiler"),
                    lib("libnvidia-nvvm"),
                ],
                library_dirs: paths(&["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]),
                library_links: vec![
                    LibraryLink {
                        link: format!("{LIB}/libcuda.so.1").into(),
                        target: format!("libcuda.so.{VERSION}"),
                    },
                    LibraryLink {
                        link: format!("{LIB}/libnvidia-ml.so.1").into(),
                        target: format!("libnvidia-ml.so.{VERSION}"),
                    },
                    LibraryLink {
                        link: format!("{LIB}/libnvidia-nvvm.so.4").into(),
                        target: format!("libnvidia-nvvm.so.{VERSION}"),
                    },
                    LibraryLink {
                        link: "/usr/lib64/libnvidia-cfg.so.1".into(),
                        target: "libnvidia-cfg.so.550.54.15".into(),
                    },
                ],
                binaries: paths(&[
                    "/usr/bin/nvidia-smi",
                    "/usr/sbin/nvidia-persistenced",
                    "/usr/bin/nvidia-cuda-mps-control"
                ]),
                firmware: paths(&[
                    "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
                    "/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin",
                ]),
                ipc_sockets: paths(&["/run/nvidia-persistenced/socket"]),
                cdi_hook: Some("/usr/bin/nvidia-cdi-hook".into()),
            }
        );
    }

    #[test]
    fn discovery_of_nothing_is_empty_not_an_error() {
        let root = tempfile::tempdir().unwrap();
        let files = discover(root.path(), Path::new("/"), VERSION, &hook_candidates());
        assert!(files.libraries.is_empty() && files.library_dirs.is_empty() && files.library_links.is_empty());
        assert!(files.binaries.is_empty() && files.firmware.is_empty() && files.ipc_sockets.is_empty());
        assert_eq!(files.cdi_hook, None);

        // A version that is not a plain version string matches nothing, even if a file exists.
        fake_driver(root.path());
        for bad in ["", "..", "550/../550"] {
            let files = discover(root.path(), Path::new("/"), bad, &[]);
            assert!(files.libraries.is_empty() && files.firmware.is_empty(), "{bad:?}");
        }
    }

    #[test]
    fn discovery_under_a_driver_root_reports_host_paths() {
        let root = tempfile::tempdir().unwrap();
        let driver = root.path().join("run/nvidia/driver");
        fs::create_dir_all(&driver).unwrap();
        fake_driver(&driver);
        // The hook is on the host, not in the driver root; this one in the driver root is ignored.
        touch(&driver, "/usr/bin/nvidia-ctk");
        touch(root.path(), "/usr/local/nvidia/toolkit/nvidia-cdi-hook");
        let files = discover(
            root.path(),
            Path::new("/run/nvidia/driver"),
            VERSION,
            &hook_candidates(),
        );
        assert_eq!(
            files.libraries[0],
            PathBuf::from(format!("/run/nvidia/driver{LIB}/libnvidia-ml.so.{VERSION}"))
        );
        assert_eq!(
            files.library_links[0].link,
            PathBuf::from(format!("/run/nvidia/driver{LIB}/libcuda.so.1"))
        );
        assert_eq!(
            files.cdi_hook,
            Some(PathBuf::from("/usr/local/nvidia/toolkit/nvidia-cdi-hook"))
        );

        let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
        let libcuda = &spec.container_edits.mounts[2];
        assert_eq!(
            libcuda.host_path,
            format!("/run/nvidia/driver{LIB}/libcuda.so.{VERSION}")
        );
        assert_eq!(libcuda.container_path, format!("{LIB}/libcuda.so.{VERSION}"));
        let hooks = &spec.container_edits.hooks;
        assert_eq!(hooks[0].path, "/usr/local/nvidia/toolkit/nvidia-cdi-hook");
        assert_eq!(
            hooks[0].args[..4],
            [
                "nvidia-cdi-hook".to_string(),
                "create-symlinks".into(),
                "--link".into(),
                format!("libcuda.so.1::{LIB}/libcuda.so"),
            ]
        );
        assert_eq!(
            hooks[1].args,
            [
                "nvidia-cdi-hook",
                "update-ldcache",
                "--folder",
                LIB,
                "--folder",
                "/usr/lib64"
            ]
        );
    }

    /// The generated spec, byte for byte. Run with `CDI_UPDATE_GOLDEN=1` to rewrite the fixture
    /// after an intended change, then review the diff.
    #[test]
    fn golden_spec() {
        let (_root, files) = files_with_hook();
        let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
        let text = to_json(&spec).unwrap();
        let path = fixture("nvidia.com-gpu.json");
        if std::env::var_os("CDI_UPDATE_GOLDEN").is_some() {
            fs::write(&path, &text).unwrap();
        }
        let expected = fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            expected,
            "run with CDI_UPDATE_GOLDEN=1 to update {}",
            path.display()
        );
        assert_eq!(to_json(&spec).unwrap(), text, "rendering is deterministic");
        assert!(text.ends_with("}\n"));
    }

    #[test]
    fn spec_structure() {
        let (_root, files) = files_with_hook();
        let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
        assert_eq!(spec.cdi_version, "0.5.0");
        assert_eq!(spec.kind, "nvidia.com/gpu");
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", G0, "1", G1, "1:0", M0, "1:1", M1, "all"]);
        let device_paths = |name: &str| -> Vec<String> {
            let device = spec.devices.iter().find(|d| d.name == name).unwrap();
            device
                .container_edits
                .device_nodes
                .iter()
                .map(|n| n.path.clone())
                .collect()
        };
        assert_eq!(device_paths(G1), ["/dev/nvidia3"]);
        assert_eq!(
            device_paths("1:1"),
            [
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap39",
                "/dev/nvidia-caps/nvidia-cap40"
            ]
        );
        assert_eq!(
            device_paths("all"),
            [
                "/dev/nvidia0",
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap30",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidia-caps/nvidia-cap39",
                "/dev/nvidia-caps/nvidia-cap40",
            ]
        );
        let edits = &spec.container_edits;
        assert_eq!(edits.env, [VISIBLE_DEVICES_VOID]);
        assert!(edits.device_nodes.iter().all(|n| n.host_path.is_none()));
        assert_eq!(edits.mounts.len(), 5 + 1 + 2 + 3);
        let socket = edits.mounts.iter().find(|m| m.host_path.ends_with("socket")).unwrap();
        assert_eq!(socket.options, IPC_MOUNT_OPTIONS);
        assert_eq!(edits.mounts[0].options, MOUNT_OPTIONS);
        assert_eq!(
            edits.hooks[0].args,
            [
                "nvidia-cdi-hook".to_string(),
                "create-symlinks".into(),
                "--link".into(),
                format!("libcuda.so.1::{LIB}/libcuda.so"),
                "--link".into(),
                format!("libcuda.so.{VERSION}::{LIB}/libcuda.so.1"),
                "--link".into(),
                format!("libnvidia-ml.so.{VERSION}::{LIB}/libnvidia-ml.so.1"),
                "--link".into(),
                format!("libnvidia-nvvm.so.{VERSION}::{LIB}/libnvidia-nvvm.so.4"),
                "--link".into(),
                "libnvidia-cfg.so.550.54.15::/usr/lib64/libnvidia-cfg.so.1".into(),
            ]
        );
    }

    #[test]
    fn hooks_only_with_a_hook_binary() {
        let root = tempfile::tempdir().unwrap();
        fake_driver(root.path());
        let files = discover(root.path(), Path::new("/"), VERSION, &hook_candidates());
        assert_eq!(files.cdi_hook, None);
        let without = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
        assert!(without.container_edits.hooks.is_empty());
        assert!(!to_json(&without).unwrap().contains("hooks"));
        assert!(!without.container_edits.mounts.is_empty());

        // The older toolkit binary takes the hooks as `nvidia-ctk hook <name>`.
        touch(root.path(), "/usr/bin/nvidia-ctk");
        let files = discover(root.path(), Path::new("/"), VERSION, &hook_candidates());
        let with = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
        let hooks = &with.container_edits.hooks;
        assert_eq!(hooks.len(), 2);
        assert!(
            hooks
                .iter()
                .all(|h| h.path == "/usr/bin/nvidia-ctk" && h.hook_name == "createContainer")
        );
        assert_eq!(&hooks[0].args[..3], ["nvidia-ctk", "hook", "create-symlinks"]);
        assert_eq!(
            hooks[1].args,
            [
                "nvidia-ctk",
                "hook",
                "update-ldcache",
                "--folder",
                LIB,
                "--folder",
                "/usr/lib64"
            ]
        );

        // No libraries: nothing to link or cache, so no hooks even with the binary.
        let bare = DriverFiles {
            libraries: Vec::new(),
            library_dirs: Vec::new(),
            library_links: Vec::new(),
            ..files
        };
        let spec = spec(&inventory(), &nodes(), &bare, &CdiOptions::default()).unwrap();
        assert!(spec.container_edits.hooks.is_empty());
    }

    #[test]
    fn dev_root_gives_host_paths() {
        let (_root, files) = files_with_hook();
        let opts = CdiOptions {
            dev_root: "/run/nvidia/driver".into(),
            ..CdiOptions::default()
        };
        let spec = spec(&inventory(), &nodes(), &files, &opts).unwrap();
        assert_eq!(spec.cdi_version, "0.5.0");
        let ctl = &spec.container_edits.device_nodes[0];
        assert_eq!(ctl.path, "/dev/nvidiactl");
        assert_eq!(ctl.host_path.as_deref(), Some("/run/nvidia/driver/dev/nvidiactl"));
        let mig = spec.devices.iter().find(|d| d.name == M0).unwrap();
        assert_eq!(
            mig.container_edits.device_nodes[1],
            DeviceNode {
                path: "/dev/nvidia-caps/nvidia-cap30".into(),
                host_path: Some("/run/nvidia/driver/dev/nvidia-caps/nvidia-cap30".into()),
            }
        );
        // Mounts are about the driver root, not the device root.
        assert!(
            spec.container_edits
                .mounts
                .iter()
                .all(|m| m.host_path == m.container_path)
        );
    }

    #[test]
    fn minimum_version_follows_the_cdi_rules() {
        let node = |host: Option<&str>| DeviceNode {
            path: "/dev/x".into(),
            host_path: host.map(String::from),
        };
        let device = |name: &str, host: Option<&str>| Device {
            name: name.into(),
            container_edits: ContainerEdits {
                device_nodes: vec![node(host)],
                ..ContainerEdits::default()
            },
        };
        let mut spec = Spec {
            cdi_version: String::new(),
            kind: "example.com/gpu".into(),
            devices: vec![device("gpu0", None), device("all", None)],
            container_edits: ContainerEdits::default(),
        };
        assert_eq!(minimum_version(&spec), "0.3.0");
        spec.devices.push(device("0", None));
        assert_eq!(minimum_version(&spec), "0.5.0");
        spec.devices.pop();
        spec.container_edits.device_nodes.push(node(Some("/host/dev/x")));
        assert_eq!(minimum_version(&spec), "0.5.0");
        spec.kind = "example.com/gpu.shared".into();
        assert_eq!(minimum_version(&spec), "0.6.0");
    }

    #[test]
    fn missing_mig_capability_is_an_error() {
        let (_root, files) = files_with_hook();
        let mut nodes = nodes();
        nodes.mig_minors.remove("gpu3/gi2/access");
        let err = spec(&inventory(), &nodes, &files, &CdiOptions::default()).unwrap_err();
        assert_eq!(
            err,
            CdiError::MissingMigCapability {
                device: M1.into(),
                key: "gpu3/gi2/access".into(),
            }
        );
        assert!(
            err.to_string().contains(M1) && err.to_string().contains("gpu3/gi2/access"),
            "{err}"
        );

        let mut nodes = self::nodes();
        nodes.mig_minors.remove("gpu3/gi1/ci0/access");
        let err = spec(&inventory(), &nodes, &files, &CdiOptions::default()).unwrap_err();
        assert!(matches!(err, CdiError::MissingMigCapability { ref key, .. } if key == "gpu3/gi1/ci0/access"));
    }

    #[test]
    fn invalid_inputs() {
        let (_root, files) = files_with_hook();
        for kind in ["gpu", "/gpu", "nvidia.com/", "a/b/c"] {
            let opts = CdiOptions {
                kind: kind.into(),
                ..CdiOptions::default()
            };
            assert_eq!(
                spec(&inventory(), &nodes(), &files, &opts),
                Err(CdiError::InvalidKind { kind: kind.into() })
            );
        }
        let empty = Inventory {
            gpus: Vec::new(),
            ..inventory()
        };
        assert_eq!(
            spec(&empty, &nodes(), &files, &CdiOptions::default()),
            Err(CdiError::NoGpus)
        );
    }

    #[test]
    fn file_names() {
        assert_eq!(spec_file_name("nvidia.com/gpu"), "nvidia.com-gpu.json");
        assert_eq!(
            spec_file_name("k8s.device-plugin.nvidia.com/gpu"),
            "k8s.device-plugin.nvidia.com-gpu.json"
        );
    }

    // === Schema ===

    /// Hands the CDI `defs.json` fixture to the validator for `schema.json`'s relative
    /// `defs.json#/...` references; anything else is refused (no network, no files).
    struct DefsRetriever(serde_json::Value);

    impl jsonschema::Retrieve for DefsRetriever {
        fn retrieve(
            &self,
            uri: &jsonschema::Uri<String>,
        ) -> Result<serde_json::Value, Box<dyn std::error::Error + Send + Sync>> {
            if uri.path().as_str().ends_with("/defs.json") {
                Ok(self.0.clone())
            } else {
                Err(format!("unexpected schema reference {}", uri.as_str()).into())
            }
        }
    }

    fn read_json(name: &str) -> serde_json::Value {
        serde_json::from_str(&fs::read_to_string(fixture(name)).unwrap()).unwrap()
    }

    /// Validators for the whole document (`schema.json`) and for the spec-level
    /// `containerEdits`, which `schema.json` does not list (see the schema README).
    fn validators() -> (jsonschema::Validator, jsonschema::Validator) {
        let defs = read_json("schema/defs.json");
        let build = |schema: &serde_json::Value| {
            jsonschema::options()
                .with_draft(jsonschema::Draft::Draft7)
                .with_retriever(DefsRetriever(defs.clone()))
                .build(schema)
                .unwrap()
        };
        let whole = build(&read_json("schema/schema.json"));
        let edits = build(&serde_json::json!({
            "$schema": "http://json-schema.org/draft-07/schema#",
            "$ref": "defs.json#/definitions/containerEdits",
        }));
        (whole, edits)
    }

    fn schema_errors(doc: &serde_json::Value) -> Vec<String> {
        let (whole, edits) = validators();
        let mut errors: Vec<String> = whole
            .iter_errors(doc)
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        if let Some(spec_edits) = doc.get("containerEdits") {
            errors.extend(
                edits
                    .iter_errors(spec_edits)
                    .map(|e| format!("containerEdits{}: {e}", e.instance_path())),
            );
        }
        errors
    }

    #[test]
    fn spec_validates_against_the_cdi_schema() {
        let (_root, files) = files_with_hook();
        for dev_root in ["/", "/run/nvidia/driver"] {
            let opts = CdiOptions {
                dev_root: dev_root.into(),
                ..CdiOptions::default()
            };
            let spec = spec(&inventory(), &nodes(), &files, &opts).unwrap();
            let doc: serde_json::Value = serde_json::from_str(&to_json(&spec).unwrap()).unwrap();
            assert_eq!(schema_errors(&doc), Vec::<String>::new(), "dev_root {dev_root}");
        }
        let golden = read_json("nvidia.com-gpu.json");
        assert_eq!(schema_errors(&golden), Vec::<String>::new());

        // The validator does resolve defs.json: broken documents fail, at both levels.
        let mut broken = golden.clone();
        broken["devices"][0]["containerEdits"]["deviceNodes"][0] = serde_json::json!({"hostPath": "/dev/nvidia0"});
        assert!(!schema_errors(&broken).is_empty());
        let mut broken = golden.clone();
        broken["containerEdits"]["mounts"][0]["options"] = serde_json::json!("ro,nosuid");
        assert!(!schema_errors(&broken).is_empty());
        let mut broken = golden;
        broken.as_object_mut().unwrap().remove("kind");
        assert!(!schema_errors(&broken).is_empty());
    }

    // === Names the device plugin hands out ===

    /// Every `cdi_devices` name Allocate returns for `resource`, with both id strategies.
    fn handed_out(resource: &Resource, kind: &str) -> Vec<String> {
        let mut names = Vec::new();
        let ids: Vec<String> = resource.devices.keys().cloned().collect();
        for id_strategy in [DeviceIdStrategy::Uuid, DeviceIdStrategy::Index] {
            let opts = AllocateOptions {
                strategies: vec![DeviceListStrategy::CdiCri],
                id_strategy,
                cdi_kind: kind.to_string(),
                ..AllocateOptions::default()
            };
            // One request per device and one for all of them.
            let mut requests: Vec<Vec<String>> = ids.iter().map(|id| vec![id.clone()]).collect();
            requests.push(ids.clone());
            for devices_ids in requests {
                let req = ContainerAllocateRequest { devices_ids };
                let resp = allocate(resource, &req, &opts, &nodes()).unwrap();
                assert!(!resp.cdi_devices.is_empty());
                names.extend(resp.cdi_devices.into_iter().map(|d| d.name));
            }
        }
        names
    }

    #[test]
    fn every_name_the_plugin_hands_out_resolves() {
        let (_root, files) = files_with_hook();
        let inventory = inventory();
        let spec = spec(&inventory, &nodes(), &files, &CdiOptions::default()).unwrap();

        let mut resources = Vec::new();
        for strategy in [MigStrategy::None, MigStrategy::Mixed] {
            resources.extend(build_resources(&inventory, strategy).unwrap());
        }
        // Time-slicing replicas: `<uuid>::<n>` IDs.
        let mut replicas = BTreeMap::new();
        for gpu in &inventory.gpus {
            for n in 0..2 {
                replicas.insert(format!("{}::{n}", gpu.uuid), whole_gpu(gpu));
            }
        }
        resources.push(Resource {
            name: "nvidia.com/gpu.shared".into(),
            devices: replicas,
        });

        let mut seen = BTreeSet::new();
        for resource in &resources {
            for name in handed_out(resource, &spec.kind) {
                let (kind, id) = name.split_once('=').unwrap();
                assert_eq!(kind, spec.kind, "{name}");
                assert!(spec.devices.iter().any(|d| d.name == id), "{name} is not in the spec");
                seen.insert(id.to_string());
            }
        }
        // Whole GPUs and MIG devices, by UUID and by index, were all exercised.
        let expected: BTreeSet<String> = ["0", G0, "1", G1, "1:0", M0, "1:1", M1].map(String::from).into();
        assert_eq!(seen, expected);
    }
}
