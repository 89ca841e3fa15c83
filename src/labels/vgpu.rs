//! Whether the node is a vGPU guest, as GPU Feature Discovery decides it (`internal/vgpu`): some
//! NVIDIA PCI function (`/sys/bus/pci/devices/*`, vendor `0x10de`) has, in the capability list
//! of its configuration space, a vendor-specific capability (id `0x09`) whose bytes 3 and 4 are
//! `V` `F`, the signature NVIDIA's vGPU manager puts there for its guests.
//!
//! Anything that cannot be read (no sysfs, a config space shorter than 256 bytes because the
//! agent is not root) counts as no vGPU: GFD also labels `false` when its scan fails.

use std::path::Path;

use crate::devices::{NVIDIA_VENDOR, parse_sysfs_hex};
use crate::host::HostRoot;

/// PCI config space: status register, its "capability list" bit, and the first capability.
const STATUS: usize = 0x06;
const STATUS_CAP_LIST: u8 = 0x10;
const CAP_POINTER: usize = 0x34;
const CAP_VENDOR_SPECIFIC: u8 = 0x09;

/// Scans the PCI functions under the root.
pub fn vgpu_present(root: &HostRoot) -> bool {
    let Ok(entries) = std::fs::read_dir(root.join("/sys/bus/pci/devices")) else {
        return false;
    };
    entries.flatten().any(|entry| is_vgpu_function(&entry.path()))
}

fn is_vgpu_function(dir: &Path) -> bool {
    let vendor = std::fs::read_to_string(dir.join("vendor")).ok();
    if vendor.as_deref().and_then(parse_sysfs_hex) != Some(u32::from(NVIDIA_VENDOR)) {
        return false;
    }
    match std::fs::read(dir.join("config")) {
        Ok(config) => has_vgpu_capability(&config),
        Err(e) => {
            tracing::debug!("{}: {e}; not counted as a vGPU", dir.join("config").display());
            false
        }
    }
}

/// Walks the capability list for the first vendor-specific capability and checks its `VF`
/// signature. A list that loops or runs off the end stops the walk.
pub fn has_vgpu_capability(config: &[u8]) -> bool {
    if config.len() < 256 || config[STATUS] & STATUS_CAP_LIST == 0 {
        return false;
    }
    let mut seen = [false; 256];
    let mut pos = usize::from(config[CAP_POINTER]);
    while pos != 0 && pos + 2 < config.len() && !seen[pos] {
        seen[pos] = true;
        let (id, next) = (config[pos], usize::from(config[pos + 1]));
        if id == 0xff {
            return false;
        }
        if id == CAP_VENDOR_SPECIFIC {
            return config.get(pos + 3..pos + 5) == Some(b"VF".as_slice());
        }
        pos = next;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(caps: &[(usize, &[u8])]) -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[STATUS] = STATUS_CAP_LIST;
        c[CAP_POINTER] = caps.first().map_or(0, |(at, _)| *at as u8);
        for (at, bytes) in caps {
            c[*at..*at + bytes.len()].copy_from_slice(bytes);
        }
        c
    }

    #[test]
    fn the_vf_signature_in_the_vendor_capability_marks_a_vgpu() {
        // PCI Express at 0x60 pointing to the vendor capability at 0xd4.
        let guest = config(&[(0x60, &[0x10, 0xd4]), (0xd4, &[0x09, 0x00, 0x1b, b'V', b'F'])]);
        assert!(has_vgpu_capability(&guest));
        let passthrough = config(&[(0x60, &[0x10, 0xd4]), (0xd4, &[0x09, 0x00, 0x14, 0x01, 0x00])]);
        assert!(!has_vgpu_capability(&passthrough));
        let no_vendor_cap = config(&[(0x60, &[0x10, 0x00])]);
        assert!(!has_vgpu_capability(&no_vendor_cap));
        let mut no_list = guest.clone();
        no_list[STATUS] = 0;
        assert!(!has_vgpu_capability(&no_list));
        assert!(!has_vgpu_capability(&guest[..64]), "an unprivileged read of 64 bytes");
        let looping = config(&[(0x60, &[0x10, 0x70]), (0x70, &[0x05, 0x60])]);
        assert!(!has_vgpu_capability(&looping));
    }
}
