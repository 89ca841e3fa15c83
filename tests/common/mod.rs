//! A simulated GPU node for integration tests: a temp root with the fake NVML library installed
//! where the real one would be, a fake-NVML machine file and state dir, the agent's config, and
//! helpers to run the real `gpu-node-agent` binary against it.

#![allow(dead_code)]

pub mod cri;
pub mod scrape;
pub mod status;

#[allow(unused_imports)]
pub use status::{
    desired, desired_error, desired_is, find_stage, label, read_status, stage, stage_detail, stage_error, stage_is,
};

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Where the test node's NVML library lives (a symlink to the fake), as on Debian/Ubuntu.
pub const NVML_PATH: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
pub const PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

pub const DGX_A100: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040
"#;

/// Two H100s with MIG devices: GPU 0 one 3g.40gb and two 2g.20gb, GPU 1 two 1g.10gb.
pub const H100_MIG: &str = r#"
driver_version = "550.54.15"
cuda_driver_version = 12040

[[gpu]]
model = "H100-80GB-HBM3"
uuid = "GPU-00000000-aaaa-bbbb-cccc-000000000000"
mig_mode = true
numa_node = 0
[[gpu.mig_device]]
profile = "3g.40gb"
placement = 4
[[gpu.mig_device]]
profile = "2g.20gb"
placement = 0
[[gpu.mig_device]]
profile = "2g.20gb"
placement = 2

[[gpu]]
model = "H100-80GB-HBM3"
uuid = "GPU-00000001-aaaa-bbbb-cccc-000000000000"
mig_mode = true
numa_node = 1
[[gpu.mig_device]]
profile = "1g.10gb"
[[gpu.mig_device]]
profile = "1g.10gb"
"#;

/// `n` GPUs of `model`, uuids `GPU-<model tag>-<i>`, NUMA node `i / (n/2)`.
/// Port 9 (discard) on loopback: nothing listens there, so a request sent through it fails.
const DEAD_PROXY: &str = "http://127.0.0.1:9";

pub fn machine(model: &str, n: u32) -> String {
    let mut m = DGX_A100.to_string();
    for i in 0..n {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"{model}\"\nuuid = \"{}\"\nnuma_node = {}\n",
            gpu_uuid(i),
            i / (n / 2).max(1)
        ));
    }
    m
}

/// The uuid `machine()` gives GPU `i`.
pub fn gpu_uuid(i: u32) -> String {
    format!("GPU-{i:08x}-1111-2222-3333-444455556666")
}

/// Points this process's NVML at the fake with `node`'s machine file and state dir, and opens it
/// (the in-process tests: one per test binary, or under the binary's own lock).
///
/// # Safety
///
/// It sets environment variables: no other thread of the process may read the environment
/// meanwhile.
pub unsafe fn open_fake_nvml(node: &Node) -> gpu_node_agent::nvml::Gpus {
    // SAFETY: the caller guarantees no other thread reads the environment.
    unsafe {
        std::env::set_var("FAKE_NVML_MACHINE", &node.machine);
        std::env::set_var("FAKE_NVML_STATE_DIR", &node.state);
    }
    gpu_node_agent::nvml::Gpus::open(&fake_nvml_library()).expect("fake NVML")
}

/// The fake NVML library the test binary was built with (a dev-dependency, so cargo builds its
/// cdylib into the same `deps` directory as this test executable).
pub fn fake_nvml_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir");
    for dir in [deps.to_path_buf(), deps.parent().expect("profile dir").to_path_buf()] {
        let lib = dir.join("libfake_nvml.so");
        if lib.exists() {
            return lib;
        }
    }
    panic!(
        "libfake_nvml.so not found next to {}: build the workspace (cargo build --workspace)",
        exe.display()
    );
}

/// Runs `cmd` to the end and asserts it succeeded; its standard output.
pub fn ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `mknod path c major minor` (parents created), for device nodes in the tests' trees.
pub fn char_node(path: &Path, major: u64, minor: u64) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    nix::sys::stat::mknod(
        path,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(major, minor),
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
}

/// `dlcheck`, for the container tests' images: `dlopen`s each name it is given and says how
/// each went (exit 1 when one failed).
pub const DLCHECK_C: &str = r#"#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
  int rc = 0;
  for (int i = 1; i < argc; i++) {
    if (dlopen(argv[i], RTLD_NOW)) { printf("dlopen %s: ok\n", argv[i]); }
    else { printf("dlopen %s: %s\n", argv[i], dlerror()); rc = 1; }
  }
  return rc;
}
"#;

/// The agent's CDI hook program as the packages ship it: `gpu-node-agent-cdi-hook` linked
/// statically (`crt-static`), built once into `target/static-hook/` (scripts/test builds it before
/// the tests; here it is only checked to be up to date).
pub fn cdi_hook_program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
            let dir = workspace.join("target/static-hook");
            let out = Command::new(env!("CARGO"))
                .current_dir(workspace)
                .args(["rustc", "--quiet", "--locked", "-p", "gpu-node-agent-cdi-hook"])
                .args(["--bin", "gpu-node-agent-cdi-hook", "--target-dir"])
                .arg(&dir)
                .args(["--", "-C", "target-feature=+crt-static"])
                .output()
                .expect("cargo rustc for the static hook program");
            assert!(
                out.status.success(),
                "building the static gpu-node-agent-cdi-hook: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            dir.join("debug/gpu-node-agent-cdi-hook")
        })
        .clone()
}

pub struct Node {
    pub tmp: TempDir,
    pub root: PathBuf,
    pub state: PathBuf,
    pub machine: PathBuf,
}

impl Node {
    /// A node whose GPUs are described by `machine` and whose agent config is `config`.
    pub fn new(machine: &str, config: &str) -> Node {
        let tmp = tempfile::Builder::new().prefix("gna").tempdir().expect("tempdir");
        let root = tmp.path().join("r");
        let state = tmp.path().join("nvml-state");
        let machine_path = tmp.path().join("machine.toml");
        fs::write(&machine_path, machine).expect("write machine");
        let nvml = root.join(NVML_PATH.trim_start_matches('/'));
        fs::create_dir_all(nvml.parent().expect("lib dir")).expect("mkdir lib");
        std::os::unix::fs::symlink(fake_nvml_library(), &nvml).expect("install fake NVML");
        fs::create_dir_all(root.join("etc")).expect("mkdir etc");
        fs::write(root.join("etc/hostname"), "gpu-node-1\n").expect("hostname");
        // What the host shows of these GPUs and their loaded driver (sysfs PCI functions, module
        // version, the MIG capability table); a machine the fake refuses gets none.
        if let Ok(parsed) = fake_nvml::machine::Machine::parse(machine) {
            fake_nvml::host::install(&parsed, &root).expect("install host files");
        }
        let node = Node {
            tmp,
            root,
            state,
            machine: machine_path,
        };
        node.write_config(config);
        node
    }

    /// Installs a stand-in for the NVIDIA Container Toolkit's runtime
    /// (`/usr/bin/nvidia-container-runtime`, an empty script): the agent's `auto` mode then gives
    /// the engines the `nvidia` runtime and hands GPUs out as `NVIDIA_VISIBLE_DEVICES`.
    pub fn install_toolkit_runtime(&self) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.root.join("usr/bin/nvidia-container-runtime");
        fs::create_dir_all(path.parent().expect("bin dir")).expect("mkdir bin");
        fs::write(&path, "#!/bin/sh\nexit 0\n").expect("write runtime");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod runtime");
    }

    pub fn config_path(&self) -> PathBuf {
        self.root.join("etc/gpu-node-agent/config.toml")
    }

    /// Writes the main config (`[nvml] library` pointing at the installed fake, a fast lost-GPU
    /// probe) and, when `extra` is not empty, the drop-in `config.d/50-test.toml` with `extra`,
    /// which overrides the main file key by key.
    pub fn write_config(&self, extra: &str) {
        let path = self.config_path();
        let dir = path.parent().expect("etc dir");
        fs::create_dir_all(dir.join("config.d")).expect("mkdir config dir");
        // Metrics on a free loopback port: tests run many agents at once. The machines boot with
        // the MIG devices a test describes, kept without a label (`default_layout = ""`; the
        // agent's default, `all-disabled` as under the GPU Operator, has tests of its own).
        let main = format!(
            "[nvml]\nlibrary = \"{NVML_PATH}\"\n\n[health]\nlost_check_interval = \"100ms\"\n\n[metrics]\naddress = \"127.0.0.1:0\"\n\n\
             [mig]\ndefault_layout = \"\"\n"
        );
        fs::write(&path, main).expect("write config");
        let dropin = dir.join("config.d/50-test.toml");
        if extra.is_empty() {
            let _ = fs::remove_file(dropin);
        } else {
            fs::write(dropin, extra).expect("write drop-in");
        }
    }

    /// Writes the drop-in `config.d/<name>` (read in name order, before `50-test.toml`).
    pub fn write_dropin(&self, name: &str, text: &str) {
        let path = self.config_path().with_file_name("config.d").join(name);
        fs::write(path, text).expect("write drop-in");
    }

    /// Makes the static [`cdi_hook_program`] the spec's hook program (`cdi.agent_path`).
    pub fn use_static_cdi_hook(&self) {
        self.write_dropin(
            "10-cdi-hook.toml",
            &format!("[cdi]\nagent_path = \"{}\"\n", cdi_hook_program().display()),
        );
    }

    pub fn plugin_dir(&self) -> PathBuf {
        self.root.join(PLUGIN_DIR.trim_start_matches('/'))
    }

    pub fn status_path(&self) -> PathBuf {
        self.root.join("run/gpu-node-agent/status.json")
    }

    /// The agent binary with this node's root and fake NVML environment.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-node-agent"));
        cmd.arg("--root").arg(&self.root).args(args);
        cmd.env("FAKE_NVML_MACHINE", &self.machine)
            .env("FAKE_NVML_STATE_DIR", &self.state)
            .env("RUST_LOG", "info,gpu_node_agent=debug")
            .env_remove("JOURNAL_STREAM")
            // The host's own cluster settings must not leak into a simulated node.
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .env_remove("NODE_NAME");
        // A proxy that answers nothing: the agent must reach the test API server and download
        // servers on loopback directly, as Go clients do, whatever proxy the host has set.
        for var in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            cmd.env(var, DEAD_PROXY);
        }
        cmd.env_remove("NO_PROXY").env_remove("no_proxy");
        cmd
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run gpu-node-agent")
    }

    /// Starts `gpu-node-agent run`; its log goes to a file shown when a test fails.
    pub fn spawn(&self) -> Agent {
        self.spawn_with_env(&[])
    }

    /// [`Node::spawn`] with more environment (the fake NVML's `FAKE_NVML_MUTATION_DELAY_MS`).
    pub fn spawn_with_env(&self, env: &[(&str, &str)]) -> Agent {
        self.spawn_with(|cmd| {
            cmd.envs(env.iter().copied());
        })
    }

    /// [`Node::spawn`] with the command adjusted by `adjust` first (limits, environment).
    pub fn spawn_with(&self, adjust: impl FnOnce(&mut Command)) -> Agent {
        let log = self
            .tmp
            .path()
            .join(format!("agent-{}.log", Instant::now().elapsed().as_nanos()));
        let file = fs::File::create(&log).expect("log file");
        let mut cmd = self.command(&["run"]);
        adjust(&mut cmd);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn gpu-node-agent");
        Agent {
            child: Some(child),
            log,
        }
    }

    /// [`Node::spawn`] running `program` instead of this build's agent (a bench's "before" build),
    /// with the same arguments and environment.
    pub fn spawn_program(&self, program: &Path) -> Agent {
        self.spawn_with(|cmd| {
            let mut other = Command::new(program);
            other.args(cmd.get_args());
            for (key, value) in cmd.get_envs() {
                match value {
                    Some(value) => other.env(key, value),
                    None => other.env_remove(key),
                };
            }
            *cmd = other;
        })
    }

    /// Where a kubeadm node keeps the kubelet's kubeconfig (`/etc/kubernetes`, under the root):
    /// a kubeconfig written there as `kubelet.conf` is found by the agent's default search.
    pub fn kubeconfig_dir(&self) -> PathBuf {
        let dir = self.root.join("etc/kubernetes");
        fs::create_dir_all(&dir).expect("mkdir /etc/kubernetes");
        dir
    }

    /// Writes `/etc/gpu-node-agent/labels` (`key=value` lines), the file a test's
    /// `[desired] labels_file` points at: the desired state without an API server.
    pub fn write_labels(&self, lines: &str) {
        fs::write(self.root.join("etc/gpu-node-agent/labels"), lines).expect("labels");
    }

    /// `run --once`, asserted to exit with `code` (its stderr shown when not); its output.
    pub fn run_once(&self, code: i32) -> Output {
        let out = self.run(&["run", "--once"]);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Appends a line to a fake-NVML injection file (`xid`, `processes`, `lost`).
    pub fn inject(&self, file: &str, line: &str) {
        fs::create_dir_all(&self.state).expect("state dir");
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.join(file))
            .expect("open injection file");
        writeln!(f, "{line}").expect("inject");
    }

    /// Replaces an injection file's content (for the "current set" files `lost`, `processes`).
    pub fn set_injection(&self, file: &str, content: &str) {
        fs::create_dir_all(&self.state).expect("state dir");
        fs::write(self.state.join(file), content).expect("write injection file");
    }

    pub fn sockets(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.plugin_dir())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// A running agent: SIGTERM on `stop`, SIGKILL on drop.
pub struct Agent {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Agent {
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then waits for exit; returns the exit code and how long the exit took.
    pub fn stop_timed(self) -> (i32, Duration) {
        let started = Instant::now();
        let code = self.stop();
        (code, started.elapsed())
    }

    /// SIGTERM, then waits for exit; returns the exit code.
    pub fn stop(mut self) -> i32 {
        let mut child = self.child.take().expect("running agent");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("agent did not exit within 10 s of SIGTERM; log:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGHUP: the agent re-reads its config and runs every stage again at once (not waiting
    /// for the stages' backoffs). See [`another_pass`] to also wait for that pass.
    pub fn sighup(&self) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::Signal::SIGHUP)
            .expect("SIGHUP");
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            if std::thread::panicking() {
                eprintln!("---- agent log ({}) ----\n{}", self.log.display(), self.log_text());
            }
        }
    }
}

/// Reads a device list into (id, health, numa) triples, sorted by id.
pub fn summary(devices: &[test_kubelet::api::Device]) -> Vec<(String, String, Option<i64>)> {
    let mut v: Vec<_> = devices
        .iter()
        .map(|d| {
            (
                d.id.clone(),
                d.health.clone(),
                d.topology.as_ref().and_then(|t| t.nodes.first()).map(|n| n.id),
            )
        })
        .collect();
    v.sort();
    v
}

pub fn healthy(devices: &[test_kubelet::api::Device], id: &str) -> Option<bool> {
    devices.iter().find(|d| d.id == id).map(|d| d.health == "Healthy")
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}

/// The pod UID and container ID [`Node::pod_process`] puts a process in.
pub const POD_UID: &str = "0a1b2c3d-0000-4000-8000-000000000001";
pub const CONTAINER_ID: &str = "aaaabbbbccccddddeeeeffff00001111222233334444555566667777888899990000";

impl Node {
    /// A real process (`sleep 60`) in a pod's container as the agent sees it: its
    /// `/proc/<pid>/cgroup` under the root names pod [`POD_UID`] and container
    /// [`CONTAINER_ID`] (cgroup v2, systemd driver, containerd).
    pub fn pod_process(&self) -> Child {
        let child = Command::new("sleep").arg("60").spawn().expect("sleep");
        let cgroup = self.root.join(format!("proc/{}/cgroup", child.id()));
        fs::create_dir_all(cgroup.parent().expect("dir")).expect("mkdir");
        let systemd_uid = POD_UID.replace('-', "_");
        fs::write(
            &cgroup,
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{CONTAINER_ID}.scope\n"
            ),
        )
        .expect("cgroup");
        child
    }
}

/// The simulated node's name (its `/etc/hostname`) and the token its kubeconfig carries.
pub const NODE_NAME: &str = "gpu-node-1";
pub const NODE_TOKEN: &str = "agent-token-0123456789";

/// A test API server holding this node's Node (with `labels`) and a token for
/// `system:node:gpu-node-1`, written as the kubelet's kubeconfig where kubeadm keeps it, so the
/// agent finds it by its default search.
pub async fn api_server_for(node: &Node, labels: &[(&str, &str)]) -> test_apiserver::TestApiServer {
    let api = test_apiserver::TestApiServer::start().await;
    api.create_node(NODE_NAME, labels);
    api.add_token(NODE_TOKEN, "system:node:gpu-node-1");
    let options = test_apiserver::KubeconfigOptions {
        file_name: "kubelet.conf".into(),
        ..test_apiserver::KubeconfigOptions::default()
    };
    api.write_kubeconfig_with(
        &node.kubeconfig_dir(),
        test_apiserver::KubeconfigAuth::Token(NODE_TOKEN.into()),
        &options,
    );
    api
}

/// [`api_server_for`] the node, and a test kubelet on its device plugin directory.
pub async fn api_server_and_kubelet(
    node: &Node,
    labels: &[(&str, &str)],
) -> (test_apiserver::TestApiServer, test_kubelet::TestKubelet) {
    let api = api_server_for(node, labels).await;
    let kubelet = test_kubelet::TestKubelet::start(&node.plugin_dir(), test_kubelet::KubeletOptions::default())
        .await
        .expect("start the test kubelet");
    (api, kubelet)
}

/// systemd's notify socket, the test's own: bound in a temp dir, for `NOTIFY_SOCKET`.
pub struct NotifySocket {
    _dir: TempDir,
    pub path: PathBuf,
    socket: std::os::unix::net::UnixDatagram,
}

impl NotifySocket {
    pub fn new() -> NotifySocket {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("bind notify socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        NotifySocket {
            _dir: dir,
            path,
            socket,
        }
    }

    /// The messages received until `done` says so or `deadline` has passed.
    pub fn receive_until(&self, deadline: Duration, mut done: impl FnMut(&[String]) -> bool) -> Vec<String> {
        let mut got = Vec::new();
        let start = Instant::now();
        let mut buf = [0u8; 4096];
        while start.elapsed() < deadline && !done(&got) {
            if let Ok(n) = self.socket.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        got
    }
}

/// The GPU instances of `gpu` counted by profile name, each with the one compute instance that
/// spans it (asserted).
pub fn gi_counts(gpu: &gpu_node_agent::mig::state::ObservedGpu) -> std::collections::BTreeMap<String, u32> {
    let mut counts = std::collections::BTreeMap::new();
    for gi in &gpu.gpu_instances {
        let name = gpu
            .profiles
            .iter()
            .find(|p| p.id == gi.profile_id)
            .map(|p| p.name.clone())
            .unwrap_or_default();
        assert_eq!(
            gi.compute_instances.len(),
            1,
            "one spanning compute instance per GPU instance"
        );
        *counts.entry(name).or_insert(0) += 1;
    }
    counts
}

/// The Events posted on the Node with `reason`, oldest first, one entry per posting: the agent
/// aggregates repeats of a reason into one object whose `count` they raise (as the kubelet
/// does), and an object of count n is here n times, so that "posted once" still means once.
pub fn events_with(api: &test_apiserver::TestApiServer, reason: &str) -> Vec<serde_json::Value> {
    api.events()
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .flat_map(|e| {
            let count = e["count"]
                .as_u64()
                .map_or(1, |n| usize::try_from(n).unwrap_or(1).max(1));
            std::iter::repeat_n(e, count)
        })
        .collect()
}

/// Waits up to `within` for the Node's label `key` to be `value` (`None`: absent); panics with
/// the labels when it does not get there.
pub async fn wait_label(api: &test_apiserver::TestApiServer, key: &str, value: Option<&str>, within: Duration) {
    let ok = api
        .wait_for(within, |a| a.labels(NODE_NAME).get(key).map(String::as_str) == value)
        .await;
    assert!(
        ok,
        "label {key} never became {value:?}; labels: {:?}",
        api.labels(NODE_NAME)
    );
}

/// Waits (20 s) for an Event with `reason` and returns the first one.
pub async fn event_posted(api: &test_apiserver::TestApiServer, reason: &str) -> serde_json::Value {
    let posted = api
        .wait_for(Duration::from_secs(20), |a| {
            a.events().iter().any(|e| e["reason"] == reason)
        })
        .await;
    assert!(posted, "no {reason} Event: {:?}", api.events());
    events_with(api, reason).remove(0)
}

/// Asserts the Event's type and that its message contains every one of `parts`.
pub fn assert_event(event: &serde_json::Value, kind: &str, parts: &[&str]) {
    assert_eq!(event["type"], kind, "{event}");
    let message = event["message"].as_str().unwrap_or_default();
    for part in parts {
        assert!(message.contains(part), "{part:?} not in the message: {event}");
    }
}

/// SIGHUP (every stage runs again), then waits for the agent to log it and for the pass to end
/// and post what it posts: a pass without a transition that should post nothing.
pub async fn another_pass(agent: &Agent) {
    let sighups = |log: &str| log.matches("SIGHUP: re-reading").count();
    let before = sighups(&agent.log_text());
    agent.sighup();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sighups(&agent.log_text()) <= before {
        assert!(Instant::now() < deadline, "no SIGHUP in the log:\n{}", agent.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
}
