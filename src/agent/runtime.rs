//! The runtime stage inside the reconcile loop: the `nvidia` runtime in the container engines
//! (first in the order: MIG and the device plugin wait for it), and the CDI spec, rewritten
//! whenever the GPU inventory changes (at start and after every MIG change).

use super::pass::{Note, Outbox, Pass};
use crate::cli::RuntimeCommand;
use crate::config::Config;
use crate::edits::DeviceNodes;
use crate::edits::injections::{FLAG_CLASSES, IMEX_CLASS};
use crate::exit::Exit;
use crate::host::HostRoot;
use crate::host::command::Runner;
use crate::kube::EventType;
use crate::logging;
use crate::nvml::Gpus;
use crate::runtime::cdi::{CdiError, spec_file_name};
use crate::runtime::node_spec;
use crate::runtime::stage::{self as rt, ApplyOptions, RuntimeError};
use crate::status::{StageId, StageState};
use std::process::ExitCode;

/// What the runtime stage keeps between passes.
#[derive(Debug, Default)]
pub(super) struct RuntimeStage {
    /// What the last runtime pass did (empty before one succeeded).
    detail: String,
    /// Where the CDI spec is, once written.
    cdi_detail: Option<String>,
    /// Why the CDI spec could not be written.
    cdi_error: Option<String>,
    /// The rollbacks last posted as Events (engine and reason): the same rollback at every
    /// pass is posted once.
    rolled_back: Vec<String>,
}

impl RuntimeStage {
    /// Brings the engines' files to what `[runtime]` asks for; `false` when the stage failed (the
    /// stages after it then wait for the next pass). The plan, once the engines hold the
    /// runtime, goes out as [`Note::RuntimePlan`] (validation checks the engines it names).
    pub(super) async fn step(&mut self, pass: &Pass<'_>, out: &mut Outbox) -> bool {
        let id = StageId::Runtime;
        if !pass.config.runtime.enabled {
            out.status(id, StageState::Disabled, None, Some("[runtime] enabled = false".into()));
            return true;
        }
        // The GPU Operator's toolkit configured the engines: two writers of one config fight;
        // its runtime serves GPU containers meanwhile, so the stages after this one go on.
        if let Some(why) = &pass.held.runtime {
            out.status(
                id,
                StageState::Pending,
                Some(format!("engines not configured: {why}")),
                None,
            );
            return true;
        }
        let (config, root, stop) = (pass.config.clone(), pass.root.clone(), pass.stop.clone());
        // Restarting an engine may take its restart timeout, twice when rolling back.
        let _long = crate::notify::LongStep::start(&pass.services.long_step);
        let result = tokio::task::spawn_blocking(move || {
            let runner = Runner::new(&root).with_stop(&stop);
            if let Some(note) = rt::recover(&config, &root)? {
                tracing::warn!("runtime: {note}");
            }
            let observed = rt::observe(&config, &root, &runner)?;
            let plan = rt::plan(&observed, &config.runtime)?;
            let opts = ApplyOptions {
                // A root prefix is an image being built or a test: nothing to restart there.
                restart: config.runtime.restart && root.is_real(),
            };
            let applied = rt::apply_all(&plan, &config, &root, &runner, &opts);
            Ok::<_, RuntimeError>((plan, applied))
        })
        .await;
        let outcome = match result {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(format!("runtime stage task failed: {e}")),
        };
        match outcome {
            Ok((plan, applied)) => {
                let mut detail = plan.describe(&pass.config.runtime.runtime_name);
                if !applied.files.is_empty() {
                    tracing::info!(
                        "runtime: wrote {}",
                        applied
                            .files
                            .iter()
                            .map(|f| f.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                if !applied.restarted.is_empty() {
                    detail.push_str(&format!(" (restarted {})", applied.restarted.join(", ")));
                }
                self.events(&applied, out);
                for remark in plan.remarks() {
                    tracing::info!("runtime: {remark}");
                    detail.push_str(&format!("; {remark}"));
                }
                // One engine's failure is that engine's: the device plugin waits only for the
                // engine the kubelet uses.
                for failure in applied.failures.iter().filter(|f| !f.kubelet) {
                    tracing::error!("runtime: {}: {}", failure.engine.as_str(), failure.error);
                    detail.push_str(&format!("; {} failed: {}", failure.engine.as_str(), failure.error));
                }
                if let Some(failure) = applied.kubelet_failure() {
                    let e = format!(
                        "{} (the engine the kubelet uses) failed: {}",
                        failure.engine.as_str(),
                        failure.error
                    );
                    tracing::error!("runtime stage failed: {e}");
                    out.push(Note::RuntimePlan(None));
                    out.status(id, StageState::Failed, Some(e), Some(detail));
                    return false;
                }
                // A RuntimeClass per runtime the engines got, for pods that name one.
                let mut handlers: Vec<String> = plan
                    .engines
                    .iter()
                    .filter(|e| e.error.is_none() && e.skipped.is_none())
                    .flat_map(|e| e.runtime.names().map(str::to_owned).collect::<Vec<_>>())
                    .collect();
                handlers.sort();
                handlers.dedup();
                if let Some(link) = pass.services.link.as_ref()
                    && !handlers.is_empty()
                {
                    link.runtime_classes(handlers);
                    if let Some(note) = link.runtime_class_note() {
                        detail.push_str(&format!("; {note}"));
                    }
                }
                self.detail = detail;
                out.push(Note::RuntimePlan(Some(plan)));
                self.show(pass, out);
                true
            }
            Err(e) => {
                tracing::error!("runtime stage failed: {e}");
                out.push(Note::RuntimePlan(None));
                out.status(id, StageState::Failed, Some(e), None);
                false
            }
        }
    }

    /// Events for what the pass changed: `RuntimeConfigured` when it wrote files, and
    /// `RuntimeRolledBack` for each engine whose new configuration was put back (once per
    /// engine and reason, however many passes meet it again).
    fn events(&mut self, applied: &rt::Applied, out: &mut Outbox) {
        if !applied.files.is_empty() {
            let files: Vec<String> = applied.files.iter().map(|f| f.display().to_string()).collect();
            let mut message = format!("container runtime configuration written: {}", files.join(", "));
            if !applied.restarted.is_empty() {
                message.push_str(&format!("; restarted {}", applied.restarted.join(", ")));
            }
            out.event(EventType::Normal, "RuntimeConfigured", message);
        }
        let rolled_back: Vec<String> = applied
            .failures
            .iter()
            .filter(|f| matches!(f.error, RuntimeError::Check { .. } | RuntimeError::Restart { .. }))
            .map(|f| format!("{}: {}", f.engine.as_str(), f.error))
            .collect();
        for message in rolled_back.iter().filter(|m| !self.rolled_back.contains(m)) {
            out.event(EventType::Warning, "RuntimeRolledBack", message.clone());
        }
        self.rolled_back = rolled_back;
    }

    /// Rewrites the CDI spec for the pass's inventory (with the device `nodes` the device plugin
    /// hands out) when its bytes change.
    pub(super) fn cdi(&mut self, pass: &Pass<'_>, nodes: &DeviceNodes, out: &mut Outbox) {
        if !pass.config.cdi.enabled {
            self.cdi_detail = None;
            self.cdi_error = None;
            return;
        }
        let Some(inventory) = pass.inventory else { return };
        let path = node_spec::cdi_path(pass.config);
        match node_spec::write_cdi(pass.config, pass.root, inventory, nodes) {
            Ok((written, conflicts)) => {
                if written {
                    tracing::info!("CDI spec written to {}", path.display());
                }
                let mut detail = format!("CDI spec {}", path.display());
                for conflict in conflicts {
                    tracing::warn!("{conflict}");
                    detail.push_str(&format!("; warning: {conflict}"));
                }
                self.cdi_detail = Some(detail);
                self.cdi_error = None;
            }
            Err(RuntimeError::Cdi(CdiError::NoGpus)) => {
                self.cdi_detail = Some("no GPUs: no CDI spec".into());
                self.cdi_error = None;
            }
            Err(e) => {
                tracing::error!("CDI spec {}: {e}", path.display());
                self.cdi_error = Some(e.to_string());
            }
        }
        self.show(pass, out);
    }

    /// Whether the CDI spec must be written again: the last write failed, or it should be
    /// there (CDI on, GPUs known) but is not.
    pub(super) fn cdi_due(&self, pass: &Pass<'_>) -> bool {
        self.cdi_error.is_some()
            || (pass.config.cdi.enabled
                && pass.inventory.is_some_and(|i| !i.gpus.is_empty())
                && !pass.root.join(node_spec::cdi_path(pass.config)).exists())
    }

    /// The runtime stage's status from the engines' and the CDI spec's outcome.
    fn show(&self, pass: &Pass<'_>, out: &mut Outbox) {
        if pass.stages[StageId::Runtime].status.state == StageState::Failed && self.cdi_error.is_none() {
            // An engine failure stays until the next runtime pass says otherwise.
            if self.detail.is_empty() {
                return;
            }
        }
        let detail = match &self.cdi_detail {
            Some(cdi) if !self.detail.is_empty() => format!("{}; {cdi}", self.detail),
            Some(cdi) => cdi.clone(),
            None => self.detail.clone(),
        };
        match &self.cdi_error {
            Some(e) => out.status(StageId::Runtime, StageState::Failed, Some(e.clone()), Some(detail)),
            None => out.status(StageId::Runtime, StageState::Ok, None, Some(detail)),
        }
    }
}

/// `gpu-node-agent runtime …`: the runtime stage by itself.
pub fn runtime_command(config: &Config, root: &HostRoot, command: RuntimeCommand) -> ExitCode {
    logging::init(&config.log);
    let runner = Runner::new(root);
    let (no_restart, dry_run, unconfigure) = match command {
        RuntimeCommand::Configure { no_restart, dry_run } => (no_restart, dry_run, false),
        RuntimeCommand::Unconfigure { no_restart } => (no_restart, false, true),
    };
    if !dry_run {
        match rt::recover(config, root) {
            Ok(Some(note)) => println!("{note}"),
            Ok(None) => {}
            Err(e) => {
                eprintln!("gpu-node-agent: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if unconfigure {
        unconfigure_dra(config, root);
        super::devnodes::remove_dev_char_links(config, root);
        super::operator::undo_on_unconfigure(config, root);
        if let Err(e) = remove_cdi_specs(config, root) {
            eprintln!("gpu-node-agent: {e}");
            return ExitCode::FAILURE;
        }
    }
    let planned = rt::observe(config, root, &runner).and_then(|o| {
        if unconfigure {
            rt::plan_unconfigure(&o, &config.runtime)
        } else {
            rt::plan(&o, &config.runtime)
        }
    });
    let plan = match planned {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    for remark in plan.remarks() {
        println!("{remark}");
    }
    let failed_plans: Vec<String> = plan
        .engines
        .iter()
        .filter_map(|e| e.error.as_ref().map(|m| format!("{}: {m}", e.engine.as_str())))
        .collect();
    if plan.is_empty() {
        match &plan.note {
            Some(note) => println!("{note}"),
            None if failed_plans.is_empty() => println!("{}: already configured, nothing to do", plan.summary()),
            None => {}
        }
        for failure in &failed_plans {
            eprintln!("gpu-node-agent: {failure}");
        }
        return if failed_plans.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if dry_run {
        print!("{}", rt::diff(&plan));
        return ExitCode::SUCCESS;
    }
    let opts = rt::ApplyOptions {
        restart: config.runtime.restart && !no_restart && root.is_real(),
    };
    let applied = rt::apply_all(&plan, config, root, &runner, &opts);
    for f in &applied.files {
        println!("{} {}", if unconfigure { "restored" } else { "wrote" }, f.display());
    }
    if applied.restarted.is_empty() {
        println!("restarted nothing");
    } else {
        println!("restarted {}", applied.restarted.join(", "));
    }
    for failure in &applied.failures {
        eprintln!("gpu-node-agent: {}", failure.error);
    }
    if applied.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `runtime unconfigure`: the CDI specs the agent writes into `[cdi] dir` go (the spec of
/// `[device_plugin] cdi_kind` and the GDS, MOFED, GDRCopy and IMEX-channel specs of its vendor):
/// their hooks name the agent's programs, which leave with the package, so a container started
/// from them afterwards would fail. The directory is followed under the root ([`rt::resolve`]);
/// a spec that is a link loses the link only. DRA claims' specs stay (see [`unconfigure_dra`]).
fn remove_cdi_specs(config: &Config, root: &HostRoot) -> Result<(), String> {
    let kind = &config.device_plugin.cdi_kind;
    let vendor = kind.split_once('/').map_or(kind.as_str(), |(vendor, _)| vendor);
    let extra = FLAG_CLASSES.iter().chain(std::iter::once(&IMEX_CLASS));
    let names =
        std::iter::once(spec_file_name(kind)).chain(extra.map(|class| spec_file_name(&format!("{vendor}/{class}"))));
    let dir = rt::resolve(root, &config.cdi.dir).map_err(|e| format!("the CDI specs were not removed: {e}"))?;
    for name in names {
        let path = root.join(dir.join(&name));
        match std::fs::remove_file(&path) {
            Ok(()) => println!("removed {}", config.cdi.dir.join(&name).display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot remove the CDI spec {}: {e}", path.display())),
        }
    }
    Ok(())
}

/// `runtime unconfigure` on a node whose DRA driver is (or was) on: its ResourceSlices go, so
/// the scheduler stops placing claims on a node whose agent is being removed. Claims prepared
/// already keep their CDI specs (their pods may still run); the checkpoint stays with them.
fn unconfigure_dra(config: &Config, root: &HostRoot) {
    if !config.dra.enabled && !crate::dra::was_on(config, root) {
        return;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpu-node-agent: cannot start the async runtime to remove the ResourceSlices: {e}");
            return;
        }
    };
    match runtime.block_on(crate::dra::remove_slices(config, root)) {
        Ok(n) => println!(
            "removed {n} ResourceSlice(s) of DRA driver {} on node {}",
            config.dra.driver,
            crate::kube::node_name(&config.kubernetes, root)
        ),
        Err(e) => eprintln!(
            "gpu-node-agent: the DRA driver's ResourceSlices were not removed: {e} (the kubelet removes them 30 s \
             after the plugin is gone)"
        ),
    }
}

/// `gpu-node-agent cdi generate`: the CDI spec for the GPUs NVML reports.
pub fn cdi_generate(config: &Config, root: &HostRoot, output: Option<&std::path::Path>) -> ExitCode {
    logging::init(&config.log);
    let gpus = match Gpus::open(&super::nvml::nvml_library(config, root)) {
        Ok(gpus) => gpus,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    let inventory = match gpus.inventory(&root.join("/sys")) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            return Exit::NoNvml.into();
        }
    };
    // The nodes the spec names exist when it is written (not for a spec only printed).
    let printing = output.is_some_and(|p| p == std::path::Path::new("-"));
    if config.driver.create_device_nodes && !printing {
        super::devnodes::report(&super::devnodes::ensure_device_nodes(config, root, Some(&inventory)));
    }
    let nodes = crate::edits::DeviceNodes::gather(&root.join(&config.device_plugin.dev_root), &root.join("/proc"));
    let result = match output {
        Some(p) if p == std::path::Path::new("-") => {
            node_spec::cdi_spec(config, root, &inventory, &nodes).map(|text| print!("{text}"))
        }
        Some(p) => node_spec::cdi_spec(config, root, &inventory, &nodes).and_then(|text| {
            crate::host::write_atomic(p, text.as_bytes(), 0o644)
                .map(|()| println!("wrote {}", p.display()))
                .map_err(Into::into)
        }),
        None => node_spec::write_cdi(config, root, &inventory, &nodes).map(|(written, conflicts)| {
            let path = node_spec::cdi_path(config);
            if written {
                println!("wrote {}", path.display());
            } else {
                println!("{} is up to date", path.display());
            }
            for conflict in conflicts {
                eprintln!("gpu-node-agent: warning: {conflict}");
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-node-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `runtime unconfigure` removes the agent's CDI specs (its kind's and the injections'),
    /// following `[cdi] dir` under the root (an image's `/var/run` → `/run`), and nothing else
    /// there.
    #[test]
    fn unconfigure_removes_the_agents_cdi_specs_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = HostRoot::new(tmp.path());
        let dir = root.join("/run/cdi");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(root.join("/var")).unwrap();
        std::os::unix::fs::symlink("/run", root.join("/var/run")).unwrap();
        let ours = [
            "k8s.device-plugin.nvidia.com-gpu.json",
            "k8s.device-plugin.nvidia.com-gdrcopy.json",
            "k8s.device-plugin.nvidia.com-imex-channel.json",
        ];
        for name in ours.iter().chain(&["nvidia.yaml", "other.com-gpu.json"]) {
            std::fs::write(dir.join(name), "{}").unwrap();
        }
        let config = Config::default();
        assert_eq!(config.cdi.dir, std::path::Path::new("/var/run/cdi"));
        remove_cdi_specs(&config, &root).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["nvidia.yaml", "other.com-gpu.json"]);
        // Nothing left to remove is not an error.
        remove_cdi_specs(&config, &root).unwrap();
    }

    /// The stage by itself, without the loop: off, or held back by the GPU Operator's toolkit,
    /// it writes nothing and lets the stages after it run.
    #[tokio::test]
    async fn the_stage_steps_on_its_own_off_or_held_by_the_operator() {
        use crate::agent::pass::{Fixture, Outbox};
        let mut config = Config::default();
        config.runtime.enabled = false;
        config.cdi.enabled = false;
        let mut fixture = Fixture::new(config);
        let mut stage = RuntimeStage::default();
        let mut out = Outbox::default();
        assert!(stage.step(&fixture.pass(), &mut out).await);
        assert_eq!(
            out.last_status(StageId::Runtime),
            Some((StageState::Disabled, None, Some("[runtime] enabled = false")))
        );
        assert!(!stage.cdi_due(&fixture.pass()), "CDI is off");

        fixture.config.runtime.enabled = true;
        fixture.held.runtime = Some("the GPU Operator's toolkit configured containerd".into());
        let mut out = Outbox::default();
        assert!(stage.step(&fixture.pass(), &mut out).await);
        assert_eq!(
            out.last_status(StageId::Runtime),
            Some((
                StageState::Pending,
                Some("engines not configured: the GPU Operator's toolkit configured containerd"),
                None
            ))
        );
    }
}
