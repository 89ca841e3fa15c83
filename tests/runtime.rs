//! The container runtime stage end to end: the real binary configuring and unconfiguring
//! containerd, docker and CRI-O under a temp root (byte-exact round trips, zero writes when
//! nothing changes, refusals that touch nothing), containerd's own `config dump` of the result,
//! the restart-and-rollback path in-process with a stand-in `systemctl`, and the CDI spec the
//! agent writes for whole GPUs and MIG devices.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::SystemTime;

use common::{Node, gpu_uuid};
use gpu_node_agent::config::{Config, Engine, Source};
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::command::Runner;
use gpu_node_agent::runtime::containerd::{dump_has_runtime, rebase_imports};
use gpu_node_agent::runtime::stage::{
    Applied, ApplyOptions, RuntimeError, apply, observe, plan, plan_unconfigure, recover,
};
use gpu_node_agent::runtime::{DefaultRuntime, NvidiaRuntime};
use gpu_node_agent::status::{StageId, StageState};

const CONTAINERD_MAIN: &str = "/etc/containerd/config.toml";
const CONTAINERD_DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";
const CONTAINERD_IMPORT: &str = "/etc/containerd/conf.d/*.toml";
const CRI_V2: &str = "io.containerd.grpc.v1.cri";
const CRI_V3: &str = "io.containerd.cri.v1.runtime";
const DOCKER_MAIN: &str = "/etc/docker/daemon.json";
const CRIO_MAIN: &str = "/etc/crio/crio.conf";
const CRIO_DROP_IN: &str = "/etc/crio/crio.conf.d/99-nvidia.toml";
const RUNTIME_BINARY: &str = "/usr/bin/nvidia-container-runtime";
const BACKUP_DIR: &str = "/var/lib/gpu-node-agent/runtime";
const CDI_SPEC: &str = "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json";
const REAL_CONTAINERD: &str = "/usr/bin/containerd";
const NO_KUBERNETES: &str = "[kubernetes]\nenabled = false\n";

// === the simulated host ===

/// An engine's standard files: its systemd unit (which makes it "installed"), main config and the
/// agent's drop-in (docker has none).
struct EngineFiles {
    unit: &'static str,
    main: &'static str,
    drop_in: Option<&'static str>,
}

fn engine_files(engine: Engine) -> EngineFiles {
    match engine {
        Engine::Containerd => EngineFiles {
            unit: "containerd.service",
            main: CONTAINERD_MAIN,
            drop_in: Some(CONTAINERD_DROP_IN),
        },
        Engine::Docker => EngineFiles {
            unit: "docker.service",
            main: DOCKER_MAIN,
            drop_in: None,
        },
        Engine::Crio => EngineFiles {
            unit: "crio.service",
            main: CRIO_MAIN,
            drop_in: Some(CRIO_DROP_IN),
        },
    }
}

/// `<root><host path>`.
fn under(root: &Path, host_path: &str) -> PathBuf {
    root.join(host_path.trim_start_matches('/'))
}

fn write_file(root: &Path, host_path: &str, text: &str) {
    let path = under(root, host_path);
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(&path, text).expect("write");
}

/// An executable shell script at `host_path` under the root.
fn script(root: &Path, host_path: &str, body: &str) {
    write_file(root, host_path, &format!("#!/bin/sh\n{body}\n"));
    fs::set_permissions(under(root, host_path), fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// The host's file, `None` when it does not exist.
fn read(root: &Path, host_path: &str) -> Option<String> {
    fs::read_to_string(under(root, host_path)).ok()
}

/// A file of `tests/fixtures/runtime/`.
fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/runtime")
        .join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Makes `engine` installed on the host (its systemd unit) with `main` as its main config
/// (`None`: no file), and installs the NVIDIA runtime binary (a stub).
fn install_engine(root: &Path, engine: Engine, main: Option<&str>) {
    let files = engine_files(engine);
    write_file(root, &format!("/lib/systemd/system/{}", files.unit), "[Service]\n");
    if let Some(text) = main {
        write_file(root, files.main, text);
    }
    script(root, RUNTIME_BINARY, "exit 0");
}

/// A node with one A100 (for `plan`'s NVML part), `engine` installed with `main`, the runtime
/// binary, and `extra` agent config.
///
/// The golden files are edits without a default runtime, so this node has `set_as_default =
/// false` (in `config.d/40-golden.toml`, which `extra` overrides); the default `"auto"` has
/// tests of its own.
fn engine_node(engine: Engine, main: Option<&str>, extra: &str) -> Node {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 1), extra);
    let dir = node.config_path().parent().expect("config dir").join("config.d");
    fs::write(dir.join("40-golden.toml"), "[runtime]\nset_as_default = false\n").expect("golden drop-in");
    install_engine(&node.root, engine, main);
    node
}

// === running the binary ===

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs the agent with `args`, expects exit `code`, and returns the output.
fn expect_exit(node: &Node, args: &[&str], code: i32) -> Output {
    let out = node.run(args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "gpu-node-agent {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// Runs the agent, expects success, returns stdout.
fn succeeds(node: &Node, args: &[&str]) -> String {
    text(&expect_exit(node, args, 0).stdout)
}

/// Runs the agent, expects exit 1, returns stderr.
fn fails(node: &Node, args: &[&str]) -> String {
    text(&expect_exit(node, args, 1).stderr)
}

const CONFIGURE: &[&str] = &["runtime", "configure", "--no-restart"];
const UNCONFIGURE: &[&str] = &["runtime", "unconfigure", "--no-restart"];

// === whole-tree snapshots ===

/// Every regular file under `root` (symlinks such as the fake NVML are skipped), relative path →
/// (bytes, mtime), and every directory but the agent's state dir and its parents (a trailing
/// `/`, no bytes, no time: only whether it is there counts).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (Vec<u8>, SystemTime)> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, (Vec<u8>, SystemTime)>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for entry in entries.map(|e| e.expect("dir entry")) {
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                let rel = path.strip_prefix(root).expect("under root");
                let state = Path::new("var/lib/gpu-node-agent");
                if !rel.starts_with(state) && !state.starts_with(rel) {
                    out.insert(rel.join(""), (Vec::new(), SystemTime::UNIX_EPOCH));
                }
                walk(root, &path, out);
            } else if meta.is_file() {
                let rel = path.strip_prefix(root).expect("under root").to_path_buf();
                // The one-writer lock a command takes is the agent's, not a change to the node.
                if rel == Path::new("var/lib/gpu-node-agent/lock") {
                    continue;
                }
                let bytes = fs::read(&path).expect("read");
                out.insert(rel, (bytes, meta.modified().expect("mtime")));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// Every regular file under `root`, relative path → bytes.
fn contents(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    snapshot(root).into_iter().map(|(p, (bytes, _))| (p, bytes)).collect()
}

/// Asserts two trees are the same, naming the files that differ.
fn assert_same<V: PartialEq>(before: &BTreeMap<PathBuf, V>, after: &BTreeMap<PathBuf, V>, what: &str) {
    let differ: Vec<String> = before
        .keys()
        .chain(after.keys())
        .filter(|p| before.get(*p) != after.get(*p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        differ.is_empty(),
        "{what}; these files or directories differ: {differ:?}"
    );
}

// === TOML / JSON checks ===

fn toml_table(text: &str) -> toml::Table {
    text.parse().unwrap_or_else(|e| panic!("not TOML: {e}\n{text}"))
}

/// `table.a.b.c...`, panicking with the path when a key is missing.
fn at<'a>(table: &'a toml::Table, keys: &[&str]) -> &'a toml::Value {
    let (first, rest) = keys.split_first().expect("a key");
    let mut v = table.get(*first).unwrap_or_else(|| panic!("no {first} in\n{table}"));
    for key in rest {
        v = v
            .get(*key)
            .unwrap_or_else(|| panic!("no {} in\n{table}", keys.join(".")));
    }
    v
}

/// `plugins."io.containerd.grpc.v1.cri".containerd.runtimes.<name>.options` of a version 2
/// containerd config (a file or a `config dump`).
fn v2_runtime_options<'a>(table: &'a toml::Table, name: &str) -> &'a toml::Value {
    at(table, &["plugins", CRI_V2, "containerd", "runtimes", name, "options"])
}

/// The runtime an [`engine_node`] asks for (`set_as_default = false`).
fn default_runtime() -> NvidiaRuntime {
    NvidiaRuntime {
        name: "nvidia".into(),
        binary: RUNTIME_BINARY.into(),
        default: DefaultRuntime::Unset,
        enable_cdi: false,
        also: Vec::new(),
        runtimes: true,
    }
}

// === 1. round trips ===

/// `runtime configure --no-restart` on a host with `engine` and `main` (`None`: no main file),
/// then `configured` checks the files; a second configure writes nothing at all; `runtime
/// unconfigure --no-restart` puts every file back as it was (main byte-identical or absent again,
/// drop-in and backups gone).
fn round_trip(engine: Engine, main: Option<&str>, configured: impl Fn(&Path)) {
    let files = engine_files(engine);
    let node = engine_node(engine, main, "");
    let root = node.root.as_path();
    let before = contents(root);

    let stdout = succeeds(&node, CONFIGURE);
    let written = files.drop_in.unwrap_or(files.main);
    assert!(
        stdout.contains(&format!("wrote {written}")) && stdout.contains("restarted nothing"),
        "{stdout}"
    );
    configured(root);

    let snap = snapshot(root);
    let stdout = succeeds(&node, CONFIGURE);
    assert!(stdout.contains("already configured, nothing to do"), "{stdout}");
    assert_same(
        &snap,
        &snapshot(root),
        "a second configure writes nothing (bytes and mtimes)",
    );

    let stdout = succeeds(&node, UNCONFIGURE);
    assert!(stdout.contains(&format!("restored {written}")), "{stdout}");
    assert_eq!(read(root, files.main).as_deref(), main, "main file byte-identical");
    if let Some(drop_in) = files.drop_in {
        assert_eq!(read(root, drop_in), None, "the drop-in is gone");
    }
    assert_same(
        &before,
        &contents(root),
        "unconfigure leaves every file as it was, backups included",
    );
    let stdout = succeeds(&node, UNCONFIGURE);
    assert!(stdout.contains("nothing to undo"), "{stdout}");
}

#[test]
fn containerd_round_trip_keeps_comments_and_systemd_cgroup_and_restores_the_original_bytes() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    round_trip(Engine::Containerd, Some(&main), |root| {
        let new_main = read(root, CONTAINERD_MAIN).expect("main");
        assert_eq!(new_main, fixture("containerd/v2-systemd-cgroup.expected.main.toml"));
        for comment in [
            "# Top-level containerd config, kept by hand (see the ops wiki).",
            "    # Pause image from the local mirror.",
            "SystemdCgroup = true # the kubelet uses the systemd cgroup driver",
        ] {
            assert!(new_main.contains(comment), "{comment:?} kept:\n{new_main}");
        }
        assert_eq!(
            at(&toml_table(&new_main), &["imports"]),
            &toml::Value::Array(vec![CONTAINERD_IMPORT.into()])
        );
        let drop_in = toml_table(&read(root, CONTAINERD_DROP_IN).expect("drop-in"));
        let nvidia = v2_runtime_options(&drop_in, "nvidia");
        assert_eq!(nvidia["BinaryName"].as_str(), Some(RUNTIME_BINARY));
        assert_eq!(nvidia["SystemdCgroup"].as_bool(), Some(true), "copied from runc");
        // containerd 1.x replaces the CRI table from an import: runc must keep its setting.
        assert_eq!(
            v2_runtime_options(&drop_in, "runc")["SystemdCgroup"].as_bool(),
            Some(true)
        );
    });
}

#[test]
fn docker_round_trip_keeps_the_other_keys_in_order_and_restores_the_original_bytes() {
    let main = fixture("docker/existing.json");
    round_trip(Engine::Docker, Some(&main), |root| {
        let daemon = read(root, DOCKER_MAIN).expect("daemon.json");
        assert_eq!(daemon, fixture("docker/existing.expected.json"), "keys in their order");
        let json: serde_json::Value = serde_json::from_str(&daemon).expect("JSON");
        assert_eq!(json["runtimes"]["nvidia"]["path"], RUNTIME_BINARY);
        assert_eq!(
            json["runtimes"]["runsc"]["path"], "/usr/local/bin/runsc",
            "other runtimes stay"
        );
        assert_eq!(json["exec-opts"][0], "native.cgroupdriver=systemd");
    });
}

#[test]
fn crio_round_trip_adds_and_removes_only_the_drop_in() {
    let main = fixture("crio/crio.conf");
    round_trip(Engine::Crio, Some(&main), |root| {
        assert_eq!(
            read(root, CRIO_MAIN).as_deref(),
            Some(main.as_str()),
            "crio.conf untouched"
        );
        let drop_in = read(root, CRIO_DROP_IN).expect("drop-in");
        assert_eq!(drop_in, fixture("crio/crio.expected.drop-in.toml"));
        let table = toml_table(&drop_in);
        let nvidia = at(&table, &["crio", "runtime", "runtimes", "nvidia"]);
        assert_eq!(nvidia["runtime_path"].as_str(), Some(RUNTIME_BINARY));
        assert_eq!(nvidia["runtime_type"].as_str(), Some("oci"));
    });
}

/// containerd 2.x (config version 3): the runtime goes under `io.containerd.cri.v1.runtime`.
#[test]
fn containerd_v3_round_trip_keeps_comments_and_systemd_cgroup_and_restores_the_original_bytes() {
    let main = fixture("containerd/v3-systemd-cgroup.main.toml");
    round_trip(Engine::Containerd, Some(&main), |root| {
        let new_main = read(root, CONTAINERD_MAIN).expect("main");
        assert_eq!(new_main, fixture("containerd/v3-systemd-cgroup.expected.main.toml"));
        assert!(
            new_main.starts_with("# containerd 2.x, written from `containerd config default` and trimmed.\n"),
            "comment kept:\n{new_main}"
        );
        assert_eq!(
            at(&toml_table(&new_main), &["imports"]),
            &toml::Value::Array(vec!["/etc/containerd/site/*.toml".into(), CONTAINERD_IMPORT.into()]),
            "the user's import first, then the agent's"
        );
        let drop_in = read(root, CONTAINERD_DROP_IN).expect("drop-in");
        assert_eq!(drop_in, fixture("containerd/v3-systemd-cgroup.expected.drop-in.toml"));
        let table = toml_table(&drop_in);
        assert_eq!(table["version"].as_integer(), Some(3));
        let runtimes = at(&table, &["plugins", CRI_V3, "containerd", "runtimes"]);
        let nvidia = &runtimes["nvidia"];
        assert_eq!(nvidia["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(nvidia["options"]["BinaryName"].as_str(), Some(RUNTIME_BINARY));
        assert_eq!(
            nvidia["options"]["SystemdCgroup"].as_bool(),
            Some(true),
            "copied from runc"
        );
        assert_eq!(runtimes["runc"]["options"]["SystemdCgroup"].as_bool(), Some(true));
        assert!(
            at(&table, &["plugins"]).get(CRI_V2).is_none(),
            "nothing under the version 2 plugin"
        );
    });
}

#[test]
fn a_fresh_docker_host_gets_a_daemon_json_and_unconfigure_removes_it() {
    round_trip(Engine::Docker, None, |root| {
        let daemon = read(root, DOCKER_MAIN).expect("daemon.json created");
        assert_eq!(daemon, fixture("docker/fresh.expected.json"));
        let json: serde_json::Value = serde_json::from_str(&daemon).expect("JSON");
        assert_eq!(json["runtimes"]["nvidia"]["path"], RUNTIME_BINARY);
        assert!(json.get("default-runtime").is_none(), "{daemon}");
    });
}

#[test]
fn a_directory_the_agent_created_stays_when_someone_else_put_a_file_there() {
    let main = fixture("crio/crio.conf");
    let node = engine_node(Engine::Crio, Some(&main), "");
    let root = node.root.as_path();
    succeeds(&node, CONFIGURE);
    write_file(root, "/etc/crio/crio.conf.d/10-registries.toml", "# the user's own\n");
    succeeds(&node, UNCONFIGURE);
    assert_eq!(read(root, CRIO_DROP_IN), None);
    assert_eq!(
        read(root, "/etc/crio/crio.conf.d/10-registries.toml").as_deref(),
        Some("# the user's own\n")
    );
}

#[test]
fn unconfigure_keeps_a_user_edit_made_after_configure_and_removes_only_the_import() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    let root = node.root.as_path();
    succeeds(&node, CONFIGURE);
    let (old, new) = (
        "max_container_log_line_size = 16384",
        "max_container_log_line_size = 32768",
    );
    let configured = read(root, CONTAINERD_MAIN).expect("main");
    write_file(root, CONTAINERD_MAIN, &configured.replace(old, new));

    succeeds(&node, UNCONFIGURE);
    assert_eq!(
        read(root, CONTAINERD_MAIN),
        Some(main.replace(old, new)),
        "the user's edit stays, only the import goes"
    );
    assert_eq!(read(root, CONTAINERD_DROP_IN), None);
    assert!(snapshot(&under(root, BACKUP_DIR)).is_empty(), "no backups left");
}

/// The same, when the user's tool rewrites the file without the import (config management
/// putting its template back) and the agent adds the import again: unconfigure must keep the
/// user's new text, not go back to the bytes from before the agent's first configure.
#[test]
fn unconfigure_keeps_a_rewrite_the_agent_configured_again() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    let root = node.root.as_path();
    succeeds(&node, CONFIGURE);
    let rewritten = main.replace("pause:3.9", "pause:3.10");
    write_file(root, CONTAINERD_MAIN, &rewritten);
    succeeds(&node, CONFIGURE);

    succeeds(&node, UNCONFIGURE);
    assert_eq!(read(root, CONTAINERD_MAIN), Some(rewritten), "the user's rewrite stays");
}

/// A main config that is a symbolic link, as config management often keeps it: the link stays,
/// its target gets the edit, and unconfigure puts the target's bytes back. A relative target is
/// read against the link's directory, an absolute one is a host path (under the root).
#[test]
fn a_symlinked_containerd_config_keeps_its_link_and_its_target_is_configured() {
    const MANAGED: &str = "/etc/containerd-managed/config.toml";
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    for link in ["../containerd-managed/config.toml", MANAGED] {
        let node = engine_node(Engine::Containerd, None, "");
        let root = node.root.as_path();
        write_file(root, MANAGED, &main);
        fs::create_dir_all(under(root, "/etc/containerd")).expect("mkdir");
        std::os::unix::fs::symlink(link, under(root, CONTAINERD_MAIN)).expect("symlink");
        let still_a_link = |when: &str| {
            assert_eq!(
                fs::read_link(under(root, CONTAINERD_MAIN)).ok(),
                Some(PathBuf::from(link)),
                "{link}: the link stays ({when})"
            );
        };
        let before = contents(root);

        let stdout = succeeds(&node, CONFIGURE);
        assert!(stdout.contains(&format!("wrote {CONTAINERD_MAIN}")), "{stdout}");
        still_a_link("configure");
        assert_eq!(
            read(root, MANAGED),
            Some(fixture("containerd/v2-systemd-cgroup.expected.main.toml")),
            "{link}: the target is configured"
        );
        assert_eq!(
            read(root, CONTAINERD_DROP_IN),
            Some(fixture("containerd/v2-systemd-cgroup.expected.drop-in.toml")),
            "{link}: the drop-in copies the target's CRI table"
        );

        let snap = snapshot(root);
        let stdout = succeeds(&node, CONFIGURE);
        assert!(stdout.contains("already configured, nothing to do"), "{link}: {stdout}");
        assert_same(&snap, &snapshot(root), "a second configure writes nothing");
        still_a_link("second configure");

        let stdout = succeeds(&node, UNCONFIGURE);
        assert!(stdout.contains(&format!("restored {CONTAINERD_MAIN}")), "{stdout}");
        still_a_link("unconfigure");
        assert_eq!(
            read(root, MANAGED).as_deref(),
            Some(main.as_str()),
            "{link}: target restored"
        );
        assert_same(&before, &contents(root), "unconfigure leaves every file as it was");
    }
}

/// A link that leads nowhere, or in a circle: the stage fails naming the file and the link's
/// target, and changes nothing (the link is not replaced by a fresh file).
#[test]
fn a_dangling_or_looping_config_link_is_refused_naming_the_link() {
    const LINK: &str = "../containerd-managed/config.toml";
    // What /etc/containerd-managed/config.toml is: nothing, or a link back to the main file.
    for (back, why) in [(None, "points to nothing"), (Some("../containerd/config.toml"), "loop")] {
        let node = engine_node(Engine::Containerd, None, "");
        let root = node.root.as_path();
        fs::create_dir_all(under(root, "/etc/containerd")).expect("mkdir");
        std::os::unix::fs::symlink(LINK, under(root, CONTAINERD_MAIN)).expect("symlink");
        if let Some(back) = back {
            fs::create_dir_all(under(root, "/etc/containerd-managed")).expect("mkdir");
            std::os::unix::fs::symlink(back, under(root, "/etc/containerd-managed/config.toml")).expect("symlink");
        }
        let before = snapshot(root);
        let stderr = fails(&node, CONFIGURE);
        for words in [CONTAINERD_MAIN, "->", why, "nothing was changed"] {
            assert!(stderr.contains(words), "{words:?} in {stderr}");
        }
        assert!(
            stderr.contains(LINK) || back.is_some_and(|b| stderr.contains(b)),
            "a link target named: {stderr}"
        );
        assert_eq!(
            fs::read_link(under(root, CONTAINERD_MAIN)).ok(),
            Some(PathBuf::from(LINK))
        );
        assert_same(&before, &snapshot(root), "nothing written");
        assert_eq!(read(root, CONTAINERD_DROP_IN), None);
    }
}

/// containerd 1.x replaces a plugin table from an import as a whole, and loads the agent's
/// drop-in last: a CRI table in another `conf.d` file is what containerd ran with, so the drop-in
/// must carry that one, not the top-level config's.
#[test]
fn the_containerd_drop_in_keeps_the_cri_settings_of_other_imported_files() {
    const REGISTRY: &str = "/etc/containerd/conf.d/50-registry.toml";
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    let root = node.root.as_path();
    write_file(root, REGISTRY, &fixture("containerd/conf.d-50-registry.toml"));
    let before = contents(root);

    succeeds(&node, CONFIGURE);
    assert_eq!(
        read(root, CONTAINERD_MAIN),
        Some(fixture("containerd/v2-systemd-cgroup.expected.main.toml"))
    );
    let drop_in = read(root, CONTAINERD_DROP_IN).expect("drop-in");
    assert_eq!(
        drop_in,
        fixture("containerd/v2-conf.d-50-registry.expected.drop-in.toml")
    );
    let table = toml_table(&drop_in);
    assert_eq!(
        at(&table, &["plugins", CRI_V2, "sandbox_image"]).as_str(),
        Some("registry.internal.example/pause:3.10")
    );
    assert_eq!(
        at(&table, &["plugins", CRI_V2, "registry", "config_path"]).as_str(),
        Some("/etc/containerd/certs.d-internal")
    );
    let nvidia = v2_runtime_options(&table, "nvidia");
    assert_eq!(nvidia["BinaryName"].as_str(), Some(RUNTIME_BINARY));
    assert_eq!(nvidia["SystemdCgroup"].as_bool(), Some(true));

    let snap = snapshot(root);
    let stdout = succeeds(&node, CONFIGURE);
    assert!(stdout.contains("already configured, nothing to do"), "{stdout}");
    assert_same(&snap, &snapshot(root), "a second configure writes nothing");

    succeeds(&node, UNCONFIGURE);
    assert_same(&before, &contents(root), "unconfigure leaves every file as it was");
}

// === 2. fresh host ===

#[test]
fn a_fresh_containerd_host_gets_a_minimal_main_and_drop_in_and_unconfigure_removes_both() {
    let node = engine_node(Engine::Containerd, None, "");
    let root = node.root.as_path();
    let before = contents(root);

    succeeds(&node, CONFIGURE);
    let new_main = toml_table(&read(root, CONTAINERD_MAIN).expect("main created"));
    assert_eq!(new_main["version"].as_integer(), Some(2), "{new_main}");
    assert_eq!(
        new_main["imports"],
        toml::Value::Array(vec![CONTAINERD_IMPORT.into()]),
        "{new_main}"
    );
    let drop_in = read(root, CONTAINERD_DROP_IN).expect("drop-in created");
    assert_eq!(drop_in, fixture("containerd/fresh-v2.expected.drop-in.toml"));
    assert_eq!(
        v2_runtime_options(&toml_table(&drop_in), "nvidia")["BinaryName"].as_str(),
        Some(RUNTIME_BINARY)
    );

    succeeds(&node, UNCONFIGURE);
    assert_eq!(read(root, CONTAINERD_MAIN), None, "there was no main file before");
    assert_eq!(read(root, CONTAINERD_DROP_IN), None);
    assert_same(&before, &contents(root), "unconfigure leaves the host as it was");
}

// === 3. broken configs ===

/// A main file that does not parse: exit 1 naming file, line and column; nothing written.
fn refused(engine: Engine, broken: &str, location: &str) {
    let node = engine_node(engine, Some(&fixture(broken)), "");
    let before = snapshot(&node.root);
    let stderr = fails(&node, CONFIGURE);
    let files = engine_files(engine);
    assert!(
        stderr.contains(&format!("{}: {location}", files.main)) && stderr.contains("nothing was changed"),
        "{stderr}"
    );
    assert_eq!(read(&node.root, files.main), Some(fixture(broken)), "unchanged");
    if let Some(drop_in) = files.drop_in {
        assert_eq!(read(&node.root, drop_in), None, "no drop-in");
    }
    assert_same(&before, &snapshot(&node.root), "a refused configure writes nothing");
}

#[test]
fn a_broken_containerd_config_is_refused_with_its_line_and_column() {
    refused(Engine::Containerd, "containerd/broken.main.toml", "line 4, column 27");
}

#[test]
fn a_broken_containerd_v3_config_is_refused_with_its_line_and_column() {
    refused(
        Engine::Containerd,
        "containerd/broken-v3.main.toml",
        "line 8, column 33",
    );
}

#[test]
fn a_broken_daemon_json_is_refused_with_its_line_and_column() {
    refused(Engine::Docker, "docker/broken.json", "line 4, column 64");
}

#[test]
fn a_broken_crio_conf_is_refused_with_its_line_and_column() {
    refused(Engine::Crio, "crio/broken.conf", "line 3, column 14");
}

// === 4. runtime binary / cdi-only ===

#[test]
fn a_missing_runtime_binary_fails_naming_the_key_and_the_package() {
    // Asked for: mode "runtime", or "auto" with a strategy only the runtime's hook reads.
    for config in [
        "[runtime]\nmode = \"runtime\"\n",
        "[device_plugin]\ndevice_list_strategy = \"envvar\"\n",
    ] {
        let node = engine_node(
            Engine::Containerd,
            Some(&fixture("containerd/v2-systemd-cgroup.main.toml")),
            config,
        );
        fs::remove_file(under(&node.root, RUNTIME_BINARY)).expect("remove runtime binary");
        let before = snapshot(&node.root);
        let stderr = fails(&node, CONFIGURE);
        for words in [
            RUNTIME_BINARY,
            "[runtime] runtime_binary",
            "nvidia-container-toolkit",
            "cdi-only",
        ] {
            assert!(stderr.contains(words), "{config}: {words:?} in {stderr}");
        }
        assert_same(&before, &snapshot(&node.root), "nothing written");
    }
}

/// Without NVIDIA's toolkit (the default `auto` mode decides cdi-only) or with `cdi-only`
/// asked for, each engine gets its CDI switch and no runtime: containerd's drop-in turns
/// `enable_cdi` on, docker's daemon.json `features.cdi`, CRI-O (CDI always on) keeps no drop-in
/// of the agent's; a default runtime naming `nvidia` (left by a run with the toolkit) goes.
#[test]
fn cdi_only_gives_the_engines_cdi_and_no_runtime() {
    for config in ["", "[runtime]\nmode = \"cdi-only\"\n"] {
        let main = fixture("containerd/v2-systemd-cgroup.main.toml");
        let node = engine_node(Engine::Containerd, Some(&main), config);
        fs::remove_file(under(&node.root, RUNTIME_BINARY)).expect("remove runtime binary");
        let stdout = succeeds(&node, CONFIGURE);
        let drop_in = read(&node.root, "/etc/containerd/conf.d/99-nvidia.toml").expect("containerd drop-in");
        let doc: toml::Table = drop_in.parse().expect("drop-in TOML");
        let cri = &doc["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["enable_cdi"].as_bool(), Some(true), "{config:?}: {drop_in}");
        let runtimes = cri["containerd"]["runtimes"].as_table().expect("runtimes");
        assert_eq!(runtimes.keys().collect::<Vec<_>>(), ["runc"], "{config:?}: {drop_in}");
        assert!(stdout.contains("containerd"), "{stdout}");
        let again = succeeds(&node, CONFIGURE);
        assert!(again.contains("containerd (CDI only): already configured"), "{again}");
    }

    let node = engine_node(
        Engine::Docker,
        Some(
            "{\n  \"default-runtime\": \"nvidia\",\n  \"runtimes\": {\"nvidia\": {\"path\": \"/usr/bin/nvidia-container-runtime\"}}\n}\n",
        ),
        "[runtime]\nset_as_default = true\n",
    );
    fs::remove_file(under(&node.root, RUNTIME_BINARY)).expect("remove runtime binary");
    succeeds(&node, CONFIGURE);
    let daemon: serde_json::Value =
        serde_json::from_str(&read(&node.root, "/etc/docker/daemon.json").expect("daemon.json")).expect("JSON");
    assert_eq!(daemon["features"]["cdi"], true, "{daemon}");
    assert_eq!(
        daemon["default-runtime"], "runc",
        "no default naming a runtime that is gone: {daemon}"
    );

    let node = engine_node(
        Engine::Crio,
        Some(&fixture("crio/crio.conf")),
        "[runtime]\nmode = \"runtime\"\n",
    );
    succeeds(&node, CONFIGURE);
    assert!(read(&node.root, "/etc/crio/crio.conf.d/99-nvidia.toml").is_some());
    fs::remove_file(under(&node.root, RUNTIME_BINARY)).expect("remove runtime binary");
    node.write_config("");
    succeeds(&node, CONFIGURE);
    assert_eq!(
        read(&node.root, "/etc/crio/crio.conf.d/99-nvidia.toml"),
        None,
        "CRI-O reads CDI specs as it is: the agent's drop-in with its runtimes goes"
    );
}

// === 5. plan ===

#[test]
fn plan_shows_the_containerd_diff_before_configure_and_no_changes_after() {
    let node = engine_node(
        Engine::Containerd,
        Some(&fixture("containerd/v2-systemd-cgroup.main.toml")),
        "",
    );
    let before = snapshot(&node.root);
    let stdout = succeeds(&node, &["plan"]);
    for line in [
        "Container runtimes: would change",
        "--- a/etc/containerd/config.toml",
        "+++ b/etc/containerd/config.toml",
        "+imports = [\"/etc/containerd/conf.d/*.toml\"]",
        " state = \"/run/containerd\"",
        "--- /dev/null",
        "+++ b/etc/containerd/conf.d/99-nvidia.toml",
        "+[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]",
        "+BinaryName = \"/usr/bin/nvidia-container-runtime\"",
    ] {
        assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
    }
    assert_same(&before, &snapshot(&node.root), "plan writes nothing");

    succeeds(&node, CONFIGURE);
    let stdout = succeeds(&node, &["plan"]);
    assert!(
        stdout.contains("Container runtimes: containerd already configured: no changes"),
        "{stdout}"
    );
    assert!(!stdout.contains("would change") && !stdout.contains("+++"), "{stdout}");
}

// === 6. the real containerd ===

/// Debian's containerd, which the agent's `config dump` check and this test run.
fn real_containerd() -> &'static Path {
    let path = Path::new(REAL_CONTAINERD);
    assert!(
        path.is_file(),
        "{REAL_CONTAINERD} is missing: these tests need the real containerd (apt-get install containerd)"
    );
    path
}

/// Configures containerd (`main`: its config, `None`: none; `extra`: more files, host path and
/// text) with the real binary installed under the root, and returns containerd's own `config
/// dump` of the written files.
fn configure_and_dump_with_real_containerd(main: Option<&str>, extra: &[(&str, &str)]) -> (String, toml::Table) {
    let containerd = real_containerd();
    let node = engine_node(Engine::Containerd, main, "");
    for (path, text) in extra {
        write_file(&node.root, path, text);
    }
    std::os::unix::fs::symlink(containerd, under(&node.root, REAL_CONTAINERD)).expect("symlink containerd");
    let out = expect_exit(&node, CONFIGURE, 0);
    let log = text(&out.stderr);
    assert!(
        log.contains("containerd --config") && log.contains("config dump"),
        "the agent ran its own check: {log}"
    );

    // The written main, with its absolute imports pointed into the root.
    let written = read(&node.root, CONTAINERD_MAIN).expect("main");
    let copy = node.tmp.path().join("dump-check.toml");
    let rebased = rebase_imports(&written, CONTAINERD_MAIN, |p| {
        if p.starts_with('/') {
            under(&node.root, p).to_string_lossy().into_owned()
        } else {
            p.to_string()
        }
    })
    .expect("rebase imports");
    assert!(rebased.contains(&node.root.to_string_lossy().into_owned()), "{rebased}");
    fs::write(&copy, rebased).expect("write copy");
    let out = std::process::Command::new(containerd)
        .arg("--config")
        .arg(&copy)
        .args(["config", "dump"])
        .output()
        .expect("run containerd");
    assert!(out.status.success(), "containerd config dump: {}", text(&out.stderr));
    let dump = text(&out.stdout);
    if let Err(e) = dump_has_runtime(&dump, &default_runtime()) {
        panic!("{e}\n{dump}");
    }
    let table = toml_table(&dump);
    (dump, table)
}

#[test]
fn containerd_itself_reads_the_nvidia_runtime_with_systemd_cgroup() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let (dump, table) = configure_and_dump_with_real_containerd(Some(&main), &[]);
    let nvidia = v2_runtime_options(&table, "nvidia");
    assert_eq!(nvidia["BinaryName"].as_str(), Some(RUNTIME_BINARY), "{dump}");
    assert_eq!(nvidia["SystemdCgroup"].as_bool(), Some(true), "{dump}");
    // What the import would wipe on containerd 1.x if the drop-in held only the nvidia runtime.
    assert_eq!(
        v2_runtime_options(&table, "runc")["SystemdCgroup"].as_bool(),
        Some(true),
        "{dump}"
    );
    assert_eq!(
        at(&table, &["plugins", CRI_V2, "sandbox_image"]).as_str(),
        Some("registry.example.com/pause:3.9"),
        "{dump}"
    );
}

#[test]
fn containerd_itself_reads_the_nvidia_runtime_on_a_fresh_host() {
    let (dump, table) = configure_and_dump_with_real_containerd(None, &[]);
    assert_eq!(
        v2_runtime_options(&table, "nvidia")["BinaryName"].as_str(),
        Some(RUNTIME_BINARY),
        "{dump}"
    );
}

/// containerd 1.6 itself, loading the top-level config, `conf.d/50-registry.toml` and the drop-in:
/// the CRI settings of the other imported file survive the drop-in.
#[test]
fn containerd_itself_keeps_the_cri_settings_of_other_imported_files() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let registry = fixture("containerd/conf.d-50-registry.toml");
    let (dump, table) =
        configure_and_dump_with_real_containerd(Some(&main), &[("/etc/containerd/conf.d/50-registry.toml", &registry)]);
    assert_eq!(
        at(&table, &["plugins", CRI_V2, "sandbox_image"]).as_str(),
        Some("registry.internal.example/pause:3.10"),
        "{dump}"
    );
    assert_eq!(
        at(&table, &["plugins", CRI_V2, "registry", "config_path"]).as_str(),
        Some("/etc/containerd/certs.d-internal"),
        "{dump}"
    );
    assert_eq!(
        v2_runtime_options(&table, "nvidia")["SystemdCgroup"].as_bool(),
        Some(true),
        "{dump}"
    );
}

/// A containerd that rejects the new files (a stand-in whose `config dump` fails): exit 1 and
/// the engine's files are as they were.
#[test]
fn a_config_containerd_rejects_is_rolled_back() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    script(
        &node.root,
        REAL_CONTAINERD,
        "echo 'containerd: failed to load TOML: invalid plugin key' >&2; exit 1",
    );
    let stderr = fails(&node, CONFIGURE);
    assert!(
        stderr.contains("containerd rejects the new configuration") && stderr.contains("invalid plugin key"),
        "{stderr}"
    );
    assert_eq!(read(&node.root, CONTAINERD_MAIN), Some(main), "main put back");
    assert_eq!(read(&node.root, CONTAINERD_DROP_IN), None, "drop-in removed");
}

/// containerd's version and effective configuration are asked once per binary and set of files,
/// not at every start of the agent: a restart where nothing changed runs no containerd (those
/// runs gate the device plugin's registration); a new binary or a changed imported file asks
/// again.
#[test]
fn containerd_is_asked_again_only_when_its_binary_or_files_change() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    let log = node.tmp.path().join("containerd-runs.log");
    // The real containerd, each run logged.
    let logged = format!(
        "echo \"$*\" >> {}\nexec {} \"$@\"",
        log.display(),
        real_containerd().display()
    );
    script(&node.root, REAL_CONTAINERD, &logged);
    let runs = || fs::read_to_string(&log).unwrap_or_default().lines().count();
    expect_exit(&node, CONFIGURE, 0);
    expect_exit(&node, &["plan"], 0);
    let asked = runs();
    assert!(
        asked >= 2,
        "containerd was asked for its version and dump: {asked} run(s)"
    );
    // Two more starts of the agent with nothing changed: no run of containerd.
    expect_exit(&node, &["plan"], 0);
    expect_exit(&node, &["plan"], 0);
    assert_eq!(runs(), asked, "{}", fs::read_to_string(&log).unwrap_or_default());
    // A file containerd imports changes: asked again, once.
    write_file(&node.root, "/etc/containerd/conf.d/50-other.toml", "# another\n");
    expect_exit(&node, &["plan"], 0);
    let after_file = runs();
    assert!(after_file > asked, "a changed import asks containerd again");
    expect_exit(&node, &["plan"], 0);
    assert_eq!(runs(), after_file);
    // A new containerd binary (a package upgrade renames a new file into place): asked again.
    let binary = under(&node.root, REAL_CONTAINERD);
    let new = binary.with_extension("new");
    fs::copy(&binary, &new).expect("copy");
    fs::rename(&new, &binary).expect("rename");
    expect_exit(&node, &["plan"], 0);
    assert!(runs() > after_file, "a new binary asks containerd again");
}

// === 7. restart and rollback, in-process ===

/// A temp root with containerd installed (its unit), the runtime binary, and a stand-in
/// `systemctl` that logs its argv to `systemctl.log` and, on `restart`, whether the drop-in was
/// there to `restarts.log`. `restart` and `is_active` are the shell bodies of those commands;
/// `$DROP_IN` is the drop-in's path under the root.
struct RestartHost {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    config: Config,
    main: String,
    /// containerd's CRI at its default socket under the root, serving runc and nvidia.
    cri: common::cri::TestCri,
}

/// The config of a [`RestartHost`].
fn restart_config() -> Config {
    Config::from_sources(&[Source::new(
        "t.toml",
        "[agent]\nstate_dir = \"/var/lib/gpu-node-agent\"\n[runtime]\nrestart_timeout = \"1s\"\nset_as_default = false\n",
    )])
    .expect("config")
}

/// Observes, plans and applies (configure or unconfigure) on `root`, restarts on, after
/// finishing what an interrupted apply left.
fn apply_on(root: &Path, config: &Config, unconfigure: bool) -> Result<Applied, RuntimeError> {
    let root = HostRoot::new(root);
    let runner = Runner::new(&root);
    recover(config, &root).expect("recover");
    let observed = observe(config, &root, &runner).expect("observe");
    let planned = if unconfigure {
        plan_unconfigure(&observed, &config.runtime).expect("plan")
    } else {
        plan(&observed, &config.runtime).expect("plan")
    };
    apply(&planned, config, &root, &runner, &ApplyOptions { restart: true })
}

impl RestartHost {
    fn new(restart: &str, is_active: &str) -> RestartHost {
        RestartHost::with_main(
            Some(&fixture("containerd/v2-systemd-cgroup.main.toml")),
            restart,
            is_active,
        )
    }

    fn with_main(main: Option<&str>, restart: &str, is_active: &str) -> RestartHost {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().to_path_buf();
        install_engine(&root, Engine::Containerd, main);
        let main = main.unwrap_or_default().to_owned();
        let body = format!(
            "DROP_IN='{drop_in}'\necho \"$*\" >> '{log}'\ncase \"$1\" in\n\
             restart)\n  if [ -e \"$DROP_IN\" ]; then echo with-drop-in; else echo without-drop-in; fi >> '{restarts}'\n  \
             {restart} ;;\nis-active)\n  {is_active} ;;\nesac",
            drop_in = under(&root, CONTAINERD_DROP_IN).display(),
            log = root.join("systemctl.log").display(),
            restarts = root.join("restarts.log").display(),
        );
        script(&root, "/usr/bin/systemctl", &body);
        let config = restart_config();
        let cri = common::cri::TestCri::start(
            &under(&root, "/run/containerd/containerd.sock"),
            common::cri::serving(&["runc", "nvidia"]),
        );
        RestartHost {
            _tmp: tmp,
            root,
            config,
            main,
            cri,
        }
    }

    /// Observes, plans and applies with restarts on.
    fn apply(&self) -> Result<Applied, RuntimeError> {
        apply_on(&self.root, &self.config, false)
    }

    fn log(&self, name: &str) -> Vec<String> {
        fs::read_to_string(self.root.join(name))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// The engine's files are as before the apply.
    fn assert_rolled_back(&self) {
        assert_eq!(read(&self.root, CONTAINERD_MAIN).as_deref(), Some(self.main.as_str()));
        assert_eq!(
            read(&self.root, CONTAINERD_DROP_IN),
            None,
            "the drop-in is absent again"
        );
    }
}

const RESTART: &str = "restart containerd.service";
const IS_ACTIVE: &str = "is-active containerd.service";

#[test]
fn a_restarted_engine_that_comes_back_keeps_its_new_files() {
    let host = RestartHost::new("exit 0", "echo active");
    let applied = host.apply().expect("apply");
    assert_eq!(applied.restarted, ["containerd.service"]);
    assert_eq!(
        applied.files,
        [PathBuf::from(CONTAINERD_MAIN), PathBuf::from(CONTAINERD_DROP_IN)]
    );
    assert_eq!(host.log("systemctl.log"), [RESTART, IS_ACTIVE]);
    assert_eq!(
        host.log("restarts.log"),
        ["with-drop-in"],
        "restarted with the new files"
    );
    assert!(read(&host.root, CONTAINERD_DROP_IN).is_some());
}

/// The daemon stopping (SIGTERM: its stop token) while `systemctl restart` hangs kills the
/// restart within a second; the engine's files are put back, and the next plan has the same
/// change to make.
#[test]
fn a_stop_during_a_hanging_engine_restart_ends_it_within_a_second_and_rolls_back() {
    let host = RestartHost::new("sleep 30", "echo active");
    let root = HostRoot::new(&host.root);
    let stop = tokio_util::sync::CancellationToken::new();
    let runner = Runner::new(&root).with_stop(&stop);
    let observed = observe(&host.config, &root, &runner).expect("observe");
    let planned = plan(&observed, &host.config.runtime).expect("plan");
    assert!(!planned.is_empty());
    let cancel = stop.clone();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        cancel.cancel();
        std::time::Instant::now()
    });
    let err = apply(&planned, &host.config, &root, &runner, &ApplyOptions { restart: true })
        .expect_err("the restart was stopped");
    let took = stopper.join().expect("stopper").elapsed();
    assert!(took < std::time::Duration::from_secs(1), "the stop took {took:?}");
    assert!(err.to_string().contains("the agent is stopping"), "{err}");
    host.assert_rolled_back();
    let observed = observe(&host.config, &root, &Runner::new(&root)).expect("observe");
    assert_eq!(
        gpu_node_agent::runtime::stage::diff(&plan(&observed, &host.config.runtime).expect("plan")),
        gpu_node_agent::runtime::stage::diff(&planned),
        "the next start makes the same change"
    );
}

/// Right after a restart containerd's CRI answers "server is not initialized yet" for a moment:
/// the check waits for it (within the restart timeout) instead of rolling a good change back.
#[test]
fn a_cri_still_initialising_after_the_restart_is_waited_for() {
    let host = RestartHost::new("exit 0", "echo active");
    host.cri.set(common::cri::Answer::Initializing {
        until: std::time::Instant::now() + std::time::Duration::from_millis(600),
        then: Box::new(common::cri::serving(&["runc", "nvidia"])),
    });
    let applied = host.apply().expect("applied, not rolled back");
    assert_eq!(applied.restarted, ["containerd.service"]);
    assert!(read(&host.root, CONTAINERD_DROP_IN).is_some());
}

#[test]
fn an_engine_that_does_not_come_back_gets_its_old_files_and_another_restart() {
    // Failed with the new files, active again with the old ones.
    let host = RestartHost::new(
        "exit 0",
        "if [ -e \"$DROP_IN\" ]; then echo failed; exit 3; fi; echo active",
    );
    let err = host.apply().expect_err("the restart fails");
    let RuntimeError::Restart { engine, reason, again } = &err else {
        panic!("not a restart error: {err}");
    };
    assert_eq!(*engine, "containerd");
    assert!(
        reason.contains("containerd.service is failed 1s after the restart"),
        "{reason}"
    );
    assert!(again.is_none(), "it came back with the old files: {again:?}");
    assert!(
        err.to_string()
            .contains("the previous files were put back and it was restarted with them"),
        "{err}"
    );
    host.assert_rolled_back();
    assert_eq!(host.log("restarts.log"), ["with-drop-in", "without-drop-in"]);
    // restart, is-active until the timeout, restart with the old files, is-active.
    let log = host.log("systemctl.log");
    let second = log.iter().rposition(|l| l == RESTART).expect("a restart");
    assert!(log[0] == RESTART && second > 1, "{log:?}");
    assert!(log[1..second].iter().all(|l| l == IS_ACTIVE), "{log:?}");
    assert_eq!(&log[second + 1..], [IS_ACTIVE], "{log:?}");
}

#[test]
fn a_restart_that_fails_is_quoted_and_rolled_back() {
    let job = "Job for containerd.service failed because the control process exited with error code.";
    let host = RestartHost::new(&format!("echo '{job}' >&2; exit 1"), "echo active");
    let err = host.apply().expect_err("the restart fails");
    let RuntimeError::Restart { reason, again, .. } = &err else {
        panic!("not a restart error: {err}");
    };
    assert!(reason.contains(job), "{reason}");
    assert!(again.as_deref().is_some_and(|a| a.contains(job)), "{again:?}");
    let message = err.to_string();
    assert!(
        message.contains(job) && message.contains("restarting it with them failed too"),
        "{message}"
    );
    host.assert_rolled_back();
    assert_eq!(
        host.log("systemctl.log"),
        [RESTART, RESTART],
        "no is-active after a failed restart"
    );
    assert_eq!(host.log("restarts.log"), ["with-drop-in", "without-drop-in"]);
}

/// containerd came back active but without its CRI plugin (what the agent's old drop-in did to
/// containerd 1.6): the files are rolled back and the engine restarted with them, and the
/// error says the CRI did not load, quoting `ctr plugins ls --detailed`.
#[test]
fn an_engine_active_without_its_cri_is_rolled_back_quoting_the_plugin_error() {
    let host = RestartHost::new("exit 0", "echo active");
    host.cri
        .set(common::cri::Answer::NoCriWith(under(&host.root, CONTAINERD_DROP_IN)));
    // The real containerd under the root (its version and config dump), and a ctr beside it
    // that lists the CRI plugin's error as containerd 1.6's does.
    std::os::unix::fs::symlink(real_containerd(), under(&host.root, REAL_CONTAINERD)).expect("symlink containerd");
    script(
        &host.root,
        "/usr/bin/ctr",
        "cat <<'EOF'\nType:          io.containerd.grpc.v1\nID:            cri\nError:\n               Code:        Unknown\n               \
         Message:     invalid plugin config: no corresponding runtime configured in `containerd.runtimes` for `containerd` \
         `default_runtime_name = \"runc\"\nEOF",
    );
    let err = host.apply().expect_err("the CRI did not load");
    let message = err.to_string();
    assert!(
        message.contains(
            "containerd.service is active but its CRI plugin did not load: invalid plugin config: no corresponding \
             runtime configured"
        ) && message.contains("it was restarted with them"),
        "{message}"
    );
    host.assert_rolled_back();
    assert_eq!(host.log("restarts.log"), ["with-drop-in", "without-drop-in"]);
}

/// A CRI that loads but lacks the agent's runtime fails the same way, naming what it has.
#[test]
fn an_engine_whose_cri_lacks_the_runtime_is_rolled_back() {
    let host = RestartHost::new("exit 0", "echo active");
    host.cri.set(common::cri::serving(&["runc"]));
    let err = host.apply().expect_err("no nvidia handler");
    let message = err.to_string();
    assert!(
        message.contains("its CRI lists no runtime handler nvidia (it has: runc)"),
        "{message}"
    );
    host.assert_rolled_back();
}

// === kill -9 during an apply ===

/// The steps of an apply after which the test hook `GNA_TEST_KILL_AT` kills the process.
const KILL_POINTS: [&str; 6] = ["backup", "intent", "write", "check", "restart", "record"];

/// The apply that [`an_apply_killed_at_any_step_converges_after_a_restart`] kills: run in a
/// child process of this test binary (`GNA_CRASH_ROOT` names the host); does nothing otherwise.
#[test]
#[ignore = "the child of an_apply_killed_at_any_step_converges_after_a_restart"]
fn crash_child() {
    let Some(root) = std::env::var_os("GNA_CRASH_ROOT") else {
        return;
    };
    let _ = apply_on(Path::new(&root), &restart_config(), false);
}

/// For every step of the apply, on a host with and without a containerd config: the agent is
/// killed there (SIGKILL, from the test hook), started again (it recovers, then configures),
/// ends configured exactly as an uninterrupted run, and `unconfigure` then gives back the
/// original bytes (and removes the directories it created).
#[test]
fn an_apply_killed_at_any_step_converges_after_a_restart() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    for original in [Some(main.as_str()), None] {
        // What an uninterrupted run leaves.
        let clean = RestartHost::with_main(original, "exit 0", "echo active");
        clean.apply().expect("clean apply");
        let expected = (
            read(&clean.root, CONTAINERD_MAIN),
            read(&clean.root, CONTAINERD_DROP_IN),
        );
        for point in KILL_POINTS {
            let host = RestartHost::with_main(original, "exit 0", "echo active");
            let before = contents(&host.root);
            let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
                .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads=1"])
                .env("GNA_CRASH_ROOT", &host.root)
                .env("GNA_TEST_KILL_AT", point)
                .stdout(std::process::Stdio::null())
                .status()
                .expect("run the child");
            assert_eq!(
                std::os::unix::process::ExitStatusExt::signal(&status),
                Some(9),
                "{point}: the child was killed there"
            );
            host.apply()
                .unwrap_or_else(|e| panic!("{point}: the restarted agent converges: {e}"));
            assert_eq!(
                (read(&host.root, CONTAINERD_MAIN), read(&host.root, CONTAINERD_DROP_IN)),
                expected,
                "{point} ({}): configured as by an uninterrupted run",
                if original.is_some() {
                    "with a config"
                } else {
                    "no config"
                }
            );
            let again = host.apply().expect("apply again");
            assert!(again.files.is_empty(), "{point}: stable afterwards: {again:?}");
            apply_on(&host.root, &host.config, true).expect("unconfigure");
            let after: BTreeMap<PathBuf, Vec<u8>> = contents(&host.root)
                .into_iter()
                .filter(|(p, _)| !p.ends_with("systemctl.log") && !p.ends_with("restarts.log"))
                .collect();
            let before: BTreeMap<PathBuf, Vec<u8>> = before
                .into_iter()
                .filter(|(p, _)| !p.ends_with("systemctl.log") && !p.ends_with("restarts.log"))
                .collect();
            assert_same(
                &before,
                &after,
                &format!("{point}: unconfigure gives back the original host"),
            );
        }
    }
}

// === CRI-O with its runtimes only in crio.conf.d ===

/// CRI-O's own packages (1.28 and later) keep crun and runc in `crio.conf.d/10-crio.conf` and
/// ship no crio.conf: the agent's runtime wraps the default (crun) with its monitor, root and
/// type as that drop-in has them.
#[test]
fn crio_runtimes_from_its_drop_ins_are_the_template() {
    let node = engine_node(
        Engine::Crio,
        None,
        "[runtime]\nset_as_default = \"auto\"\nkubelet_runtime_endpoint = \"unix:///var/run/crio/crio.sock\"\n",
    );
    let packaged = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/runtime/nodes/crio-nvidia-dropin-only/crio.conf.d-10-crio.conf"),
    )
    .expect("fixture");
    write_file(&node.root, "/etc/crio/crio.conf.d/10-crio.conf", &packaged);
    succeeds(&node, CONFIGURE);
    let drop_in = toml_table(&read(&node.root, CRIO_DROP_IN).expect("drop-in"));
    let nvidia = at(&drop_in, &["crio", "runtime", "runtimes", "nvidia"]);
    assert_eq!(nvidia["runtime_path"].as_str(), Some(RUNTIME_BINARY), "{drop_in}");
    assert_eq!(
        nvidia["monitor_path"].as_str(),
        Some("/usr/libexec/crio/conmonrs"),
        "{drop_in}"
    );
    assert_eq!(nvidia["runtime_root"].as_str(), Some("/run/crun"), "{drop_in}");
    assert_eq!(nvidia["runtime_type"].as_str(), Some("pod"), "{drop_in}");
    assert_eq!(
        at(&drop_in, &["crio", "runtime", "default_runtime"]).as_str(),
        Some("nvidia"),
        "the kubelet's engine (its endpoint in the config) gets nvidia as its default"
    );
    assert_eq!(
        read(&node.root, "/etc/crio/crio.conf.d/10-crio.conf").as_deref(),
        Some(packaged.as_str()),
        "the package's drop-in is not touched"
    );
}

// === one engine's failure is that engine's ===

/// containerd (the kubelet's engine) and docker with a broken daemon.json: `run --once`
/// configures containerd, reports docker's error, and does not fail the pass; with the kubelet
/// on docker (cri-dockerd) the same host fails the runtime stage, and the stages after it wait.
#[test]
fn only_the_kubelets_engine_failing_fails_the_runtime_stage() {
    let broken = "{\n  \"log-driver\": \"json-file\",\n";
    for (kubelet, code) in [
        ("unix:///run/containerd/containerd.sock", 0),
        ("unix:///run/cri-dockerd.sock", 1),
    ] {
        let config = format!("{NO_KUBERNETES}[runtime]\nkubelet_runtime_endpoint = \"{kubelet}\"\n");
        let node = engine_node(Engine::Containerd, None, &config);
        install_engine(&node.root, Engine::Docker, Some(broken));
        let out = expect_exit(&node, &["run", "--once"], code);
        assert!(
            read(&node.root, CONTAINERD_DROP_IN).is_some(),
            "{kubelet}: containerd is configured"
        );
        assert_eq!(
            read(&node.root, DOCKER_MAIN).as_deref(),
            Some(broken),
            "{kubelet}: docker untouched"
        );
        let status = node.status();
        let runtime = common::stage(&status, StageId::Runtime);
        let text = format!("{runtime:?}");
        assert!(
            text.contains("/etc/docker/daemon.json: line 3"),
            "{kubelet}: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let expected = if code == 0 { StageState::Ok } else { StageState::Failed };
        assert_eq!(runtime.state, expected, "{kubelet}: {text}");
    }
}

/// A node without NVIDIA's toolkit under the defaults: the pass succeeds, the runtime stage is
/// ok (CDI in containerd, no runtime), and the stages after it run.
#[test]
fn without_the_toolkit_the_runtime_stage_is_ok_and_the_rest_proceeds() {
    let node = engine_node(Engine::Containerd, None, NO_KUBERNETES);
    fs::remove_file(under(&node.root, RUNTIME_BINARY)).expect("remove runtime binary");
    let out = expect_exit(&node, &["run", "--once"], 0);
    let status = node.status();
    let stage = |id: StageId| common::stage(&status, id);
    let runtime = stage(StageId::Runtime);
    assert_eq!(
        runtime.state,
        StageState::Ok,
        "{runtime:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        runtime
            .detail
            .as_deref()
            .unwrap_or_default()
            .starts_with("CDI, no runtime, in containerd"),
        "{runtime:?}"
    );
    assert_eq!(stage(StageId::Mig).state, StageState::Ok, "{:?}", stage(StageId::Mig));
    let plugin = stage(StageId::DevicePlugin);
    assert!(
        plugin
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains("would advertise nvidia.com/gpu"),
        "the device plugin is not held back: {plugin:?}"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("runtime.mode auto: cdi-only (/usr/bin/nvidia-container-runtime is not installed)"),
        "the log says what auto became: {log}"
    );
}

// === unconfigure takes out only what the agent put in ===

/// The user's config already imported conf.d (for files of their own): after configure, a
/// later edit of theirs, and unconfigure, their `imports` entry is still there.
#[test]
fn unconfigure_keeps_an_imports_glob_the_user_had() {
    let main = "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
    let node = engine_node(Engine::Containerd, Some(main), "");
    write_file(&node.root, "/etc/containerd/conf.d/50-mine.toml", "version = 2\n");
    succeeds(&node, CONFIGURE);
    assert_eq!(
        read(&node.root, CONTAINERD_MAIN).as_deref(),
        Some(main),
        "nothing to add"
    );
    // The user edits the file since.
    let edited = format!("{main}oom_score = -999\n");
    write_file(&node.root, CONTAINERD_MAIN, &edited);
    succeeds(&node, UNCONFIGURE);
    assert_eq!(read(&node.root, CONTAINERD_MAIN), Some(edited), "their import stays");
    assert_eq!(read(&node.root, CONTAINERD_DROP_IN), None);
    assert!(read(&node.root, "/etc/containerd/conf.d/50-mine.toml").is_some());
}

/// A daemon.json that nvidia-ctk (or an image) had already configured, the agent changing
/// nothing in it: unconfigure leaves it as it is instead of emptying it.
#[test]
fn unconfigure_leaves_a_daemon_json_the_agent_never_changed() {
    let main = "{\n    \"default-runtime\": \"nvidia\",\n    \"runtimes\": {\n        \"nvidia\": {\n            \
                \"args\": [],\n            \"path\": \"/usr/bin/nvidia-container-runtime\"\n        }\n    }\n}\n";
    // docker is not the kubelet's engine here (containerd is, by default): "auto" keeps docker's
    // default; the agent adds nothing it does not already have.
    let node = engine_node(Engine::Docker, Some(main), "[runtime]\nset_as_default = \"auto\"\n");
    let stdout = succeeds(&node, CONFIGURE);
    assert!(stdout.contains("already configured"), "{stdout}");
    assert_eq!(read(&node.root, DOCKER_MAIN).as_deref(), Some(main));
    succeeds(&node, UNCONFIGURE);
    assert_eq!(
        read(&node.root, DOCKER_MAIN).as_deref(),
        Some(main),
        "not the agent's to undo"
    );
    // Edited by the agent once (CDI on), then by the user: only the agent's key goes.
    let node = engine_node(
        Engine::Docker,
        Some(main),
        "[runtime]\nset_as_default = \"auto\"\nenable_cdi = true\n",
    );
    succeeds(&node, CONFIGURE);
    let configured = read(&node.root, DOCKER_MAIN).expect("daemon.json");
    assert!(configured.contains("\"cdi\": true"), "{configured}");
    write_file(
        &node.root,
        DOCKER_MAIN,
        &configured.replace("{\n", "{\n    \"debug\": true,\n"),
    );
    succeeds(&node, UNCONFIGURE);
    let after: serde_json::Value =
        serde_json::from_str(&read(&node.root, DOCKER_MAIN).expect("daemon.json")).expect("json");
    assert_eq!(after["default-runtime"], "nvidia", "{after}");
    assert_eq!(after["runtimes"]["nvidia"]["path"], RUNTIME_BINARY, "{after}");
    assert_eq!(after["debug"], true, "{after}");
}

/// Files that are already as the agent wants them: no write and no systemctl call at all, even
/// with restarts on.
#[test]
fn an_engine_already_configured_is_not_restarted_again() {
    let host = RestartHost::new("exit 0", "echo active");
    assert_eq!(host.apply().expect("first apply").restarted, ["containerd.service"]);
    assert_eq!(host.log("systemctl.log"), [RESTART, IS_ACTIVE]);
    let snap = snapshot(&host.root);
    let applied = host.apply().expect("second apply");
    assert_eq!(applied, Applied::default(), "nothing written, nothing restarted");
    assert_eq!(
        host.log("systemctl.log"),
        [RESTART, IS_ACTIVE],
        "no systemctl call the second time"
    );
    assert_same(&snap, &snapshot(&host.root), "no file touched");
}

/// Under a `--root` other than `/` (an image being built, a test) the files are written but
/// nothing is restarted, without `--no-restart` too: neither `runtime configure` /
/// `unconfigure` nor the agent's own pass runs the (stand-in) systemctl under the root.
#[test]
fn under_a_root_prefix_nothing_is_restarted_without_no_restart() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), NO_KUBERNETES);
    let root = node.root.as_path();
    let log = node.tmp.path().join("systemctl.log");
    script(
        root,
        "/usr/bin/systemctl",
        &format!("echo \"$*\" >> '{}'\necho active", log.display()),
    );
    let calls = || fs::read_to_string(&log).unwrap_or_default();

    let stdout = succeeds(&node, &["runtime", "configure"]);
    assert!(
        stdout.contains(&format!("wrote {CONTAINERD_DROP_IN}")) && stdout.contains("restarted nothing"),
        "{stdout}"
    );
    assert!(read(root, CONTAINERD_DROP_IN).is_some());
    assert_eq!(calls(), "", "systemctl was run");

    let stdout = succeeds(&node, &["runtime", "unconfigure"]);
    assert!(
        stdout.contains(&format!("restored {CONTAINERD_DROP_IN}")) && stdout.contains("restarted nothing"),
        "{stdout}"
    );
    assert_eq!(read(root, CONTAINERD_DROP_IN), None);
    assert_eq!(calls(), "", "systemctl was run");

    expect_exit(&node, &["run", "--once"], 0);
    assert!(
        read(root, CONTAINERD_DROP_IN).is_some(),
        "the agent's pass configured containerd"
    );
    // The validation stage may ask whether the engine is active; nothing else.
    let calls = calls();
    assert!(calls.lines().all(|l| l.starts_with("is-active ")), "{calls}");
}

// === 8. CDI ===

/// The CDI spec the agent wrote, parsed.
fn cdi_spec(node: &Node) -> (String, serde_json::Value) {
    let text = read(&node.root, CDI_SPEC).unwrap_or_else(|| panic!("no {CDI_SPEC}"));
    let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{CDI_SPEC} is not JSON: {e}\n{text}"));
    (text, json)
}

/// Device name → its device node paths.
fn cdi_devices(spec: &serde_json::Value) -> BTreeMap<String, Vec<String>> {
    let devices = spec["devices"].as_array().expect("devices");
    devices
        .iter()
        .map(|d| {
            let nodes = d["containerEdits"]["deviceNodes"]
                .as_array()
                .map(|n| n.iter().filter_map(|n| n["path"].as_str().map(String::from)).collect())
                .unwrap_or_default();
            (d["name"].as_str().expect("name").to_string(), nodes)
        })
        .collect()
}

/// `run --once`, then the spec, which `cdi generate --output -` prints byte for byte.
fn run_once_and_read_spec(node: &Node) -> (serde_json::Value, BTreeMap<String, Vec<String>>) {
    expect_exit(node, &["run", "--once"], 0);
    let (text, spec) = cdi_spec(node);
    assert_eq!(spec["kind"], "k8s.device-plugin.nvidia.com/gpu");
    assert_eq!(
        succeeds(node, &["cdi", "generate", "--output", "-"]),
        text,
        "cdi generate prints the same spec"
    );
    let devices = cdi_devices(&spec);
    (spec, devices)
}

#[test]
fn run_once_writes_the_cdi_spec_for_every_gpu() {
    let node = Node::new(&common::machine("A100-SXM4-80GB", 8), NO_KUBERNETES);
    let (spec, devices) = run_once_and_read_spec(&node);
    assert!(spec["cdiVersion"].is_string(), "{spec}");
    for i in 0..8u32 {
        let by_index = &devices[&i.to_string()];
        assert_eq!(by_index.len(), 1, "{by_index:?}");
        assert!(by_index[0].starts_with("/dev/nvidia"), "{by_index:?}");
        assert_eq!(devices.get(&gpu_uuid(i)), Some(by_index), "by UUID, the same node");
    }
    assert_eq!(devices["all"].len(), 8, "all: every GPU's node");
    assert_eq!(devices.len(), 8 * 2 + 1, "{:?}", devices.keys());
    assert!(!devices.keys().any(|n| n.contains(':')), "no MIG devices");

    // An unchanged inventory: the spec is not rewritten.
    let mtime = |n: &Node| {
        fs::metadata(under(&n.root, CDI_SPEC))
            .and_then(|m| m.modified())
            .expect("mtime")
    };
    let before = mtime(&node);
    expect_exit(&node, &["run", "--once"], 0);
    assert_eq!(mtime(&node), before);
}

/// A spec written with a hook program that is not statically linked says so (an image's
/// LD_PRELOAD would reach it under a runtime that ignores the spec's env); the static build, as
/// the packages ship it, passes without a word. Checked when the spec is written.
#[test]
fn a_spec_naming_a_dynamically_linked_hook_program_is_written_with_a_warning() {
    let config = format!("{NO_KUBERNETES}\n[cdi]\nhook = \"agent\"\nagent_path = \"/bin/sh\"\n");
    let node = Node::new(&common::machine("A100-SXM4-80GB", 1), &config);
    let out = node.run(&["cdi", "generate"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("the agent's hook program /bin/sh is dynamically linked"),
        "{said}"
    );
    node.write_config(NO_KUBERNETES);
    node.use_static_cdi_hook();
    let out = node.run(&["cdi", "generate"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(!said.contains("hook program"), "{said}");
}

/// Two A100-40GB with MIG enabled and no MIG devices yet (as in tests/mig.rs).
fn two_mig_a100s() -> String {
    let mut m = common::DGX_A100.to_string();
    for i in 0..2 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            gpu_uuid(i)
        ));
    }
    m
}

/// The driver's MIG capability table under the node's root: minor → key (`gpu0/gi1/access`).
fn mig_minors(node: &Node) -> BTreeMap<String, String> {
    let table = fs::read_to_string(node.root.join("proc/driver/nvidia-caps/mig-minors")).expect("mig-minors");
    table
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(key, minor)| (minor.to_string(), key.to_string()))
        .collect()
}

#[test]
fn the_cdi_spec_follows_a_mig_layout() {
    let node = Node::new(&two_mig_a100s(), NO_KUBERNETES);
    let (_, devices) = run_once_and_read_spec(&node);
    assert!(
        !devices.keys().any(|n| n.contains(':')),
        "no MIG devices yet: {devices:?}"
    );

    succeeds(&node, &["mig", "apply", "all-1g.5gb"]);
    let (_, devices) = run_once_and_read_spec(&node);
    let minors = mig_minors(&node);
    let mut caps_seen = Vec::new();
    for gpu in 0..2u32 {
        let gpu_node = devices[&gpu.to_string()][0].clone();
        let gpu_minor = gpu_node.trim_start_matches("/dev/nvidia");
        for mig in 0..7 {
            let name = format!("{gpu}:{mig}");
            let nodes = devices
                .get(&name)
                .unwrap_or_else(|| panic!("no {name}: {:?}", devices.keys()));
            let [parent, gi, ci] = nodes.as_slice() else {
                panic!("{name}: parent GPU node and two capability nodes: {nodes:?}");
            };
            assert_eq!(parent, &gpu_node, "{name}");
            // The capabilities are this GPU's GI access and that GI's CI access.
            let key = |cap: &str| {
                let minor = cap
                    .strip_prefix("/dev/nvidia-caps/nvidia-cap")
                    .unwrap_or_else(|| panic!("{name}: {cap} is not a capability node"));
                minors
                    .get(minor)
                    .cloned()
                    .unwrap_or_else(|| panic!("{cap} not in mig-minors"))
            };
            let (gi_key, ci_key) = (key(gi), key(ci));
            let gi_prefix = gi_key.strip_suffix("/access").expect("a GI access key");
            assert!(gi_key.starts_with(&format!("gpu{gpu_minor}/gi")), "{name}: {gi_key}");
            assert!(
                ci_key.starts_with(&format!("{gi_prefix}/ci")),
                "{name}: {gi_key} {ci_key}"
            );
            caps_seen.push((gi.clone(), ci.clone()));
        }
    }
    caps_seen.sort();
    caps_seen.dedup();
    assert_eq!(caps_seen.len(), 14, "every MIG device has its own capabilities");
    let mig_uuids: Vec<&String> = devices.keys().filter(|n| n.starts_with("MIG-")).collect();
    assert_eq!(mig_uuids.len(), 14, "{:?}", devices.keys());
    for uuid in mig_uuids {
        assert_eq!(devices[uuid].len(), 3, "{uuid}: {:?}", devices[uuid]);
    }
    let all = &devices["all"];
    assert!(
        caps_seen.iter().all(|(gi, ci)| all.contains(gi) && all.contains(ci)),
        "all has every capability node: {all:?}"
    );
}

// === the toolkit's config with the volume-mounts strategy ===

const TOOLKIT_CONFIG: &str = "/etc/nvidia-container-runtime/config.toml";

/// With `volume-mounts`, unprivileged pods that request no GPU must see none: the toolkit's
/// config gets `accept-nvidia-visible-devices-envvar-when-unprivileged = false` and
/// `accept-nvidia-visible-devices-as-volume-mounts = true` (backed up), and unconfigure gives
/// back its bytes. Without that strategy the file is not touched.
#[test]
fn volume_mounts_make_the_toolkit_ignore_the_envvar_for_unprivileged_pods() {
    let packaged = "#accept-nvidia-visible-devices-as-volume-mounts = false\ndisable-require = false\n\n\
                    [nvidia-container-runtime]\nmode = \"auto\"\n";
    let node = engine_node(
        Engine::Containerd,
        None,
        "[device_plugin]\ndevice_list_strategy = [\"volume-mounts\"]\n",
    );
    write_file(&node.root, TOOLKIT_CONFIG, packaged);
    let stdout = succeeds(&node, CONFIGURE);
    assert!(stdout.contains(&format!("wrote {TOOLKIT_CONFIG}")), "{stdout}");
    let written = toml_table(&read(&node.root, TOOLKIT_CONFIG).expect("toolkit config"));
    assert_eq!(
        written["accept-nvidia-visible-devices-envvar-when-unprivileged"].as_bool(),
        Some(false)
    );
    assert_eq!(
        written["accept-nvidia-visible-devices-as-volume-mounts"].as_bool(),
        Some(true)
    );
    assert_eq!(written["nvidia-container-runtime"]["mode"].as_str(), Some("auto"));
    assert!(succeeds(&node, CONFIGURE).contains("already configured"));
    succeeds(&node, UNCONFIGURE);
    assert_eq!(read(&node.root, TOOLKIT_CONFIG).as_deref(), Some(packaged));

    let envvar = engine_node(Engine::Containerd, None, "");
    write_file(&envvar.root, TOOLKIT_CONFIG, packaged);
    succeeds(&envvar, CONFIGURE);
    assert_eq!(
        read(&envvar.root, TOOLKIT_CONFIG).as_deref(),
        Some(packaged),
        "envvar: not touched"
    );
}

/// Every pass observes, but containerd is asked for its version and effective configuration
/// only when its binary or a file it reads changed.
#[test]
fn containerd_is_asked_again_only_when_its_files_change() {
    let host = RestartHost::new("exit 0", "echo active");
    let calls = host.root.join("containerd-calls.log");
    script(
        &host.root,
        REAL_CONTAINERD,
        &format!(
            "echo \"$*\" >> '{}'\nexec {} \"$@\"",
            calls.display(),
            real_containerd().display()
        ),
    );
    let count = || fs::read_to_string(&calls).unwrap_or_default().lines().count();
    host.apply().expect("first apply");
    host.apply().expect("second apply (the main file changed: asked again)");
    let settled = count();
    host.apply().expect("third apply");
    assert_eq!(count(), settled, "nothing changed: containerd was not run");
    write_file(&host.root, "/etc/containerd/conf.d/50-registry.toml", "version = 2\n");
    host.apply().expect("after a new imported file");
    assert!(count() > settled, "a new imported file: asked again");
}

// === RuntimeClasses ===

/// Polls `check` for up to 20 s.
async fn eventually(what: &str, agent: &common::Agent, check: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !check() {
        assert!(std::time::Instant::now() < deadline, "{what}\n{}", agent.log_text());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// With credentials that may, the agent creates a RuntimeClass per runtime it configured
/// (`nvidia`, and `nvidia-cdi` for the toolkit's `.cdi` binary); with node credentials that may
/// not (403), a Warning Event on the Node carries the manifest to apply.
#[tokio::test(flavor = "multi_thread")]
async fn runtime_classes_are_created_or_the_node_says_what_to_apply() {
    for allowed in [true, false] {
        // Passes every second, so that status catches up with the RuntimeClass outcome.
        let node = engine_node(Engine::Containerd, None, "[agent]\nresync_interval = \"1s\"\n");
        script(&node.root, &format!("{RUNTIME_BINARY}.cdi"), "exit 0");
        let api = common::api_server_for(&node, &[]).await;
        if !allowed {
            api.forbid("system:node:gpu-node-1", "create", "runtimeclasses");
        }
        let agent = node.spawn();
        if allowed {
            eventually("the RuntimeClasses are created", &agent, || {
                api.runtime_classes().len() == 2
            })
            .await;
            let classes = api.runtime_classes();
            for name in ["nvidia", "nvidia-cdi"] {
                assert_eq!(classes[name]["handler"], name, "{classes:?}");
            }
        } else {
            let warned = || api.events().iter().any(|e| e["reason"] == "RuntimeClassMissing");
            eventually("a Warning Event says what to apply", &agent, warned).await;
            let events = api.events();
            let event = events
                .iter()
                .find(|e| e["reason"] == "RuntimeClassMissing")
                .expect("event");
            let message = event["message"].as_str().unwrap_or_default();
            assert_eq!(event["type"], "Warning");
            assert!(
                message.contains("kind: RuntimeClass\nmetadata:\n  name: nvidia-cdi\nhandler: nvidia-cdi"),
                "{message}"
            );
            assert!(api.runtime_classes().is_empty());
            let says = || {
                fs::read_to_string(node.status_path())
                    .is_ok_and(|s| s.contains("RuntimeClass nvidia, nvidia-cdi missing: the agent may not create it"))
            };
            eventually("status says which RuntimeClasses are missing", &agent, says).await;
        }
        // The files written are posted once; a later pass that writes nothing posts nothing.
        let event = common::event_posted(&api, "RuntimeConfigured").await;
        common::assert_event(
            &event,
            "Normal",
            &["container runtime configuration written", CONTAINERD_DROP_IN],
        );
        common::another_pass(&agent).await;
        assert_eq!(
            common::events_with(&api, "RuntimeConfigured").len(),
            1,
            "{:?}",
            api.events()
        );
        for reason in ["RuntimeFailed", "RuntimeRolledBack"] {
            assert!(common::events_with(&api, reason).is_empty(), "{:?}", api.events());
        }
        // What to apply is said once, not at every pass.
        let missing = common::events_with(&api, "RuntimeClassMissing").len();
        assert_eq!(missing, usize::from(!allowed), "{:?}", api.events());
    }
}

// === retries ===

/// Seconds of the day of a log line's timestamp (`2026-11-24T19:48:44.311072Z ...`).
fn log_seconds(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}

/// A stage that fails the same way every time runs again on its backoff schedule (doubling
/// from `retry_min` to `retry_max`, each wait jittered to between half and all of it), not at
/// every pass: here passes come every 100 ms. SIGHUP runs it at once.
#[test]
fn a_failing_stage_is_retried_on_its_backoff_schedule_not_every_pass() {
    let node = engine_node(
        Engine::Containerd,
        Some("version = 2\n[plugins\n"),
        "[kubernetes]\nenabled = false\n[agent]\nresync_interval = \"100ms\"\nretry_min = \"400ms\"\nretry_max = \"1600ms\"\n",
    );
    let agent = node.spawn();
    let attempts = |log: &str| -> Vec<f64> {
        log.lines()
            .filter(|l| l.contains("stage runtime failed: trying again in"))
            .filter_map(log_seconds)
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while attempts(&agent.log_text()).len() < 5 {
        assert!(std::time::Instant::now() < deadline, "{}", agent.log_text());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let log = agent.log_text();
    let at = attempts(&log);
    let gaps: Vec<f64> = at.windows(2).map(|w| w[1] - w[0]).collect();
    // Steps 0.4, 0.8, 1.6, 1.6 s; each wait at least half its step (less a little for the log).
    for (gap, step) in gaps.iter().zip([0.4, 0.8, 1.6, 1.6]) {
        assert!(*gap >= step / 2.0 - 0.02, "gaps {gaps:?} (step {step})\n{log}");
        assert!(*gap <= step + 0.5, "gaps {gaps:?} (step {step})\n{log}");
    }
    assert!(
        log.contains("(attempt 5)"),
        "the attempts of one cause are counted\n{log}"
    );
    // Passes kept coming every 100 ms meanwhile: the stage was not run at each.
    let status = node.status();
    let stage = common::stage(&status, StageId::Runtime);
    assert_eq!(stage.state, StageState::Failed, "{status:?}");
    // SIGHUP: the operator asks for every stage now.
    let before = at.len();
    agent.sighup();
    let asked = std::time::Instant::now();
    while attempts(&agent.log_text()).len() == before {
        assert!(std::time::Instant::now() < deadline, "{}", agent.log_text());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        asked.elapsed() < std::time::Duration::from_millis(1200),
        "SIGHUP ran the stage before its backoff ended"
    );
    assert_eq!(agent.stop(), 0);
}

// === Events ===

/// A containerd that rejects the new files, in the daemon: the rollback is posted once
/// (`RuntimeRolledBack`, naming the engine and containerd's words), the stage's failure once
/// (`RuntimeFailed`: containerd is the kubelet's engine), and the passes that meet the same
/// rollback again post neither, nor a `RuntimeConfigured` for files that were put back.
#[tokio::test(flavor = "multi_thread")]
async fn a_rollback_in_the_daemon_is_posted_once_with_the_failed_stage() {
    let main = fixture("containerd/v2-systemd-cgroup.main.toml");
    let node = engine_node(Engine::Containerd, Some(&main), "");
    script(
        &node.root,
        REAL_CONTAINERD,
        "echo 'containerd: failed to load TOML: invalid plugin key' >&2; exit 1",
    );
    let api = common::api_server_for(&node, &[]).await;
    let agent = node.spawn();
    let event = common::event_posted(&api, "RuntimeRolledBack").await;
    common::assert_event(
        &event,
        "Warning",
        &["containerd", "rejects the new configuration", "invalid plugin key"],
    );
    let event = common::event_posted(&api, "RuntimeFailed").await;
    common::assert_event(
        &event,
        "Warning",
        &[
            "runtime stage failed",
            "containerd (the engine the kubelet uses)",
            "invalid plugin key",
        ],
    );
    for _ in 0..2 {
        common::another_pass(&agent).await;
    }
    let log = agent.log_text();
    assert!(
        log.matches("containerd rejects the new configuration").count() >= 3,
        "the later passes met the rollback again\n{log}"
    );
    for reason in ["RuntimeRolledBack", "RuntimeFailed"] {
        assert_eq!(common::events_with(&api, reason).len(), 1, "{:?}", api.events());
    }
    assert!(
        common::events_with(&api, "RuntimeConfigured").is_empty(),
        "{:?}",
        api.events()
    );
    assert_eq!(read(&node.root, CONTAINERD_MAIN), Some(main), "main put back");
}
