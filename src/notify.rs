//! The systemd notify protocol (`sd_notify`): `READY=1` once the first reconcile has finished,
//! `STATUS=` with the stages, `WATCHDOG=1` from the main loop, `STOPPING=1`. Datagrams to
//! `$NOTIFY_SOCKET` (a path, or an abstract name starting with `@`); a no-op without it.

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Where to send notifications, from the environment systemd sets.
#[derive(Debug, Default)]
pub struct Notifier {
    socket: Option<(UnixDatagram, std::os::unix::net::SocketAddr)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` (the watchdog applies only
    /// when it names this process, or no process).
    pub fn from_env() -> Notifier {
        let socket = std::env::var_os("NOTIFY_SOCKET").and_then(|path| {
            let path = path.to_string_lossy().into_owned();
            let addr = match path.strip_prefix('@') {
                Some(name) => {
                    use std::os::linux::net::SocketAddrExt;
                    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?
                }
                None => std::os::unix::net::SocketAddr::from_pathname(&path).ok()?,
            };
            match UnixDatagram::unbound() {
                Ok(s) => Some((s, addr)),
                Err(e) => {
                    tracing::warn!("cannot open a socket for NOTIFY_SOCKET {path}: {e}");
                    None
                }
            }
        });
        let ours = std::env::var("WATCHDOG_PID")
            .ok()
            .is_none_or(|pid| pid.trim() == std::process::id().to_string());
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&us| us > 0 && ours)
            .map(Duration::from_micros);
        Notifier { socket, watchdog }
    }

    /// Whether systemd listens.
    pub fn enabled(&self) -> bool {
        self.socket.is_some()
    }

    /// How often to send `WATCHDOG=1`: half the watchdog timeout, as sd_watchdog_enabled(3)
    /// recommends; `None` without a watchdog.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.socket.as_ref()?;
        self.watchdog.map(|d| d / 2)
    }

    /// Sends one notification (newline-separated `KEY=value` lines). Failures are logged once
    /// at debug: systemd may have gone away during shutdown.
    pub fn send(&self, message: &str) {
        if let Some((socket, addr)) = &self.socket
            && let Err(e) = socket.send_to_addr(message.as_bytes(), addr)
        {
            tracing::debug!("sd_notify {message:?}: {e}");
        }
    }
}

/// A `STATUS=` value: one line, no newlines.
pub fn status_line(text: &str) -> String {
    text.replace('\n', " ")
}

/// Milliseconds since the Unix epoch (for heartbeats).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Before READY: while a long step runs (a driver package install or module build on a fresh
/// node), asks systemd every `every` for more start time (`EXTEND_TIMEOUT_USEC`, three periods),
/// so the unit's `TimeoutStartSec` bounds the wait between steps and each command's own limit
/// (package manager, module build) bounds the step. Runs until aborted at READY.
pub async fn extend_start(every: Duration, long_step: Arc<AtomicBool>) {
    let notifier = Notifier::from_env();
    let extension = format!("EXTEND_TIMEOUT_USEC={}", (every * 3).as_micros());
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        if long_step.load(Ordering::Relaxed) {
            notifier.send(&extension);
        }
    }
}

/// The main loop went round.
pub fn beat(heartbeat: &AtomicU64) {
    heartbeat.store(now_ms(), Ordering::Relaxed);
}

/// Sends `WATCHDOG=1` every `every` while the main loop's heartbeat is younger than two
/// intervals (the watchdog timeout), or while `long_step` says a long step holds the loop. A
/// loop that hangs otherwise stops the pings, and systemd restarts the agent.
pub async fn watchdog(every: Duration, heartbeat: Arc<AtomicU64>, long_step: Arc<AtomicBool>) {
    let notifier = Notifier::from_env();
    let limit = (every * 2).as_millis() as u64;
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        let age = now_ms().saturating_sub(heartbeat.load(Ordering::Relaxed));
        if age < limit || long_step.load(Ordering::Relaxed) {
            notifier.send("WATCHDOG=1");
        } else {
            tracing::error!("the main loop has not gone round for {age} ms: no watchdog ping");
        }
    }
}

/// Marks a long step for the watchdog while it lives.
pub struct LongStep(Arc<AtomicBool>);

impl LongStep {
    pub fn start(flag: &Arc<AtomicBool>) -> LongStep {
        flag.store(true, Ordering::Relaxed);
        LongStep(flag.clone())
    }
}

impl Drop for LongStep {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}
