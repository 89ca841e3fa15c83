//! The driver's state and its effects: prepare and unprepare (the claim read from the API
//! server, a CDI spec per claim, the checkpoint), and the publisher that keeps this node's
//! ResourceSlices in step with the inventory, health and the device plugin's allocations.
//!
//! Prepare and unprepare are serialised (one lock around the checkpoint), idempotent (a claim
//! in the checkpoint is answered from it) and crash-safe: a claim's CDI spec is written before
//! the checkpoint names it, and the checkpoint before the kubelet hears of it; at start, spec
//! files of claims the checkpoint does not name are removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{Mutex, Notify, watch};
use tokio_util::sync::CancellationToken;

use super::claims::{self, Checkpoint, ClaimRef, PreparedClaim, PreparedDevice};
use super::devices::{self, DraDevice};
use crate::config::Config;
use crate::devices::{PluginDevice, Withdrawn};
use crate::edits::DeviceNodes;
use crate::host::{HostRoot, write_atomic};
use crate::kube::KubeClient;
use crate::metrics::pods::{Attribution, attribution};
use crate::nvml::Inventory;
use crate::runtime::cdi;
use crate::runtime::node_spec::node_edits;

/// The driver's state for status.json and `gpu-node-agent status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DraStatus {
    pub driver: String,
    /// The kubelet accepted the registration (and has not refused a later one).
    pub registered: bool,
    /// Unix seconds of the last accepted registration.
    pub registered_at: Option<u64>,
    /// Devices in the slices last written or found up to date.
    pub published: usize,
    /// The pool's generation then.
    pub generation: i64,
    /// Prepared claims, `namespace/name`.
    pub prepared: Vec<String>,
    /// The last registration refusal or publishing failure; `None` once it works again.
    pub error: Option<String>,
}

/// How often the publisher asks the kubelet which devices the device plugin has handed out.
pub const POD_RESOURCES_EVERY: Duration = Duration::from_secs(10);
/// How often, at least, the publisher lists its slices even when nothing happened: a safety
/// net. The kubelet deletes a node's slices when it starts and when no plugin of a driver
/// answered for 30 s, and re-registers the plugin afterwards, which makes the publisher list at
/// once; this catches anything else that removed them. Each period is longer by up to a fifth,
/// at random, so that a fleet's lists do not line up. (It was one minute: 60 lists an hour per
/// node, which alone broke the one-request-per-node-per-minute budget of a large fleet.)
pub const RELIST_EVERY: Duration = Duration::from_secs(10 * 60);
/// First retry delay after a failed publish.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Whether a device is healthy now (the agent's health tracker).
pub type HealthFn = Arc<dyn Fn(&PluginDevice) -> bool + Send + Sync>;

/// What the driver reads of the agent.
#[derive(Clone)]
pub struct Inputs {
    pub health: HealthFn,
    /// Bumped on every health change.
    pub health_changed: watch::Receiver<u64>,
}

/// The driver: shared by the gRPC services and the publisher.
pub struct Driver {
    pub(super) config: Config,
    pub(super) root: HostRoot,
    /// The Node's name: the pool and `spec.nodeName` of the slices.
    pub(super) node: String,
    pub(super) client: Option<KubeClient>,
    inputs: Inputs,
    /// The current inventory (GPUs whose MIG layout is changing left out); `None` while unknown.
    inventory: watch::Receiver<Option<Arc<Inventory>>>,
    checkpoint_path: PathBuf,
    state: Mutex<Checkpoint>,
    withdrawn: watch::Sender<Withdrawn>,
    /// Woken when the kubelet (re)registers the plugin: it may just have wiped the slices.
    registered: Notify,
    /// What status shows.
    pub status: watch::Sender<DraStatus>,
}

impl Driver {
    /// The driver for this config, with the checkpoint read back (a corrupt one is kept aside
    /// as `checkpoint.json.corrupt` and the driver starts empty, with an error in the log) and
    /// stale claim specs removed. Returns it and the devices it holds, for the device plugin.
    pub fn new(
        config: Config,
        root: HostRoot,
        node: String,
        client: Option<KubeClient>,
        inputs: Inputs,
        inventory: watch::Receiver<Option<Arc<Inventory>>>,
    ) -> (Arc<Driver>, watch::Receiver<Withdrawn>) {
        let driver_name = config.dra.driver.clone();
        let checkpoint_path = claims::checkpoint_path(&config, &root);
        let checkpoint = load_checkpoint(&checkpoint_path, &driver_name);
        remove_stale_specs(&root.join(&config.cdi.dir), &driver_name, &checkpoint);
        // The checkpoint exists from the first start on: it also tells a later agent with DRA
        // turned off that this node has slices to remove.
        if !checkpoint_path.exists()
            && let Err(e) = write_atomic(&checkpoint_path, checkpoint.render().as_bytes(), 0o600)
        {
            tracing::error!("DRA: cannot write the checkpoint: {e}");
        }
        let (withdrawn, withdrawn_rx) = watch::channel(withdrawn_by(&checkpoint, None));
        let status = watch::Sender::new(DraStatus {
            driver: driver_name,
            prepared: prepared_names(&checkpoint),
            ..DraStatus::default()
        });
        let driver = Arc::new(Driver {
            config,
            root,
            node,
            client,
            inputs,
            inventory,
            checkpoint_path,
            state: Mutex::new(checkpoint),
            withdrawn,
            registered: Notify::new(),
            status,
        });
        (driver, withdrawn_rx)
    }

    /// The kubelet (re)registered the plugin: it may just have wiped the node's slices (it does
    /// at its start), so the publisher lists them at once.
    pub fn kubelet_registered(&self) {
        self.registered.notify_one();
    }

    fn driver_name(&self) -> &str {
        &self.config.dra.driver
    }

    fn cdi_dir(&self) -> PathBuf {
        self.root.join(&self.config.cdi.dir)
    }

    /// Tells the device plugin which devices claims hold, and status which claims.
    fn publish_withdrawn(&self, state: &Checkpoint) {
        let w = withdrawn_by(state, self.inventory.borrow().as_deref());
        self.withdrawn.send_if_modified(|cur| {
            let changed = *cur != w;
            *cur = w;
            changed
        });
        let prepared = prepared_names(state);
        self.update_status(|s| s.prepared = prepared);
    }

    /// Changes what status shows (watchers hear of it only when something changed).
    pub(super) fn update_status(&self, f: impl FnOnce(&mut DraStatus)) {
        self.status.send_if_modified(|s| {
            let before = s.clone();
            f(s);
            *s != before
        });
    }

    /// Prepares the claims; one answer per claim, in order: its devices, or why not.
    pub async fn prepare(&self, claims: &[ClaimRef]) -> Vec<Result<Vec<PreparedDevice>, String>> {
        let mut state = self.state.lock().await;
        let mut answers = Vec::new();
        let mut new = Vec::new();
        for claim in claims {
            if let Err(e) = claim.check() {
                tracing::warn!("prepare: {e}");
                answers.push(Err(e));
                continue;
            }
            if let Some(done) = state.claims.get(&claim.uid) {
                answers.push(Ok(done.devices.clone()));
                continue;
            }
            match self.prepare_one(&state, claim).await {
                Ok(prepared) => {
                    answers.push(Ok(prepared.devices.clone()));
                    state.claims.insert(claim.uid.clone(), prepared);
                    new.push(claim.uid.clone());
                }
                Err(e) => {
                    tracing::warn!("prepare {claim}: {e}");
                    answers.push(Err(e));
                }
            }
        }
        if !new.is_empty() {
            if let Err(e) = self.save(&state).await {
                // The kubelet must not hear of a prepare the checkpoint does not hold.
                let e = format!("cannot record the prepared claim: {e}");
                tracing::error!("{e}");
                for (answer, claim) in answers.iter_mut().zip(claims) {
                    if new.contains(&claim.uid) {
                        state.claims.remove(&claim.uid);
                        self.remove_spec(&claim.uid);
                        *answer = Err(e.clone());
                    }
                }
            } else {
                for uid in &new {
                    if let Some(c) = state.claims.get(uid) {
                        let names: Vec<&str> = c.devices.iter().map(|d| d.device.as_str()).collect();
                        tracing::info!(
                            "prepared ResourceClaim {}/{} ({uid}): {}",
                            c.namespace,
                            c.name,
                            names.join(", ")
                        );
                    }
                }
            }
            self.publish_withdrawn(&state);
        }
        answers
    }

    async fn prepare_one(&self, state: &Checkpoint, want: &ClaimRef) -> Result<PreparedClaim, String> {
        let Some(client) = &self.client else {
            return Err(format!(
                "cannot read {want}: no Kubernetes credentials ([kubernetes] enabled, a kubeconfig or the in-cluster account)"
            ));
        };
        let claim = client
            .get_resource_claim(&want.namespace, &want.name)
            .await
            .map_err(|e| e.to_string())?;
        let allocated = claims::allocated(&claim, want, self.driver_name())?;
        let inventory = self.inventory.borrow().clone().ok_or_else(|| {
            "the GPU inventory is not known yet (NVML not open, or a MIG change in progress)".to_string()
        })?;
        let available = devices::devices(&inventory, &self.config.dra.publish);
        let mut chosen: Vec<(&claims::Allocated, &DraDevice)> = Vec::new();
        for a in &allocated {
            if a.pool != self.node {
                return Err(format!(
                    "{want}: device {} is in pool {:?}, and this node's pool is {:?}",
                    a.device, a.pool, self.node
                ));
            }
            let device = available.iter().find(|d| d.name == a.device).ok_or_else(|| {
                let names: Vec<&str> = available.iter().map(|d| d.name.as_str()).collect();
                format!(
                    "{want}: device {} is not on this node (it has: {})",
                    a.device,
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                )
            })?;
            if !(self.inputs.health)(&device.device) {
                return Err(format!(
                    "{want}: device {} ({}) is unhealthy",
                    device.name,
                    device.uuid()
                ));
            }
            chosen.push((a, device));
        }
        // Never the same GPU through both APIs, nor to two claims.
        let held = self.device_plugin_holders().await;
        for (a, device) in &chosen {
            if a.admin_access {
                continue;
            }
            let related = related_uuids(&inventory, device);
            if let Some((uid, other)) = state.holder(&related, &want.uid) {
                return Err(format!(
                    "{want}: device {} ({}) is prepared for ResourceClaim {}/{} ({uid}) already",
                    device.name,
                    device.uuid(),
                    other.namespace,
                    other.name
                ));
            }
            if let Some(holder) = related.iter().find_map(|u| held.get(u)) {
                return Err(format!(
                    "{want}: device {} ({}) is in use through the device plugin by pod {}/{} container {}",
                    device.name,
                    device.uuid(),
                    holder.namespace,
                    holder.pod,
                    holder.container
                ));
            }
        }
        // The claim's CDI spec: exactly its devices, with the node spec's edits.
        let nodes = DeviceNodes::gather(
            &self.root.join(&self.config.device_plugin.dev_root),
            &self.root.join("/proc"),
        );
        let node = node_edits(&self.config, &self.root, &inventory, &nodes)
            .map_err(|e| format!("{want}: no CDI spec for the node's GPUs: {e}"))?;
        let pairs: Vec<(&str, &str)> = chosen.iter().map(|(_, d)| (d.name.as_str(), d.uuid())).collect();
        let node_kind = &self.config.device_plugin.cdi_kind;
        let claim_kind = claims::claim_kind(self.driver_name());
        let (spec, ids) =
            cdi::claim_spec(&node, node_kind, &claim_kind, &want.uid, &pairs).map_err(|e| format!("{want}: {e}"))?;
        let text = cdi::to_json(&spec).map_err(|e| format!("{want}: {e}"))?;
        let path = self
            .cdi_dir()
            .join(claims::claim_spec_file(self.driver_name(), &want.uid));
        write_off_loop(path, text, 0o644)
            .await
            .map_err(|e| format!("{want}: {e}"))?;
        let devices = chosen
            .iter()
            .zip(ids)
            .map(|((a, d), id)| PreparedDevice {
                request: a.base_request().to_string(),
                pool: a.pool.clone(),
                device: a.device.clone(),
                uuid: d.uuid().to_string(),
                cdi_ids: vec![id],
                share_id: a.share_id.clone(),
                admin_access: a.admin_access,
            })
            .collect();
        Ok(PreparedClaim {
            namespace: want.namespace.clone(),
            name: want.name.clone(),
            devices,
        })
    }

    /// Which devices the device plugin has handed out (the kubelet's pod-resources API);
    /// nothing when it cannot tell (logged).
    async fn device_plugin_holders(&self) -> Attribution {
        if !self.config.device_plugin.enabled {
            return Attribution::default();
        }
        let socket = self.root.join(&self.config.metrics.pod_resources_socket);
        match attribution(&socket).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("cannot tell which GPUs the device plugin handed out: {e}");
                Attribution::default()
            }
        }
    }

    /// Unprepares the claims (unknown ones are no error); one answer per claim.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> Vec<Result<(), String>> {
        let mut state = self.state.lock().await;
        let mut removed = Vec::new();
        for claim in claims {
            if let Some(c) = state.claims.remove(&claim.uid) {
                removed.push((claim.uid.clone(), c));
            }
        }
        if removed.is_empty() {
            return claims.iter().map(|_| Ok(())).collect();
        }
        if let Err(e) = self.save(&state).await {
            let e = format!("cannot record the unprepared claim: {e}");
            tracing::error!("{e}");
            for (uid, c) in removed {
                state.claims.insert(uid, c);
            }
            return claims.iter().map(|_| Err(e.clone())).collect();
        }
        let answers = claims
            .iter()
            .map(|claim| {
                if removed.iter().any(|(uid, _)| *uid == claim.uid) {
                    self.remove_spec(&claim.uid);
                    tracing::info!("unprepared {claim}");
                }
                Ok(())
            })
            .collect();
        self.publish_withdrawn(&state);
        answers
    }

    fn remove_spec(&self, uid: &str) {
        let path = self.cdi_dir().join(claims::claim_spec_file(self.driver_name(), uid));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("cannot remove {}: {e} (removed at the next start)", path.display()),
        }
    }

    /// Writes the checkpoint, off the async workers (the write fsyncs).
    async fn save(&self, state: &Checkpoint) -> Result<(), String> {
        write_off_loop(self.checkpoint_path.clone(), state.render(), 0o600).await
    }

    /// What should be published now: devices healthy and not handed out by the device plugin.
    fn wanted(&self, held: &Attribution) -> Vec<DraDevice> {
        let inventory = self.inventory.borrow().clone();
        let Some(inventory) = inventory else { return Vec::new() };
        devices::devices(&inventory, &self.config.dra.publish)
            .into_iter()
            .filter(|d| (self.inputs.health)(&d.device))
            .filter(|d| related_uuids(&inventory, d).iter().all(|u| held.get(u).is_none()))
            .collect()
    }

    /// Keeps the slices in step until `stop`; then leaves them (a restarted agent takes them
    /// over; the kubelet removes them 30 s after the plugin is gone).
    pub async fn publish(self: Arc<Self>, stop: CancellationToken) {
        let Some(client) = self.client.clone() else {
            tracing::warn!("DRA: no Kubernetes credentials: ResourceSlices are not published");
            return;
        };
        let mut inventory = self.inventory.clone();
        let mut health = self.inputs.health_changed.clone();
        let mut held = Attribution::default();
        let mut held_at: Option<Instant> = None;
        let mut listed_at: Option<Instant> = None;
        let mut last: Option<Vec<Value>> = None;
        let mut generation: i64 = 0;
        // After a failed round nothing is tried before `retry_at`, whatever wakes the loop
        // (health, inventory): jittered doubling steps, so a fleet that failed together (an API
        // server restart) does not retry together.
        let mut backoff = crate::host::backoff::Backoff::new(RETRY_MIN, RETRY_MAX);
        let mut retry_at: Option<Instant> = None;
        let mut failed = false;
        let mut relist_every = relist_period();
        loop {
            if held_at.is_none_or(|t| t.elapsed() >= POD_RESOURCES_EVERY) {
                held = self.device_plugin_holders().await;
                held_at = Some(Instant::now());
            }
            let ready = inventory.borrow().is_some();
            let holding = retry_at.is_some_and(|t| Instant::now() < t);
            if ready && !holding {
                let relist = failed || listed_at.is_none_or(|t| t.elapsed() >= relist_every);
                match self.sync(&client, &held, relist, &mut last, &mut generation).await {
                    Ok(listed) => {
                        if listed {
                            listed_at = Some(Instant::now());
                            relist_every = relist_period();
                        }
                        failed = false;
                        retry_at = None;
                        backoff.reset();
                    }
                    Err(e) => {
                        let retry = backoff.next();
                        tracing::warn!(
                            "DRA: publishing the ResourceSlices of node {:?}: {e}; again in {retry:?}",
                            self.node
                        );
                        failed = true;
                        retry_at = Some(Instant::now() + retry);
                    }
                }
            }
            let wait = match retry_at {
                Some(t) if failed => t.saturating_duration_since(Instant::now()),
                _ => POD_RESOURCES_EVERY,
            };
            tokio::select! {
                () = stop.cancelled() => return,
                Ok(()) = inventory.changed() => {
                    // Which GPU holds a prepared MIG device may only be known now.
                    let state = self.state.lock().await;
                    self.publish_withdrawn(&state);
                }
                Ok(()) = health.changed() => {}
                () = self.registered.notified() => { listed_at = None; }
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One round: the slices wanted now against those last written (or listed, with
    /// `relist`); writes only what differs, at the next generation. Returns whether it listed.
    async fn sync(
        &self,
        client: &KubeClient,
        held: &Attribution,
        relist: bool,
        last: &mut Option<Vec<Value>>,
        generation: &mut i64,
    ) -> Result<bool, String> {
        let wanted_devices = self.wanted(held);
        let refs: Vec<&DraDevice> = wanted_devices.iter().collect();
        let driver = self.driver_name();
        let mut wanted = devices::slices(&self.node, driver, &refs, *generation);
        let (mut existing, listed) = match last.take() {
            Some(l) if !relist => (l, false),
            _ => {
                let listed = client
                    .list_resource_slices(&self.node, driver)
                    .await
                    .map_err(|e| e.to_string())?;
                (listed, true)
            }
        };
        if devices::same_content(&existing, &wanted) {
            *last = Some(existing);
            if listed {
                self.show_published(wanted_devices.len(), *generation);
            }
            return Ok(listed);
        }
        // On an error below `last` stays empty: the next round lists again (a stale
        // resourceVersion, a slice made or deleted meanwhile).
        let on_server = existing
            .iter()
            .filter_map(|s| s.pointer("/spec/pool/generation").and_then(Value::as_i64))
            .max()
            .unwrap_or(0);
        *generation = (*generation).max(on_server) + 1;
        let mut written = Vec::new();
        for slice in &mut wanted {
            slice["spec"]["pool"]["generation"] = Value::from(*generation);
            let name = slice.pointer("/metadata/name").and_then(Value::as_str);
            let old = existing
                .iter()
                .position(|s| s.pointer("/metadata/name").and_then(Value::as_str) == name)
                .map(|i| existing.remove(i));
            let stored = match old {
                Some(old) => {
                    if let Some(rv) = old.pointer("/metadata/resourceVersion") {
                        slice["metadata"]["resourceVersion"] = rv.clone();
                    }
                    client.update_resource_slice(slice).await
                }
                None => client.create_resource_slice(slice).await,
            };
            written.push(stored.map_err(|e| e.to_string())?);
        }
        for gone in existing {
            if let Some(name) = gone.pointer("/metadata/name").and_then(Value::as_str) {
                client.delete_resource_slice(name).await.map_err(|e| e.to_string())?;
            }
        }
        tracing::info!(
            "DRA: ResourceSlices of node {:?} at generation {}: {} device(s)",
            self.node,
            generation,
            wanted_devices.len()
        );
        *last = Some(written);
        self.show_published(wanted_devices.len(), *generation);
        Ok(listed)
    }

    fn show_published(&self, devices: usize, generation: i64) {
        self.update_status(|s| {
            s.published = devices;
            s.generation = generation;
        });
    }
}

/// The checkpoint at `path`, for `driver`: empty when missing, unreadable (logged), of another
/// driver (logged), or corrupt (kept aside as `.json.corrupt`, logged).
/// The time until the next safety-net list: [`RELIST_EVERY`] plus up to a fifth of it.
fn relist_period() -> Duration {
    RELIST_EVERY.mul_f64(1.0 + fastrand::f64() / 5.0)
}

fn load_checkpoint(path: &Path, driver: &str) -> Checkpoint {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Checkpoint::new(driver),
        Err(e) => {
            tracing::error!("cannot read {}: {e}; starting with no prepared claims", path.display());
            return Checkpoint::new(driver);
        }
    };
    match Checkpoint::parse(&text, &path.display().to_string()) {
        Ok(c) if c.driver == driver => c,
        Ok(c) => {
            tracing::warn!(
                "{}: prepared for driver {:?}, not {driver:?} ([dra] driver changed): starting empty",
                path.display(),
                c.driver
            );
            Checkpoint::new(driver)
        }
        Err(e) => {
            let aside = path.with_extension("json.corrupt");
            let _ = std::fs::rename(path, &aside);
            tracing::error!(
                "{e}: kept as {}; starting with no prepared claims (the kubelet prepares its claims again)",
                aside.display()
            );
            Checkpoint::new(driver)
        }
    }
}

/// Removes the claim specs of `driver` in `cdi_dir` that `checkpoint` does not name (a prepare
/// that crashed between the spec and the checkpoint, or an unprepare between the checkpoint and
/// the spec).
fn remove_stale_specs(cdi_dir: &Path, driver: &str, checkpoint: &Checkpoint) {
    let Ok(entries) = std::fs::read_dir(cdi_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        if let Some(uid) = claims::claim_of_spec_file(driver, file)
            && !checkpoint.claims.contains_key(uid)
        {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!("removed {}: no prepared claim {uid}", entry.path().display()),
                Err(e) => tracing::warn!("cannot remove stale {}: {e}", entry.path().display()),
            }
        }
    }
}

/// What the claims of `state` hold, for the device plugin: their devices, and the GPUs of
/// their MIG devices (known once the inventory is).
fn withdrawn_by(state: &Checkpoint, inventory: Option<&Inventory>) -> Withdrawn {
    let mut w = Withdrawn::default();
    for uuid in state.uuids() {
        w.devices.insert(uuid.to_string());
        let parent = inventory.and_then(|i| i.gpus.iter().find(|g| g.mig_devices.iter().any(|m| m.uuid == uuid)));
        if let Some(gpu) = parent {
            w.parents.insert(gpu.uuid.clone());
        }
    }
    w
}

/// The prepared claims as `namespace/name`, for status.
fn prepared_names(state: &Checkpoint) -> Vec<String> {
    state
        .claims
        .values()
        .map(|c| format!("{}/{}", c.namespace, c.name))
        .collect()
}

/// [`write_atomic`] on a blocking thread: it fsyncs, which must not hold an async worker.
async fn write_off_loop(path: PathBuf, text: String, mode: u32) -> Result<(), String> {
    tokio::task::spawn_blocking(move || write_atomic(&path, text.as_bytes(), mode).map_err(|e| e.to_string()))
        .await
        .map_err(|e| format!("the write was cancelled: {e}"))?
}

/// The UUIDs a claim on `device` conflicts with: its own, its GPU's (for a MIG device), and its
/// MIG devices' (for a GPU).
fn related_uuids(inventory: &Inventory, device: &DraDevice) -> Vec<String> {
    let mut out = vec![device.uuid().to_string()];
    if let Some(mig) = &device.device.mig {
        out.push(mig.parent_uuid.clone());
    } else if let Some(gpu) = inventory.gpus.iter().find(|g| g.uuid == device.uuid()) {
        out.extend(gpu.mig_devices.iter().map(|m| m.uuid.clone()));
    }
    out
}
