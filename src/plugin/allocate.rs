//! `Allocate`: turn the device IDs the kubelet picked for one container into the
//! `ContainerAllocateResponse` NVIDIA's k8s-device-plugin would return, so the NVIDIA Container
//! Toolkit (or a CDI-aware runtime) injects the same GPUs into the same images.
//!
//! The Allocate renderer of the container-edits model ([`crate::edits`]): the devices' nodes,
//! the injections and MPS's env and mounts come from there; what is decided here is only the
//! response's format (the device list strategies, the CDI names, the device specs). The function
//! is pure apart from the random UUID in the CDI annotation key; the host facts it needs (which
//! device nodes exist) come in as [`DeviceNodes`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::api::{CdiDevice, ContainerAllocateRequest, ContainerAllocateResponse, DeviceSpec, Mount};
use crate::config::{DeviceIdStrategy, DeviceListStrategy};
use crate::devices::{PluginDevice, Resource, is_replica_id};
use crate::edits::injections::{ENABLED, IMEX_CHANNELS_ENV, IMEX_CLASS, InjectionEdits};
use crate::edits::{self, ContainerEdits, DeviceNode, DeviceNodes, Injections};
use crate::plugin::mps::{MpsAllocate, MpsNotReady, mps_edits};

/// The environment variable the NVIDIA Container Toolkit reads.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// Container directory of the `volume-mounts` strategy; also the env value that points there.
pub const VOLUME_MOUNTS_DIR: &str = "/var/run/nvidia-container-devices";
/// Stem of the CDI annotation key after the prefix; a fresh UUID follows per response.
pub const CDI_ANNOTATION_KEY_STEM: &str = "nvidia-device-plugin_";

/// Settings that shape the response; see the module docs of each field's NVIDIA equivalent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocateOptions {
    /// Strategies to apply together. Empty means NVIDIA's default, `[Envvar]`.
    pub strategies: Vec<DeviceListStrategy>,
    pub id_strategy: DeviceIdStrategy,
    /// Also return device specs for the device nodes (NVIDIA's `passDeviceSpecs`, for the static
    /// CPU manager). Ignored when every strategy is a CDI one; implied by `HostMounts`.
    pub pass_device_specs: bool,
    /// Prefix of the CDI annotation key, normally `cdi.k8s.io/`.
    pub cdi_annotation_prefix: String,
    /// Fully qualified CDI kind, normally `k8s.device-plugin.nvidia.com/gpu`.
    pub cdi_kind: String,
    /// Host prefix for device node host paths (`/` = none), NVIDIA's `nvidiaDevRoot`.
    pub dev_root: PathBuf,
    /// `HostMounts`: host directory holding the driver's user-space (`lib64/`, `bin/`).
    pub host_mounts_driver_dir: PathBuf,
    /// `HostMounts`: where that directory appears in the container.
    pub host_mounts_container_dir: PathBuf,
    /// For shared (replica) resources: refuse requests for more than one ID.
    pub fail_requests_greater_than_one: bool,
    /// GDS, MOFED, GDRCopy and IMEX channels (see [`crate::edits::injections`]).
    pub injections: Injections,
    /// MPS: the control daemon of each resource shared through MPS ([`crate::plugin::mps`]).
    pub mps: MpsAllocate,
}

impl Default for AllocateOptions {
    /// NVIDIA's defaults; the host-mounts directories follow GKE's installer layout.
    fn default() -> Self {
        AllocateOptions {
            strategies: vec![DeviceListStrategy::Envvar],
            id_strategy: DeviceIdStrategy::Uuid,
            pass_device_specs: false,
            cdi_annotation_prefix: "cdi.k8s.io/".to_string(),
            cdi_kind: "k8s.device-plugin.nvidia.com/gpu".to_string(),
            dev_root: PathBuf::from("/"),
            host_mounts_driver_dir: PathBuf::from("/home/kubernetes/bin/nvidia"),
            host_mounts_container_dir: PathBuf::from("/usr/local/nvidia"),
            fail_requests_greater_than_one: false,
            injections: Injections::default(),
            mps: MpsAllocate::default(),
        }
    }
}

/// Why an allocation request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The container request carried no device IDs (the kubelet never sends that).
    #[error("invalid allocation request for '{resource}': no device IDs requested")]
    EmptyRequest { resource: String },
    /// A requested ID is not one this resource advertises.
    #[error("invalid allocation request for '{resource}': unknown device: {id}")]
    UnknownDevice { id: String, resource: String },
    /// `fail_requests_greater_than_one` and a multi-ID request for replicas (NVIDIA's text).
    #[error("invalid request: maximum request size for shared resources is 1; found {found}")]
    SharedRequestTooLarge { found: usize },
    /// The driver's `mig-minors` table has no entry for a capability a MIG device needs.
    #[error("MIG device {device}: capability {key:?} not found in /proc/driver/nvidia-caps/mig-minors")]
    MissingMigCapability { key: String, device: String },
    /// `[device_plugin.imex] required` and a listed channel's node does not exist.
    #[error("IMEX channel {path} does not exist and [device_plugin.imex] required = true")]
    ImexChannelMissing { path: String },
    /// A replica of a resource shared through MPS while its control daemon does not answer.
    #[error(transparent)]
    MpsNotReady(#[from] Box<MpsNotReady>),
}

/// Builds the response for one container request.
///
/// - Validation (NVIDIA's order): every ID must be a key of `resource.devices` (replica IDs are
///   keys too), else [`AllocateError::UnknownDevice`]; then, with
///   `fail_requests_greater_than_one`, a request of more than one ID containing any replica
///   ID is [`AllocateError::SharedRequestTooLarge`]. Unhealthy devices are not refused: the
///   kubelet only hands out healthy ones, and a re-admission of a running pod must not fail.
///   The one exception: a replica of a resource shared through MPS while its control daemon
///   does not answer ([`AllocateError::MpsNotReady`]), since the container would get a pipe
///   nobody serves.
/// - IDs are mapped per `id_strategy` (replicas to their device's UUID or index), deduplicated
///   in request order; every strategy below uses the mapped list.
/// - `envvar`: `NVIDIA_VISIBLE_DEVICES=<id>,<id>`.
/// - `volume-mounts`: `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` (wins over
///   `envvar`) and a read-write `/dev/null` mount at `/var/run/nvidia-container-devices/<id>`
///   per ID, as NVIDIA does.
/// - `cdi-annotations`: one annotation `<prefix>nvidia-device-plugin_<uuid v4>` whose value is
///   the comma-separated qualified names `<kind>=<id>,<kind>=<id>`.
/// - `cdi-cri`: one `cdi_devices` entry `<kind>=<id>` per ID.
/// - `host-mounts`: see [`host_mounts`].
/// - If every strategy is a CDI one, no envs, mounts or device specs are returned at all (the
///   CDI spec carries them).
/// - Device specs (`pass_device_specs` or `host-mounts`): see [`device_specs`].
/// - GDS, MOFED, GDRCopy and IMEX channels are added last: see [`add_injections`].
/// - Replicas of a resource shared through MPS: the pipe folder, `/dev/shm` and the limits, see
///   [`crate::plugin::mps::mps_edits`].
pub fn allocate(
    resource: &Resource,
    req: &ContainerAllocateRequest,
    opts: &AllocateOptions,
    nodes: &DeviceNodes,
) -> Result<ContainerAllocateResponse, AllocateError> {
    let ids = &req.devices_ids;
    if ids.is_empty() {
        return Err(AllocateError::EmptyRequest {
            resource: resource.name.clone(),
        });
    }
    let mut requested = Vec::with_capacity(ids.len());
    for id in ids {
        let device = resource.devices.get(id).ok_or_else(|| AllocateError::UnknownDevice {
            id: id.clone(),
            resource: resource.name.clone(),
        })?;
        requested.push(device);
    }
    if opts.fail_requests_greater_than_one && ids.len() > 1 && ids.iter().any(|id| is_replica_id(id)) {
        return Err(AllocateError::SharedRequestTooLarge { found: ids.len() });
    }
    opts.mps.check_ready(resource, ids)?;

    // Distinct devices in request order; replicas of one GPU collapse to it.
    let mut seen = BTreeSet::new();
    let devices: Vec<&PluginDevice> = requested.into_iter().filter(|d| seen.insert(d.uuid.as_str())).collect();
    let visible: Vec<&str> = devices
        .iter()
        .map(|d| match opts.id_strategy {
            DeviceIdStrategy::Uuid => d.uuid.as_str(),
            DeviceIdStrategy::Index => d.index.as_str(),
        })
        .collect();

    let default_strategies = [DeviceListStrategy::Envvar];
    let strategies: &[DeviceListStrategy] = if opts.strategies.is_empty() {
        &default_strategies
    } else {
        &opts.strategies
    };
    let has = |s: DeviceListStrategy| strategies.contains(&s);
    let all_cdi = strategies.iter().all(|s| s.is_cdi());

    let injected = opts
        .injections
        .edits(&nodes.extra, &opts.dev_root)
        .map_err(|missing| AllocateError::ImexChannelMissing { path: missing.path })?;
    let mut resp = ContainerAllocateResponse::default();

    if !all_cdi {
        if has(DeviceListStrategy::VolumeMounts) {
            resp.envs
                .insert(VISIBLE_DEVICES_ENV.to_string(), VOLUME_MOUNTS_DIR.to_string());
            resp.mounts.extend(visible.iter().map(|id| Mount {
                container_path: format!("{VOLUME_MOUNTS_DIR}/{id}"),
                host_path: "/dev/null".to_string(),
                read_only: false,
            }));
        } else if has(DeviceListStrategy::Envvar)
            || has(DeviceListStrategy::HostMounts)
            // Decided at start (Config::resolve_auto); left as it is, it means what a node with
            // the NVIDIA runtime makes of it.
            || has(DeviceListStrategy::Auto)
        {
            resp.envs.insert(VISIBLE_DEVICES_ENV.to_string(), visible.join(","));
        }
        if has(DeviceListStrategy::HostMounts) {
            let (mount, envs) = host_mounts(opts);
            resp.mounts.push(mount);
            resp.envs.extend(envs);
        }
        if opts.pass_device_specs || has(DeviceListStrategy::HostMounts) {
            resp.devices = device_specs(&devices, &opts.dev_root, nodes)?;
        }
    }

    let mut qualified: Vec<String> = visible.iter().map(|id| format!("{}={id}", opts.cdi_kind)).collect();
    qualified.extend(injection_cdi_names(&injected, &opts.cdi_kind));
    if has(DeviceListStrategy::CdiAnnotations) {
        let key = format!(
            "{}{CDI_ANNOTATION_KEY_STEM}{}",
            opts.cdi_annotation_prefix,
            uuid::Uuid::new_v4()
        );
        resp.annotations.insert(key, qualified.join(","));
    }
    if has(DeviceListStrategy::CdiCri) {
        resp.cdi_devices = qualified.into_iter().map(|name| CdiDevice { name }).collect();
    }
    add_injections(&injected, opts, &mut resp, strategies);
    // Whatever the strategies: the CDI spec knows nothing of MPS.
    add_edits(&mps_edits(&opts.mps, resource, ids), &mut resp);
    Ok(resp)
}

/// The CDI names of the injections, handed out after the GPUs': `<vendor>/imex-channel=<N>` per
/// channel, then `<vendor>/<class>=all` per enabled flag class the host has nodes of (NVIDIA
/// drops a class whose spec came out empty; the agent writes that spec from the same nodes).
/// The vendor is `cdi_kind`'s.
fn injection_cdi_names(injected: &InjectionEdits, cdi_kind: &str) -> Vec<String> {
    let vendor = cdi_kind.split_once('/').map_or(cdi_kind, |(vendor, _)| vendor);
    let mut names: Vec<String> = injected
        .imex_channels
        .iter()
        .map(|(id, _)| format!("{vendor}/{IMEX_CLASS}={id}"))
        .collect();
    for flag in injected.present_flags() {
        names.push(format!("{vendor}/{}={}", flag.class, edits::injections::ALL_DEVICE));
    }
    names
}

/// Adds the injections' envs, mounts and device specs to `resp`, as NVIDIA's
/// `getAllocateResponse` does:
/// - `NVIDIA_GDRCOPY=enabled`, `NVIDIA_GDS=enabled`, `NVIDIA_MOFED=enabled` for each enabled
///   flag, whatever the strategies (also when all are CDI ones);
/// - unless every strategy is a CDI one: `NVIDIA_IMEX_CHANNELS=<N>,…` with `envvar` (and `auto`,
///   `host-mounts`, which set `NVIDIA_VISIBLE_DEVICES` too); a `/dev/null` mount at
///   `/var/run/nvidia-container-devices/imex/<N>` with `volume-mounts`; a device spec for
///   `/dev/nvidia-caps-imex-channels/channel<N>` with `pass_device_specs` (or `host-mounts`).
/// - The agent's own `host-mounts` strategy has no runtime hook to read the envs, so it also gets
///   the GDS, MOFED and GDRCopy device nodes as device specs (NVIDIA has no such strategy).
pub fn add_injections(
    injected: &InjectionEdits,
    opts: &AllocateOptions,
    resp: &mut ContainerAllocateResponse,
    strategies: &[DeviceListStrategy],
) {
    for flag in &injected.flags {
        resp.envs.insert(flag.env.to_string(), ENABLED.to_string());
    }
    if strategies.iter().all(|s| s.is_cdi()) {
        return;
    }
    let has = |s: DeviceListStrategy| strategies.contains(&s);
    let host_mounts = has(DeviceListStrategy::HostMounts);
    let channels = &injected.imex_channels;
    if !channels.is_empty() && (has(DeviceListStrategy::Envvar) || has(DeviceListStrategy::Auto) || host_mounts) {
        let ids: Vec<String> = channels.iter().map(|(id, _)| id.to_string()).collect();
        resp.envs.insert(IMEX_CHANNELS_ENV.to_string(), ids.join(","));
    }
    if has(DeviceListStrategy::VolumeMounts) {
        resp.mounts.extend(channels.iter().map(|(id, _)| Mount {
            container_path: format!("{VOLUME_MOUNTS_DIR}/imex/{id}"),
            host_path: "/dev/null".to_string(),
            read_only: false,
        }));
    }
    let mut nodes: Vec<&DeviceNode> = Vec::new();
    if opts.pass_device_specs || host_mounts {
        nodes.extend(channels.iter().map(|(_, node)| node));
    }
    if host_mounts {
        for flag in &injected.flags {
            nodes.extend(&flag.device_nodes);
        }
    }
    for node in nodes {
        if !resp.devices.iter().any(|d| d.container_path == node.path) {
            resp.devices.push(device_spec(node));
        }
    }
}

/// Adds `edits` (env, mounts, device nodes; a device plugin response has no hooks) to `resp`.
fn add_edits(edits: &ContainerEdits, resp: &mut ContainerAllocateResponse) {
    for (name, value) in &edits.env {
        resp.envs.insert(name.clone(), value.clone());
    }
    resp.mounts.extend(edits.mounts.iter().map(|m| Mount {
        container_path: m.container_path.to_string_lossy().into_owned(),
        host_path: m.host_path.to_string_lossy().into_owned(),
        read_only: m.read_only(),
    }));
    resp.devices.extend(edits.device_nodes.iter().map(device_spec));
}

/// What the `host-mounts` strategy adds besides device specs: the host driver directory mounted
/// read-only at the container directory, and envs `NVIDIA_VISIBLE_DEVICES` (set by the caller;
/// harmless without a hook, and tools read it) and `LD_LIBRARY_PATH=<container_dir>/lib64` so
/// `libcuda.so.1` resolves without `ldconfig` in the image.
///
/// `PATH` is deliberately not set: an env from the device plugin replaces the image's value
/// wholesale, and the image's `PATH` is not known here; images that want `nvidia-smi` add
/// `<container_dir>/bin` themselves (CUDA base images already do). `LD_LIBRARY_PATH` has the
/// same clobbering property; CUDA base images set it to exactly the GKE directories, so setting
/// it costs them nothing, but an image with its own `LD_LIBRARY_PATH` loses it.
pub fn host_mounts(opts: &AllocateOptions) -> (Mount, Vec<(String, String)>) {
    let container_dir = opts.host_mounts_container_dir.to_string_lossy().into_owned();
    let mount = Mount {
        container_path: container_dir.clone(),
        host_path: opts.host_mounts_driver_dir.to_string_lossy().into_owned(),
        read_only: true,
    };
    let lib64 = format!("{}/lib64", container_dir.trim_end_matches('/'));
    (mount, vec![("LD_LIBRARY_PATH".to_string(), lib64)])
}

/// Device specs for `devices`, deduplicated by container path, permissions `rw`, host path =
/// `dev_root` + container path: the control nodes that exist on the host (`nodes.control`, in
/// its order), then each device's nodes ([`edits::device_nodes`]: `/dev/nvidia<minor>`, and a
/// MIG device's capability nodes). A missing capability is
/// [`AllocateError::MissingMigCapability`]: without it CUDA cannot open the instance.
pub fn device_specs(
    devices: &[&PluginDevice],
    dev_root: &Path,
    nodes: &DeviceNodes,
) -> Result<Vec<DeviceSpec>, AllocateError> {
    let mut found = edits::control_nodes(nodes, dev_root);
    for device in devices {
        let own =
            edits::device_nodes(device, nodes, dev_root).map_err(|missing| AllocateError::MissingMigCapability {
                key: missing.key,
                device: missing.device,
            })?;
        found.extend(own);
    }
    let mut seen = BTreeSet::new();
    Ok(found
        .iter()
        .filter(|n| seen.insert(n.path.clone()))
        .map(device_spec)
        .collect())
}

/// A device node as a device plugin `DeviceSpec` (`rw`).
fn device_spec(node: &DeviceNode) -> DeviceSpec {
    DeviceSpec {
        container_path: node.path.clone(),
        host_path: node.host_path.to_string_lossy().into_owned(),
        permissions: "rw".to_string(),
    }
}

/// The envs of a response as a sorted map, for logs and tests.
pub fn sorted_envs(resp: &ContainerAllocateResponse) -> Vec<(&str, &str)> {
    let mut envs: Vec<(&str, &str)> = resp.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    envs.sort();
    envs
}

#[cfg(test)]
mod injections_tests;
#[cfg(test)]
mod mps_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{Health, MigInfo};
    use std::collections::BTreeMap;

    const G0: &str = "GPU-00000000-0000-0000-0000-000000000000";
    const G1: &str = "GPU-11111111-1111-1111-1111-111111111111";
    const M0: &str = "MIG-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa";
    const M1: &str = "MIG-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb";

    fn gpu(uuid: &str, index: u32) -> PluginDevice {
        PluginDevice {
            uuid: uuid.into(),
            index: index.to_string(),
            minor: index,
            numa_node: Some(0),
            mig: None,
            health: Health::Healthy,
        }
    }

    fn mig(uuid: &str, mig_index: u32, gi: u32) -> PluginDevice {
        PluginDevice {
            uuid: uuid.into(),
            index: format!("1:{mig_index}"),
            minor: 1,
            numa_node: Some(0),
            mig: Some(MigInfo {
                parent_uuid: G1.into(),
                parent_index: 1,
                gi_id: gi,
                ci_id: 0,
                profile: "3g.20gb".into(),
            }),
            health: Health::Healthy,
        }
    }

    fn gpus() -> Resource {
        Resource {
            name: "nvidia.com/gpu".into(),
            devices: [(G0.into(), gpu(G0, 0)), (G1.into(), gpu(G1, 1))].into(),
        }
    }

    fn migs() -> Resource {
        Resource {
            name: "nvidia.com/mig-3g.20gb".into(),
            devices: [(M0.into(), mig(M0, 0, 1)), (M1.into(), mig(M1, 1, 2))].into(),
        }
    }

    fn replicas() -> Resource {
        let mut devices = BTreeMap::new();
        for (uuid, index) in [(G0, 0), (G1, 1)] {
            for n in 0..2 {
                devices.insert(format!("{uuid}::{n}"), gpu(uuid, index));
            }
        }
        Resource {
            name: "nvidia.com/gpu.shared".into(),
            devices,
        }
    }

    fn nodes() -> DeviceNodes {
        DeviceNodes {
            control: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
            mig_minors: [
                ("config".into(), 1),
                ("monitor".into(), 2),
                ("gpu1/gi1/access".into(), 12),
                ("gpu1/gi1/ci0/access".into(), 13),
                ("gpu1/gi2/access".into(), 21),
                ("gpu1/gi2/ci0/access".into(), 22),
            ]
            .into(),
            extra: Default::default(),
        }
    }

    fn req(ids: &[&str]) -> ContainerAllocateRequest {
        ContainerAllocateRequest {
            devices_ids: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn opts(strategies: &[DeviceListStrategy]) -> AllocateOptions {
        AllocateOptions {
            strategies: strategies.to_vec(),
            ..AllocateOptions::default()
        }
    }

    fn index_opts(strategies: &[DeviceListStrategy]) -> AllocateOptions {
        AllocateOptions {
            id_strategy: DeviceIdStrategy::Index,
            ..opts(strategies)
        }
    }

    fn spec_paths(resp: &ContainerAllocateResponse) -> Vec<(&str, &str)> {
        resp.devices
            .iter()
            .map(|d| {
                assert_eq!(d.permissions, "rw");
                (d.container_path.as_str(), d.host_path.as_str())
            })
            .collect()
    }

    use DeviceListStrategy::*;

    #[test]
    fn envvar_uuid_and_index() {
        let r = allocate(&gpus(), &req(&[G1, G0]), &opts(&[Envvar]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, format!("{G1},{G0}").as_str())]);
        assert!(r.mounts.is_empty() && r.devices.is_empty());
        assert!(r.annotations.is_empty() && r.cdi_devices.is_empty());

        let r = allocate(&gpus(), &req(&[G0, G1]), &index_opts(&[Envvar]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, "0,1")]);
    }

    #[test]
    fn envvar_mig_uuid_and_index() {
        let r = allocate(&migs(), &req(&[M0]), &opts(&[Envvar]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, M0)]);
        let r = allocate(&migs(), &req(&[M0, M1]), &index_opts(&[Envvar]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, "1:0,1:1")]);
        assert!(r.devices.is_empty());
    }

    #[test]
    fn empty_strategy_list_means_envvar() {
        let r = allocate(&gpus(), &req(&[G0]), &opts(&[]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, G0)]);
    }

    #[test]
    fn volume_mounts_for_gpus_and_migs() {
        let r = allocate(&gpus(), &req(&[G0, G1]), &opts(&[VolumeMounts]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, VOLUME_MOUNTS_DIR)]);
        assert_eq!(
            r.mounts,
            [G0, G1].map(|id| Mount {
                container_path: format!("/var/run/nvidia-container-devices/{id}"),
                host_path: "/dev/null".into(),
                read_only: false,
            })
        );

        let r = allocate(&migs(), &req(&[M1]), &index_opts(&[VolumeMounts]), &nodes()).unwrap();
        assert_eq!(r.mounts.len(), 1);
        assert_eq!(r.mounts[0].container_path, "/var/run/nvidia-container-devices/1:1");
        assert!(r.devices.is_empty());
    }

    #[test]
    fn volume_mounts_overwrite_envvar_in_either_order() {
        for strategies in [[Envvar, VolumeMounts], [VolumeMounts, Envvar]] {
            let r = allocate(&gpus(), &req(&[G0]), &opts(&strategies), &nodes()).unwrap();
            assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, VOLUME_MOUNTS_DIR)]);
            assert_eq!(r.mounts.len(), 1);
        }
    }

    #[test]
    fn cdi_annotations() {
        let r = allocate(&gpus(), &req(&[G0, G1]), &opts(&[CdiAnnotations]), &nodes()).unwrap();
        assert_eq!(r.annotations.len(), 1);
        let (key, value) = r.annotations.iter().next().unwrap();
        let uuid = key.strip_prefix("cdi.k8s.io/nvidia-device-plugin_").expect(key);
        assert!(uuid::Uuid::parse_str(uuid).is_ok(), "{key}");
        assert_eq!(
            value,
            &format!("k8s.device-plugin.nvidia.com/gpu={G0},k8s.device-plugin.nvidia.com/gpu={G1}")
        );
        // All-CDI: nothing else.
        assert!(r.envs.is_empty() && r.mounts.is_empty() && r.devices.is_empty());
        assert!(r.cdi_devices.is_empty());

        // Fresh key per response; custom prefix; index names for MIG.
        let o = AllocateOptions {
            cdi_annotation_prefix: "example.com/".into(),
            ..index_opts(&[CdiAnnotations])
        };
        let a = allocate(&migs(), &req(&[M0, M1]), &o, &nodes()).unwrap();
        let b = allocate(&migs(), &req(&[M0, M1]), &o, &nodes()).unwrap();
        let ka = a.annotations.keys().next().unwrap();
        assert!(ka.starts_with("example.com/nvidia-device-plugin_"));
        assert_ne!(ka, b.annotations.keys().next().unwrap());
        assert_eq!(
            a.annotations.values().next().unwrap(),
            "k8s.device-plugin.nvidia.com/gpu=1:0,k8s.device-plugin.nvidia.com/gpu=1:1"
        );
    }

    #[test]
    fn cdi_cri() {
        let o = AllocateOptions {
            pass_device_specs: true,
            ..opts(&[CdiCri])
        };
        let r = allocate(&migs(), &req(&[M1, M0]), &o, &nodes()).unwrap();
        let names: Vec<_> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                format!("k8s.device-plugin.nvidia.com/gpu={M1}"),
                format!("k8s.device-plugin.nvidia.com/gpu={M0}")
            ]
        );
        assert!(r.envs.is_empty() && r.mounts.is_empty() && r.devices.is_empty());
        assert!(r.annotations.is_empty());

        let r = allocate(&gpus(), &req(&[G1]), &index_opts(&[CdiCri, CdiAnnotations]), &nodes()).unwrap();
        assert_eq!(r.cdi_devices[0].name, "k8s.device-plugin.nvidia.com/gpu=1");
        assert_eq!(r.annotations.len(), 1);
        assert!(r.envs.is_empty());
    }

    #[test]
    fn cdi_mixed_with_envvar_keeps_envs_and_specs() {
        let o = AllocateOptions {
            pass_device_specs: true,
            ..opts(&[Envvar, CdiCri])
        };
        let r = allocate(&gpus(), &req(&[G0]), &o, &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, G0)]);
        assert_eq!(r.cdi_devices.len(), 1);
        assert!(!r.devices.is_empty());
    }

    #[test]
    fn device_specs_for_gpus() {
        let o = AllocateOptions {
            pass_device_specs: true,
            ..opts(&[Envvar])
        };
        let r = allocate(&gpus(), &req(&[G1, G0]), &o, &nodes()).unwrap();
        assert_eq!(
            spec_paths(&r),
            [
                ("/dev/nvidiactl", "/dev/nvidiactl"),
                ("/dev/nvidia-uvm", "/dev/nvidia-uvm"),
                ("/dev/nvidia1", "/dev/nvidia1"),
                ("/dev/nvidia0", "/dev/nvidia0"),
            ]
        );

        // A dev root prefixes host paths only.
        let o = AllocateOptions {
            dev_root: "/run/nvidia/driver".into(),
            ..o
        };
        let r = allocate(&gpus(), &req(&[G0]), &o, &nodes()).unwrap();
        assert_eq!(
            spec_paths(&r),
            [
                ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl"),
                ("/dev/nvidia-uvm", "/run/nvidia/driver/dev/nvidia-uvm"),
                ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0"),
            ]
        );
    }

    #[test]
    fn device_specs_for_migs_include_caps_and_dedupe_parent() {
        let o = AllocateOptions {
            pass_device_specs: true,
            ..index_opts(&[VolumeMounts])
        };
        let r = allocate(&migs(), &req(&[M0, M1]), &o, &nodes()).unwrap();
        let containers: Vec<_> = spec_paths(&r).into_iter().map(|(c, _)| c).collect();
        assert_eq!(
            containers,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia1",
                "/dev/nvidia-caps/nvidia-cap12",
                "/dev/nvidia-caps/nvidia-cap13",
                "/dev/nvidia-caps/nvidia-cap21",
                "/dev/nvidia-caps/nvidia-cap22",
            ]
        );
    }

    #[test]
    fn missing_mig_capability() {
        let o = AllocateOptions {
            pass_device_specs: true,
            ..opts(&[Envvar])
        };
        let mut n = nodes();
        n.mig_minors.remove("gpu1/gi2/ci0/access");
        let err = allocate(&migs(), &req(&[M1]), &o, &n).unwrap_err();
        assert_eq!(
            err,
            AllocateError::MissingMigCapability {
                key: "gpu1/gi2/ci0/access".into(),
                device: M1.into()
            }
        );
        let text = err.to_string();
        assert!(text.contains("gpu1/gi2/ci0/access") && text.contains(M1), "{text}");

        // Without device specs the table is not consulted.
        assert!(allocate(&migs(), &req(&[M1]), &opts(&[Envvar]), &n).is_ok());
    }

    #[test]
    fn unknown_id() {
        let err = allocate(&gpus(), &req(&[G0, "GPU-nope"]), &opts(&[Envvar]), &nodes()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid allocation request for 'nvidia.com/gpu': unknown device: GPU-nope"
        );
        // A replica ID is not a key of a non-shared resource.
        let err = allocate(&gpus(), &req(&[&format!("{G0}::0")]), &opts(&[Envvar]), &nodes()).unwrap_err();
        assert!(matches!(err, AllocateError::UnknownDevice { .. }));
        // Nor is a MIG ID a key of the full-GPU resource.
        assert!(allocate(&gpus(), &req(&[M0]), &opts(&[Envvar]), &nodes()).is_err());

        let err = allocate(&gpus(), &req(&[]), &opts(&[Envvar]), &nodes()).unwrap_err();
        assert!(matches!(err, AllocateError::EmptyRequest { .. }));
    }

    #[test]
    fn replicas_map_to_devices_and_dedupe() {
        let ids = [format!("{G1}::1"), format!("{G0}::0"), format!("{G1}::0")];
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let r = allocate(&replicas(), &req(&ids), &opts(&[Envvar]), &nodes()).unwrap();
        assert_eq!(sorted_envs(&r), [(VISIBLE_DEVICES_ENV, format!("{G1},{G0}").as_str())]);
        let r = allocate(&replicas(), &req(&ids), &index_opts(&[CdiCri]), &nodes()).unwrap();
        assert_eq!(r.cdi_devices.len(), 2);
        assert_eq!(r.cdi_devices[0].name, "k8s.device-plugin.nvidia.com/gpu=1");
    }

    #[test]
    fn shared_request_limit() {
        let o = AllocateOptions {
            fail_requests_greater_than_one: true,
            ..opts(&[Envvar])
        };
        let two = [format!("{G0}::0"), format!("{G0}::1")];
        let two: Vec<&str> = two.iter().map(String::as_str).collect();
        let err = allocate(&replicas(), &req(&two), &o, &nodes()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid request: maximum request size for shared resources is 1; found 2"
        );
        assert!(allocate(&replicas(), &req(&two[..1]), &o, &nodes()).is_ok());
        // Unknown IDs are reported first, as NVIDIA does.
        let err = allocate(&replicas(), &req(&[two[0], "x::1"]), &o, &nodes()).unwrap_err();
        assert!(matches!(err, AllocateError::UnknownDevice { .. }));
        // Not shared: no limit.
        assert!(allocate(&gpus(), &req(&[G0, G1]), &o, &nodes()).is_ok());
    }

    #[test]
    fn unhealthy_devices_are_still_allocated() {
        let mut res = gpus();
        res.devices.get_mut(G0).unwrap().health = Health::Unhealthy;
        assert!(allocate(&res, &req(&[G0]), &opts(&[Envvar]), &nodes()).is_ok());
    }

    #[test]
    fn host_mounts_strategy() {
        let o = index_opts(&[HostMounts]);
        let r = allocate(&migs(), &req(&[M0]), &o, &nodes()).unwrap();
        assert_eq!(
            sorted_envs(&r),
            [
                ("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
                (VISIBLE_DEVICES_ENV, "1:0"),
            ]
        );
        assert_eq!(
            r.mounts,
            [Mount {
                container_path: "/usr/local/nvidia".into(),
                host_path: "/home/kubernetes/bin/nvidia".into(),
                read_only: true,
            }]
        );
        let containers: Vec<_> = spec_paths(&r).into_iter().map(|(c, _)| c).collect();
        assert_eq!(
            containers,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia1",
                "/dev/nvidia-caps/nvidia-cap12",
                "/dev/nvidia-caps/nvidia-cap13",
            ]
        );

        // Whole GPUs, custom dirs, combined with volume-mounts (which keeps its env value).
        let o = AllocateOptions {
            host_mounts_driver_dir: "/opt/nvidia/driver".into(),
            host_mounts_container_dir: "/nvidia/".into(),
            dev_root: "/host".into(),
            ..opts(&[HostMounts, VolumeMounts])
        };
        let r = allocate(&gpus(), &req(&[G0]), &o, &nodes()).unwrap();
        assert_eq!(
            sorted_envs(&r),
            [
                ("LD_LIBRARY_PATH", "/nvidia/lib64"),
                (VISIBLE_DEVICES_ENV, VOLUME_MOUNTS_DIR),
            ]
        );
        assert_eq!(r.mounts.len(), 2);
        assert_eq!(r.mounts[1].host_path, "/opt/nvidia/driver");
        assert_eq!(spec_paths(&r).last(), Some(&("/dev/nvidia0", "/host/dev/nvidia0")));
    }
}
