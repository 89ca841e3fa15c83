//! The opt-in injections of NVIDIA's device plugin (v0.20): `gdsEnabled`, `mofedEnabled`,
//! `gdrcopyEnabled` and the IMEX channels (`imex.channelIDs`, `imex.required`), added to every
//! Allocate response besides the GPUs (pure; the host facts come in as [`ExtraNodes`]).
//!
//! What NVIDIA's `getAllocateResponse` adds, and so what [`Injected::apply`] and
//! [`Injected::cdi_names`] add:
//! - `NVIDIA_GDRCOPY=enabled`, `NVIDIA_GDS=enabled`, `NVIDIA_MOFED=enabled` for each enabled
//!   flag, whatever the strategies (also when all are CDI ones);
//! - with a `cdi-*` strategy, after the GPU names: `<vendor>/imex-channel=<N>` per channel, then
//!   `<vendor>/gdrcopy=all`, `<vendor>/gds=all`, `<vendor>/mofed=all` for each enabled flag whose
//!   CDI spec exists (NVIDIA drops a class whose spec came out empty; here: whose device nodes
//!   the host lacks, since the agent writes that spec from the same nodes);
//! - unless every strategy is a CDI one: `NVIDIA_IMEX_CHANNELS=<N>,…` with `envvar` (and `auto`,
//!   `host-mounts`, which set `NVIDIA_VISIBLE_DEVICES` too); a `/dev/null` mount at
//!   `/var/run/nvidia-container-devices/imex/<N>` with `volume-mounts`; a device spec for
//!   `/dev/nvidia-caps-imex-channels/channel<N>` with `pass_device_specs` (or `host-mounts`).
//! - The agent's own `host-mounts` strategy has no runtime hook to read the envs, so it also gets
//!   the GDS, MOFED and GDRCopy device nodes as device specs (NVIDIA has no such strategy).
//!
//! IMEX channels are NVIDIA's `imex.GetChannels`: a configured channel is handed out only when its
//! node exists under the dev root; with `required` a missing one is an error naming its path.

use std::path::Path;

use super::allocate::{AllocateError, AllocateOptions, VOLUME_MOUNTS_DIR, host_path};
use super::devnodes::{ExtraNodes, imex_channel_path};
use crate::api::{ContainerAllocateResponse, DeviceSpec, Mount};
use crate::config::{DeviceListStrategy, DevicePluginConfig};

/// Env of the GDRCopy injection (`NVIDIA_GDRCOPY=enabled`).
pub const GDRCOPY_ENV: &str = "NVIDIA_GDRCOPY";
/// Env of the GPUDirect Storage injection.
pub const GDS_ENV: &str = "NVIDIA_GDS";
/// Env of the MOFED injection.
pub const MOFED_ENV: &str = "NVIDIA_MOFED";
/// The value of the three envs above.
pub const ENABLED: &str = "enabled";
/// Env listing the IMEX channels (`spec.ImexChannelEnvVar`).
pub const IMEX_CHANNELS_ENV: &str = "NVIDIA_IMEX_CHANNELS";
/// CDI class of the IMEX channels.
pub const IMEX_CLASS: &str = "imex-channel";
/// CDI classes of the flag injections, in the order NVIDIA hands them out.
pub const FLAG_CLASSES: [&str; 3] = ["gdrcopy", "gds", "mofed"];
/// The CDI device of a flag class.
pub const ALL_DEVICE: &str = "all";

/// What is enabled (the `[device_plugin]` keys `gds_enabled`, `mofed_enabled`,
/// `gdrcopy_enabled` and `[device_plugin.imex]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Injections {
    pub gds: bool,
    pub mofed: bool,
    pub gdrcopy: bool,
    /// `[]` or `[0]` (validated by the config).
    pub imex_channel_ids: Vec<u32>,
    pub imex_required: bool,
}

impl Injections {
    /// What the `[device_plugin]` keys enable.
    pub fn from_config(dp: &DevicePluginConfig) -> Injections {
        Injections {
            gds: dp.gds_enabled,
            mofed: dp.mofed_enabled,
            gdrcopy: dp.gdrcopy_enabled,
            imex_channel_ids: dp.imex.channel_ids.clone(),
            imex_required: dp.imex.required,
        }
    }

    /// Whether the flag of a class of [`FLAG_CLASSES`] is on.
    pub fn flag(&self, class: &str) -> bool {
        match class {
            "gdrcopy" => self.gdrcopy,
            "gds" => self.gds,
            "mofed" => self.mofed,
            _ => false,
        }
    }

    /// The configured IMEX channels whose node exists (`nodes.imex_channels`), in config order.
    /// With `imex_required`, the first missing one is `Err(<host path of its node>)`.
    pub fn imex_channels(&self, nodes: &ExtraNodes, dev_root: &Path) -> Result<Vec<u32>, String> {
        let mut channels = Vec::new();
        for &id in &self.imex_channel_ids {
            if nodes.imex_channels.contains(&id) {
                channels.push(id);
            } else if self.imex_required {
                return Err(host_path(dev_root, &imex_channel_path(id)));
            }
        }
        Ok(channels)
    }
}

/// The flag nodes a class of [`FLAG_CLASSES`] stands for.
pub fn class_nodes<'a>(nodes: &'a ExtraNodes, class: &str) -> &'a [String] {
    match class {
        "gdrcopy" => &nodes.gdrcopy,
        "gds" => &nodes.gds,
        "mofed" => &nodes.mofed,
        _ => &[],
    }
}

/// The injections of one response, decided from the options and the host's nodes.
#[derive(Debug, Clone)]
pub struct Injected<'a> {
    opts: &'a AllocateOptions,
    nodes: &'a ExtraNodes,
    /// IMEX channels handed out.
    pub channels: Vec<u32>,
}

impl<'a> Injected<'a> {
    /// Decides the IMEX channels; a required one missing is
    /// [`AllocateError::ImexChannelMissing`].
    pub fn new(opts: &'a AllocateOptions, nodes: &'a ExtraNodes) -> Result<Self, AllocateError> {
        let channels = opts
            .injections
            .imex_channels(nodes, &opts.dev_root)
            .map_err(|path| AllocateError::ImexChannelMissing { path })?;
        Ok(Injected { opts, nodes, channels })
    }

    /// The CDI names to hand out after the GPUs' (see the module docs). The vendor is
    /// `cdi_kind`'s.
    pub fn cdi_names(&self) -> Vec<String> {
        let kind = &self.opts.cdi_kind;
        let vendor = kind.split_once('/').map_or(kind.as_str(), |(vendor, _)| vendor);
        let mut names: Vec<String> = self
            .channels
            .iter()
            .map(|id| format!("{vendor}/{IMEX_CLASS}={id}"))
            .collect();
        for class in FLAG_CLASSES {
            if self.opts.injections.flag(class) && !class_nodes(self.nodes, class).is_empty() {
                names.push(format!("{vendor}/{class}={ALL_DEVICE}"));
            }
        }
        names
    }

    /// Adds the envs, mounts and device specs (see the module docs) to `resp`.
    pub fn apply(&self, resp: &mut ContainerAllocateResponse, strategies: &[DeviceListStrategy]) {
        let inj = &self.opts.injections;
        for (on, env) in [(inj.gdrcopy, GDRCOPY_ENV), (inj.gds, GDS_ENV), (inj.mofed, MOFED_ENV)] {
            if on {
                resp.envs.insert(env.to_string(), ENABLED.to_string());
            }
        }
        if strategies.iter().all(|s| s.is_cdi()) {
            return;
        }
        let has = |s: DeviceListStrategy| strategies.contains(&s);
        let host_mounts = has(DeviceListStrategy::HostMounts);
        if !self.channels.is_empty()
            && (has(DeviceListStrategy::Envvar) || has(DeviceListStrategy::Auto) || host_mounts)
        {
            let ids: Vec<String> = self.channels.iter().map(u32::to_string).collect();
            resp.envs.insert(IMEX_CHANNELS_ENV.to_string(), ids.join(","));
        }
        if has(DeviceListStrategy::VolumeMounts) {
            resp.mounts.extend(self.channels.iter().map(|id| Mount {
                container_path: format!("{VOLUME_MOUNTS_DIR}/imex/{id}"),
                host_path: "/dev/null".to_string(),
                read_only: false,
            }));
        }
        let mut paths: Vec<String> = Vec::new();
        if self.opts.pass_device_specs || host_mounts {
            paths.extend(self.channels.iter().map(|id| imex_channel_path(*id)));
        }
        if host_mounts {
            for class in FLAG_CLASSES {
                if inj.flag(class) {
                    paths.extend(class_nodes(self.nodes, class).iter().cloned());
                }
            }
        }
        for path in paths {
            if resp.devices.iter().any(|d| d.container_path == path) {
                continue;
            }
            resp.devices.push(DeviceSpec {
                host_path: host_path(&self.opts.dev_root, &path),
                container_path: path,
                permissions: "rw".to_string(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ContainerAllocateRequest;
    use crate::plugin::allocate::{VISIBLE_DEVICES_ENV, allocate, sorted_envs};
    use crate::plugin::devnodes::DeviceNodes;
    use crate::devices::{Health, PluginDevice, Resource};
    use DeviceListStrategy::*;

    const G0: &str = "GPU-00000000-0000-0000-0000-000000000000";

    fn gpus() -> Resource {
        let device = PluginDevice {
            uuid: G0.into(),
            index: "0".into(),
            minor: 0,
            numa_node: None,
            mig: None,
            health: Health::Healthy,
        };
        Resource {
            name: "nvidia.com/gpu".into(),
            devices: [(G0.into(), device)].into(),
        }
    }

    /// A host with every injection's nodes (two nvidia-fs, one uverbs, rdma_cm, gdrdrv,
    /// channel 0).
    fn nodes() -> DeviceNodes {
        DeviceNodes {
            control: vec!["/dev/nvidiactl".into()],
            extra: ExtraNodes {
                gds: vec!["/dev/nvidia-fs0".into(), "/dev/nvidia-fs1".into()],
                mofed: vec!["/dev/infiniband/rdma_cm".into(), "/dev/infiniband/uverbs0".into()],
                gdrcopy: vec!["/dev/gdrdrv".into()],
                imex_channels: [0].into(),
            },
            ..DeviceNodes::default()
        }
    }

    fn all_on() -> Injections {
        Injections {
            gds: true,
            mofed: true,
            gdrcopy: true,
            imex_channel_ids: vec![0],
            imex_required: false,
        }
    }

    fn opts(strategies: &[DeviceListStrategy], injections: Injections) -> AllocateOptions {
        AllocateOptions {
            strategies: strategies.to_vec(),
            injections,
            ..AllocateOptions::default()
        }
    }

    fn run(o: &AllocateOptions, n: &DeviceNodes) -> ContainerAllocateResponse {
        let req = ContainerAllocateRequest {
            devices_ids: vec![G0.into()],
        };
        allocate(&gpus(), &req, o, n).unwrap()
    }

    fn cdi_names(r: &ContainerAllocateResponse) -> Vec<&str> {
        r.cdi_devices.iter().map(|d| d.name.as_str()).collect()
    }

    #[test]
    fn off_by_default_adds_nothing() {
        for strategies in [&[Envvar][..], &[VolumeMounts], &[CdiCri, CdiAnnotations], &[HostMounts]] {
            let with = run(&opts(strategies, Injections::default()), &nodes());
            let without = run(&opts(strategies, Injections::default()), &DeviceNodes::default());
            assert_eq!(with.envs, without.envs, "{strategies:?}");
            assert_eq!(with.mounts, without.mounts);
            assert_eq!(with.cdi_devices, without.cdi_devices);
            assert_eq!(
                with.annotations.values().collect::<Vec<_>>(),
                without.annotations.values().collect::<Vec<_>>()
            );
            assert!(with.devices.iter().all(|d| d.container_path.starts_with("/dev/nvidia")));
        }
    }

    #[test]
    fn envvar_gets_the_flag_envs_and_imex_channels() {
        let r = run(&opts(&[Envvar], all_on()), &nodes());
        assert_eq!(
            sorted_envs(&r),
            [
                (GDRCOPY_ENV, "enabled"),
                (GDS_ENV, "enabled"),
                (IMEX_CHANNELS_ENV, "0"),
                (MOFED_ENV, "enabled"),
                (VISIBLE_DEVICES_ENV, G0),
            ]
        );
        assert!(r.mounts.is_empty() && r.devices.is_empty() && r.cdi_devices.is_empty());

        // One flag alone.
        let gds = Injections {
            gds: true,
            ..Injections::default()
        };
        let r = run(&opts(&[Envvar], gds), &nodes());
        assert_eq!(sorted_envs(&r), [(GDS_ENV, "enabled"), (VISIBLE_DEVICES_ENV, G0)]);
    }

    #[test]
    fn volume_mounts_get_an_imex_mount_but_no_imex_env() {
        let r = run(&opts(&[VolumeMounts], all_on()), &nodes());
        let paths: Vec<_> = r.mounts.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                format!("/var/run/nvidia-container-devices/{G0}").as_str(),
                "/var/run/nvidia-container-devices/imex/0"
            ]
        );
        assert_eq!(r.mounts[1].host_path, "/dev/null");
        assert!(!r.envs.contains_key(IMEX_CHANNELS_ENV));
        assert_eq!(r.envs[GDS_ENV], "enabled");
    }

    #[test]
    fn pass_device_specs_add_the_imex_channel_only() {
        let o = AllocateOptions {
            pass_device_specs: true,
            dev_root: "/run/nvidia/driver".into(),
            ..opts(&[Envvar], all_on())
        };
        let r = run(&o, &nodes());
        let specs: Vec<_> = r
            .devices
            .iter()
            .map(|d| (d.container_path.as_str(), d.host_path.as_str(), d.permissions.as_str()))
            .collect();
        assert_eq!(
            specs,
            [
                ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl", "rw"),
                ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0", "rw"),
                (
                    "/dev/nvidia-caps-imex-channels/channel0",
                    "/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0",
                    "rw"
                ),
            ]
        );
    }

    #[test]
    fn cdi_cri_names_follow_the_gpus_in_nvidias_order() {
        let r = run(&opts(&[CdiCri], all_on()), &nodes());
        assert_eq!(
            cdi_names(&r),
            [
                format!("k8s.device-plugin.nvidia.com/gpu={G0}").as_str(),
                "k8s.device-plugin.nvidia.com/imex-channel=0",
                "k8s.device-plugin.nvidia.com/gdrcopy=all",
                "k8s.device-plugin.nvidia.com/gds=all",
                "k8s.device-plugin.nvidia.com/mofed=all",
            ]
        );
        // All-CDI: the flag envs still go in (NVIDIA sets them before its all-CDI return), the
        // IMEX env, mounts and specs do not.
        assert_eq!(
            sorted_envs(&r),
            [(GDRCOPY_ENV, "enabled"), (GDS_ENV, "enabled"), (MOFED_ENV, "enabled")]
        );
        assert!(r.mounts.is_empty() && r.devices.is_empty());

        // The vendor follows cdi_kind.
        let o = AllocateOptions {
            cdi_kind: "example.com/gpu".into(),
            ..opts(&[CdiCri], all_on())
        };
        let r = run(&o, &nodes());
        assert_eq!(cdi_names(&r)[4], "example.com/mofed=all");
    }

    #[test]
    fn cdi_annotations_carry_the_same_names() {
        let r = run(&opts(&[CdiAnnotations], all_on()), &nodes());
        let value = r.annotations.values().next().unwrap();
        assert_eq!(
            value,
            &format!(
                "k8s.device-plugin.nvidia.com/gpu={G0},k8s.device-plugin.nvidia.com/imex-channel=0,\
                 k8s.device-plugin.nvidia.com/gdrcopy=all,k8s.device-plugin.nvidia.com/gds=all,\
                 k8s.device-plugin.nvidia.com/mofed=all"
            )
        );
    }

    #[test]
    fn a_class_without_nodes_is_not_handed_out_by_name() {
        let mut n = nodes();
        n.extra.gds.clear();
        n.extra.imex_channels.clear();
        let r = run(&opts(&[CdiCri, Envvar], all_on()), &n);
        assert_eq!(
            cdi_names(&r),
            [
                format!("k8s.device-plugin.nvidia.com/gpu={G0}").as_str(),
                "k8s.device-plugin.nvidia.com/gdrcopy=all",
                "k8s.device-plugin.nvidia.com/mofed=all",
            ]
        );
        // The env is NVIDIA's answer whatever the host has; the missing channel is left out.
        assert_eq!(r.envs[GDS_ENV], "enabled");
        assert!(!r.envs.contains_key(IMEX_CHANNELS_ENV));
    }

    #[test]
    fn a_required_missing_channel_fails_naming_its_path() {
        let mut n = nodes();
        n.extra.imex_channels.clear();
        let inj = Injections {
            imex_channel_ids: vec![0],
            imex_required: true,
            ..Injections::default()
        };
        let o = AllocateOptions {
            dev_root: "/run/nvidia/driver".into(),
            ..opts(&[Envvar], inj)
        };
        let req = ContainerAllocateRequest {
            devices_ids: vec![G0.into()],
        };
        let err = allocate(&gpus(), &req, &o, &n).unwrap_err();
        assert_eq!(
            err.to_string(),
            "IMEX channel /run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0 does not exist \
             and [device_plugin.imex] required = true"
        );
        // Present: fine.
        assert!(allocate(&gpus(), &req, &o, &nodes()).is_ok());
    }

    #[test]
    fn host_mounts_pass_every_injected_node_as_a_device_spec() {
        let r = run(&opts(&[HostMounts], all_on()), &nodes());
        let specs: Vec<_> = r.devices.iter().map(|d| d.container_path.as_str()).collect();
        assert_eq!(
            specs,
            [
                "/dev/nvidiactl",
                "/dev/nvidia0",
                "/dev/nvidia-caps-imex-channels/channel0",
                "/dev/gdrdrv",
                "/dev/nvidia-fs0",
                "/dev/nvidia-fs1",
                "/dev/infiniband/rdma_cm",
                "/dev/infiniband/uverbs0",
            ]
        );
        assert_eq!(r.envs[IMEX_CHANNELS_ENV], "0");
        assert_eq!(r.envs[GDRCOPY_ENV], "enabled");
    }
}
