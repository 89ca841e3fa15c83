//! Is the driver usable: NVML initialises, sees every NVIDIA GPU on the PCI bus, runs the version
//! the config asks for, and the kernel modules CUDA needs are loaded. Pure: the caller observes
//! (PCI scan, NVML, `/sys/module`, the device nodes) and hands the results in.
//!
//! Which modules are required depends on who loads them ([`Loader`]): compute needs `nvidia` and
//! `nvidia_uvm` (loaded, or their device nodes present); `nvidia_modeset` serves display and DRM,
//! so it is required only where the agent loads the driver itself (it loads it with the others)
//! or where `[driver] require_modeset` asks for it. Many GPU hosts never load it.
//!
//! Each failed [`Check`] says what failed and what to do about it.

use serde::Serialize;

use super::observe::{COMPUTE_MODULES, LoadedDriver};
use crate::nvml::normalise_bus_id;

/// The display and DRM module, required only as [`Loader`] says.
pub const MODESET_MODULE: &str = "nvidia_modeset";

/// Who loads the driver's modules, which decides the modules validation requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loader {
    /// The driver stage (`[driver] source` is `package`, `runfile` or `prebuilt`): it loads
    /// `nvidia`, `nvidia-uvm` and `nvidia-modeset`, so all three are required, and a missing one
    /// is loaded by the stage's next pass.
    Agent,
    /// Installed and loaded by other means (`source = "none"`): what compute needs, and
    /// `nvidia_modeset` only with `[driver] require_modeset = true`.
    Other { require_modeset: bool },
}

impl Loader {
    /// Why `nvidia_modeset` is required, or `None` when it is not.
    fn modeset_required(self) -> Option<&'static str> {
        match self {
            Loader::Agent => Some("the driver stage loads it with the others"),
            Loader::Other { require_modeset: true } => Some("[driver] require_modeset = true"),
            Loader::Other { require_modeset: false } => None,
        }
    }
}

/// What NVML reports once it initialises.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NvmlView {
    /// `nvmlSystemGetDriverVersion`, e.g. `550.54.15`.
    pub driver_version: String,
    /// `nvmlDeviceGetCount`.
    pub gpu_count: usize,
}

/// What validation looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationInput {
    /// NVIDIA GPUs on the PCI bus ([`super::observe::nvidia_gpus`]).
    pub pci_gpus: usize,
    /// NVML, or why it does not initialise.
    pub nvml: Result<NvmlView, String>,
    /// `[driver] version`, when pinned.
    pub desired_version: Option<String>,
    /// The loaded modules ([`super::observe::loaded_driver`]).
    pub loaded: Option<LoadedDriver>,
    /// Which of the [`COMPUTE_MODULES`]' device nodes exist under `[device_plugin] dev_root`,
    /// as host paths (`/dev/nvidiactl`, `/dev/nvidia-uvm`): [`super::observe::driver_nodes`].
    pub device_nodes: Vec<String>,
    /// Who loads the modules: which ones are required.
    pub loader: Loader,
}

/// The GPUs behind the two counts of the `gpu-count` check, so that a mismatch names them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuAddresses {
    /// The NVIDIA GPUs on the PCI bus, as sysfs names them (`0000:07:00.0`):
    /// [`super::observe::PciDevice::address`].
    pub pci: Vec<String>,
    /// The GPUs NVML lists ([`NvmlGpu::read_all`]).
    pub nvml: Vec<NvmlGpu>,
}

/// One GPU as NVML lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NvmlGpu {
    pub index: u32,
    pub uuid: String,
    /// NVML's form, `00000000:07:00.0`.
    pub pci_bus_id: String,
}

impl NvmlGpu {
    /// Every GPU NVML lists, by index: its UUID and bus id (a handle, `nvmlDeviceGetUUID` and
    /// `nvmlDeviceGetPciInfo` per GPU). The one read in this module, for the caller that observes
    /// NVML.
    pub fn read_all(gpus: &crate::nvml::Gpus) -> Result<Vec<NvmlGpu>, String> {
        let nvml = gpus.nvml();
        let count = nvml.device_count().map_err(|e| format!("nvmlDeviceGetCount_v2: {e}"))?;
        (0..count)
            .map(|index| {
                let device = nvml
                    .device_by_index(index)
                    .map_err(|e| format!("nvmlDeviceGetHandleByIndex_v2 (index {index}): {e}"))?;
                let uuid = device
                    .uuid()
                    .map_err(|e| format!("nvmlDeviceGetUUID (index {index}): {e}"))?;
                let pci = device
                    .pci_info()
                    .map_err(|e| format!("nvmlDeviceGetPciInfo (index {index}, {uuid}): {e}"))?;
                Ok(NvmlGpu {
                    index,
                    uuid,
                    pci_bus_id: pci.bus_id,
                })
            })
            .collect()
    }
}

impl std::fmt::Display for NvmlGpu {
    /// `GPU 2 (GPU-…, 00000000:c1:00.0)`, as [`crate::nvml::GpuInfo`] shows.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU {} ({}, {})", self.index, self.uuid, self.pci_bus_id)
    }
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// `nvml`, `gpu-count`, `version` or `modules`.
    pub name: &'static str,
    pub ok: bool,
    /// What was found; when failed, what failed and what to do.
    pub message: String,
    /// The value the check found, when it found one: the driver version (`nvml`, `version`), the
    /// GPU count (`gpu-count`), the loaded modules (`modules`).
    pub observed: Option<String>,
}

impl Check {
    fn pass(name: &'static str, message: String, observed: Option<String>) -> Check {
        Check {
            name,
            ok: true,
            message,
            observed,
        }
    }

    fn fail(name: &'static str, message: String, observed: Option<String>) -> Check {
        Check {
            name,
            ok: false,
            message,
            observed,
        }
    }
}

/// Runs the checks, in order: `nvml`, `gpu-count` (only when NVML initialises: without it there
/// is nothing to count, and the `nvml` failure already says why), `version`, `modules`.
pub fn validate(input: &ValidationInput) -> Vec<Check> {
    validate_named(input, None)
}

/// [`validate`], with the GPUs' addresses on both sides: a `gpu-count` mismatch names the PCI
/// devices NVML does not list (or the NVML GPUs sysfs does not show).
pub fn validate_named(input: &ValidationInput, addresses: Option<&GpuAddresses>) -> Vec<Check> {
    let mut checks = vec![check_nvml(input)];
    if let Ok(nvml) = &input.nvml {
        checks.push(check_gpu_count(input.pci_gpus, nvml.gpu_count, addresses));
    }
    checks.push(check_version(input));
    checks.push(check_modules(input));
    checks
}

/// `Ok("driver 550.54.15 on 8 GPU(s)")` when every check passed, else `Err` with the failed
/// checks' messages joined by `"; "`.
pub fn summary(checks: &[Check]) -> Result<String, String> {
    let failed: Vec<&str> = checks.iter().filter(|c| !c.ok).map(|c| c.message.as_str()).collect();
    if !failed.is_empty() {
        return Err(failed.join("; "));
    }
    let observed = |name: &str| {
        checks
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.observed.as_deref())
            .unwrap_or("unknown")
    };
    Ok(format!(
        "driver {} on {} GPU(s)",
        observed("version"),
        observed("gpu-count")
    ))
}

fn check_nvml(input: &ValidationInput) -> Check {
    match &input.nvml {
        Ok(nvml) => Check::pass(
            "nvml",
            format!("NVML initialises with driver {}", nvml.driver_version),
            Some(nvml.driver_version.clone()),
        ),
        Err(e) => {
            let why = match &input.loaded {
                None => "the nvidia module is not loaded (see the modules check)".to_string(),
                Some(LoadedDriver { version: Some(v), .. }) => format!(
                    "the nvidia module {v} is loaded, so the user-space libraries do not match it: install the \
                     user-space part of driver {v} (libnvidia-ml.so.1), or check [nvml] library"
                ),
                Some(_) => "the nvidia module is loaded but does not match the user-space libraries \
                            (libnvidia-ml.so.1)"
                    .to_string(),
            };
            Check::fail("nvml", format!("NVML does not initialise ({e}): {why}"), None)
        }
    }
}

fn check_gpu_count(pci: usize, nvml: usize, addresses: Option<&GpuAddresses>) -> Check {
    let observed = Some(nvml.to_string());
    if pci == 0 && nvml == 0 {
        return Check::fail(
            "gpu-count",
            "no NVIDIA GPU is on the PCI bus and NVML sees none: this node has nothing for the driver to drive \
             (check `lspci -d 10de:` and that the host's /sys is under --root)"
                .to_string(),
            observed,
        );
    }
    if nvml == pci {
        return Check::pass(
            "gpu-count",
            format!("NVML sees all {nvml} NVIDIA GPU(s) on the PCI bus"),
            observed,
        );
    }
    // Matched on the sysfs form: NVML writes `00000000:07:00.0`, sysfs `0000:07:00.0`. Only lists
    // that agree with the counts name anything (a list NVML would not give is empty).
    let (unlisted, unseen) = match addresses {
        Some(a) if a.pci.len() == pci && a.nvml.len() == nvml => {
            let nvml_buses: Vec<String> = a.nvml.iter().map(|g| normalise_bus_id(&g.pci_bus_id)).collect();
            let pci_buses: Vec<String> = a.pci.iter().map(|p| normalise_bus_id(p)).collect();
            let unlisted: Vec<String> = pci_buses.iter().filter(|p| !nvml_buses.contains(p)).cloned().collect();
            let unseen: Vec<String> = a
                .nvml
                .iter()
                .filter(|g| !pci_buses.contains(&normalise_bus_id(&g.pci_bus_id)))
                .map(|g| g.to_string())
                .collect();
            (unlisted, unseen)
        }
        _ => (Vec::new(), Vec::new()),
    };
    let message = if nvml < pci {
        let (which, lspci) = match unlisted.as_slice() {
            [] => (String::new(), "-d 10de:".to_string()),
            [one] => (format!(": NVML does not list {one}"), format!("-s {one}")),
            many => (
                format!(": NVML does not list {}", many.join(", ")),
                "-d 10de:".to_string(),
            ),
        };
        format!(
            "NVML sees {nvml} GPU(s) but {pci} NVIDIA PCI devices are present{which}: a GPU fell off the bus or is \
             bound to another driver (vfio-pci?), check `dmesg` for Xid 79 and `lspci -k {lspci}`"
        )
    } else {
        let which = if unseen.is_empty() {
            String::new()
        } else {
            format!(": {} not in sysfs", unseen.join(", "))
        };
        format!(
            "NVML sees {nvml} GPU(s) but only {pci} NVIDIA PCI device(s) are visible in /sys/bus/pci/devices{which}: \
             the host's /sys is not under --root, or the PCI scan missed a device class"
        )
    };
    Check::fail("gpu-count", message, observed)
}

fn check_version(input: &ValidationInput) -> Check {
    let actual = match &input.nvml {
        Ok(nvml) => Some(nvml.driver_version.clone()),
        Err(_) => input.loaded.as_ref().and_then(|l| l.version.clone()),
    };
    let Some(desired) = &input.desired_version else {
        let message = match &actual {
            Some(v) => format!("driver {v}, no [driver] version is pinned"),
            None => "no [driver] version is pinned".to_string(),
        };
        return Check::pass("version", message, actual);
    };
    match &actual {
        None => Check::fail(
            "version",
            format!(
                "[driver] version asks for {desired} but no loaded driver version can be read (NVML does not \
                 initialise and /sys/module/nvidia/version is missing): the driver stage installs and loads it"
            ),
            None,
        ),
        Some(v) if version_matches(desired, v) => Check::pass(
            "version",
            format!("driver {v}, as [driver] version asks"),
            actual.clone(),
        ),
        Some(v) => Check::fail(
            "version",
            format!(
                "the loaded driver is {v} but [driver] version asks for {desired}: the upgrade waits for GPU work \
                 to end (see the driver stage)"
            ),
            actual.clone(),
        ),
    }
}

/// Whether the running version is the desired one: equal, or the desired one names a branch or a
/// prefix of it by whole dot-separated parts (`550` and `550.54` match `550.54.15`, `550.54.1`
/// does not).
fn version_matches(desired: &str, actual: &str) -> bool {
    let desired: Vec<&str> = desired.trim().split('.').collect();
    let actual: Vec<&str> = actual.trim().split('.').collect();
    desired.len() <= actual.len() && desired.iter().zip(&actual).all(|(d, a)| d == a)
}

fn check_modules(input: &ValidationInput) -> Check {
    let loaded: &[String] = input.loaded.as_ref().map_or(&[], |l| l.modules.as_slice());
    let is_loaded = |name: &str| loaded.iter().any(|m| m == name);
    let has_node = |node: &str| input.device_nodes.iter().any(|n| n == node);
    let mut missing: Vec<(&str, &str)> = Vec::new();
    // Modules `/sys/module` does not show but whose device node is there.
    let mut by_node: Vec<String> = Vec::new();
    for (name, why, node) in COMPUTE_MODULES {
        if is_loaded(name) {
            continue;
        }
        if has_node(node) {
            by_node.push(format!("{name} is not in /sys/module but {node} is present"));
        } else {
            missing.push((name, why));
        }
    }
    let modeset = input.loader.modeset_required();
    if let Some(why) = modeset
        && !is_loaded(MODESET_MODULE)
    {
        missing.push((MODESET_MODULE, why));
    }
    let mut observed: Vec<String> = loaded.to_vec();
    observed.extend(
        COMPUTE_MODULES
            .iter()
            .filter(|(name, _, node)| !is_loaded(name) && has_node(node))
            .map(|(_, _, node)| node.to_string()),
    );
    let observed = (!observed.is_empty()).then(|| observed.join(","));
    let other_means = matches!(input.loader, Loader::Other { .. });
    if missing.iter().any(|(name, _)| *name == "nvidia") {
        let message = if other_means {
            "the nvidia kernel module is not loaded (no /sys/module/nvidia, no /dev/nvidiactl), and [driver] source = \
             \"none\" loads none: load the driver installed on this node (`modprobe -a nvidia nvidia-uvm`); if \
             loading fails `dmesg` says why (an unsigned module under Secure Boot, nouveau holding the GPUs, a build \
             for another kernel)"
        } else {
            "the nvidia kernel module is not loaded: the driver stage loads it, and if loading failed `dmesg` \
             says why (an unsigned module under Secure Boot, nouveau holding the GPUs, a build for another kernel)"
        };
        return Check::fail("modules", message.to_string(), observed);
    }
    if missing.is_empty() {
        let refcnt = input
            .loaded
            .as_ref()
            .and_then(|l| l.refcnt)
            .map(|r| format!(" (nvidia refcnt {r})"))
            .unwrap_or_default();
        let mut message = format!("loaded: {}{refcnt}", loaded.join(", "));
        for line in &by_node {
            message.push_str(&format!("; {line}"));
        }
        if modeset.is_none() && !is_loaded(MODESET_MODULE) {
            message.push_str(&format!(
                "; {MODESET_MODULE} is not loaded, which compute does not need ([driver] require_modeset = false)"
            ));
        }
        return Check::pass("modules", message, observed);
    }
    let why: Vec<String> = missing.iter().map(|(name, why)| format!("{name}: {why}")).collect();
    let modprobe: Vec<String> = missing.iter().map(|(name, _)| name.replace('_', "-")).collect();
    let then = if other_means {
        "([driver] source = \"none\": the agent loads no module)"
    } else {
        "or run the driver stage again"
    };
    Check::fail(
        "modules",
        format!(
            "{} not loaded ({}): load with `modprobe -a {}` {then}",
            missing.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
            why.join(", "),
            modprobe.join(" ")
        ),
        observed,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(version: &str, modules: &[&str]) -> Option<LoadedDriver> {
        Some(LoadedDriver {
            version: Some(version.into()),
            modules: modules.iter().map(|m| m.to_string()).collect(),
            refcnt: Some(3),
        })
    }

    fn healthy() -> ValidationInput {
        ValidationInput {
            pci_gpus: 8,
            nvml: Ok(NvmlView {
                driver_version: "550.54.15".into(),
                gpu_count: 8,
            }),
            desired_version: Some("550.54.15".into()),
            loaded: loaded("550.54.15", &["nvidia", "nvidia_uvm", "nvidia_modeset"]),
            device_nodes: Vec::new(),
            loader: Loader::Agent,
        }
    }

    fn check<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap()
    }

    fn failed(input: &ValidationInput) -> Vec<&'static str> {
        validate(input).iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn healthy_driver() {
        let checks = validate(&healthy());
        assert_eq!(
            checks.iter().map(|c| (c.name, c.ok)).collect::<Vec<_>>(),
            [
                ("nvml", true),
                ("gpu-count", true),
                ("version", true),
                ("modules", true)
            ]
        );
        assert_eq!(summary(&checks), Ok("driver 550.54.15 on 8 GPU(s)".to_string()));
        assert_eq!(
            check(&checks, "modules").message,
            "loaded: nvidia, nvidia_uvm, nvidia_modeset (nvidia refcnt 3)"
        );
    }

    #[test]
    fn unpinned_version_passes() {
        let input = ValidationInput {
            desired_version: None,
            ..healthy()
        };
        let checks = validate(&input);
        assert_eq!(
            check(&checks, "version").message,
            "driver 550.54.15, no [driver] version is pinned"
        );
        assert_eq!(summary(&checks), Ok("driver 550.54.15 on 8 GPU(s)".to_string()));
    }

    #[test]
    fn branch_pin_matches_by_whole_parts() {
        assert!(version_matches("550", "550.54.15"));
        assert!(version_matches("550.54", "550.54.15"));
        assert!(version_matches("550.54.15", "550.54.15"));
        assert!(!version_matches("550.54.1", "550.54.15"));
        assert!(!version_matches("55", "550.54.15"));
        assert!(!version_matches("550.54.15.1", "550.54.15"));
    }

    #[test]
    fn nvml_fails_with_module_loaded() {
        let input = ValidationInput {
            nvml: Err("Driver/library version mismatch".into()),
            ..healthy()
        };
        assert_eq!(failed(&input), ["nvml"]);
        let checks = validate(&input);
        assert!(
            checks.iter().all(|c| c.name != "gpu-count"),
            "nothing to count without NVML"
        );
        let msg = &check(&checks, "nvml").message;
        assert_eq!(
            msg,
            "NVML does not initialise (Driver/library version mismatch): the nvidia module 550.54.15 is loaded, so \
             the user-space libraries do not match it: install the user-space part of driver 550.54.15 \
             (libnvidia-ml.so.1), or check [nvml] library"
        );
        // The version still checks out from /sys/module/nvidia/version.
        assert_eq!(check(&checks, "version").observed.as_deref(), Some("550.54.15"));
        assert_eq!(summary(&checks), Err(msg.clone()));
    }

    #[test]
    fn nothing_loaded() {
        let input = ValidationInput {
            nvml: Err("Driver Not Loaded".into()),
            loaded: None,
            ..healthy()
        };
        assert_eq!(failed(&input), ["nvml", "version", "modules"]);
        let checks = validate(&input);
        assert_eq!(
            check(&checks, "nvml").message,
            "NVML does not initialise (Driver Not Loaded): the nvidia module is not loaded (see the modules check)"
        );
        let version = &check(&checks, "version").message;
        assert!(
            version.contains("asks for 550.54.15 but no loaded driver version can be read"),
            "{version}"
        );
        let modules = &check(&checks, "modules").message;
        assert!(modules.starts_with("the nvidia kernel module is not loaded") && modules.contains("dmesg"));
        let err = summary(&checks).unwrap_err();
        assert_eq!(err.matches("; ").count(), 2, "{err}");
    }

    #[test]
    fn gpu_missing_from_nvml() {
        let mut input = healthy();
        input.nvml = Ok(NvmlView {
            driver_version: "550.54.15".into(),
            gpu_count: 7,
        });
        assert_eq!(failed(&input), ["gpu-count"]);
        assert_eq!(
            check(&validate(&input), "gpu-count").message,
            "NVML sees 7 GPU(s) but 8 NVIDIA PCI devices are present: a GPU fell off the bus or is bound to another \
             driver (vfio-pci?), check `dmesg` for Xid 79 and `lspci -k -d 10de:`"
        );
    }

    /// Two GPUs NVML lists (bus ids in NVML's form) and the sysfs addresses `pci`.
    fn addresses(pci: &[&str]) -> GpuAddresses {
        GpuAddresses {
            pci: pci.iter().map(|p| p.to_string()).collect(),
            nvml: [(0, "00000000:07:00.0"), (1, "00000000:0F:00.0")]
                .into_iter()
                .map(|(index, bus)| NvmlGpu {
                    index,
                    uuid: format!("GPU-{index}"),
                    pci_bus_id: bus.into(),
                })
                .collect(),
        }
    }

    fn named(pci_gpus: usize, addresses: &GpuAddresses) -> String {
        let mut input = healthy();
        input.pci_gpus = pci_gpus;
        input.nvml = Ok(NvmlView {
            driver_version: "550.54.15".into(),
            gpu_count: addresses.nvml.len(),
        });
        let checks = validate_named(&input, Some(addresses));
        check(&checks, "gpu-count").message.clone()
    }

    #[test]
    fn a_count_mismatch_names_the_gpus_only_one_side_lists() {
        // sysfs has a GPU NVML does not list; the formats differ (domain width, case).
        let a = addresses(&["0000:07:00.0", "0000:0f:00.0", "0000:c1:00.0"]);
        assert_eq!(
            named(3, &a),
            "NVML sees 2 GPU(s) but 3 NVIDIA PCI devices are present: NVML does not list 0000:c1:00.0: a GPU fell \
             off the bus or is bound to another driver (vfio-pci?), check `dmesg` for Xid 79 and `lspci -k -s \
             0000:c1:00.0`"
        );
        let a = addresses(&["0000:07:00.0", "0000:0f:00.0", "0000:c1:00.0", "0000:c2:00.0"]);
        assert!(
            named(4, &a).contains(": NVML does not list 0000:c1:00.0, 0000:c2:00.0: ")
                && named(4, &a).contains("-d 10de:"),
            "{}",
            named(4, &a)
        );
        // NVML lists a GPU sysfs does not show: named by index, UUID and bus id.
        let a = addresses(&["0000:07:00.0"]);
        assert_eq!(
            named(1, &a),
            "NVML sees 2 GPU(s) but only 1 NVIDIA PCI device(s) are visible in /sys/bus/pci/devices: GPU 1 (GPU-1, \
             00000000:0F:00.0) not in sysfs: the host's /sys is not under --root, or the PCI scan missed a device \
             class"
        );
        // Lists that do not agree with the counts (NVML's could not be read) name nothing.
        let mut unread = addresses(&["0000:07:00.0", "0000:0f:00.0", "0000:c1:00.0"]);
        unread.nvml.clear();
        let mut input = healthy();
        input.pci_gpus = 3;
        input.nvml = Ok(NvmlView {
            driver_version: "550.54.15".into(),
            gpu_count: 2,
        });
        let message = check(&validate_named(&input, Some(&unread)), "gpu-count")
            .message
            .clone();
        assert!(
            message.starts_with("NVML sees 2 GPU(s) but 3 NVIDIA PCI devices are present: a GPU"),
            "{message}"
        );
        // Counts that agree pass, whatever the formats.
        let a = addresses(&["0000:07:00.0", "0000:0f:00.0"]);
        assert_eq!(named(2, &a), "NVML sees all 2 NVIDIA GPU(s) on the PCI bus");
    }

    #[test]
    fn more_in_nvml_than_on_the_bus_and_no_gpu_at_all() {
        let mut input = healthy();
        input.pci_gpus = 0;
        let msg = check(&validate(&input), "gpu-count").message.clone();
        assert!(msg.starts_with("NVML sees 8 GPU(s) but only 0 NVIDIA PCI device(s)") && msg.contains("--root"));

        input.nvml = Ok(NvmlView {
            driver_version: "550.54.15".into(),
            gpu_count: 0,
        });
        let msg = check(&validate(&input), "gpu-count").message.clone();
        assert!(
            msg.starts_with("no NVIDIA GPU is on the PCI bus and NVML sees none"),
            "{msg}"
        );
    }

    #[test]
    fn version_differs() {
        let input = ValidationInput {
            nvml: Ok(NvmlView {
                driver_version: "535.161.08".into(),
                gpu_count: 8,
            }),
            loaded: loaded("535.161.08", &["nvidia", "nvidia_uvm", "nvidia_modeset"]),
            ..healthy()
        };
        assert_eq!(failed(&input), ["version"]);
        let checks = validate(&input);
        assert_eq!(
            summary(&checks),
            Err(
                "the loaded driver is 535.161.08 but [driver] version asks for 550.54.15: the upgrade waits for GPU \
                 work to end (see the driver stage)"
                    .to_string()
            )
        );
    }

    #[test]
    fn modules_missing() {
        let input = ValidationInput {
            loaded: loaded("550.54.15", &["nvidia"]),
            ..healthy()
        };
        assert_eq!(failed(&input), ["modules"]);
        let c = validate(&input).into_iter().find(|c| c.name == "modules").unwrap();
        assert_eq!(c.observed.as_deref(), Some("nvidia"));
        assert_eq!(
            c.message,
            "nvidia_uvm, nvidia_modeset not loaded (nvidia_uvm: CUDA programs cannot start without /dev/nvidia-uvm, \
             nvidia_modeset: the driver stage loads it with the others): load with `modprobe -a nvidia-uvm \
             nvidia-modeset` or run the driver stage again"
        );
    }

    /// The H200 host of issue 33: driver 580 installed by other means, `nvidia` and `nvidia_uvm`
    /// loaded, no `nvidia_modeset`.
    fn other_means(modules: &[&str]) -> ValidationInput {
        ValidationInput {
            pci_gpus: 1,
            nvml: Ok(NvmlView {
                driver_version: "580.159.04".into(),
                gpu_count: 1,
            }),
            desired_version: None,
            loaded: loaded("580.159.04", modules),
            device_nodes: Vec::new(),
            loader: Loader::Other { require_modeset: false },
        }
    }

    #[test]
    fn a_driver_installed_by_other_means_passes_without_nvidia_modeset() {
        let input = other_means(&["nvidia", "nvidia_uvm"]);
        let checks = validate(&input);
        assert!(failed(&input).is_empty(), "{checks:?}");
        assert_eq!(summary(&checks), Ok("driver 580.159.04 on 1 GPU(s)".to_string()));
        let modules = check(&checks, "modules");
        assert_eq!(
            modules.message,
            "loaded: nvidia, nvidia_uvm (nvidia refcnt 3); nvidia_modeset is not loaded, which compute does not \
             need ([driver] require_modeset = false)"
        );
        assert_eq!(modules.observed.as_deref(), Some("nvidia,nvidia_uvm"));
        // Loaded anyway: nothing to say about it.
        let input = other_means(&["nvidia", "nvidia_uvm", "nvidia_modeset"]);
        assert_eq!(
            check(&validate(&input), "modules").message,
            "loaded: nvidia, nvidia_uvm, nvidia_modeset (nvidia refcnt 3)"
        );
    }

    #[test]
    fn compute_still_needs_nvidia_uvm_from_a_driver_installed_by_other_means() {
        let input = other_means(&["nvidia"]);
        assert_eq!(failed(&input), ["modules"]);
        assert_eq!(
            check(&validate(&input), "modules").message,
            "nvidia_uvm not loaded (nvidia_uvm: CUDA programs cannot start without /dev/nvidia-uvm): load with \
             `modprobe -a nvidia-uvm` ([driver] source = \"none\": the agent loads no module)"
        );
        // Nothing loaded: the message does not promise a driver stage that loads nothing.
        let input = ValidationInput {
            nvml: Err("Driver Not Loaded".into()),
            loaded: None,
            ..other_means(&[])
        };
        let modules = check(&validate(&input), "modules").message.clone();
        assert!(
            modules.starts_with("the nvidia kernel module is not loaded (no /sys/module/nvidia, no /dev/nvidiactl)")
                && modules.contains("source = \"none\" loads none")
                && !modules.contains("the driver stage loads it"),
            "{modules}"
        );
    }

    #[test]
    fn device_nodes_stand_in_for_modules_sys_module_does_not_show() {
        let input = ValidationInput {
            device_nodes: vec!["/dev/nvidia-uvm".into()],
            ..other_means(&["nvidia"])
        };
        let c = check(&validate(&input), "modules").clone();
        assert!(c.ok, "{c:?}");
        assert!(
            c.message
                .contains("nvidia_uvm is not in /sys/module but /dev/nvidia-uvm is present"),
            "{}",
            c.message
        );
        assert_eq!(c.observed.as_deref(), Some("nvidia,/dev/nvidia-uvm"));
        // No /sys/module at all (a root without the host's /sys), both nodes there.
        let input = ValidationInput {
            loaded: None,
            device_nodes: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
            ..other_means(&[])
        };
        let c = check(&validate(&input), "modules").clone();
        assert!(c.ok, "{c:?}");
        assert_eq!(c.observed.as_deref(), Some("/dev/nvidiactl,/dev/nvidia-uvm"));
        // A node does not stand in for nvidia_modeset where it is required.
        let input = ValidationInput {
            device_nodes: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
            loader: Loader::Other { require_modeset: true },
            ..other_means(&["nvidia", "nvidia_uvm"])
        };
        assert_eq!(failed(&input), ["modules"]);
    }

    #[test]
    fn nvidia_modeset_is_required_where_the_agent_loads_the_driver_or_the_config_asks() {
        let input = ValidationInput {
            loader: Loader::Agent,
            ..other_means(&["nvidia", "nvidia_uvm"])
        };
        assert_eq!(failed(&input), ["modules"]);
        assert_eq!(
            check(&validate(&input), "modules").message,
            "nvidia_modeset not loaded (nvidia_modeset: the driver stage loads it with the others): load with \
             `modprobe -a nvidia-modeset` or run the driver stage again"
        );
        let input = ValidationInput {
            loader: Loader::Other { require_modeset: true },
            ..other_means(&["nvidia", "nvidia_uvm"])
        };
        assert_eq!(failed(&input), ["modules"]);
        assert_eq!(
            check(&validate(&input), "modules").message,
            "nvidia_modeset not loaded (nvidia_modeset: [driver] require_modeset = true): load with `modprobe -a \
             nvidia-modeset` ([driver] source = \"none\": the agent loads no module)"
        );
    }
}
