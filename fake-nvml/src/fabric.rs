//! The GPU's NVLink fabric as NVML reports it (`nvmlDeviceGetGpuFabricInfo` and
//! `nvmlDeviceGetGpuFabricInfoV`): which NVLink domain (cluster UUID) and clique the GPU joined,
//! and how far the fabric manager got.
//!
//! A GPU has fabric info only when its machine-file entry has a `[gpu.fabric]` table, and only on
//! NVLink models of the Hopper generation or later (the drivers report fabric state there); every
//! other GPU answers `NVML_ERROR_NOT_SUPPORTED`, as a PCIe card or an older GPU does. A GB200
//! NVL72 tray is simulated with B200 entries whose tables share one cluster UUID and clique id;
//! an HGX H100 board with its NVSwitches has `state = "completed"` and the all-zero cluster UUID
//! (no multi-node domain).

use serde::Deserialize;

use crate::models::GpuModel;

/// `[gpu.fabric]` as written in the machine file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricEntry {
    /// `clusterUuid`: the NVLink domain, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (hex).
    cluster_uuid: String,
    /// `cliqueId`.
    #[serde(default)]
    clique_id: u32,
    /// `state`: `not-started`, `in-progress` or `completed` (the default).
    #[serde(default)]
    state: Option<String>,
    /// `status`: the `nvmlReturn_t` of the fabric probe, 0 (`NVML_SUCCESS`) by default.
    #[serde(default)]
    status: u32,
}

/// `NVML_GPU_FABRIC_STATE_*`.
pub const STATE_NOT_STARTED: u8 = 1;
pub const STATE_IN_PROGRESS: u8 = 2;
pub const STATE_COMPLETED: u8 = 3;

/// One GPU's fabric info, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fabric {
    pub cluster_uuid: [u8; 16],
    pub clique_id: u32,
    /// `nvmlGpuFabricState_t`.
    pub state: u8,
    /// `nvmlReturn_t`.
    pub status: u32,
}

/// Checks a `[gpu.fabric]` table against the GPU's model.
pub fn fabric_spec(model: &GpuModel, entry: FabricEntry) -> Result<Fabric, String> {
    if model.nvlink_links == 0 || model.compute_capability.0 < 9 {
        return Err(format!(
            "fabric given but model {} reports no fabric (NVLink GPUs of compute capability 9.0 or later only)",
            model.key
        ));
    }
    let cluster_uuid = parse_uuid(&entry.cluster_uuid).ok_or_else(|| {
        format!(
            "fabric.cluster_uuid {:?} is not valid: expected xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (hex)",
            entry.cluster_uuid
        )
    })?;
    let state = match entry.state.as_deref() {
        None | Some("completed") => STATE_COMPLETED,
        Some("in-progress") => STATE_IN_PROGRESS,
        Some("not-started") => STATE_NOT_STARTED,
        Some(other) => {
            return Err(format!(
                "fabric.state {other:?} is not valid: expected not-started, in-progress or completed"
            ));
        }
    };
    Ok(Fabric {
        cluster_uuid,
        clique_id: entry.clique_id,
        state,
        status: entry.status,
    })
}

/// `8-4-4-4-12` hex digits to the 16 bytes NVML gives.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = text.split('-').collect();
    if groups.iter().map(|g| g.len()).collect::<Vec<_>>() != [8, 4, 4, 4, 12] {
        return None;
    }
    let hex: String = groups.concat();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model_by_key;

    fn entry(uuid: &str, state: Option<&str>) -> FabricEntry {
        FabricEntry {
            cluster_uuid: uuid.into(),
            clique_id: 7,
            state: state.map(str::to_owned),
            status: 0,
        }
    }

    #[test]
    fn fabric_tables_are_checked() {
        let b200 = model_by_key("B200").expect("B200");
        let f = fabric_spec(b200, entry("0123abcd-0000-1111-2222-333344445555", None)).expect("valid");
        assert_eq!(f.cluster_uuid[0..4], [0x01, 0x23, 0xab, 0xcd]);
        assert_eq!(f.cluster_uuid[15], 0x55);
        assert_eq!((f.clique_id, f.state), (7, STATE_COMPLETED));
        let f = fabric_spec(b200, entry("0123abcd-0000-1111-2222-333344445555", Some("in-progress"))).expect("ok");
        assert_eq!(f.state, STATE_IN_PROGRESS);
        for bad in [
            "0123abcd-0000-1111-2222-33334444555",
            "0123abcd00001111-2222-333344445555",
            "zz23abcd-0000-1111-2222-333344445555",
        ] {
            assert!(fabric_spec(b200, entry(bad, None)).is_err(), "{bad}");
        }
        assert!(fabric_spec(b200, entry("0123abcd-0000-1111-2222-333344445555", Some("done"))).is_err());
        let a100 = model_by_key("A100-SXM4-40GB").expect("A100");
        let t4 = model_by_key("T4").expect("T4");
        for m in [a100, t4] {
            let e = fabric_spec(m, entry("0123abcd-0000-1111-2222-333344445555", None)).unwrap_err();
            assert!(e.contains("reports no fabric"), "{e}");
        }
    }
}
