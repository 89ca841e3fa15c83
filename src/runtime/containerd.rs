//! containerd: the `nvidia` runtime as a drop-in file, imported from the top-level config.
//!
//! Pure text edits, modelled on `nvidia-ctk runtime configure --runtime=containerd` with a drop-in:
//!
//! - The top-level config (`/etc/containerd/config.toml`) only gains an `imports` entry for the
//!   drop-in's directory (`/etc/containerd/conf.d/*.toml`). It is edited with `toml_edit`, so the
//!   user's comments, key order and layout stay byte-identical, and a file that needs no change is
//!   returned unchanged (the stage then writes nothing).
//! - The drop-in (`/etc/containerd/conf.d/99-nvidia.toml`) is generated from scratch. It holds a copy
//!   of the **whole** CRI plugin table of the top-level config plus the `nvidia` runtime, because
//!   containerd 1.x replaces, rather than merges, a plugin table that comes from an imported
//!   file (containerd/containerd#5837): a drop-in holding only the `nvidia` runtime would wipe the
//!   user's CRI settings (`runc`'s `SystemdCgroup = true` among them). For a version 2 config
//!   (containerd 1.x, which always replaces) the copied table is the one containerd ends up with
//!   from the top-level config and the other files it imports ([`configure_with_imports`]): a CRI
//!   table in `conf.d/50-registry.toml` replaces the top-level one, and the drop-in keeps it.
//! - The `nvidia` runtime copies the options of the runtime it wraps (the default runtime, else
//!   `runc`, else `crun`) and sets `options.BinaryName` to the NVIDIA runtime binary.
//!
//! Config versions 2 (containerd 1.x, plugin `io.containerd.grpc.v1.cri`) and 3 (containerd 2.x,
//! plugin `io.containerd.cri.v1.runtime`) are supported. Version 1 has no `imports`; such a file has
//! to be migrated with `containerd config migrate` first.
//!
//! The TOML helpers at the bottom (`parse_toml`, `plain_table`, ...) are shared with the CRI-O
//! module.

use toml_edit::{Array, ArrayOfTables, DocumentMut, InlineTable, Item, Table, TableLike, Value, value};

use super::{DefaultRuntime, EditError, NvidiaRuntime};

/// CRI plugin of config version 2 (containerd 1.x; containerd 2.x migrates it on load).
pub const CRI_PLUGIN_V2: &str = "io.containerd.grpc.v1.cri";

/// CRI runtime plugin of config version 3 (containerd 2.x). Its table holds `containerd.runtimes`,
/// `containerd.default_runtime_name` and `enable_cdi`, like the version 2 CRI plugin did.
pub const CRI_PLUGIN_V3: &str = "io.containerd.cri.v1.runtime";

/// The runc shim, the `runtime_type` containerd uses for runc-compatible runtimes.
const RUNC_SHIM: &str = "io.containerd.runc.v2";

/// containerd's default runtime when `default_runtime_name` is not set.
const RUNC: &str = "runc";

/// Runtimes whose options the `nvidia` runtime copies when the default runtime is not usable.
const FALLBACK_TEMPLATES: [&str; 2] = ["runc", "crun"];

/// First lines of every generated drop-in.
const DROP_IN_HEADER: &str = "\
# Written by gpu-node-agent, which rewrites this file on every run: edit the top-level config instead.
# It holds a copy of the whole CRI plugin table containerd would use without it, because containerd
# 1.x replaces, rather than merges, plugin tables from imported files (containerd/containerd#5837).
";

/// The two files [`configure`] renders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerdFiles {
    /// Config schema version of both files (2 or 3).
    pub version: u32,
    /// New text of the top-level config. Byte-identical to the input when it already imports the
    /// drop-in.
    pub main: String,
    /// Full text of the drop-in.
    pub drop_in: String,
}

/// The config schema version (1, 2 or 3) to edit `main` (the top-level config's text, `None`
/// when the file does not exist) with.
///
/// A file with `version = N` is version N; a non-empty file without `version` is version 1 (the
/// schema of Docker's `containerd.io` package, which containerd 1.x still reads, `imports`
/// included, with plugins under short names such as `plugins.cri`, and 2.x migrates). With no file, or one holding only comments and whitespace, the
/// version follows the installed containerd: `binary_major` 2 or later gives 3, anything else
/// (1.x, or unknown) gives 2, which every containerd from 1.5 on reads.
pub fn detect_version(main: Option<&str>, file: &str, binary_major: Option<u32>) -> Result<u32, EditError> {
    let doc = main.map(|text| parse_toml(text, file)).transpose()?;
    version_of(doc.as_ref(), file, binary_major)
}

/// The CRI plugin that holds the runtimes in a config of schema `version`: 3 and above give
/// [`CRI_PLUGIN_V3`], 2 [`CRI_PLUGIN_V2`], 1 the short name `cri`.
pub fn cri_plugin(version: u32) -> &'static str {
    match version {
        0 | 1 => CRI_PLUGIN_V1,
        2 => CRI_PLUGIN_V2,
        _ => CRI_PLUGIN_V3,
    }
}

/// The CRI plugin's name in a version 1 config.
pub const CRI_PLUGIN_V1: &str = "cri";

/// The plugin IDs that, listed in `disabled_plugins`, turn containerd's CRI off.
const CRI_PLUGIN_IDS: [&str; 3] = [CRI_PLUGIN_V1, CRI_PLUGIN_V2, CRI_PLUGIN_V3];

/// Whether containerd's CRI plugin is off: `disabled_plugins` of `text` (the effective config,
/// or the top-level file when containerd cannot be asked) names it. Docker's `containerd.io`
/// package ships `disabled_plugins = ["cri"]`: no kubelet can use such a containerd, so the agent
/// leaves it alone. A file that does not parse says nothing here (the edit reports it).
pub fn cri_disabled(text: &str) -> bool {
    let Ok(doc) = text.parse::<DocumentMut>() else {
        return false;
    };
    doc.get("disabled_plugins").and_then(Item::as_array).is_some_and(|a| {
        a.iter()
            .any(|v| v.as_str().is_some_and(|id| CRI_PLUGIN_IDS.contains(&id)))
    })
}

/// What [`configure_input`] works from: the files containerd reads and what it says itself.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// The top-level config's text (`None`: no file).
    pub main: Option<&'a str>,
    /// Its path, for error messages.
    pub main_file: &'a str,
    /// The drop-in's absolute host path, e.g. `/etc/containerd/conf.d/99-nvidia.toml`.
    pub drop_in_path: &'a str,
    /// The installed containerd's major version, used only when there is no config to read the
    /// version from (see [`detect_version`]).
    pub binary_major: Option<u32>,
    /// The other files containerd imports, in its load order, without the drop-in.
    pub imported: &'a [ImportedFile],
    /// `containerd config dump` of the configured top-level file without the drop-in (see
    /// [`effective_main`]): the configuration containerd would run with, its built-in defaults
    /// included. `None` where containerd cannot be asked (not installed, or the dump failed).
    pub effective: Option<&'a str>,
}

/// Adds the runtime `rt` to containerd.
///
/// `main` is the top-level config's text (`None` when the file does not exist) and `main_file`
/// its path, for error messages. `drop_in_path` is the drop-in's absolute host path, e.g.
/// `/etc/containerd/conf.d/99-nvidia.toml`: the top-level config must import it, so
/// `"<dir of drop-in>/*.toml"` is appended to `imports` unless an entry already matches it.
/// `binary_major` is the installed containerd's major version, used only when there is no
/// config to read the version from (see [`detect_version`]).
///
/// The result is stable: running it again on the returned `main` gives the same two texts, and
/// `main` byte-identical to its input, so an already configured host needs no writes. A runtime
/// the user configured by hand in the top-level file is left there; the drop-in overrides it.
pub fn configure(
    main: Option<&str>,
    main_file: &str,
    drop_in_path: &str,
    binary_major: Option<u32>,
    rt: &NvidiaRuntime,
) -> Result<ContainerdFiles, EditError> {
    configure_with_imports(main, main_file, drop_in_path, binary_major, rt, &[])
}

/// A file containerd loads through `imports` (from the top-level config or from another imported
/// file), with its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedFile {
    /// Its path (absolute host path), for error messages and the drop-in's header.
    pub file: String,
    pub text: String,
}

/// [`configure`], knowing the other files containerd imports: `imported` in containerd's load
/// order (the top-level config's [`imports_after_configure`] breadth first, glob matches sorted,
/// each file once), without the agent's drop-in. See [`configure_input`].
pub fn configure_with_imports(
    main: Option<&str>,
    main_file: &str,
    drop_in_path: &str,
    binary_major: Option<u32>,
    rt: &NvidiaRuntime,
    imported: &[ImportedFile],
) -> Result<ContainerdFiles, EditError> {
    let input = Input {
        main,
        main_file,
        drop_in_path,
        binary_major,
        imported,
        effective: None,
    };
    configure_input(&input, rt)
}

/// The two files that add `rt` to containerd.
///
/// The drop-in holds the whole CRI plugin table containerd would use without it, plus the
/// runtimes, because containerd 1.x replaces a plugin table from an import as a whole:
///
/// - With `input.effective` (`containerd config dump`), that table is the dump's: every file
///   and containerd's built-in defaults are already in it, `runc` and the default runtime
///   included.
/// - Without it, it is the CRI table of the last of [top-level config, `imported`...] that has
///   one (version 1 and 2; for version 3 only the top-level config's, since containerd 2.0 and
///   later merge imported plugin tables key by key), and `runc` is added as containerd defines it
///   when the default runtime is `runc` and the files do not define it: containerd's CRI plugin
///   refuses to load when `default_runtime_name` names no runtime (k8s-device-plugin#1145).
///
/// An imported file that does not parse is an error naming it (containerd would not start with
/// it either).
pub fn configure_input(input: &Input, rt: &NvidiaRuntime) -> Result<ContainerdFiles, EditError> {
    let (version, main) = configured_main(input.main, input.main_file, input.drop_in_path, input.binary_major)?;
    let doc = input.main.map(|text| parse_toml(text, input.main_file)).transpose()?;
    let effective = input
        .effective
        .map(|text| parse_toml(text, "containerd config dump"))
        .transpose()?;
    let imported = if version <= 2 && effective.is_none() {
        input
            .imported
            .iter()
            .map(|f| Ok((f.file.as_str(), parse_toml(&f.text, &f.file)?)))
            .collect::<Result<Vec<_>, EditError>>()?
    } else {
        Vec::new()
    };
    let source = match &effective {
        Some(dump) => Source::Dump(dump),
        None => Source::Files {
            main: doc.as_ref(),
            imported: &imported,
        },
    };
    let (version, drop_in) = render_drop_in(&source, version, input.main_file, rt)?;
    Ok(ContainerdFiles { version, main, drop_in })
}

/// The schema version and the text of the top-level config once [`configure`] is done with it:
/// `main` with the drop-in's directory in `imports` (byte-identical when an entry already covers
/// it), or a fresh file when there is none.
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
/// is the user's own and stays.
///
/// The stage normally restores its byte-exact backup instead; this is the fallback for a file the
/// user edited since. A `version` line that [`configure`] added to an empty file stays: it is
/// harmless and the user may rely on it by now.
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
    let Some(item) = doc.get_mut("imports") else {
        return Ok(main.to_owned());
    };
    let imports = string_array(item, main_file, "imports")?;
    let ours = |entry: &str| (entry == glob || entry == drop_in_path) && !theirs.iter().any(|t| t == entry);
    if !remove_values(imports, ours) {
        return Ok(main.to_owned());
    }
    if imports.is_empty() {
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
    /// `Err`: malformed pattern.
    fn go(p: &[char], s: &[char]) -> Result<bool, ()> {
        let Some((&c, rest)) = p.split_first() else {
            return Ok(s.is_empty());
        };
        match c {
            '*' => {
                for n in 0..=s.len() {
                    if go(rest, &s[n..])? {
                        return Ok(true);
                    }
                }
                Ok(false)
            }
            '?' => Ok(!s.is_empty() && go(rest, &s[1..])?),
            '[' => {
                let (matched, rest) = class(rest, s.first().copied())?;
                Ok(matched && go(rest, &s[1..])?)
            }
            '\\' => {
                let (&e, rest) = rest.split_first().ok_or(())?;
                Ok(s.first() == Some(&e) && go(rest, &s[1..])?)
            }
            _ => Ok(s.first() == Some(&c) && go(rest, &s[1..])?),
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
    go(&p, &s).unwrap_or(false)
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

/// Checks that `dump`, the output of `containerd config dump` (the merged config, version 2 or
/// 3), has the runtimes of `rt`: `plugins.<cri>.containerd.runtimes.<name>.options.BinaryName`
/// is the runtime's binary, the runtime `default_runtime_name` names (`runc` when unset) is
/// defined (the CRI plugin does not load otherwise), and, when requested, `default_runtime_name`
/// is `rt.name` and `enable_cdi` is true.
///
/// The error lists everything that is missing, in words.
pub fn dump_has_runtime(dump: &str, rt: &NvidiaRuntime) -> Result<(), String> {
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| format!("config dump is not valid TOML: {}", e.message()))?;
    let version = match doc.get("version").map(|v| v.as_integer()) {
        None => 2,
        Some(Some(v)) => u32::try_from(v).map_err(|_| format!("config dump has version {v}"))?,
        Some(None) => return Err("config dump has a non-integer version".to_owned()),
    };
    let cri = cri_plugin(version.max(2));
    let cri_item = doc.get("plugins").and_then(|p| p.get(cri));
    let containerd = cri_item.and_then(|c| c.get("containerd"));
    let runtimes = containerd.and_then(|c| c.get("runtimes"));
    let mut problems = Vec::new();
    for (name, binary) in rt.all() {
        let binary = binary.to_string_lossy();
        match runtimes.and_then(|r| r.get(name)) {
            None => problems.push(format!(
                "no runtime `{name}` (plugins.\"{cri}\".containerd.runtimes.{name})"
            )),
            Some(runtime) => match runtime
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(Item::as_str)
            {
                Some(found) if found == binary => {}
                Some(found) => problems.push(format!(
                    "runtime `{name}` has BinaryName {found:?}, expected {binary:?}"
                )),
                None => problems.push(format!("runtime `{name}` has no options.BinaryName")),
            },
        }
    }
    let default = containerd
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Item::as_str);
    if rt.default == DefaultRuntime::Set && default != Some(rt.name.as_str()) {
        problems.push(format!(
            "default_runtime_name is {}, expected {:?}",
            default.map_or_else(|| "unset".to_owned(), |d| format!("{d:?}")),
            rt.name
        ));
    }
    let default = default.filter(|d| !d.is_empty()).unwrap_or(RUNC);
    if runtimes.and_then(|r| r.get(default)).is_none() {
        problems.push(format!(
            "default_runtime_name {default:?} names no runtime in plugins.\"{cri}\".containerd.runtimes, \
             so containerd's CRI plugin would not load"
        ));
    }
    if rt.enable_cdi && cri_item.and_then(|c| c.get("enable_cdi")).and_then(Item::as_bool) != Some(true) {
        problems.push(format!("plugins.\"{cri}\".enable_cdi is not true"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The CRI socket of the effective configuration `dump`: `[grpc] address`, containerd's
/// default `/run/containerd/containerd.sock` when unset.
pub fn dump_address(dump: &str) -> String {
    dump.parse::<DocumentMut>()
        .ok()
        .and_then(|doc| doc.get("grpc")?.get("address")?.as_str().map(str::to_owned))
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| DEFAULT_ADDRESS.to_owned())
}

/// containerd's gRPC (and CRI) socket when `[grpc] address` is not set.
pub const DEFAULT_ADDRESS: &str = "/run/containerd/containerd.sock";

// === top-level config ===

/// Version of a parsed top-level config; see [`detect_version`].
fn version_of(doc: Option<&DocumentMut>, file: &str, binary_major: Option<u32>) -> Result<u32, EditError> {
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
/// element hands its leading whitespace to the new first element.
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
    }
    removed
}

/// Whether the `imports` entry `entry` already brings in the drop-in at `drop_in_path` (`glob` is
/// the entry [`configure`] would add).
fn covers(entry: &str, glob: &str, drop_in_path: &str) -> bool {
    entry == glob || glob_matches(entry, drop_in_path)
}

/// Whether the `imports` pattern `pattern` (a `filepath.Glob` pattern) names `path`. Supports `*`
/// and `?`; a pattern with character classes or escapes only matches itself literally.
fn glob_matches(pattern: &str, path: &str) -> bool {
    if pattern.contains(['[', '\\']) {
        return pattern == path;
    }
    fn go(p: &[char], s: &[char]) -> bool {
        match p.split_first() {
            None => s.is_empty(),
            Some(('*', rest)) => (0..=s.len())
                .take_while(|&n| n == 0 || s[n - 1] != '/')
                .any(|n| go(rest, &s[n..])),
            Some(('?', rest)) => s.first().is_some_and(|&c| c != '/') && go(rest, &s[1..]),
            Some((c, rest)) => s.first() == Some(c) && go(rest, &s[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = path.chars().collect();
    go(&p, &s)
}

/// Renders the edited `after`, keeping `original`'s line endings when toml_edit would not (it
/// writes `\n` after every line): if `before` (the unedited parse) does not reproduce `original`
/// byte for byte but does once turned to CRLF, `after` is turned to CRLF too.
fn render_like(original: &str, before: &DocumentMut, after: &DocumentMut) -> String {
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

// === drop-in ===

/// Where the drop-in's CRI table comes from.
enum Source<'a> {
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
fn render_drop_in(
    source: &Source,
    version: u32,
    main_file: &str,
    rt: &NvidiaRuntime,
) -> Result<(u32, String), EditError> {
    let cri = cri_plugin(version);
    let path = |rest: &str| format!("plugins.\"{cri}\"{rest}");
    let (found, file, note, whole) = match source {
        Source::Dump(dump) => {
            let merging = dump.get("version").and_then(Item::as_integer).is_some_and(|v| v >= 3);
            let dumped = if merging { CRI_PLUGIN_V3 } else { CRI_PLUGIN_V2 };
            let table = table_at(dump.as_table(), &["plugins", dumped], "containerd config dump")?;
            let note = if merging {
                "# containerd 2.x merges it key by key into the CRI table of the other files: it holds only the runtimes.\n"
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

// === TOML helpers, shared with the CRI-O module ===

/// Parses `text` (the contents of `file`), turning toml_edit's error into [`EditError::Parse`]
/// with a 1-based line and column.
pub(super) fn parse_toml(text: &str, file: &str) -> Result<DocumentMut, EditError> {
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
pub(super) fn line_column(text: &str, offset: usize) -> (usize, usize) {
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
pub(super) fn binary_text<'a>(binary: &'a std::path::Path, file: &str, key: &str) -> Result<&'a str, EditError> {
    binary.to_str().ok_or_else(|| EditError::Shape {
        file: file.to_owned(),
        key: key.to_owned(),
        message: format!("the runtime binary {} is not valid UTF-8", binary.display()),
    })
}

/// The table (standard or inline) at `path` under `root`, `None` when a key on the way is
/// missing, or a shape error naming the first key on the way that is not a table.
pub(super) fn table_at<'a>(root: &'a Table, path: &[&str], file: &str) -> Result<Option<&'a dyn TableLike>, EditError> {
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
pub(super) fn dotted(keys: &[&str]) -> String {
    keys.iter()
        .map(|key| toml_edit::Key::new(*key).display_repr().into_owned())
        .collect::<Vec<_>>()
        .join(".")
}

/// The table under `key` in `parent`, created (empty) when missing; a shape error naming `path`
/// when it is something else. `parent` must hold only standard tables (see [`plain_table`]).
pub(super) fn child_table<'a>(
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
pub(super) fn optional_str<'a>(
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
pub(super) fn plain_table(source: &dyn TableLike) -> Table {
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
pub(super) fn hide_grouping_headers(table: &mut Table) {
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

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStrExt;

    use super::*;

    const MAIN_FILE: &str = "/etc/containerd/config.toml";
    const DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";
    const BINARY: &str = "/usr/bin/nvidia-container-runtime";

    const V2_MAIN: &str = include_str!("../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.main.toml");
    const V2_EXPECTED_MAIN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.expected.main.toml");
    const V2_EXPECTED_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.expected.drop-in.toml");
    const V2_DEFAULT_CDI_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.default-cdi.expected.drop-in.toml");
    const V3_MAIN: &str = include_str!("../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.main.toml");
    const V3_EXPECTED_MAIN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.expected.main.toml");
    const V3_EXPECTED_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.expected.drop-in.toml");
    const V3_DEFAULT_CDI_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.default-cdi.expected.drop-in.toml");
    const FRESH_V2_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/fresh-v2.expected.drop-in.toml");
    const FRESH_V3_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/fresh-v3.expected.drop-in.toml");
    const HAND_MAIN: &str = include_str!("../../tests/fixtures/runtime/containerd/hand-configured.main.toml");
    const HAND_EXPECTED_DROP_IN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/hand-configured.expected.drop-in.toml");
    const COMMENTS_MAIN: &str = include_str!("../../tests/fixtures/runtime/containerd/comments-only.main.toml");
    const COMMENTS_EXPECTED_MAIN: &str =
        include_str!("../../tests/fixtures/runtime/containerd/comments-only.expected.main.toml");
    const BROKEN_MAIN: &str = include_str!("../../tests/fixtures/runtime/containerd/broken.main.toml");
    const DUMP_1_6: &str = include_str!("../../tests/fixtures/runtime/containerd/dump-1.6.20-nvidia-default.toml");

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
        }
    }

    fn run(main: Option<&str>, rt: &NvidiaRuntime) -> ContainerdFiles {
        configure(main, MAIN_FILE, DROP_IN, Some(1), rt).unwrap()
    }

    fn shape_key(err: EditError) -> String {
        match err {
            EditError::Shape { key, .. } => key,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    // === version detection ===

    #[test]
    fn detect_version_follows_the_file_then_the_binary() {
        assert_eq!(detect_version(Some("version = 2\n"), MAIN_FILE, Some(2)).unwrap(), 2);
        assert_eq!(detect_version(Some("version = 3\n"), MAIN_FILE, Some(1)).unwrap(), 3);
        for empty in [None, Some(""), Some("  \n\n"), Some(COMMENTS_MAIN)] {
            assert_eq!(detect_version(empty, MAIN_FILE, Some(2)).unwrap(), 3, "{empty:?}");
            assert_eq!(detect_version(empty, MAIN_FILE, Some(3)).unwrap(), 3, "{empty:?}");
            assert_eq!(detect_version(empty, MAIN_FILE, Some(1)).unwrap(), 2, "{empty:?}");
            assert_eq!(detect_version(empty, MAIN_FILE, None).unwrap(), 2, "{empty:?}");
        }
    }

    #[test]
    fn detect_version_reads_version_1_and_refuses_unknown_versions() {
        // Docker's containerd.io package ships a file without `version`: version 1.
        for text in ["version = 1\n", "root = \"/var/lib/containerd\"\n", "[plugins.cri]\n"] {
            assert_eq!(detect_version(Some(text), MAIN_FILE, Some(1)).unwrap(), 1, "{text}");
        }
        for text in ["version = 4\n", "version = 0\n", "version = -2\n", "version = \"2\"\n"] {
            let err = detect_version(Some(text), MAIN_FILE, Some(2)).unwrap_err();
            assert_eq!(shape_key(err), "version", "{text}");
        }
    }

    #[test]
    fn cri_plugin_per_version() {
        assert_eq!(cri_plugin(1), "cri");
        assert_eq!(cri_plugin(2), "io.containerd.grpc.v1.cri");
        assert_eq!(cri_plugin(3), "io.containerd.cri.v1.runtime");
    }

    // === golden files ===

    #[test]
    fn fresh_host_v2() {
        let out = configure(None, MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap();
        assert_eq!(out.version, 2);
        assert_eq!(out.main, "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n");
        assert_eq!(out.drop_in, FRESH_V2_DROP_IN);
        // An unknown containerd version is treated as 1.x: version 2 is read by 1.5+ and 2.x.
        assert_eq!(
            configure(None, MAIN_FILE, DROP_IN, None, &rt(false, false)).unwrap(),
            out
        );
    }

    #[test]
    fn fresh_host_v3() {
        let out = configure(None, MAIN_FILE, DROP_IN, Some(2), &rt(false, false)).unwrap();
        assert_eq!(out.version, 3);
        assert_eq!(out.main, "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n");
        assert_eq!(out.drop_in, FRESH_V3_DROP_IN);
    }

    #[test]
    fn v2_config_keeps_comments_and_copies_the_cri_table() {
        let out = run(Some(V2_MAIN), &rt(false, false));
        assert_eq!(out.version, 2);
        assert_eq!(out.main, V2_EXPECTED_MAIN);
        assert_eq!(out.drop_in, V2_EXPECTED_DROP_IN);
        // The only change to the main file is the added import line.
        let added: Vec<_> = out.main.lines().filter(|l| !V2_MAIN.lines().any(|m| m == *l)).collect();
        assert_eq!(added, ["imports = [\"/etc/containerd/conf.d/*.toml\"]"]);
        assert!(
            out.main
                .contains("SystemdCgroup = true # the kubelet uses the systemd cgroup driver")
        );
        assert!(out.main.contains("snapshotter = 'overlayfs'"));

        let drop_in = parse_toml(&out.drop_in, DROP_IN).unwrap();
        let cri = &drop_in["plugins"][CRI_PLUGIN_V2];
        let nvidia = &cri["containerd"]["runtimes"]["nvidia"];
        assert_eq!(nvidia["options"]["SystemdCgroup"].as_bool(), Some(true));
        assert_eq!(nvidia["options"]["BinaryName"].as_str(), Some(BINARY));
        assert_eq!(nvidia["runtime_type"].as_str(), Some(RUNC_SHIM));
        assert_eq!(cri["sandbox_image"].as_str(), Some("registry.example.com/pause:3.9"));
        assert_eq!(cri["registry"]["config_path"].as_str(), Some("/etc/containerd/certs.d"));
        assert_eq!(
            cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"].as_bool(),
            Some(true)
        );
        // Other plugins stay in the main file only: containerd replaces plugin tables by key.
        assert!(drop_in["plugins"].get("io.containerd.internal.v1.opt").is_none());
    }

    #[test]
    fn v2_config_set_as_default_and_cdi() {
        let out = run(Some(V2_MAIN), &rt(true, true));
        assert_eq!(out.main, V2_EXPECTED_MAIN);
        assert_eq!(out.drop_in, V2_DEFAULT_CDI_DROP_IN);
    }

    #[test]
    fn v3_config_keeps_layout_and_copies_the_cri_table() {
        let out = run(Some(V3_MAIN), &rt(false, false));
        assert_eq!(out.version, 3);
        assert_eq!(out.main, V3_EXPECTED_MAIN);
        assert_eq!(out.drop_in, V3_EXPECTED_DROP_IN);
        let out = run(Some(V3_MAIN), &rt(true, true));
        assert_eq!(out.main, V3_EXPECTED_MAIN);
        assert_eq!(out.drop_in, V3_DEFAULT_CDI_DROP_IN);
    }

    #[test]
    fn comment_only_file_gets_version_below_its_comments() {
        let out = configure(Some(COMMENTS_MAIN), MAIN_FILE, DROP_IN, Some(2), &rt(false, false)).unwrap();
        assert_eq!(out.version, 3);
        assert_eq!(out.main, COMMENTS_EXPECTED_MAIN);
        assert_eq!(out.drop_in, FRESH_V3_DROP_IN);
        let blank = configure(Some("\n\n"), MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap();
        assert_eq!(
            blank.main,
            "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n"
        );
    }

    #[test]
    fn hand_configured_runtime_is_overridden_in_the_drop_in_only() {
        // The main file already imports conf.d and has its own `nvidia` runtime (and default).
        let out = run(Some(HAND_MAIN), &rt(false, false));
        assert_eq!(out.main, HAND_MAIN, "main must stay byte-identical");
        assert_eq!(out.drop_in, HAND_EXPECTED_DROP_IN);
    }

    // === stability ===

    #[test]
    fn configure_is_idempotent() {
        for main in [None, Some(V2_MAIN), Some(V3_MAIN), Some(HAND_MAIN), Some(COMMENTS_MAIN)] {
            for (set_as_default, enable_cdi) in [(false, false), (true, true), (true, false), (false, true)] {
                let rt = rt(set_as_default, enable_cdi);
                let first = configure(main, MAIN_FILE, DROP_IN, Some(2), &rt).unwrap();
                let second = configure(Some(&first.main), MAIN_FILE, DROP_IN, Some(2), &rt).unwrap();
                assert_eq!(second, first, "{main:?} {rt:?}");
            }
        }
    }

    #[test]
    fn existing_import_entries_that_cover_the_drop_in_count() {
        for imports in [
            "[\"/etc/containerd/conf.d/*.toml\"]",
            "[\"/etc/containerd/conf.d/99-nvidia.toml\"]",
            "[\"/etc/containerd/conf.d/*\"]",
            "[\"/etc/containerd/conf.d/99-*.toml\"]",
            "[\"/etc/containerd/*/*.toml\"]",
        ] {
            let main = format!("version = 2\nimports = {imports}\n");
            assert_eq!(run(Some(&main), &rt(false, false)).main, main);
        }
        let main = "version = 2\nimports = [\"/etc/containerd/*.toml\", \"/etc/containerd/conf.d/[0-9]*.toml\"]\n";
        assert_eq!(
            run(Some(main), &rt(false, false)).main,
            "version = 2\nimports = [\"/etc/containerd/*.toml\", \"/etc/containerd/conf.d/[0-9]*.toml\", \
             \"/etc/containerd/conf.d/*.toml\"]\n"
        );
    }

    #[test]
    fn glob_matching() {
        assert!(glob_matches("/a/b/*.toml", "/a/b/c.toml"));
        assert!(glob_matches("/a/*/c.toml", "/a/b/c.toml"));
        assert!(glob_matches("/a/b/?.toml", "/a/b/c.toml"));
        assert!(glob_matches("/a/b/c.toml", "/a/b/c.toml"));
        assert!(!glob_matches("/a/*.toml", "/a/b/c.toml"));
        assert!(!glob_matches("/a/b/*.conf", "/a/b/c.toml"));
        assert!(!glob_matches("/a/b/[c].toml", "/a/b/c.toml"));
    }

    #[test]
    fn import_is_added_to_a_multi_line_array_on_its_own_line() {
        let main = "version = 2\nimports = [\n  \"/etc/containerd/site.toml\",\n]\n";
        assert_eq!(
            run(Some(main), &rt(false, false)).main,
            "version = 2\nimports = [\n  \"/etc/containerd/site.toml\",\n  \"/etc/containerd/conf.d/*.toml\",\n]\n"
        );
        let main = "version = 2\nimports = []\n";
        assert_eq!(
            run(Some(main), &rt(false, false)).main,
            "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n"
        );
    }

    #[test]
    fn crlf_line_endings_are_kept() {
        let main = "version = 2\r\n# keep CRLF\r\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\r\n  \
                    SystemdCgroup = true\r\n";
        let out = run(Some(main), &rt(false, false));
        assert_eq!(
            out.main,
            "version = 2\r\nimports = [\"/etc/containerd/conf.d/*.toml\"]\r\n# keep CRLF\r\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\r\n  SystemdCgroup = true\r\n"
        );
        assert!(out.drop_in.contains("SystemdCgroup = true\nBinaryName"));
        assert_eq!(unconfigure(&out.main, MAIN_FILE, DROP_IN, None).unwrap(), main);
    }

    // === template runtime ===

    fn nvidia_of(main: &str) -> Table {
        let out = run(Some(main), &rt(false, false));
        let drop_in = parse_toml(&out.drop_in, DROP_IN).unwrap();
        drop_in["plugins"][CRI_PLUGIN_V2]["containerd"]["runtimes"]["nvidia"]
            .as_table()
            .unwrap()
            .clone()
    }

    #[test]
    fn template_is_the_default_runtime_then_runc_then_crun() {
        let runtimes = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\nBinaryName = \"runc\"\n\
                        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\nruntime_type = \"\"\n\
                        options = { BinaryName = \"crun\", Root = \"/run/crun\" }\n";
        let with_default = |default: &str| {
            format!(
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"{default}\"\n{runtimes}"
            )
        };
        let crun = nvidia_of(&with_default("crun"));
        assert_eq!(crun["options"]["Root"].as_str(), Some("/run/crun"));
        assert_eq!(crun["options"]["BinaryName"].as_str(), Some(BINARY));
        assert_eq!(
            crun["runtime_type"].as_str(),
            Some(RUNC_SHIM),
            "an empty runtime_type is filled in"
        );
        // A default that is an NVIDIA runtime itself is skipped, and so is one that does not exist.
        for default in ["nvidia", "nvidia-cdi", "kata"] {
            let runc = nvidia_of(&with_default(default));
            assert!(runc["options"].get("Root").is_none(), "{default}");
            assert_eq!(runc["options"]["BinaryName"].as_str(), Some(BINARY), "{default}");
        }
        let only_crun = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\n\
                         runtime_type = \"io.containerd.runc.v2\"\noptions = { Root = \"/run/crun\" }\n";
        assert_eq!(nvidia_of(only_crun)["options"]["Root"].as_str(), Some("/run/crun"));
        let none = nvidia_of("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nsandbox_image = \"pause\"\n");
        assert_eq!(none.to_string(), "runtime_type = \"io.containerd.runc.v2\"\n");
    }

    #[test]
    fn default_runtime_naming_us_is_dropped_without_set_as_default() {
        let main =
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"nvidia\"\n";
        let out = run(Some(main), &rt(false, false));
        assert!(!out.drop_in.contains("default_runtime_name"), "{}", out.drop_in);
        let main = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"kata\"\n";
        let out = run(Some(main), &rt(false, false));
        assert!(
            out.drop_in.contains("default_runtime_name = \"kata\""),
            "{}",
            out.drop_in
        );
    }

    // === other imported files ===

    const REGISTRY_FILE: &str = "/etc/containerd/conf.d/50-registry.toml";
    const REGISTRY: &str = include_str!("../../tests/fixtures/runtime/containerd/conf.d-50-registry.toml");

    fn imported(files: &[(&str, &str)]) -> Vec<ImportedFile> {
        files
            .iter()
            .map(|(file, text)| ImportedFile {
                file: (*file).to_owned(),
                text: (*text).to_owned(),
            })
            .collect()
    }

    fn with_imports(main: &str, files: &[(&str, &str)]) -> Result<ContainerdFiles, EditError> {
        configure_with_imports(
            Some(main),
            MAIN_FILE,
            DROP_IN,
            Some(1),
            &rt(false, false),
            &imported(files),
        )
    }

    #[test]
    fn v2_drop_in_copies_the_cri_table_containerd_loads_last() {
        let out = with_imports(V2_MAIN, &[(REGISTRY_FILE, REGISTRY)]).unwrap();
        assert_eq!(out.main, V2_EXPECTED_MAIN, "the main file is edited the same way");
        let drop_in = parse_toml(&out.drop_in, DROP_IN).unwrap();
        let cri = &drop_in["plugins"][CRI_PLUGIN_V2];
        assert_eq!(
            cri["sandbox_image"].as_str(),
            Some("registry.internal.example/pause:3.10")
        );
        assert_eq!(
            cri["registry"]["config_path"].as_str(),
            Some("/etc/containerd/certs.d-internal")
        );
        assert!(cri.get("max_container_log_line_size").is_none(), "replaced, not merged");
        let nvidia = &cri["containerd"]["runtimes"]["nvidia"]["options"];
        assert_eq!(nvidia["SystemdCgroup"].as_bool(), Some(true));
        assert_eq!(nvidia["BinaryName"].as_str(), Some(BINARY));
        assert!(
            out.drop_in
                .contains(&format!("# Here that is the CRI table of {REGISTRY_FILE}: ")),
            "{}",
            out.drop_in
        );
        // A later file without a CRI table, or one with only other plugins, changes nothing.
        let other = "version = 2\n[plugins.\"io.containerd.internal.v1.opt\"]\npath = \"/opt/x\"\n";
        let later = with_imports(
            V2_MAIN,
            &[(REGISTRY_FILE, REGISTRY), ("/etc/containerd/conf.d/60-opt.toml", other)],
        );
        assert_eq!(later.unwrap(), out);
        // Without imported CRI tables the drop-in is the usual one.
        let plain = with_imports(V2_MAIN, &[("/etc/containerd/conf.d/60-opt.toml", other)]).unwrap();
        assert_eq!(plain.drop_in, V2_EXPECTED_DROP_IN);
        // Stable: the second run gives the same files.
        let again = configure_with_imports(
            Some(&out.main),
            MAIN_FILE,
            DROP_IN,
            Some(1),
            &rt(false, false),
            &imported(&[(REGISTRY_FILE, REGISTRY)]),
        )
        .unwrap();
        assert_eq!(again, out);
    }

    #[test]
    fn v3_drop_in_copies_only_the_main_cri_table() {
        let v3_import = REGISTRY
            .replace("version = 2", "version = 3")
            .replace(CRI_PLUGIN_V2, CRI_PLUGIN_V3);
        let out = with_imports(V3_MAIN, &[(REGISTRY_FILE, &v3_import)]).unwrap();
        assert_eq!(out.drop_in, V3_EXPECTED_DROP_IN);
    }

    #[test]
    fn a_broken_imported_file_is_a_parse_error_naming_it() {
        let err = with_imports(V2_MAIN, &[(REGISTRY_FILE, "version = 2\n[plugins\n")]).unwrap_err();
        assert!(
            matches!(&err, EditError::Parse { file, line: 2, .. } if file == REGISTRY_FILE),
            "{err:?}"
        );
    }

    #[test]
    fn imports_after_configure_adds_the_drop_in_glob_unless_covered() {
        let glob = "/etc/containerd/conf.d/*.toml";
        assert_eq!(imports_after_configure(None, MAIN_FILE, DROP_IN).unwrap(), [glob]);
        assert_eq!(
            imports_after_configure(Some(V2_MAIN), MAIN_FILE, DROP_IN).unwrap(),
            [glob]
        );
        assert_eq!(
            imports_after_configure(Some(V3_MAIN), MAIN_FILE, DROP_IN).unwrap(),
            ["/etc/containerd/site/*.toml", glob]
        );
        let covered = "version = 2\nimports = [\"/etc/containerd/conf.d/99-*.toml\"]\n";
        assert_eq!(
            imports_after_configure(Some(covered), MAIN_FILE, DROP_IN).unwrap(),
            ["/etc/containerd/conf.d/99-*.toml"]
        );
        assert_eq!(imports("version = 2\n", MAIN_FILE).unwrap(), Vec::<String>::new());
        assert_eq!(shape_key(imports("imports = 1\n", MAIN_FILE).unwrap_err()), "imports");
    }

    #[test]
    fn glob_components_match_like_go() {
        for (pattern, name) in [
            ("*.toml", "50-registry.toml"),
            ("*.toml", ".hidden.toml"),
            ("*", ""),
            ("?0-*", "50-x"),
            ("[0-9]*.toml", "5.toml"),
            ("[^a-z]*", "9x"),
            ("\\*x", "*x"),
            ("a[\\-]b", "a-b"),
        ] {
            assert!(glob_component_matches(pattern, name), "{pattern} {name}");
        }
        for (pattern, name) in [
            ("*.toml", "50-registry.conf"),
            ("?", ""),
            ("[0-9]*", "a9"),
            ("[^a-z]*", "x9"),
            ("[a-", "a"),
            ("[", "["),
            ("[]a]", "]"),
            ("a\\", "a"),
        ] {
            assert!(!glob_component_matches(pattern, name), "{pattern} {name}");
        }
    }

    // === unconfigure and rebase ===

    #[test]
    fn unconfigure_restores_the_main_file() {
        for main in [V2_MAIN, V3_MAIN] {
            let out = run(Some(main), &rt(true, true));
            assert_eq!(unconfigure(&out.main, MAIN_FILE, DROP_IN, None).unwrap(), main);
        }
        let fresh = run(None, &rt(false, false));
        assert_eq!(
            unconfigure(&fresh.main, MAIN_FILE, DROP_IN, None).unwrap(),
            "version = 2\n"
        );
        // The version added to a comment-only file stays.
        let out = configure(Some(COMMENTS_MAIN), MAIN_FILE, DROP_IN, Some(2), &rt(false, false)).unwrap();
        assert_eq!(
            unconfigure(&out.main, MAIN_FILE, DROP_IN, None).unwrap(),
            "# containerd 2.x: no settings yet\n\nversion = 3\n"
        );
    }

    #[test]
    fn unconfigure_removes_only_our_entries() {
        assert_eq!(unconfigure(V2_MAIN, MAIN_FILE, DROP_IN, None).unwrap(), V2_MAIN);
        assert_eq!(
            unconfigure(HAND_MAIN, MAIN_FILE, DROP_IN, None).unwrap(),
            HAND_MAIN.replace("  \"/etc/containerd/conf.d/*.toml\",\n", "")
        );
        let main = "version = 2\nimports = [\"/etc/containerd/conf.d/99-nvidia.toml\", \"/etc/containerd/a.toml\"]\n";
        assert_eq!(
            unconfigure(main, MAIN_FILE, DROP_IN, None).unwrap(),
            "version = 2\nimports = [\"/etc/containerd/a.toml\"]\n"
        );
        let err = unconfigure(
            "version = 2\nimports = \"/etc/containerd/conf.d/*.toml\"\n",
            MAIN_FILE,
            DROP_IN,
            None,
        );
        assert_eq!(shape_key(err.unwrap_err()), "imports");
    }

    #[test]
    fn rebase_imports_maps_every_entry() {
        let main = run(Some(V3_MAIN), &rt(false, false)).main;
        let rebased = rebase_imports(&main, MAIN_FILE, |entry| format!("/host{entry}")).unwrap();
        assert_eq!(
            rebased,
            main.replace(
                "imports = ['/etc/containerd/site/*.toml', '/etc/containerd/conf.d/*.toml']",
                "imports = [\"/host/etc/containerd/site/*.toml\", \"/host/etc/containerd/conf.d/*.toml\"]"
            )
        );
        assert_eq!(rebase_imports(&main, MAIN_FILE, str::to_owned).unwrap(), main);
        assert_eq!(
            rebase_imports(V2_MAIN, MAIN_FILE, |e| format!("/host{e}")).unwrap(),
            V2_MAIN
        );
    }

    // === errors ===

    #[test]
    fn broken_toml_reports_line_and_column() {
        let err = configure(Some(BROKEN_MAIN), MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap_err();
        let EditError::Parse {
            file,
            line,
            column,
            message,
        } = err
        else {
            panic!("expected a parse error, got {err:?}");
        };
        assert_eq!((file.as_str(), line, column), (MAIN_FILE, 4, 27), "{message}");
        assert!(!message.is_empty());
        let err = unconfigure("version = 2\nversion = 3\n", MAIN_FILE, DROP_IN, None).unwrap_err();
        assert!(matches!(err, EditError::Parse { line: 2, column: 1, .. }), "{err:?}");
    }

    #[test]
    fn line_column_counts_characters() {
        assert_eq!(line_column("ab\ncdé\nf", 0), (1, 1));
        assert_eq!(line_column("ab\ncdé\nf", 3), (2, 1));
        assert_eq!(line_column("ab\ncdé\nf", 8), (3, 1));
        assert_eq!(line_column("ab\ncdé\nf", 6), (2, 3), "inside a multi-byte character");
        assert_eq!(line_column("ab", 99), (1, 3));
    }

    #[test]
    fn wrong_types_are_shape_errors() {
        let cases = [
            ("version = 2\nimports = \"/etc/containerd/conf.d/*.toml\"\n", "imports"),
            ("version = 2\nimports = [1]\n", "imports"),
            ("version = 2\nplugins = 1\n", "plugins"),
            (
                "version = 2\n[plugins]\n\"io.containerd.grpc.v1.cri\" = \"x\"\n",
                "plugins.\"io.containerd.grpc.v1.cri\"",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd = []\n",
                "plugins.\"io.containerd.grpc.v1.cri\".containerd",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\nruntimes = 1\n",
                "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes]\nrunc = \"runc\"\n",
                "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\noptions = 1\n",
                "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = 1\n",
                "plugins.\"io.containerd.grpc.v1.cri\".containerd.default_runtime_name",
            ),
        ];
        for (main, key) in cases {
            let err = configure(Some(main), MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap_err();
            assert_eq!(shape_key(err), key, "{main}");
        }
    }

    #[test]
    fn non_utf8_binary_is_a_shape_error() {
        let mut rt = rt(false, false);
        rt.binary = std::ffi::OsStr::from_bytes(b"/usr/bin/nvidia-\xff").into();
        let err = configure(None, MAIN_FILE, DROP_IN, Some(1), &rt).unwrap_err();
        assert!(shape_key(err).ends_with("runtimes.nvidia.options.BinaryName"));
    }

    // === config dump ===

    #[test]
    fn dump_from_containerd_1_6_has_the_runtime() {
        // `containerd config dump` of containerd 1.6.20 (Debian bookworm) reading the v2 golden
        // main file plus the set-as-default + CDI drop-in. 1.6 has no CDI, so `enable_cdi` is
        // dropped from the dump.
        assert_eq!(dump_has_runtime(DUMP_1_6, &rt(true, false)), Ok(()));
        assert_eq!(dump_has_runtime(DUMP_1_6, &rt(false, false)), Ok(()));
        let err = dump_has_runtime(DUMP_1_6, &rt(true, true)).unwrap_err();
        assert_eq!(err, "plugins.\"io.containerd.grpc.v1.cri\".enable_cdi is not true");
        let mut other = rt(false, false);
        other.binary = "/usr/local/bin/nvidia-container-runtime".into();
        assert!(dump_has_runtime(DUMP_1_6, &other).unwrap_err().contains("BinaryName"));
        other.name = "nvidia-cdi".to_owned();
        other.default = DefaultRuntime::Set;
        let err = dump_has_runtime(DUMP_1_6, &other).unwrap_err();
        assert!(err.contains("no runtime `nvidia-cdi`"), "{err}");
        assert!(err.contains("default_runtime_name is \"nvidia\""), "{err}");
    }

    #[test]
    fn dump_v3_uses_the_runtime_plugin() {
        let dump = "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\nenable_cdi = true\n\
                    [plugins.'io.containerd.cri.v1.runtime'.containerd]\ndefault_runtime_name = 'runc'\n\
                    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n\
                    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]\n\
                    BinaryName = '/usr/bin/nvidia-container-runtime'\n";
        assert_eq!(dump_has_runtime(dump, &rt(false, true)), Ok(()));
        // The CRI plugin refuses a default runtime that is not defined (k8s-device-plugin#1145).
        let no_runc = dump.replace(
            "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n",
            "",
        );
        let err = dump_has_runtime(&no_runc, &rt(false, true)).unwrap_err();
        assert!(err.contains("default_runtime_name \"runc\" names no runtime"), "{err}");
        let err = dump_has_runtime(dump, &rt(true, true)).unwrap_err();
        assert_eq!(err, "default_runtime_name is \"runc\", expected \"nvidia\"");
        let v2_layout = dump.replace("io.containerd.cri.v1.runtime", "io.containerd.grpc.v1.cri");
        assert!(dump_has_runtime(&v2_layout, &rt(false, false)).is_err());
        assert!(dump_has_runtime("version = [", &rt(false, false)).is_err());
    }

    // === the real nodes' inputs (issue 13) ===

    #[test]
    fn a_comment_only_file_without_a_final_newline_keeps_version_on_its_own_line() {
        let main = "# containerd config, managed by hand";
        let out = configure(Some(main), MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap();
        assert_eq!(
            out.main,
            "# containerd config, managed by hand\nversion = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n"
        );
        // The agent reads its own file back as version 2, not 1.
        assert_eq!(detect_version(Some(&out.main), MAIN_FILE, Some(1)).unwrap(), 2);
        let again = configure(Some(&out.main), MAIN_FILE, DROP_IN, Some(1), &rt(false, false)).unwrap();
        assert_eq!(again, out);
    }

    #[test]
    fn with_no_file_or_no_runtimes_runc_stays_defined() {
        // containerd's own default runtime, `runc`, must be in the table the drop-in replaces.
        for main in [
            None,
            Some("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nsandbox_image = \"p\"\n"),
        ] {
            let out = run(main, &rt(false, false));
            let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
            let runtimes = &doc["plugins"][CRI_PLUGIN_V2]["containerd"]["runtimes"];
            assert_eq!(runtimes["runc"]["runtime_type"].as_str(), Some(RUNC_SHIM), "{main:?}");
        }
        // A default that names another runtime is that runtime's business.
        let crun = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"crun\"\n\
                    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\nruntime_type = \"io.containerd.runc.v2\"\n";
        let out = run(Some(crun), &rt(false, false));
        assert!(!out.drop_in.contains("runtimes.runc"), "{}", out.drop_in);
    }

    /// `containerd config dump` of Debian's containerd 1.6.20 without a config file, cut to the
    /// CRI plugin's runtimes.
    const DUMP_1_6_DEFAULTS: &str = "version = 2\n\
        [grpc]\n  address = \"/run/containerd/containerd.sock\"\n\
        [plugins]\n  [plugins.\"io.containerd.grpc.v1.cri\"]\n    sandbox_image = \"registry.k8s.io/pause:3.6\"\n\
        [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n      default_runtime_name = \"runc\"\n      snapshotter = \"overlayfs\"\n\
        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes]\n\
        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n          runtime_type = \"io.containerd.runc.v2\"\n\
        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n            SystemdCgroup = false\n";

    fn from_dump(main: Option<&str>, dump: &str, rt: &NvidiaRuntime) -> ContainerdFiles {
        let input = Input {
            main,
            main_file: MAIN_FILE,
            drop_in_path: DROP_IN,
            binary_major: Some(1),
            imported: &[],
            effective: Some(dump),
        };
        configure_input(&input, rt).unwrap()
    }

    #[test]
    fn the_drop_in_copies_the_effective_cri_table_from_the_dump() {
        let out = from_dump(None, DUMP_1_6_DEFAULTS, &rt(true, false));
        let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
        let cri = &doc["plugins"][CRI_PLUGIN_V2];
        assert_eq!(cri["sandbox_image"].as_str(), Some("registry.k8s.io/pause:3.6"));
        assert_eq!(cri["containerd"]["snapshotter"].as_str(), Some("overlayfs"));
        assert_eq!(cri["containerd"]["default_runtime_name"].as_str(), Some("nvidia"));
        assert_eq!(
            cri["containerd"]["runtimes"]["runc"]["runtime_type"].as_str(),
            Some(RUNC_SHIM)
        );
        let nvidia = &cri["containerd"]["runtimes"]["nvidia"]["options"];
        assert_eq!(nvidia["SystemdCgroup"].as_bool(), Some(false));
        assert_eq!(nvidia["BinaryName"].as_str(), Some(BINARY));
        assert!(out.drop_in.contains("`containerd config dump`"), "{}", out.drop_in);
        assert_eq!(dump_address(DUMP_1_6_DEFAULTS), "/run/containerd/containerd.sock");
    }

    #[test]
    fn a_version_3_dump_gives_a_drop_in_with_only_the_runtimes_in_the_files_version() {
        // containerd 2.x dumps version 3 and merges imports key by key; its drop-in may not be of
        // a higher version than the top-level file.
        let dump = DUMP_1_6_DEFAULTS
            .replace("version = 2", "version = 3")
            .replace(CRI_PLUGIN_V2, CRI_PLUGIN_V3)
            .replace("SystemdCgroup = false", "SystemdCgroup = true");
        let out = from_dump(Some("version = 2\n"), &dump, &rt(true, false));
        assert_eq!(out.version, 2);
        let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
        assert_eq!(doc["version"].as_integer(), Some(2));
        let cri = doc["plugins"][CRI_PLUGIN_V2].as_table().unwrap();
        assert!(cri.get("sandbox_image").is_none(), "{}", out.drop_in);
        let runtimes = cri["containerd"]["runtimes"].as_table().unwrap();
        assert_eq!(runtimes.iter().map(|(k, _)| k).collect::<Vec<_>>(), ["nvidia"]);
        assert_eq!(runtimes["nvidia"]["options"]["SystemdCgroup"].as_bool(), Some(true));
        assert_eq!(cri["containerd"]["default_runtime_name"].as_str(), Some("nvidia"));
    }

    #[test]
    fn an_existing_nvidia_runtime_keeps_its_options_and_the_default_stays_with_keep() {
        // EKS AL2023's NVIDIA variant: nvidia is the default, with its own base_runtime_spec.
        let main = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"nvidia\"\n\
                    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]\nruntime_type = \"io.containerd.runc.v2\"\n\
                    base_runtime_spec = \"/etc/containerd/base-runtime-spec.json\"\n\
                    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\n\
                    BinaryName = \"/usr/bin/nvidia-container-runtime\"\nSystemdCgroup = true\n";
        let mut keep = rt(false, false);
        keep.default = DefaultRuntime::Keep;
        let out = run(Some(main), &keep);
        let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
        let containerd = &doc["plugins"][CRI_PLUGIN_V2]["containerd"];
        assert_eq!(containerd["default_runtime_name"].as_str(), Some("nvidia"));
        let nvidia = &containerd["runtimes"]["nvidia"];
        assert_eq!(
            nvidia["base_runtime_spec"].as_str(),
            Some("/etc/containerd/base-runtime-spec.json")
        );
        assert_eq!(nvidia["options"]["SystemdCgroup"].as_bool(), Some(true));
        // Without runc in the file the default is still defined: it is nvidia itself.
        assert!(containerd["runtimes"].get("runc").is_none(), "{}", out.drop_in);
    }

    #[test]
    fn extra_runtimes_get_the_same_options_and_their_own_binaries() {
        let mut rt = rt(true, false);
        rt.also = vec![
            ("nvidia-cdi".to_owned(), "/usr/bin/nvidia-container-runtime.cdi".into()),
            (
                "nvidia-legacy".to_owned(),
                "/usr/bin/nvidia-container-runtime.legacy".into(),
            ),
        ];
        let out = run(Some(V2_MAIN), &rt);
        let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
        let runtimes = &doc["plugins"][CRI_PLUGIN_V2]["containerd"]["runtimes"];
        for (name, binary) in rt.all() {
            assert_eq!(
                runtimes[name]["options"]["SystemdCgroup"].as_bool(),
                Some(true),
                "{name}"
            );
            assert_eq!(
                runtimes[name]["options"]["BinaryName"].as_str(),
                binary.to_str(),
                "{name}"
            );
        }
        assert_eq!(
            doc["plugins"][CRI_PLUGIN_V2]["containerd"]["default_runtime_name"].as_str(),
            Some("nvidia")
        );
    }

    #[test]
    fn a_version_1_file_gets_a_version_1_drop_in() {
        let main =
            "root = \"/var/lib/containerd\"\n[plugins.cri.containerd.runtimes.runc.options]\nSystemdCgroup = true\n";
        let out = run(Some(main), &rt(false, false));
        assert_eq!(out.version, 1);
        assert_eq!(
            out.main,
            "root = \"/var/lib/containerd\"\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n\
             [plugins.cri.containerd.runtimes.runc.options]\nSystemdCgroup = true\n"
        );
        let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
        assert!(doc.get("version").is_none(), "{}", out.drop_in);
        assert_eq!(
            doc["plugins"]["cri"]["containerd"]["runtimes"]["nvidia"]["options"]["SystemdCgroup"].as_bool(),
            Some(true)
        );
    }

    #[test]
    fn cri_disabled_is_read_from_disabled_plugins() {
        assert!(cri_disabled("disabled_plugins = [\"cri\"]\n"));
        assert!(cri_disabled(
            "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"
        ));
        assert!(!cri_disabled(
            "version = 2\ndisabled_plugins = [\"io.containerd.snapshotter.v1.zfs\"]\n"
        ));
        assert!(!cri_disabled("version = 2\n"));
        assert!(!cri_disabled("not toml ["));
    }

    #[test]
    fn unconfigure_keeps_an_import_the_original_file_had() {
        let mine = "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
        let edited = format!("{mine}# edited since\n");
        assert_eq!(unconfigure(&edited, MAIN_FILE, DROP_IN, Some(mine)).unwrap(), edited);
        assert_eq!(
            unconfigure(&edited, MAIN_FILE, DROP_IN, Some("version = 2\n")).unwrap(),
            "version = 2\n# edited since\n"
        );
    }
}
