//! DCGM's profiling fields (`DCGM_FI_PROF_*`) from NVML GPM, against the fake NVML library
//! and the test kubelet: absent on the first readings interval (GPM needs two samples), then
//! on the second with the fake's configured activity in DCGM's units, per GPU and per MIG GPU
//! instance with the labels of the other DCGM series; absent on GPUs without GPM (A100, T4).
//! One test function: the fake library is a process-wide singleton configured through the
//! environment.

mod common;

use std::time::Duration;

use common::scrape::{LabelSet, gauge_value, gauges, parse};
use gpu_node_agent::metrics::{Metrics, PROF_FIELDS};
use prometheus_parse::Scrape;
use test_kubelet::PodContainer;

const H100: &str = "GPU-00000000-1111-2222-3333-444455556666";
const H100_MIG: &str = "GPU-00000001-1111-2222-3333-444455556666";
const A100: &str = "GPU-00000002-1111-2222-3333-444455556666";
const T4: &str = "GPU-00000003-1111-2222-3333-444455556666";
const MIB: f64 = 1024.0 * 1024.0;

/// GPU 0: an H100 with every GPM value fixed. GPU 1: an H100 in MIG mode, GPU instance 2
/// (3g.40gb at slice 4) with a fixed tensor activity and GPU instance 3 (2g.20gb at slice 0)
/// following its load. GPU 2: an A100, GPU 3: a T4 (no GPM).
const MACHINE: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "H100-80GB-HBM3"
uuid = "GPU-00000000-1111-2222-3333-444455556666"
pci_bus_id = "00000000:07:00.0"
nvlink_peers = ["00000000:0F:00.0"]
[gpu.gpm]
graphics = 0.9
sm_active = 0.8
sm_occupancy = 0.3
tensor = 0.4
dram = 0.5
fp64 = 0.05
fp32 = 0.25
fp16 = 0.125
pcie_tx_bytes = 1048576000
pcie_rx_bytes = 524288000
nvlink_tx_bytes = 10485760000
nvlink_rx_bytes = 5242880000

[[gpu]]
model = "H100-80GB-HBM3"
uuid = "GPU-00000001-1111-2222-3333-444455556666"
pci_bus_id = "00000000:0F:00.0"
mig_mode = true
[[gpu.mig_device]]
profile = "3g.40gb"
placement = 4
[[gpu.mig_device]]
profile = "2g.20gb"
placement = 0
[gpu.gpm.instance.2]
tensor = 0.7

[[gpu]]
model = "A100-SXM4-40GB"
uuid = "GPU-00000002-1111-2222-3333-444455556666"
pci_bus_id = "00000000:17:00.0"

[[gpu]]
model = "T4"
uuid = "GPU-00000003-1111-2222-3333-444455556666"
pci_bus_id = "00000000:1F:00.0"
"#;

/// The labels of the `DCGM_FI_DEV_FB_USED` series of GPU `uuid` (GPU instance `gi`).
fn labels_of(scrape: &Scrape, uuid: &str, gi: Option<&str>) -> LabelSet {
    gauges(scrape, "DCGM_FI_DEV_FB_USED")
        .into_iter()
        .map(|(l, _)| l)
        .find(|l| l["UUID"] == uuid && l.get("GPU_I_ID").map(String::as_str) == gi)
        .unwrap_or_else(|| panic!("FB_USED of {uuid} {gi:?}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiling_series_come_from_gpm_on_hopper_from_the_second_interval() {
    let node = common::Node::new(MACHINE, "[kubernetes]\nenabled = false\n");
    // SAFETY of set_var: this test binary has this one test, and nothing else runs yet.
    let gpus = unsafe { common::open_fake_nvml(&node) };
    let inventory = gpus.inventory(&node.root.join("sys")).expect("inventory");
    let mig = &inventory.gpus[1].mig_devices;
    let gi = |profile: &str| mig.iter().find(|m| m.profile == profile).expect(profile);
    assert_eq!(gi("3g.40gb").gi_id, 2, "{mig:?}");
    assert_eq!(gi("2g.20gb").gi_id, 3, "{mig:?}");

    // One process on GPU instance 3: 30 % busy, so tensor 0.15 by the fake's defaults.
    let busy = gi("2g.20gb").uuid.clone();
    fake_nvml::write_processes(&node.state, &[(busy.as_str(), 300, 512)]).expect("processes");

    let (kubelet, socket) = common::scrape::kubelet_with_pod_resources(&node).await;
    kubelet.assign(
        "nvidia.com/gpu",
        &[H100],
        &PodContainer::new("ml", "trainer-0", "worker"),
    );
    kubelet.assign(
        "nvidia.com/mig-2g.20gb",
        &[busy.as_str()],
        &PodContainer::new("infer", "server", "main"),
    );

    let metrics = Metrics::new();
    let (mut sampler, _inventory_tx) =
        common::scrape::hand_ticked_sampler(&gpus, &metrics, inventory.clone(), "gpu-node-1", Some(socket.clone()));

    // First interval: the other series, no profiling series (GPM has one sample per device).
    assert!(sampler.tick().await);
    let first = metrics.encode().expect("encode");
    assert!(first.contains("DCGM_FI_DEV_FB_USED{"), "{first}");
    assert!(
        !first.contains("DCGM_FI_PROF_"),
        "no profiling series on the first interval:\n{first}"
    );

    // Second interval: rates between the two samples.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(sampler.tick().await);
    let body = metrics.encode().expect("encode");
    let scrape = parse(&body);

    for field in PROF_FIELDS {
        assert!(
            body.contains(&format!("# HELP {} {}\n", field.name, field.help)),
            "{}",
            field.name
        );
        assert!(
            body.contains(&format!("# TYPE {} gauge\n", field.name)),
            "{}",
            field.name
        );
    }
    assert_eq!(
        scrape.docs["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"],
        "Ratio of cycles the tensor (HMMA) pipe is active."
    );

    // GPU 0: every field, in DCGM's units (ratios; bytes per second), with the labels its other
    // DCGM series have (pod labels included).
    let h100 = labels_of(&scrape, H100, None);
    assert_eq!(h100["pod"], "trainer-0", "{h100:?}");
    let expected: &[(&str, f64)] = &[
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.9),
        ("DCGM_FI_PROF_SM_ACTIVE", 0.8),
        ("DCGM_FI_PROF_SM_OCCUPANCY", 0.3),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.4),
        ("DCGM_FI_PROF_DRAM_ACTIVE", 0.5),
        ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", 0.05),
        ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", 0.25),
        ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", 0.125),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", 1000.0 * MIB),
        ("DCGM_FI_PROF_PCIE_RX_BYTES", 500.0 * MIB),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", 10_000.0 * MIB),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", 5_000.0 * MIB),
    ];
    assert_eq!(expected.len(), PROF_FIELDS.len());
    for (name, want) in expected {
        let got = gauge_value(&scrape, name, &h100).unwrap_or_else(|| panic!("{name} of GPU 0 in:\n{body}"));
        assert!(close(got, *want), "{name}: {got} != {want}");
    }

    // GPU instance 2: its own tensor activity, GPU_I_PROFILE/GPU_I_ID labels; PCIe and NVLink
    // exist per GPU only.
    let gi2 = labels_of(&scrape, H100_MIG, Some("2"));
    assert_eq!(gi2["GPU_I_PROFILE"], "3g.40gb");
    let tensor = |l: &LabelSet| gauge_value(&scrape, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", l);
    assert!(close(tensor(&gi2).expect("GI 2 tensor"), 0.7), "{body}");
    assert_eq!(gauge_value(&scrape, "DCGM_FI_PROF_PCIE_TX_BYTES", &gi2), None);
    assert_eq!(gauge_value(&scrape, "DCGM_FI_PROF_NVLINK_RX_BYTES", &gi2), None);
    // GPU instance 3: from its load, with the pod that holds its MIG device.
    let gi3 = labels_of(&scrape, H100_MIG, Some("3"));
    assert_eq!(
        (gi3["GPU_I_PROFILE"].as_str(), gi3["pod"].as_str()),
        ("2g.20gb", "server")
    );
    assert!(close(tensor(&gi3).expect("GI 3 tensor"), 0.15), "{body}");
    assert!(close(
        gauge_value(&scrape, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", &gi3).expect("GI 3 gr"),
        0.3
    ));
    // The MIG GPU as a whole: its instances weighted by compute slices (3 × 0.7 + 2 × 0.15) / 7.
    let whole = labels_of(&scrape, H100_MIG, None);
    assert!(close(
        tensor(&whole).expect("GPU 1 tensor"),
        (3.0 * 0.7 + 2.0 * 0.15) / 7.0
    ));
    // Every profiling series belongs to a device the other DCGM series have.
    let devices: Vec<LabelSet> = gauges(&scrape, "DCGM_FI_DEV_FB_USED")
        .into_iter()
        .map(|(l, _)| l)
        .collect();
    for field in PROF_FIELDS {
        for (l, v) in gauges(&scrape, field.name) {
            assert!(devices.contains(&l), "{}: labels {l:?} match no device", field.name);
            assert!(v.is_finite() && v >= 0.0, "{}: {v}", field.name);
        }
    }

    // GPUs without GPM: no profiling series at all.
    for uuid in [A100, T4] {
        assert!(
            body.contains(&format!("UUID=\"{uuid}\"")),
            "{uuid} has its other series"
        );
        for field in PROF_FIELDS {
            assert!(
                gauges(&scrape, field.name).iter().all(|(l, _)| l["UUID"] != uuid),
                "{} on {uuid}",
                field.name
            );
        }
    }

    // A later interval follows a change of load: a second process on GPU instance 3.
    fake_nvml::write_processes(&node.state, &[(busy.as_str(), 300, 512), (busy.as_str(), 301, 512)])
        .expect("processes");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(sampler.tick().await);
    let body = metrics.encode().expect("encode");
    let scrape = parse(&body);
    let gi3 = labels_of(&scrape, H100_MIG, Some("3"));
    let now = gauge_value(&scrape, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", &gi3).expect("GI 3 tensor");
    assert!(close(now, 0.3), "two processes: 60 % busy, tensor 0.3; got {now}");

    kubelet.stop().await;
}
