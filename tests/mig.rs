//! MIG layouts end to end: `nvidia.com/mig.config` on the Node (test API server), the real
//! binary applying it through the fake NVML, and what the test kubelet then sees.

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid};
use test_apiserver::{KubeconfigAuth, KubeconfigOptions, TestApiServer};
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(15);
const NODE: &str = "gpu-node-1";
const TOKEN: &str = "agent-token-0123456789";
const STATE: &str = "nvidia.com/mig.config.state";

/// Two A100-40GB with MIG enabled and no MIG devices yet.
fn two_a100s() -> String {
    let mut m = common::DGX_A100.to_string();
    for i in 0..2 {
        m.push_str(&format!(
            "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n",
            gpu_uuid(i)
        ));
    }
    m
}

async fn setup(extra: &str) -> (TestApiServer, Node, TestKubelet) {
    let api = TestApiServer::start().await;
    api.create_node(NODE, &[]);
    api.add_token(TOKEN, "system:node:gpu-node-1");
    let config = format!("[device_plugin]\nmig_strategy = \"mixed\"\n{extra}");
    let node = Node::new(&two_a100s(), &config);
    let options = KubeconfigOptions {
        file_name: "kubelet.conf".into(),
        ..KubeconfigOptions::default()
    };
    api.write_kubeconfig_with(&node.kubeconfig_dir(), KubeconfigAuth::Token(TOKEN.into()), &options);
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    (api, node, kubelet)
}

async fn wait_label(api: &TestApiServer, key: &str, value: Option<&str>) {
    let ok = api
        .wait_for(T, |a| a.labels(NODE).get(key).map(String::as_str) == value)
        .await;
    assert!(ok, "label {key} never became {value:?}; labels: {:?}", api.labels(NODE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_label_is_applied_and_the_kubelet_sees_the_new_resources() {
    let (api, node, kubelet) = setup("").await;
    let agent = node.spawn();
    wait_label(&api, "nvidia.com/gpu.present", Some("true")).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    wait_label(&api, STATE, Some("success")).await;
    let devices = kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("7 per GPU");
    assert!(
        devices
            .iter()
            .all(|d| d.id.starts_with("MIG-") && d.health == "Healthy")
    );
    wait_label(&api, "nvidia.com/mig-1g.5gb.count", Some("14")).await;
    let ok = api
        .wait_for(T, |a| a.events().iter().any(|e| e["reason"] == "MigConfigApplied"))
        .await;
    assert!(ok, "{:?}", api.events());
    let status = node.wait_status(T, |s| common::stage(s, "mig")["state"] == "ok");
    assert!(
        common::stage(&status, "mig")["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("all-1g.5gb")
    );

    // Another layout swaps the resources in place.
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-balanced"));
    kubelet
        .wait_for_devices("nvidia.com/mig-3g.20gb", T, |d| d.len() == 2)
        .await
        .expect("balanced");
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 4)
        .await
        .expect("2 per GPU");
    wait_label(&api, "nvidia.com/mig-2g.10gb.count", Some("2")).await;
    assert_eq!(agent.stop(), 0);

    // A restart with the same label changes nothing on the GPUs.
    let out = node.run(&["mig", "assert", "all-balanced"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let out = node.run(&["mig", "apply", "all-balanced"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to do"),
        "zero NVML mutations on re-apply"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_or_impossible_layout_fails_and_changes_nothing() {
    let impossible = "[[mig.layouts.too-much]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1g.10gb\" = 4, \"1g.5gb\" = 1 }\n";
    let (api, node, kubelet) = setup(impossible).await;
    let agent = node.spawn();
    wait_label(&api, "nvidia.com/gpu.present", Some("true")).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("applied");

    api.set_label(NODE, "nvidia.com/mig.config", Some("no-such-layout"));
    wait_label(&api, STATE, Some("failed")).await;
    let status = node.wait_status(T, |s| common::stage(s, "mig")["state"] == "failed");
    let error = common::stage(&status, "mig")["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("no-such-layout") && error.contains("all-balanced"),
        "{error}"
    );

    api.set_label(NODE, "nvidia.com/mig.config", Some("too-much"));
    let ok = api
        .wait_for(T, |a| {
            a.events().iter().any(|e| {
                e["reason"] == "MigConfigFailed" && e["message"].as_str().is_some_and(|m| m.contains("does not fit"))
            })
        })
        .await;
    assert!(ok, "the reason names the profile that does not fit: {:?}", api.events());
    // Nothing changed: the 1g.5gb devices are still there.
    let devices = kubelet.devices("nvidia.com/mig-1g.5gb").expect("still listed");
    assert_eq!(devices.len(), 14);
    let out = node.run(&["mig", "assert", "all-1g.5gb"]);
    assert_eq!(out.status.code(), Some(0), "the GPUs were not touched");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_work_keeps_the_layout_pending_until_it_ends() {
    let (api, node, kubelet) = setup("").await;
    let agent = node.spawn();
    wait_label(&api, "nvidia.com/gpu.present", Some("true")).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("applied");

    // A process runs on GPU 0; the next layout must wait for it.
    node.set_injection("processes", &format!("{} 4242 1024\n", gpu_uuid(0)));
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-7g.40gb"));
    wait_label(&api, STATE, Some("pending")).await;
    let status = node.wait_status(T, |s| common::stage(s, "mig")["state"] == "pending");
    let reason = common::stage(&status, "mig")["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        reason.contains("waiting for GPU processes") && reason.contains(&gpu_uuid(0)),
        "{reason}"
    );
    // Both GPUs change, so both are withdrawn from the kubelet while it waits; nothing is killed.
    kubelet
        .wait_for_disconnect("nvidia.com/mig-1g.5gb", T)
        .await
        .expect("withdrawn");
    let out = node.run(&["mig", "assert", "all-1g.5gb"]);
    assert_eq!(out.status.code(), Some(0), "nothing changed while GPU work runs");

    // The work ends: the layout is applied.
    node.set_injection("processes", "");
    wait_label(&api, STATE, Some("success")).await;
    kubelet
        .wait_for_devices("nvidia.com/mig-7g.40gb", T, |d| d.len() == 2)
        .await
        .expect("7g on both");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn run_once_applies_the_layout_a_bootstrap_asks_for() {
    let config = "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n";
    let node = Node::new(&two_a100s(), config);
    std::fs::write(
        node.root.join("etc/gpu-node-agent/labels"),
        "nvidia.com/mig.config=all-3g.20gb\n",
    )
    .expect("labels");
    // GPU work on GPU 1: the layout cannot be applied, and --once says so with exit 75 (try
    // again later).
    node.set_injection("processes", &format!("{} 77 512\n", gpu_uuid(1)));
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(common::stage(&node.status_json(), "mig")["state"], "pending");
    // Without it: applied before the kubelet ever sees a device, exit 0.
    node.set_injection("processes", "");
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let status = node.status_json();
    assert_eq!(common::stage(&status, "mig")["state"], "ok");
    assert_eq!(status["labels"]["nvidia.com/mig.config.state"], "success");
    assert_eq!(node.run(&["mig", "assert", "all-3g.20gb"]).status.code(), Some(0));
}

/// One A100 with MIG off whose mode changes need a GPU reset, and a fake `nvidia-smi` under the
/// root that performs the reset through the fake NVML's `reset` file (or fails, if `works` is
/// false).
fn reset_node(extra: &str, works: bool) -> Node {
    let machine = format!(
        "{}\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_reset_required = true\n",
        common::DGX_A100,
        gpu_uuid(0)
    );
    let config =
        format!("[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{extra}");
    let node = Node::new(&machine, &config);
    std::fs::write(
        node.root.join("etc/gpu-node-agent/labels"),
        "nvidia.com/mig.config=all-1g.5gb\n",
    )
    .expect("labels");
    let smi = node.root.join("usr/bin/nvidia-smi");
    std::fs::create_dir_all(smi.parent().expect("bin")).expect("mkdir");
    let body = if works {
        format!(
            "#!/bin/sh\n[ \"$1\" = --gpu-reset ] && [ \"$2\" = -i ] || exit 2\necho \"$3\" >> \"{}/reset\"\necho \"$3\" >> \"{}/resets-done\"\n",
            node.state.display(),
            node.state.display()
        )
    } else {
        "#!/bin/sh\necho 'Unable to reset this GPU because it is in use' >&2\nexit 255\n".to_string()
    };
    std::fs::write(&smi, body).expect("nvidia-smi");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    node
}

#[test]
fn a_mode_change_that_needs_a_reset_resets_the_idle_gpu() {
    let node = reset_node("", true);
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let resets = std::fs::read_to_string(node.state.join("resets-done")).unwrap_or_default();
    assert_eq!(resets.trim(), gpu_uuid(0), "nvidia-smi --gpu-reset -i <uuid> ran once");
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(0));
}

#[test]
fn a_failed_reset_fails_or_reboots_once() {
    // Without reboot_on_mode_change: failed, with the reset's error.
    let node = reset_node("", false);
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(1));
    let mig = common::stage(&node.status_json(), "mig");
    assert_eq!(mig["state"], "failed");
    let error = mig["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("pending until the GPU is reset") && error.contains("in use"),
        "{error}"
    );

    // With it: rebooting (under --root the agent only reports it), and never twice for the
    // same layout.
    let node = reset_node("[mig]\nreboot_on_mode_change = true\n", false);
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(75), "rebooting: try again after the reboot");
    let status = node.status_json();
    assert_eq!(status["labels"]["nvidia.com/mig.config.state"], "rebooting");
    assert!(
        node.root.join("var/lib/gpu-node-agent/mig-reboot-requested").exists(),
        "reboot marker"
    );
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(1));
    let status = node.status_json();
    assert_eq!(status["labels"]["nvidia.com/mig.config.state"], "failed");
    let error = common::stage(&status, "mig")["error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("a reboot for this layout did not finish it"), "{error}");
}

#[test]
fn a_daemon_killed_in_the_middle_of_an_apply_converges_after_restart() {
    let config = "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n[device_plugin]\nmig_strategy = \"mixed\"\n";
    let node = Node::new(&two_a100s(), config);
    std::fs::write(
        node.root.join("etc/gpu-node-agent/labels"),
        "nvidia.com/mig.config=all-1g.5gb\n",
    )
    .expect("labels");
    // Every MIG operation takes 50 ms: the 28 of this layout take 1.4 s.
    let mut child = node
        .command(&["run"])
        .env("FAKE_NVML_MUTATION_DELAY_MS", "50")
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("agent");
    let state = node.state.join("state.json");
    let deadline = std::time::Instant::now() + T;
    // Wait until some, not all, GPU instances exist, then kill -9.
    loop {
        let text = std::fs::read_to_string(&state).unwrap_or_default();
        let created = text.matches("\"profile_id\"").count();
        if created >= 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the apply never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("kill -9");
    let _ = child.wait();
    assert_eq!(
        node.run(&["mig", "assert", "all-1g.5gb"]).status.code(),
        Some(1),
        "killed half way"
    );
    // The restarted agent converges from whatever was left.
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(0));
    assert_eq!(node.status_json()["labels"]["nvidia.com/mig.config.state"], "success");
}

const SHARED_LAYOUT: &str = "[[mig.layouts.shared]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 4, \"2c.3g.20gb\" = 1 }\n";

/// Compute instance forms name profiles NVML lists only inside a GPU instance. On a GPU with MIG
/// off and no instances, `plan` says so, and `mig apply` enables MIG (resetting the GPU where
/// the mode change needs it), reads them from a short-lived instance, and applies the layout.
#[test]
fn compute_instance_forms_apply_on_a_fresh_gpu() {
    let node = reset_node(SHARED_LAYOUT, true);
    let out = node.run(&["plan", "--mig-layout", "shared"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("not complete yet") && stdout.contains("\"1c.4g.20gb\"") && stdout.contains("4g.20gb GPU"),
        "{stdout}"
    );

    let out = node.run(&["mig", "apply", "shared"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let resets = std::fs::read_to_string(node.state.join("resets-done")).unwrap_or_default();
    assert_eq!(
        resets.trim(),
        gpu_uuid(0),
        "the mode change was finished with one reset"
    );
    let out = node.run(&["mig", "export"]);
    let exported = String::from_utf8_lossy(&out.stdout);
    assert!(
        exported.contains(r#"profiles = { "1c.4g.20gb" = 4, "2c.3g.20gb" = 1 }"#),
        "{exported}"
    );
    assert_eq!(node.run(&["mig", "assert", "shared"]).status.code(), Some(0));
    let out = node.run(&["mig", "apply", "shared"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to do"),
        "zero NVML mutations on re-apply"
    );
}

/// With no room left for a GPU instance to read compute instance profiles from, the apply
/// fails with the reason and leaves the GPU as it was.
#[test]
fn compute_instance_forms_without_room_to_read_them_fail_and_change_nothing() {
    let full = "[[mig.layouts.full]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 7 }\n\
                [[mig.layouts.mixed]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 2, \"1g.5gb\" = 3 }\n";
    let node = reset_node(full, true);
    assert_eq!(node.run(&["mig", "apply", "full"]).status.code(), Some(0));
    let out = node.run(&["mig", "apply", "mixed"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no room for a 4g.20gb GPU instance"), "{stderr}");
    assert_eq!(node.run(&["mig", "assert", "full"]).status.code(), Some(0), "unchanged");
}
