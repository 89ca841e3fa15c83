//! Patch bodies: RFC 7386 merge patch, strategic merge patch (as merge patch, see README),
//! RFC 6902 JSON patch.

use serde_json::{Map, Value};

use crate::status::ApiError;

pub(crate) const MERGE: &str = "application/merge-patch+json";
pub(crate) const STRATEGIC: &str = "application/strategic-merge-patch+json";
pub(crate) const JSON_PATCH: &str = "application/json-patch+json";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PatchType {
    Merge,
    Strategic,
    Json,
}

impl PatchType {
    /// From a `Content-Type` header value (parameters ignored); `None` is 415.
    pub fn from_content_type(ct: Option<&str>) -> Option<PatchType> {
        let ct = ct?.split(';').next()?.trim().to_ascii_lowercase();
        match ct.as_str() {
            MERGE => Some(PatchType::Merge),
            STRATEGIC => Some(PatchType::Strategic),
            JSON_PATCH => Some(PatchType::Json),
            _ => None,
        }
    }

    pub fn unsupported() -> ApiError {
        ApiError::unsupported_media_type(&[JSON_PATCH, MERGE, STRATEGIC])
    }
}

/// Applies `body` (as `kind`) to a copy of `current`.
pub(crate) fn apply(current: &Value, kind: PatchType, body: &[u8]) -> Result<Value, ApiError> {
    let patch: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let mut doc = current.clone();
    match kind {
        PatchType::Merge => merge(&mut doc, &patch),
        PatchType::Strategic => {
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "strategic merge patch body must be a JSON object",
                ));
            }
            merge(&mut doc, &strip_directives(&patch));
        }
        PatchType::Json => json_patch(&mut doc, &patch)?,
    }
    Ok(doc)
}

/// RFC 7386: objects merge recursively, `null` deletes, anything else replaces.
pub(crate) fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else { unreachable!() };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Drops strategic-merge directives (`$patch`, `$retainKeys`, `$setElementOrder/...`, ...).
fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn pointer(path: &str) -> Result<Vec<String>, String> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(format!("JSON pointer {path:?} does not start with '/'"));
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn array_index(token: &str, len: usize, allow_end: bool) -> Option<usize> {
    if token == "-" {
        return allow_end.then_some(len);
    }
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) || !token.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let i: usize = token.parse().ok()?;
    let limit = if allow_end { len } else { len.saturating_sub(1) };
    (i <= limit && (allow_end || len > 0)).then_some(i)
}

fn get<'a>(doc: &'a Value, tokens: &[String]) -> Option<&'a Value> {
    tokens.iter().try_fold(doc, |cur, t| match cur {
        Value::Object(m) => m.get(t),
        Value::Array(a) => a.get(array_index(t, a.len(), false)?),
        _ => None,
    })
}

fn get_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Option<&'a mut Value> {
    tokens.iter().try_fold(doc, |cur, t| match cur {
        Value::Object(m) => m.get_mut(t),
        Value::Array(a) => {
            let i = array_index(t, a.len(), false)?;
            a.get_mut(i)
        }
        _ => None,
    })
}

fn add(doc: &mut Value, path: &str, tokens: &[String], value: Value) -> Result<(), String> {
    let Some((last, parent)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    let missing = || format!("add operation does not apply: doc is missing path: {path:?}");
    match get_mut(doc, parent).ok_or_else(missing)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
        }
        Value::Array(a) => {
            let i = array_index(last, a.len(), true)
                .ok_or_else(|| format!("add operation does not apply: index out of bounds in {path:?}"))?;
            a.insert(i, value);
        }
        _ => return Err(missing()),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &str, tokens: &[String], op: &str) -> Result<Value, String> {
    let missing = || format!("{op} operation does not apply: doc is missing path: {path:?}");
    let Some((last, parent)) = tokens.split_last() else {
        return Err(missing());
    };
    match get_mut(doc, parent).ok_or_else(missing)? {
        Value::Object(m) => m.remove(last).ok_or_else(missing),
        Value::Array(a) => {
            let i = array_index(last, a.len(), false).ok_or_else(missing)?;
            Ok(a.remove(i))
        }
        _ => Err(missing()),
    }
}

/// RFC 6902 with all six operations. Errors are 400 (malformed) or 422 (does not apply).
pub(crate) fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let Value::Array(ops) = patch else {
        return Err(ApiError::bad_request("json patch must be a JSON array of operations"));
    };
    for op in ops {
        let field = |name: &str| op.get(name).and_then(Value::as_str);
        let name = field("op").ok_or_else(|| ApiError::bad_request("json patch operation has no \"op\""))?;
        let path = field("path").ok_or_else(|| ApiError::bad_request(format!("json patch {name} has no \"path\"")))?;
        let tokens = pointer(path).map_err(ApiError::bad_request)?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| ApiError::bad_request(format!("json patch {name} has no \"value\"")))
        };
        let from = || -> Result<(String, Vec<String>), ApiError> {
            let from =
                field("from").ok_or_else(|| ApiError::bad_request(format!("json patch {name} has no \"from\"")))?;
            Ok((from.to_owned(), pointer(from).map_err(ApiError::bad_request)?))
        };
        let result = match name {
            "add" => add(doc, path, &tokens, value()?),
            "remove" => remove(doc, path, &tokens, "remove").map(drop),
            "replace" => {
                let v = value()?;
                if tokens.is_empty() {
                    *doc = v;
                    Ok(())
                } else {
                    remove(doc, path, &tokens, "replace").and_then(|_| add(doc, path, &tokens, v))
                }
            }
            "move" => {
                let (from_path, from_tokens) = from()?;
                if tokens.len() > from_tokens.len() && tokens.starts_with(&from_tokens) {
                    Err(format!(
                        "move operation does not apply: {path:?} is inside {from_path:?}"
                    ))
                } else {
                    remove(doc, &from_path, &from_tokens, "move").and_then(|v| add(doc, path, &tokens, v))
                }
            }
            "copy" => {
                let (from_path, from_tokens) = from()?;
                match get(doc, &from_tokens).cloned() {
                    Some(v) => add(doc, path, &tokens, v),
                    None => Err(format!(
                        "copy operation does not apply: doc is missing from path: {from_path:?}"
                    )),
                }
            }
            "test" => {
                let expected = value()?;
                match get(doc, &tokens) {
                    Some(actual) if *actual == expected => Ok(()),
                    _ => Err(format!("testing value {path} failed: test failed")),
                }
            }
            other => return Err(ApiError::bad_request(format!("Unexpected kind: {other}"))),
        };
        result.map_err(ApiError::unprocessable)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_rfc7386_examples() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge(
            &mut doc,
            &json!({"a": "z", "c": {"f": null}, "l": [3], "n": {"x": null, "y": 1}}),
        );
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3], "n": {"y": 1}}));
        let mut doc = json!({"a": "b"});
        merge(&mut doc, &json!(["c"]));
        assert_eq!(doc, json!(["c"]));
    }

    #[test]
    fn json_patch_ops() {
        let mut doc = json!({"metadata": {"labels": {"a": "1"}}, "list": [1, 2, 3]});
        let patch = json!([
            {"op": "add", "path": "/metadata/labels/nvidia.com~1gpu", "value": "true"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "2"},
            {"op": "test", "path": "/metadata/labels/a", "value": "2"},
            {"op": "remove", "path": "/list/1"},
            {"op": "add", "path": "/list/-", "value": 9},
            {"op": "copy", "from": "/metadata/labels/a", "path": "/copied"},
            {"op": "move", "from": "/copied", "path": "/moved"},
            {"op": "add", "path": "/t~0x", "value": 1},
        ]);
        json_patch(&mut doc, &patch).unwrap();
        assert_eq!(
            doc,
            json!({"metadata": {"labels": {"a": "2", "nvidia.com/gpu": "true"}}, "list": [1, 3, 9], "moved": "2", "t~x": 1})
        );
        let err = json_patch(&mut doc, &json!([{"op": "remove", "path": "/metadata/labels/missing"}])).unwrap_err();
        assert_eq!(err.code, 422);
        let err = json_patch(&mut doc, &json!([{"op": "test", "path": "/moved", "value": "3"}])).unwrap_err();
        assert_eq!(err.code, 422);
        let err = json_patch(&mut doc, &json!([{"op": "add", "path": "/nope/x", "value": 1}])).unwrap_err();
        assert_eq!(err.code, 422);
        let err = json_patch(&mut doc, &json!({"op": "add"})).unwrap_err();
        assert_eq!(err.code, 400);
    }

    #[test]
    fn content_types() {
        assert_eq!(
            PatchType::from_content_type(Some("application/merge-patch+json; charset=utf-8")),
            Some(PatchType::Merge)
        );
        assert_eq!(PatchType::from_content_type(Some("application/json")), None);
        assert_eq!(PatchType::from_content_type(None), None);
    }
}
