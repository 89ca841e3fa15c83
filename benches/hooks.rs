//! `cargo bench --bench hooks`: what the CDI hooks add to a container's start, printed as a
//! table: the wall time of the four hooks of the agent's spec for one container, each run as a
//! separate process exactly as runc and crun run a `createContainer` hook (the OCI state on
//! standard input, the container's root file system as the working directory, the spec's
//! `env` only), on a fresh copy of a small glibc image for every container (the copy is not
//! timed).
//!
//! | what | budget |
//! | the four hooks of one container, p50 | ≤ 2× the hooks before #32 |
//!
//! "after" is the statically linked `gpu-node-agent-cdi-hook`, built here in release (the
//! profile the packages ship; `GNA_HOOKS_PROGRAM=<path>` uses another build). "before" is
//! printed only when `GNA_HOOKS_BASELINE` names the agent binary of a commit before #32 (its
//! hooks were `gpu-node-agent cdi hook <name>` and ran the image's own `ldconfig` chrooted, so
//! the image here ships the host's static `ldconfig`; the new hook ignores it and runs the
//! host's in its sandbox). That binary is built by hand, once, outside the tree:
//!
//! ```sh
//! mkdir /tmp/gna-baseline && git archive ca5cd1c | tar -x -C /tmp/gna-baseline
//! (cd /tmp/gna-baseline && CARGO_TARGET_DIR=$PWD/../gna-baseline-target cargo build --release --locked --bin gpu-node-agent)
//! GNA_HOOKS_BASELINE=/tmp/gna-baseline-target/release/gpu-node-agent cargo bench --bench hooks
//! ```
//!
//! `disable-device-node-modification` finds no `/proc/driver/nvidia/params` in the image (no
//! driver here) and returns at once, as on any node without one; with the driver it reads the
//! file and bind-mounts a copy, which this bench does not measure. `update-ldcache` needs root
//! (namespaces, `chroot`): without root the bench says so and measures nothing.

mod table;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use table::{Row, percentile, sorted};

/// Containers measured per variant (after a few not measured, to warm the page cache).
const N: usize = 100;
const WARMUP: usize = 3;

const DRIVER: &str = "550.54.15";
const LIBDIR: &str = "/usr/lib/x86_64-linux-gnu";

/// The hooks of the agent's spec, in its order: name and arguments.
fn hooks() -> [(&'static str, Vec<String>); 4] {
    [
        (
            "create-symlinks",
            vec![
                "--link".into(),
                format!("libcuda.so.{DRIVER}::{LIBDIR}/libcuda.so.1"),
                "--link".into(),
                format!("libcuda.so.1::{LIBDIR}/libcuda.so"),
            ],
        ),
        ("enable-cuda-compat", vec![format!("--host-driver-version={DRIVER}")]),
        ("update-ldcache", vec!["--folder".into(), LIBDIR.into()]),
        ("disable-device-node-modification", vec![]),
    ]
}

/// How a variant's hook is started: the program and the arguments before the hook's name.
struct Variant {
    label: &'static str,
    program: PathBuf,
    prefix: Vec<&'static str>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The statically linked hook program in release, built into `target/static-hook` as the
/// packages build it.
fn static_hook_program() -> PathBuf {
    if let Some(path) = std::env::var_os("GNA_HOOKS_PROGRAM") {
        return PathBuf::from(path);
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = workspace.join("target/static-hook");
    eprintln!(
        "building the static gpu-node-agent-cdi-hook (release) into {}",
        dir.display()
    );
    run(Command::new(env!("CARGO"))
        .current_dir(workspace)
        .args([
            "rustc",
            "--quiet",
            "--locked",
            "--release",
            "-p",
            "gpu-node-agent-cdi-hook",
        ])
        .args(["--bin", "gpu-node-agent-cdi-hook", "--target-dir"])
        .arg(&dir)
        .args(["--", "-C", "target-feature=+crt-static"]));
    dir.join("release/gpu-node-agent-cdi-hook")
}

/// A small Debian-layout glibc image: the host's C library and a few common libraries in the
/// multiarch folder, `ld.so.conf` with `ld.so.conf.d/`, a stub `libcuda.so.<driver>` (as CDI
/// bind-mounts it) and the host's static `ldconfig` in `/sbin` (which the hooks before #32 ran).
fn make_image(at: &Path, work: &Path) {
    let lib = at.join(LIBDIR.trim_start_matches('/'));
    for dir in [
        lib.as_path(),
        &at.join("etc/ld.so.conf.d"),
        &at.join("sbin"),
        &at.join("lib64"),
        &at.join("usr/bin"),
        &at.join("usr/local/lib"),
        &at.join("tmp"),
        &at.join("proc"),
        &at.join("dev"),
    ] {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::os::unix::fs::symlink("usr/lib", at.join("lib")).expect("lib link");
    let host_libs = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"];
    let mut copied = 0;
    for name in [
        "ld-linux-x86-64.so.2",
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "libpthread.so.0",
        "librt.so.1",
        "libresolv.so.2",
        "libgcc_s.so.1",
        "libstdc++.so.6",
        "libz.so.1",
        "libtinfo.so.6",
        "libselinux.so.1",
        "libpcre2-8.so.0",
        "libacl.so.1",
        "libattr.so.1",
        "libcrypt.so.1",
        "libzstd.so.1",
        "liblzma.so.5",
        "libbz2.so.1.0",
        "libgmp.so.10",
    ] {
        if let Some(src) = host_libs.iter().map(|d| Path::new(d).join(name)).find(|p| p.exists()) {
            std::fs::copy(&src, lib.join(name)).expect("copy library");
            copied += 1;
        }
    }
    assert!(copied >= 2, "the host's libc and ld.so were not found");
    std::os::unix::fs::symlink(
        format!("{LIBDIR}/ld-linux-x86-64.so.2"),
        at.join("lib64/ld-linux-x86-64.so.2"),
    )
    .expect("ld.so link");
    std::fs::write(at.join("etc/ld.so.conf"), "include /etc/ld.so.conf.d/*.conf\n\n").expect("ld.so.conf");
    std::fs::write(
        at.join("etc/ld.so.conf.d/x86_64-linux-gnu.conf"),
        "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
    )
    .expect("conf");
    std::fs::write(
        at.join("etc/ld.so.conf.d/libc.conf"),
        "# libc default configuration\n/usr/local/lib\n",
    )
    .expect("conf");
    let ldconfig = ["/sbin/ldconfig.real", "/sbin/ldconfig"]
        .iter()
        .find(|p| Path::new(p).exists())
        .expect("the host's ldconfig");
    std::fs::copy(ldconfig, at.join("sbin/ldconfig")).expect("copy ldconfig");
    let src = work.join("cuda.c");
    std::fs::write(&src, "int cuInit(unsigned flags) { return (int)flags; }\n").expect("source");
    run(Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(lib.join(format!("libcuda.so.{DRIVER}")))
        .arg(&src));
    // The cache the image was built with.
    run(Command::new(ldconfig).arg("-r").arg(at));
}

/// One container: a bundle with `config.json` and a fresh copy of the image as `rootfs/`.
fn container(image: &Path, bundle: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(bundle);
    std::fs::create_dir_all(bundle).expect("bundle");
    std::fs::write(
        bundle.join("config.json"),
        r#"{"ociVersion":"1.0.2","root":{"path":"rootfs","readonly":false},"process":{"args":["sh"]}}"#,
    )
    .expect("config.json");
    let rootfs = bundle.join("rootfs");
    run(Command::new("cp").arg("-a").arg(image).arg(&rootfs));
    rootfs
}

/// Runs the four hooks for the container in `bundle`, as a runtime does; the wall time of each.
fn start(variant: &Variant, bundle: &Path, rootfs: &Path) -> [Duration; 4] {
    let state = format!(
        r#"{{"ociVersion":"1.0.2","id":"c","status":"creating","pid":1,"bundle":"{}"}}"#,
        bundle.display()
    );
    let mut took = [Duration::ZERO; 4];
    for (i, (name, args)) in hooks().into_iter().enumerate() {
        let started = Instant::now();
        let mut child = Command::new(&variant.program)
            .args(&variant.prefix)
            .arg(name)
            .args(&args)
            .current_dir(rootfs)
            .env_clear()
            .env("NVIDIA_CTK_DEBUG", "false")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", variant.program.display()));
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(state.as_bytes())
            .expect("state");
        let out = child.wait_with_output().expect("wait");
        took[i] = started.elapsed();
        assert!(
            out.status.success(),
            "{} {name}: {}",
            variant.label,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let link = rootfs.join(LIBDIR.trim_start_matches('/')).join("libcuda.so.1");
    assert!(link.exists(), "{}: no libcuda.so.1 in the container", variant.label);
    took
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        println!("hooks bench skipped: update-ldcache needs root (namespaces and chroot); CI runs as root");
        return;
    }
    let work = tempfile::Builder::new()
        .prefix("gna-hooks-bench")
        .tempdir()
        .expect("tempdir");
    let image = work.path().join("image");
    make_image(&image, work.path());
    let mut variants = Vec::new();
    if let Some(baseline) = std::env::var_os("GNA_HOOKS_BASELINE") {
        variants.push(Variant {
            label: "before",
            program: PathBuf::from(baseline),
            prefix: vec!["cdi", "hook"],
        });
    }
    variants.push(Variant {
        label: "after",
        program: static_hook_program(),
        prefix: vec![],
    });
    // Containers interleaved between the variants, so drift of the machine hits both alike.
    let mut times: Vec<[Vec<f64>; 5]> = variants.iter().map(|_| Default::default()).collect();
    let bundle = work.path().join("bundle");
    for round in 0..WARMUP + N {
        for (v, variant) in variants.iter().enumerate() {
            let rootfs = container(&image, &bundle);
            let took = start(variant, &bundle, &rootfs);
            if round >= WARMUP {
                for (i, t) in took.iter().enumerate() {
                    times[v][i].push(ms(*t));
                }
                times[v][4].push(ms(took.iter().sum()));
            }
        }
    }
    let names = [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-mod.",
    ];
    let mut rows = Vec::new();
    let mut totals = Vec::new();
    for (v, variant) in variants.iter().enumerate() {
        let columns: Vec<Vec<f64>> = times[v].iter().cloned().map(sorted).collect();
        for (i, name) in names.iter().enumerate() {
            rows.push(Row {
                what: leak(format!("{}: {name}, ms p50 / p99", variant.label)),
                value: format!(
                    "{:.2} / {:.2}",
                    percentile(&columns[i], 0.5),
                    percentile(&columns[i], 0.99)
                ),
                budget: "reference",
                ok: true,
            });
        }
        rows.push(Row {
            what: leak(format!(
                "{}: all four hooks, one container, ms p50 / p99",
                variant.label
            )),
            value: format!(
                "{:.2} / {:.2}",
                percentile(&columns[4], 0.5),
                percentile(&columns[4], 0.99)
            ),
            budget: "reference",
            ok: true,
        });
        totals.push(percentile(&columns[4], 0.5));
    }
    if let [before, after] = totals[..] {
        let ratio = after / before;
        rows.push(Row {
            what: "after / before, all four hooks, p50 ratio",
            value: format!("{ratio:.2}×"),
            budget: "≤ 2×",
            ok: ratio <= 2.0,
        });
    } else {
        println!("(set GNA_HOOKS_BASELINE to the agent binary of a commit before #32 for the \"before\" rows)");
    }
    println!(
        "\n{N} containers per variant, each hook a process with the OCI state on stdin, cwd the root, \
         the spec's env; image: {}",
        image.display()
    );
    table::print(&rows, 62);
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
