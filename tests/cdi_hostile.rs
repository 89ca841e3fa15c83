//! Hostile images against the CDI spec's hooks (issue #32), with real OCI runtimes and no engine:
//! Debian's `runc` (1.1) and `crun` (1.8), each given a bundle the test builds itself.
//!
//! The hooks of the agent's CDI spec are OCI `createContainer` hooks: the runtime runs them as
//! host root, in the container's mount namespace before `pivot_root` (the host's files still
//! visible), while the image is untrusted. Each test here builds an image that tries to make a
//! hook act on a host file, and asserts that nothing outside the container's root changed: a
//! *canary* folder beside the bundles (`<tmp>/canary`, a few files and the folders the images'
//! symlinks point at) is read before and after (type, mode, inode, size, mtime, content, link
//! targets) and must be exactly as it was, for both runtimes.
//!
//! The harness:
//!
//! - The node: the fake NVML with one A100 and a driver tree under the agent's root at
//!   `/run/nvidia/driver` (the GPU Operator's driver-container layout), as in
//!   `tests/cdi_container.rs`: stub `libcuda.so.550.54.15` and `libnvidia-ml.so.550.54.15` built
//!   with `cc` into `usr/lib64`, and the GPU's device nodes (`mknod`).
//! - The spec: `gpu-node-agent cdi generate --output -` with [`CONFIG`] and [`HOOK_CONFIG`],
//!   taken as it is: the hooks' `path`, `args` and `env` are whatever the spec says, so these tests
//!   follow the spec to another hook program unchanged.
//! - A test-side CDI applier ([`apply_cdi`]) writes the OCI `config.json`: the device's and the
//!   spec's `containerEdits` (env to `process.env`; device nodes to `linux.devices`, type, major
//!   and minor from the host node; mounts to bind mounts with the spec's options; hooks copied
//!   with `path`, `args` and `env` exactly, an absent `env` left absent). The config has its own
//!   PID, network, IPC, UTS and mount namespaces, a memory and PIDs limit (a hook that reads
//!   `/dev/zero` to the end is killed by the cgroup, not the machine), no terminal.
//! - Each runtime runs in a private mount namespace (`unshare --mount --propagation private`)
//!   with a tmpfs on `/run`, where the driver tree is bind-mounted at `/run/nvidia/driver`, so
//!   host paths in the spec are the paths the runtime sees; its state (`--root`) is in the test's
//!   temp dir, cgroups are cgroupfs (crun refuses a hybrid v1/v2 host, so for crun the namespace
//!   also unmounts `/sys/fs/cgroup/unified`), and it runs with the bundle as working directory, as
//!   containerd's shim runs it. crun drops a hook's output unless the bundle's annotations
//!   `run.oci.hooks.stdout`/`stderr` name files: they do, and the output shown includes them.
//! - Every run is bounded ([`BOUND`]): a runtime still running then is killed with all its
//!   descendants and `delete -f`'d, and the run counts as hung (a failure).
//! - Every hostile test first runs a benign control container with the same harness and asserts
//!   it starts and `dlopen("libcuda.so.1")` works in it, so a failure below is the escape and not
//!   a harness that cannot start containers at all.
//!
//! What the two runtimes do differently, seen here: runc runs a hook without `env` with the
//! *container's* environment (`process.env`) and the root file system as working directory, so
//! the image's `LD_PRELOAD=/proc/self/cwd/evil.so` reaches it; crun gives such a hook crun's own
//! environment and the bundle as working directory. Neither bounds a hook without `timeout`.
//! crun 1.8 refuses a folder of the image that is a link when it creates a bind mount's target
//! (`openat2`, in the root); runc 1.1 follows it inside the root, and races on it (see
//! [`racing_sibling`]).
//!
//! Nothing outside the test's temp dir changes: mounts are in the private namespaces, state is
//! in the temp dir, and the runtimes remove the cgroups they create when the container goes.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::Node;
use serde_json::{Value, json};

const DRIVER_ROOT: &str = "/run/nvidia/driver";
const VERSION: &str = "550.54.15";

/// The node's driver and device roots (the GPU Operator's driver-container layout).
const CONFIG: &str = "[device_plugin]\ndriver_root = \"/run/nvidia/driver\"\ndev_root = \"/run/nvidia/driver\"\n";

/// Which program the spec's hooks run: the agent's own, `gpu-node-agent-cdi-hook`, as the
/// packages ship it (statically linked, [`common::cdi_hook_program`], named by `cdi.agent_path`
/// in a drop-in). The hooks are taken from the spec as they are.
const HOOK_CONFIG: &str = "[cdi]\nhook = \"agent\"\n";

/// How long one runtime run may take before the test kills it and reports it as hung.
const BOUND: Duration = Duration::from_secs(60);

/// How long a run against a hostile image may take at most to count as finished "well within"
/// [`BOUND`] (a hook that waits on a FIFO until some inner timeout fires is not well).
const PROMPT: Duration = Duration::from_secs(20);

/// What the container runs to show its driver libraries work.
const CHECK: &str = "dlcheck libcuda.so.1 libnvidia-ml.so.1; echo rc=$?";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runtime {
    Runc,
    Crun,
}

const RUNTIMES: [Runtime; 2] = [Runtime::Runc, Runtime::Crun];

impl Runtime {
    fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Crun => "crun",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Runtime::Runc => "/usr/sbin/runc",
            Runtime::Crun => "/usr/bin/crun",
        }
    }
}

fn require_root_and(programs: &[&str]) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs containers and needs root (CI runs as root)"
    );
    for program in programs {
        assert!(
            Path::new(program).is_file(),
            "{program} is missing: scripts/deps installs it (apt-get install runc crun busybox-static gcc libc6-dev)"
        );
    }
}

/// Compiles the C `source` with `cc <flags> -o out`.
fn compile(scratch: &Path, name: &str, source: &str, flags: &[&str], out: &Path) {
    let c = scratch.join(format!("{name}.c"));
    fs::write(&c, source).unwrap_or_else(|e| panic!("write {}: {e}", c.display()));
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    }
    common::ok(Command::new("cc").args(flags).arg("-o").arg(out).arg(&c));
}

/// A C string literal for `text` (paths of the test's temp dir: ASCII, no quotes).
fn c_string(text: &Path) -> String {
    let text = text.to_str().expect("a UTF-8 temp path");
    assert!(!text.contains(['"', '\\']), "{text}");
    format!("\"{text}\"")
}

fn fifo(path: &Path) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o644))
        .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

/// `path` (absolute, in the container) under `rootfs`, not following anything.
fn at(rootfs: &Path, path: &str) -> PathBuf {
    rootfs.join(path.trim_start_matches('/'))
}

/// Removes whatever is at `path` (file, link, special file or folder).
fn remove(path: &Path) {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => Ok(()),
    }
    .unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
}

// ---------------------------------------------------------------------------------------------
// The canary.

/// One entry of the canary as it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: String,
    mode: u32,
    inode: u64,
    size: u64,
    mtime: (i64, i64),
    content: Vec<u8>,
}

/// Every entry under `dir` (and `dir` itself, as ""), not following links.
fn snapshot(dir: &Path) -> BTreeMap<String, Seen> {
    let mut seen = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(path) = todo.pop() {
        let meta = fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("canary {}: {e}", path.display()));
        let ft = meta.file_type();
        let (kind, content) = if ft.is_symlink() {
            let target = fs::read_link(&path).expect("read canary link");
            (format!("symlink -> {}", target.display()), Vec::new())
        } else if ft.is_dir() {
            for entry in fs::read_dir(&path).expect("read canary dir") {
                todo.push(entry.expect("canary entry").path());
            }
            ("dir".to_string(), Vec::new())
        } else if ft.is_file() {
            ("file".to_string(), fs::read(&path).expect("read canary file"))
        } else {
            (format!("special {:?}", ft), Vec::new())
        };
        let rel = path.strip_prefix(dir).expect("under the canary").display().to_string();
        seen.insert(
            rel,
            Seen {
                kind,
                mode: meta.mode(),
                inode: meta.ino(),
                size: meta.size(),
                mtime: (meta.mtime(), meta.mtime_nsec()),
                content,
            },
        );
    }
    seen
}

/// What differs between two snapshots, one line each; empty when nothing does.
fn differences(before: &BTreeMap<String, Seen>, after: &BTreeMap<String, Seen>) -> Vec<String> {
    let mut said = Vec::new();
    for (path, was) in before {
        match after.get(path) {
            None => said.push(format!("removed: canary/{path} (was {})", was.kind)),
            Some(now) if now != was => {
                let mut what = Vec::new();
                if now.kind != was.kind {
                    what.push(format!("{} -> {}", was.kind, now.kind));
                }
                if now.content != was.content {
                    what.push(format!("content now {:?}", String::from_utf8_lossy(&now.content)));
                }
                for (field, changed) in [
                    ("mode", now.mode != was.mode),
                    ("inode (replaced)", now.inode != was.inode),
                    ("size", now.size != was.size),
                    (
                        if was.kind == "dir" {
                            "mtime (an entry was added or removed)"
                        } else {
                            "mtime"
                        },
                        now.mtime != was.mtime,
                    ),
                ] {
                    if changed {
                        what.push(field.to_string());
                    }
                }
                said.push(format!("changed: canary/{path} ({}): {}", was.kind, what.join(", ")));
            }
            Some(_) => {}
        }
    }
    for (path, now) in after {
        if !before.contains_key(path) {
            said.push(format!(
                "created: canary/{path} ({}{})",
                now.kind,
                if now.content.is_empty() {
                    String::new()
                } else {
                    format!(", content {:?}", String::from_utf8_lossy(&now.content))
                }
            ));
        }
    }
    said
}

// ---------------------------------------------------------------------------------------------
// The node, the spec and the runs.

/// What one runtime run did.
struct Run {
    runtime: Runtime,
    /// The exit status; `None` when the run was still going after [`BOUND`] and was killed.
    status: Option<std::process::ExitStatus>,
    elapsed: Duration,
    /// The runtime's standard output and error, then the hooks' (crun's annotations).
    output: String,
}

impl Run {
    fn started(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn hung(&self) -> bool {
        self.status.is_none()
    }

    fn describe(&self) -> String {
        let how = match self.status {
            None => format!("hung: killed after {} s", BOUND.as_secs()),
            Some(s) => format!("{s}"),
        };
        format!(
            "{} ({how}, {:.1} s):\n{}",
            self.runtime.name(),
            self.elapsed.as_secs_f64(),
            self.output.trim_end()
        )
    }
}

/// The node with its driver tree, the agent's spec, the canary and the compiled helpers.
struct Harness {
    node: Node,
    /// The test's own folder (bundles, scratch, runtime state) in the node's temp dir.
    dir: PathBuf,
    canary: PathBuf,
    spec: Value,
    /// `dlcheck`: `dlopen`s each name it is given (host glibc, dynamically linked).
    dlcheck: PathBuf,
    runs: AtomicU32,
}

impl Harness {
    fn new() -> Harness {
        require_root_and(&[
            Runtime::Runc.program(),
            Runtime::Crun.program(),
            "/bin/busybox",
            "/usr/bin/unshare",
        ]);
        let node = Node::new(&common::machine("A100-SXM4-40GB", 1), CONFIG);
        node.use_static_cdi_hook();
        let dir = node.tmp.path().join("hostile");
        let scratch = dir.join("src");
        fs::create_dir_all(&scratch).expect("scratch");

        let driver = node.root.join(DRIVER_ROOT.trim_start_matches('/'));
        let lib64 = driver.join("usr/lib64");
        for (lib, source) in [
            ("libcuda", "int cuInit(unsigned flags) { return flags; }\n"),
            ("libnvidia-ml", "int nvmlInit_v2(void) { return 0; }\n"),
        ] {
            compile(
                &scratch,
                lib,
                source,
                &["-shared", "-fPIC", &format!("-Wl,-soname,{lib}.so.1")],
                &lib64.join(format!("{lib}.so.{VERSION}")),
            );
        }
        let dev = driver.join("dev");
        common::char_node(&dev.join("nvidiactl"), 195, 255);
        common::char_node(&dev.join("nvidia0"), 195, 0);

        let dlcheck = scratch.join("dlcheck");
        compile(&scratch, "dlcheck", common::DLCHECK_C, &[], &dlcheck);

        // The canary: files, and the folders the hostile images' links point at (with what a
        // hook would act on if it followed them).
        let canary = node.tmp.path().join("canary");
        for (path, text) in [
            ("keep.txt", "the host's file\n"),
            ("etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n"),
            ("ld.so.conf.d/host.conf", "/opt/host/lib\n"),
            ("lib64/libhost.so.1", "not a library\n"),
            ("compat/libcuda.so.999.1.1", "a compat libcuda newer than any driver\n"),
        ] {
            let file = canary.join(path);
            fs::create_dir_all(file.parent().expect("dir")).expect("mkdir canary");
            fs::write(&file, text).expect("write canary");
        }

        node.write_config(&format!("{CONFIG}\n{HOOK_CONFIG}"));
        let out = node.run(&["cdi", "generate", "--output", "-"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "cdi generate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let spec: Value = serde_json::from_slice(&out.stdout).expect("the spec is JSON");
        let hooks = spec["containerEdits"]["hooks"].as_array().cloned().unwrap_or_default();
        assert!(!hooks.is_empty(), "the spec has no hooks to test: {spec}");

        Harness {
            node,
            dir,
            canary,
            spec,
            dlcheck,
            runs: AtomicU32::new(0),
        }
    }

    fn scratch(&self) -> PathBuf {
        self.dir.join("src")
    }

    fn driver_tree(&self) -> PathBuf {
        self.node.root.join(DRIVER_ROOT.trim_start_matches('/'))
    }

    /// The spec's hooks (all hook names).
    fn hooks(&self) -> Vec<Value> {
        self.spec["containerEdits"]["hooks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The link paths (in the container) of the spec's `create-symlinks` hook: the values of its
    /// `--link <target>::<path>` arguments.
    fn link_paths(&self) -> Vec<String> {
        let mut paths = Vec::new();
        for hook in self.hooks() {
            let args: Vec<&str> = hook["args"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            for (i, arg) in args.iter().enumerate() {
                let value = if *arg == "--link" {
                    args.get(i + 1).copied()
                } else {
                    arg.strip_prefix("--link=")
                };
                if let Some((_, path)) = value.and_then(|v| v.split_once("::")) {
                    paths.push(path.to_string());
                }
            }
        }
        paths
    }

    /// A fresh bundle folder with a Debian-layout root file system in `rootfs/`.
    fn bundle(&self, name: &str) -> PathBuf {
        let n = self.runs.fetch_add(1, Ordering::SeqCst);
        let bundle = self.dir.join(format!("{name}-{n}"));
        debian_rootfs(&bundle.join("rootfs"), &self.dlcheck);
        bundle
    }

    /// Writes `bundle/config.json`: the container runs `sh -c command` with `env` added, gets
    /// GPU 0 of the spec applied; `strip_hook_env` removes every hook's `env` (a runtime that
    /// ignores it).
    fn configure(&self, bundle: &Path, command: &str, env: &[&str], strip_hook_env: bool) {
        let mut config = base_config(bundle, command, env);
        apply_cdi(&mut config, &self.spec, "0", &self.node.root);
        if strip_hook_env {
            for (_, hooks) in config["hooks"].as_object_mut().expect("hooks").iter_mut() {
                for hook in hooks.as_array_mut().expect("hook list") {
                    hook.as_object_mut().expect("hook").remove("env");
                }
            }
        }
        fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config).expect("config json"),
        )
        .expect("write config.json");
    }

    /// Runs the bundle's container with `runtime`, bounded by [`BOUND`].
    fn run(&self, runtime: Runtime, bundle: &Path) -> Run {
        let n = self.runs.fetch_add(1, Ordering::SeqCst);
        let id = format!("gna-hostile-{}-{n}", std::process::id());
        let state = self.dir.join(format!("state-{}", runtime.name()));
        fs::create_dir_all(&state).expect("state dir");
        let log = bundle.join(format!("{}.out", runtime.name()));
        let file = fs::File::create(&log).expect("runtime log");
        // The driver tree where the spec's host paths say it is, in this namespace only; crun
        // 1.8 refuses a hybrid cgroup v1/v2 host, so it sees the v1 hierarchies only.
        let script = r#"set -e
mount -t tmpfs tmpfs /run
mkdir -p /run/nvidia/driver
mount --bind "$1" /run/nvidia/driver
if [ "$2" = crun ] && mountpoint -q /sys/fs/cgroup/unified; then umount /sys/fs/cgroup/unified; fi
cd "$4"
case "$2" in
  runc) exec "$3" --root "$5" run --bundle "$4" "$6" ;;
  crun) exec "$3" --root "$5" --cgroup-manager cgroupfs run --bundle "$4" "$6" ;;
esac
"#;
        let started = Instant::now();
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", script, "sh"])
            .arg(self.driver_tree())
            .arg(runtime.name())
            .arg(runtime.program())
            .arg(bundle)
            .arg(&state)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", runtime.name()));
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for the runtime") {
                break Some(status);
            }
            if started.elapsed() > BOUND {
                kill_tree(child.id() as i32);
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = started.elapsed();
        if status.is_none_or(|s| !s.success()) {
            clean_up(runtime, &state, &id);
        }
        let mut output = fs::read_to_string(&log).unwrap_or_default();
        for hook_log in ["hooks.stdout", "hooks.stderr"] {
            if let Ok(text) = fs::read_to_string(bundle.join(hook_log))
                && !text.is_empty()
            {
                output.push_str(&format!("[{hook_log}] {text}"));
            }
        }
        Run {
            runtime,
            status,
            elapsed,
            output,
        }
    }

    /// A benign container with the same harness: it starts and finds `libcuda.so.1`. Panics
    /// (before any hostile image) otherwise.
    fn control(&self, runtime: Runtime) {
        let bundle = self.bundle("control");
        self.configure(&bundle, CHECK, &[], false);
        let run = self.run(runtime, &bundle);
        assert!(
            run.started() && run.output.contains("dlopen libcuda.so.1: ok") && run.output.contains("rc=0"),
            "the benign control container does not work with this harness, so nothing hostile was tried: {}",
            run.describe()
        );
    }

    fn snapshot(&self) -> BTreeMap<String, Seen> {
        snapshot(&self.canary)
    }
}

/// What a killed or failed run may leave: the container's state (`delete --force`) and the
/// cgroups the runtime made for it (`/sys/fs/cgroup/<hierarchy>/<id>`, the default
/// `cgroupsPath`), which a runtime killed while it creates the container does not remove.
fn clean_up(runtime: Runtime, state: &Path, id: &str) {
    let _ = Command::new(runtime.program())
        .arg("--root")
        .arg(state)
        .args(["delete", "--force", id])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let Ok(hierarchies) = fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let left: Vec<PathBuf> = hierarchies
        .flatten()
        .map(|h| h.path().join(id))
        .filter(|c| c.is_dir())
        .collect();
    // A killed process leaves its cgroup a moment after it is gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    for cgroup in left {
        while fs::remove_dir(&cgroup).is_err() && cgroup.is_dir() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// SIGKILLs `root` and every process descending from it (found by walking `/proc`), children
/// first found, so nothing is left behind; the runtimes' own processes only.
fn kill_tree(root: i32) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for _ in 0..5 {
        let mut parent_of = Vec::new();
        for entry in fs::read_dir("/proc").expect("/proc").flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
            let Some(ppid) = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue;
            };
            parent_of.push((pid, ppid));
        }
        let mut tree = vec![root];
        let mut i = 0;
        while i < tree.len() {
            let p = tree[i];
            tree.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
            i += 1;
        }
        // Stop them all before killing any, so none is reparented out of sight meanwhile.
        for pid in &tree {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGSTOP);
        }
        for pid in &tree {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        if tree.len() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The OCI config of a container running `sh -c command` (no GPU yet).
fn base_config(bundle: &Path, command: &str, env: &[&str]) -> Value {
    let mut process_env = vec!["PATH=/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    process_env.extend(env.iter().map(|e| e.to_string()));
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", command],
            "env": process_env,
            "cwd": "/",
            "noNewPrivileges": true,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
        },
        "root": {"path": "rootfs", "readonly": false},
        "hostname": "hostile",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]}
        ],
        "hooks": {},
        // crun drops hook output unless told where to write it.
        "annotations": {
            "run.oci.hooks.stdout": bundle.join("hooks.stdout"),
            "run.oci.hooks.stderr": bundle.join("hooks.stderr")
        },
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}
            ],
            "resources": {
                "devices": [{"allow": false, "access": "rwm"}],
                "memory": {"limit": 512u64 << 20},
                "pids": {"limit": 512}
            },
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/sys/firmware"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]
        }
    })
}

/// Applies CDI `device` of `spec` to an OCI `config`, as a CDI library does: the device's and
/// the spec's `containerEdits`. Host paths are read under `host_root` (the node's root, where
/// the spec's `/run/nvidia/driver` lies on this machine).
fn apply_cdi(config: &mut Value, spec: &Value, device: &str, host_root: &Path) {
    let dev = spec["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| d["name"] == device)
        .unwrap_or_else(|| panic!("no device {device} in the spec: {spec}"));
    for edits in [&dev["containerEdits"], &spec["containerEdits"]] {
        for env in edits["env"].as_array().into_iter().flatten() {
            config["process"]["env"].as_array_mut().expect("env").push(env.clone());
        }
        for node in edits["deviceNodes"].as_array().into_iter().flatten() {
            let path = node["path"].as_str().expect("deviceNodes path");
            let host = node["hostPath"].as_str().unwrap_or(path);
            let on_disk = host_root.join(host.trim_start_matches('/'));
            let meta = fs::metadata(&on_disk).unwrap_or_else(|e| panic!("device node {}: {e}", on_disk.display()));
            let kind = if meta.file_type().is_block_device() { "b" } else { "c" };
            let (major, minor) = (nix::sys::stat::major(meta.rdev()), nix::sys::stat::minor(meta.rdev()));
            if config["linux"].get("devices").is_none() {
                config["linux"]["devices"] = json!([]);
            }
            config["linux"]["devices"].as_array_mut().expect("devices").push(json!({
                "path": path, "type": node["type"].as_str().unwrap_or(kind),
                "major": major, "minor": minor,
                "fileMode": node["fileMode"].as_u64().unwrap_or(0o666),
                "uid": 0, "gid": 0
            }));
            config["linux"]["resources"]["devices"]
                .as_array_mut()
                .expect("device rules")
                .push(json!({
                    "allow": true, "type": kind, "major": major, "minor": minor,
                    "access": node["permissions"].as_str().unwrap_or("rwm")
                }));
        }
        for mount in edits["mounts"].as_array().into_iter().flatten() {
            let mut options: Vec<Value> = mount["options"].as_array().cloned().unwrap_or_default();
            if !options.iter().any(|o| o == "bind" || o == "rbind") {
                options.push(json!("bind"));
            }
            config["mounts"].as_array_mut().expect("mounts").push(json!({
                "destination": mount["containerPath"],
                "source": mount["hostPath"],
                "type": mount["type"].as_str().unwrap_or("bind"),
                "options": options
            }));
        }
        for hook in edits["hooks"].as_array().into_iter().flatten() {
            let name = hook["hookName"].as_str().expect("hookName");
            let mut oci = serde_json::Map::new();
            for key in ["path", "args", "env", "timeout"] {
                if let Some(v) = hook.get(key) {
                    oci.insert(key.to_string(), v.clone());
                }
            }
            let hooks = config["hooks"].as_object_mut().expect("hooks");
            hooks
                .entry(name)
                .or_insert_with(|| json!([]))
                .as_array_mut()
                .expect("hook list")
                .push(Value::Object(oci));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Root file systems.

/// busybox (`/bin/sh` and a few applets), nothing else.
fn busybox(rootfs: &Path) {
    for d in ["bin", "sbin", "etc", "proc", "dev", "sys", "tmp"] {
        fs::create_dir_all(rootfs.join(d)).expect("rootfs dir");
    }
    fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static");
    for applet in ["sh", "ls", "cat", "echo", "true", "grep"] {
        symlink("busybox", rootfs.join("bin").join(applet)).expect("applet");
    }
}

/// A Debian image: glibc multiarch (`/lib/x86_64-linux-gnu`, the loader in `/lib64`), the
/// host's static `ldconfig` as `/sbin/ldconfig`, `/etc/ld.so.conf` with `ld.so.conf.d`, and
/// `dlcheck`.
fn debian_rootfs(rootfs: &Path, dlcheck: &Path) {
    busybox(rootfs);
    let multiarch = rootfs.join("lib/x86_64-linux-gnu");
    fs::create_dir_all(&multiarch).expect("multiarch dir");
    fs::create_dir_all(rootfs.join("lib64")).expect("lib64");
    fs::copy("/lib64/ld-linux-x86-64.so.2", rootfs.join("lib64/ld-linux-x86-64.so.2")).expect("ld.so");
    fs::copy("/lib/x86_64-linux-gnu/libc.so.6", multiarch.join("libc.so.6")).expect("libc");
    fs::copy("/sbin/ldconfig", rootfs.join("sbin/ldconfig")).expect("ldconfig");
    fs::create_dir_all(rootfs.join("etc/ld.so.conf.d")).expect("ld.so.conf.d");
    fs::write(rootfs.join("etc/ld.so.conf"), "include /etc/ld.so.conf.d/*.conf\n").expect("ld.so.conf");
    fs::write(
        rootfs.join("etc/ld.so.conf.d/x86_64-linux-gnu.conf"),
        "/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
    )
    .expect("multiarch conf");
    fs::copy(dlcheck, rootfs.join("bin/dlcheck")).expect("dlcheck");
}

/// A RHEL-style image: the C library in `/usr/lib64`, `/lib64 -> usr/lib64`, and `/usr/lib64`
/// in `ld.so.conf.d` (RHEL's glibc has it built in; the host's Debian one does not).
fn lib64_rootfs(rootfs: &Path, dlcheck: &Path) {
    busybox(rootfs);
    let lib64 = rootfs.join("usr/lib64");
    fs::create_dir_all(&lib64).expect("usr/lib64");
    symlink("usr/lib64", rootfs.join("lib64")).expect("lib64 link");
    fs::copy("/lib64/ld-linux-x86-64.so.2", lib64.join("ld-linux-x86-64.so.2")).expect("ld.so");
    fs::copy("/lib/x86_64-linux-gnu/libc.so.6", lib64.join("libc.so.6")).expect("libc");
    fs::copy("/sbin/ldconfig", rootfs.join("sbin/ldconfig")).expect("ldconfig");
    fs::create_dir_all(rootfs.join("etc/ld.so.conf.d")).expect("ld.so.conf.d");
    fs::write(rootfs.join("etc/ld.so.conf"), "include ld.so.conf.d/*.conf\n").expect("ld.so.conf");
    fs::write(rootfs.join("etc/ld.so.conf.d/lib64.conf"), "/usr/lib64\n").expect("lib64 conf");
    fs::copy(dlcheck, rootfs.join("bin/dlcheck")).expect("dlcheck");
}

/// Scenario 1: `/evil.so`, a library whose constructor appends its process's command line to
/// `canary/pwned-by-preload`, for `LD_PRELOAD=/proc/self/cwd/evil.so` (runc runs hooks in the
/// root file system); and `/evil/libgcc_s.so.1`, a stand-in for the real one (a filter over it,
/// with its symbol versions) whose constructor writes `canary/pwned-by-library-path`, for
/// `LD_LIBRARY_PATH=/proc/self/cwd/evil`: a dynamically linked Rust program needs
/// `libgcc_s.so.1`, finds this one first, and works as before.
fn evil_libraries(h: &Harness, rootfs: &Path) {
    let payload = |file: &str| {
        format!(
            r#"#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void pwn(void) {{
  char cmd[512];
  ssize_t n = 0;
  int c = open("/proc/self/cmdline", O_RDONLY);
  if (c >= 0) {{ n = read(c, cmd, sizeof cmd); close(c); }}
  for (ssize_t i = 0; i < n; i++) if (!cmd[i]) cmd[i] = ' ';
  int fd = open({}, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {{ if (n > 0) write(fd, cmd, n); write(fd, "\n", 1); close(fd); }}
}}
"#,
            c_string(&h.canary.join(file))
        )
    };
    let preload = h.scratch().join("evil.so");
    let libgcc = h.scratch().join("evil/libgcc_s.so.1");
    if !libgcc.exists() {
        compile(
            &h.scratch(),
            "evil-preload",
            &payload("pwned-by-preload"),
            &["-shared", "-fPIC"],
            &preload,
        );
        let versions = h.scratch().join("libgcc_s.map");
        fs::write(
            &versions,
            "GCC_3.0 { };\nGCC_3.3 { } GCC_3.0;\nGCC_4.2.0 { } GCC_3.3;\nGCC_7.0.0 { } GCC_4.2.0;\n",
        )
        .expect("version script");
        compile(
            &h.scratch(),
            "evil-libgcc",
            &payload("pwned-by-library-path"),
            &[
                "-shared",
                "-fPIC",
                "-Wl,-soname,libgcc_s.so.1",
                &format!("-Wl,--version-script={}", versions.display()),
                "-Wl,--filter=/lib/x86_64-linux-gnu/libgcc_s.so.1",
            ],
            &libgcc,
        );
    }
    fs::copy(&preload, rootfs.join("evil.so")).expect("install evil.so");
    fs::create_dir_all(rootfs.join("evil")).expect("mkdir /evil");
    fs::copy(&libgcc, rootfs.join("evil/libgcc_s.so.1")).expect("install the evil libgcc_s.so.1");
}

/// Scenario 2: the image's `/sbin/ldconfig` and `/sbin/ldconfig.real` are a static program
/// that drops `/ldconfig-ran` in whatever root it was started in, then leaves a chroot (a new
/// one below the working directory, `..` up to the real root, chroot there) and writes
/// `canary/pwned-by-ldconfig`.
fn escaping_ldconfig(h: &Harness, rootfs: &Path) {
    let source = format!(
        r#"#define _GNU_SOURCE
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char **argv) {{
  int fd = open("/ldconfig-ran", O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {{ write(fd, argv[0], strlen(argv[0])); write(fd, "\n", 1); close(fd); }}
  mkdir("x", 0755);
  chroot("x");
  for (int i = 0; i < 64; i++) chdir("..");
  chroot(".");
  fd = open({}, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {{ write(fd, "escaped the chroot\n", 19); close(fd); }}
  return 0;
}}
"#,
        c_string(&h.canary.join("pwned-by-ldconfig"))
    );
    let built = h.scratch().join("evil-ldconfig");
    if !built.exists() {
        compile(&h.scratch(), "evil-ldconfig", &source, &["-static", "-O"], &built);
    }
    for name in ["sbin/ldconfig", "sbin/ldconfig.real"] {
        let path = rootfs.join(name);
        remove(&path);
        fs::copy(&built, &path).expect("install the evil ldconfig");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    }
}

/// Scenario 3: the folders the hooks and the spec's mounts use are links to the canary's
/// folders: `/etc/ld.so.conf.d`, `/usr/lib64`, `/usr/local/cuda/compat`; absolute links, or
/// relative ones that climb (`../../../..` past the root) first.
fn links_to_host_folders(h: &Harness, rootfs: &Path, relative: bool) {
    for (path, host) in [
        ("/etc/ld.so.conf.d", "ld.so.conf.d"),
        ("/usr/lib64", "lib64"),
        ("/usr/local/cuda/compat", "compat"),
    ] {
        let link = at(rootfs, path);
        remove(&link);
        fs::create_dir_all(link.parent().expect("parent")).expect("mkdir");
        symlink(host_link(&h.canary.join(host), relative), &link).expect("link to the host");
    }
}

/// Scenario 3, files: the files the hooks read or write (see [`hook_files`]) are links to
/// canary files.
fn links_to_host_files(h: &Harness, rootfs: &Path, relative: bool) {
    let host_files = ["etc/ld.so.conf", "ld.so.conf.d/host.conf", "lib64/libhost.so.1"];
    for (i, path) in hook_files(h).iter().enumerate() {
        let link = at(rootfs, path);
        remove(&link);
        fs::create_dir_all(link.parent().expect("parent")).expect("mkdir");
        let host = h.canary.join(host_files[i % host_files.len()]);
        symlink(host_link(&host, relative), &link).expect("link to the host");
    }
}

/// A link target for the host path `host`: itself, or relative, climbing past any root first.
fn host_link(host: &Path, relative: bool) -> PathBuf {
    if relative {
        Path::new(&"../".repeat(16)).join(host.strip_prefix("/").expect("absolute"))
    } else {
        host.to_path_buf()
    }
}

/// The files the hooks read or write in the container (from `src/runtime/cdi/hook.rs` and the
/// spec): the two `ld.so.conf.d` files, `ld.so.conf`, `ld.so.cache`, and the first
/// `create-symlinks` link path of the spec.
fn hook_files(h: &Harness) -> Vec<String> {
    let mut files: Vec<String> = [
        "/etc/ld.so.conf.d/00-gpu-node-agent.conf",
        "/etc/ld.so.conf.d/00-gpu-node-agent-cuda-compat.conf",
        "/etc/ld.so.conf",
        "/etc/ld.so.cache",
    ]
    .map(String::from)
    .to_vec();
    let links = h.link_paths();
    let link = links
        .iter()
        .find(|p| p.ends_with("/libcuda.so.1"))
        .or(links.first())
        .expect("the spec's create-symlinks hook has a link");
    files.push(link.clone());
    files
}

#[derive(Clone, Copy, Debug)]
enum Special {
    Fifo,
    /// `mknod c 1 5`: `/dev/zero`, endless to read, swallows writes.
    Zero,
}

/// Scenario 4: a special file at `path`.
fn special_at(rootfs: &Path, path: &str, special: Special) {
    let file = at(rootfs, path);
    remove(&file);
    match special {
        Special::Fifo => fifo(&file),
        Special::Zero => common::char_node(&file, 1, 5),
    }
}

/// Whether `output` names `path` (not as the prefix of a longer name).
fn names(output: &str, path: &str) -> bool {
    output.match_indices(path).any(|(i, _)| {
        output[i + path.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || matches!(c, '.' | '-' | '_' | '/')))
    })
}

/// Runs `check` for each runtime and panics with every failure at the end, so one runtime's
/// failure does not hide the other's result.
fn each_runtime(h: &Harness, mut check: impl FnMut(Runtime) -> Vec<String>) {
    let mut failures = Vec::new();
    for runtime in RUNTIMES {
        h.control(runtime);
        failures.extend(check(runtime).into_iter().map(|f| format!("[{}] {f}", runtime.name())));
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

/// Runs a container of `bundle` with `runtime` and returns the failures: the canary changed,
/// or the run hung.
fn run_hostile(h: &Harness, runtime: Runtime, bundle: &Path, what: &str) -> (Run, Vec<String>) {
    let before = h.snapshot();
    let run = h.run(runtime, bundle);
    let changed = differences(&before, &h.snapshot());
    let mut failures = Vec::new();
    if !changed.is_empty() {
        failures.push(format!(
            "{what}: the host's canary changed:\n  {}\n{}",
            changed.join("\n  "),
            run.describe()
        ));
    }
    if run.hung() {
        failures.push(format!("{what}: {}", run.describe()));
    }
    (run, failures)
}

// ---------------------------------------------------------------------------------------------
// Scenario 1: the image's environment.

#[test]
fn the_images_ld_preload_and_ld_library_path_never_reach_a_hook() {
    let h = Harness::new();
    let variants: [(&str, &str, bool); 4] = [
        (
            "LD_PRELOAD, hooks as in the spec",
            "LD_PRELOAD=/proc/self/cwd/evil.so",
            false,
        ),
        (
            "LD_LIBRARY_PATH, hooks as in the spec",
            "LD_LIBRARY_PATH=/proc/self/cwd/evil",
            false,
        ),
        (
            "LD_PRELOAD, the hooks' env stripped (a runtime that ignores it)",
            "LD_PRELOAD=/proc/self/cwd/evil.so",
            true,
        ),
        (
            "LD_LIBRARY_PATH, the hooks' env stripped (a runtime that ignores it)",
            "LD_LIBRARY_PATH=/proc/self/cwd/evil",
            true,
        ),
    ];
    each_runtime(&h, |runtime| {
        let mut failures = Vec::new();
        for (what, env, strip) in variants {
            let bundle = h.bundle("env");
            evil_libraries(&h, &bundle.join("rootfs"));
            h.configure(&bundle, "true", &[env], strip);
            let (run, mut failed) = run_hostile(&h, runtime, &bundle, what);
            if failed.is_empty() && !run.started() {
                failed.push(format!(
                    "{what}: the container did not start (nothing hostile is in its way): {}",
                    run.describe()
                ));
            }
            failures.extend(failed);
            // Each variant on its own: what one left must not count for the next.
            for file in ["pwned-by-preload", "pwned-by-library-path"] {
                let _ = fs::remove_file(h.canary.join(file));
            }
        }
        failures
    });
}

// ---------------------------------------------------------------------------------------------
// Scenario 2: the image's ldconfig.

#[test]
fn the_images_ldconfig_is_never_run_and_cannot_leave_a_chroot() {
    let h = Harness::new();
    each_runtime(&h, |runtime| {
        let bundle = h.bundle("ldconfig");
        let rootfs = bundle.join("rootfs");
        escaping_ldconfig(&h, &rootfs);
        h.configure(&bundle, "true", &[], false);
        let (run, mut failures) = run_hostile(&h, runtime, &bundle, "the image's ldconfig");
        if let Ok(ran) = fs::read_to_string(rootfs.join("ldconfig-ran")) {
            failures.push(format!(
                "the image's ldconfig was executed with host privileges (it left /ldconfig-ran: {:?}): {}",
                ran.trim(),
                run.describe()
            ));
        }
        let _ = fs::remove_file(h.canary.join("pwned-by-ldconfig"));
        failures
    });
}

// ---------------------------------------------------------------------------------------------
// Scenario 2b: what the host's ldconfig could do in its sandbox if the image's files took it
// over (a parser bug): a static probe stands in for ldconfig (`--ldconfig-path`) and tries the
// ways out a review found or feared. runc mounts /proc read-write and unmasked before the hooks
// run, and a process without capabilities may still write a sysctl there.

/// The probe: each attempt prints `BLOCKED <what>` or `ESCAPED <what>`, then `probe done`, and
/// it exits 1 so the hook fails and the runtime shows its output.
const SANDBOX_PROBE: &str = r#"#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>
static void says(int escaped, const char *what) {
  printf("%s %s\n", escaped ? "ESCAPED" : "BLOCKED", what);
  fflush(stdout);
}
int main(void) {
  int fd = open("/proc/sys/kernel/core_pattern", O_WRONLY);
  says(fd >= 0, "write /proc/sys/kernel/core_pattern");
  fd = open("/proc/sysrq-trigger", O_WRONLY);
  says(fd >= 0, "write /proc/sysrq-trigger");
  struct statfs st;
  says(statfs("/proc", &st) == 0 && st.f_type == 0x9fa0, "procfs at /proc");
  says(statfs("/sys", &st) == 0 && st.f_type == 0x62656572, "sysfs at /sys");
  says(syscall(SYS_mount, "none", "/", "tmpfs", 0, 0) == 0, "mount");
  pid_t p = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
  if (p == 0) _exit(0);
  if (p > 0) waitpid(p, 0, 0);
  says(p >= 0, "clone(CLONE_NEWUSER)");
  says(syscall(SYS_memfd_create, "x", 0) >= 0, "memfd_create");
  char *argv[] = {"sh", "-c", "exit 0", 0}, *envp[] = {0};
  for (int d = 0; d < 8; d++) {
    pid_t c = fork();
    if (c == 0) { syscall(SYS_execveat, d, "/bin/sh", argv, envp, AT_EMPTY_PATH); _exit(99); }
    int status = 0;
    waitpid(c, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) { says(1, "execveat of the image's /bin/sh"); break; }
    if (d == 7) says(0, "execveat of the image's /bin/sh");
  }
  pid_t c = fork();
  if (c == 0) { execve("/bin/sh", argv, envp); _exit(99); }
  int status = 0;
  waitpid(c, &status, 0);
  says(WIFEXITED(status) && WEXITSTATUS(status) == 0, "execve of the image's /bin/sh");
  struct { unsigned version; int pid; } hdr = {0x20080522, 0};
  struct { unsigned eff, perm, inh; } caps[2] = {{0}};
  syscall(SYS_capget, &hdr, caps);
  says(caps[0].eff || caps[1].eff || caps[0].perm || caps[1].perm, "a capability");
  puts("probe done");
  return 1;
}
"#;

#[test]
fn a_taken_over_ldconfig_reaches_no_sysctl_executes_nothing_and_has_no_privilege() {
    let h = Harness::new();
    let probe = h.scratch().join("ldconfig-probe");
    compile(
        &h.scratch(),
        "ldconfig-probe",
        SANDBOX_PROBE,
        &["-static", "-O1"],
        &probe,
    );
    let probe_arg = format!("--ldconfig-path={}", probe.display());
    each_runtime(&h, |runtime| {
        let bundle = h.bundle("probe");
        h.configure(&bundle, "true", &[], false);
        // The update-ldcache hook runs the probe as its ldconfig.
        let config_path = bundle.join("config.json");
        let mut config: Value =
            serde_json::from_slice(&fs::read(&config_path).expect("config.json")).expect("config json");
        for hook in config["hooks"]["createContainer"].as_array_mut().expect("hooks") {
            let args = hook["args"].as_array_mut().expect("args");
            if args.iter().any(|a| a == "update-ldcache") {
                args.push(json!(probe_arg));
            }
        }
        fs::write(&config_path, serde_json::to_vec_pretty(&config).expect("json")).expect("config.json");
        let (run, mut failures) = run_hostile(&h, runtime, &bundle, "a taken-over ldconfig");
        if !run.output.contains("probe done") {
            failures.push(format!("the probe did not run to its end: {}", run.describe()));
        }
        for line in run.output.lines().filter(|l| l.contains("ESCAPED")) {
            failures.push(format!("{}: {}", line.trim(), run.describe()));
        }
        failures
    });
}

// ---------------------------------------------------------------------------------------------
// Scenario 3: folders that are links to host folders.

#[test]
fn links_to_host_folders_and_files_are_resolved_inside_the_root() {
    let h = Harness::new();
    type Build = fn(&Harness, &Path, bool);
    let variants: [(&str, Build, bool); 4] = [
        (
            "folders linked to the host's (absolute links)",
            links_to_host_folders,
            false,
        ),
        (
            "folders linked to the host's (relative links)",
            links_to_host_folders,
            true,
        ),
        (
            "files linked to the host's (absolute links)",
            links_to_host_files,
            false,
        ),
        ("files linked to the host's (relative links)", links_to_host_files, true),
    ];
    each_runtime(&h, |runtime| {
        let mut failures = Vec::new();
        for (what, build, relative) in variants {
            let bundle = h.bundle("links");
            let rootfs = bundle.join("rootfs");
            build(&h, &rootfs, relative);
            h.configure(&bundle, CHECK, &[], false);
            let (run, failed) = run_hostile(&h, runtime, &bundle, what);
            eprintln!("[{}] {what}: {}", runtime.name(), run.describe());
            failures.extend(failed);
            // The compat folder the link points at has a libcuda newer than the driver: a hook
            // that read the host's folder would enable it, in the root, where the image's
            // `/etc/ld.so.conf.d` link leads.
            let in_root = rootfs.join(h.canary.strip_prefix("/").expect("absolute"));
            let conf = in_root.join("ld.so.conf.d/00-gpu-node-agent-cuda-compat.conf");
            if what.starts_with("folders") && fs::symlink_metadata(&conf).is_ok() {
                failures.push(format!(
                    "{what}: a hook read the host's folder through the image's /usr/local/cuda/compat link \
                     (it enabled the host's compat libcuda in {}): {}",
                    conf.display(),
                    run.describe()
                ));
            }
        }
        failures
    });
}

// ---------------------------------------------------------------------------------------------
// Scenario 4: special files where the hooks read and write.

/// One container per (runtime, file), all at once (each run is bounded by [`BOUND`], and a hook
/// that blocks would otherwise take that long each).
fn special_files(special: Special) {
    let h = Harness::new();
    for runtime in RUNTIMES {
        h.control(runtime);
    }
    let files = hook_files(&h);
    let before = h.snapshot();
    let runs: Vec<(Runtime, String, Run)> = std::thread::scope(|s| {
        let mut started = Vec::new();
        for runtime in RUNTIMES {
            for file in &files {
                let bundle = h.bundle("special");
                special_at(&bundle.join("rootfs"), file, special);
                h.configure(&bundle, "true", &[], false);
                let h = &h;
                started.push((runtime, file.clone(), s.spawn(move || h.run(runtime, &bundle))));
            }
        }
        started
            .into_iter()
            .map(|(r, f, t)| (r, f, t.join().expect("run thread")))
            .collect()
    });
    let changed = differences(&before, &h.snapshot());
    let mut failures = Vec::new();
    if !changed.is_empty() {
        failures.push(format!("the host's canary changed:\n  {}", changed.join("\n  ")));
    }
    for (runtime, file, run) in &runs {
        let what = format!("[{}] {special:?} at {file}", runtime.name());
        if run.hung() || run.elapsed > PROMPT {
            failures.push(format!(
                "{what}: not finished within {} s: {}",
                PROMPT.as_secs(),
                run.describe()
            ));
        } else if !run.started() && !names(&run.output, file) {
            failures.push(format!(
                "{what}: refused (fine) without naming {file}: {}",
                run.describe()
            ));
        }
    }
    let summary: Vec<String> = runs
        .iter()
        .map(|(r, f, run)| {
            format!(
                "{} {f}: {}",
                r.name(),
                if run.started() { "started" } else { "refused or hung" }
            )
        })
        .collect();
    eprintln!("{special:?}:\n  {}", summary.join("\n  "));
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

#[test]
fn a_fifo_at_a_file_a_hook_reads_or_writes_neither_hangs_nor_escapes() {
    special_files(Special::Fifo);
}

#[test]
fn dev_zero_at_a_file_a_hook_reads_or_writes_neither_hangs_nor_escapes() {
    special_files(Special::Zero);
}

// ---------------------------------------------------------------------------------------------
// Scenario 5: a sibling that swaps a folder for a link to the host's while the hooks run.

/// How long the racing sibling runs; it stops by itself.
const RACE: Duration = Duration::from_secs(20);
/// The most containers started during the race, per runtime.
const RACE_CONTAINERS: usize = 40;

/// Swaps `path` in `rootfs` (a real folder) with a link to `host`, atomically
/// (`renameat2(RENAME_EXCHANGE)`), as fast as it can, until `stop` or [`RACE`] has passed; the
/// number of swaps.
fn race(rootfs: &Path, path: &str, host: &Path, stop: &AtomicBool) -> u64 {
    let real = at(rootfs, path);
    let other = real.with_file_name(format!(".{}-swap", real.file_name().expect("name").to_string_lossy()));
    symlink(host, &other).expect("the swap link");
    let started = Instant::now();
    let mut swaps = 0;
    while !stop.load(Ordering::Relaxed) && started.elapsed() < RACE {
        nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &real,
            nix::fcntl::AT_FDCWD,
            &other,
            nix::fcntl::RenameFlags::RENAME_EXCHANGE,
        )
        .unwrap_or_else(|e| panic!("swap {}: {e}", real.display()));
        swaps += 1;
    }
    swaps
}

/// Containers of one bundle started in a loop while a sibling swaps its folder `path` with a
/// link to the canary's folder `host`.
fn racing_sibling(runtime: Runtime, path: &str, host: &str) {
    let h = Harness::new();
    h.control(runtime);
    let bundle = h.bundle("race");
    let rootfs = bundle.join("rootfs");
    fs::create_dir_all(at(&rootfs, path)).expect("the raced folder");
    h.configure(&bundle, "true", &[], false);
    let before = h.snapshot();
    let stop = AtomicBool::new(false);
    let mut runs = Vec::new();
    let swaps = std::thread::scope(|s| {
        let racer = s.spawn(|| race(&rootfs, path, &h.canary.join(host), &stop));
        let started = Instant::now();
        while started.elapsed() < RACE && runs.len() < RACE_CONTAINERS {
            let run = h.run(runtime, &bundle);
            let hung = run.hung();
            runs.push(run);
            if hung {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        racer.join().expect("racer")
    });
    let changed = differences(&before, &h.snapshot());
    let started = runs.iter().filter(|r| r.started()).count();
    eprintln!(
        "[{}] {} containers while {swaps} swaps of {path}: {started} started, {} refused or hung",
        runtime.name(),
        runs.len(),
        runs.len() - started
    );
    // runc 1.1 creates a bind mount's target (an empty file) before it checks where the path
    // led, so with `/usr/lib64` raced it makes the spec's mount targets in the host's folder
    // itself: a runtime bug (runc 1.2 opens the target inside the root), not a hook's. Those
    // files, and the folder's mtime they change, are reported and not counted.
    let targets: Vec<String> = h.spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| &d["containerEdits"])
        .chain([&h.spec["containerEdits"]])
        .flat_map(|e| e["mounts"].as_array().cloned().unwrap_or_default())
        .filter_map(|m| {
            let dest = m["containerPath"].as_str()?;
            (Path::new(dest).parent()? == Path::new(path)).then(|| {
                format!(
                    "created: canary/{host}/{} (file)",
                    Path::new(dest).file_name().expect("name").to_string_lossy()
                )
            })
        })
        .collect();
    let (by_runtime, by_hooks): (Vec<String>, Vec<String>) =
        changed.into_iter().partition(|line| targets.contains(line));
    let by_hooks: Vec<String> = by_hooks
        .into_iter()
        .filter(|line| {
            by_runtime.is_empty()
                || *line != format!("changed: canary/{host} (dir): mtime (an entry was added or removed)")
        })
        .collect();
    if !by_runtime.is_empty() {
        eprintln!(
            "[{}] the runtime itself made its mount targets in the host's folder (not counted here):\n  {}",
            runtime.name(),
            by_runtime.join("\n  ")
        );
    }
    let mut failures = Vec::new();
    if !by_hooks.is_empty() {
        let refused: Vec<String> = runs
            .iter()
            .filter(|r| !r.started())
            .take(3)
            .map(Run::describe)
            .collect();
        failures.push(format!(
            "the host's canary changed:\n  {}\nsome refused runs:\n{}",
            by_hooks.join("\n  "),
            refused.join("\n")
        ));
    }
    if let Some(hung) = runs.iter().find(|r| r.hung()) {
        failures.push(hung.describe());
    }
    assert!(failures.is_empty(), "[{}]\n{}", runtime.name(), failures.join("\n\n"));
}

#[test]
fn a_sibling_swapping_etc_ld_so_conf_d_for_a_host_link_cannot_redirect_a_hook_runc() {
    racing_sibling(Runtime::Runc, "/etc/ld.so.conf.d", "ld.so.conf.d");
}

#[test]
fn a_sibling_swapping_etc_ld_so_conf_d_for_a_host_link_cannot_redirect_a_hook_crun() {
    racing_sibling(Runtime::Crun, "/etc/ld.so.conf.d", "ld.so.conf.d");
}

#[test]
fn a_sibling_swapping_usr_lib64_for_a_host_link_cannot_redirect_a_hook_runc() {
    racing_sibling(Runtime::Runc, "/usr/lib64", "lib64");
}

#[test]
fn a_sibling_swapping_usr_lib64_for_a_host_link_cannot_redirect_a_hook_crun() {
    racing_sibling(Runtime::Crun, "/usr/lib64", "lib64");
}

// ---------------------------------------------------------------------------------------------
// Scenario 6: benign images.

/// What a benign image's container shows: its own `ldconfig -p` lists `libcuda.so.1`, and
/// `dlopen("libcuda.so.1")` works.
fn benign(build: impl Fn(&Path, &Path), ldconfig_in_image: bool) {
    let h = Harness::new();
    each_runtime(&h, |runtime| {
        let bundle = h.dir.join(format!("benign-{}", runtime.name()));
        build(&bundle.join("rootfs"), &h.dlcheck);
        let command = if ldconfig_in_image {
            "ldconfig -p | grep libcuda; dlcheck libcuda.so.1; echo rc=$?"
        } else {
            "dlcheck libcuda.so.1; echo rc=$?"
        };
        h.configure(&bundle, command, &[], false);
        let run = h.run(runtime, &bundle);
        eprintln!("{}", run.describe());
        let mut failures = Vec::new();
        if !run.started() {
            failures.push(format!("the container did not start: {}", run.describe()));
            return failures;
        }
        if ldconfig_in_image
            && !run
                .output
                .contains("libcuda.so.1 (libc6,x86-64) => /usr/lib64/libcuda.so.1")
        {
            failures.push(format!(
                "the image's ldconfig -p does not list libcuda.so.1: {}",
                run.describe()
            ));
        }
        // An image without ldconfig gets a cache too: the host's ldconfig builds it (the hook of
        // earlier versions ran the image's own, and left such an image without one).
        if !(run.output.contains("dlopen libcuda.so.1: ok") && run.output.contains("rc=0")) {
            failures.push(format!("dlopen(\"libcuda.so.1\") fails: {}", run.describe()));
        }
        failures
    });
}

#[test]
fn a_debian_layout_image_gets_libcuda_in_its_ld_cache() {
    benign(debian_rootfs, true);
}

#[test]
fn a_lib64_layout_image_gets_libcuda_in_its_ld_cache() {
    benign(lib64_rootfs, true);
}

#[test]
fn an_image_without_ldconfig_still_starts() {
    benign(
        |rootfs, dlcheck| {
            debian_rootfs(rootfs, dlcheck);
            fs::remove_file(rootfs.join("sbin/ldconfig")).expect("remove ldconfig");
        },
        false,
    );
}
