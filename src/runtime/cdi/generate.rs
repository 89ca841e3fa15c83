//! Building the node's edits ([`node_edits`]): the devices from the inventory and device nodes
//! (the model's, [`crate::edits::node_devices`]), and the edits every container gets from the
//! driver's files (environment, control nodes, driver mounts, hooks); [`spec`] renders them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::CdiError;
use super::driver_files::{DriverFiles, HookBinary, REQUIRED_LIBRARIES};
use super::model::Spec;
use super::render::{render_node, utf8};
use crate::edits::{self, ContainerEdits, DeviceNodes, Hook, Mount, NodeEdits};
use crate::nvml::Inventory;

/// The CDI kind NVIDIA's own tools use (`nvidia-ctk cdi generate` defaults `--vendor nvidia.com
/// --class gpu`).
pub const DEFAULT_KIND: &str = "nvidia.com/gpu";

/// Options of every file mount: read-only, no setuid or device files through it.
pub const MOUNT_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// Sockets and the MPS pipe folder get `noexec` and are not read-only, as `nvidia-ctk` 1.18.2
/// and later mount them: an MPS client writes to the pipes.
pub const IPC_MOUNT_OPTIONS: [&str; 5] = ["nosuid", "nodev", "rbind", "rprivate", "noexec"];

/// The environment variable `nvidia-ctk` sets to the container folder of `libcuda`.
pub const LIBCUDA_DIR_ENV: &str = "NVIDIA_CTK_LIBCUDA_DIR";

/// The environment of every container that gets a device from the spec. `void` tells an NVIDIA
/// runtime hook that may also be installed to leave the container alone: CDI did the injection.
pub const VISIBLE_DEVICES_VOID: &str = "NVIDIA_VISIBLE_DEVICES=void";

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
    render_node(&node_edits(inventory, nodes, files, opts)?, &opts.kind)
}

/// The node's edits that [`spec`] renders, and that the DRA driver renders each claim's spec
/// from (checked as [`spec`] says).
pub fn node_edits(
    inventory: &Inventory,
    nodes: &DeviceNodes,
    files: &DriverFiles,
    opts: &CdiOptions,
) -> Result<NodeEdits, CdiError> {
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
    let missing: Vec<String> = REQUIRED_LIBRARIES
        .iter()
        .map(|lib| format!("{lib}.so.{}", files.version))
        .filter(|file| {
            !files
                .libraries
                .iter()
                .any(|l| l.file_name().is_some_and(|n| n == file.as_str()))
        })
        .collect();
    if !missing.is_empty() {
        return Err(CdiError::DriverLibrariesMissing {
            missing,
            searched: files.library_search.clone(),
        });
    }
    let devices = edits::node_devices(inventory, nodes, &opts.dev_root, &files.dri).map_err(|missing| {
        CdiError::MissingMigCapability {
            device: missing.device,
            key: missing.key,
        }
    })?;

    let mut env = Vec::new();
    if let Some(dir) = &files.libcuda_dir {
        env.push((
            LIBCUDA_DIR_ENV.to_string(),
            utf8(&in_container(&files.driver_root, dir))?.to_string(),
        ));
    }
    // The model keeps env as (name, value); the renderer writes `NAME=value` back.
    let (name, value) = VISIBLE_DEVICES_VOID
        .split_once('=')
        .unwrap_or((VISIBLE_DEVICES_VOID, ""));
    env.push((name.to_string(), value.to_string()));
    let common = ContainerEdits {
        env,
        device_nodes: edits::control_nodes(nodes, &opts.dev_root),
        hooks: hooks(files)?,
        mounts: mounts(files),
    };
    Ok(NodeEdits { common, devices })
}

/// Mounts of the driver files: libraries, sockets, firmware, programs (`nvidia-ctk`'s order).
fn mounts(files: &DriverFiles) -> Vec<Mount> {
    let plain = MOUNT_OPTIONS.map(String::from).to_vec();
    let ipc = IPC_MOUNT_OPTIONS.map(String::from).to_vec();
    let groups = [
        (&files.libraries, &plain),
        (&files.graphics, &plain),
        (&files.ipc_sockets, &ipc),
        (&files.firmware, &plain),
        (&files.binaries, &plain),
    ];
    let mut mounts = Vec::new();
    for (paths, options) in groups {
        for host in paths {
            mounts.push(Mount {
                host_path: host.clone(),
                container_path: in_container(&files.driver_root, host),
                options: options.clone(),
            });
        }
    }
    mounts
}

/// The hooks, in `nvidia-ctk`'s order: `create-symlinks` (when there are links to make),
/// `enable-cuda-compat` (the agent's hook only), `update-ldcache` (when there are library
/// folders), `disable-device-node-modification` (the agent's hook only). The toolkit's hook gets
/// only the two every version of it knows: a hook subcommand the installed binary does not know
/// fails every container start.
fn hooks(files: &DriverFiles) -> Result<Vec<Hook>, CdiError> {
    let Some(binary) = &files.cdi_hook else {
        return Ok(Vec::new());
    };
    let agent = matches!(binary, HookBinary::Agent(_));
    let path = utf8(binary.path())?;
    let base = binary.path().file_name().and_then(|n| n.to_str()).unwrap_or(path);
    let hook = |name: &str, args: Vec<String>| {
        let mut argv = vec![base.to_string()];
        // `nvidia-ctk` takes the hooks as `nvidia-ctk hook <name>`; `nvidia-cdi-hook` and the
        // agent's `gpu-node-agent-cdi-hook` as `<name>`.
        if base == "nvidia-ctk" {
            argv.push("hook".to_string());
        }
        argv.push(name.to_string());
        argv.extend(args);
        Hook::new(path.to_string(), argv)
    };

    // (link path in the container, target) pairs; the first for a link path wins.
    let mut links: Vec<(PathBuf, String)> = Vec::new();
    if let Some(dir) = &files.libcuda_dir {
        // Many programs dlopen "libcuda.so", which only the CUDA toolkit's dev package provides.
        links.push((
            in_container(&files.driver_root, dir).join("libcuda.so"),
            "libcuda.so.1".to_string(),
        ));
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
    if agent && !files.libraries.is_empty() {
        hooks.push(hook(
            "enable-cuda-compat",
            vec![format!("--host-driver-version={}", files.version)],
        ));
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
    if agent {
        hooks.push(hook("disable-device-node-modification", Vec::new()));
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
