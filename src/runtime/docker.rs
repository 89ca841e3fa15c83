//! Docker: the `nvidia` runtime in `/etc/docker/daemon.json`.
//!
//! Pure text edits, modelled on `nvidia-ctk runtime configure --runtime=docker`. Docker has no
//! drop-in directory, so the agent merges its keys into the user's file:
//!
//! - `runtimes.<name> = {"path": "<binary>", "args": []}`;
//! - `default-runtime = "<name>"` when the runtime is to be the default;
//! - `features.cdi = true` when CDI is on.
//!
//! Every other key keeps its value and its place, and the file keeps its indentation (the layout
//! of values is serde_json's pretty printing). A file that already holds all of that is returned
//! byte-identical, so the stage writes nothing.

mod engine;
pub use engine::DockerEngine;

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, Serializer};
use serde_json::ser::PrettyFormatter;

use super::containerd::binary_text;
use super::{DefaultRuntime, EditError, NvidiaRuntime};

/// Indentation of a file that has none to copy: four spaces, like `nvidia-ctk` writes.
const DEFAULT_INDENT: &str = "    ";

/// Docker's built-in default runtime.
const RUNC: &str = "runc";

/// Key named in shape errors about the document itself.
const TOP_LEVEL: &str = "(top level)";

/// Adds the runtime `rt` (and its `also` runtimes) to `daemon.json`.
///
/// `existing` is the file's text (`None` when it does not exist; an empty or whitespace-only file
/// counts as `{}`), `file` its path for error messages. With [`DefaultRuntime::Unset`], a
/// `default-runtime` that names one of the agent's runtimes (left by an earlier run that had it)
/// goes back to `runc`; with [`DefaultRuntime::Keep`] any `default-runtime` stays, `nvidia`
/// included (EKS GPU AMIs ship it so).
pub fn configure(existing: Option<&str>, file: &str, rt: &NvidiaRuntime) -> Result<String, EditError> {
    let text = existing.filter(|text| !text.trim().is_empty());
    let original = match text {
        Some(text) => parse(text, file)?,
        None => Object::default(),
    };
    let mut config = original.clone();
    for (name, binary) in rt.all() {
        let key = format!("runtimes.{name}.path");
        let binary = binary_text(binary, file, &key)?;
        let runtimes = object_entry(&mut config, "runtimes", file)?;
        match runtimes.get_mut(name) {
            // One that is there already (nvidia-ctk's, an image's) keeps its keys, its args and
            // their order: only the path is the agent's.
            Some(Json::Object(runtime)) => runtime.insert("path", Json::String(binary.to_owned())),
            _ => {
                let runtime = Object(vec![
                    ("path".to_owned(), Json::String(binary.to_owned())),
                    ("args".to_owned(), Json::Array(Vec::new())),
                ]);
                runtimes.insert(name, Json::Object(runtime));
            }
        }
    }
    match rt.default {
        DefaultRuntime::Set => config.insert("default-runtime", Json::String(rt.name.clone())),
        DefaultRuntime::Unset
            if config
                .get_str("default-runtime")
                .is_some_and(|d| rt.names().any(|n| n == d)) =>
        {
            config.insert("default-runtime", Json::String(RUNC.to_owned()))
        }
        DefaultRuntime::Unset | DefaultRuntime::Keep => {}
    }
    if rt.enable_cdi {
        object_entry(&mut config, "features", file)?.insert("cdi", Json::Bool(true));
    }
    match text {
        Some(text) if config == original => Ok(text.to_owned()),
        _ => render(&config, text.map_or(DEFAULT_INDENT, indent_unit), file),
    }
}

/// Removes the runtimes `names` from `daemon.json`: `runtimes.<name>` (and `runtimes` when it is
/// left empty), and `default-runtime` when it names one of them (docker then uses `runc`).
/// What `original` (the file before the agent's first change, when known) already had stays:
/// a runtime or default that `nvidia-ctk` or the image put there is not the agent's to remove,
/// nor a `runtimes` object that was empty there.
///
/// `features.cdi` stays: CDI is a daemon-wide switch that other devices' CDI specs and the user's
/// own `--device vendor/class=name` flags may rely on, and it is harmless without NVIDIA specs.
/// A file without the runtimes is returned byte-identical.
pub fn unconfigure(existing: &str, file: &str, names: &[&str], original: Option<&str>) -> Result<String, EditError> {
    if existing.trim().is_empty() {
        return Ok(existing.to_owned());
    }
    let before = original
        .filter(|t| !t.trim().is_empty())
        .and_then(|t| parse(t, file).ok())
        .unwrap_or_default();
    let had_runtime = |name: &str| matches!(before.get("runtimes"), Some(Json::Object(r)) if r.get(name).is_some());
    let original_default = before.get_str("default-runtime").map(str::to_owned);
    let parsed = parse(existing, file)?;
    let mut config = parsed.clone();
    if let Some(Json::Object(runtimes)) = config.get_mut("runtimes") {
        for name in names.iter().filter(|n| !had_runtime(n)) {
            runtimes.remove(name);
        }
        if runtimes.0.is_empty() && before.get("runtimes").is_none() {
            config.remove("runtimes");
        }
    }
    if let Some(default) = config.get_str("default-runtime")
        && names.contains(&default)
        && original_default.as_deref() != Some(default)
    {
        match original_default {
            Some(d) => config.insert("default-runtime", Json::String(d)),
            None => config.remove("default-runtime"),
        }
    }
    if config == parsed {
        return Ok(existing.to_owned());
    }
    render(&config, indent_unit(existing), file)
}

/// Parses `text` as a JSON object.
fn parse(text: &str, file: &str) -> Result<Object, EditError> {
    match serde_json::from_str::<Json>(text) {
        Ok(Json::Object(object)) => Ok(object),
        Ok(_) => Err(EditError::Shape {
            file: file.to_owned(),
            key: TOP_LEVEL.to_owned(),
            message: "must be a JSON object".to_owned(),
        }),
        Err(e) => {
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            Err(EditError::Parse {
                file: file.to_owned(),
                line: e.line(),
                column: e.column(),
                message: full.strip_suffix(&suffix).unwrap_or(&full).to_owned(),
            })
        }
    }
}

/// The object under `key` in `config`, created (empty, at the end) when missing; a shape error
/// when it is something else.
fn object_entry<'a>(config: &'a mut Object, key: &str, file: &str) -> Result<&'a mut Object, EditError> {
    if config.get(key).is_none() {
        config.insert(key, Json::Object(Object::default()));
    }
    match config.get_mut(key) {
        Some(Json::Object(object)) => Ok(object),
        _ => Err(EditError::Shape {
            file: file.to_owned(),
            key: key.to_owned(),
            message: "must be a JSON object".to_owned(),
        }),
    }
}

/// The indentation step of `text`: the leading whitespace of its first indented line (tabs or
/// spaces), or [`DEFAULT_INDENT`] for a file on one line or with mixed indentation.
fn indent_unit(text: &str) -> &str {
    text.lines()
        .skip(1)
        .find_map(|line| {
            let body = line.trim_start_matches([' ', '\t']);
            let indent = &line[..line.len() - body.len()];
            (!indent.is_empty() && !body.trim().is_empty()).then_some(indent)
        })
        .filter(|indent| indent.bytes().all(|b| b == b' ') || indent.bytes().all(|b| b == b'\t'))
        .unwrap_or(DEFAULT_INDENT)
}

/// `config` as pretty JSON indented by `indent`, with a trailing newline.
fn render(config: &Object, indent: &str, file: &str) -> Result<String, EditError> {
    let mut out = Vec::new();
    let mut serializer =
        serde_json::Serializer::with_formatter(&mut out, PrettyFormatter::with_indent(indent.as_bytes()));
    // A `Json` tree (string keys, finite numbers) always serializes; the error is kept anyway.
    config.serialize(&mut serializer).map_err(|e| EditError::Shape {
        file: file.to_owned(),
        key: TOP_LEVEL.to_owned(),
        message: format!("cannot render JSON: {e}"),
    })?;
    out.push(b'\n');
    // serde_json writes UTF-8 only, so nothing is replaced here.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

// === order-preserving JSON ===

/// A JSON value that keeps object keys in file order.
///
/// serde_json's `Value` sorts keys unless its `preserve_order` feature is on, and that feature
/// would apply to every crate of the workspace (it grows every `Value`, which trips clippy's
/// `result_large_err` in test-apiserver). daemon.json is small, so entries in a vector will do.
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Object),
}

/// A JSON object's entries in file order, keys unique (a repeated key keeps its first place and
/// its last value, like serde_json).
#[derive(Debug, Clone, Default, PartialEq)]
struct Object(Vec<(String, Json)>);

impl Object {
    fn get(&self, key: &str) -> Option<&Json> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        self.0.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(Json::String(s)) => Some(s),
            _ => None,
        }
    }

    /// Sets `key`, in place when it exists, else at the end.
    fn insert(&mut self, key: &str, value: Json) {
        match self.get_mut(key) {
            Some(slot) => *slot = value,
            None => self.0.push((key.to_owned(), value)),
        }
    }

    /// Removes `key`, keeping the order of the rest.
    fn remove(&mut self, key: &str) {
        self.0.retain(|(k, _)| k != key);
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => serializer.serialize_unit(),
            Json::Bool(b) => serializer.serialize_bool(*b),
            Json::Number(n) => n.serialize(serializer),
            Json::String(s) => serializer.serialize_str(s),
            Json::Array(items) => serializer.collect_seq(items),
            Json::Object(object) => object.serialize(serializer),
        }
    }
}

impl Serialize for Object {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        Json::deserialize(deserializer)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        serde_json::Number::from_f64(v)
            .map(Json::Number)
            .ok_or_else(|| E::custom("number is not finite"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut object = Object::default();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            object.insert(&key, value);
        }
        Ok(Json::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStrExt;

    use super::*;

    const FILE: &str = "/etc/docker/daemon.json";
    const BINARY: &str = "/usr/bin/nvidia-container-runtime";

    const EXISTING: &str = include_str!("../../tests/fixtures/runtime/docker/existing.json");
    const EXISTING_EXPECTED: &str = include_str!("../../tests/fixtures/runtime/docker/existing.expected.json");
    const EXISTING_DEFAULT_CDI: &str =
        include_str!("../../tests/fixtures/runtime/docker/existing.default-cdi.expected.json");
    const FRESH_EXPECTED: &str = include_str!("../../tests/fixtures/runtime/docker/fresh.expected.json");
    const TABS: &str = include_str!("../../tests/fixtures/runtime/docker/tabs-default-nvidia.json");
    const TABS_NOT_DEFAULT: &str =
        include_str!("../../tests/fixtures/runtime/docker/tabs-default-nvidia.not-default.expected.json");
    const BROKEN: &str = include_str!("../../tests/fixtures/runtime/docker/broken.json");

    fn rt(set_as_default: bool, enable_cdi: bool) -> NvidiaRuntime {
        NvidiaRuntime {
            name: "nvidia".to_owned(),
            binary: BINARY.into(),
            default: if set_as_default {
                DefaultRuntime::Set
            } else {
                DefaultRuntime::Unset
            },
            enable_cdi,
            also: Vec::new(),
            runtimes: true,
        }
    }

    /// `text` parsed for comparisons that ignore key order and layout.
    fn json(text: &str) -> serde_json::Value {
        serde_json::from_str(text).unwrap()
    }

    fn shape_key(err: EditError) -> String {
        match err {
            EditError::Shape { key, .. } => key,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn fresh_host() {
        for existing in [None, Some(""), Some(" \n")] {
            assert_eq!(
                configure(existing, FILE, &rt(false, false)).unwrap(),
                FRESH_EXPECTED,
                "{existing:?}"
            );
        }
        assert_eq!(
            json(&configure(None, FILE, &rt(true, true)).unwrap()),
            json(
                r#"{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime", "args": []}},
                     "default-runtime": "nvidia", "features": {"cdi": true}}"#
            )
        );
    }

    #[test]
    fn existing_file_keeps_its_keys_order_and_indent() {
        assert_eq!(
            configure(Some(EXISTING), FILE, &rt(false, false)).unwrap(),
            EXISTING_EXPECTED
        );
        assert_eq!(
            configure(Some(EXISTING), FILE, &rt(true, true)).unwrap(),
            EXISTING_DEFAULT_CDI
        );
        let Ok(Json::Object(object)) = serde_json::from_str::<Json>(EXISTING_DEFAULT_CDI) else {
            panic!("not an object");
        };
        let keys: Vec<_> = object.0.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "log-driver",
                "log-opts",
                "registry-mirrors",
                "exec-opts",
                "runtimes",
                "storage-driver",
                "default-runtime",
                "features"
            ]
        );
    }

    #[test]
    fn already_configured_file_is_returned_byte_identical() {
        for (set_as_default, enable_cdi) in [(false, false), (true, true), (true, false), (false, true)] {
            let rt = rt(set_as_default, enable_cdi);
            let first = configure(Some(EXISTING), FILE, &rt).unwrap();
            assert_eq!(configure(Some(&first), FILE, &rt).unwrap(), first, "{rt:?}");
        }
        // Hand-written, compact and already right: not even reformatted.
        let compact = r#"{"runtimes":{"nvidia":{"path":"/usr/bin/nvidia-container-runtime","args":[]}}}"#;
        assert_eq!(configure(Some(compact), FILE, &rt(false, false)).unwrap(), compact);
        assert_eq!(configure(Some(TABS), FILE, &rt(true, false)).unwrap(), TABS);
    }

    #[test]
    fn our_default_runtime_goes_back_to_runc_without_set_as_default() {
        assert_eq!(
            configure(Some(TABS), FILE, &rt(false, false)).unwrap(),
            TABS_NOT_DEFAULT
        );
        let other = r#"{"default-runtime": "runsc"}"#;
        let out = configure(Some(other), FILE, &rt(false, false)).unwrap();
        assert_eq!(json(&out)["default-runtime"], "runsc");
        let out = configure(Some(other), FILE, &rt(true, false)).unwrap();
        assert_eq!(json(&out)["default-runtime"], "nvidia");
    }

    #[test]
    fn an_existing_runtime_entry_keeps_its_keys_and_gets_the_path() {
        let old = "{\n  \"runtimes\": {\n    \"nvidia\": {\"path\": \"nvidia-container-runtime\", \"runtimeArgs\": [\"-d\"]},\n    \
                   \"runsc\": {\"path\": \"/usr/bin/runsc\"}\n  }\n}\n";
        assert_eq!(
            configure(Some(old), FILE, &rt(false, false)).unwrap(),
            "{\n  \"runtimes\": {\n    \"nvidia\": {\n      \"path\": \"/usr/bin/nvidia-container-runtime\",\n      \
             \"runtimeArgs\": [\n        \"-d\"\n      ]\n    },\n    \"runsc\": {\n      \"path\": \"/usr/bin/runsc\"\n    }\n  }\n}\n"
        );
        // nvidia-ctk's entry (keys sorted, as Go writes them) is already right: byte-identical.
        let ctk = "{\n    \"runtimes\": {\n        \"nvidia\": {\n            \"args\": [],\n            \
                   \"path\": \"/usr/bin/nvidia-container-runtime\"\n        }\n    }\n}\n";
        assert_eq!(configure(Some(ctk), FILE, &rt(false, false)).unwrap(), ctk);
    }

    #[test]
    fn values_of_every_kind_survive() {
        let text =
            r#"{"a": 1, "b": -1.5e3, "c": null, "d": [true, {"z": 18446744073709551615, "y": "\u00e9"}], "a": 2}"#;
        assert_eq!(
            configure(Some(text), FILE, &rt(false, false)).unwrap(),
            "{\n    \"a\": 2,\n    \"b\": -1500.0,\n    \"c\": null,\n    \"d\": [\n        true,\n        {\n            \
             \"z\": 18446744073709551615,\n            \"y\": \"\u{e9}\"\n        }\n    ],\n    \"runtimes\": {\n        \
             \"nvidia\": {\n            \"path\": \"/usr/bin/nvidia-container-runtime\",\n            \"args\": []\n        \
             }\n    }\n}\n"
        );
    }

    #[test]
    fn indent_detection() {
        assert_eq!(indent_unit("{\n  \"a\": 1\n}"), "  ");
        assert_eq!(indent_unit("{\n\t\"a\": 1\n}"), "\t");
        assert_eq!(indent_unit("{\n\n   \"a\": 1\n}"), "   ");
        assert_eq!(indent_unit("{\"a\": 1}"), DEFAULT_INDENT);
        assert_eq!(indent_unit("{\n \t\"a\": 1\n}"), DEFAULT_INDENT);
    }

    #[test]
    fn unconfigure_round_trip() {
        for (set_as_default, enable_cdi) in [(false, false), (true, false)] {
            let configured = configure(Some(EXISTING), FILE, &rt(set_as_default, enable_cdi)).unwrap();
            let restored = unconfigure(&configured, FILE, &["nvidia"], None).unwrap();
            assert_eq!(json(&restored), json(EXISTING));
            assert!(restored.starts_with("{\n  \"log-driver\""), "indent kept: {restored}");
        }
        // features.cdi stays on.
        let configured = configure(Some(EXISTING), FILE, &rt(true, true)).unwrap();
        let mut expected = json(EXISTING);
        expected["features"] = json(r#"{"cdi": true}"#);
        assert_eq!(
            json(&unconfigure(&configured, FILE, &["nvidia"], None).unwrap()),
            expected
        );
        // A fresh file comes back as an empty object.
        let fresh = configure(None, FILE, &rt(true, false)).unwrap();
        assert_eq!(unconfigure(&fresh, FILE, &["nvidia"], None).unwrap(), "{}\n");
    }

    /// Found by the property tests (issue 15): an empty `runtimes` object the file had was
    /// removed along with the agent's runtime, so unconfigure did not give the file back.
    #[test]
    fn unconfigure_keeps_an_empty_runtimes_object_the_file_had() {
        let original = "{\n  \"runtimes\": {}\n}\n";
        let configured = configure(Some(original), FILE, &rt(true, false)).unwrap();
        assert_eq!(
            unconfigure(&configured, FILE, &["nvidia"], Some(original)).unwrap(),
            original
        );
        // Without the original, the object the agent created goes with its runtime.
        assert_eq!(unconfigure(&configured, FILE, &["nvidia"], None).unwrap(), "{}\n");
    }

    #[test]
    fn unconfigure_without_the_runtime_is_byte_identical() {
        assert_eq!(unconfigure(EXISTING, FILE, &["nvidia"], None).unwrap(), EXISTING);
        assert_eq!(unconfigure("", FILE, &["nvidia"], None).unwrap(), "");
        let odd = r#"{"runtimes": [], "default-runtime": "runsc"}"#;
        assert_eq!(unconfigure(odd, FILE, &["nvidia"], None).unwrap(), odd);
    }

    #[test]
    fn broken_json_reports_line_and_column() {
        let err = configure(Some(BROKEN), FILE, &rt(false, false)).unwrap_err();
        assert_eq!(
            err,
            EditError::Parse {
                file: FILE.to_owned(),
                line: 4,
                column: 64,
                message: "trailing comma".to_owned(),
            }
        );
        assert!(matches!(
            unconfigure(BROKEN, FILE, &["nvidia"], None),
            Err(EditError::Parse { line: 4, .. })
        ));
    }

    #[test]
    fn wrong_types_are_shape_errors() {
        for (text, key) in [
            ("[]", TOP_LEVEL),
            ("\"runtimes\"", TOP_LEVEL),
            (r#"{"runtimes": []}"#, "runtimes"),
            (r#"{"runtimes": {"runsc": {}}, "features": true}"#, "features"),
        ] {
            let err = configure(Some(text), FILE, &rt(false, true)).unwrap_err();
            assert_eq!(shape_key(err), key, "{text}");
        }
        assert_eq!(
            shape_key(unconfigure("[1]", FILE, &["nvidia"], None).unwrap_err()),
            TOP_LEVEL
        );
        let mut rt = rt(false, false);
        rt.binary = std::ffi::OsStr::from_bytes(b"/usr/bin/\xff").into();
        assert_eq!(
            shape_key(configure(None, FILE, &rt).unwrap_err()),
            "runtimes.nvidia.path"
        );
    }
}
