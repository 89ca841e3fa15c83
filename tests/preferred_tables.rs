//! go-gpuallocator's topology tables, as fake-NVML machine files (tests/fixtures/topology/),
//! through the real agent's GetPreferredAllocation: the fake NVML answers common ancestors and
//! NVLink remote PCI info, the agent scores pairs from them, and the test kubelet asks.
//!
//! Expected sets are go-gpuallocator's own test expectations (sets, compared sorted), from
//!   NVIDIA/go-gpuallocator gpuallocator/besteffort_test.go @ 2a5a762c17930bf4a0fdec4ff39cd155941cb56e
//! over the tables of
//!   NVIDIA/go-gpuallocator gpuallocator/common_test.go @ 304658a711467ba44189355dfab3f6b441732d77
//! Successive cases (`TestBestEffort*GPUAlloc*`, go-gpuallocator's `Allocator`) take each answer
//! out of the available list before the next request, as the kubelet does once a container has
//! its devices. Requests the kubelet never sends (a must-include device that is not available,
//! more must-include devices than the size) are refused with InvalidArgument instead of
//! go-gpuallocator's empty answer.

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(10);
const GPU: &str = "nvidia.com/gpu";

/// A running agent on a machine file from tests/fixtures/topology and its kubelet.
struct Bench {
    kubelet: TestKubelet,
    agent: common::Agent,
    _node: Node,
}

impl Bench {
    async fn start(fixture: &str, gpus: usize, config: &str) -> Bench {
        let path = format!("{}/tests/fixtures/topology/{fixture}", env!("CARGO_MANIFEST_DIR"));
        let machine = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let node = Node::new(&machine, config);
        let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
            .await
            .expect("start test kubelet");
        let agent = node.spawn();
        kubelet
            .wait_for_devices(GPU, T, |d| d.len() == gpus)
            .await
            .unwrap_or_else(|e| panic!("{fixture}: {gpus} devices: {e}"));
        Bench {
            kubelet,
            agent,
            _node: node,
        }
    }

    /// The answer for GPU indices `available` / `must`, as sorted indices.
    async fn ask(&self, available: &[u32], must: &[u32], size: i32) -> Result<Vec<u32>, tonic::Status> {
        let avail: Vec<String> = available.iter().map(|&i| gpu_uuid(i)).collect();
        let must: Vec<String> = must.iter().map(|&i| gpu_uuid(i)).collect();
        let a: Vec<&str> = avail.iter().map(String::as_str).collect();
        let m: Vec<&str> = must.iter().map(String::as_str).collect();
        let got = self.kubelet.preferred_allocation(GPU, &a, &m, size).await?;
        assert_eq!(got[..m.len()], must[..], "must-include devices come first");
        let mut idx: Vec<u32> = got
            .iter()
            .map(|u| {
                (0..64)
                    .find(|&i| gpu_uuid(i) == *u)
                    .unwrap_or_else(|| panic!("unknown {u}"))
            })
            .collect();
        idx.sort_unstable();
        Ok(idx)
    }

    /// go-gpuallocator's `RunAllocTests`: each `(size, want)` from what is left, then taken.
    async fn successive(&self, gpus: u32, steps: &[(i32, &[u32])], name: &str) {
        let mut free: Vec<u32> = (0..gpus).collect();
        for (step, &(size, want)) in steps.iter().enumerate() {
            if want.is_empty() {
                // go-gpuallocator answers nothing when too few are left; the kubelet never asks.
                assert!(free.len() < size as usize, "{name} step {step}");
                let err = self.ask(&free, &[], size).await.unwrap_err();
                assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name} step {step}");
                continue;
            }
            let got = self.ask(&free, &[], size).await.expect("preferred");
            assert_eq!(got, want, "{name} step {step}, free {free:?}");
            free.retain(|g| !got.contains(g));
        }
    }

    fn stop(self) {
        assert_eq!(self.agent.stop(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dgx1_volta() {
    let b = Bench::start("dgx1-volta.toml", 8, "").await;
    let all: &[u32] = &[0, 1, 2, 3, 4, 5, 6, 7];
    // TestBestEffortAllocate: (description, available, must-include, size, want).
    type Case<'a> = (&'a str, &'a [u32], &'a [u32], i32, &'a [u32]);
    let cases: [Case; 9] = [
        ("Single NVLINK, prefer same switch", &[0, 2, 4, 5], &[], 2, &[4, 5]),
        ("Single NVLINK, prefer same socket", &[0, 4, 5, 6], &[], 2, &[5, 6]),
        ("Prefer dual NVLINK same socket", &[0, 3, 1], &[], 2, &[0, 3]),
        ("Prefer dual NVLINK cross socket", &[0, 1, 4], &[], 2, &[0, 4]),
        ("Must include with allocation size 1", all, &[4], 1, &[4]),
        ("Must include with allocation size 2", all, &[4], 2, &[4, 7]),
        ("Must include with allocation size 4", all, &[4], 4, &[4, 5, 6, 7]),
        (
            "Must include with full set specified",
            all,
            &[0, 2, 4, 6],
            4,
            &[0, 2, 4, 6],
        ),
        ("Must include, size 8", all, &[3], 8, all),
    ];
    for (name, avail, must, size, want) in cases {
        let got = b.ask(avail, must, size).await.expect(name);
        assert_eq!(got, want, "{name}");
    }
    let refused: [(&str, &[u32], &[u32], i32); 3] = [
        (
            "Must include with unavailable device",
            &[1, 2, 3, 4, 5, 6, 7],
            &[0, 1, 2, 3],
            4,
        ),
        (
            "Must include with too many devices specified",
            all,
            &[1, 2, 3, 4, 5, 6],
            4,
        ),
        (
            "Required too many devices than available",
            &[1, 2, 3, 4, 5],
            &[1, 2, 3, 4, 5, 6],
            1,
        ),
    ];
    for (name, avail, must, size) in refused {
        let err = b.ask(avail, must, size).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name}");
    }
    let ones: Vec<(i32, &[u32])> = (0..8usize).map(|i| (1, &all[i..=i])).chain([(1, &[][..])]).collect();
    b.successive(8, &ones, "TestBestEffortDGX1VoltaGPUAllocOne").await;
    b.successive(
        8,
        &[(2, &[0, 3]), (2, &[1, 2]), (2, &[4, 7]), (2, &[5, 6]), (1, &[])],
        "TestBestEffortDGX1VoltaGPUAllocTwo",
    )
    .await;
    b.successive(
        8,
        &[(4, &[0, 1, 2, 3]), (4, &[4, 5, 6, 7]), (1, &[])],
        "TestBestEffortDGX1VoltaGPUAllocFour",
    )
    .await;
    b.successive(8, &[(8, all), (1, &[])], "TestBestEffortDGX1VoltaGPUAllocEight")
        .await;
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dgx1_pascal() {
    let b = Bench::start("dgx1-pascal.toml", 8, "").await;
    let all: &[u32] = &[0, 1, 2, 3, 4, 5, 6, 7];
    let ones: Vec<(i32, &[u32])> = (0..8usize).map(|i| (1, &all[i..=i])).chain([(1, &[][..])]).collect();
    b.successive(8, &ones, "TestBestEffortDGX1PascalGPUAllocOne").await;
    b.successive(
        8,
        &[(2, &[0, 2]), (2, &[1, 3]), (2, &[4, 6]), (2, &[5, 7]), (1, &[])],
        "TestBestEffortDGX1PascalGPUAllocTwo",
    )
    .await;
    b.successive(
        8,
        &[(4, &[0, 1, 2, 3]), (4, &[4, 5, 6, 7]), (1, &[])],
        "TestBestEffortDGX1PascalGPUAllocFour",
    )
    .await;
    b.successive(8, &[(8, all), (1, &[])], "TestBestEffortDGX1PascalGPUAllocEight")
        .await;
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rtx8000_4x() {
    let b = Bench::start("rtx8000-4x.toml", 4, "").await;
    b.successive(
        4,
        &[(1, &[0]), (1, &[1]), (1, &[2]), (1, &[3]), (1, &[])],
        "TestBestEffort4xRTX8000GPUAllocOne",
    )
    .await;
    b.successive(
        4,
        &[(2, &[0, 3]), (2, &[1, 2]), (1, &[])],
        "TestBestEffort4xRTX8000GPUAllocTwo",
    )
    .await;
    b.successive(
        4,
        &[(4, &[0, 1, 2, 3]), (1, &[])],
        "TestBestEffort4xRTX8000GPUAllocFour",
    )
    .await;
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_set_in_the_last_slot_of_the_best_partition() {
    // TestBestEffortAllocateRetainsBestPartition: 14 GPUs, the four-link pair 12-13 is the
    // best set of the best partition of pairs.
    let b = Bench::start("nvlink-pairs-14.toml", 14, "").await;
    let all: Vec<u32> = (0..14).collect();
    assert_eq!(b.ask(&all, &[], 2).await.expect("preferred"), [12, 13]);
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvswitch_links_score_nothing() {
    // Our own table (see the fixture): NVLinks end at NVSwitches, so go-gpuallocator's rules
    // leave only PCIe to decide: pairs under one PCIe switch chain, then host-bridge halves.
    let b = Bench::start("hgx-a100-nvswitch.toml", 8, "").await;
    b.successive(8, &[(2, &[0, 1]), (2, &[2, 3]), (2, &[4, 5]), (2, &[6, 7])], "pairs")
        .await;
    b.successive(8, &[(4, &[0, 1, 2, 3]), (4, &[4, 5, 6, 7])], "quads")
        .await;
    // Must-include GPU 5: its switch partner.
    assert_eq!(
        b.ask(&(0..8).collect::<Vec<_>>(), &[5], 2).await.expect("preferred"),
        [4, 5]
    );
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_sliced_replicas_follow_the_policy() {
    // Issue 19's example: 8 GPUs × 4 replicas, one replica each of GPUs 0 and 1 in use, a
    // container asks for 2. NVIDIA's packed takes both from GPU 0 (its greedy loop keeps the
    // most allocated GPU); distributed and spread take the idle GPUs 2 and 3.
    let replica = |g: u32, n: u32| format!("{}::{n}", gpu_uuid(g));
    let free: Vec<String> = (0..8)
        .flat_map(|g| (0..4).map(move |n| (g, n)))
        .filter(|&(g, n)| !(n == 0 && g < 2))
        .map(|(g, n)| replica(g, n))
        .collect();
    let refs: Vec<&str> = free.iter().map(String::as_str).collect();
    for (policy, want) in [
        ("packed", [replica(0, 1), replica(0, 2)]),
        ("distributed", [replica(2, 0), replica(3, 0)]),
        ("spread", [replica(2, 0), replica(3, 0)]),
    ] {
        let config = format!(
            "[device_plugin.sharing]\nstrategy = \"time-slicing\"\npolicy = \"{policy}\"\n\
             [[device_plugin.sharing.resources]]\nname = \"nvidia.com/gpu\"\nreplicas = 4\n"
        );
        let b = Bench::start("dgx1-volta.toml", 32, &config).await;
        let got = b
            .kubelet
            .preferred_allocation(GPU, &refs, &[], 2)
            .await
            .expect("preferred");
        assert_eq!(got, want, "{policy}");
        b.stop();
    }
}
