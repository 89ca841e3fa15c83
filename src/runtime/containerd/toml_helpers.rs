//! TOML helpers shared with the CRI-O module: parsing with line and column, tables and strings
//! with shape errors, plain copies of tables for generated files.

use toml_edit::{Array, ArrayOfTables, DocumentMut, InlineTable, Item, Table, TableLike, Value};

use crate::runtime::EditError;

/// Parses `text` (the contents of `file`), turning toml_edit's error into [`EditError::Parse`]
/// with a 1-based line and column.
pub(in crate::runtime) fn parse_toml(text: &str, file: &str) -> Result<DocumentMut, EditError> {
    text.parse::<DocumentMut>().map_err(|e| {
        let offset = e.span().map_or(0, |span| span.start);
        let (line, column) = line_column(text, offset);
        EditError::Parse {
            file: file.to_owned(),
            line,
            column,
            message: e.message().trim_end().to_owned(),
        }
    })
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
pub(in crate::runtime) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let head = &text[..offset];
    let line_start = head.rfind('\n').map_or(0, |i| i + 1);
    (head.matches('\n').count() + 1, head[line_start..].chars().count() + 1)
}

/// A runtime binary as text, or a shape error naming `key` when the path is not UTF-8 (a TOML
/// or JSON file cannot hold it).
pub(in crate::runtime) fn binary_text<'a>(
    binary: &'a std::path::Path,
    file: &str,
    key: &str,
) -> Result<&'a str, EditError> {
    binary.to_str().ok_or_else(|| EditError::Shape {
        file: file.to_owned(),
        key: key.to_owned(),
        message: format!("the runtime binary {} is not valid UTF-8", binary.display()),
    })
}

/// The table (standard or inline) at `path` under `root`, `None` when a key on the way is
/// missing, or a shape error naming the first key on the way that is not a table.
pub(in crate::runtime) fn table_at<'a>(
    root: &'a Table,
    path: &[&str],
    file: &str,
) -> Result<Option<&'a dyn TableLike>, EditError> {
    let mut current: &dyn TableLike = root;
    for (depth, key) in path.iter().enumerate() {
        let Some(item) = current.get(key) else {
            return Ok(None);
        };
        current = item.as_table_like().ok_or_else(|| EditError::Shape {
            file: file.to_owned(),
            key: dotted(&path[..=depth]),
            message: "must be a table".to_owned(),
        })?;
    }
    Ok(Some(current))
}

/// `keys` as a dotted TOML key, quoting the ones that need it.
pub(in crate::runtime) fn dotted(keys: &[&str]) -> String {
    keys.iter()
        .map(|key| toml_edit::Key::new(*key).display_repr().into_owned())
        .collect::<Vec<_>>()
        .join(".")
}

/// The table under `key` in `parent`, created (empty) when missing; a shape error naming `path`
/// when it is something else. `parent` must hold only standard tables (see [`plain_table`]).
pub(in crate::runtime) fn child_table<'a>(
    parent: &'a mut Table,
    key: &str,
    path: &str,
    file: &str,
) -> Result<&'a mut Table, EditError> {
    parent
        .entry(key)
        .or_insert_with(|| Item::Table(Table::new()))
        .as_table_mut()
        .ok_or_else(|| EditError::Shape {
            file: file.to_owned(),
            key: path.to_owned(),
            message: "must be a table".to_owned(),
        })
}

/// The string under `key` in `table`, `None` when missing; a shape error naming `path` when it is
/// not a string.
pub(in crate::runtime) fn optional_str<'a>(
    table: &'a Table,
    key: &str,
    path: &str,
    file: &str,
) -> Result<Option<&'a str>, EditError> {
    match table.get(key) {
        None => Ok(None),
        Some(item) => item.as_str().map(Some).ok_or_else(|| EditError::Shape {
            file: file.to_owned(),
            key: path.to_owned(),
            message: "must be a string".to_owned(),
        }),
    }
}

/// A copy of `source` for a generated file: standard tables all the way down (inline and dotted
/// tables become `[headers]`), values in toml_edit's default layout, without the user's comments.
/// Key order is kept, so the output is a deterministic function of the input.
pub(in crate::runtime) fn plain_table(source: &dyn TableLike) -> Table {
    let mut table = Table::new();
    for (key, item) in source.iter() {
        table.insert(key, plain_item(item));
    }
    table
}

fn plain_item(item: &Item) -> Item {
    match item {
        Item::None => Item::None,
        Item::Value(Value::InlineTable(inline)) => Item::Table(plain_table(inline)),
        Item::Value(v) => Item::Value(plain_value(v)),
        Item::Table(table) => Item::Table(plain_table(table)),
        Item::ArrayOfTables(array) => {
            Item::ArrayOfTables(array.iter().map(|t| plain_table(t)).collect::<ArrayOfTables>())
        }
    }
}

fn plain_value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::from(s.value().as_str()),
        Value::Integer(i) => Value::from(*i.value()),
        Value::Float(f) => Value::from(*f.value()),
        Value::Boolean(b) => Value::from(*b.value()),
        Value::Datetime(d) => Value::from(*d.value()),
        Value::Array(array) => Value::Array(array.iter().map(plain_value).collect::<Array>()),
        Value::InlineTable(inline) => Value::InlineTable(
            inline
                .iter()
                .map(|(key, v)| (key, plain_value(v)))
                .collect::<InlineTable>(),
        ),
    }
}

/// Marks every table that only groups other tables as implicit, so that it gets no `[header]` of
/// its own (`[plugins]` and the like). Empty tables keep theirs, so that they stay in the file.
pub(in crate::runtime) fn hide_grouping_headers(table: &mut Table) {
    for (_, item) in table.iter_mut() {
        match item {
            Item::Table(child) => {
                hide_grouping_headers(child);
                let only_tables =
                    !child.is_empty() && child.iter().all(|(_, i)| i.is_table() || i.is_array_of_tables());
                child.set_implicit(only_tables);
            }
            Item::ArrayOfTables(array) => array.iter_mut().for_each(hide_grouping_headers),
            _ => {}
        }
    }
}

/// Renders the edited `after`, keeping `original`'s line endings when toml_edit would not (it
/// writes `\n` after every line): if `before` (the unedited parse) does not reproduce `original`
/// byte for byte but does once turned to CRLF, `after` is turned to CRLF too.
pub(in crate::runtime) fn render_like(original: &str, before: &DocumentMut, after: &DocumentMut) -> String {
    let rendered = after.to_string();
    let before = before.to_string();
    if before != original && original.contains("\r\n") && to_crlf(&before) == original {
        return to_crlf(&rendered);
    }
    rendered
}

fn to_crlf(text: &str) -> String {
    text.replace("\r\n", "\n").replace('\n', "\r\n")
}
