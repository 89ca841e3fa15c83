//! The driver plan (pure): from what the host has ([`HostFacts`]) and what `[driver]` asks for,
//! the steps that bring the running kernel to the wanted driver, or the reason to wait or fail.

use serde::Serialize;

use super::observe::{Distro, HostFacts, SecureBoot};
use super::{Flavour, MODULES};
use crate::config::{DriverConfig, DriverSource, FlavourChoice};

/// The first driver branch whose recommended modules are the open ones (NVIDIA's rule when
/// `nvidia-installer --print-recommended-kernel-module-type` cannot be asked).
pub const OPEN_BY_DEFAULT_FROM_BRANCH: u32 = 560;

/// The package manager of a distribution family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PackageManager {
    Apt,
    Dnf,
}

/// One step of a driver change, in order. For `runfile` and `prebuilt` the artifact is
/// downloaded and verified first, the headers installed and the modules built next, and only then
/// are modules touched (modprobe.d, nouveau, the old driver's services and modules, the load);
/// for `package` the packages are installed before the new modules load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "step", rename_all = "kebab-case")]
pub enum Step {
    /// Write `[driver] modprobe_conf`: module options and the nouveau blacklist.
    WriteModprobeConf { path: String, text: String },
    /// `modprobe -r nouveau`.
    UnloadNouveau,
    /// Stop nvidia-persistenced and the fabric manager where they run (they hold the driver
    /// open; they start again after the load), then unload the loaded driver modules in this
    /// order (an upgrade).
    Unload { modules: Vec<String> },
    /// Install distribution packages.
    InstallPackages {
        manager: PackageManager,
        packages: Vec<String>,
    },
    /// Download a file, accepted only with this sha256.
    Download { url: String, sha256: String },
    /// Extract the `.run` file, build its kernel modules for the running kernel and cache them.
    /// Changes nothing outside the agent's state dir.
    BuildRunfile { flavour: Flavour },
    /// Install the built `.run`'s user space without its kernel modules (after the old modules
    /// are unloaded, before the new ones load).
    InstallUserSpace,
    /// Unpack the prebuilt modules tarball into the cache.
    UnpackPrebuilt,
    /// Load the modules: from the distribution (`modprobe`) or from the cache (`insmod`).
    Load { from: LoadFrom, modules: Vec<String> },
    /// Persistence mode on.
    Persistence,
}

/// Where loaded modules come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadFrom {
    Modprobe,
    Cache,
}

/// What the driver stage will do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DriverPlan {
    /// One line for status and `plan`.
    pub summary: String,
    /// Nothing to change beyond validation when empty.
    pub steps: Vec<Step>,
    /// Set when the change must wait (GPU work running); `steps` are what will happen then.
    pub wait: Option<String>,
    /// The modules' flavour, when a driver is installed.
    pub flavour: Option<Flavour>,
}

/// Why no plan can be made. Nothing is changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "unknown distribution {id:?} (/etc/os-release): [driver] source = \"package\" needs Ubuntu, Debian or the RHEL family; use source = \"runfile\" or \"prebuilt\", or install the driver yourself (source = \"none\")"
    )]
    UnknownDistro { id: String },
    #[error("[driver.package_names] has no {family} entry for this {family} host")]
    NoPackages { family: &'static str },
    #[error("{0}")]
    Template(String),
    #[error(
        "no [driver.prebuilt_sha256] entry for the running kernel {kernel}: add the tarball's sha256 for it, or use source = \"runfile\""
    )]
    NoPrebuiltChecksum { kernel: String },
    #[error(
        "Secure Boot is on: the kernel refuses the unsigned modules source = \"{method}\" would load (\"Key was rejected by service\"); use source = \"package\" (Ubuntu's signed precompiled modules) or enroll a key and sign them yourself; nothing was changed"
    )]
    SecureBoot { method: &'static str },
    /// An earlier install for this `[driver]` and kernel loaded another version than asked
    /// for: not tried again until the config or the kernel changes, or the agent restarts.
    #[error("{0} (an earlier pass found this; not installed again)")]
    InstalledOtherVersion(String),
    #[error(
        "no kernel headers for the running kernel {kernel} (/lib/modules/{kernel}/build), and this distribution's headers package is unknown: install them (e.g. linux-headers-{kernel} or kernel-devel-{kernel}), or use source = \"prebuilt\""
    )]
    NoHeaders { kernel: String },
    #[error(
        "{why}: [driver] source = \"{method}\" installs the driver's files into /usr, which this host cannot write; use source = \"prebuilt\" (modules built for this kernel, kept and loaded from /var/lib/gpu-node-agent) with the driver's user space from the OS (Flatcar's NVIDIA driver extension, an rpm-ostree layer), or install the whole driver with the OS's own tools and use source = \"none\"; nothing was changed"
    )]
    ReadOnlyUsr { why: String, method: &'static str },
}

/// The inputs besides the config and the host facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    /// Processes on the GPUs (NVML); `None` when unknown (NVML not up): an upgrade then waits.
    pub gpu_processes: Option<usize>,
    /// The built modules for the wanted driver are in the cache.
    pub cached: bool,
    /// The current text of `[driver] modprobe_conf`.
    pub modprobe_conf: Option<String>,
    /// Why an earlier install for this `[driver]` and kernel did not give the wanted version:
    /// the plan then fails with it instead of installing again.
    pub failed_install: Option<String>,
}

/// The driver version's first number, e.g. 550.
pub fn branch(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// The flavour `[driver] flavour` means for `version`.
pub fn flavour(choice: FlavourChoice, version: &str) -> Flavour {
    match choice {
        FlavourChoice::Open => Flavour::Open,
        FlavourChoice::Proprietary => Flavour::Proprietary,
        FlavourChoice::Auto if branch(version).is_some_and(|b| b >= OPEN_BY_DEFAULT_FROM_BRANCH) => Flavour::Open,
        FlavourChoice::Auto => Flavour::Proprietary,
    }
}

/// The module list to load: the core three, then the extras.
pub fn modules(config: &DriverConfig) -> Vec<String> {
    MODULES
        .iter()
        .map(|m| m.to_string())
        .chain(config.extra_modules.iter().cloned())
        .collect()
}

/// Which of the driver's core [`MODULES`] (as modprobe names them) are not loaded, in load
/// order; none when `nvidia` itself is not (the whole driver is then planned).
pub fn missing_modules(facts: &HostFacts) -> Vec<String> {
    let Some(loaded) = &facts.loaded else {
        return Vec::new();
    };
    MODULES
        .iter()
        .filter(|m| !loaded.modules.iter().any(|l| *l == m.replace('-', "_")))
        .map(|m| m.to_string())
        .collect()
}

/// `[driver] modprobe_conf`'s text: `options <module> <params>` lines and the nouveau blacklist.
pub fn modprobe_conf(config: &DriverConfig) -> String {
    let mut text = String::from(
        "# Written by gpu-node-agent ([driver] module_params): edit the agent's config instead.\n\
         blacklist nouveau\noptions nouveau modeset=0\n",
    );
    for (module, params) in &config.module_params {
        if !params.is_empty() {
            text.push_str(&format!("options {} {}\n", module.replace('-', "_"), params.join(" ")));
        }
    }
    text
}

/// Fills a package name template.
fn package_name(template: &str, version: &str, kernel: &str, flavour: Flavour) -> Result<String, PlanError> {
    let branch = branch(version).map(|b| b.to_string()).unwrap_or_default();
    let open = if flavour == Flavour::Open { "-open" } else { "" };
    let name = template
        .replace("{version}", version)
        .replace("{branch}", &branch)
        .replace("{kernel}", kernel)
        .replace("{-open}", open);
    if name.contains(['{', '}']) {
        return Err(PlanError::Template(format!(
            "[driver.package_names] {template:?}: unknown placeholder (known: {{version}}, {{branch}}, {{kernel}}, {{-open}})"
        )));
    }
    Ok(name)
}

/// The package manager and names for `[driver] source = "package"` on this host.
pub fn packages(
    config: &DriverConfig,
    facts: &HostFacts,
    flavour: Flavour,
) -> Result<(PackageManager, Vec<String>), PlanError> {
    let (family, manager) = match facts.os.distro() {
        Distro::Ubuntu => ("ubuntu", PackageManager::Apt),
        Distro::Debian => ("debian", PackageManager::Apt),
        Distro::RhelFamily => ("rhel", PackageManager::Dnf),
        Distro::Unknown => {
            return Err(PlanError::UnknownDistro {
                id: facts.os.id.clone(),
            });
        }
    };
    let templates = config
        .package_names
        .get(family)
        .filter(|t| !t.is_empty())
        .ok_or(PlanError::NoPackages { family })?;
    let names = templates
        .iter()
        .map(|t| package_name(t, &config.version, &facts.kernel_release, flavour))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((manager, names))
}

/// The kernel variants of the RHEL family whose release (`uname -r`) ends in `+<variant>` and
/// whose headers come in `kernel-<variant>-devel`: the 64k-page kernel of aarch64 (`kernel-64k`,
/// the one Grace nodes often run), the real-time and the debug kernels.
const RHEL_KERNEL_VARIANTS: [&str; 5] = ["64k", "rt", "debug", "64k-debug", "rt-debug"];

/// The headers package of the running kernel on this host, if the family is known.
///
/// Debian and Ubuntu name it after the release whatever the architecture
/// (`linux-headers-6.1.0-18-arm64`, `linux-headers-6.8.0-31-generic-64k`). The RHEL family's
/// release carries the architecture (`5.14.0-427.el9.aarch64`, so `kernel-devel-<release>` is
/// already the right one), and a variant kernel's release ends in `+<variant>` while its headers
/// are `kernel-<variant>-devel-<release without it>`: `5.14.0-427.el9.aarch64+64k` needs
/// `kernel-64k-devel-5.14.0-427.el9.aarch64`.
pub fn headers_package(facts: &HostFacts) -> Option<(PackageManager, String)> {
    let k = &facts.kernel_release;
    match facts.os.distro() {
        Distro::Ubuntu | Distro::Debian => Some((PackageManager::Apt, format!("linux-headers-{k}"))),
        Distro::RhelFamily => {
            let package = match k.rsplit_once('+') {
                Some((base, variant)) if RHEL_KERNEL_VARIANTS.contains(&variant) => {
                    format!("kernel-{variant}-devel-{base}")
                }
                _ => format!("kernel-devel-{k}"),
            };
            Some((PackageManager::Dnf, package))
        }
        Distro::Unknown => None,
    }
}

/// Whether the `[driver.package_names]` templates for this host name the exact version: when they
/// do not (the defaults use `{branch}`), the archive decides the point release.
pub fn package_names_pin_version(config: &DriverConfig, facts: &HostFacts) -> bool {
    let family = match facts.os.distro() {
        Distro::Ubuntu => "ubuntu",
        Distro::Debian => "debian",
        Distro::RhelFamily => "rhel",
        Distro::Unknown => return true,
    };
    config
        .package_names
        .get(family)
        .is_none_or(|templates| templates.iter().any(|t| t.contains("{version}")))
}

/// The version `[driver] version` asks for as validation checks it: the branch alone (e.g.
/// `550`) for `source = "package"` when the package names do not pin the version (any point
/// release of the branch the archive has), else the version itself.
pub fn accepted_version(config: &DriverConfig, facts: &HostFacts) -> String {
    match branch(&config.version) {
        Some(b) if config.source == DriverSource::Package && !package_names_pin_version(config, facts) => b.to_string(),
        _ => config.version.clone(),
    }
}

/// Whether the loaded driver `loaded` is the one `[driver]` asks for: the same version, or for
/// `source = "package"` with package names that do not pin the version, the same branch.
pub fn satisfies(config: &DriverConfig, facts: &HostFacts, loaded: &str) -> bool {
    loaded == config.version
        || (config.source == DriverSource::Package
            && !package_names_pin_version(config, facts)
            && branch(loaded).is_some_and(|b| Some(b) == branch(&config.version)))
}

/// Plans the driver stage. Pure.
pub fn plan(config: &DriverConfig, facts: &HostFacts, ctx: &Context) -> Result<DriverPlan, PlanError> {
    let mut plan = DriverPlan {
        summary: String::new(),
        steps: Vec::new(),
        wait: None,
        flavour: None,
    };
    if facts.gpus.is_empty() {
        plan.summary = "no NVIDIA GPU on the PCI bus: nothing to do".into();
        return Ok(plan);
    }
    let loaded = facts.loaded.as_ref().and_then(|l| l.version.clone());
    if config.source == DriverSource::None {
        plan.summary = match &loaded {
            Some(v) => format!("driver {v} installed by other means ([driver] source = \"none\"): validating only"),
            None => "no driver loaded, and [driver] source = \"none\" installs none: validating only".into(),
        };
        return Ok(plan);
    }
    let wanted = config.version.as_str();
    let flavour = flavour(config.flavour, wanted);
    plan.flavour = Some(flavour);
    let conf = modprobe_conf(config);
    let write_conf = (ctx.modprobe_conf.as_deref() != Some(conf.as_str())).then(|| Step::WriteModprobeConf {
        path: config.modprobe_conf.to_string_lossy().into_owned(),
        text: conf,
    });
    if let Some(l) = loaded.as_deref().filter(|l| satisfies(config, facts, l)) {
        plan.summary = if l == wanted {
            format!("driver {wanted} loaded")
        } else {
            format!(
                "driver {l} loaded (branch {}: the package names do not pin the point release)",
                accepted_version(config, facts)
            )
        };
        plan.steps.extend(write_conf);
        // The stage loads nvidia-uvm and nvidia-modeset with nvidia, and validation requires
        // them: one unloaded since (or a wanted driver loaded by other means without it) is
        // loaded again, rather than failing validation on every pass.
        let missing = missing_modules(facts);
        if !missing.is_empty() {
            let from = match config.source {
                DriverSource::Runfile | DriverSource::Prebuilt if ctx.cached => LoadFrom::Cache,
                _ => LoadFrom::Modprobe,
            };
            plan.summary = format!("{}; {} not loaded", plan.summary, missing.join(", "));
            plan.steps.push(Step::Load { from, modules: missing });
        }
        return Ok(plan);
    }
    if let Some(why) = &ctx.failed_install {
        return Err(PlanError::InstalledOtherVersion(why.clone()));
    }
    let mut unload = None;
    if let (Some(old), Some(l)) = (&loaded, &facts.loaded) {
        // An upgrade (or downgrade): the old modules go, never under GPU work.
        let order = [
            "nvidia_drm",
            "nvidia_modeset",
            "nvidia_uvm",
            "nvidia_peermem",
            "nvidia_fs",
            "nvidia",
        ];
        let modules: Vec<String> = order
            .iter()
            .filter(|m| l.modules.iter().any(|x| x == *m))
            .map(|m| m.to_string())
            .collect();
        unload = Some(Step::Unload { modules });
        match ctx.gpu_processes {
            Some(0) => {}
            Some(n) => {
                plan.wait = Some(format!(
                    "{n} GPU process(es) running: the change from driver {old} to {wanted} waits for them to end"
                ))
            }
            None => {
                plan.wait = Some(format!(
                    "cannot tell whether GPU work runs (NVML unavailable): the change from driver {old} to {wanted} waits"
                ))
            }
        }
    }
    if facts.secure_boot == SecureBoot::Enabled {
        let method = match config.source {
            DriverSource::Runfile => Some("runfile"),
            DriverSource::Prebuilt => Some("prebuilt"),
            DriverSource::None | DriverSource::Package => None,
        };
        if let Some(method) = method {
            return Err(PlanError::SecureBoot { method });
        }
    }
    // The packages and nvidia-installer write /usr; a cached runfile build and prebuilt modules
    // only load from /var/lib.
    if let Some(why) = &facts.read_only_usr {
        let method = match config.source {
            DriverSource::Package => Some("package"),
            DriverSource::Runfile if !ctx.cached => Some("runfile"),
            DriverSource::Runfile | DriverSource::Prebuilt | DriverSource::None => None,
        };
        if let Some(method) = method {
            return Err(PlanError::ReadOnlyUsr {
                why: why.clone(),
                method,
            });
        }
    }
    let load = |from| Step::Load {
        from,
        modules: modules(config),
    };
    // Touching modules comes last: modprobe.d (options, the nouveau blacklist), nouveau out, the
    // old driver out, then the new one in.
    let modules_steps = |steps: &mut Vec<Step>, unload: Option<Step>, user_space: bool, from: LoadFrom| {
        steps.extend(write_conf.clone());
        if facts.nouveau {
            steps.push(Step::UnloadNouveau);
        }
        steps.extend(unload);
        if user_space {
            steps.push(Step::InstallUserSpace);
        }
        steps.push(load(from));
    };
    match config.source {
        DriverSource::None => {}
        DriverSource::Package => {
            let (manager, packages) = packages(config, facts, flavour)?;
            // The packages replace the old driver's files: its modules go first.
            plan.steps.extend(unload);
            plan.steps.push(Step::InstallPackages { manager, packages });
            modules_steps(&mut plan.steps, None, false, LoadFrom::Modprobe);
        }
        DriverSource::Runfile if ctx.cached => modules_steps(&mut plan.steps, unload, false, LoadFrom::Cache),
        DriverSource::Runfile => {
            let headers = match facts.headers {
                Some(_) => None,
                None => Some(headers_package(facts).ok_or_else(|| PlanError::NoHeaders {
                    kernel: facts.kernel_release.clone(),
                })?),
            };
            let url = super::fetch::url_from_template(
                &config.runfile_url,
                &[("version", wanted), ("arch", facts.arch.machine())],
            )
            .map_err(|e| PlanError::Template(format!("[driver] runfile_url: {e}")))?;
            // Nothing changes on the host before the .run is downloaded and verified, and the
            // old driver keeps running until its replacement is built.
            plan.steps.push(Step::Download {
                url,
                sha256: config.runfile_sha256.to_ascii_lowercase(),
            });
            if let Some((manager, package)) = headers {
                plan.steps.push(Step::InstallPackages {
                    manager,
                    packages: vec![package],
                });
            }
            plan.steps.push(Step::BuildRunfile { flavour });
            modules_steps(&mut plan.steps, unload, true, LoadFrom::Cache);
        }
        DriverSource::Prebuilt if ctx.cached => modules_steps(&mut plan.steps, unload, false, LoadFrom::Cache),
        DriverSource::Prebuilt => {
            let kernel = facts.kernel_release.as_str();
            let sha256 = config
                .prebuilt_sha256
                .get(kernel)
                .ok_or_else(|| PlanError::NoPrebuiltChecksum { kernel: kernel.into() })?;
            let url = super::fetch::url_from_template(
                &config.prebuilt_url,
                &[
                    ("version", wanted),
                    ("kernel", kernel),
                    ("flavour", flavour.as_str()),
                    ("arch", facts.arch.machine()),
                ],
            )
            .map_err(|e| PlanError::Template(format!("[driver] prebuilt_url: {e}")))?;
            plan.steps.push(Step::Download {
                url,
                sha256: sha256.to_ascii_lowercase(),
            });
            plan.steps.push(Step::UnpackPrebuilt);
            modules_steps(&mut plan.steps, unload, false, LoadFrom::Cache);
        }
    }
    if config.persistence_mode {
        plan.steps.push(Step::Persistence);
    }
    plan.summary = match (&loaded, ctx.cached) {
        (Some(old), _) => format!("driver {old} → {wanted} ({})", flavour.as_str()),
        (None, true) => format!("driver {wanted} ({}) from the module cache", flavour.as_str()),
        (None, false) => format!("driver {wanted} ({}) to install", flavour.as_str()),
    };
    Ok(plan)
}

/// The plan for people: the summary and one line per step.
pub fn describe(plan: &DriverPlan) -> String {
    let mut lines = vec![plan.summary.clone()];
    if let Some(wait) = &plan.wait {
        lines.push(format!("  waits: {wait}"));
    }
    for step in &plan.steps {
        lines.push(format!(
            "  - {}",
            match step {
                Step::WriteModprobeConf { path, .. } => format!("write {path} (module options, nouveau blacklist)"),
                Step::UnloadNouveau => "unload nouveau".into(),
                Step::Unload { modules } => format!(
                    "stop nvidia-persistenced and nvidia-fabricmanager where active, unload {}",
                    modules.join(", ")
                ),
                Step::InstallPackages { manager, packages } => {
                    let tool = match manager {
                        PackageManager::Apt => "apt-get",
                        PackageManager::Dnf => "dnf",
                    };
                    format!("{tool} install {}", packages.join(" "))
                }
                Step::Download { url, sha256 } => format!("download {url} (sha256 {sha256})"),
                Step::BuildRunfile { flavour } => {
                    format!(
                        "build the {} kernel modules with kbuild and cache them",
                        flavour.as_str()
                    )
                }
                Step::InstallUserSpace => "install the .run's user space (nvidia-installer --no-kernel-module)".into(),
                Step::UnpackPrebuilt => "unpack the prebuilt modules into the cache".into(),
                Step::Load { from, modules } => format!(
                    "load {} ({})",
                    modules.join(", "),
                    match from {
                        LoadFrom::Modprobe => "modprobe",
                        LoadFrom::Cache => "insmod from the module cache",
                    }
                ),
                Step::Persistence => "persistence mode on".into(),
            }
        ));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::observe::{LoadedDriver, OsRelease, PciDevice, SecureBoot, parse_os_release};
    use crate::host::arch::HostArch;

    fn facts(os: &str, loaded: Option<&str>) -> HostFacts {
        HostFacts {
            kernel_release: "6.8.0-1015-aws".into(),
            arch: HostArch::X86_64,
            os: parse_os_release(os),
            gpus: vec![PciDevice {
                address: "0000:07:00.0".into(),
                vendor: 0x10de,
                device: 0x2330,
                class: 0x030200,
            }],
            loaded: loaded.map(|v| LoadedDriver {
                version: Some(v.into()),
                modules: vec!["nvidia".into(), "nvidia_uvm".into(), "nvidia_modeset".into()],
                refcnt: Some(2),
            }),
            loaded_flavour: None,
            nouveau: false,
            headers: Some("/lib/modules/6.8.0-1015-aws/build".into()),
            secure_boot: SecureBoot::Disabled,
            read_only_usr: None,
        }
    }

    const UBUNTU: &str = "ID=ubuntu\nID_LIKE=debian\nVERSION_ID=\"22.04\"\n";

    fn config(source: DriverSource) -> DriverConfig {
        DriverConfig {
            source,
            version: "550.54.15".into(),
            runfile_sha256: "ab".repeat(32),
            ..DriverConfig::default()
        }
    }

    fn ctx() -> Context {
        Context {
            gpu_processes: Some(0),
            cached: false,
            modprobe_conf: None,
            failed_install: None,
        }
    }

    #[test]
    fn ubuntu_packages_are_canonicals_signed_precompiled_modules() {
        let (manager, names) = packages(&config(DriverSource::Package), &facts(UBUNTU, None), Flavour::Open).unwrap();
        assert_eq!(manager, PackageManager::Apt);
        assert_eq!(
            names,
            [
                "linux-modules-nvidia-550-server-open-6.8.0-1015-aws",
                "nvidia-headless-no-dkms-550-server-open",
                "nvidia-utils-550-server"
            ]
        );
        let rhel = facts("ID=\"rocky\"\nID_LIKE=\"rhel centos fedora\"\n", None);
        let (manager, names) = packages(&config(DriverSource::Package), &rhel, Flavour::Proprietary).unwrap();
        assert_eq!(manager, PackageManager::Dnf);
        assert_eq!(names[1], "kmod-nvidia-dkms");
    }

    #[test]
    fn an_unknown_distribution_is_refused_with_what_to_do() {
        let e = plan(&config(DriverSource::Package), &facts("ID=gentoo\n", None), &ctx()).unwrap_err();
        assert!(
            e.to_string().contains("\"gentoo\"") && e.to_string().contains("source = \"runfile\""),
            "{e}"
        );
    }

    #[test]
    fn the_loaded_wanted_version_needs_no_step_but_its_modprobe_conf() {
        let c = config(DriverSource::Package);
        let p = plan(&c, &facts(UBUNTU, Some("550.54.15")), &ctx()).unwrap();
        assert_eq!(p.steps.len(), 1, "{p:?}");
        assert!(matches!(p.steps[0], Step::WriteModprobeConf { .. }));
        let again = Context {
            modprobe_conf: Some(modprobe_conf(&c)),
            ..ctx()
        };
        assert!(
            plan(&c, &facts(UBUNTU, Some("550.54.15")), &again)
                .unwrap()
                .steps
                .is_empty()
        );
    }

    #[test]
    fn the_wanted_driver_without_nvidia_modeset_gets_it_loaded_where_the_stage_loads_the_driver() {
        let mut f = facts(UBUNTU, Some("550.54.15"));
        if let Some(l) = f.loaded.as_mut() {
            l.modules.retain(|m| m != "nvidia_modeset");
        }
        let c = config(DriverSource::Package);
        let conf = Context {
            modprobe_conf: Some(modprobe_conf(&c)),
            ..ctx()
        };
        let p = plan(&c, &f, &conf).unwrap();
        assert_eq!(
            p.steps,
            [Step::Load {
                from: LoadFrom::Modprobe,
                modules: vec!["nvidia-modeset".into()]
            }]
        );
        assert_eq!(p.summary, "driver 550.54.15 loaded; nvidia-modeset not loaded");
        // Built here and cached: from the cache.
        let cached = Context {
            cached: true,
            ..conf.clone()
        };
        let p = plan(&config(DriverSource::Runfile), &f, &cached).unwrap();
        assert!(
            matches!(&p.steps[..], [Step::Load { from: LoadFrom::Cache, modules }] if modules == &["nvidia-modeset"]),
            "{p:?}"
        );
        // Installed by other means: the stage loads nothing.
        assert!(plan(&config(DriverSource::None), &f, &conf).unwrap().steps.is_empty());
    }

    #[test]
    fn an_upgrade_unloads_in_dependency_order_and_waits_for_gpu_work() {
        let busy = Context {
            gpu_processes: Some(3),
            ..ctx()
        };
        let p = plan(
            &config(DriverSource::Package),
            &facts(UBUNTU, Some("535.161.08")),
            &busy,
        )
        .unwrap();
        assert!(p.wait.as_deref().is_some_and(|w| w.contains("3 GPU process")), "{p:?}");
        let unload = p.steps.iter().find_map(|s| match s {
            Step::Unload { modules } => Some(modules.clone()),
            _ => None,
        });
        assert_eq!(unload.unwrap(), ["nvidia_modeset", "nvidia_uvm", "nvidia"]);
    }

    /// The steps' names, for order checks.
    fn names(p: &DriverPlan) -> Vec<&'static str> {
        p.steps
            .iter()
            .map(|s| match s {
                Step::WriteModprobeConf { .. } => "modprobe.d",
                Step::UnloadNouveau => "nouveau",
                Step::Unload { .. } => "unload",
                Step::InstallPackages { packages, .. } if packages[0].starts_with("linux-headers") => "headers",
                Step::InstallPackages { .. } => "packages",
                Step::Download { .. } => "download",
                Step::BuildRunfile { .. } => "build",
                Step::InstallUserSpace => "user-space",
                Step::UnpackPrebuilt => "unpack",
                Step::Load { .. } => "load",
                Step::Persistence => "persistence",
            })
            .collect()
    }

    #[test]
    fn runfile_downloads_builds_and_loads_unless_cached() {
        let c = config(DriverSource::Runfile);
        let p = plan(&c, &facts(UBUNTU, None), &ctx()).unwrap();
        assert!(
            matches!(&p.steps[0], Step::Download { url, .. } if url == "https://us.download.nvidia.com/tesla/550.54.15/NVIDIA-Linux-x86_64-550.54.15.run")
        );
        assert_eq!(
            names(&p),
            ["download", "build", "modprobe.d", "user-space", "load", "persistence"]
        );
        let mut no_headers = facts(UBUNTU, None);
        no_headers.headers = None;
        let p = plan(&c, &no_headers, &ctx()).unwrap();
        assert!(
            matches!(&p.steps[1], Step::InstallPackages { packages, .. } if packages == &["linux-headers-6.8.0-1015-aws"])
        );
        let cached = Context { cached: true, ..ctx() };
        let p = plan(&c, &facts(UBUNTU, None), &cached).unwrap();
        assert_eq!(names(&p), ["modprobe.d", "load", "persistence"]);
        assert!(p.summary.contains("module cache"), "{}", p.summary);
    }

    #[test]
    fn an_arm64_node_downloads_the_aarch64_runfile() {
        let arm = HostFacts {
            arch: HostArch::Aarch64,
            ..facts(UBUNTU, None)
        };
        let mut c = config(DriverSource::Runfile);
        let p = plan(&c, &arm, &ctx()).unwrap();
        assert!(
            matches!(&p.steps[0], Step::Download { url, .. } if url == "https://us.download.nvidia.com/tesla/550.54.15/NVIDIA-Linux-aarch64-550.54.15.run"),
            "{:?}",
            p.steps[0]
        );
        // NVIDIA's XFree86 archive has one folder per architecture too.
        c.runfile_url =
            "https://download.nvidia.com/XFree86/Linux-{arch}/{version}/NVIDIA-Linux-{arch}-{version}.run".into();
        let p = plan(&c, &arm, &ctx()).unwrap();
        assert!(
            matches!(&p.steps[0], Step::Download { url, .. } if url == "https://download.nvidia.com/XFree86/Linux-aarch64/550.54.15/NVIDIA-Linux-aarch64-550.54.15.run"),
            "{:?}",
            p.steps[0]
        );
        // The prebuilt tarball's template gets the same name.
        let mut c = config(DriverSource::Prebuilt);
        c.prebuilt_url = "https://mirror.example/{arch}/{kernel}/{version}-{flavour}.tar.gz".into();
        c.prebuilt_sha256 = [("6.8.0-1015-aws".to_string(), "cd".repeat(32))].into_iter().collect();
        let p = plan(&c, &arm, &ctx()).unwrap();
        assert!(
            matches!(&p.steps[0], Step::Download { url, .. } if url == "https://mirror.example/aarch64/6.8.0-1015-aws/550.54.15-proprietary.tar.gz"),
            "{:?}",
            p.steps[0]
        );
    }

    #[test]
    fn headers_packages_follow_the_kernel_on_either_architecture() {
        let headers = |os: &str, release: &str| {
            let mut f = facts(os, None);
            f.kernel_release = release.into();
            headers_package(&f).map(|(_, name)| name)
        };
        const DEBIAN: &str = "ID=debian\nVERSION_ID=\"12\"\n";
        const RHEL: &str = "ID=\"rhel\"\nID_LIKE=\"fedora\"\nVERSION_ID=\"9.4\"\n";
        let cases = [
            // Debian and Ubuntu: the release names the flavour, 64k-page arm64 kernels included.
            (DEBIAN, "6.1.0-18-arm64", "linux-headers-6.1.0-18-arm64"),
            (UBUNTU, "6.8.0-31-generic-64k", "linux-headers-6.8.0-31-generic-64k"),
            (UBUNTU, "6.8.0-1015-nvidia-64k", "linux-headers-6.8.0-1015-nvidia-64k"),
            // RHEL: the release carries the architecture; a variant kernel has its own -devel.
            (
                RHEL,
                "5.14.0-427.13.1.el9_4.aarch64",
                "kernel-devel-5.14.0-427.13.1.el9_4.aarch64",
            ),
            (
                RHEL,
                "5.14.0-427.13.1.el9_4.aarch64+64k",
                "kernel-64k-devel-5.14.0-427.13.1.el9_4.aarch64",
            ),
            (
                RHEL,
                "5.14.0-427.13.1.el9_4.x86_64+rt",
                "kernel-rt-devel-5.14.0-427.13.1.el9_4.x86_64",
            ),
            (
                RHEL,
                "5.14.0-427.13.1.el9_4.x86_64",
                "kernel-devel-5.14.0-427.13.1.el9_4.x86_64",
            ),
            // An unknown suffix is left in the name: dnf then says it has no such package.
            (RHEL, "6.9.0+custom", "kernel-devel-6.9.0+custom"),
        ];
        for (os, release, package) in cases {
            assert_eq!(headers(os, release).unwrap(), package, "{release}");
        }
    }

    #[test]
    fn runfile_and_prebuilt_fetch_verify_and_build_before_touching_the_host_or_its_modules() {
        // An upgrade with nouveau loaded and no headers: everything there is to change.
        let mut f = facts(UBUNTU, Some("535.161.08"));
        f.nouveau = true;
        f.headers = None;
        let p = plan(&config(DriverSource::Runfile), &f, &ctx()).unwrap();
        assert_eq!(
            names(&p),
            [
                "download",
                "headers",
                "build",
                "modprobe.d",
                "nouveau",
                "unload",
                "user-space",
                "load",
                "persistence"
            ]
        );
        let prebuilt = DriverConfig {
            prebuilt_url: "https://mirror.example/{kernel}/{version}-{flavour}.tar.gz".into(),
            prebuilt_sha256: [("6.8.0-1015-aws".to_string(), "cd".repeat(32))].into(),
            ..config(DriverSource::Prebuilt)
        };
        assert_eq!(
            names(&plan(&prebuilt, &f, &ctx()).unwrap()),
            [
                "download",
                "unpack",
                "modprobe.d",
                "nouveau",
                "unload",
                "load",
                "persistence"
            ]
        );
        // Cached: nothing to fetch; the old driver goes right before the new one loads.
        let cached = Context { cached: true, ..ctx() };
        assert_eq!(
            names(&plan(&config(DriverSource::Runfile), &f, &cached).unwrap()),
            ["modprobe.d", "nouveau", "unload", "load", "persistence"]
        );
        // Packages: the install comes before modprobe.d and nouveau (a failed apt-get leaves
        // them as they were); the old modules go before their files are replaced.
        assert_eq!(
            names(&plan(&config(DriverSource::Package), &f, &ctx()).unwrap()),
            ["unload", "packages", "modprobe.d", "nouveau", "load", "persistence"]
        );
    }

    #[test]
    fn a_package_of_the_wanted_branch_satisfies_unless_the_names_pin_the_version() {
        // The default names use {branch}: the archive's 550.54.14 is the 550 asked for.
        let c = config(DriverSource::Package);
        let f = facts(UBUNTU, Some("550.54.14"));
        assert!(satisfies(&c, &f, "550.54.14") && !satisfies(&c, &f, "535.161.08"));
        assert_eq!(accepted_version(&c, &f), "550");
        let p = plan(&c, &f, &ctx()).unwrap();
        assert_eq!(names(&p), ["modprobe.d"], "{p:?}");
        assert!(p.summary.contains("550.54.14 loaded (branch 550"), "{}", p.summary);
        // Names with {version} ask for that version exactly.
        let mut pinned = config(DriverSource::Package);
        pinned
            .package_names
            .insert("ubuntu".into(), vec!["nvidia-driver-{version}".into()]);
        assert!(!satisfies(&pinned, &f, "550.54.14"));
        assert_eq!(accepted_version(&pinned, &f), "550.54.15");
        assert!(names(&plan(&pinned, &f, &ctx()).unwrap()).contains(&"packages"));
        // runfile and prebuilt always want the exact version.
        let runfile = config(DriverSource::Runfile);
        assert!(!satisfies(&runfile, &f, "550.54.14"));
        assert_eq!(accepted_version(&runfile, &f), "550.54.15");
    }

    #[test]
    fn an_install_that_gave_another_version_is_not_planned_again() {
        let c = config(DriverSource::Package);
        let failed = Context {
            failed_install: Some("installed X, but the loaded driver is 535.161.08".into()),
            ..ctx()
        };
        let e = plan(&c, &facts(UBUNTU, Some("535.161.08")), &failed).unwrap_err();
        assert!(
            matches!(&e, PlanError::InstalledOtherVersion(m) if m.contains("535.161.08")),
            "{e}"
        );
        assert!(e.to_string().contains("not installed again"), "{e}");
        // Once the wanted driver is loaded (installed by hand), all is well again.
        assert!(plan(&c, &facts(UBUNTU, Some("550.54.15")), &failed).is_ok());
    }

    #[test]
    fn no_gpu_on_the_bus_means_nothing_to_do() {
        let mut f = facts(UBUNTU, None);
        f.gpus.clear();
        let p = plan(&config(DriverSource::Runfile), &f, &ctx()).unwrap();
        assert!(p.steps.is_empty() && p.summary.contains("no NVIDIA GPU"), "{p:?}");
    }

    #[test]
    fn secure_boot_refuses_modules_built_here() {
        let mut f = facts(UBUNTU, None);
        f.secure_boot = SecureBoot::Enabled;
        let e = plan(&config(DriverSource::Runfile), &f, &ctx()).unwrap_err();
        assert!(
            e.to_string().contains("Secure Boot is on") && e.to_string().contains("signed"),
            "{e}"
        );
        assert!(
            plan(&config(DriverSource::Package), &f, &ctx()).is_ok(),
            "signed packages are fine"
        );
    }

    #[test]
    fn a_read_only_usr_refuses_what_writes_usr_and_keeps_what_loads_from_var() {
        let mut f = facts("ID=fedora\nVARIANT_ID=coreos\n", None);
        f.read_only_usr = Some("/run/ostree-booted: an rpm-ostree host".into());
        for (source, method) in [(DriverSource::Package, "package"), (DriverSource::Runfile, "runfile")] {
            let e = plan(&config(source), &f, &ctx()).unwrap_err().to_string();
            assert!(
                e.contains("/run/ostree-booted")
                    && e.contains(&format!("source = \"{method}\""))
                    && e.contains("source = \"prebuilt\"")
                    && e.contains("nothing was changed"),
                "{e}"
            );
        }
        // Modules already built for this kernel only load from the cache under /var/lib.
        let cached = Context { cached: true, ..ctx() };
        assert_eq!(
            names(&plan(&config(DriverSource::Runfile), &f, &cached).unwrap()),
            ["modprobe.d", "load", "persistence"]
        );
        assert!(plan(&config(DriverSource::None), &f, &ctx()).is_ok());
        let prebuilt = DriverConfig {
            prebuilt_url: "https://mirror.example/{kernel}.tar.gz".into(),
            prebuilt_sha256: [("6.8.0-1015-aws".to_string(), "0".repeat(64))].into(),
            ..config(DriverSource::Prebuilt)
        };
        let p = plan(&prebuilt, &f, &ctx()).unwrap();
        assert!(
            !names(&p).contains(&"user-space") && !names(&p).contains(&"packages"),
            "{:?}",
            names(&p)
        );
    }

    #[test]
    fn prebuilt_needs_a_checksum_for_the_running_kernel() {
        let c = DriverConfig {
            prebuilt_url: "https://mirror.example/{kernel}/{version}-{flavour}.tar.gz".into(),
            ..config(DriverSource::Prebuilt)
        };
        let e = plan(&c, &facts(UBUNTU, None), &ctx()).unwrap_err();
        assert!(e.to_string().contains("6.8.0-1015-aws"), "{e}");
    }

    #[test]
    fn modprobe_conf_blacklists_nouveau_and_sets_options() {
        let mut c = config(DriverSource::Package);
        c.module_params
            .insert("nvidia-uvm".into(), vec!["uvm_perf_prefetch_enable=0".into()]);
        assert_eq!(
            modprobe_conf(&c),
            "# Written by gpu-node-agent ([driver] module_params): edit the agent's config instead.\n\
             blacklist nouveau\noptions nouveau modeset=0\noptions nvidia_uvm uvm_perf_prefetch_enable=0\n"
        );
        let _ = OsRelease::default;
    }
}
