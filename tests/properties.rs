//! Property-based tests of every parser that turns text into a value (issue 15): each one never
//! panics on arbitrary input nor on valid documents with random edits, its errors name what is
//! wrong, and where the code has both directions, what it writes reads back the same.
//!
//! Each property runs a bounded number of cases (96 for the expensive ones to 1,024 for the
//! cheap ones) unless `PROPTEST_CASES` is set, which then applies to every property: CI runs the
//! bounded default, and a long run is
//! `PROPTEST_CASES=100000 cargo nextest run --profile long --test properties` (README,
//! Development; the `long` nextest profile does not kill a test after 2 minutes).
//! Failures are not persisted to `proptest-regressions/` files, so that runs never write into the
//! source tree: a bug a property finds is kept as a named regression test next to the code it
//! fixes (`status::tests::a_stale_status_with_a_huge_timestamp_is_reported`,
//! `runtime::docker::tests::unconfigure_keeps_an_empty_runtimes_object_the_file_had`,
//! `runtime::containerd::tests::unconfigure_keeps_an_empty_imports_the_original_file_had`,
//! `runtime::containerd::tests::glob_properties::many_stars_match_in_polynomial_time`,
//! `runtime::toolkit::tests::crlf_line_endings_are_kept`).
//!
//! Properties of private helpers live next to them (`src/runtime/containerd/tests.rs` for the
//! `imports` globs).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config as ProptestConfig;

// === shared ===

/// proptest's configuration for a property: `PROPTEST_CASES` when set, else `cases`; no
/// failure files.
fn cases(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = cases;
    }
    config.failure_persistence = None;
    config
}

/// Text that parsers choke on: the syntax characters of TOML, YAML and JSON, line ends, odd
/// unicode, huge and negative numbers, and anything else.
fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "\"", "'", "[", "]", "[[", "]]", "{", "}", "=", ",", ":", "\n", "\r\n", "\r", "#", "\\", ".", "-", "- ",
            "  ", "\t", "0x", "-1", "0", "4294967296", "18446744073709551616", "99999999999999999999999",
            "1e400", "nan", "inf", "true", "false", "null", "~", "&a", "*a", "!!str", "? ", "|", ">", "---",
            "...", "%YAML 1.2", "é", "\u{0}", "\u{feff}", "\u{202e}", "\u{10ffff}", "🦀", "\u{7f}", "\u{85}",
            "\u{2028}", "all", "v1", "1g.5gb", "+me", "-me", "/", "*", "?", "..",
        ])
        .prop_map(str::to_owned),
        1 => ".{0,12}",
        1 => any::<String>().prop_map(|s| s.chars().take(24).collect()),
    ]
}

/// One random edit of a document.
#[derive(Debug, Clone)]
enum Edit {
    Insert(Index, String),
    Delete(Index, usize),
    Replace(Index, String),
    DuplicateLine(Index),
    DropLine(Index),
    SwapLines(Index, Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<Index>(), token()).prop_map(|(at, s)| Edit::Insert(at, s)),
        2 => (any::<Index>(), 1..8usize).prop_map(|(at, n)| Edit::Delete(at, n)),
        2 => (any::<Index>(), token()).prop_map(|(at, s)| Edit::Replace(at, s)),
        1 => any::<Index>().prop_map(Edit::DuplicateLine),
        1 => any::<Index>().prop_map(Edit::DropLine),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Edit::SwapLines(a, b)),
    ]
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..6)
}

/// `text` with `edits` applied, in order (positions on character boundaries).
fn apply_edits(text: &str, edits: &[Edit]) -> String {
    let mut text = text.to_owned();
    for e in edits {
        let chars: Vec<char> = text.chars().collect();
        let at = |i: &Index| if chars.is_empty() { 0 } else { i.index(chars.len() + 1) };
        let lines = || text.split_inclusive('\n').map(str::to_owned).collect::<Vec<_>>();
        text = match e {
            Edit::Insert(i, s) => {
                let at = at(i);
                chars[..at].iter().collect::<String>() + s + &chars[at..].iter().collect::<String>()
            }
            Edit::Delete(i, n) => {
                let at = at(i);
                let end = (at + n).min(chars.len());
                chars[..at].iter().chain(&chars[end..]).collect()
            }
            Edit::Replace(i, s) => {
                let at = at(i);
                let end = (at + 1).min(chars.len());
                chars[..at].iter().collect::<String>() + s + &chars[end..].iter().collect::<String>()
            }
            Edit::DuplicateLine(i) => {
                let mut lines = lines();
                if !lines.is_empty() {
                    let k = i.index(lines.len());
                    let line = lines[k].clone();
                    lines.insert(k, line);
                }
                lines.concat()
            }
            Edit::DropLine(i) => {
                let mut lines = lines();
                if !lines.is_empty() {
                    lines.remove(i.index(lines.len()));
                }
                lines.concat()
            }
            Edit::SwapLines(a, b) => {
                let mut lines = lines();
                if !lines.is_empty() {
                    let (a, b) = (a.index(lines.len()), b.index(lines.len()));
                    lines.swap(a, b);
                }
                lines.concat()
            }
        };
    }
    text
}

/// An arbitrary document: short random text, or a jumble of tokens.
fn garbage() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>().prop_map(|s| s.chars().take(200).collect()),
        prop::collection::vec(token(), 0..40).prop_map(|t| t.concat()),
    ]
}

/// A lower-case DNS label, 1 to 12 characters.
fn dns_label() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
}

/// A valid label value that is not empty.
fn label_value() -> impl Strategy<Value = String> {
    "[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
}

/// A valid label key: an optional DNS-subdomain prefix and a name.
fn label_key() -> impl Strategy<Value = String> {
    (
        prop::option::of(prop::collection::vec(dns_label(), 1..4).prop_map(|l| l.join("."))),
        label_value(),
    )
        .prop_map(|(prefix, name)| match prefix {
            Some(p) => format!("{p}/{name}"),
            None => name,
        })
}

// === config: durations and closed sets ===

mod config_values {
    use super::*;
    use gpu_node_agent::config::{
        DeviceIdStrategy, DeviceListStrategy, LogFormat, MemoryAction, MigStrategy, SharedPolicy, SharingStrategy,
        format_duration, parse_duration,
    };

    fn duration_text() -> impl Strategy<Value = (String, u64)> {
        prop::collection::vec(
            (
                0u64..100_000,
                prop::sample::select(vec![("ms", 1u64), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)]),
            ),
            1..4,
        )
        .prop_map(|parts| {
            let text = parts
                .iter()
                .map(|(n, (unit, _))| format!("{n}{unit}"))
                .collect::<String>();
            let ms = parts.iter().map(|(n, (_, per))| n * per).sum();
            (text, ms)
        })
    }

    proptest! {
        #![proptest_config(cases(512))]

        #[test]
        fn durations_never_panic_and_errors_quote_the_input(text in garbage()) {
            if let Err(e) = parse_duration(&text) {
                prop_assert!(e.to_string().contains("expected a duration"), "{e}");
                prop_assert_eq!(&e.input, &text);
            }
        }

        #[test]
        fn durations_parse_their_parts((text, ms) in duration_text()) {
            prop_assert_eq!(parse_duration(&text), Ok(Duration::from_millis(ms)));
        }

        #[test]
        fn durations_round_trip(ms in any::<u64>()) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }

        #[test]
        fn closed_sets_round_trip_and_name_what_is_allowed(text in garbage()) {
            fn check<T>(text: &str) -> Result<(), TestCaseError>
            where
                T: std::str::FromStr<Err = gpu_node_agent::config::ParseEnumError> + std::fmt::Display,
            {
                match text.parse::<T>() {
                    Ok(v) => prop_assert_eq!(v.to_string(), text),
                    Err(e) => {
                        prop_assert!(!e.expected.is_empty());
                        for allowed in e.expected.split(", ") {
                            let v = allowed.parse::<T>();
                            prop_assert!(v.is_ok(), "{allowed} is listed but not parsed");
                        }
                    }
                }
                Ok(())
            }
            check::<MigStrategy>(&text)?;
            check::<DeviceListStrategy>(&text)?;
            check::<DeviceIdStrategy>(&text)?;
            check::<LogFormat>(&text)?;
            check::<MemoryAction>(&text)?;
            check::<SharingStrategy>(&text)?;
            check::<SharedPolicy>(&text)?;
        }
    }
}

// === config: files and drop-ins ===

mod config_files {
    use super::*;
    use gpu_node_agent::config::{Config, ConfigError, Source, parse_duration};

    /// What a generated value should come out as.
    #[derive(Debug, Clone, PartialEq)]
    enum Want {
        Str(String),
        Bool(bool),
        Int(i64),
        Dur(Duration),
        Ints(Vec<i64>),
    }

    impl Want {
        fn toml(&self) -> String {
            match self {
                Want::Str(s) => toml::Value::String(s.clone()).to_string(),
                Want::Bool(b) => b.to_string(),
                Want::Int(n) => n.to_string(),
                Want::Dur(d) => format!("\"{}ms\"", d.as_millis()),
                Want::Ints(v) => format!("[{}]", v.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")),
            }
        }

        fn matches(&self, value: &toml::Value) -> bool {
            match (self, value) {
                (Want::Dur(d), toml::Value::String(s)) => parse_duration(s).ok() == Some(*d),
                (Want::Str(s), toml::Value::String(v)) => s == v,
                (Want::Bool(b), toml::Value::Boolean(v)) => b == v,
                (Want::Int(n), toml::Value::Integer(v)) => n == v,
                (Want::Ints(n), toml::Value::Array(v)) => {
                    n.len() == v.len() && n.iter().zip(v).all(|(a, b)| b.as_integer() == Some(*a))
                }
                _ => false,
            }
        }
    }

    /// The kind of a key, for generating good and bad values.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Kind {
        Enum(&'static [&'static str]),
        Bool,
        /// A duration greater than zero.
        Positive,
        Path,
        Xids,
        LogLevel,
        NodeName,
        MetricsPath,
        Connections,
    }

    /// Keys whose values are valid on their own, whatever the other keys say.
    const KEYS: &[(&str, &str, Kind)] = &[
        ("log", "level", Kind::LogLevel),
        ("log", "format", Kind::Enum(&["auto", "journald", "text"])),
        ("agent", "state_dir", Kind::Path),
        ("agent", "run_dir", Kind::Path),
        ("agent", "resync_interval", Kind::Positive),
        ("nvml", "fail_on_init_error", Kind::Bool),
        ("nvml", "retry_interval", Kind::Positive),
        ("kubelet", "device_plugin_dir", Kind::Path),
        ("kubelet", "register_timeout", Kind::Positive),
        (
            "device_plugin",
            "mig_strategy",
            Kind::Enum(&["none", "single", "mixed"]),
        ),
        ("device_plugin", "device_id_strategy", Kind::Enum(&["uuid", "index"])),
        ("device_plugin", "pass_device_specs", Kind::Bool),
        ("device_plugin", "driver_root", Kind::Path),
        ("driver", "persistence_mode", Kind::Bool),
        ("driver", "create_device_nodes", Kind::Bool),
        ("runtime", "restart", Kind::Bool),
        ("runtime", "restart_timeout", Kind::Positive),
        ("cdi", "dir", Kind::Path),
        ("mig", "gpu_reset", Kind::Bool),
        ("validation", "cuda", Kind::Bool),
        ("metrics", "path", Kind::MetricsPath),
        ("metrics", "max_connections", Kind::Connections),
        ("metrics", "interval", Kind::Positive),
        ("health", "enabled", Kind::Bool),
        ("health", "ignored_xids", Kind::Xids),
        ("health", "critical_xids", Kind::Xids),
        ("health", "lost_check_interval", Kind::Positive),
        ("kubernetes", "node_name", Kind::NodeName),
        ("kubernetes", "watch", Kind::Bool),
        ("kubernetes", "poll_interval", Kind::Positive),
        ("labels", "report_features", Kind::Bool),
    ];

    fn good(kind: Kind) -> BoxedStrategy<Want> {
        match kind {
            Kind::Enum(values) => prop::sample::select(values)
                .prop_map(|v| Want::Str(v.to_owned()))
                .boxed(),
            Kind::Bool => any::<bool>().prop_map(Want::Bool).boxed(),
            Kind::Positive => (1u64..10_000_000)
                .prop_map(|ms| Want::Dur(Duration::from_millis(ms)))
                .boxed(),
            Kind::Path => prop::collection::vec("[a-zA-Z0-9._ -]{1,8}", 0..4)
                .prop_map(|parts| Want::Str(format!("/{}", parts.join("/"))))
                .boxed(),
            Kind::Xids => prop::collection::vec(0..=i64::from(u32::MAX), 0..6)
                .prop_map(Want::Ints)
                .boxed(),
            Kind::LogLevel => prop::sample::select(vec!["info", "debug", "WARN", "off", "info,gpu_node_agent=trace"])
                .prop_map(|v| Want::Str(v.to_owned()))
                .boxed(),
            Kind::NodeName => prop::collection::vec(dns_label(), 1..4)
                .prop_map(|l| Want::Str(l.join(".")))
                .boxed(),
            Kind::MetricsPath => "/[a-z]{0,10}".prop_map(Want::Str).boxed(),
            Kind::Connections => (1i64..=4096).prop_map(Want::Int).boxed(),
        }
    }

    /// A value of the wrong type, or one that breaks the key's rule.
    fn bad(kind: Kind) -> BoxedStrategy<String> {
        let wrong_type = prop::sample::select(vec!["1979-05-27T07:32:00Z", "{ x = 1 }"]).prop_map(str::to_owned);
        let specific: BoxedStrategy<String> = match kind {
            Kind::Enum(_) => "[a-z]{1,8}x".prop_map(|s| format!("\"{s}\"")).boxed(),
            Kind::Bool => Just("\"yes\"".to_owned()).boxed(),
            Kind::Positive => prop::sample::select(vec!["\"0s\"", "\"5 minutes\"", "\"\"", "30", "\"1h-5m\""])
                .prop_map(str::to_owned)
                .boxed(),
            Kind::Path => "[a-z]{1,8}(/[a-z]{1,8})?".prop_map(|s| format!("\"{s}\"")).boxed(),
            Kind::Xids => prop::sample::select(vec!["[-1]", "[4294967296]", "[\"13\"]", "13"])
                .prop_map(str::to_owned)
                .boxed(),
            Kind::LogLevel => Just("\"verbose\"".to_owned()).boxed(),
            Kind::NodeName => Just("\"Not_A_Name\"".to_owned()).boxed(),
            Kind::MetricsPath => Just("\"metrics\"".to_owned()).boxed(),
            Kind::Connections => prop::sample::select(vec!["0", "4097", "-1"])
                .prop_map(str::to_owned)
                .boxed(),
        };
        prop_oneof![1 => wrong_type, 3 => specific].boxed()
    }

    /// A generated setting: key index, value, and which file (0: main) sets it.
    type Setting = (usize, Want, usize);

    fn settings(files: usize) -> impl Strategy<Value = Vec<Setting>> {
        prop::collection::vec(
            (0..KEYS.len(), 0..files).prop_flat_map(|(k, file)| (Just(k), good(KEYS[k].2), Just(file))),
            0..16,
        )
        .prop_map(|mut all| {
            // One value per key and file.
            let mut seen = std::collections::BTreeSet::new();
            all.retain(|(k, _, f)| seen.insert((*k, *f)));
            all
        })
    }

    /// How a file spells a section's keys.
    #[derive(Debug, Clone, Copy)]
    enum Style {
        Header,
        Dotted,
        Inline,
    }

    /// One config file with these settings, each section in one of the styles, with comments
    /// and blank lines between.
    fn render(settings: &[(&str, &str, String)], styles: &[Style], noise: &[bool]) -> String {
        let mut sections: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
        for (section, key, value) in settings {
            sections.entry(section).or_default().push((key, value));
        }
        let mut top = String::new();
        let mut tables = String::new();
        let mut n = 0;
        let mut noise_line = |out: &mut String| {
            n += 1;
            if noise.get(n % noise.len().max(1)).copied().unwrap_or(false) {
                out.push_str(if n % 2 == 0 { "# a comment = [\n" } else { "\n" });
            }
        };
        for (i, (section, keys)) in sections.iter().enumerate() {
            match styles.get(i % styles.len().max(1)).copied().unwrap_or(Style::Header) {
                Style::Header => {
                    tables.push_str(&format!("[{section}]\n"));
                    for (key, value) in keys {
                        noise_line(&mut tables);
                        tables.push_str(&format!("{key} = {value}\n"));
                    }
                }
                Style::Dotted => {
                    for (key, value) in keys {
                        noise_line(&mut top);
                        top.push_str(&format!("{section}.{key} = {value}\n"));
                    }
                }
                Style::Inline => {
                    let inner: Vec<String> = keys.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                    noise_line(&mut top);
                    top.push_str(&format!("{section} = {{ {} }}\n", inner.join(", ")));
                }
            }
        }
        top + &tables
    }

    fn style() -> impl Strategy<Value = Style> {
        prop_oneof![Just(Style::Header), Just(Style::Dotted), Just(Style::Inline)]
    }

    const NAMES: [&str; 3] = [
        "/etc/gpu-node-agent/config.toml",
        "/etc/gpu-node-agent/config.d/10-a.toml",
        "/etc/gpu-node-agent/config.d/20-b.toml",
    ];

    /// Generated valid files: their sources, and the value each key should end up with.
    fn valid_files() -> impl Strategy<Value = (Vec<Source>, BTreeMap<usize, Want>)> {
        (
            settings(NAMES.len()),
            prop::collection::vec(style(), 1..4),
            prop::collection::vec(any::<bool>(), 1..8),
        )
            .prop_map(|(settings, styles, noise)| {
                let mut sources = Vec::new();
                for (f, name) in NAMES.iter().enumerate() {
                    let mine: Vec<(&str, &str, String)> = settings
                        .iter()
                        .filter(|(_, _, file)| *file == f)
                        .map(|(k, want, _)| (KEYS[*k].0, KEYS[*k].1, want.toml()))
                        .collect();
                    sources.push(Source::new(*name, render(&mine, &styles, &noise)));
                }
                let mut want = BTreeMap::new();
                let mut by_file = settings.clone();
                by_file.sort_by_key(|(_, _, f)| *f);
                for (k, value, _) in by_file {
                    want.insert(k, value);
                }
                (sources, want)
            })
    }

    fn lookup<'a>(config: &'a toml::Value, section: &str, key: &str) -> Option<&'a toml::Value> {
        config.get(section)?.get(key)
    }

    /// Every error names what it is about: a file among the sources and a line inside it, and
    /// the key when there is one; only a default value breaking a rule has no place.
    fn check_error(e: &ConfigError, sources: &[Source]) -> Result<(), TestCaseError> {
        let text = e.to_string();
        prop_assert!(!text.is_empty());
        prop_assert_eq!(e.exit_code(), 64);
        match e.location() {
            Some(at) => {
                let source = sources.iter().find(|s| s.name == at.file);
                prop_assert!(source.is_some(), "{text}: names no source");
                let lines = source.map_or(0, |s| s.text.split('\n').count());
                prop_assert!(at.line >= 1 && at.line <= lines, "{text}: line {} of {lines}", at.line);
                let prefix = format!("{}:{}: ", at.file, at.line);
                prop_assert!(text.starts_with(&prefix), "{text}");
            }
            None => prop_assert!(
                matches!(e, ConfigError::InvalidValue { .. }) && text.contains("(default)"),
                "{text}: no place"
            ),
        }
        if let Some(key) = e.key() {
            prop_assert!(!key.is_empty());
            prop_assert!(text.contains(key), "{text}");
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(cases(96))]

        #[test]
        fn generated_configs_are_accepted_with_their_values((sources, want) in valid_files()) {
            let config = match Config::from_sources(&sources) {
                Ok(config) => config,
                Err(e) => {
                    let files: Vec<String> = sources.iter().map(|s| format!("{}:\n{}", s.name, s.text)).collect();
                    return Err(TestCaseError::fail(format!("{e}\n{}", files.join("\n"))));
                }
            };
            let effective = toml::Value::try_from(&config).unwrap();
            for (k, value) in &want {
                let (section, key, _) = KEYS[*k];
                let got = lookup(&effective, section, key);
                prop_assert!(got.is_some_and(|got| value.matches(got)), "{section}.{key}: {got:?}, want {value:?}");
            }
            // The effective config, written out, reads back the same.
            let text = toml::to_string(&config).unwrap();
            prop_assert_eq!(Config::from_sources(&[Source::new("effective.toml", text)]).unwrap(), config);
        }

        #[test]
        fn a_bad_value_is_reported_at_its_file_line_and_key(
            (sources, _) in valid_files(),
            (k, bad) in (0..KEYS.len()).prop_flat_map(|k| (Just(k), bad(KEYS[k].2))),
            blank in 0..4usize,
            dotted in any::<bool>(),
        ) {
            let (section, key, _) = KEYS[k];
            let mut text = "# the operator's override\n\n".repeat(blank);
            let line = if dotted {
                text.push_str(&format!("{section}.{key} = {bad}\n"));
                2 * blank + 1
            } else {
                text.push_str(&format!("[{section}]\n{key} = {bad}\n"));
                2 * blank + 2
            };
            let name = "/etc/gpu-node-agent/config.d/99-bad.toml";
            let mut sources = sources;
            sources.push(Source::new(name, text));
            let e = Config::from_sources(&sources).expect_err("bad value accepted");
            check_error(&e, &sources)?;
            let shown = e.to_string();
            prop_assert!(shown.starts_with(&format!("{name}:{line}: ")), "{shown}");
            prop_assert!(shown.contains(&format!("{section}.{key}")), "{shown}");
        }

        #[test]
        fn an_unknown_key_is_reported_at_its_file_line_and_key(
            (sources, _) in valid_files(),
            k in 0..KEYS.len(),
            unknown in "[a-z]{1,6}_x",
        ) {
            let section = KEYS[k].0;
            let name = "/etc/gpu-node-agent/config.d/99-typo.toml";
            let mut sources = sources;
            sources.push(Source::new(name, format!("# typo\n[{section}]\n{unknown} = 1\n")));
            let e = Config::from_sources(&sources).expect_err("unknown key accepted");
            check_error(&e, &sources)?;
            let shown = e.to_string();
            let want = format!("{name}:3: unknown key {section}.{unknown}: expected ");
            prop_assert!(shown.starts_with(&want), "{shown}");
        }

        #[test]
        fn edited_configs_never_panic_and_errors_name_file_line_and_key(
            (sources, _) in valid_files(),
            file in 0..NAMES.len(),
            edits in edits(),
        ) {
            let mut sources = sources;
            sources[file].text = apply_edits(&sources[file].text, &edits);
            if let Err(e) = Config::from_sources(&sources) {
                check_error(&e, &sources)?;
            }
        }

        #[test]
        fn edited_example_config_never_panics(edits in edits()) {
            let example = include_str!("../config/gpu-node-agent.toml");
            let sources = [Source::new("/etc/gpu-node-agent/config.toml", apply_edits(example, &edits))];
            if let Err(e) = Config::from_sources(&sources) {
                check_error(&e, &sources)?;
            }
        }

        #[test]
        fn arbitrary_text_never_panics(text in garbage(), second in garbage()) {
            let sources = [Source::new("a.toml", text), Source::new("b.toml", second)];
            if let Err(e) = Config::from_sources(&sources) {
                check_error(&e, &sources)?;
            }
        }
    }
}

// === labels: keys, values, the labels file, desired state, GPU feature labels ===

mod labels {
    use super::*;
    use gpu_node_agent::config::{LabelsConfig, MigStrategy};
    use gpu_node_agent::desired::{Desired, Selection, parse_labels_file};
    use gpu_node_agent::labels::gfd::{FeatureInputs, ResourceSharing, feature_labels};
    use gpu_node_agent::names::{check_label_key, check_label_value, is_dns_subdomain};
    use gpu_node_agent::nvml::{GpuInfo, Inventory, MigAttributes, MigDeviceInfo, MigState};

    /// The API server's rule for a name part or value, written out independently.
    fn is_segment(s: &str) -> bool {
        let b = s.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
    }

    /// Mostly label-ish text, sometimes anything.
    fn labelish() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[A-Za-z0-9._/-]{0,70}",
            1 => "[a-z0-9.-]{0,260}/[a-z0-9]{0,3}",
            1 => any::<String>().prop_map(|s| s.chars().take(70).collect()),
        ]
    }

    fn gpu(index: u32, name: String, mig: Option<bool>, profiles: Vec<String>) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            name,
            memory_mib: 40960,
            pci_bus_id: format!("00000000:{index:02x}:00.0"),
            pci_device_id: 0x20b0,
            minor: index,
            numa_node: None,
            compute_capability: Some((8, 0)),
            mig: mig.map(|current| MigState {
                current,
                pending: current,
            }),
            mig_devices: profiles
                .into_iter()
                .enumerate()
                .map(|(i, profile)| MigDeviceInfo {
                    index: i as u32,
                    uuid: format!("MIG-{index}-{i}"),
                    gi_id: i as u32,
                    ci_id: 0,
                    profile,
                    memory_mib: 4864,
                    attributes: (i % 2 == 0).then_some(MigAttributes {
                        multiprocessors: 14,
                        gpu_instance_slices: 1,
                        compute_instance_slices: 1,
                        copy_engines: 1,
                        decoders: 0,
                        encoders: 0,
                        jpeg: 0,
                        ofa: 0,
                        memory_mib: 4864,
                    }),
                    placement: None,
                })
                .collect(),
            fabric: None,
            pci_class: Some(0x030200),
        }
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("NVIDIA A100-SXM4-40GB".to_owned()),
            Just("1g.5gb+me".to_owned()),
            "[A-Za-z0-9 ().+_-]{0,80}",
            any::<String>().prop_map(|s| s.chars().take(80).collect()),
        ]
    }

    fn inventory() -> impl Strategy<Value = Inventory> {
        (
            text(),
            text(),
            prop::collection::vec(
                (
                    text(),
                    prop::option::of(any::<bool>()),
                    prop::collection::vec(text(), 0..3),
                ),
                0..4,
            ),
        )
            .prop_map(|(driver_version, cuda_driver_version, gpus)| Inventory {
                driver_version,
                cuda_driver_version,
                gpus: gpus
                    .into_iter()
                    .enumerate()
                    .map(|(i, (name, mig, profiles))| gpu(i as u32, name, mig, profiles))
                    .collect(),
            })
    }

    proptest! {
        #![proptest_config(cases(512))]

        #[test]
        fn label_values_follow_the_api_server(value in labelish()) {
            let ok = value.is_empty() || is_segment(&value);
            let checked = check_label_value(&value);
            prop_assert_eq!(checked.is_ok(), ok, "{:?}: {:?}", value, checked);
            if let Err(reason) = checked {
                prop_assert!(reason.contains(&format!("{value:?}")), "{reason}");
            }
        }

        #[test]
        fn label_keys_follow_the_api_server(key in prop_oneof![label_key(), labelish()]) {
            let ok = match key.rsplit_once('/') {
                Some((prefix, name)) => prefix.len() <= 253 && is_dns_subdomain(prefix) && is_segment(name),
                None => is_segment(&key),
            };
            let checked = check_label_key(&key);
            prop_assert_eq!(checked.is_ok(), ok, "{:?}: {:?}", key, checked);
            if let Err(reason) = checked {
                prop_assert!(!reason.is_empty());
            }
        }

        #[test]
        fn generated_keys_and_values_are_valid(key in label_key(), value in label_value()) {
            prop_assert_eq!(check_label_key(&key), Ok(()));
            prop_assert_eq!(check_label_value(&value), Ok(()));
        }

        #[test]
        fn labels_files_round_trip(
            labels in prop::collection::btree_map(label_key(), "[^\n\r]{0,30}", 0..8),
            comments in prop::collection::vec(any::<bool>(), 0..8),
            spaced in any::<bool>(),
        ) {
            let mut text = String::new();
            for (i, (k, v)) in labels.iter().enumerate() {
                if comments.get(i).copied().unwrap_or(false) {
                    text.push_str("# nvidia.com/x = y\n\n");
                }
                let sep = if spaced { " = " } else { "=" };
                text.push_str(&format!("{k}{sep}{v}\n"));
            }
            let want: BTreeMap<String, String> = labels.iter().map(|(k, v)| (k.clone(), v.trim().to_owned())).collect();
            prop_assert_eq!(parse_labels_file("/etc/labels", &text), Ok(want));
        }

        #[test]
        fn labels_files_never_panic_and_errors_name_file_and_line(text in prop_oneof![
            garbage(),
            (prop::collection::btree_map(label_key(), label_value(), 1..6), edits()).prop_map(|(labels, edits)| {
                let text: String = labels.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
                apply_edits(&text, &edits)
            }),
        ]) {
            if let Err(e) = parse_labels_file("/etc/gpu-node-agent/labels", &text) {
                let lines = text.lines().count();
                prop_assert!(e.line >= 1 && e.line <= lines, "line {} of {lines}", e.line);
                prop_assert!(!e.reason.is_empty());
                let prefix = format!("/etc/gpu-node-agent/labels:{}: ", e.line);
                prop_assert!(e.to_string().starts_with(&prefix), "{e}");
            }
        }

        #[test]
        fn desired_state_selects_exactly_the_valid_values(
            mig in prop::option::of(labelish()),
            plugin in prop::option::of(labelish()),
        ) {
            let keys = LabelsConfig::default();
            let mut labels = BTreeMap::new();
            if let Some(v) = &mig {
                labels.insert(keys.mig_config.clone(), v.clone());
            }
            if let Some(v) = &plugin {
                labels.insert(keys.device_plugin_config.clone(), v.clone());
            }
            let desired = Desired::from_labels(&labels, &keys);
            for (given, selection) in [(&mig, &desired.mig_config), (&plugin, &desired.device_plugin_config)] {
                match (given.as_deref(), selection) {
                    (None | Some(""), Selection::Unset) => {}
                    (Some(v), Selection::Name { name }) => {
                        prop_assert_eq!(v, name.as_str());
                        prop_assert!(check_label_value(v).is_ok());
                    }
                    (Some(v), Selection::Invalid { value, reason }) => {
                        prop_assert_eq!(v, value.as_str());
                        prop_assert!(check_label_value(v).is_err() && !reason.is_empty());
                    }
                    (given, selection) => prop_assert!(false, "{given:?} gave {selection:?}"),
                }
            }
        }

        #[test]
        fn feature_labels_are_always_valid_labels(
            inventory in inventory(),
            strategy in prop_oneof![Just(MigStrategy::None), Just(MigStrategy::Single), Just(MigStrategy::Mixed)],
            machine in prop::option::of(text()),
            sharing in prop_oneof![
                prop::sample::select(vec!["none", "time-slicing", "mps"]).prop_map(str::to_owned),
                text(),
            ],
            replicas in 0u32..6,
            renamed in any::<bool>(),
        ) {
            let mut shared = BTreeMap::new();
            shared.insert("gpu".to_owned(), ResourceSharing { replicas, renamed });
            for g in &inventory.gpus {
                for m in &g.mig_devices {
                    let resource = format!("mig-{}", m.profile.replace('+', "."));
                    shared.insert(resource, ResourceSharing { replicas, renamed });
                }
            }
            let inputs = FeatureInputs {
                inventory: &inventory,
                mig_strategy: strategy,
                prefix: "nvidia.com/",
                machine: machine.as_deref(),
                vgpu: false,
                sharing_strategy: &sharing,
                shared: &shared,
            };
            let labels = feature_labels(&inputs);
            prop_assert!(labels.contains_key("nvidia.com/gpu.present"));
            for (k, v) in &labels {
                prop_assert!(k.starts_with("nvidia.com/"), "{k}");
                prop_assert_eq!(check_label_key(k), Ok(()), "key {:?}", k);
                prop_assert_eq!(check_label_value(v), Ok(()), "{} = {:?}", k, v);
            }
        }
    }
}

// === MIG: profile names, device ids, layouts, mig-parted import and TOML export ===

mod mig {
    use super::*;
    use gpu_node_agent::config::{Config, Source};
    use gpu_node_agent::mig::import::{import_mig_parted, to_toml};
    use gpu_node_agent::mig_layout::{
        DeviceId, DeviceSelector, LayoutEntry, MigLayout, format_device_id, parse_device_id, parse_profile_name,
    };

    /// A profile name and what it should parse to: (C, G, GB, +attrs, -attrs).
    type Profile = (String, (Option<u32>, u32, u32, Vec<String>, Vec<String>));

    fn attrs() -> impl Strategy<Value = Vec<String>> {
        prop::collection::btree_set("[a-z][a-z0-9]{0,3}(\\.[a-z0-9]{1,3})?", 1..3).prop_map(|s| s.into_iter().collect())
    }

    fn profile() -> impl Strategy<Value = Profile> {
        (1u32..=8, 1u32..=200)
            .prop_flat_map(|(g, gb)| {
                let c = if g > 1 {
                    prop::option::of(1..g).boxed()
                } else {
                    Just(None).boxed()
                };
                let suffix = prop_oneof![
                    2 => Just((Vec::new(), Vec::new())),
                    1 => attrs().prop_map(|a| (a, Vec::new())),
                    1 => attrs().prop_map(|a| (Vec::new(), a)),
                ];
                (c, Just(g), Just(gb), suffix)
            })
            .prop_map(|(c, g, gb, (plus, minus))| {
                let mut text = c.map(|c| format!("{c}c.")).unwrap_or_default() + &format!("{g}g.{gb}gb");
                if !plus.is_empty() {
                    text += &format!("+{}", plus.join(","));
                }
                if !minus.is_empty() {
                    text += &format!("-{}", minus.join(","));
                }
                (text, (c, g, gb, plus, minus))
            })
    }

    /// A valid entry for the GPUs `8*slot .. 8*slot+8`, so that entries never overlap.
    fn entry(slot: u32, all: bool) -> impl Strategy<Value = LayoutEntry> {
        let devices = if all {
            Just(DeviceSelector::All).boxed()
        } else {
            prop::collection::btree_set(8 * slot..8 * slot + 8, 1..4)
                .prop_map(|s| DeviceSelector::Indices(s.into_iter().collect()))
                .boxed()
        };
        (
            devices,
            prop::collection::btree_set((any::<u16>(), prop::option::of(any::<u32>())), 0..3),
            any::<bool>(),
            prop::collection::btree_map(profile().prop_map(|(text, _)| text), 1u32..=7, 0..4),
        )
            .prop_map(|(devices, filter, mig_enabled, profiles)| LayoutEntry {
                devices,
                device_filter: filter
                    .into_iter()
                    .map(|(device, subsystem)| DeviceId { device, subsystem })
                    .collect(),
                mig_enabled,
                profiles: if mig_enabled { profiles } else { BTreeMap::new() },
                generated: None,
            })
    }

    fn layout() -> impl Strategy<Value = MigLayout> {
        prop_oneof![
            entry(0, true).prop_map(|e| MigLayout::new(vec![e])),
            (1usize..4).prop_flat_map(|n| {
                (0..n as u32)
                    .map(|slot| entry(slot, false))
                    .collect::<Vec<_>>()
                    .prop_map(MigLayout::new)
            }),
        ]
    }

    fn layouts() -> impl Strategy<Value = BTreeMap<String, MigLayout>> {
        prop::collection::btree_map(label_value(), layout(), 1..4)
    }

    /// The layouts as a mig-parted config file, in a few of the spellings mig-parted accepts.
    fn mig_parted_yaml(layouts: &BTreeMap<String, MigLayout>, style: u8) -> String {
        let mut out = String::from("version: v1\nmig-configs:\n");
        for (name, layout) in layouts {
            out += &format!("  {name:?}:\n");
            for e in &layout.entries {
                match &e.devices {
                    DeviceSelector::All => out += "    - devices: all\n",
                    DeviceSelector::Indices(list) => {
                        let list: Vec<String> = list.iter().map(u32::to_string).collect();
                        out += &format!("    - devices: [{}]\n", list.join(", "));
                    }
                }
                let ids: Vec<String> = e
                    .device_filter
                    .iter()
                    .map(|id| format!("\"{}\"", id.to_mig_parted()))
                    .collect();
                match (ids.as_slice(), style % 2) {
                    ([], _) => {}
                    ([one], 0) => out += &format!("      device-filter: {one}\n"),
                    (many, _) => out += &format!("      device-filter: [{}]\n", many.join(", ")),
                }
                let enabled = match (e.mig_enabled, style % 3) {
                    (true, 0) => "true",
                    (true, 1) => "yes",
                    (true, _) => "On",
                    (false, 0) => "false",
                    (false, 1) => "no",
                    (false, _) => "OFF",
                };
                out += &format!("      mig-enabled: {enabled}\n");
                if e.mig_enabled {
                    if e.profiles.is_empty() {
                        out += "      mig-devices: {}\n";
                    } else {
                        out += "      mig-devices:\n";
                        for (p, n) in &e.profiles {
                            out += &format!("        {p:?}: {n}\n");
                        }
                    }
                }
            }
        }
        out
    }

    fn import_errors_name_something(text: &str) -> Result<(), TestCaseError> {
        if let Err(e) = import_mig_parted(text) {
            prop_assert!(!e.reason.is_empty());
            prop_assert!(!e.to_string().is_empty());
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(cases(256))]

        #[test]
        fn profile_names_parse_to_their_parts((text, (c, g, gb, plus, minus)) in profile()) {
            let p = parse_profile_name(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!((p.compute_slices, p.gpu_slices, p.memory_gb), (c, g, gb));
            prop_assert_eq!(&p.attrs, &plus);
            prop_assert_eq!(&p.neg_attrs, &minus);
            prop_assert_eq!(p.to_string(), text.clone());
            let gi = parse_profile_name(&p.gpu_instance_name()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!((gi.compute_slices, gi.gpu_slices, gi.memory_gb), (None, g, gb));
        }

        #[test]
        fn profile_names_never_panic_and_errors_quote_the_name(text in prop_oneof![
            garbage(),
            (profile(), edits()).prop_map(|((text, _), edits)| apply_edits(&text, &edits)),
        ]) {
            if let Err(e) = parse_profile_name(&text) {
                let shown = e.to_string();
                prop_assert!(shown.contains(&format!("{text:?}")), "{shown}");
            }
        }

        #[test]
        fn device_ids_round_trip(
            id in any::<u16>(),
            vendor in any::<u16>(),
            subsystem in prop::option::of(any::<u32>()),
            lower in any::<bool>(),
        ) {
            let short = format_device_id(id);
            let short = if lower { short.to_lowercase().replacen("0x", "0X", 1) } else { short };
            prop_assert_eq!(parse_device_id(&short), Ok(DeviceId::from(id)));
            let with_subsystem = DeviceId { device: id, subsystem };
            prop_assert_eq!(parse_device_id(&with_subsystem.to_string()), Ok(with_subsystem));
            prop_assert_eq!(parse_device_id(&with_subsystem.to_mig_parted()), Ok(with_subsystem));
            let long = format!("0x{id:04X}{vendor:04X}");
            let parsed = parse_device_id(&long);
            if vendor == 0x10DE {
                prop_assert_eq!(parsed, Ok(DeviceId::from(id)));
            } else {
                prop_assert!(parsed.is_err_and(|e| e.contains("vendor")));
            }
        }

        #[test]
        fn device_ids_never_panic(text in garbage()) {
            if let Err(e) = parse_device_id(&text) {
                prop_assert!(!e.is_empty());
            }
        }

        #[test]
        fn generated_layouts_pass_their_check(layout in layout()) {
            prop_assert_eq!(layout.check(), Ok(()));
        }

        #[test]
        fn mig_parted_files_import_to_their_layouts(layouts in layouts(), style in any::<u8>()) {
            let yaml = mig_parted_yaml(&layouts, style);
            let imported = import_mig_parted(&yaml).map_err(|e| TestCaseError::fail(format!("{e}\n{yaml}")))?;
            prop_assert_eq!(&imported, &layouts);
        }

        #[test]
        fn exported_layouts_read_back_through_the_config(layouts in layouts()) {
            let text = to_toml(&layouts);
            let config = Config::from_sources(&[Source::new("/etc/gpu-node-agent/config.d/50-mig.toml", text.clone())])
                .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
            prop_assert_eq!(&config.mig.layouts, &layouts);
            // And the effective config writes them the same way again.
            let effective = toml::to_string(&config).unwrap();
            let again = Config::from_sources(&[Source::new("effective.toml", effective)]).unwrap();
            prop_assert_eq!(&again.mig.layouts, &layouts);
        }

        #[test]
        fn edited_mig_parted_files_never_panic(layouts in layouts(), style in any::<u8>(), edits in edits()) {
            import_errors_name_something(&apply_edits(&mig_parted_yaml(&layouts, style), &edits))?;
        }

        #[test]
        fn arbitrary_mig_parted_files_never_panic(text in garbage()) {
            import_errors_name_something(&text)?;
        }
    }

    /// Deep nesting and alias bombs: an error, not a crash or an endless expansion.
    #[test]
    fn hostile_yaml_is_refused() {
        for depth in [64, 1_000, 20_000] {
            let deep = format!("version: v1\nmig-configs: {}{}\n", "[".repeat(depth), "]".repeat(depth));
            assert!(import_mig_parted(&deep).is_err());
            let deep = format!(
                "version: v1\nmig-configs:\n{}",
                (0..depth.min(2_000))
                    .map(|i| format!("{}a:\n", " ".repeat(i)))
                    .collect::<String>()
            );
            assert!(import_mig_parted(&deep).is_err());
        }
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let refs = vec![format!("*a{}", i - 1); 10];
            bomb += &format!("a{i}: &a{i} [{}]\n", refs.join(", "));
        }
        bomb += "version: v1\nmig-configs: *a11\n";
        let start = std::time::Instant::now();
        assert!(import_mig_parted(&bomb).is_err());
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    }
}

// === Kubernetes: kubeconfig files, RFC 3339 times ===
//
// The ExecCredential parser and the watch-event parser are private to `kube` and not reachable
// from here; `kube` is covered through its public readers.

mod kube {
    use super::*;
    use gpu_node_agent::host::HostRoot;
    use gpu_node_agent::kube::{FoundBy, TokenSource, format_rfc3339, load_kubeconfig, parse_rfc3339};

    /// Seconds of 9999-12-31T23:59:59Z, the last time a four-digit year can write.
    const MAX_RFC3339: u64 = 253_402_300_799;

    #[derive(Debug, Clone)]
    struct Kubeconfig {
        context: String,
        cluster: String,
        user: String,
        server: String,
        token: String,
        ca: Option<Vec<u8>>,
        flow: bool,
    }

    impl Kubeconfig {
        fn yaml(&self) -> String {
            let ca = self.ca.as_ref().map_or(String::new(), |ca| {
                use base64::Engine;
                format!(
                    "    certificate-authority-data: {}\n",
                    base64::engine::general_purpose::STANDARD.encode(ca)
                )
            });
            let Kubeconfig {
                context,
                cluster,
                user,
                server,
                token,
                flow,
                ..
            } = self;
            if *flow {
                format!(
                    "{{apiVersion: v1, kind: Config, current-context: {context}, \
                     contexts: [{{name: {context}, context: {{cluster: {cluster}, user: {user}}}}}], \
                     clusters: [{{name: {cluster}, cluster: {{server: '{server}'}}}}], \
                     users: [{{name: {user}, user: {{token: {token}}}}}]}}\n"
                )
            } else {
                format!(
                    "apiVersion: v1\nkind: Config\ncurrent-context: {context}\n\
                     contexts:\n- name: {context}\n  context:\n    cluster: {cluster}\n    user: {user}\n\
                     clusters:\n- name: other\n  cluster:\n    server: https://wrong.example\n\
                     - name: {cluster}\n  cluster:\n    server: {server}\n{ca}\
                     users:\n- name: {user}\n  user:\n    token: {token}\n"
                )
            }
        }
    }

    fn kubeconfig() -> impl Strategy<Value = Kubeconfig> {
        (
            dns_label(),
            dns_label().prop_filter("not the decoy", |c| c != "other"),
            dns_label(),
            (dns_label(), prop::option::of(1u16..), any::<bool>()),
            "[A-Za-z0-9]{24,40}",
            prop::option::of(prop::collection::vec(any::<u8>(), 1..64)),
            any::<bool>(),
        )
            .prop_map(
                |(context, cluster, user, (host, port, slash), token, ca, flow)| Kubeconfig {
                    context,
                    cluster,
                    user,
                    server: format!(
                        "https://{host}.example{}{}",
                        port.map_or(String::new(), |p| format!(":{p}")),
                        if slash { "/" } else { "" }
                    ),
                    token: format!("sekrit{token}"),
                    ca: if flow { None } else { ca },
                    flow,
                },
            )
    }

    fn load(text: &str) -> Result<gpu_node_agent::kube::Credentials, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("etc/kubernetes/kubelet.conf");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        load_kubeconfig(&path, FoundBy::Search, &HostRoot::new(dir.path())).map_err(|e| e.to_string())
    }

    proptest! {
        #![proptest_config(cases(128))]

        #[test]
        fn generated_kubeconfigs_resolve(k in kubeconfig()) {
            let creds = load(&k.yaml()).map_err(|e| TestCaseError::fail(format!("{e}\n{}", k.yaml())))?;
            prop_assert_eq!(creds.server.as_str(), k.server.trim_end_matches('/'));
            prop_assert!(matches!(&creds.auth.token, Some(TokenSource::Inline(t)) if t.expose() == k.token));
            prop_assert!(!format!("{creds:?}").contains(&k.token), "the token shows in Debug");
        }

        #[test]
        fn edited_kubeconfigs_never_panic_nor_show_the_token(k in kubeconfig(), edits in edits()) {
            let text = apply_edits(&k.yaml(), &edits);
            match load(&text) {
                Ok(creds) => {
                    let shown = format!("{creds:?}");
                    prop_assert!(!shown.contains(&k.token), "the token shows in Debug: {shown}");
                }
                Err(e) => {
                    prop_assert!(e.contains("kubelet.conf"), "{e}");
                    prop_assert!(!e.contains(&k.token), "the error shows the token: {e}");
                }
            }
        }

        #[test]
        fn arbitrary_kubeconfigs_never_panic(text in garbage()) {
            if let Err(e) = load(&text) {
                prop_assert!(e.contains("kubelet.conf"), "{e}");
            }
        }
    }

    proptest! {
        #![proptest_config(cases(1024))]

        #[test]
        fn rfc3339_round_trips(secs in 0..=MAX_RFC3339) {
            let t = UNIX_EPOCH + Duration::from_secs(secs);
            prop_assert_eq!(parse_rfc3339(&format_rfc3339(t)), Some(t));
        }

        #[test]
        fn rfc3339_offsets_and_fractions(
            secs in 86_400..=MAX_RFC3339 - 86_400,
            offset_min in -1439i64..=1439,
            frac in prop::option::of("[0-9]{1,12}"),
        ) {
            let local = UNIX_EPOCH + Duration::from_secs((secs as i64 + offset_min * 60) as u64);
            let sign = if offset_min < 0 { '-' } else { '+' };
            let zone = format!("{sign}{:02}:{:02}", offset_min.abs() / 60, offset_min.abs() % 60);
            let frac_text = frac.as_ref().map_or(String::new(), |f| format!(".{f}"));
            let text = format_rfc3339(local).replace('Z', &format!("{frac_text}{zone}"));
            let nanos = frac.as_ref().map_or(0, |f| format!("{:0<9}", &f[..f.len().min(9)]).parse::<u32>().unwrap());
            prop_assert_eq!(parse_rfc3339(&text), Some(UNIX_EPOCH + Duration::new(secs, nanos)), "{}", text);
        }

        #[test]
        fn rfc3339_never_panics(text in prop_oneof![
            garbage(),
            (0..=MAX_RFC3339, edits())
                .prop_map(|(s, e)| apply_edits(&format_rfc3339(UNIX_EPOCH + Duration::from_secs(s)), &e)),
        ]) {
            let _ = parse_rfc3339(&text);
        }

        #[test]
        fn rfc3339_formats_any_time(secs in any::<i64>()) {
            let t = if secs >= 0 {
                UNIX_EPOCH.checked_add(Duration::from_secs(secs as u64))
            } else {
                UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
            };
            if let Some(t) = t {
                prop_assert!(!format_rfc3339(t).is_empty());
            }
        }
    }

    #[test]
    fn times_before_the_epoch_round_trip() {
        let t = UNIX_EPOCH - Duration::from_secs(86_400 * 365);
        assert_eq!(format_rfc3339(t), "1969-01-01T00:00:00Z");
        assert_eq!(parse_rfc3339("1969-01-01T00:00:00Z"), Some(t));
    }
}

// === container runtimes: containerd, docker, CRI-O, the toolkit, the kubelet's endpoint ===

mod runtime {
    use super::*;
    use gpu_node_agent::runtime::{
        DefaultRuntime, EditError, NvidiaRuntime, containerd, cri, crio, docker, kubelet, toolkit,
    };

    const MAIN_FILE: &str = "/etc/containerd/config.toml";
    const DROP_IN: &str = "/etc/containerd/conf.d/99-nvidia.toml";

    fn quoted(s: &str) -> String {
        toml::Value::String(s.to_owned()).to_string()
    }

    fn nvidia_runtime() -> impl Strategy<Value = NvidiaRuntime> {
        (
            prop_oneof![
                Just(DefaultRuntime::Set),
                Just(DefaultRuntime::Keep),
                Just(DefaultRuntime::Unset)
            ],
            any::<bool>(),
            any::<bool>(),
            prop_oneof![
                Just("/usr/bin/nvidia-container-runtime".to_owned()),
                "/[a-z]{1,6}/[a-z \"'\\\\é-]{1,12}"
            ],
            // cdi-only (no runtime) one time in four.
            prop_oneof![3 => Just(true), 1 => Just(false)],
        )
            .prop_map(|(default, enable_cdi, also, binary, runtimes)| NvidiaRuntime {
                name: "nvidia".to_owned(),
                binary: PathBuf::from(&binary),
                default,
                enable_cdi,
                also: if also {
                    vec![
                        ("nvidia-cdi".to_owned(), PathBuf::from(format!("{binary}.cdi"))),
                        ("nvidia-legacy".to_owned(), PathBuf::from(format!("{binary}.legacy"))),
                    ]
                } else {
                    Vec::new()
                },
                runtimes,
            })
    }

    fn edit_error_names_the_file(e: &EditError, files: &[&str]) -> Result<(), TestCaseError> {
        let shown = e.to_string();
        let (file, message) = match e {
            EditError::Parse {
                file, line, message, ..
            } => {
                // Columns are 1-based, except serde_json's 0 for an error at a line's end.
                prop_assert!(*line >= 1, "{shown}");
                (file, message)
            }
            EditError::Shape { file, key, message } => {
                prop_assert!(!key.is_empty(), "{shown}");
                (file, message)
            }
        };
        prop_assert!(
            files.contains(&file.as_str()) || file == "containerd config dump",
            "{shown}"
        );
        prop_assert!(!message.is_empty(), "{shown}");
        prop_assert!(shown.starts_with(file.as_str()), "{shown}");
        Ok(())
    }

    // --- containerd ---

    /// A containerd top-level config: version, imports, the CRI plugin with runtimes, other
    /// tables, comments, in a few layouts.
    fn containerd_main() -> impl Strategy<Value = String> {
        (
            prop_oneof![Just(None), Just(Some(2)), Just(Some(3)), Just(Some(1))],
            prop::option::of(prop::collection::vec(
                prop_oneof![
                    Just("/etc/containerd/conf.d/*.toml".to_owned()),
                    Just("/etc/containerd/conf.d/99-nvidia.toml".to_owned()),
                    Just("/etc/containerd/*/*.toml".to_owned()),
                    "/etc/[a-z]{1,6}/[a-z*?]{1,6}\\.toml",
                ],
                0..3,
            )),
            (any::<bool>(), any::<bool>()),
            prop::option::of(prop::sample::select(vec!["runc", "crun", "nvidia", "kata", ""])),
            prop::collection::btree_map(
                prop::sample::select(vec!["runc", "crun", "kata", "nvidia"]),
                (any::<bool>(), prop::option::of("[a-z/]{1,12}")),
                0..3,
            ),
            (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        )
            .prop_map(
                |(version, imports, (multiline, literal), default, runtimes, (comments, other, crlf, inline))| {
                    let cri = match version {
                        Some(3) => "io.containerd.cri.v1.runtime",
                        Some(2) => "io.containerd.grpc.v1.cri",
                        _ => "cri",
                    };
                    let mut out = String::new();
                    if comments {
                        out += "# containerd config, managed by hand\n\n";
                    }
                    if let Some(v) = version {
                        out += &format!("version = {v}\n");
                    }
                    if other {
                        out += "root = \"/var/lib/containerd\"\noom_score = -999\n";
                    }
                    if let Some(imports) = imports {
                        let entries: Vec<String> = imports
                            .iter()
                            .map(|e| if literal { format!("'{e}'") } else { quoted(e) })
                            .collect();
                        if multiline {
                            let lines: String = entries.iter().map(|e| format!("  {e},\n")).collect();
                            out += &format!("imports = [\n{lines}]\n");
                        } else {
                            out += &format!("imports = [{}]\n", entries.join(", "));
                        }
                    }
                    if other {
                        out += "\n[grpc]\n  address = \"/run/containerd/containerd.sock\"\n";
                        out += "\n[plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"/opt/containerd\"\n";
                    }
                    if default.is_some() || !runtimes.is_empty() {
                        out += &format!(
                            "\n[plugins.{}]\n  sandbox_image = \"registry.k8s.io/pause:3.9\"\n",
                            quoted(cri)
                        );
                        if let Some(d) = default {
                            let (cri, d) = (quoted(cri), quoted(d));
                            out += &format!("[plugins.{cri}.containerd]\n  default_runtime_name = {d}\n");
                        }
                        for (name, (systemd, binary)) in &runtimes {
                            let head = format!("plugins.{}.containerd.runtimes.{name}", quoted(cri));
                            out += &format!("[{head}]\n  runtime_type = \"io.containerd.runc.v2\"\n");
                            let binary = binary.as_ref().map(|b| format!("BinaryName = {}", quoted(b)));
                            if inline {
                                let binary = binary.map_or(String::new(), |b| format!(", {b}"));
                                out += &format!("  options = {{ SystemdCgroup = {systemd}{binary} }}\n");
                            } else {
                                out += &format!("[{head}.options]\n  SystemdCgroup = {systemd} # cgroup driver\n");
                                if let Some(b) = binary {
                                    out += &format!("  {b}\n");
                                }
                            }
                        }
                    }
                    if crlf { out.replace('\n', "\r\n") } else { out }
                },
            )
    }

    fn configure(main: Option<&str>, rt: &NvidiaRuntime) -> Result<containerd::ContainerdFiles, EditError> {
        containerd::configure(main, MAIN_FILE, DROP_IN, Some(2), rt)
    }

    fn check_drop_in(files: &containerd::ContainerdFiles, rt: &NvidiaRuntime) -> Result<(), TestCaseError> {
        let doc: toml::Table = files
            .drop_in
            .parse()
            .map_err(|e| TestCaseError::fail(format!("{e}\n{}", files.drop_in)))?;
        let version = doc.get("version").and_then(toml::Value::as_integer);
        prop_assert_eq!(version, (files.version >= 2).then_some(i64::from(files.version)));
        let cri = doc["plugins"][containerd::cri_plugin(files.version)]
            .as_table()
            .unwrap();
        let containerd = cri["containerd"].as_table().unwrap();
        for (name, binary) in rt.all() {
            let options = &containerd["runtimes"][name]["options"];
            prop_assert_eq!(options["BinaryName"].as_str(), binary.to_str(), "{}", files.drop_in);
        }
        if rt.default == DefaultRuntime::Set {
            prop_assert_eq!(containerd["default_runtime_name"].as_str(), Some(rt.name.as_str()));
        }
        if rt.enable_cdi {
            prop_assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(cases(128))]

        #[test]
        fn containerd_configure_is_stable_and_adds_the_runtimes(
            main in prop::option::of(containerd_main()),
            rt in nvidia_runtime(),
        ) {
            let Ok(first) = configure(main.as_deref(), &rt) else {
                // Only a hand-made runtime that is not a table can refuse: the generator has none.
                return Err(TestCaseError::fail(format!("{:?}", configure(main.as_deref(), &rt))));
            };
            check_drop_in(&first, &rt)?;
            let second = configure(Some(&first.main), &rt).unwrap();
            prop_assert_eq!(&second, &first, "configure is not stable");
            // The imports the stage expects are the ones the file gets.
            prop_assert_eq!(
                containerd::imports_after_configure(main.as_deref(), MAIN_FILE, DROP_IN).unwrap(),
                containerd::imports(&first.main, MAIN_FILE).unwrap()
            );
            let rebased = containerd::rebase_imports(&first.main, MAIN_FILE, str::to_owned).unwrap();
            prop_assert_eq!(rebased, first.main.clone());
        }

        #[test]
        fn containerd_unconfigure_gives_the_original_back(main in containerd_main(), rt in nvidia_runtime()) {
            let first = configure(Some(&main), &rt).unwrap();
            if main.parse::<toml::Table>().unwrap().is_empty() {
                // A file with nothing but comments got `version` too, which stays (documented).
                let back = containerd::unconfigure(&first.main, MAIN_FILE, DROP_IN, Some(&main)).unwrap();
                let want = format!("version = {}", first.version);
                prop_assert!(back.starts_with(&main) && back[main.len()..].trim_start().trim_end() == want, "{back:?}");
                return Ok(());
            }
            prop_assert_eq!(
                containerd::unconfigure(&first.main, MAIN_FILE, DROP_IN, Some(&main)).unwrap(),
                main.clone(),
                "configured:\n{}", first.main
            );
            let ours = ["/etc/containerd/conf.d/*.toml", "/etc/containerd/conf.d/99-nvidia.toml"];
            let entries = containerd::imports(&main, MAIN_FILE).unwrap();
            let had_ours = entries.iter().any(|e| ours.contains(&e.as_str()));
            let had_empty_key = entries.is_empty() && main.parse::<toml::Table>().unwrap().contains_key("imports");
            // Without the original, an entry like the agent's is taken for the agent's, and an
            // `imports` left empty goes.
            if !had_ours && !had_empty_key {
                prop_assert_eq!(containerd::unconfigure(&first.main, MAIN_FILE, DROP_IN, None).unwrap(), main);
            }
        }

        #[test]
        fn containerd_never_panics_on_edited_files(
            main in containerd_main(),
            edits in edits(),
            rt in nvidia_runtime(),
        ) {
            let main = apply_edits(&main, &edits);
            match configure(Some(&main), &rt) {
                Ok(first) => {
                    check_drop_in(&first, &rt)?;
                    prop_assert_eq!(&configure(Some(&first.main), &rt).unwrap(), &first, "configure is not stable");
                    let back = containerd::unconfigure(&first.main, MAIN_FILE, DROP_IN, Some(&main)).unwrap();
                    let mut want = main.parse::<toml::Table>().unwrap();
                    if want.is_empty() {
                        want.insert("version".to_owned(), toml::Value::Integer(i64::from(first.version)));
                    }
                    prop_assert_eq!(back.parse::<toml::Table>().unwrap(), want);
                }
                Err(e) => edit_error_names_the_file(&e, &[MAIN_FILE])?,
            }
            let _ = containerd::cri_disabled(&main);
            let _ = containerd::dump_address(&main);
            let _ = containerd::dump_has_runtime(&main, &rt);
        }

        #[test]
        fn containerd_never_panics_on_arbitrary_files(
            main in garbage(),
            imported in garbage(),
            rt in nvidia_runtime(),
        ) {
            let file = "/etc/containerd/conf.d/50-x.toml".to_owned();
            let files = [gpu_node_agent::runtime::engine::ImportedFile { file, text: imported }];
            let input = containerd::Input {
                main: Some(&main),
                main_file: MAIN_FILE,
                drop_in_path: DROP_IN,
                binary_major: None,
                imported: &files,
                effective: None,
                cdi_dir: Some("/var/run/cdi"),
            };
            if let Err(e) = containerd::configure_input(&input, &rt) {
                edit_error_names_the_file(&e, &[MAIN_FILE, "/etc/containerd/conf.d/50-x.toml"])?;
            }
            let dump = containerd::Input { effective: Some(&main), main: None, ..input };
            if let Err(e) = containerd::configure_input(&dump, &rt) {
                edit_error_names_the_file(&e, &[MAIN_FILE])?;
            }
        }
    }

    // --- docker ---

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            ".{0,10}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map(".{0,6}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A daemon.json: the keys docker users set, other runtimes, and arbitrary others, with its
    /// text pretty-printed (indent 2, 4 or a tab) or on one line.
    fn daemon_json() -> impl Strategy<Value = (String, bool)> {
        (
            prop::collection::vec(
                prop_oneof![
                    Just(("log-driver".to_owned(), serde_json::json!("json-file"))),
                    Just((
                        "exec-opts".to_owned(),
                        serde_json::json!(["native.cgroupdriver=systemd"])
                    )),
                    prop::sample::select(vec!["runc", "nvidia", "runsc", ""])
                        .prop_map(|d| ("default-runtime".to_owned(), serde_json::json!(d))),
                    prop::collection::btree_map(
                        prop::sample::select(vec!["runsc", "kata", "crun"]),
                        "/[a-z/]{1,10}",
                        0..3
                    )
                    .prop_map(|m| {
                        let m: serde_json::Map<String, serde_json::Value> = m
                            .into_iter()
                            .map(|(k, p)| (k.to_owned(), serde_json::json!({ "path": p })))
                            .collect();
                        ("runtimes".to_owned(), serde_json::Value::Object(m))
                    }),
                    any::<bool>().prop_map(|b| ("features".to_owned(), serde_json::json!({ "buildkit": b }))),
                    ("[a-z-]{1,8}", json_value())
                        .prop_filter("keys the edit needs as objects", |(k, _)| k != "runtimes"
                            && k != "features"),
                ],
                0..6,
            ),
            prop::sample::select(vec!["  ", "    ", "\t", ""]),
        )
            .prop_map(|(entries, indent)| {
                // Keys once each, in generated order (serde_json's Map would sort them).
                let mut seen = std::collections::BTreeSet::new();
                let entries: Vec<_> = entries.into_iter().filter(|(k, _)| seen.insert(k.clone())).collect();
                if indent.is_empty() {
                    let body: Vec<String> = entries
                        .iter()
                        .map(|(k, v)| format!("{}:{}", serde_json::json!(k), v))
                        .collect();
                    return (format!("{{{}}}", body.join(",")), false);
                }
                let mut out = Vec::new();
                let formatter = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
                let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
                use serde::Serializer;
                use serde::ser::SerializeMap;
                let mut map = (&mut ser).serialize_map(Some(entries.len())).unwrap();
                for (k, v) in &entries {
                    map.serialize_entry(k, v).unwrap();
                }
                map.end().unwrap();
                out.push(b'\n');
                (String::from_utf8(out).unwrap(), !entries.is_empty())
            })
    }

    fn json(text: &str) -> serde_json::Value {
        serde_json::from_str(text).unwrap()
    }

    proptest! {
        #![proptest_config(cases(256))]

        #[test]
        fn docker_configure_is_stable_and_unconfigure_gives_the_original_back(
            (text, pretty) in daemon_json(),
            rt in nvidia_runtime(),
        ) {
            let first = docker::configure(Some(&text), "/etc/docker/daemon.json", &rt).unwrap();
            let config = json(&first);
            for (name, binary) in rt.all() {
                prop_assert_eq!(config["runtimes"][name]["path"].as_str(), binary.to_str());
            }
            if rt.default == DefaultRuntime::Set {
                prop_assert_eq!(config["default-runtime"].as_str(), Some("nvidia"));
            }
            if rt.enable_cdi {
                prop_assert_eq!(config["features"]["cdi"].as_bool(), Some(true));
            }
            let again = docker::configure(Some(&first), "/etc/docker/daemon.json", &rt).unwrap();
            prop_assert_eq!(&again, &first, "not stable");

            let names: Vec<&str> = rt.names().collect();
            let back = docker::unconfigure(&first, "/etc/docker/daemon.json", &names, Some(&text)).unwrap();
            let mut want = json(&text);
            let had_nvidia = want.get("runtimes").is_some_and(|r| r.get("nvidia").is_some());
            // With the default not to be the agent's runtime, a default naming it went back to
            // runc, and unconfigure does not bring it back (it only removes what is the agent's).
            let reset_default = rt.default == DefaultRuntime::Unset && want["default-runtime"] == "nvidia";
            if reset_default {
                want["default-runtime"] = serde_json::json!("runc");
            }
            if had_nvidia {
                // A runtime the file had stays, with the agent's binary.
                want["runtimes"]["nvidia"]["path"] = serde_json::json!(rt.binary.to_str().unwrap());
            }
            if rt.enable_cdi {
                // features.cdi stays: other devices' CDI specs may rely on it.
                want["features"]["cdi"] = serde_json::json!(true);
            }
            prop_assert_eq!(json(&back), want, "configured:\n{}\nback:\n{}", first, back);
            if pretty && !rt.enable_cdi && !had_nvidia && !reset_default {
                prop_assert_eq!(back, text, "not byte-identical");
            }
        }

        #[test]
        fn docker_never_panics(text in prop_oneof![
            garbage(),
            (daemon_json(), edits()).prop_map(|((text, _), edits)| apply_edits(&text, &edits)),
        ], rt in nvidia_runtime()) {
            match docker::configure(Some(&text), "/etc/docker/daemon.json", &rt) {
                Ok(first) => {
                    prop_assert_eq!(&docker::configure(Some(&first), "/etc/docker/daemon.json", &rt).unwrap(), &first);
                }
                Err(e) => edit_error_names_the_file(&e, &["/etc/docker/daemon.json"])?,
            }
            if let Err(e) = docker::unconfigure(&text, "/etc/docker/daemon.json", &["nvidia"], Some(&text)) {
                edit_error_names_the_file(&e, &["/etc/docker/daemon.json"])?;
            }
        }
    }

    // --- CRI-O ---

    fn crio_conf() -> impl Strategy<Value = String> {
        (
            prop::option::of(prop::sample::select(vec!["crun", "runc", "nvidia", "kata", ""])),
            prop::collection::btree_map(
                prop::sample::select(vec!["crun", "runc", "kata", "nvidia"]),
                (
                    prop::sample::select(vec!["oci", "vm", "pod", ""]),
                    prop::option::of("/[a-z/]{1,12}"),
                ),
                0..4,
            ),
            any::<bool>(),
        )
            .prop_map(|(default, runtimes, annotations)| {
                let mut out = String::from("# crio.conf\n[crio]\nroot = \"/var/lib/containers/storage\"\n");
                out += "\n[crio.runtime]\n";
                if let Some(d) = default {
                    out += &format!("default_runtime = {}\n", quoted(d));
                }
                out += "cgroup_manager = \"systemd\"\n";
                for (name, (kind, monitor)) in &runtimes {
                    let monitor = monitor
                        .as_ref()
                        .map_or(String::new(), |m| format!("monitor_path = {}\n", quoted(m)));
                    let kind = quoted(kind);
                    out += &format!("\n[crio.runtime.runtimes.{name}]\nruntime_path = \"/usr/bin/{name}\"\n");
                    out += &format!("runtime_type = {kind}\n{monitor}");
                    if annotations {
                        out += "allowed_annotations = [\n  \"io.kubernetes.cri-o.Devices\",\n]\n";
                    }
                }
                out
            })
    }

    proptest! {
        #![proptest_config(cases(256))]

        #[test]
        fn crio_drop_ins_hold_the_runtimes_and_are_stable(
            main in prop::option::of(crio_conf()),
            drop_in in prop::option::of(crio_conf()),
            rt in nvidia_runtime(),
        ) {
            // Under cdi-only the stage removes CRI-O's drop-in instead of editing it.
            let rt = NvidiaRuntime { runtimes: true, ..rt };
            let others: Vec<(String, String)> =
                drop_in.into_iter().map(|t| ("/etc/crio/crio.conf.d/10-crun.conf".to_owned(), t)).collect();
            let out = crio::configure_with_drop_ins(main.as_deref(), "/etc/crio/crio.conf", &others, &rt).unwrap();
            let doc: toml::Table = out.parse().map_err(|e| TestCaseError::fail(format!("{e}\n{out}")))?;
            for (name, binary) in rt.all() {
                let runtime = &doc["crio"]["runtime"]["runtimes"][name];
                prop_assert_eq!(runtime["runtime_path"].as_str(), binary.to_str());
                prop_assert!(matches!(runtime["runtime_type"].as_str(), Some("oci" | "pod")));
            }
            if rt.default == DefaultRuntime::Set {
                prop_assert_eq!(doc["crio"]["runtime"]["default_runtime"].as_str(), Some("nvidia"));
            }
            // The runtime copies the table of the default runtime (the last file's), else runc's,
            // else crun's, each the last file's that declares it.
            let docs: Vec<toml::Table> =
                main.iter().chain(others.iter().map(|(_, t)| t)).map(|t| t.parse().unwrap()).collect();
            let runtime_of = |doc: &toml::Table| doc.get("crio").and_then(|c| c.get("runtime")).cloned();
            let default = docs
                .iter()
                .filter_map(|d| runtime_of(d)?.get("default_runtime")?.as_str().map(str::to_owned))
                .next_back();
            let candidates = default
                .into_iter()
                .filter(|d| !d.is_empty() && !d.starts_with("nvidia"))
                .chain(["runc".to_owned(), "crun".to_owned()]);
            let declared = |name: &str| {
                docs.iter().filter_map(|d| runtime_of(d)?.get("runtimes")?.get(name).cloned()).next_back()
            };
            let template = candidates.filter_map(|c| declared(&c)).next();
            let nvidia = &doc["crio"]["runtime"]["runtimes"]["nvidia"];
            let want = template.as_ref().and_then(|t| t.get("monitor_path"));
            prop_assert_eq!(nvidia.get("monitor_path"), want, "{}", out);
            let pod = template.as_ref().and_then(|t| t.get("runtime_type")).and_then(|t| t.as_str()) == Some("pod");
            prop_assert_eq!(nvidia["runtime_type"].as_str(), Some(if pod { "pod" } else { "oci" }));
            let again = crio::configure_with_drop_ins(main.as_deref(), "/etc/crio/crio.conf", &others, &rt).unwrap();
            prop_assert_eq!(again, out);
        }

        #[test]
        fn crio_never_panics(text in prop_oneof![
            garbage(),
            (crio_conf(), edits()).prop_map(|(text, edits)| apply_edits(&text, &edits)),
        ], rt in nvidia_runtime()) {
            if let Err(e) = crio::configure(Some(&text), "/etc/crio/crio.conf", &rt) {
                edit_error_names_the_file(&e, &["/etc/crio/crio.conf"])?;
            }
        }
    }

    // --- the toolkit's config ---

    /// A toolkit config, and whether it sets one of the agent's keys itself.
    fn toolkit_conf() -> impl Strategy<Value = (String, bool)> {
        (
            prop::option::of(any::<bool>()),
            prop::option::of(any::<bool>()),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(volume_mounts, envvar, comments, tables, crlf)| {
                let mut out = String::new();
                if comments {
                    out += "#accept-nvidia-visible-devices-as-volume-mounts = false\n";
                }
                out += "disable-require = false\n";
                if let Some(v) = volume_mounts {
                    out += &format!("{} = {v}\n", toolkit::AS_VOLUME_MOUNTS);
                }
                if let Some(v) = envvar {
                    out += &format!("{} = {v} # the default\n", toolkit::ENVVAR_WHEN_UNPRIVILEGED);
                }
                if tables {
                    out += "\n[nvidia-container-cli]\nenvironment = []\nldconfig = \"@/sbin/ldconfig.real\"\n";
                    out += "\n[nvidia-container-runtime]\nmode = \"auto\"\n";
                }
                let out = if crlf { out.replace('\n', "\r\n") } else { out };
                (out, volume_mounts.is_some() || envvar.is_some())
            })
    }

    proptest! {
        #![proptest_config(cases(256))]

        #[test]
        fn toolkit_configure_is_stable_and_unconfigure_gives_the_original_back((text, had_keys) in toolkit_conf()) {
            let file = "/etc/nvidia-container-runtime/config.toml";
            let first = toolkit::configure(Some(&text), file).unwrap();
            let doc: toml::Table = first.parse().unwrap();
            prop_assert_eq!(doc[toolkit::AS_VOLUME_MOUNTS].as_bool(), Some(true));
            prop_assert_eq!(doc[toolkit::ENVVAR_WHEN_UNPRIVILEGED].as_bool(), Some(false));
            prop_assert_eq!(&toolkit::configure(Some(&first), file).unwrap(), &first);
            let back = toolkit::unconfigure(&first, file, Some(&text)).unwrap();
            prop_assert_eq!(back.parse::<toml::Table>().unwrap(), text.parse::<toml::Table>().unwrap());
            if !had_keys {
                prop_assert_eq!(back, text, "not byte-identical");
            }
        }

        #[test]
        fn toolkit_never_panics(text in prop_oneof![
            garbage(),
            (toolkit_conf(), edits()).prop_map(|((text, _), edits)| apply_edits(&text, &edits)),
        ]) {
            let file = "/etc/nvidia-container-runtime/config.toml";
            match toolkit::configure(Some(&text), file) {
                Ok(first) => prop_assert_eq!(&toolkit::configure(Some(&first), file).unwrap(), &first),
                Err(e) => edit_error_names_the_file(&e, &[file])?,
            }
            if let Err(e) = toolkit::unconfigure(&text, file, Some(&text)) {
                edit_error_names_the_file(&e, &[file])?;
            }
        }
    }

    // --- the kubelet's CRI endpoint, the CRI status, ctr's plugin list ---

    fn word() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_./:=-]{1,16}".prop_filter("not a quote", |w| !w.starts_with(['"', '\'']))
    }

    proptest! {
        #![proptest_config(cases(512))]

        #[test]
        fn kubelet_flags_are_found_in_either_spelling(
            before in prop::collection::vec(word(), 0..4),
            after in prop::collection::vec(word(), 0..4),
            value in "unix:///[a-z/]{1,20}\\.sock",
            equals in any::<bool>(),
        ) {
            let mut args = before.clone();
            if equals {
                args.push(format!("--container-runtime-endpoint={value}"));
            } else {
                args.push("--container-runtime-endpoint".to_owned());
                args.push(value.clone());
            }
            args.extend(after.iter().cloned());
            prop_assert_eq!(kubelet::flag(&args, "--container-runtime-endpoint"), Some(value.clone()));
            // The same words in an environment file.
            let env = format!("# kubeadm\nKUBELET_KUBEADM_ARGS=\"{}\"\n", args.join(" "));
            let from_env = kubelet::flag(&kubelet::env_args(&env), "--container-runtime-endpoint");
            prop_assert_eq!(from_env, Some(value.clone()));
            // And in a KubeletConfiguration.
            let yaml = format!(
                "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
                 containerRuntimeEndpoint: {value}\n"
            );
            prop_assert_eq!(kubelet::config_endpoint(&yaml), Some(value));
        }

        #[test]
        fn kubelet_readers_never_panic(text in garbage(), args in prop::collection::vec(garbage(), 0..6)) {
            let _ = kubelet::env_args(&text);
            let _ = kubelet::config_endpoint(&text);
            let _ = kubelet::engine_of(&text);
            let _ = kubelet::flag(&args, "--config");
            let _ = cri::ctr_cri_errors(&text);
            let _ = cri::handlers_of_config(&text);
        }

        #[test]
        fn cri_handlers_are_read_from_the_status_config(
            handlers in prop::collection::btree_set(".{0,10}", 0..5),
            default in prop::option::of(".{0,10}"),
            extra in json_value(),
        ) {
            let runc = serde_json::json!({ "runtimeType": "io.containerd.runc.v2" });
            let runtimes: serde_json::Map<String, serde_json::Value> =
                handlers.iter().map(|h| (h.clone(), runc.clone())).collect();
            let mut containerd = serde_json::json!({ "runtimes": runtimes, "other": extra });
            if let Some(d) = &default {
                containerd["defaultRuntimeName"] = serde_json::json!(d);
            }
            let text = serde_json::json!({ "containerd": containerd, "enableCDI": true }).to_string();
            prop_assert_eq!(cri::handlers_of_config(&text), (handlers, default));
        }
    }
}

// === /proc and /sys readers ===

mod host_readers {
    use super::*;
    use gpu_node_agent::devices::parse_sysfs_hex;
    use gpu_node_agent::devices::{REPLICA_SEPARATOR, split_replica_id};
    use gpu_node_agent::driver::Flavour;
    use gpu_node_agent::driver::observe::{
        OsRelease, SecureBoot, parse_os_release, parse_proc_version, parse_secure_boot_var,
    };
    use gpu_node_agent::edits::nodes::parse_mig_minors;
    use gpu_node_agent::plugin::memlimit::{
        PodName, Qos, parse_container_log_name, parse_pod_log_dir, parse_stat, pod_of_cgroup,
    };

    /// An os-release value written the way shells quote it: double quotes with escapes, single
    /// quotes, or a bare word with backslashes.
    fn shell_quote(value: &str, style: u8) -> String {
        match style % 3 {
            0 => {
                let escaped: String = value
                    .chars()
                    .flat_map(|c| match c {
                        '"' | '\\' | '$' | '`' => vec!['\\', c],
                        c => vec![c],
                    })
                    .collect();
                format!("\"{escaped}\"")
            }
            1 if !value.contains('\'') => format!("'{value}'"),
            _ => value
                .chars()
                .flat_map(|c| {
                    if c.is_alphanumeric() || "._-".contains(c) {
                        vec![c]
                    } else {
                        vec!['\\', c]
                    }
                })
                .collect(),
        }
    }

    /// A value os-release can hold on one line (no line break of any kind `str::lines` knows).
    fn os_value() -> impl Strategy<Value = String> {
        prop_oneof!["[A-Za-z0-9 ._()\"'$`\\\\-]{0,20}", "[^\n\r]{0,20}"]
    }

    fn os_release() -> impl Strategy<Value = OsRelease> {
        (
            "[a-z0-9._-]{0,10}",
            prop::collection::vec("[a-z0-9._-]{1,8}", 0..3),
            os_value(),
            "[a-z0-9]{0,8}",
            os_value(),
        )
            .prop_map(|(id, id_like, version_id, version_codename, pretty_name)| OsRelease {
                id,
                id_like,
                version_id,
                version_codename,
                pretty_name,
            })
    }

    proptest! {
        #![proptest_config(cases(512))]

        #[test]
        fn os_release_round_trips(
            os in os_release(),
            styles in prop::collection::vec(any::<u8>(), 5),
            noise in any::<bool>(),
        ) {
            let mut text = String::new();
            if noise {
                text += "# /etc/os-release\nNAME=\"Some Linux\"\n\nHOME_URL=\"https://example.com/\"\n";
            }
            text += &format!("ID={}\n", shell_quote(&os.id, styles[0]));
            text += &format!("ID_LIKE={}\n", shell_quote(&os.id_like.join(" "), styles[1]));
            text += &format!("VERSION_ID={}\n", shell_quote(&os.version_id, styles[2]));
            text += &format!("export VERSION_CODENAME={}\n", shell_quote(&os.version_codename, styles[3]));
            text += &format!("PRETTY_NAME={} # trailing comment\n", shell_quote(&os.pretty_name, styles[4]));
            prop_assert_eq!(parse_os_release(&text), os, "{}", text);
        }

        #[test]
        fn host_readers_never_panic(text in garbage(), bytes in prop::collection::vec(any::<u8>(), 0..12)) {
            let _ = parse_os_release(&text).distro();
            let _ = parse_proc_version(&text);
            let _ = parse_sysfs_hex(&text);
            let _ = pod_of_cgroup(&text);
            let _ = parse_stat(&text);
            let _ = parse_container_log_name(&text, "0123456789abcdef");
            let _ = parse_pod_log_dir(&text, "1234-abcd");
            let _ = split_replica_id(&text);
            let secure = parse_secure_boot_var(&bytes);
            let want = match bytes.get(4) {
                Some(1) => SecureBoot::Enabled,
                Some(0) => SecureBoot::Disabled,
                _ => SecureBoot::Unknown,
            };
            prop_assert_eq!(secure, want);
            if let Err(e) = parse_mig_minors(&text) {
                prop_assert!(e.to_string().starts_with("mig-minors line "), "{e}");
            }
        }

        #[test]
        fn proc_driver_versions_are_read(
            open in any::<bool>(),
            version in "[1-9][0-9]{2}\\.[0-9]{1,3}(\\.[0-9]{2})?",
            arch in prop::sample::select(vec!["x86_64", "aarch64"]),
            before in "[^\n]{0,30}",
        ) {
            let line = if open {
                format!(
                    "NVRM version: NVIDIA UNIX Open Kernel Module for {arch}  {version}  Release Build  \
                     (dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 21:13:18 UTC 2024"
                )
            } else {
                format!("NVRM version: NVIDIA UNIX {arch} Kernel Module  {version}  Tue Mar  5 21:13:18 UTC 2024")
            };
            let before = before.replace("Kernel Module", "");
            let text = format!("{before}\n{line}\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n");
            let flavour = if open { Flavour::Open } else { Flavour::Proprietary };
            prop_assert_eq!(parse_proc_version(&text), Some((flavour, version)));
        }

        #[test]
        fn sysfs_hex_round_trips(v in any::<u32>(), upper in any::<bool>(), newline in any::<bool>()) {
            let text = if upper { format!("0x{v:04X}") } else { format!("0x{v:04x}") };
            let text = text + if newline { "\n" } else { "" };
            prop_assert_eq!(parse_sysfs_hex(&text), Some(v));
        }

        #[test]
        fn mig_minors_round_trip(
            minors in prop::collection::btree_map("[a-z0-9/]{1,20}", any::<u32>(), 0..10),
            blank in prop::collection::vec(any::<bool>(), 10),
            sep in prop::sample::select(vec![" ", "\t", "  "]),
        ) {
            let mut text = String::new();
            for (i, (name, minor)) in minors.iter().enumerate() {
                if blank[i % blank.len()] {
                    text += "\n";
                }
                text += &format!("{name}{sep}{minor}\n");
            }
            prop_assert_eq!(parse_mig_minors(&text), Ok(minors));
        }

        #[test]
        fn mig_minors_errors_name_their_line(
            good in prop::collection::vec(("[a-z0-9/]{1,10}", any::<u32>()), 0..6),
            bad in prop_oneof![
                "[a-z]{1,5}",
                "[a-z]{1,5} [a-z]{1,3}",
                "[a-z]{1,5} 1 2",
                "[a-z]{1,5} -1",
                "[a-z]{1,5} 4294967296",
            ],
        ) {
            let mut text: String = good.iter().map(|(n, m)| format!("{n} {m}\n")).collect();
            text += &bad;
            text += "\nconfig 1\n";
            let e = parse_mig_minors(&text).expect_err("bad line accepted");
            prop_assert!(e.to_string().starts_with(&format!("mig-minors line {}: ", good.len() + 1)), "{e}");
        }

        #[test]
        fn proc_stat_fields_are_counted_from_the_last_parenthesis(
            pid in any::<u32>(),
            comm in "[^\u{0}]{0,16}",
            state in prop::sample::select(vec!['R', 'S', 'D', 'Z', 'T', 'X', 'I']),
            start in any::<u64>(),
            fields in prop::collection::vec(any::<i64>(), 18),
        ) {
            let middle: Vec<String> = fields.iter().map(i64::to_string).collect();
            let text = format!("{pid} ({comm}) {state} {} {start} 0 0 18446744073709551615 0\n", middle.join(" "));
            prop_assert_eq!(parse_stat(&text), Some((state, start)), "{}", text);
        }

        #[test]
        fn cgroups_name_their_pod(
            uid in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            container in prop::option::of("[0-9a-f]{64}"),
            qos in prop_oneof![Just(Qos::Guaranteed), Just(Qos::Burstable), Just(Qos::BestEffort)],
            systemd in any::<bool>(),
            runtime in prop::sample::select(vec!["cri-containerd-", "docker-", "crio-", ""]),
            v1 in any::<bool>(),
            nested in prop::option::of("[a-z]{1,8}(\\.slice)?".prop_filter("not a kubepods node", |n| n != "kubepods")),
        ) {
            let mut path = nested.map(|n| format!("/{n}")).unwrap_or_default();
            if systemd {
                let (level, prefix) = match qos {
                    Qos::Guaranteed => ("", "kubepods".to_owned()),
                    Qos::Burstable => ("/kubepods-burstable.slice", "kubepods-burstable".to_owned()),
                    Qos::BestEffort => ("/kubepods-besteffort.slice", "kubepods-besteffort".to_owned()),
                };
                path += &format!("/kubepods.slice{level}/{prefix}-pod{}.slice", uid.replace('-', "_"));
                if let Some(id) = &container {
                    let runtime = if runtime.is_empty() { "cri-containerd-" } else { runtime };
                    path += &format!("/{runtime}{id}.scope");
                }
            } else {
                let level = match qos {
                    Qos::Guaranteed => "",
                    Qos::Burstable => "/burstable",
                    Qos::BestEffort => "/besteffort",
                };
                path += &format!("/kubepods{level}/pod{uid}");
                if let Some(id) = &container {
                    path += &format!("/{runtime}{id}");
                }
            }
            let text = if v1 {
                format!("12:pids:/user.slice\n11:memory:{path}\n0::/\n")
            } else {
                format!("0::{path}\n")
            };
            let pod = pod_of_cgroup(&text).ok_or_else(|| TestCaseError::fail(format!("no pod in {text}")))?;
            prop_assert_eq!(pod.pod_uid, uid);
            prop_assert_eq!(pod.container_id, container);
            prop_assert_eq!(pod.qos, qos);
        }

        #[test]
        fn kubelet_log_names_round_trip(
            pod in "[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?",
            namespace in dns_label(),
            container in dns_label(),
            id in "[0-9a-f]{64}",
            uid in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        ) {
            let file = format!("{pod}_{namespace}_{container}-{id}.log");
            let want = PodName { namespace: namespace.clone(), pod: pod.clone(), container: Some(container) };
            prop_assert_eq!(parse_container_log_name(&file, &id), Some(want));
            prop_assert_eq!(parse_container_log_name(&file, &id[1..]), None);
            let dir = format!("{namespace}_{pod}_{uid}");
            prop_assert_eq!(parse_pod_log_dir(&dir, &uid), Some(PodName { namespace, pod, container: None }));
        }

        #[test]
        fn replica_ids_round_trip(uuid in "(GPU|MIG)-[0-9a-f-]{1,36}", n in any::<u32>()) {
            let id = format!("{uuid}{REPLICA_SEPARATOR}{n}");
            let want = n.to_string();
            prop_assert_eq!(split_replica_id(&id), Some((uuid.as_str(), want.as_str())));
            prop_assert_eq!(split_replica_id(&uuid), None);
        }
    }
}

// === status.json ===

mod status {
    use super::*;
    use gpu_node_agent::desired::{ProfileOutcome, ProfileState, Selection, Source};
    use gpu_node_agent::plugin::manager::ResourceStatus;
    use gpu_node_agent::status::{DesiredStatus, GpuStatus, MigStatus, StageState, StageStatus, Status, report};

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![3 => "[a-z0-9 .:/-]{0,12}", 1 => any::<String>().prop_map(|s| s.chars().take(16).collect())]
    }

    fn selection() -> impl Strategy<Value = Selection> {
        prop_oneof![
            Just(Selection::Unset),
            text().prop_map(|name| Selection::Name { name }),
            (text(), text()).prop_map(|(value, reason)| Selection::Invalid { value, reason }),
        ]
    }

    fn desired() -> impl Strategy<Value = DesiredStatus> {
        (
            prop_oneof![Just(Source::Node), Just(Source::File), Just(Source::None)],
            text(),
            any::<bool>(),
            prop::option::of(text()),
            selection(),
            selection(),
            (
                prop::option::of(text()),
                prop_oneof![
                    Just(ProfileState::None),
                    Just(ProfileState::Success),
                    Just(ProfileState::Failed)
                ],
                prop::option::of(text()),
            ),
        )
            .prop_map(
                |(source, detail, connected, error, mig_config, device_plugin_config, (applied, state, reason))| {
                    DesiredStatus {
                        source,
                        detail,
                        connected,
                        error,
                        mig_config,
                        device_plugin_config,
                        profile: ProfileOutcome { applied, state, reason },
                    }
                },
            )
    }

    fn stage() -> impl Strategy<Value = StageStatus> {
        (
            prop::sample::select(vec!["driver", "runtime", "mig", "device-plugin", "validation"]),
            prop_oneof![
                Just(StageState::Pending),
                Just(StageState::Ok),
                Just(StageState::Failed),
                Just(StageState::Disabled),
                Just(StageState::Skipped),
            ],
            any::<u64>(),
            prop::option::of(text()),
            prop::option::of(text()),
        )
            .prop_map(|(name, state, since, error, detail)| StageStatus {
                name: name.to_owned(),
                state,
                since,
                error,
                detail,
            })
    }

    fn gpu() -> impl Strategy<Value = GpuStatus> {
        (
            any::<u32>(),
            text(),
            text(),
            any::<u64>(),
            text(),
            prop::option::of(text()),
            prop::option::of(any::<bool>()),
            prop::collection::vec(
                (text(), text(), any::<u32>(), any::<u32>(), prop::option::of(text())).prop_map(
                    |(uuid, profile, gi_id, ci_id, reason)| MigStatus {
                        uuid,
                        profile,
                        gi_id,
                        ci_id,
                        health: "Healthy".to_owned(),
                        reason,
                    },
                ),
                0..3,
            ),
        )
            .prop_map(
                |(index, uuid, name, memory_mib, pci_bus_id, reason, mig_enabled, mig_devices)| GpuStatus {
                    index,
                    uuid,
                    name,
                    memory_mib,
                    pci_bus_id,
                    health: "Healthy".to_owned(),
                    reason,
                    mig_enabled,
                    mig_devices,
                },
            )
    }

    fn resource() -> impl Strategy<Value = ResourceStatus> {
        (
            text(),
            any::<bool>(),
            prop::option::of(any::<u64>()),
            (any::<usize>(), any::<usize>(), any::<usize>()),
            prop::option::of(text()),
            prop::option::of(any::<usize>()),
        )
            .prop_map(
                |(name, registered, registered_at, (devices, healthy, streams_open), error, devices_sent)| {
                    ResourceStatus {
                        socket: format!("/var/lib/kubelet/device-plugins/{name}.sock"),
                        name,
                        registered,
                        registered_at,
                        devices,
                        healthy,
                        error,
                        streams_open,
                        devices_sent,
                    }
                },
            )
    }

    fn status() -> impl Strategy<Value = Status> {
        (
            (any::<u32>(), text(), text(), any::<u32>()),
            prop::sample::select(vec!["running", "stopped", "once"]),
            any::<u64>(),
            (prop::option::of(text()), prop::option::of(text())),
            prop::collection::vec(stage(), 0..5),
            prop::collection::vec(gpu(), 0..3),
            any::<bool>(),
            prop::collection::vec(resource(), 0..3),
            prop::option::of(desired()),
            prop::collection::btree_map(text(), text(), 0..4),
        )
            .prop_map(
                |(
                    (version, agent_version, node, pid),
                    state,
                    updated,
                    (driver_version, cuda_driver_version),
                    stages,
                    gpus,
                    kubelet_present,
                    resources,
                    desired,
                    labels,
                )| {
                    Status {
                        version,
                        agent_version,
                        node,
                        pid,
                        state: state.to_owned(),
                        updated,
                        driver_version,
                        cuda_driver_version,
                        stages,
                        gpus,
                        kubelet_present,
                        resources,
                        desired,
                        labels,
                        mps: Vec::new(),
                        dra: None,
                        dev_char: None,
                        operator: None,
                    }
                },
            )
    }

    fn to_json(status: &Status, pretty: bool) -> String {
        if pretty {
            serde_json::to_string_pretty(status)
        } else {
            serde_json::to_string(status)
        }
        .unwrap()
    }

    /// A `/proc` in which no process runs.
    fn empty_proc() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    proptest! {
        #![proptest_config(cases(256))]

        #[test]
        fn status_files_round_trip(status in status(), pretty in any::<bool>()) {
            let text = to_json(&status, pretty);
            prop_assert_eq!(Status::parse(&text).unwrap(), status);
        }

        #[test]
        fn status_reports_never_panic(status in status(), now in any::<u64>()) {
            let proc = empty_proc();
            let mut text = serde_json::to_vec_pretty(&status).unwrap();
            text.push(b'\n');
            let text = String::from_utf8(text).unwrap();
            let human = report(&text, proc.path(), false, now).unwrap();
            prop_assert!(human.starts_with("gpu-node-agent "), "{human}");
            if status.state != "running" {
                prop_assert_eq!(human, status.render(now));
            }
        }

        #[test]
        fn status_json_reports_add_their_fields(status in status(), pretty in any::<bool>()) {
            let proc = empty_proc();
            let text = to_json(&status, pretty);
            let out = report(&text, proc.path(), true, 0).unwrap();
            let value: serde_json::Value =
                serde_json::from_str(&out).map_err(|e| TestCaseError::fail(format!("{e}\n{out}")))?;
            prop_assert_eq!(value["agent_running"].as_bool(), Some(false));
            prop_assert_eq!(value["stale_reason"].is_string(), status.state == "running");
            // The file's own fields are all there, unchanged.
            let mut without: serde_json::Value = value.clone();
            let object = without.as_object_mut().unwrap();
            object.remove("agent_running");
            object.remove("stale_reason");
            prop_assert_eq!(without, serde_json::to_value(&status).unwrap());
        }

        #[test]
        fn status_parse_never_panics(text in prop_oneof![
            garbage(),
            (status(), edits()).prop_map(|(s, e)| apply_edits(&serde_json::to_string_pretty(&s).unwrap(), &e)),
        ]) {
            let proc = empty_proc();
            if let Err(e) = Status::parse(&text) {
                prop_assert!(!e.to_string().is_empty());
            }
            let _ = report(&text, proc.path(), false, 0);
            let _ = report(&text, proc.path(), true, 0);
        }
    }
}
