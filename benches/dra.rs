//! `cargo bench --bench dra`: the DRA driver's latencies, end to end with the real binary, the
//! fake NVML library, the test kubelet (device plugin and DRA sides) and the test API server,
//! printed as a table.
//!
//! | what | budget |
//! | start → DRA plugin registered | ≤ 200 ms |
//! | NodePrepareResources (1 claim, 1 GPU: claim GET, CDI spec, checkpoint) | ≤ 5 ms p50 |
//! | the same prepare repeated (answered from the checkpoint) / Allocate, back to back | ≤ 1.5× |
//!
//! Calls interleaved with prepares (which fsync the spec and the checkpoint) are slower on
//! both sockets than back to back; the table shows both.
//! | Xid → the GPU gone from the ResourceSlice | ≤ 1 s |

#[path = "../tests/common/mod.rs"]
mod common;
mod table;

use std::time::{Duration, Instant};

use common::{Node, api_server_and_kubelet, gpu_uuid, machine};
use serde_json::json;
use table::{Row, percentile, sorted};
use test_kubelet::dra::{ClaimRef, DraKubelet, DraOptions};

const GPU: &str = "nvidia.com/gpu";
const DRIVER: &str = "gpu.nvidia.com";
const T: Duration = Duration::from_secs(10);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn gpus_published(api: &test_apiserver::TestApiServer) -> Vec<String> {
    api.resource_slices()
        .values()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d["name"].as_str().map(str::to_string))
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rows = Vec::new();
    let config = "[log]\nlevel = \"warn\"\n[dra]\nenabled = true\n[health]\nrecovery_after = \"0s\"\n";
    let node = Node::new(&machine("A100-SXM4-40GB", 8), config);
    let (api, kubelet) = api_server_and_kubelet(&node, &[]).await;
    let opts = DraOptions {
        host_root: Some(node.root.clone()),
        ..DraOptions::default()
    };
    let dra = DraKubelet::start(&node.root.join("var/lib/kubelet/plugins_registry"), opts)
        .await
        .expect("DRA kubelet");

    // 1. Start → registered as a DRA plugin.
    let spawned = Instant::now();
    let agent = node.spawn();
    let reg = dra.wait_for_plugin(DRIVER, T).await.expect("registered");
    let start_ms = ms(reg.at.duration_since(spawned));
    rows.push(Row {
        what: "start → DRA plugin registered (8×A100), ms",
        value: format!("{start_ms:.1}"),
        budget: "≤ 200 ms",
        ok: start_ms <= 200.0,
    });
    assert!(api.wait_for(T, |a| gpus_published(a).len() == 8).await, "slices");
    kubelet
        .wait_for_devices(GPU, T, |d| d.len() == 8)
        .await
        .expect("devices");

    // 2. Prepare and unprepare, each claim new (GET, CDI spec, checkpoint, fsyncs), against
    //    Allocate on the device plugin's socket and the repeated (checkpointed) prepare.
    const N: usize = 300;
    let mut fresh = Vec::with_capacity(N);
    let mut repeated = Vec::with_capacity(N);
    let mut unprepare = Vec::with_capacity(N);
    let mut alloc = Vec::with_capacity(N);
    let mut empty = Vec::with_capacity(N);
    let id = gpu_uuid(1);
    for i in 0..N + 20 {
        let uid = format!("6f1e0a52-0000-4c4c-9d9d-{i:012}");
        api.create_resource_claim(json!({
            "metadata": {"namespace": "bench", "name": format!("c{i}"), "uid": uid},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": common::NODE_NAME, "device": "gpu-0"}]}}}
        }));
        let claim = [ClaimRef::new("bench", &format!("c{i}"), &uid)];
        let t = Instant::now();
        let answer = dra.prepare(DRIVER, &claim).await.expect("prepare");
        let first = t.elapsed();
        assert!(answer[&uid].is_ok(), "{answer:?}");
        let t = Instant::now();
        dra.prepare(DRIVER, &claim).await.expect("prepare again");
        let again = t.elapsed();
        let t = Instant::now();
        kubelet.allocate(GPU, &[&id]).await.expect("allocate");
        let allocated = t.elapsed();
        let t = Instant::now();
        dra.unprepare(DRIVER, &claim).await.expect("unprepare");
        let un = t.elapsed();
        // The plain round trip on the DRA socket: unprepare of no claim.
        let t = Instant::now();
        dra.unprepare(DRIVER, &[]).await.expect("empty unprepare");
        let nothing = t.elapsed();
        api.delete_resource_claim("bench", &format!("c{i}"));
        if i >= 20 {
            fresh.push(ms(first));
            repeated.push(ms(again));
            alloc.push(ms(allocated));
            unprepare.push(ms(un));
            empty.push(ms(nothing));
        }
    }
    // The same round trip back to back, and Allocate back to back, for comparison.
    let mut empty_b2b = Vec::with_capacity(N);
    let mut alloc_b2b = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        dra.unprepare(DRIVER, &[]).await.expect("empty unprepare");
        empty_b2b.push(ms(t.elapsed()));
    }
    for _ in 0..N {
        let t = Instant::now();
        kubelet.allocate(GPU, &[&id]).await.expect("allocate");
        alloc_b2b.push(ms(t.elapsed()));
    }
    // A prepared claim prepared again and again (the kubelet's repeat after its restart).
    let uid = "6f1e0a52-0000-4c4c-9d9d-ffffffffffff";
    api.create_resource_claim(json!({
        "metadata": {"namespace": "bench", "name": "kept", "uid": uid},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": common::NODE_NAME, "device": "gpu-0"}]}}}
    }));
    let kept = [ClaimRef::new("bench", "kept", uid)];
    dra.prepare(DRIVER, &kept).await.expect("prepare");
    let mut repeated_b2b = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        dra.prepare(DRIVER, &kept).await.expect("prepare again");
        repeated_b2b.push(ms(t.elapsed()));
    }
    dra.unprepare(DRIVER, &kept).await.expect("unprepare");
    let (empty_b2b, alloc_b2b, repeated_b2b) = (sorted(empty_b2b), sorted(alloc_b2b), sorted(repeated_b2b));
    let (fresh, repeated, alloc, unprepare, empty) = (
        sorted(fresh),
        sorted(repeated),
        sorted(alloc),
        sorted(unprepare),
        sorted(empty),
    );
    let p = |v: &[f64]| format!("{:.2} / {:.2}", percentile(v, 0.5), percentile(v, 0.99));
    rows.push(Row {
        what: "Allocate (1 GPU), between prepares, ms p50 / p99",
        value: p(&alloc),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "Allocate back to back, ms p50 / p99",
        value: p(&alloc_b2b),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "empty DRA call (unprepare of nothing), between, ms p50 / p99",
        value: p(&empty),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "the same, back to back, ms p50 / p99",
        value: p(&empty_b2b),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "NodePrepareResources (new claim, 1 GPU), ms p50 / p99",
        value: p(&fresh),
        budget: "≤ 5 ms p50",
        ok: percentile(&fresh, 0.5) <= 5.0,
    });
    rows.push(Row {
        what: "NodePrepareResources repeated (checkpoint), between, ms p50 / p99",
        value: p(&repeated),
        budget: "reference",
        ok: true,
    });
    rows.push(Row {
        what: "NodePrepareResources repeated back to back, ms p50 / p99",
        value: p(&repeated_b2b),
        budget: "reference",
        ok: true,
    });
    let ratio = percentile(&repeated_b2b, 0.5) / percentile(&alloc_b2b, 0.5);
    rows.push(Row {
        what: "repeated prepare / Allocate, back to back, p50 ratio",
        value: format!("{ratio:.2}×"),
        budget: "≤ 1.5×",
        ok: ratio <= 1.5,
    });
    rows.push(Row {
        what: "NodeUnprepareResources, ms p50 / p99",
        value: p(&unprepare),
        budget: "reference",
        ok: true,
    });

    // 3. Xid → the GPU gone from the slice.
    let mut gone = Vec::new();
    for i in 2..8 {
        let name = format!("gpu-{i}");
        let t = Instant::now();
        node.inject("xid", &format!("{} 79", gpu_uuid(i)));
        assert!(
            api.wait_for(T, |a| !gpus_published(a).contains(&name)).await,
            "{name} leaves the slice"
        );
        gone.push(ms(t.elapsed()));
    }
    let gone = sorted(gone);
    let max = gone[gone.len() - 1];
    rows.push(Row {
        what: "Xid → GPU gone from the ResourceSlice, ms p50 / max",
        value: format!("{:.1} / {max:.1}", percentile(&gone, 0.5)),
        budget: "≤ 1000 ms",
        ok: max <= 1000.0,
    });
    agent.stop();

    table::print(&rows, 58);
}
