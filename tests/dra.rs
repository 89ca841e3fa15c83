//! The agent as the node's DRA driver, end to end on a simulated node: it registers with the
//! (stand-in) kubelet's plugin watcher, publishes ResourceSlices to the (stand-in) API server
//! for 8 A100s, one of them with a MIG layout, prepares a claim the scheduler allocated to a
//! MIG device (a CDI spec naming exactly that device and its capability nodes), unprepares it,
//! prepares it again after an agent restart without duplication, keeps the device plugin and
//! DRA from handing out one GPU twice, and drops an unhealthy GPU from its slice.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use gpu_node_agent::status::StageId;
use serde_json::{Value, json};
use test_kubelet::dra::{ClaimRef, DraKubelet, DraOptions};

const T: Duration = Duration::from_secs(30);
const DRIVER: &str = "gpu.nvidia.com";
const MIG_1G: &str = "nvidia.com/mig-1g.5gb";
const GPU: &str = "nvidia.com/gpu";

/// 8 A100-SXM4-40GB; GPU 7 in MIG mode with a 3g.20gb at slices 4-7 and two 1g.5gb at 0 and 1.
fn machine_8_a100_with_mig() -> String {
    let mut m = DGX_A100.to_string();
    for i in 0..8u32 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nnuma_node = {}\n",
            gpu_uuid(i),
            i / 4
        ));
        if i == 7 {
            m.push_str(
                "mig_mode = true\n[[gpu.mig_device]]\nprofile = \"3g.20gb\"\nplacement = 4\n\
                 [[gpu.mig_device]]\nprofile = \"1g.5gb\"\nplacement = 0\n\
                 [[gpu.mig_device]]\nprofile = \"1g.5gb\"\nplacement = 1\n",
            );
        }
    }
    m
}

const CONFIG: &str = "[dra]\nenabled = true\n\n[device_plugin]\nmig_strategy = \"mixed\"\n";

async fn dra_kubelet(node: &Node) -> DraKubelet {
    let opts = DraOptions {
        host_root: Some(node.root.clone()),
        ..DraOptions::default()
    };
    DraKubelet::start(&node.root.join("var/lib/kubelet/plugins_registry"), opts)
        .await
        .expect("start the DRA side of the test kubelet")
}

/// The devices in the node's slices, by name.
fn published(api: &test_apiserver::TestApiServer) -> Vec<Value> {
    let mut devices: Vec<Value> = api
        .resource_slices()
        .values()
        .filter(|s| s["spec"]["nodeName"] == NODE_NAME && s["spec"]["driver"] == DRIVER)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect();
    devices.sort_by_key(|d| d["name"].as_str().unwrap_or("").to_string());
    devices
}

fn names(devices: &[Value]) -> Vec<String> {
    devices
        .iter()
        .filter_map(|d| d["name"].as_str().map(str::to_string))
        .collect()
}

/// A claim as the scheduler leaves it: allocated to `device` of this node's pool.
fn allocated_claim(name: &str, uid: &str, device: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com"}}]}},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "mig", "driver": DRIVER, "pool": NODE_NAME, "device": device}
            ]}},
            "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "0a1b2c3d-0000-4000-8000-00000000beef"}]
        }
    })
}

fn claim_spec_path(node: &Node, uid: &str) -> PathBuf {
    node.root
        .join(format!("var/run/cdi/k8s.gpu.nvidia.com-claim_{uid}.json"))
}

fn claim_specs(node: &Node) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(node.root.join("var/run/cdi"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("k8s.gpu.nvidia.com-claim_"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The MIG device of GPU 7 at placement `start`, as `nvidia-smi -L` would show it: its UUID
/// from the device plugin's list of `resource`.
fn mig_uuids(kubelet: &test_kubelet::TestKubelet, resource: &str) -> Vec<String> {
    kubelet
        .devices(resource)
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_claim_is_prepared_unprepared_and_prepared_again_after_a_restart() {
    let node = Node::new(&machine_8_a100_with_mig(), CONFIG);
    let (api, kubelet) = api_server_and_kubelet(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();

    // Registration: type DRAPlugin under the driver's name, the v1 service chosen, the
    // endpoint in the kubelet's plugin directory.
    let reg = dra
        .wait_for_plugin(DRIVER, T)
        .await
        .expect("the agent registers as a DRA plugin");
    assert_eq!(reg.service.as_deref(), Some("v1.DRAPlugin"));
    assert_eq!(
        reg.endpoint,
        PathBuf::from("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
    );

    // Slices: the 7 whole GPUs and the 3 MIG devices of GPU 7, in NVIDIA's names.
    assert!(
        api.wait_for(T, |a| published(a).len() == 10).await,
        "slices: {:?}",
        names(&published(&api))
    );
    let devices = published(&api);
    let mut want: Vec<String> = (0..7).map(|i| format!("gpu-{i}")).collect();
    want.extend(["gpu-7-mig-19-0-1", "gpu-7-mig-19-1-1", "gpu-7-mig-9-4-4"].map(String::from));
    want.sort();
    assert_eq!(names(&devices), want);
    let gpu0 = &devices[0];
    assert_eq!(gpu0["attributes"]["type"]["string"], "gpu");
    assert_eq!(gpu0["attributes"]["uuid"]["string"], gpu_uuid(0));
    assert_eq!(gpu0["attributes"]["productName"]["string"], "NVIDIA A100-SXM4-40GB");
    assert_eq!(gpu0["attributes"]["architecture"]["string"], "Ampere");
    assert_eq!(gpu0["attributes"]["cudaComputeCapability"]["version"], "8.0.0");
    assert_eq!(gpu0["attributes"]["driverVersion"]["version"], "550.54.15");
    assert_eq!(gpu0["attributes"]["cudaDriverVersion"]["version"], "12.4.0");
    assert_eq!(gpu0["capacity"]["memory"]["value"], "40960Mi");
    let mig = devices
        .iter()
        .find(|d| d["name"] == "gpu-7-mig-19-1-1")
        .expect("1g.5gb at slice 1");
    assert_eq!(mig["attributes"]["type"]["string"], "mig");
    assert_eq!(mig["attributes"]["profile"]["string"], "1g.5gb");
    assert_eq!(mig["attributes"]["parentUUID"]["string"], gpu_uuid(7));
    assert_eq!(mig["capacity"]["memorySlice1"]["value"], "1");
    assert!(
        mig["capacity"].get("memorySlice0").is_none(),
        "slice 0 is the other 1g.5gb's"
    );
    let mig_uuid = mig["attributes"]["uuid"]["string"]
        .as_str()
        .expect("MIG uuid")
        .to_string();
    for slice in api.resource_slices().values() {
        assert_eq!(slice["spec"]["pool"]["name"], NODE_NAME);
    }

    // The device plugin hands out the same MIG devices, under the mixed strategy.
    kubelet
        .wait_for_devices(MIG_1G, T, |d| d.len() == 2)
        .await
        .expect("the device plugin advertises both 1g.5gb");

    // Prepare a claim allocated to that MIG device.
    let uid = "6f1e0a52-1111-4c4c-9d9d-000000000001";
    api.create_resource_claim(allocated_claim("trainer-mig", uid, "gpu-7-mig-19-1-1"));
    let claim = ClaimRef::new("ml", "trainer-mig", uid);
    let answer = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare");
    let prepared = answer[uid].clone().expect("the claim is prepared");
    assert_eq!(prepared.len(), 1);
    assert_eq!(prepared[0].device_name, "gpu-7-mig-19-1-1");
    assert_eq!(prepared[0].pool_name, NODE_NAME);
    assert_eq!(prepared[0].request_names, ["mig"]);
    let cdi_id = format!("k8s.gpu.nvidia.com/claim={uid}-gpu-7-mig-19-1-1");
    assert_eq!(prepared[0].cdi_device_ids, std::slice::from_ref(&cdi_id));
    assert_eq!(test_kubelet::dra::cdi_devices_for(&prepared, "mig"), [cdi_id]);

    // Its CDI spec names exactly that device: GPU 7's node and its two capability nodes.
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(claim_spec_path(&node, uid)).expect("claim spec"))
        .expect("claim spec is JSON");
    assert_eq!(spec["kind"], "k8s.gpu.nvidia.com/claim");
    let spec_devices = spec["devices"].as_array().expect("devices");
    assert_eq!(spec_devices.len(), 1);
    assert_eq!(spec_devices[0]["name"], format!("{uid}-gpu-7-mig-19-1-1"));
    let nodes: Vec<&str> = spec_devices[0]["containerEdits"]["deviceNodes"]
        .as_array()
        .expect("device nodes")
        .iter()
        .filter_map(|n| n["path"].as_str())
        .collect();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    assert_eq!(nodes[0], "/dev/nvidia7");
    assert!(
        nodes[1..].iter().all(|n| n.starts_with("/dev/nvidia-caps/nvidia-cap")),
        "{nodes:?}"
    );
    assert_ne!(nodes[1], nodes[2]);
    assert!(
        spec["containerEdits"]["mounts"]
            .as_array()
            .is_some_and(|m| !m.is_empty()),
        "the driver's files come with the claim's spec"
    );

    // Status says so, in status.json and to a person.
    let status = node.wait_status(T, |s| s.dra.as_ref().is_some_and(|d| d.prepared == ["ml/trainer-mig"]));
    let driver = status.dra.as_ref().expect("the DRA driver in the status");
    assert!(driver.registered, "{driver:?}");
    assert_eq!(driver.published, 10);
    assert_eq!(driver.error, None);
    let text = String::from_utf8_lossy(&node.run(&["status"]).stdout).into_owned();
    assert!(
        text.contains("DRA driver gpu.nvidia.com: registered")
            && text.contains("10 device(s) published")
            && text.contains("claims: ml/trainer-mig"),
        "{text}"
    );

    // The device plugin no longer hands that MIG device out; the other 1g.5gb stays.
    let left = kubelet
        .wait_for_devices(MIG_1G, T, |d| d.len() == 1)
        .await
        .expect("the prepared MIG device leaves the device plugin's list");
    assert_ne!(left[0].id, mig_uuid);
    // Preparing again answers the same (the kubelet repeats prepares after its restarts).
    let again = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare again");
    assert_eq!(again[uid].clone().expect("prepared"), prepared);
    assert_eq!(claim_specs(&node).len(), 1);

    // Unprepare: the spec goes, the device returns to the device plugin.
    let un = dra
        .unprepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("unprepare");
    assert_eq!(un[uid], Ok(()));
    assert!(
        !claim_spec_path(&node, uid).exists(),
        "unprepare removes the claim's spec"
    );
    kubelet
        .wait_for_devices(MIG_1G, T, |d| d.len() == 2)
        .await
        .expect("the MIG device is back in the device plugin's list");
    // Unpreparing a claim the driver does not know is no error.
    let un = dra
        .unprepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("unprepare again");
    assert_eq!(un[uid], Ok(()));

    // Prepared again, then the agent restarts: the kubelet's repeated prepare gets the same
    // answer from the checkpoint, with one spec file, and the device stays withdrawn.
    let first = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare")[uid]
        .clone()
        .expect("prepared");
    assert_eq!(agent.stop(), 0);
    dra.wait_for_deregistration(DRIVER, T)
        .await
        .expect("the registration socket goes with the agent");
    let restarted = Instant::now();
    let agent = node.spawn();
    dra.wait_for_plugin_since(DRIVER, Some(restarted), T)
        .await
        .expect("the restarted agent registers again");
    let after = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare after restart")[uid]
        .clone()
        .expect("prepared after the restart");
    assert_eq!(after, first);
    assert_eq!(claim_specs(&node), [format!("k8s.gpu.nvidia.com-claim_{uid}.json")]);
    let checkpoint: Value = serde_json::from_str(
        &std::fs::read_to_string(node.root.join("var/lib/gpu-node-agent/dra/checkpoint.json")).expect("checkpoint"),
    )
    .expect("checkpoint is JSON");
    assert_eq!(checkpoint["claims"].as_object().map(|c| c.len()), Some(1));
    let listed = kubelet
        .wait_for_devices(MIG_1G, T, |d| d.len() == 1)
        .await
        .expect("after the restart the prepared device is still withdrawn");
    assert!(!mig_uuids(&kubelet, MIG_1G).contains(&mig_uuid), "{listed:?}");
    assert!(dra.violations().is_empty(), "{:?}", dra.violations());
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_two_apis_never_hand_out_one_gpu_and_a_sick_gpu_leaves_the_slice() {
    let node = Node::new(
        &machine("A100-SXM4-40GB", 4),
        "[dra]\nenabled = true\n\n[health]\nlost_check_interval = \"100ms\"\n",
    );
    let (api, kubelet) = api_server_and_kubelet(&node, &[]).await;
    kubelet
        .serve_pod_resources(&node.root.join("var/lib/kubelet"))
        .expect("pod-resources socket");
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    assert!(
        api.wait_for(T, |a| published(a).len() == 4).await,
        "{:?}",
        names(&published(&api))
    );

    // The device plugin hands GPU 1 to a pod: it leaves the slice, and a claim allocated to it
    // (a scheduler that raced) is refused, naming the pod.
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 4)
        .await
        .expect("advertised");
    kubelet.assign(
        GPU,
        &[&gpu_uuid(1)],
        &test_kubelet::PodContainer::new("default", "cuda-job", "main"),
    );
    assert!(
        api.wait_for(T, |a| !names(&published(a)).contains(&"gpu-1".to_string()))
            .await,
        "a GPU the device plugin handed out is withdrawn from the slice: {:?}",
        names(&published(&api))
    );
    let uid = "6f1e0a52-2222-4c4c-9d9d-000000000002";
    api.create_resource_claim(allocated_claim("racer", uid, "gpu-1"));
    let answer = dra
        .prepare(DRIVER, &[ClaimRef::new("ml", "racer", uid)])
        .await
        .expect("prepare");
    let err = answer[uid].clone().expect_err("GPU 1 is the device plugin's");
    assert!(
        err.contains("device plugin") && err.contains("default/cuda-job"),
        "{err}"
    );
    assert!(claim_specs(&node).is_empty());

    // A claim on GPU 2 is prepared; the device plugin withdraws GPU 2.
    let uid2 = "6f1e0a52-3333-4c4c-9d9d-000000000003";
    api.create_resource_claim(allocated_claim("trainer", uid2, "gpu-2"));
    let answer = dra
        .prepare(DRIVER, &[ClaimRef::new("ml", "trainer", uid2)])
        .await
        .expect("prepare");
    assert!(answer[uid2].is_ok(), "{answer:?}");
    let listed = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 3)
        .await
        .expect("GPU 2 leaves the device plugin");
    assert!(listed.iter().all(|d| d.id != gpu_uuid(2)));
    // A second claim on the same GPU is refused, naming the first.
    let uid3 = "6f1e0a52-4444-4c4c-9d9d-000000000004";
    api.create_resource_claim(allocated_claim("second", uid3, "gpu-2"));
    let answer = dra
        .prepare(DRIVER, &[ClaimRef::new("ml", "second", uid3)])
        .await
        .expect("prepare");
    let err = answer[uid3].clone().expect_err("GPU 2 is prepared for another claim");
    assert!(err.contains("ml/trainer"), "{err}");

    // A critical Xid on GPU 3: it leaves the slice (the wait is the publisher's reaction).
    let before = Instant::now();
    node.inject("xid", &format!("{} 79", gpu_uuid(3)));
    assert!(
        api.wait_for(T, |a| !names(&published(a)).contains(&"gpu-3".to_string()))
            .await,
        "an unhealthy GPU leaves the slice: {:?}",
        names(&published(&api))
    );
    eprintln!("gpu-3 left the slice {:?} after its Xid", before.elapsed());
    assert!(dra.violations().is_empty(), "{:?}", dra.violations());
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_kubelet_gets_the_v1beta1_service() {
    let node = Node::new(&machine("A100-SXM4-40GB", 1), "[dra]\nenabled = true\n");
    let api = api_server_for(&node, &[]).await;
    let opts = DraOptions {
        host_root: Some(node.root.clone()),
        services: vec!["v1beta1.DRAPlugin".into()],
        ..DraOptions::default()
    };
    let dra = DraKubelet::start(&node.root.join("var/lib/kubelet/plugins_registry"), opts)
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let reg = dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    assert_eq!(reg.service.as_deref(), Some("v1beta1.DRAPlugin"));
    assert!(api.wait_for(T, |a| published(a).len() == 1).await);
    let uid = "6f1e0a52-5555-4c4c-9d9d-000000000005";
    api.create_resource_claim(allocated_claim("old", uid, "gpu-0"));
    let claim = ClaimRef::new("ml", "old", uid);
    let answer = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare");
    let devices = answer[uid].clone().expect("prepared through v1beta1");
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("k8s.gpu.nvidia.com/claim={uid}-gpu-0")]
    );
    assert_eq!(dra.unprepare(DRIVER, &[claim]).await.expect("unprepare")[uid], Ok(()));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_node_cannot_serve_is_refused_with_its_reason() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[dra]\nenabled = true\n");
    let api = api_server_for(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    // A device of another node's pool, a device the node lacks, a claim replaced under its
    // name, a claim that does not exist.
    api.create_resource_claim(json!({
        "metadata": {"namespace": "ml", "name": "elsewhere", "uid": "u-elsewhere"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": "gpu-node-2", "device": "gpu-0"}]}}}
    }));
    api.create_resource_claim(allocated_claim("ghost", "u-ghost", "gpu-9"));
    api.create_resource_claim(allocated_claim("replaced", "u-new", "gpu-0"));
    let claims = [
        ClaimRef::new("ml", "elsewhere", "u-elsewhere"),
        ClaimRef::new("ml", "ghost", "u-ghost"),
        ClaimRef::new("ml", "replaced", "u-old"),
        ClaimRef::new("ml", "missing", "u-missing"),
    ];
    let answer = dra.prepare(DRIVER, &claims).await.expect("prepare");
    let err = |uid: &str| answer[uid].clone().expect_err(uid);
    assert!(
        err("u-elsewhere").contains("pool \"gpu-node-2\""),
        "{}",
        err("u-elsewhere")
    );
    assert!(
        err("u-ghost").contains("gpu-9 is not on this node"),
        "{}",
        err("u-ghost")
    );
    assert!(err("u-old").contains("replaced"), "{}", err("u-old"));
    assert!(
        err("u-missing").contains("404") || err("u-missing").contains("not found"),
        "{}",
        err("u-missing")
    );
    assert!(claim_specs(&node).is_empty(), "nothing is written for a refused claim");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_go_when_dra_is_turned_off_or_the_runtime_unconfigured() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[dra]\nenabled = true\n");
    let api = api_server_for(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    assert!(api.wait_for(T, |a| published(a).len() == 2).await);
    // A stopped agent leaves its slices (a restart takes them over; the kubelet removes them
    // 30 s after the plugin is gone).
    assert_eq!(agent.stop(), 0);
    assert_eq!(published(&api).len(), 2);

    // `runtime unconfigure` (before the package is removed) deletes them.
    let out = node.run(&["runtime", "unconfigure", "--no-restart"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("removed 1 ResourceSlice(s) of DRA driver gpu.nvidia.com"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(api.resource_slices().is_empty());

    // Published again, then DRA turned off: the next start deletes them.
    let agent = node.spawn();
    assert!(api.wait_for(T, |a| published(a).len() == 2).await);
    assert_eq!(agent.stop(), 0);
    node.write_config("[dra]\nenabled = false\n");
    let agent = node.spawn();
    assert!(
        api.wait_for(T, |a| a.resource_slices().is_empty()).await,
        "the slices of a driver turned off are deleted"
    );
    assert!(
        !node
            .root
            .join("var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock")
            .exists()
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_mig_layout_replaces_the_published_devices() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[dra]\nenabled = true\n");
    let api = api_server_for(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    assert!(api.wait_for(T, |a| names(&published(a)) == ["gpu-0", "gpu-1"]).await);

    // The layout label: 7 × 1g.5gb per GPU, one memory slice each, named by placement.
    api.set_label(NODE_NAME, "nvidia.com/mig.config", Some("all-1g.5gb"));
    assert!(
        api.wait_for(T, |a| published(a).len() == 14).await,
        "{:?}",
        names(&published(&api))
    );
    let mut want: Vec<String> = (0..2)
        .flat_map(|g| (0..7).map(move |s| format!("gpu-{g}-mig-19-{s}-1")))
        .collect();
    want.sort();
    assert_eq!(names(&published(&api)), want);
    let generations: Vec<i64> = api
        .resource_slices()
        .values()
        .filter_map(|s| s["spec"]["pool"]["generation"].as_i64())
        .collect();
    assert!(
        generations.iter().all(|g| *g >= 2),
        "the pool's generation goes up: {generations:?}"
    );

    // Back to whole GPUs.
    api.set_label(NODE_NAME, "nvidia.com/mig.config", Some("all-disabled"));
    assert!(
        api.wait_for(T, |a| names(&published(a)) == ["gpu-0", "gpu-1"]).await,
        "{:?}",
        names(&published(&api))
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_the_kubelet_wiped_at_its_restart_come_back() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[dra]\nenabled = true\n");
    let api = api_server_for(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    // (The request log has the create a moment after the store.)
    let slice_writes = |a: &test_apiserver::TestApiServer| {
        a.count("POST", "/apis/resource.k8s.io/v1/resourceslices")
            + a.count("PUT", "/apis/resource.k8s.io/v1/resourceslices")
    };
    assert!(
        api.wait_for(T, |a| published(a).len() == 2 && slice_writes(a) == 1)
            .await
    );
    let writes = slice_writes(&api);

    // Nothing changes: nothing is written.
    another_pass(&agent).await;
    assert_eq!(slice_writes(&api), writes, "steady state writes no slices");

    // A kubelet restart: it deletes the node's slices, then registers the plugin again.
    dra.stop().await;
    assert_eq!(api.delete_resource_slices(NODE_NAME, None), 1);
    let restarted = Instant::now();
    let dra = dra_kubelet(&node).await;
    dra.wait_for_plugin_since(DRIVER, Some(restarted), T)
        .await
        .expect("registered with the new kubelet");
    assert!(
        api.wait_for(T, |a| published(a).len() == 2).await,
        "the agent publishes again after the kubelet wiped its slices"
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_layout_waits_for_the_claims_on_its_gpus() {
    let node = Node::new(
        &machine("A100-SXM4-40GB", 2),
        "[dra]\nenabled = true\n\n[agent]\nretry_min = \"200ms\"\nretry_max = \"1s\"\n",
    );
    let api = api_server_for(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    assert!(api.wait_for(T, |a| published(a).len() == 2).await);
    let uid = "6f1e0a52-6666-4c4c-9d9d-000000000006";
    api.create_resource_claim(allocated_claim("holder", uid, "gpu-0"));
    let claim = ClaimRef::new("ml", "holder", uid);
    let answer = dra
        .prepare(DRIVER, std::slice::from_ref(&claim))
        .await
        .expect("prepare");
    assert!(answer[uid].is_ok(), "{answer:?}");

    // The layout would destroy GPU 0 as the claim knows it: it fails, naming the claim.
    api.set_label(NODE_NAME, "nvidia.com/mig.config", Some("all-1g.5gb"));
    assert!(
        api.wait_for(T, |a| a
            .labels(NODE_NAME)
            .get("nvidia.com/mig.config.state")
            .map(String::as_str)
            == Some("failed"))
            .await,
        "{:?}",
        api.labels(NODE_NAME)
    );
    let status = node.status();
    let error = stage_error(&status, StageId::Mig).unwrap_or_default().to_string();
    assert!(error.contains(&gpu_uuid(0)) && error.contains("ml/holder"), "{error}");
    assert!(names(&published(&api)).contains(&"gpu-0".to_string()));

    // Unprepared: the layout goes through.
    assert_eq!(dra.unprepare(DRIVER, &[claim]).await.expect("unprepare")[uid], Ok(()));
    assert!(
        api.wait_for(T, |a| a
            .labels(NODE_NAME)
            .get("nvidia.com/mig.config.state")
            .map(String::as_str)
            == Some("success"))
            .await,
        "{:?}",
        api.labels(NODE_NAME)
    );
    assert!(
        api.wait_for(T, |a| published(a).len() == 14).await,
        "{:?}",
        names(&published(&api))
    );
    assert_eq!(agent.stop(), 0);
}

/// A current kubelet (grpc-go 1.57 and later) dials the registration socket by its bare path
/// (the plugin watcher's `grpc.DialContext(ctx, socketPath, ...)` with a unix dialer), so
/// `:authority` is the percent-encoded path (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F...`),
/// which is not a URI authority. The agent's servers (tonic on h2) must answer it as grpc-go
/// servers do: without the `vendor/h2` patch's treatment of such an authority as absent, GetInfo
/// is reset with PROTOCOL_ERROR and the driver never registers with such a kubelet. The same
/// holds for the DRA service socket and the device plugin socket, and for the raw path
/// (grpc-go before 1.57) and `localhost` (`unix://` targets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_sockets_answer_the_authority_grpc_go_derives_from_a_bare_path() {
    use test_kubelet::api::{DevicePluginOptions, Empty};
    use test_kubelet::dra_api::v1::{NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse};
    use test_kubelet::grpcgo::{GrpcGoConn, GrpcGoVersion, bare_path_authority};
    use test_kubelet::registration_api::{InfoRequest, PluginInfo};

    let node = Node::new(&machine("A100-SXM4-40GB", 1), "[dra]\nenabled = true\n");
    let (_api, kubelet) = api_server_and_kubelet(&node, &[]).await;
    let dra = dra_kubelet(&node).await;
    let agent = node.spawn();
    let reg = dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    let rec = kubelet
        .wait_for_registration(GPU, T)
        .await
        .expect("the device plugin registers");
    let dra_socket = node
        .root
        .join(reg.endpoint.strip_prefix("/").expect("an absolute endpoint"));
    let plugin_socket = kubelet.dir().join(&rec.endpoint);
    let user_agent = "grpc-go/1.72.0";
    let authorities = |socket: &std::path::Path| {
        [
            bare_path_authority(socket, GrpcGoVersion::Since1_57),
            bare_path_authority(socket, GrpcGoVersion::Before1_57),
            "localhost".to_string(),
        ]
    };
    assert!(
        authorities(&reg.socket)[0].starts_with("%2F"),
        "{:?}",
        authorities(&reg.socket)
    );

    for authority in authorities(&reg.socket) {
        let mut conn = GrpcGoConn::connect(&reg.socket, &authority, user_agent)
            .await
            .expect("dial the registration socket");
        let info: PluginInfo = conn
            .unary("/pluginregistration.Registration/GetInfo", &InfoRequest {})
            .await
            .unwrap_or_else(|s| panic!("GetInfo with :authority {authority:?}: {s:?}"));
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, DRIVER);
        assert!(info.supported_versions.iter().any(|v| v == "v1.DRAPlugin"), "{info:?}");
    }
    for authority in authorities(&dra_socket) {
        let mut conn = GrpcGoConn::connect(&dra_socket, &authority, user_agent)
            .await
            .expect("dial the DRA socket");
        let answer: NodeUnprepareResourcesResponse = conn
            .unary(
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
                &NodeUnprepareResourcesRequest { claims: vec![] },
            )
            .await
            .unwrap_or_else(|s| panic!("NodeUnprepareResources with :authority {authority:?}: {s:?}"));
        assert!(answer.claims.is_empty(), "{answer:?}");
    }
    for authority in authorities(&plugin_socket) {
        let mut conn = GrpcGoConn::connect(&plugin_socket, &authority, user_agent)
            .await
            .expect("dial the device plugin socket");
        let options: DevicePluginOptions = conn
            .unary("/v1beta1.DevicePlugin/GetDevicePluginOptions", &Empty {})
            .await
            .unwrap_or_else(|s| panic!("GetDevicePluginOptions with :authority {authority:?}: {s:?}"));
        assert_eq!(Some(options), rec.options);
    }
    assert!(dra.violations().is_empty(), "{:?}", dra.violations());
    assert_eq!(agent.stop(), 0);
}
