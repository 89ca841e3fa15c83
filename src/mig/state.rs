//! The MIG facts of a GPU as NVML reports them (observed state), and the operations that
//! change them. Profiles come from NVML for each GPU, never from a hard-coded table: names
//! depend on the card's memory and driver.

use serde::Serialize;

/// A placement in NVML's terms: first slice and number of slices (memory slices for a GPU
/// instance, compute slices inside a GPU instance for a compute instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

/// A compute instance profile available inside a GPU instance of some profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CiProfile {
    /// Name without NVML's `MIG ` prefix, e.g. `1c.3g.20gb`, or the GPU instance's own name
    /// (`3g.20gb`) for the compute instance spanning it.
    pub name: String,
    /// NVML profile *index* (the `NVML_COMPUTE_INSTANCE_PROFILE_*` constant).
    pub index: u32,
    /// NVML profile id (what the create calls take).
    pub id: u32,
    pub slice_count: u32,
    pub instance_count: u32,
    /// Possible placements inside a GPU instance of the parent profile.
    pub placements: Vec<Placement>,
}

/// A GPU instance profile of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GiProfile {
    /// Name without `MIG `, e.g. `1g.5gb`, `1g.5gb+me`, `7g.80gb`.
    pub name: String,
    /// NVML profile *index* (`NVML_GPU_INSTANCE_PROFILE_*`), what GetGpuInstanceProfileInfo takes.
    pub index: u32,
    /// NVML profile id (e.g. 19 for 1g.5gb), what the create and list calls take.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// How many such instances fit at most.
    pub instance_count: u32,
    pub memory_mib: u64,
    /// Every placement NVML allows for it (memory slices).
    pub placements: Vec<Placement>,
    /// Compute instance profiles inside one instance of this profile.
    pub ci_profiles: Vec<CiProfile>,
}

impl GiProfile {
    /// Whether `ci_profiles` came from NVML. Until an instance of the profile exists, NVML cannot
    /// be asked, and observation puts in only the compute instance spanning the whole instance,
    /// with [`CiProfile::UNREAD`] as its index and id.
    pub fn ci_profiles_read(&self) -> bool {
        self.ci_profiles.iter().any(|c| c.index != CiProfile::UNREAD)
    }
}

impl CiProfile {
    /// Index and id of a compute instance profile not read from NVML (see
    /// [`GiProfile::ci_profiles_read`]); the applier looks it up by name in the new instance.
    pub const UNREAD: u32 = u32::MAX;
}

/// A compute instance that exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObservedCi {
    pub id: u32,
    pub profile_id: u32,
    pub placement: Placement,
}

/// A GPU instance that exists, with its compute instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObservedGi {
    pub id: u32,
    pub profile_id: u32,
    pub placement: Placement,
    pub compute_instances: Vec<ObservedCi>,
}

/// One GPU's MIG state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObservedGpu {
    pub index: u32,
    pub uuid: String,
    /// 16-bit PCI device id, e.g. 0x20b0 (for `device_filter`).
    pub pci_device_id: u16,
    /// NVML's `pciSubSystemId` (subsystem device << 16 | subsystem vendor), for `device_filter`
    /// entries with a subsystem id.
    pub pci_subsystem_id: u32,
    /// `None`: the GPU does not support MIG.
    pub mode: Option<crate::nvml::MigState>,
    /// The GPU's instance profiles (empty for a GPU without MIG). Most drivers report them
    /// whether or not MIG is enabled; those of the R535 class only while it is (empty with MIG
    /// off: [`super::planner::PlanError::GiProfilesUnknown`]).
    pub profiles: Vec<GiProfile>,
    pub gpu_instances: Vec<ObservedGi>,
}

impl ObservedGpu {
    /// What a layout's `device_filter` is matched against.
    pub fn pci_ids(&self) -> crate::mig_layout::GpuPciIds {
        crate::mig_layout::GpuPciIds {
            device: self.pci_device_id,
            subsystem: self.pci_subsystem_id,
        }
    }
}

/// One NVML mutation. GPU and compute instances are named by id (existing ones) or by the
/// position of a `CreateGi` in the same GPU's plan (new ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum MigOp {
    DestroyCi {
        gi_id: u32,
        ci_id: u32,
    },
    DestroyGi {
        gi_id: u32,
    },
    SetMode {
        enabled: bool,
    },
    /// Create a GPU instance of `profile_id` at `placement`.
    CreateGi {
        profile_id: u32,
        placement: Placement,
        name: String,
    },
    /// Create a compute instance in the GPU instance made by the `gi`-th `CreateGi` of this plan,
    /// or in an existing GPU instance.
    CreateCi {
        gi: GiRef,
        profile_id: u32,
        placement: Placement,
        name: String,
    },
}

/// Which GPU instance a `CreateCi` goes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GiRef {
    Existing(u32),
    /// The n-th `CreateGi` (0-based) of the same GPU plan.
    New(usize),
}

/// What to do to one GPU; no operations when it already matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuPlan {
    pub index: u32,
    pub uuid: String,
    pub ops: Vec<MigOp>,
}
