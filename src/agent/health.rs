//! The health path, on a task of its own: NVML health events (Xids, GPUs lost and back) go
//! through the health tracker straight to the device plugin, so a long stage step (a MIG apply,
//! a driver build, an engine restart) never holds them back. The agent hands this task the
//! resources to advertise without health; the task applies the tracker's health to them and
//! passes them on to the plugin manager, again on every change, and tells the agent so it
//! reports (status, Events, metrics) when its loop is free. The tracker's policy is the
//! config's ([`health_policy`]).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::devices::{Resource, Withdrawn};
use crate::metrics::Metrics;
use crate::nvml::HealthEvent;
use crate::plugin::health::{HealthPolicy, HealthTracker};
use crate::plugin::manager::Command;
use crate::plugin::server::PluginContext;

/// The health policy the config describes.
pub fn health_policy(config: &Config) -> HealthPolicy {
    let h = &config.health;
    HealthPolicy {
        enabled: h.enabled,
        ignored_xids: h.ignored_xids.iter().map(|x| u64::from(*x)).collect(),
        critical_xids: h.critical_xids.iter().map(|x| u64::from(*x)).collect(),
        recovery_after: (!h.recovery_after.is_zero()).then_some(h.recovery_after),
    }
}

/// The tracker, shared: the relay changes it, the agent reads reasons for its reports.
#[derive(Clone)]
pub(super) struct SharedTracker(Arc<Mutex<HealthTracker>>);

impl SharedTracker {
    pub(super) fn new(tracker: HealthTracker) -> SharedTracker {
        SharedTracker(Arc::new(Mutex::new(tracker)))
    }

    /// The tracker (a panic elsewhere while it was held leaves it as it was: still usable).
    pub(super) fn lock(&self) -> MutexGuard<'_, HealthTracker> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The relay between the agent, the NVML health watcher and the plugin manager.
pub(super) struct HealthRelay {
    tracker: SharedTracker,
    /// What the agent asked to advertise last (health not applied), with its context.
    current: Option<(Vec<Resource>, Arc<PluginContext>)>,
    /// The plugin manager (none with `[device_plugin] enabled = false`).
    manager: Option<mpsc::Sender<Command>>,
    metrics: Option<Metrics>,
    /// Bumped on every health change the agent should report.
    changed: watch::Sender<u64>,
    /// The devices the DRA driver's claims hold: never advertised.
    withdrawn: Withdrawn,
}

impl HealthRelay {
    pub(super) fn new(
        tracker: SharedTracker,
        manager: Option<mpsc::Sender<Command>>,
        metrics: Option<Metrics>,
    ) -> (HealthRelay, watch::Receiver<u64>) {
        let (changed, rx) = watch::channel(0);
        let relay = HealthRelay {
            tracker,
            current: None,
            manager,
            metrics,
            changed,
            withdrawn: Withdrawn::default(),
        };
        (relay, rx)
    }

    /// Runs until the agent closes `commands`; the manager's channel closes with it (which
    /// stops the manager). `withdrawn`: what the DRA driver's claims hold (a closed channel
    /// when DRA is off).
    pub(super) async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut events: mpsc::UnboundedReceiver<HealthEvent>,
        mut withdrawn: watch::Receiver<Withdrawn>,
    ) {
        loop {
            let expiry = self.tracker.lock().next_expiry();
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Set { resources, ctx }) => {
                        self.current = Some((resources, ctx));
                        self.forward().await;
                    }
                    None => break,
                },
                Some(event) = events.recv() => {
                    let mut changed = self.on_event(&event);
                    // Drain what else is queued so a burst gives one update.
                    while let Ok(event) = events.try_recv() {
                        changed |= self.on_event(&event);
                    }
                    if changed {
                        self.forward().await;
                        self.changed.send_modify(|n| *n += 1);
                    }
                }
                Ok(()) = withdrawn.changed() => {
                    self.withdrawn = withdrawn.borrow_and_update().clone();
                    self.forward().await;
                }
                () = super::wait::sleep_until(expiry) => {
                    let recovered = self.tracker.lock().expire(Instant::now());
                    if recovered {
                        self.forward().await;
                        self.changed.send_modify(|n| *n += 1);
                    }
                }
            }
        }
    }

    fn on_event(&self, event: &HealthEvent) -> bool {
        if let Some(metrics) = &self.metrics {
            metrics.health_event(event);
        }
        self.tracker.lock().on_event(event, Instant::now())
    }

    /// The current resources with the tracker's health applied, to the manager.
    async fn forward(&self) {
        let (Some(manager), Some((resources, ctx))) = (&self.manager, &self.current) else {
            return;
        };
        let mut resources = resources.clone();
        self.withdrawn.apply(&mut resources);
        {
            let tracker = self.tracker.lock();
            for device in resources.iter_mut().flat_map(|r| r.devices.values_mut()) {
                device.health = tracker.health(device);
            }
        }
        let _ = manager
            .send(Command::Set {
                resources,
                ctx: ctx.clone(),
            })
            .await;
    }
}
