//! NVIDIA's GPU Operator beside the agent, inside the reconcile loop: each pass looks at the
//! node ([`crate::host::operator::observe`]); the conflicts go to status, the log and Warning
//! Events; the MIG and runtime stages hold back while mig-manager or the Operator's toolkit is
//! there (the device plugin's sockets are the plugin manager's to leave alone); with
//! `[kubernetes] withdraw_operator_operands` the replaced operands' deploy labels are set to
//! `false`. And `gpu-node-agent migrate [--undo]` outside the daemon.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::pass::{Held, Note, Outbox, Pass};
use crate::cluster::LabelsView;
use crate::config::{Config, DriverSource};
use crate::host::HostRoot;
use crate::host::operator::{
    self as op, Conflict, Facts, Operand, PREVIOUS_FILE, Placement, Process, Record, ServedPath, parse_record,
    render_record, restore_patch, withdraw_record,
};
use crate::kube::{EventType, KubeClient};
use crate::mig::stage::MigState as MigLabelState;
use crate::plugin::manager::PluginStatus;
use crate::status::OperatorStatus;

/// What the agent keeps about the Operator between passes.
#[derive(Default)]
pub(super) struct OperatorState {
    /// The last look at the node.
    facts: Facts,
    /// The conflicts already reported (by their line), for Events on change only.
    reported: BTreeSet<String>,
    /// The processes under an operand's name in a pod not the Operator's, already logged (pid,
    /// program), so each is logged once.
    ignored: BTreeSet<(i32, Option<String>)>,
    /// A deploy-label patch is on its way.
    patching: Arc<AtomicBool>,
    /// Its last failure.
    error: Arc<std::sync::Mutex<Option<String>>>,
    client: Option<KubeClient>,
}

impl OperatorState {
    /// Looks at the node for the Operator's operands (at the start of every pass) and, when the
    /// config says so, withdraws the ones the agent replaces.
    pub(super) fn check(&mut self, pass: &Pass<'_>, out: &mut Outbox) {
        let config = pass.config;
        let mut served = Vec::new();
        if config.dra.enabled {
            let driver = &config.dra.driver;
            served.push(ServedPath {
                host: crate::dra::dra_socket(config),
                what: format!("DRA driver {driver}"),
            });
            served.push(ServedPath {
                host: crate::dra::registration_socket(config),
                what: format!("DRA driver {driver} (registration)"),
            });
        }
        let mut facts = op::observe(pass.root, &engine_files(config), &served);
        name_pods(pass.root, &mut facts);
        // The agent's own DRA sockets answer too.
        let me = std::process::id() as i32;
        facts
            .live_sockets
            .retain(|(_, p)| p.as_ref().is_none_or(|p| p.pid != me));
        self.log_ignored(config, &facts);
        self.facts = facts;
        out.push(Note::Held(Held {
            runtime: self.held_by(config, Operand::ContainerToolkit),
            mig: self.held_by(config, Operand::MigManager),
        }));
        if config.kubernetes.withdraw_operator_operands {
            self.withdraw_operands(pass, out);
        }
    }

    /// Logs once each process under an operand's name that is not the Operator's (in a pod of
    /// another namespace, or of one not known): it holds nothing back.
    fn log_ignored(&mut self, config: &Config, facts: &Facts) {
        let namespace = &config.kubernetes.operator_namespace;
        let mut now = BTreeSet::new();
        for (operand, p) in op::ignored_processes(facts, namespace) {
            let key = (p.pid, p.program.clone());
            if !self.ignored.contains(&key) {
                tracing::info!(
                    "GPU Operator: pid {} ({}, {}) runs under the name of {} but not in namespace {namespace} \
                     ([kubernetes] operator_namespace): not the GPU Operator's: ignored",
                    p.pid,
                    p.program.as_deref().unwrap_or("program unknown"),
                    p.pod.as_deref().unwrap_or("pod not known"),
                    operand.words(),
                );
            }
            now.insert(key);
        }
        self.ignored = now;
    }

    /// Every conflict now: the device plugin's sockets the manager found held, and what the
    /// last look saw.
    fn conflicts(&self, config: &Config, root: &HostRoot, plugin: &PluginStatus) -> Vec<Conflict> {
        let mut facts = self.facts.clone();
        for c in &plugin.conflicts {
            let process = c.pid.map(|pid| {
                let (pod, placement) = pod_of(root, pid);
                Process {
                    pid,
                    program: op::program_of(root, pid),
                    pod,
                    placement,
                }
            });
            let host = std::path::Path::new(&c.socket)
                .strip_prefix(root.path())
                .map(|p| std::path::Path::new("/").join(p))
                .unwrap_or_else(|_| c.socket.clone().into());
            facts.live_sockets.push((
                ServedPath {
                    host,
                    what: c.resource.clone(),
                },
                process,
            ));
        }
        op::conflicts(&facts, &roles(config), &config.kubernetes.operator_namespace)
    }

    /// The Operator's part of status (with the device plugin's sockets another process holds,
    /// from `plugin`); posts a Warning Event for each new conflict and a Normal one when one is
    /// gone. `None` when there is nothing to say.
    pub(super) fn status(
        &mut self,
        config: &Config,
        root: &HostRoot,
        plugin: &PluginStatus,
        out: &mut Outbox,
    ) -> Option<OperatorStatus> {
        let withdrawing = config.kubernetes.withdraw_operator_operands;
        let details = self.conflicts(config, root, plugin);
        let lines: Vec<String> = details.iter().map(|c| c.line(withdrawing)).collect();
        let now: BTreeSet<String> = lines.iter().cloned().collect();
        for line in now.difference(&self.reported) {
            tracing::warn!("GPU Operator: {line}");
            out.event(EventType::Warning, "GpuOperatorConflict", line.clone());
        }
        for line in self.reported.difference(&now) {
            tracing::info!("GPU Operator: no longer so: {line}");
            out.event(
                EventType::Normal,
                "GpuOperatorConflictResolved",
                format!("no longer so, the agent takes over: {line}"),
            );
        }
        self.reported = now;
        let withdrawn = read_record(config, root).labels;
        let error = self.error.lock().map(|e| e.clone()).unwrap_or_default();
        if lines.is_empty() && withdrawn.is_empty() && error.is_none() {
            return None;
        }
        Some(OperatorStatus {
            conflicts: lines,
            details,
            withdrawing,
            withdrawn,
            error,
        })
    }

    /// The line of the conflict with the Operator's `operand`, when there is one: why the MIG
    /// stage makes no change (mig-manager runs), why the runtime stage writes no engine config
    /// (the Operator's toolkit configured the engines; its runtime serves GPU containers
    /// meanwhile).
    fn held_by(&self, config: &Config, operand: Operand) -> Option<String> {
        let withdrawing = config.kubernetes.withdraw_operator_operands;
        op::conflicts(&self.facts, &roles(config), &config.kubernetes.operator_namespace)
            .into_iter()
            .find(|c| c.operand == operand)
            .map(|c| c.line(withdrawing))
    }

    /// Sets the replaced operands' deploy labels to `false` on the Node (once the Node's labels
    /// are known), recording each one's previous value first.
    fn withdraw_operands(&mut self, pass: &Pass<'_>, out: &mut Outbox) {
        let (config, root, view) = (pass.config, pass.root, pass.view);
        if view.source != crate::desired::Source::Node || !view.connected {
            return;
        }
        if self.patching.load(Ordering::Acquire) {
            return;
        }
        let recorded = read_record(config, root);
        let node = crate::kube::node_name(&config.kubernetes, root);
        let replaced = op::replaced(&roles(config));
        let (patch, record) = match withdraw_record(&view.labels, &replaced, &recorded, &node) {
            Ok(done) => done,
            Err(e) => {
                self.set_operator_error(Some(e));
                return;
            }
        };
        if patch.is_empty() {
            return;
        }
        if record != recorded
            && let Err(e) = write_record(config, root, &record)
        {
            tracing::error!("GPU Operator: not withdrawing its operands: {e}");
            self.set_operator_error(Some(e));
            return;
        }
        if self.client.is_none() {
            self.client = client(config, root);
        }
        let Some(client) = self.client.clone() else {
            self.set_operator_error(Some(
                "no Kubernetes credentials to set the Operator's deploy labels with".into(),
            ));
            return;
        };
        let keys: Vec<String> = patch.keys().map(|k| format!("{k}=false")).collect();
        let message = format!(
            "withdrawing NVIDIA's GPU Operator operands the agent replaces: {}",
            keys.join(", ")
        );
        tracing::info!("{message}");
        out.event(EventType::Normal, "GpuOperatorWithdrawn", message);
        let patching = self.patching.clone();
        let error = self.error.clone();
        patching.store(true, Ordering::Release);
        tokio::spawn(async move {
            let result = client.patch_node_metadata(&node, &patch, &BTreeMap::new()).await;
            if let Ok(mut slot) = error.lock() {
                *slot = result
                    .as_ref()
                    .err()
                    .map(|e| format!("cannot set the deploy labels: {e}"));
            }
            if let Err(e) = result {
                tracing::warn!("GPU Operator: cannot set the deploy labels on node {node}: {e}; trying again");
            }
            patching.store(false, Ordering::Release);
        });
    }

    fn set_operator_error(&self, e: Option<String>) {
        if let Ok(mut slot) = self.error.lock() {
            *slot = e;
        }
    }
}

/// While mig-manager runs it owns `nvidia.com/mig.config.state` too: the agent reports what the
/// Node carries (`view`), so it neither rewrites nor removes mig-manager's value.
pub(super) fn mig_state_as_on_node(config: &Config, view: &LabelsView) -> Option<MigLabelState> {
    match view.labels.get(&config.labels.mig_config_state)?.as_str() {
        "pending" => Some(MigLabelState::Pending),
        "rebooting" => Some(MigLabelState::Rebooting),
        "success" => Some(MigLabelState::Success),
        "failed" => Some(MigLabelState::Failed),
        _ => None,
    }
}

/// The most bytes of a `/proc/<pid>/cgroup` read (a few lines).
const MAX_CGROUP: u64 = 64 * 1024;

/// The pod `pid` runs in: for the messages, `pod <namespace>/<name>` (the kubelet's log folders
/// name it), else `pod uid <uid>`, else `cgroup <path>` (under `kubepods`, in no form known);
/// `None` outside a pod or when `/proc` does not say. And its [`Placement`], which decides
/// whether it may be the Operator's. Any pod can run a program named like an operand (its `comm`
/// and argv[0] are its own), but not choose its cgroup, nor write the kubelet's log folders: this
/// tells an operand's pod from a tenant's.
fn pod_of(root: &HostRoot, pid: i32) -> (Option<String>, Placement) {
    use crate::plugin::memlimit::{KubeletLogNames, PodNames, pod_of_cgroup};
    let Ok(text) = crate::host::read_text_limited(&root.join(format!("/proc/{pid}/cgroup")), MAX_CGROUP) else {
        return (None, Placement::Host);
    };
    match pod_of_cgroup(&text) {
        Some(pod) => match KubeletLogNames::new(root).lookup(&pod.pod_uid, pod.container_id.as_deref()) {
            Some(name) => (
                Some(format!("pod {}/{}", name.namespace, name.pod)),
                Placement::Pod {
                    namespace: Some(name.namespace),
                },
            ),
            None => (
                Some(format!("pod uid {}", pod.pod_uid)),
                Placement::Pod { namespace: None },
            ),
        },
        None => match text
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .find(|path| path.contains("kubepods"))
        {
            Some(path) => (
                Some(format!("cgroup {}", op::printable(path.trim()))),
                Placement::Pod { namespace: None },
            ),
            None => (None, Placement::Host),
        },
    }
}

/// Fills in the pod and placement of each process in `facts` ([`pod_of`]).
fn name_pods(root: &HostRoot, facts: &mut Facts) {
    let sockets = facts.live_sockets.iter_mut().filter_map(|(_, p)| p.as_mut());
    for process in sockets.chain(facts.processes.iter_mut().map(|(_, p)| p)) {
        (process.pod, process.placement) = pod_of(root, process.pid);
    }
}

/// What the agent does on this node, for the Operator's side ([`op::Roles`]).
fn roles(config: &Config) -> op::Roles {
    op::Roles {
        driver: config.driver.enabled && config.driver.source != DriverSource::None,
        runtime: config.runtime.enabled,
        device_plugin: config.device_plugin.enabled,
        features: config.labels.report_features,
        mig: config.mig.enabled,
        metrics: config.metrics.enabled,
        validation: config.validation.enabled,
        dra: config.dra.enabled,
    }
}

/// The engine configs the Operator's toolkit would have edited: containerd's and CRI-O's main
/// files and every file in their drop-in folders (the toolkit's drop-in has the agent's name,
/// `99-nvidia.toml`), docker's `daemon.json`.
fn engine_files(config: &Config) -> op::EngineFiles {
    let rt = &config.runtime;
    op::EngineFiles {
        files: vec![
            rt.containerd.config.clone(),
            rt.containerd.drop_in.clone(),
            rt.crio.config.clone(),
            rt.crio.drop_in.clone(),
            rt.docker.config.clone(),
        ],
        folders: [&rt.containerd.drop_in, &rt.crio.drop_in]
            .into_iter()
            .filter_map(|d| d.parent().filter(|p| !p.as_os_str().is_empty()).map(Into::into))
            .collect(),
    }
}

fn previous_path(config: &Config, root: &HostRoot) -> std::path::PathBuf {
    root.join(&config.agent.state_dir).join(PREVIOUS_FILE)
}

/// The deploy labels a migration set, with their previous values, and the Node it set them on
/// (empty when none).
fn read_record(config: &Config, root: &HostRoot) -> Record {
    crate::host::read_text(&previous_path(config, root))
        .map(|t| parse_record(&t))
        .unwrap_or_default()
}

fn write_record(config: &Config, root: &HostRoot, record: &Record) -> Result<(), String> {
    let path = previous_path(config, root);
    crate::host::write_atomic(&path, render_record(record).as_bytes(), 0o644).map_err(|e| e.to_string())
}

/// The Node to put the recorded labels back on: the one they were set on, else (a record from
/// before the Node was kept) this node's name.
fn undo_node(config: &Config, root: &HostRoot, record: &Record) -> String {
    record
        .node
        .clone()
        .unwrap_or_else(|| crate::kube::node_name(&config.kubernetes, root))
}

/// The API client (the cluster link's credentials); `None` without any.
fn client(config: &Config, root: &HostRoot) -> Option<KubeClient> {
    if !config.kubernetes.enabled {
        return None;
    }
    match crate::kube::discover(&config.kubernetes, root) {
        Ok(Some(credentials)) => KubeClient::new(credentials, &config.kubernetes)
            .map_err(|e| tracing::error!("cannot build the Kubernetes API client: {e}"))
            .ok(),
        Ok(None) => None,
        Err(e) => {
            tracing::error!("{e}");
            None
        }
    }
}

/// `gpu-node-agent migrate [--undo]`: sets (or puts back) the GPU Operator's deploy labels of
/// the operands the agent replaces on this Node, and says what runs of the Operator still.
pub fn migrate_command(config: &Config, root: &HostRoot, undo: bool) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpu-node-agent migrate: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(migrate(config, root, undo)) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpu-node-agent migrate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `runtime unconfigure` (which the package's removal runs): the deploy labels a migration set
/// are put back, so the GPU Operator serves the node again once the agent has gone. An API server
/// that cannot be reached does not stop the removal: the labels to put back are named, with the
/// commands that do it.
pub fn undo_on_unconfigure(config: &Config, root: &HostRoot) {
    let recorded = read_record(config, root);
    if recorded.labels.is_empty() {
        return;
    }
    let result = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(migrate(config, root, true)),
        Err(e) => Err(format!("cannot start the async runtime: {e}")),
    };
    match result {
        Ok(text) => print!("{text}"),
        Err(e) => {
            let node = undo_node(config, root, &recorded);
            let labels: Vec<String> = recorded
                .labels
                .iter()
                .map(|(k, v)| match v {
                    Some(v) => format!("{k}={v}"),
                    None => format!("{k}-"),
                })
                .collect();
            eprintln!(
                "gpu-node-agent: the GPU Operator's deploy labels the agent set on node {node} were not put back \
                 ({e}); run `gpu-node-agent migrate --undo` once the API server answers, or \
                 `kubectl label node {node} --overwrite {}`",
                labels.join(" ")
            );
        }
    }
}

async fn migrate(config: &Config, root: &HostRoot, undo: bool) -> Result<String, String> {
    let Some(client) = client(config, root) else {
        return Err("no Kubernetes credentials ([kubernetes]): the deploy labels live on the Node".into());
    };
    let recorded = read_record(config, root);
    let node_name = if undo {
        undo_node(config, root, &recorded)
    } else {
        crate::kube::node_name(&config.kubernetes, root)
    };
    let node = client.get_node(&node_name, false).await.map_err(|e| e.to_string())?;
    let mut out = String::new();
    if undo {
        let patch = restore_patch(&node.labels, &recorded.labels);
        if !patch.is_empty() {
            client
                .patch_node_metadata(&node_name, &patch, &BTreeMap::new())
                .await
                .map_err(|e| e.to_string())?;
        }
        for (k, v) in &patch {
            match v {
                Some(v) => out.push_str(&format!("node {node_name}: {k}={v} (as before)\n")),
                None => out.push_str(&format!("node {node_name}: {k} removed (it was not set before)\n")),
            }
        }
        if patch.is_empty() {
            out.push_str(&format!(
                "node {node_name}: no deploy label of the agent's to put back\n"
            ));
        }
        match std::fs::remove_file(previous_path(config, root)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(format!("{}: {e}", previous_path(config, root).display()));
            }
        }
        if config.kubernetes.withdraw_operator_operands {
            out.push_str(
                "note: [kubernetes] withdraw_operator_operands = true: a running agent sets them again; turn it off \
                 first\n",
            );
        }
        return Ok(out);
    }
    let (patch, record) = withdraw_record(&node.labels, &op::replaced(&roles(config)), &recorded, &node_name)?;
    if record != recorded {
        write_record(config, root, &record)?;
    }
    if !patch.is_empty() {
        client
            .patch_node_metadata(&node_name, &patch, &BTreeMap::new())
            .await
            .map_err(|e| e.to_string())?;
    }
    for k in record.labels.keys() {
        out.push_str(&format!("node {node_name}: {k}=false\n"));
    }
    let mut facts = op::observe(root, &engine_files(config), &[]);
    name_pods(root, &mut facts);
    let namespace = &config.kubernetes.operator_namespace;
    let ignored: Vec<String> = op::ignored_processes(&facts, namespace)
        .map(|(o, p)| {
            let pod = p.pod.as_deref().map(|pod| format!(", {pod}")).unwrap_or_default();
            format!("pid {} under the name of {}{pod}", p.pid, o.words())
        })
        .collect();
    if !ignored.is_empty() {
        out.push_str(&format!(
            "not the GPU Operator's (not in namespace {namespace}, [kubernetes] operator_namespace): ignored: {}\n",
            ignored.join(", ")
        ));
    }
    let still: Vec<String> = op::operators_processes(&facts, namespace)
        .map(|(o, p)| {
            let pod = p.pod.as_deref().map(|pod| format!(", {pod}")).unwrap_or_default();
            format!("{} (pid {}{pod})", o.words(), p.pid)
        })
        .collect();
    if still.is_empty() {
        out.push_str("no operand of the GPU Operator runs on this node\n");
    } else {
        out.push_str(&format!(
            "still running (the Operator removes them shortly; the agent takes over each once it has gone): {}\n",
            still.join(", ")
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process named like NVIDIA's mig-manager is placed in the pod its cgroup names (which the
    /// process cannot choose), by namespace once the kubelet's log folder names it; the report
    /// names the pod.
    #[test]
    fn a_process_under_an_operands_name_is_reported_with_its_pod() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = HostRoot::new(dir.path());
        let uid = "0f3c8a52-1b2d-4e5f-8a9b-112233445566";
        let cid = "4a5b6c7d8e9f00112233445566778899aabbccddeeff00112233445566778899";
        let proc_dir = dir.path().join("proc/77");
        std::fs::create_dir_all(&proc_dir).expect("mkdir");
        std::fs::write(proc_dir.join("comm"), "nvidia-mig-mana\n").expect("comm");
        std::fs::write(proc_dir.join("cmdline"), "/usr/bin/nvidia-mig-manager\0").expect("cmdline");
        std::fs::write(
            proc_dir.join("cgroup"),
            format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{cid}.scope\n",
                uid.replace('-', "_")
            ),
        )
        .expect("cgroup");
        let mut facts = op::observe(&root, &op::EngineFiles::default(), &[]);
        name_pods(&root, &mut facts);
        assert_eq!(facts.processes.len(), 1, "{facts:?}");
        assert_eq!(
            facts.processes[0].1.pod.as_deref(),
            Some(format!("pod uid {uid}").as_str())
        );
        // With the kubelet's log folder, by name.
        std::fs::create_dir_all(dir.path().join(format!("var/log/pods/tenant-a_evil_{uid}"))).expect("logs");
        name_pods(&root, &mut facts);
        let roles = op::Roles {
            mig: true,
            ..op::Roles::default()
        };
        assert_eq!(
            facts.processes[0].1.placement,
            Placement::Pod {
                namespace: Some("tenant-a".into())
            }
        );
        assert!(op::conflicts(&facts, &roles, "gpu-operator").is_empty(), "a tenant's");
        let line = op::conflicts(&facts, &roles, "tenant-a")[0].line(false);
        assert!(
            line.contains("(nvidia-mig-manager, pid 77, pod tenant-a/evil)"),
            "{line}"
        );
        // Outside a pod, or no cgroup to read: no pod named.
        std::fs::write(proc_dir.join("cgroup"), "0::/system.slice/foo.service\n").expect("cgroup");
        assert_eq!(pod_of(&root, 77), (None, Placement::Host));
        assert_eq!(pod_of(&root, 78), (None, Placement::Host));
        // Under kubepods in no form known: a pod, namespace unknown.
        std::fs::write(proc_dir.join("cgroup"), "0::/kubepods/odd\n").expect("cgroup");
        assert_eq!(
            pod_of(&root, 77),
            (Some("cgroup /kubepods/odd".into()), Placement::Pod { namespace: None })
        );
    }

    /// The stage by itself, without the loop: NVIDIA's device plugin holding a socket is a
    /// conflict, with an Event when it shows and one when it is gone.
    #[test]
    fn a_held_device_plugin_socket_is_a_conflict_with_an_event_each_way() {
        use crate::agent::pass::Fixture;
        use crate::plugin::manager::SocketConflict;
        let mut fixture = Fixture::new(Config::default());
        let mut stage = OperatorState::default();
        let mut out = Outbox::default();
        stage.check(&fixture.pass(), &mut out);
        assert_eq!(
            out.take(),
            [Note::Held(Held::default())],
            "nothing held on an empty node"
        );
        assert_eq!(
            stage.status(&fixture.config, &fixture.root, &fixture.plugin, &mut out),
            None
        );
        assert!(out.take().is_empty(), "nothing on an empty node");

        fixture.plugin.conflicts.push(SocketConflict {
            resource: "nvidia.com/gpu".into(),
            socket: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock".into(),
            pid: None,
        });
        let status = stage
            .status(&fixture.config, &fixture.root, &fixture.plugin, &mut out)
            .expect("a conflict");
        assert_eq!(status.conflicts.len(), 1, "{status:?}");
        let notes = out.take();
        assert!(
            matches!(
                &notes[..],
                [crate::agent::pass::Note::Event {
                    reason: "GpuOperatorConflict",
                    ..
                }]
            ),
            "{notes:?}"
        );
        // Reported once, not at every status.
        stage.status(&fixture.config, &fixture.root, &fixture.plugin, &mut out);
        assert!(out.take().is_empty());

        fixture.plugin.conflicts.clear();
        stage.check(&fixture.pass(), &mut out);
        assert_eq!(out.take(), [Note::Held(Held::default())]);
        assert_eq!(
            stage.status(&fixture.config, &fixture.root, &fixture.plugin, &mut out),
            None
        );
        let notes = out.take();
        assert!(
            matches!(
                &notes[..],
                [crate::agent::pass::Note::Event {
                    reason: "GpuOperatorConflictResolved",
                    ..
                }]
            ),
            "{notes:?}"
        );
    }
}
