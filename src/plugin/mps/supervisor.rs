//! The control daemons as the agent's children: each runs `nvidia-cuda-mps-control -f` on a
//! thread of its own that starts it, sets its limits through the control client, watches it and
//! starts it again (with backoff) when it dies, and sends `quit` when told to stop. The daemon
//! and every control client call run in a container of their own ([`super::contain`]); the
//! folders they share with pods are made and cleaned through handles ([`super::folders`]).
//!
//! Every daemon's state is on a [`DaemonBoard`] that the device plugin watches: a daemon is
//! [`DaemonState::Running`] only once its control client has answered and its limits are set, so
//! its replicas are advertised healthy (and `Allocate` answers for them) only then.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::contain::Sandbox;
use super::folders::{self, Folders};
use super::{CONTROL_PROGRAM, MpsDaemon, PROGRAM_DIRS};
use crate::host::backoff::Backoff;
use crate::nvml::{ComputeMode, Gpus};

/// How long a new daemon gets to answer its control client.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// How long a daemon gets to exit after `quit` before it is killed.
const QUIT_WITHIN: Duration = Duration::from_secs(10);
/// How often a thread looks at its daemon and its stop flag.
const POLL: Duration = Duration::from_millis(100);
/// Restart delays after a daemon died or could not start.
const RESTART_MIN: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(60);
/// How much of a daemon's stderr an error quotes.
const STDERR_TAIL: usize = 2048;

/// Where a daemon is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DaemonState {
    Starting,
    Running,
    /// It died or could not start; the next attempt is due after a backoff.
    Restarting,
    /// It cannot start until the config or the node changes (no control program, compute mode
    /// refused).
    Failed,
    Stopped,
}

/// A daemon's state for the status file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStatus {
    pub resource: String,
    pub state: DaemonState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Host path of the pipe folder.
    pub pipe_dir: String,
    pub gpus: Vec<String>,
    pub restarts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

type Notify = Arc<dyn Fn() + Send + Sync>;

type Statuses = BTreeMap<String, DaemonStatus>;

/// The daemons' states by resource, as the supervisor and its threads set them; the device
/// plugin reads them through a [`DaemonWatch`] (health of the replicas, `Allocate`) and is woken
/// when one changes, without waiting for the agent's loop.
#[derive(Clone)]
pub struct DaemonBoard(Arc<watch::Sender<Statuses>>);

impl Default for DaemonBoard {
    fn default() -> Self {
        DaemonBoard::new()
    }
}

impl DaemonBoard {
    pub fn new() -> DaemonBoard {
        DaemonBoard(Arc::new(watch::channel(Statuses::new()).0))
    }

    /// A reader of the board.
    pub fn watch(&self) -> DaemonWatch {
        DaemonWatch(self.0.subscribe())
    }

    /// Puts `status` on the board (replacing what its resource had).
    pub fn insert(&self, status: DaemonStatus) {
        self.0.send_modify(|m| {
            m.insert(status.resource.clone(), status);
        });
    }

    /// Changes the status of `resource`, if it is on the board; readers are woken only when it
    /// changed.
    fn update(&self, resource: &str, f: impl FnOnce(&mut DaemonStatus)) {
        self.0.send_if_modified(|m| match m.get_mut(resource) {
            Some(status) => {
                let before = status.clone();
                f(status);
                *status != before
            }
            None => false,
        });
    }

    fn remove(&self, resource: &str) {
        self.0.send_if_modified(|m| m.remove(resource).is_some());
    }

    fn get(&self, resource: &str) -> Option<DaemonStatus> {
        self.0.borrow().get(resource).cloned()
    }
}

/// What the device plugin reads of a [`DaemonBoard`]. Two are equal when they read the same
/// board. The default reads a board nobody writes (no daemon ever runs).
#[derive(Clone, Debug)]
pub struct DaemonWatch(watch::Receiver<Statuses>);

impl Default for DaemonWatch {
    fn default() -> Self {
        DaemonBoard::new().watch()
    }
}

impl PartialEq for DaemonWatch {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_channel(&other.0)
    }
}

impl Eq for DaemonWatch {}

impl DaemonWatch {
    /// The daemon of `resource` as it is now; `None` when the supervisor has none (yet).
    pub fn status(&self, resource: &str) -> Option<DaemonStatus> {
        self.0.borrow().get(resource).cloned()
    }

    /// Waits until a daemon's state changed since the last wait (forever when nobody writes
    /// the board any more).
    pub async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// One daemon's place on the board.
#[derive(Clone)]
struct Slot {
    resource: String,
    board: DaemonBoard,
}

impl Slot {
    fn update(&self, f: impl FnOnce(&mut DaemonStatus)) {
        self.board.update(&self.resource, f);
    }

    fn get(&self) -> Option<DaemonStatus> {
        self.board.get(&self.resource)
    }
}

struct Running {
    plan: MpsDaemon,
    stop: Arc<AtomicBool>,
    status: Slot,
    thread: Option<JoinHandle<()>>,
}

/// The running control daemons, by resource.
pub struct Supervisor {
    root: PathBuf,
    daemons: BTreeMap<String, Running>,
    board: DaemonBoard,
    notify: Notify,
}

impl Supervisor {
    /// `root` is the agent's `--root`; the daemons' states go on `board`; `notify` is called
    /// (from the daemons' threads) whenever a daemon's state changes.
    pub fn new(root: &Path, board: DaemonBoard, notify: Notify) -> Supervisor {
        Supervisor {
            root: root.to_path_buf(),
            daemons: BTreeMap::new(),
            board,
            notify,
        }
    }

    /// Brings the daemons to `plans`: stops those no longer planned or planned differently (compute
    /// mode back to `DEFAULT`), starts the new ones (compute mode `EXCLUSIVE_PROCESS` first), and
    /// tries again those that could not start.
    /// `driver_root` is where the control program is looked for.
    pub fn apply(&mut self, plans: &[MpsDaemon], driver_root: &Path, gpus: &Gpus) {
        let wanted: BTreeMap<&str, &MpsDaemon> = plans.iter().map(|p| (p.resource.as_str(), p)).collect();
        let gone: Vec<String> = self
            .daemons
            .iter()
            // A daemon that could not start at all (no program, compute mode refused) is tried
            // again: the driver may have been installed since.
            .filter(|(name, r)| r.thread.is_none() || wanted.get(name.as_str()).is_none_or(|p| **p != r.plan))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            if let Some(running) = self.daemons.remove(&name) {
                self.stop_one(running, gpus);
            }
        }
        for plan in plans {
            if !self.daemons.contains_key(&plan.resource) {
                let running = self.start_one(plan, driver_root, gpus);
                self.daemons.insert(plan.resource.clone(), running);
            }
        }
    }

    /// Stops every daemon (agent shutdown, or MPS switched off).
    pub fn stop_all(&mut self, gpus: &Gpus) {
        for (_, running) in std::mem::take(&mut self.daemons) {
            self.stop_one(running, gpus);
        }
    }

    /// The daemons' states, by resource.
    pub fn statuses(&self) -> Vec<DaemonStatus> {
        self.daemons.values().filter_map(|r| r.status.get()).collect()
    }

    fn start_one(&self, plan: &MpsDaemon, driver_root: &Path, gpus: &Gpus) -> Running {
        self.board.insert(DaemonStatus {
            resource: plan.resource.clone(),
            state: DaemonState::Starting,
            pid: None,
            pipe_dir: plan.pipe_dir.display().to_string(),
            gpus: plan.gpus.iter().map(|g| g.uuid.clone()).collect(),
            restarts: 0,
            error: None,
        });
        let status = Slot {
            resource: plan.resource.clone(),
            board: self.board.clone(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let fail = |error: String| {
            tracing::error!(resource = %plan.resource, "MPS control daemon: {error}");
            status.update(|s| {
                s.state = DaemonState::Failed;
                s.error = Some(error);
            });
        };
        let Some(program) = super::find_program(&self.root, driver_root) else {
            let dirs: Vec<String> = PROGRAM_DIRS
                .iter()
                .map(|d| driver_root.join(d.trim_start_matches('/')).display().to_string())
                .collect();
            fail(format!(
                "cannot start the MPS control daemon for {}: {CONTROL_PROGRAM} not found in {} (the driver's user-space; [device_plugin] driver_root)",
                plan.resource,
                dirs.join(", ")
            ));
            return Running {
                plan: plan.clone(),
                stop,
                status,
                thread: None,
            };
        };
        // The folders containers mount exist before the replicas are advertised, even while the
        // daemon is still starting.
        if let Err(e) = Folders::open(&self.root, plan) {
            fail(format!(
                "cannot start the MPS control daemon for {}: {e}",
                plan.resource
            ));
            return Running {
                plan: plan.clone(),
                stop,
                status,
                thread: None,
            };
        }
        for g in &plan.gpus {
            if let Err(e) = gpus.set_compute_mode(&g.uuid, ComputeMode::ExclusiveProcess) {
                fail(format!(
                    "cannot start the MPS control daemon for {}: compute mode EXCLUSIVE_PROCESS on GPU {} ({}): {e}",
                    plan.resource, g.index, g.uuid
                ));
                return Running {
                    plan: plan.clone(),
                    stop,
                    status,
                    thread: None,
                };
            }
        }
        tracing::info!(
            resource = %plan.resource,
            "starting the MPS control daemon {} for GPU(s) {}",
            program.display(),
            plan.gpus.iter().map(|g| g.index.to_string()).collect::<Vec<_>>().join(", ")
        );
        let worker = Worker {
            plan: plan.clone(),
            root: self.root.clone(),
            driver_root: driver_root.to_path_buf(),
            program,
            stop: stop.clone(),
            status: status.clone(),
            notify: self.notify.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("mps {}", plan.resource))
            .spawn(move || worker.run())
            .map_err(|e| fail(format!("cannot start a thread for the MPS control daemon: {e}")))
            .ok();
        Running {
            plan: plan.clone(),
            stop,
            status,
            thread,
        }
    }

    fn stop_one(&self, mut running: Running, gpus: &Gpus) {
        let plan = &running.plan;
        tracing::info!(resource = %plan.resource, "stopping the MPS control daemon");
        running.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = running.thread.take() {
            let _ = thread.join();
        }
        for g in &plan.gpus {
            if let Err(e) = gpus.set_compute_mode(&g.uuid, ComputeMode::Default) {
                tracing::warn!(
                    "MPS for {}: cannot set compute mode DEFAULT back on GPU {} ({}): {e}",
                    plan.resource,
                    g.index,
                    g.uuid
                );
            }
        }
        remove_started(&self.root, plan);
        // Off the board: the replicas of a resource without a daemon are not ready.
        running.status.update(|s| s.state = DaemonState::Stopped);
        self.board.remove(&plan.resource);
        (self.notify)();
    }
}

/// Removes `.started` through handles ([`folders::remove_started`]); a failure is logged.
fn remove_started(root: &Path, plan: &MpsDaemon) {
    if let Err(e) = folders::remove_started(root, plan) {
        tracing::warn!(resource = %plan.resource, "MPS control daemon: {e}");
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One daemon's thread.
struct Worker {
    plan: MpsDaemon,
    root: PathBuf,
    /// Where the control program was found (host path, without the root): the container gets
    /// its user space.
    driver_root: PathBuf,
    /// Host path (without the root).
    program: PathBuf,
    stop: Arc<AtomicBool>,
    status: Slot,
    notify: Notify,
}

impl Worker {
    fn run(self) {
        let mut backoff = Backoff::new(RESTART_MIN, RESTART_MAX);
        let mut attempts = 0u32;
        while !self.stopped() {
            if attempts > 0 {
                self.status.update(|s| s.restarts = attempts);
            }
            attempts += 1;
            match self.start() {
                Ok((child, stderr, sandbox)) => {
                    // It answered its control client and has its limits: its replicas are ready.
                    self.status.update(|s| {
                        s.state = DaemonState::Running;
                        s.pid = Some(child.id());
                        s.error = None;
                    });
                    (self.notify)();
                    tracing::info!(resource = %self.plan.resource, pid = child.id(), "MPS control daemon running");
                    backoff.reset();
                    if let Some(error) = self.watch(child, &stderr, &sandbox) {
                        self.set_error(error);
                    } else {
                        break;
                    }
                }
                Err(error) => self.set_error(error),
            }
            let wait = backoff.next();
            let until = Instant::now() + wait;
            while Instant::now() < until && !self.stopped() {
                std::thread::sleep(POLL);
            }
        }
        remove_started(&self.root, &self.plan);
        self.status.update(|s| {
            s.state = DaemonState::Stopped;
            s.pid = None;
        });
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn set_error(&self, error: String) {
        tracing::error!(resource = %self.plan.resource, "MPS control daemon: {error}");
        self.status.update(|s| {
            s.state = DaemonState::Restarting;
            s.pid = None;
            s.error = Some(error);
        });
        (self.notify)();
    }

    /// Starts the daemon in its container and sets its limits; `Err` says what failed, naming
    /// the program, the pipe folder and the GPUs.
    fn start(&self) -> Result<(Child, Arc<Mutex<String>>, Sandbox), String> {
        let plan = &self.plan;
        let what = format!(
            "{} -f for {} (pipe folder {}, GPU(s) {})",
            self.program.display(),
            plan.resource,
            plan.pipe_dir.display(),
            plan.gpus.iter().map(|g| g.uuid.as_str()).collect::<Vec<_>>().join(",")
        );
        // Opened (and made) again at each start: what a pod planted since is refused.
        let folders = Folders::open(&self.root, plan).map_err(|e| format!("{what}: {e}"))?;
        let sandbox = Sandbox::new(&self.root, &self.driver_root, &self.program, plan, &folders)
            .map_err(|e| format!("{what}: cannot prepare its container: {e}"))?;
        // A daemon left by an agent that did not stop cleanly holds the pipe: quit it first.
        if self.client(&sandbox, "get_default_active_thread_percentage").is_ok() {
            tracing::info!(resource = %plan.resource, "quitting an MPS control daemon left from before");
            let _ = self.client(&sandbox, "quit");
        }
        let (mut command, mut report) = sandbox.command().map_err(|e| format!("{what}: {e}"))?;
        command
            .arg("-f")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = match command.spawn() {
            Ok(child) => child,
            // The agent needs CAP_SYS_ADMIN (namespaces, mounts) and CAP_SETPCAP.
            Err(e) => return Err(format!("{what}: {}", sandbox.explain(&mut report, &e))),
        };
        report.spawned();
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut s = lock(&sink);
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if s.len() > STDERR_TAIL {
                        let cut = s.len() - STDERR_TAIL;
                        let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(s.len());
                        s.drain(..cut);
                    }
                }
            });
        }
        let exited = |child: &mut Child, stderr: &Mutex<String>| -> Option<String> {
            let status = child.try_wait().ok().flatten()?;
            Some(format!("{what} exited with {status}: {}", lock(stderr).trim()))
        };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(e) = exited(&mut child, &stderr) {
                return Err(e);
            }
            if self.stopped() {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what}: stopped while starting"));
            }
            if self.client(&sandbox, "get_default_active_thread_percentage").is_ok() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{what}: the control daemon did not answer within {}s",
                    READY_WITHIN.as_secs()
                ));
            }
            std::thread::sleep(POLL);
        }
        for command in plan.control_commands() {
            if let Err(e) = self.client(&sandbox, &command) {
                let _ = self.client(&sandbox, "quit");
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what}: `{command}` failed: {e}"));
            }
        }
        if let Err(e) = folders.mark_started(plan) {
            let _ = self.client(&sandbox, "quit");
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what}: {e}"));
        }
        Ok((child, stderr, sandbox))
    }

    /// Waits for the daemon to exit or for the stop flag; `Some(error)` when it died, `None`
    /// when it was stopped.
    fn watch(&self, mut child: Child, stderr: &Mutex<String>, sandbox: &Sandbox) -> Option<String> {
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                remove_started(&self.root, &self.plan);
                return Some(format!(
                    "{} for {} exited with {status}: {}",
                    self.program.display(),
                    self.plan.resource,
                    lock(stderr).trim()
                ));
            }
            if self.stopped() {
                if let Err(e) = self.client(sandbox, "quit") {
                    tracing::warn!(resource = %self.plan.resource, "MPS control daemon: quit failed: {e}");
                }
                let deadline = Instant::now() + QUIT_WITHIN;
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        return None;
                    }
                    std::thread::sleep(POLL);
                }
                tracing::warn!(resource = %self.plan.resource, "MPS control daemon did not quit; killing it");
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    /// One command through the control client (the program without arguments, the command on
    /// its stdin as NVIDIA sends it), in the daemon's container; its output, or why it failed.
    fn client(&self, sandbox: &Sandbox, command: &str) -> Result<String, String> {
        let (mut client, mut report) = sandbox.command()?;
        let spawned = client
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = spawned.map_err(|e| sandbox.explain(&mut report, &e))?;
        report.spawned();
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(command.as_bytes());
        }
        let out = child
            .wait_with_output()
            .map_err(|e| format!("{}: {e}", self.program.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() {
            Ok(stdout)
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
            Err(format!("{} ({}): {stdout}{stderr}", out.status, command))
        }
    }
}
