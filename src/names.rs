//! Kubernetes name syntax, checked as the API server checks it: DNS subdomains, label keys and
//! label values (and cutting text to a byte limit on a character boundary). The config, the
//! desired state and the MIG layouts all validate names with these; a leaf, so that each of them
//! can without importing the others.

/// `text` cut to at most `max` bytes, on a character boundary (Event messages, attribute
/// values: fields the API server limits in bytes).
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Whether `s` is a DNS subdomain as Kubernetes checks it (RFC 1123): lower-case
/// alphanumeric labels with inner '-', separated by '.', 253 bytes at most, 63 per label.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// A Kubernetes label name part or value: at most 63 characters, alphanumerics at both ends,
/// `-`, `_`, `.` and alphanumerics between (an empty value is allowed for values only).
fn is_label_segment(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Checks a label key as the API server does: `[prefix/]name`, the prefix a DNS subdomain of at
/// most 253 characters, the name at most 63.
pub fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && (prefix.len() > 253 || !is_dns_subdomain(prefix))
    {
        return Err(format!("label key prefix {prefix:?} is not a DNS subdomain"));
    }
    if !is_label_segment(name) {
        return Err(format!(
            "label name {name:?} must be 1-63 characters, alphanumeric at both ends, with '-', '_', '.' between"
        ));
    }
    Ok(())
}

/// Checks a label value as the API server does: empty, or at most 63 characters, alphanumeric at
/// both ends, with `-`, `_`, `.` between.
pub fn check_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() || is_label_segment(value) {
        Ok(())
    } else {
        Err(format!(
            "label value {value:?} must be at most 63 characters, alphanumeric at both ends, with '-', '_', '.' between"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys_and_values_follow_the_api_server() {
        assert!(check_label_key("nvidia.com/mig.config").is_ok());
        assert!(check_label_key("plain").is_ok());
        assert!(check_label_key("nvidia.com/").is_err());
        assert!(check_label_key("Bad_Prefix!/x").is_err());
        assert!(check_label_key(&format!("a/{}", "x".repeat(64))).is_err());
        assert!(check_label_value("").is_ok());
        assert!(check_label_value("all-1g.5gb").is_ok());
        assert!(check_label_value("-leading").is_err());
        assert!(check_label_value(&"x".repeat(64)).is_err());
        assert!(check_label_value("has space").is_err());
    }
}
