//! GPU sharing end to end: time-slicing profiles from the config, selected by the
//! `nvidia.com/device-plugin.config` label on the Node (test API server), advertised by the real
//! binary over the fake NVML to the test kubelet, and swapped in place when the label changes.

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid, machine};
use gpu_node_agent::desired::ProfileState;
use test_apiserver::TestApiServer;
use test_kubelet::{Event, TestKubelet};

const T: Duration = Duration::from_secs(15);
const NODE: &str = common::NODE_NAME;
const PROFILE: &str = "nvidia.com/device-plugin.config";
const PROFILE_STATE: &str = "nvidia.com/device-plugin.config.state";
const SHARED: &str = "nvidia.com/gpu.shared";

/// A profile that time-slices `resources` (compact strings) with `rename_by_default`, one
/// replica per container, and `policy`.
fn profile(name: &str, policy: &str, compact: &[&str]) -> String {
    format!(
        "[device_plugin.profiles.{name}.sharing]\nstrategy = \"time-slicing\"\nrename_by_default = true\n\
         fail_requests_greater_than_one = true\npolicy = \"{policy}\"\ncompact = {compact:?}\n"
    )
}

/// The API server with this node's Node (carrying `labels`), the node itself with `config`, its
/// kubeconfig, and the kubelet.
async fn setup(machine: &str, config: &str, labels: &[(&str, &str)]) -> (TestApiServer, Node, TestKubelet) {
    let node = Node::new(machine, config);
    // With NVIDIA's toolkit, replicas reach containers as NVIDIA_VISIBLE_DEVICES.
    node.install_toolkit_runtime();
    let (api, kubelet) = common::api_server_and_kubelet(&node, labels).await;
    (api, node, kubelet)
}

fn ids(devices: &[test_kubelet::api::Device]) -> Vec<String> {
    let mut ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
    ids.sort();
    ids
}

/// The physical device of a replica ID.
fn physical(id: &str) -> &str {
    id.split_once("::").map_or(id, |(uuid, _)| uuid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_on_two_gpus_are_eight_shared_gpus_one_per_container() {
    let config = format!(
        "[device_plugin]\ndefault_profile = \"shared4\"\n{}{}",
        profile("shared4", "distributed", &["gpu::4"]),
        profile("packed4", "packed", &["gpu::4"]),
    );
    let (api, node, kubelet) = setup(&machine("A100-SXM4-40GB", 2), &config, &[]).await;
    let agent = node.spawn();

    // No label: the default profile. 2 GPUs × 4 replicas, renamed, nothing as nvidia.com/gpu.
    let devices = kubelet
        .wait_for_devices(SHARED, T, |d| d.len() == 8)
        .await
        .expect("8 replicas");
    let want: Vec<String> = (0..2)
        .flat_map(|g| (0..4).map(move |n| format!("{}::{n}", gpu_uuid(g))))
        .collect();
    assert_eq!(ids(&devices), want);
    for d in &devices {
        assert_eq!(d.health, "Healthy");
        let numa = d.topology.as_ref().and_then(|t| t.nodes.first()).map(|n| n.id);
        let gpu = if physical(&d.id) == gpu_uuid(0) { 0 } else { 1 };
        assert_eq!(numa, Some(gpu), "{} has its GPU's NUMA node", d.id);
    }
    assert_eq!(kubelet.resources(), [SHARED]);
    assert!(node.sockets().contains(&"nvidia-gpu.shared.sock".to_string()));
    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());

    // One replica per container: two are refused with NVIDIA's message, one is a GPU.
    let two = [want[0].as_str(), want[4].as_str()];
    let refused = kubelet.allocate(SHARED, &two).await.expect_err("more than one replica");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("maximum request size for shared resources is 1; found 2"),
        "{}",
        refused.message()
    );
    let one = kubelet.allocate(SHARED, &[&want[5]]).await.expect("one replica");
    assert_eq!(one.envs["NVIDIA_VISIBLE_DEVICES"], gpu_uuid(1));

    // Preferred allocation spreads over both GPUs.
    let available: Vec<&str> = want.iter().map(String::as_str).collect();
    let spread = kubelet
        .preferred_allocation(SHARED, &available, &[], 2)
        .await
        .expect("preferred");
    assert_ne!(physical(&spread[0]), physical(&spread[1]), "{spread:?}");
    // GPU 0 has two replicas in use, GPU 1 none: NVIDIA's distributed takes the least
    // allocated GPU each time, so both from GPU 1 (1 allocated after the first is still < 2).
    let busy: Vec<&str> = available[2..].to_vec();
    let spread = kubelet
        .preferred_allocation(SHARED, &busy, &[], 2)
        .await
        .expect("preferred");
    assert_eq!(spread, [want[4].clone(), want[5].clone()]);

    // The GPU feature labels say how the GPUs are shared (renamed: no -SHARED product).
    common::wait_label(&api, "nvidia.com/gpu.replicas", Some("4"), T).await;
    common::wait_label(&api, "nvidia.com/gpu.sharing-strategy", Some("time-slicing"), T).await;
    common::wait_label(&api, "nvidia.com/gpu.product", Some("NVIDIA-A100-SXM4-40GB"), T).await;
    common::wait_label(&api, PROFILE_STATE, Some("success"), T).await;

    // The packed profile: same resource, so the same stream. Preferred allocation fills the
    // busier GPU first: with one replica of GPU 0 in use, a single replica goes to GPU 0 (it went
    // to the idle GPU 1 under distributed).
    let registrations = kubelet.registrations().len();
    let mut events = kubelet.subscribe();
    let one_busy: Vec<&str> = available[1..].to_vec();
    let single = kubelet
        .preferred_allocation(SHARED, &one_busy, &[], 1)
        .await
        .expect("preferred");
    assert_eq!(single, [want[4].clone()], "distributed");
    api.set_label(NODE, PROFILE, Some("packed4"));
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.applied.as_deref() == Some("packed4"))
    });
    assert_eq!(i64::from(status.pid), i64::from(agent.pid()));
    let packed = async {
        loop {
            let got = kubelet.preferred_allocation(SHARED, &one_busy, &[], 1).await;
            match got {
                Ok(ids) if ids == [want[1].clone()] => return ids,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    tokio::time::timeout(T, packed)
        .await
        .expect("packed preferred allocation");
    // Two replicas both come from the busier GPU while it has room (NVIDIA's packed).
    let two = kubelet
        .preferred_allocation(SHARED, &one_busy, &[], 2)
        .await
        .expect("preferred");
    assert_eq!(two, [want[1].clone(), want[2].clone()]);
    let two = kubelet
        .preferred_allocation(SHARED, &available, &[], 2)
        .await
        .expect("preferred");
    assert_eq!(two, [want[0].clone(), want[1].clone()]);
    assert!(kubelet.is_connected(SHARED));
    assert_eq!(kubelet.registrations().len(), registrations, "no new registration");
    while let Ok(event) = events.try_recv() {
        assert!(!matches!(event, Event::Disconnected { .. }), "{event:?}");
    }

    // A profile that does not exist changes nothing and says so.
    api.set_label(NODE, PROFILE, Some("shared8"));
    common::wait_label(&api, PROFILE_STATE, Some("failed"), T).await;
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.state == ProfileState::Failed)
    });
    let reason = common::desired(&status).profile.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("shared8") && reason.contains("nothing changed"),
        "{reason}"
    );
    assert_eq!(kubelet.resources(), [SHARED]);
    assert_eq!(kubelet.devices(SHARED).map(|d| d.len()), Some(8));
    assert_eq!(kubelet.registrations().len(), registrations);
    assert_eq!(agent.stop(), 0);
}

/// GPU 0 has MIG devices (one 3g.40gb, two 1g.10gb), GPU 1 is a whole GPU.
fn mig_and_whole() -> String {
    let mut m = common::DGX_A100.to_string();
    m.push_str(&format!(
        "\n[[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\nmig_mode = true\nnuma_node = 0\n\
         [[gpu.mig_device]]\nprofile = \"3g.40gb\"\nplacement = 4\n\
         [[gpu.mig_device]]\nprofile = \"1g.10gb\"\nplacement = 0\n\
         [[gpu.mig_device]]\nprofile = \"1g.10gb\"\nplacement = 1\n\
         \n[[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\nnuma_node = 1\n",
        gpu_uuid(0),
        gpu_uuid(1)
    ));
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_change_swaps_shared_resources_in_place() {
    const MIG3G: &str = "nvidia.com/mig-3g.40gb";
    const MIG1G: &str = "nvidia.com/mig-1g.10gb";
    const MIG1G_SHARED: &str = "nvidia.com/mig-1g.10gb.shared";
    let config = format!(
        "[device_plugin]\nmig_strategy = \"mixed\"\n{}{}",
        profile("share-gpu", "distributed", &["gpu::4"]),
        profile("share-mig", "distributed", &["mig-1g.10gb::2"]),
    );
    let (api, node, kubelet) = setup(&mig_and_whole(), &config, &[(PROFILE, "share-gpu")]).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(SHARED, T, |d| d.len() == 4)
        .await
        .expect("the whole GPU, 4 ways");
    kubelet.wait_for_devices(MIG1G, T, |d| d.len() == 2).await.expect("1g");
    kubelet.wait_for_devices(MIG3G, T, |d| d.len() == 1).await.expect("3g");
    common::wait_label(&api, "nvidia.com/gpu.replicas", Some("4"), T).await;
    common::wait_label(&api, "nvidia.com/mig-1g.10gb.replicas", Some("1"), T).await;
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.applied.as_deref() == Some("share-gpu"))
    });
    let pid = status.pid;
    let registrations = kubelet.registrations().len();
    let mut events = kubelet.subscribe();

    api.set_label(NODE, PROFILE, Some("share-mig"));
    let devices = kubelet
        .wait_for_devices(MIG1G_SHARED, T, |d| d.len() == 4)
        .await
        .expect("two 1g devices, 2 ways");
    assert!(devices.iter().all(|d| d.id.starts_with("MIG-") && d.id.contains("::")));
    kubelet
        .wait_for_devices("nvidia.com/gpu", T, |d| ids(d) == [gpu_uuid(1)])
        .await
        .expect("the whole GPU, unshared");
    kubelet
        .wait_for_disconnect(SHARED, T)
        .await
        .expect("gpu.shared withdrawn");
    kubelet.wait_for_disconnect(MIG1G, T).await.expect("1g withdrawn");
    common::wait_label(&api, "nvidia.com/mig-1g.10gb.replicas", Some("2"), T).await;
    common::wait_label(&api, "nvidia.com/gpu.replicas", Some("1"), T).await;

    // Same process; the servers of removed resources stopped and their sockets went.
    let status = node.wait_status(T, |s| {
        common::desired_is(s, |d| d.profile.applied.as_deref() == Some("share-mig"))
    });
    assert_eq!(status.pid, pid);
    assert_eq!(i64::from(pid), i64::from(agent.pid()));
    let sockets = node.sockets();
    for gone in ["nvidia-gpu.shared.sock", "nvidia-mig-1g.10gb.sock"] {
        assert!(!sockets.contains(&gone.to_string()), "{gone} in {sockets:?}");
    }
    for here in [
        "nvidia-gpu.sock",
        "nvidia-mig-1g.10gb.shared.sock",
        "nvidia-mig-3g.40gb.sock",
    ] {
        assert!(sockets.contains(&here.to_string()), "{here} not in {sockets:?}");
    }
    // The unchanged resource kept its registration and its ListAndWatch stream.
    assert!(kubelet.is_connected(MIG3G));
    let mut new_registrations = Vec::new();
    while let Ok(event) = events.try_recv() {
        match event {
            Event::Disconnected { resource, .. } => assert_ne!(resource, MIG3G, "the 3g stream was closed"),
            Event::Registration(r) => new_registrations.push(r.resource),
            _ => {}
        }
    }
    new_registrations.sort();
    assert_eq!(new_registrations, ["nvidia.com/gpu", MIG1G_SHARED]);
    assert_eq!(kubelet.registrations().len(), registrations + 2);
    assert_eq!(kubelet.resources(), ["nvidia.com/gpu", MIG1G_SHARED, MIG3G]);
    assert_eq!(agent.stop(), 0);
}
