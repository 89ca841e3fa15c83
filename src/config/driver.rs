//! `[driver]`: the NVIDIA kernel driver for the running kernel; its defaults and validation.

use super::merge::KeyPath;
use super::{Check, Invalid, absolute_path, invalid};
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `driver.enabled`: run the driver stage.
pub const DEFAULT_DRIVER_ENABLED: bool = true;
/// `driver.runfile_url`: NVIDIA's download site for data center drivers.
pub const DEFAULT_RUNFILE_URL: &str =
    "https://us.download.nvidia.com/tesla/{version}/NVIDIA-Linux-{arch}-{version}.run";
/// `driver.create_device_nodes`: create the driver's missing device nodes, as nvidia-modprobe does.
pub const DEFAULT_CREATE_DEVICE_NODES: bool = true;
/// `driver.create_dev_char_links`: keep `/dev/char/<major>:<minor>` links to the NVIDIA device
/// nodes, as `nvidia-ctk system create-dev-char-symlinks` does.
pub const DEFAULT_CREATE_DEV_CHAR_LINKS: bool = true;
/// `driver.require_modeset`: validation requires `nvidia_modeset` also with `source = "none"`.
pub const DEFAULT_REQUIRE_MODESET: bool = false;
/// `driver.modprobe_conf`: the module options and nouveau blacklist the agent owns.
pub const DEFAULT_MODPROBE_CONF: &str = "/etc/modprobe.d/gpu-node-agent.conf";
/// `driver.package_names.ubuntu`: Canonical's signed precompiled modules for the running kernel
/// and the matching user space (`{branch}` is the version's first component, `{-open}` is
/// `-open` for the open flavour).
pub const DEFAULT_PACKAGES_UBUNTU: &[&str] = &[
    "linux-modules-nvidia-{branch}-server{-open}-{kernel}",
    "nvidia-headless-no-dkms-{branch}-server{-open}",
    "nvidia-utils-{branch}-server",
];
/// `driver.package_names.debian`: Debian's DKMS packages (built for the running kernel on
/// install; they need the kernel headers).
pub const DEFAULT_PACKAGES_DEBIAN: &[&str] = &[
    "linux-headers-{kernel}",
    "nvidia{-open}-kernel-dkms",
    "nvidia-driver",
    "nvidia-smi",
];
/// `driver.package_names.rhel`: NVIDIA's CUDA repository packages (DKMS flavour).
pub const DEFAULT_PACKAGES_RHEL: &[&str] = &["kernel-devel-{kernel}", "kmod-nvidia{-open}-dkms", "nvidia-driver-cuda"];

/// Where the driver comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverSource {
    /// Installed by other means: only validated.
    None,
    /// The distribution's packages (apt or dnf).
    Package,
    /// An NVIDIA `.run` file, its modules built with kbuild for the running kernel.
    Runfile,
    /// A tarball of modules built for this kernel.
    Prebuilt,
}

/// Which kernel modules: `auto` picks open where the GPUs support it (Turing and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlavourChoice {
    Auto,
    Open,
    Proprietary,
}

/// `[driver]`: the NVIDIA kernel driver for the running kernel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DriverConfig {
    /// Run the driver stage.
    pub enabled: bool,
    /// `none` (validate only), `package`, `runfile` or `prebuilt`.
    pub source: DriverSource,
    /// The driver version wanted, e.g. `550.54.15`; required unless `source = "none"` (where it
    /// is only checked when set).
    pub version: String,
    /// `auto`, `open` or `proprietary`.
    pub flavour: FlavourChoice,
    /// Module parameters by module (`nvidia`, `nvidia-uvm`, `nvidia-modeset`, ...), e.g.
    /// `{ nvidia = ["NVreg_EnableGpuFirmware=1"] }`, written to `modprobe_conf` and passed when
    /// loading.
    pub module_params: BTreeMap<String, Vec<String>>,
    /// Modules loaded after the three core ones, e.g. `["nvidia-peermem"]`.
    pub extra_modules: Vec<String>,
    /// Turn persistence mode on after loading.
    pub persistence_mode: bool,
    /// The `.run` URL template (`{version}`, `{arch}`).
    pub runfile_url: String,
    /// sha256 of the `.run` file; required with `source = "runfile"` (no checksum, no download).
    pub runfile_sha256: String,
    /// URL template of the prebuilt modules tarball (`{version}`, `{kernel}`, `{flavour}`,
    /// `{arch}`).
    pub prebuilt_url: String,
    /// sha256 of the prebuilt tarball per kernel release.
    pub prebuilt_sha256: BTreeMap<String, String>,
    /// Package name templates per distribution family (`ubuntu`, `debian`, `rhel`), with
    /// `{version}`, `{branch}`, `{kernel}`, `{-open}`.
    pub package_names: BTreeMap<String, Vec<String>>,
    /// Module options and the nouveau blacklist the agent owns (host path).
    pub modprobe_conf: PathBuf,
    /// Create the device nodes the loaded driver has and `/dev` lacks (`nvidiactl`,
    /// `nvidia<N>`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`, the MIG capability nodes
    /// under `nvidia-caps/`), as nvidia-modprobe does, under `[device_plugin] dev_root`: when
    /// NVML is opened and whenever the GPU inventory changes (after every MIG change). Nothing
    /// is ever removed; a node with other numbers is reported and left as it is.
    pub create_device_nodes: bool,
    /// Keep a `/dev/char/<major>:<minor>` link (relative, as udev writes it: `../nvidia0`) to
    /// every NVIDIA device node under `[device_plugin] dev_root` (`nvidiactl`, `nvidia<N>`,
    /// `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`, `nvidia-caps/nvidia-cap<N>`): systemd
    /// rebuilds a container's device rules from those links at every `daemon-reload`, and without
    /// them containers under the systemd cgroup driver lose their GPUs. Done after the device
    /// nodes, when NVML is opened and after every MIG change; a link someone else made is left as
    /// it is; `runtime unconfigure` removes the links the agent made.
    pub create_dev_char_links: bool,
    /// Validation requires the `nvidia_modeset` module loaded (display and DRM need it, CUDA
    /// does not) also with `source = "none"`. Where the agent loads the driver itself
    /// (`package`, `runfile`, `prebuilt`) it loads `nvidia-modeset` with the others and requires
    /// it whatever this says; with `source = "none"` validation otherwise requires what compute
    /// needs: `nvidia` and `nvidia_uvm` loaded (or their device nodes present).
    pub require_modeset: bool,
}

impl Default for DriverConfig {
    fn default() -> Self {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        DriverConfig {
            enabled: DEFAULT_DRIVER_ENABLED,
            source: DriverSource::None,
            version: String::new(),
            flavour: FlavourChoice::Auto,
            module_params: BTreeMap::new(),
            extra_modules: Vec::new(),
            persistence_mode: true,
            runfile_url: DEFAULT_RUNFILE_URL.into(),
            runfile_sha256: String::new(),
            prebuilt_url: String::new(),
            prebuilt_sha256: BTreeMap::new(),
            package_names: BTreeMap::from([
                ("debian".to_string(), names(DEFAULT_PACKAGES_DEBIAN)),
                ("rhel".to_string(), names(DEFAULT_PACKAGES_RHEL)),
                ("ubuntu".to_string(), names(DEFAULT_PACKAGES_UBUNTU)),
            ]),
            modprobe_conf: DEFAULT_MODPROBE_CONF.into(),
            create_device_nodes: DEFAULT_CREATE_DEVICE_NODES,
            create_dev_char_links: DEFAULT_CREATE_DEV_CHAR_LINKS,
            require_modeset: DEFAULT_REQUIRE_MODESET,
        }
    }
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl DriverConfig {
    pub(super) fn validate(&self) -> Check {
        let version_ok = |v: &str| {
            !v.is_empty()
                && v.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        };
        if !self.version.is_empty() && !version_ok(&self.version) {
            return Err(invalid(
                "driver.version",
                "expected a driver version such as \"550.54.15\"",
            ));
        }
        if self.source != DriverSource::None && self.version.is_empty() {
            return Err(invalid(
                "driver.source",
                "installing a driver needs [driver] version (e.g. \"550.54.15\")",
            ));
        }
        if self.source == DriverSource::Runfile && !is_sha256(&self.runfile_sha256) {
            return Err(invalid(
                "driver.runfile_sha256",
                "source = \"runfile\" needs the .run file's sha256 (64 hex digits): nothing is downloaded without one",
            ));
        }
        if self.source == DriverSource::Prebuilt && self.prebuilt_url.is_empty() {
            return Err(invalid(
                "driver.prebuilt_url",
                "source = \"prebuilt\" needs a URL template",
            ));
        }
        for (kernel, sum) in &self.prebuilt_sha256 {
            if !is_sha256(sum) {
                return Err(Invalid {
                    key: KeyPath::dotted("driver.prebuilt_sha256").key(kernel),
                    reason: "expected a sha256 (64 hex digits)".into(),
                });
            }
        }
        for distro in self.package_names.keys() {
            if !["debian", "rhel", "ubuntu"].contains(&distro.as_str()) {
                return Err(Invalid {
                    key: KeyPath::dotted("driver.package_names").key(distro),
                    reason: "expected one of debian, rhel, ubuntu".into(),
                });
            }
        }
        let module_name =
            |m: &str| !m.is_empty() && m.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if let Some(module) = self.module_params.keys().find(|m| !module_name(m)) {
            return Err(Invalid {
                key: KeyPath::dotted("driver.module_params").key(module),
                reason: format!("{module:?} is not a kernel module name"),
            });
        }
        if let Some((i, module)) = self.extra_modules.iter().enumerate().find(|(_, m)| !module_name(m)) {
            return Err(Invalid {
                key: KeyPath::dotted("driver.extra_modules").index(i),
                reason: format!("{module:?} is not a kernel module name"),
            });
        }
        for (module, params) in &self.module_params {
            for p in params {
                let ok = p.split_once('=').is_some_and(|(k, _)| !k.is_empty()) && !p.contains(char::is_whitespace);
                if !ok {
                    return Err(Invalid {
                        key: KeyPath::dotted("driver.module_params").key(module),
                        reason: format!("{p:?} is not a module parameter (name=value, no spaces)"),
                    });
                }
            }
        }
        absolute_path("driver.modprobe_conf", &self.modprobe_conf)
    }
}
