//! Named MIG layouts, the successor of mig-parted's `mig-configs`: a layout is a list of
//! entries, each saying which GPUs it is for (indices and PCI device ids) and what they should
//! look like (MIG mode and profile counts).
//!
//! Profile names are only checked for syntax here ([`parse_profile_name`]). What a name means
//! depends on the card (`1g.10gb` is a different slice on an A100-40GB and an H100-80GB), so
//! the planner resolves names against the profiles NVML reports for each GPU, never against a
//! table.
//!
//! # Which entry applies to a GPU
//!
//! An entry applies to GPU `i` with PCI device id `d` when both hold (mig-parted's rule):
//! - its `devices` is [`DeviceSelector::All`], or lists `i` (the NVML index);
//! - its `device_filter` is empty, or lists `d` ([`DeviceId`]: a device id alone matches every
//!   GPU with it; one with a subsystem id, mig-parted's `0x<device>10DE:0x<subsystem>`, only
//!   the GPUs whose NVML `pciSubSystemId` is that).
//!
//! [`MigLayout::entries_for`] returns every entry that applies, in order.
//! - **None**: the layout does not cover that GPU. mig-parted's `apply` leaves such a GPU as it
//!   is, and its `assert` then fails ("not all GPUs match the specified config"), so the node
//!   never reports success. [`crate::mig::stage::plan_layout`] therefore refuses such a layout
//!   before anything changes on any GPU, naming the GPU ([`crate::mig::planner::PlanError::NotCovered`]).
//!   A GPU without MIG that no entry covers is simply left alone.
//! - **A GPU without MIG** is skipped, as mig-parted's apply does, unless an entry that applies
//!   to it lists its index explicitly and enables MIG (then the layout is refused, naming it):
//!   `devices: all` and `mig_enabled = false` both leave it alone.
//! - **Several**: mig-parted applies the entries one after the other, so the last one wins
//!   ("`devices: all`, then an override for `[0]`"). [`MigLayout::entry_for`] (the last one)
//!   is the one used; [`MigLayout::overrides`] names each later entry that overrides an
//!   earlier one with a different state, for a warning.

pub mod defaults;

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

/// NVIDIA's PCI vendor id, the low 16 bits of mig-parted's 32-bit device filters.
pub const NVIDIA_VENDOR_ID: u16 = 0x10DE;

/// One named layout: its entries, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigLayout {
    pub entries: Vec<LayoutEntry>,
    /// What happens to a MIG-capable GPU no entry covers (`[mig] uncovered_gpus`).
    pub uncovered: Uncovered,
}

/// What a layout does with a MIG-capable GPU that no entry covers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Uncovered {
    /// Left as it is, and the layout still succeeds (mig-manager's behaviour).
    #[default]
    Leave,
    /// The layout is refused before anything changes, naming the GPU.
    Fail,
}

/// A built-in layout's profiles, worked out for each GPU from the GPU instance profiles NVML
/// reports for it, as mig-manager's generated config (v0.14 and later) holds them: every MIG
/// GPU, current or future, gets the GPU Operator's names with no table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Generated {
    /// `all-<profile>`: as many instances of the profile as fit (its NVML instance count). A
    /// GPU without the profile is not covered.
    Max(String),
    /// `all-balanced`: on a GPU whose largest profile has 7 slices 2 × 1g + 1 × 2g + 1 × 3g, on
    /// one with 4 slices 2 × 1g + 1 × 2g; each of these the profile without attributes of that
    /// slice count that fits most often (`1g.5gb` rather than `1g.10gb` on an A100-40GB). Other
    /// GPUs are not covered.
    Balanced,
}

/// What [`Generated::profiles_for`] needs of one GPU instance profile.
#[derive(Debug, Clone, Copy)]
pub struct ProfileFacts<'a> {
    /// NVML's name without `MIG `, e.g. `1g.5gb+me`.
    pub name: &'a str,
    /// Compute slices.
    pub slices: u32,
    /// How many fit at most.
    pub instances: u32,
}

impl Generated {
    /// The profile counts for a GPU with the GPU instance profiles `profiles`; `None` when the
    /// GPU has nothing that fits (the entry does not apply to it).
    pub fn profiles_for(&self, profiles: &[ProfileFacts]) -> Option<BTreeMap<String, u32>> {
        match self {
            Generated::Max(wanted) => {
                let wanted = parse_profile_name(wanted).ok()?;
                let found = profiles
                    .iter()
                    .find(|p| parse_profile_name(p.name).is_ok_and(|name| name.same_profile(&wanted)))?;
                (found.instances > 0).then(|| BTreeMap::from([(found.name.to_owned(), found.instances)]))
            }
            Generated::Balanced => {
                let base = |slices: u32| {
                    profiles
                        .iter()
                        .filter(|p| p.slices == slices && p.instances > 0)
                        .filter(|p| {
                            parse_profile_name(p.name).is_ok_and(|n| {
                                n.attrs.is_empty() && n.neg_attrs.is_empty() && n.compute_slices.is_none()
                            })
                        })
                        // The most instances; of equals, the first NVML lists.
                        .fold(None::<&ProfileFacts>, |best, p| match best {
                            Some(b) if b.instances >= p.instances => Some(b),
                            _ => Some(p),
                        })
                };
                let largest = profiles.iter().map(|p| p.slices).max()?;
                let recipe: &[(u32, u32)] = match largest {
                    7 => &[(1, 2), (2, 1), (3, 1)],
                    4 => &[(1, 2), (2, 1)],
                    _ => return None,
                };
                recipe
                    .iter()
                    .map(|&(slices, count)| base(slices).map(|p| (p.name.to_owned(), count)))
                    .collect()
            }
        }
    }
}

/// One entry of a layout: which GPUs, and the MIG state they should have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutEntry {
    /// The GPUs (NVML indices) it is for.
    pub devices: DeviceSelector,
    /// PCI device ids (e.g. 0x20B0 for A100-SXM4-40GB), each perhaps with a subsystem id;
    /// empty: any.
    pub device_filter: Vec<DeviceId>,
    /// The MIG mode.
    pub mig_enabled: bool,
    /// Profile name → number of instances, e.g. `1g.5gb` → 7, `1c.4g.20gb` → 4. Empty with
    /// `mig_enabled`: MIG on with no instances. Always empty without `mig_enabled`.
    pub profiles: BTreeMap<String, u32>,
    /// A built-in layout's profiles, worked out per GPU instead of `profiles` (then empty).
    pub generated: Option<Generated>,
}

/// `devices`: every GPU, or the GPUs with these NVML indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelector {
    All,
    Indices(Vec<u32>),
}

impl DeviceSelector {
    /// Whether the GPU with NVML index `gpu_index` is selected.
    pub fn contains(&self, gpu_index: u32) -> bool {
        match self {
            DeviceSelector::All => true,
            DeviceSelector::Indices(list) => list.contains(&gpu_index),
        }
    }

    /// Whether some GPU index is selected by both.
    fn intersects(&self, other: &DeviceSelector) -> bool {
        match (self, other) {
            (DeviceSelector::Indices(a), DeviceSelector::Indices(b)) => a.iter().any(|i| b.contains(i)),
            (DeviceSelector::All, DeviceSelector::Indices(l)) | (DeviceSelector::Indices(l), DeviceSelector::All) => {
                !l.is_empty()
            }
            (DeviceSelector::All, DeviceSelector::All) => true,
        }
    }
}

impl LayoutEntry {
    /// Whether this entry applies to the GPU with NVML index `gpu_index` and PCI ids `pci`
    /// (see the module docs).
    pub fn matches(&self, gpu_index: u32, pci: GpuPciIds) -> bool {
        self.devices.contains(gpu_index)
            && (self.device_filter.is_empty() || self.device_filter.iter().any(|d| d.matches(pci)))
    }

    /// Whether some GPU could be matched by both entries.
    fn overlaps(&self, other: &LayoutEntry) -> bool {
        let filters_meet = self.device_filter.is_empty()
            || other.device_filter.is_empty()
            || self
                .device_filter
                .iter()
                .any(|d| other.device_filter.iter().any(|o| d.meets(o)));
        filters_meet && self.devices.intersects(&other.devices)
    }

    /// Whether both ask for the same MIG state.
    fn same_state(&self, other: &LayoutEntry) -> bool {
        self.mig_enabled == other.mig_enabled && self.profiles == other.profiles && self.generated == other.generated
    }
}

impl MigLayout {
    /// A layout of these entries.
    pub fn new(entries: Vec<LayoutEntry>) -> Self {
        MigLayout {
            entries,
            uncovered: Uncovered::default(),
        }
    }

    /// Every entry that applies to the GPU with NVML index `gpu_index` and PCI ids `pci`, in
    /// order. Empty: the layout does not cover that GPU.
    pub fn entries_for(&self, gpu_index: u32, pci: GpuPciIds) -> Vec<&LayoutEntry> {
        self.entries.iter().filter(|e| e.matches(gpu_index, pci)).collect()
    }

    /// The entry that decides the GPU's state: the last one that applies, which is what
    /// mig-parted ends up with after applying entries in order. `None`: not covered.
    pub fn entry_for(&self, gpu_index: u32, pci: GpuPciIds) -> Option<&LayoutEntry> {
        self.entries.iter().rev().find(|e| e.matches(gpu_index, pci))
    }

    /// The rules every layout follows, wherever it comes from (the config, an import, the
    /// built-in defaults):
    /// - at least one entry;
    /// - `devices` is `All` or a non-empty list without duplicates;
    /// - `device_filter` has no duplicates;
    /// - without `mig_enabled`, no profiles;
    /// - every profile name parses ([`parse_profile_name`]), no two name the same profile
    ///   (attributes in another order), and every count is at least 1.
    ///
    /// Entries that can apply to the same GPU may differ: the last one wins (see
    /// [`MigLayout::overrides`]).
    pub fn check(&self) -> Result<(), LayoutError> {
        if self.entries.is_empty() {
            return Err(LayoutError::NoEntries);
        }
        for (i, entry) in self.entries.iter().enumerate() {
            check_entry(i, entry)?;
        }
        Ok(())
    }

    /// A warning for each entry that can apply to the same GPUs as an earlier one but asks for
    /// a different MIG state: on those GPUs the later entry wins, as in mig-parted.
    pub fn overrides(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, later) in self.entries.iter().enumerate() {
            for (j, earlier) in self.entries[..i].iter().enumerate() {
                if earlier.overlaps(later) && !earlier.same_state(later) {
                    out.push(format!(
                        "entry {i} overrides entry {j} on the GPUs both select (the last entry wins, as in mig-parted)"
                    ));
                }
            }
        }
        out
    }
}

fn check_entry(index: usize, entry: &LayoutEntry) -> Result<(), LayoutError> {
    let problem = |field, item, reason: String| LayoutError::Entry {
        entry: index,
        field,
        item,
        reason,
    };
    if let DeviceSelector::Indices(list) = &entry.devices {
        if list.is_empty() {
            return Err(problem(
                EntryField::Devices,
                None,
                "an empty list selects no GPU; expected \"all\" or GPU indices".to_owned(),
            ));
        }
        for (k, gpu) in list.iter().enumerate() {
            if list[..k].contains(gpu) {
                return Err(problem(
                    EntryField::Devices,
                    Some(Item::Index(k)),
                    format!("GPU {gpu} is listed twice"),
                ));
            }
        }
    }
    for (k, id) in entry.device_filter.iter().enumerate() {
        if entry.device_filter[..k].contains(id) {
            return Err(problem(
                EntryField::DeviceFilter,
                Some(Item::Index(k)),
                format!("device id {id} is listed twice"),
            ));
        }
    }
    if !entry.mig_enabled && !entry.profiles.is_empty() {
        return Err(problem(
            EntryField::Profiles,
            None,
            "MIG devices need MIG enabled; leave the profiles out or set MIG enabled".to_owned(),
        ));
    }
    let mut parsed: Vec<ProfileName> = Vec::with_capacity(entry.profiles.len());
    for (name, &count) in &entry.profiles {
        let item = || Some(Item::Profile(name.clone()));
        let profile = parse_profile_name(name).map_err(|e| problem(EntryField::Profiles, item(), e.to_string()))?;
        if let Some(same) = parsed.iter().find(|p| p.same_profile(&profile)) {
            return Err(problem(
                EntryField::Profiles,
                item(),
                format!("names the same profile as {:?}", same.text),
            ));
        }
        if count == 0 {
            return Err(problem(
                EntryField::Profiles,
                item(),
                "expected a count of at least 1; leave the profile out instead".to_owned(),
            ));
        }
        parsed.push(profile);
    }
    Ok(())
}

// === errors ===

/// A field of a layout entry, for messages. Spelled `devices`, `device_filter`, `mig_enabled`,
/// `profiles` in the agent's config and `devices`, `device-filter`, `mig-enabled`,
/// `mig-devices` in mig-parted's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryField {
    Devices,
    DeviceFilter,
    MigEnabled,
    Profiles,
}

impl EntryField {
    /// The key in the agent's config.
    pub fn config_key(self) -> &'static str {
        match self {
            EntryField::Devices => "devices",
            EntryField::DeviceFilter => "device_filter",
            EntryField::MigEnabled => "mig_enabled",
            EntryField::Profiles => "profiles",
        }
    }

    /// The key in a mig-parted config file.
    pub fn mig_parted_key(self) -> &'static str {
        match self {
            EntryField::Devices => "devices",
            EntryField::DeviceFilter => "device-filter",
            EntryField::MigEnabled => "mig-enabled",
            EntryField::Profiles => "mig-devices",
        }
    }
}

/// The part of a field a problem is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// The n-th element of a list (`devices`, `device_filter`).
    Index(usize),
    /// A profile of `profiles`, by name.
    Profile(String),
}

/// A profile name that is not well-formed, or a layout breaking a rule of
/// [`MigLayout::check`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Not `[<C>c.]<G>g.<GB>gb[+attr[,attr]|-attr[,attr]]`.
    #[error(
        "{text:?} is not a MIG profile name: {reason} (expected [<C>c.]<G>g.<GB>gb with an optional \
         +attr[,attr] or -attr suffix, e.g. 1g.5gb, 1c.4g.20gb, 1g.5gb+me, 1g.24gb-me)"
    )]
    ProfileName { text: String, reason: String },
    /// A layout without entries.
    #[error("a layout needs at least one entry")]
    NoEntries,
    /// An entry breaks a rule.
    #[error("entry {entry}, {}{}: {reason}", field.config_key(), ItemDisplay(item.as_ref()))]
    Entry {
        /// 0-based position of the entry.
        entry: usize,
        field: EntryField,
        item: Option<Item>,
        reason: String,
    },
}

struct ItemDisplay<'a>(Option<&'a Item>);

impl fmt::Display for ItemDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some(Item::Index(i)) => write!(f, "[{i}]"),
            Some(Item::Profile(p)) => write!(f, "[{p:?}]"),
        }
    }
}

// === profile names ===

/// A syntactically valid MIG profile name, e.g. `1g.5gb`, `1g.5gb+me`, `1g.24gb-me`,
/// `1c.4g.20gb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileName {
    /// `C` of `<C>c.<G>g...`: the compute slices of a compute-instance sub-profile; `None` when
    /// the compute instance spans the GPU instance (C = G, which is written without `c.`).
    pub compute_slices: Option<u32>,
    /// `G`: the GPU instance's compute slices.
    pub gpu_slices: u32,
    /// `GB`: memory as NVIDIA's naming rounds it.
    pub memory_gb: u32,
    /// Attributes after `+`, in the order written (`me`, `me.all`, `gfx`).
    pub attrs: Vec<String>,
    /// Attributes after `-`, in the order written (`me` of `1g.24gb-me`).
    pub neg_attrs: Vec<String>,
    /// The name as given.
    pub text: String,
}

impl ProfileName {
    /// Whether both name the same profile: equal numbers and the same attribute sets, in any
    /// order.
    pub fn same_profile(&self, other: &ProfileName) -> bool {
        let sorted = |v: &[String]| {
            let mut v = v.to_vec();
            v.sort();
            v
        };
        self.compute_slices == other.compute_slices
            && self.gpu_slices == other.gpu_slices
            && self.memory_gb == other.memory_gb
            && sorted(&self.attrs) == sorted(&other.attrs)
            && sorted(&self.neg_attrs) == sorted(&other.neg_attrs)
    }

    /// The GPU instance part of the name: `1c.4g.20gb+me` → `4g.20gb+me`.
    pub fn gpu_instance_name(&self) -> String {
        match self.compute_slices {
            None => self.text.clone(),
            Some(_) => self
                .text
                .split_once('.')
                .map_or_else(|| self.text.clone(), |(_, rest)| rest.to_owned()),
        }
    }
}

impl fmt::Display for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Checks the syntax of a MIG profile name: `[<C>c.]<G>g.<GB>gb`, then optionally `+` or `-`
/// and comma-separated attributes. Numbers are positive decimals without leading zeros; `C`,
/// when written, is less than `G` (C = G is written without `c.`); attributes are lower-case
/// letters and digits starting with a letter, with `.` between parts (`me.all`), and unique;
/// `+` and `-` are not combined.
pub fn parse_profile_name(name: &str) -> Result<ProfileName, LayoutError> {
    let fail = |reason: &str| LayoutError::ProfileName {
        text: name.to_owned(),
        reason: reason.to_owned(),
    };
    if name.is_empty() {
        return Err(fail("it is empty"));
    }
    let (base, attrs, neg_attrs) = match name.find(['+', '-']) {
        None => (name, Vec::new(), Vec::new()),
        Some(at) => {
            let (base, suffix) = name.split_at(at);
            let (sign, list) = suffix.split_at(1);
            if list.contains(['+', '-']) {
                return Err(fail("only one + or - attribute suffix is allowed"));
            }
            let list = parse_attrs(list).map_err(|r| fail(&r))?;
            if sign == "+" {
                (base, list, Vec::new())
            } else {
                (base, Vec::new(), list)
            }
        }
    };
    let parts: Vec<&str> = base.split('.').collect();
    let (c, g, gb) = match parts.as_slice() {
        [g, gb] => (None, *g, *gb),
        [c, g, gb] => (Some(*c), *g, *gb),
        _ => return Err(fail("expected 2 or 3 dot-separated fields before the attributes")),
    };
    let number = |field: &str, unit: &str| -> Result<u32, LayoutError> {
        let digits = field
            .strip_suffix(unit)
            .ok_or_else(|| fail(&format!("{field:?} does not end in {unit:?}")))?;
        parse_positive(digits).ok_or_else(|| fail(&format!("{field:?} does not start with a positive number")))
    };
    let compute_slices = c.map(|c| number(c, "c")).transpose()?;
    let gpu_slices = number(g, "g")?;
    let memory_gb = number(gb, "gb")?;
    match compute_slices {
        Some(c) if c == gpu_slices => {
            return Err(fail(&format!(
                "a compute instance spanning its GPU instance is written without \"{c}c.\""
            )));
        }
        Some(c) if c > gpu_slices => return Err(fail("more compute slices than GPU slices")),
        _ => {}
    }
    Ok(ProfileName {
        compute_slices,
        gpu_slices,
        memory_gb,
        attrs,
        neg_attrs,
        text: name.to_owned(),
    })
}

/// A positive decimal without sign or leading zeros.
fn parse_positive(digits: &str) -> Option<u32> {
    let ok = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && !digits.starts_with('0');
    if ok { digits.parse().ok() } else { None }
}

fn parse_attrs(list: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for attr in list.split(',') {
        let part_ok = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        let ok = attr.as_bytes().first().is_some_and(u8::is_ascii_lowercase) && attr.split('.').all(part_ok);
        if !ok {
            return Err(format!(
                "attribute {attr:?} is not lower-case letters and digits starting with a letter, e.g. me, me.all, gfx"
            ));
        }
        if out.iter().any(|a| a == attr) {
            return Err(format!("attribute {attr:?} is listed twice"));
        }
        out.push(attr.to_owned());
    }
    Ok(out)
}

// === PCI device ids ===

/// One element of `device_filter`: a PCI device id, and perhaps the subsystem id too
/// (mig-parted v0.15's `0x<device>10DE:0x<subsystem device><subsystem vendor>`), for models
/// that share a device id but differ in their boards (A16 and A2 are both 0x25B6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId {
    /// The 16-bit PCI device id, e.g. 0x20B0.
    pub device: u16,
    /// The subsystem id as NVML's `pciSubSystemId` holds it (subsystem device id in the high
    /// half, subsystem vendor id in the low half), e.g. 0x134F10DE; `None`: any.
    pub subsystem: Option<u32>,
}

/// What a GPU shows a device filter: its PCI device id and NVML's `pciSubSystemId`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPciIds {
    pub device: u16,
    pub subsystem: u32,
}

/// A GPU of device id `device` whose subsystem id NVML reports as 0 (unknown).
impl From<u16> for GpuPciIds {
    fn from(device: u16) -> Self {
        GpuPciIds { device, subsystem: 0 }
    }
}

/// A bare device id equals a filter of that device id without a subsystem.
impl PartialEq<u16> for DeviceId {
    fn eq(&self, device: &u16) -> bool {
        self.subsystem.is_none() && self.device == *device
    }
}

impl From<u16> for DeviceId {
    fn from(device: u16) -> Self {
        DeviceId {
            device,
            subsystem: None,
        }
    }
}

impl DeviceId {
    /// Whether a GPU with these ids is one this filter names.
    pub fn matches(&self, gpu: GpuPciIds) -> bool {
        self.device == gpu.device && self.subsystem.is_none_or(|s| s == gpu.subsystem)
    }

    /// Whether some GPU could match both.
    fn meets(&self, other: &DeviceId) -> bool {
        self.device == other.device
            && match (self.subsystem, other.subsystem) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }

    /// mig-parted's spelling: `0x20B010DE`, or `0x20B010DE:0x134F10DE`.
    pub fn to_mig_parted(&self) -> String {
        let primary = format!("0x{:04X}{NVIDIA_VENDOR_ID:04X}", self.device);
        match self.subsystem {
            Some(s) => format!("{primary}:0x{s:08X}"),
            None => primary,
        }
    }
}

/// The config's spelling: `0x20B0`, or `0x20B0:0x134F10DE`.
impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_device_id(self.device))?;
        match self.subsystem {
            Some(s) => write!(f, ":0x{s:08X}"),
            None => Ok(()),
        }
    }
}

/// Writes a device id the way the config does: `0x20B0`.
pub fn format_device_id(id: u16) -> String {
    format!("0x{id:04X}")
}

/// A device id from mig-parted's 32-bit form, device id in the high half and vendor id in the
/// low half (`0x20B010DE`). The vendor must be NVIDIA's.
pub fn device_id_from_pci_id(value: u32) -> Result<u16, String> {
    let device = (value >> 16) as u16;
    let vendor = (value & 0xFFFF) as u16;
    if vendor == NVIDIA_VENDOR_ID {
        Ok(device)
    } else {
        Err(format!(
            "0x{value:08X} has vendor id 0x{vendor:04X}, not NVIDIA's 0x10DE; expected 0x<device id>10DE, \
             e.g. \"0x20B010DE\""
        ))
    }
}

const DEVICE_ID_EXPECTED: &str = "expected a PCI device id such as \"0x20B0\", or device and vendor id such as \
     \"0x20B010DE\", either perhaps followed by a subsystem id (\"0x25B610DE:0x14A910DE\"), or an integer";

/// Hex digits after `0x`, as a number of at most 32 bits, and how many digits there were.
fn hex_u32(text: &str) -> Option<(u32, usize)> {
    let hex = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .filter(|h| !h.is_empty() && h.len() <= 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))?;
    Some((u32::from_str_radix(hex, 16).ok()?, hex.len()))
}

/// A device id as the config accepts it: `"0x20B0"` (1 to 4 hex digits: the device id),
/// `"0x20B010DE"` (5 to 8 hex digits: device and NVIDIA's vendor id, mig-parted's form), either
/// perhaps followed by `:0x<subsystem device><subsystem vendor>` (8 hex digits at most, as
/// NVML's `pciSubSystemId`; mig-parted v0.15's subsystem filter).
pub fn parse_device_id(text: &str) -> Result<DeviceId, String> {
    let (primary, subsystem) = match text.split_once(':') {
        Some((p, s)) => (p, Some(s)),
        None => (text, None),
    };
    let (value, digits) = hex_u32(primary).ok_or_else(|| DEVICE_ID_EXPECTED.to_owned())?;
    let device = if digits <= 4 {
        value as u16
    } else {
        device_id_from_pci_id(value)?
    };
    let subsystem =
        match subsystem {
            None => None,
            Some(s) => Some(hex_u32(s).map(|(v, _)| v).ok_or_else(|| {
                format!("the subsystem id {s:?} is not 0x and 1 to 8 hex digits; {DEVICE_ID_EXPECTED}")
            })?),
        };
    Ok(DeviceId { device, subsystem })
}

/// A device id given as an integer: up to 0xFFFF the device id, above it mig-parted's 32-bit
/// device-and-vendor form.
fn device_id_from_int(value: i64) -> Result<DeviceId, String> {
    match u32::try_from(value) {
        Ok(v) if v <= 0xFFFF => Ok(DeviceId::from(v as u16)),
        Ok(v) => device_id_from_pci_id(v).map(DeviceId::from),
        Err(_) => Err(DEVICE_ID_EXPECTED.to_owned()),
    }
}

// === serde (the config's spelling) ===

impl Serialize for DeviceSelector {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DeviceSelector::All => s.serialize_str("all"),
            DeviceSelector::Indices(list) => list.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceSelector {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;

        impl<'de> Visitor<'de> for V {
            type Value = DeviceSelector;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"all\" or an array of GPU indices")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceSelector, E> {
                if v == "all" {
                    Ok(DeviceSelector::All)
                } else {
                    Err(E::custom("expected \"all\" or an array of GPU indices"))
                }
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DeviceSelector, A::Error> {
                let mut out = Vec::new();
                while let Some(i) = seq.next_element::<u32>()? {
                    out.push(i);
                }
                Ok(DeviceSelector::Indices(out))
            }
        }

        d.deserialize_any(V)
    }
}

/// One element of `device_filter`.
struct DeviceIdDe(DeviceId);

impl<'de> Deserialize<'de> for DeviceIdDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DeviceIdVisitor)
    }
}

struct DeviceIdVisitor;

impl<'de> Visitor<'de> for DeviceIdVisitor {
    type Value = DeviceIdDe;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(DEVICE_ID_EXPECTED.trim_start_matches("expected "))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceIdDe, E> {
        parse_device_id(v).map(DeviceIdDe).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<DeviceIdDe, E> {
        device_id_from_int(v).map(DeviceIdDe).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<DeviceIdDe, E> {
        let v = i64::try_from(v).map_err(|_| E::custom(DEVICE_ID_EXPECTED))?;
        self.visit_i64(v)
    }
}

/// `device_filter`: one device id or an array of them.
struct DeviceFilter(Vec<DeviceId>);

impl<'de> Deserialize<'de> for DeviceFilter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;

        impl<'de> Visitor<'de> for V {
            type Value = DeviceFilter;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a PCI device id such as \"0x20B0\" or an array of them")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceFilter, E> {
                DeviceIdVisitor.visit_str(v).map(|id| DeviceFilter(vec![id.0]))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DeviceFilter, E> {
                DeviceIdVisitor.visit_i64(v).map(|id| DeviceFilter(vec![id.0]))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DeviceFilter, E> {
                DeviceIdVisitor.visit_u64(v).map(|id| DeviceFilter(vec![id.0]))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DeviceFilter, A::Error> {
                let mut out = Vec::new();
                while let Some(DeviceIdDe(id)) = seq.next_element()? {
                    out.push(id);
                }
                Ok(DeviceFilter(out))
            }
        }

        d.deserialize_any(V)
    }
}

struct DeviceIds<'a>(&'a [DeviceId]);

impl Serialize for DeviceIds<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for id in self.0 {
            seq.serialize_element(&id.to_string())?;
        }
        seq.end()
    }
}

impl Serialize for LayoutEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("LayoutEntry", 4)?;
        st.serialize_field("devices", &self.devices)?;
        if self.device_filter.is_empty() {
            st.skip_field("device_filter")?;
        } else {
            st.serialize_field("device_filter", &DeviceIds(&self.device_filter))?;
        }
        st.serialize_field("mig_enabled", &self.mig_enabled)?;
        if self.mig_enabled || !self.profiles.is_empty() {
            st.serialize_field("profiles", &self.profiles)?;
        } else {
            st.skip_field("profiles")?;
        }
        st.end()
    }
}

const ENTRY_FIELDS: &[&str] = &["devices", "device_filter", "mig_enabled", "profiles"];

impl<'de> Deserialize<'de> for LayoutEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "snake_case")]
        enum Field {
            Devices,
            DeviceFilter,
            MigEnabled,
            Profiles,
        }

        struct V;

        impl<'de> Visitor<'de> for V {
            type Value = LayoutEntry;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a layout entry (a table with devices, device_filter, mig_enabled, profiles)")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LayoutEntry, A::Error> {
                let mut devices = None;
                let mut device_filter = None;
                let mut mig_enabled = None;
                let mut profiles = None;
                while let Some(key) = map.next_key()? {
                    let dup = |name| de::Error::duplicate_field(name);
                    match key {
                        Field::Devices if devices.is_some() => return Err(dup("devices")),
                        Field::Devices => devices = Some(map.next_value()?),
                        Field::DeviceFilter if device_filter.is_some() => return Err(dup("device_filter")),
                        Field::DeviceFilter => device_filter = Some(map.next_value::<DeviceFilter>()?.0),
                        Field::MigEnabled if mig_enabled.is_some() => return Err(dup("mig_enabled")),
                        Field::MigEnabled => mig_enabled = Some(map.next_value()?),
                        Field::Profiles if profiles.is_some() => return Err(dup("profiles")),
                        Field::Profiles => profiles = Some(map.next_value()?),
                    }
                }
                let devices = devices.ok_or_else(|| de::Error::missing_field("devices"))?;
                let mig_enabled = mig_enabled.ok_or_else(|| de::Error::missing_field("mig_enabled"))?;
                // mig-parted's rule: MIG on needs the devices spelled out, `{}` for none, so a
                // forgotten key does not silently mean "destroy every instance".
                if mig_enabled && profiles.is_none() {
                    return Err(de::Error::custom(
                        "missing field `profiles` (required when mig_enabled = true; {} for none)",
                    ));
                }
                Ok(LayoutEntry {
                    devices,
                    device_filter: device_filter.unwrap_or_default(),
                    mig_enabled,
                    profiles: profiles.unwrap_or_default(),
                    generated: None,
                })
            }
        }

        d.deserialize_struct("LayoutEntry", ENTRY_FIELDS, V)
    }
}

impl Serialize for MigLayout {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.entries.serialize(s)
    }
}

impl<'de> Deserialize<'de> for MigLayout {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;

        impl<'de> Visitor<'de> for V {
            type Value = MigLayout;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of layout entries, written [[mig.layouts.<name>]]")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MigLayout, A::Error> {
                let mut entries = Vec::new();
                while let Some(e) = seq.next_element()? {
                    entries.push(e);
                }
                Ok(MigLayout::new(entries))
            }
        }

        d.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(devices: DeviceSelector, filter: &[u16], enabled: bool, profiles: &[(&str, u32)]) -> LayoutEntry {
        LayoutEntry {
            devices,
            device_filter: filter.iter().map(|&d| d.into()).collect(),
            mig_enabled: enabled,
            profiles: profiles.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
            generated: None,
        }
    }

    #[test]
    fn profile_names_parse() {
        let p = parse_profile_name("1g.5gb").unwrap();
        assert_eq!((p.compute_slices, p.gpu_slices, p.memory_gb), (None, 1, 5));
        assert!(p.attrs.is_empty() && p.neg_attrs.is_empty());

        let p = parse_profile_name("1g.5gb+me").unwrap();
        assert_eq!(p.attrs, ["me"]);
        let p = parse_profile_name("1g.24gb-me").unwrap();
        assert_eq!(
            (p.attrs.len(), p.neg_attrs.as_slice()),
            (0, ["me".to_owned()].as_slice())
        );
        let p = parse_profile_name("1g.24gb+me.all").unwrap();
        assert_eq!(p.attrs, ["me.all"]);
        let p = parse_profile_name("4g.96gb+gfx,me").unwrap();
        assert_eq!(p.attrs, ["gfx", "me"]);

        let p = parse_profile_name("1c.4g.20gb").unwrap();
        assert_eq!((p.compute_slices, p.gpu_slices, p.memory_gb), (Some(1), 4, 20));
        assert_eq!(p.gpu_instance_name(), "4g.20gb");
        assert_eq!(p.to_string(), "1c.4g.20gb");
        let p = parse_profile_name("7g.80gb").unwrap();
        assert_eq!((p.gpu_slices, p.memory_gb), (7, 80));
        assert_eq!(parse_profile_name("7g.141gb").unwrap().memory_gb, 141);

        assert!(
            parse_profile_name("1g.5gb+gfx,me")
                .unwrap()
                .same_profile(&parse_profile_name("1g.5gb+me,gfx").unwrap())
        );
        assert!(
            !parse_profile_name("1g.5gb+me")
                .unwrap()
                .same_profile(&parse_profile_name("1g.5gb").unwrap())
        );
    }

    #[test]
    fn bad_profile_names() {
        for bad in [
            "",
            "1x.5gb",
            "g.5gb",
            "1g.5",
            "1g.5GB",
            "1g",
            "1g.5gb.",
            "0g.5gb",
            "01g.5gb",
            "1g.0gb",
            "-1g.5gb",
            "1g.5gb+",
            "1g.5gb+me,",
            "1g.5gb+me,me",
            "1g.5gb+me-gfx",
            "1g.5gb+ME",
            "1g.5gb+1x",
            "1g.5gb+me..all",
            "1c.1g.5gb",
            "2c.1g.5gb",
            "1c.2c.4g.20gb",
            " 1g.5gb",
            "1g.5gb ",
            "1d.4g.20gb",
            "1g.99999999999gb",
        ] {
            let e = parse_profile_name(bad).expect_err(bad);
            assert!(matches!(e, LayoutError::ProfileName { .. }), "{bad:?}: {e}");
        }
        let e = parse_profile_name("1x.5gb").unwrap_err().to_string();
        assert!(
            e.starts_with("\"1x.5gb\" is not a MIG profile name: \"1x\" does not end in \"g\""),
            "{e}"
        );
        let e = parse_profile_name("4c.4g.20gb").unwrap_err().to_string();
        assert!(e.contains("written without \"4c.\""), "{e}");
    }

    #[test]
    fn entries_for_matches_devices_and_filter() {
        let layout = MigLayout::new(vec![
            entry(DeviceSelector::Indices(vec![0, 1]), &[], true, &[("1g.5gb", 7)]),
            entry(DeviceSelector::Indices(vec![3]), &[0x20B0], false, &[]),
        ]);
        layout.check().unwrap();
        // By index, any model.
        assert_eq!(layout.entries_for(0, 0x20B0.into()), [&layout.entries[0]]);
        assert_eq!(layout.entries_for(1, 0x1234.into()), [&layout.entries[0]]);
        assert!(layout.entries_for(2, 0x20B0.into()).is_empty());
        // Index and filter both needed.
        assert_eq!(layout.entries_for(3, 0x20B0.into()), [&layout.entries[1]]);
        assert!(layout.entries_for(3, 0x20B5.into()).is_empty());
        assert_eq!(layout.entry_for(3, 0x20B5.into()), None);

        // `all` restricted by the filter: one entry per model.
        let per_model = MigLayout::new(vec![
            entry(DeviceSelector::All, &[0x20B2, 0x2330], true, &[("1g.10gb", 7)]),
            entry(DeviceSelector::All, &[0x20B0], true, &[("1g.10gb", 4)]),
        ]);
        per_model.check().unwrap();
        assert_eq!(per_model.entries_for(5, 0x2330.into()), [&per_model.entries[0]]);
        assert_eq!(per_model.entries_for(2, 0x20B2.into()), [&per_model.entries[0]]);
        assert_eq!(per_model.entries_for(2, 0x20B0.into()), [&per_model.entries[1]]);
        assert!(per_model.entries_for(2, 0x20B5.into()).is_empty());

        let all = MigLayout::new(vec![entry(DeviceSelector::All, &[], false, &[])]);
        assert_eq!(all.entries_for(7, 0xFFFF.into()).len(), 1);
    }

    #[test]
    fn overlapping_entries_the_last_wins_with_a_warning() {
        // GPU 0 with device 0x20B2 is matched by both; same state is fine.
        let same = MigLayout::new(vec![
            entry(DeviceSelector::All, &[0x20B2], true, &[("1g.10gb", 7)]),
            entry(DeviceSelector::Indices(vec![0]), &[], true, &[("1g.10gb", 7)]),
        ]);
        same.check().unwrap();
        assert!(same.overrides().is_empty());
        assert_eq!(same.entries_for(0, 0x20B2.into()).len(), 2);
        assert_eq!(same.entry_for(0, 0x20B2.into()), Some(&same.entries[1]));

        // "devices: all, then an override for [0]": accepted, the last entry wins, and it says so.
        let conflict = MigLayout::new(vec![
            entry(DeviceSelector::All, &[0x20B2], true, &[("1g.10gb", 7)]),
            entry(DeviceSelector::Indices(vec![0]), &[], false, &[]),
        ]);
        conflict.check().unwrap();
        assert_eq!(conflict.entry_for(0, 0x20B2.into()), Some(&conflict.entries[1]));
        assert_eq!(conflict.entry_for(1, 0x20B2.into()), Some(&conflict.entries[0]));
        assert_eq!(
            conflict.overrides(),
            ["entry 1 overrides entry 0 on the GPUs both select (the last entry wins, as in mig-parted)"]
        );

        // An index entry without a filter can meet an `all` entry with one.
        let meets = MigLayout::new(vec![
            entry(DeviceSelector::All, &[0x20B0], true, &[("1g.10gb", 4)]),
            entry(DeviceSelector::All, &[0x20B2], true, &[("1g.10gb", 7)]),
            entry(DeviceSelector::Indices(vec![1]), &[], false, &[]),
            entry(DeviceSelector::Indices(vec![2]), &[], true, &[]),
        ]);
        assert_eq!(meets.overrides().len(), 4, "{:?}", meets.overrides());
        // Disjoint indices, or the same index with disjoint filters, never conflict.
        let disjoint = MigLayout::new(vec![
            entry(DeviceSelector::Indices(vec![1]), &[], false, &[]),
            entry(DeviceSelector::Indices(vec![2]), &[], true, &[]),
            entry(DeviceSelector::Indices(vec![3]), &[0x20B0], true, &[("1g.10gb", 4)]),
            entry(DeviceSelector::Indices(vec![3]), &[0x20B2], true, &[("1g.10gb", 7)]),
        ]);
        assert!(disjoint.overrides().is_empty());
    }

    #[test]
    fn check_rules() {
        assert_eq!(MigLayout::default().check(), Err(LayoutError::NoEntries));
        let one = |e: LayoutEntry| MigLayout::new(vec![e]).check().unwrap_err();
        let e = one(entry(DeviceSelector::Indices(vec![]), &[], false, &[]));
        assert!(e.to_string().starts_with("entry 0, devices: an empty list"), "{e}");
        let e = one(entry(DeviceSelector::Indices(vec![0, 1, 0]), &[], false, &[]));
        assert_eq!(e.to_string(), "entry 0, devices[2]: GPU 0 is listed twice");
        let e = one(entry(DeviceSelector::All, &[0x20B0, 0x20B0], false, &[]));
        assert_eq!(
            e.to_string(),
            "entry 0, device_filter[1]: device id 0x20B0 is listed twice"
        );
        let e = one(entry(DeviceSelector::All, &[], false, &[("1g.5gb", 1)]));
        assert!(
            e.to_string()
                .starts_with("entry 0, profiles: MIG devices need MIG enabled"),
            "{e}"
        );
        let e = one(entry(DeviceSelector::All, &[], true, &[("1g.5gb", 0)]));
        assert!(
            e.to_string()
                .starts_with("entry 0, profiles[\"1g.5gb\"]: expected a count"),
            "{e}"
        );
        let e = one(entry(DeviceSelector::All, &[], true, &[("1x.5gb", 1)]));
        assert!(
            e.to_string()
                .starts_with("entry 0, profiles[\"1x.5gb\"]: \"1x.5gb\" is not a MIG profile name"),
            "{e}"
        );
        let e = one(entry(
            DeviceSelector::All,
            &[],
            true,
            &[("1g.5gb+me,gfx", 1), ("1g.5gb+gfx,me", 1)],
        ));
        assert!(
            e.to_string().contains("names the same profile as \"1g.5gb+gfx,me\""),
            "{e}"
        );
        // MIG on with no instances is a layout (all-enabled).
        MigLayout::new(vec![entry(DeviceSelector::All, &[], true, &[])])
            .check()
            .unwrap();
    }

    #[test]
    fn device_ids() {
        let id = |device| Ok(DeviceId::from(device));
        assert_eq!(parse_device_id("0x20B0"), id(0x20B0));
        assert_eq!(parse_device_id("0x20b0"), id(0x20B0));
        assert_eq!(parse_device_id("0X20B010DE"), id(0x20B0));
        assert_eq!(parse_device_id("0x233010de"), id(0x2330));
        let a16 = DeviceId {
            device: 0x25B6,
            subsystem: Some(0x14A9_10DE),
        };
        assert_eq!(parse_device_id("0x25B610DE:0x14A910DE"), Ok(a16));
        assert_eq!(parse_device_id("0x25B6:0x14a910de"), Ok(a16));
        for bad in [
            "20B0",
            "0x",
            "0xG0",
            "0x20B010DE0",
            "0x20B01002",
            "0x20B010DE:",
            "0x20B010DE:134F10DE",
            "0x20B010DE:0x134F10DE0",
            "0x20B010DE:0x1:0x2",
            "",
        ] {
            assert!(parse_device_id(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_device_id("0x20B01002").unwrap_err().contains("vendor id 0x1002"));
        assert_eq!(device_id_from_int(0x20B0), id(0x20B0));
        assert_eq!(device_id_from_int(0x20B010DE), id(0x20B0));
        assert!(device_id_from_int(-1).is_err());
        assert!(device_id_from_int(0x1_0000_0000).is_err());
        assert_eq!(format_device_id(0x20B0), "0x20B0");
        assert_eq!(format_device_id(0x0A), "0x000A");
        assert_eq!(a16.to_string(), "0x25B6:0x14A910DE");
        assert_eq!(a16.to_mig_parted(), "0x25B610DE:0x14A910DE");
        assert_eq!(DeviceId::from(0x20B0).to_mig_parted(), "0x20B010DE");
    }

    /// mig-parted's `DeviceID.Matches`: a filter without a subsystem matches every board of the
    /// device id; one with a subsystem only that board, and not a GPU whose subsystem NVML
    /// reports as 0 (unknown), unless the filter says 0.
    #[test]
    fn subsystem_filters_match_as_mig_parted_does() {
        let a16 = GpuPciIds {
            device: 0x25B6,
            subsystem: 0x14A9_10DE,
        };
        let a2 = GpuPciIds {
            device: 0x25B6,
            subsystem: 0x157E_10DE,
        };
        let unknown = GpuPciIds {
            device: 0x25B6,
            subsystem: 0,
        };
        let only_a16 = parse_device_id("0x25B610DE:0x14A910DE").unwrap();
        let any = parse_device_id("0x25B610DE").unwrap();
        let zero = parse_device_id("0x25B610DE:0x0").unwrap();
        assert!(any.matches(a16) && any.matches(a2) && any.matches(unknown));
        assert!(only_a16.matches(a16) && !only_a16.matches(a2) && !only_a16.matches(unknown));
        assert!(zero.matches(unknown) && !zero.matches(a16));
        assert!(!parse_device_id("0x1E30").unwrap().matches(a16));

        // Entries for two boards of one device id do not overlap; a bare id overlaps both.
        let entry = |filter: &[DeviceId], n| LayoutEntry {
            devices: DeviceSelector::All,
            device_filter: filter.to_vec(),
            mig_enabled: true,
            profiles: BTreeMap::from([("1g.6gb".to_owned(), n)]),
            generated: None,
        };
        let other = parse_device_id("0x25B610DE:0x157E10DE").unwrap();
        let layout = MigLayout::new(vec![entry(&[only_a16], 1), entry(&[other], 2)]);
        assert!(layout.overrides().is_empty(), "{:?}", layout.overrides());
        assert_eq!(layout.entry_for(0, a16).unwrap().profiles["1g.6gb"], 1);
        assert_eq!(layout.entry_for(0, a2).unwrap().profiles["1g.6gb"], 2);
        assert!(layout.entry_for(0, unknown).is_none());
        let layout = MigLayout::new(vec![entry(&[only_a16], 1), entry(&[any], 2)]);
        assert_eq!(layout.overrides().len(), 1);
    }
}
