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
//! This file holds the configure API (the CRI plugin names, [`Input`], [`configure_input`]) and
//! re-exports the rest: `top_level.rs` edits the top-level config (its `imports`, the version),
//! `drop_in.rs` renders the drop-in, `effective.rs` reads what containerd says it runs with
//! (`containerd config dump`), and `toml_helpers.rs` holds the TOML helpers (`parse_toml`,
//! `plain_table`, ...) shared with the CRI-O module.

mod drop_in;
mod effective;
mod engine;
mod toml_helpers;
mod top_level;

use super::engine::ImportedFile;
use super::{EditError, NvidiaRuntime};
use drop_in::{Source, render_drop_in};
use top_level::version_of;

pub use effective::{DEFAULT_ADDRESS, cri_disabled, drop_in_changes_nothing, dump_address, dump_has_runtime};
pub use engine::ContainerdEngine;
pub(super) use toml_helpers::{
    binary_text, child_table, dotted, hide_grouping_headers, parse_toml, plain_table, render_like, table_at,
};
pub use top_level::{
    configured_main, glob_component_matches, imports, imports_after_configure, rebase_imports, unconfigure,
    with_imports,
};

/// CRI plugin of config version 2 (containerd 1.x; containerd 2.x migrates it on load).
pub const CRI_PLUGIN_V2: &str = "io.containerd.grpc.v1.cri";

/// CRI runtime plugin of config version 3 (containerd 2.x). Its table holds `containerd.runtimes`,
/// `containerd.default_runtime_name` and `enable_cdi`, like the version 2 CRI plugin did.
pub const CRI_PLUGIN_V3: &str = "io.containerd.cri.v1.runtime";

/// The runc shim, the `runtime_type` containerd uses for runc-compatible runtimes.
const RUNC_SHIM: &str = "io.containerd.runc.v2";

/// containerd's default runtime when `default_runtime_name` is not set.
const RUNC: &str = "runc";

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
    /// The directory the agent writes its CDI spec to (`[cdi] dir`, host path): with CDI on, the
    /// drop-in adds it to `cdi_spec_dirs` when containerd would not read it (containerd's own
    /// default is `/etc/cdi` and `/var/run/cdi`). `None`: left as it is.
    pub cdi_dir: Option<&'a str>,
}

/// containerd's `cdi_spec_dirs` when unset (1.7 and 2.x).
pub const DEFAULT_CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

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
        cdi_dir: None,
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
    let (version, drop_in) = render_drop_in(&source, version, input.main_file, rt, input.cdi_dir)?;
    Ok(ContainerdFiles { version, main, drop_in })
}

#[cfg(test)]
mod tests;
