//! The top-level config (`/etc/containerd/config.toml`): its schema version, the `imports` entry
//! for the drop-in (added, removed, rebased), and containerd's `imports` globbing.

use std::collections::HashSet;

use toml_edit::{Array, DocumentMut, Item, Value, value};

use super::{parse_toml, render_like};
use crate::runtime::EditError;

/// The schema version and the text of the top-level config once [`configure`] is done with it:
/// `main` with the drop-in's directory in `imports` (byte-identical when an entry already covers
/// it), or a fresh file when there is none.
///
/// [`configure`]: super::configure
pub fn configured_main(
    main: Option<&str>,
    main_file: &str,
    drop_in_path: &str,
    binary_major: Option<u32>,
) -> Result<(u32, String), EditError> {
    let doc = main.map(|text| parse_toml(text, main_file)).transpose()?;
    let version = version_of(doc.as_ref(), main_file, binary_major)?;
    let glob = import_glob(drop_in_path);
    let text = match (main, doc) {
        (Some(text), Some(doc)) => add_import(text, doc, main_file, version, &glob, drop_in_path)?,
        _ => fresh_main(version, &glob),
    };
    Ok((version, text))
}

/// `main` (a top-level config's text) with `imports` set to `entries` (added when missing),
/// everything else kept: the stage's copy for `containerd config dump`, with absolute paths
/// under the root and without the agent's drop-in.
pub fn with_imports(main: &str, main_file: &str, entries: &[String]) -> Result<String, EditError> {
    let mut doc = parse_toml(main, main_file)?;
    if let Some(item) = doc.get_mut("imports") {
        string_array(item, main_file, "imports")?;
    }
    doc.insert("imports", value(Array::from_iter(entries.iter().map(String::as_str))));
    Ok(doc.to_string())
}

/// Removes the `imports` entry [`configure`] added for `drop_in_path` (the directory glob, or the
/// drop-in path itself) from the top-level config `main`, and the `imports` key when it is left
/// empty. Everything else stays byte-identical; with no such entry the input is returned as is.
/// An entry that `original` (the file before the agent's first change, when known) already had
/// is the user's own and stays, and so does an `imports` key it had, even empty.
///
/// The stage normally restores its byte-exact backup instead; this is the fallback for a file the
/// user edited since. A `version` line that [`configure`] added to an empty file stays: it is
/// harmless and the user may rely on it by now.
///
/// [`configure`]: super::configure
pub fn unconfigure(
    main: &str,
    main_file: &str,
    drop_in_path: &str,
    original: Option<&str>,
) -> Result<String, EditError> {
    let mut doc = parse_toml(main, main_file)?;
    let before = doc.clone();
    let glob = import_glob(drop_in_path);
    let theirs = original
        .map(|text| imports(text, main_file).unwrap_or_default())
        .unwrap_or_default();
    let theirs_had_key = original
        .and_then(|text| parse_toml(text, main_file).ok())
        .is_some_and(|doc| doc.contains_key("imports"));
    let Some(item) = doc.get_mut("imports") else {
        return Ok(main.to_owned());
    };
    let imports = string_array(item, main_file, "imports")?;
    let ours = |entry: &str| (entry == glob || entry == drop_in_path) && !theirs.iter().any(|t| t == entry);
    if !remove_values(imports, ours) {
        return Ok(main.to_owned());
    }
    if imports.is_empty() && !theirs_had_key {
        doc.remove("imports");
    }
    Ok(render_like(main, &before, &doc))
}

/// The `imports` entries of a containerd config (`text`, the contents of `file`), in order; empty
/// when it has none.
pub fn imports(text: &str, file: &str) -> Result<Vec<String>, EditError> {
    let mut doc = parse_toml(text, file)?;
    match doc.get_mut("imports") {
        None => Ok(Vec::new()),
        Some(item) => Ok(string_array(item, file, "imports")?
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()),
    }
}

/// The `imports` entries the top-level config (`main`, `None`: no file) has once [`configure`]
/// is done with it: its own, plus the drop-in's directory glob unless an entry already covers
/// `drop_in_path`.
///
/// [`configure`]: super::configure
pub fn imports_after_configure(
    main: Option<&str>,
    main_file: &str,
    drop_in_path: &str,
) -> Result<Vec<String>, EditError> {
    let glob = import_glob(drop_in_path);
    let mut entries = match main {
        Some(text) => imports(text, main_file)?,
        None => Vec::new(),
    };
    if !entries.iter().any(|entry| covers(entry, &glob, drop_in_path)) {
        entries.push(glob);
    }
    Ok(entries)
}

/// Go's `filepath.Match` for one path component (containerd globs `imports` entries with
/// `filepath.Glob`): `*` any run of characters, `?` one character, `[a-z]` / `[^a-z]` a class,
/// `\` escapes the next character. A malformed pattern matches nothing.
pub fn glob_component_matches(pattern: &str, name: &str) -> bool {
    /// `Err`: malformed pattern. `p` and `s` are always suffixes of the pattern and the name,
    /// and `failed` holds the (pattern, name) suffix lengths already known not to match, so
    /// that each pair is tried once: without it every `*` retried every split of the rest of
    /// the name again, and `*a*a*a*a*a*a*a*a*b` took time exponential in the stars.
    fn go(p: &[char], s: &[char], failed: &mut HashSet<(usize, usize)>) -> Result<bool, ()> {
        if failed.contains(&(p.len(), s.len())) {
            return Ok(false);
        }
        let matched = step(p, s, failed)?;
        if !matched {
            failed.insert((p.len(), s.len()));
        }
        Ok(matched)
    }
    fn step(p: &[char], s: &[char], failed: &mut HashSet<(usize, usize)>) -> Result<bool, ()> {
        let Some((&c, rest)) = p.split_first() else {
            return Ok(s.is_empty());
        };
        match c {
            '*' => {
                for n in 0..=s.len() {
                    if go(rest, &s[n..], failed)? {
                        return Ok(true);
                    }
                }
                Ok(false)
            }
            '?' => Ok(!s.is_empty() && go(rest, &s[1..], failed)?),
            '[' => {
                let (matched, rest) = class(rest, s.first().copied())?;
                Ok(matched && go(rest, &s[1..], failed)?)
            }
            '\\' => {
                let (&e, rest) = rest.split_first().ok_or(())?;
                Ok(s.first() == Some(&e) && go(rest, &s[1..], failed)?)
            }
            _ => Ok(s.first() == Some(&c) && go(rest, &s[1..], failed)?),
        }
    }
    /// A class after its `[`: whether `ch` is in it (false without a character), and the pattern
    /// after its `]`.
    fn class(mut p: &[char], ch: Option<char>) -> Result<(bool, &[char]), ()> {
        let negated = p.first() == Some(&'^');
        if negated {
            p = &p[1..];
        }
        let mut hit = false;
        let mut ranges = 0;
        loop {
            if p.first() == Some(&']') && ranges > 0 {
                p = &p[1..];
                break;
            }
            let lo;
            (lo, p) = escaped(p)?;
            let mut hi = lo;
            if p.first() == Some(&'-') {
                (hi, p) = escaped(&p[1..])?;
            }
            hit |= ch.is_some_and(|c| lo <= c && c <= hi);
            ranges += 1;
        }
        Ok((ch.is_some() && hit != negated, p))
    }
    fn escaped(p: &[char]) -> Result<(char, &[char]), ()> {
        match p {
            [] | ['-' | ']', ..] => Err(()),
            ['\\', c, rest @ ..] => Ok((*c, rest)),
            ['\\'] => Err(()),
            [c, rest @ ..] => Ok((*c, rest)),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = name.chars().collect();
    go(&p, &s, &mut HashSet::new()).unwrap_or(false)
}

/// Rewrites every `imports` entry of the top-level config `main` through `map`, keeping the rest
/// byte-identical.
///
/// The stage uses it to check a config written under a `--root` prefix: it maps
/// `/etc/containerd/conf.d/*.toml` to `<root>/etc/containerd/conf.d/*.toml` and runs
/// `containerd --config <rebased copy> config dump`.
pub fn rebase_imports(main: &str, main_file: &str, map: impl Fn(&str) -> String) -> Result<String, EditError> {
    let mut doc = parse_toml(main, main_file)?;
    let before = doc.clone();
    let Some(item) = doc.get_mut("imports") else {
        return Ok(main.to_owned());
    };
    let imports = string_array(item, main_file, "imports")?;
    let mut changed = false;
    for index in 0..imports.len() {
        let Some((entry, decor)) = imports
            .get(index)
            .and_then(|v| Some((v.as_str()?.to_owned(), v.decor().clone())))
        else {
            continue;
        };
        let mapped = map(&entry);
        if mapped != entry {
            let mut new = Value::from(mapped);
            *new.decor_mut() = decor;
            imports.replace_formatted(index, new);
            changed = true;
        }
    }
    if !changed {
        return Ok(main.to_owned());
    }
    Ok(render_like(main, &before, &doc))
}

/// Version of a parsed top-level config; see [`detect_version`].
///
/// [`detect_version`]: super::detect_version
pub(super) fn version_of(doc: Option<&DocumentMut>, file: &str, binary_major: Option<u32>) -> Result<u32, EditError> {
    let shape = |message: String| EditError::Shape {
        file: file.to_owned(),
        key: "version".to_owned(),
        message,
    };
    let Some(doc) = doc.filter(|doc| !doc.is_empty()) else {
        return Ok(if binary_major.is_some_and(|major| major >= 2) {
            3
        } else {
            2
        });
    };
    let version = match doc.get("version") {
        None => 1,
        Some(item) => item
            .as_integer()
            .ok_or_else(|| shape("must be an integer".to_owned()))?,
    };
    match version {
        1..=3 => Ok(version as u32),
        other => Err(shape(format!(
            "config version {other} is not supported (1, 2 and 3 are)"
        ))),
    }
}

/// The `imports` entry that covers the drop-in: every `.toml` file in its directory, the way
/// `nvidia-ctk` and the GPU Operator write it.
fn import_glob(drop_in_path: &str) -> String {
    match drop_in_path.rsplit_once('/') {
        Some((dir, _)) => format!("{dir}/*.toml"),
        None => "*.toml".to_owned(),
    }
}

/// The top-level config for a host that has none.
fn fresh_main(version: u32, glob: &str) -> String {
    let mut doc = DocumentMut::new();
    doc.insert("version", value(i64::from(version)));
    doc.insert("imports", value(Array::from_iter([glob])));
    doc.to_string()
}

/// Appends `glob` to the `imports` of the parsed top-level config `doc` (whose text is `text`)
/// unless an entry already matches the drop-in. An empty file also gets `version` first.
fn add_import(
    text: &str,
    mut doc: DocumentMut,
    file: &str,
    version: u32,
    glob: &str,
    drop_in_path: &str,
) -> Result<String, EditError> {
    let before = doc.clone();
    if let Some(item) = doc.get_mut("imports") {
        let imports = string_array(item, file, "imports")?;
        let covered = imports
            .iter()
            .filter_map(Value::as_str)
            .any(|entry| covers(entry, glob, drop_in_path));
        if covered {
            return Ok(text.to_owned());
        }
        push_like_last(imports, glob);
        return Ok(render_like(text, &before, &doc));
    }
    if doc.is_empty() {
        // Only comments and whitespace, which toml_edit keeps as the document's trailing text:
        // keep them on top, before the keys.
        doc.insert("version", value(i64::from(version)));
        let mut comments = doc.trailing().as_str().unwrap_or_default().to_owned();
        if !comments.is_empty() && !comments.ends_with('\n') {
            // A last comment line without its newline would swallow `version = N`.
            comments.push('\n');
        }
        doc.set_trailing("");
        if !comments.trim().is_empty()
            && let Some(mut key) = doc.key_mut("version")
        {
            key.leaf_decor_mut().set_prefix(comments);
        }
    }
    doc.insert("imports", value(Array::from_iter([glob])));
    Ok(render_like(text, &before, &doc))
}

/// `item` as an array of strings, or a shape error naming `key`.
fn string_array<'a>(item: &'a mut Item, file: &str, key: &str) -> Result<&'a mut Array, EditError> {
    let shape = || EditError::Shape {
        file: file.to_owned(),
        key: key.to_owned(),
        message: "must be an array of strings".to_owned(),
    };
    let array = item.as_array_mut().ok_or_else(shape)?;
    if array.iter().all(|v| v.as_str().is_some()) {
        Ok(array)
    } else {
        Err(shape())
    }
}

/// Appends `entry` to `array` in the style of its last element: on a line of its own when the
/// array has one element per line, and as a 'literal string' when the last element is one.
fn push_like_last(array: &mut Array, entry: &str) {
    let last = array.iter().last();
    let literal = last
        .and_then(|v| match v {
            Value::String(s) => s.as_repr(),
            _ => None,
        })
        .and_then(|repr| repr.as_raw().as_str())
        .is_some_and(|raw| raw.starts_with('\''));
    let mut new = Value::from(entry);
    if literal
        && !entry.contains(['\'', '\n', '\r'])
        && let Ok(parsed) = format!("'{entry}'").parse::<Value>()
    {
        new = parsed;
    }
    new.decor_mut().clear();
    match last.and_then(|v| v.decor().prefix()).and_then(|p| p.as_str()) {
        None => array.push(new),
        Some(prefix) => {
            new.decor_mut()
                .set_prefix(if prefix.contains('\n') { prefix } else { " " }.to_owned());
            array.push_formatted(new);
        }
    }
}

/// Removes the string elements for which `gone` holds; true when it removed any. A removed first
/// element hands its leading whitespace to the new first element, and one that leaves the array
/// empty hands its trailing whitespace to the array (`imports = [\n]` comes back as it was).
fn remove_values(array: &mut Array, gone: impl Fn(&str) -> bool) -> bool {
    let mut removed = false;
    let mut index = 0;
    while let Some(entry) = array.get(index) {
        if !entry.as_str().is_some_and(&gone) {
            index += 1;
            continue;
        }
        let old = array.remove(index);
        removed = true;
        if index == 0
            && let Some(first) = array.get_mut(0)
        {
            let prefix = old
                .decor()
                .prefix()
                .and_then(|p| p.as_str())
                .unwrap_or_default()
                .to_owned();
            first.decor_mut().set_prefix(prefix);
        }
        if array.is_empty() {
            // Without a trailing comma, the whitespace before `]` parses as the element's.
            let suffix = old.decor().suffix().and_then(|s| s.as_str()).unwrap_or_default();
            let trailing = format!("{suffix}{}", array.trailing().as_str().unwrap_or_default());
            array.set_trailing(trailing);
        }
    }
    removed
}

/// Whether the `imports` entry `entry` already brings in the drop-in at `drop_in_path` (`glob` is
/// the entry [`configure`] would add).
///
/// [`configure`]: super::configure
fn covers(entry: &str, glob: &str, drop_in_path: &str) -> bool {
    entry == glob || glob_matches(entry, drop_in_path)
}

/// Whether the `imports` pattern `pattern` (a `filepath.Glob` pattern) names `path`. Supports `*`
/// and `?`; a pattern with character classes or escapes only matches itself literally.
pub(super) fn glob_matches(pattern: &str, path: &str) -> bool {
    if pattern.contains(['[', '\\']) {
        return pattern == path;
    }
    /// `failed`: the (pattern, path) suffix lengths known not to match, as in
    /// [`glob_component_matches`], so that many `*`s do not take exponential time.
    fn go(p: &[char], s: &[char], failed: &mut HashSet<(usize, usize)>) -> bool {
        if failed.contains(&(p.len(), s.len())) {
            return false;
        }
        let matched = match p.split_first() {
            None => s.is_empty(),
            Some(('*', rest)) => (0..=s.len())
                .take_while(|&n| n == 0 || s[n - 1] != '/')
                .any(|n| go(rest, &s[n..], failed)),
            Some(('?', rest)) => s.first().is_some_and(|&c| c != '/') && go(rest, &s[1..], failed),
            Some((c, rest)) => s.first() == Some(c) && go(rest, &s[1..], failed),
        };
        if !matched {
            failed.insert((p.len(), s.len()));
        }
        matched
    }
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = path.chars().collect();
    go(&p, &s, &mut HashSet::new())
}
