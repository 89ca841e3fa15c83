//! The configuration read, merged and validated end to end: defaults, the example file, files
//! and drop-ins, and every error naming its file, line and key.

use super::*;

const EXAMPLE: &str = include_str!("../../config/gpu-node-agent.toml");

fn parse(files: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let sources: Vec<Source> = files.iter().map(|(n, t)| Source::new(*n, *t)).collect();
    Config::from_sources(&sources)
}

fn err(files: &[(&str, &str)]) -> String {
    parse(files).expect_err("config accepted").to_string()
}

#[test]
fn defaults() {
    let config = parse(&[]).unwrap();
    assert_eq!(config, Config::default());
    assert_eq!(parse(&[("c.toml", "")]).unwrap(), Config::default());
    assert_eq!(config.log.level, "info");
    assert_eq!(config.agent.resync_interval, Duration::from_secs(60));
    assert_eq!(config.nvml.library, Path::new("libnvidia-ml.so.1"));
    assert_eq!(
        config.device_plugin.device_list_strategy.as_slice(),
        &[DeviceListStrategy::Auto]
    );
    assert_eq!(config.runtime.mode, RuntimeMode::Auto);
    assert_eq!(config.health.ignored_xids, [13, 31, 43, 45, 68, 109]);
    assert_eq!(config.health.recovery_after, Duration::from_secs(300));
    assert!(config.driver.create_device_nodes);
    let off = parse(&[("c.toml", "[driver]\ncreate_device_nodes = false\n")]).unwrap();
    assert!(!off.driver.create_device_nodes);
    assert!(!config.driver.require_modeset);
    let on = parse(&[("c.toml", "[driver]\nrequire_modeset = true\n")]).unwrap();
    assert!(on.driver.require_modeset);
}

/// `auto` follows the NVIDIA Container Toolkit: its runtime means today's envvar over the
/// `nvidia` runtime; without it, CDI only, unless the config asks for what only the runtime does.
#[test]
fn auto_is_decided_by_the_toolkit_runtime() {
    use DeviceListStrategy::*;
    let decide = |text: &str, toolkit: bool| {
        let mut config = parse(&[("c.toml", text)]).unwrap();
        let said = config.resolve_auto(toolkit);
        let profiles: Vec<Vec<DeviceListStrategy>> = config
            .device_plugin
            .profiles
            .values()
            .filter_map(|p| p.device_list_strategy.as_ref().map(|s| s.as_slice().to_vec()))
            .collect();
        (
            config.runtime.mode,
            config.device_plugin.device_list_strategy.as_slice().to_vec(),
            profiles,
            said.unwrap_or_default(),
        )
    };
    let (mode, strategy, _, said) = decide("", true);
    assert_eq!((mode, strategy), (RuntimeMode::Runtime, vec![Envvar]));
    assert_eq!(
        said,
        "runtime.mode auto: runtime (/usr/bin/nvidia-container-runtime is installed); device_list_strategy auto: envvar"
    );
    let (mode, strategy, _, said) = decide("", false);
    assert_eq!((mode, strategy), (RuntimeMode::CdiOnly, vec![CdiCri]));
    assert!(
        said.contains("cdi-only (/usr/bin/nvidia-container-runtime is not installed)"),
        "{said}"
    );
    // A profile's auto follows too; a profile that needs the hook keeps the runtime mode, so the
    // runtime stage names what is missing.
    let profile = "[device_plugin.profiles.a]\ndevice_list_strategy = \"auto\"\n";
    let (mode, _, profiles, _) = decide(profile, false);
    assert_eq!((mode, profiles), (RuntimeMode::CdiOnly, vec![vec![CdiCri]]));
    let hook = "[device_plugin.profiles.a]\ndevice_list_strategy = \"volume-mounts\"\n";
    let (mode, strategy, _, said) = decide(hook, false);
    assert_eq!((mode, strategy), (RuntimeMode::Runtime, vec![Envvar]));
    assert!(said.contains("device_list_strategy volume-mounts needs it"), "{said}");
    let (mode, strategy, _, said) = decide("[runtime]\nenabled = false\n", false);
    assert_eq!((mode, strategy), (RuntimeMode::Runtime, vec![Envvar]));
    assert!(said.contains("configured by other means"), "{said}");
    let (mode, _, _, said) = decide("[cdi]\nenabled = false\n", false);
    assert_eq!(mode, RuntimeMode::Runtime);
    assert!(said.contains("[cdi] is off"), "{said}");
    // Explicit values stay, and then nothing is said.
    let (mode, strategy, _, said) = decide(
        "[runtime]\nmode = \"runtime\"\n[device_plugin]\ndevice_list_strategy = \"cdi-annotations\"\n",
        false,
    );
    assert_eq!(
        (mode, strategy, said.as_str()),
        (RuntimeMode::Runtime, vec![CdiAnnotations], "")
    );
    let (mode, strategy, _, _) = decide("[device_plugin]\ndevice_list_strategy = \"cdi-annotations\"\n", false);
    assert_eq!((mode, strategy), (RuntimeMode::CdiOnly, vec![CdiAnnotations]));
    // auto stands alone.
    let e = err(&[(
        "c.toml",
        "[device_plugin]\ndevice_list_strategy = [\"auto\", \"envvar\"]\n",
    )]);
    assert!(e.contains("auto picks one strategy itself"), "{e}");
}

#[test]
fn example_file_is_the_defaults() {
    let config = parse(&[("config/gpu-node-agent.toml", EXAMPLE)]).unwrap();
    assert_eq!(config, Config::default());
}

/// Every key of the config is set in the example file, so a new key cannot go
/// undocumented.
#[test]
fn example_file_sets_every_key() {
    fn keys(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
        if let toml::Value::Table(t) = v {
            for (k, v) in t {
                let key = format!("{prefix}{k}");
                keys(&format!("{key}."), v, out);
                out.push(key);
            }
        }
    }
    let mut want = Vec::new();
    keys("", &toml::Value::try_from(Config::default()).unwrap(), &mut want);
    let mut have = Vec::new();
    keys("", &toml::from_str::<toml::Value>(EXAMPLE).unwrap(), &mut have);
    want.sort();
    have.sort();
    assert_eq!(have, want);
}

#[test]
fn later_sources_override_earlier() {
    let config = parse(&[
        ("main.toml", "[device_plugin]\nmig_strategy = \"single\"\n"),
        ("10-a.toml", "[device_plugin]\nmig_strategy = \"mixed\"\n"),
        ("20-b.toml", "device_plugin.mig_strategy = \"none\"\n"),
    ])
    .unwrap();
    assert_eq!(config.device_plugin.mig_strategy, MigStrategy::None);
}

#[test]
fn tables_merge_across_files() {
    let config = parse(&[
        (
            "main.toml",
            "log = { level = \"debug\" }\n[device_plugin]\nmig_strategy = \"mixed\"\n",
        ),
        (
            "10-a.toml",
            "[log]\nformat = \"text\"\n[device_plugin]\npass_device_specs = true\n",
        ),
    ])
    .unwrap();
    assert_eq!(config.log.level, "debug");
    assert_eq!(config.log.format, LogFormat::Text);
    assert_eq!(config.device_plugin.mig_strategy, MigStrategy::Mixed);
    assert!(config.device_plugin.pass_device_specs);
}

#[test]
fn arrays_replace() {
    let config = parse(&[
        ("main.toml", "[health]\nignored_xids = [1, 2, 3]\n"),
        ("10-a.toml", "[health]\nignored_xids = [4]\n"),
    ])
    .unwrap();
    assert_eq!(config.health.ignored_xids, [4]);
}

#[test]
fn runtime_engine_sections_default_per_engine_and_check_their_keys() {
    let c = parse(&[(
        "c.toml",
        "[runtime.crio]\nunit = \"cri-o.service\"\n[runtime.docker]\nconfig = \"/srv/daemon.json\"\n",
    )])
    .unwrap();
    assert_eq!(c.runtime.crio.unit, "cri-o.service");
    assert_eq!(
        c.runtime.crio.drop_in,
        Path::new(DEFAULT_CRIO_DROP_IN),
        "keys left out keep the engine's defaults"
    );
    assert_eq!(c.runtime.docker.config, Path::new("/srv/daemon.json"));
    assert_eq!(c.runtime.files(Engine::Docker).binary, Path::new(DEFAULT_DOCKER_BINARY));
    assert_eq!(
        err(&[("c.toml", "[runtime.docker]\ndrop_in = \"/etc/docker/x.json\"\n")]),
        "c.toml:2: runtime.docker.drop_in = \"/etc/docker/x.json\" is not valid: docker reads no drop-in files; leave it out"
    );
    assert_eq!(
        err(&[("c.toml", "[runtime]\nengines = [\"docker\", \"docker\"]\n")]),
        "c.toml:2: runtime.engines = [\"docker\", \"docker\"] is not valid: docker is listed twice"
    );
    assert!(err(&[("c.toml", "[runtime]\nengines = [\"podman\"]\n")]).contains("podman"));
    assert!(err(&[("c.toml", "[runtime]\nmode = \"hook\"\n")]).contains("cdi-only"));
    // Combinations under which an allocated GPU reaches no container are refused.
    let e = err(&[(
        "c.toml",
        "[device_plugin]\ndevice_list_strategy = \"cdi-annotations\"\n\n[cdi]\nenabled = false\n",
    )]);
    assert!(
        e.contains("device_plugin.device_list_strategy") && e.contains("[cdi] enabled = false"),
        "{e}"
    );
    let e = err(&[(
        "c.toml",
        "[runtime]\nmode = \"cdi-only\"\n\n[device_plugin]\ndevice_list_strategy = \"envvar\"\n",
    )]);
    assert!(e.contains("runtime.mode") && e.contains("cdi-cri"), "{e}");
    let e = err(&[("c.toml", "[runtime]\nmode = \"cdi-only\"\n\n[cdi]\nenabled = false\n")]);
    assert!(
        e.contains("auto (with [runtime] mode = \"cdi-only\") hands out CDI names"),
        "{e}"
    );
    parse(&[("c.toml", "[runtime]\nmode = \"cdi-only\"\n")]).expect("cdi-only with the auto strategy");
    parse(&[(
        "c.toml",
        "[runtime]\nmode = \"cdi-only\"\n\n[device_plugin]\ndevice_list_strategy = [\"cdi-cri\"]\n",
    )])
    .expect("cdi-only with cdi-cri delivers GPUs");
    assert!(err(&[("c.toml", "[cdi]\ndir = \"cdi\"\n")]).contains("cdi.dir"));
}

#[test]
fn unknown_keys_name_file_line_and_key() {
    assert_eq!(
        err(&[("main.toml", "# top\n\nbogus = 1\n")]),
        "main.toml:3: unknown key bogus: expected one of log, agent, nvml, kubelet, \
         device_plugin, driver, runtime, cdi, mig, validation, metrics, health, kubernetes, desired, labels, dra"
    );
    assert_eq!(
        err(&[("main.toml", "[log]\nlevel = \"info\"\nformt = \"text\"\n")]),
        "main.toml:3: unknown key log.formt: expected one of level, format"
    );
    assert_eq!(
        err(&[
            ("main.toml", "[device_plugin]\nenabled = true\n"),
            (
                "/etc/gpu-node-agent/config.d/10-x.toml",
                "[device_plugin]\n\nmig_stratgy = \"mixed\"\n"
            ),
        ]),
        "/etc/gpu-node-agent/config.d/10-x.toml:3: unknown key device_plugin.mig_stratgy: \
         expected one of enabled, mig_strategy, device_list_strategy, device_id_strategy, \
         pass_device_specs, cdi_annotation_prefix, cdi_kind, driver_root, dev_root, \
         host_mounts_driver_dir, host_mounts_container_dir, default_profile, profiles, sharing, \
         memory_limits, gds_enabled, mofed_enabled, gdrcopy_enabled, imex"
    );
    // A section name typo is reported at its header.
    let e = err(&[("main.toml", "[log]\n[helth]\nenabled = false\n")]);
    assert!(e.starts_with("main.toml:2: unknown key helth: "), "{e}");
}

#[test]
fn bad_enum_value() {
    let e = parse(&[(
        "/etc/gpu-node-agent/config.d/10-mig.toml",
        "# MIG\n[device_plugin]\nmig_strategy = \"mixd\"\n",
    )])
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "/etc/gpu-node-agent/config.d/10-mig.toml:3: device_plugin.mig_strategy = \"mixd\" \
         is not valid: expected one of none, single, mixed"
    );
    assert_eq!(e.exit_code(), 64);
    assert_eq!(e.key(), Some("device_plugin.mig_strategy"));
    assert_eq!(e.location().map(|l| l.line), Some(3));

    assert_eq!(
        err(&[("c.toml", "[log]\nformat = 1\n")]),
        "c.toml:2: log.format = 1 is not valid: expected one of auto, journald, text"
    );
}

#[test]
fn wrong_types() {
    assert_eq!(
        err(&[("c.toml", "[health]\nenabled = \"yes\"\n")]),
        "c.toml:2: health.enabled = \"yes\" is not valid: expected a boolean"
    );
    assert_eq!(
        err(&[("c.toml", "[driver]\nsource = \"none\"\ncreate_device_nodes = 1\n")]),
        "c.toml:3: driver.create_device_nodes = 1 is not valid: expected a boolean"
    );
    assert_eq!(
        err(&[("c.toml", "[log]\nlevel = \"debug\"\n"), ("d.toml", "log = 5\n")]),
        "d.toml:1: log = 5 is not valid: expected a table"
    );
}

#[test]
fn xids_out_of_range() {
    assert_eq!(
        err(&[("c.toml", "[health]\nignored_xids = [\n  13,\n  -1,\n]\n")]),
        "c.toml:4: health.ignored_xids[1] = -1 is not valid: expected an integer in \
         0..=4294967295"
    );
    let e = err(&[("c.toml", "health.critical_xids = [4294967296]\n")]);
    assert!(
        e.starts_with("c.toml:1: health.critical_xids[0] = 4294967296 is not valid"),
        "{e}"
    );
    let config = parse(&[("c.toml", "health.critical_xids = [0, 4294967295]\n")]).unwrap();
    assert_eq!(config.health.critical_xids, [0, u32::MAX]);
}

#[test]
fn durations() {
    let config = parse(&[(
        "c.toml",
        "[agent]\nresync_interval = \"1h30m\"\n[health]\nrecovery_after = \"0s\"\n\
         lost_check_interval = \"500ms\"\n",
    )])
    .unwrap();
    assert_eq!(config.agent.resync_interval, Duration::from_secs(5400));
    assert_eq!(config.health.recovery_after, Duration::ZERO);
    assert_eq!(config.health.lost_check_interval, Duration::from_millis(500));

    assert_eq!(
        err(&[("c.toml", "[agent]\nresync_interval = \"5 minutes\"\n")]),
        "c.toml:2: agent.resync_interval = \"5 minutes\" is not valid: expected a duration \
         such as \"500ms\", \"5s\", \"2m\", \"1h\" or \"1h30m\""
    );
    let e = err(&[("c.toml", "[nvml]\nretry_interval = 30\n")]);
    assert!(
        e.starts_with("c.toml:2: nvml.retry_interval = 30 is not valid: expected a duration"),
        "{e}"
    );
    assert_eq!(
        err(&[("c.toml", "[kubelet]\nregister_timeout = \"0s\"\n")]),
        "c.toml:2: kubelet.register_timeout = \"0s\" is not valid: expected a duration \
         greater than 0s"
    );
}

#[test]
fn relative_paths_rejected() {
    assert_eq!(
        err(&[("c.toml", "[agent]\nstate_dir = \"var/lib/gpu-node-agent\"\n")]),
        "c.toml:2: agent.state_dir = \"var/lib/gpu-node-agent\" is not valid: expected an \
         absolute path"
    );
    for key in [
        "kubelet.device_plugin_dir",
        "device_plugin.driver_root",
        "device_plugin.host_mounts_driver_dir",
    ] {
        let e = err(&[("c.toml", &format!("{key} = \"relative\"\n"))]);
        assert_eq!(
            e,
            format!("c.toml:1: {key} = \"relative\" is not valid: expected an absolute path")
        );
    }
}

#[test]
fn nvml_library_soname_or_absolute() {
    let config = parse(&[("c.toml", "nvml.library = \"libnvidia-ml.so\"\n")]).unwrap();
    assert_eq!(
        config.nvml.library_path(Path::new("/tmp/r")),
        Path::new("libnvidia-ml.so")
    );
    let config = parse(&[("c.toml", "nvml.library = \"/usr/lib/libnvidia-ml.so.1\"\n")]).unwrap();
    assert_eq!(
        config.nvml.library_path(Path::new("/tmp/r")),
        Path::new("/tmp/r/usr/lib/libnvidia-ml.so.1")
    );
    for bad in ["lib/libnvidia-ml.so.1", ""] {
        let e = err(&[("c.toml", &format!("nvml.library = {bad:?}\n"))]);
        assert!(
            e.starts_with(&format!("c.toml:1: nvml.library = {bad:?} is not valid: ")),
            "{e}"
        );
    }
}

#[test]
fn device_list_strategy_string_or_list() {
    use DeviceListStrategy::*;
    let one = parse(&[("c.toml", "device_plugin.device_list_strategy = \"cdi-cri\"\n")]).unwrap();
    assert_eq!(one.device_plugin.device_list_strategy.as_slice(), &[CdiCri]);
    let many = parse(&[(
        "c.toml",
        "device_plugin.device_list_strategy = [\"envvar\", \"volume-mounts\", \
         \"cdi-annotations\"]\n",
    )])
    .unwrap();
    assert_eq!(
        many.device_plugin.device_list_strategy.as_slice(),
        &[Envvar, VolumeMounts, CdiAnnotations]
    );
    let mounts = parse(&[(
        "c.toml",
        "device_plugin.device_list_strategy = [\"host-mounts\", \"envvar\"]\n",
    )])
    .unwrap();
    assert!(mounts.device_plugin.device_list_strategy.contains(HostMounts));

    assert_eq!(
        err(&[(
            "c.toml",
            "[device_plugin]\ndevice_list_strategy = [\"envvar\",\n  \"bogus\"]\n"
        )]),
        "c.toml:3: device_plugin.device_list_strategy[1] = \"bogus\" is not valid: expected \
         one of auto, envvar, volume-mounts, cdi-annotations, cdi-cri, host-mounts"
    );
    let e = err(&[("c.toml", "device_plugin.device_list_strategy = 1\n")]);
    assert!(
        e.starts_with(
            "c.toml:1: device_plugin.device_list_strategy = 1 is not valid: expected a \
             strategy or an array of strategies"
        ),
        "{e}"
    );
}

#[test]
fn device_list_strategy_rules() {
    assert_eq!(
        err(&[("c.toml", "[device_plugin]\ndevice_list_strategy = []\n")]),
        "c.toml:2: device_plugin.device_list_strategy = [] is not valid: expected at least \
         one of auto, envvar, volume-mounts, cdi-annotations, cdi-cri, host-mounts"
    );
    assert_eq!(
        err(&[(
            "c.toml",
            "[device_plugin]\ndevice_list_strategy = [\"envvar\", \"envvar\"]\n"
        )]),
        "c.toml:2: device_plugin.device_list_strategy = [\"envvar\", \"envvar\"] is not \
         valid: envvar is listed twice"
    );
    // The rule breaks in the drop-in that set the key, and the message points there.
    assert_eq!(
        err(&[
            ("main.toml", "[device_plugin]\ndevice_list_strategy = \"host-mounts\"\n"),
            (
                "10-cdi.toml",
                "\n[device_plugin]\ndevice_list_strategy = [\"host-mounts\", \"cdi-cri\"]\n"
            ),
        ]),
        "10-cdi.toml:3: device_plugin.device_list_strategy = [\"host-mounts\", \"cdi-cri\"] \
         is not valid: host-mounts cannot be combined with cdi-cri"
    );
}

#[test]
fn cdi_settings() {
    assert_eq!(
        err(&[("c.toml", "device_plugin.cdi_annotation_prefix = \"cdi.k8s.io\"\n")]),
        "c.toml:1: device_plugin.cdi_annotation_prefix = \"cdi.k8s.io\" is not valid: \
         expected a DNS name followed by '/', e.g. \"cdi.k8s.io/\""
    );
    let e = err(&[("c.toml", "device_plugin.cdi_kind = \"gpu\"\n")]);
    assert!(
        e.starts_with("c.toml:1: device_plugin.cdi_kind = \"gpu\" is not valid: expected"),
        "{e}"
    );
    let config = parse(&[("c.toml", "device_plugin.cdi_kind = \"nvidia.com/gpu\"\n")]);
    assert_eq!(config.unwrap().device_plugin.cdi_kind, "nvidia.com/gpu");
}

#[test]
fn log_level() {
    let config = parse(&[("c.toml", "log.level = \"info,gpu_node_agent::plugin=trace\"\n")]);
    assert_eq!(config.unwrap().log.level, "info,gpu_node_agent::plugin=trace");
    let e = err(&[("c.toml", "[log]\nlevel = \"verbose\"\n")]);
    assert!(
        e.starts_with("c.toml:2: log.level = \"verbose\" is not valid: \"verbose\": expected a level"),
        "{e}"
    );
}

#[test]
fn syntax_errors_name_file_and_line() {
    let e = parse(&[("ok.toml", ""), ("bad.toml", "[log]\nlevel = \n")]).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax { .. }));
    let text = e.to_string();
    assert!(text.starts_with("bad.toml:2: TOML syntax error: "), "{text}");
    assert_eq!(e.exit_code(), 64);

    let e = err(&[("dup.toml", "[log]\nlevel = \"info\"\nlevel = \"debug\"\n")]);
    assert!(e.starts_with("dup.toml:3: TOML syntax error: "), "{e}");
}

#[test]
fn effective_config_round_trips() {
    let config = parse(&[(
        "c.toml",
        "[device_plugin]\ndevice_list_strategy = \"cdi-cri\"\nmig_strategy = \"mixed\"\n\
         [health]\nrecovery_after = \"90s\"\n",
    )])
    .unwrap();
    let text = toml::to_string(&config).unwrap();
    assert_eq!(parse(&[("effective", &text)]).unwrap(), config);
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(json["device_plugin"]["device_list_strategy"][0], "cdi-cri");
    assert_eq!(json["health"]["recovery_after"], "90s");
}

#[test]
fn rooted_paths() {
    let p = Path::new("/etc/gpu-node-agent/config.toml");
    assert_eq!(rooted(Path::new("/"), p), p);
    assert_eq!(
        rooted(Path::new("/tmp/r"), p),
        Path::new("/tmp/r/etc/gpu-node-agent/config.toml")
    );
    assert_eq!(rooted(Path::new("/tmp/r"), Path::new("/")), Path::new("/tmp/r"));
}

// === load ===

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

#[test]
fn load_without_files_gives_defaults() {
    let root = tempfile::tempdir().unwrap();
    let (config, files) = Config::load(root.path(), None).unwrap();
    assert_eq!(config, Config::default());
    assert!(files.is_empty());
}

#[test]
fn load_explicit_missing_file_is_an_error() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("nope.toml");
    let e = Config::load(Path::new("/"), Some(&path)).unwrap_err();
    assert!(matches!(e, ConfigError::ReadFile { .. }));
    let text = e.to_string();
    assert!(
        text.starts_with(&format!("{}: cannot read config file: ", path.display())),
        "{text}"
    );
    assert!(text.contains("No such file"), "{text}");
    assert_eq!(e.exit_code(), 64);
}

#[test]
fn load_reads_main_and_drop_ins_in_name_order() {
    let root = tempfile::tempdir().unwrap();
    let etc = root.path().join("etc/gpu-node-agent");
    let d = etc.join("config.d");
    write(
        &etc.join("config.toml"),
        "[device_plugin]\nmig_strategy = \"single\"\npass_device_specs = true\n",
    );
    // Written in reverse order so directory order cannot pass for name order.
    write(&d.join("20-b.toml"), "[device_plugin]\nmig_strategy = \"mixed\"\n");
    write(
        &d.join("10-a.toml"),
        "[device_plugin]\nmig_strategy = \"none\"\n[log]\nformat = \"text\"\n",
    );
    write(&d.join("30-c.toml.bak"), "this is not toml");
    write(&d.join("README"), "this is not toml");
    write(&d.join(".40-hidden.toml"), "this is not toml");
    fs::create_dir_all(d.join("50-dir.toml")).unwrap();

    let (config, files) = Config::load(root.path(), None).unwrap();
    assert_eq!(config.device_plugin.mig_strategy, MigStrategy::Mixed);
    assert!(config.device_plugin.pass_device_specs);
    assert_eq!(config.log.format, LogFormat::Text);
    let shown = |p: PathBuf| p.display().to_string();
    assert_eq!(
        files,
        [
            shown(etc.join("config.toml")),
            shown(d.join("10-a.toml")),
            shown(d.join("20-b.toml")),
        ]
    );
}

#[test]
fn load_drop_ins_without_main_file() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("etc/gpu-node-agent/config.d");
    write(&d.join("10-a.toml"), "health.enabled = false\n");
    let (config, files) = Config::load(root.path(), None).unwrap();
    assert!(!config.health.enabled);
    assert_eq!(files.len(), 1);
}

#[test]
fn load_explicit_path_is_not_rooted_and_brings_its_drop_ins() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("custom/agent.toml");
    write(&main, "log.level = \"debug\"\n");
    write(&dir.path().join("custom/config.d/10-a.toml"), "log.format = \"text\"\n");
    // A root that does not contain the file: the explicit path is used as given.
    let elsewhere = tempfile::tempdir().unwrap();
    let (config, files) = Config::load(elsewhere.path(), Some(&main)).unwrap();
    assert_eq!(config.log.level, "debug");
    assert_eq!(config.log.format, LogFormat::Text);
    assert_eq!(files.len(), 2);
}

#[test]
fn load_errors_name_the_drop_in() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("etc/gpu-node-agent/config.d");
    let bad = d.join("10-mig.toml");
    write(&bad, "[device_plugin]\nmig_strategy = \"mixd\"\n");
    let e = Config::load(root.path(), None).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}:2: device_plugin.mig_strategy = \"mixd\" is not valid",
            bad.display()
        )),
        "{e}"
    );
}

#[test]
fn load_unreadable_main_file_is_an_error() {
    let root = tempfile::tempdir().unwrap();
    // A directory where the main file should be: reading it fails even as root.
    fs::create_dir_all(root.path().join("etc/gpu-node-agent/config.toml")).unwrap();
    let e = Config::load(root.path(), None).unwrap_err();
    assert!(matches!(e, ConfigError::ReadFile { .. }), "{e}");
    assert!(e.to_string().contains("config.toml: cannot read config file: "), "{e}");
}
#[test]
fn mig_layouts_parse_and_merge_with_defaults() {
    use crate::mig_layout::DeviceSelector;
    let config = parse(&[(
        "10-mig.toml",
        "[mig]\nprocess_wait_timeout = \"0s\"\n\n[[mig.layouts.custom-1]]\ndevices = \"all\"\n\
         device_filter = [\"0x20B0\", \"0x20B210DE\", 0x2330]\nmig_enabled = true\n\
         profiles = { \"1g.5gb\" = 7 }\n\n[[mig.layouts.custom-1]]\ndevices = [4, 5]\ndevice_filter = 0x20B5\nmig_enabled = false\n\n\
         [[mig.layouts.all-balanced]]\ndevices = \"all\"\ndevice_filter = \"0x20B0\"\nmig_enabled = true\n\
         profiles = {}\n",
    )])
    .unwrap();
    assert_eq!(config.mig.process_wait_timeout, Duration::ZERO);
    let custom = config.mig.layout("custom-1").unwrap();
    assert_eq!(custom.entries.len(), 2);
    assert_eq!(custom.entries[0].device_filter, [0x20B0, 0x20B2, 0x2330]);
    assert_eq!(custom.entries[0].profiles["1g.5gb"], 7);
    assert_eq!(custom.entries[1].devices, DeviceSelector::Indices(vec![4, 5]));
    assert!(custom.entries[1].profiles.is_empty());
    // A user layout replaces the built-in one of the same name; the others stay.
    assert_eq!(config.mig.layout("all-balanced").unwrap().entries.len(), 1);
    assert!(config.mig.layout("all-1g.10gb").is_some());
    assert!(config.mig.layout("nope").is_none());
    let names = config.mig.layout_names();
    assert!(names.contains(&"custom-1".to_owned()) && names.contains(&"all-disabled".to_owned()));
    assert!(names.windows(2).all(|w| w[0] < w[1]));

    let only_mine = parse(&[(
        "c.toml",
        "[mig]\ndefault_layouts = false\n[[mig.layouts.x]]\ndevices = \"all\"\nmig_enabled = false\n",
    )])
    .unwrap();
    assert_eq!(only_mine.mig.layout_names(), ["x"]);
    assert!(only_mine.mig.layout("all-disabled").is_none());
    assert_eq!(
        Config::default().mig.layout_names().len(),
        crate::mig_layout::defaults::default_layouts().len()
    );
}

#[test]
fn mig_layout_errors_name_file_line_and_key() {
    let e = |text: &str| err(&[("m.toml", text)]);
    const HEAD: &str = "[[mig.layouts.x]]\ndevices = \"all\"\n";
    assert_eq!(
        e(&format!(
            "{HEAD}mig_enabled = true\nprofiles = {{ \"1g.5gb\" = 7, \"1x.5gb\" = 1 }}\n"
        )),
        "m.toml:4: mig.layouts.x[0].profiles.\"1x.5gb\" = 1 is not valid: \"1x.5gb\" is not a MIG profile name: \
         \"1x\" does not end in \"g\" (expected [<C>c.]<G>g.<GB>gb with an optional +attr[,attr] or -attr \
         suffix, e.g. 1g.5gb, 1c.4g.20gb, 1g.5gb+me, 1g.24gb-me)"
    );
    assert_eq!(
        e(&format!("{HEAD}mig_enabled = true\nprofiles = {{ \"1g.5gb\" = 0 }}\n")),
        "m.toml:4: mig.layouts.x[0].profiles.\"1g.5gb\" = 0 is not valid: expected a count of at least 1; \
         leave the profile out instead"
    );
    assert_eq!(
        e(&format!("{HEAD}mig_enabled = false\nprofiles = {{ \"1g.5gb\" = 7 }}\n")),
        "m.toml:4: mig.layouts.x[0].profiles = { \"1g.5gb\" = 7 } is not valid: MIG devices need mig_enabled; \
         leave the profiles out or set mig_enabled"
    );
    let missing = e(&format!("{HEAD}mig_enabled = true\n"));
    assert!(
        missing.starts_with("m.toml:1: mig.layouts.x[0] = ")
            && missing
                .ends_with("is not valid: missing field `profiles` (required when mig_enabled = true; {} for none)"),
        "{missing}"
    );
    let missing = e("[[mig.layouts.x]]\nmig_enabled = false\n");
    assert!(
        missing.starts_with("m.toml:1: mig.layouts.x[0] = ") && missing.ends_with("missing field `devices`"),
        "{missing}"
    );
    assert_eq!(
        e("[[mig.layouts.x]]\ndevices = [0, 1,\n  0]\nmig_enabled = false\n"),
        "m.toml:3: mig.layouts.x[0].devices[2] = 0 is not valid: GPU 0 is listed twice"
    );
    assert_eq!(
        e("[[mig.layouts.x]]\ndevices = []\nmig_enabled = false\n"),
        "m.toml:2: mig.layouts.x[0].devices = [] is not valid: an empty list selects no GPU; expected \"all\" \
         or GPU indices"
    );
    assert_eq!(
        e("[[mig.layouts.x]]\ndevices = \"some\"\nmig_enabled = false\n"),
        "m.toml:2: mig.layouts.x[0].devices = \"some\" is not valid: expected \"all\" or an array of GPU indices"
    );
    assert_eq!(
        e("[[mig.layouts.x]]\ndevices = [-1]\nmig_enabled = false\n"),
        "m.toml:2: mig.layouts.x[0].devices[0] = -1 is not valid: expected an integer in 0..=4294967295"
    );
    assert_eq!(
        e(&format!(
            "{HEAD}device_filter = [\"0x20B0\", \"0x20B01002\"]\nmig_enabled = false\n"
        )),
        "m.toml:3: mig.layouts.x[0].device_filter[1] = \"0x20B01002\" is not valid: 0x20B01002 has vendor id \
         0x1002, not NVIDIA's 0x10DE; expected 0x<device id>10DE, e.g. \"0x20B010DE\""
    );
    let bad_id = e(&format!("{HEAD}device_filter = \"A100\"\nmig_enabled = false\n"));
    assert!(
        bad_id
            .starts_with("m.toml:3: mig.layouts.x[0].device_filter = \"A100\" is not valid: expected a PCI device id"),
        "{bad_id}"
    );
    assert_eq!(
        e(&format!("{HEAD}mig_enabled = false\nmig_devices = {{}}\n")),
        "m.toml:4: unknown key mig.layouts.x[0].mig_devices: expected one of devices, device_filter, \
         mig_enabled, profiles"
    );
    assert_eq!(
        e("[mig.layouts]\nx = []\n"),
        "m.toml:2: mig.layouts.x = [] is not valid: a layout needs at least one entry"
    );
    let table = e("[mig.layouts.x]\ndevices = \"all\"\nmig_enabled = false\n");
    assert!(
        table.starts_with("m.toml:1: mig.layouts.x = ")
            && table.ends_with("is not valid: expected an array of layout entries, written [[mig.layouts.<name>]]"),
        "{table}"
    );
    let name = e("[[mig.layouts.\"-x\"]]\ndevices = \"all\"\nmig_enabled = false\n");
    assert!(
        name.starts_with("m.toml:1: mig.layouts.-x = ") && name.contains("a layout name is selected by a label value"),
        "{name}"
    );
    // Overlapping entries are accepted: the last one wins, as in mig-parted.
    let overriding = parse(&[(
        "m.toml",
        "[[mig.layouts.x]]\ndevices = \"all\"\nmig_enabled = false\n\n[[mig.layouts.x]]\ndevices = [1]\n\
         mig_enabled = true\nprofiles = {}\n",
    )])
    .unwrap();
    assert_eq!(overriding.mig.layouts["x"].overrides().len(), 1);
    assert_eq!(
        e("[mig]\nprocess_wait_timeout = \"10 minutes\"\n"),
        "m.toml:2: mig.process_wait_timeout = \"10 minutes\" is not valid: expected a duration such as \
         \"500ms\", \"5s\", \"2m\", \"1h\" or \"1h30m\""
    );
    assert_eq!(
        e("[mig]\nreboot = true\n"),
        "m.toml:2: unknown key mig.reboot: expected one of enabled, default_layouts, process_wait_timeout, \
         reboot_on_mode_change, gpu_reset, nvidia_smi, uncovered_gpus, host_gpu_clients, host_gpu_clients_stop_timeout, \
         stop_kubelet_on_mode_change, kubelet_unit, default_layout, layouts"
    );
}

#[test]
fn host_gpu_clients_are_unit_names_each_listed_once() {
    let e = |text: &str| err(&[("m.toml", text)]);
    let config = parse(&[(
        "m.toml",
        "[mig]\nhost_gpu_clients = [\"nvidia-dcgm.service\", \"nvsm@x.service\"]\nstop_kubelet_on_mode_change = true\n",
    )])
    .unwrap();
    assert_eq!(config.mig.host_gpu_clients, ["nvidia-dcgm.service", "nvsm@x.service"]);
    assert!(config.mig.stop_kubelet_on_mode_change);
    assert_eq!(
        Config::default().mig.host_gpu_clients,
        crate::config::DEFAULT_MIG_HOST_GPU_CLIENTS
    );
    let path = e("[mig]\nhost_gpu_clients = [\"dcgm.service\", \"/etc/systemd/system/x.service\"]\n");
    assert!(
        path.starts_with(
            "m.toml:2: mig.host_gpu_clients[1] = \"/etc/systemd/system/x.service\" is not valid: expected a systemd \
             unit name such as \"nvidia-dcgm.service\""
        ),
        "{path}"
    );
    for bad in [
        "\"--all\"",
        "\"dcgm\"",
        "\".service\"",
        "\"a b.service\"",
        "\"*.service\"",
    ] {
        let text = e(&format!("[mig]\nhost_gpu_clients = [{bad}]\n"));
        assert!(
            text.contains("mig.host_gpu_clients[0]") && text.contains("expected a systemd unit name"),
            "{text}"
        );
    }
    assert_eq!(
        e("[mig]\nhost_gpu_clients = [\"dcgm.service\", \"dcgm.service\"]\n"),
        "m.toml:2: mig.host_gpu_clients[1] = \"dcgm.service\" is not valid: dcgm.service is listed twice"
    );
    assert!(
        e("[mig]\nkubelet_unit = \"kubelet\"\n").starts_with("m.toml:2: mig.kubelet_unit = \"kubelet\" is not valid")
    );
    assert_eq!(
        e("[mig]\nhost_gpu_clients_stop_timeout = \"0s\"\n"),
        "m.toml:2: mig.host_gpu_clients_stop_timeout = \"0s\" is not valid: expected a duration greater than 0s"
    );
}

#[test]
fn device_plugin_profiles_override_keys_and_are_validated() {
    let config = parse(&[(
        "main.toml",
        "[device_plugin]\ndefault_profile = \"mig-mixed\"\n\n[device_plugin.profiles.mig-mixed]\nmig_strategy = \"mixed\"\n\n[device_plugin.profiles.\"cdi.only\"]\ndevice_list_strategy = \"cdi-cri\"\n",
    )])
    .unwrap();
    let mixed = config.device_plugin.with_profile("mig-mixed").expect("profile");
    assert_eq!(mixed.mig_strategy, MigStrategy::Mixed);
    assert_eq!(mixed.device_list_strategy, config.device_plugin.device_list_strategy);
    let cdi = config.device_plugin.with_profile("cdi.only").expect("dotted name");
    assert_eq!(cdi.device_list_strategy.as_slice(), [DeviceListStrategy::CdiCri]);
    assert!(config.device_plugin.with_profile("nope").is_none());

    assert_eq!(
        err(&[("main.toml", "[device_plugin]\ndefault_profile = \"x\"\n")]),
        "main.toml:2: device_plugin.default_profile = \"x\" is not valid: names no profile defined under [device_plugin.profiles]"
    );
    let e = err(&[(
        "main.toml",
        "[device_plugin.profiles.\"a.b\"]\ndevice_list_strategy = []\n",
    )]);
    assert!(
        e.starts_with("main.toml:2: device_plugin.profiles.\"a.b\".device_list_strategy"),
        "{e}"
    );
    let e = err(&[(
        "main.toml",
        "[device_plugin.profiles.\"-bad\"]\nmig_strategy = \"mixed\"\n",
    )]);
    assert!(e.contains("label value"), "{e}");
    let e = err(&[("main.toml", "[device_plugin.profiles.p]\nmig_stratgy = \"mixed\"\n")]);
    assert!(
        e.starts_with("main.toml:2: unknown key device_plugin.profiles.p.mig_stratgy"),
        "{e}"
    );
}

/// `[kubernetes] operator_namespace` is a namespace name; an error names the key.
#[test]
fn the_operator_namespace_is_a_namespace_name() {
    assert_eq!(parse(&[]).unwrap().kubernetes.operator_namespace, "gpu-operator");
    let config = parse(&[("c.toml", "[kubernetes]\noperator_namespace = \"nvidia-gpu-operator\"\n")]).unwrap();
    assert_eq!(config.kubernetes.operator_namespace, "nvidia-gpu-operator");
    for bad in ["", "GPU-Operator", "gpu.operator", "-gpu", &"a".repeat(64)] {
        let e = err(&[("c.toml", &format!("[kubernetes]\noperator_namespace = \"{bad}\"\n"))]);
        assert!(
            e.contains("kubernetes.operator_namespace") && e.contains("expected a namespace name"),
            "{bad}: {e}"
        );
    }
}

/// List entries are blamed on their own file, line and index, not on a "(default)" key.
#[test]
fn list_entry_errors_name_file_line_and_index() {
    let e = |text: &str| err(&[("d.toml", text)]);
    assert_eq!(
        e("[cdi]\nhook_paths = [\n  \"/usr/bin/nvidia-cdi-hook\",\n  \"relative\",\n]\n"),
        "d.toml:4: cdi.hook_paths[1] = \"relative\" is not valid: expected an absolute path"
    );
    assert_eq!(
        e("[kubernetes]\nkubeconfig_search = [\"/etc/k\", \"rel\"]\n"),
        "d.toml:2: kubernetes.kubeconfig_search[1] = \"rel\" is not valid: expected an absolute path"
    );
    assert_eq!(
        e("[driver]\nextra_modules = [\"nvidia_peermem\",\n  \"bad module!\"]\n"),
        "d.toml:3: driver.extra_modules[1] = \"bad module!\" is not valid: \"bad module!\" is not a kernel module name"
    );
    assert_eq!(
        e("[driver.module_params]\n\"bad mod\" = [\"a=1\"]\n"),
        "d.toml:2: driver.module_params.\"bad mod\" = [\"a=1\"] is not valid: \"bad mod\" is not a kernel module name"
    );
}

/// NVIDIA's gdsEnabled/mofedEnabled/gdrcopyEnabled and imex keys, in the agent's spelling; the
/// IMEX channel list is [] or [0] as NVIDIA allows, in profiles too.
#[test]
fn injection_keys_and_imex_validation() {
    let config = parse(&[(
        "main.toml",
        "[device_plugin]\ngds_enabled = true\ngdrcopy_enabled = true\n\n[device_plugin.imex]\nchannel_ids = [0]\nrequired = true\n\n[device_plugin.profiles.ib]\nmofed_enabled = true\nimex = { channel_ids = [] }\n",
    )])
    .unwrap();
    let dp = &config.device_plugin;
    assert!(dp.gds_enabled && dp.gdrcopy_enabled && !dp.mofed_enabled);
    assert_eq!(dp.imex.channel_ids, [0]);
    assert!(dp.imex.required);
    let ib = dp.with_profile("ib").expect("profile");
    assert!(ib.mofed_enabled && ib.gds_enabled);
    assert!(ib.imex.channel_ids.is_empty() && !ib.imex.required);

    assert_eq!(
        err(&[("main.toml", "[device_plugin.imex]\nchannel_ids = [1]\n")]),
        "main.toml:2: device_plugin.imex.channel_ids = [1] is not valid: must be [] or [0] (the only IMEX channel NVIDIA's device plugin hands out), found [1]"
    );
    let e = err(&[("main.toml", "[device_plugin.imex]\nchannel_ids = [0, 0]\n")]);
    assert!(
        e.contains("device_plugin.imex.channel_ids") && e.contains("[0, 0]"),
        "{e}"
    );
    let e = err(&[("main.toml", "[device_plugin.profiles.p.imex]\nchannel_ids = [2]\n")]);
    assert!(
        e.starts_with("main.toml:2: device_plugin.profiles.p.imex.channel_ids"),
        "{e}"
    );
    let e = err(&[("main.toml", "[device_plugin]\ngds_enabled = \"yes\"\n")]);
    assert!(e.contains("device_plugin.gds_enabled"), "{e}");
    let e = err(&[("main.toml", "[device_plugin.imex]\nchannelIDs = [0]\n")]);
    assert!(e.contains("unknown key device_plugin.imex.channelIDs"), "{e}");
}
