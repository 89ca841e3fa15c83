//! resource.k8s.io/v1 (DRA): what the API server's decoder rejects in a ResourceSlice (400),
//! the ResourceSlice validation of `pkg/apis/resource/validation` (422), Kubernetes quantities
//! and semver 2.0.0 versions.

use serde_json::Value;

use crate::status::{ApiError, Cause};
use crate::validate::{c_identifier_errors, dns1123_label_errors, dns1123_subdomain_errors};

pub(crate) const GROUP: &str = "resource.k8s.io";
pub(crate) const API_VERSION: &str = "resource.k8s.io/v1";
/// The group-qualified resources, as upstream names them in Status messages.
pub(crate) const SLICES: &str = "resourceslices.resource.k8s.io";
pub(crate) const CLAIMS: &str = "resourceclaims.resource.k8s.io";

const DRIVER_NAME_MAX: usize = 63;
const POOL_NAME_MAX: usize = 253;
const MAX_DEVICES: usize = 128;
const MAX_DEVICES_WITH_TAINTS_OR_COUNTERS: usize = 64;
const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
const ATTRIBUTE_VALUE_MAX: usize = 64;
const ID_MAX: usize = 32;
const MAX_COUNTER_SETS: usize = 8;
/// Map keys longer than this are shortened in field paths (`DeviceMaxDomainLength + 1 + DeviceMaxIDLength`).
const KEY_PATH_MAX: usize = 63 + 1 + 32;

const QUANTITY_FORMAT: &str =
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";
const QUANTITY_SUFFIX: &str = "unable to parse quantity's suffix";

// ----- quantities and versions -----

/// `resource.ParseQuantity`: `<sign?><digits>[.<digits>]<suffix>`, the suffix one of the
/// decimal SI (`n u m k M G T P E` or none), binary SI (`Ki` … `Ei`) or `e<int>`/`E<int>`.
/// Stricter than upstream only for a bare sign (`"-"`), which upstream reads as 0.
pub(crate) fn parse_quantity(s: &str) -> Result<(), &'static str> {
    let b = s.as_bytes();
    let digits_from = |from: usize| (from..b.len()).find(|&i| !b[i].is_ascii_digit()).unwrap_or(b.len());
    let mut pos = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int_end = digits_from(pos);
    let mut digits = int_end - pos;
    pos = int_end;
    if b.get(pos) == Some(&b'.') {
        let frac_end = digits_from(pos + 1);
        digits += frac_end - pos - 1;
        pos = frac_end;
    }
    if digits == 0 {
        return Err(QUANTITY_FORMAT);
    }
    // Everything before `pos` is ASCII, so `pos` is a char boundary.
    let suffix = &s[pos..];
    let sb = suffix.as_bytes();
    let mut i = 0;
    while i < sb.len() && b"eEinumkKMGTP".contains(&sb[i]) {
        i += 1;
    }
    if matches!(sb.get(i), Some(b'+' | b'-')) {
        i += 1;
    }
    while i < sb.len() && sb[i].is_ascii_digit() {
        i += 1;
    }
    if i < sb.len() {
        return Err(QUANTITY_FORMAT);
    }
    match suffix {
        "" | "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => Ok(()),
        // Exponent: `e`/`E` then a signed integer (all ASCII here, so slicing at 1 is safe).
        _ if sb.len() > 1 && matches!(sb[0], b'e' | b'E') && suffix[1..].parse::<i32>().is_ok() => Ok(()),
        _ => Err(QUANTITY_SUFFIX),
    }
}

/// The semver.org 2.0.0 grammar the API server checks versions with: `MAJOR.MINOR.PATCH`,
/// optional `-prerelease` and `+build` dot-separated identifiers, no leading zeros in numbers.
pub(crate) fn is_semver(s: &str) -> bool {
    let alnum_hyphen = |id: &str| !id.is_empty() && id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
    let numeric =
        |id: &str| id == "0" || (!id.starts_with('0') && !id.is_empty() && id.bytes().all(|c| c.is_ascii_digit()));
    let (rest, build) = match s.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|p| {
            p.split('.')
                .all(|id| alnum_hyphen(id) && (numeric(id) || !id.bytes().all(|c| c.is_ascii_digit())))
        })
        && build.is_none_or(|b| b.split('.').all(alnum_hyphen))
}

// ----- decoding (400) -----

#[derive(Clone, Copy)]
enum Ty {
    Str,
    Bool,
    Int,
    Obj,
    Arr,
}

fn what(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "bool".into(),
        Value::Number(n) => format!("number {n}"),
        Value::String(_) => "string".into(),
        Value::Array(_) => "array".into(),
        Value::Object(_) => "object".into(),
    }
}

/// `null` and absent fields decode to Go's zero value; anything else must have the JSON type.
fn check(v: Option<&Value>, ty: Ty, field: &str, go_type: &str) -> Result<(), String> {
    let Some(v) = v else { return Ok(()) };
    let ok = match (ty, v) {
        (_, Value::Null)
        | (Ty::Str, Value::String(_))
        | (Ty::Bool, Value::Bool(_))
        | (Ty::Obj, Value::Object(_))
        | (Ty::Arr, Value::Array(_)) => true,
        (Ty::Int, Value::Number(n)) => n.is_i64(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "json: cannot unmarshal {} into Go struct field ResourceSlice.{field} of type {go_type}",
            what(v)
        ))
    }
}

fn entries(v: Option<&Value>) -> impl Iterator<Item = (&String, &Value)> {
    v.and_then(Value::as_object).into_iter().flatten()
}

fn items(v: Option<&Value>) -> impl Iterator<Item = &Value> {
    v.and_then(Value::as_array).into_iter().flatten()
}

/// What the API server's JSON decoder refuses in a ResourceSlice before validation: wrong JSON
/// types for the fields it knows and capacities that are not quantities. 400 `BadRequest`.
pub(crate) fn decode_slice(obj: &Value) -> Result<(), ApiError> {
    decode_slice_fields(obj).map_err(|m| {
        ApiError::bad_request(format!(
            "ResourceSlice in version \"v1\" cannot be handled as a ResourceSlice: {m}"
        ))
    })
}

fn decode_slice_fields(obj: &Value) -> Result<(), String> {
    if !obj.is_object() {
        return Err(format!(
            "json: cannot unmarshal {} into Go value of type v1.ResourceSlice",
            what(obj)
        ));
    }
    check(obj.get("metadata"), Ty::Obj, "metadata", "v1.ObjectMeta")?;
    check(obj.get("spec"), Ty::Obj, "spec", "v1.ResourceSliceSpec")?;
    let Some(spec) = obj.get("spec") else { return Ok(()) };
    for (field, ty, go_type) in [
        ("driver", Ty::Str, "string"),
        ("nodeName", Ty::Str, "string"),
        ("nodeSelector", Ty::Obj, "v1.NodeSelector"),
        ("allNodes", Ty::Bool, "bool"),
        ("perDeviceNodeSelection", Ty::Bool, "bool"),
        ("pool", Ty::Obj, "v1.ResourcePool"),
        ("devices", Ty::Arr, "[]v1.Device"),
        ("sharedCounters", Ty::Arr, "[]v1.CounterSet"),
    ] {
        check(spec.get(field), ty, &format!("spec.{field}"), go_type)?;
    }
    if let Some(pool) = spec.get("pool") {
        check(pool.get("name"), Ty::Str, "spec.pool.name", "string")?;
        check(pool.get("generation"), Ty::Int, "spec.pool.generation", "int64")?;
        check(
            pool.get("resourceSliceCount"),
            Ty::Int,
            "spec.pool.resourceSliceCount",
            "int64",
        )?;
    }
    for set in items(spec.get("sharedCounters")) {
        check(Some(set), Ty::Obj, "spec.sharedCounters", "v1.CounterSet")?;
        check(set.get("name"), Ty::Str, "spec.sharedCounters.name", "string")?;
        check(
            set.get("counters"),
            Ty::Obj,
            "spec.sharedCounters.counters",
            "map[string]v1.Counter",
        )?;
        for (_, counter) in entries(set.get("counters")) {
            check(Some(counter), Ty::Obj, "spec.sharedCounters.counters", "v1.Counter")?;
            decode_quantity(counter.get("value"))?;
        }
    }
    for device in items(spec.get("devices")) {
        check(Some(device), Ty::Obj, "spec.devices", "v1.Device")?;
        for (field, ty, go_type) in [
            ("name", Ty::Str, "string"),
            ("attributes", Ty::Obj, "map[v1.QualifiedName]v1.DeviceAttribute"),
            ("capacity", Ty::Obj, "map[v1.QualifiedName]v1.DeviceCapacity"),
            ("nodeName", Ty::Str, "string"),
            ("nodeSelector", Ty::Obj, "v1.NodeSelector"),
            ("allNodes", Ty::Bool, "bool"),
            ("taints", Ty::Arr, "[]v1.DeviceTaint"),
            ("consumesCounters", Ty::Arr, "[]v1.DeviceCounterConsumption"),
            ("allowMultipleAllocations", Ty::Bool, "bool"),
        ] {
            check(device.get(field), ty, &format!("spec.devices.{field}"), go_type)?;
        }
        for (_, attr) in entries(device.get("attributes")) {
            check(Some(attr), Ty::Obj, "spec.devices.attributes", "v1.DeviceAttribute")?;
            for (field, ty, go_type) in [
                ("int", Ty::Int, "int64"),
                ("bool", Ty::Bool, "bool"),
                ("string", Ty::Str, "string"),
                ("version", Ty::Str, "string"),
            ] {
                check(
                    attr.get(field),
                    ty,
                    &format!("spec.devices.attributes.{field}"),
                    go_type,
                )?;
            }
        }
        for (_, capacity) in entries(device.get("capacity")) {
            check(Some(capacity), Ty::Obj, "spec.devices.capacity", "v1.DeviceCapacity")?;
            decode_quantity(capacity.get("value"))?;
        }
    }
    Ok(())
}

/// `Quantity.UnmarshalJSON`: `null` is zero; a string is parsed without its quotes, any other
/// JSON value as its text (so `42` works and `true` does not).
fn decode_quantity(v: Option<&Value>) -> Result<(), String> {
    let text = match v {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(s)) => s.trim().to_owned(),
        Some(other) => other.to_string(),
    };
    parse_quantity(&text).map_err(str::to_owned)
}

// ----- validation (422) -----

fn str_of(v: Option<&Value>) -> &str {
    v.and_then(Value::as_str).unwrap_or_default()
}

/// Present and not `null` (a Go pointer that is set).
fn set(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null())
}

/// `ValidateCSIDriverName`, which DRA reuses for driver names and attribute domains. Upstream
/// lower-cases the name before the DNS-1123 check, so `GPU.example.com` passes.
fn driver_name(name: &str, path: &str, causes: &mut Vec<Cause>) {
    if name.is_empty() {
        causes.push(Cause::required(path, ""));
    }
    if name.len() > DRIVER_NAME_MAX {
        causes.push(Cause::too_long_bytes(path, DRIVER_NAME_MAX));
    }
    for msg in dns1123_subdomain_errors(&name.to_lowercase()) {
        causes.push(Cause::invalid(path, name, &msg));
    }
}

fn c_identifier(id: &str, path: &str, causes: &mut Vec<Cause>) {
    if id.len() > ID_MAX {
        causes.push(Cause::too_long_bytes(path, ID_MAX));
    }
    for msg in c_identifier_errors(id) {
        causes.push(Cause::invalid(path, id, &msg));
    }
}

/// An attribute or capacity name: a C identifier, or `<driver-like domain>/<C identifier>`.
/// Like upstream, a key with more than one `/` is not checked at all.
fn qualified_name(key: &str, path: &str, causes: &mut Vec<Cause>) {
    let parts: Vec<&str> = key.split('/').collect();
    match parts.as_slice() {
        [id] => c_identifier(id, path, causes),
        [domain, id] => {
            if domain.is_empty() {
                causes.push(Cause::invalid(path, "", "the domain must not be empty"));
            } else {
                driver_name(domain, path, causes);
            }
            if id.is_empty() {
                causes.push(Cause::invalid(path, "", "the name must not be empty"));
            } else {
                c_identifier(id, path, causes);
            }
        }
        _ => {}
    }
}

/// `truncateIfTooLong`: a long map key is shown as its head, `...` and its tail in field paths.
fn key_path(key: &str) -> String {
    if key.len() <= KEY_PATH_MAX {
        return key.to_owned();
    }
    let remaining = KEY_PATH_MAX - 3;
    let b = key.as_bytes();
    let head = String::from_utf8_lossy(&b[..remaining.div_ceil(2)]);
    let tail = String::from_utf8_lossy(&b[b.len() - remaining / 2..]);
    format!("{head}...{tail}")
}

fn pool_name(name: &str, path: &str, causes: &mut Vec<Cause>) {
    if name.is_empty() {
        causes.push(Cause::required(path, ""));
        return;
    }
    if name.len() > POOL_NAME_MAX {
        causes.push(Cause::too_long_bytes(path, POOL_NAME_MAX));
    }
    for part in name.split('/') {
        for msg in dns1123_subdomain_errors(part) {
            causes.push(Cause::invalid(path, part, &msg));
        }
    }
}

fn attribute(attr: &Value, path: &str, causes: &mut Vec<Cause>) {
    let mut values = 0;
    if set(attr.get("bool")).is_some() {
        values += 1;
    }
    if set(attr.get("int")).is_some() {
        values += 1;
    }
    if let Some(s) = set(attr.get("string")).and_then(Value::as_str) {
        values += 1;
        if s.len() > ATTRIBUTE_VALUE_MAX {
            causes.push(Cause::too_long_bytes(&format!("{path}.string"), ATTRIBUTE_VALUE_MAX));
        }
    }
    if let Some(v) = set(attr.get("version")).and_then(Value::as_str) {
        values += 1;
        let field = format!("{path}.version");
        if !is_semver(v) {
            causes.push(Cause::invalid(
                &field,
                v,
                "must be a string compatible with semver.org spec 2.0.0",
            ));
        }
        if v.len() > ATTRIBUTE_VALUE_MAX {
            causes.push(Cause::too_long_bytes(&field, ATTRIBUTE_VALUE_MAX));
        }
    }
    match values {
        0 => causes.push(Cause::invalid(path, "", "exactly one value must be specified")),
        1 => {}
        _ => causes.push(Cause::invalid_value(path, attr, "exactly one value must be specified")),
    }
}

fn device(device: &Value, path: &str, per_device_node_selection: bool, causes: &mut Vec<Cause>) {
    let name = str_of(device.get("name"));
    for msg in dns1123_label_errors(name) {
        causes.push(Cause::invalid(&format!("{path}.name"), name, &msg));
    }
    let attributes: Vec<(&String, &Value)> = entries(device.get("attributes")).collect();
    let capacity: Vec<(&String, &Value)> = entries(device.get("capacity")).collect();
    let total = attributes.len() + capacity.len();
    if total > MAX_ATTRIBUTES_AND_CAPACITIES {
        causes.push(Cause::invalid_value(
            path,
            &Value::from(total),
            &format!("the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}"),
        ));
    }
    for (key, attr) in attributes {
        let field = format!("{path}.attributes[{}]", key_path(key));
        qualified_name(key, &field, causes);
        attribute(attr, &field, causes);
    }
    let multiple = set(device.get("allowMultipleAllocations")).and_then(Value::as_bool) == Some(true);
    for (key, cap) in capacity {
        let field = format!("{path}.capacity[{}]", key_path(key));
        qualified_name(key, &field, causes);
        if !multiple && set(cap.get("requestPolicy")).is_some() {
            causes.push(Cause::forbidden(
                &format!("{field}.requestPolicy"),
                "allowMultipleAllocations must be true",
            ));
        }
    }
    let node_name = set(device.get("nodeName"));
    let node_selector = set(device.get("nodeSelector"));
    let all_nodes = set(device.get("allNodes"));
    if per_device_node_selection {
        let mut fields = Vec::new();
        if let Some(n) = node_name {
            let n = n.as_str().unwrap_or_default();
            let field = format!("{path}.nodeName");
            if n.is_empty() {
                causes.push(Cause::invalid(&field, n, "must not be empty"));
            } else {
                fields.push("`nodeName`");
                for msg in dns1123_subdomain_errors(n) {
                    causes.push(Cause::invalid(&field, n, &msg));
                }
            }
        }
        if node_selector.is_some() {
            fields.push("`nodeSelector`");
        }
        if let Some(all) = all_nodes {
            if all.as_bool() == Some(true) {
                fields.push("`allNodes`");
            } else {
                causes.push(Cause::invalid_value(
                    &format!("{path}.allNodes"),
                    all,
                    "must be either unset or set to true",
                ));
            }
        }
        const WHY: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when \
                           `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
        match fields.len() {
            0 => causes.push(Cause::required(path, WHY)),
            1 => {}
            _ => causes.push(Cause::invalid(path, &format!("{{{}}}", fields.join(", ")), WHY)),
        }
    } else if node_name.is_some() || node_selector.is_some() || all_nodes.is_some() {
        causes.push(Cause::invalid_value(
            path,
            &Value::Null,
            "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true \
             in the ResourceSlice spec",
        ));
    }
}

fn immutable(new: Option<&Value>, old: Option<&Value>, path: &str, causes: &mut Vec<Cause>) {
    let (new, old) = (set(new), set(old));
    if new != old {
        causes.push(Cause::invalid_value(
            path,
            new.unwrap_or(&Value::Null),
            "field is immutable",
        ));
    }
}

/// `ValidateResourceSlice` (create, `old` = `None`) and `ValidateResourceSliceUpdate`, after
/// [`decode_slice`] accepted the object. Metadata labels and annotations are checked elsewhere.
pub(crate) fn validate_slice(obj: &Value, old: Option<&Value>) -> Vec<Cause> {
    let mut causes = Vec::new();
    if old.is_none() {
        let name = str_of(obj.pointer("/metadata/name"));
        let generate = str_of(obj.pointer("/metadata/generateName"));
        if !generate.is_empty() {
            // Checked as a prefix: a trailing '-' is fine.
            let masked = generate
                .strip_suffix('-')
                .map_or_else(|| generate.to_owned(), |g| format!("{g}a"));
            for msg in dns1123_subdomain_errors(&masked) {
                causes.push(Cause::invalid("metadata.generateName", generate, &msg));
            }
        }
        if name.is_empty() {
            causes.push(Cause::required("metadata.name", "name or generateName is required"));
        } else {
            for msg in dns1123_subdomain_errors(name) {
                causes.push(Cause::invalid("metadata.name", name, &msg));
            }
        }
    }
    let spec = set(obj.get("spec"));
    let field = |f: &str| spec.and_then(|s| s.get(f));
    let old_field = |f: &str| old.and_then(|o| o.get("spec")).and_then(|s| s.get(f));

    driver_name(str_of(field("driver")), "spec.driver", &mut causes);
    let pool = field("pool");
    pool_name(str_of(pool.and_then(|p| p.get("name"))), "spec.pool.name", &mut causes);
    let count = pool
        .and_then(|p| p.get("resourceSliceCount"))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if count <= 0 {
        causes.push(Cause::invalid_value(
            "spec.pool.resourceSliceCount",
            &Value::from(count),
            "must be greater than zero",
        ));
    }
    let generation = pool
        .and_then(|p| p.get("generation"))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if generation < 0 {
        causes.push(Cause::invalid_value(
            "spec.pool.generation",
            &Value::from(generation),
            "must be greater than or equal to zero",
        ));
    }
    if old.is_some() {
        let pool_name = |p: Option<&Value>| p.and_then(|p| p.get("name")).cloned().unwrap_or_default();
        immutable(
            Some(&pool_name(pool)),
            Some(&pool_name(old_field("pool"))),
            "spec.pool.name",
            &mut causes,
        );
        let driver = |d: Option<&Value>| d.cloned().unwrap_or(Value::String(String::new()));
        immutable(
            Some(&driver(field("driver"))),
            Some(&driver(old_field("driver"))),
            "spec.driver",
            &mut causes,
        );
        immutable(field("nodeName"), old_field("nodeName"), "spec.nodeName", &mut causes);
    }

    let mut node_fields = Vec::new();
    if let Some(node) = set(field("nodeName")) {
        let node = node.as_str().unwrap_or_default();
        if node.is_empty() {
            causes.push(Cause::invalid(
                "spec.nodeName",
                node,
                "must be either unset or set to a non-empty string",
            ));
        } else {
            node_fields.push("`nodeName`");
            for msg in dns1123_subdomain_errors(node) {
                causes.push(Cause::invalid("spec.nodeName", node, &msg));
            }
        }
    }
    if let Some(selector) = set(field("nodeSelector")) {
        node_fields.push("`nodeSelector`");
        let terms = selector.get("nodeSelectorTerms").cloned().unwrap_or(Value::Null);
        if terms.as_array().map_or(0, Vec::len) != 1 {
            causes.push(Cause::invalid_value(
                "spec.nodeSelector.nodeSelectorTerms",
                &terms,
                "must have exactly one node selector term",
            ));
        }
    }
    for flag in ["allNodes", "perDeviceNodeSelection"] {
        if let Some(v) = set(field(flag)) {
            if v.as_bool() == Some(true) {
                node_fields.push(if flag == "allNodes" {
                    "`allNodes`"
                } else {
                    "`perDeviceNodeSelection`"
                });
            } else {
                causes.push(Cause::invalid_value(
                    &format!("spec.{flag}"),
                    v,
                    "must be either unset or set to true",
                ));
            }
        }
    }
    const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
    match node_fields.len() {
        0 => causes.push(Cause::required("spec", ONE_OF)),
        1 => {}
        _ => causes.push(Cause::invalid(
            "spec",
            &format!("{{{}}}", node_fields.join(", ")),
            &format!("{ONE_OF}, but multiple fields are set"),
        )),
    }

    let devices = set(field("devices"));
    let counters = set(field("sharedCounters"));
    if devices.is_some() && counters.is_some() {
        causes.push(Cause::invalid(
            "spec",
            "",
            "only one of `sharedCounters` or `devices` is allowed",
        ));
    }
    let devices: Vec<&Value> = items(devices).collect();
    let nonempty = |d: &Value, f: &str| d.get(f).and_then(Value::as_array).is_some_and(|a| !a.is_empty());
    let max = if devices
        .iter()
        .any(|d| nonempty(d, "taints") || nonempty(d, "consumesCounters"))
    {
        MAX_DEVICES_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES
    };
    if devices.len() > max {
        causes.push(Cause::too_many("spec.devices", devices.len(), max));
    } else {
        let per_device = set(field("perDeviceNodeSelection")).and_then(Value::as_bool) == Some(true);
        for (i, d) in devices.iter().enumerate() {
            device(d, &format!("spec.devices[{i}]"), per_device, &mut causes);
        }
        let mut seen = std::collections::HashSet::new();
        for (i, d) in devices.iter().enumerate() {
            let name = str_of(d.get("name"));
            if !seen.insert(name) {
                causes.push(Cause::duplicate(&format!("spec.devices[{i}]"), name));
            }
        }
    }

    let counter_sets: Vec<&Value> = items(counters).collect();
    if counter_sets.len() > MAX_COUNTER_SETS {
        causes.push(Cause::too_many(
            "spec.sharedCounters",
            counter_sets.len(),
            MAX_COUNTER_SETS,
        ));
    } else {
        let mut seen = std::collections::HashSet::new();
        for (i, set_) in counter_sets.iter().enumerate() {
            let name = str_of(set_.get("name"));
            let field = format!("spec.sharedCounters[{i}].name");
            if name.is_empty() {
                causes.push(Cause::required(&field, ""));
            } else {
                for msg in dns1123_label_errors(name) {
                    causes.push(Cause::invalid(&field, name, &msg));
                }
            }
            if !seen.insert(name) {
                causes.push(Cause::duplicate(&format!("spec.sharedCounters[{i}]"), name));
            }
        }
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in [
            "80Gi", "1", "81920Mi", "42", "0", "1.5", ".5", "1.", "-1", "+2k", "100m", "1e3", "1E-3", "5E", "12Ki",
            "000",
        ] {
            assert_eq!(parse_quantity(ok), Ok(()), "{ok}");
        }
        for bad in ["", "-", ".", "abc", "80GB", "1KiB", "1 Gi", "Gi", "1.2.3"] {
            assert_eq!(parse_quantity(bad), Err(QUANTITY_FORMAT), "{bad:?}");
        }
        for bad in ["1ki", "1i", "5e", "1e-", "1Gii", "1mm"] {
            assert_eq!(parse_quantity(bad), Err(QUANTITY_SUFFIX), "{bad:?}");
        }
    }

    #[test]
    fn semver() {
        for ok in [
            "8.0.0",
            "550.54.15",
            "0.0.0",
            "1.2.3-alpha.1",
            "1.2.3-0a",
            "1.2.3-x-y",
            "1.2.3+build.01",
            "1.2.3-rc.0+exp.sha.5114f85",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "8.0",
            "8",
            "v1.2.3",
            "01.2.3",
            "1.02.3",
            "1.2.03",
            "1.2.3-01",
            "1.2.3-",
            "1.2.3+",
            "1.2.3-a..b",
            "1.2.3+a+b",
            "1.2.3.4",
            "",
            "1.2.x",
        ] {
            assert!(!is_semver(bad), "{bad:?}");
        }
    }

    #[test]
    fn long_keys_are_shortened_in_paths() {
        let key = format!("{}/{}", "d".repeat(70), "x".repeat(40));
        let shown = key_path(&key);
        assert_eq!(shown.len(), KEY_PATH_MAX);
        assert!(shown.starts_with("ddd") && shown.ends_with("xxx") && shown.contains("..."));
        // Multi-byte characters at the cut do not panic.
        let _ = key_path(&"é".repeat(80));
    }
}
