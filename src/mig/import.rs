//! Reading mig-parted config files (`version: v1`, the format of the GPU Operator's
//! `default-mig-parted-config` ConfigMap) into layouts, and writing layouts as the agent's
//! TOML (`[[mig.layouts.<name>]]`), for `gpu-node-agent mig import FILE`.
//!
//! mig-parted's own validation is applied, then the agent's ([`MigLayout::check`]). Where they
//! differ:
//! - counts of 0 are accepted as mig-parted does (and ignored, as its assert does): they are
//!   dropped from the layout;
//! - device filters must name NVIDIA's vendor id (`0x<device>10DE`); a subsystem qualifier
//!   (`0x25B610DE:0x14A910DE`, mig-parted v0.15) is kept and matched as mig-parted does;
//! - config names must be Kubernetes label values (the node label selects them);
//! - the rules of [`MigLayout::check`] apply: no empty or repeated `devices`, no two entries
//!   that can apply to the same GPU with different settings.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use serde_json::{Map, Value};

use crate::mig_layout::{
    DeviceId, DeviceSelector, Item, LayoutEntry, LayoutError, MigLayout, device_id_from_pci_id, parse_profile_name,
};
use crate::names::check_label_value;

/// What is wrong with a mig-parted file, and where: the config name, the entry's position and
/// the field (mig-parted's spelling).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportError {
    /// The name under `mig-configs`.
    pub config: Option<String>,
    /// 0-based position of the entry in that config's list.
    pub entry: Option<usize>,
    /// The field, e.g. `mig-enabled`, `devices[1]` or `mig-devices["1g.5gb"]`; at the top level
    /// `version` or `mig-configs`.
    pub field: Option<String>,
    /// What is wrong and what is expected.
    pub reason: String,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(config) = &self.config {
            parts.push(format!("config {config:?}"));
        }
        if let Some(entry) = self.entry {
            parts.push(format!("entry {entry}"));
        }
        if let Some(field) = &self.field {
            parts.push(field.clone());
        }
        if parts.is_empty() {
            f.write_str(&self.reason)
        } else {
            write!(f, "{}: {}", parts.join(", "), self.reason)
        }
    }
}

impl std::error::Error for ImportError {}

/// Where in the file a problem is.
#[derive(Clone, Default)]
struct At {
    config: Option<String>,
    entry: Option<usize>,
    field: Option<String>,
}

impl At {
    fn config(name: &str) -> At {
        At {
            config: Some(name.to_owned()),
            ..At::default()
        }
    }

    fn entry(&self, i: usize) -> At {
        At {
            entry: Some(i),
            ..self.clone()
        }
    }

    fn field(&self, field: impl Into<String>) -> At {
        At {
            field: Some(field.into()),
            ..self.clone()
        }
    }

    fn err(&self, reason: impl Into<String>) -> ImportError {
        ImportError {
            config: self.config.clone(),
            entry: self.entry,
            field: self.field.clone(),
            reason: reason.into(),
        }
    }
}

const ENTRY_KEYS: &[&str] = &["device-filter", "devices", "mig-enabled", "mig-devices"];

/// Reads a mig-parted config file (YAML or JSON) into layouts by name.
pub fn import_mig_parted(text: &str) -> Result<BTreeMap<String, MigLayout>, ImportError> {
    let (layouts, mut refused) = import_what_fits(text)?;
    match refused.is_empty() {
        true => Ok(layouts),
        false => Err(refused.remove(0)),
    }
}

/// [`import_mig_parted`], importing every config that can be and returning the errors of
/// those that cannot (one each, in file order) beside them; an error of the file itself (not
/// YAML, no `mig-configs`, an unknown version) is still the whole answer.
pub fn import_what_fits(text: &str) -> Result<(BTreeMap<String, MigLayout>, Vec<ImportError>), ImportError> {
    let top = At::default();
    let doc: Value = serde_saphyr::from_str(text).map_err(|e| top.err(format!("not valid YAML: {e}")))?;
    let Value::Object(doc) = doc else {
        return Err(top.err(format!(
            "expected a mapping with version and mig-configs, found {}",
            kind(&doc)
        )));
    };
    if doc.get("kind").and_then(Value::as_str) == Some("ConfigMap") {
        return import_what_fits(&config_map_file(&doc)?);
    }
    for key in doc.keys() {
        if key != "version" && key != "mig-configs" {
            let hint = if matches!(key.as_str(), "apiVersion" | "kind" | "data" | "metadata") {
                " (this looks like a Kubernetes object; import the mig-parted file it holds, e.g. the \
                 ConfigMap's data value)"
            } else {
                ""
            };
            return Err(top
                .field(key.clone())
                .err(format!("unexpected field; expected version and mig-configs{hint}")));
        }
    }
    match doc.get("version") {
        None => return Err(top.field("version").err("missing; expected version: v1")),
        Some(Value::String(v)) if v == "v1" => {}
        Some(v) => {
            return Err(top
                .field("version")
                .err(format!("unknown version {}, expected v1", show(v))));
        }
    }
    let configs = match doc.get("mig-configs") {
        None => return Err(top.field("mig-configs").err("missing")),
        Some(Value::Object(m)) if !m.is_empty() => m,
        Some(Value::Object(_)) => {
            return Err(top.field("mig-configs").err("expected at least one config"));
        }
        Some(v) => {
            return Err(top.field("mig-configs").err(format!(
                "expected a mapping of config names to entry lists, found {}",
                kind(v)
            )));
        }
    };

    let mut out = BTreeMap::new();
    let mut refused = Vec::new();
    for (name, list) in configs {
        match config(name, list) {
            Ok(layout) => {
                out.insert(name.clone(), layout);
            }
            Err(e) => refused.push(e),
        }
    }
    Ok((out, refused))
}

/// The mig-parted file a ConfigMap holds (`kubectl get configmap default-mig-parted-config -o
/// yaml`, or the Operator's `custom-mig-config`): `data."config.yaml"`, else its only key.
fn config_map_file(doc: &Map<String, Value>) -> Result<String, ImportError> {
    let at = At::default().field("data");
    let Some(Value::Object(data)) = doc.get("data") else {
        return Err(at.err("a ConfigMap without data: expected data.\"config.yaml\" holding a mig-parted file"));
    };
    let value = match data.get("config.yaml") {
        Some(v) => v,
        None if data.len() == 1 => data.values().next().unwrap_or(&Value::Null),
        None => {
            let keys: Vec<&str> = data.keys().map(String::as_str).collect();
            return Err(at.err(format!(
                "no config.yaml among the ConfigMap's keys ({}); import the one that holds the mig-parted \
                 file on its own",
                keys.join(", ")
            )));
        }
    };
    match value {
        Value::String(text) => Ok(text.clone()),
        other => Err(at.err(format!(
            "expected the mig-parted file as a string, found {}",
            kind(other)
        ))),
    }
}

/// One config of `mig-configs`.
fn config(name: &str, list: &Value) -> Result<MigLayout, ImportError> {
    let at = At::config(name);
    if name.is_empty() {
        return Err(at.err("a config name cannot be empty"));
    }
    check_label_value(name).map_err(|reason| at.err(format!("the name is selected by a node label: {reason}")))?;
    let items = match list {
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => return Err(at.err("expected at least one entry")),
        other => return Err(at.err(format!("expected a list of entries, found {}", kind(other)))),
    };
    let entries = items
        .iter()
        .enumerate()
        .map(|(i, item)| entry(&at.entry(i), item))
        .collect::<Result<Vec<_>, _>>()?;
    let layout = MigLayout::new(entries);
    layout.check().map_err(|e| layout_error(&at, e))?;
    Ok(layout)
}

fn entry(at: &At, item: &Value) -> Result<LayoutEntry, ImportError> {
    let Value::Object(map) = item else {
        return Err(at.err(format!("expected a mapping, found {}", kind(item))));
    };
    for key in map.keys() {
        if !ENTRY_KEYS.contains(&key.as_str()) {
            return Err(at
                .field(key.clone())
                .err(format!("unexpected field; expected one of {}", ENTRY_KEYS.join(", "))));
        }
    }
    let devices = devices(at, map)?;
    let mig_enabled = mig_enabled(at, map)?;
    let device_filter = device_filter(at, map)?;
    let profiles = mig_devices(at, map, mig_enabled)?;
    Ok(LayoutEntry {
        devices,
        device_filter,
        mig_enabled,
        profiles,
        generated: None,
    })
}

fn devices(at: &At, map: &Map<String, Value>) -> Result<DeviceSelector, ImportError> {
    let at = at.field("devices");
    const EXPECTED: &str = "expected \"all\" or a list of GPU indices";
    match map.get("devices") {
        None => Err(at.err(format!("missing; {EXPECTED}"))),
        Some(Value::String(s)) if s == "all" => Ok(DeviceSelector::All),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
                    at.field(format!("devices[{i}]"))
                        .err(format!("{}: {EXPECTED}", show(v)))
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(DeviceSelector::Indices),
        Some(v) => Err(at.err(format!("{}: {EXPECTED}", show(v)))),
    }
}

fn mig_enabled(at: &At, map: &Map<String, Value>) -> Result<bool, ImportError> {
    let at = at.field("mig-enabled");
    match map.get("mig-enabled") {
        None => Err(at.err("missing; expected true or false")),
        Some(Value::Bool(b)) => Ok(*b),
        // YAML 1.1 spellings, which mig-parted's YAML parser reads as booleans.
        Some(Value::String(s)) => match s.as_str() {
            "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True" | "TRUE" => Ok(true),
            "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False" | "FALSE" => Ok(false),
            _ => Err(at.err(format!("{}: expected true or false", show(&Value::String(s.clone()))))),
        },
        Some(v) => Err(at.err(format!("{}: expected true or false", show(v)))),
    }
}

fn device_filter(at: &At, map: &Map<String, Value>) -> Result<Vec<DeviceId>, ImportError> {
    let at = at.field("device-filter");
    let one = |at: &At, v: &Value| match v {
        Value::String(s) => mig_parted_device_id(s).map_err(|reason| at.err(format!("{s:?}: {reason}"))),
        other => Err(at.err(format!(
            "{}: expected a device id string such as \"0x20B010DE\"",
            show(other)
        ))),
    };
    match map.get("device-filter") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, v)| one(&at.field(format!("device-filter[{i}]")), v))
            .collect(),
        Some(v) => one(&at, v).map(|id| vec![id]),
    }
}

/// A device filter as mig-parted parses it: `<device and vendor>` or
/// `<device and vendor>:<subsystem device and vendor>` (v0.15), each an unsigned integer of at
/// most 32 bits in any base Go's `ParseUint(s, 0, 32)` reads (here hex with `0x` or decimal):
/// device id in the high 16 bits, vendor id in the low 16. The vendor must be NVIDIA's; the
/// subsystem vendor is the board maker's and may be anything.
fn mig_parted_device_id(text: &str) -> Result<DeviceId, String> {
    const EXPECTED: &str = "expected a 32-bit device and vendor id such as \"0x20B010DE\", perhaps followed by \
                            :<subsystem id> such as \"0x25B610DE:0x14A910DE\"";
    let number = |text: &str| match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => u32::from_str_radix(hex, 16).ok(),
        Some(_) => None,
        None if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => text.parse().ok(),
        None => None,
    };
    let mut parts = text.split(':');
    let (primary, subsystem) = (parts.next().unwrap_or_default(), parts.next());
    if parts.next().is_some() {
        return Err(format!("more than one ':'; {EXPECTED}"));
    }
    let device = device_id_from_pci_id(number(primary).ok_or_else(|| EXPECTED.to_owned())?)?;
    let subsystem = match subsystem {
        None => None,
        Some(s) => Some(number(s).ok_or_else(|| format!("the subsystem id {s:?} is not a number; {EXPECTED}"))?),
    };
    Ok(DeviceId { device, subsystem })
}

fn mig_devices(at: &At, map: &Map<String, Value>, mig_enabled: bool) -> Result<BTreeMap<String, u32>, ImportError> {
    let field = at.field("mig-devices");
    let devices = match map.get("mig-devices") {
        None if mig_enabled => {
            return Err(field.err("missing; required when mig-enabled is true ({} for no MIG devices)"));
        }
        None | Some(Value::Null) => return Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(field.err(format!(
                "{}: expected a mapping of MIG profile names to counts",
                show(v)
            )));
        }
    };
    if !mig_enabled && !devices.is_empty() {
        return Err(field.err("must be empty when mig-enabled is false"));
    }
    let mut out = BTreeMap::new();
    for (name, count) in devices {
        let at = at.field(format!("mig-devices[{name:?}]"));
        parse_profile_name(name).map_err(|e| at.err(e.to_string()))?;
        let n = count
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| at.err(format!("{}: expected a count, an integer of at least 0", show(count))))?;
        out.insert(name.clone(), n);
    }
    if !out.is_empty() && out.values().all(|&n| n == 0) {
        return Err(field.err("every count is 0; at least one must be greater than 0"));
    }
    // A count of 0 asks for nothing (mig-parted's assert ignores it).
    out.retain(|_, n| *n > 0);
    Ok(out)
}

fn layout_error(at: &At, e: LayoutError) -> ImportError {
    match e {
        LayoutError::Entry {
            entry,
            field,
            item,
            reason,
        } => {
            let mut name = field.mig_parted_key().to_owned();
            match item {
                Some(Item::Index(i)) => name.push_str(&format!("[{i}]")),
                Some(Item::Profile(p)) => name.push_str(&format!("[{p:?}]")),
                None => {}
            }
            at.entry(entry)
                .field(name)
                .err(reason.replace("MIG enabled", "mig-enabled"))
        }
        other => at.err(other.to_string()),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

fn show(v: &Value) -> String {
    match v {
        Value::Array(_) | Value::Object(_) => kind(v).to_owned(),
        other => other.to_string(),
    }
}

// === TOML ===

/// The layouts as `[[mig.layouts.<name>]]` tables that the config accepts, for a drop-in file.
pub fn to_toml(layouts: &BTreeMap<String, MigLayout>) -> String {
    let mut out = String::new();
    for (name, layout) in layouts {
        for e in &layout.entries {
            if !out.is_empty() {
                out.push('\n');
            }
            let _ = writeln!(out, "[[mig.layouts.{}]]", toml_key(name));
            match &e.devices {
                DeviceSelector::All => out.push_str("devices = \"all\"\n"),
                DeviceSelector::Indices(list) => {
                    let list: Vec<String> = list.iter().map(u32::to_string).collect();
                    let _ = writeln!(out, "devices = [{}]", list.join(", "));
                }
            }
            if !e.device_filter.is_empty() {
                let ids: Vec<String> = e.device_filter.iter().map(|id| format!("\"{id}\"")).collect();
                let _ = writeln!(out, "device_filter = [{}]", ids.join(", "));
            }
            let _ = writeln!(out, "mig_enabled = {}", e.mig_enabled);
            if e.mig_enabled || !e.profiles.is_empty() {
                let profiles: Vec<String> = e
                    .profiles
                    .iter()
                    .map(|(p, n)| format!("{} = {n}", toml::Value::String(p.clone())))
                    .collect();
                if profiles.is_empty() {
                    out.push_str("profiles = {}\n");
                } else {
                    let _ = writeln!(out, "profiles = {{ {} }}", profiles.join(", "));
                }
            }
        }
    }
    out
}

/// A TOML key: bare when it can be, quoted otherwise (layout names with '.').
fn toml_key(key: &str) -> String {
    let bare = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        key.to_owned()
    } else {
        toml::Value::String(key.to_owned()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Source};
    use crate::mig_layout::GpuPciIds;
    use crate::mig_layout::defaults::default_layouts;

    /// In the style of the GPU Operator's default-mig-parted-config.
    const OPERATOR_STYLE: &str = r#"
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false

  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}

  # A100-40GB, A800-40GB
  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7

  all-1g.5gb.me:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb+me": 1

  all-1g.10gb:
    # A100-40GB
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 4

    # H100-80GB, H800-80GB, A100-80GB, A800-80GB
    - device-filter: ["0x233010DE", "0x233110DE", "0x232210DE", "0x20B210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE", "0x232410DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7

  all-balanced:
    # A30-24GB
    - device-filter: "0x20B710DE"
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.6gb": 2
        "2g.12gb": 1

    # A100-40GB, A800-40GB
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1

  custom-config:
    - devices: [0, 1, 2, 3]
      mig-enabled: false
    - devices: [4]
      mig-enabled: true
      mig-devices:
        "1c.4g.20gb": 4
        "3g.20gb": 0
    - devices: [5, 6]
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1
"#;

    #[test]
    fn imports_an_operator_style_file() {
        let layouts = import_mig_parted(OPERATOR_STYLE).unwrap();
        assert_eq!(
            layouts.keys().collect::<Vec<_>>(),
            [
                "all-1g.10gb",
                "all-1g.5gb",
                "all-1g.5gb.me",
                "all-balanced",
                "all-disabled",
                "all-enabled",
                "custom-config"
            ]
        );
        let defaults = default_layouts();
        assert_eq!(layouts["all-disabled"], defaults["all-disabled"]);
        assert_eq!(layouts["all-enabled"], defaults["all-enabled"]);
        assert_eq!(layouts["all-1g.10gb"], defaults["all-1g.10gb"]);

        let l = &layouts["all-1g.10gb"];
        assert_eq!(l.entries_for(0, 0x20F1.into())[0].profiles["1g.10gb"], 4);
        assert_eq!(l.entries_for(0, 0x2330.into())[0].profiles["1g.10gb"], 7);
        let b = &layouts["all-balanced"];
        assert_eq!(b.entries[0].device_filter, [0x20B7]);
        assert_eq!(b.entries[1].device_filter, [0x20B0, 0x20B1, 0x20F1, 0x20F6]);

        let c = &layouts["custom-config"];
        assert_eq!(c.entries[0].devices, DeviceSelector::Indices(vec![0, 1, 2, 3]));
        assert!(!c.entries[0].mig_enabled && c.entries[0].profiles.is_empty());
        // The 0 count is dropped.
        assert_eq!(c.entries[1].profiles, BTreeMap::from([("1c.4g.20gb".to_owned(), 4)]));
        assert_eq!(c.entry_for(6, 0x20B0.into()).unwrap().profiles.len(), 3);
        assert!(c.entries_for(7, 0x20B0.into()).is_empty());
    }

    #[test]
    fn toml_round_trip() {
        let layouts = import_mig_parted(OPERATOR_STYLE).unwrap();
        let text = to_toml(&layouts);
        assert!(
            text.starts_with("[[mig.layouts.\"all-1g.10gb\"]]\ndevices = \"all\"\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "[[mig.layouts.custom-config]]\ndevices = [4]\nmig_enabled = true\nprofiles = { \"1c.4g.20gb\" = 4 }\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("[[mig.layouts.all-disabled]]\ndevices = \"all\"\nmig_enabled = false\n\n"),
            "{text}"
        );
        assert!(
            text.contains("[[mig.layouts.all-enabled]]\ndevices = \"all\"\nmig_enabled = true\nprofiles = {}\n"),
            "{text}"
        );
        let config = Config::from_sources(&[Source::new("10-imported.toml", text.clone())])
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(config.mig.layouts, layouts);

        // The built-in layouts survive the same trip, and so does the effective config.
        let defaults = default_layouts();
        let config = Config::from_sources(&[Source::new("d.toml", to_toml(&defaults))]).unwrap();
        assert_eq!(config.mig.layouts, defaults);
        let effective = toml::to_string(&config).unwrap();
        let again = Config::from_sources(&[Source::new("effective", effective)]).unwrap();
        assert_eq!(again, config);
    }

    /// The built-in fallback table ([`default_layouts`], for GPUs whose NVML lists no profiles)
    /// says what the Operator's own file says (the copy in tests/fixtures/mig/), both ways:
    /// each (name, device id) of the table has the file's counts, and each name of the file
    /// whose entry for a device id names only profiles the table lists for that id (beyond
    /// `all-balanced`) is in the table for it. Only the B300 and GB300 entries, newer than that copy, are not in it.
    #[test]
    fn the_fallback_table_is_the_operators_file() {
        let file = import_mig_parted(include_str!(
            "../../tests/fixtures/mig/gpu-operator-default-mig-parted-config.yaml"
        ))
        .expect("the Operator's file imports");
        let table = default_layouts();
        let newer = [0x3182, 0x31C2];
        let mut compared = 0;
        for (name, layout) in &table {
            for entry in &layout.entries {
                for id in &entry.device_filter {
                    let in_file = file.get(name).and_then(|l| l.entry_for(0, id.device.into()));
                    if newer.contains(&id.device) {
                        assert!(in_file.is_none(), "{name} {id}: now in the file");
                        continue;
                    }
                    let in_file = in_file.unwrap_or_else(|| panic!("{name} {id}: not in the Operator's file"));
                    assert_eq!(in_file.profiles, entry.profiles, "{name} {id}");
                    compared += 1;
                }
            }
        }
        // Every name of the file is in the table but the GB200-only ones (the table has only
        // GB200's all-balanced: its other profiles are not known from a real listing).
        let gb200_only = [
            "all-1g.47gb",
            "all-2g.47gb",
            "all-3g.93gb",
            "all-3g.95gb",
            "all-4g.93gb",
            "all-4g.95gb",
            "all-7g.186gb",
            "all-7g.189gb",
        ];
        let missing: Vec<&String> = file.keys().filter(|n| !table.contains_key(*n)).collect();
        assert_eq!(missing, gb200_only);
        assert!(table.keys().all(|n| file.contains_key(n)));
        assert!(compared > 100, "{compared}");
    }

    /// mig-parted v0.15's subsystem filters are kept, and matched on the subsystem as well.
    #[test]
    fn subsystem_device_filters_import() {
        let layouts = import_mig_parted(
            "version: v1\nmig-configs:\n  boards:\n    - devices: all\n      device-filter: [\"0x233010DE:0x16C110DE\", \
             \"0x2330\"]\n      mig-enabled: true\n      mig-devices: {\"7g.80gb\": 1}\n    - devices: all\n      \
             device-filter: \"0x233010DE:0x16C010DE\"\n      mig-enabled: false\n",
        );
        // "0x2330" is not a 32-bit id with NVIDIA's vendor: refused as mig-parted would.
        assert!(layouts.is_err());
        let text = "version: v1\nmig-configs:\n  boards:\n    - devices: all\n      device-filter: \
                    \"0x233010DE:0x16C110DE\"\n      mig-enabled: true\n      mig-devices: {\"7g.80gb\": 1}\n    - \
                    devices: all\n      device-filter: \"0x233010DE:0x16C010DE\"\n      mig-enabled: false\n";
        let layouts = import_mig_parted(text).unwrap();
        let boards = &layouts["boards"];
        assert!(boards.overrides().is_empty(), "two boards do not overlap");
        let board = |subsystem| GpuPciIds {
            device: 0x2330,
            subsystem,
        };
        assert!(boards.entry_for(0, board(0x16C1_10DE)).unwrap().mig_enabled);
        assert!(!boards.entry_for(0, board(0x16C0_10DE)).unwrap().mig_enabled);
        assert!(boards.entry_for(0, board(0)).is_none());
        // And they survive the trip through the config's TOML.
        let toml = to_toml(&layouts);
        assert!(toml.contains("device_filter = [\"0x2330:0x16C110DE\"]"), "{toml}");
        let config =
            Config::from_sources(&[Source::new("i.toml", toml.clone())]).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        assert_eq!(config.mig.layouts, layouts);
    }

    /// `kubectl get configmap … -o yaml` output imports as the file it holds.
    #[test]
    fn a_config_map_imports_as_the_file_it_holds() {
        let file = "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: false\n";
        let indented: String = file.lines().map(|l| format!("    {l}\n")).collect();
        let cm = format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: custom-mig-config\ndata:\n  config.yaml: |\n{indented}"
        );
        assert_eq!(import_mig_parted(&cm).unwrap(), import_mig_parted(file).unwrap());
        let other_key = cm.replace("config.yaml:", "mig.yaml:");
        assert_eq!(import_mig_parted(&other_key).unwrap(), import_mig_parted(file).unwrap());
        let two_keys = format!("{other_key}  other.yaml: \"x\"\n");
        assert_eq!(
            err(&two_keys),
            "data: no config.yaml among the ConfigMap's keys (mig.yaml, other.yaml); import the one that holds \
             the mig-parted file on its own"
        );
        assert_eq!(
            err("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"),
            "data: a ConfigMap without data: expected data.\"config.yaml\" holding a mig-parted file"
        );
    }

    #[test]
    fn json_is_yaml_too() {
        let layouts = import_mig_parted(
            r#"{"version": "v1", "mig-configs": {"x": [{"devices": [0], "mig-enabled": true, "mig-devices": {"7g.80gb": 1}}]}}"#,
        )
        .unwrap();
        assert_eq!(layouts["x"].entries[0].profiles["7g.80gb"], 1);
        // YAML 1.1 booleans, as mig-parted's parser reads them.
        let layouts =
            import_mig_parted("version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: no\n").unwrap();
        assert!(!layouts["x"].entries[0].mig_enabled);
    }

    fn err(yaml: &str) -> String {
        import_mig_parted(yaml).expect_err("accepted").to_string()
    }

    fn one(entry: &str) -> String {
        err(&format!("version: v1\nmig-configs:\n  custom:\n{entry}"))
    }

    #[test]
    fn top_level_errors() {
        assert!(err("version: v1\nmig-configs: [\n").starts_with("not valid YAML: "));
        assert_eq!(
            err(""),
            "expected a mapping with version and mig-configs, found nothing"
        );
        assert_eq!(
            err("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false}]}\nhooks: {}\n"),
            "hooks: unexpected field; expected version and mig-configs"
        );
        assert!(err("apiVersion: v1\nkind: Secret\ndata: {}\n").contains("looks like a Kubernetes object"),);
        assert_eq!(
            err("mig-configs: {a: [{devices: all, mig-enabled: false}]}\n"),
            "version: missing; expected version: v1"
        );
        assert_eq!(
            err("version: v2\nmig-configs: {a: [{devices: all, mig-enabled: false}]}\n"),
            "version: unknown version \"v2\", expected v1"
        );
        assert_eq!(err("version: v1\n"), "mig-configs: missing");
        assert_eq!(
            err("version: v1\nmig-configs: {}\n"),
            "mig-configs: expected at least one config"
        );
        assert_eq!(
            err("version: v1\nmig-configs:\n  a: []\n"),
            "config \"a\": expected at least one entry"
        );
        assert_eq!(
            err("version: v1\nmig-configs:\n  a: {devices: all}\n"),
            "config \"a\": expected a list of entries, found a mapping"
        );
        assert!(
            err("version: v1\nmig-configs:\n  \"-bad\": [{devices: all, mig-enabled: false}]\n")
                .starts_with("config \"-bad\": the name is selected by a node label: ")
        );
    }

    #[test]
    fn entry_errors_name_config_entry_and_field() {
        assert_eq!(
            one("    - devices: all\n      mig-enabled: false\n    - devices: all\n      mig-enable: true\n"),
            "config \"custom\", entry 1, mig-enable: unexpected field; expected one of device-filter, devices, \
             mig-enabled, mig-devices"
        );
        assert_eq!(
            one("    - mig-enabled: false\n"),
            "config \"custom\", entry 0, devices: missing; expected \"all\" or a list of GPU indices"
        );
        assert_eq!(
            one("    - devices: some\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, devices: \"some\": expected \"all\" or a list of GPU indices"
        );
        assert_eq!(
            one("    - devices: [0, -1]\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, devices[1]: -1: expected \"all\" or a list of GPU indices"
        );
        assert_eq!(
            one("    - devices: [0, 0]\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, devices[1]: GPU 0 is listed twice"
        );
        assert_eq!(
            one("    - devices: all\n"),
            "config \"custom\", entry 0, mig-enabled: missing; expected true or false"
        );
        assert_eq!(
            one("    - devices: all\n      mig-enabled: maybe\n"),
            "config \"custom\", entry 0, mig-enabled: \"maybe\": expected true or false"
        );
        assert_eq!(
            one("    - devices: all\n      mig-enabled: true\n"),
            "config \"custom\", entry 0, mig-devices: missing; required when mig-enabled is true ({} for no MIG \
             devices)"
        );
        assert_eq!(
            one("    - devices: all\n      mig-enabled: false\n      mig-devices: {\"1g.5gb\": 7}\n"),
            "config \"custom\", entry 0, mig-devices: must be empty when mig-enabled is false"
        );
        assert!(
            one("    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5\": 7}\n")
                .starts_with("config \"custom\", entry 0, mig-devices[\"1g.5\"]: \"1g.5\" is not a MIG profile name")
        );
        assert_eq!(
            one("    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": -1}\n"),
            "config \"custom\", entry 0, mig-devices[\"1g.5gb\"]: -1: expected a count, an integer of at least 0"
        );
        assert_eq!(
            one("    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": 0, \"2g.10gb\": 0}\n"),
            "config \"custom\", entry 0, mig-devices: every count is 0; at least one must be greater than 0"
        );
        assert_eq!(
            one("    - devices: all\n      device-filter: [\"0x20B010DE\", \"0x20B0\"]\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, device-filter[1]: \"0x20B0\": 0x000020B0 has vendor id 0x20B0, not \
             NVIDIA's 0x10DE; expected 0x<device id>10DE, e.g. \"0x20B010DE\""
        );
        assert_eq!(
            one("    - devices: all\n      device-filter: \"0x20B010DE:0x134F10DE:0x1\"\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, device-filter: \"0x20B010DE:0x134F10DE:0x1\": more than one ':'; expected a \
             32-bit device and vendor id such as \"0x20B010DE\", perhaps followed by :<subsystem id> such as \
             \"0x25B610DE:0x14A910DE\""
        );
        assert!(
            one("    - devices: all\n      device-filter: \"0x20B010DE:A100\"\n      mig-enabled: false\n")
                .starts_with(
                    "config \"custom\", entry 0, device-filter: \"0x20B010DE:A100\": the subsystem id \"A100\""
                )
        );
        assert_eq!(
            one("    - devices: all\n      device-filter: 548409566\n      mig-enabled: false\n"),
            "config \"custom\", entry 0, device-filter: 548409566: expected a device id string such as \
             \"0x20B010DE\""
        );
        // "devices: all, then an override for [1]" imports: the last entry wins, as in mig-parted.
        let overriding = import_mig_parted(
            "version: v1\nmig-configs:\n  custom:\n    - devices: all\n      mig-enabled: false\n    \
             - devices: [1]\n      mig-enabled: true\n      mig-devices: {}\n",
        )
        .unwrap();
        assert_eq!(
            overriding["custom"].entry_for(1, 0x20B0.into()),
            Some(&overriding["custom"].entries[1])
        );
    }

    /// One config that cannot be imported no longer costs the others: they are imported, and it
    /// is named with its reason.
    #[test]
    fn what_fits_is_imported_and_the_rest_named() {
        let text = "version: v1\nmig-configs:\n  good:\n    - devices: all\n      mig-enabled: false\n  \
                    bad:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"1g.5gb\": -1\n  \
                    also-good:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {}\n";
        let (layouts, refused) = import_what_fits(text).unwrap();
        assert_eq!(layouts.keys().collect::<Vec<_>>(), ["also-good", "good"]);
        assert_eq!(refused.len(), 1);
        assert!(
            refused[0]
                .to_string()
                .starts_with("config \"bad\", entry 0, mig-devices"),
            "{}",
            refused[0]
        );
        // The strict form refuses the file with that reason.
        assert_eq!(import_mig_parted(text).unwrap_err(), refused[0]);
        // A file-level error is still the whole answer.
        assert!(import_what_fits("version: v2\nmig-configs: {}\n").is_err());
    }

    #[test]
    fn decimal_device_filters_as_go_parses_them() {
        // 0x20B010DE in decimal.
        let l = import_mig_parted(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      device-filter: \"548409566\"\n      mig-enabled: false\n",
        )
        .unwrap();
        assert_eq!(l["a"].entries[0].device_filter, [0x20B0]);
    }
}
