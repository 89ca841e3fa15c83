//! Device health from NVML events (pure bookkeeping; the events come from `nvml::watch_health`).
//!
//! Policy, documented in the README:
//! - a critical Xid (not in `[health] ignored_xids`, or listed in `critical_xids`) makes the GPU
//!   unhealthy; if NVML attributes it to a MIG device (GPU/compute instance ids), only that MIG
//!   device is affected;
//! - a GPU NVML no longer answers for (lost, fallen off the bus) is unhealthy with all its MIG
//!   devices until NVML answers again;
//! - going beyond NVIDIA's plugin (whose Unhealthy is terminal, NVIDIA/k8s-device-plugin#1014):
//!   an Xid-unhealthy device is advertised healthy again once `recovery_after` has passed with no
//!   new critical Xid for it while NVML answers for its GPU. `recovery_after = "0s"` keeps
//!   NVIDIA's behaviour (unhealthy until the agent restarts).
//!
//! Only the affected devices change; the others keep their state.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::devices::{Health, PluginDevice};
use crate::nvml::{HealthEvent, NO_INSTANCE};

/// Which Xids count and when a device recovers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    pub enabled: bool,
    pub ignored_xids: BTreeSet<u64>,
    pub critical_xids: BTreeSet<u64>,
    /// `None`: never recover from an Xid.
    pub recovery_after: Option<Duration>,
}

impl HealthPolicy {
    /// Whether this Xid makes a device unhealthy.
    pub fn is_critical(&self, xid: u64) -> bool {
        self.enabled && (self.critical_xids.contains(&xid) || !self.ignored_xids.contains(&xid))
    }
}

/// The last critical Xid seen for a GPU or MIG device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct XidMark {
    xid: u64,
    at: Instant,
}

#[derive(Debug, Default, Clone)]
struct GpuHealth {
    lost: bool,
    gpu_xid: Option<XidMark>,
    /// Keyed by (GPU instance id, compute instance id); the compute id may be [`NO_INSTANCE`]
    /// for an Xid attributed to a whole GPU instance.
    mig_xids: BTreeMap<(u32, u32), XidMark>,
}

/// Health of every GPU and MIG device the agent advertises.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    policy: HealthPolicy,
    gpus: BTreeMap<String, GpuHealth>,
}

impl HealthTracker {
    pub fn new(policy: HealthPolicy) -> HealthTracker {
        HealthTracker {
            policy,
            gpus: BTreeMap::new(),
        }
    }

    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Records an event; returns whether any device's health may have changed.
    pub fn on_event(&mut self, event: &HealthEvent, now: Instant) -> bool {
        match event {
            HealthEvent::Xid {
                uuid,
                xid,
                gi_id,
                ci_id,
            } => {
                if !self.policy.is_critical(*xid) {
                    tracing::info!(gpu = %uuid, xid, "Xid {xid} on {uuid} is in [health] ignored_xids: health unchanged");
                    return false;
                }
                let mark = XidMark { xid: *xid, at: now };
                let gpu = self.gpus.entry(uuid.clone()).or_default();
                if *gi_id == NO_INSTANCE {
                    tracing::warn!(gpu = %uuid, xid, "critical Xid {xid} on {uuid}: marking it unhealthy");
                    gpu.gpu_xid = Some(mark);
                } else {
                    tracing::warn!(gpu = %uuid, xid, gi = gi_id, ci = ci_id,
                        "critical Xid {xid} on {uuid} GPU instance {gi_id} compute instance {ci_id}: marking that MIG device unhealthy");
                    gpu.mig_xids.insert((*gi_id, *ci_id), mark);
                }
                true
            }
            HealthEvent::Lost { uuid } => {
                tracing::error!(gpu = %uuid, "NVML no longer answers for {uuid} (GPU lost): marking it unhealthy");
                let gpu = self.gpus.entry(uuid.clone()).or_default();
                !std::mem::replace(&mut gpu.lost, true)
            }
            HealthEvent::Answering { uuid } => {
                tracing::info!(gpu = %uuid, "NVML answers for {uuid} again");
                let gpu = self.gpus.entry(uuid.clone()).or_default();
                std::mem::replace(&mut gpu.lost, false)
            }
        }
    }

    /// Forgets Xids older than the recovery time; returns whether anything recovered.
    pub fn expire(&mut self, now: Instant) -> bool {
        let Some(after) = self.policy.recovery_after else {
            return false;
        };
        let old = |m: &XidMark| now.saturating_duration_since(m.at) >= after;
        let mut changed = false;
        for (uuid, gpu) in &mut self.gpus {
            if gpu.gpu_xid.as_ref().is_some_and(old) {
                tracing::info!(gpu = %uuid, "no critical Xid on {uuid} for {after:?}: advertising it healthy again");
                gpu.gpu_xid = None;
                changed = true;
            }
            let before = gpu.mig_xids.len();
            gpu.mig_xids.retain(|_, m| !old(m));
            changed |= gpu.mig_xids.len() != before;
        }
        changed
    }

    /// When the next Xid mark expires, if recovery is on and any is pending.
    pub fn next_expiry(&self) -> Option<Instant> {
        let after = self.policy.recovery_after?;
        self.gpus
            .values()
            .flat_map(|g| g.gpu_xid.iter().chain(g.mig_xids.values()))
            .map(|m| m.at + after)
            .min()
    }

    /// Health of one advertised device.
    pub fn health(&self, device: &PluginDevice) -> Health {
        match self.reason(device) {
            Some(_) => Health::Unhealthy,
            None => Health::Healthy,
        }
    }

    /// Why a device is unhealthy, for status; `None` when healthy.
    pub fn reason(&self, device: &PluginDevice) -> Option<String> {
        let gpu = self.gpus.get(device.physical_uuid())?;
        if gpu.lost {
            return Some("GPU lost: NVML does not answer for it".into());
        }
        if let Some(m) = gpu.gpu_xid {
            return Some(format!("critical Xid {}", m.xid));
        }
        let mig = device.mig.as_ref()?;
        gpu.mig_xids
            .iter()
            .find(|((gi, ci), _)| *gi == mig.gi_id && (*ci == NO_INSTANCE || *ci == mig.ci_id))
            .map(|(_, m)| format!("critical Xid {} on this MIG device", m.xid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::MigInfo;

    fn policy(recovery: Option<u64>) -> HealthPolicy {
        HealthPolicy {
            enabled: true,
            ignored_xids: [13, 31, 43, 45, 68, 109].into_iter().collect(),
            critical_xids: BTreeSet::new(),
            recovery_after: recovery.map(Duration::from_secs),
        }
    }

    fn gpu(uuid: &str) -> PluginDevice {
        PluginDevice {
            uuid: uuid.into(),
            index: "0".into(),
            minor: 0,
            numa_node: None,
            mig: None,
            health: Health::Healthy,
        }
    }

    fn mig(uuid: &str, parent: &str, gi: u32, ci: u32) -> PluginDevice {
        PluginDevice {
            uuid: uuid.into(),
            index: "0:0".into(),
            minor: 0,
            numa_node: None,
            mig: Some(MigInfo {
                parent_uuid: parent.into(),
                parent_index: 0,
                gi_id: gi,
                ci_id: ci,
                profile: "1g.5gb".into(),
            }),
            health: Health::Healthy,
        }
    }

    fn xid(uuid: &str, xid: u64, gi: u32, ci: u32) -> HealthEvent {
        HealthEvent::Xid {
            uuid: uuid.into(),
            xid,
            gi_id: gi,
            ci_id: ci,
        }
    }

    #[test]
    fn ignored_xids_change_nothing_unless_forced_critical() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(policy(None));
        assert!(!t.on_event(&xid("GPU-a", 13, NO_INSTANCE, NO_INSTANCE), t0));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Healthy);
        let mut forced = policy(None);
        forced.critical_xids.insert(13);
        let mut t = HealthTracker::new(forced);
        assert!(t.on_event(&xid("GPU-a", 13, NO_INSTANCE, NO_INSTANCE), t0));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Unhealthy);
    }

    #[test]
    fn gpu_xid_affects_that_gpu_and_its_mig_devices_only() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(policy(None));
        t.on_event(&xid("GPU-a", 79, NO_INSTANCE, NO_INSTANCE), t0);
        assert_eq!(t.health(&gpu("GPU-a")), Health::Unhealthy);
        assert_eq!(t.health(&mig("MIG-1", "GPU-a", 1, 0)), Health::Unhealthy);
        assert_eq!(t.health(&gpu("GPU-b")), Health::Healthy);
    }

    #[test]
    fn mig_xid_affects_only_the_matching_instance() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(policy(None));
        t.on_event(&xid("GPU-a", 94, 2, 0), t0);
        assert_eq!(t.health(&mig("MIG-2", "GPU-a", 2, 0)), Health::Unhealthy);
        assert_eq!(t.health(&mig("MIG-1", "GPU-a", 1, 0)), Health::Healthy);
        assert_eq!(t.health(&gpu("GPU-a")), Health::Healthy);
        t.on_event(&xid("GPU-a", 94, 3, NO_INSTANCE), t0);
        assert_eq!(t.health(&mig("MIG-3", "GPU-a", 3, 1)), Health::Unhealthy);
    }

    #[test]
    fn recovery_after_quiet_period_and_never_when_zero() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(policy(Some(60)));
        t.on_event(&xid("GPU-a", 79, NO_INSTANCE, NO_INSTANCE), t0);
        assert_eq!(t.next_expiry(), Some(t0 + Duration::from_secs(60)));
        assert!(!t.expire(t0 + Duration::from_secs(59)));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Unhealthy);
        assert!(t.expire(t0 + Duration::from_secs(60)));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Healthy);
        assert_eq!(t.next_expiry(), None);

        let mut never = HealthTracker::new(policy(None));
        never.on_event(&xid("GPU-a", 79, NO_INSTANCE, NO_INSTANCE), t0);
        assert!(!never.expire(t0 + Duration::from_secs(100_000)));
        assert_eq!(never.health(&gpu("GPU-a")), Health::Unhealthy);
    }

    #[test]
    fn lost_until_answering_even_after_recovery_time() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(policy(Some(1)));
        assert!(t.on_event(&HealthEvent::Lost { uuid: "GPU-a".into() }, t0));
        t.expire(t0 + Duration::from_secs(10));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Unhealthy);
        assert!(t.reason(&gpu("GPU-a")).is_some_and(|r| r.contains("lost")));
        assert!(t.on_event(&HealthEvent::Answering { uuid: "GPU-a".into() }, t0));
        assert_eq!(t.health(&gpu("GPU-a")), Health::Healthy);
    }
}
