//! Host GPU clients around a MIG change: systemd units (DCGM, NVSM, ... and the kubelet for a
//! mode change when configured) that the MIG stage stops right before its first NVML change and
//! starts again after it, whatever the outcome. systemd is a stand-in under the root that logs
//! every call and keeps each unit's state in a file; the GPUs are the fake NVML's.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use common::{Node, gpu_uuid};
use gpu_node_agent::status::{StageId, StageState, StageStatus};

/// The layout every test asks for (from the labels file): MIG on with seven 1g.5gb.
const LAYOUT: &str = "all-1g.5gb";

struct Host {
    node: Node,
    /// One file per active unit; `<unit>.hang` makes its stop hang, `<unit>.nostart` its start
    /// fail.
    units: PathBuf,
}

impl Host {
    /// One A100 (MIG off unless `mig_on`; a mode change needs a GPU reset, done by an
    /// `nvidia-smi` stand-in that works when `reset_works`), the layout asked for by a labels
    /// file, `extra` config, and `active` units active.
    fn new(mig_on: bool, reset_works: bool, extra: &str, active: &[&str]) -> Host {
        let config =
            format!("[kubernetes]\nenabled = false\n[desired]\nlabels_file = \"/etc/gpu-node-agent/labels\"\n{extra}");
        let machine = format!(
            "{}\n[[gpu]]\nmodel = \"A100-SXM4-40GB\"\nuuid = \"{}\"\nmig_reset_required = true\nmig_mode = {mig_on}\n",
            common::DGX_A100,
            gpu_uuid(0)
        );
        let node = Node::new(&machine, &config);
        node.write_labels(&format!("nvidia.com/mig.config={LAYOUT}\n"));
        let units = node.tmp.path().join("units");
        fs::create_dir_all(&units).expect("units dir");
        for unit in active {
            fs::write(units.join(unit), "").expect("active unit");
        }
        let host = Host { node, units };
        let log = host.log_path();
        let state = host.node.state.join("state.json");
        // systemctl: every call logged; stop and start also keep the fake NVML's state as it was
        // at that moment, to tell whether the MIG change came before or after.
        host.script(
            "usr/bin/systemctl",
            &format!(
                "d=\"{units}\"\necho \"systemctl $*\" >> \"{log}\"\ncase \"$1\" in\n\
                 is-active) [ -e \"$d/$3\" ]; exit $? ;;\n\
                 stop) cp \"{state}\" \"$d/$2.state-at-stop\" 2>/dev/null\n\
                   [ -e \"$d/$2.hang\" ] && sleep 30\n\
                   rm -f \"$d/$2\" ;;\n\
                 start) u=\"$2\"; [ \"$u\" = --no-block ] && u=\"$3\"\n\
                   cp \"{state}\" \"$d/$u.state-at-start\" 2>/dev/null\n\
                   if [ -e \"$d/$u.nostart\" ]; then echo \"Job for $u failed.\" >&2; exit 1; fi\n\
                   touch \"$d/$u\" ;;\n\
                 esac\nexit 0",
                units = host.units.display(),
                log = log.display(),
                state = state.display()
            ),
        );
        let reset = if reset_works {
            format!("echo \"$3\" >> \"{}/reset\"", host.node.state.display())
        } else {
            "echo 'Unable to reset this GPU because it is in use by another client' >&2; exit 255".to_string()
        };
        host.script(
            "usr/bin/nvidia-smi",
            &format!("echo \"nvidia-smi $*\" >> \"{}\"\n{reset}", log.display()),
        );
        host
    }

    fn script(&self, path: &str, body: &str) {
        let path = self.node.root.join(path);
        fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("script");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    fn log_path(&self) -> PathBuf {
        self.node.tmp.path().join("commands.log")
    }

    /// The logged calls that change something (no `is-active`).
    fn changes(&self) -> Vec<String> {
        fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("systemctl is-active"))
            .map(str::to_string)
            .collect()
    }

    /// Every logged call.
    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn active(&self, unit: &str) -> bool {
        self.units.join(unit).exists()
    }

    /// The fake NVML's state when `unit` was stopped (`stop`) or started (`start`).
    fn state_at(&self, unit: &str, what: &str) -> String {
        fs::read_to_string(self.units.join(format!("{unit}.state-at-{what}"))).unwrap_or_default()
    }

    fn nvml_state(&self) -> String {
        fs::read_to_string(self.node.state.join("state.json")).expect("state.json")
    }

    fn run_once(&self) -> std::process::Output {
        self.node.run(&["run", "--once"])
    }

    fn mig_stage(&self) -> StageStatus {
        common::stage(&self.node.status(), StageId::Mig).clone()
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_mode_change_stops_the_active_clients_first_and_starts_them_after() {
    // The default list: nvsm and nvidia-dcgm active, dcgm-exporter installed but inactive, the
    // others absent.
    let host = Host::new(false, true, "", &["nvsm.service", "nvidia-dcgm.service"]);
    let out = host.node.run(&["plan", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan --json");
    assert_eq!(
        plan["mig"]["stop_units"],
        serde_json::json!(["nvsm.service", "nvidia-dcgm.service"]),
        "{}",
        plan["mig"]
    );
    let printed = text(&host.node.run(&["plan"]));
    assert!(
        printed.contains("first stop the host GPU clients nvsm.service, nvidia-dcgm.service"),
        "{printed}"
    );
    assert!(host.changes().is_empty(), "plan changes nothing: {:?}", host.changes());
    let before = host.nvml_state();

    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvsm.service",
            "systemctl stop nvidia-dcgm.service",
            &format!("nvidia-smi --gpu-reset -i {}", gpu_uuid(0)),
            "systemctl start nvidia-dcgm.service",
            "systemctl start nvsm.service",
        ]),
        "stopped in order before the reset, started the other way round after; nothing else touched"
    );
    // Stopped before the first NVML change, started after the last.
    assert_eq!(
        host.state_at("nvsm.service", "stop"),
        before,
        "nothing changed before the stop"
    );
    assert_eq!(host.state_at("nvidia-dcgm.service", "stop"), before);
    let after = host.nvml_state();
    assert_ne!(after, before, "the layout was applied");
    assert_eq!(
        host.state_at("nvidia-dcgm.service", "start"),
        after,
        "started after the change"
    );
    assert_eq!(host.state_at("nvsm.service", "start"), after);
    assert!(host.active("nvsm.service") && host.active("nvidia-dcgm.service"));
    let mig = host.mig_stage();
    assert_eq!(mig.state, StageState::Ok, "{mig:?}");
    let detail = mig.detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("host GPU clients stopped for the change and started again: nvsm.service, nvidia-dcgm.service"),
        "{detail}"
    );
    // Asked about, never stopped or started: the inactive and the absent ones.
    let calls = host.calls();
    assert!(calls.contains(&"systemctl is-active --quiet dcgm-exporter.service".to_string()));
    assert!(!host.node.root.join("var/lib/gpu-node-agent/mig-stopped-units").exists());
    assert_eq!(host.node.run(&["mig", "assert", LAYOUT]).status.code(), Some(0));

    // In place: nothing is stopped again.
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(host.changes().len(), 5, "{:?}", host.changes());
}

#[test]
fn a_failed_mode_change_starts_the_clients_again_and_reports_the_failure() {
    let host = Host::new(false, false, "", &["nvidia-dcgm.service", "dcgm-exporter.service"]);
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvidia-dcgm.service",
            "systemctl stop dcgm-exporter.service",
            &format!("nvidia-smi --gpu-reset -i {}", gpu_uuid(0)),
            "systemctl start dcgm-exporter.service",
            "systemctl start nvidia-dcgm.service",
        ])
    );
    assert!(host.active("nvidia-dcgm.service") && host.active("dcgm-exporter.service"));
    let mig = host.mig_stage();
    assert_eq!(mig.state, StageState::Failed, "{mig:?}");
    let error = mig.error.as_deref().unwrap_or_default();
    assert!(error.contains("the reset failed"), "{error}");
    assert!(
        error.contains(
            "host GPU clients stopped for the change and started again: nvidia-dcgm.service, dcgm-exporter.service"
        ),
        "{error}"
    );
    assert!(!host.node.root.join("var/lib/gpu-node-agent/mig-stopped-units").exists());
}

#[test]
fn a_client_that_does_not_stop_fails_the_change_before_anything_changed() {
    let host = Host::new(
        false,
        true,
        "[mig]\nhost_gpu_clients = [\"nvsm.service\", \"nvidia-dcgm.service\", \"dcgm.service\"]\n\
         host_gpu_clients_stop_timeout = \"1s\"\n",
        &["nvsm.service", "nvidia-dcgm.service", "dcgm.service"],
    );
    fs::write(host.units.join("nvidia-dcgm.service.hang"), "").expect("hang");
    let before = host.nvml_state_or_init();
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvsm.service",
            "systemctl stop nvidia-dcgm.service",
            "systemctl start nvidia-dcgm.service",
            "systemctl start nvsm.service",
        ]),
        "the one that hung and the one before it started again; dcgm.service never stopped, no reset"
    );
    assert_eq!(host.nvml_state(), before, "no NVML change");
    assert!(host.active("nvsm.service") && host.active("dcgm.service"));
    let mig = host.mig_stage();
    assert_eq!(mig.state, StageState::Failed, "{mig:?}");
    let error = mig.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("host GPU client nvidia-dcgm.service did not stop")
            && error.contains("did not finish within 1s")
            && error.contains("started again: nvsm.service, nvidia-dcgm.service")
            && error.contains("nothing changed"),
        "{error}"
    );
}

impl Host {
    /// The fake NVML's state before any change (NVML opened once by `mig export`).
    fn nvml_state_or_init(&self) -> String {
        let out = self.node.run(&["mig", "export"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        self.nvml_state()
    }
}

#[test]
fn the_kubelet_is_stopped_only_for_a_mode_change_and_only_when_configured() {
    let kubelet = "[mig]\nstop_kubelet_on_mode_change = true\nhost_gpu_clients = [\"nvidia-dcgm.service\"]\n";
    // A mode change: the kubelet first, started again last.
    let host = Host::new(false, true, kubelet, &["kubelet.service", "nvidia-dcgm.service"]);
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop kubelet.service",
            "systemctl stop nvidia-dcgm.service",
            &format!("nvidia-smi --gpu-reset -i {}", gpu_uuid(0)),
            "systemctl start nvidia-dcgm.service",
            "systemctl start kubelet.service",
        ])
    );
    assert!(host.active("kubelet.service"));

    // MIG already on: GPU instances only, the kubelet keeps running.
    let host = Host::new(true, true, kubelet, &["kubelet.service", "nvidia-dcgm.service"]);
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvidia-dcgm.service",
            "systemctl start nvidia-dcgm.service"
        ])
    );

    // Not configured (the default): a mode change leaves the kubelet alone.
    let host = Host::new(
        false,
        true,
        "[mig]\nhost_gpu_clients = []\n",
        &["kubelet.service", "nvidia-dcgm.service"],
    );
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[&format!("nvidia-smi --gpu-reset -i {}", gpu_uuid(0))]),
        "an empty list stops nothing"
    );
    assert!(
        host.calls().iter().all(|c| !c.contains("kubelet")),
        "{:?}",
        host.calls()
    );
}

#[test]
fn a_client_that_does_not_start_again_is_reported_and_the_layout_stays() {
    let host = Host::new(
        true,
        true,
        "[mig]\nhost_gpu_clients = [\"nvsm.service\", \"nvidia-dcgm.service\"]\n",
        &["nvsm.service", "nvidia-dcgm.service"],
    );
    fs::write(host.units.join("nvidia-dcgm.service.nostart"), "").expect("nostart");
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvsm.service",
            "systemctl stop nvidia-dcgm.service",
            "systemctl start nvidia-dcgm.service",
            "systemctl start nvsm.service",
        ]),
        "a failed start does not keep the others stopped"
    );
    assert!(host.active("nvsm.service") && !host.active("nvidia-dcgm.service"));
    let mig = host.mig_stage();
    assert_eq!(mig.state, StageState::Ok, "the MIG change stands: {mig:?}");
    let detail = mig.detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("host GPU client nvidia-dcgm.service did not start again")
            && detail.contains("Job for nvidia-dcgm.service failed."),
        "{detail}"
    );
    assert_eq!(host.node.run(&["mig", "assert", LAYOUT]).status.code(), Some(0));
}

#[test]
fn units_an_interrupted_change_left_stopped_are_started_at_the_next_pass() {
    let host = Host::new(true, true, "", &[]);
    let journal = host.node.root.join("var/lib/gpu-node-agent/mig-stopped-units");
    fs::create_dir_all(journal.parent().expect("state dir")).expect("mkdir");
    fs::write(&journal, "nvsm.service\nnvidia-dcgm.service\n").expect("journal");
    let out = host.run_once();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let changes = host.changes();
    assert_eq!(
        changes[..2],
        strings(&["systemctl start nvidia-dcgm.service", "systemctl start nvsm.service"]),
        "{changes:?}"
    );
    assert!(!journal.exists());
    assert!(host.active("nvsm.service") && host.active("nvidia-dcgm.service"));
}

#[test]
fn mig_apply_stops_and_starts_the_clients_too() {
    let host = Host::new(false, false, "", &["nvidia-dcgm.service"]);
    let out = host.node.run(&["mig", "apply", LAYOUT]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("host GPU clients stopped for the change and started again: nvidia-dcgm.service"),
        "{}",
        text(&out)
    );
    assert_eq!(
        host.changes(),
        strings(&[
            "systemctl stop nvidia-dcgm.service",
            &format!("nvidia-smi --gpu-reset -i {}", gpu_uuid(0)),
            "systemctl start nvidia-dcgm.service",
        ])
    );
    assert!(host.active("nvidia-dcgm.service"));
}
