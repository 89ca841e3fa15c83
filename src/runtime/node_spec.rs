//! The node's CDI specs as files: where the spec goes, which hook program it names, writing it
//! (and the injection classes' specs) when its bytes change, and the other specs on the host that
//! define the same names. The spec itself is built by [`super::cdi`]; the runtime stage and the
//! commands (`cdi generate`, `plan`) write and show what is built here, and the DRA driver renders
//! each claim's spec from the same container edits ([`node_edits`]).

use std::path::{Path, PathBuf};

use super::cdi;
use super::engine::FileError;
use super::stage::{RuntimeError, read_optional};
use crate::config::{CdiHook, Config};
use crate::edits::{DeviceNodes, NodeEdits};
use crate::host::arch::HostArch;
use crate::host::{HostRoot, write_atomic};
use crate::nvml::Inventory;

/// Where the CDI spec goes (host path).
pub fn cdi_path(config: &Config) -> PathBuf {
    config.cdi.dir.join(cdi::spec_file_name(&config.device_plugin.cdi_kind))
}

/// The CDI spec for `inventory` (driver files discovered under the driver root), as text.
pub fn cdi_spec(
    config: &Config,
    root: &HostRoot,
    inventory: &Inventory,
    nodes: &DeviceNodes,
) -> Result<String, RuntimeError> {
    let spec = cdi::render_node(
        &node_edits(config, root, inventory, nodes)?,
        &config.device_plugin.cdi_kind,
    )?;
    Ok(cdi::to_json(&spec)?)
}

/// The node's container edits for `inventory` (driver files discovered under the driver root):
/// what [`cdi_spec`] renders, and what the DRA driver renders each claim's spec from.
pub fn node_edits(
    config: &Config,
    root: &HostRoot,
    inventory: &Inventory,
    nodes: &DeviceNodes,
) -> Result<NodeEdits, RuntimeError> {
    let dp = &config.device_plugin;
    let files = cdi::discover(
        root.path(),
        &dp.driver_root,
        &inventory.driver_version,
        &hook_search(config),
        &HostArch::read(root),
    );
    let opts = cdi::CdiOptions {
        kind: dp.cdi_kind.clone(),
        dev_root: dp.dev_root.clone(),
    };
    Ok(cdi::node_edits(inventory, nodes, &files, &opts)?)
}

/// Where the spec's hook program is looked for, by `[cdi] hook`.
pub fn hook_search(config: &Config) -> cdi::HookSearch {
    let agent = || agent_hook(config);
    match config.cdi.hook {
        CdiHook::Auto => cdi::HookSearch {
            toolkit: config.cdi.hook_paths.clone(),
            agent: agent(),
        },
        CdiHook::Agent => cdi::HookSearch {
            toolkit: Vec::new(),
            agent: agent(),
        },
        CdiHook::Toolkit => cdi::HookSearch {
            toolkit: config.cdi.hook_paths.clone(),
            agent: None,
        },
    }
}

/// The agent's hook program (a host path): `cdi.agent_path`, else `gpu-node-agent-cdi-hook` beside
/// the running agent (the packages install both in `/usr/bin`).
pub fn agent_hook(config: &Config) -> Option<PathBuf> {
    if config.cdi.agent_path.as_os_str().is_empty() {
        Some(agent_binary()?.with_file_name(cdi::hook::PROGRAM))
    } else {
        Some(config.cdi.agent_path.clone())
    }
}

/// When the spec `text` just written names the agent's hook program, warns if that program is
/// not statically linked: it runs as host root against untrusted images, and only a static
/// build is safe from an image's `LD_PRELOAD` under a runtime that ignores the spec's `env` (the
/// spec still gives every hook its `env`, which runc, crun and containerd honour). Checked when
/// the spec is written, not each time it is built (plan, DRA prepares).
fn warn_unless_static_hook(config: &Config, text: &str) {
    let Some(path) = agent_hook(config) else {
        return;
    };
    let named = serde_json::to_string(&path.to_string_lossy()).is_ok_and(|quoted| text.contains(&quoted));
    if !named {
        return;
    }
    if let Err(reason) = check_agent_hook(&path) {
        tracing::warn!(
            "cdi: the agent's hook program {} {reason}; a container runtime that ignores a hook's env would let an image's LD_PRELOAD run in it as root (install the package's static build, set cdi.agent_path, or cdi.hook = \"toolkit\")",
            path.display()
        );
    }
}

/// Why the hook program at `path` is not a statically linked program, if it is not.
pub fn check_agent_hook(path: &Path) -> Result<(), String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot be opened: {e}"))?;
    cdi::hook::ldcache::static_elf(&mut file).map_err(|why| format!("is {why}"))
}

/// The running agent's path: what a package installed (`/usr/bin/gpu-node-agent`). After an
/// upgrade replaced the file the kernel reports `<path> (deleted)`; the path is still where the
/// new binary is.
fn agent_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let text = exe.to_str()?;
    Some(PathBuf::from(text.strip_suffix(" (deleted)").unwrap_or(text)))
}

/// Other CDI specs on the host that define the device names of the agent's spec `text` (see
/// [`cdi::conflicts`]).
pub fn cdi_conflicts(config: &Config, root: &HostRoot, text: &str) -> Vec<cdi::conflicts::Conflict> {
    let ours = cdi_path(config);
    let Some((kind, names)) = cdi::conflicts::kind_and_names(text) else {
        return Vec::new();
    };
    let (dirs, others) = cdi::conflicts::read_spec_dirs(root.path(), &config.cdi.dir);
    let ours_dir = dirs.iter().rposition(|d| *d == config.cdi.dir).unwrap_or(0);
    cdi::conflicts::conflicts(&ours, ours_dir, &kind, &names, &others)
}

/// Writes the CDI spec when its bytes change, and the injection specs ([`write_extra_cdi`]);
/// whether any was written, and the other specs that define the GPU spec's names (looked for
/// every time, from the spec text in hand: a toolkit spec written after the agent's is seen at
/// the next pass). A required IMEX channel that is missing fails before anything is written.
pub fn write_cdi(
    config: &Config,
    root: &HostRoot,
    inventory: &Inventory,
    nodes: &DeviceNodes,
) -> Result<(bool, Vec<cdi::conflicts::Conflict>), RuntimeError> {
    let text = cdi_spec(config, root, inventory, nodes)?;
    let extra = extra_cdi_specs(config, root, nodes)?;
    let path = root.join(cdi_path(config));
    let mut written = read_optional(&path)?.as_deref() != Some(text.as_str());
    if written {
        write_atomic(&path, text.as_bytes(), 0o644)?;
        warn_unless_static_hook(config, &text);
    }
    written |= write_extra_cdi(root, &extra)?;
    Ok((written, cdi_conflicts(config, root, &text)))
}

/// The injection specs (GDS, MOFED, GDRCopy, IMEX channels; see [`cdi::extra_specs`]) with their
/// host paths (`[cdi] dir`/`<vendor>-<class>.json`), text `None` for a class with nothing to
/// write. A class counts as enabled when `[device_plugin]` or any of its profiles enables it,
/// so that a profile a label selects later finds its spec; whether a name is handed out is
/// Allocate's decision. `required` applies with the `[device_plugin]` keys.
pub fn extra_cdi_specs(
    config: &Config,
    root: &HostRoot,
    nodes: &DeviceNodes,
) -> Result<Vec<(PathBuf, Option<String>)>, RuntimeError> {
    let dp = &config.device_plugin;
    let mut injections = crate::edits::Injections::from_config(dp);
    for name in dp.profiles.keys() {
        if let Some(p) = dp.with_profile(name) {
            injections.gds |= p.gds_enabled;
            injections.mofed |= p.mofed_enabled;
            injections.gdrcopy |= p.gdrcopy_enabled;
            for id in p.imex.channel_ids {
                if !injections.imex_channel_ids.contains(&id) {
                    injections.imex_channel_ids.push(id);
                }
            }
        }
    }
    let vendor = dp.cdi_kind.split_once('/').map_or(dp.cdi_kind.as_str(), |(v, _)| v);
    let opts = cdi::ExtraOptions {
        vendor: vendor.to_string(),
        injections,
        dev_root: dp.dev_root.clone(),
        gds_mounts: cdi::gds_mounts(root.path(), &dp.driver_root),
        driver_root: dp.driver_root.clone(),
    };
    let mut out = Vec::new();
    for extra in cdi::extra_specs(&nodes.extra, &opts)? {
        let path = config.cdi.dir.join(cdi::spec_file_name(&extra.kind));
        let text = extra.spec.as_ref().map(cdi::to_json).transpose()?;
        out.push((path, text));
    }
    Ok(out)
}

/// Writes the injection specs whose bytes changed and removes those with nothing to write
/// (a class turned off, or its nodes gone); whether anything changed.
pub fn write_extra_cdi(root: &HostRoot, specs: &[(PathBuf, Option<String>)]) -> Result<bool, RuntimeError> {
    let mut changed = false;
    for (path, text) in specs {
        let host = root.join(path);
        let current = read_optional(&host)?;
        match text {
            Some(text) if current.as_deref() != Some(text.as_str()) => {
                write_atomic(&host, text.as_bytes(), 0o644)?;
                tracing::info!("CDI spec written to {}", path.display());
                changed = true;
            }
            None if current.is_some() => {
                std::fs::remove_file(&host).map_err(|source| FileError::Read {
                    path: host.clone(),
                    source,
                })?;
                tracing::info!("CDI spec {} removed: nothing to inject", path.display());
                changed = true;
            }
            _ => {}
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::engine::tests::host;

    /// A class a profile enables gets its spec (a label may select that profile later); once
    /// nothing enables it, the spec left from before is removed, and only that one.
    #[test]
    fn injection_specs_follow_profiles_and_are_removed_when_off() {
        let (_tmp, root) = host(&[("/var/run/cdi/other.json", "{}")], &[]);
        let mut config = Config::default();
        let profile: crate::config::DevicePluginProfile =
            toml::from_str("gdrcopy_enabled = true\nimex = { channel_ids = [0] }\n").unwrap();
        config.device_plugin.profiles.insert("rdma".into(), profile);
        let mut nodes = DeviceNodes::default();
        nodes.extra.gdrcopy = vec!["/dev/gdrdrv".into()];
        nodes.extra.imex_channels = [0].into();

        let specs = extra_cdi_specs(&config, &root, &nodes).unwrap();
        let written: Vec<_> = specs
            .iter()
            .filter(|(_, text)| text.is_some())
            .map(|(path, _)| path.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            written,
            [
                "/var/run/cdi/k8s.device-plugin.nvidia.com-gdrcopy.json",
                "/var/run/cdi/k8s.device-plugin.nvidia.com-imex-channel.json"
            ]
        );
        assert!(write_extra_cdi(&root, &specs).unwrap());
        assert!(
            !write_extra_cdi(&root, &specs).unwrap(),
            "unchanged bytes are not rewritten"
        );
        let gdrcopy = root.join("/var/run/cdi/k8s.device-plugin.nvidia.com-gdrcopy.json");
        assert!(std::fs::read_to_string(&gdrcopy).unwrap().contains("\"/dev/gdrdrv\""));

        config.device_plugin.profiles.clear();
        let specs = extra_cdi_specs(&config, &root, &nodes).unwrap();
        assert!(specs.iter().all(|(_, text)| text.is_none()));
        assert!(write_extra_cdi(&root, &specs).unwrap());
        assert!(!gdrcopy.exists());
        assert!(root.join("/var/run/cdi/other.json").exists());
    }
}
