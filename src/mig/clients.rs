//! The host's GPU clients around a MIG change: systemd units (NVSM, DCGM, nv_peer_mem,
//! dcgm-exporter, `[mig] host_gpu_clients`; the kubelet for a mode change with `[mig]
//! stop_kubelet_on_mode_change`) that keep the GPUs open, so that a mode change or a GPU reset
//! fails under them. The GPU Operator's MIG manager stops them with a host driver
//! (`WITH_SHUTDOWN_HOST_GPU_CLIENTS`) and starts them again afterwards.
//!
//! Which units are stopped is planned purely ([`plan_clients`]) from which are active
//! ([`observe_active`]: `systemctl is-active`); [`HostClients`] stops them, in order, right before
//! the first NVML change and starts them again the other way round once the change is over,
//! whatever its outcome. Each stop is recorded first in the state dir
//! ([`STOPPED_UNITS_FILE`]), so that units a crashed agent left stopped are started by the next
//! one ([`start_left_over`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, MigConfig};
use crate::host::HostRoot;
use crate::host::command::{Cmd, Runner};

/// Under the state dir: the units stopped for a MIG change and not started again yet, one per
/// line, in stop order.
pub const STOPPED_UNITS_FILE: &str = "mig-stopped-units";

/// How long one `systemctl is-active` may take.
const IS_ACTIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The units a MIG change would stop if active, in stop order: the kubelet first (only for a
/// mode change, and only with `stop_kubelet_on_mode_change`), then `host_gpu_clients`. Pure.
pub fn candidates(config: &MigConfig, mode_change: bool) -> Vec<String> {
    let kubelet = (mode_change && config.stop_kubelet_on_mode_change).then(|| config.kubelet_unit.clone());
    let mut out: Vec<String> = Vec::new();
    for unit in kubelet.into_iter().chain(config.host_gpu_clients.iter().cloned()) {
        if !out.contains(&unit) {
            out.push(unit);
        }
    }
    out
}

/// The units to stop before a MIG change, in order (started again in reverse): the
/// `candidates` that are `active`. Pure.
pub fn plan_clients(candidates: &[String], active: &BTreeSet<String>) -> Vec<String> {
    candidates.iter().filter(|u| active.contains(*u)).cloned().collect()
}

/// Which of `units` systemd reports active (`systemctl is-active --quiet`). Without systemctl
/// under the root, none. A unit whose state cannot be read counts as inactive (left alone),
/// with a warning.
pub fn observe_active(config: &Config, root: &HostRoot, units: &[String]) -> BTreeSet<String> {
    active_units(&config.runtime.systemctl, root, units)
}

fn active_units(systemctl: &Path, root: &HostRoot, units: &[String]) -> BTreeSet<String> {
    let runner = Runner::new(root);
    if units.is_empty() || !runner.exists(systemctl) {
        return BTreeSet::new();
    }
    units
        .iter()
        .filter(|unit| {
            let cmd = Cmd::new(systemctl)
                .args(["is-active", "--quiet", unit.as_str()])
                .timeout(IS_ACTIVE_TIMEOUT);
            match runner.output(&cmd) {
                Ok(out) => out.success(),
                Err(e) => {
                    tracing::warn!("cannot tell whether {unit} is active, leaving it alone: {e}");
                    false
                }
            }
        })
        .cloned()
        .collect()
}

/// Stops the planned units before a MIG change and starts them again after it.
#[derive(Debug)]
pub struct HostClients {
    root: HostRoot,
    systemctl: PathBuf,
    timeout: Duration,
    /// [`STOPPED_UNITS_FILE`], rooted.
    journal: PathBuf,
    stop: Option<CancellationToken>,
    /// The units it may stop ([`candidates`]).
    candidates: Vec<String>,
    /// The units to stop, in order ([`plan_clients`]), once [`HostClients::stop_all`] ran.
    plan: Vec<String>,
    /// Whether [`HostClients::stop_all`] ran.
    done: bool,
    /// The units stopped (or asked to stop) and not started again yet, in stop order.
    stopped: Vec<String>,
}

impl HostClients {
    /// For the units `candidates` lists (see [`candidates`]); which of them are active is looked
    /// at only when they are to be stopped. `stop` (the daemon's SIGTERM) kills a `systemctl
    /// stop` that hangs.
    pub fn new(
        config: &Config,
        root: &HostRoot,
        candidates: Vec<String>,
        stop: Option<&CancellationToken>,
    ) -> HostClients {
        HostClients {
            root: root.clone(),
            systemctl: config.runtime.systemctl.clone(),
            timeout: config.mig.host_gpu_clients_stop_timeout,
            journal: root.join(config.agent.state_dir.join(STOPPED_UNITS_FILE)),
            stop: stop.cloned(),
            candidates,
            plan: Vec::new(),
            done: false,
            stopped: Vec::new(),
        }
    }

    /// The units stopped and not started again yet.
    pub fn stopped(&self) -> &[String] {
        &self.stopped
    }

    /// Right before the first NVML change: plans which units to stop (the candidates that are
    /// active now, [`observe_active`], [`plan_clients`]) and stops them in order, each within
    /// `[mig] host_gpu_clients_stop_timeout` (only once; later calls do nothing). `Err`: a unit
    /// did not stop (or its stop could not be recorded); every unit asked to stop so far, that
    /// one included, has been started again, and the reason says so.
    pub fn stop_all(&mut self) -> Result<(), String> {
        if std::mem::replace(&mut self.done, true) {
            return Ok(());
        }
        let active = active_units(&self.systemctl, &self.root, &self.candidates);
        self.plan = plan_clients(&self.candidates, &active);
        if !self.plan.is_empty() {
            tracing::info!(
                "host GPU clients to stop before the MIG change: {}",
                self.plan.join(", ")
            );
        }
        let runner = match &self.stop {
            Some(stop) => Runner::new(&self.root).with_stop(stop),
            None => Runner::new(&self.root),
        };
        for unit in self.plan.clone() {
            let mut recorded = self.stopped.clone();
            recorded.push(unit.clone());
            // Recorded before it is stopped: a crash in between leaves it to the next start.
            if let Err(e) = write_journal(&self.journal, &recorded) {
                let e = format!("cannot record that {unit} is stopped for the MIG change ({e}); not stopping it");
                return Err(self.failed(e));
            }
            self.stopped.push(unit.clone());
            tracing::info!("stopping host GPU client {unit} for the MIG change");
            let cmd = Cmd::new(&self.systemctl)
                .args(["stop", unit.as_str()])
                .timeout(self.timeout);
            if let Err(e) = runner.run(&cmd) {
                return Err(self.failed(format!("host GPU client {unit} did not stop: {e}")));
            }
        }
        Ok(())
    }

    /// `reason` with what starting the stopped units again gave.
    fn failed(&mut self, reason: String) -> String {
        let started = self.stopped.clone();
        match self.start_all().as_slice() {
            [] if started.is_empty() => reason,
            [] => format!("{reason}; started again: {}", started.join(", ")),
            problems => format!("{reason}; {}", problems.join("; ")),
        }
    }

    /// After the MIG change, whatever its outcome: starts every stopped unit again, the last
    /// stopped first, and drops the record. Returns one line per unit that did not start (the
    /// MIG change stands; a unit that fails to start is reported once, not retried).
    pub fn start_all(&mut self) -> Vec<String> {
        if self.stopped.is_empty() {
            return Vec::new();
        }
        let stopping = self.stop.as_ref().is_some_and(CancellationToken::is_cancelled);
        let failed = start_units(&self.root, &self.systemctl, self.timeout, &self.stopped, stopping);
        self.stopped.clear();
        remove_journal(&self.journal);
        failed
            .into_iter()
            .map(|(unit, e)| format!("host GPU client {unit} did not start again: {e}"))
            .collect()
    }
}

impl Drop for HostClients {
    /// A panic between stop and start must not leave the units stopped.
    fn drop(&mut self) {
        if !self.stopped.is_empty() {
            for problem in self.start_all() {
                tracing::error!("{problem}");
            }
        }
    }
}

/// Starts `units` in reverse order (with `--no-block` when the agent is stopping: the stop must
/// not wait for them). The units that failed, with why.
fn start_units(
    root: &HostRoot,
    systemctl: &Path,
    timeout: Duration,
    units: &[String],
    no_block: bool,
) -> Vec<(String, String)> {
    // Not killed by the agent's stop: these bring the host back.
    let runner = Runner::new(root);
    let mut failed = Vec::new();
    for unit in units.iter().rev() {
        tracing::info!("starting host GPU client {unit} again after the MIG change");
        let mut cmd = Cmd::new(systemctl).arg("start");
        if no_block {
            cmd = cmd.arg("--no-block");
        }
        let cmd = cmd.arg(unit.as_str()).timeout(timeout);
        if let Err(e) = runner.run(&cmd) {
            tracing::error!("host GPU client {unit} did not start again: {e}");
            failed.push((unit.clone(), e.to_string()));
        }
    }
    failed
}

fn write_journal(path: &Path, units: &[String]) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text: String = units.iter().map(|u| format!("{u}\n")).collect();
    crate::host::write_atomic(path, text.as_bytes(), 0o644).map_err(|e| e.to_string())
}

fn remove_journal(path: &Path) {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
        _ => {}
    }
}

/// At the start of a MIG pass: starts the units an earlier agent stopped for a MIG change and
/// did not start again (it crashed or was killed in between), from [`STOPPED_UNITS_FILE`].
/// Returns the units started and one line per unit that would not start (tried once).
pub fn start_left_over(config: &Config, root: &HostRoot) -> (Vec<String>, Vec<String>) {
    let journal = root.join(config.agent.state_dir.join(STOPPED_UNITS_FILE));
    let Ok(text) = std::fs::read_to_string(&journal) else {
        return (Vec::new(), Vec::new());
    };
    // Only unit names the config accepts are run; anything else in the file is dropped.
    let units: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|u| crate::config::check_unit_name(u).is_ok())
        .map(str::to_string)
        .collect();
    tracing::warn!(
        "host GPU clients left stopped by an interrupted MIG change: {}; starting them again",
        units.join(", ")
    );
    let failed = start_units(
        root,
        &config.runtime.systemctl,
        config.mig.host_gpu_clients_stop_timeout,
        &units,
        false,
    );
    remove_journal(&journal);
    let left: Vec<String> = failed.iter().map(|(u, _)| u.clone()).collect();
    let started = units.into_iter().filter(|u| !left.contains(u)).collect();
    let problems = failed
        .into_iter()
        .map(|(unit, e)| format!("host GPU client {unit} did not start again: {e}"))
        .collect();
    (started, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_kubelet_goes_first_and_only_for_a_mode_change_when_configured() {
        let mut mig = MigConfig {
            host_gpu_clients: units(&["nvsm.service", "nvidia-dcgm.service"]),
            ..MigConfig::default()
        };
        assert_eq!(candidates(&mig, true), ["nvsm.service", "nvidia-dcgm.service"]);
        mig.stop_kubelet_on_mode_change = true;
        assert_eq!(
            candidates(&mig, true),
            ["kubelet.service", "nvsm.service", "nvidia-dcgm.service"]
        );
        assert_eq!(candidates(&mig, false), ["nvsm.service", "nvidia-dcgm.service"]);
        mig.host_gpu_clients.push("kubelet.service".into());
        assert_eq!(
            candidates(&mig, true),
            ["kubelet.service", "nvsm.service", "nvidia-dcgm.service"],
            "each unit once"
        );
    }

    #[test]
    fn only_active_units_are_planned_in_the_configured_order() {
        let all = units(&["nvsm.service", "nv_peer_mem.service", "nvidia-dcgm.service"]);
        let active: BTreeSet<String> = units(&["nvidia-dcgm.service", "nvsm.service", "other.service"])
            .into_iter()
            .collect();
        assert_eq!(plan_clients(&all, &active), ["nvsm.service", "nvidia-dcgm.service"]);
        assert!(plan_clients(&all, &BTreeSet::new()).is_empty());
    }
}
