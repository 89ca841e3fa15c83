//! The kubelet's checks on a `RegisterRequest` (resource name, version, endpoint).

/// The only device plugin API version the kubelet supports.
pub const SUPPORTED_VERSION: &str = "v1beta1";

/// Checks a resource name the way the kubelet's `IsExtendedResourceName` does: the name must
/// contain a `/` (be domain-prefixed), must not contain `kubernetes.io/` (native resources),
/// must not start with `requests.`, and `requests.<name>` must be a qualified name (DNS-1123
/// subdomain prefix of at most 253 characters, a `/`, then a name part of at most 63
/// characters of `[A-Za-z0-9_.-]` starting and ending alphanumeric).
pub fn check_extended_resource_name(name: &str) -> Result<(), String> {
    if !name.contains('/') {
        return Err(format!(
            "resource name {name:?} is not an extended resource name: it has no domain prefix"
        ));
    }
    if name.contains("kubernetes.io/") {
        return Err(format!(
            "resource name {name:?} is not an extended resource name: the kubernetes.io/ \
             domain is reserved for native resources"
        ));
    }
    if name.starts_with("requests.") {
        return Err(format!(
            "resource name {name:?} is not an extended resource name: it starts with requests."
        ));
    }
    let quota = format!("requests.{name}");
    check_qualified_name(&quota)
        .map_err(|why| format!("resource name {name:?} is not an extended resource name: {why}"))
}

fn check_qualified_name(value: &str) -> Result<(), String> {
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                return Err("the prefix part must be non-empty".into());
            }
            check_dns1123_subdomain(prefix)?;
            *name
        }
        _ => return Err("a qualified name has at most one '/'".into()),
    };
    if name.is_empty() {
        return Err("the name part must be non-empty".into());
    }
    if name.len() > 63 {
        return Err(format!("the name part {name:?} is longer than 63 characters"));
    }
    let b = name.as_bytes();
    let alnum = |c: u8| c.is_ascii_alphanumeric();
    if !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return Err(format!(
            "the name part {name:?} must start and end with an alphanumeric character"
        ));
    }
    if let Some(c) = b.iter().find(|&&c| !(alnum(c) || c == b'-' || c == b'_' || c == b'.')) {
        return Err(format!(
            "the name part {name:?} contains {:?}; allowed are alphanumerics, '-', '_' and '.'",
            *c as char
        ));
    }
    Ok(())
}

fn check_dns1123_subdomain(s: &str) -> Result<(), String> {
    if s.len() > 253 {
        return Err(format!("the prefix {s:?} is longer than 253 characters"));
    }
    if !dns1123_labels(s) {
        return Err(format!(
            "the prefix {s:?} is not a DNS-1123 subdomain (lowercase alphanumerics, '-' \
             and '.', each label starting and ending alphanumeric)"
        ));
    }
    Ok(())
}

/// Whether every `.`-separated label of `s` is a DNS-1123 label: lowercase alphanumerics and
/// '-', starting and ending alphanumeric (lengths are the caller's to check).
pub(crate) fn dns1123_labels(s: &str) -> bool {
    s.split('.').all(|label| {
        let b = label.as_bytes();
        !b.is_empty()
            && b.iter()
                .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    })
}

/// The endpoint must be a plain socket file name inside the device plugin directory.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if endpoint.is_empty() {
        return Err("endpoint is empty".into());
    }
    if endpoint.contains('/') || endpoint == "." || endpoint == ".." || endpoint.contains('\0') {
        return Err(format!(
            "endpoint {endpoint:?} is not a plain file name in the device plugin directory"
        ));
    }
    Ok(())
}

pub fn check_version(version: &str) -> Result<(), String> {
    if version != SUPPORTED_VERSION {
        return Err(format!(
            "requested device plugin API version {version:?} is not supported by kubelet; \
             supported versions are [\"{SUPPORTED_VERSION}\"]"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        for ok in [
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/gpu.shared",
            "example.com/A_b-9",
            "a/b",
        ] {
            assert!(check_extended_resource_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "gpu",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "requests.nvidia.com/gpu",
            "nvidia.com/",
            "/gpu",
            "Nvidia.com/gpu",
            "nvidia.com/gpu/x",
            "nvidia.com/-gpu",
            "nvidia.com/g pu",
            "nvidia..com/gpu",
            &format!("nvidia.com/{}", "g".repeat(64)),
        ] {
            assert!(check_extended_resource_name(bad).is_err(), "{bad}");
        }
        assert!(check_extended_resource_name(&format!("nvidia.com/{}", "g".repeat(63))).is_ok());
    }

    #[test]
    fn endpoints_and_versions() {
        assert!(check_endpoint("nvidia-gpu.sock").is_ok());
        for bad in ["", "a/b.sock", "/abs.sock", ".", ".."] {
            assert!(check_endpoint(bad).is_err(), "{bad:?}");
        }
        assert!(check_version("v1beta1").is_ok());
        assert!(check_version("v1alpha2").is_err());
        assert!(check_version("").is_err());
    }
}
