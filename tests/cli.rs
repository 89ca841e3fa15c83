//! The commands a person runs on the node: config check, plan, status, version, and the errors
//! a user can cause (bad config, no NVML).

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid, machine};
use gpu_node_agent::status::{StageId, StageState};

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn bad_config_exits_64_naming_file_line_and_key_and_touches_nothing() {
    let node = Node::new(&machine("T4", 1), "");
    let dropin = node.root.join("etc/gpu-node-agent/config.d/10-mig.toml");
    std::fs::create_dir_all(dropin.parent().expect("config.d")).expect("mkdir");
    std::fs::write(&dropin, "# MIG\n[device_plugin]\nmig_strategy = \"mixd\"\n").expect("write drop-in");
    for args in [&["run"][..], &["run", "--once"], &["plan"], &["config", "check"]] {
        let out = node.run(args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(err.contains("config.d/10-mig.toml:3"), "{args:?}: {err}");
        assert!(err.contains("device_plugin.mig_strategy"), "{args:?}: {err}");
        assert!(err.contains("mixd"), "{args:?}: {err}");
    }
    assert!(!node.status_path().exists(), "an invalid config must not write status");
    assert!(!node.plugin_dir().exists(), "an invalid config must not create sockets");

    std::fs::write(&dropin, "[device_plugin]\nmig_strategy = \"mixed\"\nsurprise = 1\n").expect("write drop-in");
    let out = node.run(&["config", "check"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(text(&out.stderr).contains("surprise"), "{}", text(&out.stderr));
}

#[test]
fn config_check_prints_the_effective_config_with_drop_ins_applied() {
    let node = Node::new(&machine("T4", 1), "");
    let dropin = node.root.join("etc/gpu-node-agent/config.d/10-mig.toml");
    std::fs::create_dir_all(dropin.parent().expect("config.d")).expect("mkdir");
    std::fs::write(&dropin, "[device_plugin]\nmig_strategy = \"mixed\"\n").expect("write drop-in");
    let out = node.run(&["config", "check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("config.d/10-mig.toml"), "{stdout}");
    assert!(stdout.contains("mig_strategy = \"mixed\""), "{stdout}");
}

#[test]
fn no_nvml_is_a_clear_error_with_exit_69() {
    let node = Node::new(
        &machine("T4", 1),
        "[nvml]\nlibrary = \"/usr/lib/nope/libnvidia-ml.so.1\"\n",
    );
    for args in [&["run"][..], &["plan"]] {
        let out = node.run(args);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("libnvidia-ml.so.1") && err.contains("NVIDIA driver"),
            "{args:?}: {err}"
        );
    }
    assert!(!node.plugin_dir().join("nvidia-gpu.sock").exists());
}

#[test]
fn no_nvml_with_fail_on_init_error_false_keeps_running_without_devices() {
    let node = Node::new(
        &machine("T4", 1),
        "[nvml]\nlibrary = \"/usr/lib/nope/libnvidia-ml.so.1\"\nfail_on_init_error = false\nretry_interval = \"100ms\"\n",
    );
    let mut agent = node.spawn();
    let status = node.wait_status(Duration::from_secs(10), |s| {
        common::stage_is(s, StageId::DevicePlugin, StageState::Failed)
    });
    assert!(
        common::stage_error(&status, StageId::DevicePlugin)
            .unwrap_or_default()
            .contains("libnvidia-ml"),
        "{status:?}"
    );
    assert!(status.resources.is_empty(), "{status:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(agent.running(), "the agent keeps running and retries");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn machine_without_driver_is_reported_like_a_node_without_driver() {
    let node = Node::new("this is not a machine file", "");
    let out = node.run(&["plan"]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
}

#[test]
fn plan_prints_inventory_and_resources_and_changes_nothing() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "");
    let out = node.run(&["plan"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("driver 550.54.15, CUDA 12.4, 2 GPU(s)"), "{stdout}");
    assert!(stdout.contains("NVIDIA A100-SXM4-40GB"), "{stdout}");
    assert!(stdout.contains(&gpu_uuid(1)), "{stdout}");
    assert!(
        stdout.contains("nvidia.com/gpu (2 device(s), socket nvidia-gpu.sock)"),
        "{stdout}"
    );
    let out = node.run(&["plan", "--json"]);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json parses");
    assert_eq!(plan["resources"][0]["name"], "nvidia.com/gpu");
    assert_eq!(plan["inventory"]["gpus"][0]["memory_mib"], 40960);
    assert!(
        !node.plugin_dir().exists() && !node.status_path().exists(),
        "plan changes nothing"
    );
}

#[test]
fn status_without_a_running_agent_says_so() {
    let node = Node::new(&machine("T4", 1), "");
    let out = node.run(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("is the agent running?"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn run_once_reports_what_it_would_advertise_and_exits_zero() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "");
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status = node.status();
    assert_eq!(status.state, "once");
    assert_eq!(common::stage(&status, StageId::DevicePlugin).state, StageState::Skipped);
    assert!(
        common::stage_detail(&status, StageId::DevicePlugin)
            .unwrap_or_default()
            .contains("nvidia.com/gpu ×2"),
        "{status:?}"
    );
    let out = node.run(&["status"]);
    assert_eq!(out.status.code(), Some(0));
    let view = text(&out.stdout);
    assert!(
        view.contains("device-plugin") && view.contains("NVIDIA A100-SXM4-40GB"),
        "{view}"
    );
}

#[test]
fn version_and_help_work_without_config() {
    let node = Node::new(&machine("T4", 1), "");
    let out = node.run(&["version"]);
    assert!(text(&out.stdout).starts_with("gpu-node-agent "));
    let out = node.run(&["--help"]);
    let help = text(&out.stdout);
    for cmd in ["run", "plan", "status", "config", "version", "--root", "--config"] {
        assert!(help.contains(cmd), "{cmd} in help:\n{help}");
    }
}

/// The kubelet's ListAndWatch streams per resource, as the plugin tracks them, are in
/// status.json and `status`: how many are open and how many devices the last message listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_each_resources_listandwatch_streams() {
    use test_kubelet::{KubeletOptions, TestKubelet};

    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn();
    node.wait_status(Duration::from_secs(15), |s| {
        s.resources
            .first()
            .is_some_and(|r| r.streams_open == 1 && r.devices_sent == Some(2))
    });
    let out = node.run(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // `status --json` is read as JSON on purpose: its keys are the scripts' contract.
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json parses");
    assert_eq!(status["resources"][0]["name"], "nvidia.com/gpu");
    assert_eq!(status["resources"][0]["streams_open"], 1);
    assert_eq!(status["resources"][0]["devices_sent"], 2);
    let view = text(&node.run(&["status"]).stdout);
    assert!(view.contains("DEVICES  HEALTHY  STREAMS  LISTED  REGISTERED"), "{view}");
    assert!(
        view.lines().any(|l| l.starts_with("nvidia.com/gpu ")
            && l.split_whitespace().take(5).eq(["nvidia.com/gpu", "2", "2", "1", "2"])),
        "{view}\n{}",
        agent.log_text()
    );
    drop(kubelet);
}

/// `status` finds a live agent started with `--root` (the pid in status.json is a process of this
/// kernel: it is looked for in the live /proc, not the root's). status.json that says `running`
/// for an agent that is gone (killed without a chance to write `stopped`) shows as not running,
/// with when it was written, and exits 3; `--json` keeps the file's fields and adds
/// `agent_running` and `stale_reason`.
#[test]
fn status_of_an_agent_that_is_gone_says_not_running() {
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    let agent = node.spawn();
    let pid = agent.pid();
    node.wait_status(Duration::from_secs(15), |s| s.state == "running");
    let out = node.run(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // `status --json` is read as JSON on purpose: the keys it adds to the file's
    // (`agent_running`, `stale_reason`) are the scripts' contract.
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json parses");
    assert_eq!(
        (status["state"].as_str(), status["agent_running"].as_bool()),
        (Some("running"), Some(true)),
        "{status:?}"
    );
    assert!(status.get("stale_reason").is_none(), "{status:?}");
    let out = node.run(&["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&format!("— running (pid {pid},")),
        "{}",
        text(&out.stdout)
    );

    // SIGKILL (and reaped): status.json still says running.
    drop(agent);
    assert_eq!(node.status().state, "running");
    let out = node.run(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json parses");
    assert_eq!(status["state"], "running", "the file's own fields are kept");
    assert_eq!(status["pid"], pid);
    assert_eq!(status["agent_running"], false);
    assert_eq!(status["stale_reason"], format!("no process {pid}"));
    let out = node.run(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    let view = text(&out.stdout);
    let first = view.lines().next().unwrap_or_default();
    assert!(
        first.contains("— not running (status from ") && first.contains(&format!("no process {pid}")),
        "{view}"
    );
    assert!(!first.contains("— running"), "{view}");

    // The pid taken by another program is not the agent either.
    let mut other = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
    let mut file = node.status();
    file.pid = other.id();
    std::fs::write(
        node.status_path(),
        serde_json::to_string(&file).expect("status serializes"),
    )
    .expect("status.json");
    let out = node.run(&["status", "--json"]);
    let _ = other.kill();
    let _ = other.wait();
    assert_eq!(out.status.code(), Some(3));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json parses");
    assert_eq!(
        status["stale_reason"],
        format!("pid {} is now another program (sleep)", other.id())
    );
}

/// `gpu-node-agent ... | head -1`: a reader that goes away ends the command quietly, as for any
/// Unix tool (killed by SIGPIPE, nothing on stderr), instead of a Rust panic and exit 101.
#[test]
fn a_closed_pipe_on_stdout_ends_a_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let node = Node::new(&machine("A100-SXM4-40GB", 2), "[kubernetes]\nenabled = false\n");
    assert_eq!(node.run(&["run", "--once"]).status.code(), Some(0));
    for args in [
        &["config", "check"][..],
        &["plan"],
        &["plan", "--json"],
        &["mig", "assert", "all-disabled"],
        &["status"],
        &["driver", "status"],
    ] {
        let normal = node.run(args);
        assert!(!normal.stdout.is_empty(), "{args:?} prints something");
        // A pipe whose reader is already gone: the first write fails.
        let (reader, writer) = nix::unistd::pipe().expect("pipe");
        drop(reader);
        let out = node
            .command(args)
            .stdout(std::process::Stdio::from(writer))
            .output()
            .expect("run gpu-node-agent");
        let err = text(&out.stderr);
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
        assert_eq!(
            out.status.signal(),
            Some(nix::sys::signal::Signal::SIGPIPE as i32),
            "{args:?}: {:?} {err}",
            out.status
        );
    }
}

/// A config file over the 4 MiB text-file limit is refused naming the file and the limit,
/// without reading it all (and so is a labels file, the same reader).
#[test]
fn an_oversized_config_file_is_refused_naming_it() {
    let node = Node::new(&machine("T4", 1), "");
    let dropin = node.root.join("etc/gpu-node-agent/config.d/90-huge.toml");
    std::fs::create_dir_all(dropin.parent().expect("config.d")).expect("mkdir");
    let line = "# padding padding padding padding padding padding padding padding padding\n";
    std::fs::write(&dropin, line.repeat(4 * 1024 * 1024 / line.len() + 1)).expect("write");
    let out = node.run(&["config", "check"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("config.d/90-huge.toml") && err.contains("over the 4 MiB limit"),
        "{err}"
    );
}

/// The GFD labels `plan --json` reports for a machine: `n` GPUs of `model`, each entry followed
/// by `extra(i)` (machine-file keys and tables of that GPU).
fn planned_labels(model: &str, n: u32, extra: impl Fn(u32) -> String) -> serde_json::Map<String, serde_json::Value> {
    let mut m = machine(model, 0);
    for i in 0..n {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"{model}\"\nuuid = \"{}\"\n{}\n",
            gpu_uuid(i),
            extra(i)
        ));
    }
    let node = Node::new(&m, "");
    let out = node.run(&["plan", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json parses");
    plan["labels"].as_object().cloned().expect("labels")
}

fn fabric(uuid: &str, clique: u32, state: &str) -> String {
    format!("[gpu.fabric]\ncluster_uuid = \"{uuid}\"\nclique_id = {clique}\nstate = \"{state}\"\n")
}

const DOMAIN: &str = "0123abcd-0000-1111-2222-333344445555";

#[test]
fn gpu_mode_vgpu_and_clique_labels_follow_sysfs_and_the_fabric() {
    let label = |labels: &serde_json::Map<String, serde_json::Value>, k: &str| {
        labels
            .get(&format!("nvidia.com/{k}"))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    // A compute H100 node: 3D controllers, no vGPU, no fabric table (NOT_SUPPORTED).
    let h100 = planned_labels("H100-80GB-HBM3", 2, |_| String::new());
    assert_eq!(label(&h100, "gpu.mode").as_deref(), Some("compute"), "{h100:?}");
    assert_eq!(label(&h100, "vgpu.present").as_deref(), Some("false"));
    assert_eq!(label(&h100, "gpu.clique"), None);
    // An HGX H100 with its NVSwitch fabric up but no multi-node domain (all-zero cluster UUID).
    let hgx = planned_labels("H100-80GB-HBM3", 2, |_| {
        fabric("00000000-0000-0000-0000-000000000000", 0, "completed")
    });
    assert_eq!(label(&hgx, "gpu.clique"), None, "{hgx:?}");
    // A GB200-class tray: every GPU in one NVLink domain and clique.
    let tray = planned_labels("B200", 4, |_| fabric(DOMAIN, 7, "completed"));
    assert_eq!(
        label(&tray, "gpu.clique").as_deref(),
        Some("0123abcd-0000-1111-2222-333344445555.7"),
        "{tray:?}"
    );
    // GPUs in different cliques, or a fabric still registering: no clique label.
    let split = planned_labels("B200", 2, |i| fabric(DOMAIN, 7 + i, "completed"));
    assert_eq!(label(&split, "gpu.clique"), None, "{split:?}");
    let starting = planned_labels("B200", 2, |_| fabric(DOMAIN, 7, "in-progress"));
    assert_eq!(label(&starting, "gpu.clique"), None, "{starting:?}");
    // A vGPU guest in graphics (VGA) mode.
    let guest = planned_labels("H100-80GB-HBM3", 1, |_| "vgpu = true\npci_class = 0x030000\n".into());
    assert_eq!(label(&guest, "vgpu.present").as_deref(), Some("true"), "{guest:?}");
    assert_eq!(label(&guest, "gpu.mode").as_deref(), Some("graphics"));
    // GPUs in different modes.
    let mixed = planned_labels("H100-80GB-HBM3", 2, |i| {
        if i == 0 {
            "pci_class = 0x030000".into()
        } else {
            String::new()
        }
    });
    assert_eq!(label(&mixed, "gpu.mode").as_deref(), Some("unknown"), "{mixed:?}");
}
