//! MPS sharing: the CUDA MPS control daemon of each resource shared with `strategy = "mps"`, and
//! what `Allocate` adds for its replicas.
//!
//! NVIDIA runs one `mps-control-daemon` per shared resource
//! (`cmd/mps-control-daemon/mps/daemon.go` in NVIDIA/k8s-device-plugin). Its observable steps,
//! which the agent repeats itself:
//!
//! 1. every GPU of the resource to compute mode `EXCLUSIVE_PROCESS` (NVIDIA: `nvidia-smi -c`; the
//!    agent: `nvmlDeviceSetComputeMode`);
//! 2. `<mps_root>/<resource>/pipe` and `.../log` created (`cmd/mps-control-daemon/mps/root.go`: the
//!    full resource name is the folder path, so `nvidia.com/gpu` gives
//!    `<mps_root>/nvidia.com/gpu/pipe`);
//! 3. `nvidia-cuda-mps-control` started with `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`
//!    set to them (NVIDIA: `-d`, a background daemon; the agent: `-f`, its own child, so it sees
//!    the daemon die and restarts it);
//! 4. through the control client, per GPU `set_default_device_pinned_mem_limit <ordinal> <MiB>M`
//!    (total memory / replicas) and once `set_default_active_thread_percentage <100/replicas>`;
//! 5. `<mps_root>/<resource>/.started` created.
//!
//! Stopping sends `quit`, sets compute mode `DEFAULT` back and removes `.started`. The plugin
//! checks a daemon with `get_default_active_thread_percentage` (`internal/plugin/mps.go`).
//!
//! Readiness: NVIDIA's plugin waits for its daemon before it serves. The agent serves at once
//! (its other resources must not wait) but advertises a daemon's replicas healthy only while the
//! daemon is [`DaemonState::Running`]: its control client answered
//! `get_default_active_thread_percentage` and took the limits. While it starts, restarts or
//! cannot start, its replicas are `Unhealthy` in `ListAndWatch` (the kubelet keeps them in the
//! node's capacity but schedules nothing on them) and `Allocate` refuses them, naming the
//! resource, the GPU and the daemon's state ([`MpsAllocate::check_ready`]).
//!
//! Where the agent differs: the daemon gets `CUDA_VISIBLE_DEVICES` = the resource's GPUs (NVIDIA
//! leaves a TODO for it), so the ordinals of step 4 are positions in that list; the log folder
//! is kept after a stop (NVIDIA removes it), for what went wrong.
//!
//! [`plan`] is pure (what `gpu-node-agent plan` prints); [`Supervisor`] applies it.

mod contain;
mod folders;
mod supervisor;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::{MemoryBudget, MigStrategy, Sharing, SharingStrategy};
use crate::devices::is_replica_id;
use crate::devices::{Health, Resource};
use crate::edits::{ContainerEdits, Mount};
use crate::nvml::Inventory;
use crate::plugin::sharing::{replicas_for, selects};
use crate::plugin::strategy::build_resources;

pub use supervisor::{DaemonBoard, DaemonState, DaemonStatus, DaemonWatch, Supervisor};

/// The control program, in the driver's user-space.
pub const CONTROL_PROGRAM: &str = "nvidia-cuda-mps-control";
/// Where it is looked for under the driver root, in order (as the CDI spec's programs).
pub const PROGRAM_DIRS: [&str; 3] = ["/usr/bin", "/usr/sbin", "/bin"];
/// Where a container sees the MPS root (NVIDIA's `mps.ContainerRoot`).
pub const CONTAINER_ROOT: &str = "/mps";
/// The container's shared memory, which MPS clients and the server share through the host's
/// `<mps_root>/shm`.
pub const CONTAINER_SHM: &str = "/dev/shm";

/// The env of MPS clients and daemons.
pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
pub const PINNED_MEM_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
pub const THREAD_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// Why MPS cannot be planned for the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MpsError {
    /// A compact entry that does not parse (a loaded config has been validated).
    #[error("[device_plugin.sharing] compact: {0}")]
    Compact(String),
    /// The resources cannot be built (the MIG strategy's own error).
    #[error("{0}")]
    Resources(String),
    /// MPS on a MIG device (NVIDIA: "sharing using MPS is not supported for MIG devices").
    #[error(
        "[device_plugin.sharing] strategy = \"mps\": {resource} has MIG device {device} (GPU {gpu}); sharing using MPS is not supported for MIG devices: disable MIG on the GPU or use mig_strategy = \"none\""
    )]
    MigDevice {
        resource: String,
        device: String,
        gpu: String,
    },
}

/// One GPU under a control daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MpsGpu {
    pub uuid: String,
    /// NVML index on the host.
    pub index: u32,
    /// Its CUDA ordinal as the daemon sees it (position in `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub replicas: u32,
    /// Pinned device memory per client, MiB: `memory_per_replica`, else the GPU's memory divided
    /// by its replicas (NVIDIA's); `None` when NVML reports no memory.
    pub memory_limit_mib: Option<u64>,
    /// Thread share per client, percent: `active_thread_percentage`, else 100 / replicas.
    pub active_thread_percentage: u32,
}

/// One control daemon: a shared resource and its GPUs. Paths are host paths (without the
/// agent's `--root`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MpsDaemon {
    /// The advertised resource name (`nvidia.com/gpu`, or its rename).
    pub resource: String,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub started_file: PathBuf,
    /// `<mps_root>/shm`, the containers' `/dev/shm`.
    pub shm_dir: PathBuf,
    pub gpus: Vec<MpsGpu>,
    /// The daemon's default for every client: the smallest share any of its GPUs gives.
    pub active_thread_percentage: u32,
}

impl MpsDaemon {
    /// The daemon's and its control client's env, with the folders under `root`.
    pub fn env(&self, root: &Path) -> Vec<(String, String)> {
        let under = |p: &Path| crate::host::rooted(root, p).display().to_string();
        let visible: Vec<&str> = self.gpus.iter().map(|g| g.uuid.as_str()).collect();
        vec![
            (PIPE_ENV.to_string(), under(&self.pipe_dir)),
            (LOG_ENV.to_string(), under(&self.log_dir)),
            ("CUDA_VISIBLE_DEVICES".to_string(), visible.join(",")),
        ]
    }

    /// The control commands that set the limits once the daemon answers, in order.
    pub fn control_commands(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .gpus
            .iter()
            .filter_map(|g| {
                let mib = g.memory_limit_mib?;
                Some(format!("set_default_device_pinned_mem_limit {} {mib}M", g.ordinal))
            })
            .collect();
        out.push(format!(
            "set_default_active_thread_percentage {}",
            self.active_thread_percentage
        ));
        out
    }

    /// `<mps_root>`, the folder that holds the daemons' folders (the shm folder's parent, by
    /// [`plan`]'s layout).
    pub fn mps_root(&self) -> &Path {
        self.shm_dir.parent().unwrap_or(Path::new("/"))
    }

    /// The pipe folder as containers see it: `/mps/<resource>/pipe`.
    pub fn container_pipe_dir(&self) -> String {
        format!("{CONTAINER_ROOT}/{}/pipe", self.resource)
    }
}

/// The control daemons `sharing` asks for on this inventory, one per shared resource whose
/// devices get more than one replica; none unless the strategy is `mps`.
pub fn plan(inventory: &Inventory, sharing: &Sharing, mig_strategy: MigStrategy) -> Result<Vec<MpsDaemon>, MpsError> {
    if sharing.strategy != SharingStrategy::Mps {
        return Ok(Vec::new());
    }
    let entries = sharing.entries().map_err(MpsError::Compact)?;
    let resources = build_resources(inventory, mig_strategy).map_err(|e| MpsError::Resources(e.to_string()))?;
    let gpu_info: BTreeMap<&str, (u32, u64)> = inventory
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), (g.index, g.memory_mib)))
        .collect();
    let root = &sharing.mps_root;
    let mut out = Vec::new();
    for entry in &entries {
        let source = entry.resource_name();
        let Some(resource) = resources.iter().find(|r| r.name == source) else {
            continue;
        };
        let picked: Vec<_> = resource.devices.values().filter(|d| selects(entry, d)).collect();
        if picked.iter().all(|d| replicas_for(entry, d) <= 1) {
            continue;
        }
        if let Some(d) = picked.iter().find(|d| d.mig.is_some()) {
            return Err(MpsError::MigDevice {
                resource: source,
                device: d.uuid.clone(),
                gpu: d.index.clone(),
            });
        }
        let name = entry.advertised_name(sharing.rename_by_default);
        let mut gpus: Vec<MpsGpu> = picked
            .iter()
            .map(|d| {
                let replicas = replicas_for(entry, d).max(1);
                let (index, memory) = gpu_info.get(d.uuid.as_str()).copied().unwrap_or((0, 0));
                let memory_limit_mib = match entry.memory_per_replica {
                    Some(MemoryBudget::Mib(mib)) => Some(mib),
                    Some(MemoryBudget::Fair) | None => (memory > 0).then(|| memory / u64::from(replicas)),
                };
                MpsGpu {
                    uuid: d.uuid.clone(),
                    index,
                    ordinal: 0,
                    replicas,
                    memory_limit_mib,
                    active_thread_percentage: entry.active_thread_percentage.unwrap_or(100 / replicas).max(1),
                }
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        for (ordinal, g) in gpus.iter_mut().enumerate() {
            g.ordinal = ordinal;
        }
        let active_thread_percentage = gpus.iter().map(|g| g.active_thread_percentage).min().unwrap_or(100);
        let dir = root.join(&name);
        out.push(MpsDaemon {
            pipe_dir: dir.join("pipe"),
            log_dir: dir.join("log"),
            started_file: dir.join(".started"),
            shm_dir: root.join("shm"),
            resource: name,
            gpus,
            active_thread_percentage,
        });
    }
    out.sort_by(|a, b| a.resource.cmp(&b.resource));
    Ok(out)
}

/// What `Allocate` adds for MPS, per advertised resource name, and whether each daemon answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MpsAllocate {
    pub daemons: BTreeMap<String, MpsDaemon>,
    /// The daemons' states, as the [`Supervisor`] sets them.
    pub states: DaemonWatch,
}

/// A replica asked for while its daemon does not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{resource} replica {id} (GPU {gpu_index}, {gpu_uuid}): the MPS control daemon for {resource} does not answer on its pipe {pipe_dir} (state: {state}); its replicas are advertised unhealthy until it does"
)]
pub struct MpsNotReady {
    pub resource: String,
    pub id: String,
    pub gpu_index: u32,
    pub gpu_uuid: String,
    /// The daemon's state, with its error when it has one.
    pub state: String,
    /// Host path of the pipe folder.
    pub pipe_dir: String,
}

impl MpsAllocate {
    pub fn new(daemons: &[MpsDaemon], states: DaemonWatch) -> MpsAllocate {
        MpsAllocate {
            daemons: daemons.iter().map(|d| (d.resource.clone(), d.clone())).collect(),
            states,
        }
    }

    /// The state of the daemon of `resource` when it does not answer now (`starting`,
    /// `restarting: <why>`, ...); `None` when it runs or the resource has no daemon.
    fn not_answering(&self, resource: &str) -> Option<String> {
        self.daemons.get(resource)?;
        let Some(status) = self.states.status(resource) else {
            return Some("not started".to_string());
        };
        if status.state == DaemonState::Running {
            return None;
        }
        let word = serde_json::to_value(status.state)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{:?}", status.state));
        Some(match status.error {
            Some(error) => format!("{word}: {error}"),
            None => word,
        })
    }

    /// The daemon's GPU a replica of `resource` runs on; `None` for IDs that are not replicas
    /// or devices the daemon does not serve.
    fn served_gpu<'a>(&'a self, resource: &Resource, id: &str) -> Option<(&'a MpsDaemon, &'a MpsGpu)> {
        let daemon = self.daemons.get(&resource.name)?;
        if !is_replica_id(id) {
            return None;
        }
        let device = resource.devices.get(id)?;
        daemon.gpus.iter().find(|g| g.uuid == device.uuid).map(|g| (daemon, g))
    }

    /// Marks `Unhealthy` the replicas of `resource` whose daemon does not answer now; other
    /// devices (and resources without a daemon) keep their health.
    pub fn apply_health(&self, resource: &mut Resource) {
        if self.not_answering(&resource.name).is_none() {
            return;
        }
        let served: Vec<String> = resource
            .devices
            .keys()
            .filter(|id| self.served_gpu(resource, id).is_some())
            .cloned()
            .collect();
        for id in served {
            if let Some(device) = resource.devices.get_mut(&id) {
                device.health = Health::Unhealthy;
            }
        }
    }

    /// `Err` when `ids` hold a replica of `resource` whose daemon does not answer now: the
    /// container would get a pipe nobody serves.
    pub fn check_ready(&self, resource: &Resource, ids: &[String]) -> Result<(), Box<MpsNotReady>> {
        let Some(state) = self.not_answering(&resource.name) else {
            return Ok(());
        };
        match ids
            .iter()
            .find_map(|id| self.served_gpu(resource, id).map(|found| (id, found)))
        {
            Some((id, (daemon, gpu))) => Err(Box::new(MpsNotReady {
                resource: resource.name.clone(),
                id: id.clone(),
                gpu_index: gpu.index,
                gpu_uuid: gpu.uuid.clone(),
                state,
                pipe_dir: daemon.pipe_dir.display().to_string(),
            })),
            None => Ok(()),
        }
    }
}

/// The MPS edits of an `Allocate` answer for the replicas in `ids` of `resource`: NVIDIA's
/// `CUDA_MPS_PIPE_DIRECTORY=/mps/<resource>/pipe` with that folder mounted from
/// `<mps_root>/<resource>/pipe` and `/dev/shm` from `<mps_root>/shm`
/// (`internal/plugin/mps.go` `updateReponse`; NVIDIA sets no `CUDA_MPS_LOG_DIRECTORY` in the
/// container), and the replica's limits as client env, so they hold even for a daemon whose
/// defaults were changed by hand: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` (ordinal 0: a
/// container gets one replica, its one GPU) and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<percent>`.
/// IDs that are not replicas (devices the entry does not select) get nothing. Only Allocate
/// renders these: the CDI spec knows nothing of MPS.
pub fn mps_edits(mps: &MpsAllocate, resource: &Resource, ids: &[String]) -> ContainerEdits {
    let mut edits = ContainerEdits::default();
    let Some(daemon) = mps.daemons.get(&resource.name) else {
        return edits;
    };
    let gpus: Vec<&MpsGpu> = ids
        .iter()
        .filter(|id| is_replica_id(id))
        .filter_map(|id| resource.devices.get(id))
        .filter_map(|d| daemon.gpus.iter().find(|g| g.uuid == d.uuid))
        .collect();
    let Some(first) = gpus.first() else {
        return edits;
    };
    let pipe = daemon.container_pipe_dir();
    edits.env.push((PIPE_ENV.to_string(), pipe.clone()));
    let mut limits: Vec<String> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for g in &gpus {
        if seen.contains(&g.uuid.as_str()) {
            continue;
        }
        if let Some(mib) = g.memory_limit_mib {
            limits.push(format!("{}={mib}M", seen.len()));
        }
        seen.push(&g.uuid);
    }
    if !limits.is_empty() {
        edits.env.push((PINNED_MEM_ENV.to_string(), limits.join(",")));
    }
    edits
        .env
        .push((THREAD_ENV.to_string(), first.active_thread_percentage.to_string()));
    // Read-write: clients write to the pipes and the shared memory.
    edits.mounts.push(Mount {
        container_path: PathBuf::from(pipe),
        host_path: daemon.pipe_dir.clone(),
        options: Vec::new(),
    });
    edits.mounts.push(Mount {
        container_path: PathBuf::from(CONTAINER_SHM),
        host_path: daemon.shm_dir.clone(),
        options: Vec::new(),
    });
    edits
}

/// The control program under the driver root (a host path, not under `--root`), the first of
/// [`PROGRAM_DIRS`] that has it; `None` when none has.
pub fn find_program(root: &Path, driver_root: &Path) -> Option<PathBuf> {
    PROGRAM_DIRS.iter().find_map(|dir| {
        let host = driver_root.join(dir.trim_start_matches('/')).join(CONTROL_PROGRAM);
        crate::host::rooted(root, &host).is_file().then_some(host)
    })
}

#[cfg(test)]
pub(crate) mod tests;
