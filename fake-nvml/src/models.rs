//! The GPU models the fake knows, with their MIG profile tables.
//!
//! GPU-instance tables are the hardware tables from `nvidia-smi mig -lgip/-lgipp` (see
//! `test-peers.md` §1.6): hardware profile ids (19/20/15/14/9/5/0), NVML profile *indices*
//! (0/7/9/1/2/3/4), instance counts, engine counts, memory and placements in memory slices.
//! Compute-instance profiles are derived from the GPU instance they live in (see
//! [`ci_profiles`]).

use nvml_wrapper_sys::bindings::{
    NVML_DEVICE_ARCH_AMPERE, NVML_DEVICE_ARCH_BLACKWELL, NVML_DEVICE_ARCH_HOPPER, NVML_DEVICE_ARCH_TURING,
    nvmlBrandType_enum_NVML_BRAND_NVIDIA, nvmlBrandType_enum_NVML_BRAND_NVIDIA_RTX,
    nvmlBrandType_enum_NVML_BRAND_TESLA,
};

/// Memory slices, compute slices and MIG device slots of the 7-slice parts (A100, H100):
/// 8 memory slices, 7 compute slices (GPCs usable by MIG), `nvmlDeviceGetMaxMigDeviceCount` 7.
const SEVEN_SLICE: MigGeometry = MigGeometry {
    memory_slices: 8,
    compute_slices: 7,
    max_mig_devices: 7,
};

/// A30 and RTX PRO 6000 Blackwell: 4 memory slices, 4 compute slices, at most 4 MIG devices
/// (MIG user guide, "Supported GPUs": both max 4 instances; their profile fractions are
/// quarters).
const FOUR_SLICE: MigGeometry = MigGeometry {
    memory_slices: 4,
    compute_slices: 4,
    max_mig_devices: 4,
};

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of the newest NVML header (13.3: 18, after
/// `3_SLICE_GFX` = 17; nvml-wrapper-sys 0.10's bindings stop at `2_SLICE_ALL_ME` = 16, COUNT
/// 17). Profile-info calls answer INVALID_ARGUMENT from this index on and NOT_SUPPORTED below
/// it for an index the model lacks, so callers probing indices 0.. stop here.
pub const GI_PROFILE_INDEX_COUNT: u32 = 18;

/// No MIG (T4).
const NO_MIG: MigGeometry = MigGeometry {
    memory_slices: 0,
    compute_slices: 0,
    max_mig_devices: 0,
};

/// How a MIG-capable model divides into slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigGeometry {
    /// Memory slices; GPU-instance placements are in these units.
    pub memory_slices: u32,
    /// Compute slices (the `Ng` of the profile names add up to at most this).
    pub compute_slices: u32,
    /// `nvmlDeviceGetMaxMigDeviceCount` with MIG enabled; also the number of MIG device slots.
    pub max_mig_devices: u32,
}

/// One GPU model the machine file can name.
#[derive(Debug)]
pub struct GpuModel {
    /// The key used in the machine file (`model = "..."`).
    pub key: &'static str,
    /// What `nvmlDeviceGetName` reports.
    pub name: &'static str,
    /// PCI device id (the high half of `pciDeviceId`; the low half is 0x10DE).
    pub pci_device_id: u16,
    /// `pciSubSystemId` as NVML reports it (subsystem id << 16 | subsystem vendor).
    pub pci_subsystem_id: u32,
    /// Total framebuffer in MiB.
    pub memory_mib: u64,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `nvmlDeviceArchitecture_t`.
    pub architecture: u32,
    /// `nvmlBrandType_t`.
    pub brand: u32,
    /// Streaming multiprocessors of the whole GPU.
    pub sm_count: u32,
    /// Copy engines, decoders, encoders, JPEG decoders and OFAs of the whole GPU.
    pub engines: Engines,
    /// NVLink links the part has; 0 means no NVLink (calls answer NOT_SUPPORTED).
    pub nvlink_links: u32,
    /// Idle power draw reported by `nvmlDeviceGetPowerUsage`, in milliwatts.
    pub idle_power_mw: u32,
    /// SM clock (MHz) of an idle GPU and of a busy one (the maximum boost clock).
    pub sm_clock_mhz: (u32, u32),
    /// Memory clock (MHz), `nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)`.
    pub memory_clock_mhz: u32,
    /// HBM memory, whose temperature NVML reports (field `NVML_FI_DEV_MEMORY_TEMP`); GDDR parts
    /// answer NOT_SUPPORTED.
    pub hbm: bool,
    /// Slice counts; all zero when the model has no MIG.
    pub mig: MigGeometry,
    /// GPU-instance profiles; empty when the model has no MIG.
    pub gi_profiles: &'static [GiProfile],
}

impl GpuModel {
    /// Whether the model supports MIG at all.
    pub fn has_mig(&self) -> bool {
        !self.gi_profiles.is_empty()
    }

    /// GPU-instance profile by hardware profile id (what creation calls take).
    pub fn gi_profile_by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.gi_profiles.iter().find(|p| p.id == id)
    }

    /// GPU-instance profile by NVML profile index (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub fn gi_profile_by_index(&self, index: u32) -> Option<&'static GiProfile> {
        self.gi_profiles.iter().find(|p| p.index == index)
    }

    /// GPU-instance profile by its name, e.g. `3g.20gb` or `1g.24gb+me.all`.
    pub fn gi_profile_by_name(&self, name: &str) -> Option<&'static GiProfile> {
        self.gi_profiles.iter().find(|p| p.name == name)
    }
}

impl GiProfile {
    /// Whether the profile supports graphics (the `+gfx` profiles of GB20x parts): NVML's
    /// `NVML_GPU_INSTANCE_PROFILE_CAPS_GFX`, and `NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX` on
    /// the compute instances inside it.
    pub fn gfx(&self) -> bool {
        self.name.ends_with("+gfx")
    }
}

/// Engine counts of a GPU, GPU instance or compute instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Engines {
    /// Copy engines.
    pub ce: u32,
    /// Video decoders.
    pub dec: u32,
    /// Video encoders.
    pub enc: u32,
    /// JPEG decoders.
    pub jpeg: u32,
    /// Optical flow accelerators.
    pub ofa: u32,
}

/// One GPU-instance profile of a model.
#[derive(Debug)]
pub struct GiProfile {
    /// NVML profile index (`NVML_GPU_INSTANCE_PROFILE_1_SLICE` = 0, ...).
    pub index: u32,
    /// Hardware profile id (what `nvmlDeviceCreateGpuInstance` takes).
    pub id: u32,
    /// Profile name without the `MIG ` prefix, e.g. `1g.5gb`.
    pub name: &'static str,
    /// How many instances of this profile fit on an empty GPU.
    pub instance_count: u32,
    /// Compute slices (the `Ng` in the name).
    pub slices: u32,
    /// Streaming multiprocessors.
    pub sm: u32,
    /// Engine counts.
    pub engines: Engines,
    /// Memory in MiB as NVML reports `memorySizeMB`.
    pub memory_mib: u64,
    /// Memory slices the instance occupies (the placement `size`).
    pub mem_size: u32,
    /// Valid placement starts, in memory slices.
    pub starts: &'static [u32],
}

/// One compute-instance profile inside a GPU instance of a given profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CiProfile {
    /// NVML compute-instance profile index; also the profile id NVML reports.
    pub index: u32,
    /// Compute slices the compute instance uses.
    pub slices: u32,
    /// How many fit into an empty GPU instance.
    pub instance_count: u32,
    /// Streaming multiprocessors.
    pub sm: u32,
    /// Valid placement starts, in compute slices of the GPU instance.
    pub starts: Vec<u32>,
    /// Name without the `MIG ` prefix: `1c.3g.20gb`, or the GI name for the full-size one.
    pub name: String,
}

const fn eng(ce: u32, dec: u32, enc: u32, jpeg: u32, ofa: u32) -> Engines {
    Engines {
        ce,
        dec,
        enc,
        jpeg,
        ofa,
    }
}

const ONE_SLICE_STARTS: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO_SLICE_STARTS: &[u32] = &[0, 2, 4];
const DOUBLE_MEM_ONE_SLICE_STARTS: &[u32] = &[0, 2, 4, 6];
const HALF_STARTS: &[u32] = &[0, 4];
const ZERO_START: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn gi(
    index: u32,
    id: u32,
    name: &'static str,
    instance_count: u32,
    slices: u32,
    sm: u32,
    engines: Engines,
    memory_mib: u64,
    mem_size: u32,
    starts: &'static [u32],
) -> GiProfile {
    GiProfile {
        index,
        id,
        name,
        instance_count,
        slices,
        sm,
        engines,
        memory_mib,
        mem_size,
        starts,
    }
}

/// A100-SXM4-40GB, memory sizes as older drivers report them (4.75/9.62/19.50/39.25 GiB).
static A100_40GB_PROFILES: [GiProfile; 7] = [
    gi(0, 19, "1g.5gb", 7, 1, 14, eng(1, 0, 0, 0, 0), 4864, 1, ONE_SLICE_STARTS),
    gi(
        7,
        20,
        "1g.5gb+me",
        1,
        1,
        14,
        eng(1, 1, 0, 1, 1),
        4864,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.10gb",
        4,
        1,
        14,
        eng(1, 1, 0, 0, 0),
        9856,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.10gb",
        3,
        2,
        28,
        eng(2, 1, 0, 0, 0),
        9856,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.20gb", 2, 3, 42, eng(3, 2, 0, 0, 0), 19968, 4, HALF_STARTS),
    gi(3, 5, "4g.20gb", 1, 4, 56, eng(4, 2, 0, 0, 0), 19968, 4, ZERO_START),
    gi(4, 0, "7g.40gb", 1, 7, 98, eng(7, 5, 0, 1, 1), 40192, 8, ZERO_START),
];

/// A100-SXM4-80GB: same ids, counts, SMs and placements as the 40GB part; memory and the
/// 1g.10gb decoder count as a real A100-80GB listing shows them
/// (`tests/fixtures/a100-sxm4-80gb.lgip`). 7g.80gb is 78.75 GiB = 80640 MiB there, not the
/// 79.25 GiB (81152 MiB) of the H100 table this value was once copied from.
static A100_80GB_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.10gb",
        7,
        1,
        14,
        eng(1, 0, 0, 0, 0),
        9728,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.10gb+me",
        1,
        1,
        14,
        eng(1, 1, 0, 1, 1),
        9728,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.20gb",
        4,
        1,
        14,
        eng(1, 1, 0, 0, 0),
        19968,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.20gb",
        3,
        2,
        28,
        eng(2, 1, 0, 0, 0),
        19968,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.40gb", 2, 3, 42, eng(3, 2, 0, 0, 0), 40192, 4, HALF_STARTS),
    gi(3, 5, "4g.40gb", 1, 4, 56, eng(4, 2, 0, 0, 0), 40192, 4, ZERO_START),
    gi(4, 0, "7g.80gb", 1, 7, 98, eng(7, 5, 0, 1, 1), 80640, 8, ZERO_START),
];

/// H100 80GB HBM3 (SXM5), the hardware table (not go-nvml's mock table).
static H100_80GB_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.10gb",
        7,
        1,
        16,
        eng(1, 1, 0, 1, 0),
        9984,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.10gb+me",
        1,
        1,
        16,
        eng(1, 1, 0, 1, 1),
        9984,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.20gb",
        4,
        1,
        26,
        eng(1, 1, 0, 1, 0),
        20096,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.20gb",
        3,
        2,
        32,
        eng(2, 2, 0, 2, 0),
        20096,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.40gb", 2, 3, 60, eng(3, 3, 0, 3, 0), 40448, 4, HALF_STARTS),
    gi(3, 5, "4g.40gb", 1, 4, 64, eng(4, 4, 0, 4, 0), 40448, 4, ZERO_START),
    gi(4, 0, "7g.80gb", 1, 7, 132, eng(8, 7, 0, 7, 1), 81152, 8, ZERO_START),
];

const QUARTER_STARTS: &[u32] = &[0, 1, 2, 3];
const HALF_OF_FOUR_STARTS: &[u32] = &[0, 2];

/// A30-24GB (4 memory slices, 4 compute slices). Every number is from a public `nvidia-smi
/// mig -lgip/-lgipp/-lcip` listing on driver 535.183.01 (`tests/fixtures/a30-24gb.lgip`);
/// NVML indices 1_SLICE, 1_SLICE_REV1, 2_SLICE, 2_SLICE_REV1 and 4_SLICE are the ones
/// go-nvml's A30 table keys these profiles by. The MIG user guide's table gives 1g.6gb
/// "0 NVDECs" while NVML reports DEC 1 for it; the listing is what NVML answers, so it wins.
/// Memory: 1g and 2g are exact (`nvidia-smi` shows those MIG devices with 5952 and 11968
/// MiB); 4g.24gb is listed as 23.44 GiB only, and 24000 MiB is the value that prints so
/// (a newer driver's listing shows 23.50 GiB).
static A30_24GB_PROFILES: [GiProfile; 5] = [
    gi(0, 14, "1g.6gb", 4, 1, 14, eng(1, 1, 0, 0, 0), 5952, 1, QUARTER_STARTS),
    gi(
        7,
        21,
        "1g.6gb+me",
        1,
        1,
        14,
        eng(1, 1, 0, 1, 1),
        5952,
        1,
        QUARTER_STARTS,
    ),
    gi(
        1,
        5,
        "2g.12gb",
        2,
        2,
        28,
        eng(2, 2, 0, 0, 0),
        11968,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(
        8,
        6,
        "2g.12gb+me",
        1,
        2,
        28,
        eng(2, 2, 0, 1, 1),
        11968,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(3, 0, "4g.24gb", 1, 4, 56, eng(4, 4, 0, 1, 1), 24000, 4, ZERO_START),
];

/// A100 80GB PCIe as driver 515.86.01 lists it (`tests/fixtures/a100-pcie-80gb.lgip`): the
/// SXM4-80GB ids, counts, SMs and engines, 7g.80gb at 79.00 GiB (80896 MiB), and no
/// 1g.20gb, which that driver predates (the guide: the double-memory 1g profile needs R525).
/// 1g.10gb memory is exact (GPU Feature Discovery labels that MIG device 9728 MiB); the
/// others are the listed GiB x 1024.
static A100_PCIE_80GB_PROFILES: [GiProfile; 6] = [
    gi(
        0,
        19,
        "1g.10gb",
        7,
        1,
        14,
        eng(1, 0, 0, 0, 0),
        9728,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.10gb+me",
        1,
        1,
        14,
        eng(1, 1, 0, 1, 1),
        9728,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.20gb",
        3,
        2,
        28,
        eng(2, 1, 0, 0, 0),
        19968,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.40gb", 2, 3, 42, eng(3, 2, 0, 0, 0), 40192, 4, HALF_STARTS),
    gi(3, 5, "4g.40gb", 1, 4, 56, eng(4, 2, 0, 0, 0), 40192, 4, ZERO_START),
    gi(4, 0, "7g.80gb", 1, 7, 98, eng(7, 5, 0, 1, 1), 80896, 8, ZERO_START),
];

/// H100 NVL (94 GB), driver 560.35.03 (`tests/fixtures/h100-nvl.lgip`): the H100 ids,
/// indices, SMs, engines and placements with NVL memory. 1g.12gb, 1g.24gb/2g.24gb and
/// 3g.47gb/4g.47gb memory is exact (the same source's `nvidia-smi` shows those MIG devices
/// with 11008, 22144 and 47488 MiB); 7g.94gb is listed as 93.12 GiB only, and 95360 MiB
/// (93.125 GiB) is the value that prints so.
static H100_NVL_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.12gb",
        7,
        1,
        16,
        eng(1, 1, 0, 1, 0),
        11008,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.12gb+me",
        1,
        1,
        16,
        eng(1, 1, 0, 1, 1),
        11008,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.24gb",
        4,
        1,
        26,
        eng(1, 1, 0, 1, 0),
        22144,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.24gb",
        3,
        2,
        32,
        eng(2, 2, 0, 2, 0),
        22144,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.47gb", 2, 3, 60, eng(3, 3, 0, 3, 0), 47488, 4, HALF_STARTS),
    gi(3, 5, "4g.47gb", 1, 4, 64, eng(4, 4, 0, 4, 0), 47488, 4, ZERO_START),
    gi(4, 0, "7g.94gb", 1, 7, 132, eng(8, 7, 0, 7, 1), 95360, 8, ZERO_START),
];

// === Hopper parts without a full public -lgip listing, and Blackwell ===
//
// Engines, copy engines, instance counts and the memory/SM fractions (memory slices used,
// compute slices) come from the MIG user guide v580, "Supported MIG Profiles"
// (docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html), and are
// checked row by row by `tests/guide_fractions.rs` against `tests/fixtures/<key>.guide`.
// Hardware profile ids, NVML indices and placements are the H100's (same GH100 die). B200
// reuses them: no public B200 `-lgip`/`-lgipp` listing was found.
// SMs and MiB are not in the guide: each table says where they come from and which are
// estimates.

/// H200 (SXM, 141 GB), the guide's Table 8 "GPU Instance Profiles on H200".
/// Measured, not estimated: every row (profile ids 19/20/15/14/9/5/0 at NVML indices
/// 0/7/9/1/2/3/4, 16384/16384/33280/33280/71424/71424/143360 MiB, 16/16/26/32/60/64/132 SMs,
/// instance counts and placements) equals a real H200 (driver 580.159.04 open modules, CUDA 13.0)
/// as `nvidia-smi mig -lgip`/`-lgipp` and NVML's profile queries with MIG off (which R580
/// answers) printed them (issue #33). Before that card was read, the 3g/4g.71gb memory and some
/// SM counts were estimates from public `-lgip` excerpts and benchmark notes.
static H200_141GB_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.18gb",
        7,
        1,
        16,
        eng(1, 1, 0, 1, 0),
        16384,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.18gb+me",
        1,
        1,
        16,
        eng(1, 1, 0, 1, 1),
        16384,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.35gb",
        4,
        1,
        26,
        eng(1, 1, 0, 1, 0),
        33280,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.35gb",
        3,
        2,
        32,
        eng(2, 2, 0, 2, 0),
        33280,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.71gb", 2, 3, 60, eng(3, 3, 0, 3, 0), 71424, 4, HALF_STARTS),
    gi(3, 5, "4g.71gb", 1, 4, 64, eng(4, 4, 0, 4, 0), 71424, 4, ZERO_START),
    gi(4, 0, "7g.141gb", 1, 7, 132, eng(8, 7, 0, 7, 1), 143360, 8, ZERO_START),
];

/// GH200 144G HBM3e. The guide copy has no table for it: engines, copy engines, counts and
/// fractions are the H200 table's (same GH100 die, same 8/7 slicing); names are the GPU
/// Operator's default mig config ("GH200 144G HBM3e": 1g.18gb, 1g.36gb, 2g.36gb, 3g.72gb,
/// 4g.72gb, 7g.144gb). SMs are the H200's (GH200 has 132 SMs). Memory is an estimate: the
/// H200's per-profile share of its 7g (16384/33280/71424 of 143360) applied to 7g.144gb =
/// 145920 MiB (142.50 GiB), rounded down to 128 MiB.
static GH200_144GB_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.18gb",
        7,
        1,
        16,
        eng(1, 1, 0, 1, 0),
        16640,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.18gb+me",
        1,
        1,
        16,
        eng(1, 1, 0, 1, 1),
        16640,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.36gb",
        4,
        1,
        26,
        eng(1, 1, 0, 1, 0),
        33792,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.36gb",
        3,
        2,
        32,
        eng(2, 2, 0, 2, 0),
        33792,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.72gb", 2, 3, 60, eng(3, 3, 0, 3, 0), 72704, 4, HALF_STARTS),
    gi(3, 5, "4g.72gb", 1, 4, 64, eng(4, 4, 0, 4, 0), 72704, 4, ZERO_START),
    gi(4, 0, "7g.144gb", 1, 7, 132, eng(8, 7, 0, 7, 1), 145920, 8, ZERO_START),
];

/// H100 96GB (H100 on GH200, `NVIDIA GH200 480GB`). The guide copy names the product but its
/// table is missing: engines, copy engines, counts and fractions are the H200/H100 tables'
/// (same GH100 die). Names as the GPU Operator's default mig config lists them for H100-96GB.
/// SMs are the H100 NVL listing's (`tests/fixtures/h100-nvl.lgip`), the same die with the
/// same 132 SMs. Memory is an estimate: the H100 NVL listing's shares of its 7g (11008,
/// 22144, 47488 of 95360 MiB) applied to 7g.96gb = 97408 MiB (95.125 GiB, total 97871 MiB
/// less about 460 MiB as on the NVL), rounded to 128 MiB.
static H100_96GB_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.12gb",
        7,
        1,
        16,
        eng(1, 1, 0, 1, 0),
        11264,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.12gb+me",
        1,
        1,
        16,
        eng(1, 1, 0, 1, 1),
        11264,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.24gb",
        4,
        1,
        26,
        eng(1, 1, 0, 1, 0),
        22656,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.24gb",
        3,
        2,
        32,
        eng(2, 2, 0, 2, 0),
        22656,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.48gb", 2, 3, 60, eng(3, 3, 0, 3, 0), 48512, 4, HALF_STARTS),
    gi(3, 5, "4g.48gb", 1, 4, 64, eng(4, 4, 0, 4, 0), 48512, 4, ZERO_START),
    gi(4, 0, "7g.96gb", 1, 7, 132, eng(8, 7, 0, 7, 1), 97408, 8, ZERO_START),
];

/// B200 (180 GB), the guide's Table 9 "GPU Instance Profiles on B200": copy engines
/// 2/2/2/3/6/8/16 and one NVDEC and one JPEG in every profile, OFA only in +me and 7g, as the
/// table gives them. Hardware ids are the Hopper ones (19/20/15/14/9/5/0, no public B200
/// listing known). SMs are estimates: 18 per compute slice (1g..4g: 18/18/18/36/54/72) and
/// the whole part's 148 for 7g. Memory is an estimate: the H200's per-profile share of its
/// 7g applied to 7g.180gb = 182912 MiB (178.625 GiB; total 183359 MiB less about 450 MiB),
/// rounded to 128 MiB (1g.23gb 20864 MiB = 20.375 GiB, which public notes on B200 1g.23gb
/// devices, "~20.5 GB", agree with).
static B200_PROFILES: [GiProfile; 7] = [
    gi(
        0,
        19,
        "1g.23gb",
        7,
        1,
        18,
        eng(2, 1, 0, 1, 0),
        20864,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        7,
        20,
        "1g.23gb+me",
        1,
        1,
        18,
        eng(2, 1, 0, 1, 1),
        20864,
        1,
        ONE_SLICE_STARTS,
    ),
    gi(
        9,
        15,
        "1g.45gb",
        4,
        1,
        18,
        eng(2, 1, 0, 1, 0),
        42496,
        2,
        DOUBLE_MEM_ONE_SLICE_STARTS,
    ),
    gi(
        1,
        14,
        "2g.45gb",
        3,
        2,
        36,
        eng(3, 1, 0, 1, 0),
        42496,
        2,
        TWO_SLICE_STARTS,
    ),
    gi(2, 9, "3g.90gb", 2, 3, 54, eng(6, 1, 0, 1, 0), 91136, 4, HALF_STARTS),
    gi(3, 5, "4g.90gb", 1, 4, 72, eng(8, 1, 0, 1, 0), 91136, 4, ZERO_START),
    gi(4, 0, "7g.180gb", 1, 7, 148, eng(16, 1, 0, 1, 1), 182912, 8, ZERO_START),
];

/// RTX PRO 6000 Blackwell Server Edition (96 GB GDDR7), the guide's Table 11 "GPU Instance
/// Profiles on RTX PRO 6000": 4 memory and 4 compute slices like the A30, with NVENCs, and
/// the `+gfx` (graphics), `+me.all` (every media engine) and `-me` (no media engine) kinds at
/// NVML indices 10..16 (`1_SLICE_GFX` 10, `2_SLICE_GFX` 11, `4_SLICE_GFX` 12, `1_SLICE_NO_ME`
/// 13, `2_SLICE_NO_ME` 14, `1_SLICE_ALL_ME` 15, `2_SLICE_ALL_ME` 16).
/// Hardware ids, SMs and memory are from a public table transcribed from `nvidia-smi mig
/// -lgip` on an RTX PRO 6000 Blackwell (code-index file id 53820038330; the same ids appear
/// in an unrelated public setup script, 56111908165): 1g.24gb 14, +me 21, +gfx 47, +me.all
/// 65, -me 67, 2g.48gb 5, +gfx 35, +me.all 64, -me 66, 4g.96gb 0, +gfx 32 (1g/1g+me/2g/4g
/// are the A30's ids); SMs 46/94/188; memory 23.62, 47.38 and 95.00 GiB, i.e. 24192, 48512
/// and 97280 MiB. That table has no placement lines: placements are the A30's (quarters,
/// halves, whole). Not modelled: a `+me.all` instance takes every media engine, so real
/// drivers then refuse other instances that need one; the fake checks only slices and counts.
static RTX_PRO_6000_PROFILES: [GiProfile; 11] = [
    gi(0, 14, "1g.24gb", 4, 1, 46, eng(1, 1, 1, 1, 0), 24192, 1, QUARTER_STARTS),
    gi(
        7,
        21,
        "1g.24gb+me",
        1,
        1,
        46,
        eng(1, 1, 1, 1, 1),
        24192,
        1,
        QUARTER_STARTS,
    ),
    gi(
        10,
        47,
        "1g.24gb+gfx",
        4,
        1,
        46,
        eng(1, 1, 1, 1, 0),
        24192,
        1,
        QUARTER_STARTS,
    ),
    gi(
        15,
        65,
        "1g.24gb+me.all",
        1,
        1,
        46,
        eng(1, 4, 4, 4, 1),
        24192,
        1,
        QUARTER_STARTS,
    ),
    gi(
        13,
        67,
        "1g.24gb-me",
        4,
        1,
        46,
        eng(1, 0, 0, 0, 0),
        24192,
        1,
        QUARTER_STARTS,
    ),
    gi(
        1,
        5,
        "2g.48gb",
        2,
        2,
        94,
        eng(2, 2, 2, 2, 0),
        48512,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(
        11,
        35,
        "2g.48gb+gfx",
        2,
        2,
        94,
        eng(2, 2, 2, 2, 0),
        48512,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(
        16,
        64,
        "2g.48gb+me.all",
        1,
        2,
        94,
        eng(2, 4, 4, 4, 1),
        48512,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(
        14,
        66,
        "2g.48gb-me",
        2,
        2,
        94,
        eng(2, 0, 0, 0, 0),
        48512,
        2,
        HALF_OF_FOUR_STARTS,
    ),
    gi(3, 0, "4g.96gb", 1, 4, 188, eng(4, 4, 4, 4, 1), 97280, 4, ZERO_START),
    gi(
        12,
        32,
        "4g.96gb+gfx",
        1,
        4,
        188,
        eng(4, 4, 4, 4, 1),
        97280,
        4,
        ZERO_START,
    ),
];

/// Every model the fake simulates.
pub static MODELS: [GpuModel; 12] = [
    GpuModel {
        key: "A100-SXM4-40GB",
        name: "NVIDIA A100-SXM4-40GB",
        pci_device_id: 0x20B0,
        pci_subsystem_id: 0x134F_10DE,
        memory_mib: 40960,
        compute_capability: (8, 0),
        architecture: NVML_DEVICE_ARCH_AMPERE,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 108,
        engines: eng(7, 5, 0, 1, 1),
        nvlink_links: 12,
        idle_power_mw: 54_000,
        sm_clock_mhz: (210, 1410),
        memory_clock_mhz: 1215,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &A100_40GB_PROFILES,
    },
    GpuModel {
        key: "A100-SXM4-80GB",
        name: "NVIDIA A100-SXM4-80GB",
        pci_device_id: 0x20B2,
        pci_subsystem_id: 0x147F_10DE,
        memory_mib: 81920,
        compute_capability: (8, 0),
        architecture: NVML_DEVICE_ARCH_AMPERE,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 108,
        engines: eng(7, 5, 0, 1, 1),
        nvlink_links: 12,
        idle_power_mw: 62_000,
        sm_clock_mhz: (210, 1410),
        memory_clock_mhz: 1593,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &A100_80GB_PROFILES,
    },
    GpuModel {
        key: "H100-80GB-HBM3",
        name: "NVIDIA H100 80GB HBM3",
        pci_device_id: 0x2330,
        pci_subsystem_id: 0x16C1_10DE,
        memory_mib: 81559,
        compute_capability: (9, 0),
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 132,
        engines: eng(8, 7, 0, 7, 1),
        nvlink_links: 18,
        idle_power_mw: 71_000,
        sm_clock_mhz: (345, 1980),
        memory_clock_mhz: 2619,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &H100_80GB_PROFILES,
    },
    GpuModel {
        key: "A30-24GB",
        name: "NVIDIA A30",
        pci_device_id: 0x20B7,
        // Subsystem id not taken from a public dump: left 0 (vendor half only).
        pci_subsystem_id: 0x0000_10DE,
        memory_mib: 24576,
        compute_capability: (8, 0),
        architecture: NVML_DEVICE_ARCH_AMPERE,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 56,
        engines: eng(4, 4, 0, 1, 1),
        // The optional NVLink bridge is not modelled.
        nvlink_links: 0,
        // Readings defaults, not MIG data: idle draw as the listing's nvidia-smi shows it,
        // boost and HBM2 clocks of the A30 datasheet.
        idle_power_mw: 32_000,
        sm_clock_mhz: (210, 1440),
        memory_clock_mhz: 1215,
        hbm: true,
        mig: FOUR_SLICE,
        gi_profiles: &A30_24GB_PROFILES,
    },
    GpuModel {
        key: "A100-PCIE-80GB",
        name: "NVIDIA A100 80GB PCIe",
        pci_device_id: 0x20B5,
        pci_subsystem_id: 0x0000_10DE,
        memory_mib: 81920,
        compute_capability: (8, 0),
        architecture: NVML_DEVICE_ARCH_AMPERE,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 108,
        engines: eng(7, 5, 0, 1, 1),
        // Bridge-only NVLink on the PCIe card is not modelled.
        nvlink_links: 0,
        // Readings defaults, not MIG data: idle draw as the listing's nvidia-smi shows it;
        // clocks of the A100 80GB PCIe datasheet.
        idle_power_mw: 75_000,
        sm_clock_mhz: (210, 1410),
        memory_clock_mhz: 1512,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &A100_PCIE_80GB_PROFILES,
    },
    GpuModel {
        key: "H100-NVL",
        name: "NVIDIA H100 NVL",
        pci_device_id: 0x2321,
        pci_subsystem_id: 0x0000_10DE,
        memory_mib: 95830,
        compute_capability: (9, 0),
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 132,
        engines: eng(8, 7, 0, 7, 1),
        nvlink_links: 18,
        // Idle draw as the listing's nvidia-smi shows it; clocks are the H100 SXM model's.
        idle_power_mw: 62_000,
        sm_clock_mhz: (345, 1980),
        memory_clock_mhz: 2619,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &H100_NVL_PROFILES,
    },
    GpuModel {
        key: "H200-141GB",
        name: "NVIDIA H200",
        pci_device_id: 0x2335,
        pci_subsystem_id: 0x0000_10DE,
        // nvidia-smi's total for an H200 SXM (141 GB HBM3e).
        memory_mib: 143771,
        compute_capability: (9, 0),
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 132,
        // The guide's 7g.141gb row: 8 CE, 7 NVDEC, 7 JPEG, 1 OFA.
        engines: eng(8, 7, 0, 7, 1),
        nvlink_links: 18,
        // Readings defaults, not MIG data (estimates): the H100 SXM's clocks and an idle draw
        // near it; HBM3e memory clock as H200 nvidia-smi reports its maximum.
        idle_power_mw: 75_000,
        sm_clock_mhz: (345, 1980),
        memory_clock_mhz: 3201,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &H200_141GB_PROFILES,
    },
    GpuModel {
        key: "GH200-144GB",
        name: "NVIDIA GH200 144G HBM3e",
        pci_device_id: 0x2348,
        pci_subsystem_id: 0x0000_10DE,
        // Estimate: a public fake-libcuda test gives this part's cuDeviceTotalMem as
        // 153008209920 bytes (145920 MiB); nvidia-smi's total is about 450 MiB more on H100
        // 80GB (81559 vs CUDA's 81106 MiB).
        memory_mib: 146373,
        compute_capability: (9, 0),
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 132,
        engines: eng(8, 7, 0, 7, 1),
        nvlink_links: 18,
        // Readings defaults (estimates): the H200's.
        idle_power_mw: 90_000,
        sm_clock_mhz: (345, 1980),
        memory_clock_mhz: 3201,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &GH200_144GB_PROFILES,
    },
    GpuModel {
        key: "H100-96GB",
        name: "NVIDIA GH200 480GB",
        pci_device_id: 0x2342,
        pci_subsystem_id: 0x0000_10DE,
        // nvidia-smi's total for the GPU of a GH200 480GB (96 GB HBM3).
        memory_mib: 97871,
        compute_capability: (9, 0),
        architecture: NVML_DEVICE_ARCH_HOPPER,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 132,
        engines: eng(8, 7, 0, 7, 1),
        nvlink_links: 18,
        // Readings defaults (estimates): the H100 SXM's clocks.
        idle_power_mw: 90_000,
        sm_clock_mhz: (345, 1980),
        memory_clock_mhz: 2619,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &H100_96GB_PROFILES,
    },
    GpuModel {
        key: "B200",
        name: "NVIDIA B200",
        pci_device_id: 0x2901,
        pci_subsystem_id: 0x0000_10DE,
        // Approximately nvidia-smi's total for a B200 (180 GB HBM3e); an estimate.
        memory_mib: 183359,
        compute_capability: (10, 0),
        architecture: NVML_DEVICE_ARCH_BLACKWELL,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        sm_count: 148,
        // The guide's 7g.180gb row: 16 CE, 1 NVDEC, 1 JPEG, 1 OFA.
        engines: eng(16, 1, 0, 1, 1),
        nvlink_links: 18,
        // Readings defaults (estimates): B200 boost clock and HBM3e memory clock.
        idle_power_mw: 140_000,
        sm_clock_mhz: (345, 1965),
        memory_clock_mhz: 3996,
        hbm: true,
        mig: SEVEN_SLICE,
        gi_profiles: &B200_PROFILES,
    },
    GpuModel {
        key: "RTX-PRO-6000",
        name: "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        pci_device_id: 0x2BB5,
        pci_subsystem_id: 0x0000_10DE,
        // nvidia-smi's total for the 96 GB GDDR7 card.
        memory_mib: 97887,
        compute_capability: (12, 0),
        architecture: NVML_DEVICE_ARCH_BLACKWELL,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA_RTX,
        sm_count: 188,
        // The guide's 4g.96gb row: 4 CE, 4 NVDEC, 4 NVENC, 4 JPEG, 1 OFA.
        engines: eng(4, 4, 4, 4, 1),
        nvlink_links: 0,
        // Readings defaults (estimates): boost clock of the datasheet, GDDR7 memory clock.
        idle_power_mw: 30_000,
        sm_clock_mhz: (180, 2430),
        memory_clock_mhz: 12481,
        // GDDR7: no memory temperature.
        hbm: false,
        mig: FOUR_SLICE,
        gi_profiles: &RTX_PRO_6000_PROFILES,
    },
    GpuModel {
        key: "T4",
        name: "Tesla T4",
        pci_device_id: 0x1EB8,
        pci_subsystem_id: 0x12A2_10DE,
        memory_mib: 15360,
        compute_capability: (7, 5),
        architecture: NVML_DEVICE_ARCH_TURING,
        brand: nvmlBrandType_enum_NVML_BRAND_TESLA,
        sm_count: 40,
        engines: eng(3, 2, 1, 0, 0),
        nvlink_links: 0,
        idle_power_mw: 14_000,
        sm_clock_mhz: (300, 1590),
        memory_clock_mhz: 5001,
        hbm: false,
        mig: NO_MIG,
        gi_profiles: &[],
    },
];

/// Looks a model up by its machine-file key.
pub fn model_by_key(key: &str) -> Option<&'static GpuModel> {
    MODELS.iter().find(|m| m.key == key)
}

/// NVML compute-instance profile index for a compute instance of `slices` compute slices
/// (`NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE` = 0, `2_SLICE` = 1, `3_SLICE` = 2, `4_SLICE` = 3,
/// `7_SLICE` = 4).
fn ci_index_for_slices(slices: u32) -> Option<u32> {
    match slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        _ => None,
    }
}

/// Compute-instance profiles available inside a GPU instance of profile `gi`.
///
/// The sizes follow `nvidia-smi mig -lcip` on A100: a 1g GI offers only the full CI; 2g offers
/// 1c and 2g; 3g offers 1c, 2c, 3g; 4g offers 1c, 2c, 4g; 7g offers 1c, 2c, 3c, 4c, 7g. The
/// whole-GPU 4g GI of a 4-slice part (A30 4g.24gb, RTX PRO 6000 4g.96gb and 4g.96gb+gfx) is a
/// 4g like any other. Every kind of GI (`+me`, `+gfx`, `-me`, `+me.all`) is sized by its
/// compute slices alone; CI names keep the suffix (`1c.2g.48gb+gfx`).
/// Placements of a `k`-slice CI start at multiples of `k` and must fit inside the GI.
/// SMs are the GI's SMs scaled by `k / n` (exact on A100; an approximation on H100, whose
/// GPCs are uneven). Shared engines are the GI's, so they are not stored per CI profile.
pub fn ci_profiles(gi: &GiProfile) -> Vec<CiProfile> {
    let n = gi.slices;
    let sizes: &[u32] = match n {
        1 => &[1],
        2 => &[1, 2],
        3 => &[1, 2, 3],
        4 => &[1, 2, 4],
        _ => &[1, 2, 3, 4, 7],
    };
    sizes
        .iter()
        .filter_map(|&k| {
            let index = ci_index_for_slices(k)?;
            let starts: Vec<u32> = (0..n).step_by(k as usize).filter(|s| s + k <= n).collect();
            let name = if k == n {
                gi.name.to_string()
            } else {
                format!("{k}c.{}", gi.name)
            };
            Some(CiProfile {
                index,
                slices: k,
                instance_count: u32::try_from(starts.len()).unwrap_or(u32::MAX),
                sm: gi.sm * k / n,
                starts,
                name,
            })
        })
        .collect()
}

/// Compute-instance profile by NVML index inside a GPU instance of profile `gi`.
pub fn ci_profile_by_index(gi: &GiProfile, index: u32) -> Option<CiProfile> {
    ci_profiles(gi).into_iter().find(|c| c.index == index)
}

/// The GPU-instance id the fake assigns to an instance at `start` occupying `mem_size` of
/// `memory_slices` memory slices.
///
/// Real drivers assign ids from a fixed table keyed by placement, not by creation order
/// (H100: 1g placements 0..6 were ids 7..13). The fake uses a binary-tree numbering of the
/// memory slices: `memory_slices / mem_size - 1 + start / mem_size`. With 8 slices: size 8
/// -> 0; size 4 at 0/4 -> 1/2; size 2 at 0/2/4/6 -> 3..6; size 1 at 0..7 -> 7..14. With 4
/// (A30): size 4 -> 0; size 2 at 0/2 -> 1/2; size 1 at 0..3 -> 3..6, which is what a real A30
/// reported (1g at 0:1 and 1:1 -> GI 3 and 4, 2g at 2:2 -> GI 2). Two instances that can
/// coexist never overlap, so they never share an id.
pub fn gi_id_for(start: u32, mem_size: u32, memory_slices: u32) -> u32 {
    let size = mem_size.max(1);
    memory_slices / size - 1 + start / size
}

/// The compute-instance id the fake assigns inside a GPU instance with `gi_slices` compute
/// slices, for a CI of `slices` at `start`.
///
/// Ids enumerate every (size, start) pair the GI offers, largest size first, then by start:
/// the full-size CI is always id 0 (as on hardware), then e.g. on a 3g GI: 2c@0 -> 1,
/// 1c@0/1/2 -> 2/3/4. Coexisting CIs never share an id.
pub fn ci_id_for(gi: &GiProfile, slices: u32, start: u32) -> u32 {
    let mut profiles = ci_profiles(gi);
    profiles.sort_by_key(|p| std::cmp::Reverse(p.slices));
    let mut id = 0;
    for p in &profiles {
        for &s in &p.starts {
            if p.slices == slices && s == start {
                return id;
            }
            id += 1;
        }
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_key_is_unique_and_findable() {
        for m in &MODELS {
            assert_eq!(model_by_key(m.key).map(|x| x.key), Some(m.key));
        }
    }

    #[test]
    fn gi_tables_are_consistent() {
        for m in MODELS.iter().filter(|m| m.has_mig()) {
            for p in m.gi_profiles {
                assert_eq!(m.gi_profile_by_id(p.id).map(|x| x.index), Some(p.index));
                assert!(p.slices <= m.mig.compute_slices, "{} {}", m.key, p.name);
                for &s in p.starts {
                    assert!(s + p.mem_size <= m.mig.memory_slices, "{} {}", m.key, p.name);
                }
            }
        }
    }

    #[test]
    fn profile_indices_are_unique_and_below_count() {
        for m in MODELS.iter().filter(|m| m.has_mig()) {
            let mut seen = std::collections::BTreeSet::new();
            for p in m.gi_profiles {
                assert!(p.index < GI_PROFILE_INDEX_COUNT, "{} {}", m.key, p.name);
                assert!(seen.insert(p.index), "{} {}: index {} twice", m.key, p.name, p.index);
                assert_eq!(m.gi_profile_by_index(p.index).map(|x| x.id), Some(p.id));
                assert_eq!(m.gi_profile_by_name(p.name).map(|x| x.id), Some(p.id));
                // The most instances of a profile fit the card's memory and its placements.
                assert!(
                    u64::from(p.instance_count) * p.memory_mib <= m.memory_mib,
                    "{} {}",
                    m.key,
                    p.name
                );
                assert!(p.instance_count as usize <= p.starts.len(), "{} {}", m.key, p.name);
            }
        }
    }

    #[test]
    fn rtx_pro_6000_kinds_sit_at_indices_10_to_16() {
        let rtx = model_by_key("RTX-PRO-6000").unwrap();
        assert_eq!(rtx.mig, FOUR_SLICE);
        let by_index: Vec<(u32, &str, bool)> = (10..17)
            .map(|i| {
                let p = rtx.gi_profile_by_index(i).unwrap();
                (i, p.name, p.gfx())
            })
            .collect();
        assert_eq!(
            by_index,
            vec![
                (10, "1g.24gb+gfx", true),
                (11, "2g.48gb+gfx", true),
                (12, "4g.96gb+gfx", true),
                (13, "1g.24gb-me", false),
                (14, "2g.48gb-me", false),
                (15, "1g.24gb+me.all", false),
                (16, "2g.48gb+me.all", false),
            ]
        );
        // A 4-slice whole-GPU GI offers 1c, 2c and itself; names keep the suffix.
        let g4 = rtx.gi_profile_by_name("4g.96gb+gfx").unwrap();
        let cis: Vec<(u32, u32, u32, String)> = ci_profiles(g4)
            .into_iter()
            .map(|c| (c.index, c.slices, c.instance_count, c.name))
            .collect();
        assert_eq!(
            cis,
            vec![
                (0, 1, 4, "1c.4g.96gb+gfx".to_string()),
                (1, 2, 2, "2c.4g.96gb+gfx".to_string()),
                (3, 4, 1, "4g.96gb+gfx".to_string()),
            ]
        );
        let g2 = rtx.gi_profile_by_name("2g.48gb+me.all").unwrap();
        let names: Vec<String> = ci_profiles(g2).into_iter().map(|c| c.name).collect();
        assert_eq!(names, vec!["1c.2g.48gb+me.all", "2g.48gb+me.all"]);
        assert_eq!(ci_id_for(g4, 4, 0), 0);
        assert_eq!(ci_id_for(g4, 1, 3), 6);
    }

    #[test]
    fn gi_ids_match_h100_observation() {
        let ids: Vec<u32> = (0..7).map(|s| gi_id_for(s, 1, 8)).collect();
        assert_eq!(ids, vec![7, 8, 9, 10, 11, 12, 13]);
        assert_eq!(gi_id_for(0, 8, 8), 0);
        assert_eq!(gi_id_for(4, 4, 8), 2);
        assert_eq!(gi_id_for(6, 2, 8), 6);
    }

    #[test]
    fn gi_ids_match_a30_observation() {
        // 1g.6gb at 0:1 and 1:1 were GI 3 and 4, 2g.12gb at 2:2 was GI 2 (A30 listing).
        assert_eq!(gi_id_for(0, 1, 4), 3);
        assert_eq!(gi_id_for(1, 1, 4), 4);
        assert_eq!(gi_id_for(2, 2, 4), 2);
        assert_eq!(gi_id_for(0, 4, 4), 0);
    }

    #[test]
    fn mig_models_fit_their_slices_and_others_have_none() {
        for m in &MODELS {
            if m.has_mig() {
                assert!(m.mig.memory_slices > 0 && m.mig.compute_slices > 0, "{}", m.key);
                let full = m.gi_profiles.iter().map(|p| p.slices).max().unwrap_or(0);
                assert_eq!(full, m.mig.compute_slices, "{}", m.key);
            } else {
                assert_eq!(m.mig, NO_MIG, "{}", m.key);
            }
        }
    }

    #[test]
    fn ci_profiles_follow_lcip() {
        let a100 = model_by_key("A100-SXM4-40GB").unwrap();
        let g3 = a100.gi_profile_by_name("3g.20gb").unwrap();
        let cis = ci_profiles(g3);
        let summary: Vec<(u32, u32, u32, u32)> = cis
            .iter()
            .map(|c| (c.index, c.slices, c.instance_count, c.sm))
            .collect();
        assert_eq!(summary, vec![(0, 1, 3, 14), (1, 2, 1, 28), (2, 3, 1, 42)]);
        assert_eq!(cis[0].name, "1c.3g.20gb");
        assert_eq!(cis[2].name, "3g.20gb");
        let g4 = a100.gi_profile_by_name("4g.20gb").unwrap();
        let idx: Vec<u32> = ci_profiles(g4).iter().map(|c| c.index).collect();
        assert_eq!(idx, vec![0, 1, 3]);
        assert_eq!(ci_id_for(g3, 3, 0), 0);
        assert_eq!(ci_id_for(g3, 2, 0), 1);
        assert_eq!(ci_id_for(g3, 1, 2), 4);
    }
}
