//! The kbuild path the agent uses for the NVIDIA driver, for real: a small module from
//! `tests/fixtures/kmod/hello` built against the kernel headers installed on this machine
//! (`scripts/deps` installs Debian's `linux-headers-amd64`, which need not match the running
//! kernel), its vermagic checked with modinfo, and the result kept in the module cache.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use gpu_node_agent::driver::Flavour;
use gpu_node_agent::driver::build::{BuildError, BuildRequest, build, installed_headers};
use gpu_node_agent::driver::cache::{CacheKey, ModuleCache};
use gpu_node_agent::host::HostRoot;
use gpu_node_agent::host::command::Runner;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kmod/hello");

/// The installed headers to build against: the running kernel's when installed, else the
/// newest. Fails the test when there are none.
fn headers() -> (String, PathBuf) {
    let found = installed_headers(&HostRoot::new("/"));
    let running = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    found
        .iter()
        .find(|(release, _)| *release == running)
        .or(found.last())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no kernel headers installed (no /lib/modules/*/build/Makefile): \
                 run scripts/deps (apt-get install linux-headers-amd64 make kmod)"
            )
        })
}

/// The same module (its source comes from [`FIXTURE`]) in the form of NVIDIA's kernel-open
/// tree: a top-level Makefile taking `SYSSRC`/`SYSOUT` that calls kbuild itself.
const FIXTURE_SYSSRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kmod/hello-syssrc");

/// A copy of the fixture in a temp dir (kbuild writes its objects into the tree).
fn fixture_copy() -> (tempfile::TempDir, PathBuf) {
    copy_of(FIXTURE)
}

fn copy_of(fixture: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let tree = dir.path().join("hello");
    fs::create_dir_all(&tree).expect("mkdir");
    for entry in fs::read_dir(fixture).expect("the fixture") {
        let entry = entry.expect("entry");
        fs::copy(entry.path(), tree.join(entry.file_name())).expect("copy the fixture");
    }
    if !tree.join("gna_hello.c").exists() {
        fs::copy(Path::new(FIXTURE).join("gna_hello.c"), tree.join("gna_hello.c")).expect("copy the source");
    }
    (dir, tree)
}

fn request(tree: &Path, release: &str, headers: &Path) -> BuildRequest {
    BuildRequest {
        headers: headers.to_path_buf(),
        ..BuildRequest::new(tree, release)
    }
}

fn modinfo_vermagic(ko: &Path) -> String {
    let modinfo = ["/usr/sbin/modinfo", "/sbin/modinfo"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("modinfo (kmod) is installed: run scripts/deps");
    let out = Command::new(modinfo)
        .args(["-F", "vermagic"])
        .arg(ko)
        .output()
        .expect("run modinfo");
    assert!(
        out.status.success(),
        "modinfo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn the_fixture_builds_against_the_installed_headers_and_is_cached() {
    let (release, headers) = headers();
    let (_dir, tree) = fixture_copy();
    let root = HostRoot::new("/");
    let runner = Runner::new(&root);

    let started = Instant::now();
    let built = build(&runner, &root, &request(&tree, &release, &headers))
        .unwrap_or_else(|e| panic!("kbuild of the fixture against {release}: {e}"));
    eprintln!("kbuild of the fixture for {release}: {:?}", started.elapsed());

    assert_eq!(built.modules, vec![tree.join("gna_hello.ko")]);
    let vermagic = modinfo_vermagic(&built.modules[0]);
    assert!(
        vermagic.starts_with(&format!("{release} ")),
        "vermagic {vermagic:?} is for {release}"
    );
    assert_eq!(built.vermagic, vermagic);

    // The cache: store, hit, then every key field and a changed module miss.
    let cache_dir = tempfile::tempdir().expect("tempdir");
    let cache = ModuleCache::new(cache_dir.path().join("driver/cache"));
    let key = CacheKey {
        kernel_release: release.clone(),
        driver_version: "580.95.05".into(),
        flavour: Flavour::Open,
        params: vec![("NVreg_EnableGpuFirmware".into(), "1".into())],
        source: "runfile:0123abcd".into(),
    };
    let stored = cache.store(&key, &built.modules).expect("store");
    assert_eq!(stored.modules, vec![stored.dir.join("gna_hello.ko")]);
    let started = Instant::now();
    let hit = cache.lookup(&key).expect("lookup");
    eprintln!("cache lookup hit: {:?}", started.elapsed());
    assert_eq!(hit.as_ref(), Some(&stored));
    assert_eq!(
        modinfo_vermagic(&stored.modules[0]),
        vermagic,
        "the cached copy is the module"
    );

    let misses = [
        CacheKey {
            kernel_release: format!("{release}-other"),
            ..key.clone()
        },
        CacheKey {
            driver_version: "580.95.06".into(),
            ..key.clone()
        },
        CacheKey {
            flavour: Flavour::Proprietary,
            ..key.clone()
        },
        CacheKey {
            params: vec![("NVreg_EnableGpuFirmware".into(), "0".into())],
            ..key.clone()
        },
        CacheKey {
            source: "prebuilt:0123abcd".into(),
            ..key.clone()
        },
    ];
    for other in &misses {
        assert_eq!(cache.lookup(other).expect("lookup"), None, "{other:?}");
    }

    let mut bytes = fs::read(&stored.modules[0]).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    fs::write(&stored.modules[0], &bytes).expect("corrupt");
    assert_eq!(cache.lookup(&key).expect("lookup"), None, "a corrupt module misses");
}

/// NVIDIA's form (`make -C <tree> SYSSRC=<sources> SYSOUT=<build> modules`), with the real
/// make and kbuild: on Debian the sources (`-common`) and the build tree (`-amd64`) are apart.
#[test]
fn a_tree_in_nvidias_syssrc_form_builds_against_the_installed_headers() {
    let (release, headers) = headers();
    let (_dir, tree) = copy_of(FIXTURE_SYSSRC);
    let root = HostRoot::new("/");
    let built = build(&Runner::new(&root), &root, &request(&tree, &release, &headers))
        .unwrap_or_else(|e| panic!("SYSSRC build of the fixture against {release}: {e}"));
    assert_eq!(built.modules, vec![tree.join("gna_hello.ko")]);
    let vermagic = modinfo_vermagic(&built.modules[0]);
    assert!(
        vermagic.starts_with(&format!("{release} ")),
        "vermagic {vermagic:?} is for {release}"
    );
}

#[test]
fn missing_headers_name_the_package_to_install() {
    let (_dir, tree) = fixture_copy();
    let root = HostRoot::new("/");
    let release = "6.99.0-1-gna-test";
    let e = build(
        &Runner::new(&root),
        &root,
        &request(&tree, release, Path::new("/lib/modules/6.99.0-1-gna-test/build")),
    )
    .expect_err("no such headers");
    assert!(matches!(e, BuildError::MissingHeaders { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("linux-headers-6.99.0-1-gna-test"), "{msg}");
    assert!(msg.contains("kernel-devel-6.99.0-1-gna-test"), "{msg}");
}

#[test]
fn a_broken_source_fails_quoting_the_compiler() {
    let (release, headers) = headers();
    let (_dir, tree) = fixture_copy();
    let source = tree.join("gna_hello.c");
    let text = fs::read_to_string(&source).expect("read");
    fs::write(&source, text.replace("return 0;", "return gna_no_such_symbol;")).expect("break it");
    let root = HostRoot::new("/");
    let e = build(&Runner::new(&root), &root, &request(&tree, &release, &headers)).expect_err("does not compile");
    assert!(matches!(e, BuildError::Make { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("gna_hello.c:") && msg.contains("error:") && msg.contains("gna_no_such_symbol"),
        "the compiler's error line is quoted: {msg}"
    );
    assert!(!tree.join("gna_hello.ko").exists());
}
