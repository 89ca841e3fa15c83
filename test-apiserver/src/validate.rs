//! The API server's validation of label and annotation maps and of core/v1 Events
//! (apimachinery `IsQualifiedName`, `IsValidLabelValue`, `IsDNS1123Subdomain`).

use serde_json::{Map, Value};

use crate::status::Cause;

const QUALIFIED_NAME_MAX: usize = 63;
const LABEL_VALUE_MAX: usize = 63;
const DNS1123_SUBDOMAIN_MAX: usize = 253;
const ANNOTATIONS_MAX_BYTES: usize = 256 * 1024;

const QUALIFIED_NAME_FMT: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end \
     with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is \
     '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_FMT: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', \
     '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or \
     '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const DNS1123_SUBDOMAIN_FMT: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
     characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex \
     used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

const DNS1123_LABEL_MAX: usize = 63;
const DNS1123_LABEL_FMT: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or \
     '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for \
     validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const C_IDENTIFIER_FMT: &str = "a valid C identifier must start with alphabetic character or '_', followed by a \
     string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for \
     validation is '[A-Za-z_][A-Za-z0-9_]*')";

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
fn is_dns1123_label_syntax(label: &str) -> bool {
    let b = label.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty() && alnum(&b[0]) && alnum(&b[b.len() - 1]) && b.iter().all(|c| alnum(c) || *c == b'-')
}

/// apimachinery `IsDNS1123Label`.
pub(crate) fn dns1123_label_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > DNS1123_LABEL_MAX {
        errs.push(format!("must be no more than {DNS1123_LABEL_MAX} characters"));
    }
    if !is_dns1123_label_syntax(s) {
        errs.push(DNS1123_LABEL_FMT.to_owned());
    }
    errs
}

/// apimachinery `IsCIdentifier` (no length limit of its own).
pub(crate) fn c_identifier_errors(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let ok = !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
    if ok {
        Vec::new()
    } else {
        vec![C_IDENTIFIER_FMT.to_owned()]
    }
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*`
fn is_dns1123_subdomain_syntax(s: &str) -> bool {
    s.split('.').all(is_dns1123_label_syntax)
}

pub(crate) fn dns1123_subdomain_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > DNS1123_SUBDOMAIN_MAX {
        errs.push(format!("must be no more than {DNS1123_SUBDOMAIN_MAX} characters"));
    }
    if !is_dns1123_subdomain_syntax(s) {
        errs.push(DNS1123_SUBDOMAIN_FMT.to_owned());
    }
    errs
}

/// apimachinery `IsQualifiedName`: `[prefix/]name`.
pub(crate) fn qualified_name_errors(key: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = key.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_owned());
            } else {
                errs.extend(
                    dns1123_subdomain_errors(prefix)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            *name
        }
        _ => {
            errs.push(format!(
                "a qualified name {QUALIFIED_NAME_FMT} with an optional DNS subdomain prefix and '/' \
                 (e.g. 'example.com/MyName')"
            ));
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_owned());
    } else if name.len() > QUALIFIED_NAME_MAX {
        errs.push(format!(
            "name part must be no more than {QUALIFIED_NAME_MAX} characters"
        ));
    }
    if !name.is_empty() && !is_name_part(name) {
        errs.push(format!("name part {QUALIFIED_NAME_FMT}"));
    }
    errs
}

pub(crate) fn label_value_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > LABEL_VALUE_MAX {
        errs.push(format!("must be no more than {LABEL_VALUE_MAX} characters"));
    }
    if !value.is_empty() && !is_name_part(value) {
        errs.push(LABEL_VALUE_FMT.to_owned());
    }
    errs
}

/// Validates `metadata.labels`; the map holds strings only (checked before).
pub(crate) fn labels(map: &Map<String, Value>) -> Vec<Cause> {
    let mut causes = Vec::new();
    for (key, value) in map {
        for msg in qualified_name_errors(key) {
            causes.push(Cause::invalid("metadata.labels", key, &msg));
        }
        let value = value.as_str().unwrap_or_default();
        for msg in label_value_errors(value) {
            causes.push(Cause::invalid("metadata.labels", value, &msg));
        }
    }
    causes
}

/// Validates `metadata.annotations`: keys are qualified names (checked lower-cased), 256 KiB total.
pub(crate) fn annotations(map: &Map<String, Value>) -> Vec<Cause> {
    let mut causes = Vec::new();
    let mut total = 0;
    for (key, value) in map {
        for msg in qualified_name_errors(&key.to_lowercase()) {
            causes.push(Cause::invalid("metadata.annotations", key, &msg));
        }
        total += key.len() + value.as_str().map_or(0, str::len);
    }
    if total > ANNOTATIONS_MAX_BYTES {
        causes.push(Cause::too_long(
            "metadata.annotations",
            &format!("must have at most {ANNOTATIONS_MAX_BYTES} bytes"),
        ));
    }
    causes
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for p in path {
        match cur.get(p) {
            Some(next) => cur = next,
            None => return "",
        }
    }
    cur.as_str().unwrap_or_default()
}

/// core/v1 Event create validation (the legacy Event rules of the API server).
pub(crate) fn event(ev: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    let name = str_at(ev, &["metadata", "name"]);
    if name.is_empty() {
        causes.push(Cause::required("metadata.name", "name or generateName is required"));
    } else {
        for msg in dns1123_subdomain_errors(name) {
            causes.push(Cause::invalid("metadata.name", name, &msg));
        }
    }
    let ns = str_at(ev, &["metadata", "namespace"]);
    let involved_ns = str_at(ev, &["involvedObject", "namespace"]);
    let event_time_zero = ev
        .get("eventTime")
        .is_none_or(|t| t.is_null() || t.as_str() == Some(""));
    let mismatch = || {
        Cause::invalid(
            "involvedObject.namespace",
            involved_ns,
            "does not match event.namespace",
        )
    };
    if event_time_zero {
        if involved_ns.is_empty() {
            if !ns.is_empty() && ns != "default" {
                causes.push(mismatch());
            }
        } else if ns != involved_ns {
            causes.push(mismatch());
        }
    } else {
        if involved_ns.is_empty() && ns != "default" && ns != "kube-system" {
            causes.push(mismatch());
        }
        let controller = str_at(ev, &["reportingComponent"]);
        if controller.is_empty() {
            causes.push(Cause::required("reportingComponent", ""));
        } else {
            for msg in qualified_name_errors(controller) {
                causes.push(Cause::invalid("reportingComponent", controller, &msg));
            }
        }
        for (field, limit) in [("reportingInstance", 128), ("action", 128), ("reason", 128)] {
            let v = str_at(ev, &[field]);
            if v.is_empty() {
                causes.push(Cause::required(field, ""));
            } else if v.len() > limit {
                causes.push(Cause::invalid(
                    field,
                    "",
                    &format!("can have at most {limit} characters"),
                ));
            }
        }
        if str_at(ev, &["message"]).len() > 1024 {
            causes.push(Cause::invalid("message", "", "can have at most 1024 characters"));
        }
    }
    for msg in dns1123_subdomain_errors(ns) {
        causes.push(Cause::invalid("namespace", ns, &msg));
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_names() {
        for ok in ["a", "nvidia.com/gpu.present", "A_b-c.d", "x/y", &"a".repeat(63)] {
            assert!(qualified_name_errors(ok).is_empty(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a b",
            "/a",
            "a/",
            "a/b/c",
            "Upper.com/x",
            &"a".repeat(64),
            "a..b/c",
        ] {
            assert!(!qualified_name_errors(bad).is_empty(), "{bad:?}");
        }
        let long_prefix = format!("{}/x", "a".repeat(254));
        assert!(!qualified_name_errors(&long_prefix).is_empty());
    }

    #[test]
    fn dns_labels_and_c_identifiers() {
        for ok in ["gpu-0", "gpu-0-mig-9-4-4", "0", &"a".repeat(63)] {
            assert!(dns1123_label_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"a".repeat(64)] {
            assert!(!dns1123_label_errors(bad).is_empty(), "{bad:?}");
        }
        for ok in ["a", "_", "memory", "cudaComputeCapability", "A_1"] {
            assert!(c_identifier_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["", "1a", "a-b", "a.b", "a b"] {
            assert!(!c_identifier_errors(bad).is_empty(), "{bad:?}");
        }
    }

    #[test]
    fn label_values() {
        for ok in ["", "true", "A100-SXM4-40GB", "1.2_3", &"v".repeat(63)] {
            assert!(label_value_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["-x", "x-", "a b", "a/b", &"v".repeat(64)] {
            assert!(!label_value_errors(bad).is_empty(), "{bad:?}");
        }
    }
}
