//! `[device_plugin.sharing]` (and a profile's `sharing` table): which resources are advertised
//! as time-slicing or MPS replicas, how many, under which name, and with what memory budget. The
//! replication itself is [`crate::plugin::sharing`], the MPS control daemons
//! [`crate::plugin::mps`]; this module holds the file format and its validation.
//!
//! The format follows NVIDIA's `sharing.timeSlicing` and `sharing.mps` (`renameByDefault`,
//! `failRequestsGreaterThanOne`, `resources[].{name, rename, devices, replicas}`, the `mpsRoot`
//! flag), with per-GPU replica counts, a memory budget per replica, an MPS thread share, and the
//! compact `resource:newname:replicas` strings of the sharing fork of NVIDIA's plugin.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::merge::KeyPath;
use super::values::{MigStrategy, SharedPolicy, SharingStrategy};
use super::{Check, Invalid};

/// `sharing.strategy`: nothing is shared.
pub const DEFAULT_SHARING_STRATEGY: SharingStrategy = SharingStrategy::None;
/// `sharing.rename_by_default`: shared resources keep their names (NVIDIA's default).
pub const DEFAULT_RENAME_BY_DEFAULT: bool = false;
/// `sharing.fail_requests_greater_than_one`: off, as in NVIDIA's time-slicing (backwards
/// compatible: a container may ask for several replicas).
pub const DEFAULT_FAIL_REQUESTS_GREATER_THAN_ONE: bool = false;
/// `sharing.policy`: the least used physical GPU first (NVIDIA's default).
pub const DEFAULT_SHARED_POLICY: SharedPolicy = SharedPolicy::Distributed;
/// `sharing.mps_root`: NVIDIA's Helm chart default for `mps.root`.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvidia/mps";

/// The domain every advertised resource lives under (NVIDIA's plugin requires it).
pub const RESOURCE_PREFIX: &str = "nvidia.com/";
/// Suffix of a shared resource's name under `rename_by_default` (`nvidia.com/gpu.shared`).
pub const SHARED_SUFFIX: &str = ".shared";
/// Prefix of the MIG resources of the `mixed` strategy.
const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// `[device_plugin.sharing]`: time-slicing or MPS. A profile's `sharing` table replaces this one
/// whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Sharing {
    /// `none`, `time-slicing` or `mps`.
    pub strategy: SharingStrategy,
    /// Shared resources without a `rename` are advertised as `<name>.shared`.
    pub rename_by_default: bool,
    /// `Allocate` refuses a container asking for more than one replica. Always on under `mps`
    /// (NVIDIA sets it there whatever the config says); see [`Sharing::fails_requests_greater_than_one`].
    pub fail_requests_greater_than_one: bool,
    /// `mps`: host folder of the MPS control daemons: `<mps_root>/<resource>/{pipe,log}` per
    /// shared resource and `<mps_root>/shm`, which containers get as `/dev/shm` (NVIDIA's
    /// `mpsRoot`).
    pub mps_root: PathBuf,
    /// How `GetPreferredAllocation` picks replicas and MIG devices over physical GPUs.
    pub policy: SharedPolicy,
    /// The shared resources.
    pub resources: Vec<SharedResource>,
    /// More shared resources, each written `resource:newname:replicas` (`gpu:sharedgpu:4`,
    /// `mig-3g.20gb:small:2`, `gpu::4` for default naming).
    pub compact: Vec<String>,
}

impl Default for Sharing {
    fn default() -> Self {
        Sharing {
            strategy: DEFAULT_SHARING_STRATEGY,
            rename_by_default: DEFAULT_RENAME_BY_DEFAULT,
            fail_requests_greater_than_one: DEFAULT_FAIL_REQUESTS_GREATER_THAN_ONE,
            mps_root: PathBuf::from(DEFAULT_MPS_ROOT),
            policy: DEFAULT_SHARED_POLICY,
            resources: Vec::new(),
            compact: Vec::new(),
        }
    }
}

/// `[[...sharing.resources]]`: one resource advertised as replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedResource {
    /// The resource: `nvidia.com/gpu`, `nvidia.com/mig-1g.5gb`, or the same without
    /// `nvidia.com/`.
    pub name: String,
    /// The name its replicas are advertised under (with or without `nvidia.com/`); empty:
    /// `<name>.shared` under `rename_by_default`, else `name`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rename: String,
    /// Replicas per device; 1 shares nothing.
    pub replicas: u32,
    /// The devices of the resource that are shared; the others are advertised as before.
    #[serde(default)]
    pub devices: SharedDevices,
    /// Replica counts for some GPUs (NVML index or UUID; for a MIG device also its
    /// `<gpu>:<mig>` index or MIG UUID), instead of `replicas`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub replicas_per_gpu: BTreeMap<String, u32>,
    /// Memory each replica may use: for the memory-limit enforcer under `time-slicing`, the MPS
    /// pinned device memory limit under `mps` (default there: the GPU's memory divided by its
    /// replicas, as NVIDIA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_per_replica: Option<MemoryBudget>,
    /// `mps`: the share of a GPU's threads one replica's clients may use, 1 to 100 percent;
    /// default 100 / replicas (NVIDIA's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u32>,
}

/// `devices` of a shared resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SharedDevices {
    /// Every device of the resource.
    #[default]
    All,
    /// GPUs by NVML index (`0`) or UUID, MIG devices by `<gpu>:<mig>` index or UUID; a GPU
    /// selects its MIG devices too.
    List(Vec<String>),
}

/// `memory_per_replica`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBudget {
    /// This many MiB per replica.
    Mib(u64),
    /// The device's memory divided by its replica count.
    Fair,
}

impl Sharing {
    /// `resources` followed by the `compact` entries, parsed. `Err` names the first compact
    /// string that does not parse (validation has refused it already in a loaded config).
    /// Under strategy `none` there are none.
    pub fn entries(&self) -> Result<Vec<SharedResource>, String> {
        if self.strategy == SharingStrategy::None {
            return Ok(Vec::new());
        }
        let mut out = self.resources.clone();
        for text in &self.compact {
            out.push(SharedResource::from_compact(text)?);
        }
        Ok(out)
    }

    /// Whether `Allocate` refuses a container asking for more than one replica: the key, and
    /// always under `mps` (NVIDIA sets `sharing.mps.failRequestsGreaterThanOne = true` in
    /// `api/config/v1/config.go`: several MPS replicas in one container have no clear meaning).
    pub fn fails_requests_greater_than_one(&self) -> bool {
        self.fail_requests_greater_than_one || self.strategy == SharingStrategy::Mps
    }

    /// The rules serde cannot check, keyed under `at` (`device_plugin.sharing` or a profile's
    /// `sharing`); `mig_strategy` is the effective one beside this table.
    pub(super) fn validate(&self, at: &KeyPath, mig_strategy: MigStrategy) -> Check {
        let invalid = |key: KeyPath, reason: String| Invalid { key, reason };
        if self.strategy == SharingStrategy::None && (!self.resources.is_empty() || !self.compact.is_empty()) {
            // Blamed on the list, which a file set (the strategy may be the default).
            let list = if self.resources.is_empty() {
                "compact"
            } else {
                "resources"
            };
            return Err(invalid(
                at.clone().key(list),
                "sharing needs strategy = \"time-slicing\" or \"mps\" (it is \"none\")".into(),
            ));
        }
        let mps = self.strategy == SharingStrategy::Mps;
        if mps && mig_strategy == MigStrategy::Mixed {
            return Err(invalid(
                at.clone().key("strategy"),
                "MPS is not supported with device_plugin.mig_strategy = \"mixed\" (as in NVIDIA's plugin); \
                 MPS shares full GPUs: use mig_strategy \"none\" or \"single\" without MIG"
                    .into(),
            ));
        }
        if mps && !self.mps_root.is_absolute() {
            return Err(invalid(
                at.clone().key("mps_root"),
                "expected an absolute host path, e.g. \"/run/nvidia/mps\"".into(),
            ));
        }
        // (entry, where it was written) for the duplicate checks.
        let mut seen: Vec<(SharedResource, KeyPath)> = Vec::new();
        for (i, entry) in self.resources.iter().enumerate() {
            let here = at.clone().key("resources").index(i);
            entry.validate(&here)?;
            if let Some(pct) = entry.active_thread_percentage {
                let key = here.clone().key("active_thread_percentage");
                if !mps {
                    return Err(invalid(key, "applies to strategy = \"mps\" only".into()));
                }
                if !(1..=100).contains(&pct) {
                    return Err(invalid(key, "expected a percentage from 1 to 100".into()));
                }
            }
            if mps {
                check_mps_resource(entry).map_err(|reason| invalid(here.clone().key("name"), reason))?;
            }
            seen.push((entry.clone(), here));
        }
        for (i, text) in self.compact.iter().enumerate() {
            let here = at.clone().key("compact").index(i);
            let entry = SharedResource::from_compact(text).map_err(|reason| invalid(here.clone(), reason))?;
            entry.validate_names().map_err(|reason| invalid(here.clone(), reason))?;
            if mps {
                check_mps_resource(&entry).map_err(|reason| invalid(here.clone(), reason))?;
            }
            seen.push((entry, here));
        }
        for (i, (entry, here)) in seen.iter().enumerate() {
            let target = entry.advertised_name(self.rename_by_default);
            for (other, there) in &seen[..i] {
                if other.resource_name() == entry.resource_name() {
                    return Err(invalid(
                        here.clone(),
                        format!("{} is already shared by {there}", entry.resource_name()),
                    ));
                }
                if other.advertised_name(self.rename_by_default) == target {
                    return Err(invalid(
                        here.clone(),
                        format!("{there} already advertises its replicas as {target}"),
                    ));
                }
                // Entries share the resources as built, not each other's replicas.
                let renamed_onto = |a: &SharedResource, b: &SharedResource| {
                    let name = a.advertised_name(self.rename_by_default);
                    name != a.resource_name() && name == b.resource_name()
                };
                if renamed_onto(other, entry) || renamed_onto(entry, other) {
                    return Err(invalid(
                        here.clone(),
                        format!(
                            "this entry and {there} name each other's replicas; share resources by their original names"
                        ),
                    ));
                }
            }
        }
        if self.fail_requests_greater_than_one && !seen.iter().any(|(e, _)| e.max_replicas() > 1) {
            return Err(invalid(
                at.clone().key("fail_requests_greater_than_one"),
                "applies to shared resources only, and no resource has more than 1 replica".into(),
            ));
        }
        Ok(())
    }
}

impl SharedResource {
    /// `name` shared as `replicas` replicas of every device, under its default name, with no
    /// per-GPU counts or limits.
    pub fn new(name: &str, replicas: u32) -> SharedResource {
        SharedResource {
            name: name.to_owned(),
            rename: String::new(),
            replicas,
            devices: SharedDevices::All,
            replicas_per_gpu: BTreeMap::new(),
            memory_per_replica: None,
            active_thread_percentage: None,
        }
    }

    /// A resource from the compact form `resource:newname:replicas`; an empty `newname` means
    /// default naming (`rename_by_default`).
    pub fn from_compact(text: &str) -> Result<SharedResource, String> {
        const FORM: &str = "expected resource:newname:replicas, e.g. \"gpu:sharedgpu:4\" or \"mig-3g.20gb:small:2\" \
                            (an empty newname keeps the default naming: \"gpu::4\")";
        let parts: Vec<&str> = text.split(':').collect();
        let [name, rename, replicas] = parts.as_slice() else {
            return Err(FORM.into());
        };
        if name.is_empty() {
            return Err(format!("the resource is missing; {FORM}"));
        }
        let replicas = replicas
            .parse::<u32>()
            .map_err(|_| format!("{replicas:?} is not a replica count; {FORM}"))?;
        if replicas == 0 {
            return Err("expected at least 1 replica".into());
        }
        Ok(SharedResource {
            rename: (*rename).to_owned(),
            ..SharedResource::new(name, replicas)
        })
    }

    /// The full resource name: `name` with `nvidia.com/` added when it has no domain.
    pub fn resource_name(&self) -> String {
        qualified(&self.name)
    }

    /// The name the replicas are advertised under.
    pub fn advertised_name(&self, rename_by_default: bool) -> String {
        if !self.rename.is_empty() {
            qualified(&self.rename)
        } else if rename_by_default {
            format!("{}{SHARED_SUFFIX}", self.resource_name())
        } else {
            self.resource_name()
        }
    }

    /// The largest replica count any device of this resource gets.
    pub fn max_replicas(&self) -> u32 {
        self.replicas_per_gpu
            .values()
            .copied()
            .chain([self.replicas])
            .max()
            .unwrap_or(self.replicas)
    }

    fn validate(&self, at: &KeyPath) -> Check {
        let invalid = |key: KeyPath, reason: String| Invalid { key, reason };
        check_resource_name(&self.name).map_err(|reason| invalid(at.clone().key("name"), reason))?;
        if !self.rename.is_empty() {
            check_resource_name(&self.rename).map_err(|reason| invalid(at.clone().key("rename"), reason))?;
        }
        if self.replicas == 0 {
            return Err(invalid(
                at.clone().key("replicas"),
                "expected at least 1 (1 shares nothing)".into(),
            ));
        }
        if let SharedDevices::List(list) = &self.devices {
            let key = at.clone().key("devices");
            if list.is_empty() {
                return Err(invalid(
                    key,
                    "an empty list selects no device; expected \"all\" or GPU indices or UUIDs".into(),
                ));
            }
            for (i, device) in list.iter().enumerate() {
                if device.is_empty() {
                    return Err(invalid(key.clone().index(i), "expected a GPU index or UUID".into()));
                }
                if list[..i].contains(device) {
                    return Err(invalid(key.clone().index(i), format!("{device} is listed twice")));
                }
            }
        }
        for (gpu, count) in &self.replicas_per_gpu {
            let key = at.clone().key("replicas_per_gpu").key(gpu);
            if gpu.is_empty() {
                return Err(invalid(key, "expected a GPU index or UUID as the key".into()));
            }
            if *count == 0 {
                return Err(invalid(key, "expected at least 1 (1 shares nothing)".into()));
            }
        }
        if self.memory_per_replica == Some(MemoryBudget::Mib(0)) {
            return Err(invalid(
                at.clone().key("memory_per_replica"),
                "expected at least 1 MiB, or \"fair\"".into(),
            ));
        }
        Ok(())
    }

    /// The name checks of a compact entry (which has no other fields to check).
    fn validate_names(&self) -> Result<(), String> {
        check_resource_name(&self.name)?;
        if !self.rename.is_empty() {
            check_resource_name(&self.rename)?;
        }
        Ok(())
    }
}

/// Under `mps`: the entry shares full GPUs. NVIDIA refuses MIG devices ("sharing using MPS is
/// not supported for MIG devices", `internal/plugin/mps.go`); a MIG resource of the `mixed`
/// strategy is refused here, MIG devices under `single` when the resources are built.
fn check_mps_resource(entry: &SharedResource) -> Result<(), String> {
    let name = entry.resource_name();
    if name.starts_with(MIG_RESOURCE_PREFIX) {
        return Err(format!(
            "{name} is a MIG resource: sharing using MPS is not supported for MIG devices (MPS shares full GPUs)"
        ));
    }
    Ok(())
}

/// `name` with `nvidia.com/` added when it has no domain.
fn qualified(name: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{RESOURCE_PREFIX}{name}")
    }
}

/// A resource name as written in the config: an extended resource name under `nvidia.com/`,
/// with or without that prefix.
fn check_resource_name(name: &str) -> Result<(), String> {
    let full = qualified(name);
    if !full.starts_with(RESOURCE_PREFIX) {
        return Err(format!(
            "expected a resource under {RESOURCE_PREFIX}, e.g. \"nvidia.com/gpu\", \"gpu\" or \"mig-1g.5gb\""
        ));
    }
    crate::names::check_label_key(&full)
        .map_err(|reason| format!("{full:?} is not a valid extended resource name: {reason}"))
}

// === serde ===

impl Serialize for SharedDevices {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SharedDevices::All => s.serialize_str("all"),
            SharedDevices::List(list) => list.serialize(s),
        }
    }
}

const DEVICES_EXPECTED: &str = "expected \"all\" or an array of GPU indices or UUIDs";

impl<'de> Deserialize<'de> for SharedDevices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct DevicesVisitor;

        impl<'de> Visitor<'de> for DevicesVisitor {
            type Value = SharedDevices;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(DEVICES_EXPECTED.trim_start_matches("expected "))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<SharedDevices, E> {
                if v == "all" {
                    Ok(SharedDevices::All)
                } else {
                    Err(E::custom(DEVICES_EXPECTED))
                }
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SharedDevices, A::Error> {
                let mut list = Vec::new();
                while let Some(DeviceRef(id)) = seq.next_element()? {
                    list.push(id);
                }
                Ok(SharedDevices::List(list))
            }
        }

        d.deserialize_any(DevicesVisitor)
    }
}

/// One `devices` item: an index (integer or string) or a UUID, kept as written.
struct DeviceRef(String);

const DEVICE_REF_EXPECTED: &str = "expected a GPU index (0, 1, ...), \"<gpu>:<mig>\" or a UUID";

impl<'de> Deserialize<'de> for DeviceRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct RefVisitor;

        impl Visitor<'_> for RefVisitor {
            type Value = DeviceRef;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(DEVICE_REF_EXPECTED.trim_start_matches("expected "))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DeviceRef, E> {
                Ok(DeviceRef(v.to_string()))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DeviceRef, E> {
                u64::try_from(v)
                    .map(|v| DeviceRef(v.to_string()))
                    .map_err(|_| E::custom(DEVICE_REF_EXPECTED))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceRef, E> {
                Ok(DeviceRef(v.to_owned()))
            }
        }

        d.deserialize_any(RefVisitor)
    }
}

impl Serialize for MemoryBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MemoryBudget::Mib(mib) => s.serialize_u64(*mib),
            MemoryBudget::Fair => s.serialize_str("fair"),
        }
    }
}

const BUDGET_EXPECTED: &str = "expected a number of MiB or \"fair\"";

impl<'de> Deserialize<'de> for MemoryBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BudgetVisitor;

        impl Visitor<'_> for BudgetVisitor {
            type Value = MemoryBudget;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(BUDGET_EXPECTED.trim_start_matches("expected "))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<MemoryBudget, E> {
                Ok(MemoryBudget::Mib(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<MemoryBudget, E> {
                u64::try_from(v)
                    .map(MemoryBudget::Mib)
                    .map_err(|_| E::custom(BUDGET_EXPECTED))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<MemoryBudget, E> {
                if v == "fair" {
                    Ok(MemoryBudget::Fair)
                } else {
                    Err(E::custom(BUDGET_EXPECTED))
                }
            }
        }

        d.deserialize_any(BudgetVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, MemoryAction, Source};
    use std::time::Duration;

    fn parse(text: &str) -> Result<Config, String> {
        Config::from_sources(&[Source::new("s.toml", text)]).map_err(|e| e.to_string())
    }

    fn err(text: &str) -> String {
        parse(text).expect_err("config accepted")
    }

    const SHARED4: &str = "[device_plugin.profiles.shared4.sharing]\nstrategy = \"time-slicing\"\n\
                           rename_by_default = true\nfail_requests_greater_than_one = true\npolicy = \"packed\"\n\
                           [[device_plugin.profiles.shared4.sharing.resources]]\nname = \"nvidia.com/gpu\"\n\
                           replicas = 4\ndevices = [0, \"1\", \"GPU-x\"]\nreplicas_per_gpu = { \"0\" = 2 }\n\
                           memory_per_replica = \"fair\"\n";

    #[test]
    fn a_profile_replaces_the_sharing_table() {
        let config = parse(&format!(
            "[device_plugin.sharing]\nstrategy = \"time-slicing\"\ncompact = [\"mig-1g.5gb::2\"]\n{SHARED4}"
        ))
        .expect("valid");
        let base = &config.device_plugin.sharing;
        assert_eq!(
            base.entries().expect("parses")[0].resource_name(),
            "nvidia.com/mig-1g.5gb"
        );
        let shared = config.device_plugin.with_profile("shared4").expect("profile").sharing;
        assert_eq!(shared.policy, SharedPolicy::Packed);
        assert!(shared.rename_by_default && shared.fail_requests_greater_than_one);
        assert!(shared.compact.is_empty(), "the base table is not merged in");
        let entry = &shared.resources[0];
        assert_eq!(
            entry.devices,
            SharedDevices::List(vec!["0".into(), "1".into(), "GPU-x".into()])
        );
        assert_eq!(entry.replicas_per_gpu["0"], 2);
        assert_eq!(entry.memory_per_replica, Some(MemoryBudget::Fair));
        assert_eq!(entry.advertised_name(true), "nvidia.com/gpu.shared");
        assert_eq!(entry.max_replicas(), 4);
        // Sharing takes part in the effective settings' equality (a label change swaps them).
        assert_ne!(
            config.device_plugin.with_profile("shared4"),
            Some(config.device_plugin.clone())
        );

        // The effective config round-trips through TOML.
        let text = toml::to_string(&config).expect("serializes");
        assert_eq!(parse(&text).expect("reparses"), config);
    }

    #[test]
    fn mps_keys_and_rules() {
        const MPS: &str = "[device_plugin.sharing]\nstrategy = \"mps\"\n";
        const RES: &str = "[[device_plugin.sharing.resources]]\nname = \"gpu\"\nreplicas = 4\n";
        let config = parse(&format!("{MPS}{RES}active_thread_percentage = 30\n")).expect("valid");
        let sharing = &config.device_plugin.sharing;
        assert_eq!(sharing.strategy, SharingStrategy::Mps);
        assert_eq!(sharing.mps_root, std::path::Path::new(DEFAULT_MPS_ROOT));
        assert_eq!(sharing.resources[0].active_thread_percentage, Some(30));
        // NVIDIA forces failRequestsGreaterThanOne under MPS; time-slicing keeps the key.
        assert!(!sharing.fail_requests_greater_than_one && sharing.fails_requests_greater_than_one());
        let ts = parse(&format!("[device_plugin.sharing]\nstrategy = \"time-slicing\"\n{RES}")).expect("valid");
        assert!(!ts.device_plugin.sharing.fails_requests_greater_than_one());
        let root = parse(&format!("{MPS}mps_root = \"/var/mps\"\n{RES}")).expect("valid");
        assert_eq!(root.device_plugin.sharing.mps_root, std::path::Path::new("/var/mps"));

        assert_eq!(
            err(&format!("{MPS}mps_root = \"mps\"\n{RES}")),
            "s.toml:3: device_plugin.sharing.mps_root = \"mps\" is not valid: expected an absolute host path, e.g. \
             \"/run/nvidia/mps\""
        );
        assert_eq!(
            err(&format!("[device_plugin]\nmig_strategy = \"mixed\"\n{MPS}{RES}")),
            "s.toml:4: device_plugin.sharing.strategy = \"mps\" is not valid: MPS is not supported with \
             device_plugin.mig_strategy = \"mixed\" (as in NVIDIA's plugin); MPS shares full GPUs: use mig_strategy \
             \"none\" or \"single\" without MIG"
        );
        // A profile's own mig_strategy counts, and the base's when it has none.
        let profile = err(
            "[device_plugin.profiles.p]\nmig_strategy = \"mixed\"\n[device_plugin.profiles.p.sharing]\n\
             strategy = \"mps\"\ncompact = [\"gpu::2\"]\n",
        );
        assert!(
            profile.starts_with(
                "s.toml:4: device_plugin.profiles.p.sharing.strategy = \"mps\" is not valid: MPS is not supported"
            ),
            "{profile}"
        );
        assert_eq!(
            err(&format!(
                "{MPS}[[device_plugin.sharing.resources]]\nname = \"mig-1g.5gb\"\nreplicas = 2\n"
            )),
            "s.toml:4: device_plugin.sharing.resources[0].name = \"mig-1g.5gb\" is not valid: nvidia.com/mig-1g.5gb is \
             a MIG resource: sharing using MPS is not supported for MIG devices (MPS shares full GPUs)"
        );
        assert_eq!(
            err(&format!("{MPS}{RES}active_thread_percentage = 0\n")),
            "s.toml:6: device_plugin.sharing.resources[0].active_thread_percentage = 0 is not valid: expected a \
             percentage from 1 to 100"
        );
        assert_eq!(
            err(&format!(
                "[device_plugin.sharing]\nstrategy = \"time-slicing\"\n{RES}active_thread_percentage = 50\n"
            )),
            "s.toml:6: device_plugin.sharing.resources[0].active_thread_percentage = 50 is not valid: applies to \
             strategy = \"mps\" only"
        );
    }

    #[test]
    fn memory_limits_keys() {
        let config =
            parse("[device_plugin.memory_limits]\naction = \"dry-run\"\ninterval = \"500ms\"\ngrace_period = \"0s\"\n")
                .expect("valid");
        let limits = &config.device_plugin.memory_limits;
        assert_eq!(limits.action, MemoryAction::DryRun);
        assert_eq!(limits.interval, Duration::from_millis(500));
        assert_eq!(limits.grace_period, Duration::ZERO);
        assert_eq!(
            err("[device_plugin.memory_limits]\naction = \"term\"\n"),
            "s.toml:2: device_plugin.memory_limits.action = \"term\" is not valid: expected one of log, kill, dry-run"
        );
        assert_eq!(
            err("[device_plugin.memory_limits]\ninterval = \"0s\"\n"),
            "s.toml:2: device_plugin.memory_limits.interval = \"0s\" is not valid: expected a duration greater than 0s"
        );
    }

    #[test]
    fn errors_name_file_line_and_key() {
        const HEAD: &str = "[device_plugin.sharing]\nstrategy = \"time-slicing\"\n";
        const RES: &str = "[[device_plugin.sharing.resources]]\n";
        let e = |rest: &str| err(&format!("{HEAD}{rest}"));
        assert_eq!(
            err("[device_plugin.sharing]\nstrategy = \"vgpu\"\n"),
            "s.toml:2: device_plugin.sharing.strategy = \"vgpu\" is not valid: expected one of none, time-slicing, mps"
        );
        assert_eq!(
            err("[device_plugin.sharing]\ncompact = [\"gpu::2\"]\n"),
            "s.toml:2: device_plugin.sharing.compact = [\"gpu::2\"] is not valid: sharing needs strategy = \
             \"time-slicing\" or \"mps\" (it is \"none\")"
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 0\n")),
            "s.toml:5: device_plugin.sharing.resources[0].replicas = 0 is not valid: expected at least 1 (1 shares nothing)"
        );
        let missing = e(&format!("{RES}name = \"gpu\"\n"));
        assert!(
            missing.starts_with("s.toml:3: device_plugin.sharing.resources[0] = ")
                && missing.ends_with("missing field `replicas`"),
            "{missing}"
        );
        assert_eq!(
            e(&format!("{RES}name = \"amd.com/gpu\"\nreplicas = 2\n")),
            "s.toml:4: device_plugin.sharing.resources[0].name = \"amd.com/gpu\" is not valid: expected a resource \
             under nvidia.com/, e.g. \"nvidia.com/gpu\", \"gpu\" or \"mig-1g.5gb\""
        );
        let bad_name = e(&format!("{RES}name = \"gpu\"\nrename = \"gpu shared\"\nreplicas = 2\n"));
        assert!(
            bad_name.starts_with(
                "s.toml:5: device_plugin.sharing.resources[0].rename = \"gpu shared\" is not valid: \
                 \"nvidia.com/gpu shared\" is not a valid extended resource name"
            ),
            "{bad_name}"
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 2\ndevices = \"some\"\n")),
            "s.toml:6: device_plugin.sharing.resources[0].devices = \"some\" is not valid: expected \"all\" or an \
             array of GPU indices or UUIDs"
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 2\ndevices = [0, -1]\n")),
            "s.toml:6: device_plugin.sharing.resources[0].devices[1] = -1 is not valid: expected a GPU index (0, 1, \
             ...), \"<gpu>:<mig>\" or a UUID"
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 2\ndevices = [0, \"0\"]\n")),
            "s.toml:6: device_plugin.sharing.resources[0].devices[1] = \"0\" is not valid: 0 is listed twice"
        );
        assert_eq!(
            e(&format!(
                "{RES}name = \"gpu\"\nreplicas = 2\nreplicas_per_gpu = {{ \"GPU-1\" = 0 }}\n"
            )),
            "s.toml:6: device_plugin.sharing.resources[0].replicas_per_gpu.GPU-1 = 0 is not valid: expected at least \
             1 (1 shares nothing)"
        );
        assert_eq!(
            e(&format!(
                "{RES}name = \"gpu\"\nreplicas = 2\nmemory_per_replica = \"half\"\n"
            )),
            "s.toml:6: device_plugin.sharing.resources[0].memory_per_replica = \"half\" is not valid: expected a \
             number of MiB or \"fair\""
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 2\nmemory_per_replica = 0\n")),
            "s.toml:6: device_plugin.sharing.resources[0].memory_per_replica = 0 is not valid: expected at least \
             1 MiB, or \"fair\""
        );
        assert_eq!(
            e(&format!("{RES}name = \"gpu\"\nreplicas = 2\nreplica = 3\n")),
            "s.toml:6: unknown key device_plugin.sharing.resources[0].replica: expected one of name, rename, \
             replicas, devices, replicas_per_gpu, memory_per_replica, active_thread_percentage"
        );
        // Compact strings.
        assert_eq!(
            e("compact = [\"gpu::4\",\n  \"gpu:4\"]\n"),
            "s.toml:4: device_plugin.sharing.compact[1] = \"gpu:4\" is not valid: expected \
             resource:newname:replicas, e.g. \"gpu:sharedgpu:4\" or \"mig-3g.20gb:small:2\" (an empty newname keeps \
             the default naming: \"gpu::4\")"
        );
        let count = e("compact = [\"gpu:x:four\"]\n");
        assert!(
            count.starts_with(
                "s.toml:3: device_plugin.sharing.compact[0] = \"gpu:x:four\" is not valid: \"four\" is not a replica count"
            ),
            "{count}"
        );
        assert_eq!(
            e("compact = [\"gpu:x:0\"]\n"),
            "s.toml:3: device_plugin.sharing.compact[0] = \"gpu:x:0\" is not valid: expected at least 1 replica"
        );
        // Duplicates: a resource shared twice, or two resources under one name.
        assert_eq!(
            e(&format!(
                "compact = [\"nvidia.com/gpu:a:2\"]\n{RES}name = \"gpu\"\nreplicas = 2\n"
            )),
            "s.toml:3: device_plugin.sharing.compact[0] = \"nvidia.com/gpu:a:2\" is not valid: nvidia.com/gpu is \
             already shared by device_plugin.sharing.resources[0]"
        );
        assert_eq!(
            e("compact = [\"gpu:small:2\", \"mig-1g.5gb:nvidia.com/small:2\"]\n"),
            "s.toml:3: device_plugin.sharing.compact[1] = \"mig-1g.5gb:nvidia.com/small:2\" is not valid: \
             device_plugin.sharing.compact[0] already advertises its replicas as nvidia.com/small"
        );
        assert_eq!(
            e("rename_by_default = true\ncompact = [\"gpu::2\", \"gpu.shared::2\"]\n"),
            "s.toml:4: device_plugin.sharing.compact[1] = \"gpu.shared::2\" is not valid: this entry and \
             device_plugin.sharing.compact[0] name each other's replicas; share resources by their original names"
        );
        // fail_requests_greater_than_one needs something shared.
        assert_eq!(
            e("fail_requests_greater_than_one = true\ncompact = [\"gpu::1\"]\n"),
            "s.toml:3: device_plugin.sharing.fail_requests_greater_than_one = true is not valid: applies to shared \
             resources only, and no resource has more than 1 replica"
        );
        assert!(
            parse(&format!(
                "{HEAD}fail_requests_greater_than_one = true\ncompact = [\"gpu::2\"]\n"
            ))
            .is_ok()
        );
        // In a profile, the key names the profile.
        let profile = err(
            "[device_plugin.profiles.\"a.b\".sharing]\nstrategy = \"time-slicing\"\n\
             [[device_plugin.profiles.\"a.b\".sharing.resources]]\nname = \"gpu\"\nreplicas = 0\n",
        );
        assert_eq!(
            profile,
            "s.toml:5: device_plugin.profiles.\"a.b\".sharing.resources[0].replicas = 0 is not valid: expected at \
             least 1 (1 shares nothing)"
        );
    }
}
