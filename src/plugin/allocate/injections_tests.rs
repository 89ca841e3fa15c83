//! The injections (GDS, MOFED, GDRCopy, IMEX channels) as the Allocate response renders them.

use super::*;
use crate::devices::Health;
use crate::edits::ExtraNodes;
use crate::edits::injections::{GDRCOPY_ENV, GDS_ENV, MOFED_ENV};
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
