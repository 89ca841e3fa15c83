//! A real container through a real CDI consumer, with the spec the agent writes and the agent as
//! its own CDI hook: Debian's podman (its CDI library resolves the device names) with runc (which
//! runs the createContainer hooks), on a node without the NVIDIA Container Toolkit.
//!
//! The node: the fake NVML with two A100s, the second in MIG mode with two MIG devices; a driver
//! tree the test builds under the agent's root at `/run/nvidia/driver` (the GPU Operator's
//! driver-container layout): stub `libcuda.so.550.54.15` and `libnvidia-ml.so.550.54.15`
//! compiled with the system C compiler into `usr/lib64` (not on glibc's default search path, so
//! only the ld cache finds them), and the GPUs' device nodes (`mknod`, char 195:N and the
//! capability nodes). The container: a root file system the test builds from busybox-static,
//! the host's glibc, its static `ldconfig` and a small program that `dlopen`s each name it is
//! given.
//!
//! podman runs in a private mount namespace (`unshare -m`) with a tmpfs on `/run`, where the CDI
//! spec goes (`/run/cdi`, which podman 4.3 reads; its `cdi_spec_dirs` setting came later) and the
//! driver tree is bind-mounted at `/run/nvidia/driver`, so host paths in the spec are the paths
//! podman sees. Nothing outside the test's temp dir changes. podman's default rlimits need
//! CAP_SYS_RESOURCE, which CI containers lack; the container gets explicit lower ones instead.

mod common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::Node;

const DRIVER_ROOT: &str = "/run/nvidia/driver";
const VERSION: &str = "550.54.15";
const PODMAN: &str = "/usr/bin/podman";

/// Two A100s; the second in MIG mode.
fn machine() -> String {
    let mut m = common::machine("A100-SXM4-40GB", 0);
    m.push_str(&format!(
        "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\n",
        common::gpu_uuid(0)
    ));
    m.push_str(&format!(
        "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
        common::gpu_uuid(1)
    ));
    m
}

const CONFIG: &str = "[device_plugin]\ndriver_root = \"/run/nvidia/driver\"\ndev_root = \"/run/nvidia/driver\"\n\n\
[[mig.layouts.one]]\ndevices = [0]\nmig_enabled = false\n\n\
[[mig.layouts.one]]\ndevices = [1]\nmig_enabled = true\nprofiles = { \"3g.20gb\" = 2 }\n";

fn require(program: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test runs containers and needs root (CI runs as root)"
    );
    assert!(
        Path::new(program).is_file(),
        "{program} is missing: scripts/deps installs it (apt-get install podman busybox-static)"
    );
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// A shared library `dir/<lib>.so.<VERSION>` with soname `<lib>.so.1`, built from `source`.
fn stub_library(dir: &Path, lib: &str, source: &str, scratch: &Path) {
    fs::create_dir_all(dir).expect("lib dir");
    let c = scratch.join(format!("{lib}.c"));
    fs::write(&c, source).expect("write source");
    common::ok(
        Command::new("cc")
            .args(["-shared", "-fPIC", &format!("-Wl,-soname,{lib}.so.1"), "-o"])
            .arg(dir.join(format!("{lib}.so.{VERSION}")))
            .arg(&c),
    );
}

/// The minors of `/dev/nvidia-caps/nvidia-cap<N>` the fake host's `mig-minors` table gives.
fn cap_minors(root: &Path) -> Vec<u64> {
    let text = fs::read_to_string(root.join("proc/driver/nvidia-caps/mig-minors")).expect("mig-minors");
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect()
}

/// The container's root file system: busybox, the host's glibc and ldconfig, and `dlcheck`.
fn rootfs(dir: &Path, scratch: &Path) -> PathBuf {
    let rootfs = dir.join("rootfs");
    for d in [
        "bin",
        "sbin",
        "etc",
        "lib64",
        "lib/x86_64-linux-gnu",
        "proc",
        "dev",
        "sys",
        "tmp",
    ] {
        fs::create_dir_all(rootfs.join(d)).expect("rootfs dir");
    }
    fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox-static");
    for applet in ["sh", "ls", "cat", "test"] {
        symlink("busybox", rootfs.join("bin").join(applet)).expect("applet");
    }
    fs::copy("/sbin/ldconfig", rootfs.join("sbin/ldconfig")).expect("ldconfig");
    fs::copy("/lib64/ld-linux-x86-64.so.2", rootfs.join("lib64/ld-linux-x86-64.so.2")).expect("ld.so");
    fs::copy(
        "/lib/x86_64-linux-gnu/libc.so.6",
        rootfs.join("lib/x86_64-linux-gnu/libc.so.6"),
    )
    .expect("libc");
    let c = scratch.join("dlcheck.c");
    fs::write(&c, common::DLCHECK_C).expect("write dlcheck.c");
    common::ok(Command::new("cc").arg("-o").arg(rootfs.join("bin/dlcheck")).arg(&c));
    rootfs
}

/// The node with its driver tree and device nodes, the agent's spec for it, and a scratch dir.
struct Setup {
    node: Node,
    dir: PathBuf,
}

fn setup() -> Setup {
    require(PODMAN);
    require("/bin/busybox");
    let node = Node::new(&machine(), CONFIG);
    node.use_static_cdi_hook();
    let out = node.run(&["mig", "apply", "one"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "mig apply: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = node.tmp.path().join("cdi-test");
    let scratch = dir.join("src");
    fs::create_dir_all(&scratch).expect("scratch");

    let driver = node.root.join(DRIVER_ROOT.trim_start_matches('/'));
    let lib64 = driver.join("usr/lib64");
    stub_library(
        &lib64,
        "libcuda",
        "int cuInit(unsigned flags) { return flags; }\n",
        &scratch,
    );
    stub_library(
        &lib64,
        "libnvidia-ml",
        "int nvmlInit_v2(void) { return 0; }\n",
        &scratch,
    );
    let dev = driver.join("dev");
    common::char_node(&dev.join("nvidiactl"), 195, 255);
    common::char_node(&dev.join("nvidia0"), 195, 0);
    common::char_node(&dev.join("nvidia1"), 195, 1);
    for minor in cap_minors(&node.root).into_iter().filter(|m| *m < 200) {
        common::char_node(&dev.join(format!("nvidia-caps/nvidia-cap{minor}")), 235, minor);
    }
    Setup { node, dir }
}

impl Setup {
    /// The agent's spec (`cdi generate --output -`) with config `config`.
    fn spec(&self, config: &str) -> serde_json::Value {
        self.node.write_config(config);
        let out = self.node.run(&["cdi", "generate", "--output", "-"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "cdi generate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the spec is JSON")
    }

    /// Runs `command` in a fresh container that asks for `device` of `spec`; its output.
    fn container(&self, spec: &serde_json::Value, device: &str, command: &str) -> Output {
        self.container_beside(spec, &[], device, command)
    }

    /// [`Setup::container`] with more spec files (name, text) in the same CDI directory.
    fn container_beside(
        &self,
        spec: &serde_json::Value,
        others: &[(&str, &str)],
        device: &str,
        command: &str,
    ) -> Output {
        let work = self.dir.join(format!("run-{}", fastrand::u32(..)));
        let scratch = self.dir.join("src");
        let cdi = work.join("cdi");
        fs::create_dir_all(&cdi).expect("cdi dir");
        fs::write(cdi.join("agent.json"), serde_json::to_vec_pretty(spec).expect("json")).expect("spec");
        for (name, text) in others {
            fs::write(cdi.join(name), text).expect("other spec");
        }
        fs::write(
            work.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = \"{0}/storage\"\nrunroot = \"{0}/runroot\"\n",
                work.display()
            ),
        )
        .expect("storage.conf");
        fs::write(work.join("containers.conf"), "[containers]\n[engine]\n").expect("containers.conf");
        let kind = spec["kind"].as_str().expect("kind");
        let device = if device.contains('=') {
            device.to_string()
        } else {
            format!("{kind}={device}")
        };
        let script = r#"set -e
mount -t tmpfs tmpfs /run
mkdir -p /run/cdi /run/nvidia/driver
cp "$1"/cdi/* /run/cdi/
mount --bind "$2" /run/nvidia/driver
export CONTAINERS_CONF="$1/containers.conf" CONTAINERS_STORAGE_CONF="$1/storage.conf"
exec podman --root "$1/storage" --runroot "$1/runroot" --runtime /usr/sbin/runc \
  --cgroup-manager cgroupfs --events-backend none \
  run --rm --network none --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 \
  --device "$3" --rootfs "$1/rootfs" /bin/sh -c "$4"
"#;
        rootfs(&work, &scratch);
        run(Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", script, "sh"])
            .arg(&work)
            .arg(self.node.root.join(DRIVER_ROOT.trim_start_matches('/')))
            .arg(&device)
            .arg(command))
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

const CHECK: &str = "dlcheck libcuda.so.1 libnvidia-ml.so.1; echo rc=$?; ls /dev /dev/nvidia-caps 2>&1; echo end";

#[test]
fn a_container_gets_working_driver_libraries_and_only_its_gpu_through_podman_and_the_agents_hook() {
    let setup = setup();
    // No toolkit on this node: `auto` makes the agent its own hook.
    let spec = setup.spec(CONFIG);
    let hooks = spec["containerEdits"]["hooks"].as_array().expect("hooks");
    assert!(
        hooks.iter().all(|h| h["args"][0] == "gpu-node-agent-cdi-hook"
            && h["path"] == common::path_str(&common::cdi_hook_program())
            && h["env"] == serde_json::json!(["NVIDIA_CTK_DEBUG=false"])),
        "{hooks:?}"
    );

    let out = setup.container(&spec, "0", CHECK);
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert!(seen.contains("dlopen libcuda.so.1: ok"), "{seen}");
    assert!(seen.contains("dlopen libnvidia-ml.so.1: ok"), "{seen}");
    assert!(seen.contains("rc=0"), "{seen}");
    let dev: Vec<&str> = seen.split_whitespace().collect();
    assert!(dev.contains(&"nvidia0") && dev.contains(&"nvidiactl"), "{seen}");
    assert!(!dev.contains(&"nvidia1"), "another GPU's node leaked in: {seen}");

    // By UUID, the other GPU.
    let out = setup.container(&spec, &common::gpu_uuid(1), "ls /dev");
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert!(seen.contains("nvidia1") && !seen.contains("nvidia0"), "{seen}");
}

#[test]
fn a_mig_device_gets_its_parent_and_capability_nodes() {
    let setup = setup();
    let spec = setup.spec(CONFIG);
    let mig = spec["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| d["name"] == "1:0")
        .expect("MIG device 1:0 in the spec")
        .clone();
    let caps: Vec<String> = mig["containerEdits"]["deviceNodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|n| n["path"].as_str())
        .filter(|p| p.starts_with("/dev/nvidia-caps/"))
        .map(|p| p.trim_start_matches("/dev/nvidia-caps/").to_string())
        .collect();
    assert_eq!(caps.len(), 2, "{mig}");

    let out = setup.container(&spec, "1:0", CHECK);
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert!(seen.contains("dlopen libcuda.so.1: ok"), "{seen}");
    let words: Vec<&str> = seen.split_whitespace().collect();
    assert!(words.contains(&"nvidia1") && !words.contains(&"nvidia0"), "{seen}");
    for cap in &caps {
        assert!(words.contains(&cap.as_str()), "{cap} missing: {seen}");
    }
}

#[test]
fn without_the_hooks_the_container_finds_no_libcuda_so_1() {
    let setup = setup();
    // `toolkit` and no toolkit installed: the same spec without hooks.
    let spec = setup.spec(&format!("{CONFIG}\n[cdi]\nhook = \"toolkit\"\n"));
    assert!(spec["containerEdits"].get("hooks").is_none(), "{spec}");
    let out = setup.container(&spec, "0", CHECK);
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert!(
        seen.contains("dlopen libcuda.so.1: libcuda.so.1: cannot open shared object file"),
        "{seen}"
    );
    assert!(seen.contains("rc=1"), "{seen}");
}

/// `disable-device-node-modification` in a mount namespace of its own, as runc runs it: the
/// container's view of the driver's parameters says `ModifyDeviceFiles: 0`, read-only; the file
/// itself is untouched.
#[test]
fn the_container_sees_modify_device_files_0() {
    require("/usr/bin/unshare");
    let tmp = tempfile::tempdir().expect("tempdir");
    let bundle = tmp.path();
    let params = bundle.join("rootfs/proc/driver/nvidia/params");
    fs::create_dir_all(params.parent().expect("dir")).expect("mkdir");
    let original = "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\n";
    fs::write(&params, original).expect("params");
    fs::write(
        bundle.join("config.json"),
        r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"}}"#,
    )
    .expect("config");
    let state = format!(
        r#"{{"ociVersion":"1.0.2","id":"c","status":"creating","pid":1,"bundle":"{}"}}"#,
        bundle.display()
    );
    let script = r#"set -e
echo "$3" | "$1" disable-device-node-modification
cat "$2"
if echo x >> "$2" 2>/dev/null; then echo writable; fi
"#;
    let out = run(Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script, "sh"])
        .arg(common::cdi_hook_program())
        .arg(&params)
        .arg(&state));
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 0\nDeviceFileUID: 0\n",
        "{seen}"
    );
    assert_eq!(
        fs::read_to_string(&params).expect("params"),
        original,
        "the host's file is untouched"
    );
}

/// What the NVIDIA Container Toolkit's `nvidia-cdi-refresh` (1.18+) writes to
/// `/var/run/cdi/nvidia.yaml`: kind `nvidia.com/gpu`, index and UUID names, `all`.
fn toolkit_spec() -> String {
    let mut text = String::from("---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n");
    for (name, minor) in [("0".to_string(), 0), (common::gpu_uuid(0), 0), ("all".to_string(), 0)] {
        text.push_str(&format!(
            "- name: \"{name}\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia{minor}\n      hostPath: /run/nvidia/driver/dev/nvidia{minor}\n"
        ));
    }
    text.push_str("containerEdits:\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\n");
    text
}

#[test]
fn the_agents_names_resolve_beside_the_toolkits_nvidia_yaml() {
    let setup = setup();
    let toolkit = toolkit_spec();
    // The default kind is NVIDIA's device plugin's, not the toolkit's: both specs resolve.
    let spec = setup.spec(CONFIG);
    assert_eq!(spec["kind"], "k8s.device-plugin.nvidia.com/gpu");
    let out = setup.container_beside(&spec, &[("nvidia.yaml", &toolkit)], "0", CHECK);
    let seen = text(&out);
    assert!(
        out.status.success() && seen.contains("dlopen libcuda.so.1: ok"),
        "{seen}"
    );
    let out = setup.container_beside(&spec, &[("nvidia.yaml", &toolkit)], "nvidia.com/gpu=0", "ls /dev");
    assert!(
        out.status.success(),
        "the toolkit's own name still resolves: {}",
        text(&out)
    );

    // With the toolkit's kind, the real CDI library drops the names both define...
    let same = setup.spec(&CONFIG.replace("[device_plugin]\n", "[device_plugin]\ncdi_kind = \"nvidia.com/gpu\"\n"));
    let out = setup.container_beside(&same, &[("nvidia.yaml", &toolkit)], "0", "true");
    let seen = text(&out);
    assert!(!out.status.success(), "{seen}");
    assert!(seen.contains("unresolvable CDI devices nvidia.com/gpu=0"), "{seen}");

    // ...and the agent says so, naming both files, when it writes its spec beside that one.
    let cdi = setup.node.root.join("var/run/cdi");
    fs::create_dir_all(&cdi).expect("cdi dir");
    fs::write(cdi.join("nvidia.yaml"), &toolkit).expect("toolkit spec");
    let out = setup.node.run(&["cdi", "generate"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("warning: CDI spec /var/run/cdi/nvidia.yaml defines nvidia.com/gpu=0, nvidia.com/gpu=GPU-")
            && said.contains("like the agent's /var/run/cdi/nvidia.com-gpu.json")
            && said.contains("drops them"),
        "{said}"
    );
    // With the default kind there is nothing to say.
    setup.node.write_config(CONFIG);
    let out = setup.node.run(&["cdi", "generate"]);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        text(&out)
    );
}

/// `gdrcopy_enabled`: `cdi generate` writes `k8s.device-plugin.nvidia.com-gdrcopy.json` beside
/// the GPU spec when the host has `/dev/gdrdrv`, and a container asking for the name the device
/// plugin hands out (`k8s.device-plugin.nvidia.com/gdrcopy=all`) gets the node; off, there is
/// no such spec and the name does not resolve.
#[test]
fn a_container_given_the_gdrcopy_device_sees_dev_gdrdrv() {
    let setup = setup();
    let dev = setup.node.root.join(DRIVER_ROOT.trim_start_matches('/')).join("dev");
    common::char_node(&dev.join("gdrdrv"), 1, 3);
    let config = CONFIG.replace("[device_plugin]\n", "[device_plugin]\ngdrcopy_enabled = true\n");
    let spec = setup.spec(&config);
    let out = setup.node.run(&["cdi", "generate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let cdi = setup.node.root.join("var/run/cdi");
    let gdrcopy = fs::read_to_string(cdi.join("k8s.device-plugin.nvidia.com-gdrcopy.json")).expect("gdrcopy spec");
    // Only the classes enabled get a spec.
    for off in ["gds", "mofed", "imex-channel"] {
        assert!(
            !cdi.join(format!("k8s.device-plugin.nvidia.com-{off}.json")).exists(),
            "{off}"
        );
    }

    let name = "k8s.device-plugin.nvidia.com/gdrcopy=all";
    let out = setup.container_beside(
        &spec,
        &[("gdrcopy.json", &gdrcopy)],
        name,
        "ls -l /dev/gdrdrv; echo end",
    );
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    assert!(seen.contains("/dev/gdrdrv") && !seen.contains("No such file"), "{seen}");

    // Turned off: the agent removes its spec, and the name no longer resolves.
    setup.node.write_config(CONFIG);
    let out = setup.node.run(&["cdi", "generate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(!cdi.join("k8s.device-plugin.nvidia.com-gdrcopy.json").exists());
    let out = setup.container(&spec, name, "true");
    let seen = text(&out);
    assert!(!out.status.success(), "{seen}");
    assert!(seen.contains("unresolvable CDI devices"), "{seen}");
}
