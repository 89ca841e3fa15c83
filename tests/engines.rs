//! The real container engines started with the files the agent wrote.
//!
//! For each containerd configuration that real nodes ship (`tests/fixtures/runtime/nodes/`,
//! each with its source in its header; plus no file at all, comment-only files and `containerd
//! config default`), the agent configures it under a temp root, then Debian's containerd is
//! started with the result and asked over the CRI (the `Status` call the kubelet makes) whether
//! its CRI plugin loaded, with `runc`, `nvidia` and the default runtime. The same input is
//! started unchanged first: the agent's edit must keep every CRI setting the node had.
//!
//! containerd 2.x (Debian unstable's: config version 3, its CRI split in two plugins, CDI on by
//! default) gets every one of these inputs, with and without NVIDIA's toolkit; containerd 1.7
//! (the next Debian release's) kubeadm's, both ways. scripts/deps unpacks both under
//! `.test-deps/`. Where containerd's own configuration already has what the agent would add,
//! the agent must write nothing and ask for no restart.
//!
//! Every engine runs as root in a private mount and network namespace (`unshare -mn`) with
//! copy-on-write overlays on /etc, /opt, /var and /run, its root, state and sockets in the
//! test's temp dir: nothing it does reaches the machine the tests run on.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Node;
use gpu_node_agent::config::Config;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::command::Runner;
use gpu_node_agent::runtime::containerd::{self, rebase_imports};
use gpu_node_agent::runtime::cri::{self, CriStatus};
use gpu_node_agent::runtime::stage::{self, ApplyOptions};

const CONTAINERD: &str = "/usr/bin/containerd";
const CTR: &str = "/usr/bin/ctr";
const MAIN: &str = "/etc/containerd/config.toml";
const DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";
const RUNTIME_BINARY: &str = "/usr/bin/nvidia-container-runtime";

/// Runs `argv` in a private mount and network namespace with overlays over the host's
/// directories an engine writes to (their upper layers under `scratch`), loopback up.
const ISOLATE: &str = r#"
set -e
scratch=$1; shift
for d in /etc /opt /var /run; do
  n=$(echo "$d" | tr / _)
  mkdir -p "$scratch/ov$n/upper" "$scratch/ov$n/work"
  mount -t overlay overlay -o "lowerdir=$d,upperdir=$scratch/ov$n/upper,workdir=$scratch/ov$n/work" "$d"
done
ip link set lo up 2>/dev/null || true
exec "$@"
"#;

/// Starts `program` with `args` isolated as [`ISOLATE`] says (its overlays under `dir`), its
/// stderr in `dir/<name>.log`; returns the child and the log's path.
fn spawn_isolated(dir: &Path, program: &str, args: &[std::ffi::OsString]) -> (Child, PathBuf) {
    require_root_and(program);
    let scratch = dir.join("scratch");
    fs::create_dir_all(&scratch).expect("scratch dir");
    let name = Path::new(program).file_name().expect("program name").to_string_lossy();
    let log = dir.join(format!("{name}.log"));
    let child = Command::new("unshare")
        .args([
            "--mount",
            "--net",
            "--propagation",
            "private",
            "sh",
            "-c",
            ISOLATE,
            "sh",
        ])
        .arg(&scratch)
        .arg(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).expect("log"))
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    (child, log)
}

/// `args` as OS strings.
fn os_args(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<std::ffi::OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

fn require_root_and(program: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests start real engines and need root (CI runs as root)"
    );
    assert!(
        Path::new(program).is_file(),
        "{program} is missing: scripts/deps installs it (apt-get install containerd docker.io)"
    );
}

/// A containerd of its own, killed when dropped.
struct Containerd {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    /// The `ctr` next to its binary (Debian's when there is none).
    ctr: PathBuf,
}

impl Containerd {
    /// Starts containerd with the config file `config` (its imports already pointing at real
    /// paths), its root, state and socket under `dir`.
    fn start(config: &Path, dir: &Path) -> Containerd {
        Containerd::start_binary(CONTAINERD, config, dir)
    }

    /// [`Containerd::start`] with the containerd binary `binary`.
    fn start_binary(binary: &str, config: &Path, dir: &Path) -> Containerd {
        let socket = dir.join("c.sock");
        let (root, state) = (dir.join("root"), dir.join("state"));
        let args = os_args(&[
            &"--config",
            &config,
            &"--root",
            &root,
            &"--state",
            &state,
            &"--address",
            &socket,
        ]);
        let (child, log) = spawn_isolated(dir, binary, &args);
        Containerd {
            child,
            socket,
            log,
            ctr: ctr_of(binary),
        }
    }

    /// Waits until the socket answers, then asks the CRI.
    fn cri(&mut self) -> Result<CriStatus, String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.socket.exists() {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("containerd exited with {status}:\n{}", self.log()));
            }
            assert!(Instant::now() < deadline, "containerd did not listen:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        cri::status_blocking(&self.socket, Duration::from_secs(20)).map_err(|e| {
            let plugins = Command::new(&self.ctr)
                .arg("--address")
                .arg(&self.socket)
                .args(["plugins", "ls", "--detailed"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            format!(
                "{e}\nCRI plugin error: {:?}\n{}",
                cri::ctr_cri_errors(&plugins),
                self.log()
            )
        })
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

/// The verbose CRI configuration without what the agent sets (its runtimes and the default),
/// for comparing a node's settings before and after.
fn settings_without_ours(status: &CriStatus) -> serde_json::Value {
    let mut config: serde_json::Value =
        serde_json::from_str(status.config.as_deref().unwrap_or("{}")).expect("CRI config JSON");
    // Where each test instance keeps its files.
    if let Some(top) = config.as_object_mut() {
        for key in ["containerdEndpoint", "containerdRootDir", "rootDir", "stateDir"] {
            top.remove(key);
        }
    }
    if let Some(containerd) = config.get_mut("containerd").and_then(|c| c.as_object_mut()) {
        containerd.remove("defaultRuntimeName");
        if let Some(runtimes) = containerd.get_mut("runtimes").and_then(|r| r.as_object_mut()) {
            runtimes.retain(|name, _| !name.starts_with("nvidia"));
        }
        // containerd 1.6 also shows the default runtime's table here.
        containerd.remove("defaultRuntime");
    }
    without_zero_values(config)
}

/// `value` without Go's zero values (null, "", false, 0, [] and {}): containerd shows a runtime
/// read from a file with `[]` and `""` where its built-in one has `null` and no key, and both
/// mean the same.
fn without_zero_values(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, without_zero_values(v)))
                .filter(|(_, v)| !is_zero(v))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_zero_values).collect()),
        other => other,
    }
}

fn is_zero(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// The node's main file as containerd under test reads it: imports pointed into the root, next
/// to the original so relative imports resolve the same way.
fn rebased_main(root: &Path) -> PathBuf {
    let main = root.join(MAIN.trim_start_matches('/'));
    let copy = main.with_file_name("under-test.toml");
    let text = fs::read_to_string(&main).unwrap_or_default();
    let rebased = rebase_imports(&text, MAIN, |p| {
        if p.starts_with('/') {
            root.join(p.trim_start_matches('/')).to_string_lossy().into_owned()
        } else {
            p.to_owned()
        }
    })
    .expect("rebase imports");
    fs::create_dir_all(copy.parent().expect("dir")).expect("mkdir");
    fs::write(&copy, rebased).expect("write copy");
    copy
}

/// Writes `text` at the host path `path` under `root`, with its directories.
fn put(root: &Path, path: &str, text: &str) {
    let file = root.join(path.trim_start_matches('/'));
    fs::create_dir_all(file.parent().expect("dir")).expect("mkdir");
    fs::write(file, text).expect("write");
}

/// Links the host path `path` under `root` to this machine's `target` (a real engine binary).
fn link(root: &Path, path: &str, target: &str) {
    let file = root.join(path.trim_start_matches('/'));
    fs::create_dir_all(file.parent().expect("dir")).expect("mkdir");
    std::os::unix::fs::symlink(target, file).expect("symlink");
}

/// The NVIDIA runtime binary under `root`: a stub (the engines only need its path).
fn runtime_stub(root: &Path) {
    use std::os::unix::fs::PermissionsExt;
    put(root, RUNTIME_BINARY, "#!/bin/sh\nexit 0\n");
    let stub = root.join(RUNTIME_BINARY.trim_start_matches('/'));
    fs::set_permissions(&stub, fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// The `ctr` next to the containerd binary `binary` (Debian's when there is none).
fn ctr_of(binary: &str) -> PathBuf {
    let next = Path::new(binary).with_file_name("ctr");
    if next.is_file() { next } else { PathBuf::from(CTR) }
}

/// A node with the containerd binary `binary` (and its `ctr`) under the root, `main` as its
/// config (`None`: no file), and the NVIDIA runtime (a stub) when `toolkit`: without it the
/// agent's `auto` mode is cdi-only.
fn containerd_node_with(binary: &str, main: Option<&str>, toolkit: bool) -> Node {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "");
    link(&node.root, CONTAINERD, binary);
    link(&node.root, CTR, &ctr_of(binary).to_string_lossy());
    if toolkit {
        runtime_stub(&node.root);
    }
    if let Some(text) = main {
        put(&node.root, MAIN, text);
    }
    node
}

fn run_agent(node: &Node, args: &[&str]) -> String {
    let out = node.run(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "gpu-node-agent {}:\n{text}", args.join(" "));
    text
}

/// The whole check for one input; `name` names it in failures.
fn containerd_loads_cri_with_the_agents_files(name: &str, main: Option<&str>) {
    containerd_loads_cri_with_the_agents_files_on(CONTAINERD, name, main);
}

/// [`containerd_loads_cri_with_the_agents_files`] with the containerd binary `binary`, the
/// NVIDIA runtime installed; returns the CRI's status with the input as it is.
fn containerd_loads_cri_with_the_agents_files_on(binary: &str, name: &str, main: Option<&str>) -> CriStatus {
    let node = containerd_node_with(binary, main, true);
    let root = node.root.clone();

    // The input as it is: containerd loads its CRI (else the input is no working node).
    let before = {
        let dir = node.tmp.path().join("before");
        let config = rebased_main(&root);
        let mut engine = Containerd::start_binary(binary, &config, &dir);
        engine
            .cri()
            .unwrap_or_else(|e| panic!("{name}: the input itself does not load containerd's CRI: {e}"))
    };

    let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let drop_in = fs::read_to_string(root.join(DROP_IN.trim_start_matches('/'))).unwrap_or_default();
    let after = {
        let dir = node.tmp.path().join("after");
        let config = rebased_main(&root);
        let mut engine = Containerd::start_binary(binary, &config, &dir);
        engine.cri().unwrap_or_else(|e| {
            panic!(
                "{name}: containerd's CRI does not load with the agent's files: {e}\nagent: {out}\ndrop-in:\n{drop_in}"
            )
        })
    };
    // runc is there wherever the node had it (EKS AL2023's NVIDIA variant defines only nvidia).
    let wanted = if before.handlers.contains("runc") {
        vec!["runc", "nvidia"]
    } else {
        vec!["nvidia"]
    };
    for handler in wanted {
        assert!(
            after.handlers.contains(handler),
            "{name}: no {handler} runtime: {:?}\ndrop-in:\n{drop_in}",
            after.handlers
        );
    }
    assert_eq!(
        after.default_handler.as_deref(),
        Some("nvidia"),
        "{name}: the kubelet's engine gets nvidia as its default (set_as_default = \"auto\")"
    );
    assert_eq!(
        settings_without_ours(&after),
        settings_without_ours(&before),
        "{name}: every other CRI setting is as before\ndrop-in:\n{drop_in}"
    );

    // Stable, and undone to the byte.
    let again = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    assert!(again.contains("already configured"), "{name}: {again}");
    run_agent(&node, &["runtime", "unconfigure", "--no-restart"]);
    let now = fs::read_to_string(root.join(MAIN.trim_start_matches('/'))).ok();
    assert_eq!(now.as_deref(), main, "{name}: unconfigure restores the original bytes");
    assert!(
        !root.join(DROP_IN.trim_start_matches('/')).exists(),
        "{name}: drop-in gone"
    );
    before
}

fn node_fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/runtime/nodes")
        .join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn no_config_file() {
    containerd_loads_cri_with_the_agents_files("no file", None);
}

#[test]
fn a_comment_only_file() {
    containerd_loads_cri_with_the_agents_files("comments", Some("# managed by hand\n# nothing yet\n"));
}

#[test]
fn a_comment_only_file_without_a_final_newline() {
    containerd_loads_cri_with_the_agents_files("comments, no newline", Some("# managed by hand"));
}

#[test]
fn containerd_config_default() {
    require_root_and(CONTAINERD);
    let out = Command::new(CONTAINERD)
        .args(["config", "default"])
        .output()
        .expect("containerd config default");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    containerd_loads_cri_with_the_agents_files("containerd config default", Some(&text));
}

/// One test per node configuration in `tests/fixtures/runtime/nodes/` (each file's header
/// names its source).
macro_rules! node_inputs {
    ($($test:ident => $file:literal,)*) => {$(
        #[test]
        fn $test() {
            containerd_loads_cri_with_the_agents_files($file, Some(&node_fixture($file)));
        }
    )*};
}

node_inputs! {
    debian_packaged_config => "containerd-debian.toml",
    gke_cos_configure_sh => "containerd-gke-cos.toml",
    containerd_1_6_config_default => "containerd-default-1.6.toml",
    kubeadm => "containerd-kubeadm.toml",
    k3s => "containerd-k3s.toml",
    rke2 => "containerd-rke2.toml",
    eks_al2 => "containerd-eks-al2.toml",
}

/// EKS AL2023 (nodeadm): the runc variant, the NVIDIA variant whose default runtime is already
/// `nvidia` with its own `base_runtime_spec` (kept), and nodeadm's e2e rendering of it. The spec
/// file the configs name is put under the root and the path pointed there, as imports are.
#[test]
fn eks_al2023_runc_and_nvidia_variants() {
    let spec = node_fixture("eks-al2023-base-runtime-spec.json");
    for file in [
        "containerd-eks-al2023.toml",
        "containerd-eks-al2023-nvidia.toml",
        "containerd-eks-al2023-nvidia-nodeadm-e2e.toml",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec_path = dir.path().join("base-runtime-spec.json");
        fs::write(&spec_path, &spec).expect("spec");
        let main = node_fixture(file).replace("/etc/containerd/base-runtime-spec.json", &spec_path.to_string_lossy());
        containerd_loads_cri_with_the_agents_files(file, Some(&main));
    }
}

/// Docker's containerd.io package: a version 1 file with the CRI plugin disabled. No kubelet
/// uses such a containerd, so the agent leaves it alone and says so, without failing; on
/// containerd 2.x too (which migrates the file, `cri` becoming `io.containerd.grpc.v1.cri`).
#[test]
fn docker_ce_containerd_with_cri_disabled_is_left_alone() {
    let main = node_fixture("containerd-docker-ce.toml");
    for binary in [CONTAINERD.to_owned(), containerd_2()] {
        let node = containerd_node_with(&binary, Some(&main), true);
        let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
        assert!(
            out.contains(
                "containerd left alone: its CRI plugin is disabled (disabled_plugins in /etc/containerd/config.toml)"
            ),
            "{binary}: {out}"
        );
        let root = &node.root;
        assert_eq!(
            fs::read_to_string(root.join(MAIN.trim_start_matches('/'))).ok(),
            Some(main.clone()),
            "{binary}"
        );
        assert!(!root.join(DROP_IN.trim_start_matches('/')).exists(), "{binary}");
    }
}

// === docker ===

const DOCKERD: &str = "/usr/sbin/dockerd";
const DAEMON_JSON: &str = "/etc/docker/daemon.json";

/// A dockerd of its own (no bridge, no iptables), killed when dropped.
struct Dockerd {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Dockerd {
    fn start(daemon_json: &Path, dir: &Path) -> Dockerd {
        Dockerd::start_binary(DOCKERD, daemon_json, dir)
    }

    /// [`Dockerd::start`] with the dockerd binary `binary` (the programs it starts, such as
    /// `docker-proxy`, from its folder first).
    fn start_binary(binary: &str, daemon_json: &Path, dir: &Path) -> Dockerd {
        let socket = dir.join("d.sock");
        let (data, exec, pid) = (dir.join("data"), dir.join("exec"), dir.join("docker.pid"));
        let host = format!("unix://{}", socket.display());
        let args = os_args(&[
            &"--config-file",
            &daemon_json,
            &"--data-root",
            &data,
            &"--exec-root",
            &exec,
            &"--pidfile",
            &pid,
            &"--host",
            &host,
            &"--bridge=none",
            &"--iptables=false",
        ]);
        let (child, log) = spawn_isolated(dir, binary, &args);
        Dockerd { child, socket, log }
    }

    /// Its runtimes and default runtime, as `GET /info` shows them.
    fn runtimes(&mut self) -> (serde_json::Value, String) {
        let info = self.info();
        let default = info["DefaultRuntime"].as_str().unwrap_or_default().to_owned();
        (info["Runtimes"].clone(), default)
    }

    /// The engine's own `GET /info` (over its socket with curl: Debian 12's docker CLI is older
    /// than the daemons asked here and drops the fields it does not know).
    fn info(&mut self) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new("curl")
                .args(["-sf", "--unix-socket"])
                .arg(&self.socket)
                .arg("http://localhost/info")
                .output()
                .expect("curl (scripts/deps installs it)");
            let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            if out.status.success() && !info["Runtimes"].is_null() {
                return info;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "dockerd exited with {status}:\n{}",
                    fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "dockerd did not answer:\n{}",
                fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        // SIGTERM first: dockerd stops the containerd it started.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A node with docker installed (its unit), the NVIDIA runtime (a stub), `daemon` as its
/// daemon.json (`None`: none) and `config` as the agent's config drop-in.
fn docker_node(daemon: Option<&str>, config: &str) -> Node {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), config);
    put(&node.root, "/lib/systemd/system/docker.service", "[Service]\n");
    runtime_stub(&node.root);
    if let Some(text) = daemon {
        put(&node.root, DAEMON_JSON, text);
    }
    node
}

/// Configures docker, starts Debian's dockerd with the daemon.json the agent wrote and checks
/// `docker info`: the nvidia runtime at the binary's path and `default` as the default runtime;
/// then unconfigure gives back the original bytes.
fn dockerd_reads_the_agents_daemon_json(name: &str, daemon: Option<&str>, config: &str, default: &str) {
    let node = docker_node(daemon, config);
    run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let path = node.root.join(DAEMON_JSON.trim_start_matches('/'));
    let written = fs::read_to_string(&path).unwrap_or_default();
    let (runtimes, found_default) = Dockerd::start(&path, &node.tmp.path().join("dockerd")).runtimes();
    assert_eq!(
        runtimes["nvidia"]["path"].as_str(),
        Some(RUNTIME_BINARY),
        "{name}: {runtimes}\n{written}"
    );
    assert_eq!(found_default, default, "{name}: default runtime\n{written}");
    run_agent(&node, &["runtime", "unconfigure", "--no-restart"]);
    assert_eq!(
        fs::read_to_string(&path).ok().as_deref(),
        daemon,
        "{name}: original bytes"
    );
}

#[test]
fn dockerd_on_a_fresh_host_gets_the_runtime_and_keeps_runc_as_default() {
    // The kubelet uses containerd (its default endpoint): docker's default stays runc.
    dockerd_reads_the_agents_daemon_json("fresh", None, "", "runc");
}

#[test]
fn dockerd_behind_cri_dockerd_gets_nvidia_as_its_default() {
    let config = "[runtime]\nkubelet_runtime_endpoint = \"unix:///run/cri-dockerd.sock\"\n";
    let daemon = "{\n  \"log-driver\": \"json-file\",\n  \"log-opts\": {\"max-size\": \"100m\"}\n}\n";
    dockerd_reads_the_agents_daemon_json("cri-dockerd", Some(daemon), config, "nvidia");
}

#[test]
fn dockerd_whose_default_was_already_nvidia_keeps_it() {
    let daemon = node_fixture("docker-nvidia-default.daemon.json");
    dockerd_reads_the_agents_daemon_json("nvidia default", Some(&daemon), "", "nvidia");
    // Told otherwise, it goes back to runc.
    let node = docker_node(Some(&daemon), "[runtime]\nset_as_default = false\n");
    run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let path = node.root.join(DAEMON_JSON.trim_start_matches('/'));
    let (_, default) = Dockerd::start(&path, &node.tmp.path().join("dockerd")).runtimes();
    assert_eq!(default, "runc");
}

/// An upstream tarball install: containerd in /usr/local/bin with its unit in
/// /usr/local/lib/systemd/system, and `enable_cdi` asked for on containerd 1.6 (which has no
/// CDI): the engine is found and configured, the key left out with a warning, and containerd
/// loads its CRI with the result.
#[test]
fn a_tarball_containerd_1_6_with_enable_cdi_asked_for() {
    require_root_and(CONTAINERD);
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "[runtime]\nenable_cdi = true\n");
    let root = node.root.clone();
    link(&root, "/usr/local/bin/containerd", CONTAINERD);
    link(&root, "/usr/local/bin/ctr", CTR);
    put(
        &root,
        "/usr/local/lib/systemd/system/containerd.service",
        "[Service]\nExecStart=/usr/local/bin/containerd\n",
    );
    runtime_stub(&root);

    let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    assert!(
        out.contains("containerd: [runtime] enable_cdi is left out: containerd 1.6 has no CDI"),
        "{out}"
    );
    let drop_in = fs::read_to_string(root.join(DROP_IN.trim_start_matches('/'))).expect("drop-in");
    assert!(!drop_in.contains("enable_cdi"), "{drop_in}");
    assert!(
        drop_in.contains("`containerd config dump`"),
        "the tarball's binary was asked: {drop_in}"
    );
    let config = rebased_main(&root);
    let status = Containerd::start(&config, &node.tmp.path().join("after"))
        .cri()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status.default_handler.as_deref(), Some("nvidia"));
}

/// An engine of version `first` or later: the one scripts/deps unpacks under
/// `.test-deps/<fetched>`, or the system's `system` when it is recent enough.
fn engine_at_least(system: &str, fetched: &str, first: (u32, u32)) -> String {
    let unpacked = Path::new(env!("CARGO_MANIFEST_DIR")).join(".test-deps").join(fetched);
    if unpacked.is_file() {
        return unpacked.to_string_lossy().into_owned();
    }
    let version = Command::new(system)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // `containerd github.com/containerd/containerd v1.7.24 …`, `Docker version 26.1.5, build …`
    let found = version.split_whitespace().find_map(|w| {
        let mut parts = w.trim_start_matches('v').split('.');
        Some((parts.next()?.parse::<u32>().ok()?, parts.next()?.parse::<u32>().ok()?))
    });
    assert!(
        found.is_some_and(|v| v >= first),
        "tests need {system} {}.{} or later and it is {version:?}: scripts/deps unpacks one into .test-deps/",
        first.0,
        first.1
    );
    system.to_owned()
}

/// containerd 1.7, the first with CDI.
fn containerd_1_7() -> String {
    engine_at_least(CONTAINERD, "containerd-1.7/usr/bin/containerd", (1, 7))
}

/// The CRI's CDI settings (`enableCDI`, `cdiSpecDirs`) from its verbose status.
fn cdi_settings(status: &CriStatus) -> (bool, Vec<String>) {
    let config: serde_json::Value =
        serde_json::from_str(status.config.as_deref().unwrap_or("{}")).expect("CRI config JSON");
    let dirs = config["cdiSpecDirs"]
        .as_array()
        .map(|a| a.iter().filter_map(|d| d.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    (config["enableCDI"].as_bool().unwrap_or(false), dirs)
}

/// Real containerd 1.7 with the agent's files. Without NVIDIA's toolkit (the defaults decide
/// cdi-only) its CRI has CDI on, reads the agent's spec directory, and has no `nvidia` handler,
/// its default and every other setting as before; with the toolkit and `enable_cdi` it has
/// both. The runtime stage's own check (`config dump`) ran with this containerd too.
#[test]
fn containerd_1_7_gets_cdi_with_or_without_the_toolkit() {
    let binary = containerd_1_7();
    let main = node_fixture("containerd-kubeadm.toml");
    for (case, toolkit, config) in [
        ("no toolkit (auto: cdi-only)", false, ""),
        ("toolkit with enable_cdi", true, "[runtime]\nenable_cdi = true\n"),
    ] {
        let node = Node::new(&common::machine("A100-SXM4-40GB", 1), config);
        let root = node.root.clone();
        link(&root, CONTAINERD, &binary);
        link(&root, CTR, &Path::new(&binary).with_file_name("ctr").to_string_lossy());
        if toolkit {
            runtime_stub(&root);
        }
        put(&root, MAIN, &main);
        let before = Containerd::start_binary(&binary, &rebased_main(&root), &node.tmp.path().join("before"))
            .cri()
            .unwrap_or_else(|e| panic!("{case}: the input itself does not load containerd 1.7's CRI: {e}"));
        assert!(before.runtime.contains("1.7"), "{case}: {}", before.runtime);
        assert!(
            !cdi_settings(&before).0,
            "{case}: containerd 1.7 has CDI off by default"
        );

        let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
        let drop_in = fs::read_to_string(root.join(DROP_IN.trim_start_matches('/'))).unwrap_or_default();
        let after = Containerd::start_binary(&binary, &rebased_main(&root), &node.tmp.path().join("after"))
            .cri()
            .unwrap_or_else(|e| panic!("{case}: containerd 1.7's CRI does not load: {e}\n{out}\n{drop_in}"));
        let (enabled, dirs) = cdi_settings(&after);
        assert!(enabled, "{case}: enableCDI\n{drop_in}");
        assert!(dirs.iter().any(|d| d == "/var/run/cdi"), "{case}: {dirs:?}");
        assert_eq!(
            after.handlers.contains("nvidia"),
            toolkit,
            "{case}: {:?}\n{drop_in}",
            after.handlers
        );
        if !toolkit {
            assert_eq!(after.default_handler, before.default_handler, "{case}");
        }
        let without_cdi = |status: &CriStatus| {
            let mut settings = settings_without_ours(status);
            if let Some(top) = settings.as_object_mut() {
                top.remove("enableCDI");
            }
            settings
        };
        assert_eq!(
            without_cdi(&after),
            without_cdi(&before),
            "{case}: every other CRI setting is as before\n{drop_in}"
        );
    }
}

/// containerd 1.6 has no CDI: without NVIDIA's toolkit nothing would deliver a GPU there, so
/// the runtime stage fails for it, naming both ways out, and writes nothing.
#[test]
fn containerd_1_6_without_the_toolkit_is_an_error_naming_the_fix() {
    require_root_and(CONTAINERD);
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "");
    let root = node.root.clone();
    link(&root, CONTAINERD, CONTAINERD);
    let main = node_fixture("containerd-kubeadm.toml");
    put(&root, MAIN, &main);
    let out = node.run(&["runtime", "configure", "--no-restart"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    for words in [
        "containerd 1.6 has no CDI (1.7 and later do)",
        "install the NVIDIA Container Toolkit",
        "nothing was changed",
    ] {
        assert!(text.contains(words), "{words:?} in {text}");
    }
    assert_eq!(
        fs::read_to_string(root.join(MAIN.trim_start_matches('/'))).ok(),
        Some(main)
    );
    assert!(!root.join(DROP_IN.trim_start_matches('/')).exists());
}

// === containerd 2.x ===

/// containerd 2.x (config version 3, its CRI split into `io.containerd.cri.v1.runtime` and
/// `io.containerd.cri.v1.images`, CDI on by default): Debian unstable's, which scripts/deps
/// unpacks under `.test-deps/containerd-2`, or the system's when it is 2.x.
fn containerd_2() -> String {
    engine_at_least(CONTAINERD, "containerd-2/usr/bin/containerd", (2, 0))
}

/// `containerd config default` of the containerd binary `binary`.
fn config_default(binary: &str) -> String {
    require_root_and(binary);
    let out = Command::new(binary)
        .args(["config", "default"])
        .output()
        .expect("containerd config default");
    assert!(out.status.success(), "{binary} config default: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether the CRI status shows CDI on with the agent's spec directory (`/var/run/cdi`) read.
fn reads_the_agents_cdi_specs(status: &CriStatus) -> bool {
    let (enabled, dirs) = cdi_settings(status);
    enabled && dirs.iter().any(|d| d == "/var/run/cdi")
}

/// The CRI settings without what the agent sets, `enableCDI` and `cdiSpecDirs` included.
fn settings_without_ours_or_cdi(status: &CriStatus) -> serde_json::Value {
    let mut settings = settings_without_ours(status);
    if let Some(top) = settings.as_object_mut() {
        top.remove("enableCDI");
        top.remove("cdiSpecDirs");
    }
    settings
}

/// Without NVIDIA's toolkit (`auto`: cdi-only) on the containerd binary `binary` with `main`,
/// whose CRI status as it is was `before`. Where that already has CDI on, reads the agent's
/// spec directory (containerd 2.x's default) and has a default runtime that is not the
/// toolkit's, the agent writes nothing and says so; elsewhere its files turn CDI on or give the
/// default back to runc. Either way the CRI then has CDI, the handlers it had (the agent adds
/// none), its default (runc instead of the toolkit's) and every other setting as before, and
/// unconfigure gives the original bytes back.
fn cdi_only_on(binary: &str, name: &str, main: Option<&str>, before: &CriStatus) {
    let node = containerd_node_with(binary, main, false);
    let root = node.root.clone();
    let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let now = fs::read_to_string(root.join(MAIN.trim_start_matches('/'))).ok();
    let drop_in = fs::read_to_string(root.join(DROP_IN.trim_start_matches('/'))).ok();
    let toolkits_default = before
        .default_handler
        .as_deref()
        .is_some_and(|d| d.starts_with("nvidia"));
    let after = if reads_the_agents_cdi_specs(before) && !toolkits_default {
        assert_eq!(now.as_deref(), main, "{name}: nothing to add, nothing written\n{out}");
        assert_eq!(drop_in, None, "{name}: no drop-in\n{out}");
        assert!(
            out.contains("containerd: its own configuration already has all the agent would add"),
            "{name}: {out}"
        );
        before.clone()
    } else {
        let config = rebased_main(&root);
        Containerd::start_binary(binary, &config, &node.tmp.path().join("cdi-only"))
            .cri()
            .unwrap_or_else(|e| panic!("{name}: cdi-only: containerd's CRI does not load: {e}\n{out}\n{drop_in:?}"))
    };
    assert!(
        reads_the_agents_cdi_specs(&after),
        "{name}: cdi-only: {:?}\n{drop_in:?}",
        cdi_settings(&after)
    );
    assert_eq!(after.handlers, before.handlers, "{name}: cdi-only");
    if toolkits_default {
        assert_eq!(after.default_handler.as_deref(), Some("runc"), "{name}: cdi-only");
    } else {
        assert_eq!(after.default_handler, before.default_handler, "{name}: cdi-only");
    }
    assert_eq!(
        settings_without_ours_or_cdi(&after),
        settings_without_ours_or_cdi(before),
        "{name}: cdi-only: every other CRI setting is as before\n{drop_in:?}"
    );
    run_agent(&node, &["runtime", "unconfigure", "--no-restart"]);
    let now = fs::read_to_string(root.join(MAIN.trim_start_matches('/'))).ok();
    assert_eq!(
        now.as_deref(),
        main,
        "{name}: cdi-only: unconfigure restores the original bytes"
    );
    assert!(!root.join(DROP_IN.trim_start_matches('/')).exists(), "{name}: cdi-only");
}

/// One input on containerd 2.x: with the toolkit as [`containerd_loads_cri_with_the_agents_files`]
/// checks it on 1.6, then without it ([`cdi_only_on`]).
fn containerd_2_loads_cri_with_the_agents_files(name: &str, main: Option<&str>) {
    let binary = containerd_2();
    let before = containerd_loads_cri_with_the_agents_files_on(&binary, name, main);
    assert!(before.runtime.contains("2."), "{name}: {}", before.runtime);
    cdi_only_on(&binary, name, main, &before);
}

/// Every input the 1.6 tests above start that containerd 2.x accepts, on 2.x, with and without
/// the toolkit. containerd 2.x refuses none of them: it migrates version 2 files (the removed
/// `systemd_cgroup` and `registry.mirrors` keys included) on load.
macro_rules! containerd_2_inputs {
    ($($test:ident => $main:expr,)*) => {$(
        #[test]
        fn $test() {
            let main: Option<String> = $main;
            containerd_2_loads_cri_with_the_agents_files(stringify!($test), main.as_deref());
        }
    )*};
}

containerd_2_inputs! {
    containerd_2_no_config_file => None,
    containerd_2_a_comment_only_file => Some("# managed by hand\n# nothing yet\n".to_owned()),
    containerd_2_a_comment_only_file_without_a_final_newline => Some("# managed by hand".to_owned()),
    containerd_2_its_own_config_default => Some(config_default(&containerd_2())),
    containerd_2_containerd_1_6_config_default => Some(node_fixture("containerd-default-1.6.toml")),
    containerd_2_debian_packaged_config => Some(node_fixture("containerd-debian.toml")),
    containerd_2_gke_cos_configure_sh => Some(node_fixture("containerd-gke-cos.toml")),
    containerd_2_kubeadm => Some(node_fixture("containerd-kubeadm.toml")),
    containerd_2_k3s => Some(node_fixture("containerd-k3s.toml")),
    containerd_2_rke2 => Some(node_fixture("containerd-rke2.toml")),
    containerd_2_eks_al2 => Some(node_fixture("containerd-eks-al2.toml")),
}

/// containerd 2.x with the toolkit and `enable_cdi` (kubeadm's file): the `nvidia` handler, its
/// default, and CDI reading the agent's spec directory; every other setting as before.
#[test]
fn containerd_2_with_the_toolkit_and_enable_cdi() {
    let binary = containerd_2();
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "[runtime]\nenable_cdi = true\n");
    let root = node.root.clone();
    link(&root, CONTAINERD, &binary);
    link(&root, CTR, &ctr_of(&binary).to_string_lossy());
    runtime_stub(&root);
    put(&root, MAIN, &node_fixture("containerd-kubeadm.toml"));
    let before = Containerd::start_binary(&binary, &rebased_main(&root), &node.tmp.path().join("before"))
        .cri()
        .unwrap_or_else(|e| panic!("the input itself does not load containerd 2's CRI: {e}"));
    let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let drop_in = fs::read_to_string(root.join(DROP_IN.trim_start_matches('/'))).unwrap_or_default();
    let after = Containerd::start_binary(&binary, &rebased_main(&root), &node.tmp.path().join("after"))
        .cri()
        .unwrap_or_else(|e| panic!("containerd 2's CRI does not load: {e}\n{out}\n{drop_in}"));
    assert!(
        reads_the_agents_cdi_specs(&after),
        "{:?}\n{drop_in}",
        cdi_settings(&after)
    );
    assert!(after.handlers.contains("nvidia"), "{:?}\n{drop_in}", after.handlers);
    assert_eq!(after.default_handler.as_deref(), Some("nvidia"), "{drop_in}");
    assert_eq!(
        settings_without_ours_or_cdi(&after),
        settings_without_ours_or_cdi(&before),
        "every other CRI setting is as before\n{drop_in}"
    );
}

/// EKS AL2023's three files (see [`eks_al2023_runc_and_nvidia_variants`]) on containerd 2.x.
#[test]
fn containerd_2_eks_al2023_runc_and_nvidia_variants() {
    let spec = node_fixture("eks-al2023-base-runtime-spec.json");
    for file in [
        "containerd-eks-al2023.toml",
        "containerd-eks-al2023-nvidia.toml",
        "containerd-eks-al2023-nvidia-nodeadm-e2e.toml",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec_path = dir.path().join("base-runtime-spec.json");
        fs::write(&spec_path, &spec).expect("spec");
        let main = node_fixture(file).replace("/etc/containerd/base-runtime-spec.json", &spec_path.to_string_lossy());
        containerd_2_loads_cri_with_the_agents_files(file, Some(&main));
    }
}

/// A stand-in `systemctl` under the node's root that logs its arguments to `systemctl.log` in
/// the node's temp dir and succeeds (a restarted unit is `active`), and containerd's unit; returns
/// the log's path.
fn systemctl_stand_in(node: &Node) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let log = node.tmp.path().join("systemctl.log");
    put(
        &node.root,
        "/usr/bin/systemctl",
        &format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\n[ \"$1\" = is-active ] && echo active\nexit 0\n",
            log.display()
        ),
    );
    let path = node.root.join("usr/bin/systemctl");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    put(&node.root, "/lib/systemd/system/containerd.service", "[Service]\n");
    log
}

/// The agent's runtime stage in-process on `node` (its config, `auto` resolved as the daemon
/// does): observe and plan.
fn runtime_plan(node: &Node) -> (Config, stage::RuntimePlan) {
    let (mut config, _) = Config::load(&node.root, None).expect("config");
    config.resolve_auto_on(&node.root);
    let root = HostRoot::new(&node.root);
    let observed = stage::observe(&config, &root, &Runner::new(&root)).expect("observe");
    let plan = stage::plan(&observed, &config.runtime).expect("plan");
    (config, plan)
}

/// Applies `plan` on `node` with restarts allowed, as the daemon does on a real root.
fn apply_with_restarts(node: &Node, config: &Config, plan: &stage::RuntimePlan) -> stage::Applied {
    let root = HostRoot::new(&node.root);
    stage::apply(
        plan,
        config,
        &root,
        &Runner::new(&root),
        &ApplyOptions { restart: true },
    )
    .expect("apply")
}

/// Issue 33: without NVIDIA's toolkit, a containerd whose own configuration already has CDI on
/// and reads the agent's spec directory needs nothing from the agent: `plan` says so, and
/// configure writes nothing (the top-level file's bytes, no drop-in, no backup) and asks systemd
/// for no restart, with restarts allowed. On containerd 2.1's own `config default` (where the
/// agent added an `imports` line and a drop-in holding `enable_cdi = true` and an empty runtimes
/// table, and restarted containerd to load them) and on 1.7's with `enable_cdi = true`. The
/// CRI started with the file as it is has what cdi-only needs.
///
/// An earlier drop-in of the agent's then goes: the one the agent wrote before this rule (it
/// changed nothing) without a restart, the toolkit's (the `nvidia` runtime, its default) with
/// one; and the next plan is empty.
#[test]
fn containerd_with_cdi_already_on_gets_no_write_and_no_restart() {
    let (c2, c17) = (containerd_2(), containerd_1_7());
    let on_1_7 = config_default(&c17).replace("enable_cdi = false", "enable_cdi = true");
    assert!(on_1_7.contains("enable_cdi = true"), "{on_1_7}");
    for (name, binary, main, version) in [
        ("2.1 config default", &c2, config_default(&c2), 3),
        ("1.7 with enable_cdi", &c17, on_1_7, 2),
    ] {
        let node = containerd_node_with(binary, Some(&main), false);
        let log = systemctl_stand_in(&node);
        let main_path = node.root.join(MAIN.trim_start_matches('/'));
        let drop_in_path = node.root.join(DROP_IN.trim_start_matches('/'));
        let backups = node.root.join("var/lib/gpu-node-agent/runtime");
        let no_backup = || {
            fs::read_dir(&backups)
                .map(|d| {
                    d.filter_map(Result::ok)
                        .all(|e| !e.file_name().to_string_lossy().starts_with("%2Fetc%2Fcontainerd"))
                })
                .unwrap_or(true)
        };

        let said = run_agent(&node, &["plan"]);
        for line in [
            "Container runtimes: containerd (CDI only) already configured: no changes",
            "  containerd: its own configuration already has all the agent would add (containerd config dump): no drop-in and no restart",
        ] {
            assert!(said.lines().any(|l| l == line), "{name}: {line:?} in\n{said}");
        }
        let (config, plan) = runtime_plan(&node);
        assert!(plan.is_empty(), "{name}: {plan:?}");
        let applied = apply_with_restarts(&node, &config, &plan);
        assert!(
            applied.files.is_empty() && applied.restarted.is_empty(),
            "{name}: {applied:?}"
        );
        let out = run_agent(&node, &["runtime", "configure"]);
        assert!(out.contains("already configured, nothing to do"), "{name}: {out}");
        assert_eq!(
            fs::read_to_string(&main_path).ok(),
            Some(main.clone()),
            "{name}: top-level file"
        );
        assert!(!drop_in_path.exists(), "{name}: no drop-in");
        assert!(no_backup(), "{name}: nothing backed up");
        assert!(
            !log.exists(),
            "{name}: systemctl was run: {:?}",
            fs::read_to_string(&log)
        );
        let status = Containerd::start_binary(binary, &rebased_main(&node.root), &node.tmp.path().join("c"))
            .cri()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            reads_the_agents_cdi_specs(&status),
            "{name}: {:?}",
            cdi_settings(&status)
        );

        // What the agent wrote here before: the `imports` line and the drop-in its renderer
        // gives for containerd's dump (on 2.1 `enable_cdi = true` and an empty runtimes table,
        // on 1.7 the whole CRI table with it), applied without a restart as the stage applies
        // its files.
        let dump = Command::new(binary)
            .arg("--config")
            .arg(rebased_main(&node.root))
            .args(["config", "dump"])
            .output()
            .expect("config dump");
        let dump = String::from_utf8_lossy(&dump.stdout).into_owned();
        let input = containerd::Input {
            main: Some(&main),
            main_file: MAIN,
            drop_in_path: DROP_IN,
            binary_major: Some(version - 1),
            imported: &[],
            effective: Some(&dump),
            cdi_dir: Some("/var/run/cdi"),
        };
        let earlier = containerd::configure_input(&input, &plan.engines[0].runtime).expect("render");
        let (with_import, earlier) = (earlier.main, earlier.drop_in);
        assert!(earlier.contains("enable_cdi = true"), "{name}: {earlier}");
        let mut old = plan.clone();
        old.engines
            .retain(|e| e.engine == gpu_node_agent::config::Engine::Containerd);
        let engine = &mut old.engines[0];
        engine.warnings.clear();
        engine.changes = vec![
            stage::FileChange {
                path: MAIN.into(),
                target: MAIN.into(),
                before: Some(main.clone()),
                after: Some(with_import.clone()),
            },
            stage::FileChange {
                path: DROP_IN.into(),
                target: DROP_IN.into(),
                before: None,
                after: Some(earlier.clone()),
            },
        ];
        let root = HostRoot::new(&node.root);
        stage::apply(
            &old,
            &config,
            &root,
            &Runner::new(&root),
            &ApplyOptions { restart: false },
        )
        .unwrap_or_else(|e| panic!("{name}: {e}\n{with_import}"));
        let (_, plan) = runtime_plan(&node);
        let engine = &plan.engines[0];
        assert!(!engine.restart, "{name}: the earlier drop-in changed nothing: {plan:?}");
        assert_eq!(engine.changes.len(), 1, "{name}: {plan:?}");
        assert_eq!(engine.changes[0].after, None, "{name}: the earlier drop-in goes");
        let applied = apply_with_restarts(&node, &config, &plan);
        assert!(applied.restarted.is_empty(), "{name}: {applied:?}");
        assert!(
            !log.exists(),
            "{name}: systemctl was run: {:?}",
            fs::read_to_string(&log)
        );
        assert!(!drop_in_path.exists(), "{name}: the earlier drop-in is gone");
        assert!(runtime_plan(&node).1.is_empty(), "{name}: nothing more to do");
        // unconfigure gives the original bytes back.
        run_agent(&node, &["runtime", "unconfigure", "--no-restart"]);
        assert_eq!(
            fs::read_to_string(&main_path).ok(),
            Some(main.clone()),
            "{name}: unconfigure"
        );

        // The toolkit's drop-in (the nvidia runtime, its default) from a run with the toolkit:
        // without it now, the drop-in goes with a restart.
        runtime_stub(&node.root);
        run_agent(&node, &["runtime", "configure", "--no-restart"]);
        fs::remove_file(node.root.join(RUNTIME_BINARY.trim_start_matches('/'))).expect("toolkit gone");
        let _cri = common::cri::TestCri::start(
            &node.root.join("run/containerd/containerd.sock"),
            common::cri::serving(&["runc"]),
        );
        let (config, plan) = runtime_plan(&node);
        assert!(plan.engines[0].restart, "{name}: {plan:?}");
        let applied = apply_with_restarts(&node, &config, &plan);
        assert_eq!(applied.restarted, ["containerd.service"], "{name}");
        assert!(!drop_in_path.exists(), "{name}: the toolkit's drop-in is gone");
        assert!(runtime_plan(&node).1.is_empty(), "{name}: nothing more to do");
    }
}

/// docker 25, the first with CDI.
fn dockerd_25() -> String {
    engine_at_least(DOCKERD, "docker-26/usr/sbin/dockerd", (25, 0))
}

/// Real dockerd 26 with the daemon.json the agent wrote on a node without NVIDIA's toolkit:
/// CDI is on (its API lists the spec directories, the agent's among them) and it has no
/// `nvidia` runtime; the user's keys stay. Debian 12's docker 20.10 has no CDI: there the stage
/// fails for docker, naming the fix, and writes nothing.
#[test]
fn docker_without_the_toolkit_gets_cdi_from_25_on() {
    let binary = dockerd_25();
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), "");
    put(&node.root, "/lib/systemd/system/docker.service", "[Service]\n");
    link(&node.root, "/usr/sbin/dockerd", &binary);
    put(&node.root, DAEMON_JSON, "{\n  \"log-level\": \"warn\"\n}\n");
    let before = Dockerd::start_binary(
        &binary,
        &node.root.join(DAEMON_JSON.trim_start_matches('/')),
        &node.tmp.path().join("before"),
    )
    .info();
    assert_eq!(
        before["CDISpecDirs"],
        serde_json::json!([]),
        "CDI is off by default in docker 26"
    );

    let out = run_agent(&node, &["runtime", "configure", "--no-restart"]);
    let written = fs::read_to_string(node.root.join(DAEMON_JSON.trim_start_matches('/'))).expect("daemon.json");
    let after = Dockerd::start_binary(
        &binary,
        &node.root.join(DAEMON_JSON.trim_start_matches('/')),
        &node.tmp.path().join("after"),
    )
    .info();
    let dirs: Vec<&str> = after["CDISpecDirs"]
        .as_array()
        .map(|a| a.iter().filter_map(|d| d.as_str()).collect())
        .unwrap_or_default();
    assert!(dirs.contains(&"/var/run/cdi"), "{dirs:?}\n{out}\n{written}");
    assert!(after["Runtimes"].get("nvidia").is_none(), "{}", after["Runtimes"]);
    assert!(written.contains("\"log-level\": \"warn\""), "{written}");

    require_root_and(DOCKERD);
    let old = Node::new(&common::machine("A100-SXM4-40GB", 1), "");
    put(&old.root, "/lib/systemd/system/docker.service", "[Service]\n");
    link(&old.root, "/usr/sbin/dockerd", DOCKERD);
    let out = old.run(&["runtime", "configure", "--no-restart"]);
    let text = String::from_utf8_lossy(&out.stderr);
    if dockerd_25() == DOCKERD {
        return; // the system's docker has CDI: no old one to try
    }
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("has no CDI (25.0 and later do)") && text.contains("install the NVIDIA Container Toolkit"),
        "{text}"
    );
    assert!(!old.root.join(DAEMON_JSON.trim_start_matches('/')).exists());
}
