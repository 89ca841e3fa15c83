//! Layering config files key by key while remembering, for every key, the file and line that
//! set it last.
//!
//! Each file is parsed with `toml_edit` (which keeps byte spans) into a tree of [`Node`]s that
//! carry their [`Location`]. Trees are merged in file order: tables merge recursively, anything
//! else (a scalar, an array, a table replacing a scalar or the reverse) replaces what was there,
//! origins included. The merged tree is turned into a plain `toml::Value` for serde, and error
//! paths from serde or from validation are looked up in the tree to find their origin.

use std::collections::BTreeMap;
use std::fmt;

use toml_edit::{Item, TableLike};

use super::error::{ConfigError, Location};

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// A dotted key path such as `device_plugin.device_list_strategy[1]`, as shown in messages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct KeyPath(Vec<Seg>);

impl KeyPath {
    /// A path from a dotted string of plain keys with optional array indexes, e.g.
    /// `"health.ignored_xids"` or `"cdi.hook_paths[1]"`. (Keys that are user-chosen names, which
    /// may contain dots or brackets, go through [`KeyPath::key`].)
    pub(crate) fn dotted(dotted: &str) -> Self {
        let mut segs = Vec::new();
        for part in dotted.split('.') {
            // `name[1][2]`: the name, then each index; anything else is a key as written.
            let (name, mut rest) = part.split_at(part.find('[').unwrap_or(part.len()));
            let mut indexes = Vec::new();
            while let Some(inner) = rest.strip_prefix('[') {
                let Some((n, after)) = inner.split_once(']') else { break };
                let Ok(n) = n.parse() else { break };
                indexes.push(n);
                rest = after;
            }
            if rest.is_empty() && !name.is_empty() {
                segs.push(Seg::Key(name.to_owned()));
                segs.extend(indexes.into_iter().map(Seg::Index));
            } else {
                segs.push(Seg::Key(part.to_owned()));
            }
        }
        KeyPath(segs)
    }

    /// This path with one more table key, which may contain dots (a user-chosen name).
    pub(crate) fn key(mut self, key: &str) -> Self {
        self.0.push(Seg::Key(key.to_owned()));
        self
    }

    /// This path with one more array index.
    pub(crate) fn index(mut self, index: usize) -> Self {
        self.0.push(Seg::Index(index));
        self
    }

    /// The path serde_path_to_error recorded for a deserialization error. Enum-variant and
    /// unknown segments carry no key and are skipped.
    pub(crate) fn from_serde(path: &serde_path_to_error::Path) -> Self {
        use serde_path_to_error::Segment;
        KeyPath(
            path.iter()
                .filter_map(|seg| match seg {
                    Segment::Map { key } => Some(Seg::Key(key.clone())),
                    Segment::Seq { index } => Some(Seg::Index(*index)),
                    Segment::Enum { .. } | Segment::Unknown => None,
                })
                .collect(),
        )
    }

    fn segments(&self) -> &[Seg] {
        &self.0
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Index(n) => write!(f, "[{n}]")?,
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        // A quoted TOML key is spelled like a basic string.
                        write!(f, "{}", toml::Value::String(k.clone()))?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A value in the merged tree, with the place that set it.
#[derive(Debug, Clone)]
struct Node {
    origin: Location,
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    Table(BTreeMap<String, Node>),
    Array(Vec<Node>),
    Scalar(toml::Value),
}

/// The config files merged so far.
#[derive(Debug, Default)]
pub(crate) struct Merged {
    root: BTreeMap<String, Node>,
}

impl Merged {
    /// Parses one file and layers it over what was merged before.
    pub(crate) fn add(&mut self, name: &str, text: &str) -> Result<(), ConfigError> {
        let doc = toml_edit::Document::parse(text).map_err(|e| ConfigError::Syntax {
            at: Location {
                file: name.to_owned(),
                line: e.span().map_or(1, |s| line_of(text, s.start)),
            },
            message: e.message().trim_end().to_owned(),
        })?;
        let file = FileCtx {
            name,
            lines: Lines::new(text),
        };
        let tree = file.table(doc.as_table(), 1);
        merge_tables(&mut self.root, tree);
        Ok(())
    }

    /// The merged tree as a plain TOML value for serde.
    pub(crate) fn to_value(&self) -> toml::Value {
        toml::Value::Table(table_value(&self.root))
    }

    /// Where the key at `path` was set. With `exact`, only the node at `path` itself counts;
    /// otherwise the deepest node on the way to it does (an error below a key that no file set
    /// is blamed on the key that holds it).
    pub(crate) fn origin(&self, path: &KeyPath, exact: bool) -> Option<&Location> {
        let mut found = None;
        let mut table = Some(&self.root);
        let mut array: Option<&Vec<Node>> = None;
        for seg in path.segments() {
            let node = match seg {
                Seg::Key(k) => table.and_then(|t| t.get(k)),
                Seg::Index(i) => array.and_then(|a| a.get(*i)),
            };
            let Some(node) = node else {
                return if exact { None } else { found };
            };
            found = Some(&node.origin);
            (table, array) = match &node.kind {
                Kind::Table(t) => (Some(t), None),
                Kind::Array(a) => (None, Some(a)),
                Kind::Scalar(_) => (None, None),
            };
        }
        found
    }

    /// The merged value at `path`, if some file set it.
    pub(crate) fn value(&self, path: &KeyPath) -> Option<toml::Value> {
        let mut node: Option<&Node> = None;
        for seg in path.segments() {
            let next = match (node.map(|n| &n.kind), seg) {
                (None, Seg::Key(k)) => self.root.get(k),
                (Some(Kind::Table(t)), Seg::Key(k)) => t.get(k),
                (Some(Kind::Array(a)), Seg::Index(i)) => a.get(*i),
                _ => None,
            };
            node = Some(next?);
        }
        node.map(node_value)
    }
}

/// Looks up `path` in a plain TOML value (the serialized effective config, for keys that no
/// file set).
pub(crate) fn value_in(value: &toml::Value, path: &KeyPath) -> Option<toml::Value> {
    let mut v = value;
    for seg in path.segments() {
        v = match (v, seg) {
            (toml::Value::Table(t), Seg::Key(k)) => t.get(k)?,
            (toml::Value::Array(a), Seg::Index(i)) => a.get(*i)?,
            _ => return None,
        };
    }
    Some(v.clone())
}

fn merge_tables(into: &mut BTreeMap<String, Node>, from: BTreeMap<String, Node>) {
    for (key, new) in from {
        match (into.get_mut(&key), new.kind) {
            (
                Some(Node {
                    origin,
                    kind: Kind::Table(old),
                }),
                Kind::Table(new_table),
            ) => {
                merge_tables(old, new_table);
                *origin = new.origin;
            }
            (_, kind) => {
                into.insert(
                    key,
                    Node {
                        origin: new.origin,
                        kind,
                    },
                );
            }
        }
    }
}

fn table_value(table: &BTreeMap<String, Node>) -> toml::Table {
    table.iter().map(|(k, n)| (k.clone(), node_value(n))).collect()
}

fn node_value(node: &Node) -> toml::Value {
    match &node.kind {
        Kind::Table(t) => toml::Value::Table(table_value(t)),
        Kind::Array(a) => toml::Value::Array(a.iter().map(node_value).collect()),
        Kind::Scalar(v) => v.clone(),
    }
}

/// 1-based line of a byte offset (one scan: for a single lookup).
fn line_of(text: &str, offset: usize) -> usize {
    Lines::new(text).line_of(offset)
}

/// Where a text's lines start, for the line of any byte offset in O(log lines): a file with
/// 40,000 keys is numbered in one pass, not one scan per key.
struct Lines {
    /// Byte offsets of every `\n`.
    newlines: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        Lines {
            newlines: text
                .bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i)
                .collect(),
        }
    }

    /// 1-based line of `offset`: one more than the newlines before it.
    fn line_of(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&nl| nl < offset) + 1
    }
}

/// One file being turned into a tree.
struct FileCtx<'a> {
    name: &'a str,
    lines: Lines,
}

impl FileCtx<'_> {
    fn at(&self, span: Option<std::ops::Range<usize>>, fallback: usize) -> Location {
        Location {
            file: self.name.to_owned(),
            line: span.map_or(fallback, |s| self.lines.line_of(s.start)),
        }
    }

    fn table(&self, table: &dyn TableLike, parent_line: usize) -> BTreeMap<String, Node> {
        let mut out = BTreeMap::new();
        for (name, item) in table.iter() {
            // The key's own span is the line a user looks for; the item's span covers implicit
            // tables, which have none.
            let span = table.key(name).and_then(|k| k.span()).or_else(|| item.span());
            let origin = self.at(span, parent_line);
            let line = origin.line;
            if let Some(node) = self.item(item, origin, line) {
                out.insert(name.to_owned(), node);
            }
        }
        out
    }

    fn item(&self, item: &Item, origin: Location, line: usize) -> Option<Node> {
        let kind = match item {
            Item::None => return None,
            Item::Table(t) => Kind::Table(self.table(t, line)),
            Item::ArrayOfTables(a) => Kind::Array(
                a.iter()
                    .map(|t| {
                        let at = self.at(t.span(), line);
                        let l = at.line;
                        Node {
                            origin: at,
                            kind: Kind::Table(self.table(t, l)),
                        }
                    })
                    .collect(),
            ),
            Item::Value(v) => return Some(self.value(v, origin)),
        };
        Some(Node { origin, kind })
    }

    fn value(&self, value: &toml_edit::Value, origin: Location) -> Node {
        use toml_edit::Value as V;
        let line = origin.line;
        let kind = match value {
            V::String(s) => Kind::Scalar(toml::Value::String(s.value().clone())),
            V::Integer(i) => Kind::Scalar(toml::Value::Integer(*i.value())),
            V::Float(x) => Kind::Scalar(toml::Value::Float(*x.value())),
            V::Boolean(b) => Kind::Scalar(toml::Value::Boolean(*b.value())),
            V::Datetime(d) => Kind::Scalar(toml::Value::Datetime(*d.value())),
            V::Array(a) => Kind::Array(a.iter().map(|v| self.value(v, self.at(v.span(), line))).collect()),
            V::InlineTable(t) => Kind::Table(self.table(t, line)),
        };
        Node { origin, kind }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_keys_take_array_indexes() {
        assert_eq!(
            KeyPath::dotted("cdi.hook_paths[1]"),
            KeyPath::dotted("cdi.hook_paths").index(1)
        );
        assert_eq!(KeyPath::dotted("a.b[0][2].c").to_string(), "a.b[0][2].c");
        assert_eq!(KeyPath::dotted("a.b[x]"), KeyPath::dotted("a").key("b[x]"));
    }

    /// The line index gives every byte offset the line a scan would: start, end, on and just
    /// after a newline, past the end, no trailing newline, empty lines, CRLF.
    #[test]
    fn line_numbers_match_a_scan_at_every_offset() {
        let scan = |text: &str, offset: usize| {
            text.as_bytes()[..offset.min(text.len())]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1
        };
        for text in [
            "",
            "a",
            "\n",
            "a\nb",
            "a\nb\n",
            "\n\n\nx",
            "k = 1\r\n[t]\r\nv = 2",
            "é\nü\n",
        ] {
            let lines = Lines::new(text);
            for offset in 0..=text.len() + 2 {
                assert_eq!(lines.line_of(offset), scan(text, offset), "{text:?} at {offset}");
            }
        }
    }
}
