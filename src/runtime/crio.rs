//! CRI-O: the `nvidia` runtime as a drop-in, `/etc/crio/crio.conf.d/99-nvidia.toml`.
//!
//! A pure text render, modelled on `nvidia-ctk runtime configure --runtime=crio`. CRI-O merges
//! drop-ins key by key, so the drop-in holds only what the agent sets and the top-level
//! `crio.conf` is never edited:
//!
//! - `[crio.runtime.runtimes.<name>]`: a copy of the table of the runtime the NVIDIA runtime wraps
//!   (the default runtime, else `runc`, else `crun`, as declared in the top-level config), which
//!   brings `monitor_path`, `runtime_root` and the like along; then `runtime_path = "<binary>"`
//!   and `runtime_type = "oci"`;
//! - `[crio.runtime] default_runtime = "<name>"` when the runtime is to be the default.
//!
//! CDI needs no switch: CRI-O always has it on.

mod engine;
pub use engine::CrioEngine;

use toml_edit::{DocumentMut, Item, Table, value};

use super::containerd::{binary_text, child_table, dotted, hide_grouping_headers, parse_toml, plain_table, table_at};
use super::{DefaultRuntime, EditError, NvidiaRuntime};

/// Runtimes whose table the `nvidia` runtime copies when the default runtime is not usable.
const FALLBACK_TEMPLATES: [&str; 2] = ["runc", "crun"];

/// First lines of every generated drop-in.
const DROP_IN_HEADER: &str = "\
# Written by gpu-node-agent, which rewrites this file on every run.
";

/// The drop-in text that adds the runtime `rt` to CRI-O.
///
/// `main` is the top-level config's text (`/etc/crio/crio.conf`, `None` when it does not exist),
/// `main_file` its path for error messages. Without a top-level config, or when it declares none
/// of the template runtimes, the runtime table holds only `runtime_path` and `runtime_type` and
/// CRI-O fills in the rest (it finds `conmon` on its own). The output depends only on the inputs.
///
/// Without `rt.set_as_default` the drop-in says nothing about the default runtime: a
/// `default_runtime` the user set in the top-level config stays in force.
pub fn configure(main: Option<&str>, main_file: &str, rt: &NvidiaRuntime) -> Result<String, EditError> {
    configure_with_drop_ins(main, main_file, &[], rt)
}

/// [`configure`], knowing the other drop-ins CRI-O reads after the top-level config
/// (`crio.conf.d/`, in name order, file and text, without the agent's): CRI-O packages from
/// 1.28 on keep their runtimes (crun, runc) only there. A runtime table defined again in a later
/// file replaces the earlier one whole, as CRI-O does, and the last `default_runtime` counts; a
/// drop-in that does not parse is an error naming it (CRI-O would not start with it either).
pub fn configure_with_drop_ins(
    main: Option<&str>,
    main_file: &str,
    drop_ins: &[(String, String)],
    rt: &NvidiaRuntime,
) -> Result<String, EditError> {
    let mut docs = Vec::new();
    if let Some(text) = main {
        docs.push((main_file.to_owned(), parse_toml(text, main_file)?));
    }
    for (file, text) in drop_ins {
        docs.push((file.clone(), parse_toml(text, file)?));
    }
    let template = template(&docs, &rt.name)?;
    let mut crio = Table::new();
    let runtime = child_table(&mut crio, "runtime", &dotted(&["crio", "runtime"]), main_file)?;
    if rt.default == DefaultRuntime::Set {
        runtime.insert("default_runtime", value(rt.name.as_str()));
    }
    let runtimes = child_table(
        runtime,
        "runtimes",
        &dotted(&["crio", "runtime", "runtimes"]),
        main_file,
    )?;
    for (name, binary) in rt.all() {
        let key = dotted(&["crio", "runtime", "runtimes", name, "runtime_path"]);
        let binary = binary_text(binary, main_file, &key)?;
        let mut table = template.clone();
        table.insert("runtime_path", value(binary));
        // An OCI runtime; "pod" (the same under conmon-rs, whose monitor_path the template
        // has) stays, anything else ("vm") becomes "oci".
        if table.get("runtime_type").and_then(Item::as_str) != Some("pod") {
            table.insert("runtime_type", value("oci"));
        }
        runtimes.insert(name, Item::Table(table));
    }

    let mut out = DocumentMut::new();
    out.decor_mut().set_prefix(DROP_IN_HEADER);
    out.insert("crio", Item::Table(crio));
    hide_grouping_headers(out.as_table_mut());
    Ok(out.to_string())
}

/// A copy of the table of the first runtime among [`crio.runtime.default_runtime` (unless it is
/// an NVIDIA runtime itself), `runc`, `crun`] that the files (in CRI-O's load order) declare,
/// each name's last table; empty when they declare none of them.
fn template(docs: &[(String, DocumentMut)], name: &str) -> Result<Table, EditError> {
    let mut default = None;
    for (file, doc) in docs {
        let Some(runtime) = table_at(doc.as_table(), &["crio", "runtime"], file)? else {
            continue;
        };
        if let Some(item) = runtime.get("default_runtime") {
            default = Some(item.as_str().ok_or_else(|| EditError::Shape {
                file: file.clone(),
                key: "crio.runtime.default_runtime".to_owned(),
                message: "must be a string".to_owned(),
            })?);
        }
    }
    let candidates = default
        .filter(|default| !default.is_empty() && !default.starts_with(name))
        .into_iter()
        .chain(FALLBACK_TEMPLATES);
    for candidate in candidates {
        let mut found = None;
        for (file, doc) in docs {
            if let Some(table) = table_at(doc.as_table(), &["crio", "runtime", "runtimes", candidate], file)? {
                found = Some(plain_table(table));
            }
        }
        if let Some(table) = found {
            return Ok(table);
        }
    }
    Ok(Table::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "/etc/crio/crio.conf";

    const CRIO_CONF: &str = include_str!("../../tests/fixtures/runtime/crio/crio.conf");
    const CRIO_EXPECTED: &str = include_str!("../../tests/fixtures/runtime/crio/crio.expected.drop-in.toml");
    const CRIO_DEFAULT_EXPECTED: &str =
        include_str!("../../tests/fixtures/runtime/crio/crio.default.expected.drop-in.toml");
    const RUNC_ONLY: &str = include_str!("../../tests/fixtures/runtime/crio/runc-only.conf");
    const RUNC_ONLY_EXPECTED: &str = include_str!("../../tests/fixtures/runtime/crio/runc-only.expected.drop-in.toml");
    const FRESH_EXPECTED: &str = include_str!("../../tests/fixtures/runtime/crio/fresh.expected.drop-in.toml");
    const BROKEN: &str = include_str!("../../tests/fixtures/runtime/crio/broken.conf");

    fn rt(set_as_default: bool, enable_cdi: bool) -> NvidiaRuntime {
        NvidiaRuntime {
            name: "nvidia".to_owned(),
            binary: "/usr/bin/nvidia-container-runtime".into(),
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

    #[test]
    fn fresh_host() {
        assert_eq!(configure(None, FILE, &rt(false, false)).unwrap(), FRESH_EXPECTED);
        assert_eq!(
            configure(Some(""), FILE, &rt(false, true)).unwrap(),
            FRESH_EXPECTED,
            "CDI is a no-op"
        );
        assert_eq!(
            configure(None, FILE, &rt(true, false)).unwrap(),
            "# Written by gpu-node-agent, which rewrites this file on every run.\n[crio.runtime]\n\
             default_runtime = \"nvidia\"\n\n[crio.runtime.runtimes.nvidia]\n\
             runtime_path = \"/usr/bin/nvidia-container-runtime\"\nruntime_type = \"oci\"\n"
        );
    }

    #[test]
    fn copies_the_default_runtime() {
        // The default runtime is crun: its monitor, root and annotations come along.
        assert_eq!(
            configure(Some(CRIO_CONF), FILE, &rt(false, false)).unwrap(),
            CRIO_EXPECTED
        );
        assert_eq!(
            configure(Some(CRIO_CONF), FILE, &rt(false, true)).unwrap(),
            CRIO_EXPECTED
        );
        assert_eq!(
            configure(Some(CRIO_CONF), FILE, &rt(true, false)).unwrap(),
            CRIO_DEFAULT_EXPECTED
        );
    }

    #[test]
    fn skips_a_default_that_is_an_nvidia_runtime() {
        // default_runtime = "nvidia" (set by hand earlier) falls through to runc; the hand-made
        // nvidia table is not copied into itself.
        assert_eq!(
            configure(Some(RUNC_ONLY), FILE, &rt(false, false)).unwrap(),
            RUNC_ONLY_EXPECTED
        );
        let crun_default_missing = "[crio.runtime]\ndefault_runtime = \"crun\"\n";
        assert_eq!(
            configure(Some(crun_default_missing), FILE, &rt(false, false)).unwrap(),
            FRESH_EXPECTED
        );
    }

    #[test]
    fn output_is_deterministic() {
        let first = configure(Some(CRIO_CONF), FILE, &rt(true, true)).unwrap();
        for _ in 0..3 {
            assert_eq!(configure(Some(CRIO_CONF), FILE, &rt(true, true)).unwrap(), first);
        }
        // The rendered drop-in is itself a valid CRI-O config that names the binary.
        let doc = parse_toml(&first, "99-nvidia.toml").unwrap();
        let nvidia = &doc["crio"]["runtime"]["runtimes"]["nvidia"];
        assert_eq!(
            nvidia["runtime_path"].as_str(),
            Some("/usr/bin/nvidia-container-runtime")
        );
        assert_eq!(nvidia["runtime_type"].as_str(), Some("oci"));
        assert_eq!(nvidia["monitor_path"].as_str(), Some("/usr/libexec/crio/conmon"));
    }

    #[test]
    fn inline_and_dotted_tables_are_read() {
        let inline = "crio.runtime.runtimes.runc = { runtime_root = \"/run/runc\", runtime_type = \"vm\" }\n";
        let out = configure(Some(inline), FILE, &rt(false, false)).unwrap();
        assert_eq!(
            out,
            "# Written by gpu-node-agent, which rewrites this file on every run.\n[crio.runtime.runtimes.nvidia]\n\
             runtime_root = \"/run/runc\"\nruntime_type = \"oci\"\n\
             runtime_path = \"/usr/bin/nvidia-container-runtime\"\n"
        );
    }

    #[test]
    fn broken_toml_reports_line_and_column() {
        let err = configure(Some(BROKEN), FILE, &rt(false, false)).unwrap_err();
        let EditError::Parse {
            file,
            line,
            column,
            message,
        } = err
        else {
            panic!("expected a parse error, got {err:?}");
        };
        assert_eq!((file.as_str(), line, column), (FILE, 3, 14), "{message}");
    }

    #[test]
    fn wrong_types_are_shape_errors() {
        for (text, key) in [
            ("crio = 1\n", "crio"),
            ("[crio]\nruntime = \"runc\"\n", "crio.runtime"),
            ("[crio.runtime]\ndefault_runtime = 1\n", "crio.runtime.default_runtime"),
            ("[crio.runtime]\nruntimes = []\n", "crio.runtime.runtimes"),
            (
                "[crio.runtime.runtimes]\nrunc = \"/usr/bin/runc\"\n",
                "crio.runtime.runtimes.runc",
            ),
        ] {
            match configure(Some(text), FILE, &rt(false, false)) {
                Err(EditError::Shape { key: found, .. }) => assert_eq!(found, key, "{text}"),
                other => panic!("{text}: expected a shape error, got {other:?}"),
            }
        }
    }
}
