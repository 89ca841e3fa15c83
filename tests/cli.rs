//! The commands a person runs on the node: config check, plan, status, version, and the errors
//! a user can cause (bad config, no NVML).

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid, machine};

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
        common::stage(s, "device-plugin")["state"] == "failed"
    });
    assert!(
        common::stage(&status, "device-plugin")["error"]
            .as_str()
            .unwrap_or_default()
            .contains("libnvidia-ml"),
        "{status}"
    );
    assert!(status["resources"].as_array().is_some_and(Vec::is_empty));
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
    let status = node.status_json();
    assert_eq!(status["state"], "once");
    assert_eq!(common::stage(&status, "device-plugin")["state"], "skipped");
    assert!(
        common::stage(&status, "device-plugin")["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("nvidia.com/gpu ×2"),
        "{status}"
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
