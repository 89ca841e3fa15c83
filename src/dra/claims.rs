//! Claims, pure: what an allocated ResourceClaim gives this driver, the checkpoint of prepared
//! claims, and the names of the CDI spec written for one claim (its edits are rendered by
//! `runtime::cdi::claim_spec` from the node's container edits).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::Config;
use crate::host::HostRoot;

/// The checkpoint of prepared claims: `<state_dir>/dra/checkpoint.json` under the root.
pub fn checkpoint_path(config: &Config, root: &HostRoot) -> PathBuf {
    root.join(&config.agent.state_dir).join("dra").join("checkpoint.json")
}

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    /// Checks the names the kubelet passes before any goes into a request path or a file name: the
    /// namespace and name are DNS subdomains (namespaces are labels, a subset), and the uid one
    /// token of letters, digits and `-` (the API server assigns UUIDs). A claim that fails is
    /// refused with the reason; nothing is read or written for it.
    pub fn check(&self) -> Result<(), String> {
        let uid_ok = !self.uid.is_empty()
            && self.uid.len() <= 128
            && self.uid.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
        if !crate::names::is_dns_subdomain(&self.namespace) {
            return Err(format!(
                "{self}: namespace {:?} is not a Kubernetes name",
                self.namespace
            ));
        }
        if !crate::names::is_dns_subdomain(&self.name) {
            return Err(format!("{self}: name {:?} is not a Kubernetes name", self.name));
        }
        if !uid_ok {
            return Err(format!("{self}: uid {:?} is not a UID", self.uid));
        }
        Ok(())
    }
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResourceClaim {}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// One device the allocation gives this driver (`status.allocation.devices.results[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    /// The request, `<request>` or `<request>/<subrequest>`.
    pub request: String,
    pub pool: String,
    pub device: String,
    /// `adminAccess`: for monitoring, may share the device with other claims.
    pub admin_access: bool,
    pub share_id: Option<String>,
}

impl Allocated {
    /// The request name the kubelet matches containers' `resources.claims[].request` against:
    /// the subrequest part cut off, as the kubelet plugin helper does.
    pub fn base_request(&self) -> &str {
        self.request.split('/').next().unwrap_or(&self.request)
    }
}

/// The results of `claim` (as the API returned it) for `driver`. Errors say why the claim
/// cannot be prepared: replaced (another uid), not allocated, nothing for this driver.
pub fn allocated(claim: &Value, want: &ClaimRef, driver: &str) -> Result<Vec<Allocated>, String> {
    let uid = claim.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("");
    if uid != want.uid {
        return Err(format!(
            "{want}: the API server has uid {uid:?} under that name: the claim was replaced"
        ));
    }
    let Some(allocation) = claim.pointer("/status/allocation").filter(|a| !a.is_null()) else {
        return Err(format!("{want} is not allocated (no status.allocation)"));
    };
    let results = allocation
        .pointer("/devices/results")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let mut out = Vec::new();
    for (i, r) in results.iter().enumerate() {
        if r.get("driver").and_then(Value::as_str) != Some(driver) {
            continue;
        }
        let field = |key: &str| {
            r.get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .ok_or_else(|| format!("{want}: status.allocation.devices.results[{i}].{key} is missing"))
        };
        out.push(Allocated {
            request: field("request")?,
            pool: field("pool")?,
            device: field("device")?,
            admin_access: r.get("adminAccess").and_then(Value::as_bool).unwrap_or(false),
            share_id: r.get("shareID").and_then(Value::as_str).map(str::to_string),
        });
    }
    if out.is_empty() {
        return Err(format!("{want}: no device of driver {driver:?} is allocated to it"));
    }
    Ok(out)
}

/// One prepared device, as the kubelet was told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    /// The GPU or MIG device's UUID.
    pub uuid: String,
    pub cdi_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    #[serde(default)]
    pub admin_access: bool,
}

/// A prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub devices: Vec<PreparedDevice>,
}

/// What the driver has prepared, by claim uid: `<state_dir>/dra/checkpoint.json`, written
/// before the kubelet hears of a prepare and after an unprepare, so a restarted agent answers
/// both as it did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The format (1).
    pub version: u32,
    /// The driver these claims were prepared for.
    pub driver: String,
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// The checkpoint format written now.
pub const CHECKPOINT_VERSION: u32 = 1;

impl Checkpoint {
    pub fn new(driver: &str) -> Checkpoint {
        Checkpoint {
            version: CHECKPOINT_VERSION,
            driver: driver.to_string(),
            claims: BTreeMap::new(),
        }
    }

    /// Reads a checkpoint's text; `name` is the file, for messages.
    pub fn parse(text: &str, name: &str) -> Result<Checkpoint, String> {
        let c: Checkpoint = serde_json::from_str(text).map_err(|e| format!("{name}: {e}"))?;
        if c.version != CHECKPOINT_VERSION {
            return Err(format!(
                "{name}: checkpoint version {} is not {CHECKPOINT_VERSION}, the one this agent writes",
                c.version
            ));
        }
        Ok(c)
    }

    pub fn render(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text
    }

    /// Which claim holds the device with this UUID, or one that contains it or that it
    /// contains (a GPU and its MIG devices), other than `except`; admin-access devices count
    /// for nobody.
    pub fn holder<'a>(&'a self, related: &[String], except: &str) -> Option<(&'a str, &'a PreparedClaim)> {
        self.claims
            .iter()
            .filter(|(uid, _)| uid.as_str() != except)
            .find(|(_, c)| c.devices.iter().any(|d| !d.admin_access && related.contains(&d.uuid)))
            .map(|(uid, c)| (uid.as_str(), c))
    }

    /// The UUIDs of every prepared device (admin access aside).
    pub fn uuids(&self) -> impl Iterator<Item = &str> {
        self.claims
            .values()
            .flat_map(|c| c.devices.iter())
            .filter(|d| !d.admin_access)
            .map(|d| d.uuid.as_str())
    }
}

/// The CDI vendor of this driver's specs: `k8s.<driver>` (NVIDIA's: `k8s.gpu.nvidia.com`).
pub fn cdi_vendor(driver: &str) -> String {
    format!("k8s.{driver}")
}

/// The file name of a claim's spec: `<vendor>-claim_<uid>.json`.
pub fn claim_spec_file(driver: &str, uid: &str) -> String {
    format!("{}-claim_{uid}.json", cdi_vendor(driver))
}

/// The claim uid a spec file name belongs to, for this driver.
pub fn claim_of_spec_file<'a>(driver: &str, file: &'a str) -> Option<&'a str> {
    let prefix = format!("{}-claim_", cdi_vendor(driver));
    file.strip_prefix(prefix.as_str())?.strip_suffix(".json")
}

/// The CDI kind of this driver's claim specs: `<vendor>/claim`.
pub fn claim_kind(driver: &str) -> String {
    format!("{}/claim", cdi_vendor(driver))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(uid: &str, results: Value) -> Value {
        json!({
            "metadata": {"namespace": "ml", "name": "c", "uid": uid},
            "status": {"allocation": {"devices": {"results": results}}}
        })
    }

    /// A claim's names go into the API path and the spec's file name: a uid with `/` or `..`, or
    /// a name that is not a Kubernetes name, is refused before either is built.
    #[test]
    fn claim_names_that_could_leave_the_cdi_folder_or_the_api_path_are_refused() {
        let ok = want("0f8e-11aa-22bb");
        assert!(ok.check().is_ok());
        for (field, bad) in [
            ("uid", "../../etc/cron.d/x"),
            ("uid", "a/b"),
            ("uid", ""),
            ("name", "c/../../nodes/n1"),
            ("name", "C"),
            ("namespace", "ml?x=1"),
        ] {
            let mut claim = ok.clone();
            match field {
                "uid" => claim.uid = bad.into(),
                "name" => claim.name = bad.into(),
                _ => claim.namespace = bad.into(),
            }
            let err = claim.check().unwrap_err();
            assert!(err.contains(field) && err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    fn want(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ml".into(),
            name: "c".into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn allocation_results_of_this_driver_only() {
        let c = claim(
            "u1",
            json!([
                {"request": "gpu/big", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
                {"request": "nic", "driver": "net.example.com", "pool": "n1", "device": "eth0"},
            ]),
        );
        let got = allocated(&c, &want("u1"), "gpu.nvidia.com").expect("allocated");
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].device, "gpu-0");
        assert_eq!(got[0].base_request(), "gpu");
    }

    #[test]
    fn replaced_unallocated_and_foreign_claims_are_refused() {
        let c = claim("u2", json!([]));
        let err = allocated(&c, &want("u1"), "gpu.nvidia.com").expect_err("replaced");
        assert!(err.contains("replaced"), "{err}");
        let unallocated = json!({"metadata": {"uid": "u1"}, "status": {}});
        let err = allocated(&unallocated, &want("u1"), "gpu.nvidia.com").expect_err("unallocated");
        assert!(err.contains("not allocated"), "{err}");
        let other = claim(
            "u1",
            json!([{"request": "r", "driver": "x.example.com", "pool": "p", "device": "d"}]),
        );
        let err = allocated(&other, &want("u1"), "gpu.nvidia.com").expect_err("foreign");
        assert!(err.contains("no device of driver"), "{err}");
        let broken = claim("u1", json!([{"request": "r", "driver": "gpu.nvidia.com", "pool": "p"}]));
        let err = allocated(&broken, &want("u1"), "gpu.nvidia.com").expect_err("no device");
        assert!(err.contains("results[0].device"), "{err}");
    }

    #[test]
    fn checkpoint_round_trip_and_version() {
        let mut c = Checkpoint::new("gpu.nvidia.com");
        c.claims.insert(
            "u1".into(),
            PreparedClaim {
                namespace: "ml".into(),
                name: "c".into(),
                devices: vec![PreparedDevice {
                    request: "gpu".into(),
                    pool: "n1".into(),
                    device: "gpu-0".into(),
                    uuid: "GPU-0".into(),
                    cdi_ids: vec!["k8s.gpu.nvidia.com/claim=u1-gpu-0".into()],
                    share_id: None,
                    admin_access: false,
                }],
            },
        );
        let back = Checkpoint::parse(&c.render(), "checkpoint.json").expect("parse");
        assert_eq!(back, c);
        assert_eq!(back.holder(&["GPU-0".into()], "u2").map(|(u, _)| u), Some("u1"));
        assert_eq!(back.holder(&["GPU-0".into()], "u1"), None);
        let err = Checkpoint::parse(r#"{"version": 7, "driver": "x", "claims": {}}"#, "cp.json").expect_err("version");
        assert!(err.contains("cp.json") && err.contains("version 7"), "{err}");
    }

    #[test]
    fn spec_file_names_round_trip() {
        let file = claim_spec_file("gpu.nvidia.com", "1234-abcd");
        assert_eq!(file, "k8s.gpu.nvidia.com-claim_1234-abcd.json");
        assert_eq!(claim_of_spec_file("gpu.nvidia.com", &file), Some("1234-abcd"));
        assert_eq!(claim_of_spec_file("gpu.nvidia.com", "nvidia.com-gpu.json"), None);
    }
}
