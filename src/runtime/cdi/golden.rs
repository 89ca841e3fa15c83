//! The spec on NVIDIA's own test driver root, entry for entry against what `nvidia-ctk cdi
//! generate` writes for it.
//!
//! The golden data is the expected spec of the `default` case of `TestGenerateSpec` in
//! `cmd/nvidia-ctk/cdi/generate/generate_test.go` of NVIDIA/nvidia-container-toolkit, transcribed
//! to JSON in `tests/fixtures/cdi/nvidia-ctk/rootfs-1.default.json` (its README names the
//! commit). That test runs `--mode nvml` with `--vendor example.com --class device` on
//! `testdata/lookup/rootfs-1`, a mocked NVML with one GPU and driver 999.88.77, and the hook at
//! `/usr/bin/nvidia-cdi-hook`. [`rootfs_1`] rebuilds that tree here.
//!
//! The agent's spec must equal the golden one after applying exactly the differences listed in
//! README ("Differences from `nvidia-ctk cdi generate`"), each a function below that asserts it
//! changes something: a difference that goes away, or a new one, fails the test.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::*;
use crate::edits::DeviceNodes;
use crate::host::arch::HostArch;
use crate::nvml::{GpuInfo, Inventory, sample};

/// The driver root on the fake host: the golden data's `{{ .driverRoot }}`.
const DRIVER_ROOT: &str = "/testdata/lookup/rootfs-1";
/// The driver version of NVIDIA's mocked NVML and of the files in rootfs-1.
const VERSION: &str = "999.88.77";
/// Where rootfs-1 has the driver's libraries.
const LIB: &str = "/lib/x86_64-linux-gnu";
/// `--vendor example.com --class device`.
const KIND: &str = "example.com/device";
/// The GPU's UUID (not in the golden data: nvidia-ctk names it by index only).
const UUID: &str = "GPU-36e8d3e1-5a3f-4c9d-8e8b-3c2b1a0f9e7d";
/// The agent's own hook program, when no toolkit hook is installed.
const AGENT: &str = "/usr/bin/gpu-node-agent-cdi-hook";

/// NVIDIA's expected spec, with the driver root filled in.
fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cdi/nvidia-ctk/rootfs-1.default.json");
    let text = fs::read_to_string(&path)
        .unwrap()
        .replace("{{ .driverRoot }}", DRIVER_ROOT);
    serde_json::from_str(&text).unwrap()
}

fn touch(root: &Path, path: &str) {
    let path = root.join(path);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, "").unwrap();
}

/// NVIDIA's `testdata/lookup/rootfs-1` at [`DRIVER_ROOT`] under `host`, as its tests show it (see
/// the fixture's README for where each entry is known from). Device nodes are empty files, as
/// NVIDIA's test makes them with `__NVCT_TESTING_DEVICES_ARE_FILES`. Returns the tree's folder.
fn rootfs_1(host: &Path) -> PathBuf {
    let root = host.join(DRIVER_ROOT.trim_start_matches('/'));
    for node in [
        "dev/nvidia0",
        "dev/nvidiactl",
        "dev/nvidia-caps/nvidia-cap1",
        "dev/nvidia-caps-imex-channels/channel0",
        "dev/nvidia-caps-imex-channels/channel1",
        "dev/nvidia-caps-imex-channels/channel2047",
    ] {
        touch(&root, node);
    }
    // A binary ld.so.cache in NVIDIA's tree; the agent does not read it.
    touch(&root, "etc/ld.so.cache");
    touch(&root, &format!("lib/x86_64-linux-gnu/libcuda.so.{VERSION}"));
    std::os::unix::fs::symlink(
        format!("libcuda.so.{VERSION}"),
        root.join("lib/x86_64-linux-gnu/libcuda.so.1"),
    )
    .unwrap();
    touch(
        &root,
        &format!("lib/x86_64-linux-gnu/vdpau/libvdpau_nvidia.so.{VERSION}"),
    );
    root
}

/// NVIDIA's mocked NVML as the agent's inventory: one GPU, index and minor 0, driver 999.88.77.
fn inventory() -> Inventory {
    Inventory {
        driver_version: VERSION.into(),
        ..sample::inventory(vec![GpuInfo {
            uuid: UUID.into(),
            ..sample::a100(0)
        }])
    }
}

/// The agent's spec for the tree under `host`, found as the agent finds it: driver files by
/// [`discover`], control nodes by [`DeviceNodes::gather`], device nodes' `hostPath` under the driver
/// root (nvidia-ctk's `--dev-root` defaults to the driver root).
fn generate(host: &Path, hooks: &HookSearch) -> Result<Spec, CdiError> {
    let files = discover(host, Path::new(DRIVER_ROOT), VERSION, hooks, &HostArch::X86_64);
    let nodes = DeviceNodes::gather(&host.join(DRIVER_ROOT.trim_start_matches('/')), &host.join("proc"));
    let opts = CdiOptions {
        kind: KIND.into(),
        dev_root: DRIVER_ROOT.into(),
    };
    spec(&inventory(), &nodes, &files, &opts)
}

fn as_json(spec: &Spec) -> Value {
    serde_json::from_str(&to_json(spec).unwrap()).unwrap()
}

fn toolkit_hook() -> HookSearch {
    HookSearch {
        toolkit: DEFAULT_HOOK_CANDIDATES.iter().map(PathBuf::from).collect(),
        agent: Some(AGENT.into()),
    }
}

fn agent_hook() -> HookSearch {
    HookSearch {
        toolkit: Vec::new(),
        agent: Some(AGENT.into()),
    }
}

fn edits(spec: &mut Value) -> &mut serde_json::Map<String, Value> {
    spec["containerEdits"].as_object_mut().unwrap()
}

fn hooks(spec: &mut Value) -> &mut Vec<Value> {
    edits(spec).get_mut("hooks").unwrap().as_array_mut().unwrap()
}

fn hook_name(hook: &Value) -> &str {
    hook["args"][1].as_str().unwrap()
}

// The differences, each applied to the golden spec. Each asserts what it changes is there.

/// The agent refuses a driver root without `libnvidia-ml.so.<version>` (a spec without it gives
/// no CUDA, README); rootfs-1 has none, so the comparison adds it to the tree. nvidia-ctk mounts
/// every `*.so.<version>` in the folder of libcuda, so it would mount this one too, after libcuda
/// (its mounts of the folder are in name order, then `vdpau/`).
fn with_libnvidia_ml(spec: &mut Value) {
    let mounts = edits(spec).get_mut("mounts").unwrap().as_array_mut().unwrap();
    assert_eq!(mounts[0]["containerPath"], format!("{LIB}/libcuda.so.{VERSION}"));
    assert!(mounts[1]["containerPath"].as_str().unwrap().contains("/vdpau/"));
    mounts.insert(
        1,
        json!({
            "hostPath": format!("{DRIVER_ROOT}{LIB}/libnvidia-ml.so.{VERSION}"),
            "containerPath": format!("{LIB}/libnvidia-ml.so.{VERSION}"),
            "options": MOUNT_OPTIONS,
        }),
    );
}

/// Each GPU is also named by its UUID, right after its index name, with the same edits: the
/// device plugin hands out either (`device_id_strategy`). nvidia-ctk's default names by index.
fn with_uuid_names(spec: &mut Value) {
    let devices = spec["devices"].as_array_mut().unwrap();
    assert_eq!(devices[0]["name"], "0");
    let mut by_uuid = devices[0].clone();
    by_uuid["name"] = json!(UUID);
    devices.insert(1, by_uuid);
}

/// The toolkit's hook gets only `create-symlinks` and `update-ldcache`: an older
/// `nvidia-cdi-hook` fails every container on a subcommand it does not know.
fn toolkit_hooks_only(spec: &mut Value) {
    let hooks = hooks(spec);
    let before = hooks.len();
    hooks.retain(|h| matches!(hook_name(h), "create-symlinks" | "update-ldcache"));
    assert_eq!(
        before - hooks.len(),
        2,
        "enable-cuda-compat and disable-device-node-modification"
    );
}

/// `create-symlinks` also recreates the host's soname links next to the mounted libraries
/// (rootfs-1's `libcuda.so.1`), so images without `ldconfig` still find `libcuda.so.1`.
fn with_soname_links(spec: &mut Value) {
    let hook = hooks(spec)
        .iter_mut()
        .find(|h| hook_name(h) == "create-symlinks")
        .unwrap();
    let args = hook["args"].as_array_mut().unwrap();
    args.push(json!("--link"));
    args.push(json!(format!("libcuda.so.{VERSION}::{LIB}/libcuda.so.1")));
}

/// Without the toolkit installed the agent's hook program is the hook: its path, and
/// `gpu-node-agent-cdi-hook <name>` in place of `nvidia-cdi-hook <name>`; the rest of each hook's
/// arguments, and its `env`, are the same.
fn as_agent_hook(spec: &mut Value) {
    for hook in hooks(spec) {
        assert_eq!(hook["path"], "/usr/bin/nvidia-cdi-hook");
        hook["path"] = json!(AGENT);
        let args = hook["args"].as_array_mut().unwrap();
        assert_eq!(args[0], "nvidia-cdi-hook");
        args[0] = json!("gpu-node-agent-cdi-hook");
    }
}

/// `ours` equals `expected`, compared entry by entry first so that a failure names the entry.
fn assert_entries_equal(ours: &Value, expected: &Value) {
    for key in ["cdiVersion", "kind"] {
        assert_eq!(ours[key], expected[key], "{key}");
    }
    let list = |v: &Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
    let compare = |what: &str, ours: Vec<Value>, expected: Vec<Value>| {
        for (i, (o, e)) in ours.iter().zip(&expected).enumerate() {
            assert_eq!(o, e, "{what}[{i}]");
        }
        assert_eq!(ours.len(), expected.len(), "number of {what}: {ours:#?}");
    };
    compare("devices", list(ours, "devices"), list(expected, "devices"));
    for key in ["env", "deviceNodes", "hooks", "mounts"] {
        compare(
            &format!("containerEdits.{key}"),
            list(&ours["containerEdits"], key),
            list(&expected["containerEdits"], key),
        );
    }
    assert_eq!(ours, expected, "the whole spec");
}

#[test]
fn nvidia_ctks_tree_as_it_is_is_refused_for_want_of_libnvidia_ml() {
    let host = tempfile::tempdir().unwrap();
    rootfs_1(host.path());
    touch(host.path(), "usr/bin/nvidia-cdi-hook");
    let err = generate(host.path(), &toolkit_hook()).unwrap_err();
    assert_eq!(
        err,
        CdiError::DriverLibrariesMissing {
            missing: vec![format!("libnvidia-ml.so.{VERSION}")],
            searched: library_dirs(&HostArch::X86_64)
                .iter()
                .map(|d| d.to_string_lossy().into_owned())
                .map(|d| PathBuf::from(format!("{DRIVER_ROOT}{d}")))
                .collect(),
        }
    );
}

/// With the toolkit's `nvidia-cdi-hook` installed (the golden case's hook).
#[test]
fn equals_nvidia_ctks_golden_spec_with_the_toolkit_hook() {
    let host = tempfile::tempdir().unwrap();
    let root = rootfs_1(host.path());
    touch(&root, &format!("lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"));
    touch(host.path(), "usr/bin/nvidia-cdi-hook");
    let ours = as_json(&generate(host.path(), &toolkit_hook()).unwrap());

    let mut expected = golden();
    with_libnvidia_ml(&mut expected);
    with_uuid_names(&mut expected);
    toolkit_hooks_only(&mut expected);
    with_soname_links(&mut expected);
    assert_entries_equal(&ours, &expected);
}

/// Without the toolkit: the agent's own hook, with all four of nvidia-ctk's hooks.
#[test]
fn equals_nvidia_ctks_golden_spec_with_the_agent_as_hook() {
    let host = tempfile::tempdir().unwrap();
    let root = rootfs_1(host.path());
    touch(&root, &format!("lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"));
    let ours = as_json(&generate(host.path(), &agent_hook()).unwrap());

    let mut expected = golden();
    with_libnvidia_ml(&mut expected);
    with_uuid_names(&mut expected);
    with_soname_links(&mut expected);
    as_agent_hook(&mut expected);
    assert_entries_equal(&ours, &expected);
}
