//! Building the spec ([`spec`]): the devices from the inventory and device nodes, the edits every
//! container gets (environment, control nodes, driver mounts, hooks).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use cdi_hook::HOOK_ENV;

use super::CdiError;
use super::driver_files::{DriverFiles, HookBinary, REQUIRED_LIBRARIES};
use super::model::{ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, minimum_version};
use crate::host::rooted;
use crate::nvml::{GpuInfo, Inventory};
use crate::plugin::allocate::mig_capability_nodes;
use crate::plugin::devnodes::DeviceNodes;

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

/// The name of the device that stands for all GPUs and MIG devices.
pub const ALL_DEVICE: &str = "all";

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
        let mut gpu_nodes = vec![node(format!("/dev/nvidia{}", gpu.minor))?];
        let drm = files.dri.get(&crate::nvml::normalise_bus_id(&gpu.pci_bus_id));
        for dri in drm.into_iter().flatten() {
            gpu_nodes.push(node(dri.clone())?);
        }
        add([gpu.index.to_string(), gpu.uuid.clone()], gpu_nodes);
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

    let mut env = Vec::new();
    if let Some(dir) = &files.libcuda_dir {
        env.push(format!(
            "{LIBCUDA_DIR_ENV}={}",
            utf8(&in_container(&files.driver_root, dir))?
        ));
    }
    env.push(VISIBLE_DEVICES_VOID.to_string());
    let container_edits = ContainerEdits {
        env,
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
pub(super) fn device_node(dev_root: &Path, path: String) -> Result<DeviceNode, CdiError> {
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
        (&files.graphics, &plain),
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
        Hook {
            hook_name: "createContainer".to_string(),
            path: path.to_string(),
            args: argv,
            env: HOOK_ENV.iter().map(|e| e.to_string()).collect(),
        }
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

fn utf8(path: &Path) -> Result<&str, CdiError> {
    path.to_str().ok_or_else(|| CdiError::NonUtf8Path {
        path: path.to_path_buf(),
    })
}
