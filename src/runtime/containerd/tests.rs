//! The containerd edits end to end: golden files, stability, imported files, unconfigure, errors,
//! config dumps and the real nodes' inputs.

use std::os::unix::ffi::OsStrExt;

use toml_edit::Table;

use super::toml_helpers::line_column;
use super::top_level::glob_matches;
use super::*;
use crate::runtime::DefaultRuntime;

const MAIN_FILE: &str = "/etc/containerd/config.toml";
const DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";
const BINARY: &str = "/usr/bin/nvidia-container-runtime";

const V2_MAIN: &str = include_str!("../../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.main.toml");
const V2_EXPECTED_MAIN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.expected.main.toml");
const V2_EXPECTED_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.expected.drop-in.toml");
const V2_DEFAULT_CDI_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v2-systemd-cgroup.default-cdi.expected.drop-in.toml");
const V3_MAIN: &str = include_str!("../../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.main.toml");
const V3_EXPECTED_MAIN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.expected.main.toml");
const V3_EXPECTED_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.expected.drop-in.toml");
const V3_DEFAULT_CDI_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/v3-systemd-cgroup.default-cdi.expected.drop-in.toml");
const FRESH_V2_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/fresh-v2.expected.drop-in.toml");
const FRESH_V3_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/fresh-v3.expected.drop-in.toml");
const HAND_MAIN: &str = include_str!("../../../tests/fixtures/runtime/containerd/hand-configured.main.toml");
const HAND_EXPECTED_DROP_IN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/hand-configured.expected.drop-in.toml");
const COMMENTS_MAIN: &str = include_str!("../../../tests/fixtures/runtime/containerd/comments-only.main.toml");
const COMMENTS_EXPECTED_MAIN: &str =
    include_str!("../../../tests/fixtures/runtime/containerd/comments-only.expected.main.toml");
const BROKEN_MAIN: &str = include_str!("../../../tests/fixtures/runtime/containerd/broken.main.toml");
const DUMP_1_6: &str = include_str!("../../../tests/fixtures/runtime/containerd/dump-1.6.20-nvidia-default.toml");

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
    let main = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"nvidia\"\n";
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
const REGISTRY: &str = include_str!("../../../tests/fixtures/runtime/containerd/conf.d-50-registry.toml");

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
        cdi_dir: Some("/var/run/cdi"),
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
    let main = "root = \"/var/lib/containerd\"\n[plugins.cri.containerd.runtimes.runc.options]\nSystemdCgroup = true\n";
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

/// Found by the property tests (issue 15): `imports = []` in the original file was removed with
/// the agent's entry, so unconfigure did not give the file back.
#[test]
fn unconfigure_keeps_an_empty_imports_the_original_file_had() {
    let original = "version = 2\nimports = []\n\n[plugins]\n";
    let out = run(Some(original), &rt(false, false));
    assert_eq!(
        out.main,
        "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n\n[plugins]\n"
    );
    assert_eq!(
        unconfigure(&out.main, MAIN_FILE, DROP_IN, Some(original)).unwrap(),
        original
    );
    // Without the original, an `imports` left empty goes.
    assert_eq!(
        unconfigure(&out.main, MAIN_FILE, DROP_IN, None).unwrap(),
        "version = 2\n\n[plugins]\n"
    );
    // The whitespace of an empty multi-line array comes back too.
    let multi_line = "version = 2\nimports = [\n]\n";
    let out = run(Some(multi_line), &rt(false, false));
    assert_eq!(
        unconfigure(&out.main, MAIN_FILE, DROP_IN, Some(multi_line)).unwrap(),
        multi_line
    );
}

// === properties of the `imports` globs (issue 15; the others are in tests/properties.rs) ===

mod glob_properties {
    use super::*;
    use proptest::prelude::*;

    /// One element of a compiled pattern.
    #[derive(Debug)]
    enum Tok {
        Star,
        Any,
        Lit(char),
        Class(bool, Vec<(char, char)>),
    }

    /// Go's `filepath.Match` pattern syntax, compiled; `None` when malformed.
    fn compile(pattern: &str) -> Option<Vec<Tok>> {
        fn escaped(p: &[char], i: &mut usize) -> Option<char> {
            match p.get(*i)? {
                '-' | ']' => None,
                '\\' => {
                    let c = *p.get(*i + 1)?;
                    *i += 2;
                    Some(c)
                }
                c => {
                    *i += 1;
                    Some(*c)
                }
            }
        }
        let p: Vec<char> = pattern.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < p.len() {
            let c = p[i];
            i += 1;
            out.push(match c {
                '*' => Tok::Star,
                '?' => Tok::Any,
                '\\' => {
                    let c = *p.get(i)?;
                    i += 1;
                    Tok::Lit(c)
                }
                '[' => {
                    let negated = p.get(i) == Some(&'^');
                    if negated {
                        i += 1;
                    }
                    let mut ranges = Vec::new();
                    loop {
                        if p.get(i) == Some(&']') && !ranges.is_empty() {
                            i += 1;
                            break;
                        }
                        let lo = escaped(&p, &mut i)?;
                        let mut hi = lo;
                        if p.get(i) == Some(&'-') {
                            i += 1;
                            hi = escaped(&p, &mut i)?;
                        }
                        ranges.push((lo, hi));
                    }
                    Tok::Class(negated, ranges)
                }
                c => Tok::Lit(c),
            });
        }
        Some(out)
    }

    /// Whether the compiled pattern matches `name`, by dynamic programming over (token, char);
    /// `star_stops_at` is a character `*` and `?` do not match.
    fn reference(tokens: &[Tok], name: &str, star_stops_at: Option<char>) -> bool {
        let s: Vec<char> = name.chars().collect();
        // ok[j]: the tokens so far match s[..j].
        let mut ok = vec![false; s.len() + 1];
        ok[0] = true;
        for t in tokens {
            let mut next = vec![false; s.len() + 1];
            for j in 0..=s.len() {
                match t {
                    Tok::Star => next[j] = ok[j] || (j > 0 && next[j - 1] && Some(s[j - 1]) != star_stops_at),
                    _ if j == 0 => {}
                    Tok::Any => next[j] = ok[j - 1] && Some(s[j - 1]) != star_stops_at,
                    Tok::Lit(c) => next[j] = ok[j - 1] && s[j - 1] == *c,
                    Tok::Class(negated, ranges) => {
                        let hit = ranges.iter().any(|(lo, hi)| *lo <= s[j - 1] && s[j - 1] <= *hi);
                        next[j] = ok[j - 1] && hit != *negated;
                    }
                }
            }
            ok = next;
        }
        ok[s.len()]
    }

    fn pattern() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop_oneof![
                3 => prop::sample::select(vec![
                    "*", "?", "a", "b", ".", "/", "[a-c]", "[^a]", "\\*", "[", "]", "-", "\\", "^",
                ]),
                1 => Just("toml"),
            ],
            0..10,
        )
        .prop_map(|parts| parts.concat())
    }

    fn name() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop::sample::select(vec!["a", "b", "c", ".", "/", "*", "-", "]", "toml"]),
            0..10,
        )
        .prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn component_globs_match_as_go_does(pattern in pattern(), name in name()) {
            let want = compile(&pattern).is_some_and(|t| reference(&t, &name, None));
            prop_assert_eq!(glob_component_matches(&pattern, &name), want);
        }

        #[test]
        fn import_globs_match_within_path_components(pattern in pattern(), path in name()) {
            let want = if pattern.contains(['[', '\\']) {
                pattern == path
            } else {
                compile(&pattern).is_some_and(|t| reference(&t, &path, Some('/')))
            };
            prop_assert_eq!(glob_matches(&pattern, &path), want);
        }
    }

    /// Found while writing the properties above (issue 15): every `*` tried every split of the rest of
    /// the name again, so matching took time exponential in the number of stars: an `imports`
    /// entry such as `/etc/containerd/conf.d/*a*a*a*a*a*a*a*a*a*a*a*a*a*a*b` next to a file with
    /// a long name stalled the runtime stage's look at the imported files. This test ran over
    /// two minutes before (nextest killed it) and takes no time now.
    #[test]
    fn many_stars_match_in_polynomial_time() {
        let start = std::time::Instant::now();
        let name = "a".repeat(60);
        let pattern = "*a".repeat(14) + "*b";
        assert!(!glob_component_matches(&pattern, &name));
        assert!(!glob_matches(&format!("/etc/{pattern}"), &format!("/etc/{name}")));
        assert!(glob_component_matches(&("*a".repeat(14) + "*"), &name));
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
}

/// containerd 2.x under cdi-only: the drop-in holds `enable_cdi` in the runtime plugin and no
/// runtime at all; a default naming `nvidia` from a run with the toolkit goes back to runc
/// (2.x merges the drop-in key by key, so only a value replaces the other files' default).
#[test]
fn cdi_only_on_containerd_2_turns_cdi_on_and_adds_no_runtime() {
    let dump = DUMP_1_6_DEFAULTS
        .replace("version = 2", "version = 3")
        .replace(CRI_PLUGIN_V2, CRI_PLUGIN_V3)
        .replace("default_runtime_name = \"runc\"", "default_runtime_name = \"nvidia\"");
    let out = from_dump(Some("version = 3\n"), &dump, &rt(true, false).cdi_only());
    let doc = parse_toml(&out.drop_in, DROP_IN).unwrap();
    assert_eq!(doc["version"].as_integer(), Some(3));
    let cri = doc["plugins"][CRI_PLUGIN_V3].as_table().unwrap();
    assert_eq!(cri["enable_cdi"].as_bool(), Some(true), "{}", out.drop_in);
    assert_eq!(cri["containerd"]["default_runtime_name"].as_str(), Some(RUNC));
    let runtimes = cri["containerd"].get("runtimes").and_then(|r| r.as_table());
    assert!(runtimes.is_none_or(|r| r.is_empty()), "{}", out.drop_in);
}

// === nothing to add (issue 33, 7) ===

/// containerd 2.1.9's `containerd config default`, which is also its `config dump`: version 3,
/// CDI on, `/etc/cdi` and `/var/run/cdi` read.
const DUMP_2_1_DEFAULT: &str = include_str!("../../../tests/fixtures/runtime/containerd/dump-2.1.9-default.toml");
/// containerd 1.7.24's dump of its `config default` with `enable_cdi = true`.
const DUMP_1_7_CDI: &str = include_str!("../../../tests/fixtures/runtime/containerd/dump-1.7.24-cdi.toml");

/// [`from_dump`] with the agent's CDI directory `cdi_dir`.
fn from_dump_in(main: Option<&str>, dump: &str, rt: &NvidiaRuntime, cdi_dir: &str) -> ContainerdFiles {
    let input = Input {
        main,
        main_file: MAIN_FILE,
        drop_in_path: DROP_IN,
        binary_major: Some(2),
        imported: &[],
        effective: Some(dump),
        cdi_dir: Some(cdi_dir),
    };
    configure_input(&input, rt).unwrap()
}

/// `dump` as containerd runs it once it loads `drop_in` too: the CRI table replaced (a version
/// 2 dump, containerd 1.x) or merged key by key (version 3, 2.x).
fn loaded_with(dump: &str, drop_in: &str) -> String {
    fn merge(table: &mut toml::Table, over: &toml::Table) {
        for (key, value) in over {
            match (table.get_mut(key), value) {
                (Some(toml::Value::Table(mine)), toml::Value::Table(theirs)) => merge(mine, theirs),
                _ => {
                    table.insert(key.clone(), value.clone());
                }
            }
        }
    }
    let mut dump: toml::Table = dump.parse().unwrap();
    let drop_in: toml::Table = drop_in.parse().unwrap();
    let v3 = dump["version"].as_integer() == Some(3);
    let id = if v3 { CRI_PLUGIN_V3 } else { CRI_PLUGIN_V2 };
    let ours = drop_in["plugins"]
        .as_table()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .as_table()
        .unwrap();
    let cri = dump["plugins"].as_table_mut().unwrap().get_mut(id).unwrap();
    let cri = cri.as_table_mut().unwrap();
    if v3 {
        merge(cri, ours);
    } else {
        *cri = ours.clone();
    }
    toml::to_string(&dump).unwrap()
}

/// What issue 33 saw: on containerd 2.1's own default configuration, which has CDI on and reads
/// `/var/run/cdi`, the cdi-only drop-in (`enable_cdi = true`, an empty runtimes table) changes
/// nothing; the same on containerd 1.7 with `enable_cdi = true`, and with the agent's spec in
/// `/etc/cdi`. The toolkit's drop-in (runtime, default), CDI off, or a spec directory containerd
/// does not read do change something, and a directory it does not read is added.
#[test]
fn a_configuration_with_cdi_on_needs_no_cdi_only_drop_in() {
    let cdi_off_2_1 = DUMP_2_1_DEFAULT.replace("enable_cdi = true", "enable_cdi = false");
    let cdi_off_1_7 = DUMP_1_7_CDI.replace("enable_cdi = true", "enable_cdi = false");
    for (name, dump, off) in [
        ("2.1.9 default", DUMP_2_1_DEFAULT, &cdi_off_2_1),
        ("1.7.24 with CDI", DUMP_1_7_CDI, &cdi_off_1_7),
    ] {
        for dir in ["/var/run/cdi", "/etc/cdi", "/etc/cdi/"] {
            let files = from_dump_in(Some(dump), dump, &rt(false, false).cdi_only(), dir);
            assert!(
                drop_in_changes_nothing(dump, &files.drop_in),
                "{name}, {dir}:\n{}",
                files.drop_in
            );
        }
        let toolkit = from_dump_in(Some(dump), dump, &rt(true, true), "/var/run/cdi");
        assert!(!drop_in_changes_nothing(dump, &toolkit.drop_in), "{name}: toolkit");
        let files = from_dump_in(Some(off), off, &rt(false, false).cdi_only(), "/var/run/cdi");
        assert!(!drop_in_changes_nothing(off, &files.drop_in), "{name}: CDI off");

        let files = from_dump_in(Some(dump), dump, &rt(false, false).cdi_only(), "/srv/cdi");
        assert!(!drop_in_changes_nothing(dump, &files.drop_in), "{name}: /srv/cdi");
        let doc: toml::Table = files.drop_in.parse().unwrap();
        let cri = doc["plugins"].as_table().unwrap().values().next().unwrap();
        assert_eq!(
            cri["cdi_spec_dirs"],
            toml::Value::try_from(["/etc/cdi", "/var/run/cdi", "/srv/cdi"]).unwrap(),
            "{name}:\n{}",
            files.drop_in
        );
    }
}

/// Once containerd runs with the agent's drop-in, rendering it again from that configuration
/// changes nothing, in both modes, with either merge rule: the rule drops only what is there.
#[test]
fn a_drop_in_containerd_already_runs_with_changes_nothing() {
    let cdi_off_1_7 = DUMP_1_7_CDI.replace("enable_cdi = true", "enable_cdi = false");
    for (name, dump) in [("2.1.9 default", DUMP_2_1_DEFAULT), ("1.7.24", &cdi_off_1_7)] {
        for (mode, rt) in [
            ("toolkit", rt(true, true)),
            ("toolkit, no CDI", rt(false, false)),
            ("cdi-only", rt(true, true).cdi_only()),
        ] {
            let first = from_dump_in(Some(dump), dump, &rt, "/srv/cdi");
            let loaded = loaded_with(dump, &first.drop_in);
            let again = from_dump_in(Some(dump), &loaded, &rt, "/srv/cdi");
            assert!(
                drop_in_changes_nothing(&loaded, &again.drop_in),
                "{name}, {mode}:\n{}\n{loaded}",
                again.drop_in
            );
        }
    }
}

/// Anything in a drop-in besides `version` and one CRI plugin table counts as a change, and so
/// does text that does not parse.
#[test]
fn a_drop_in_with_more_than_the_cri_table_changes_something() {
    let dump = DUMP_2_1_DEFAULT;
    let cri = format!("version = 3\n[plugins.\"{CRI_PLUGIN_V3}\"]\nenable_cdi = true\n");
    assert!(drop_in_changes_nothing(dump, &cri));
    assert!(drop_in_changes_nothing(dump, "version = 3\n"));
    for other in [
        format!("{cri}[plugins.\"io.containerd.gc.v1.scheduler\"]\npause_threshold = 0.02\n"),
        format!("oom_score = 0\n{cri}"),
        "version = [".to_owned(),
    ] {
        assert!(!drop_in_changes_nothing(dump, &other), "{other}");
    }
    assert!(!drop_in_changes_nothing("not = [toml", &cri));
}
