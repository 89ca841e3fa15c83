//! Keeps the advertised resources in step with the kubelet: serves one socket per resource,
//! registers each, re-registers when the kubelet restarts (its `kubelet.sock` is recreated or our
//! sockets are deleted), and swaps resources in and out without restarting the process.
//!
//! The replicas of a resource shared through MPS are advertised healthy only while its control
//! daemon answers: the manager applies the daemons' states ([`crate::plugin::mps`]) to what it
//! serves and is woken when one changes.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, mpsc, watch};

use super::server::StreamStatus;
use super::server::{PluginContext, PluginStats, ServedPlugin, register};
use crate::devices::{Health, Resource};
use crate::host::backoff::{Backoff, Jitter};
use crate::host::socket::file_id;

/// The kubelet's registration socket name inside the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How often a socket another process serves is looked at again (one `lstat` and one
/// connection, closed at once), so the agent takes over soon after that process has left.
const CONFLICT_RECHECK: Duration = Duration::from_secs(2);

/// What the agent asks of the manager.
#[derive(Debug)]
pub enum Command {
    /// Advertise exactly these resources (health already applied) with this context.
    Set {
        resources: Vec<Resource>,
        ctx: Arc<PluginContext>,
    },
}

/// The device plugin's state, for status.json and `gpu-node-agent status`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PluginStatus {
    /// Whether `kubelet.sock` exists.
    pub kubelet_present: bool,
    pub resources: Vec<ResourceStatus>,
    /// Per served resource (same names as `resources`): the kubelet's `ListAndWatch` streams,
    /// whether one is open and how many devices the last message listed.
    pub streams: BTreeMap<String, StreamStatus>,
    /// Resources not served because another process serves their socket (NVIDIA's device
    /// plugin): its socket is left alone and looked at again at each retry.
    pub conflicts: Vec<SocketConflict>,
}

/// A resource whose socket a live server of another process holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketConflict {
    pub resource: String,
    pub socket: String,
    /// The holder's pid (`SO_PEERCRED`), when the kernel said.
    pub pid: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResourceStatus {
    pub name: String,
    pub socket: String,
    pub registered: bool,
    /// Unix seconds of the last successful registration.
    pub registered_at: Option<u64>,
    pub devices: usize,
    pub healthy: usize,
    pub error: Option<String>,
    /// How many `ListAndWatch` streams the kubelet has open for this resource (0: it does not
    /// watch it).
    #[serde(default)]
    pub streams_open: usize,
    /// How many devices the last `ListAndWatch` message listed; `None` before the first.
    #[serde(default)]
    pub devices_sent: Option<usize>,
}

struct Entry {
    plugin: ServedPlugin,
    registered_at: Option<SystemTime>,
    /// The `kubelet.sock` (device, inode) the registration went to: a kubelet that started
    /// since gets one registration, one that already has it none.
    kubelet: Option<(u64, u64)>,
    error: Option<String>,
}

/// Runs the plugin side until `commands` closes, then stops every server and removes its socket.
pub struct PluginManager {
    dir: PathBuf,
    register_timeout: Duration,
    desired: Vec<Resource>,
    ctx: watch::Sender<Arc<PluginContext>>,
    served: BTreeMap<String, Entry>,
    kubelet_id: Option<(u64, u64)>,
    /// Registration retries: doubling from RETRY_MIN to RETRY_MAX.
    retry: Backoff,
    retry_at: Option<Instant>,
    stats: Arc<PluginStats>,
    status: watch::Sender<PluginStatus>,
    /// Woken by the servers when a `ListAndWatch` stream opens, sends or ends.
    streams_changed: Arc<Notify>,
    /// Desired resources whose socket another process serves, by name.
    conflicts: BTreeMap<String, SocketConflict>,
    /// When to look at those sockets again (their own timer: the registration backoff must not
    /// hold back the resources that are served).
    conflict_at: Option<Instant>,
}

impl PluginManager {
    pub fn new(
        dir: PathBuf,
        register_timeout: Duration,
        ctx: Arc<PluginContext>,
        stats: Arc<PluginStats>,
    ) -> (PluginManager, watch::Receiver<PluginStatus>) {
        let (status, status_rx) = watch::channel(PluginStatus::default());
        let (ctx, _) = watch::channel(ctx);
        let manager = PluginManager {
            dir,
            register_timeout,
            desired: Vec::new(),
            ctx,
            served: BTreeMap::new(),
            kubelet_id: None,
            retry: Backoff::with_jitter(RETRY_MIN, RETRY_MAX, Jitter::None),
            retry_at: None,
            stats,
            status,
            streams_changed: Arc::new(Notify::new()),
            conflicts: BTreeMap::new(),
            conflict_at: None,
        };
        (manager, status_rx)
    }

    pub async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        let mut watch = DirWatch::new(&self.dir);
        let streams_changed = self.streams_changed.clone();
        // The MPS daemons' states: a change serves the replicas' new health.
        let mut mps_states = self.ctx.borrow().allocate.mps.states.clone();
        loop {
            self.sync().await;
            let retry = match (self.retry_at, self.conflict_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    Some(Command::Set { resources, ctx }) => {
                        if ctx.allocate.mps.states != mps_states {
                            mps_states = ctx.allocate.mps.states.clone();
                        }
                        self.desired = resources;
                        self.ctx.send_replace(ctx);
                    }
                    None => break,
                },
                () = mps_states.changed() => {}
                events = watch.changed() => {
                    if events {
                        watch.settle().await;
                    }
                }
                () = sleep_until(retry) => {}
                () = streams_changed.notified() => {}
            }
        }
        for (name, entry) in std::mem::take(&mut self.served) {
            tracing::info!(resource = %name, "stopping device plugin server, removing {}", entry.plugin.socket.display());
            entry.plugin.stop().await;
        }
        self.publish();
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    /// One pass: make what is served and registered match what is desired and what the kubelet
    /// needs. Cheap when nothing changed (a few stat calls).
    async fn sync(&mut self) {
        // Resources no longer wanted: stop them and remove their sockets.
        let wanted: Vec<String> = self.desired.iter().map(|r| r.name.clone()).collect();
        let gone: Vec<String> = self.served.keys().filter(|n| !wanted.contains(n)).cloned().collect();
        self.conflicts.retain(|name, _| wanted.contains(name));
        for name in gone {
            if let Some(entry) = self.served.remove(&name) {
                tracing::info!(resource = %name, "resource no longer advertised: stopping its server");
                entry.plugin.stop().await;
            }
        }

        let kubelet = file_id(&self.kubelet_socket()).filter(|_| is_socket(&self.kubelet_socket()));
        if kubelet.is_none() {
            if self.kubelet_id.take().is_some() {
                tracing::warn!(
                    "kubelet socket {} is gone: waiting for the kubelet to come back",
                    self.kubelet_socket().display()
                );
            }
            for entry in self.served.values_mut() {
                entry.registered_at = None;
                entry.kubelet = None;
            }
            self.retry_at = None;
            self.publish();
            return;
        }
        if kubelet != self.kubelet_id {
            if self.kubelet_id.is_some() {
                tracing::info!(
                    "kubelet restarted ({} was recreated): registering again",
                    self.kubelet_socket().display()
                );
            } else {
                tracing::info!("kubelet found at {}", self.kubelet_socket().display());
            }
            self.kubelet_id = kubelet;
            // What registered with this kubelet already (the socket was replaced while the last
            // pass ran) stays registered.
            for entry in self.served.values_mut().filter(|e| e.kubelet != kubelet) {
                entry.registered_at = None;
            }
            self.retry.reset();
            self.retry_at = None;
        }

        // Serve every desired resource; a socket the kubelet deleted means serve anew.
        let ctx = self.ctx.borrow().clone();
        for mut resource in self.desired.clone() {
            // MPS replicas are healthy only while their daemon answers.
            ctx.allocate.mps.apply_health(&mut resource);
            let name = resource.name.clone();
            let intact = self.served.get(&name).map(|e| e.plugin.socket_intact());
            match intact {
                Some(true) => {
                    if let Some(entry) = self.served.get(&name) {
                        entry.plugin.update(resource);
                    }
                }
                Some(false) | None => {
                    if let Some(old) = self.served.remove(&name) {
                        tracing::info!(resource = %name, "socket {} was removed (kubelet restart?): serving anew", old.plugin.socket.display());
                        old.plugin.stop().await;
                    }
                    let started = ServedPlugin::start(
                        &self.dir,
                        resource,
                        self.ctx.subscribe(),
                        self.stats.clone(),
                        self.streams_changed.clone(),
                    );
                    match started {
                        Ok(plugin) => {
                            if self.conflicts.remove(&name).is_some() {
                                tracing::info!(resource = %name, "{} is free again: serving it", plugin.socket.display());
                            }
                            self.served.insert(
                                name,
                                Entry {
                                    plugin,
                                    registered_at: None,
                                    kubelet: None,
                                    error: None,
                                },
                            );
                        }
                        Err(e) => {
                            if let Some(holder) = e.holder() {
                                // Another plugin's live socket: left alone, looked at again at
                                // [`CONFLICT_RECHECK`], on its own timer.
                                let conflict = SocketConflict {
                                    resource: name.clone(),
                                    socket: self
                                        .dir
                                        .join(resource_socket(&name, &self.desired))
                                        .display()
                                        .to_string(),
                                    pid: holder.pid,
                                };
                                if self.conflicts.get(&name) != Some(&conflict) {
                                    tracing::warn!(resource = %name, "not serving {name}: {e}");
                                }
                                self.conflicts.insert(name, conflict);
                            } else {
                                let msg = format!("cannot serve {name} in {}: {e}", self.dir.display());
                                tracing::error!("{msg}");
                                self.schedule_retry();
                            }
                        }
                    }
                }
            }
        }

        self.conflict_at = (!self.conflicts.is_empty()).then(|| Instant::now() + CONFLICT_RECHECK);

        // Register what is not registered yet with this kubelet: after a failure, when the
        // backoff says (a new kubelet resets it), not at every event in the directory.
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            self.publish();
            return;
        }
        let mut failed = false;
        let kubelet_socket = self.kubelet_socket();
        for (name, entry) in self.served.iter_mut().filter(|(_, e)| e.registered_at.is_none()) {
            let endpoint = entry
                .plugin
                .socket
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            // Which kubelet gets it: the socket as it is now, not as the pass found it (a
            // restarting kubelet replaces it at any moment). Replaced during the call, the
            // registration counts for neither and the next pass registers again.
            let before = file_id(&kubelet_socket);
            match register(&kubelet_socket, &endpoint, name, self.register_timeout).await {
                Ok(()) => {
                    tracing::info!(resource = %name, socket = %entry.plugin.socket.display(), "registered with the kubelet");
                    let after = file_id(&kubelet_socket);
                    entry.kubelet = before.filter(|b| Some(*b) == after);
                    entry.registered_at = Some(SystemTime::now());
                    entry.error = None;
                    if let Some(metrics) = &self.stats.metrics {
                        metrics.registration(name);
                    }
                }
                Err(e) => {
                    tracing::warn!(resource = %name, "registration failed, will retry: {e}");
                    entry.error = Some(e.to_string());
                    failed = true;
                }
            }
        }
        if failed {
            self.schedule_retry();
        } else {
            self.retry.reset();
            self.retry_at = None;
        }
        self.publish();
    }

    fn schedule_retry(&mut self) {
        self.retry_at = Some(Instant::now() + self.retry.next());
    }

    fn publish(&self) {
        let resources = self
            .served
            .iter()
            .map(|(name, e)| {
                let resource = e.plugin.resource();
                let streams = e.plugin.streams();
                ResourceStatus {
                    name: name.clone(),
                    socket: e.plugin.socket.display().to_string(),
                    registered: e.registered_at.is_some(),
                    registered_at: e
                        .registered_at
                        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                        .map(|d| d.as_secs()),
                    devices: resource.devices.len(),
                    healthy: resource
                        .devices
                        .values()
                        .filter(|d| d.health == Health::Healthy)
                        .count(),
                    error: e.error.clone(),
                    streams_open: streams.open,
                    devices_sent: streams.devices_sent,
                }
            })
            .collect();
        let streams = self
            .served
            .iter()
            .map(|(name, e)| (name.clone(), e.plugin.streams()))
            .collect();
        let status = PluginStatus {
            kubelet_present: self.kubelet_id.is_some(),
            resources,
            streams,
            conflicts: self.conflicts.values().cloned().collect(),
        };
        self.status.send_if_modified(|s| {
            let changed = *s != status;
            *s = status;
            changed
        });
    }
}

/// The socket file name of the desired resource `name`.
fn resource_socket(name: &str, desired: &[Resource]) -> String {
    desired
        .iter()
        .find(|r| r.name == name)
        .map(|r| r.socket_name())
        .unwrap_or_default()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Wakes the manager when something changes in the device-plugin directory: inotify when it
/// can (no idle CPU), polling when inotify is unavailable (e.g. `fs.inotify.max_user_instances`
/// exhausted) or the directory does not exist yet.
struct DirWatch {
    dir: PathBuf,
    inotify: Option<AsyncFd<InotifyFd>>,
    watching: bool,
}

/// A kubelet (re)start is a burst of socket events (its cleanup deletes every socket, then it
/// binds a new `kubelet.sock`): the manager looks once the directory has been quiet this long...
const SETTLE: Duration = Duration::from_millis(20);
/// ...or this long after the first event, whichever comes first.
const SETTLE_MAX: Duration = Duration::from_millis(200);
const POLL_NO_INOTIFY: Duration = Duration::from_millis(250);
const POLL_NO_DIR: Duration = Duration::from_millis(500);

impl DirWatch {
    fn new(dir: &Path) -> DirWatch {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| tracing::warn!("inotify unavailable ({e}); polling {} instead", dir.display()))
            .ok()
            .and_then(|i| {
                // SAFETY: the Inotify owns its fd, keeps it open until dropped, and the AsyncFd
                // owns the Inotify, so the fd stays valid and the same for the AsyncFd's life.
                unsafe { AsyncFd::register_with_interest(InotifyFd(i), tokio::io::Interest::READABLE) }.ok()
            });
        DirWatch {
            dir: dir.to_path_buf(),
            inotify,
            watching: false,
        }
    }

    /// Waits for the directory to be quiet for [`SETTLE`] (at most [`SETTLE_MAX`]): one look
    /// at a kubelet restart's end state instead of one per event, in whatever order they came.
    async fn settle(&mut self) {
        let deadline = tokio::time::Instant::now() + SETTLE_MAX;
        while tokio::time::Instant::now() < deadline {
            if tokio::time::timeout(SETTLE, self.changed()).await.is_err() {
                return;
            }
        }
    }

    /// Waits until the directory may have changed: `true` when inotify reported events (worth
    /// settling), `false` after a poll interval or when the watch was just (re)established.
    async fn changed(&mut self) -> bool {
        let Some(fd) = &self.inotify else {
            tokio::time::sleep(POLL_NO_INOTIFY).await;
            return false;
        };
        if !self.watching {
            let flags = AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF;
            match fd.get_ref().0.add_watch(&self.dir, flags) {
                Ok(_) => {
                    self.watching = true;
                    return false; // the directory appeared: let the caller look
                }
                Err(_) => {
                    tokio::time::sleep(POLL_NO_DIR).await;
                    return false;
                }
            }
        }
        match fd.readable().await {
            Ok(mut guard) => match guard.get_inner().0.read_events() {
                Ok(events) => {
                    if events.iter().any(|e| {
                        e.mask.intersects(
                            AddWatchFlags::IN_IGNORED | AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF,
                        )
                    }) {
                        self.watching = false;
                    }
                    !events.is_empty()
                }
                Err(nix::errno::Errno::EAGAIN) => {
                    guard.clear_ready();
                    false
                }
                Err(e) => {
                    tracing::warn!("reading inotify events failed ({e}); polling instead");
                    self.inotify = None;
                    false
                }
            },
            Err(_) => {
                self.inotify = None;
                false
            }
        }
    }
}
