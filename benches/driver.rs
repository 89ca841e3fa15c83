//! `cargo bench --bench driver`: the driver stage's path on a reboot with an unchanged kernel and
//! driver (budget: zero module builds, driver check ≤ 100 ms), measured in-process on a temp root
//! with 8 GPUs on the fake NVML, printed as a table:
//!
//! - *loaded*: the modules are loaded; observe + plan + validate (what every pass costs);
//! - *cache hit*: after a reboot the modules are not loaded; observe + cache lookup + plan +
//!   `insmod` ×3 from the module cache (stand-in `insmod` under the root) + validate.

#[path = "../tests/common/mod.rs"]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::Node;
use gpu_node_agent::config::{Config, Source};
use gpu_node_agent::driver::stage::{apply, cache, nvml_view, plan_now, validate_now};
use gpu_node_agent::driver::validate::summary;
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::nvml::Gpus;

const ROUNDS: usize = 30;
/// Roughly the open modules' sizes (nvidia.ko is the big one).
const MODULE_SIZES: [(&str, usize); 3] = [
    ("nvidia", 48 << 20),
    ("nvidia-uvm", 4 << 20),
    ("nvidia-modeset", 2 << 20),
];

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn unload(root: &Path) {
    for m in ["nvidia", "nvidia_uvm", "nvidia_modeset"] {
        let _ = std::fs::remove_dir_all(root.join("sys/module").join(m));
    }
}

fn main() {
    let node = Node::new(&common::machine("A100-SXM4-40GB", 8), "");
    // SAFETY of set_var: nothing else runs yet in this process.
    unsafe {
        std::env::set_var("FAKE_NVML_MACHINE", &node.machine);
        std::env::set_var("FAKE_NVML_STATE_DIR", &node.state);
    }
    let gpus = Gpus::open(&common::fake_nvml_library()).expect("fake NVML");
    let root = HostRoot::new(&node.root);
    std::fs::write(node.root.join("etc/os-release"), "ID=ubuntu\nID_LIKE=debian\n").expect("os-release");
    let config = Config::from_sources(&[Source::new(
        "bench.toml",
        format!(
            "[driver]\nsource = \"runfile\"\nversion = \"550.54.15\"\nrunfile_sha256 = \"{}\"\npersistence_mode = false\n",
            "c".repeat(64)
        ),
    )])
    .expect("config");
    // insmod: what the kernel shows after loading.
    let insmod = node.root.join("usr/sbin/insmod");
    std::fs::create_dir_all(insmod.parent().expect("dir")).expect("mkdir");
    std::fs::write(
        &insmod,
        format!(
            "#!/bin/sh\nm=$(basename \"$1\" .ko | tr - _)\nmkdir -p \"{0}/sys/module/$m\"\n[ \"$m\" = nvidia ] && echo 550.54.15 > \"{0}/sys/module/nvidia/version\"\nexit 0\n",
            node.root.display()
        ),
    )
    .expect("insmod");
    std::fs::set_permissions(&insmod, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // The cache entry a first boot's build left.
    let planned = plan_now(&config, &root, Some(0)).expect("plan");
    let key = planned.cache_key.clone().expect("key");
    let built = tempfile::tempdir().expect("tmp");
    let modules: Vec<_> = MODULE_SIZES
        .iter()
        .map(|(m, size)| {
            let p = built.path().join(format!("{m}.ko"));
            std::fs::write(&p, vec![0x5a; *size]).expect("module");
            p
        })
        .collect();
    cache(&config, &root).store(&key, &modules).expect("store");

    let check = |expect_loaded: bool| {
        let planned = plan_now(&config, &root, Some(0)).expect("plan");
        assert_eq!(planned.plan.steps.is_empty(), expect_loaded, "{:?}", planned.plan);
        if !expect_loaded {
            let applied = apply(&config, &root, &planned, None).expect("apply");
            assert!(!applied.built, "a cache hit builds nothing");
        }
        let facts = gpu_node_agent::driver::observe::observe(&root).expect("observe");
        let checks = validate_now(&config, &root, &facts, nvml_view(&gpus, facts.gpus.len()));
        summary(&checks).expect("valid");
    };
    // Warm up (and write the modprobe conf once).
    unload(&node.root);
    check(false);

    let mut hit = Vec::new();
    let mut loaded = Vec::new();
    for _ in 0..ROUNDS {
        unload(&node.root);
        let t = Instant::now();
        check(false);
        hit.push(t.elapsed());
        let t = Instant::now();
        check(true);
        loaded.push(t.elapsed());
    }
    hit.sort();
    loaded.sort();
    println!("driver stage, 8 GPUs on the fake NVML, {ROUNDS} rounds (budget: ≤ 100 ms, zero builds)");
    println!("{:<48} {:>10} {:>10}", "path", "p50", "max");
    for (name, v) in [
        ("driver loaded: observe + plan + validate", &loaded),
        ("after a reboot: cache hit, insmod ×3, validate", &hit),
    ] {
        println!(
            "{:<48} {:>8.2}ms {:>8.2}ms",
            name,
            percentile(v, 0.5).as_secs_f64() * 1e3,
            percentile(v, 1.0).as_secs_f64() * 1e3
        );
    }
}
