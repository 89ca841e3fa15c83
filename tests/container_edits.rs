//! One set of container edits, rendered three ways: the device plugin's Allocate response, the
//! node's CDI spec and a DRA claim's spec with the prepare answer's CDI IDs. The point of the
//! edits model (`gpu_node_agent::edits`, issue #35): a device gets the same nodes whichever API
//! hands it out, and every hook keeps its explicit `env` in every spec. Here, outside the crate,
//! because no module of it may import all three renderers (`dra` imports nothing from `plugin`).

use std::collections::BTreeMap;
use std::path::Path;

use gpu_node_agent::api::ContainerAllocateRequest;
use gpu_node_agent::config::DeviceListStrategy;
use gpu_node_agent::devices::Resource;
use gpu_node_agent::dra::claims::claim_kind;
use gpu_node_agent::edits::{
    self, ContainerEdits, DeviceNode, DeviceNodes, ExtraNodes, Hook, Mount, NodeEdits, mig_plugin_devices, whole_gpu,
};
use gpu_node_agent::nvml::{GpuInfo, Inventory, MigDeviceInfo, MigState};
use gpu_node_agent::plugin::allocate::{AllocateOptions, allocate};
use gpu_node_agent::runtime::cdi;

const KIND: &str = "k8s.device-plugin.nvidia.com/gpu";
const DEV_ROOT: &str = "/run/nvidia/driver";

/// An A100 at `index` (minor `index`), MIG on with one `3g.20gb` device in GPU instance 1 when
/// `mig`.
fn a100(index: u32, mig: bool) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: "NVIDIA A100-SXM4-40GB".into(),
        memory_mib: 40960,
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + index),
        pci_device_id: 0x20b0,
        minor: index,
        numa_node: None,
        compute_capability: Some((8, 0)),
        mig: Some(MigState {
            current: mig,
            pending: mig,
        }),
        mig_devices: if mig {
            vec![MigDeviceInfo {
                index: 0,
                uuid: format!("MIG-{index}-0"),
                gi_id: 1,
                ci_id: 0,
                profile: "3g.20gb".into(),
                memory_mib: 19968,
                attributes: None,
                placement: None,
            }]
        } else {
            Vec::new()
        },
        fabric: None,
        pci_class: Some(0x030200),
    }
}

fn inventory() -> Inventory {
    Inventory {
        driver_version: "550.54.15".into(),
        cuda_driver_version: "12.4".into(),
        gpus: vec![a100(0, false), a100(1, true)],
    }
}

fn host() -> DeviceNodes {
    DeviceNodes {
        control: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
        mig_minors: [("gpu1/gi1/access".into(), 12), ("gpu1/gi1/ci0/access".into(), 13)].into(),
        extra: ExtraNodes::default(),
    }
}

/// The node's edits: the model's devices, and common edits with a driver mount, an env and a
/// hook.
fn node() -> NodeEdits {
    let dev_root = Path::new(DEV_ROOT);
    let devices = edits::node_devices(&inventory(), &host(), dev_root, &BTreeMap::new()).expect("devices");
    NodeEdits {
        common: ContainerEdits {
            env: vec![("NVIDIA_VISIBLE_DEVICES".into(), "void".into())],
            device_nodes: edits::control_nodes(&host(), dev_root),
            mounts: vec![Mount {
                host_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into(),
                container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into(),
                options: cdi::MOUNT_OPTIONS.map(String::from).to_vec(),
            }],
            hooks: vec![Hook::new(
                "/usr/bin/gpu-node-agent-cdi-hook".into(),
                vec!["gpu-node-agent-cdi-hook".into(), "update-ldcache".into()],
            )],
        },
        devices,
    }
}

/// `(container path, host path)` of the model's nodes.
fn model_nodes(nodes: &[DeviceNode]) -> Vec<(String, String)> {
    nodes
        .iter()
        .map(|n| (n.path.clone(), n.host_path.to_string_lossy().into_owned()))
        .collect()
}

/// `(container path, host path)` of a CDI spec's nodes (the path when it has no `hostPath`).
fn cdi_nodes(nodes: &[cdi::DeviceNode]) -> Vec<(String, String)> {
    nodes
        .iter()
        .map(|n| (n.path.clone(), n.host_path.clone().unwrap_or_else(|| n.path.clone())))
        .collect()
}

#[test]
fn one_set_of_edits_renders_the_same_nodes_mounts_env_and_hooks_three_ways() {
    let node = node();
    let mig = mig_plugin_devices(&inventory().gpus[1]).next().expect("a MIG device");
    let gpu = whole_gpu(&inventory().gpus[0]);

    // The model: the MIG device's own nodes, after the control nodes every container gets.
    let mut want = model_nodes(&node.common.device_nodes);
    want.extend(model_nodes(
        &node.device(&mig.uuid).expect("in the model").edits.device_nodes,
    ));
    assert_eq!(want.len(), 5, "{want:?}");

    // 1. Allocate, with device specs and CDI names.
    let resource = Resource {
        name: "nvidia.com/mig-3g.20gb".into(),
        devices: [(mig.uuid.clone(), mig.clone())].into(),
    };
    let opts = AllocateOptions {
        strategies: vec![DeviceListStrategy::Envvar, DeviceListStrategy::CdiCri],
        pass_device_specs: true,
        dev_root: DEV_ROOT.into(),
        cdi_kind: KIND.into(),
        ..AllocateOptions::default()
    };
    let request = ContainerAllocateRequest {
        devices_ids: vec![mig.uuid.clone()],
    };
    let resp = allocate(&resource, &request, &opts, &host()).expect("allocate");
    let specs: Vec<(String, String)> = resp
        .devices
        .iter()
        .map(|d| (d.container_path.clone(), d.host_path.clone()))
        .collect();
    assert_eq!(specs, want, "Allocate's device specs are the model's nodes");
    assert_eq!(resp.cdi_devices[0].name, format!("{KIND}={}", mig.uuid));

    // 2. The node's CDI spec: the name Allocate handed out resolves to the same nodes, and the
    //    common edits are the model's (env, mount, hook with its env).
    let spec = cdi::render_node(&node, KIND).expect("node spec");
    let named = spec.devices.iter().find(|d| d.name == mig.uuid).expect("named by UUID");
    let mut got = cdi_nodes(&spec.container_edits.device_nodes);
    got.extend(cdi_nodes(&named.container_edits.device_nodes));
    assert_eq!(got, want, "the CDI spec's nodes are the model's");
    assert!(spec.devices.iter().any(|d| d.name == mig.index));
    let common = &spec.container_edits;
    assert_eq!(common.env, ["NVIDIA_VISIBLE_DEVICES=void"]);
    assert_eq!(
        common.mounts[0].host_path,
        node.common.mounts[0].host_path.to_string_lossy()
    );
    assert_eq!(common.hooks.len(), 1);
    assert_eq!(common.hooks[0].env, node.common.hooks[0].env());
    assert!(common.hooks.iter().all(|h| !h.env.is_empty()), "every hook has its env");

    // 3. A DRA claim's spec and the prepare answer's CDI IDs: exactly the claim's devices with
    //    the same nodes, and the node spec's common edits, hooks and their env included.
    let driver = "gpu.nvidia.com";
    let (claim, ids) = cdi::claim_spec(
        &node,
        KIND,
        &claim_kind(driver),
        "uid-1",
        &[("mig-1-0", &mig.uuid), ("gpu-0", &gpu.uuid)],
    )
    .expect("claim spec");
    assert_eq!(
        ids,
        [
            "k8s.gpu.nvidia.com/claim=uid-1-mig-1-0",
            "k8s.gpu.nvidia.com/claim=uid-1-gpu-0"
        ]
    );
    assert_eq!(claim.kind, "k8s.gpu.nvidia.com/claim");
    assert_eq!(
        claim.container_edits, spec.container_edits,
        "the claim keeps the node's common edits"
    );
    let mut got = cdi_nodes(&claim.container_edits.device_nodes);
    got.extend(cdi_nodes(&claim.devices[0].container_edits.device_nodes));
    assert_eq!(got, want, "the claim spec's nodes are the model's");
    let gpu_nodes = cdi_nodes(&claim.devices[1].container_edits.device_nodes);
    assert_eq!(
        gpu_nodes,
        [(String::from("/dev/nvidia0"), format!("{DEV_ROOT}/dev/nvidia0"))]
    );
    assert!(claim.container_edits.hooks.iter().all(|h| !h.env.is_empty()));

    // A device the node's edits lack is refused, naming the node's spec.
    let err =
        cdi::claim_spec(&node, KIND, &claim_kind(driver), "uid-1", &[("gpu-9", "GPU-9")]).expect_err("not on the node");
    assert!(err.contains("GPU-9") && err.contains(KIND), "{err}");
}
