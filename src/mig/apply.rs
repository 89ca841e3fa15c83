//! Observing and changing MIG state through NVML. nvml-wrapper wraps none of the GPU/compute
//! instance calls (and its `possible_placements` returns nothing), so these go through
//! `Nvml::lib()`; each `unsafe` block says why it is sound.

use std::collections::BTreeMap;
use std::sync::Mutex;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;

use super::state::{CiProfile, GiProfile, GiRef, GpuPlan, MigOp, ObservedCi, ObservedGi, ObservedGpu, Placement};
use crate::nvml::{GpuError, Gpus, MigState, c_name, struct_version};

/// Profile indices are probed up to this bound; NVML answers INVALID_ARGUMENT past the last.
const MAX_PROFILE_INDEX: u32 = 64;

/// What happened when a plan was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// NVML mutations performed.
    pub mutations: usize,
    /// A mode change NVML accepted as pending (the GPU needs a reset or reboot to finish it).
    pub mode_pending: bool,
    /// The apply stopped before the plan's end because the agent is stopping (between two
    /// operations: the next start re-observes and converges from there).
    pub stopped: bool,
}

/// Why an NVML MIG call failed, naming the GPU and the operation.
#[derive(Debug, thiserror::Error)]
#[error("GPU {index} ({uuid}): {op}: {source}")]
pub struct MigCallError {
    pub index: u32,
    pub uuid: String,
    pub op: String,
    pub source: NvmlError,
}

impl MigCallError {
    /// NVML said the instance or GPU is in use (processes or compute instances).
    pub fn in_use(&self) -> bool {
        matches!(self.source, NvmlError::InUse)
    }

    /// GPU `index` could not even be opened.
    fn from_gpu(index: u32, e: GpuError) -> MigCallError {
        let (gpu, source) = match e {
            GpuError::Device { gpu, source, .. } => (gpu, source),
            GpuError::Call { source, .. } | GpuError::Load { source, .. } => (format!("index {index}"), source),
        };
        MigCallError {
            index,
            uuid: gpu,
            op: "open GPU".into(),
            source,
        }
    }
}

fn rc(code: sys::nvmlReturn_t) -> Result<(), NvmlError> {
    if code == sys::nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::from(code))
    }
}

/// Raw MIG access to one GPU.
struct Raw<'a> {
    nvml: &'a Nvml,
    device: Device<'a>,
    index: u32,
    uuid: String,
}

impl Raw<'_> {
    fn err(&self, op: impl Into<String>) -> impl FnOnce(NvmlError) -> MigCallError + '_ {
        let op = op.into();
        move |source| MigCallError {
            index: self.index,
            uuid: self.uuid.clone(),
            op,
            source,
        }
    }

    fn sym<T: Copy>(&self, sym: &Result<T, libloading::Error>, name: &str) -> Result<T, MigCallError> {
        sym.as_ref()
            .copied()
            .map_err(|_| self.err(name)(NvmlError::FunctionNotFound))
    }

    fn handle(&self) -> sys::nvmlDevice_t {
        // SAFETY: the device handle is valid while `self.nvml` is initialised, which outlives us.
        unsafe { self.device.handle() }
    }

    /// Every GPU instance profile NVML reports, with its placements.
    fn gi_profiles(&self) -> Result<Vec<GiProfile>, MigCallError> {
        let lib = self.nvml.lib();
        let info_v = self.sym(
            &lib.nvmlDeviceGetGpuInstanceProfileInfoV,
            "nvmlDeviceGetGpuInstanceProfileInfoV",
        )?;
        let placements = self.sym(
            &lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2,
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        )?;
        let mut out = Vec::new();
        for index in 0..MAX_PROFILE_INDEX {
            // SAFETY: `info` is a zeroed C struct with its version word set as the V call
            // requires; the device handle is live.
            let mut info: sys::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = struct_version(std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>(), 2);
            match unsafe { info_v(self.handle(), index, &mut info) } {
                sys::nvmlReturn_enum_NVML_SUCCESS => {}
                sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => continue,
                sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => break,
                other => return Err(self.err(format!("profile info index {index}"))(NvmlError::from(other))),
            }
            let mut count: u32 = 0;
            // SAFETY: NULL placements asks for the count only.
            rc(unsafe { placements(self.handle(), info.id, std::ptr::null_mut(), &mut count) })
                .map_err(self.err(format!("possible placements of profile {}", info.id)))?;
            let mut buf = vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
            // SAFETY: `buf` holds `count` placements, the capacity we pass.
            rc(unsafe { placements(self.handle(), info.id, buf.as_mut_ptr(), &mut count) })
                .map_err(self.err(format!("possible placements of profile {}", info.id)))?;
            buf.truncate(count as usize);
            out.push(GiProfile {
                name: c_name(&info.name).trim_start_matches("MIG ").to_string(),
                index,
                id: info.id,
                slice_count: info.sliceCount,
                instance_count: info.instanceCount,
                memory_mib: info.memorySizeMB,
                placements: buf
                    .iter()
                    .map(|p| Placement {
                        start: p.start,
                        size: p.size,
                    })
                    .collect(),
                ci_profiles: Vec::new(),
            });
        }
        Ok(out)
    }

    /// The GPU instances of `profile`, as handles.
    fn gpu_instances(&self, profile: &GiProfile) -> Result<Vec<sys::nvmlGpuInstance_t>, MigCallError> {
        let get = self.sym(&self.nvml.lib().nvmlDeviceGetGpuInstances, "nvmlDeviceGetGpuInstances")?;
        let mut handles = vec![std::ptr::null_mut(); profile.instance_count.max(1) as usize];
        let mut count: u32 = handles.len() as u32;
        // SAFETY: `handles` has room for the profile's instance count, the most NVML returns.
        rc(unsafe { get(self.handle(), profile.id, handles.as_mut_ptr(), &mut count) })
            .map_err(self.err(format!("list {} GPU instances", profile.name)))?;
        handles.truncate(count as usize);
        Ok(handles)
    }

    fn gi_info(&self, gi: sys::nvmlGpuInstance_t) -> Result<sys::nvmlGpuInstanceInfo_t, MigCallError> {
        let info_fn = self.sym(&self.nvml.lib().nvmlGpuInstanceGetInfo, "nvmlGpuInstanceGetInfo")?;
        // SAFETY: `gi` was just returned by NVML; `info` is a plain C struct.
        let mut info: sys::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        rc(unsafe { info_fn(gi, &mut info) }).map_err(self.err("GPU instance info"))?;
        Ok(info)
    }

    /// The compute instance profiles NVML reports inside `gi`, with placements.
    fn ci_profiles(&self, gi: sys::nvmlGpuInstance_t) -> Result<Vec<CiProfile>, MigCallError> {
        let lib = self.nvml.lib();
        let info_v = self.sym(
            &lib.nvmlGpuInstanceGetComputeInstanceProfileInfoV,
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        )?;
        let placements = self.sym(
            &lib.nvmlGpuInstanceGetComputeInstancePossiblePlacements,
            "nvmlGpuInstanceGetComputeInstancePossiblePlacements",
        )?;
        let mut out = Vec::new();
        for index in 0..MAX_PROFILE_INDEX {
            // SAFETY: zeroed C struct with its version word set; `gi` is live.
            let mut info: sys::nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = struct_version(std::mem::size_of::<sys::nvmlComputeInstanceProfileInfo_v2_t>(), 2);
            match unsafe { info_v(gi, index, sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut info) } {
                sys::nvmlReturn_enum_NVML_SUCCESS => {}
                sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => continue,
                sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => break,
                other => {
                    return Err(self.err(format!("CI profile info index {index}"))(NvmlError::from(
                        other,
                    )));
                }
            }
            let mut count: u32 = 0;
            // SAFETY: NULL asks for the count; then a buffer of that size.
            rc(unsafe { placements(gi, info.id, std::ptr::null_mut(), &mut count) })
                .map_err(self.err(format!("CI placements of profile {}", info.id)))?;
            let mut buf = vec![sys::nvmlComputeInstancePlacement_t { start: 0, size: 0 }; count as usize];
            rc(unsafe { placements(gi, info.id, buf.as_mut_ptr(), &mut count) })
                .map_err(self.err(format!("CI placements of profile {}", info.id)))?;
            buf.truncate(count as usize);
            out.push(CiProfile {
                name: c_name(&info.name).trim_start_matches("MIG ").to_string(),
                index,
                id: info.id,
                slice_count: info.sliceCount,
                instance_count: info.instanceCount,
                placements: buf
                    .iter()
                    .map(|p| Placement {
                        start: p.start,
                        size: p.size,
                    })
                    .collect(),
            });
        }
        Ok(out)
    }

    fn compute_instances(
        &self,
        gi: sys::nvmlGpuInstance_t,
        profiles: &[CiProfile],
    ) -> Result<Vec<(sys::nvmlComputeInstance_t, ObservedCi)>, MigCallError> {
        let lib = self.nvml.lib();
        let get = self.sym(
            &lib.nvmlGpuInstanceGetComputeInstances,
            "nvmlGpuInstanceGetComputeInstances",
        )?;
        let info_fn = self.sym(&lib.nvmlComputeInstanceGetInfo_v2, "nvmlComputeInstanceGetInfo_v2")?;
        let mut out = Vec::new();
        for p in profiles {
            let mut handles = vec![std::ptr::null_mut(); p.instance_count.max(1) as usize];
            let mut count = handles.len() as u32;
            // SAFETY: room for the profile's instance count; `gi` is live.
            rc(unsafe { get(gi, p.id, handles.as_mut_ptr(), &mut count) })
                .map_err(self.err(format!("list {} compute instances", p.name)))?;
            for &ci in handles.iter().take(count as usize) {
                // SAFETY: `ci` was just returned by NVML; plain C struct out-param.
                let mut info: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                rc(unsafe { info_fn(ci, &mut info) }).map_err(self.err("compute instance info"))?;
                let placement = Placement {
                    start: info.placement.start,
                    size: info.placement.size,
                };
                out.push((
                    ci,
                    ObservedCi {
                        id: info.id,
                        profile_id: info.profileId,
                        placement,
                    },
                ));
            }
        }
        Ok(out)
    }

    /// Every GPU instance that exists, by profile, with its compute instances and handles.
    fn instances(&self, profiles: &mut [GiProfile]) -> Result<Vec<(sys::nvmlGpuInstance_t, ObservedGi)>, MigCallError> {
        let mut out = Vec::new();
        for profile in profiles.iter_mut() {
            for gi in self.gpu_instances(profile)? {
                let info = self.gi_info(gi)?;
                let cis = self.ci_profiles(gi)?;
                let compute_instances = self.compute_instances(gi, &cis)?.into_iter().map(|(_, c)| c).collect();
                if profile.ci_profiles.is_empty() {
                    profile.ci_profiles = cis;
                }
                let placement = Placement {
                    start: info.placement.start,
                    size: info.placement.size,
                };
                out.push((
                    gi,
                    ObservedGi {
                        id: info.id,
                        profile_id: info.profileId,
                        placement,
                        compute_instances,
                    },
                ));
            }
        }
        out.sort_by_key(|(_, g)| g.placement);
        Ok(out)
    }
}

impl Gpus {
    fn raw(&self, index: u32) -> Result<Raw<'_>, GpuError> {
        let nvml = self.nvml();
        let at = format!("index {index}");
        let device = nvml.device_by_index(index).map_err(|source| GpuError::Device {
            call: "nvmlDeviceGetHandleByIndex_v2".into(),
            gpu: at.clone(),
            source,
        })?;
        let uuid = device.uuid().map_err(|source| GpuError::Device {
            call: "nvmlDeviceGetUUID".into(),
            gpu: at,
            source,
        })?;
        Ok(Raw {
            nvml,
            device,
            index,
            uuid,
        })
    }

    /// The MIG state of every GPU: mode, NVML's profile tables with placements, and the GPU and
    /// compute instances that exist.
    pub fn mig_observe(&self) -> Result<Vec<ObservedGpu>, GpuError> {
        let count = self.nvml().device_count().map_err(|source| GpuError::Call {
            call: "nvmlDeviceGetCount_v2".into(),
            source,
        })?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let raw = self.raw(index)?;
            let pci = raw.device.pci_info().map_err(|source| GpuError::Device {
                call: "nvmlDeviceGetPciInfo_v3".into(),
                gpu: raw.uuid.clone(),
                source,
            })?;
            let mode = match raw.device.mig_mode() {
                Ok(m) => Some(MigState {
                    current: m.current == 1,
                    pending: m.pending == 1,
                }),
                Err(NvmlError::NotSupported) => None,
                Err(source) => {
                    return Err(GpuError::Device {
                        call: "nvmlDeviceGetMigMode".into(),
                        gpu: raw.uuid.clone(),
                        source,
                    });
                }
            };
            let (profiles, gpu_instances) = if mode.is_some() {
                let to_gpu = |e: MigCallError| GpuError::Device {
                    call: e.op,
                    gpu: e.uuid,
                    source: e.source,
                };
                let mut profiles = raw.gi_profiles().map_err(to_gpu)?;
                self.remember_profiles(&raw.uuid, &mut profiles);
                let instances = if mode.is_some_and(|m| m.current) {
                    raw.instances(&mut profiles)
                        .map_err(to_gpu)?
                        .into_iter()
                        .map(|(_, g)| g)
                        .collect()
                } else {
                    Vec::new()
                };
                // NVML lists compute instance profiles only inside an existing GPU instance. For
                // a profile with none yet, only the compute instance spanning it is known to
                // exist (its id is looked up in the new instance when it is created).
                for p in profiles.iter_mut().filter(|p| p.ci_profiles.is_empty()) {
                    p.ci_profiles.push(CiProfile {
                        name: p.name.clone(),
                        index: CiProfile::UNREAD,
                        id: CiProfile::UNREAD,
                        slice_count: p.slice_count,
                        instance_count: 1,
                        placements: vec![Placement {
                            start: 0,
                            size: p.slice_count,
                        }],
                    });
                }
                (profiles, instances)
            } else {
                (Vec::new(), Vec::new())
            };
            gpus.push(ObservedGpu {
                index,
                uuid: raw.uuid.clone(),
                pci_device_id: (pci.pci_device_id >> 16) as u16,
                pci_subsystem_id: pci.pci_sub_system_id.unwrap_or(0),
                mode,
                profiles,
                gpu_instances,
            });
        }
        Ok(gpus)
    }

    /// Keeps the GPU instance profiles a GPU lists, and gives them back to it when it lists
    /// none (a driver of the R535 class while MIG is off): the table is the card's and the
    /// driver's, so it is kept per GPU UUID and driver version for as long as the process runs.
    /// A GPU whose profiles had to be read by enabling MIG is then not switched again by every
    /// later converge of the daemon.
    fn remember_profiles(&self, uuid: &str, profiles: &mut Vec<GiProfile>) {
        static SEEN: Mutex<BTreeMap<(String, String), Vec<GiProfile>>> = Mutex::new(BTreeMap::new());
        let Ok(driver) = self.nvml().sys_driver_version() else {
            return;
        };
        let Ok(mut seen) = SEEN.lock() else {
            return;
        };
        let key = (uuid.to_owned(), driver);
        if profiles.is_empty() {
            if let Some(known) = seen.get(&key) {
                profiles.clone_from(known);
            }
        } else {
            seen.insert(key, profiles.clone());
        }
    }

    /// Reads the compute instance profiles of GPU instance profile `gi_profile_id` on GPU
    /// `index`, which NVML lists only inside an existing instance: creates one wherever NVML
    /// finds room, reads them, and destroys it again (two mutations that leave the GPU as it
    /// was). `Ok(None)` when there is no room for one. The caller makes sure the GPU is idle.
    pub fn mig_read_ci_profiles(&self, index: u32, gi_profile_id: u32) -> Result<Option<Vec<CiProfile>>, MigCallError> {
        let raw = self.raw(index).map_err(|e| MigCallError::from_gpu(index, e))?;
        let lib = self.nvml().lib();
        let create = raw.sym(&lib.nvmlDeviceCreateGpuInstance, "nvmlDeviceCreateGpuInstance")?;
        let destroy = raw.sym(&lib.nvmlGpuInstanceDestroy, "nvmlGpuInstanceDestroy")?;
        let mut gi = std::ptr::null_mut();
        // SAFETY: `gi` is an out-param; the device handle is live.
        match unsafe { create(raw.handle(), gi_profile_id, &mut gi) } {
            sys::nvmlReturn_enum_NVML_SUCCESS => {}
            sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => return Ok(None),
            other => {
                return Err(raw.err(format!(
                    "create a GPU instance of profile {gi_profile_id} to read its compute instance profiles"
                ))(NvmlError::from(other)));
            }
        }
        let read = raw.ci_profiles(gi);
        // SAFETY: `gi` was created above and has no compute instances.
        let destroyed = rc(unsafe { destroy(gi) }).map_err(raw.err(format!(
            "destroy the GPU instance of profile {gi_profile_id} made to read its compute instance profiles"
        )));
        let profiles = read?;
        destroyed?;
        Ok(Some(profiles))
    }

    /// Performs `plan` on its GPU, in order. Stops at the first failure (the caller re-observes
    /// and re-plans: every step converges from whatever state it left).
    pub fn mig_apply(&self, plan: &GpuPlan) -> Result<Applied, MigCallError> {
        self.mig_apply_until(plan, &|| false)
    }

    /// [`Gpus::mig_apply`], looking at `stopped` before each operation: once it says so, the
    /// rest of the plan is left (`Applied::stopped`). NVML operations are never interrupted.
    pub fn mig_apply_until(&self, plan: &GpuPlan, stopped: &dyn Fn() -> bool) -> Result<Applied, MigCallError> {
        let raw = self.raw(plan.index).map_err(|e| MigCallError {
            uuid: plan.uuid.clone(),
            ..MigCallError::from_gpu(plan.index, e)
        })?;
        let lib = self.nvml().lib();
        let mut applied = Applied {
            mutations: 0,
            mode_pending: false,
            stopped: false,
        };
        let mut created: Vec<sys::nvmlGpuInstance_t> = Vec::new();
        for op in &plan.ops {
            if stopped() {
                applied.stopped = true;
                return Ok(applied);
            }
            match op {
                MigOp::DestroyCi { gi_id, ci_id } => {
                    let by_id = raw.sym(&lib.nvmlDeviceGetGpuInstanceById, "nvmlDeviceGetGpuInstanceById")?;
                    let ci_by_id = raw.sym(
                        &lib.nvmlGpuInstanceGetComputeInstanceById,
                        "nvmlGpuInstanceGetComputeInstanceById",
                    )?;
                    let destroy = raw.sym(&lib.nvmlComputeInstanceDestroy, "nvmlComputeInstanceDestroy")?;
                    let what = format!("destroy compute instance {ci_id} of GPU instance {gi_id}");
                    // SAFETY: handles are out-params NVML fills; used only while valid.
                    unsafe {
                        let mut gi = std::ptr::null_mut();
                        rc(by_id(raw.handle(), *gi_id, &mut gi)).map_err(raw.err(&what))?;
                        let mut ci = std::ptr::null_mut();
                        rc(ci_by_id(gi, *ci_id, &mut ci)).map_err(raw.err(&what))?;
                        rc(destroy(ci)).map_err(raw.err(&what))?;
                    }
                }
                MigOp::DestroyGi { gi_id } => {
                    let by_id = raw.sym(&lib.nvmlDeviceGetGpuInstanceById, "nvmlDeviceGetGpuInstanceById")?;
                    let destroy = raw.sym(&lib.nvmlGpuInstanceDestroy, "nvmlGpuInstanceDestroy")?;
                    let what = format!("destroy GPU instance {gi_id}");
                    // SAFETY: as above.
                    unsafe {
                        let mut gi = std::ptr::null_mut();
                        rc(by_id(raw.handle(), *gi_id, &mut gi)).map_err(raw.err(&what))?;
                        rc(destroy(gi)).map_err(raw.err(&what))?;
                    }
                }
                MigOp::SetMode { enabled } => {
                    let what = format!("set MIG mode {}", if *enabled { "enabled" } else { "disabled" });
                    let status = raw.device.set_mig_mode(*enabled).map_err(raw.err(&what))?;
                    if status != sys::nvmlReturn_enum_NVML_SUCCESS {
                        // Accepted, but pending until the GPU is reset (busy, or a VM).
                        tracing::warn!(gpu = %raw.uuid, "{what}: pending ({})", NvmlError::from(status));
                        applied.mode_pending = true;
                        applied.mutations += 1;
                        return Ok(applied);
                    }
                }
                MigOp::CreateGi {
                    profile_id,
                    placement,
                    name,
                } => {
                    let create = raw.sym(
                        &lib.nvmlDeviceCreateGpuInstanceWithPlacement,
                        "nvmlDeviceCreateGpuInstanceWithPlacement",
                    )?;
                    let what = format!("create {name} GPU instance at {}:{}", placement.start, placement.size);
                    let p = sys::nvmlGpuInstancePlacement_t {
                        start: placement.start,
                        size: placement.size,
                    };
                    let mut gi = std::ptr::null_mut();
                    // SAFETY: `p` outlives the call; `gi` is an out-param.
                    rc(unsafe { create(raw.handle(), *profile_id, &p, &mut gi) }).map_err(raw.err(&what))?;
                    created.push(gi);
                }
                MigOp::CreateCi {
                    gi: gi_ref,
                    profile_id: _,
                    placement,
                    name,
                } => {
                    let gi = match gi_ref {
                        GiRef::New(n) => *created.get(*n).ok_or_else(|| {
                            raw.err(format!(
                                "create {name} compute instance: no GPU instance #{n} in this plan"
                            ))(NvmlError::InvalidArg)
                        })?,
                        GiRef::Existing(id) => {
                            let by_id = raw.sym(&lib.nvmlDeviceGetGpuInstanceById, "nvmlDeviceGetGpuInstanceById")?;
                            let mut gi = std::ptr::null_mut();
                            // SAFETY: out-param.
                            rc(unsafe { by_id(raw.handle(), *id, &mut gi) })
                                .map_err(raw.err(format!("find GPU instance {id}")))?;
                            gi
                        }
                    };
                    // Compute instance profile ids are looked up inside the instance itself (a
                    // GPU instance that did not exist at planning time could not be asked).
                    let profiles = raw.ci_profiles(gi)?;
                    let profile = profiles.iter().find(|p| p.name == *name).ok_or_else(|| {
                        raw.err(format!(
                            "create {name} compute instance: NVML offers {} in this GPU instance",
                            profiles.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
                        ))(NvmlError::NotFound)
                    })?;
                    let create = raw.sym(
                        &lib.nvmlGpuInstanceCreateComputeInstanceWithPlacement,
                        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
                    )?;
                    let what = format!(
                        "create {name} compute instance at {}:{}",
                        placement.start, placement.size
                    );
                    let p = sys::nvmlComputeInstancePlacement_t {
                        start: placement.start,
                        size: placement.size,
                    };
                    let mut ci = std::ptr::null_mut();
                    // SAFETY: `p` outlives the call; `ci` is an out-param.
                    rc(unsafe { create(gi, profile.id, &p, &mut ci) }).map_err(raw.err(&what))?;
                }
            }
            applied.mutations += 1;
        }
        Ok(applied)
    }
}
