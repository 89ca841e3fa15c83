//! The CDI spec end to end: discovery on a fake driver tree, the golden spec, the CDI schema, and
//! every name the device plugin hands out resolving.

use super::*;
use crate::api::ContainerAllocateRequest;
use crate::config::{DeviceIdStrategy, DeviceListStrategy, MigStrategy};
use crate::devices::Resource;
use crate::edits::DeviceNodes;
use crate::edits::whole_gpu;
use crate::host::arch::HostArch;
use crate::nvml::{GpuInfo, Inventory, MigDeviceInfo, sample};
use crate::plugin::allocate::{AllocateOptions, allocate};
use crate::plugin::strategy::build_resources;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const VERSION: &str = "550.54.15";
const G0: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
const G1: &str = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff";
const M0: &str = "MIG-11111111-2222-3333-4444-555555555555";
const M1: &str = "MIG-66666666-7777-8888-9999-000000000000";
const LIB: &str = "/usr/lib/x86_64-linux-gnu";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/cdi")
        .join(name)
}

fn gpu(index: u32, uuid: &str, minor: u32, mig: &[(u32, &str, u32)]) -> GpuInfo {
    GpuInfo {
        uuid: uuid.into(),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x07 + index),
        minor,
        numa_node: Some(0),
        mig: Some(sample::mig(!mig.is_empty())),
        mig_devices: mig
            .iter()
            .map(|&(index, uuid, gi_id)| MigDeviceInfo {
                index,
                uuid: uuid.into(),
                gi_id,
                ci_id: 0,
                profile: "3g.20gb".into(),
                memory_mib: 19968,
                attributes: None,
                placement: None,
            })
            .collect(),
        ..sample::a100(index)
    }
}

/// Two GPUs; the second (device minor 3, so index and minor differ) has two MIG devices.
fn inventory() -> Inventory {
    sample::inventory(vec![gpu(0, G0, 0, &[]), gpu(1, G1, 3, &[(0, M0, 1), (1, M1, 2)])])
}

fn nodes() -> DeviceNodes {
    DeviceNodes {
        control: vec![
            "/dev/nvidiactl".into(),
            "/dev/nvidia-uvm".into(),
            "/dev/nvidia-uvm-tools".into(),
        ],
        mig_minors: [
            ("config", 1),
            ("monitor", 2),
            ("gpu3/gi1/access", 30),
            ("gpu3/gi1/ci0/access", 31),
            ("gpu3/gi2/access", 39),
            ("gpu3/gi2/ci0/access", 40),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
        extra: Default::default(),
    }
}

fn touch(root: &Path, path: &str) {
    let path = root.join(path.trim_start_matches('/'));
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, "").unwrap();
}

fn symlink(root: &Path, link: &str, target: &str) {
    std::os::unix::fs::symlink(target, root.join(link.trim_start_matches('/'))).unwrap();
}

/// A driver install under `root/<driver_root>` with decoys that must not be picked up.
fn fake_driver(root: &Path) {
    for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"] {
        touch(root, &format!("{LIB}/{lib}.so.{VERSION}"));
    }
    symlink(root, &format!("{LIB}/libcuda.so.1"), &format!("libcuda.so.{VERSION}"));
    symlink(root, &format!("{LIB}/libcuda.so"), "libcuda.so.1"); // a chain: not a soname link
    symlink(
        root,
        &format!("{LIB}/libnvidia-ml.so.1"),
        &format!("{LIB}/libnvidia-ml.so.{VERSION}"),
    );
    symlink(
        root,
        &format!("{LIB}/libnvidia-nvvm.so.4"),
        &format!("libnvidia-nvvm.so.{VERSION}"),
    );
    symlink(root, &format!("{LIB}/libfoo.so.1"), &format!("libcuda.so.{VERSION}")); // wrong name
    touch(root, "/usr/lib64/libnvidia-cfg.so.550.54.15");
    symlink(root, "/usr/lib64/libnvidia-cfg.so.1", "libnvidia-cfg.so.550.54.15");
    // A graphics and a video library: mounted too, as nvidia-ctk mounts them.
    touch(root, &format!("{LIB}/libGLX_nvidia.so.{VERSION}"));
    touch(root, &format!("{LIB}/vdpau/libvdpau_nvidia.so.{VERSION}"));
    // Decoys: another version, a copy in a later directory.
    touch(root, &format!("{LIB}/libnvidia-ml.so.535.161.08"));
    touch(root, &format!("/usr/lib64/libcuda.so.{VERSION}"));
    // Graphics configuration and X server modules; the first copy of each wins.
    touch(root, "/usr/share/glvnd/egl_vendor.d/10_nvidia.json");
    touch(root, "/etc/vulkan/icd.d/nvidia_icd.json");
    touch(root, "/usr/share/vulkan/icd.d/nvidia_icd.json");
    touch(root, "/usr/lib/xorg/modules/drivers/nvidia_drv.so");
    touch(root, &format!("{LIB}/nvidia/xorg/libglxserver_nvidia.so.{VERSION}"));
    // The second GPU (bus 08) has DRM nodes; a device without drm/ has none.
    touch(root, "/sys/bus/pci/devices/0000:08:00.0/drm/card1/dev");
    touch(root, "/sys/bus/pci/devices/0000:08:00.0/drm/renderD128/dev");
    touch(root, "/sys/bus/pci/devices/0000:08:00.0/drm/controlD64/dev");
    touch(root, "/sys/bus/pci/devices/0000:07:00.0/vendor");

    touch(root, "/usr/bin/nvidia-smi");
    touch(root, "/bin/nvidia-smi");
    touch(root, "/usr/sbin/nvidia-persistenced");
    touch(root, "/usr/bin/nvidia-cuda-mps-control");
    touch(root, "/usr/bin/nvidia-modprobe");

    touch(root, &format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"));
    touch(root, &format!("/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"));
    touch(root, &format!("/lib/firmware/nvidia/{VERSION}/README"));
    touch(root, "/lib/firmware/nvidia/535.161.08/gsp_ga10x.bin");

    touch(root, "/run/nvidia-persistenced/socket");
    fs::create_dir_all(root.join("tmp/nvidia-mps")).unwrap();
}

/// The toolkit's hook where it is installed, and no agent fallback.
fn hook_candidates() -> HookSearch {
    HookSearch {
        toolkit: DEFAULT_HOOK_CANDIDATES.iter().map(PathBuf::from).collect(),
        agent: None,
    }
}

/// Driver files of [`fake_driver`] at driver root `/`, with `nvidia-cdi-hook` installed.
fn files_with_hook() -> (tempfile::TempDir, DriverFiles) {
    let root = tempfile::tempdir().unwrap();
    fake_driver(root.path());
    touch(root.path(), "/usr/bin/nvidia-cdi-hook");
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &hook_candidates(),
        &HostArch::X86_64,
    );
    (root, files)
}

fn paths(list: &[&str]) -> Vec<PathBuf> {
    list.iter().map(PathBuf::from).collect()
}

#[test]
fn discovery_finds_exactly_the_driver_files() {
    let (_root, files) = files_with_hook();
    let lib = |name: &str| PathBuf::from(format!("{LIB}/{name}.so.{VERSION}"));
    assert_eq!(
        files,
        DriverFiles {
            driver_root: "/".into(),
            version: VERSION.into(),
            // Every library of the version in libcuda's folder (graphics and vdpau included), then
            // the known ones found elsewhere.
            libraries: vec![
                lib("libGLX_nvidia"),
                lib("libcuda"),
                lib("libnvidia-ml"),
                lib("libnvidia-nvvm"),
                lib("libnvidia-ptxjitcompiler"),
                lib("vdpau/libvdpau_nvidia"),
                PathBuf::from("/usr/lib64/libnvidia-cfg.so.550.54.15"),
            ],
            libcuda_dir: Some(LIB.into()),
            library_search: library_dirs(&HostArch::X86_64),
            library_dirs: paths(&[
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu/vdpau",
                "/usr/lib64"
            ]),
            library_links: vec![
                LibraryLink {
                    link: format!("{LIB}/libcuda.so.1").into(),
                    target: format!("libcuda.so.{VERSION}"),
                },
                LibraryLink {
                    link: format!("{LIB}/libnvidia-ml.so.1").into(),
                    target: format!("libnvidia-ml.so.{VERSION}"),
                },
                LibraryLink {
                    link: format!("{LIB}/libnvidia-nvvm.so.4").into(),
                    target: format!("libnvidia-nvvm.so.{VERSION}"),
                },
                LibraryLink {
                    link: "/usr/lib64/libnvidia-cfg.so.1".into(),
                    target: "libnvidia-cfg.so.550.54.15".into(),
                },
            ],
            binaries: paths(&[
                "/usr/bin/nvidia-smi",
                "/usr/sbin/nvidia-persistenced",
                "/usr/bin/nvidia-cuda-mps-control"
            ]),
            firmware: paths(&[
                "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
                "/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin",
            ]),
            graphics: paths(&[
                "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
                "/etc/vulkan/icd.d/nvidia_icd.json",
                "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
                "/usr/lib/x86_64-linux-gnu/nvidia/xorg/libglxserver_nvidia.so.550.54.15",
            ]),
            ipc_sockets: paths(&["/run/nvidia-persistenced/socket", "/tmp/nvidia-mps"]),
            dri: [(
                "0000:08:00.0".to_string(),
                vec!["/dev/dri/card1".to_string(), "/dev/dri/renderD128".to_string()]
            )]
            .into_iter()
            .collect(),
            cdi_hook: Some(HookBinary::Toolkit("/usr/bin/nvidia-cdi-hook".into())),
        }
    );
}

#[test]
fn discovery_of_nothing_is_empty_not_an_error() {
    let root = tempfile::tempdir().unwrap();
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &hook_candidates(),
        &HostArch::X86_64,
    );
    assert!(files.libraries.is_empty() && files.library_dirs.is_empty() && files.library_links.is_empty());
    assert!(files.binaries.is_empty() && files.firmware.is_empty() && files.ipc_sockets.is_empty());
    assert_eq!(files.cdi_hook, None);

    // A version that is not a plain version string matches nothing, even if a file exists.
    fake_driver(root.path());
    for bad in ["", "..", "550/../550"] {
        let files = discover(
            root.path(),
            Path::new("/"),
            bad,
            &HookSearch::default(),
            &HostArch::X86_64,
        );
        assert!(files.libraries.is_empty() && files.firmware.is_empty(), "{bad:?}");
    }
}

#[test]
fn discovery_under_a_driver_root_reports_host_paths() {
    let root = tempfile::tempdir().unwrap();
    let driver = root.path().join("run/nvidia/driver");
    fs::create_dir_all(&driver).unwrap();
    fake_driver(&driver);
    // The hook is on the host, not in the driver root; this one in the driver root is ignored.
    touch(&driver, "/usr/bin/nvidia-ctk");
    touch(root.path(), "/usr/local/nvidia/toolkit/nvidia-cdi-hook");
    let files = discover(
        root.path(),
        Path::new("/run/nvidia/driver"),
        VERSION,
        &hook_candidates(),
        &HostArch::X86_64,
    );
    assert_eq!(
        files.libraries[2],
        PathBuf::from(format!("/run/nvidia/driver{LIB}/libnvidia-ml.so.{VERSION}"))
    );
    assert_eq!(
        files.library_links[0].link,
        PathBuf::from(format!("/run/nvidia/driver{LIB}/libcuda.so.1"))
    );
    assert_eq!(
        files.cdi_hook,
        Some(HookBinary::Toolkit("/usr/local/nvidia/toolkit/nvidia-cdi-hook".into()))
    );

    let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let libcuda = &spec.container_edits.mounts[1];
    assert_eq!(
        libcuda.host_path,
        format!("/run/nvidia/driver{LIB}/libcuda.so.{VERSION}")
    );
    assert_eq!(libcuda.container_path, format!("{LIB}/libcuda.so.{VERSION}"));
    let hooks = &spec.container_edits.hooks;
    assert_eq!(hooks[0].path, "/usr/local/nvidia/toolkit/nvidia-cdi-hook");
    assert_eq!(
        hooks[0].args[..4],
        [
            "nvidia-cdi-hook".to_string(),
            "create-symlinks".into(),
            "--link".into(),
            format!("libcuda.so.1::{LIB}/libcuda.so"),
        ]
    );
    assert_eq!(
        hooks[1].args,
        [
            "nvidia-cdi-hook",
            "update-ldcache",
            "--folder",
            LIB,
            "--folder",
            "/usr/lib/x86_64-linux-gnu/vdpau",
            "--folder",
            "/usr/lib64"
        ]
    );
}

/// The generated spec, byte for byte. Run with `CDI_UPDATE_GOLDEN=1` to rewrite the fixture
/// after an intended change, then review the diff.
#[test]
fn golden_spec() {
    let (_root, files) = files_with_hook();
    let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let text = to_json(&spec).unwrap();
    let path = fixture("nvidia.com-gpu.json");
    if std::env::var_os("CDI_UPDATE_GOLDEN").is_some() {
        fs::write(&path, &text).unwrap();
    }
    let expected = fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        expected,
        "run with CDI_UPDATE_GOLDEN=1 to update {}",
        path.display()
    );
    assert_eq!(to_json(&spec).unwrap(), text, "rendering is deterministic");
    assert!(text.ends_with("}\n"));
}

#[test]
fn spec_structure() {
    let (_root, files) = files_with_hook();
    let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    assert_eq!(spec.cdi_version, "0.5.0");
    assert_eq!(spec.kind, "nvidia.com/gpu");
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["0", G0, "1", G1, "1:0", M0, "1:1", M1, "all"]);
    let device_paths = |name: &str| -> Vec<String> {
        let device = spec.devices.iter().find(|d| d.name == name).unwrap();
        device
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.clone())
            .collect()
    };
    // The GPU's DRM nodes come with it (its PCI device has card1 and renderD128).
    assert_eq!(
        device_paths(G1),
        ["/dev/nvidia3", "/dev/dri/card1", "/dev/dri/renderD128"]
    );
    assert_eq!(device_paths(G0), ["/dev/nvidia0"]);
    assert_eq!(
        device_paths("1:1"),
        [
            "/dev/nvidia3",
            "/dev/nvidia-caps/nvidia-cap39",
            "/dev/nvidia-caps/nvidia-cap40"
        ]
    );
    assert_eq!(
        device_paths("all"),
        [
            "/dev/nvidia0",
            "/dev/nvidia3",
            "/dev/dri/card1",
            "/dev/dri/renderD128",
            "/dev/nvidia-caps/nvidia-cap30",
            "/dev/nvidia-caps/nvidia-cap31",
            "/dev/nvidia-caps/nvidia-cap39",
            "/dev/nvidia-caps/nvidia-cap40",
        ]
    );
    let edits = &spec.container_edits;
    assert_eq!(
        edits.env,
        [format!("{LIBCUDA_DIR_ENV}={LIB}"), VISIBLE_DEVICES_VOID.to_string()]
    );
    assert!(edits.device_nodes.iter().all(|n| n.host_path.is_none()));
    // Libraries, graphics files, sockets and the MPS folder, firmware, programs.
    assert_eq!(edits.mounts.len(), 7 + 4 + 2 + 2 + 3);
    let socket = edits.mounts.iter().find(|m| m.host_path.ends_with("socket")).unwrap();
    assert_eq!(socket.options, IPC_MOUNT_OPTIONS);
    assert_eq!(edits.mounts[0].options, MOUNT_OPTIONS);
    assert_eq!(
        edits.hooks[0].args,
        [
            "nvidia-cdi-hook".to_string(),
            "create-symlinks".into(),
            "--link".into(),
            format!("libcuda.so.1::{LIB}/libcuda.so"),
            "--link".into(),
            format!("libcuda.so.{VERSION}::{LIB}/libcuda.so.1"),
            "--link".into(),
            format!("libnvidia-ml.so.{VERSION}::{LIB}/libnvidia-ml.so.1"),
            "--link".into(),
            format!("libnvidia-nvvm.so.{VERSION}::{LIB}/libnvidia-nvvm.so.4"),
            "--link".into(),
            "libnvidia-cfg.so.550.54.15::/usr/lib64/libnvidia-cfg.so.1".into(),
        ]
    );
}

#[test]
fn hooks_only_with_a_hook_binary() {
    let root = tempfile::tempdir().unwrap();
    fake_driver(root.path());
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &hook_candidates(),
        &HostArch::X86_64,
    );
    assert_eq!(files.cdi_hook, None);
    let without = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    assert!(without.container_edits.hooks.is_empty());
    assert!(!to_json(&without).unwrap().contains("hooks"));
    assert!(!without.container_edits.mounts.is_empty());

    // The older toolkit binary takes the hooks as `nvidia-ctk hook <name>`.
    touch(root.path(), "/usr/bin/nvidia-ctk");
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &hook_candidates(),
        &HostArch::X86_64,
    );
    let with = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let hooks = &with.container_edits.hooks;
    assert_eq!(hooks.len(), 2);
    assert!(
        hooks
            .iter()
            .all(|h| h.path == "/usr/bin/nvidia-ctk" && h.hook_name == "createContainer")
    );
    assert_eq!(&hooks[0].args[..3], ["nvidia-ctk", "hook", "create-symlinks"]);
    assert_eq!(
        hooks[1].args,
        [
            "nvidia-ctk",
            "hook",
            "update-ldcache",
            "--folder",
            LIB,
            "--folder",
            "/usr/lib/x86_64-linux-gnu/vdpau",
            "--folder",
            "/usr/lib64"
        ]
    );

    // No libcuda or libnvidia-ml (a wrong driver root): an error naming where it looked, not a
    // spec that gives containers no CUDA.
    let bare = DriverFiles {
        libraries: Vec::new(),
        library_dirs: Vec::new(),
        library_links: Vec::new(),
        ..files
    };
    let err = spec(&inventory(), &nodes(), &bare, &CdiOptions::default()).unwrap_err();
    assert!(matches!(err, CdiError::DriverLibrariesMissing { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("libcuda.so.550.54.15 and libnvidia-ml.so.550.54.15 not found in /usr/lib/x86_64-linux-gnu,"),
        "{text}"
    );
}

#[test]
fn dev_root_gives_host_paths() {
    let (_root, files) = files_with_hook();
    let opts = CdiOptions {
        dev_root: "/run/nvidia/driver".into(),
        ..CdiOptions::default()
    };
    let spec = spec(&inventory(), &nodes(), &files, &opts).unwrap();
    assert_eq!(spec.cdi_version, "0.5.0");
    let ctl = &spec.container_edits.device_nodes[0];
    assert_eq!(ctl.path, "/dev/nvidiactl");
    assert_eq!(ctl.host_path.as_deref(), Some("/run/nvidia/driver/dev/nvidiactl"));
    let mig = spec.devices.iter().find(|d| d.name == M0).unwrap();
    assert_eq!(
        mig.container_edits.device_nodes[1],
        DeviceNode {
            path: "/dev/nvidia-caps/nvidia-cap30".into(),
            host_path: Some("/run/nvidia/driver/dev/nvidia-caps/nvidia-cap30".into()),
        }
    );
    // Mounts are about the driver root, not the device root.
    assert!(
        spec.container_edits
            .mounts
            .iter()
            .all(|m| m.host_path == m.container_path)
    );
}

#[test]
fn minimum_version_follows_the_cdi_rules() {
    let node = |host: Option<&str>| DeviceNode {
        path: "/dev/x".into(),
        host_path: host.map(String::from),
    };
    let device = |name: &str, host: Option<&str>| Device {
        name: name.into(),
        container_edits: ContainerEdits {
            device_nodes: vec![node(host)],
            ..ContainerEdits::default()
        },
    };
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: "example.com/gpu".into(),
        devices: vec![device("gpu0", None), device("all", None)],
        container_edits: ContainerEdits::default(),
    };
    assert_eq!(minimum_version(&spec), "0.3.0");
    spec.devices.push(device("0", None));
    assert_eq!(minimum_version(&spec), "0.5.0");
    spec.devices.pop();
    spec.container_edits.device_nodes.push(node(Some("/host/dev/x")));
    assert_eq!(minimum_version(&spec), "0.5.0");
    spec.kind = "example.com/gpu.shared".into();
    assert_eq!(minimum_version(&spec), "0.6.0");
}

#[test]
fn missing_mig_capability_is_an_error() {
    let (_root, files) = files_with_hook();
    let mut nodes = nodes();
    nodes.mig_minors.remove("gpu3/gi2/access");
    let err = spec(&inventory(), &nodes, &files, &CdiOptions::default()).unwrap_err();
    assert_eq!(
        err,
        CdiError::MissingMigCapability {
            device: M1.into(),
            key: "gpu3/gi2/access".into(),
        }
    );
    assert!(
        err.to_string().contains(M1) && err.to_string().contains("gpu3/gi2/access"),
        "{err}"
    );

    let mut nodes = self::nodes();
    nodes.mig_minors.remove("gpu3/gi1/ci0/access");
    let err = spec(&inventory(), &nodes, &files, &CdiOptions::default()).unwrap_err();
    assert!(matches!(err, CdiError::MissingMigCapability { ref key, .. } if key == "gpu3/gi1/ci0/access"));
}

#[test]
fn invalid_inputs() {
    let (_root, files) = files_with_hook();
    for kind in ["gpu", "/gpu", "nvidia.com/", "a/b/c"] {
        let opts = CdiOptions {
            kind: kind.into(),
            ..CdiOptions::default()
        };
        assert_eq!(
            spec(&inventory(), &nodes(), &files, &opts),
            Err(CdiError::InvalidKind { kind: kind.into() })
        );
    }
    let empty = Inventory {
        gpus: Vec::new(),
        ..inventory()
    };
    assert_eq!(
        spec(&empty, &nodes(), &files, &CdiOptions::default()),
        Err(CdiError::NoGpus)
    );
}

#[test]
fn file_names() {
    assert_eq!(spec_file_name("nvidia.com/gpu"), "nvidia.com-gpu.json");
    assert_eq!(
        spec_file_name("k8s.device-plugin.nvidia.com/gpu"),
        "k8s.device-plugin.nvidia.com-gpu.json"
    );
}

// === Schema ===

/// Hands the CDI `defs.json` fixture to the validator for `schema.json`'s relative
/// `defs.json#/...` references; anything else is refused (no network, no files).
struct DefsRetriever(serde_json::Value);

impl jsonschema::Retrieve for DefsRetriever {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<serde_json::Value, Box<dyn std::error::Error + Send + Sync>> {
        if uri.path().as_str().ends_with("/defs.json") {
            Ok(self.0.clone())
        } else {
            Err(format!("unexpected schema reference {}", uri.as_str()).into())
        }
    }
}

fn read_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

/// Validators for the whole document (`schema.json`) and for the spec-level
/// `containerEdits`, which `schema.json` does not list (see the schema README).
fn validators() -> (jsonschema::Validator, jsonschema::Validator) {
    let defs = read_json("schema/defs.json");
    let build = |schema: &serde_json::Value| {
        jsonschema::options()
            .with_draft(jsonschema::Draft::Draft7)
            .with_retriever(DefsRetriever(defs.clone()))
            .build(schema)
            .unwrap()
    };
    let whole = build(&read_json("schema/schema.json"));
    let edits = build(&serde_json::json!({
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$ref": "defs.json#/definitions/containerEdits",
    }));
    (whole, edits)
}

fn schema_errors(doc: &serde_json::Value) -> Vec<String> {
    let (whole, edits) = validators();
    let mut errors: Vec<String> = whole
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    if let Some(spec_edits) = doc.get("containerEdits") {
        errors.extend(
            edits
                .iter_errors(spec_edits)
                .map(|e| format!("containerEdits{}: {e}", e.instance_path())),
        );
    }
    errors
}

#[test]
fn spec_validates_against_the_cdi_schema() {
    let (_root, files) = files_with_hook();
    for dev_root in ["/", "/run/nvidia/driver"] {
        let opts = CdiOptions {
            dev_root: dev_root.into(),
            ..CdiOptions::default()
        };
        let spec = spec(&inventory(), &nodes(), &files, &opts).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&to_json(&spec).unwrap()).unwrap();
        assert_eq!(schema_errors(&doc), Vec::<String>::new(), "dev_root {dev_root}");
    }
    let golden = read_json("nvidia.com-gpu.json");
    assert_eq!(schema_errors(&golden), Vec::<String>::new());

    // The validator does resolve defs.json: broken documents fail, at both levels.
    let mut broken = golden.clone();
    broken["devices"][0]["containerEdits"]["deviceNodes"][0] = serde_json::json!({"hostPath": "/dev/nvidia0"});
    assert!(!schema_errors(&broken).is_empty());
    let mut broken = golden.clone();
    broken["containerEdits"]["mounts"][0]["options"] = serde_json::json!("ro,nosuid");
    assert!(!schema_errors(&broken).is_empty());
    let mut broken = golden;
    broken.as_object_mut().unwrap().remove("kind");
    assert!(!schema_errors(&broken).is_empty());
}

// === Names the device plugin hands out ===

/// Every `cdi_devices` name Allocate returns for `resource`, with both id strategies.
fn handed_out(resource: &Resource, kind: &str) -> Vec<String> {
    let mut names = Vec::new();
    let ids: Vec<String> = resource.devices.keys().cloned().collect();
    for id_strategy in [DeviceIdStrategy::Uuid, DeviceIdStrategy::Index] {
        let opts = AllocateOptions {
            strategies: vec![DeviceListStrategy::CdiCri],
            id_strategy,
            cdi_kind: kind.to_string(),
            ..AllocateOptions::default()
        };
        // One request per device and one for all of them.
        let mut requests: Vec<Vec<String>> = ids.iter().map(|id| vec![id.clone()]).collect();
        requests.push(ids.clone());
        for devices_ids in requests {
            let req = ContainerAllocateRequest { devices_ids };
            let resp = allocate(resource, &req, &opts, &nodes()).unwrap();
            assert!(!resp.cdi_devices.is_empty());
            names.extend(resp.cdi_devices.into_iter().map(|d| d.name));
        }
    }
    names
}

#[test]
fn every_name_the_plugin_hands_out_resolves() {
    let (_root, files) = files_with_hook();
    let inventory = inventory();
    let spec = spec(&inventory, &nodes(), &files, &CdiOptions::default()).unwrap();

    let mut resources = Vec::new();
    for strategy in [MigStrategy::None, MigStrategy::Mixed] {
        resources.extend(build_resources(&inventory, strategy).unwrap());
    }
    // Time-slicing replicas: `<uuid>::<n>` IDs.
    let mut replicas = BTreeMap::new();
    for gpu in &inventory.gpus {
        for n in 0..2 {
            replicas.insert(format!("{}::{n}", gpu.uuid), whole_gpu(gpu));
        }
    }
    resources.push(Resource {
        name: "nvidia.com/gpu.shared".into(),
        devices: replicas,
    });

    let mut seen = BTreeSet::new();
    for resource in &resources {
        for name in handed_out(resource, &spec.kind) {
            let (kind, id) = name.split_once('=').unwrap();
            assert_eq!(kind, spec.kind, "{name}");
            assert!(spec.devices.iter().any(|d| d.name == id), "{name} is not in the spec");
            seen.insert(id.to_string());
        }
    }
    // Whole GPUs and MIG devices, by UUID and by index, were all exercised.
    let expected: BTreeSet<String> = ["0", G0, "1", G1, "1:0", M0, "1:1", M1].map(String::from).into();
    assert_eq!(seen, expected);
}

#[test]
fn the_agent_as_hook_gets_all_four_hooks_in_nvidia_ctks_order() {
    let root = tempfile::tempdir().unwrap();
    fake_driver(root.path());
    // No toolkit hook installed: the agent's own is used.
    let search = HookSearch {
        agent: Some("/usr/bin/gpu-node-agent-cdi-hook".into()),
        ..hook_candidates()
    };
    let files = discover(root.path(), Path::new("/"), VERSION, &search, &HostArch::X86_64);
    assert_eq!(
        files.cdi_hook,
        Some(HookBinary::Agent("/usr/bin/gpu-node-agent-cdi-hook".into()))
    );
    let agent_spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let hooks = &agent_spec.container_edits.hooks;
    assert!(
        hooks
            .iter()
            .all(|h| h.path == "/usr/bin/gpu-node-agent-cdi-hook" && h.hook_name == "createContainer")
    );
    let heads: Vec<_> = hooks.iter().map(|h| h.args[..2].join(" ")).collect();
    assert_eq!(
        heads,
        [
            "gpu-node-agent-cdi-hook create-symlinks",
            "gpu-node-agent-cdi-hook enable-cuda-compat",
            "gpu-node-agent-cdi-hook update-ldcache",
            "gpu-node-agent-cdi-hook disable-device-node-modification",
        ]
    );
    assert_eq!(hooks[1].args[2], format!("--host-driver-version={VERSION}"));
    assert_eq!(hooks[3].args.len(), 2);
    // No hook inherits the container's environment (CVE-2025-23266).
    assert!(hooks.iter().all(|h| h.env == ["NVIDIA_CTK_DEBUG=false"]), "{hooks:?}");

    // An installed toolkit hook is preferred (`auto`) and gets only the two hooks it always has.
    touch(root.path(), "/usr/bin/nvidia-cdi-hook");
    let files = discover(root.path(), Path::new("/"), VERSION, &search, &HostArch::X86_64);
    assert_eq!(
        files.cdi_hook,
        Some(HookBinary::Toolkit("/usr/bin/nvidia-cdi-hook".into()))
    );
    let toolkit_spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let names: Vec<_> = toolkit_spec
        .container_edits
        .hooks
        .iter()
        .map(|h| h.args[1].as_str())
        .collect();
    assert_eq!(names, ["create-symlinks", "update-ldcache"]);
}

/// ld.so.conf as `ldconfig` reads it: comments, separators, nested includes relative to the
/// including file, globs in name order, hwcap lines, and an include loop that ends.
#[test]
fn ld_so_conf_names_folders_like_ldconfig() {
    use std::collections::BTreeMap;
    let files: BTreeMap<&str, &str> = [
        (
            "/etc/ld.so.conf",
            "# top\ninclude /etc/ld.so.conf.d/*.conf\n/opt/a:/opt/b, /opt/c # trailing\n",
        ),
        (
            "/etc/ld.so.conf.d/10-nvidia.conf",
            "/var/lib/nvidia/lib64\ninclude more/*.conf\n",
        ),
        ("/etc/ld.so.conf.d/more/x.conf", "/opt/more\n"),
        (
            "/etc/ld.so.conf.d/20-loop.conf",
            "hwcap 0 nosegneg\ninclude /etc/ld.so.conf\n",
        ),
        ("/etc/ld.so.conf.d/.hidden.conf", "/opt/hidden\n"),
        ("/etc/ld.so.conf.d/notes.txt", "/opt/txt\n"),
    ]
    .into_iter()
    .collect();
    let read = |p: &Path| files.get(p.to_str().unwrap_or_default()).map(|t| t.to_string());
    let list = |dir: &Path| -> Vec<String> {
        let prefix = format!("{}/", dir.display());
        let mut names: Vec<String> = files
            .keys()
            .filter_map(|f| f.strip_prefix(&prefix))
            .filter(|rest| !rest.contains('/'))
            .map(str::to_owned)
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        ld_so_conf_dirs(&read, &list),
        paths(&["/var/lib/nvidia/lib64", "/opt/more", "/opt/a", "/opt/b", "/opt/c"])
    );
    assert!(ld_so_conf_dirs(&|_| None, &|_| Vec::new()).is_empty());
}

/// A driver installed in a folder of its own, found only through ld.so.conf (NVIDIA's
/// `rootfs-2` layout): its libraries are found there, and a missing one names that folder.
#[test]
fn a_driver_folder_named_by_ld_so_conf_is_searched() {
    let tmp = tempfile::tempdir().unwrap();
    let put = |path: &str, text: &str| {
        let file = tmp.path().join(path.trim_start_matches('/'));
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, text).unwrap();
    };
    put("/etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n");
    put("/etc/ld.so.conf.d/nvidia.conf", "/var/lib/nvidia/lib64\n");
    put(&format!("/var/lib/nvidia/lib64/libcuda.so.{VERSION}"), "");
    put(&format!("/var/lib/nvidia/lib64/libnvidia-ml.so.{VERSION}"), "");
    let files = discover(
        tmp.path(),
        Path::new("/"),
        VERSION,
        &HookSearch::default(),
        &HostArch::X86_64,
    );
    assert_eq!(files.libcuda_dir, Some(PathBuf::from("/var/lib/nvidia/lib64")));
    assert_eq!(
        files.library_search.last(),
        Some(&PathBuf::from("/var/lib/nvidia/lib64"))
    );
    assert_eq!(files.libraries.len(), 2, "{:?}", files.libraries);
}

mod extra {
    use super::*;
    use crate::edits::ExtraNodes;
    use crate::edits::Injections;

    fn host_nodes() -> ExtraNodes {
        ExtraNodes {
            gds: vec!["/dev/nvidia-fs0".into(), "/dev/nvidia-fs1".into()],
            mofed: vec!["/dev/infiniband/rdma_cm".into(), "/dev/infiniband/uverbs0".into()],
            gdrcopy: vec!["/dev/gdrdrv".into()],
            imex_channels: [0].into(),
        }
    }

    fn opts(injections: Injections) -> ExtraOptions {
        ExtraOptions {
            vendor: "k8s.device-plugin.nvidia.com".into(),
            injections,
            dev_root: "/".into(),
            gds_mounts: vec!["/etc/cufile.json".into()],
            driver_root: "/".into(),
        }
    }

    fn all_on() -> Injections {
        Injections {
            gds: true,
            mofed: true,
            gdrcopy: true,
            imex_channel_ids: vec![0],
            imex_required: true,
        }
    }

    /// Kind, device names, device node paths of the first device, its mount container paths.
    type Summary = (String, Vec<String>, Vec<String>, Vec<String>);

    /// A [`Summary`] per written spec.
    fn summary(specs: &[ExtraSpec]) -> Vec<Summary> {
        specs
            .iter()
            .filter_map(|s| s.spec.as_ref())
            .map(|s| {
                let edits = &s.devices[0].container_edits;
                (
                    s.kind.clone(),
                    s.devices.iter().map(|d| d.name.clone()).collect(),
                    edits.device_nodes.iter().map(|n| n.path.clone()).collect(),
                    edits.mounts.iter().map(|m| m.container_path.clone()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn one_spec_per_enabled_class_with_the_hosts_nodes() {
        let specs = extra_specs(&host_nodes(), &opts(all_on())).unwrap();
        let kinds: Vec<_> = specs.iter().map(|s| s.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "k8s.device-plugin.nvidia.com/gdrcopy",
                "k8s.device-plugin.nvidia.com/gds",
                "k8s.device-plugin.nvidia.com/mofed",
                "k8s.device-plugin.nvidia.com/imex-channel"
            ]
        );
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            summary(&specs),
            [
                (kinds[0].to_string(), s(&["all"]), s(&["/dev/gdrdrv"]), s(&[])),
                (
                    kinds[1].to_string(),
                    s(&["all"]),
                    s(&["/dev/nvidia-fs0", "/dev/nvidia-fs1"]),
                    s(&["/etc/cufile.json"])
                ),
                (
                    kinds[2].to_string(),
                    s(&["all"]),
                    s(&["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"]),
                    s(&[])
                ),
                (
                    kinds[3].to_string(),
                    s(&["0"]),
                    s(&["/dev/nvidia-caps-imex-channels/channel0"]),
                    s(&[])
                ),
            ]
        );
        // File names follow NVIDIA's <vendor>-<class>.json.
        assert_eq!(
            spec_file_name(kinds[3]),
            "k8s.device-plugin.nvidia.com-imex-channel.json"
        );
        // Every spec is a valid CDI document.
        for spec in specs.iter().filter_map(|s| s.spec.as_ref()) {
            let doc: serde_json::Value = serde_json::from_str(&to_json(spec).unwrap()).unwrap();
            assert_eq!(schema_errors(&doc), Vec::<String>::new(), "{}", spec.kind);
        }
    }

    #[test]
    fn off_or_absent_means_no_spec() {
        let specs = extra_specs(&host_nodes(), &opts(Injections::default())).unwrap();
        assert!(specs.iter().all(|s| s.spec.is_none()));
        assert_eq!(specs.len(), 4);

        // On, but the host has no such nodes: nothing that names a missing node.
        let not_required = Injections {
            imex_required: false,
            ..all_on()
        };
        let specs = extra_specs(&ExtraNodes::default(), &opts(not_required)).unwrap();
        assert!(specs.iter().all(|s| s.spec.is_none()));
        let mut nodes = host_nodes();
        nodes.gds.clear();
        let specs = extra_specs(&nodes, &opts(all_on())).unwrap();
        assert!(specs[1].spec.is_none());
        assert!(specs[0].spec.is_some() && specs[2].spec.is_some());
    }

    #[test]
    fn required_imex_channel_missing_names_its_host_path() {
        let mut nodes = host_nodes();
        nodes.imex_channels.clear();
        let o = ExtraOptions {
            dev_root: "/run/nvidia/driver".into(),
            ..opts(all_on())
        };
        let err = extra_specs(&nodes, &o).unwrap_err();
        assert_eq!(
            err.to_string(),
            "IMEX channel /run/nvidia/driver/dev/nvidia-caps-imex-channels/channel0 does not exist \
             and [device_plugin.imex] required = true"
        );
    }

    #[test]
    fn dev_root_and_driver_root_become_host_paths() {
        let o = ExtraOptions {
            dev_root: "/run/nvidia/driver".into(),
            driver_root: "/run/nvidia/driver".into(),
            gds_mounts: vec!["/run/nvidia/driver/etc/cufile.json".into()],
            ..opts(all_on())
        };
        let specs = extra_specs(&host_nodes(), &o).unwrap();
        let gds = specs[1].spec.as_ref().unwrap();
        let edits = &gds.devices[0].container_edits;
        assert_eq!(edits.device_nodes[0].path, "/dev/nvidia-fs0");
        assert_eq!(
            edits.device_nodes[0].host_path.as_deref(),
            Some("/run/nvidia/driver/dev/nvidia-fs0")
        );
        assert_eq!(edits.mounts[0].container_path, "/etc/cufile.json");
        assert_eq!(edits.mounts[0].host_path, "/run/nvidia/driver/etc/cufile.json");
        assert_eq!(gds.cdi_version, "0.5.0");
    }

    #[test]
    fn gds_mounts_are_read_under_the_root() {
        let root = tempfile::tempdir().unwrap();
        assert!(gds_mounts(root.path(), Path::new("/")).is_empty());
        fs::create_dir_all(root.path().join("drv/etc")).unwrap();
        fs::write(root.path().join("drv/etc/cufile.json"), "{}").unwrap();
        fs::create_dir_all(root.path().join("drv/run/udev")).unwrap();
        assert_eq!(
            gds_mounts(root.path(), Path::new("/drv")),
            [PathBuf::from("/drv/etc/cufile.json"), PathBuf::from("/drv/run/udev")]
        );
    }
}

/// Host and container paths of the spec's mounts.
fn mount_paths(spec: &Spec) -> Vec<(String, String)> {
    spec.container_edits
        .mounts
        .iter()
        .map(|m| (m.host_path.clone(), m.container_path.clone()))
        .collect()
}

/// A Debian/Ubuntu arm64 node (Grace Hopper): the driver's libraries in the aarch64 multiarch
/// folder, found there and mounted at the same path, with the soname links and the loader cache
/// pointed at it; an x86_64 copy of libcuda (a foreign-architecture package) is never taken.
#[test]
fn an_arm64_debian_node_mounts_the_aarch64_multiarch_libraries() {
    const ARM: &str = "/usr/lib/aarch64-linux-gnu";
    let root = tempfile::tempdir().unwrap();
    touch(root.path(), "/proc/sys/kernel/arch");
    fs::write(root.path().join("proc/sys/kernel/arch"), "aarch64\n").unwrap();
    let arch = HostArch::read(&crate::host::HostRoot::new(root.path()));
    assert_eq!(arch, HostArch::Aarch64);
    for lib in ["libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"] {
        touch(root.path(), &format!("{ARM}/{lib}.so.{VERSION}"));
    }
    symlink(
        root.path(),
        &format!("{ARM}/libcuda.so.1"),
        &format!("libcuda.so.{VERSION}"),
    );
    touch(root.path(), &format!("{LIB}/libcuda.so.{VERSION}"));
    touch(root.path(), &format!("{LIB}/libnvidia-cfg.so.{VERSION}"));
    touch(root.path(), "/usr/share/vulkan/icd.d/nvidia_icd.aarch64.json");
    touch(root.path(), "/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json");
    touch(root.path(), "/usr/bin/nvidia-cdi-hook");

    let files = discover(root.path(), Path::new("/"), VERSION, &hook_candidates(), &arch);
    assert_eq!(files.libcuda_dir, Some(PathBuf::from(ARM)));
    assert_eq!(
        files.libraries,
        paths(&[
            &format!("{ARM}/libcuda.so.{VERSION}"),
            &format!("{ARM}/libnvidia-ml.so.{VERSION}"),
            &format!("{ARM}/libnvidia-ptxjitcompiler.so.{VERSION}"),
        ])
    );
    assert!(
        !files.library_search.contains(&PathBuf::from(LIB)),
        "{:?}",
        files.library_search
    );
    assert_eq!(
        files.graphics,
        paths(&["/usr/share/vulkan/icd.d/nvidia_icd.aarch64.json"])
    );

    let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let mounts = mount_paths(&spec);
    let libcuda = format!("{ARM}/libcuda.so.{VERSION}");
    assert!(mounts.contains(&(libcuda.clone(), libcuda)), "{mounts:?}");
    assert!(!mounts.iter().any(|(host, _)| host.contains("x86_64")), "{mounts:?}");
    let hooks = &spec.container_edits.hooks;
    assert!(
        hooks[0]
            .args
            .contains(&format!("libcuda.so.{VERSION}::{ARM}/libcuda.so.1")),
        "{:?}",
        hooks[0].args
    );
    assert_eq!(hooks[1].args, ["nvidia-cdi-hook", "update-ldcache", "--folder", ARM]);
}

/// An RHEL-family aarch64 node: the driver in `/usr/lib64`, as on x86_64.
#[test]
fn an_rhel_aarch64_node_mounts_lib64() {
    let root = tempfile::tempdir().unwrap();
    for lib in ["libcuda", "libnvidia-ml"] {
        touch(root.path(), &format!("/usr/lib64/{lib}.so.{VERSION}"));
    }
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &HookSearch::default(),
        &HostArch::Aarch64,
    );
    assert_eq!(files.libcuda_dir, Some(PathBuf::from("/usr/lib64")));
    assert_eq!(
        files.library_search[..2],
        paths(&["/usr/lib/aarch64-linux-gnu", "/usr/lib64"])
    );
    let spec = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap();
    let mounts = mount_paths(&spec);
    let libml = format!("/usr/lib64/libnvidia-ml.so.{VERSION}");
    assert!(mounts.contains(&(libml.clone(), libml)), "{mounts:?}");

    // The same tree read as x86_64 finds the same files: lib64 is both architectures'.
    let x86 = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &HookSearch::default(),
        &HostArch::X86_64,
    );
    assert_eq!(x86.libraries, files.libraries);
}

/// A node whose driver is only in the other architecture's multiarch folder has no driver for
/// its own: the spec is refused and the error names the folders searched.
#[test]
fn a_foreign_architecture_driver_is_not_a_driver() {
    let root = tempfile::tempdir().unwrap();
    for lib in ["libcuda", "libnvidia-ml"] {
        touch(root.path(), &format!("{LIB}/{lib}.so.{VERSION}"));
    }
    let files = discover(
        root.path(),
        Path::new("/"),
        VERSION,
        &HookSearch::default(),
        &HostArch::Aarch64,
    );
    assert!(files.libraries.is_empty(), "{:?}", files.libraries);
    let err = spec(&inventory(), &nodes(), &files, &CdiOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("not found in /usr/lib/aarch64-linux-gnu,"),
        "{err}"
    );
}
