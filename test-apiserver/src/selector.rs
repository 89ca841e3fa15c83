//! `labelSelector` and `fieldSelector` query parameters.

use serde_json::Value;

#[derive(Clone, Debug)]
enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector (`a=b,c!=d,e in (f,g),!h,i`). Empty matches everything.
#[derive(Clone, Debug, Default)]
pub(crate) struct LabelSelector(Vec<Requirement>);

/// Splits on commas that are not inside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().map(str::trim).filter(|t| !t.is_empty()).collect()
}

fn set_values(rest: &str) -> Option<Vec<String>> {
    let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let mut reqs = Vec::new();
        for term in split_terms(s) {
            let bad = || format!("unable to parse requirement: {term:?}");
            let req = if let Some(key) = term.strip_prefix('!') {
                Requirement::NotExists(key.trim().to_owned())
            } else if let Some((key, rest)) = term.split_once(" notin ") {
                Requirement::NotIn(key.trim().to_owned(), set_values(rest).ok_or_else(bad)?)
            } else if let Some((key, rest)) = term.split_once(" in ") {
                Requirement::In(key.trim().to_owned(), set_values(rest).ok_or_else(bad)?)
            } else if let Some((key, value)) = term.split_once("!=") {
                Requirement::NotEq(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Requirement::Eq(key.trim().to_owned(), value.trim().to_owned())
            } else {
                Requirement::Exists(term.to_owned())
            };
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Matches against an object's `metadata.labels`.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEq(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
        })
    }
}

/// A parsed field selector (`metadata.name=x,type!=Normal`). Empty matches everything.
#[derive(Clone, Debug, Default)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// `allowed` lists the field labels the resource supports; others are a 400, as upstream.
    pub fn parse(s: &str, allowed: &[&str]) -> Result<FieldSelector, String> {
        let mut reqs = Vec::new();
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (f, true, v)
            } else {
                return Err(format!("invalid selector: '{term}'; can't understand '{term}'"));
            };
            let field = field.trim();
            if !allowed.contains(&field) {
                return Err(format!("field label not supported: {field}"));
            }
            reqs.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let path = if field == "source" {
                "source.component"
            } else {
                field.as_str()
            };
            let actual = path.split('.').try_fold(obj, |cur, part| cur.get(part));
            // Compared in place: a watch checks every change against its selector.
            let same = match actual {
                Some(Value::String(s)) => s == value,
                Some(Value::Null) | None => value.is_empty(),
                Some(other) => {
                    // Numbers and booleans (`spec.unschedulable=true`) as their JSON text.
                    let shown = other.to_string();
                    shown == *value
                }
            };
            same == *equal
        })
    }

    /// The value `field` must equal for anything to match (a `field=value` or `field==value`
    /// term), if the selector has such a term: the watch fan-out indexes watches by
    /// `metadata.name` with it.
    pub fn required(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, equal, _)| *equal && f == field)
            .map(|(_, _, value)| value.as_str())
    }
}

/// Whether a field selector has the term `field=value` (or `==`), which ANDed with the rest
/// limits it to objects with that value: what the Node authorizer looks for, whatever fields
/// the resource supports.
pub(crate) fn requires_equal(selector: &str, field: &str, value: &str) -> bool {
    selector.split(',').any(|term| {
        if term.contains("!=") {
            return false;
        }
        term.split_once("==")
            .or_else(|| term.split_once('='))
            .is_some_and(|(f, v)| f.trim() == field && v.trim() == value)
    })
}

pub(crate) const NODE_FIELDS: &[&str] = &["metadata.name", "spec.unschedulable"];
/// `resource.k8s.io/v1` ResourceSlices (`spec.pool.name` is newer, and left out).
pub(crate) const SLICE_FIELDS: &[&str] = &["metadata.name", "spec.nodeName", "spec.driver"];
pub(crate) const CLAIM_FIELDS: &[&str] = &["metadata.name", "metadata.namespace"];
pub(crate) const EVENT_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

/// What one list or watch selects.
#[derive(Clone, Debug, Default)]
pub(crate) struct Filter {
    pub fields: FieldSelector,
    pub labels: LabelSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value) -> bool {
        self.fields.matches(obj) && self.labels.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        for (sel, want) in [
            ("", true),
            ("a=1", true),
            ("a==1,b=2", true),
            ("a!=1", false),
            ("c!=1", true),
            ("a in (1, 3)", true),
            ("a notin (1)", false),
            ("c notin (1)", true),
            ("a", true),
            ("!a", false),
            ("!c", true),
        ] {
            assert_eq!(LabelSelector::parse(sel).unwrap().matches(&obj), want, "{sel}");
        }
    }

    #[test]
    fn field_selectors() {
        let obj = json!({"metadata": {"name": "n1"}, "spec": {"unschedulable": true}});
        let sel = FieldSelector::parse("metadata.name=n1,spec.unschedulable=true", NODE_FIELDS).unwrap();
        assert!(sel.matches(&obj));
        assert!(
            !FieldSelector::parse("metadata.name!=n1", NODE_FIELDS)
                .unwrap()
                .matches(&obj)
        );
        assert!(FieldSelector::parse("spec.other=1", NODE_FIELDS).is_err());
        assert!(
            FieldSelector::parse("spec.unschedulable=", NODE_FIELDS)
                .unwrap()
                .matches(&json!({"spec": {}}))
        );
    }

    #[test]
    fn required_values() {
        let sel = FieldSelector::parse("spec.unschedulable=true,metadata.name==n1", NODE_FIELDS).unwrap();
        assert_eq!(sel.required("metadata.name"), Some("n1"));
        assert_eq!(sel.required("spec.unschedulable"), Some("true"));
        let sel = FieldSelector::parse("metadata.name!=n1", NODE_FIELDS).unwrap();
        assert_eq!(sel.required("metadata.name"), None);
    }

    #[test]
    fn required_terms() {
        assert!(requires_equal("spec.nodeName=n1", "spec.nodeName", "n1"));
        assert!(requires_equal("spec.driver=d,spec.nodeName==n1", "spec.nodeName", "n1"));
        assert!(!requires_equal("spec.nodeName!=n1", "spec.nodeName", "n1"));
        assert!(!requires_equal("spec.nodeName=n2", "spec.nodeName", "n1"));
        assert!(!requires_equal("", "spec.nodeName", "n1"));
        assert!(!requires_equal("spec.driver=n1", "spec.nodeName", "n1"));
    }
}
