//! The metrics endpoint against the fake NVML library (in process) and the test kubelet's
//! pod-resources service: dcgm-exporter's names, labels and values for GPUs and MIG GPU
//! instances, pod labels, Xids, and the HTTP behaviour; then the agent's own metrics as the
//! running binary reports them (health transitions, Kubernetes API requests, memory-limit
//! actions, registrations, allocations, stages). The output is parsed with a Prometheus text
//! parser. One test function: the fake library is a process-wide singleton configured through
//! the environment.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::scrape::{LabelSet, PROMETHEUS_ACCEPT, http, labels, parse, parse_checked, samples, try_metrics, value};
use gpu_node_agent::metrics::{FIELDS, Metrics, MetricsServer, SamplerConfig, XID_ERRORS};
use gpu_node_agent::nvml::{HealthEvent, Inventory};
use prometheus_parse::Scrape;
use test_kubelet::{KubeletOptions, PodContainer, TestKubelet};
use tokio::sync::{oneshot, watch};

const GPU0: &str = "GPU-00000000-1111-2222-3333-444455556666";
const GPU1: &str = "GPU-00000001-1111-2222-3333-444455556666";

/// GPU 0: an A100 without MIG whose readings are all fixed (a licensed vGPU guest, so that every
/// field has a value). GPU 1: an A100 in MIG mode with a
/// 3g.20gb GPU instance at slice 0 and one at slice 4 split into two 1-slice compute instances.
const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000000-1111-2222-3333-444455556666"
pci_bus_id = "00000000:07:00.0"
[gpu.readings]
gpu_utilization = 42
memory_utilization = 17
temperature = 51
memory_temperature = 60
power_mw = 123456
energy_mj = 987654321
sm_clock_mhz = 1300
memory_clock_mhz = 1200
pcie_replay = 3
ecc_corrected = 5
ecc_uncorrected = 1
throttle_reasons = 4
memory_reserved_mib = 500
pcie_tx_kbps = 1000
pcie_rx_kbps = 2000
encoder_utilization = 7
decoder_utilization = 9
nvlink_data_tx_kib = 3000
nvlink_data_rx_kib = 4000
remapped_rows_correctable = 2
remapped_rows_uncorrectable = 1
row_remap_failure = true
vgpu_licensed = true

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000001-1111-2222-3333-444455556666"
pci_bus_id = "00000000:0F:00.0"
mig_mode = true
[gpu.readings]
temperature = 40
energy_mj = 5000
[[gpu.mig_device]]
profile = "3g.20gb"
placement = 0
[[gpu.mig_device]]
profile = "1c.3g.20gb"
placement = 4
[[gpu.mig_device]]
profile = "1c.3g.20gb"
placement = 4
"#;

const HOST: &str = "gpu-node-1";

fn with(base: &LabelSet, extra: &[(&str, &str)]) -> LabelSet {
    let mut l = base.clone();
    l.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    l
}

/// The DCGM series of the scrape (name → label sets), to compare two scrapes.
fn dcgm_part(body: &str) -> Vec<&str> {
    body.lines().filter(|l| l.starts_with("DCGM_")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_reports_gpus_mig_instances_pods_and_agent_metrics() {
    let node = common::Node::new(MACHINE, "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: this test binary has this one test, and nothing else runs yet.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let inventory = gpus.inventory(&node.root.join("sys")).expect("inventory");
    let mig = &inventory.gpus[1].mig_devices;
    assert_eq!(mig.len(), 3, "{mig:?}");
    // The GPU instance at slice 0 has one MIG device; the one at slice 4 has two.
    let whole = mig.iter().find(|m| m.profile == "3g.20gb").expect("3g.20gb");
    let split: Vec<_> = mig.iter().filter(|m| m.profile == "1c.3g.20gb").collect();
    assert_eq!(split.len(), 2);
    assert_eq!(split[0].gi_id, split[1].gi_id);
    let (gi_whole, gi_split) = (whole.gi_id.to_string(), split[0].gi_id.to_string());

    // Load: 2 GiB on GPU 0, 1 GiB on the second compute instance of the split instance.
    fake_nvml::write_processes(&node.state, &[(GPU0, 100, 2048), (split[1].uuid.as_str(), 200, 1024)])
        .expect("processes");

    // The kubelet: GPU 0 held by ml/trainer-0/worker, the split instance's first MIG device by
    // infer/server/main.
    let (kubelet, socket) = common::scrape::kubelet_with_pod_resources(&node).await;
    kubelet.assign(
        "nvidia.com/gpu",
        &[GPU0],
        &PodContainer::new("ml", "trainer-0", "worker"),
    );
    kubelet.assign(
        "nvidia.com/mig-3g.20gb",
        &[split[0].uuid.as_str()],
        &PodContainer::new("infer", "server", "main"),
    );

    let metrics = Metrics::new();
    let (mut sampler, inventory_tx) =
        common::scrape::hand_ticked_sampler(&gpus, &metrics, inventory.clone(), HOST, Some(socket.clone()));
    assert!(sampler.tick().await, "one readings interval");

    metrics.xid(GPU0, 79);
    metrics.health_event(&HealthEvent::Xid {
        uuid: GPU1.into(),
        xid: 43,
        gi_id: split[0].gi_id,
        ci_id: 0,
    });

    let server = MetricsServer::bind("127.0.0.1:0".parse().expect("addr"), metrics.clone(), "/metrics")
        .await
        .expect("bind");
    let addr = server.local_addr().expect("local addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));

    let (status, content_type, body) =
        tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", Some(PROMETHEUS_ACCEPT)))
            .await
            .expect("scrape");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(body.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    let scrape = parse_checked(&body);

    // HELP texts and types are dcgm-exporter's (cumulative fields typed unknown, see dcgm.rs).
    assert_eq!(scrape.docs["DCGM_FI_DEV_GPU_UTIL"], "GPU utilization (in %).");
    assert_eq!(scrape.docs["DCGM_FI_DEV_FB_USED"], "Framebuffer memory used (in MiB).");
    assert_eq!(scrape.docs[XID_ERRORS], "Value of the last XID error encountered.");
    for field in FIELDS {
        assert!(
            body.contains(&format!("# HELP {} {}\n", field.name, field.help)),
            "{}",
            field.name
        );
    }
    assert!(body.contains("# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"));
    assert!(body.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n"));

    // Without OpenMetrics in `Accept`: the Prometheus text format, the same series, the
    // cumulative DCGM fields typed counter as dcgm-exporter has them.
    let (status, text_type, text) = tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", None))
        .await
        .expect("scrape");
    assert_eq!(status, 200, "{text}");
    assert_eq!(text_type, "text/plain; version=0.0.4; charset=utf-8");
    assert!(!text.contains("# EOF") && !text.contains(" unknown\n"), "{text}");
    assert!(text.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"));
    let plain = parse(&text);
    let series = |s: &Scrape| {
        let mut v: Vec<String> = s
            .samples
            .iter()
            .filter(|x| x.metric.starts_with("DCGM_"))
            .map(|x| {
                let labels: std::collections::BTreeMap<_, _> = x.labels.iter().collect();
                format!("{}{labels:?}", x.metric)
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(series(&plain), series(&scrape), "the same DCGM series in both formats");

    // GPU 0: every field, with the fake's values, dcgm-exporter's labels and the pod labels.
    let gpu0 = labels(&[
        ("gpu", "0"),
        ("UUID", GPU0),
        ("pci_bus_id", "00000000:07:00.0"),
        ("device", "nvidia0"),
        ("modelName", "NVIDIA A100-SXM4-40GB"),
        ("Hostname", HOST),
        ("DCGM_FI_DRIVER_VERSION", "550.54.15"),
        ("container", "worker"),
        ("namespace", "ml"),
        ("pod", "trainer-0"),
    ]);
    let expected_gpu0: &[(&str, f64)] = &[
        ("DCGM_FI_DEV_SM_CLOCK", 1300.0),
        ("DCGM_FI_DEV_MEM_CLOCK", 1200.0),
        ("DCGM_FI_DEV_MEMORY_TEMP", 60.0),
        ("DCGM_FI_DEV_GPU_TEMP", 51.0),
        ("DCGM_FI_DEV_POWER_USAGE", 123.456),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 987_654_321.0),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 3.0),
        ("DCGM_FI_DEV_GPU_UTIL", 42.0),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", 17.0),
        ("DCGM_FI_DEV_FB_FREE", 40960.0 - 500.0 - 2048.0),
        ("DCGM_FI_DEV_FB_USED", 2048.0),
        ("DCGM_FI_DEV_FB_RESERVED", 500.0),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 5.0),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1.0),
        ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 4.0),
        ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", 1000.0),
        ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", 2000.0),
        ("DCGM_FI_DEV_ENC_UTIL", 7.0),
        ("DCGM_FI_DEV_DEC_UTIL", 9.0),
        ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 7000.0),
        ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", 1.0),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 1.0),
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 2.0),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1.0),
    ];
    assert_eq!(expected_gpu0.len(), FIELDS.len(), "every field is checked");
    for (name, want) in expected_gpu0 {
        assert_eq!(value(&scrape, name, &gpu0), Some(*want), "{name} on GPU 0 in:\n{body}");
    }
    assert_eq!(
        value(
            &scrape,
            XID_ERRORS,
            &with(&gpu0, &[("err_code", "79"), ("err_msg", "GPU has fallen off the bus")])
        ),
        Some(79.0)
    );

    // GPU 1 (MIG mode): no utilization (NVML has none in MIG mode), no pod, the defaults.
    let gpu1 = labels(&[
        ("gpu", "1"),
        ("UUID", GPU1),
        ("pci_bus_id", "00000000:0F:00.0"),
        ("device", "nvidia1"),
        ("modelName", "NVIDIA A100-SXM4-40GB"),
        ("Hostname", HOST),
        ("DCGM_FI_DRIVER_VERSION", "550.54.15"),
    ]);
    assert_eq!(value(&scrape, "DCGM_FI_DEV_GPU_TEMP", &gpu1), Some(40.0));
    assert_eq!(value(&scrape, "DCGM_FI_DEV_MEMORY_TEMP", &gpu1), Some(44.0));
    // Idle power 54 W plus 25 W for the process on its MIG device; the SM clock boosts.
    assert_eq!(value(&scrape, "DCGM_FI_DEV_POWER_USAGE", &gpu1), Some(79.0));
    assert_eq!(value(&scrape, "DCGM_FI_DEV_SM_CLOCK", &gpu1), Some(1410.0));
    assert_eq!(
        value(&scrape, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", &gpu1),
        Some(5000.0)
    );
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_USED", &gpu1), Some(1024.0));
    // The model's reserve (no `memory_reserved_mib`), outside used and free.
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_RESERVED", &gpu1), Some(634.0));
    assert_eq!(
        value(&scrape, "DCGM_FI_DEV_FB_FREE", &gpu1),
        Some(40960.0 - 634.0 - 1024.0)
    );
    // Bare metal: no vGPU license; MIG mode: no codec utilization, as no GPU utilization.
    for absent in [
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
    ] {
        assert_eq!(value(&scrape, absent, &gpu1), None, "{absent} on GPU 1");
    }
    assert_eq!(value(&scrape, "DCGM_FI_DEV_ROW_REMAP_FAILURE", &gpu1), Some(0.0));
    assert!(
        !samples(&scrape, "DCGM_FI_DEV_GPU_UTIL")
            .iter()
            .any(|(l, _)| l["gpu"] == "1"),
        "no utilization for a GPU in MIG mode"
    );
    assert_eq!(
        value(
            &scrape,
            XID_ERRORS,
            &with(&gpu1, &[("err_code", "43"), ("err_msg", "GPU stopped processing")])
        ),
        Some(43.0)
    );

    // The MIG GPU instances: memory only, with GPU_I_PROFILE / GPU_I_ID and the parent's UUID.
    let whole_gi = with(&gpu1, &[("GPU_I_PROFILE", "3g.20gb"), ("GPU_I_ID", &gi_whole)]);
    let split_gi = with(
        &gpu1,
        &[
            ("GPU_I_PROFILE", "3g.20gb"),
            ("GPU_I_ID", &gi_split),
            ("container", "main"),
            ("namespace", "infer"),
            ("pod", "server"),
        ],
    );
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_USED", &whole_gi), Some(0.0));
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_FREE", &whole_gi), Some(19968.0));
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_USED", &split_gi), Some(1024.0));
    assert_eq!(value(&scrape, "DCGM_FI_DEV_FB_FREE", &split_gi), Some(19968.0 - 1024.0));
    assert_eq!(
        value(
            &scrape,
            XID_ERRORS,
            &with(&split_gi, &[("err_code", "43"), ("err_msg", "GPU stopped processing")])
        ),
        Some(43.0)
    );
    let mig_families: Vec<&str> = scrape
        .samples
        .iter()
        .filter(|s| s.labels.get("GPU_I_ID").is_some())
        .map(|s| s.metric.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(
        mig_families,
        vec![
            "DCGM_FI_DEV_FB_FREE",
            "DCGM_FI_DEV_FB_RESERVED",
            "DCGM_FI_DEV_FB_USED",
            XID_ERRORS
        ],
        "NVML gives a MIG device its memory only"
    );
    // One series per GPU instance: the split instance's two compute instances share theirs.
    assert_eq!(samples(&scrape, "DCGM_FI_DEV_FB_USED").len(), 4);

    // Readings are taken on the interval, not per scrape: a new load shows after the next tick.
    fake_nvml::write_processes(&node.state, &[]).expect("processes end");
    let (_, _, again) = tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", Some(PROMETHEUS_ACCEPT)))
        .await
        .expect("scrape");
    assert_eq!(dcgm_part(&again), dcgm_part(&body), "a scrape does not read NVML");
    assert!(sampler.tick().await);
    let (_, _, after) = tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", Some(PROMETHEUS_ACCEPT)))
        .await
        .expect("scrape");
    assert_eq!(value(&parse_checked(&after), "DCGM_FI_DEV_FB_USED", &gpu0), Some(0.0));

    // The pod ends and GPU 1 goes away: its series and the pod labels disappear.
    kubelet.release("ml", "trainer-0");
    let mut only_gpu0: Inventory = inventory.clone();
    only_gpu0.gpus.truncate(1);
    inventory_tx.send_replace(Some(Arc::new(only_gpu0)));
    assert!(sampler.tick().await);
    let (_, _, gone) = tokio::task::spawn_blocking(move || http(addr, "GET", "/metrics", Some(PROMETHEUS_ACCEPT)))
        .await
        .expect("scrape");
    let gone = parse_checked(&gone);
    let gpu0_bare = labels(&[
        ("gpu", "0"),
        ("UUID", GPU0),
        ("pci_bus_id", "00000000:07:00.0"),
        ("device", "nvidia0"),
        ("modelName", "NVIDIA A100-SXM4-40GB"),
        ("Hostname", HOST),
        ("DCGM_FI_DRIVER_VERSION", "550.54.15"),
    ]);
    assert_eq!(value(&gone, "DCGM_FI_DEV_GPU_UTIL", &gpu0_bare), Some(42.0));
    assert!(
        !gone
            .samples
            .iter()
            .any(|s| s.metric.starts_with("DCGM_") && s.labels.get("gpu") == Some("1")),
        "GPU 1's series are gone"
    );

    // Other paths and methods.
    let (status, _, _) = tokio::task::spawn_blocking(move || http(addr, "GET", "/other", Some(PROMETHEUS_ACCEPT)))
        .await
        .expect("request");
    assert_eq!(status, 404);
    let (status, _, _) = tokio::task::spawn_blocking(move || http(addr, "POST", "/metrics", Some(PROMETHEUS_ACCEPT)))
        .await
        .expect("request");
    assert_eq!(status, 405);

    // The loop: the first readings at once, the next when the inventory changes (long before
    // the hour-long interval).
    let looped = Metrics::new();
    let (tx, rx) = watch::channel(Some(Arc::new(inventory.clone())));
    let (halt, halted) = oneshot::channel::<()>();
    let config = SamplerConfig {
        interval: Duration::from_secs(3600),
        hostname: String::new(),
        pod_resources_socket: None,
    };
    let running = tokio::spawn(gpu_node_agent::metrics::run_sampler(
        gpus.clone(),
        looped.clone(),
        rx,
        config,
        async {
            let _ = halted.await;
        },
    ));
    let gpu1_series = |m: &Metrics| m.encode().expect("encode").contains("gpu=\"1\"");
    let wait_for = |want: bool| {
        let looped = looped.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while gpu1_series(&looped) != want {
                assert!(tokio::time::Instant::now() < deadline, "the loop did not update");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(true).await;
    assert!(
        !looped.encode().expect("encode").contains("Hostname="),
        "no Hostname label when empty"
    );
    let mut only_gpu0 = inventory.clone();
    only_gpu0.gpus.truncate(1);
    tx.send_replace(Some(Arc::new(only_gpu0)));
    wait_for(false).await;
    let _ = halt.send(());
    tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the loop stops")
        .expect("loop task");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("the server stops")
        .expect("server task");
    kubelet.stop().await;

    // In the same test function: nothing may run beside the set_var above.
    the_running_agent_reports_its_own_work().await;
}

/// The running binary's own series, scraped from its endpoint: a kubelet, an API server, a
/// time-sliced GPU with a memory budget and a pod process over it, an Xid that recovers, and a
/// GPU NVML loses and finds again.
async fn the_running_agent_reports_its_own_work() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let config = format!(
        "[metrics]\naddress = \"127.0.0.1:{port}\"\n\
         [health]\nrecovery_after = \"1s\"\nlost_check_interval = \"100ms\"\n\
         [device_plugin.sharing]\nstrategy = \"time-slicing\"\n\
         [[device_plugin.sharing.resources]]\nname = \"nvidia.com/gpu\"\nreplicas = 2\nmemory_per_replica = \"fair\"\n\
         [device_plugin.memory_limits]\naction = \"dry-run\"\ninterval = \"100ms\"\n"
    );
    let node = common::Node::new(&common::machine("A100-SXM4-40GB", 2), &config);
    let _api = common::api_server_for(&node, &[]).await; // serves until the end of the test
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");

    // A pod's process on GPU 0 over its replica's budget (40960 MiB / 2); dry-run kills nobody.
    let mut sleeper = node.pod_process();
    let pid = sleeper.id();
    node.set_injection("processes", &format!("{} {pid} 30000\n", common::gpu_uuid(0)));

    let agent = node.spawn();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let scrape = |until: &dyn Fn(&Scrape) -> bool| -> (Scrape, String) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let body = try_metrics(addr, Some(PROMETHEUS_ACCEPT));
            if let Some(body) = body {
                let parsed = parse_checked(&body);
                if until(&parsed) {
                    return (parsed, body);
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the agent's metrics never got there:\n{body}\n{}",
                    agent.log_text()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no metrics from the agent: {}",
                agent.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let counter = |scrape: &Scrape, name: &str, pairs: &[(&str, &str)]| value(scrape, name, &labels(pairs));
    let transitions = "gpu_node_agent_health_transitions_total";

    // Registered and watched; one Allocate.
    let replica = format!("{}::1", common::gpu_uuid(1));
    kubelet
        .wait_for_devices("nvidia.com/gpu", Duration::from_secs(15), |d| d.len() == 4)
        .await
        .expect("4 replicas");
    kubelet.allocate("nvidia.com/gpu", &[&replica]).await.expect("allocate");

    // An Xid on GPU 0 and GPU 1 lost: one transition each into Unhealthy, with the cause.
    node.inject("xid", &format!("{} 79", common::gpu_uuid(0)));
    node.set_injection("lost", &format!("{}\n", common::gpu_uuid(1)));
    let (got, _) = tokio::task::block_in_place(|| {
        scrape(&|s| {
            counter(s, transitions, &[("to", "Unhealthy"), ("reason", "xid")]).is_some()
                && counter(s, transitions, &[("to", "Unhealthy"), ("reason", "lost")]).is_some()
        })
    });
    assert_eq!(
        counter(&got, transitions, &[("to", "Unhealthy"), ("reason", "xid")]),
        Some(1.0)
    );
    assert_eq!(
        counter(&got, transitions, &[("to", "Unhealthy"), ("reason", "lost")]),
        Some(1.0)
    );

    // NVML answers for GPU 1 again, and GPU 0's Xid is a second old: both back to Healthy.
    node.set_injection("lost", "");
    let (got, body) = tokio::task::block_in_place(|| {
        scrape(&|s| {
            samples(s, transitions).len() == 4
                && samples(s, "gpu_node_agent_api_requests_total")
                    .iter()
                    .any(|(l, _)| l["verb"] == "create")
                && samples(s, "gpu_node_agent_memory_limit_actions_total").len() == 1
                && counter(
                    s,
                    "gpu_node_agent_plugin_allocations_total",
                    &[("resource", "nvidia.com/gpu")],
                )
                .is_some()
        })
    });
    let mut seen: Vec<(String, String, f64)> = samples(&got, transitions)
        .into_iter()
        .map(|(l, v)| (l["to"].clone(), l["reason"].clone(), v))
        .collect();
    seen.sort_by(|a, b| a.partial_cmp(b).expect("numbers"));
    let want = [
        ("Healthy", "answering"),
        ("Healthy", "recovered"),
        ("Unhealthy", "lost"),
        ("Unhealthy", "xid"),
    ];
    let want: Vec<(String, String, f64)> = want.iter().map(|(t, r)| (t.to_string(), r.to_string(), 1.0)).collect();
    assert_eq!(seen, want, "{body}");

    // Kubernetes API requests by the Kubernetes verb, in lower case: the Node listed by name
    // (the watch starts from the list's resourceVersion) and watched, its labels patched, an
    // Event created (the memory-limit action); `get` only when polling while a watch cannot be
    // established, so it may or may not be there.
    let verbs: std::collections::BTreeSet<String> = samples(&got, "gpu_node_agent_api_requests_total")
        .into_iter()
        .map(|(l, _)| l["verb"].clone())
        .collect();
    for verb in ["watch", "patch", "create"] {
        assert!(verbs.contains(verb), "no {verb} in:\n{body}");
    }
    for verb in &verbs {
        assert!(
            ["get", "list", "watch", "patch", "create"].contains(&verb.as_str()),
            "verb {verb} in:\n{body}"
        );
    }

    // The memory-limit action as the enforcer names it.
    assert_eq!(
        samples(&got, "gpu_node_agent_memory_limit_actions_total")
            .into_iter()
            .map(|(l, _)| l["action"].clone())
            .collect::<Vec<_>>(),
        ["would_kill"],
        "{body}"
    );

    // Registration, allocation and the stage series.
    assert!(
        counter(
            &got,
            "gpu_node_agent_plugin_registrations_total",
            &[("resource", "nvidia.com/gpu")]
        ) >= Some(1.0)
    );
    assert_eq!(
        counter(
            &got,
            "gpu_node_agent_plugin_allocations_total",
            &[("resource", "nvidia.com/gpu")]
        ),
        Some(1.0)
    );
    assert_eq!(
        counter(
            &got,
            "gpu_node_agent_stage_state",
            &[("stage", "device-plugin"), ("state", "ok")]
        ),
        Some(1.0),
        "{body}"
    );
    assert!(
        counter(
            &got,
            "gpu_node_agent_stage_duration_seconds_count",
            &[("stage", "device-plugin")]
        ) >= Some(1.0)
    );

    // Each HELP text names the label values the agent emits.
    for (family, values) in [
        (
            "gpu_node_agent_health_transitions",
            &["Healthy", "Unhealthy", "xid", "lost", "recovered", "answering"][..],
        ),
        ("gpu_node_agent_api_requests", &["get", "watch", "patch", "create"][..]),
        (
            "gpu_node_agent_memory_limit_actions",
            &["warned", "would_kill", "terminated", "killed"][..],
        ),
    ] {
        let help = got.docs.get(family).map(String::as_str).unwrap_or_default();
        for v in values {
            assert!(help.contains(v), "HELP of {family} does not name {v}: {help}");
        }
    }

    assert_eq!(agent.stop(), 0);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    kubelet.stop().await;
}
