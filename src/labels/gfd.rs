//! The GPU Feature Discovery labels of the node, from the NVML inventory (pure).
//!
//! Keys and value formats are NVIDIA GFD's (`k8s-device-plugin` `internal/lm`), so node
//! selectors written for GFD keep matching. Every key is `<prefix><name>`; with the usual
//! prefix `nvidia.com/`:
//!
//! | key | value |
//! |---|---|
//! | `gpu.present` | `true`, or `false` when NVML sees no GPU (then it is the only label) |
//! | `gpu.machine` | DMI product name, sanitised; `unknown` when not given or nothing is left |
//! | `gpu.mode` | the GPUs' PCI class in sysfs: `compute` when every GPU is a 3D controller (`0x030200`), `graphics` when every one is a VGA controller (`0x030000`), else `unknown` (mixed classes, another class, or a class that cannot be read) |
//! | `vgpu.present` | `true` when an NVIDIA PCI function carries NVIDIA's vGPU capability (a vGPU guest: the vendor-specific capability in its config space has the `VF` signature), else `false` |
//! | `gpu.clique` | `<cluster UUID>.<clique id>` from NVML's fabric info, over the GPUs attached to a fabric (state completed, status success, cluster UUID not all zeros); absent when none is attached or the attached ones differ in cluster UUID or clique id |
//! | `cuda.driver-version.{major,minor,revision,full}`, `cuda.driver.{major,minor,rev}` | the driver version split on `.` (`550.54.15` → `550`, `54`, `15`); `revision`/`rev` empty for `X.Y`; all absent unless the version has 2 or 3 parts |
//! | `cuda.runtime-version.{major,minor,full}`, `cuda.runtime.{major,minor}` | CUDA driver API version `12.4` → `12`, `4`, `12.4`; absent unless it parses |
//! | `mig.capable` | `true` if any GPU supports MIG |
//! | `mps.capable` | `true` when the sharing strategy is `mps` and no GPU has MIG enabled |
//! | `mig.strategy` | `single` / `mixed`; absent for `none` |
//! | `gpu.{product,count,replicas,sharing-strategy,memory,family,compute.major,compute.minor}` | the whole GPUs, see below |
//! | under `single`: `gpu.{multiprocessors,slices.gi,slices.ci,engines.copy,engines.decoder,engines.encoder,engines.jpeg,engines.ofa}` | the MIG devices' attributes |
//! | under `mixed`: `mig-<profile>.{product,count,replicas,sharing-strategy,memory,multiprocessors,slices.gi,slices.ci,engines.*}` | one set per MIG profile present |
//!
//! Whole GPUs (every strategy), as GFD does it:
//! - GPUs are grouped by NVML name. A group with a MIG-disabled GPU wins over one whose GPUs
//!   all have MIG enabled; among those, the group of the lowest-index GPU wins. (GFD picks among
//!   names in Go map order, so its choice on a node with different models is random; here it is
//!   the first GPU's.) `gpu.count` is the number of GPUs with the winning name, MIG or not.
//! - When the winning GPUs have MIG enabled, sharing does not apply: `gpu.replicas` is `0`,
//!   `gpu.sharing-strategy` is `none`, and the product has no `-SHARED`.
//! - `gpu.memory` is the GPU's memory in MiB, absent when 0; `gpu.family` and
//!   `gpu.compute.{major,minor}` come from the compute capability and are absent without one.
//!
//! Sharing is per resource, as GFD looks each one up in the sharing config by its unrenamed
//! name: `gpu` (whole GPUs, and the MIG devices under `single`) or `mig-<profile>` (`mixed`).
//! `replicas > 1` means shared. A shared resource has `replicas` = the count,
//! `sharing-strategy` = the given strategy, and `-SHARED` after the product unless the resource
//! is renamed (`<name>.shared`, whose labels keep the unrenamed keys). A resource not shared, or
//! with `replicas` of 0 or 1, is labelled `1` with strategy `none`.
//!
//! MIG `single` (labels over the whole-GPU ones): nothing more when no GPU has MIG enabled.
//! When MIG is enabled on some GPUs but not all, or a MIG-enabled GPU has no MIG devices, or
//! there is more than one profile, the configuration is invalid: `gpu.product` is
//! `<product>-MIG-INVALID` (first MIG-enabled GPU), `gpu.count`, `gpu.replicas` and
//! `gpu.memory` are `0`, the rest stay. Otherwise `gpu.product` is `<product>-MIG-<profile>`,
//! `gpu.count` the number of MIG devices, `gpu.memory` the MIG device's memory and the attribute
//! labels are added (from the first MIG device).
//!
//! MIG `mixed`: one label set per profile, from its first MIG device (GPU order, then MIG slot);
//! GPUs with MIG enabled but no MIG devices are ignored. No family/compute labels for MIG
//! resources (GFD has none).
//!
//! Profiles are written as GFD writes them, `+` as `.` (`1g.5gb+me` → `mig-1g.5gb.me`), the same
//! as the device plugin's resource names. Without MIG attributes from NVML, the memory labels
//! use the MIG device's memory and the other attribute labels are left out (GFD would fail).
//!
//! Values are sanitised as GFD does (characters other than `[A-Za-z0-9-_. ]` dropped, runs of
//! spaces → `-`): `NVIDIA TITAN X (Pascal)` → `NVIDIA-TITAN-X-Pascal`. Where GFD's value would
//! still be refused by the API server (over 63 characters, or not alphanumeric at both ends) it
//! is cut to 63 and trimmed to alphanumerics at both ends, so every value here is valid; GFD's
//! label would have been rejected, so no selector can depend on it. A label whose key would be
//! invalid is left out.
//!
//! `gpu.mode`, `vgpu.present` and `gpu.clique` follow GFD's `internal/lm` (`newGPUModeLabeler`,
//! the vGPU labeler, `newImexLabeler`): GFD also writes `unknown` when a class cannot be read and
//! `false` when the vGPU scan fails, and skips GPUs not attached to a fabric.
//!
//! Not produced: `vgpu.host-driver-{version,branch}` (from the vGPU capability's records),
//! `gpu.imex-domain`, and `gfd.timestamp` (it would change the Node on every pass).

use std::collections::BTreeMap;

use crate::config::MigStrategy;
use crate::nvml::{GpuInfo, Inventory, MigAttributes, MigDeviceInfo};

/// Everything the GFD labels are computed from.
pub struct FeatureInputs<'a> {
    pub inventory: &'a Inventory,
    pub mig_strategy: MigStrategy,
    /// Label key prefix, e.g. `nvidia.com/`.
    pub prefix: &'a str,
    /// DMI product name as read from `/sys/class/dmi/id/product_name` (raw; sanitised here).
    pub machine: Option<&'a str>,
    /// A vGPU guest: some NVIDIA PCI function has the vGPU capability ([`super::vgpu`]).
    pub vgpu: bool,
    /// `none` | `time-slicing` | `mps`.
    pub sharing_strategy: &'a str,
    /// The shared resources by name after `nvidia.com/` (`gpu`, `mig-1g.5gb`); a resource not
    /// in it is not shared.
    pub shared: &'a BTreeMap<String, ResourceSharing>,
}

/// How one resource is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceSharing {
    /// Replicas per device; 1 = not shared.
    pub replicas: u32,
    /// Advertised under another name (`<name>.shared`): no `-SHARED` product suffix then.
    pub renamed: bool,
}

/// No resource is shared.
pub static NOT_SHARED: BTreeMap<String, ResourceSharing> = BTreeMap::new();

/// The GFD labels for the inventory: the complete set this module owns, so a key that was
/// produced before and is not now should be removed from the Node.
pub fn feature_labels(inputs: &FeatureInputs) -> BTreeMap<String, String> {
    let inventory = inputs.inventory;
    let mut out = Labels::default();
    if inventory.gpus.is_empty() {
        out.set("gpu.present", "false");
        return out.finish(inputs.prefix);
    }
    out.set("gpu.present", "true");
    out.set("gpu.machine", machine_value(inputs.machine));
    out.set("gpu.mode", gpu_mode(&inventory.gpus));
    out.set("vgpu.present", bool_value(inputs.vgpu));
    if let Some(clique) = clique(&inventory.gpus) {
        out.set("gpu.clique", clique);
    }
    version_labels(&mut out, inventory);
    let mig_enabled = inventory.gpus.iter().any(mig_on);
    out.set(
        "mig.capable",
        bool_value(inventory.gpus.iter().any(|g| g.mig.is_some())),
    );
    out.set(
        "mps.capable",
        bool_value(inputs.sharing_strategy == "mps" && !mig_enabled),
    );
    let sharing = Sharing {
        strategy: inputs.sharing_strategy,
        resources: inputs.shared,
    };
    whole_gpu_labels(&mut out, &inventory.gpus, &sharing);
    match inputs.mig_strategy {
        MigStrategy::None => {}
        MigStrategy::Single => {
            out.set("mig.strategy", "single");
            single_labels(&mut out, &inventory.gpus, &sharing);
        }
        MigStrategy::Mixed => {
            out.set("mig.strategy", "mixed");
            mixed_labels(&mut out, &inventory.gpus, &sharing);
        }
    }
    out.finish(inputs.prefix)
}

/// GFD's architecture family for a CUDA compute capability.
pub fn gpu_family(major: i32, minor: i32) -> &'static str {
    match major {
        1 => "tesla",
        2 => "fermi",
        3 => "kepler",
        5 => "maxwell",
        6 => "pascal",
        7 if minor < 5 => "volta",
        7 => "turing",
        8 if minor < 9 => "ampere",
        8 => "ada-lovelace",
        9 => "hopper",
        10 | 12 => "blackwell",
        13 => "rubin",
        _ => "undefined",
    }
}

/// Labels by name (without the prefix) while they are built.
#[derive(Default)]
struct Labels(BTreeMap<String, String>);

impl Labels {
    fn set(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.0.insert(name.into(), value.into());
    }

    /// Prefixes the keys and leaves out any label the API server would refuse.
    fn finish(self, prefix: &str) -> BTreeMap<String, String> {
        self.0
            .into_iter()
            .map(|(name, value)| (format!("{prefix}{name}"), value))
            .filter(|(key, value)| valid_key(key) && valid_value(value))
            .collect()
    }
}

/// The sharing settings of the advertised resources.
struct Sharing<'a> {
    strategy: &'a str,
    resources: &'a BTreeMap<String, ResourceSharing>,
}

impl Sharing<'_> {
    /// How `resource` (`gpu`, `mig-<profile>`) is shared; not at all when not listed.
    fn of(&self, resource: &str) -> ResourceSharing {
        self.resources.get(resource).copied().unwrap_or(ResourceSharing {
            replicas: 1,
            renamed: false,
        })
    }
}

fn mig_on(gpu: &GpuInfo) -> bool {
    gpu.mig.is_some_and(|m| m.current)
}

fn bool_value(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

/// PCI class codes: VGA-compatible controller and 3D controller.
const CLASS_VGA: u32 = 0x03_00_00;
const CLASS_3D: u32 = 0x03_02_00;

fn gpu_mode(gpus: &[GpuInfo]) -> &'static str {
    let first = gpus.first().and_then(|g| g.pci_class);
    if first.is_none() || gpus.iter().any(|g| g.pci_class != first) {
        return "unknown";
    }
    match first {
        Some(CLASS_3D) => "compute",
        Some(CLASS_VGA) => "graphics",
        _ => "unknown",
    }
}

/// `<cluster UUID>.<clique id>` when the GPUs attached to a fabric agree on both.
fn clique(gpus: &[GpuInfo]) -> Option<String> {
    let mut attached = gpus.iter().filter_map(|g| g.fabric.as_ref()).filter(|f| f.attached());
    let first = attached.next()?;
    if attached.any(|f| f.cluster_uuid != first.cluster_uuid || f.clique_id != first.clique_id) {
        tracing::warn!("GPUs report different fabric cluster UUIDs or clique ids: no gpu.clique label");
        return None;
    }
    Some(format!("{}.{}", first.cluster_uuid, first.clique_id))
}

fn machine_value(raw: Option<&str>) -> String {
    let value = raw.map(|m| label_value(&sanitise(m))).unwrap_or_default();
    if value.is_empty() { "unknown".into() } else { value }
}

fn version_labels(out: &mut Labels, inventory: &Inventory) {
    let driver = inventory.driver_version.trim();
    let parts: Vec<&str> = driver.split('.').collect();
    if (2..=3).contains(&parts.len()) {
        let major = label_value(parts[0]);
        let minor = label_value(parts[1]);
        let revision = parts.get(2).map(|r| label_value(r)).unwrap_or_default();
        for (new, old, value) in [
            ("major", "major", &major),
            ("minor", "minor", &minor),
            ("revision", "rev", &revision),
        ] {
            out.set(format!("cuda.driver-version.{new}"), value.clone());
            out.set(format!("cuda.driver.{old}"), value.clone());
        }
        out.set("cuda.driver-version.full", label_value(driver));
    }
    let cuda = inventory.cuda_driver_version.trim();
    if let Some((major, minor)) = cuda.split_once('.')
        && let (Ok(major), Ok(minor)) = (major.parse::<u32>(), minor.parse::<u32>())
    {
        for (name, value) in [("major", major), ("minor", minor)] {
            out.set(format!("cuda.runtime-version.{name}"), value.to_string());
            out.set(format!("cuda.runtime.{name}"), value.to_string());
        }
        out.set("cuda.runtime-version.full", format!("{major}.{minor}"));
    }
}

/// The labels GFD writes for one resource (`gpu` or `mig-<profile>`): product, count, replicas
/// and sharing strategy. `sharing` is `None` where sharing does not apply (MIG-enabled GPUs).
fn resource_labels(out: &mut Labels, resource: &str, sharing: Option<&Sharing>, count: usize, parts: &[&str]) {
    let this = sharing.map(|s| s.of(resource));
    let shared = this.is_some_and(|r| r.replicas > 1);
    let replicas = this.map_or(0, |r| r.replicas.max(1));
    let strategy = match sharing {
        Some(s) if shared => label_value(&sanitise(s.strategy)),
        _ => "none".to_string(),
    };
    out.set(
        format!("{resource}.product"),
        product(parts, shared && this.is_some_and(|r| !r.renamed)),
    );
    out.set(format!("{resource}.count"), count.to_string());
    out.set(format!("{resource}.replicas"), replicas.to_string());
    out.set(format!("{resource}.sharing-strategy"), strategy);
}

/// The sanitised parts joined with `-`, and `-SHARED` after them when `shared_suffix`.
fn product(parts: &[&str], shared_suffix: bool) -> String {
    let mut words: Vec<String> = parts.iter().map(|p| sanitise(p)).filter(|p| !p.is_empty()).collect();
    if !words.is_empty() && shared_suffix {
        words.push("SHARED".into());
    }
    label_value(&words.join("-"))
}

fn whole_gpu_labels(out: &mut Labels, gpus: &[GpuInfo], sharing: &Sharing) {
    let Some(first) = gpus.iter().find(|g| !mig_on(g)).or_else(|| gpus.first()) else {
        return;
    };
    let sharing = (!mig_on(first)).then_some(sharing);
    let count = gpus.iter().filter(|g| g.name == first.name).count();
    resource_labels(out, "gpu", sharing, count, &[&first.name]);
    if first.memory_mib != 0 {
        out.set("gpu.memory", first.memory_mib.to_string());
    }
    if let Some((major, minor)) = first.compute_capability
        && major != 0
    {
        out.set("gpu.family", gpu_family(major, minor));
        out.set("gpu.compute.major", major.to_string());
        out.set("gpu.compute.minor", minor.to_string());
    }
}

/// A MIG profile as GFD names it: NVML's profile with `+` as `.`, and nothing a label key cannot
/// hold.
fn profile_name(profile: &str) -> String {
    profile
        .replace('+', ".")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect()
}

/// The MIG devices of the GPUs by profile, each with its first device, that device's GPU and the
/// number of devices, in order of first appearance.
fn mig_profiles(gpus: &[GpuInfo]) -> Vec<(String, &GpuInfo, &MigDeviceInfo, usize)> {
    let mut profiles: Vec<(String, &GpuInfo, &MigDeviceInfo, usize)> = Vec::new();
    for gpu in gpus.iter().filter(|g| mig_on(g)) {
        for mig in &gpu.mig_devices {
            let name = profile_name(&mig.profile);
            match profiles.iter_mut().find(|p| p.0 == name) {
                Some(p) => p.3 += 1,
                None => profiles.push((name, gpu, mig, 1)),
            }
        }
    }
    profiles
}

fn mig_resource_labels(
    out: &mut Labels,
    resource: &str,
    sharing: &Sharing,
    gpu: &GpuInfo,
    mig: &MigDeviceInfo,
    profile: &str,
    count: usize,
) {
    resource_labels(out, resource, Some(sharing), count, &[&gpu.name, "MIG", profile]);
    match &mig.attributes {
        Some(a) => attribute_labels(out, resource, a),
        None => out.set(format!("{resource}.memory"), mig.memory_mib.to_string()),
    }
}

fn attribute_labels(out: &mut Labels, resource: &str, a: &MigAttributes) {
    let values = [
        ("memory", a.memory_mib),
        ("multiprocessors", a.multiprocessors.into()),
        ("slices.gi", a.gpu_instance_slices.into()),
        ("slices.ci", a.compute_instance_slices.into()),
        ("engines.copy", a.copy_engines.into()),
        ("engines.decoder", a.decoders.into()),
        ("engines.encoder", a.encoders.into()),
        ("engines.jpeg", a.jpeg.into()),
        ("engines.ofa", a.ofa.into()),
    ];
    for (name, value) in values {
        out.set(format!("{resource}.{name}"), value.to_string());
    }
}

fn single_labels(out: &mut Labels, gpus: &[GpuInfo], sharing: &Sharing) {
    let Some(first_on) = gpus.iter().find(|g| mig_on(g)) else {
        return;
    };
    let profiles = mig_profiles(gpus);
    let invalid = gpus.iter().any(|g| mig_on(g) && g.mig_devices.is_empty())
        || gpus.iter().any(|g| !mig_on(g))
        || profiles.len() != 1;
    if invalid {
        // GFD's invalid set: the sharing strategy and architecture stay from the whole GPUs.
        out.set("gpu.product", product(&[&first_on.name, "MIG", "INVALID"], false));
        for name in ["count", "replicas", "memory"] {
            out.set(format!("gpu.{name}"), "0");
        }
        return;
    }
    let (profile, gpu, mig, count) = &profiles[0];
    mig_resource_labels(out, "gpu", sharing, gpu, mig, profile, *count);
}

fn mixed_labels(out: &mut Labels, gpus: &[GpuInfo], sharing: &Sharing) {
    for (profile, gpu, mig, count) in mig_profiles(gpus) {
        mig_resource_labels(out, &format!("mig-{profile}"), sharing, gpu, mig, &profile, count);
    }
}

/// GFD's sanitising: characters other than `[A-Za-z0-9-_. ]` dropped, runs of spaces as one
/// `-`, none at the ends.
fn sanitise(raw: &str) -> String {
    let kept: String = raw
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .collect();
    kept.split(' ').filter(|w| !w.is_empty()).collect::<Vec<_>>().join("-")
}

/// A value the API server accepts: label characters only, at most 63 of them, alphanumeric at
/// both ends (or empty).
fn label_value(raw: &str) -> String {
    let kept: String = raw
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    let start = kept.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
    let cut = &start[..start.len().min(MAX_LABEL_VALUE)];
    cut.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_string()
}

const MAX_LABEL_VALUE: usize = 63;

fn label_segment(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL_VALUE
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn valid_value(value: &str) -> bool {
    value.is_empty() || label_segment(value)
}

/// `[prefix/]name`: the prefix a DNS subdomain of at most 253 characters, the name a segment.
fn valid_key(key: &str) -> bool {
    let (prefix, name) = key.rsplit_once('/').map_or((None, key), |(p, n)| (Some(p), n));
    let prefix_ok = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|part| {
                let b = part.as_bytes();
                !b.is_empty()
                    && b.len() <= 63
                    && b[0].is_ascii_alphanumeric()
                    && b[b.len() - 1].is_ascii_alphanumeric()
                    && b.iter()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            })
    });
    prefix_ok && label_segment(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::sample::{self, inventory};

    const A100: &str = "NVIDIA A100-SXM4-40GB";
    const H100: &str = "NVIDIA H100 80GB HBM3";

    fn gpu(index: u32, name: &str, memory_mib: u64, cc: (i32, i32), mig: Option<bool>) -> GpuInfo {
        GpuInfo {
            name: name.into(),
            memory_mib,
            compute_capability: Some(cc),
            mig: mig.map(sample::mig),
            ..sample::a100(index)
        }
    }

    fn a100(index: u32, mig: Option<bool>) -> GpuInfo {
        gpu(index, A100, 40960, (8, 0), mig)
    }

    fn h100(index: u32) -> GpuInfo {
        gpu(index, H100, 81559, (9, 0), Some(true))
    }

    /// Attributes as in the hardware tables: (SM, GI slices, CI slices, CE, DEC, ENC, JPEG, OFA, MiB).
    fn attributes(profile: &str) -> MigAttributes {
        let (multiprocessors, gi, ci, copy, dec, enc, jpeg, ofa, memory_mib) = match profile {
            "1g.5gb" => (14, 1, 1, 1, 0, 0, 0, 0, 4864),
            "1g.5gb+me" => (14, 1, 1, 1, 1, 0, 1, 1, 4864),
            "2g.10gb" => (28, 2, 2, 2, 1, 0, 0, 0, 9856),
            "3g.20gb" => (42, 3, 3, 3, 2, 0, 0, 0, 19968),
            "1g.10gb" => (16, 1, 1, 1, 1, 0, 1, 0, 9984),
            "2g.20gb" => (32, 2, 2, 2, 2, 0, 2, 0, 20096),
            "3g.40gb" => (60, 3, 3, 3, 3, 0, 3, 0, 40448),
            other => panic!("no attributes for {other}"),
        };
        MigAttributes {
            multiprocessors,
            gpu_instance_slices: gi,
            compute_instance_slices: ci,
            copy_engines: copy,
            decoders: dec,
            encoders: enc,
            jpeg,
            ofa,
            memory_mib,
        }
    }

    fn with_migs(mut gpu: GpuInfo, profiles: &[&str]) -> GpuInfo {
        gpu.mig_devices = sample::mig_devices(gpu.index, profiles)
            .into_iter()
            .map(|d| {
                let attributes = attributes(&d.profile);
                MigDeviceInfo {
                    memory_mib: attributes.memory_mib,
                    attributes: Some(attributes),
                    ..d
                }
            })
            .collect();
        gpu
    }

    fn inputs(inventory: &Inventory, mig_strategy: MigStrategy) -> FeatureInputs<'_> {
        FeatureInputs {
            inventory,
            mig_strategy,
            prefix: "nvidia.com/",
            machine: None,
            vgpu: false,
            sharing_strategy: "none",
            shared: &NOT_SHARED,
        }
    }

    fn shared(list: &[(&str, u32, bool)]) -> BTreeMap<String, ResourceSharing> {
        list.iter()
            .map(|&(name, replicas, renamed)| (name.to_string(), ResourceSharing { replicas, renamed }))
            .collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("nvidia.com/{k}"), v.to_string()))
            .collect()
    }

    /// The labels every node with GPUs has, for driver 550.54.15 and CUDA 12.4.
    fn common(machine: &str, mig_capable: &str) -> Vec<(&'static str, String)> {
        vec![
            ("gpu.present", "true".into()),
            ("gpu.machine", machine.into()),
            ("gpu.mode", "compute".into()),
            ("vgpu.present", "false".into()),
            ("cuda.driver-version.major", "550".into()),
            ("cuda.driver-version.minor", "54".into()),
            ("cuda.driver-version.revision", "15".into()),
            ("cuda.driver-version.full", "550.54.15".into()),
            ("cuda.driver.major", "550".into()),
            ("cuda.driver.minor", "54".into()),
            ("cuda.driver.rev", "15".into()),
            ("cuda.runtime-version.major", "12".into()),
            ("cuda.runtime-version.minor", "4".into()),
            ("cuda.runtime-version.full", "12.4".into()),
            ("cuda.runtime.major", "12".into()),
            ("cuda.runtime.minor", "4".into()),
            ("mig.capable", mig_capable.into()),
            ("mps.capable", "false".into()),
        ]
    }

    fn expected(common: Vec<(&str, String)>, rest: &[(&str, &str)]) -> BTreeMap<String, String> {
        let mut all = labels(rest);
        for (k, v) in common {
            all.insert(format!("nvidia.com/{k}"), v);
        }
        all
    }

    fn get<'a>(labels: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
        labels.get(&format!("nvidia.com/{name}")).map(String::as_str)
    }

    fn assert_all_valid(labels: &BTreeMap<String, String>) {
        for (key, value) in labels {
            assert!(valid_key(key), "invalid key {key:?}");
            assert!(valid_value(value), "invalid value {value:?} for {key}");
            // And independently: `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?` or empty, at most 63.
            let name = key.strip_prefix("nvidia.com/").expect("prefix");
            for (what, s) in [("name", name), ("value", value.as_str())] {
                let inner = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
                let ends = s.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && s.ends_with(|c: char| c.is_ascii_alphanumeric());
                let ok = s.len() <= 63 && s.chars().all(inner) && (ends || (what == "value" && s.is_empty()));
                assert!(ok, "{what} {s:?} of {key}");
            }
        }
    }

    fn a100_none() -> Inventory {
        inventory((0..8).map(|i| a100(i, Some(false))).collect())
    }

    fn h100_mixed() -> Inventory {
        inventory(vec![
            with_migs(h100(0), &["2g.20gb", "2g.20gb", "3g.40gb"]),
            with_migs(h100(1), &["1g.10gb"; 7]),
        ])
    }

    fn a100_single() -> Inventory {
        inventory(vec![
            with_migs(a100(0, Some(true)), &["1g.5gb"; 7]),
            with_migs(a100(1, Some(true)), &["1g.5gb"; 7]),
        ])
    }

    #[test]
    fn eight_a100s_without_mig() {
        let inv = a100_none();
        let mut i = inputs(&inv, MigStrategy::None);
        i.machine = Some("NVIDIA DGX A100\n");
        let want = expected(
            common("NVIDIA-DGX-A100", "true"),
            &[
                ("gpu.product", "NVIDIA-A100-SXM4-40GB"),
                ("gpu.count", "8"),
                ("gpu.replicas", "1"),
                ("gpu.sharing-strategy", "none"),
                ("gpu.memory", "40960"),
                ("gpu.family", "ampere"),
                ("gpu.compute.major", "8"),
                ("gpu.compute.minor", "0"),
            ],
        );
        assert_eq!(feature_labels(&i), want);
    }

    #[test]
    fn two_h100s_mixed() {
        let inv = h100_mixed();
        let mig = |p: &str, count: &str, a: [&str; 9]| -> Vec<(String, String)> {
            let product = format!("NVIDIA-H100-80GB-HBM3-MIG-{p}");
            let mut v = vec![
                ("product", product.as_str()),
                ("count", count),
                ("replicas", "1"),
                ("sharing-strategy", "none"),
                ("memory", a[0]),
                ("multiprocessors", a[1]),
                ("slices.gi", a[2]),
                ("slices.ci", a[3]),
                ("engines.copy", a[4]),
                ("engines.decoder", a[5]),
                ("engines.encoder", a[6]),
                ("engines.jpeg", a[7]),
                ("engines.ofa", a[8]),
            ]
            .into_iter()
            .map(|(k, v)| (format!("mig-{p}.{k}"), v.to_string()))
            .collect::<Vec<_>>();
            v.sort();
            v
        };
        let mut want = expected(
            common("unknown", "true"),
            &[
                ("mig.strategy", "mixed"),
                ("gpu.product", "NVIDIA-H100-80GB-HBM3"),
                ("gpu.count", "2"),
                // Every GPU has MIG enabled: GFD labels them without sharing.
                ("gpu.replicas", "0"),
                ("gpu.sharing-strategy", "none"),
                ("gpu.memory", "81559"),
                ("gpu.family", "hopper"),
                ("gpu.compute.major", "9"),
                ("gpu.compute.minor", "0"),
            ],
        );
        for (k, v) in mig("2g.20gb", "2", ["20096", "32", "2", "2", "2", "2", "0", "2", "0"])
            .into_iter()
            .chain(mig("3g.40gb", "1", ["40448", "60", "3", "3", "3", "3", "0", "3", "0"]))
            .chain(mig("1g.10gb", "7", ["9984", "16", "1", "1", "1", "1", "0", "1", "0"]))
        {
            want.insert(format!("nvidia.com/{k}"), v);
        }
        let got = feature_labels(&inputs(&inv, MigStrategy::Mixed));
        assert_eq!(got, want);
        assert_eq!(got.len(), 18 + 1 + 8 + 3 * 13);
    }

    #[test]
    fn t4_is_turing_without_mig() {
        let inv = inventory(vec![gpu(0, "Tesla T4", 15360, (7, 5), None)]);
        let got = feature_labels(&inputs(&inv, MigStrategy::Single));
        assert_eq!(get(&got, "gpu.product"), Some("Tesla-T4"));
        assert_eq!(get(&got, "gpu.family"), Some("turing"));
        assert_eq!(get(&got, "gpu.compute.minor"), Some("5"));
        assert_eq!(get(&got, "gpu.memory"), Some("15360"));
        assert_eq!(get(&got, "gpu.replicas"), Some("1"));
        assert_eq!(get(&got, "mig.capable"), Some("false"));
        // single without MIG-enabled GPUs: the strategy label and the whole GPUs only.
        assert_eq!(get(&got, "mig.strategy"), Some("single"));
        assert_eq!(get(&got, "gpu.multiprocessors"), None);
        assert_eq!(get(&got, "gpu.count"), Some("1"));
    }

    #[test]
    fn a100_single_labels_the_mig_devices_as_gpus() {
        let inv = a100_single();
        let got = feature_labels(&inputs(&inv, MigStrategy::Single));
        let want = expected(
            common("unknown", "true"),
            &[
                ("mig.strategy", "single"),
                ("gpu.product", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
                ("gpu.count", "14"),
                ("gpu.replicas", "1"),
                ("gpu.sharing-strategy", "none"),
                ("gpu.memory", "4864"),
                ("gpu.family", "ampere"),
                ("gpu.compute.major", "8"),
                ("gpu.compute.minor", "0"),
                ("gpu.multiprocessors", "14"),
                ("gpu.slices.gi", "1"),
                ("gpu.slices.ci", "1"),
                ("gpu.engines.copy", "1"),
                ("gpu.engines.decoder", "0"),
                ("gpu.engines.encoder", "0"),
                ("gpu.engines.jpeg", "0"),
                ("gpu.engines.ofa", "0"),
            ],
        );
        assert_eq!(got, want);
    }

    #[test]
    fn invalid_single_configurations() {
        let cases = [
            (
                "two profiles",
                inventory(vec![with_migs(a100(0, Some(true)), &["1g.5gb", "2g.10gb"])]),
            ),
            (
                "MIG on and off",
                inventory(vec![with_migs(a100(0, Some(true)), &["1g.5gb"]), a100(1, Some(false))]),
            ),
            (
                "MIG-enabled GPU without MIG devices",
                inventory(vec![a100(0, Some(true))]),
            ),
        ];
        for (what, inv) in cases {
            let got = feature_labels(&inputs(&inv, MigStrategy::Single));
            assert_eq!(
                get(&got, "gpu.product"),
                Some("NVIDIA-A100-SXM4-40GB-MIG-INVALID"),
                "{what}"
            );
            for name in ["gpu.count", "gpu.replicas", "gpu.memory"] {
                assert_eq!(get(&got, name), Some("0"), "{what}: {name}");
            }
            assert_eq!(get(&got, "gpu.sharing-strategy"), Some("none"), "{what}");
            assert_eq!(get(&got, "gpu.family"), Some("ampere"), "{what}");
            assert_eq!(get(&got, "gpu.multiprocessors"), None, "{what}");
            assert_eq!(get(&got, "mig.strategy"), Some("single"), "{what}");
            assert_all_valid(&got);
        }
    }

    #[test]
    fn time_slicing_marks_products_shared_unless_renamed() {
        let inv = inventory((0..2).map(|i| a100(i, None)).collect());
        let mut i = inputs(&inv, MigStrategy::None);
        let four = shared(&[("gpu", 4, false)]);
        i.shared = &four;
        i.sharing_strategy = "time-slicing";
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-A100-SXM4-40GB-SHARED"));
        assert_eq!(get(&got, "gpu.replicas"), Some("4"));
        assert_eq!(get(&got, "gpu.sharing-strategy"), Some("time-slicing"));
        assert_eq!(get(&got, "gpu.count"), Some("2"));
        assert_eq!(get(&got, "mps.capable"), Some("false"));
        let renamed = shared(&[("gpu", 4, true)]);
        i.shared = &renamed;
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-A100-SXM4-40GB"));
        assert_eq!(get(&got, "gpu.replicas"), Some("4"));
        i.sharing_strategy = "mps";
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.sharing-strategy"), Some("mps"));
        assert_eq!(get(&got, "mps.capable"), Some("true"));
        // replicas 0 reads as 1, not shared.
        let zero = shared(&[("gpu", 0, false)]);
        i.shared = &zero;
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.replicas"), Some("1"));
        assert_eq!(get(&got, "gpu.sharing-strategy"), Some("none"));
    }

    #[test]
    fn sharing_applies_to_mig_resources_but_not_to_mig_enabled_gpus() {
        let inv = inventory(vec![with_migs(a100(0, Some(true)), &["1g.5gb", "1g.5gb+me"])]);
        let mut i = inputs(&inv, MigStrategy::Mixed);
        let four = shared(&[("gpu", 4, false), ("mig-1g.5gb", 4, false), ("mig-1g.5gb.me", 4, false)]);
        i.shared = &four;
        i.sharing_strategy = "time-slicing";
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-A100-SXM4-40GB"));
        assert_eq!(get(&got, "gpu.replicas"), Some("0"));
        assert_eq!(get(&got, "gpu.sharing-strategy"), Some("none"));
        assert_eq!(
            get(&got, "mig-1g.5gb.product"),
            Some("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED")
        );
        assert_eq!(get(&got, "mig-1g.5gb.replicas"), Some("4"));
        assert_eq!(get(&got, "mig-1g.5gb.sharing-strategy"), Some("time-slicing"));
        // `+` is written as `.`, in the key and the product.
        assert_eq!(get(&got, "mig-1g.5gb.me.count"), Some("1"));
        assert_eq!(get(&got, "mig-1g.5gb.me.engines.ofa"), Some("1"));
        assert_eq!(
            get(&got, "mig-1g.5gb.me.product"),
            Some("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb.me-SHARED")
        );
        // Sharing is per resource: a profile not listed is not shared.
        let one = shared(&[("mig-1g.5gb", 4, false)]);
        i.shared = &one;
        let got = feature_labels(&i);
        assert_eq!(get(&got, "mig-1g.5gb.replicas"), Some("4"));
        assert_eq!(get(&got, "mig-1g.5gb.me.replicas"), Some("1"));
        assert_eq!(get(&got, "mig-1g.5gb.me.sharing-strategy"), Some("none"));
        assert_eq!(
            get(&got, "mig-1g.5gb.me.product"),
            Some("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb.me")
        );
        // MPS is not possible with MIG enabled.
        i.sharing_strategy = "mps";
        assert_eq!(get(&feature_labels(&i), "mps.capable"), Some("false"));
        // Under single the MIG devices are the shared nvidia.com/gpu.
        let inv = a100_single();
        let mut i = inputs(&inv, MigStrategy::Single);
        let two = shared(&[("gpu", 2, false)]);
        i.shared = &two;
        i.sharing_strategy = "time-slicing";
        let got = feature_labels(&i);
        assert_eq!(
            get(&got, "gpu.product"),
            Some("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED")
        );
        assert_eq!(get(&got, "gpu.replicas"), Some("2"));
        assert_eq!(get(&got, "gpu.sharing-strategy"), Some("time-slicing"));
    }

    #[test]
    fn no_gpus_is_present_false_only() {
        let inv = inventory(vec![]);
        for strategy in [MigStrategy::None, MigStrategy::Single, MigStrategy::Mixed] {
            let mut i = inputs(&inv, strategy);
            i.machine = Some("Some Box");
            assert_eq!(feature_labels(&i), labels(&[("gpu.present", "false")]));
        }
    }

    #[test]
    fn none_strategy_labels_whole_gpus_even_with_mig_devices() {
        let inv = h100_mixed();
        let got = feature_labels(&inputs(&inv, MigStrategy::None));
        assert_eq!(get(&got, "mig.strategy"), None);
        assert!(!got.keys().any(|k| k.contains("mig-")), "{got:?}");
        assert_eq!(get(&got, "gpu.count"), Some("2"));
        assert_eq!(get(&got, "gpu.multiprocessors"), None);
    }

    #[test]
    fn different_models_label_the_first_whole_gpu() {
        // The first GPU's model, counted alone.
        let inv = inventory(vec![
            gpu(0, "Tesla T4", 15360, (7, 5), None),
            a100(1, None),
            a100(2, None),
        ]);
        let got = feature_labels(&inputs(&inv, MigStrategy::None));
        assert_eq!(get(&got, "gpu.product"), Some("Tesla-T4"));
        assert_eq!(get(&got, "gpu.count"), Some("1"));
        assert_eq!(get(&got, "gpu.family"), Some("turing"));
        // A GPU without MIG wins over MIG-enabled ones, which are counted when of its model.
        let inv = inventory(vec![h100(0), a100(1, Some(true)), a100(2, Some(false))]);
        let mut i = inputs(&inv, MigStrategy::Mixed);
        let three = shared(&[("gpu", 3, false)]);
        i.shared = &three;
        i.sharing_strategy = "time-slicing";
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-A100-SXM4-40GB-SHARED"));
        assert_eq!(get(&got, "gpu.count"), Some("2"));
        assert_eq!(get(&got, "gpu.replicas"), Some("3"));
    }

    #[test]
    fn names_and_machines_are_sanitised_like_gfd() {
        let mut titan = gpu(0, "NVIDIA TITAN X (Pascal)", 12288, (6, 1), None);
        titan.memory_mib = 0;
        titan.compute_capability = None;
        let inv = inventory(vec![titan]);
        let mut i = inputs(&inv, MigStrategy::None);
        i.machine = Some("Standard PC (Q35 + ICH9, 2009)\n");
        let got = feature_labels(&i);
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-TITAN-X-Pascal"));
        assert_eq!(get(&got, "gpu.machine"), Some("Standard-PC-Q35-ICH9-2009"));
        // No memory, no compute capability: those labels are left out, as GFD does.
        for name in ["gpu.memory", "gpu.family", "gpu.compute.major", "gpu.compute.minor"] {
            assert_eq!(get(&got, name), None, "{name}");
        }
        for (raw, want) in [
            ("VMware20,1", "VMware201"),
            ("  ", "unknown"),
            ("(!)", "unknown"),
            ("-Edge Box-", "Edge-Box"),
        ] {
            i.machine = Some(raw);
            assert_eq!(get(&feature_labels(&i), "gpu.machine"), Some(want), "{raw:?}");
        }
        i.machine = None;
        assert_eq!(get(&feature_labels(&i), "gpu.machine"), Some("unknown"));
    }

    #[test]
    fn long_values_are_cut_to_valid_labels() {
        let long = "NVIDIA RTX PRO 6000 Blackwell Server Edition With A Much Longer Name";
        let inv = inventory(vec![gpu(0, long, 97887, (12, 0), None)]);
        let mut i = inputs(&inv, MigStrategy::None);
        let two = shared(&[("gpu", 2, false)]);
        i.shared = &two;
        i.sharing_strategy = "time-slicing";
        let machine = "Box-".repeat(30);
        i.machine = Some(&machine);
        let got = feature_labels(&i);
        let product = get(&got, "gpu.product").expect("product");
        assert_eq!(product.len(), 63);
        assert!(long.replace(' ', "-").starts_with(product), "{product}");
        let machine = get(&got, "gpu.machine").expect("machine");
        assert!(machine.len() <= 63 && machine.ends_with("Box"), "{machine}");
        assert_eq!(get(&got, "gpu.family"), Some("blackwell"));
        assert_all_valid(&got);
    }

    #[test]
    fn driver_versions_without_revision_and_odd_ones() {
        let mut inv = a100_none();
        inv.driver_version = "550.120".into();
        let got = feature_labels(&inputs(&inv, MigStrategy::None));
        assert_eq!(get(&got, "cuda.driver-version.revision"), Some(""));
        assert_eq!(get(&got, "cuda.driver.rev"), Some(""));
        assert_eq!(get(&got, "cuda.driver-version.full"), Some("550.120"));
        assert_all_valid(&got);
        inv.driver_version = "unknown".into();
        inv.cuda_driver_version = "twelve".into();
        let got = feature_labels(&inputs(&inv, MigStrategy::None));
        assert!(!got.keys().any(|k| k.contains("cuda.")), "{got:?}");
        assert_eq!(get(&got, "gpu.product"), Some("NVIDIA-A100-SXM4-40GB"));
    }

    #[test]
    fn mig_devices_without_attributes_keep_their_memory() {
        let mut g = with_migs(a100(0, Some(true)), &["3g.20gb", "3g.20gb"]);
        for m in &mut g.mig_devices {
            m.attributes = None;
        }
        let inv = inventory(vec![g]);
        let got = feature_labels(&inputs(&inv, MigStrategy::Single));
        assert_eq!(get(&got, "gpu.memory"), Some("19968"));
        assert_eq!(get(&got, "gpu.count"), Some("2"));
        assert_eq!(get(&got, "gpu.multiprocessors"), None);
        let got = feature_labels(&inputs(&inv, MigStrategy::Mixed));
        assert_eq!(get(&got, "mig-3g.20gb.memory"), Some("19968"));
        assert_eq!(get(&got, "mig-3g.20gb.slices.gi"), None);
    }

    #[test]
    fn families_follow_gfd() {
        let table = [
            ((1, 3), "tesla"),
            ((2, 1), "fermi"),
            ((3, 7), "kepler"),
            ((4, 0), "undefined"),
            ((5, 2), "maxwell"),
            ((6, 1), "pascal"),
            ((7, 0), "volta"),
            ((7, 2), "volta"),
            ((7, 5), "turing"),
            ((8, 0), "ampere"),
            ((8, 6), "ampere"),
            ((8, 7), "ampere"),
            ((8, 9), "ada-lovelace"),
            ((9, 0), "hopper"),
            ((10, 0), "blackwell"),
            ((11, 0), "undefined"),
            ((12, 0), "blackwell"),
            ((13, 0), "rubin"),
            ((14, 0), "undefined"),
        ];
        for ((major, minor), family) in table {
            assert_eq!(gpu_family(major, minor), family, "{major}.{minor}");
        }
    }

    #[test]
    fn every_value_is_a_valid_label() {
        let shared = 4;
        let inventories = [
            (a100_none(), MigStrategy::None),
            (
                inventory(vec![gpu(0, "Tesla T4", 15360, (7, 5), None)]),
                MigStrategy::None,
            ),
            (h100_mixed(), MigStrategy::Mixed),
            (h100_mixed(), MigStrategy::Single),
            (a100_single(), MigStrategy::Single),
            (
                inventory(vec![with_migs(a100(0, Some(true)), &["1g.5gb", "2g.10gb"])]),
                MigStrategy::Single,
            ),
            (
                inventory(vec![with_migs(a100(0, Some(true)), &["1g.5gb+me", "3g.20gb"])]),
                MigStrategy::Mixed,
            ),
            (inventory(vec![]), MigStrategy::Mixed),
        ];
        for (inv, strategy) in &inventories {
            for (replicas, sharing, renamed) in [
                (1, "none", false),
                (shared, "time-slicing", false),
                (shared, "mps", true),
            ] {
                // Every resource shared alike.
                let resources = std::iter::once("gpu".to_string())
                    .chain(mig_profiles(&inv.gpus).into_iter().map(|(p, ..)| format!("mig-{p}")))
                    .map(|name| (name, ResourceSharing { replicas, renamed }))
                    .collect();
                let i = FeatureInputs {
                    inventory: inv,
                    mig_strategy: *strategy,
                    prefix: "nvidia.com/",
                    machine: Some("PowerEdge XE9680 (rev. 2)"),
                    vgpu: true,
                    sharing_strategy: sharing,
                    shared: &resources,
                };
                let got = feature_labels(&i);
                assert!(!got.is_empty());
                assert_all_valid(&got);
            }
        }
    }

    fn fabric(uuid: &str, clique: u32, state: u8, status: u32) -> Option<crate::nvml::FabricInfo> {
        Some(crate::nvml::FabricInfo {
            cluster_uuid: uuid.into(),
            clique_id: clique,
            state,
            status,
        })
    }

    const DOMAIN: &str = "0123abcd-0000-1111-2222-333344445555";
    const OTHER: &str = "0123abcd-0000-1111-2222-999944445555";
    const ZERO: &str = "00000000-0000-0000-0000-000000000000";

    fn with_fabrics(fabrics: Vec<Option<crate::nvml::FabricInfo>>) -> Inventory {
        sample::inventory(
            fabrics
                .into_iter()
                .enumerate()
                .map(|(i, fabric)| GpuInfo {
                    fabric,
                    ..h100(i as u32)
                })
                .collect(),
        )
    }

    fn clique_of(inventory: &Inventory) -> Option<String> {
        get(&feature_labels(&inputs(inventory, MigStrategy::None)), "gpu.clique").map(str::to_owned)
    }

    #[test]
    fn clique_when_every_attached_gpu_agrees() {
        let done = |u| fabric(u, 7, 3, 0);
        let node = with_fabrics(vec![done(DOMAIN), done(DOMAIN), done(DOMAIN), done(DOMAIN)]);
        assert_eq!(
            clique_of(&node).as_deref(),
            Some("0123abcd-0000-1111-2222-333344445555.7")
        );
        // As GFD: a GPU not attached (not completed, failed probe, zero UUID, no fabric) is
        // skipped; the others still name the clique.
        for odd in [
            fabric(DOMAIN, 7, 2, 0),
            fabric(DOMAIN, 7, 3, 15),
            fabric(ZERO, 0, 3, 0),
            None,
        ] {
            let node = with_fabrics(vec![done(DOMAIN), odd.clone()]);
            assert_eq!(
                clique_of(&node).as_deref(),
                Some("0123abcd-0000-1111-2222-333344445555.7"),
                "{odd:?}"
            );
        }
    }

    #[test]
    fn no_clique_when_gpus_disagree_or_none_is_attached() {
        let cases = [
            vec![fabric(DOMAIN, 7, 3, 0), fabric(DOMAIN, 8, 3, 0)],
            vec![fabric(DOMAIN, 7, 3, 0), fabric(OTHER, 7, 3, 0)],
            vec![fabric(DOMAIN, 7, 1, 0), fabric(DOMAIN, 7, 2, 0)],
            vec![fabric(DOMAIN, 7, 3, 15), fabric(DOMAIN, 7, 3, 15)],
            vec![fabric(ZERO, 0, 3, 0), fabric(ZERO, 0, 3, 0)],
            vec![None, None],
        ];
        for case in cases {
            assert_eq!(clique_of(&with_fabrics(case.clone())), None, "{case:?}");
        }
    }

    #[test]
    fn gpu_mode_follows_the_pci_class_of_every_gpu() {
        let mode = |classes: &[Option<u32>]| {
            let inv = sample::inventory(
                classes
                    .iter()
                    .enumerate()
                    .map(|(i, c)| GpuInfo {
                        pci_class: *c,
                        ..h100(i as u32)
                    })
                    .collect(),
            );
            get(&feature_labels(&inputs(&inv, MigStrategy::None)), "gpu.mode").map(str::to_owned)
        };
        assert_eq!(mode(&[Some(0x030200), Some(0x030200)]).as_deref(), Some("compute"));
        assert_eq!(mode(&[Some(0x030000)]).as_deref(), Some("graphics"));
        assert_eq!(mode(&[Some(0x030200), Some(0x030000)]).as_deref(), Some("unknown"));
        assert_eq!(mode(&[Some(0x030200), None]).as_deref(), Some("unknown"));
        assert_eq!(mode(&[Some(0x038000)]).as_deref(), Some("unknown"));
        assert_eq!(mode(&[Some(0x030201)]).as_deref(), Some("unknown"));
    }

    #[test]
    fn vgpu_present_is_written_either_way() {
        let inv = a100_none();
        let mut i = inputs(&inv, MigStrategy::None);
        assert_eq!(get(&feature_labels(&i), "vgpu.present"), Some("false"));
        i.vgpu = true;
        assert_eq!(get(&feature_labels(&i), "vgpu.present"), Some("true"));
    }
}
