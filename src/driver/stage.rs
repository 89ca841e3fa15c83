//! Carrying out a [`DriverPlan`]: every program through the command wrapper, every path under
//! the root prefix. Steps run in order and stop at the first failure, which names the step.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use super::build::{BuildError, BuildRequest, build};
use super::cache::{CacheError, CacheKey, CachedModules, ModuleCache};
use super::fetch::{FetchError, FetchOptions, fetch};
use super::observe::{self, HostFacts, ObserveError};
use super::plan::{self, Context, DriverPlan, LoadFrom, PackageManager, PlanError, Step};
use super::validate::{self, Check, Loader, NvmlGpu, NvmlView, ValidationInput};
use crate::config::{Config, DriverSource};
use crate::host::command::{Cmd, CmdError, Runner};
use crate::host::{HostRoot, WriteError, write_atomic};

/// Systemd unit directories (host paths) searched for optional services.
const UNIT_DIRS: [&str; 3] = ["/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system"];

/// The driver's services that hold it open, in start order: stopped (the other way round) where
/// active before the old modules are unloaded, started again once the new ones are loaded.
const DRIVER_UNITS: [&str; 2] = ["nvidia-persistenced.service", "nvidia-fabricmanager.service"];

/// How long a package install may take (downloads, DKMS builds).
const PACKAGE_TIMEOUT: Duration = Duration::from_secs(45 * 60);
/// How long apt waits for another apt/dpkg to release its lock.
const APT_LOCK_TIMEOUT_S: u32 = 600;

/// Why the driver stage failed; what was done before the failing step stays (every step can be
/// repeated: the next pass plans again from what the host shows).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Observe(#[from] ObserveError),
    #[error("{0}; nothing was changed")]
    Plan(#[from] PlanError),
    #[error("{step}: {source}")]
    Command { step: String, source: CmdError },
    #[error("{step}: none of {} exists", candidates.join(", "))]
    MissingProgram { step: String, candidates: Vec<String> },
    #[error("download: {0}")]
    Fetch(#[from] FetchError),
    #[error("{0}")]
    Build(#[from] BuildError),
    #[error("module cache: {0}")]
    Cache(#[from] CacheError),
    #[error("{0}")]
    Write(#[from] WriteError),
    #[error("{step}: {message}")]
    Step { step: String, message: String },
    /// The packages installed and loaded, but the loaded driver is not the one asked for.
    #[error("{0}")]
    OtherVersion(String),
}

/// What the driver stage found and decided.
#[derive(Debug, Clone)]
pub struct Planned {
    pub facts: HostFacts,
    pub plan: DriverPlan,
    /// Set for `runfile` and `prebuilt`.
    pub cache_key: Option<CacheKey>,
}

/// The module cache (`<state_dir>/driver/cache` under the root).
pub fn cache(config: &Config, root: &HostRoot) -> ModuleCache {
    ModuleCache::new(root.join(config.agent.state_dir.join("driver/cache")))
}

/// The cache key of the wanted driver on this kernel (`runfile` and `prebuilt`).
pub fn cache_key(config: &Config, facts: &HostFacts) -> Option<CacheKey> {
    let d = &config.driver;
    let source = match d.source {
        DriverSource::Runfile => format!("runfile:{}", d.runfile_sha256.to_ascii_lowercase()),
        DriverSource::Prebuilt => format!(
            "prebuilt:{}",
            d.prebuilt_sha256.get(&facts.kernel_release)?.to_ascii_lowercase()
        ),
        DriverSource::None | DriverSource::Package => return None,
    };
    let params = d
        .module_params
        .iter()
        .flat_map(|(m, ps)| ps.iter().map(move |p| (m.clone(), p.clone())))
        .collect();
    Some(CacheKey {
        kernel_release: facts.kernel_release.clone(),
        driver_version: d.version.clone(),
        flavour: plan::flavour(d.flavour, &d.version),
        params,
        source,
    })
}

/// Observes the host and plans. `gpu_processes`: processes on the GPUs (NVML), `None` when
/// NVML is not up.
pub fn plan_now(config: &Config, root: &HostRoot, gpu_processes: Option<usize>) -> Result<Planned, DriverError> {
    plan_with(config, root, gpu_processes, None)
}

/// [`plan_now`], refusing to plan again a package install that `failed` for this kernel.
pub fn plan_with(
    config: &Config,
    root: &HostRoot,
    gpu_processes: Option<usize>,
    failed: Option<&FailedInstall>,
) -> Result<Planned, DriverError> {
    let facts = observe::observe(root)?;
    let cache_key = cache_key(config, &facts);
    let cached = match &cache_key {
        Some(key) => cache(config, root).lookup(key)?.is_some(),
        None => false,
    };
    let modprobe_conf = std::fs::read_to_string(root.join(&config.driver.modprobe_conf)).ok();
    let ctx = Context {
        gpu_processes,
        cached,
        modprobe_conf,
        failed_install: failed
            .filter(|f| f.kernel_release == facts.kernel_release)
            .map(|f| f.message.clone()),
    };
    let plan = plan::plan(&config.driver, &facts, &ctx)?;
    Ok(Planned { facts, plan, cache_key })
}

/// A package install whose loaded driver was not the one asked for: the daemon remembers it
/// (its driver stage's one memory of what not to try again) and passes it to [`plan_with`], so
/// every pass does not install the same packages again while the kernel stays the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedInstall {
    /// The kernel it was for.
    pub kernel_release: String,
    /// What happened, as the stage reported it.
    pub message: String,
}

/// Runs the host programs of the driver stage.
struct Host<'a> {
    config: &'a Config,
    root: &'a HostRoot,
    runner: Runner,
}

impl Host<'_> {
    /// The first of `candidates` (host paths) that exists under the root.
    fn program(&self, step: &str, candidates: &[&str]) -> Result<PathBuf, DriverError> {
        candidates
            .iter()
            .map(PathBuf::from)
            .find(|p| self.runner.exists(p))
            .ok_or_else(|| DriverError::MissingProgram {
                step: step.into(),
                candidates: candidates.iter().map(|c| c.to_string()).collect(),
            })
    }

    fn run(&self, step: &str, cmd: Cmd) -> Result<String, DriverError> {
        tracing::info!("driver: {cmd}");
        self.runner
            .run(&cmd)
            .map(|o| o.stdout)
            .map_err(|source| DriverError::Command {
                step: step.into(),
                source,
            })
    }

    fn modprobe(&self) -> Result<PathBuf, DriverError> {
        self.program("modprobe", &["/usr/sbin/modprobe", "/sbin/modprobe"])
    }

    fn unit_exists(&self, unit: &str) -> bool {
        UNIT_DIRS
            .iter()
            .any(|d| self.root.join(Path::new(d).join(unit)).is_file())
    }

    /// A host path under the state dir, as a host path (for commands) and rooted (for files).
    fn state_path(&self, rel: &str) -> PathBuf {
        self.config.agent.state_dir.join(rel)
    }
}

/// What an apply did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// One line per step done.
    pub done: Vec<String>,
    /// The modules were built (a cache miss).
    pub built: bool,
}

/// What the steps done so far left for the next ones.
#[derive(Default)]
struct Progress {
    /// The verified download (rooted).
    download: Option<PathBuf>,
    /// The extracted `.run` (host path), once built.
    runfile_work: Option<PathBuf>,
    /// The driver's services stopped for the change, in start order; emptied once started again.
    stopped: Vec<&'static str>,
    /// Services started again after the load (the persistence step leaves them be).
    restarted: Vec<&'static str>,
}

/// Applies `planned.plan` (which must not be waiting). Blocking; downloads run on the current
/// tokio runtime when there is one, else on a private one. When a step fails after the driver's
/// services were stopped, they are started again (the old driver may still be loaded).
///
/// `stop` (the daemon's SIGTERM) kills a running build or command at once (package managers and
/// the installer are waited for): the step fails, the services stopped for it are started
/// again, and the next start plans from what is on the host.
pub fn apply(
    config: &Config,
    root: &HostRoot,
    planned: &Planned,
    stop: Option<&CancellationToken>,
) -> Result<Applied, DriverError> {
    let runner = Runner::new(root);
    let host = Host {
        config,
        root,
        runner: match stop {
            Some(stop) => runner.with_stop(stop),
            None => runner,
        },
    };
    let mut applied = Applied::default();
    let mut progress = Progress::default();
    let started = Instant::now();
    let result =
        apply_steps(&host, planned, &mut applied, &mut progress).and_then(|()| check_installed(&host, planned));
    if let Err(e) = &result {
        for unit in std::mem::take(&mut progress.stopped) {
            match start_unit(&host, unit) {
                Ok(()) => applied.done.push(format!("started {unit} again")),
                Err(start) => tracing::warn!("driver: after the failed change ({e}): {start}"),
            }
        }
    }
    result?;
    tracing::info!(
        "driver stage: {} step(s) in {:?}",
        planned.plan.steps.len(),
        started.elapsed()
    );
    Ok(applied)
}

fn apply_steps(
    host: &Host<'_>,
    planned: &Planned,
    applied: &mut Applied,
    progress: &mut Progress,
) -> Result<(), DriverError> {
    let root = host.root;
    for step in &planned.plan.steps {
        match step {
            Step::WriteModprobeConf { path, text } => {
                write_atomic(&root.join(path), text.as_bytes(), 0o644)?;
                applied.done.push(format!("wrote {path}"));
            }
            Step::UnloadNouveau => {
                host.run("unload nouveau", Cmd::new(host.modprobe()?).args(["-r", "nouveau"]))?;
                applied.done.push("unloaded nouveau".into());
            }
            Step::Unload { modules } => {
                let rmmod = host.program("unload the driver", &["/usr/sbin/rmmod", "/sbin/rmmod"])?;
                for unit in DRIVER_UNITS.iter().rev() {
                    if unit_active(host, unit) {
                        host.run(
                            &format!("stop {unit}"),
                            Cmd::new(&host.config.runtime.systemctl).args(["stop", unit]),
                        )?;
                        progress.stopped.insert(0, unit);
                        applied.done.push(format!("stopped {unit}"));
                    }
                }
                for m in modules {
                    host.run(&format!("unload {m}"), Cmd::new(&rmmod).arg(m))?;
                }
                applied.done.push(format!("unloaded {}", modules.join(", ")));
            }
            Step::InstallPackages { manager, packages } => {
                install_packages(host, *manager, packages)?;
                applied.done.push(format!("installed {}", packages.join(" ")));
            }
            Step::Download { url, sha256 } => {
                let name = url.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("download");
                let dest = root.join(host.state_path("driver/downloads").join(name));
                if let Some(dir) = dest.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| DriverError::Step {
                        step: "download".into(),
                        message: format!("cannot create {}: {e}", dir.display()),
                    })?;
                }
                let fetched = download_blocking(url, sha256, &dest)?;
                applied.done.push(format!(
                    "{} {url} ({} bytes, sha256 verified)",
                    if fetched.cached { "already had" } else { "downloaded" },
                    fetched.bytes
                ));
                progress.download = Some(dest);
            }
            Step::BuildRunfile { flavour } => {
                let runfile = progress.download.as_ref().ok_or_else(|| DriverError::Step {
                    step: "build".into(),
                    message: "no downloaded .run file".into(),
                })?;
                let key = planned.cache_key.as_ref().ok_or_else(|| DriverError::Step {
                    step: "build".into(),
                    message: "no cache key".into(),
                })?;
                progress.runfile_work = Some(build_runfile(host, &planned.facts, runfile, *flavour, key)?);
                applied.built = true;
                applied.done.push(format!(
                    "built the {} modules for {} and cached them",
                    flavour.as_str(),
                    planned.facts.kernel_release
                ));
            }
            Step::InstallUserSpace => {
                let work = progress.runfile_work.as_ref().ok_or_else(|| DriverError::Step {
                    step: "install the user space".into(),
                    message: "no extracted .run file".into(),
                })?;
                if install_user_space(host, work)? {
                    applied.done.push("installed the driver's user space".into());
                }
            }
            Step::UnpackPrebuilt => {
                let tarball = progress.download.as_ref().ok_or_else(|| DriverError::Step {
                    step: "unpack".into(),
                    message: "no downloaded tarball".into(),
                })?;
                let key = planned.cache_key.as_ref().ok_or_else(|| DriverError::Step {
                    step: "unpack".into(),
                    message: "no cache key".into(),
                })?;
                unpack_prebuilt(host, tarball, key)?;
                applied.done.push("unpacked the prebuilt modules into the cache".into());
            }
            Step::Load { from, modules } => {
                load(host, planned, *from, modules)?;
                applied.done.push(format!("loaded {}", modules.join(", ")));
                // The services stopped for the change come back on the new driver.
                while !progress.stopped.is_empty() {
                    let unit = progress.stopped.remove(0);
                    start_unit(host, unit)?;
                    progress.restarted.push(unit);
                    applied.done.push(format!("started {unit} again"));
                }
            }
            Step::Persistence => {
                persistence(host, &progress.restarted)?;
                applied.done.push("persistence mode on".into());
            }
        }
    }
    Ok(())
}

/// After a package install: the loaded driver must be the one asked for. When it is not, the
/// stage fails naming both and the packages ([`DriverError::OtherVersion`]; the daemon does not
/// try the same install again, see [`FailedInstall`]).
fn check_installed(host: &Host<'_>, planned: &Planned) -> Result<(), DriverError> {
    let d = &host.config.driver;
    let packages: Vec<&str> = planned
        .plan
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::InstallPackages { packages, .. } if d.source == DriverSource::Package => Some(packages),
            _ => None,
        })
        .flatten()
        .map(String::as_str)
        .collect();
    if packages.is_empty() {
        return Ok(());
    }
    let loaded = observe::loaded_driver(host.root)?.and_then(|l| l.version);
    let Some(loaded) = loaded else {
        // Validation says what is missing.
        return Ok(());
    };
    if plan::satisfies(d, &planned.facts, &loaded) {
        return Ok(());
    }
    let wanted = plan::accepted_version(d, &planned.facts);
    let message = format!(
        "installed {} but the loaded driver is {loaded}, not the {wanted} [driver] version asks for: the package \
         archive has another version; set [driver] version to {loaded}, or change [driver.package_names] (not \
         installed again until [driver] or the kernel changes, or the agent restarts)",
        packages.join(" ")
    );
    Err(DriverError::OtherVersion(message))
}

/// Whether `unit` is installed and active (`systemctl is-active`).
fn unit_active(host: &Host<'_>, unit: &str) -> bool {
    let systemctl = &host.config.runtime.systemctl;
    host.unit_exists(unit)
        && host.runner.exists(systemctl)
        && host
            .runner
            .output(&Cmd::new(systemctl).args(["is-active", "--quiet", unit]))
            .is_ok_and(|o| o.success())
}

fn start_unit(host: &Host<'_>, unit: &str) -> Result<(), DriverError> {
    host.run(
        &format!("start {unit}"),
        Cmd::new(&host.config.runtime.systemctl).args(["start", unit]),
    )
    .map(|_| ())
}

fn install_packages(host: &Host<'_>, manager: PackageManager, packages: &[String]) -> Result<(), DriverError> {
    match manager {
        PackageManager::Apt => {
            let apt = host.program("install packages", &["/usr/bin/apt-get"])?;
            let lock = format!("DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}");
            let base = || {
                Cmd::new(&apt)
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .args(["-o", lock.as_str()])
                    .timeout(PACKAGE_TIMEOUT)
                    .finish_on_stop()
            };
            // An install interrupted before (a crash, a reboot, SIGKILL) leaves dpkg half-done
            // and apt refusing everything until it is finished.
            if dpkg_interrupted(host.root) {
                let dpkg = host.program("finish an interrupted package install", &["/usr/bin/dpkg"])?;
                tracing::warn!("driver: a package install was interrupted before: dpkg --configure -a");
                host.run(
                    "dpkg --configure -a",
                    Cmd::new(&dpkg)
                        .env("DEBIAN_FRONTEND", "noninteractive")
                        .args(["--configure", "-a"])
                        .timeout(PACKAGE_TIMEOUT)
                        .finish_on_stop(),
                )?;
            }
            host.run("apt-get update", base().args(["-q", "update"]))?;
            host.run(
                "apt-get install",
                base()
                    .args(["-y", "-q", "--no-install-recommends", "install"])
                    .args(packages),
            )?;
        }
        PackageManager::Dnf => {
            let dnf = host.program("install packages", &["/usr/bin/dnf", "/usr/bin/yum"])?;
            // An rpm transaction interrupted before leaves both versions of a package in the
            // database; dnf removes the older ones (yum has no such command: left as it is).
            if dnf.ends_with("dnf")
                && host
                    .runner
                    .output(&Cmd::new(&dnf).args(["-q", "check", "--duplicates"]))
                    .is_ok_and(|o| !o.success())
            {
                tracing::warn!("driver: an rpm transaction was interrupted before: dnf remove --duplicates");
                host.run(
                    "dnf remove --duplicates",
                    Cmd::new(&dnf)
                        .args(["-y", "-q", "remove", "--duplicates"])
                        .timeout(PACKAGE_TIMEOUT)
                        .finish_on_stop(),
                )?;
            }
            host.run(
                "dnf install",
                Cmd::new(&dnf)
                    .args(["-y", "-q", "install"])
                    .args(packages)
                    .timeout(PACKAGE_TIMEOUT)
                    .finish_on_stop(),
            )?;
        }
    }
    Ok(())
}

/// Whether dpkg was interrupted mid-install: what apt checks before refusing to run ("dpkg was
/// interrupted, you must manually run 'dpkg --configure -a'"), files left in its updates dir.
fn dpkg_interrupted(root: &HostRoot) -> bool {
    std::fs::read_dir(root.join("/var/lib/dpkg/updates")).is_ok_and(|mut entries| entries.next().is_some())
}

fn download_blocking(url: &str, sha256: &str, dest: &Path) -> Result<super::fetch::Fetched, DriverError> {
    let opts = FetchOptions::default();
    let client = opts.client_builder(url).build().map_err(|e| DriverError::Step {
        step: "download".into(),
        message: format!("cannot build an HTTP client: {e}"),
    })?;
    let run = async { fetch(&client, url, sha256, dest, &opts).await };
    let result = match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.block_on(run),
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DriverError::Step {
                step: "download".into(),
                message: format!("cannot start an async runtime: {e}"),
            })?
            .block_on(run),
    };
    Ok(result?)
}

/// A fresh work directory under the state dir (host path), emptied first.
fn work_dir(host: &Host<'_>, name: &str) -> Result<PathBuf, DriverError> {
    let dir = host.state_path("driver/work").join(name);
    let rooted = host.root.join(&dir);
    let fail = |e: std::io::Error| DriverError::Step {
        step: "prepare".into(),
        message: format!("{}: {e}", rooted.display()),
    };
    match std::fs::remove_dir_all(&rooted) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(fail(e)),
        _ => {}
    }
    std::fs::create_dir_all(&rooted).map_err(fail)?;
    Ok(dir)
}

/// Extracts the verified `.run` (never run before its sha256 matched: the download step only
/// leaves verified files) into a work directory under the state dir, builds its kernel modules
/// with kbuild and caches them. Returns the work directory (host path) for
/// [`install_user_space`]. Changes nothing outside the state dir.
fn build_runfile(
    host: &Host<'_>,
    facts: &HostFacts,
    runfile_rooted: &Path,
    flavour: super::Flavour,
    key: &CacheKey,
) -> Result<PathBuf, DriverError> {
    let work = work_dir(host, &format!("runfile-{}", key.digest()))?;
    let sh = host.program("extract the .run file", &["/bin/sh", "/usr/bin/sh"])?;
    // Programs resolve under the root, but run on this machine: their file arguments are rooted.
    host.run(
        "extract the .run file",
        Cmd::new(sh)
            .arg(runfile_rooted)
            .args(["-x", "--target"])
            .arg(host.root.join(&work))
            .timeout(Duration::from_secs(600)),
    )?;
    let source = work.join(match flavour {
        super::Flavour::Open => "kernel-open",
        super::Flavour::Proprietary => "kernel",
    });
    let mut req = BuildRequest::new(&source, &facts.kernel_release);
    if let Some(headers) = &facts.headers {
        req.headers = headers.clone();
    }
    let built = build(&host.runner, host.root, &req)?;
    cache_of(host).store(key, &built.modules)?;
    Ok(work)
}

/// Installs the extracted `.run`'s user space without its kernel modules (on the real root
/// only). `false` when there was nothing to run.
fn install_user_space(host: &Host<'_>, work: &Path) -> Result<bool, DriverError> {
    let installer = work.join("nvidia-installer");
    if !host.root.is_real() {
        tracing::warn!(
            "driver: --root is not /: the driver's user space is not installed (nvidia-installer runs on the node itself)"
        );
        return Ok(false);
    }
    if !host.runner.exists(&installer) {
        return Ok(false);
    }
    host.run(
        "install the user space",
        Cmd::new(&installer)
            .finish_on_stop()
            .args([
                "--silent",
                "--accept-license",
                "--no-kernel-module",
                "--no-drm",
                "--no-nouveau-check",
                "--no-nvidia-modprobe",
                "--no-rpms",
                "--no-backup",
                "--no-check-for-alternate-installs",
                "--no-libglx-indirect",
                "--no-install-libglvnd",
                "--x-prefix=/tmp/null",
                "--x-module-path=/tmp/null",
                "--x-library-path=/tmp/null",
                "--x-sysconfig-path=/tmp/null",
            ])
            .timeout(Duration::from_secs(1800)),
    )?;
    Ok(true)
}

fn unpack_prebuilt(host: &Host<'_>, tarball_rooted: &Path, key: &CacheKey) -> Result<CachedModules, DriverError> {
    let work = work_dir(host, &format!("prebuilt-{}", key.digest()))?;
    let tar = host.program("unpack", &["/usr/bin/tar", "/bin/tar"])?;
    host.run(
        "unpack",
        Cmd::new(tar)
            .arg("-xzf")
            .arg(tarball_rooted)
            .arg("-C")
            .arg(host.root.join(&work)),
    )?;
    let mut modules = Vec::new();
    collect_ko(&host.root.join(&work), &mut modules).map_err(|e| DriverError::Step {
        step: "unpack".into(),
        message: e.to_string(),
    })?;
    if modules.is_empty() {
        return Err(DriverError::Step {
            step: "unpack".into(),
            message: "the tarball holds no *.ko".into(),
        });
    }
    Ok(cache_of(host).store(key, &modules)?)
}

fn collect_ko(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_ko(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "ko") {
            out.push(path);
        }
    }
    out.sort();
    Ok(())
}

fn cache_of(host: &Host<'_>) -> ModuleCache {
    cache(host.config, host.root)
}

/// The parameters `[driver] module_params` gives `module` (`nvidia-uvm` and `nvidia_uvm` alike).
fn params(host: &Host<'_>, module: &str) -> Vec<String> {
    let norm = |m: &str| m.replace('-', "_");
    host.config
        .driver
        .module_params
        .iter()
        .filter(|(m, _)| norm(m) == norm(module))
        .flat_map(|(_, p)| p.clone())
        .collect()
}

fn load(host: &Host<'_>, planned: &Planned, from: LoadFrom, modules: &[String]) -> Result<(), DriverError> {
    match from {
        LoadFrom::Modprobe => {
            // Options come from modprobe_conf.
            let modprobe = host.modprobe()?;
            for m in modules {
                host.run(&format!("load {m}"), Cmd::new(&modprobe).arg(m))?;
            }
        }
        LoadFrom::Cache => {
            let key = planned.cache_key.as_ref().ok_or_else(|| DriverError::Step {
                step: "load".into(),
                message: "no cache key".into(),
            })?;
            let cached = cache_of(host).lookup(key)?.ok_or_else(|| DriverError::Step {
                step: "load".into(),
                message: "the built modules are not in the cache".into(),
            })?;
            let insmod = host.program("load", &["/usr/sbin/insmod", "/sbin/insmod"])?;
            for m in modules {
                let file = format!("{m}.ko");
                let alt = format!("{}.ko", m.replace('-', "_"));
                let found = cached.modules.iter().find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy() == file || n.to_string_lossy() == alt)
                });
                match found {
                    Some(ko) => {
                        host.run(&format!("load {m}"), Cmd::new(&insmod).arg(ko).args(params(host, m)))?;
                    }
                    // An extra module the build did not make (nvidia-peermem needs MOFED): the
                    // distribution may have it.
                    None => {
                        host.run(&format!("load {m}"), Cmd::new(host.modprobe()?).arg(m))?;
                    }
                }
            }
        }
    }
    // Device nodes: nvidia-modprobe creates them as the driver container's users expect.
    if !host.root.join("/dev/nvidiactl").exists()
        && let Ok(nvidia_modprobe) = host.program("device nodes", &["/usr/bin/nvidia-modprobe"])
    {
        for minor in 0..planned.facts.gpus.len() {
            host.run(
                "create device nodes",
                Cmd::new(&nvidia_modprobe).arg("-u").arg("-c").arg(minor.to_string()),
            )?;
        }
    }
    Ok(())
}

/// Persistence mode on, and the fabric manager on NVSwitch systems; `started`: services the
/// load step already started again.
fn persistence(host: &Host<'_>, started: &[&str]) -> Result<(), DriverError> {
    let systemctl = host.config.runtime.systemctl.clone();
    if started.contains(&"nvidia-persistenced.service") {
        // It turns persistence mode on itself.
    } else if host.unit_exists("nvidia-persistenced.service") && host.runner.exists(&systemctl) {
        host.run(
            "persistence mode",
            Cmd::new(&systemctl).args(["start", "nvidia-persistenced.service"]),
        )?;
    } else if let Ok(smi) = host.program("persistence mode", &["/usr/bin/nvidia-smi"]) {
        host.run("persistence mode", Cmd::new(smi).args(["-pm", "1"]))?;
    } else {
        tracing::warn!("driver: neither nvidia-persistenced nor nvidia-smi is installed: persistence mode stays off");
    }
    // NVSwitch systems need the fabric manager before CUDA works.
    let nvswitches = std::fs::read_dir(host.root.join("/proc/driver/nvidia-nvswitch/devices"))
        .map(|d| d.count())
        .unwrap_or(0);
    if nvswitches > 0
        && !started.contains(&"nvidia-fabricmanager.service")
        && host.unit_exists("nvidia-fabricmanager.service")
        && host.runner.exists(&systemctl)
    {
        host.run(
            "fabric manager",
            Cmd::new(&systemctl).args(["start", "nvidia-fabricmanager.service"]),
        )?;
    }
    Ok(())
}

/// Who loads the driver's modules under this config, which decides the modules validation
/// requires: the driver stage for `package`, `runfile` and `prebuilt` (it loads
/// `nvidia-modeset` with the others), other means for `none` (`nvidia_modeset` only with
/// `[driver] require_modeset`).
pub fn loader(config: &Config) -> Loader {
    match config.driver.source {
        DriverSource::None => Loader::Other {
            require_modeset: config.driver.require_modeset,
        },
        DriverSource::Package | DriverSource::Runfile | DriverSource::Prebuilt => Loader::Agent,
    }
}

/// The validation checks against what NVML reports now (`nvml`: driver version, GPU count and
/// the GPUs NVML lists, or why NVML does not answer), the host `facts` and the compute modules'
/// device nodes under `[device_plugin] dev_root`.
pub fn validate_now(
    config: &Config,
    root: &HostRoot,
    facts: &HostFacts,
    nvml: Result<(NvmlView, Vec<NvmlGpu>), String>,
) -> Vec<Check> {
    // With package names that do not pin the point release, any of the branch will do.
    let desired = (!config.driver.version.is_empty()).then(|| plan::accepted_version(&config.driver, facts));
    let (nvml, listed) = match nvml {
        Ok((view, listed)) => (Ok(view), listed),
        Err(e) => (Err(e), Vec::new()),
    };
    let addresses = validate::GpuAddresses {
        pci: facts.gpus.iter().map(|g| g.address.clone()).collect(),
        nvml: listed,
    };
    validate::validate_named(
        &ValidationInput {
            pci_gpus: facts.gpus.len(),
            nvml,
            desired_version: desired,
            loaded: facts.loaded.clone(),
            device_nodes: observe::driver_nodes(&root.join(&config.device_plugin.dev_root)),
            loader: loader(config),
        },
        Some(&addresses),
    )
}

/// NVML's view for validation, from an open library, with the GPUs it lists when its count
/// differs from `pci_gpus` (to name the GPU the count check misses; empty otherwise, or when
/// NVML would not list them): the usual pass asks NVML for two numbers only.
pub fn nvml_view(gpus: &crate::nvml::Gpus, pci_gpus: usize) -> Result<(NvmlView, Vec<NvmlGpu>), String> {
    let (driver_version, gpu_count) = gpus.driver_and_count().map_err(|e| e.to_string())?;
    let listed = if gpu_count == pci_gpus {
        Vec::new()
    } else {
        NvmlGpu::read_all(gpus).unwrap_or_default()
    };
    Ok((
        NvmlView {
            driver_version,
            gpu_count,
        },
        listed,
    ))
}
