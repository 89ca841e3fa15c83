//! `Status` objects: every error the stand-in answers, shaped as the API server shapes them.

use serde_json::{Value, json};

/// One field error inside an `Invalid` (422) status.
#[derive(Clone, Debug)]
pub(crate) struct Cause {
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueTooLong`, `FieldValueTooMany`,
    /// `FieldValueDuplicate`, `FieldValueForbidden`.
    pub reason: &'static str,
    pub field: String,
    /// The part after `field: `, e.g. `Invalid value: "a b": name part must ...`.
    pub message: String,
}

impl Cause {
    pub fn invalid(field: &str, bad_value: &str, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueInvalid",
            field: field.to_owned(),
            message: format!("Invalid value: {}: {detail}", go_quote(bad_value)),
        }
    }

    pub fn required(field: &str, detail: &str) -> Cause {
        let message = if detail.is_empty() {
            "Required value".to_owned()
        } else {
            format!("Required value: {detail}")
        };
        Cause {
            reason: "FieldValueRequired",
            field: field.to_owned(),
            message,
        }
    }

    pub fn too_long(field: &str, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueTooLong",
            field: field.to_owned(),
            message: format!("Too long: {detail}"),
        }
    }

    /// `Invalid value: V: detail` with V printed as Go's field errors print it: strings quoted,
    /// numbers and booleans bare, `null` as `"null"`, anything else as JSON.
    pub fn invalid_value(field: &str, bad_value: &Value, detail: &str) -> Cause {
        let shown = match bad_value {
            Value::Null => go_quote("null"),
            Value::String(s) => go_quote(s),
            other => other.to_string(),
        };
        Cause {
            reason: "FieldValueInvalid",
            field: field.to_owned(),
            message: format!("Invalid value: {shown}: {detail}"),
        }
    }

    /// apimachinery `field.TooLong` for a string longer than `max` bytes.
    pub fn too_long_bytes(field: &str, max: usize) -> Cause {
        Cause::too_long(field, &format!("may not be more than {max} bytes"))
    }

    /// apimachinery `field.TooMany`: a list or map with `actual` entries, `max` allowed.
    pub fn too_many(field: &str, actual: usize, max: usize) -> Cause {
        Cause {
            reason: "FieldValueTooMany",
            field: field.to_owned(),
            message: format!("Too many: {actual}: must have at most {max} items"),
        }
    }

    pub fn duplicate(field: &str, value: &str) -> Cause {
        Cause {
            reason: "FieldValueDuplicate",
            field: field.to_owned(),
            message: format!("Duplicate value: {}", go_quote(value)),
        }
    }

    pub fn forbidden(field: &str, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueForbidden",
            field: field.to_owned(),
            message: format!("Forbidden: {detail}"),
        }
    }

    fn line(&self) -> String {
        format!("{}: {}", self.field, self.message)
    }
}

/// An error answer: HTTP code plus the `Status` body.
#[derive(Clone, Debug)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
    /// Sent as the `Retry-After` header (and in `details.retryAfterSeconds` by the constructor).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: String, details: Option<Value>) -> ApiError {
        ApiError {
            code,
            reason,
            message,
            details,
            retry_after: None,
        }
    }

    pub fn not_found(resource: &str, name: &str) -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            format!("{resource} {} not found", go_quote(name)),
            Some(details(resource, name)),
        )
    }

    pub fn no_route() -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
            Some(json!({})),
        )
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
            Some(json!({})),
        )
    }

    pub fn conflict(resource: &str, name: &str, why: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {resource} {}: {why}", go_quote(name)),
            Some(details(resource, name)),
        )
    }

    pub fn modified(resource: &str, name: &str) -> ApiError {
        ApiError::conflict(
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn already_exists(resource: &str, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{resource} {} already exists", go_quote(name)),
            Some(details(resource, name)),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message.into(), None)
    }

    pub fn unsupported_media_type(accepted: &[&str]) -> ApiError {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: {}",
                accepted.join(", ")
            ),
            None,
        )
    }

    /// 422 with one or more field causes. `kind` is the object kind (`Node`, `Event`).
    pub fn invalid(kind: &str, name: &str, causes: Vec<Cause>) -> ApiError {
        ApiError::invalid_in("", kind, name, causes)
    }

    /// As [`invalid`](Self::invalid) for a kind in an API group: the message names
    /// `Kind.group` (`ResourceSlice.resource.k8s.io "x" is invalid: ...`).
    pub fn invalid_in(group: &str, kind: &str, name: &str, causes: Vec<Cause>) -> ApiError {
        let lines: Vec<String> = causes.iter().map(Cause::line).collect();
        let summary = if lines.len() == 1 {
            lines[0].clone()
        } else {
            format!("[{}]", lines.join(", "))
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
            .collect();
        let qualified = if group.is_empty() {
            kind.to_owned()
        } else {
            format!("{kind}.{group}")
        };
        ApiError::new(
            422,
            "Invalid",
            format!("{qualified} {} is invalid: {summary}", go_quote(name)),
            Some(json!({"name": name, "group": group, "kind": kind, "causes": causes})),
        )
    }

    /// 422 for a JSON patch that does not apply (no field path to name).
    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(422, "Invalid", message.into(), None)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized".into(), None)
    }

    pub fn forbidden(message: String, details: Value) -> ApiError {
        ApiError::new(403, "Forbidden", message, Some(details))
    }

    pub fn too_many_requests(retry_after_secs: u64) -> ApiError {
        let mut e = ApiError::new(
            429,
            "TooManyRequests",
            "Too many requests, please try again later.".into(),
            Some(json!({"retryAfterSeconds": retry_after_secs})),
        );
        e.retry_after = Some(retry_after_secs);
        e
    }

    pub fn internal(cause: &str) -> ApiError {
        ApiError::new(
            500,
            "InternalError",
            format!("Internal error occurred: {cause}"),
            Some(json!({"causes": [{"message": cause}]})),
        )
    }

    pub fn unavailable() -> ApiError {
        ApiError::new(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request".into(),
            None,
        )
    }

    pub fn timeout() -> ApiError {
        ApiError::new(
            504,
            "Timeout",
            "Timeout: request did not complete within the allotted timeout".into(),
            None,
        )
    }

    /// The object of the ERROR event a watch from a compacted resourceVersion gets.
    pub fn expired(requested: u64, current: u64) -> ApiError {
        ApiError::new(
            410,
            "Expired",
            format!("too old resource version: {requested} ({current})"),
            None,
        )
    }

    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

/// `details` of a Status about one object. `resource` may be group-qualified
/// (`resourceslices.resource.k8s.io`): upstream puts the plural in `kind` and the group apart.
fn details(resource: &str, name: &str) -> Value {
    match resource.split_once('.') {
        Some((plural, group)) => json!({"name": name, "group": group, "kind": plural}),
        None => json!({"name": name, "kind": resource}),
    }
}

/// Quotes like Go's `%q` for the strings that show up in messages (JSON escaping is close enough).
pub(crate) fn go_quote(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}
