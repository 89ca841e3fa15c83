//! Deterministic identifiers (UUIDs, serials) and PCI bus id parsing.

use std::fmt;

/// 64-bit FNV-1a with a caller-chosen offset basis, finished with a splitmix64 round so that
/// similar inputs give unrelated outputs.
fn hash64(seed: u64, data: &[u8]) -> u64 {
    let mut h = seed;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

fn hash128(data: &[u8]) -> u128 {
    let hi = hash64(0xCBF2_9CE4_8422_2325, data);
    let lo = hash64(0x6C62_272E_07BB_0142, data);
    (u128::from(hi) << 64) | u128::from(lo)
}

/// Formats 128 bits as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lowercase, like NVML).
fn uuid_body(v: u128) -> String {
    let s = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &s[0..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..32]
    )
}

/// Default GPU UUID for the GPU at `index` of model `model_key`.
pub fn default_gpu_uuid(model_key: &str, index: usize) -> String {
    let v = hash128(format!("fake-nvml/gpu/{model_key}/{index}").as_bytes());
    format!("GPU-{}", uuid_body(v))
}

/// UUID of the MIG device (compute instance `ci` in GPU instance `gi`) of the GPU `parent`.
pub fn mig_uuid(parent: &str, gi: u32, ci: u32) -> String {
    let v = hash128(format!("fake-nvml/mig/{parent}/{gi}/{ci}").as_bytes());
    format!("MIG-{}", uuid_body(v))
}

/// A 13-digit board serial derived from the GPU UUID.
pub fn serial_for(uuid: &str) -> String {
    let v = hash64(0x1234_5678_9ABC_DEF0, uuid.as_bytes()) % 1_000_000_000_000;
    format!("1{v:012}")
}

/// A PCI address `domain:bus:device.function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BusId {
    /// PCI domain (NVML prints 8 hex digits).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0..=31).
    pub device: u8,
    /// Function number (0..=7).
    pub function: u8,
}

impl BusId {
    /// Parses `DDDDDDDD:BB:DD.F`, `DDDD:BB:DD.F` or `BB:DD.F` (hex, any case; `.F` optional).
    pub fn parse(s: &str) -> Option<BusId> {
        let s = s.trim();
        let parts: Vec<&str> = s.split(':').collect();
        let (domain, bus, devfn) = match parts.as_slice() {
            [d, b, df] => (*d, *b, *df),
            [b, df] => ("0", *b, *df),
            _ => return None,
        };
        let (dev, func) = match devfn.split_once('.') {
            Some((d, f)) => (d, f),
            None => (devfn, "0"),
        };
        let hex = |t: &str, max_len: usize| -> Option<u32> {
            if t.is_empty() || t.len() > max_len || !t.chars().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            u32::from_str_radix(t, 16).ok()
        };
        let domain = hex(domain, 8)?;
        let bus = u8::try_from(hex(bus, 2)?).ok()?;
        let device = u8::try_from(hex(dev, 2)?).ok().filter(|d| *d < 32)?;
        let function = u8::try_from(hex(func, 1)?).ok().filter(|f| *f < 8)?;
        Some(BusId {
            domain,
            bus,
            device,
            function,
        })
    }

    /// The 4-digit-domain form NVML puts in `busIdLegacy`, e.g. `0000:07:00.0`.
    pub fn legacy(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl fmt::Display for BusId {
    /// The 8-digit-domain form NVML puts in `busId`, e.g. `00000000:07:00.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_deterministic_and_well_formed() {
        let a = default_gpu_uuid("A100-SXM4-40GB", 0);
        assert_eq!(a, default_gpu_uuid("A100-SXM4-40GB", 0));
        assert_ne!(a, default_gpu_uuid("A100-SXM4-40GB", 1));
        assert_eq!(a.len(), 40);
        assert!(a.starts_with("GPU-"));
        let dashes: Vec<usize> = a.match_indices('-').map(|(i, _)| i).collect();
        assert_eq!(dashes, vec![3, 12, 17, 22, 27]);
        let m = mig_uuid(&a, 7, 0);
        assert!(m.starts_with("MIG-"));
        assert_ne!(m, mig_uuid(&a, 8, 0));
        assert_eq!(serial_for(&a).len(), 13);
    }

    #[test]
    fn bus_ids_parse_in_all_forms() {
        let b = BusId::parse("00000000:07:00.0").unwrap();
        assert_eq!(b.to_string(), "00000000:07:00.0");
        assert_eq!(b.legacy(), "0000:07:00.0");
        assert_eq!(BusId::parse("0000:07:00.0"), Some(b));
        assert_eq!(BusId::parse("07:00.0"), Some(b));
        assert_eq!(BusId::parse("0000:b7:00.0").unwrap().to_string(), "00000000:B7:00.0");
        assert_eq!(BusId::parse("nonsense"), None);
        assert_eq!(BusId::parse("0000:07:40.0"), None);
    }
}
