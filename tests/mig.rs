//! MIG layouts end to end: `nvidia.com/mig.config` on the Node (test API server), the real
//! binary applying it through the fake NVML, and what the test kubelet then sees.

mod common;

use std::time::Duration;

use common::{Node, gpu_uuid};
use gpu_node_agent::status::{StageId, StageState};
use test_apiserver::TestApiServer;
use test_kubelet::{KubeletOptions, TestKubelet};

const T: Duration = Duration::from_secs(15);
const NODE: &str = common::NODE_NAME;
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
    setup_with_strategy("mixed", extra).await
}

async fn setup_with_strategy(strategy: &str, extra: &str) -> (TestApiServer, Node, TestKubelet) {
    let config = format!("[device_plugin]\nmig_strategy = \"{strategy}\"\n{extra}");
    let node = Node::new(&two_a100s(), &config);
    let api = common::api_server_for(&node, &[]).await;
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    (api, node, kubelet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_label_is_applied_and_the_kubelet_sees_the_new_resources() {
    let (api, node, kubelet) = setup("").await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    common::wait_label(&api, STATE, Some("success"), T).await;
    let devices = kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("7 per GPU");
    assert!(
        devices
            .iter()
            .all(|d| d.id.starts_with("MIG-") && d.health == "Healthy")
    );
    common::wait_label(&api, "nvidia.com/mig-1g.5gb.count", Some("14"), T).await;
    let ok = api
        .wait_for(T, |a| a.events().iter().any(|e| e["reason"] == "MigConfigApplied"))
        .await;
    assert!(ok, "{:?}", api.events());
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Mig, StageState::Ok));
    assert!(
        common::stage_detail(&status, StageId::Mig)
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
    common::wait_label(&api, "nvidia.com/mig-2g.10gb.count", Some("2"), T).await;
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
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("applied");

    api.set_label(NODE, "nvidia.com/mig.config", Some("no-such-layout"));
    common::wait_label(&api, STATE, Some("failed"), T).await;
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Mig, StageState::Failed));
    let error = common::stage_error(&status, StageId::Mig)
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
    let failed = common::events_with(&api, "MigConfigFailed");
    assert_eq!(
        failed.last().map(|e| e["type"].clone()),
        Some("Warning".into()),
        "{failed:?}"
    );
    // A pass that fails the same way posts no second Event.
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "MigConfigFailed").len(),
        failed.len(),
        "{:?}",
        api.events()
    );
    // Nothing changed: the 1g.5gb devices are still there.
    let devices = kubelet.devices("nvidia.com/mig-1g.5gb").expect("still listed");
    assert_eq!(devices.len(), 14);
    let out = node.run(&["mig", "assert", "all-1g.5gb"]);
    assert_eq!(out.status.code(), Some(0), "the GPUs were not touched");
    assert_eq!(agent.stop(), 0);
}

/// The agent running with `all-1g.5gb` applied (14 MIG devices advertised), then a process on
/// GPU 0 and the label asking for `all-7g.40gb`, which changes both GPUs.
async fn all_1g_then_7g_under_gpu_work(extra: &str) -> (TestApiServer, Node, TestKubelet, common::Agent) {
    let (api, node, kubelet) = setup(extra).await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("applied");
    node.set_injection("processes", &format!("{} 4242 1024\n", gpu_uuid(0)));
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-7g.40gb"));
    (api, node, kubelet, agent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_work_keeps_the_layout_pending_until_it_ends() {
    let (api, node, kubelet, agent) = all_1g_then_7g_under_gpu_work("").await;
    common::wait_label(&api, STATE, Some("pending"), T).await;
    // `pending` while changing, then with the reason it waits.
    let status = node.wait_status(T, |s| {
        common::stage_is(s, StageId::Mig, StageState::Pending) && common::stage_error(s, StageId::Mig).is_some()
    });
    let reason = common::stage_error(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(
        reason.contains("waiting for GPU processes") && reason.contains(&gpu_uuid(0)),
        "{reason}"
    );
    // Posted with the reason it waits; a pass that still waits for the same reason posts
    // nothing more.
    let posted = api
        .wait_for(T, |a| {
            common::events_with(a, "MigConfigPending").iter().any(|e| {
                e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("waiting for GPU processes"))
            })
        })
        .await;
    assert!(posted, "{:?}", api.events());
    let pending = common::events_with(&api, "MigConfigPending");
    assert_eq!(pending[0]["type"], "Normal", "{pending:?}");
    common::another_pass(&agent).await;
    assert_eq!(
        common::events_with(&api, "MigConfigPending").len(),
        pending.len(),
        "{:?}",
        api.events()
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
    common::wait_label(&api, STATE, Some("success"), T).await;
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
    node.write_labels("nvidia.com/mig.config=all-3g.20gb\n");
    // GPU work on GPU 1: the layout cannot be applied, and --once says so with exit 75 (try
    // again later).
    node.set_injection("processes", &format!("{} 77 512\n", gpu_uuid(1)));
    node.run_once(75);
    assert_eq!(common::stage(&node.status(), StageId::Mig).state, StageState::Pending);
    // Without it: applied before the kubelet ever sees a device, exit 0.
    node.set_injection("processes", "");
    node.run_once(0);
    let status = node.status();
    assert_eq!(common::stage(&status, StageId::Mig).state, StageState::Ok);
    assert_eq!(common::label(&status, "nvidia.com/mig.config.state"), Some("success"));
    assert_eq!(node.run(&["mig", "assert", "all-3g.20gb"]).status.code(), Some(0));
}

/// One A100 with MIG off whose mode changes need a GPU reset, and a fake `nvidia-smi` under the
/// root that performs the reset through the fake NVML's `reset` file (or fails, if `works` is
/// false).
fn reset_node(extra: &str, works: bool) -> Node {
    let config =
        format!("[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{extra}");
    reset_node_with(&config, works)
}

fn reset_node_with(config: &str, works: bool) -> Node {
    let machine = format!(
        "{}\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_reset_required = true\n",
        common::DGX_A100,
        gpu_uuid(0)
    );
    let node = Node::new(&machine, config);
    node.write_labels("nvidia.com/mig.config=all-1g.5gb\n");
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
    node.run_once(0);
    let resets = std::fs::read_to_string(node.state.join("resets-done")).unwrap_or_default();
    assert_eq!(resets.trim(), gpu_uuid(0), "nvidia-smi --gpu-reset -i <uuid> ran once");
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(0));
}

#[test]
fn a_failed_reset_fails_or_reboots_once() {
    // Without reboot_on_mode_change: failed, with the reset's error.
    let node = reset_node("", false);
    node.run_once(1);
    let status = node.status();
    let mig = common::stage(&status, StageId::Mig);
    assert_eq!(mig.state, StageState::Failed);
    let error = mig.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("pending until the GPU is reset") && error.contains("in use"),
        "{error}"
    );

    // With it: rebooting (under --root the agent only reports it), and never twice for the
    // same layout.
    let node = reset_node("[mig]\nreboot_on_mode_change = true\n", false);
    let out = node.run(&["run", "--once"]);
    assert_eq!(out.status.code(), Some(75), "rebooting: try again after the reboot");
    let status = node.status();
    assert_eq!(common::label(&status, "nvidia.com/mig.config.state"), Some("rebooting"));
    assert!(
        node.root.join("var/lib/gpu-node-agent/mig-reboot-requested").exists(),
        "reboot marker"
    );
    node.run_once(1);
    let status = node.status();
    assert_eq!(common::label(&status, "nvidia.com/mig.config.state"), Some("failed"));
    let error = common::stage_error(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(error.contains("a reboot for this layout did not finish it"), "{error}");
}

#[test]
fn a_daemon_killed_in_the_middle_of_an_apply_converges_after_restart() {
    let config = "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n[device_plugin]\nmig_strategy = \"mixed\"\n";
    let node = Node::new(&two_a100s(), config);
    node.write_labels("nvidia.com/mig.config=all-1g.5gb\n");
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
    node.run_once(0);
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(0));
    assert_eq!(
        common::label(&node.status(), "nvidia.com/mig.config.state"),
        Some("success")
    );
}

const SHARED_LAYOUT: &str = "[[mig.layouts.shared]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 4, \"2c.3g.20gb\" = 1 }\n";

/// Compute instance forms name profiles NVML lists only inside a GPU instance. On a GPU with MIG
/// off and no instances, `plan` says so, and `mig apply` enables MIG (resetting the GPU where
/// the mode change needs it), reads them from a short-lived instance, and applies the layout.
#[test]
fn compute_instance_forms_apply_on_a_fresh_gpu() {
    let node = reset_node(SHARED_LAYOUT, true);
    plan_says(&node, "shared", &["not complete yet", "\"1c.4g.20gb\"", "4g.20gb GPU"]);

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

/// With no room left for a GPU instance to read compute instance profiles from, the GPU's
/// instances (which the layout replaces anyway) are destroyed first, and the layout applies.
#[test]
fn compute_instance_forms_on_a_full_gpu_make_room_to_read_them() {
    let full = "[[mig.layouts.full]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 7 }\n\
                [[mig.layouts.mixed]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 2, \"1g.5gb\" = 3 }\n";
    let node = reset_node(full, true);
    assert_eq!(node.run(&["mig", "apply", "full"]).status.code(), Some(0));
    let out = node.run(&["mig", "apply", "mixed"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node.run(&["mig", "assert", "mixed"]).status.code(), Some(0));
}

/// An H100-80GB with MIG on and one full-GPU instance (7g.80gb).
fn full_h100(layouts: &str) -> Node {
    let machine = format!(
        "{}\n[[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\nmig_mode = true\n[[gpu.mig_device]]\nprofile = \"7g.80gb\"\n",
        common::DGX_A100,
        gpu_uuid(0)
    );
    let config = format!(
        "[kubernetes]\nenabled = false\n\
         [[mig.layouts.full]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = {{ \"7g.80gb\" = 1 }}\n{layouts}"
    );
    Node::new(&machine, &config)
}

/// Issue 17: a compute instance layout on a full GPU. `plan` says it applies after destroying the
/// full-GPU instance to make room for reading the compute instance profiles, and `mig apply`
/// does exactly that (before, `plan` said it would apply and the apply failed for want of room).
#[test]
fn plan_and_apply_agree_on_a_compute_instance_layout_for_a_full_gpu() {
    let node = full_h100(
        "[[mig.layouts.ci]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.40gb\" = 1, \"3g.40gb\" = 1 }\n",
    );
    assert_eq!(node.run(&["mig", "assert", "full"]).status.code(), Some(0));
    plan_says(
        &node,
        "ci",
        &[
            "not complete yet",
            "\"1c.4g.40gb\"",
            "no room for one: its 1 GPU instance(s) are destroyed first",
            "made again if it then fails",
        ],
    );

    let out = node.run(&["mig", "apply", "ci"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run(&["mig", "export"]);
    let exported = String::from_utf8_lossy(&out.stdout);
    assert!(
        exported.contains(r#"profiles = { "1c.4g.40gb" = 1, "3g.40gb" = 1 }"#),
        "{exported}"
    );
    let out = node.run(&["mig", "apply", "ci"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to do"),
        "zero NVML mutations on re-apply"
    );
}

/// When the layout fails once the compute instance profiles are read, the GPU instances destroyed
/// to make room are made again, and the failure says so.
#[test]
fn a_compute_instance_layout_failing_after_making_room_restores_the_gpu_instances() {
    let node =
        full_h100("[[mig.layouts.no-3c]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"3c.4g.40gb\" = 1 }\n");
    let stderr = fails_with(
        &node,
        &["mig", "apply", "no-3c"],
        &["3c.4g.40gb", "destroyed to make room", "made again"],
    );
    assert!(!stderr.contains("nothing changed"), "{stderr}");
    assert_eq!(
        node.run(&["mig", "assert", "full"]).status.code(),
        Some(0),
        "the 7g.80gb instance is back"
    );
}

/// Two A100-40GB with MIG off, no reset needed, and `layouts` in the config.
fn mig_off_node(machine_extra: &str, layouts: &str) -> Node {
    let mut machine = common::machine("A100-SXM4-40GB", 2);
    machine.push_str(machine_extra);
    let config = format!("[kubernetes]\nenabled = false\n{layouts}");
    Node::new(&machine, &config)
}

fn fails_with(node: &Node, args: &[&str], wanted: &[&str]) -> String {
    let out = node.run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    for w in wanted {
        assert!(stderr.contains(w), "{args:?}: {w:?} not in {stderr}");
    }
    stderr
}

fn mig_is_off_everywhere(node: &Node) {
    let out = node.run(&["mig", "assert", "all-disabled"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "MIG mode must still be off: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A layout with a compute instance form is checked in full before anything changes: names,
/// counts and the GPU instances it needs, on every GPU, before MIG mode is enabled to read the
/// compute instance profiles.
#[test]
fn compute_instance_forms_are_checked_on_every_gpu_before_any_change() {
    let layouts = "[[mig.layouts.too-many]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 1, \"1g.5gb\" = 8 }\n\
                   [[mig.layouts.two-4g]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 1, \"4g.20gb\" = 1 }\n\
                   [[mig.layouts.three-2c]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"2c.3g.20gb\" = 3 }\n\
                   [[mig.layouts.overlap]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 1, \"7g.40gb\" = 1 }\n\
                   [[mig.layouts.split]]\ndevices = [0]\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 1 }\n\
                   [[mig.layouts.split]]\ndevices = [1]\nmig_enabled = true\nprofiles = { \"2g.20gb\" = 1 }\n";
    let node = mig_off_node("", layouts);
    fails_with(
        &node,
        &["mig", "apply", "too-many"],
        &["does not fit", "1g.5gb", "nothing changed"],
    );
    mig_is_off_everywhere(&node);
    fails_with(
        &node,
        &["mig", "apply", "two-4g"],
        &["does not fit", "4g.20gb", "nothing changed"],
    );
    fails_with(
        &node,
        &["mig", "apply", "three-2c"],
        &["does not fit", "3g.20gb", "nothing changed"],
    );
    fails_with(
        &node,
        &["mig", "apply", "overlap"],
        &["does not fit", "nothing changed"],
    );
    mig_is_off_everywhere(&node);
    // Valid on GPU 0, an unknown profile on GPU 1: GPU 0 is not touched either.
    fails_with(
        &node,
        &["mig", "apply", "split"],
        &["GPU 1", &gpu_uuid(1), "no MIG profile \"2g.20gb\"", "nothing changed"],
    );
    mig_is_off_everywhere(&node);
    // The label path says the same, and changes nothing.
    node.write_labels("nvidia.com/mig.config=split\n");
    node.write_config(&format!(
        "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{layouts}"
    ));
    node.run_once(1);
    let status = node.status();
    let mig = common::stage(&status, StageId::Mig);
    let error = mig.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("2g.20gb") && error.contains("nothing changed"),
        "{error}"
    );
    mig_is_off_everywhere(&node);
}

/// A layout whose GPU instances fit, but whose compute instance profile turns out not to exist
/// once NVML lists them: the MIG mode enabled to read them is disabled again, and the failure
/// says so.
#[test]
fn a_layout_failing_after_reading_compute_instance_profiles_undoes_the_mode_change() {
    let layouts = "[[mig.layouts.no-3c]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"3c.4g.20gb\" = 1 }\n";
    let node = mig_off_node("", layouts);
    let stderr = fails_with(&node, &["mig", "apply", "no-3c"], &["3c.4g.20gb", "disabled again"]);
    assert!(!stderr.contains("nothing changed"), "{stderr}");
    mig_is_off_everywhere(&node);

    // Where mode changes need a GPU reset, the undo is finished with one too.
    let node = reset_node(layouts, true);
    let stderr = fails_with(&node, &["mig", "apply", "no-3c"], &["3c.4g.20gb", "disabled again"]);
    assert!(!stderr.contains("nothing changed"), "{stderr}");
    let resets = std::fs::read_to_string(node.state.join("resets-done")).unwrap_or_default();
    assert_eq!(
        resets.lines().count(),
        2,
        "enable and disable each reset once: {resets}"
    );
    assert_eq!(node.run(&["mig", "assert", "all-disabled"]).status.code(), Some(0));
}

/// `n` H100-80GB with MIG off on a driver that lists no GPU instance profiles while MIG is off
/// (R535 class; `profiles_need_mig` in the fake), and `layouts` in the config.
fn r535_node(n: u32, layouts: &str) -> Node {
    let machine = format!("profiles_need_mig = true\n{}", common::machine("H100-80GB-HBM3", n));
    Node::new(&machine, &format!("[kubernetes]\nenabled = false\n{layouts}"))
}

/// On such a driver a built-in layout is planned from the profiles read by enabling MIG mode on
/// each GPU (`plan` says so), applies with the counts of the GPU's own table, and re-applies
/// with zero operations.
#[test]
fn r535_built_in_layouts_read_the_profiles_by_enabling_mig() {
    let node = r535_node(2, "");
    plan_says(
        &node,
        "all-1g.10gb",
        &[
            "not complete yet",
            "NVML lists no GPU instance profiles while MIG mode is off",
            "applying enables MIG mode on GPU 0 to read them",
            "applying enables MIG mode on GPU 1 to read them",
        ],
    );
    mig_is_off_everywhere(&node);

    let out = node.run(&["mig", "apply", "all-1g.10gb"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run(&["mig", "export"]);
    let exported = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        exported.matches(r#"profiles = { "1g.10gb" = 7 }"#).count(),
        2,
        "seven 1g.10gb on each GPU: {exported}"
    );
    let out = node.run(&["mig", "apply", "all-1g.10gb"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("nothing to do") && !stdout.contains("NVML operation"),
        "zero NVML mutations on re-apply: {stdout}"
    );
    // A layout that wants MIG disabled needs no profiles.
    let out = node.run(&["mig", "apply", "all-disabled"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    mig_is_off_everywhere(&node);
}

/// A layout that fails once the profiles are read (an H100 has no 1g.5gb) leaves MIG mode
/// disabled again, and says so.
#[test]
fn r535_a_layout_failing_after_the_read_leaves_mig_disabled() {
    let node = r535_node(
        2,
        "[[mig.layouts.a100-names]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 2 }\n",
    );
    let stderr = fails_with(
        &node,
        &["mig", "apply", "a100-names"],
        &[
            "no MIG profile \"1g.5gb\"",
            "to read its GPU instance profiles and was disabled again",
        ],
    );
    assert!(!stderr.contains("nothing changed"), "{stderr}");
    mig_is_off_everywhere(&node);
}

/// A GPU the Operator's table says a built-in layout covers, whose own profiles (read by enabling
/// MIG mode) lack the layout's profile: MIG mode is disabled again there, and the layout applies
/// on the other GPU. (The fake's A100-PCIE-80GB lists no 1g.20gb; the Operator's file gives it
/// `all-1g.20gb`.)
#[test]
fn r535_a_gpu_the_layout_turns_out_not_to_cover_gets_mig_disabled_again() {
    let machine = format!(
        "profiles_need_mig = true\n{}\n[[gpu]]\nmodel = \"A100-PCIE-80GB\"\nuuid = \"{}\"\n\
         [[gpu]]\nmodel = \"H100-80GB-HBM3\"\nuuid = \"{}\"\n",
        common::DGX_A100,
        gpu_uuid(0),
        gpu_uuid(1)
    );
    let node = Node::new(&machine, "[kubernetes]\nenabled = false\n");
    let out = node.run(&["mig", "apply", "all-1g.20gb"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run(&["mig", "export"]);
    let exported = String::from_utf8_lossy(&out.stdout);
    assert!(
        exported.contains("devices = [0]\nmig_enabled = false")
            && exported.contains("devices = [1]\nmig_enabled = true\nprofiles = { \"1g.20gb\" = 4 }"),
        "{exported}"
    );
    // A new process applying again reads GPU 0's profiles again (the daemon remembers them
    // only for its own NVML session, see tests/mig_profiles_memory.rs: its MIG mode is enabled
    // and disabled once more), and leaves the same state.
    let out = node.run(&["mig", "apply", "all-1g.20gb"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run(&["mig", "export"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), exported);
}

/// Without the driver quirk nothing is read first: `plan` gives the whole plan at once.
#[test]
fn without_the_r535_quirk_the_plan_is_complete_at_once() {
    let node = Node::new(&common::machine("H100-80GB-HBM3", 2), "[kubernetes]\nenabled = false\n");
    let stdout = plan_says(
        &node,
        "all-1g.10gb",
        &["MIG plan for layout all-1g.10gb (30 NVML operations)"],
    );
    assert!(!stdout.contains("not complete"), "{stdout}");
}

/// A compute instance layout whose GPU instances cannot fit never gets as far as a mode change,
/// so it never asks for a reboot.
#[test]
fn an_impossible_compute_instance_layout_never_reboots() {
    let extra = "[mig]\nreboot_on_mode_change = true\n\
                 [[mig.layouts.too-many]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 1, \"1g.5gb\" = 8 }\n";
    let node = reset_node(extra, false);
    node.write_labels("nvidia.com/mig.config=too-many\n");
    node.run_once(1);
    let status = node.status();
    assert_eq!(common::label(&status, "nvidia.com/mig.config.state"), Some("failed"));
    let error = common::stage_error(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("does not fit") && error.contains("nothing changed"),
        "{error}"
    );
    assert!(
        !node.root.join("var/lib/gpu-node-agent/mig-reboot-requested").exists(),
        "no reboot marker"
    );
    assert_eq!(node.run(&["mig", "assert", "all-disabled"]).status.code(), Some(0));
}

/// Under `[mig] uncovered_gpus = "fail"` a MIG GPU no entry covers fails the layout before
/// anything changes, by every path.
#[test]
fn a_mig_gpu_the_layout_does_not_cover_fails_it_before_any_change_when_strict() {
    let layouts = "[mig]\nuncovered_gpus = \"fail\"\n\
                   [[mig.layouts.only-0]]\ndevices = [0]\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 7 }\n";
    let node = mig_off_node("", layouts);
    let uuid1 = gpu_uuid(1);
    let wanted = [
        "layout only-0",
        "no entry for GPU 1",
        uuid1.as_str(),
        "0x20B0",
        "uncovered_gpus",
        "nothing changed",
    ];
    fails_with(&node, &["mig", "apply", "only-0"], &wanted);
    mig_is_off_everywhere(&node);
    fails_with(
        &node,
        &["mig", "assert", "only-0"],
        &["no entry for GPU 1", uuid1.as_str(), "0x20B0"],
    );
    let out = node.run(&["plan", "--mig-layout", "only-0"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    mig_is_off_everywhere(&node);

    // The label path fails the same way.
    node.write_labels("nvidia.com/mig.config=only-0\n");
    node.write_config(&format!(
        "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{layouts}"
    ));
    node.run_once(1);
    let status = node.status();
    assert_eq!(common::label(&status, "nvidia.com/mig.config.state"), Some("failed"));
    let error = common::stage_error(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(
        error.contains("only-0") && error.contains("no entry for GPU 1") && error.contains(&uuid1),
        "{error}"
    );
    mig_is_off_everywhere(&node);
}

/// By default a MIG GPU no entry covers is left as it is and the layout succeeds, as under
/// mig-manager (the Operator's `custom-mig` example names GPUs 0–3 of an 8-GPU node); a
/// built-in layout whose profile no GPU of the node has fails, naming what the GPUs have.
#[test]
fn a_mig_gpu_the_layout_does_not_cover_is_left_as_it_is() {
    let layouts = "[[mig.layouts.only-0]]\ndevices = [0]\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 7 }\n";
    let node = mig_off_node("", layouts);
    let out = node.run(&["mig", "apply", "only-0"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node.run(&["mig", "assert", "only-0"]).status.code(), Some(0));
    let listed = String::from_utf8_lossy(&node.run(&["mig", "export"]).stdout).to_string();
    assert!(
        listed.contains("devices = [1]\nmig_enabled = false"),
        "GPU 1 untouched:\n{listed}"
    );

    fails_with(
        &node,
        &["mig", "apply", "all-3g.40gb"],
        &[
            "layout all-3g.40gb",
            "no GPU of this node has the profile 3g.40gb",
            "GPU 0 has 1g.5gb",
            "nothing changed",
        ],
    );
}

/// mig-parted skips a GPU without MIG under `devices: all`; naming it explicitly with MIG on is
/// an error that names it. Not covered at all, it is ignored.
#[test]
fn a_gpu_without_mig_is_skipped_by_devices_all() {
    let t4 = "\n[[gpu]]\nmodel = \"T4\"\nuuid = \"GPU-5a4b9c3e-0f1d-4e2a-8b7c-6d5e4f3a2b1c\"\n";
    let layouts = "[[mig.layouts.t4-on]]\ndevices = [0, 1]\nmig_enabled = true\nprofiles = {}\n\
                   [[mig.layouts.t4-on]]\ndevices = [2]\nmig_enabled = true\nprofiles = {}\n\
                   [[mig.layouts.t4-off]]\ndevices = [0, 1]\nmig_enabled = true\nprofiles = {}\n\
                   [[mig.layouts.t4-off]]\ndevices = [2]\nmig_enabled = false\n\
                   [[mig.layouts.a100s]]\ndevices = [0, 1]\nmig_enabled = true\nprofiles = { \"3g.20gb\" = 2 }\n";
    let node = mig_off_node(t4, layouts);
    let out = node.run(&["mig", "apply", "all-enabled"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node.run(&["mig", "assert", "all-enabled"]).status.code(), Some(0));
    fails_with(
        &node,
        &["mig", "apply", "t4-on"],
        &[
            "GPU 2",
            "GPU-5a4b9c3e-0f1d-4e2a-8b7c-6d5e4f3a2b1c",
            "does not support MIG",
        ],
    );
    let out = node.run(&["mig", "apply", "t4-off"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = node.run(&["mig", "apply", "a100s"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(node.run(&["mig", "assert", "a100s"]).status.code(), Some(0));
    let out = node.run(&["mig", "apply", "all-disabled"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A layout that waited for GPU work past `[mig] process_wait_timeout` fails and gives the GPUs
/// back to the kubelet, and stays that way (no withdraw/pending cycle) until the work ends;
/// then it is applied without anyone touching the label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_given_up_on_stays_failed_until_the_work_ends_then_applies() {
    let (api, node, kubelet, agent) = all_1g_then_7g_under_gpu_work("[mig]\nprocess_wait_timeout = \"1s\"\n").await;
    common::wait_label(&api, STATE, Some("failed"), T).await;
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Mig, StageState::Failed));
    let reason = common::stage_error(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(reason.contains("gave up after 1s"), "{reason}");
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("advertised again");
    // Longer than the gave-up recheck (10 s) and several resyncs: no state PATCH arrives (by
    // arrival time: a log entry is added after its answer, so the log's order can differ).
    let since = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let flips: Vec<String> = api
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.at >= since && r.body.contains(STATE))
        .map(|r| r.body.clone())
        .collect();
    assert!(flips.is_empty(), "the state label did not move: {flips:?}");
    assert_eq!(api.labels(NODE).get(STATE).map(String::as_str), Some("failed"));

    // The work ends: applied without a label change.
    node.set_injection("processes", "");
    let within = Duration::from_secs(30);
    assert!(
        api.wait_for(within, |a| a.labels(NODE).get(STATE).map(String::as_str)
            == Some("success"))
            .await,
        "{:?}",
        api.labels(NODE)
    );
    kubelet
        .wait_for_devices("nvidia.com/mig-7g.40gb", T, |d| d.len() == 2)
        .await
        .expect("7g on both");
    assert_eq!(agent.stop(), 0);
}

/// While a layout is being applied the Node says `pending`, then `success` (a script waiting
/// for `success` never sees the previous layout's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_is_pending_while_a_layout_is_applied() {
    let (api, node, _kubelet) = setup("").await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    common::wait_label(&api, STATE, Some("success"), T).await;
    // The state PATCHes of the new layout, in the order they arrived (the log's own order can
    // differ: an entry is added after its answer).
    let asked = std::time::Instant::now();
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-3g.20gb"));
    let states = |a: &TestApiServer| -> Vec<&'static str> {
        let mut patches: Vec<(std::time::Instant, &'static str)> = a
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH" && r.at >= asked)
            .filter_map(|r| {
                ["pending", "success"]
                    .into_iter()
                    .find(|s| r.body.contains(&format!("\"{STATE}\":\"{s}\"")))
                    .map(|s| (r.at, s))
            })
            .collect();
        patches.sort();
        patches.into_iter().map(|(_, s)| s).collect()
    };
    assert!(api.wait_for(T, |a| states(a).len() >= 2).await, "{:?}", states(&api));
    let states = states(&api);
    assert_eq!(states, ["pending", "success"], "{}", agent.log_text());
    assert_eq!(agent.stop(), 0);
}

/// `[mig] default_layout` is what a node without the label gets: a bootstrap applies it with
/// `run --once` before the node has joined.
#[test]
fn the_default_layout_applies_without_a_label() {
    let node = Node::new(
        &two_a100s(),
        "[kubernetes]\nenabled = false\n[mig]\ndefault_layout = \"all-3g.20gb\"\n",
    );
    node.run_once(0);
    assert_eq!(common::label(&node.status(), STATE), Some("success"));
    assert_eq!(node.run(&["mig", "assert", "all-3g.20gb"]).status.code(), Some(0));
    // A name that is not a layout is a config error (`all-<profile>` is one for any profile
    // name: whether the GPUs have it is known only on the node).
    let bad = Node::new(&two_a100s(), "[mig]\ndefault_layout = \"all-9g\"\n");
    let out = bad.run(&["config", "check"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(
        err.contains("mig.default_layout") && err.contains("names no MIG layout"),
        "{err}"
    );
}

/// Before rebooting for a MIG mode change, `rebooting` reaches the Node, even at the first pass
/// after boot (before the device plugin has read the inventory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebooting_reaches_the_node_before_the_reboot() {
    let node = reset_node_with("[mig]\nreboot_on_mode_change = true\n", false);
    let api = common::api_server_for(&node, &[("nvidia.com/mig.config", "all-1g.5gb")]).await;
    let out = tokio::task::spawn_blocking(move || node.run(&["run", "--once"]))
        .await
        .expect("run");
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stderr));
    let rebooting = api
        .requests()
        .iter()
        .any(|r| r.method == "PATCH" && r.body.contains(&format!("\"{STATE}\":\"rebooting\"")));
    assert!(rebooting, "{:?}", api.labels(NODE));
    let event = common::event_posted(&api, "MigConfigRebooting").await;
    assert_eq!(event["type"], "Warning", "{event}");
}

/// Layouts do not survive a reboot, and at boot the API server may not answer yet: the agent
/// re-applies the layout the Node asked for last (kept in its state dir) instead of advertising
/// the bare GPUs, and follows the Node again once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_boot_without_the_api_server_the_last_layout_is_applied_again() {
    let (api, node, kubelet) = setup("").await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    common::wait_label(&api, STATE, Some("success"), T).await;
    assert_eq!(agent.stop(), 0);

    // "Reboot": the MIG devices are gone, and the API server does not answer.
    let out = node.run(&["mig", "apply", "all-enabled"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    api.set_down(true);
    let agent = node.spawn();
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .unwrap_or_else(|e| panic!("{e:?}: {}", agent.log_text()));
    assert!(agent.log_text().contains("starting with what it asked for last"));
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(0));
    api.set_down(false);
    assert_eq!(agent.stop(), 0);
}

/// Under `mig_strategy = "single"` a layout's MIG devices are advertised as `nvidia.com/gpu`, and
/// the feature labels say what they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_single_strategy_a_layout_is_advertised_as_nvidia_com_gpu() {
    let (api, node, kubelet) = setup_with_strategy("single", "").await;
    let agent = node.spawn();
    common::wait_label(&api, "nvidia.com/gpu.present", Some("true"), T).await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-3g.20gb"));
    common::wait_label(&api, STATE, Some("success"), T).await;
    kubelet
        .wait_for_devices("nvidia.com/gpu", T, |d| {
            d.len() == 4 && d.iter().all(|d| d.id.starts_with("MIG-"))
        })
        .await
        .expect("2 × 3g.20gb per GPU as nvidia.com/gpu");
    common::wait_label(&api, "nvidia.com/mig.strategy", Some("single"), T).await;
    common::wait_label(
        &api,
        "nvidia.com/gpu.product",
        Some("NVIDIA-A100-SXM4-40GB-MIG-3g.20gb"),
        T,
    )
    .await;
    assert_eq!(agent.stop(), 0);
}

/// At start, with the layout already on the Node (a reboot), `pending` reaches the Node before
/// the change although the device plugin has not read the inventory yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_start_pending_reaches_the_node_before_the_layout_is_applied() {
    let (api, node, kubelet) = setup("").await;
    api.set_label(NODE, "nvidia.com/mig.config", Some("all-1g.5gb"));
    let agent = node.spawn();
    kubelet
        .wait_for_devices("nvidia.com/mig-1g.5gb", T, |d| d.len() == 14)
        .await
        .expect("applied");
    common::wait_label(&api, STATE, Some("success"), T).await;
    let pending = format!("\"{STATE}\":\"pending\"");
    assert!(
        api.requests()
            .iter()
            .any(|r| r.method == "PATCH" && r.body.contains(&pending)),
        "{:?}",
        api.requests().iter().map(|r| &r.body).collect::<Vec<_>>()
    );
    assert!(
        !agent.log_text().contains("did not show on the Node"),
        "{}",
        agent.log_text()
    );
    assert_eq!(agent.stop(), 0);
}

/// GPU 0 with MIG on and a layout of seven 1g.5gb for it alone; GPU 1 without MIG, left as it
/// is: the layout is applied (slowly, `FAKE_NVML_MUTATION_DELAY_MS`) from the labels file.
fn slow_layout_node() -> Node {
    let mut machine = common::DGX_A100.to_string();
    machine.push_str(&format!(
        "\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_mode = true\n\
         \n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\n",
        gpu_uuid(0),
        gpu_uuid(1)
    ));
    let config = "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n\
                  [device_plugin]\nmig_strategy = \"mixed\"\n\
                  [[mig.layouts.only-0]]\ndevices = [0]\nmig_enabled = true\nprofiles = { \"1g.5gb\" = 7 }\n\
                  [[mig.layouts.only-0]]\ndevices = [1]\nmig_enabled = false\n";
    let node = Node::new(&machine, config);
    node.write_labels("nvidia.com/mig.config=only-0\n");
    node
}

/// How many GPU instances the fake NVML holds now.
fn gpu_instances(node: &Node) -> usize {
    std::fs::read_to_string(node.state.join("state.json"))
        .unwrap_or_default()
        .matches("\"profile_id\"")
        .count()
}

/// SIGTERM in the middle of a MIG apply stops the agent within a second (between two NVML
/// operations, not after the 14 of the layout), and the next start converges from what it left.
#[test]
fn sigterm_during_a_slow_mig_apply_stops_within_a_second_and_the_next_start_converges() {
    let node = slow_layout_node();
    let agent = node.spawn_with_env(&[("FAKE_NVML_MUTATION_DELAY_MS", "300")]);
    let deadline = std::time::Instant::now() + T;
    while gpu_instances(&node) < 2 {
        assert!(std::time::Instant::now() < deadline, "the apply never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (code, took) = agent.stop_timed();
    assert_eq!(code, 0);
    assert!(took < Duration::from_secs(1), "SIGTERM took {took:?}");
    assert!(gpu_instances(&node) < 7, "stopped half way, not finished");
    assert_eq!(node.status().state, "stopped");
    assert_eq!(
        node.run(&["mig", "assert", "only-0"]).status.code(),
        Some(1),
        "left half way"
    );
    node.run_once(0);
    assert_eq!(node.run(&["mig", "assert", "only-0"]).status.code(), Some(0));
}

/// An Xid on a GPU the layout leaves alone reaches the kubelet while the MIG apply still runs:
/// health does not wait for a stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_during_a_slow_mig_apply_reaches_the_kubelet_before_the_apply_ends() {
    let node = slow_layout_node();
    let labels = node.root.join("etc/gpu-node-agent/labels");
    std::fs::write(&labels, "").expect("no layout yet");
    let kubelet = TestKubelet::start(&node.plugin_dir(), KubeletOptions::default())
        .await
        .expect("kubelet");
    let agent = node.spawn_with_env(&[("FAKE_NVML_MUTATION_DELAY_MS", "300")]);
    kubelet
        .wait_for_devices("nvidia.com/gpu", T, |d| common::healthy(d, &gpu_uuid(1)) == Some(true))
        .await
        .expect("GPU 1 advertised");
    std::fs::write(&labels, "nvidia.com/mig.config=only-0\n").expect("layout");
    let deadline = std::time::Instant::now() + T;
    while gpu_instances(&node) < 1 {
        assert!(std::time::Instant::now() < deadline, "the apply never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let injected = std::time::Instant::now();
    node.inject("xid", &format!("{} 79", gpu_uuid(1)));
    kubelet
        .wait_for_devices("nvidia.com/gpu", T, |d| common::healthy(d, &gpu_uuid(1)) == Some(false))
        .await
        .expect("GPU 1 unhealthy");
    let arrived = kubelet
        .updates("nvidia.com/gpu")
        .into_iter()
        .find(|(at, d)| *at >= injected && common::healthy(d, &gpu_uuid(1)) == Some(false))
        .map(|(at, _)| at)
        .expect("the update");
    eprintln!("Xid to kubelet during a MIG apply: {:?}", arrived - injected);
    assert!(
        gpu_instances(&node) < 7,
        "the update came before the apply ended ({} GPU instances now)",
        gpu_instances(&node)
    );
    let status = node.wait_status(T, |s| common::stage_is(s, StageId::Mig, StageState::Ok));
    assert_eq!(common::label(&status, STATE), Some("success"));
    assert_eq!(agent.stop(), 0);
}

/// `plan` is the daemon's plan: on a node whose labels ask for a MIG layout and a sharing
/// profile, `plan --json` lists the NVML operations, the resources with their replicas and the
/// labels, and `run --once` then does exactly that.
#[test]
fn plan_lists_exactly_what_run_once_then_does() {
    let config = "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n\
                  [device_plugin]\nmig_strategy = \"mixed\"\n\
                  [device_plugin.profiles.share.sharing]\nstrategy = \"time-slicing\"\nrename_by_default = true\n\
                  compact = [\"mig-1g.5gb::4\"]\n";
    let node = Node::new(&two_a100s(), config);
    node.write_labels("nvidia.com/mig.config=all-1g.5gb\nnvidia.com/device-plugin.config=share\n");
    let out = node.run(&["plan", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json");
    assert_eq!(plan["desired"]["device_plugin_profile"], "share");
    assert_eq!(plan["mig"]["layout"], "all-1g.5gb");
    let operations = plan["mig"]["operations"].as_u64().expect("operations");
    assert_eq!(operations, 28, "{}", plan["mig"]);
    let resources: Vec<String> = plan["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| format!("{} ×{}", r["name"].as_str().unwrap_or_default(), r["count"]))
        .collect();
    assert_eq!(resources, ["nvidia.com/mig-1g.5gb.shared ×56"]);
    assert_eq!(plan["cdi"]["write"], true);
    assert!(plan["driver"].is_object() && plan["runtime"].is_object(), "{plan}");
    let text = String::from_utf8_lossy(&node.run(&["plan"]).stdout).into_owned();
    assert!(
        text.contains("MIG plan for layout all-1g.5gb (28 NVML operations):"),
        "{text}"
    );
    assert!(!node.status_path().exists(), "plan changes nothing");
    assert_eq!(node.run(&["mig", "assert", "all-1g.5gb"]).status.code(), Some(1));

    node.run_once(0);
    let status = node.status();
    let mig = common::stage_detail(&status, StageId::Mig)
        .unwrap_or_default()
        .to_string();
    assert!(mig.contains(&format!("({operations} NVML operations)")), "{mig:?}");
    let advertised = common::stage_detail(&status, StageId::DevicePlugin)
        .unwrap_or_default()
        .to_string();
    assert!(
        advertised.ends_with(&format!("would advertise {}", resources.join(", "))),
        "{advertised}"
    );
    // Every label the plan listed is written with that value.
    for (key, value) in plan["labels"].as_object().expect("labels") {
        let written = common::label(&status, key).map_or(serde_json::Value::Null, serde_json::Value::from);
        assert_eq!(&written, value, "label {key}");
    }
    // Planned again: nothing left to do, and the same resources.
    let again: serde_json::Value = serde_json::from_slice(&node.run(&["plan", "--json"]).stdout).expect("plan");
    assert_eq!(again["mig"]["operations"], 0);
    assert_eq!(again["resources"][0]["count"], 56);
    assert_eq!(again["cdi"]["write"], false);
}

/// The driver's character majors as a host shows them in `/proc/devices` (not 195 for the caps
/// and uvm classes: those are dynamic).
const PROC_DEVICES: &str = "Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n226 drm\n\
                            237 nvidia-caps\n238 nvidia-uvm\n\nBlock devices:\n  7 loop\n";

/// What is at `path`: `(major, minor, mode)` of a character device, `None` for anything else.
fn char_device(path: &std::path::Path) -> Option<(u64, u64, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(path).ok()?;
    meta.file_type().is_char_device().then(|| {
        let rdev = meta.rdev();
        (
            nix::sys::stat::major(rdev),
            nix::sys::stat::minor(rdev),
            meta.permissions().mode() & 0o7777,
        )
    })
}

/// Every `deviceNodes` host path of a CDI spec.
fn spec_device_nodes(spec: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
    match spec {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                if key == "deviceNodes" {
                    for node in value.as_array().into_iter().flatten() {
                        let path = node["hostPath"].as_str().or(node["path"].as_str());
                        out.extend(path.map(str::to_string));
                    }
                } else {
                    spec_device_nodes(value, out);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| spec_device_nodes(v, out)),
        _ => {}
    }
}

/// On a host without nvidia-modprobe, the agent makes the device nodes the loaded driver has
/// and /dev lacks: after a MIG layout is applied, every new MIG device's GPU- and compute-instance
/// capability nodes exist as character devices with the `nvidia-caps` major and the minors of
/// the driver's `mig-minors` table, so every node the CDI spec names exists. A path that holds
/// something else is reported and left as it is.
#[test]
fn after_a_mig_apply_the_new_devices_capability_nodes_exist() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test creates device nodes (mknod) and needs root (CI runs as root)"
    );
    let config = |layout: &str| format!("[kubernetes]\nenabled = false\n[mig]\ndefault_layout = \"{layout}\"\n");
    let node = Node::new(&two_a100s(), &config("all-3g.20gb"));
    std::fs::write(node.root.join("proc/devices"), PROC_DEVICES).expect("proc/devices");
    std::fs::create_dir_all(node.root.join("dev")).expect("mkdir /dev");
    // Someone else's file where GPU 1's node goes.
    std::fs::write(node.root.join("dev/nvidia1"), "not a device").expect("dev/nvidia1");
    let table = std::fs::read_to_string(node.root.join("proc/driver/nvidia-caps/mig-minors")).expect("mig-minors");
    let minors: std::collections::BTreeMap<&str, u64> = table
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(key, minor)| (key, minor.parse().expect("minor")))
        .collect();
    let dev = |path: &str| char_device(&node.root.join(path.trim_start_matches('/')));

    let mut layouts_seen = Vec::new();
    for layout in ["all-3g.20gb", "all-1g.5gb"] {
        node.write_config(&config(layout));
        let out = node.run(&["run", "--once"]);
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{log}");
        assert!(log.contains("created device node(s)"), "{log}");
        assert!(
            log.contains("/dev/nvidia1 is a regular file, not character device 195:1"),
            "{log}"
        );
        let status = node.status();
        let mut caps = 0;
        for (minor, gpu) in status.gpus.iter().enumerate() {
            let migs = &gpu.mig_devices;
            assert!(!migs.is_empty(), "{layout}: {gpu:?}");
            for mig in migs {
                let (gi, ci) = (mig.gi_id, mig.ci_id);
                for key in [
                    format!("gpu{minor}/gi{gi}/access"),
                    format!("gpu{minor}/gi{gi}/ci{ci}/access"),
                ] {
                    let n = minors[key.as_str()];
                    assert_eq!(
                        dev(&format!("/dev/nvidia-caps/nvidia-cap{n}")),
                        Some((237, n, 0o444)),
                        "{layout}: {key}"
                    );
                    caps += 1;
                }
            }
        }
        layouts_seen.push((layout, caps));
        // The driver-wide nodes, created at the first start.
        assert_eq!(dev("/dev/nvidiactl"), Some((195, 255, 0o666)));
        assert_eq!(dev("/dev/nvidia0"), Some((195, 0, 0o666)));
        assert_eq!(dev("/dev/nvidia-modeset"), Some((195, 254, 0o666)));
        assert_eq!(dev("/dev/nvidia-uvm"), Some((238, 0, 0o666)));
        assert_eq!(dev("/dev/nvidia-uvm-tools"), Some((238, 1, 0o666)));
        assert_eq!(dev("/dev/nvidia-caps/nvidia-cap1"), Some((237, 1, 0o400)), "MIG config");
        assert_eq!(
            dev("/dev/nvidia-caps/nvidia-cap2"),
            Some((237, 2, 0o444)),
            "MIG monitor"
        );
        // Left as it was.
        assert_eq!(
            std::fs::read_to_string(node.root.join("dev/nvidia1")).expect("dev/nvidia1"),
            "not a device"
        );
        // Every node the CDI spec names exists (but the one someone else holds).
        let spec = std::fs::read_to_string(node.root.join("var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"))
            .expect("CDI spec");
        let spec: serde_json::Value = serde_json::from_str(&spec).expect("CDI spec JSON");
        let mut named = std::collections::BTreeSet::new();
        spec_device_nodes(&spec, &mut named);
        assert!(named.iter().any(|p| p.starts_with("/dev/nvidia-caps/")), "{named:?}");
        for path in named.iter().filter(|p| *p != "/dev/nvidia1") {
            assert!(
                dev(path).is_some(),
                "{layout}: {path} is named by the CDI spec but missing"
            );
        }
    }
    // 3g.20gb: two per GPU; 1g.5gb: seven per GPU; two capabilities each.
    assert_eq!(layouts_seen, [("all-3g.20gb", 8), ("all-1g.5gb", 28)]);
}

/// Without the label a MIG-capable node gets `all-disabled`, as the GPU Operator labels it, and
/// reports the state; a node without MIG-capable GPUs reports no MIG state at all.
#[test]
fn without_a_label_a_mig_node_gets_all_disabled_and_a_state() {
    let mut machine = common::machine("A100-SXM4-40GB", 1);
    machine = machine.replace(
        "numa_node = 0\n",
        "numa_node = 0\nmig_mode = true\n[[gpu.mig_device]]\nprofile = \"3g.20gb\"\n",
    );
    let node = Node::new(
        &machine,
        "[kubernetes]\nenabled = false\n[mig]\ndefault_layout = \"all-disabled\"\n",
    );
    node.run_once(0);
    assert_eq!(common::label(&node.status(), STATE), Some("success"));
    mig_is_off_everywhere(&node);

    let t4 = Node::new(
        &common::machine("T4", 1),
        "[kubernetes]\nenabled = false\n[mig]\ndefault_layout = \"all-disabled\"\n",
    );
    t4.run_once(0);
    let status = t4.status();
    assert!(common::label(&status, STATE).is_none(), "{:?}", status.labels);
    let detail = common::stage_detail(&status, StageId::Mig)
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("no layout requested"), "{detail}");
}

/// The GPU Operator's `values.yaml` example `custom-mig` (GPUs 0–3 only) on an 8-GPU H100 node:
/// imported with `mig import`, it applies, the other four GPUs stay as they were, and the state
/// is `success`, as under mig-manager.
#[test]
fn the_operators_custom_mig_example_applies_on_an_eight_gpu_node() {
    let yaml = "version: v1\nmig-configs:\n  custom-mig:\n    - devices: [0]\n      mig-enabled: false\n\
                \x20   - devices: [1]\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n\
                \x20   - devices: [2]\n      mig-enabled: true\n      mig-devices:\n        \"2g.20gb\": 2\n        \"3g.40gb\": 1\n\
                \x20   - devices: [3]\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 1\n        \"4g.40gb\": 1\n";
    // GPUs 4-7 (NUMA node 1) booted with MIG and one 7g.80gb each, made by other means.
    let machine = common::machine("H100-80GB-HBM3", 8).replace(
        "numa_node = 1\n",
        "numa_node = 1\nmig_mode = true\n[[gpu.mig_device]]\nprofile = \"7g.80gb\"\n",
    );
    let node = Node::new(&machine, "[kubernetes]\nenabled = false\n");
    let file = node.tmp.path().join("custom-mig.yaml");
    std::fs::write(&file, yaml).expect("yaml");
    let out = node.run(&["mig", "import", file.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let imported = String::from_utf8_lossy(&out.stdout).to_string();
    node.write_config(&format!(
        "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{imported}"
    ));
    node.write_labels("nvidia.com/mig.config=custom-mig\n");
    node.run_once(0);
    assert_eq!(common::label(&node.status(), STATE), Some("success"));
    assert_eq!(node.run(&["mig", "assert", "custom-mig"]).status.code(), Some(0));
    let export = String::from_utf8_lossy(&node.run(&["mig", "export"]).stdout).to_string();
    assert!(
        export.contains("devices = [1]\nmig_enabled = true\nprofiles = { \"1g.10gb\" = 7 }"),
        "{export}"
    );
    for gpu in 4..8 {
        assert!(
            export.contains(&format!(
                "devices = [{gpu}]\nmig_enabled = true\nprofiles = {{ \"7g.80gb\" = 1 }}"
            )),
            "GPU {gpu} untouched:\n{export}"
        );
    }
}

/// mig-parted v0.15's subsystem filters: two boards of one device id (same model, different
/// `pciSubSystemId`) get different layouts from one config imported from the Operator's
/// ConfigMap form, and a board neither names is left as it booted.
#[test]
fn subsystem_device_filters_tell_boards_of_one_model_apart() {
    let yaml = "version: v1\nmig-configs:\n  by-board:\n\
                \x20   - devices: all\n      device-filter: \"0x233010DE:0x16C110DE\"\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n\
                \x20   - devices: all\n      device-filter: [\"0x233010DE:0x16C010DE\"]\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 2\n";
    let indented: String = yaml.lines().map(|l| format!("    {l}\n")).collect();
    let config_map = format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: custom-mig-config\ndata:\n  config.yaml: |\n{indented}"
    );
    // GPU 0 and 1: two boards; GPU 2: a third board, booted with one 7g.80gb.
    let machine = common::machine("H100-80GB-HBM3", 3);
    let mut gpus = machine.split("[[gpu]]");
    let head = gpus.next().unwrap_or_default().to_owned();
    let with = |gpu: &str, extra: &str| format!("[[gpu]]{gpu}{extra}");
    let bodies: Vec<&str> = gpus.collect();
    assert_eq!(bodies.len(), 3, "{machine}");
    let machine = format!(
        "{head}{}{}{}",
        with(bodies[0], "pci_subsystem_id = 0x16C110DE\nmig_mode = true\n"),
        with(bodies[1], "pci_subsystem_id = 0x16C010DE\nmig_mode = true\n"),
        with(
            bodies[2],
            "pci_subsystem_id = 0x17A110DE\nmig_mode = true\n[[gpu.mig_device]]\nprofile = \"7g.80gb\"\n"
        ),
    );
    let node = Node::new(&machine, "[kubernetes]\nenabled = false\n");
    let file = node.tmp.path().join("custom-mig-config.yaml");
    std::fs::write(&file, config_map).expect("yaml");
    let out = node.run(&["mig", "import", file.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let imported = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        imported.contains("device_filter = [\"0x2330:0x16C110DE\"]"),
        "{imported}"
    );
    node.write_config(&format!(
        "[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{imported}"
    ));
    node.write_labels("nvidia.com/mig.config=by-board\n");
    node.run_once(0);
    assert_eq!(common::label(&node.status(), STATE), Some("success"));
    let export = String::from_utf8_lossy(&node.run(&["mig", "export"]).stdout).to_string();
    for (gpu, profiles) in [(0, "\"1g.10gb\" = 7"), (1, "\"3g.40gb\" = 2"), (2, "\"7g.80gb\" = 1")] {
        assert!(
            export.contains(&format!(
                "devices = [{gpu}]\nmig_enabled = true\nprofiles = {{ {profiles} }}"
            )),
            "GPU {gpu} wants {profiles}:\n{export}"
        );
    }
}

/// `plan --mig-layout LAYOUT`'s output, which must exit 0 and contain each of `wanted`.
fn plan_says(node: &Node, layout: &str, wanted: &[&str]) -> String {
    let out = node.run(&["plan", "--mig-layout", layout]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for w in wanted {
        assert!(stdout.contains(w), "{w:?} not in {stdout}");
    }
    stdout
}
