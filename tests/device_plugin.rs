//! The real binary against the fake NVML library and the test kubelet: what the kubelet sees.

mod common;

use std::time::{Duration, Instant};

use common::{H100_MIG, Node, gpu_uuid, healthy, machine, summary};
use gpu_node_agent::status::{StageId, StageState};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(10);
const GPU: &str = "nvidia.com/gpu";

async fn start_kubelet(node: &Node) -> TestKubelet {
    TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("start test kubelet")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_eight_a100s_with_numa_topology() {
    let node = Node::new(&machine("A100-SXM4-40GB", 8), "");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    let reg = kubelet.wait_for_registration(GPU, T).await.expect("registration");
    assert_eq!(reg.endpoint, "nvidia-gpu.sock");
    assert_eq!(reg.version, "v1beta1");
    let options = reg.plugin_options.expect("dial-back options");
    assert!(options.get_preferred_allocation_available);
    assert!(!options.pre_start_required);
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 devices");
    let expected: Vec<_> = (0..8)
        .map(|i| (gpu_uuid(i), "Healthy".to_string(), Some(i64::from(i / 4))))
        .collect();
    assert_eq!(summary(&devices), expected);
    assert!(kubelet.violations().is_empty(), "{:?}", kubelet.violations());
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Ok));
    let resource = status.resources.first().expect("a resource");
    assert_eq!(resource.name, GPU);
    assert!(resource.registered, "{resource:?}");
    assert_eq!(status.gpus.len(), 8);
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t4_without_mig_is_one_gpu_in_every_strategy() {
    for strategy in ["none", "single", "mixed"] {
        let node = Node::new(
            &machine("T4", 1),
            &format!("[device_plugin]\nmig_strategy = \"{strategy}\"\n"),
        );
        let kubelet = start_kubelet(&node).await;
        let agent = node.spawn();
        let devices = kubelet
            .wait_for_devices(GPU, T, |d| d.len() == 1)
            .await
            .expect("one T4");
        assert_eq!(devices[0].id, gpu_uuid(0));
        assert_eq!(kubelet.resources(), vec![GPU.to_string()], "strategy {strategy}");
        assert_eq!(agent.stop(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h100_mig_devices_in_each_strategy() {
    // mixed: one resource per profile, MIG UUIDs, parent's NUMA node.
    let node = Node::new(H100_MIG, "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    for (resource, count, numa) in [
        ("nvidia.com/mig-3g.40gb", 1, 0),
        ("nvidia.com/mig-2g.20gb", 2, 0),
        ("nvidia.com/mig-1g.10gb", 2, 1),
    ] {
        kubelet.wait_for_registration(resource, T).await.expect(resource);
        let devices = kubelet
            .wait_for_devices(resource, T, |d| d.len() == count)
            .await
            .expect(resource);
        for d in &devices {
            assert!(d.id.starts_with("MIG-"), "{resource}: {}", d.id);
            assert_eq!(summary(std::slice::from_ref(d))[0].2, Some(numa), "{resource}");
        }
    }
    assert!(
        node.sockets().contains(&"nvidia-mig-3g.40gb.sock".to_string()),
        "{:?}",
        node.sockets()
    );
    assert!(!kubelet.resources().contains(&GPU.to_string()));
    assert_eq!(agent.stop(), 0);

    // none: the two GPUs as whole GPUs.
    let node = Node::new(H100_MIG, "[device_plugin]\nmig_strategy = \"none\"\n");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("two whole H100s");
    assert!(devices.iter().all(|d| d.id.starts_with("GPU-")));
    assert_eq!(agent.stop(), 0);

    // single with two profiles: refused with the reason, nothing advertised.
    let node = Node::new(H100_MIG, "[device_plugin]\nmig_strategy = \"single\"\n");
    let api = common::api_server_for(&node, &[]).await;
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Failed));
    let error = common::stage_error(&status, StageId::DevicePlugin)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("one MIG profile") && error.contains("1g.10gb"),
        "{error}"
    );
    assert!(kubelet.registrations().is_empty());
    // A Warning on the Node with the reason, once: a pass that fails the same way posts none.
    let event = common::event_posted(&api, "DevicePluginFailed").await;
    common::assert_event(&event, "Warning", &["gpu-node-agent device plugin", "one MIG profile"]);
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "DevicePluginFailed").len(),
        1,
        "{:?}",
        api.events()
    );
    assert!(
        common::events_with(&api, "DevicePluginReady").is_empty(),
        "{:?}",
        api.events()
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_strategy_advertises_uniform_mig_devices_as_gpus() {
    let mut m = common::DGX_A100.to_string();
    for i in 0..2 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            gpu_uuid(i)
        ));
        for _ in 0..7 {
            m.push_str("[[gpu.mig_device]]\nprofile = \"1g.5gb\"\n");
        }
    }
    let node = Node::new(
        &m,
        "[device_plugin]\nmig_strategy = \"single\"\ndevice_id_strategy = \"index\"\ndevice_list_strategy = \"envvar\"\n",
    );
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 14)
        .await
        .expect("14 MIG devices");
    assert!(devices.iter().all(|d| d.id.starts_with("MIG-")));
    // index ids name the MIG device as <gpu>:<mig>.
    let one = devices[0].id.clone();
    let resp = kubelet.allocate(GPU, &[&one]).await.expect("allocate");
    let visible = &resp.envs["NVIDIA_VISIBLE_DEVICES"];
    assert!(visible.contains(':'), "{visible}");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_strategies_match_nvidias_plugin() {
    let cases: &[(&str, &str)] = &[
        ("envvar", "[device_plugin]\ndevice_list_strategy = \"envvar\"\n"),
        (
            "volume-mounts",
            "[device_plugin]\ndevice_list_strategy = \"volume-mounts\"\n",
        ),
        (
            "cdi-annotations",
            "[device_plugin]\ndevice_list_strategy = \"cdi-annotations\"\n",
        ),
        ("cdi-cri", "[device_plugin]\ndevice_list_strategy = \"cdi-cri\"\n"),
        (
            "index",
            "[device_plugin]\ndevice_id_strategy = \"index\"\ndevice_list_strategy = \"envvar\"\n",
        ),
        (
            "specs",
            "[device_plugin]\npass_device_specs = true\ndevice_list_strategy = \"envvar\"\n",
        ),
        // The defaults: NVIDIA_VISIBLE_DEVICES with NVIDIA's toolkit, CDI names without it.
        ("auto with the toolkit", ""),
        ("auto without the toolkit", ""),
        (
            "host-mounts",
            "[device_plugin]\ndevice_list_strategy = \"host-mounts\"\nhost_mounts_driver_dir = \"/home/kubernetes/bin/nvidia\"\n",
        ),
    ];
    let (a, b) = (gpu_uuid(0), gpu_uuid(1));
    for (case, config) in cases {
        let node = Node::new(&machine("A100-SXM4-40GB", 2), config);
        if *case == "auto with the toolkit" {
            node.install_toolkit_runtime();
        }
        for dev in ["nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"] {
            let p = node.root.join("dev").join(dev);
            std::fs::create_dir_all(p.parent().expect("dev")).expect("mkdir dev");
            std::fs::write(p, "").expect("fake device node");
        }
        let kubelet = start_kubelet(&node).await;
        let agent = node.spawn();
        kubelet.wait_for_devices(GPU, T, |d| d.len() == 2).await.expect(case);
        let resp = kubelet
            .allocate(GPU, &[&a, &b])
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let env = |k: &str| resp.envs.get(k).cloned();
        match *case {
            "envvar" | "auto with the toolkit" => {
                assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), Some(format!("{a},{b}")));
                assert!(resp.mounts.is_empty() && resp.devices.is_empty());
            }
            "volume-mounts" => {
                assert_eq!(
                    env("NVIDIA_VISIBLE_DEVICES").as_deref(),
                    Some("/var/run/nvidia-container-devices")
                );
                let mounts: Vec<_> = resp
                    .mounts
                    .iter()
                    .map(|m| (m.host_path.as_str(), m.container_path.clone()))
                    .collect();
                assert_eq!(
                    mounts,
                    vec![
                        ("/dev/null", format!("/var/run/nvidia-container-devices/{a}")),
                        ("/dev/null", format!("/var/run/nvidia-container-devices/{b}"))
                    ]
                );
            }
            "cdi-annotations" => {
                assert!(resp.envs.is_empty(), "{case}: no env with only CDI strategies");
                let (key, value) = resp.annotations.iter().next().expect("one annotation");
                assert!(key.starts_with("cdi.k8s.io/nvidia-device-plugin_"), "{key}");
                assert_eq!(
                    value,
                    &format!("k8s.device-plugin.nvidia.com/gpu={a},k8s.device-plugin.nvidia.com/gpu={b}")
                );
            }
            "cdi-cri" | "auto without the toolkit" => {
                let names: Vec<_> = resp.cdi_devices.iter().map(|d| d.name.clone()).collect();
                assert_eq!(
                    names,
                    vec![
                        format!("k8s.device-plugin.nvidia.com/gpu={a}"),
                        format!("k8s.device-plugin.nvidia.com/gpu={b}")
                    ]
                );
                assert!(resp.envs.is_empty() && resp.annotations.is_empty());
            }
            "index" => assert_eq!(env("NVIDIA_VISIBLE_DEVICES").as_deref(), Some("0,1")),
            "specs" => {
                let paths: Vec<_> = resp.devices.iter().map(|d| d.container_path.as_str()).collect();
                assert_eq!(
                    paths,
                    vec!["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1"]
                );
                assert!(
                    resp.devices
                        .iter()
                        .all(|d| d.permissions == "rw" && d.host_path == d.container_path)
                );
            }
            "host-mounts" => {
                let paths: Vec<_> = resp.devices.iter().map(|d| d.container_path.as_str()).collect();
                assert!(
                    paths.contains(&"/dev/nvidia0") && paths.contains(&"/dev/nvidiactl"),
                    "{paths:?}"
                );
                let mount = resp
                    .mounts
                    .iter()
                    .find(|m| m.host_path == "/home/kubernetes/bin/nvidia")
                    .expect("driver mount");
                assert_eq!(mount.container_path, "/usr/local/nvidia");
                assert!(mount.read_only);
            }
            _ => unreachable!(),
        }
        // An unknown device is refused with InvalidArgument naming it.
        let err = kubelet
            .allocate(GPU, &["GPU-does-not-exist"])
            .await
            .expect_err("unknown id");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{case}");
        assert!(
            err.message().contains("GPU-does-not-exist"),
            "{case}: {}",
            err.message()
        );
        assert_eq!(agent.stop(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_keeps_to_one_numa_node_and_honours_must_include() {
    let node = Node::new(&machine("A100-SXM4-40GB", 8), "");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("8 devices");
    let all: Vec<String> = (0..8).map(gpu_uuid).collect();
    let all_refs: Vec<&str> = all.iter().map(String::as_str).collect();
    // Must include GPU 5 (NUMA node 1): the other three come from NUMA node 1 too.
    let picked = kubelet
        .preferred_allocation(GPU, &all_refs, &[&all[5]], 4)
        .await
        .expect("preferred");
    let mut picked_sorted = picked.clone();
    picked_sorted.sort();
    assert_eq!(picked_sorted, all[4..8].to_vec(), "picked {picked:?}");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_reregisters_within_a_second() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet.wait_for_registration(GPU, T).await.expect("first registration");
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("devices");
    let restarted = Instant::now();
    kubelet.restart().await.expect("restart kubelet");
    let reg = kubelet
        .wait_for_registration_since(GPU, restarted, T)
        .await
        .expect("re-registration");
    let took = reg.at.duration_since(restarted);
    assert!(took < Duration::from_secs(1), "re-registered after {took:?}");
    assert_eq!(reg.kubelet_instance, 2);
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("devices after restart");
    assert!(kubelet.is_connected(GPU));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_absent_at_start_then_registers_when_it_appears() {
    let node = Node::new(&machine("T4", 1), "");
    let mut agent = node.spawn();
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Pending));
    assert!(
        common::stage_error(&status, StageId::DevicePlugin)
            .unwrap_or_default()
            .contains("waiting for the kubelet"),
        "{status:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(agent.running(), "agent must wait for the kubelet, not exit");
    let kubelet = start_kubelet(&node).await;
    kubelet
        .wait_for_registration(GPU, T)
        .await
        .expect("registration once the kubelet is up");
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("device");
    node.wait_status(T, |s| common::stage_is(s, StageId::DevicePlugin, StageState::Ok));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_makes_only_that_gpu_unhealthy_and_it_recovers() {
    let node = Node::new(
        &machine("A100-SXM4-40GB", 4),
        "[health]\nrecovery_after = \"2s\"\nlost_check_interval = \"100ms\"\n",
    );
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 4)
        .await
        .expect("devices");
    // Xid 13 is an application error (ignored by default); Xid 79 (fallen off the bus) is critical.
    node.inject("xid", &format!("{} 13", gpu_uuid(0)));
    node.inject("xid", &format!("{} 79", gpu_uuid(1)));
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| healthy(d, &gpu_uuid(1)) == Some(false))
        .await
        .expect("GPU 1 unhealthy");
    for i in [0, 2, 3] {
        assert_eq!(healthy(&devices, &gpu_uuid(i)), Some(true), "GPU {i} must stay healthy");
    }
    let status = node.wait_status(T, |s| s.gpus.get(1).is_some_and(|g| g.health == "Unhealthy"));
    assert!(
        status.gpus[1].reason.as_deref().unwrap_or_default().contains("Xid 79"),
        "{status:?}"
    );
    // No further Xid for recovery_after: healthy again.
    let unhealthy_at = Instant::now();
    kubelet
        .wait_for_devices(GPU, T, |d| healthy(d, &gpu_uuid(1)) == Some(true))
        .await
        .expect("GPU 1 healthy again");
    assert!(
        unhealthy_at.elapsed() >= Duration::from_millis(1500),
        "recovered too early"
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_on_a_mig_device_affects_only_that_device() {
    let node = Node::new(
        H100_MIG,
        "[device_plugin]\nmig_strategy = \"mixed\"\n[health]\nrecovery_after = \"0s\"\n",
    );
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    let r = "nvidia.com/mig-2g.20gb";
    kubelet
        .wait_for_devices("nvidia.com/mig-3g.40gb", T, |d| d.len() == 1)
        .await
        .expect("3g device");
    let devices = kubelet
        .wait_for_devices(r, T, |d| d.len() == 2)
        .await
        .expect("two 2g devices");
    let (sick, fine) = (devices[0].id.clone(), devices[1].id.clone());
    node.inject("xid", &format!("{sick} 94"));
    let devices = kubelet
        .wait_for_devices(r, T, |d| healthy(d, &sick) == Some(false))
        .await
        .expect("MIG unhealthy");
    assert_eq!(healthy(&devices, &fine), Some(true));
    let other = kubelet.devices("nvidia.com/mig-3g.40gb").expect("3g list");
    assert!(
        other.iter().all(|d| d.health == "Healthy"),
        "the 3g device on the same GPU stays healthy"
    );
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_gpu_is_unhealthy_until_nvml_answers_again() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "");
    let api = common::api_server_for(&node, &[]).await;
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 2)
        .await
        .expect("devices");
    node.set_injection("lost", &format!("{}\n", gpu_uuid(0)));
    let devices = kubelet
        .wait_for_devices(GPU, T, |d| healthy(d, &gpu_uuid(0)) == Some(false))
        .await
        .expect("lost");
    assert_eq!(healthy(&devices, &gpu_uuid(1)), Some(true));
    let status = node.wait_status(T, |s| s.gpus.first().is_some_and(|g| g.health == "Unhealthy"));
    assert!(
        status.gpus[0].reason.as_deref().unwrap_or_default().contains("lost"),
        "{status:?}"
    );
    // Each transition is an Event on the Node, once: not again while the GPU stays lost.
    let event = common::event_posted(&api, "GpuUnhealthy").await;
    let gpu0 = format!("GPU 0 ({})", gpu_uuid(0));
    common::assert_event(&event, "Warning", &[&gpu0, "is unhealthy", "lost"]);
    // Lost-GPU probes every 100 ms meanwhile. (Not a SIGHUP here: re-reading the inventory
    // with a GPU lost fails the device plugin stage, another transition.)
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(common::events_with(&api, "GpuUnhealthy").len(), 1, "{:?}", api.events());
    node.set_injection("lost", "");
    kubelet
        .wait_for_devices(GPU, T, |d| healthy(d, &gpu_uuid(0)) == Some(true))
        .await
        .expect("back");
    let event = common::event_posted(&api, "GpuHealthy").await;
    common::assert_event(&event, "Normal", &[&gpu0, "is healthy again"]);
    common::another_pass(&agent).await;
    assert_eq!(common::events_with(&api, "GpuHealthy").len(), 1, "{:?}", api.events());
    assert_eq!(common::events_with(&api, "GpuUnhealthy").len(), 1, "{:?}", api.events());
    // The device plugin served throughout: ready once, at the start.
    let ready = common::events_with(&api, "DevicePluginReady");
    assert_eq!(ready.len(), 1, "{:?}", api.events());
    common::assert_event(&ready[0], "Normal", &["gpu-node-agent device plugin"]);
    assert!(common::events_with(&api, "DevicePluginFailed").is_empty());
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_serving_and_removes_own_sockets() {
    let node = Node::new(H100_MIG, "[device_plugin]\nmig_strategy = \"mixed\"\n");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_registration("nvidia.com/mig-1g.10gb", T)
        .await
        .expect("registered");
    kubelet
        .wait_for_registration("nvidia.com/mig-3g.40gb", T)
        .await
        .expect("registered");
    assert!(node.sockets().len() >= 4, "{:?}", node.sockets());
    assert_eq!(agent.stop(), 0);
    assert_eq!(
        node.sockets(),
        vec!["kubelet.sock".to_string()],
        "only the kubelet's socket is left"
    );
    kubelet
        .wait_for_disconnect("nvidia.com/mig-1g.10gb", T)
        .await
        .expect("stream closed");
    assert_eq!(node.status().state, "stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_kubelet_authority_is_tolerated() {
    let node = Node::new(&machine("T4", 1), "");
    node.install_toolkit_runtime();
    let opts = KubeletOptions {
        legacy_authority: true,
        ..KubeletOptions::default()
    };
    let kubelet = TestKubelet::start(&node.plugin_dir(), opts)
        .await
        .expect("legacy kubelet");
    let agent = node.spawn();
    let reg = kubelet
        .wait_for_registration(GPU, T)
        .await
        .expect("a pre-1.26 kubelet registers us");
    assert!(reg.plugin_options.is_some());
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("ListAndWatch with the legacy authority");
    let resp = kubelet
        .allocate(GPU, &[&gpu_uuid(0)])
        .await
        .expect("Allocate with the legacy authority");
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], gpu_uuid(0));
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_follows_nvlink_read_through_nvml_before_numa() {
    // GPUs 0,1 on NUMA node 0 and 2,3 on node 1, but NVLink joins 0-2 and 1-3 (two links each):
    // a pair for a job that must include GPU 0 is 0+2, across NUMA nodes, not 0+1.
    let bus = |i: u32| format!("00000000:{:02X}:00.0", 0x10 + i);
    let mut m = common::DGX_A100.to_string();
    for (i, peer) in [(0u32, 2u32), (1, 3), (2, 0), (3, 1)] {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\npci_bus_id = \"{}\"\nnuma_node = {}\nnvlink_peers = [\"{}\", \"{}\"]\n",
            gpu_uuid(i),
            bus(i),
            i / 2,
            bus(peer),
            bus(peer)
        ));
    }
    let node = Node::new(&m, "");
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 4)
        .await
        .expect("4 devices");
    let all: Vec<String> = (0..4).map(gpu_uuid).collect();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let mut picked = kubelet
        .preferred_allocation(GPU, &refs, &[&all[0]], 2)
        .await
        .expect("preferred");
    picked.sort();
    assert_eq!(picked, vec![all[0].clone(), all[2].clone()]);
    let mut picked = kubelet
        .preferred_allocation(GPU, &refs, &[], 2)
        .await
        .expect("preferred");
    picked.sort();
    assert!(
        picked == vec![all[0].clone(), all[2].clone()] || picked == vec![all[1].clone(), all[3].clone()],
        "{picked:?}"
    );
    assert_eq!(agent.stop(), 0);
}

/// NVIDIA's opt-in injections (`gdsEnabled`, `mofedEnabled`, `gdrcopyEnabled`, `imex`): on a host
/// with their device nodes, a container gets the envs the NVIDIA runtime hook reads and the CDI
/// names, and the agent writes a CDI spec per class that resolves them; off (the default), none
/// of it, whatever the host has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_in_injections_reach_the_container_only_when_enabled() {
    let strategies = "[device_plugin]\ndevice_list_strategy = [\"envvar\", \"cdi-cri\"]\n";
    let on = format!(
        "{strategies}gds_enabled = true\nmofed_enabled = true\ngdrcopy_enabled = true\n\n[device_plugin.imex]\nchannel_ids = [0]\n"
    );
    let a = gpu_uuid(0);
    let vendor = "k8s.device-plugin.nvidia.com";
    let classes = ["gdrcopy", "gds", "mofed", "imex-channel"];
    for (case, config) in [("on", on.as_str()), ("off", strategies)] {
        let node = Node::new(&machine("A100-SXM4-40GB", 1), config);
        for dev in [
            "nvidiactl",
            "nvidia0",
            "gdrdrv",
            "nvidia-fs0",
            "infiniband/uverbs0",
            "infiniband/rdma_cm",
            "nvidia-caps-imex-channels/channel0",
        ] {
            let p = node.root.join("dev").join(dev);
            std::fs::create_dir_all(p.parent().expect("dev")).expect("mkdir dev");
            std::fs::write(p, "").expect("fake device node");
        }
        let kubelet = start_kubelet(&node).await;
        let agent = node.spawn();
        kubelet.wait_for_devices(GPU, T, |d| d.len() == 1).await.expect(case);
        let resp = kubelet
            .allocate(GPU, &[&a])
            .await
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let mut envs: Vec<_> = resp.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        envs.sort();
        let names: Vec<_> = resp.cdi_devices.iter().map(|d| d.name.clone()).collect();
        let cdi = node.root.join("var/run/cdi");
        let spec = |class: &str| cdi.join(format!("{vendor}-{class}.json"));
        // The GPU spec is written in the same pass as the injection specs.
        node.wait_status(T, |_| cdi.join(format!("{vendor}-gpu.json")).exists());
        if case == "on" {
            assert_eq!(
                envs,
                [
                    ("NVIDIA_GDRCOPY", "enabled"),
                    ("NVIDIA_GDS", "enabled"),
                    ("NVIDIA_IMEX_CHANNELS", "0"),
                    ("NVIDIA_MOFED", "enabled"),
                    ("NVIDIA_VISIBLE_DEVICES", a.as_str()),
                ]
            );
            assert_eq!(
                names,
                [
                    format!("{vendor}/gpu={a}"),
                    format!("{vendor}/imex-channel=0"),
                    format!("{vendor}/gdrcopy=all"),
                    format!("{vendor}/gds=all"),
                    format!("{vendor}/mofed=all"),
                ]
            );
            // Every name handed out resolves in a spec the agent wrote, to the host's nodes.
            for class in classes {
                let text = std::fs::read_to_string(spec(class)).unwrap_or_else(|e| panic!("{class}: {e}"));
                let doc: serde_json::Value = serde_json::from_str(&text).expect("json");
                assert_eq!(doc["kind"], format!("{vendor}/{class}"));
                let device = if class == "imex-channel" { "0" } else { "all" };
                assert_eq!(doc["devices"][0]["name"], device, "{class}");
                assert!(
                    !doc["devices"][0]["containerEdits"]["deviceNodes"]
                        .as_array()
                        .expect("nodes")
                        .is_empty()
                );
            }
            let text = std::fs::read_to_string(spec("mofed")).expect("mofed");
            assert!(
                text.contains("/dev/infiniband/uverbs0") && text.contains("/dev/infiniband/rdma_cm"),
                "{text}"
            );
        } else {
            assert_eq!(envs, [("NVIDIA_VISIBLE_DEVICES", a.as_str())]);
            assert_eq!(names, [format!("{vendor}/gpu={a}")]);
            for class in classes {
                assert!(!spec(class).exists(), "{class}");
            }
        }
        assert_eq!(agent.stop(), 0);
    }
}

/// `[device_plugin.imex] required = true` and no channel node: Allocate is refused with an error
/// naming the node, instead of a container that silently lacks the channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_imex_channel_that_is_missing_refuses_allocate() {
    let config = "[device_plugin]\ndevice_list_strategy = \"envvar\"\n\n[device_plugin.imex]\nchannel_ids = [0]\nrequired = true\n";
    let node = Node::new(&machine("A100-SXM4-40GB", 1), config);
    let kubelet = start_kubelet(&node).await;
    let agent = node.spawn();
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 1)
        .await
        .expect("one GPU");
    let err = kubelet.allocate(GPU, &[&gpu_uuid(0)]).await.expect_err("refused");
    assert!(
        err.message()
            .contains("/dev/nvidia-caps-imex-channels/channel0 does not exist"),
        "{}",
        err.message()
    );
    // The status and the dry run say why the CDI specs are not written.
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Runtime, StageState::Failed));
    let error = common::stage_error(&status, StageId::Runtime)
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("channel0 does not exist"), "{status:?}");
    let out = node.run(&["plan"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("cannot be made: CDI spec: IMEX channel /dev/nvidia-caps-imex-channels/channel0 does not exist"),
        "{said}"
    );
    assert_eq!(agent.stop(), 0);
}
