//! The drop-in (`/etc/containerd/conf.d/99-nvidia.toml`), generated from scratch: the CRI plugin
//! table containerd would use without it, plus the `nvidia` runtimes.

use toml_edit::{Array, DocumentMut, Item, Table, value};

use super::toml_helpers::{binary_text, child_table, hide_grouping_headers, optional_str, plain_table, table_at};
use super::{CRI_PLUGIN_V2, CRI_PLUGIN_V3, DEFAULT_CDI_SPEC_DIRS, RUNC, RUNC_SHIM, cri_plugin};
use crate::runtime::{DefaultRuntime, EditError, NvidiaRuntime};

/// Runtimes whose options the `nvidia` runtime copies when the default runtime is not usable.
const FALLBACK_TEMPLATES: [&str; 2] = ["runc", "crun"];

/// First lines of every generated drop-in.
const DROP_IN_HEADER: &str = "\
# Written by gpu-node-agent, which rewrites this file on every run: edit the top-level config instead.
# It holds a copy of the whole CRI plugin table containerd would use without it, because containerd
# 1.x replaces, rather than merges, plugin tables from imported files (containerd/containerd#5837).
";

/// Where the drop-in's CRI table comes from.
pub(super) enum Source<'a> {
    /// `containerd config dump` without the drop-in.
    Dump(&'a DocumentMut),
    /// The files: the top-level config and the others it imports, in load order.
    Files {
        main: Option<&'a DocumentMut>,
        imported: &'a [(&'a str, DocumentMut)],
    },
}

/// The drop-in's schema version and text: `version`, the CRI plugin table containerd would use
/// without it (see [`configure_input`]), and the runtimes.
///
/// The drop-in has the top-level config's schema `version` (containerd 2.x refuses an import of
/// a higher version than the file that imports it, and migrates lower ones). A version 3 dump
/// comes from containerd 2.x, which merges imported plugin tables key by key: there the drop-in
/// holds only what the agent sets, its runtimes' options taken from the dump.
///
/// With CDI on, `cdi_dir` (the agent's spec directory) is added to `cdi_spec_dirs` when the
/// source's list (containerd's default when unset) lacks it.
///
/// [`configure_input`]: super::configure_input
pub(super) fn render_drop_in(
    source: &Source,
    version: u32,
    main_file: &str,
    rt: &NvidiaRuntime,
    cdi_dir: Option<&str>,
) -> Result<(u32, String), EditError> {
    let cri = cri_plugin(version);
    let path = |rest: &str| format!("plugins.\"{cri}\"{rest}");
    let (found, file, note, whole) = match source {
        Source::Dump(dump) => {
            let merging = dump.get("version").and_then(Item::as_integer).is_some_and(|v| v >= 3);
            let dumped = if merging { CRI_PLUGIN_V3 } else { CRI_PLUGIN_V2 };
            let table = table_at(dump.as_table(), &["plugins", dumped], "containerd config dump")?;
            let note = if merging {
                "# containerd 2.x merges it key by key into the CRI table of the other files: it holds only what the agent sets.\n"
            } else {
                "# Its CRI table is the one `containerd config dump` shows without this file (containerd's defaults included).\n"
            };
            (table, "containerd config dump", note.to_owned(), !merging)
        }
        Source::Files { main, imported } => {
            // Each file's CRI table replaces the one before, as containerd 1.x loads them.
            let mut found = match main {
                Some(doc) => table_at(doc.as_table(), &["plugins", cri], main_file)?,
                None => None,
            };
            let mut from_import = None;
            for (imported_file, doc) in imported.iter() {
                if let Some(table) = table_at(doc.as_table(), &["plugins", cri], imported_file)? {
                    (found, from_import) = (Some(table), Some(*imported_file));
                }
            }
            let note = match from_import {
                None => String::new(),
                Some(f) => {
                    format!(
                        "# Here that is the CRI table of {f}: imported after the top-level config, it replaces that one.\n"
                    )
                }
            };
            (found, from_import.unwrap_or(main_file), note, true)
        }
    };
    let mut source_table = found.map(plain_table).unwrap_or_default();
    let source_containerd = child_table(&mut source_table, "containerd", &path(".containerd"), file)?;
    let default = optional_str(
        source_containerd,
        "default_runtime_name",
        &path(".containerd.default_runtime_name"),
        file,
    )?
    .map(str::to_owned);
    let ours = |name: &str| rt.names().any(|n| n == name);
    let existing = child_table(source_containerd, "runtimes", &path(".containerd.runtimes"), file)?.clone();
    let table_of = |name: &str| -> Result<Option<Table>, EditError> {
        match existing.get(name) {
            None => Ok(None),
            Some(item) => item.as_table().cloned().map(Some).ok_or_else(|| EditError::Shape {
                file: file.to_owned(),
                key: path(&format!(".containerd.runtimes.{name}")),
                message: "must be a table".to_owned(),
            }),
        }
    };
    // The runtime the NVIDIA runtimes wrap: the default (unless it is one of them), else runc,
    // else crun, else the user's own `nvidia` runtime.
    let mut base = None;
    for name in default
        .iter()
        .map(String::as_str)
        .filter(|name| !name.is_empty() && !ours(name))
        .chain(FALLBACK_TEMPLATES)
        .chain([rt.name.as_str()])
    {
        if let Some(table) = table_of(name)? {
            base = Some(table);
            break;
        }
    }
    let base = base.unwrap_or_default();

    let mut cri_table = if whole { source_table.clone() } else { Table::new() };
    let containerd = child_table(&mut cri_table, "containerd", &path(".containerd"), file)?;
    let runtimes = child_table(containerd, "runtimes", &path(".containerd.runtimes"), file)?;
    for (name, binary) in rt.all() {
        // A runtime of that name the files already define keeps its own settings (EKS's
        // `nvidia` runtime with its base_runtime_spec): they win over the wrapped runtime's,
        // which fill in only what it leaves out; then the binary is the agent's.
        let mut table = base.clone();
        if let Some(own) = table_of(name)? {
            overlay(&mut table, &own);
        }
        let key = |rest: &str| path(&format!(".containerd.runtimes.{name}{rest}"));
        if optional_str(&table, "runtime_type", &key(".runtime_type"), file)?.is_none_or(str::is_empty) {
            table.insert("runtime_type", value(RUNC_SHIM));
        }
        let binary = binary_text(binary, main_file, &key(".options.BinaryName"))?;
        child_table(&mut table, "options", &key(".options"), file)?.insert("BinaryName", value(binary));
        runtimes.insert(name, Item::Table(table));
    }
    match rt.default {
        DefaultRuntime::Set => {
            containerd.insert("default_runtime_name", value(rt.name.as_str()));
        }
        DefaultRuntime::Unset if default.as_deref().is_some_and(ours) => {
            if whole {
                containerd.remove("default_runtime_name");
            } else {
                // Merged into the other files' table: only a value replaces theirs.
                containerd.insert("default_runtime_name", value(RUNC));
            }
        }
        DefaultRuntime::Unset | DefaultRuntime::Keep => {}
    }
    if whole {
        // containerd's CRI plugin does not load when the default runtime is not defined; `runc`
        // is containerd's own default, defined the way containerd's built-in configuration does.
        let default = containerd
            .get("default_runtime_name")
            .and_then(Item::as_str)
            .filter(|d| !d.is_empty())
            .unwrap_or(RUNC)
            .to_owned();
        let runtimes = child_table(containerd, "runtimes", &path(".containerd.runtimes"), file)?;
        if default == RUNC && !runtimes.contains_key(RUNC) {
            let mut runc = Table::new();
            runc.insert("runtime_type", value(RUNC_SHIM));
            runtimes.insert(RUNC, Item::Table(runc));
            runtimes.sort_values_by(|a, _, b, _| (a.get() != RUNC).cmp(&(b.get() != RUNC)));
        }
    }
    if rt.enable_cdi {
        cri_table.insert("enable_cdi", value(true));
        if let Some(dir) = cdi_dir {
            let key = path(".cdi_spec_dirs");
            let dirs: Vec<String> = match source_table.get("cdi_spec_dirs") {
                None => DEFAULT_CDI_SPEC_DIRS.iter().map(|d| (*d).to_owned()).collect(),
                Some(item) => item
                    .as_array()
                    .and_then(|a| a.iter().map(|v| v.as_str().map(str::to_owned)).collect())
                    .ok_or_else(|| EditError::Shape {
                        file: file.to_owned(),
                        key,
                        message: "must be an array of strings".to_owned(),
                    })?,
            };
            let trimmed = |d: &str| d.trim_end_matches('/').to_owned();
            if !dirs.iter().any(|d| trimmed(d) == trimmed(dir)) {
                let all = dirs.iter().map(String::as_str).chain([dir]);
                cri_table.insert("cdi_spec_dirs", value(Array::from_iter(all)));
            }
        }
    }

    let mut out = DocumentMut::new();
    out.decor_mut().set_prefix(format!("{DROP_IN_HEADER}{note}"));
    if version >= 2 {
        out.insert("version", value(i64::from(version)));
    }
    let mut plugins = Table::new();
    plugins.insert(cri, Item::Table(cri_table));
    out.insert("plugins", Item::Table(plugins));
    hide_grouping_headers(out.as_table_mut());
    Ok((version, out.to_string()))
}

/// `over`'s keys set in `table`; a table in both is overlaid key by key in turn.
fn overlay(table: &mut Table, over: &Table) {
    for (key, item) in over.iter() {
        match (table.get_mut(key), item) {
            (Some(Item::Table(mine)), Item::Table(theirs)) => overlay(mine, theirs),
            _ => {
                table.insert(key, item.clone());
            }
        }
    }
}
