//! The model itself: which nodes a device gets, the node's devices in order, the injections, and
//! the rule every hook keeps (an explicit env). That the three renderers hand out the same edits
//! is tested where all three are visible, in `tests/container_edits.rs`.

use std::collections::BTreeMap;
use std::path::Path;

use super::injections::{GDRCOPY_ENV, GDS_ENV, ImexChannelMissing, MOFED_ENV};
use super::*;
use crate::nvml::sample;

/// A host with the control nodes, the MIG minors of GPU 1's instances 1 and 2 and every
/// injection's nodes.
fn host() -> DeviceNodes {
    DeviceNodes {
        control: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
        mig_minors: [
            ("gpu1/gi1/access".into(), 12),
            ("gpu1/gi1/ci0/access".into(), 13),
            ("gpu1/gi2/access".into(), 21),
            ("gpu1/gi2/ci0/access".into(), 22),
        ]
        .into(),
        extra: ExtraNodes {
            gds: vec!["/dev/nvidia-fs0".into()],
            mofed: vec![],
            gdrcopy: vec!["/dev/gdrdrv".into()],
            imex_channels: [0].into(),
        },
    }
}

/// GPU 0 whole, GPU 1 with two MIG devices (listed out of order).
fn inventory() -> Inventory {
    let mut g1 = sample::a100(1);
    g1.mig = Some(sample::mig(true));
    g1.mig_devices = sample::mig_devices(1, &["3g.20gb", "3g.20gb"]);
    g1.mig_devices.reverse();
    sample::inventory(vec![g1, sample::a100(0)])
}

fn paths(nodes: &[DeviceNode]) -> Vec<&str> {
    nodes.iter().map(|n| n.path.as_str()).collect()
}

#[test]
fn a_device_gets_its_node_and_a_mig_device_its_capabilities() {
    let inv = inventory();
    let gpu = whole_gpu(&inv.gpus[0]);
    let found = device_nodes(&gpu, &host(), Path::new("/")).expect("gpu");
    assert_eq!(paths(&found), ["/dev/nvidia1"]);
    assert_eq!(found[0].host_path, Path::new("/dev/nvidia1"));

    let mig: Vec<PluginDevice> = mig_plugin_devices(&inv.gpus[0]).collect();
    assert_eq!(mig[0].index, "1:1");
    let found = device_nodes(&mig[0], &host(), Path::new("/run/nvidia/driver")).expect("mig");
    assert_eq!(
        paths(&found),
        [
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia-caps/nvidia-cap22"
        ]
    );
    assert_eq!(
        found[2].host_path,
        Path::new("/run/nvidia/driver/dev/nvidia-caps/nvidia-cap22")
    );

    let mut lacking = host();
    lacking.mig_minors.remove("gpu1/gi2/ci0/access");
    assert_eq!(
        device_nodes(&mig[0], &lacking, Path::new("/")),
        Err(MissingMigCapability {
            key: "gpu1/gi2/ci0/access".into(),
            device: "MIG-1-1".into()
        })
    );
}

#[test]
fn the_nodes_devices_are_the_gpus_by_index_then_their_mig_devices_by_mig_index() {
    let dri: BTreeMap<String, Vec<String>> = [(
        crate::nvml::normalise_bus_id(&sample::a100(0).pci_bus_id),
        vec!["/dev/dri/card1".to_string()],
    )]
    .into();
    let devices = node_devices(&inventory(), &host(), Path::new("/"), &dri).expect("devices");
    let names: Vec<(&str, &str)> = devices
        .iter()
        .map(|d| (d.device.index.as_str(), d.device.uuid.as_str()))
        .collect();
    assert_eq!(
        names,
        [("0", "GPU-0"), ("1", "GPU-1"), ("1:0", "MIG-1-0"), ("1:1", "MIG-1-1")]
    );
    assert_eq!(
        paths(&devices[0].edits.device_nodes),
        ["/dev/nvidia0", "/dev/dri/card1"]
    );
    assert_eq!(
        paths(&devices[2].edits.device_nodes),
        [
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap12",
            "/dev/nvidia-caps/nvidia-cap13"
        ]
    );
    let node = NodeEdits {
        common: ContainerEdits::default(),
        devices,
    };
    assert_eq!(node.device("MIG-1-1").map(|d| d.device.index.as_str()), Some("1:1"));
    assert!(node.device("0").is_none(), "devices are found by UUID, not by index");
}

#[test]
fn control_nodes_follow_the_host_under_the_dev_root() {
    let found = control_nodes(&host(), Path::new("/host"));
    assert_eq!(paths(&found), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    assert_eq!(found[1].host_path, Path::new("/host/dev/nvidia-uvm"));
}

/// A runtime starts a hook without `env` with the container's environment: an image's
/// `LD_PRELOAD` would run in it as host root. No hook of the model is without one.
#[test]
fn every_hook_has_an_explicit_env() {
    let hook = Hook::new("/usr/bin/gpu-node-agent-cdi-hook".into(), vec!["x".into()]);
    assert!(!hook.env().is_empty());
    assert_eq!(hook.env(), cdi_hook::HOOK_ENV.map(String::from));
    assert!(hook.env().iter().all(|e| !e.starts_with("LD_")));
    assert_eq!(hook.args(), ["x"]);
}

#[test]
fn mounts_are_read_only_when_ro_is_among_their_options() {
    let mount = |options: &[&str]| Mount {
        host_path: "/a".into(),
        container_path: "/b".into(),
        options: options.iter().map(|o| o.to_string()).collect(),
    };
    assert!(mount(&["ro", "nosuid"]).read_only());
    assert!(!mount(&["nosuid", "rbind"]).read_only());
    assert!(!mount(&[]).read_only());
}

#[test]
fn injections_are_decided_once_from_the_config_and_the_host() {
    let all = Injections {
        gds: true,
        mofed: true,
        gdrcopy: true,
        imex_channel_ids: vec![0],
        imex_required: false,
    };
    let got = all
        .edits(&host().extra, Path::new("/run/nvidia/driver"))
        .expect("edits");
    let flags: Vec<(&str, &str, Vec<&str>)> = got
        .flags
        .iter()
        .map(|f| (f.class, f.env, paths(&f.device_nodes)))
        .collect();
    assert_eq!(
        flags,
        [
            ("gdrcopy", GDRCOPY_ENV, vec!["/dev/gdrdrv"]),
            ("gds", GDS_ENV, vec!["/dev/nvidia-fs0"]),
            ("mofed", MOFED_ENV, vec![]),
        ]
    );
    let present: Vec<&str> = got.present_flags().map(|f| f.class).collect();
    assert_eq!(present, ["gdrcopy", "gds"], "a class without nodes is not handed out");
    assert_eq!(got.imex_channels.len(), 1);
    assert_eq!(
        got.imex_channels[0].1.host_path,
        Path::new("/run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0")
    );

    assert_eq!(
        Injections::default().edits(&host().extra, Path::new("/")),
        Ok(InjectionEdits::default())
    );

    let required = Injections {
        imex_channel_ids: vec![3],
        imex_required: true,
        ..Injections::default()
    };
    assert_eq!(
        required.edits(&host().extra, Path::new("/")),
        Err(ImexChannelMissing {
            path: "/dev/nvidia-caps-imex-channels/channel3".into()
        })
    );
}
