//! The validation stage (last): driver, runtime, CUDA and device plugin checks, with the real
//! binary, the fake NVML and the test kubelet. A failed check is reported in status and the
//! validation label; the device plugin keeps serving.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::Node;
use gpu_node_agent::status::{StageId, StageState, Status};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(15);

fn node(extra: &str) -> Node {
    Node::new(
        &common::machine("A100-SXM4-40GB", 2),
        &format!("[kubernetes]\nenabled = false\n{extra}"),
    )
}

/// `run --once` failing (exit 1): the validation stage's error.
fn validation_error_of_a_failed_pass(node: &Node) -> String {
    node.run_once(1);
    common::stage_error(&node.status(), StageId::Validation)
        .unwrap_or_default()
        .to_string()
}

fn executable(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
    std::fs::write(path, body).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_passes_or_is_not_applicable_on_a_healthy_node() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), "");
    let api = common::api_server_for(&node, &[]).await;
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Ok));
    let detail = common::stage_detail(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        detail,
        "driver ok, runtime skipped, cuda skipped, device-plugin ok",
        "{}",
        agent.log_text()
    );
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("success")
    );
    // Passing from the start is no recovery: no validation Event at all.
    common::another_pass(&agent).await;
    for reason in ["ValidationFailed", "ValidationRecovered"] {
        assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
    }
    drop(kubelet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_missing_from_nvml_fails_validation_and_the_plugin_keeps_serving() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 2), "");
    let api = common::api_server_for(&node, &[]).await;
    // A third NVIDIA GPU on the PCI bus that NVML does not see (fell off the bus, vfio-pci).
    let extra = node.root.join("sys/bus/pci/devices/0000:c1:00.0");
    for (file, value) in [("vendor", "0x10de\n"), ("device", "0x20b0\n"), ("class", "0x030200\n")] {
        std::fs::create_dir_all(&extra).expect("mkdir");
        std::fs::write(extra.join(file), value).expect("write");
    }
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Failed));
    let error = common::stage_error(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("driver:") && error.contains("NVML sees 2"), "{error}");
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("failed")
    );
    let devices = kubelet
        .wait_for_devices("nvidia.com/gpu", T, |d| d.len() == 2)
        .await
        .expect("the device plugin keeps serving both GPUs");
    assert_eq!(devices.len(), 2, "{}", agent.log_text());

    // Failed once: one Warning, however many passes stay failed.
    let event = common::event_posted(&api, "ValidationFailed").await;
    common::assert_event(&event, "Warning", &["validation stage failed", "NVML sees 2"]);
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "ValidationFailed").len(),
        1,
        "{:?}",
        api.events()
    );
    assert!(common::events_with(&api, "ValidationRecovered").is_empty());

    // The GPU gone from the bus: validation passes again, posted once.
    std::fs::remove_dir_all(&extra).expect("rm");
    common::another_pass(&agent).await;
    node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Ok));
    let event = common::event_posted(&api, "ValidationRecovered").await;
    common::assert_event(&event, "Normal", &["validation passes again", "driver ok"]);
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "ValidationRecovered").len(),
        1,
        "{:?}",
        api.events()
    );
    assert_eq!(
        common::events_with(&api, "ValidationFailed").len(),
        1,
        "{:?}",
        api.events()
    );
}

#[test]
fn an_engine_that_is_not_active_fails_the_runtime_check() {
    let node = node("");
    executable(&node.root.join("usr/bin/nvidia-container-runtime"), "#!/bin/sh\n");
    std::fs::create_dir_all(node.root.join("lib/systemd/system")).expect("mkdir");
    std::fs::write(node.root.join("lib/systemd/system/containerd.service"), "[Unit]\n").expect("unit");
    // systemctl says containerd is down.
    executable(
        &node.root.join("usr/bin/systemctl"),
        "#!/bin/sh\n[ \"$1\" = is-active ] && { echo failed; exit 3; }\nexit 0\n",
    );
    node.run_once(1);
    let status = node.status();
    let error = common::stage_error(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("runtime: containerd.service is failed"), "{error}");
    assert_eq!(
        common::stage(&status, StageId::Runtime).state,
        StageState::Ok,
        "the runtime stage itself wrote its files"
    );
}

#[test]
fn cuda_is_not_available_without_libcuda_and_fails_cleanly_with_a_broken_one() {
    let node = node("");
    let out = node.run(&["validate", "cuda"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("CUDA not available: no libcuda.so.1 under the driver root /"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // A libcuda whose cuInit finds no device, as on a node whose driver lost its GPUs.
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("cuda.c");
    std::fs::write(
        &src,
        "int cuInit(unsigned f) { (void)f; return 100; }\n\
         int cuGetErrorString(int e, const char **s) { (void)e; *s = \"no CUDA-capable device is detected\"; return 0; }\n\
         #define STUB(n) int n(void) { return 999; }\n\
         STUB(cuDriverGetVersion) STUB(cuDeviceGetCount) STUB(cuDeviceGet) STUB(cuDeviceGetName)\n\
         STUB(cuDeviceGetPCIBusId)\n\
         STUB(cuCtxCreate_v2) STUB(cuCtxDestroy_v2) STUB(cuMemAlloc_v2) STUB(cuMemFree_v2)\n\
         STUB(cuMemcpyDtoH_v2) STUB(cuModuleLoadData) STUB(cuModuleGetFunction) STUB(cuLaunchKernel)\n\
         STUB(cuCtxSynchronize)\n",
    )
    .expect("source");
    let lib = node.root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(built.success());
    let out = node.run(&["validate", "cuda", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(answer["result"], "failed");
    assert_eq!(
        answer["reason"],
        "cuInit: CUDA error 100 (no CUDA-capable device is detected)"
    );

    // The stage runs the same check in a child process and reports it.
    let error = validation_error_of_a_failed_pass(&node);
    assert!(error.contains("cuda: cuInit: CUDA error 100"), "{error}");
}

/// Where the fake libcuda counts its `cuInit` calls, one line each.
fn cuda_runs(node: &Node) -> std::path::PathBuf {
    node.tmp.path().join("cuda-runs")
}

/// Builds a fake `libcuda.so.1` under the node's driver root that sees `count` devices, all
/// A100s: CUDA ordinal `n` is the GPU at bus `0x11 - n` (fastest first: ordinal 0 is NVML's
/// GPU 1 at `00000000:11:00.0`), and the kernel launch fails on ordinal `fail` (-1: none).
fn fake_libcuda(node: &Node, count: u32, fail: i32) {
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("cuda.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int current = -1;
int cuInit(unsigned f) { (void)f; FILE *r = fopen(RUNS, "a"); if (r) { fputs("cuInit\n", r); fclose(r); } return 0; }
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuDeviceGetCount(int *n) { *n = COUNT; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetName(char *s, int len, int d) { (void)d; snprintf(s, len, "NVIDIA A100-SXM4-40GB"); return 0; }
int cuDeviceGetPCIBusId(char *s, int len, int d) { snprintf(s, len, "0000:%02X:00.0", 0x11 - d); return 0; }
int cuCtxCreate_v2(void **c, unsigned f, int d) { (void)f; current = d; *c = (void *)(long)(d + 1); return 0; }
int cuCtxDestroy_v2(void *c) { (void)c; current = -1; return 0; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { *p = (unsigned long long)(size_t)calloc(1, n); return 0; }
int cuMemFree_v2(unsigned long long p) { free((void *)(size_t)p); return 0; }
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) { memcpy(dst, (void *)(size_t)src, n); return 0; }
int cuModuleLoadData(void **m, const void *ptx) { (void)ptx; *m = (void *)1; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *n) { (void)m; (void)n; *f = (void *)1; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **args, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
    if (current == FAIL) return 719;
    unsigned *out = (unsigned *)(size_t)*(unsigned long long *)args[0];
    for (unsigned i = 0; i < bx; i++) out[i] = 2 * i;
    return 0;
}
int cuCtxSynchronize(void) { return 0; }
int cuGetErrorString(int e, const char **s) { *s = e == 719 ? "unspecified launch failure" : "error"; return 0; }
"#,
    )
    .expect("source");
    let lib = node.root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1");
    std::fs::create_dir_all(lib.parent().expect("dir")).expect("mkdir");
    let built = std::process::Command::new("cc")
        .args([
            "-shared",
            "-fPIC",
            &format!("-DCOUNT={count}"),
            &format!("-DFAIL={fail}"),
            &format!("-DRUNS=\"{}\"", cuda_runs(node).display()),
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(built.success());
}

/// CUDA numbers devices fastest first, not as NVML does: a device that fails the kernel is named
/// by its NVML index, UUID and bus id (matched on the bus id libcuda reports).
#[test]
fn a_gpu_failing_the_cuda_kernel_is_named_as_nvml_knows_it() {
    let node = node("");
    fake_libcuda(&node, 2, 0);
    let out = node.run(&["validate", "cuda", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(answer["result"], "failed");
    assert_eq!(
        answer["reason"],
        "CUDA device 0 (NVIDIA A100-SXM4-40GB, PCI 0000:11:00.0): cuLaunchKernel: CUDA error 719 (unspecified \
         launch failure)"
    );
    assert_eq!(answer["devices"][0]["pci_bus_id"], "0000:11:00.0");

    let error = validation_error_of_a_failed_pass(&node);
    assert!(
        error.contains(&format!(
            "cuda: GPU 1 ({}, 00000000:11:00.0; CUDA device 0): cuLaunchKernel: CUDA error 719",
            common::gpu_uuid(1)
        )),
        "{error}"
    );
}

/// CUDA seeing fewer GPUs than NVML fails the check, naming the GPU CUDA does not see.
#[test]
fn a_gpu_cuda_does_not_see_fails_the_cuda_check_naming_it() {
    let node = node("");
    fake_libcuda(&node, 1, -1);
    let out = node.run(&["validate", "cuda"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("CUDA 12.4: the check kernel ran on 1 GPU(s): 0: NVIDIA A100-SXM4-40GB (0000:11:00.0)"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let error = validation_error_of_a_failed_pass(&node);
    assert!(
        error.contains(&format!(
            "cuda: CUDA sees 1 device(s) but NVML sees 2 GPU(s): not a CUDA device: GPU 0 ({}, 00000000:10:00.0)",
            common::gpu_uuid(0)
        )),
        "{error}"
    );

    // Both GPUs seen and working: the check passes.
    fake_libcuda(&node, 2, -1);
    let out = node.run(&["run", "--once"]);
    let status = node.status();
    assert!(
        common::stage_detail(&status, StageId::Validation)
            .unwrap_or_default()
            .contains("cuda ok"),
        "{status:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn without_a_kubelet_the_device_plugin_check_waits() {
    let node = node("");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| {
        common::stage_is(s, StageId::Validation, StageState::Pending)
            && common::stage_error(s, StageId::Validation).is_some()
    });
    let error = common::stage_error(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("device-plugin: the kubelet is not running"),
        "{error}: {}",
        agent.log_text()
    );
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("pending")
    );
}

/// The running agent serves its metrics: GPU readings with dcgm-exporter's names and the
/// stage states, the validation stage's among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_agent_serves_dcgm_and_stage_metrics() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let node = node(&format!(
        "[metrics]\naddress = \"127.0.0.1:{port}\"\ninterval = \"100ms\"\n"
    ));
    let _kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Ok));
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = std::time::Instant::now() + T;
    let (head, body) = loop {
        let (head, body) = common::scrape::request(addr, "GET", "/metrics", None).unwrap_or_default();
        if body.contains("DCGM_FI_DEV_GPU_TEMP{") && body.contains("stage=\"validation\",state=\"ok\"") {
            break (head, body);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "metrics never complete: {body}\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains(&format!("UUID=\"{}\"", common::gpu_uuid(0))), "{body}");
    assert!(body.contains("Hostname=\"gpu-node-1\""), "{body}");
    assert!(
        body.contains("gpu_node_agent_plugin_registrations_total{resource=\"nvidia.com/gpu\"}"),
        "{body}"
    );
}

/// A kubelet that accepts every `Register` and never dials back: it does not watch anything
/// (as a kubelet that is wedged, or still starting its device manager).
struct SilentKubelet;

#[tonic::async_trait]
impl gpu_node_agent::api::registration_server::Registration for SilentKubelet {
    async fn register(
        &self,
        _: tonic::Request<gpu_node_agent::api::RegisterRequest>,
    ) -> Result<tonic::Response<gpu_node_agent::api::Empty>, tonic::Status> {
        Ok(tonic::Response::new(gpu_node_agent::api::Empty {}))
    }
}

/// Registration is not enough: until the kubelet has a ListAndWatch stream open for the
/// resource the device plugin check waits, and it waits again when the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_resource_nobody_watches_keeps_the_device_plugin_check_waiting() {
    use gpu_node_agent::api::device_plugin_client::DevicePluginClient;
    use gpu_node_agent::api::registration_server::RegistrationServer;

    let node = node("");
    let dir = node.plugin_dir();
    std::fs::create_dir_all(&dir).expect("mkdir");
    let listener = tokio::net::UnixListener::bind(dir.join("kubelet.sock")).expect("bind kubelet.sock");
    let kubelet = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(SilentKubelet))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let agent = node.spawn();
    let waiting = |s: &Status| {
        common::stage_is(s, StageId::Validation, StageState::Pending)
            && common::stage_error(s, StageId::Validation)
                .is_some_and(|e| e.contains("device-plugin: registered, but the kubelet has no ListAndWatch stream"))
    };
    let status = node.wait_status(T, |s| {
        waiting(s) && common::stage_is(s, StageId::DevicePlugin, StageState::Ok)
    });
    let error = common::stage_error(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert!(error.ends_with("open yet: nvidia.com/gpu"), "{error}");
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("pending")
    );

    // The test watches in the kubelet's place: the check passes with what was listed.
    let channel = test_kubelet::unix_channel(dir.join("nvidia-gpu.sock"))
        .await
        .expect("connect to the plugin");
    let mut stream = DevicePluginClient::new(channel)
        .list_and_watch(gpu_node_agent::api::Empty {})
        .await
        .expect("ListAndWatch")
        .into_inner();
    let first = stream.message().await.expect("a message").expect("the device list");
    assert_eq!(first.devices.len(), 2);
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Ok));
    assert_eq!(
        common::stage_detail(&status, StageId::Validation),
        Some("driver ok, runtime skipped, cuda skipped, device-plugin ok"),
        "{}",
        agent.log_text()
    );

    // The watcher hangs up: waiting again.
    drop(stream);
    node.wait_status(T, waiting);
    kubelet.abort();
}

/// GPUs the plan cannot advertise (single MIG strategy over two different MIG profiles) fail
/// the device plugin check instead of passing it with nothing registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_with_nothing_advertised_fail_the_device_plugin_check() {
    let node = Node::new(
        common::H100_MIG,
        "[kubernetes]\nenabled = false\n[device_plugin]\nmig_strategy = \"single\"\n",
    );
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Validation, StageState::Failed));
    let error = common::stage_error(&status, StageId::Validation)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.starts_with("device-plugin: no device advertised to the kubelet for 2 GPU(s): "),
        "{error}: {}",
        agent.log_text()
    );
    assert_eq!(
        common::label(&status, "nvidia.com/gpu-node-agent.validation.state"),
        Some("failed")
    );
    assert!(kubelet.resources().is_empty(), "{:?}", kubelet.resources());
}

/// A MIG change makes the CUDA check run again (it is otherwise kept for a day per driver
/// version): the GPUs it passed on no longer look that way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_change_runs_the_cuda_check_again() {
    let node = Node::new(
        &common::machine("A100-SXM4-40GB", 2),
        "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n\
         [agent]\nresync_interval = \"1s\"\n",
    );
    fake_libcuda(&node, 2, -1);
    let labels = node.root.join("etc/gpu-node-agent/labels");
    std::fs::write(&labels, "# none yet\n").expect("labels");
    let runs = || {
        std::fs::read_to_string(cuda_runs(&node))
            .unwrap_or_default()
            .lines()
            .count()
    };
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while runs() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the CUDA check never ran: {:?}",
            common::find_stage(&node.status(), StageId::Validation)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let first = runs();
    std::fs::write(&labels, "nvidia.com/mig.config=all-1g.5gb\n").expect("label");
    node.wait_status(std::time::Duration::from_secs(30), |s| {
        common::label(s, "nvidia.com/mig.config.state") == Some("success")
    });
    while runs() == first {
        assert!(
            std::time::Instant::now() < deadline + std::time::Duration::from_secs(30),
            "the CUDA check did not run again after the MIG change ({first} runs before): {:?}",
            common::find_stage(&node.status(), StageId::Validation)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(agent.stop(), 0);
    drop(kubelet);
}
