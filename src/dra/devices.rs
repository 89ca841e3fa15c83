//! What the DRA driver publishes, pure: the node's GPUs and MIG devices as DRA devices, in
//! NVIDIA's DRA driver's names, attributes and capacities, and the ResourceSlices that carry
//! them.
//!
//! Names (NVIDIA's k8s-dra-driver-gpu, so its DeviceClasses and CEL selectors keep working):
//! a GPU is `gpu-<minor>`, a MIG device `gpu-<parent minor>-mig-<GPU instance profile
//! id>-<placement start>-<placement size>`. Attributes live in the driver's domain (bare names):
//! `type` (`gpu`/`mig`), `uuid`, `productName`, `architecture`, `cudaComputeCapability`,
//! `driverVersion`, `cudaDriverVersion` (versions: strict three-part semver), `pcieBusID`; MIG
//! devices add `parentUUID` and `profile`. Capacities: `memory`; MIG devices add their engines
//! and one `memorySlice<i>` per memory slice they occupy, so the scheduler never puts two
//! overlapping placements on one claim.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::config::DraDeviceKind;
use crate::devices::PluginDevice;
use crate::edits::{mig_plugin_devices, whole_gpu};
use crate::labels::gfd::gpu_family;
use crate::nvml::{GpuInfo, Inventory, MigDeviceInfo};

/// Most devices in one ResourceSlice (`ResourceSliceMaxDevices`).
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// One attribute value, as the API types it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribute {
    String(String),
    Int(i64),
    /// Strict semver 2.0.0 (`MAJOR.MINOR.PATCH`).
    Version(String),
}

impl Attribute {
    fn to_json(&self) -> Value {
        match self {
            Attribute::String(s) => json!({ "string": s }),
            Attribute::Int(i) => json!({ "int": i }),
            Attribute::Version(v) => json!({ "version": v }),
        }
    }
}

/// A device the driver can publish and prepare.
#[derive(Debug, Clone, PartialEq)]
pub struct DraDevice {
    /// The device name in the slice (a DNS label).
    pub name: String,
    /// The same device as the device plugin sees it (UUIDs, MIG ids, minor): for health, the
    /// CDI edits and the exclusion between the two APIs.
    pub device: PluginDevice,
    pub attributes: BTreeMap<String, Attribute>,
    /// Capacity name → Kubernetes quantity.
    pub capacity: BTreeMap<String, String>,
}

impl DraDevice {
    /// The UUID (`GPU-…` or `MIG-…`).
    pub fn uuid(&self) -> &str {
        &self.device.uuid
    }

    /// The device's entry in a ResourceSlice's `spec.devices`.
    pub fn to_json(&self) -> Value {
        let attributes: Map<String, Value> = self.attributes.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
        let capacity: Map<String, Value> = self
            .capacity
            .iter()
            .map(|(k, v)| (k.clone(), json!({ "value": v })))
            .collect();
        json!({ "name": self.name, "attributes": attributes, "capacity": capacity })
    }
}

/// NVIDIA's DRA name of a GPU.
pub fn gpu_name(gpu: &GpuInfo) -> String {
    format!("gpu-{}", gpu.minor)
}

/// NVIDIA's DRA name of a MIG device; `None` without its GPU instance's placement.
pub fn mig_name(gpu: &GpuInfo, mig: &MigDeviceInfo) -> Option<String> {
    let p = mig.placement?;
    Some(format!("gpu-{}-mig-{}-{}-{}", gpu.minor, p.profile_id, p.start, p.size))
}

/// A version as strict three-part semver, as NVIDIA's driver writes it (Go's lenient semver
/// parse and print): `8.0` → `8.0.0`, `535.104.05` → `535.104.5`. `None` when it is not
/// dotted numbers.
pub fn semver(text: &str) -> Option<String> {
    let parts: Vec<u64> = text
        .trim()
        .split('.')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let at = |i: usize| parts.get(i).copied().unwrap_or(0);
    Some(format!("{}.{}.{}", at(0), at(1), at(2)))
}

/// The attributes a GPU and its MIG devices share.
fn common_attributes(
    inventory: &Inventory,
    gpu: &GpuInfo,
    uuid: &str,
    kind: DraDeviceKind,
) -> BTreeMap<String, Attribute> {
    let mut a = BTreeMap::new();
    a.insert("type".into(), Attribute::String(kind.as_str().into()));
    a.insert("uuid".into(), Attribute::String(uuid.into()));
    a.insert("productName".into(), Attribute::String(cut(&gpu.name)));
    a.insert(
        "pcieBusID".into(),
        Attribute::String(gpu.pci_bus_id.to_ascii_lowercase()),
    );
    if let Some((major, minor)) = gpu.compute_capability {
        a.insert("architecture".into(), Attribute::String(arch_name(major, minor)));
        if let Some(v) = semver(&format!("{major}.{minor}")) {
            a.insert("cudaComputeCapability".into(), Attribute::Version(v));
        }
    }
    if let Some(v) = semver(&inventory.driver_version) {
        a.insert("driverVersion".into(), Attribute::Version(v));
    }
    if let Some(v) = semver(&inventory.cuda_driver_version) {
        a.insert("cudaDriverVersion".into(), Attribute::Version(v));
    }
    a
}

/// NVIDIA's architecture names are capitalised (`Ampere`, `Hopper`); GFD's families are lower
/// case with dashes.
fn arch_name(major: i32, minor: i32) -> String {
    gpu_family(major, minor)
        .split('-')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// String attributes are at most 64 bytes.
fn cut(s: &str) -> String {
    crate::names::truncate(s, 64).to_string()
}

/// The devices to publish, in name order: whole GPUs (those not in MIG mode) and the MIG
/// devices that exist, as `publish` asks. A MIG device without a known placement is left out
/// (it would have no stable name).
pub fn devices(inventory: &Inventory, publish: &[DraDeviceKind]) -> Vec<DraDevice> {
    let mut out = Vec::new();
    for gpu in &inventory.gpus {
        let mig_mode = gpu.mig.is_some_and(|m| m.current);
        if !mig_mode && publish.contains(&DraDeviceKind::Gpu) {
            let mut capacity = BTreeMap::new();
            capacity.insert("memory".into(), format!("{}Mi", gpu.memory_mib));
            out.push(DraDevice {
                name: gpu_name(gpu),
                device: whole_gpu(gpu),
                attributes: common_attributes(inventory, gpu, &gpu.uuid, DraDeviceKind::Gpu),
                capacity,
            });
        }
        if mig_mode && publish.contains(&DraDeviceKind::Mig) {
            for (info, device) in gpu.mig_devices.iter().zip(mig_plugin_devices(gpu)) {
                let Some(name) = mig_name(gpu, info) else { continue };
                let mut attributes = common_attributes(inventory, gpu, &info.uuid, DraDeviceKind::Mig);
                attributes.insert("parentUUID".into(), Attribute::String(gpu.uuid.clone()));
                attributes.insert("profile".into(), Attribute::String(cut(&info.profile)));
                let mut capacity = BTreeMap::new();
                let memory = info.attributes.as_ref().map_or(info.memory_mib, |a| a.memory_mib);
                capacity.insert("memory".into(), format!("{memory}Mi"));
                if let Some(a) = &info.attributes {
                    for (key, n) in [
                        ("multiprocessors", a.multiprocessors),
                        ("copyEngines", a.copy_engines),
                        ("decoders", a.decoders),
                        ("encoders", a.encoders),
                        ("jpegEngines", a.jpeg),
                        ("ofaEngines", a.ofa),
                    ] {
                        capacity.insert(key.into(), n.to_string());
                    }
                }
                if let Some(p) = info.placement {
                    for slice in p.start..p.start.saturating_add(p.size) {
                        capacity.insert(format!("memorySlice{slice}"), "1".into());
                    }
                }
                out.push(DraDevice {
                    name,
                    device,
                    attributes,
                    capacity,
                });
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The name of slice `index` of this node and driver: `<node>-<driver>-<index>`, a DNS
/// subdomain (the node part is shortened if the whole would pass 253 characters).
pub fn slice_name(node: &str, driver: &str, index: usize) -> String {
    let suffix = format!("-{driver}-{index}");
    let room = 253usize.saturating_sub(suffix.len());
    let mut node = &node[..node.len().min(room)];
    node = node.trim_end_matches(['-', '.']);
    format!("{node}{suffix}")
}

/// The ResourceSlices for these devices (at most [`MAX_DEVICES_PER_SLICE`] each; one, empty,
/// when there is none, so that the pool says the node has no devices): pool `node`, owned by
/// `node` (`spec.nodeName`, what the Node authorizer lets a node write), at `generation`.
pub fn slices(node: &str, driver: &str, devices: &[&DraDevice], generation: i64) -> Vec<Value> {
    let chunks: Vec<&[&DraDevice]> = if devices.is_empty() {
        vec![&[]]
    } else {
        devices.chunks(MAX_DEVICES_PER_SLICE).collect()
    };
    let count = chunks.len();
    chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {
                    "name": slice_name(node, driver, i),
                    "labels": {"app.kubernetes.io/managed-by": crate::kube::COMPONENT},
                },
                "spec": {
                    "driver": driver,
                    "nodeName": node,
                    "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
                    "devices": chunk.iter().map(|d| d.to_json()).collect::<Vec<_>>(),
                }
            })
        })
        .collect()
}

/// Whether the slices on the server carry what `wanted` does: the same names, devices and
/// slice count (generation and server fields aside).
pub fn same_content(existing: &[Value], wanted: &[Value]) -> bool {
    let key = |s: &Value| {
        (
            s.pointer("/metadata/name").cloned(),
            s.pointer("/spec/pool/resourceSliceCount").and_then(Value::as_i64),
            s.pointer("/spec/devices").cloned().unwrap_or(Value::Array(Vec::new())),
        )
    };
    let mut a: Vec<_> = existing.iter().map(key).collect();
    let mut b: Vec<_> = wanted.iter().map(key).collect();
    let order =
        |x: &(Option<Value>, Option<i64>, Value)| x.0.as_ref().and_then(Value::as_str).unwrap_or("").to_string();
    a.sort_by_key(order);
    b.sort_by_key(order);
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::sample;
    use crate::nvml::{GiPlacement, MigAttributes};

    #[test]
    fn versions_are_strict_semver() {
        assert_eq!(semver("8.0").as_deref(), Some("8.0.0"));
        assert_eq!(semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(semver("12.4").as_deref(), Some("12.4.0"));
        assert_eq!(semver("550.54.15").as_deref(), Some("550.54.15"));
        assert_eq!(semver("1.2.3.4"), None);
        assert_eq!(semver("abc"), None);
        assert_eq!(semver(""), None);
    }

    #[test]
    fn architecture_is_capitalised() {
        assert_eq!(arch_name(8, 0), "Ampere");
        assert_eq!(arch_name(9, 0), "Hopper");
        assert_eq!(arch_name(8, 9), "Ada Lovelace");
    }

    #[test]
    fn gpus_and_mig_devices_in_nvidia_names() {
        let mut inv = sample::inventory(vec![sample::a100(0), sample::a100(1)]);
        inv.gpus[1].mig = Some(sample::mig(true));
        inv.gpus[1].mig_devices = sample::mig_devices(1, &["3g.20gb"]);
        inv.gpus[1].mig_devices[0].placement = Some(GiPlacement {
            profile_id: 9,
            start: 4,
            size: 4,
        });
        inv.gpus[1].mig_devices[0].attributes = Some(MigAttributes {
            multiprocessors: 42,
            gpu_instance_slices: 3,
            compute_instance_slices: 3,
            copy_engines: 3,
            decoders: 2,
            encoders: 0,
            jpeg: 0,
            ofa: 0,
            memory_mib: 19968,
        });
        let all = devices(&inv, &[DraDeviceKind::Gpu, DraDeviceKind::Mig]);
        let names: Vec<&str> = all.iter().map(|d| d.name.as_str()).collect();
        let minor = inv.gpus[1].minor;
        assert_eq!(
            names,
            [format!("gpu-{}", inv.gpus[0].minor), format!("gpu-{minor}-mig-9-4-4")]
        );
        let mig = &all[1];
        assert_eq!(mig.attributes["type"], Attribute::String("mig".into()));
        assert_eq!(
            mig.attributes["parentUUID"],
            Attribute::String(inv.gpus[1].uuid.clone())
        );
        assert_eq!(mig.attributes["profile"], Attribute::String("3g.20gb".into()));
        assert_eq!(mig.capacity["memory"], "19968Mi");
        assert_eq!(mig.capacity["multiprocessors"], "42");
        let slices: Vec<&str> = mig
            .capacity
            .keys()
            .filter(|k| k.starts_with("memorySlice"))
            .map(String::as_str)
            .collect();
        assert_eq!(slices, ["memorySlice4", "memorySlice5", "memorySlice6", "memorySlice7"]);
        assert!(mig.attributes.len() + mig.capacity.len() <= 32);
        let gpu = &all[0];
        assert_eq!(gpu.attributes["type"], Attribute::String("gpu".into()));
        assert!(matches!(gpu.attributes["driverVersion"], Attribute::Version(_)));
        // Only what is asked for.
        let only_gpus = devices(&inv, &[DraDeviceKind::Gpu]);
        assert_eq!(only_gpus.len(), 1);
    }

    #[test]
    fn slices_hold_at_most_128_devices_and_agree_on_the_pool() {
        let inv = sample::inventory(vec![sample::a100(0)]);
        let one = devices(&inv, &[DraDeviceKind::Gpu]).remove(0);
        let many: Vec<DraDevice> = (0..200)
            .map(|i| DraDevice {
                name: format!("gpu-{i}"),
                ..one.clone()
            })
            .collect();
        let refs: Vec<&DraDevice> = many.iter().collect();
        let out = slices("node-a", "gpu.nvidia.com", &refs, 3);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["spec"]["devices"].as_array().map(Vec::len), Some(128));
        assert_eq!(out[1]["spec"]["devices"].as_array().map(Vec::len), Some(72));
        for s in &out {
            assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 2);
            assert_eq!(s["spec"]["pool"]["generation"], 3);
            assert_eq!(s["spec"]["nodeName"], "node-a");
        }
        assert!(same_content(&out, &slices("node-a", "gpu.nvidia.com", &refs, 4)));
        assert!(!same_content(
            &out,
            &slices("node-a", "gpu.nvidia.com", &refs[..100], 4)
        ));
        let none = slices("node-a", "gpu.nvidia.com", &[], 1);
        assert_eq!(none.len(), 1);
        assert_eq!(none[0]["spec"]["devices"], json!([]));
    }

    #[test]
    fn slice_names_stay_dns_subdomains() {
        assert_eq!(slice_name("node-a", "gpu.nvidia.com", 0), "node-a-gpu.nvidia.com-0");
        // Node names are DNS subdomains: labels of at most 63 characters.
        let long = ["n".repeat(63), "m".repeat(63), "o".repeat(63), "p".repeat(60)].join(".");
        let name = slice_name(&long, "gpu.nvidia.com", 1);
        assert!(name.len() <= 253);
        assert!(crate::names::is_dns_subdomain(&name));
    }
}
