//! Building kernel modules with kbuild against one kernel's headers: NVIDIA's `kernel-open/` or
//! `kernel/` tree from a `.run`, or any out-of-tree module (the test fixture).
//!
//! - [`build`] runs make, collects the `*.ko` files and checks that each one's vermagic names the
//!   kernel it was built for, so a module for the wrong kernel is never handed to the loader.
//! - [`installed_headers`] lists the kernels whose headers are installed under the root.
//!
//! Two make forms, picked from the tree's own `Makefile`:
//! - NVIDIA's trees drive kbuild themselves (their Makefile reads `SYSSRC`/`SYSOUT` and passes
//!   `NV_KERNEL_SOURCES`/`NV_KERNEL_OUTPUT` to their Kbuild, which the conftest needs), so they
//!   get `make -C <tree> SYSSRC=<sources> SYSOUT=<headers> -j<n> modules`, the call
//!   `nvidia-installer` makes. `<sources>` is the kernel's `source` tree where the distribution
//!   splits it from the build tree (Debian's `-common` headers), as NVIDIA's Makefile would pick
//!   itself.
//! - Any other tree gets plain kbuild: `make -C <headers> M=<tree> -j<n> modules`.
//!
//! Make runs on this machine, so the paths it gets are the rooted ones. With a root prefix other
//! than `/`, the headers' own absolute symlinks and includes must make sense there too.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::host::HostRoot;
use crate::host::command::{Cmd, CmdError, Runner};

use super::MODULES;
use super::observe::resolve_in_root;

/// The make used when the request names none (a host path).
pub const DEFAULT_MAKE: &str = "/usr/bin/make";

/// How long one kbuild may run: NVIDIA's modules take a few minutes on a big machine and much
/// longer on a small one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Where modinfo lives (host paths), first match wins: kmod installs it in `/sbin` on older
/// distributions and `/usr/sbin` on merged-/usr ones.
pub const MODINFO_CANDIDATES: [&str; 3] = ["/usr/sbin/modinfo", "/sbin/modinfo", "/usr/bin/modinfo"];

/// Compiler error lines quoted in a [`BuildError::Make`], at most.
const QUOTED_ERRORS: usize = 8;

/// Output lines quoted in a [`BuildError::Make`] when no compiler error line is recognised.
const QUOTED_TAIL: usize = 15;

/// One kbuild of a source tree for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRequest {
    /// Host path of the kbuild source tree (NVIDIA's `kernel-open/` or `kernel/`, or any
    /// out-of-tree module). The modules are built in place.
    pub source_dir: PathBuf,
    /// Host path of the kernel's build tree, normally `/lib/modules/<release>/build`.
    pub headers: PathBuf,
    /// The kernel the modules are for (`uname -r` of the target kernel).
    pub kernel_release: String,
    /// `make -j`.
    pub jobs: u32,
    /// Host path of make.
    pub make: PathBuf,
    /// More `make` arguments (`CC=gcc-12`, `IGNORE_CC_MISMATCH=1`, …), after the standard ones.
    pub extra_make_args: Vec<String>,
    /// Kill make after this long.
    pub timeout: Duration,
}

impl BuildRequest {
    /// A request with the defaults: `/lib/modules/<release>/build`, one job per CPU,
    /// [`DEFAULT_MAKE`], [`DEFAULT_TIMEOUT`].
    pub fn new(source_dir: impl Into<PathBuf>, kernel_release: &str) -> BuildRequest {
        let jobs = std::thread::available_parallelism()
            .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
            .unwrap_or(1);
        BuildRequest {
            source_dir: source_dir.into(),
            headers: PathBuf::from(format!("/lib/modules/{kernel_release}/build")),
            kernel_release: kernel_release.to_string(),
            jobs,
            make: PathBuf::from(DEFAULT_MAKE),
            extra_make_args: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// What a build produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// The `.ko` files (rooted paths), the driver's in [`MODULES`] load order, then the others by
    /// name.
    pub modules: Vec<PathBuf>,
    /// The modules' vermagic (`6.1.0-18-amd64 SMP preempt mod_unload modversions`).
    pub vermagic: String,
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "no kernel headers for {release} in {}: install {} (Debian/Ubuntu) or {} (RHEL)",
        looked_in.display(),
        headers_packages(release)[0],
        headers_packages(release)[1]
    )]
    MissingHeaders { release: String, looked_in: PathBuf },
    #[error(
        "the kernel headers in {} are for {found}, not {release}: install {}",
        headers.display(),
        headers_packages(release)[0]
    )]
    HeadersMismatch {
        release: String,
        headers: PathBuf,
        found: String,
    },
    #[error("no kbuild source tree at {}: {source}", dir.display())]
    MissingSource { dir: PathBuf, source: io::Error },
    #[error("kbuild of {} for {release} failed: {detail}", dir.display())]
    Make {
        dir: PathBuf,
        release: String,
        /// The command line, its exit status and the compiler's error lines (else the end of
        /// its output).
        detail: String,
    },
    #[error("kbuild of {} succeeded but produced no *.ko", dir.display())]
    NoModules { dir: PathBuf },
    #[error("cannot list the modules built in {}: {source}", dir.display())]
    Collect { dir: PathBuf, source: io::Error },
    #[error(
        "{} was built for another kernel: vermagic {vermagic:?} does not start with {release:?}",
        module.display()
    )]
    Vermagic {
        module: PathBuf,
        vermagic: String,
        release: String,
    },
    #[error("cannot read a module's vermagic: {0}")]
    Modinfo(CmdError),
}

/// The headers packages for a kernel: Debian/Ubuntu's, then RHEL's.
pub fn headers_packages(release: &str) -> [String; 2] {
    [format!("linux-headers-{release}"), format!("kernel-devel-{release}")]
}

/// Builds `req.source_dir` for `req.kernel_release` and checks the result.
pub fn build(runner: &Runner, root: &HostRoot, req: &BuildRequest) -> Result<Built, BuildError> {
    let headers = resolve(root, &req.headers);
    if !headers.join("Makefile").is_file() {
        return Err(BuildError::MissingHeaders {
            release: req.kernel_release.clone(),
            looked_in: req.headers.clone(),
        });
    }
    if let Some(found) = uts_release(&headers)
        && found != req.kernel_release
    {
        return Err(BuildError::HeadersMismatch {
            release: req.kernel_release.clone(),
            headers: req.headers.clone(),
            found,
        });
    }
    let source_dir = root.join(&req.source_dir);
    let makefile = fs::read_to_string(source_dir.join("Makefile")).map_err(|source| BuildError::MissingSource {
        dir: req.source_dir.clone(),
        source,
    })?;
    let cmd = make_command(root, req, &headers, &source_dir, &makefile);
    tracing::info!(command = %cmd, release = %req.kernel_release, "building kernel modules");
    runner.run(&cmd).map_err(|e| BuildError::Make {
        dir: req.source_dir.clone(),
        release: req.kernel_release.clone(),
        detail: make_failure(&e),
    })?;

    let modules = collect_modules(&source_dir).map_err(|source| BuildError::Collect {
        dir: req.source_dir.clone(),
        source,
    })?;
    if modules.is_empty() {
        return Err(BuildError::NoModules {
            dir: req.source_dir.clone(),
        });
    }
    let modinfo = MODINFO_CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| runner.exists(p))
        .unwrap_or_else(|| PathBuf::from(MODINFO_CANDIDATES[0]));
    let mut vermagic = String::new();
    for module in &modules {
        let out = runner
            .run(&Cmd::new(&modinfo).args(["-F", "vermagic"]).arg(module))
            .map_err(BuildError::Modinfo)?;
        let magic = out.stdout.trim().to_string();
        if !vermagic_matches(&magic, &req.kernel_release) {
            return Err(BuildError::Vermagic {
                module: module.clone(),
                vermagic: magic,
                release: req.kernel_release.clone(),
            });
        }
        if vermagic.is_empty() {
            vermagic = magic;
        }
    }
    Ok(Built { modules, vermagic })
}

/// Whether a vermagic (`<release> SMP preempt …`) names `release`.
fn vermagic_matches(vermagic: &str, release: &str) -> bool {
    vermagic == release || vermagic.strip_prefix(release).is_some_and(|rest| rest.starts_with(' '))
}

/// The make call for the tree: NVIDIA's form when its Makefile takes `SYSSRC`, kbuild's `M=`
/// otherwise. `headers` and `source_dir` are rooted.
fn make_command(root: &HostRoot, req: &BuildRequest, headers: &Path, source_dir: &Path, makefile: &str) -> Cmd {
    let cmd = Cmd::new(&req.make).env("LC_ALL", "C").timeout(req.timeout).arg("-C");
    let cmd = if makefile.contains("SYSSRC") {
        let sources = kernel_sources(root, &req.headers).unwrap_or_else(|| headers.to_path_buf());
        cmd.arg(source_dir)
            .arg(key_value("SYSSRC", &sources))
            .arg(key_value("SYSOUT", headers))
    } else {
        cmd.arg(headers).arg(key_value("M", source_dir))
    };
    cmd.arg(format!("-j{}", req.jobs.max(1)))
        .arg("modules")
        .args(&req.extra_make_args)
}

fn key_value(key: &str, path: &Path) -> std::ffi::OsString {
    let mut word = std::ffi::OsString::from(format!("{key}="));
    word.push(path);
    word
}

/// The kernel's source tree when the distribution ships it apart from the build tree
/// (`/lib/modules/<release>/source`, or `<build>/source`), rooted; what NVIDIA's Makefile and
/// nvidia-installer use as `SYSSRC`.
fn kernel_sources(root: &HostRoot, headers: &Path) -> Option<PathBuf> {
    let sibling = headers
        .file_name()
        .filter(|n| *n == "build")
        .and_then(|_| headers.parent())
        .map(|modlib| modlib.join("source"));
    sibling
        .into_iter()
        .chain([headers.join("source")])
        .map(|p| resolve(root, &p))
        .find(|p| p.join("Makefile").is_file())
}

/// What a failed make said: the command, its status, and the compiler's and modpost's error
/// lines (kbuild's `make[2]: *** … Error 1` lines only say that something failed), else the end
/// of its output.
fn make_failure(e: &CmdError) -> String {
    let CmdError::Failed {
        cmd,
        status,
        stdout,
        stderr,
    } = e
    else {
        return e.to_string();
    };
    let lines = || stderr.lines().chain(stdout.lines()).map(str::trim_end);
    let errors: Vec<&str> = lines()
        .filter(|l| l.contains("error:") || l.contains("Error:") || l.contains("ERROR:"))
        .take(QUOTED_ERRORS)
        .collect();
    let quoted = if errors.is_empty() {
        let all: Vec<&str> = if stderr.trim().is_empty() {
            stdout.lines().collect()
        } else {
            stderr.lines().collect()
        };
        all[all.len().saturating_sub(QUOTED_TAIL)..].join("\n")
    } else {
        errors.join("\n")
    };
    format!("{cmd} exited with {status}:\n{}", quoted.trim())
}

/// Every `*.ko` under `dir` (symlinks not followed), in [`MODULES`] load order, then by path.
fn collect_modules(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in fs::read_dir(&d)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            let path = entry.path();
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() && path.extension().is_some_and(|e| e == "ko") {
                found.push(path);
            }
        }
    }
    found.sort_by_key(|p| (load_rank(p), p.clone()));
    Ok(found)
}

/// Position of a module file in [`MODULES`] (`nvidia-uvm.ko` and `nvidia_uvm.ko` alike), or past
/// the end.
pub(crate) fn load_rank(path: &Path) -> usize {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().replace('_', "-"))
        .unwrap_or_default();
    MODULES.iter().position(|m| *m == stem).unwrap_or(MODULES.len())
}

/// `UTS_RELEASE` from a build tree's `include/generated/utsrelease.h`: the release its modules'
/// vermagic will carry. (`include/config/kernel.release` is not it on Debian, which builds with
/// the upstream version there.)
fn uts_release(build_dir: &Path) -> Option<String> {
    let text = fs::read_to_string(build_dir.join("include/generated/utsrelease.h")).ok()?;
    text.lines().find_map(|l| {
        let rest = l.trim().strip_prefix("#define UTS_RELEASE")?;
        Some(rest.trim().trim_matches('"').to_string())
    })
}

/// Every kernel whose headers are installed under the root: `(release, host path of its build
/// tree)`, by release. `/lib/modules/<release>/build` with a Makefile first; then build trees
/// under `/usr/src/linux-headers-*` and `/usr/src/kernels/*` that no module directory links to,
/// named by their `UTS_RELEASE`.
pub fn installed_headers(root: &HostRoot) -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    for (release, _) in dir_entries(&root.join("/lib/modules")) {
        let build = PathBuf::from("/lib/modules").join(&release).join("build");
        if resolve(root, &build).join("Makefile").is_file() {
            found.push((release, build));
        }
    }
    for (base, prefix) in [("/usr/src", "linux-headers-"), ("/usr/src/kernels", "")] {
        for (name, _) in dir_entries(&root.join(base)) {
            if !name.starts_with(prefix) {
                continue;
            }
            let dir = Path::new(base).join(&name);
            let rooted = root.join(&dir);
            // Debian's `-common` half has a Makefile but no generated headers: not a build tree.
            if !rooted.join("Makefile").is_file() {
                continue;
            }
            if let Some(release) = uts_release(&rooted)
                && !found.iter().any(|(r, _)| *r == release)
            {
                found.push((release, dir));
            }
        }
    }
    found.sort();
    found
}

/// The entries of a directory by name; nothing when it cannot be read.
fn dir_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok().map(|n| (n, e.path())))
        .collect();
    out.sort();
    out
}

/// A host path as a rooted path with its symlinks resolved inside the root
/// ([`resolve_in_root`]): `/lib/modules/<r>/build` links to the absolute
/// `/usr/src/linux-headers-<r>`, which must not leave the root. A symlink loop is left as it is
/// (the existence checks then fail on it).
fn resolve(root: &HostRoot, host_path: &Path) -> PathBuf {
    root.join(resolve_in_root(root, host_path).unwrap_or_else(|| host_path.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const RELEASE: &str = "6.1.0-18-amd64";

    fn write(root: &Path, path: &str, body: &str) {
        let p = root.join(path.trim_start_matches('/'));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, body).unwrap();
    }

    fn script(root: &Path, path: &str, body: &str) {
        write(root, path, &format!("#!/bin/sh\n{body}\n"));
        let p = root.join(path.trim_start_matches('/'));
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A root with Debian-style split headers for [`RELEASE`], a make that logs its argv and
    /// "builds" the modules named in `$KOS` into the tree, and a modinfo that prints `$MAGIC`.
    fn fake_root(kos: &str, magic: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let common = format!("/usr/src/linux-headers-{RELEASE}-common");
        let build = format!("/usr/src/linux-headers-{RELEASE}");
        write(r, &format!("{common}/Makefile"), "# source\n");
        write(r, &format!("{build}/Makefile"), &format!("include {common}/Makefile\n"));
        write(
            r,
            &format!("{build}/include/generated/utsrelease.h"),
            &format!("#define UTS_RELEASE \"{RELEASE}\"\n"),
        );
        fs::create_dir_all(r.join(format!("lib/modules/{RELEASE}"))).unwrap();
        std::os::unix::fs::symlink(&build, r.join(format!("lib/modules/{RELEASE}/build"))).unwrap();
        std::os::unix::fs::symlink(&common, r.join(format!("lib/modules/{RELEASE}/source"))).unwrap();
        let log = r.join("make.log");
        script(
            r,
            "/usr/bin/make",
            &format!(
                "echo \"$@\" > {log}\nwhile [ $# -gt 0 ]; do case \"$1\" in M=*) out=${{1#M=}};; -C) shift; c=$1;; esac; shift; done\n\
                 [ -n \"$out\" ] || out=$c\nfor k in {kos}; do mkdir -p \"$out/$(dirname $k)\"; echo elf > \"$out/$k\"; done",
                log = log.display()
            ),
        );
        script(r, "/sbin/modinfo", &format!("echo '{magic}'"));
        dir
    }

    fn request(root: &Path, tree: &str, makefile: &str) -> BuildRequest {
        write(root, &format!("{tree}/Makefile"), makefile);
        BuildRequest {
            jobs: 4,
            ..BuildRequest::new(tree, RELEASE)
        }
    }

    fn make_argv(root: &Path) -> String {
        fs::read_to_string(root.join("make.log")).unwrap().trim().to_string()
    }

    #[test]
    fn a_plain_tree_gets_kbuild_m_and_its_modules_come_back_checked() {
        let dir = fake_root("sub/b.ko a.ko", &format!("{RELEASE} SMP preempt mod_unload "));
        let root = HostRoot::new(dir.path());
        let req = request(dir.path(), "/src/hello", "obj-m += a.o\n");
        let built = build(&Runner::new(&root), &root, &req).unwrap();
        let r = dir.path().display();
        assert_eq!(
            make_argv(dir.path()),
            format!("-C {r}/usr/src/linux-headers-{RELEASE} M={r}/src/hello -j4 modules"),
            "the symlinked build tree is resolved under the root"
        );
        assert_eq!(
            built.modules,
            vec![dir.path().join("src/hello/a.ko"), dir.path().join("src/hello/sub/b.ko")]
        );
        assert_eq!(built.vermagic, format!("{RELEASE} SMP preempt mod_unload"));
    }

    #[test]
    fn an_nvidia_tree_gets_its_own_makefile_with_syssrc_and_sysout() {
        let dir = fake_root("nvidia-modeset.ko nvidia-drm.ko nvidia.ko nvidia-uvm.ko", RELEASE);
        let root = HostRoot::new(dir.path());
        let mut req = request(
            dir.path(),
            "/run/gna/kernel-open",
            "ifdef SYSSRC\n  KERNEL_SOURCES := $(SYSSRC)\nendif\n",
        );
        req.extra_make_args = vec!["IGNORE_CC_MISMATCH=1".into()];
        let built = build(&Runner::new(&root), &root, &req).unwrap();
        let r = dir.path().display();
        assert_eq!(
            make_argv(dir.path()),
            format!(
                "-C {r}/run/gna/kernel-open SYSSRC={r}/usr/src/linux-headers-{RELEASE}-common \
                 SYSOUT={r}/usr/src/linux-headers-{RELEASE} -j4 modules IGNORE_CC_MISMATCH=1"
            )
        );
        let names: Vec<_> = built
            .modules
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko", "nvidia-drm.ko"],
            "load order"
        );
    }

    #[test]
    fn missing_or_foreign_headers_fail_before_make_runs() {
        let dir = fake_root("a.ko", RELEASE);
        let root = HostRoot::new(dir.path());
        let mut req = request(dir.path(), "/src/hello", "obj-m += a.o\n");
        req.kernel_release = "6.8.0-31-generic".into();
        req.headers = "/lib/modules/6.8.0-31-generic/build".into();
        let e = build(&Runner::new(&root), &root, &req).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no kernel headers for 6.8.0-31-generic in /lib/modules/6.8.0-31-generic/build: install \
             linux-headers-6.8.0-31-generic (Debian/Ubuntu) or kernel-devel-6.8.0-31-generic (RHEL)"
        );
        req.headers = format!("/lib/modules/{RELEASE}/build").into();
        let e = build(&Runner::new(&root), &root, &req).unwrap_err();
        assert!(
            matches!(e, BuildError::HeadersMismatch { ref found, .. } if found == RELEASE),
            "{e}"
        );
        assert!(!dir.path().join("make.log").exists(), "make never ran");
    }

    #[test]
    fn a_module_for_another_kernel_is_refused() {
        let dir = fake_root("a.ko", "6.1.0-17-amd64 SMP preempt mod_unload");
        let root = HostRoot::new(dir.path());
        let req = request(dir.path(), "/src/hello", "obj-m += a.o\n");
        let e = build(&Runner::new(&root), &root, &req).unwrap_err();
        assert!(matches!(e, BuildError::Vermagic { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("a.ko") && msg.contains("6.1.0-17-amd64 SMP") && msg.contains(RELEASE),
            "{msg}"
        );
        // A release that is a prefix of the vermagic's is not the same kernel.
        assert!(!vermagic_matches("6.1.0-18-amd64-rt SMP", RELEASE));
        assert!(vermagic_matches(&format!("{RELEASE} SMP"), RELEASE));
    }

    #[test]
    fn no_modules_and_make_failures_are_reported() {
        let dir = fake_root("", RELEASE);
        let root = HostRoot::new(dir.path());
        let req = request(dir.path(), "/src/hello", "obj-m += a.o\n");
        let e = build(&Runner::new(&root), &root, &req).unwrap_err();
        assert!(matches!(e, BuildError::NoModules { .. }), "{e}");

        script(
            dir.path(),
            "/usr/bin/make",
            "echo '  CC [M]  /src/hello/a.o'\necho '/src/hello/a.c:3:1: error: unknown type name ‘in’' >&2\n\
             echo 'make[2]: *** [scripts/Makefile.build:250: /src/hello/a.o] Error 1' >&2\nexit 2",
        );
        let e = build(&Runner::new(&root), &root, &req).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, BuildError::Make { .. }), "{msg}");
        assert!(msg.contains("a.c:3:1: error: unknown type name"), "{msg}");
        assert!(msg.contains("exit status: 2"), "{msg}");
    }

    #[test]
    fn installed_headers_lists_build_trees_not_the_common_half() {
        let dir = fake_root("", RELEASE);
        write(
            dir.path(),
            "/usr/src/kernels/5.14.0-427.el9.x86_64/include/generated/utsrelease.h",
            "#define UTS_RELEASE \"5.14.0-427.el9.x86_64\"\n",
        );
        write(dir.path(), "/usr/src/kernels/5.14.0-427.el9.x86_64/Makefile", "");
        fs::create_dir_all(dir.path().join("lib/modules/6.1.0-9-amd64")).unwrap();
        let found = installed_headers(&HostRoot::new(dir.path()));
        assert_eq!(
            found,
            vec![
                (
                    "5.14.0-427.el9.x86_64".to_string(),
                    PathBuf::from("/usr/src/kernels/5.14.0-427.el9.x86_64")
                ),
                (
                    RELEASE.to_string(),
                    PathBuf::from(format!("/lib/modules/{RELEASE}/build"))
                ),
            ]
        );
    }
}
