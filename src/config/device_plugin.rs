//! `[kubelet]` and `[device_plugin]` (with its memory limits and profiles): what the device plugin
//! advertises to the kubelet, and how; their defaults and validation.

use super::merge::KeyPath;
use super::values::{self, DeviceIdStrategy, DeviceListStrategies, DeviceListStrategy, MemoryAction, MigStrategy};
use super::{Check, Invalid, Sharing, absolute_path, invalid, positive};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `kubelet.device_plugin_dir`: where `kubelet.sock` is and plugin sockets go.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// `kubelet.register_timeout`: limit on one `Register` call.
pub const DEFAULT_REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// `device_plugin.enabled`: serve the kubelet device plugin.
pub const DEFAULT_DEVICE_PLUGIN_ENABLED: bool = true;
/// `device_plugin.mig_strategy`.
pub const DEFAULT_MIG_STRATEGY: MigStrategy = MigStrategy::None;
/// `device_plugin.device_list_strategy`.
/// `auto`: `envvar` with the NVIDIA Container Toolkit's runtime, `cdi-cri` without it.
pub const DEFAULT_DEVICE_LIST_STRATEGY: &[DeviceListStrategy] = &[DeviceListStrategy::Auto];
/// `device_plugin.device_id_strategy`.
pub const DEFAULT_DEVICE_ID_STRATEGY: DeviceIdStrategy = DeviceIdStrategy::Uuid;
/// `device_plugin.pass_device_specs`: add `/dev/nvidia*` device specs to `Allocate` responses.
pub const DEFAULT_PASS_DEVICE_SPECS: bool = false;
/// `device_plugin.cdi_annotation_prefix`: annotation key prefix of the `cdi-annotations`
/// strategy.
pub const DEFAULT_CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// `device_plugin.cdi_kind`: CDI `vendor/class` of the devices: NVIDIA's device plugin's
/// vendor, not `nvidia.com/gpu`. The NVIDIA Container Toolkit (1.18 and later,
/// `nvidia-cdi-refresh`) writes `/var/run/cdi/nvidia.yaml` with kind `nvidia.com/gpu` and the same
/// device names; the CDI library drops every device two specs of one directory both define, so
/// with that kind no name would resolve on such a node. The agent writes the CDI spec for this
/// kind itself (`[cdi]`), so the names it hands out always resolve.
pub const DEFAULT_CDI_KIND: &str = "k8s.device-plugin.nvidia.com/gpu";
/// `device_plugin.driver_root`: where the driver's files are on the host.
pub const DEFAULT_DRIVER_ROOT: &str = "/";
/// `device_plugin.dev_root`: host root of `/dev/nvidia*` for device specs.
pub const DEFAULT_DEV_ROOT: &str = "/";
/// `device_plugin.host_mounts_driver_dir`: host dir with the driver's `lib64/` and `bin/`.
pub const DEFAULT_HOST_MOUNTS_DRIVER_DIR: &str = "/usr/local/nvidia";
/// `device_plugin.host_mounts_container_dir`: where that dir is mounted in the container.
pub const DEFAULT_HOST_MOUNTS_CONTAINER_DIR: &str = "/usr/local/nvidia";
/// `device_plugin.gds_enabled`, `mofed_enabled`, `gdrcopy_enabled`: NVIDIA's `gdsEnabled`,
/// `mofedEnabled`, `gdrcopyEnabled`, off by default.
pub const DEFAULT_INJECTION_ENABLED: bool = false;
/// `device_plugin.memory_limits.action`: a process over its replica's memory budget is logged.
pub const DEFAULT_MEMORY_ACTION: MemoryAction = MemoryAction::Log;
/// `device_plugin.memory_limits.interval`: how often GPU processes' memory is checked.
pub const DEFAULT_MEMORY_INTERVAL: Duration = Duration::from_secs(5);
/// `device_plugin.memory_limits.grace_period`: SIGTERM to SIGKILL under `action = "kill"`.
pub const DEFAULT_MEMORY_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// `[kubelet]`: talking to the kubelet's device-plugin API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeletConfig {
    /// Directory with `kubelet.sock`, where plugin sockets are created (host path).
    pub device_plugin_dir: PathBuf,
    /// Limit on one `Register` call.
    #[serde(with = "values::duration")]
    pub register_timeout: Duration,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        KubeletConfig {
            device_plugin_dir: DEFAULT_DEVICE_PLUGIN_DIR.into(),
            register_timeout: DEFAULT_REGISTER_TIMEOUT,
        }
    }
}

impl KubeletConfig {
    pub(super) fn validate(&self) -> Check {
        absolute_path("kubelet.device_plugin_dir", &self.device_plugin_dir)?;
        positive("kubelet.register_timeout", self.register_timeout)
    }
}

/// `[device_plugin]`: what is advertised to the kubelet and how devices reach containers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginConfig {
    /// Serve the device plugin.
    pub enabled: bool,
    /// How MIG devices are advertised.
    pub mig_strategy: MigStrategy,
    /// How allocated devices are passed to containers; non-empty, no duplicates,
    /// `host-mounts` not combined with a `cdi-*` strategy.
    pub device_list_strategy: DeviceListStrategies,
    /// How devices are named in responses.
    pub device_id_strategy: DeviceIdStrategy,
    /// Add `/dev/nvidia*` device specs to `Allocate` responses.
    pub pass_device_specs: bool,
    /// Annotation key prefix for `cdi-annotations`; ends with '/'.
    pub cdi_annotation_prefix: String,
    /// CDI device kind, `<vendor>/<class>`.
    pub cdi_kind: String,
    /// Where the driver's files are on the host (host path).
    pub driver_root: PathBuf,
    /// Host root of `/dev/nvidia*` for device specs (host path).
    pub dev_root: PathBuf,
    /// `host-mounts`: host dir with the driver's `lib64/` and `bin/` (host path; GKE:
    /// `/home/kubernetes/bin/nvidia`).
    pub host_mounts_driver_dir: PathBuf,
    /// `host-mounts`: where that dir is mounted in the container.
    pub host_mounts_container_dir: PathBuf,
    /// Profile applied when the Node has no `nvidia.com/device-plugin.config` label; empty:
    /// none (the keys above apply as they are).
    pub default_profile: String,
    /// Named profiles a Node label selects (`[device_plugin.profiles.<name>]`): each overrides
    /// some of the keys above. Labels only name profiles; what they do is defined here.
    pub profiles: BTreeMap<String, DevicePluginProfile>,
    /// `[device_plugin.sharing]`: time-slicing (none by default).
    pub sharing: Sharing,
    /// `[device_plugin.memory_limits]`: what happens to a process over its replica's memory
    /// budget (`sharing.resources[].memory_per_replica`).
    pub memory_limits: MemoryLimitsConfig,
    /// GPUDirect Storage: `NVIDIA_GDS=enabled` and the CDI device `<vendor>/gds=all`
    /// (NVIDIA's `gdsEnabled`).
    pub gds_enabled: bool,
    /// MOFED (InfiniBand verbs): `NVIDIA_MOFED=enabled` and `<vendor>/mofed=all` (NVIDIA's
    /// `mofedEnabled`).
    pub mofed_enabled: bool,
    /// GDRCopy: `NVIDIA_GDRCOPY=enabled` and `<vendor>/gdrcopy=all` (NVIDIA's `gdrcopyEnabled`).
    pub gdrcopy_enabled: bool,
    /// `[device_plugin.imex]`: IMEX channels given to every container with a GPU.
    pub imex: ImexConfig,
}

/// `[device_plugin.imex]`: NVIDIA's `imex` config: IMEX channels injected into every container
/// that gets a device of this plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImexConfig {
    /// `[]` (none, the default) or `[0]`, as NVIDIA allows.
    pub channel_ids: Vec<u32>,
    /// A listed channel whose `/dev/nvidia-caps-imex-channels/channel<N>` does not exist is an
    /// error (Allocate fails, the CDI spec is not written) instead of being left out.
    pub required: bool,
}

impl ImexConfig {
    /// NVIDIA's rule (`AssertChannelIDsValid`): `channel_ids` is `[]` or `[0]`.
    fn validate(&self, key: &KeyPath) -> Check {
        if self.channel_ids.is_empty() || self.channel_ids == [0] {
            return Ok(());
        }
        Err(Invalid {
            key: key.clone().key("channel_ids"),
            reason: format!(
                "must be [] or [0] (the only IMEX channel NVIDIA's device plugin hands out), found {:?}",
                self.channel_ids
            ),
        })
    }
}

/// `[device_plugin.memory_limits]`: the memory-limit enforcer's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryLimitsConfig {
    /// `log`, `kill` or `dry-run`.
    pub action: MemoryAction,
    /// How often the GPU processes' memory use is compared with the budgets.
    #[serde(with = "values::duration")]
    pub interval: Duration,
    /// Under `kill`: how long after SIGTERM a process still over its budget gets SIGKILL.
    #[serde(with = "values::duration")]
    pub grace_period: Duration,
}

impl Default for MemoryLimitsConfig {
    fn default() -> Self {
        MemoryLimitsConfig {
            action: DEFAULT_MEMORY_ACTION,
            interval: DEFAULT_MEMORY_INTERVAL,
            grace_period: DEFAULT_MEMORY_GRACE_PERIOD,
        }
    }
}

/// `[device_plugin.profiles.<name>]`: overrides of `[device_plugin]` keys, selected by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicePluginProfile {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_strategy: Option<MigStrategy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<DeviceListStrategies>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_id_strategy: Option<DeviceIdStrategy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_device_specs: Option<bool>,
    /// Replaces the whole `[device_plugin.sharing]` table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gds_enabled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mofed_enabled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gdrcopy_enabled: Option<bool>,
    /// Replaces the whole `[device_plugin.imex]` table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub imex: Option<ImexConfig>,
}

impl DevicePluginConfig {
    /// The effective `[device_plugin]` keys with the profile `name` applied; `None` when no
    /// such profile is defined.
    pub fn with_profile(&self, name: &str) -> Option<DevicePluginConfig> {
        let p = self.profiles.get(name)?;
        let mut out = self.clone();
        if let Some(v) = p.mig_strategy {
            out.mig_strategy = v;
        }
        if let Some(v) = &p.device_list_strategy {
            out.device_list_strategy = v.clone();
        }
        if let Some(v) = p.device_id_strategy {
            out.device_id_strategy = v;
        }
        if let Some(v) = p.pass_device_specs {
            out.pass_device_specs = v;
        }
        if let Some(v) = &p.sharing {
            out.sharing = v.clone();
        }
        if let Some(v) = p.gds_enabled {
            out.gds_enabled = v;
        }
        if let Some(v) = p.mofed_enabled {
            out.mofed_enabled = v;
        }
        if let Some(v) = p.gdrcopy_enabled {
            out.gdrcopy_enabled = v;
        }
        if let Some(v) = &p.imex {
            out.imex = v.clone();
        }
        Some(out)
    }
}

impl Default for DevicePluginConfig {
    fn default() -> Self {
        DevicePluginConfig {
            enabled: DEFAULT_DEVICE_PLUGIN_ENABLED,
            mig_strategy: DEFAULT_MIG_STRATEGY,
            device_list_strategy: DeviceListStrategies(DEFAULT_DEVICE_LIST_STRATEGY.to_vec()),
            device_id_strategy: DEFAULT_DEVICE_ID_STRATEGY,
            pass_device_specs: DEFAULT_PASS_DEVICE_SPECS,
            cdi_annotation_prefix: DEFAULT_CDI_ANNOTATION_PREFIX.to_owned(),
            cdi_kind: DEFAULT_CDI_KIND.to_owned(),
            driver_root: DEFAULT_DRIVER_ROOT.into(),
            dev_root: DEFAULT_DEV_ROOT.into(),
            host_mounts_driver_dir: DEFAULT_HOST_MOUNTS_DRIVER_DIR.into(),
            host_mounts_container_dir: DEFAULT_HOST_MOUNTS_CONTAINER_DIR.into(),
            default_profile: String::new(),
            profiles: BTreeMap::new(),
            sharing: Sharing::default(),
            memory_limits: MemoryLimitsConfig::default(),
            gds_enabled: DEFAULT_INJECTION_ENABLED,
            mofed_enabled: DEFAULT_INJECTION_ENABLED,
            gdrcopy_enabled: DEFAULT_INJECTION_ENABLED,
            imex: ImexConfig::default(),
        }
    }
}

impl DevicePluginConfig {
    pub(super) fn validate(&self) -> Check {
        check_strategies(
            KeyPath::dotted("device_plugin.device_list_strategy"),
            &self.device_list_strategy,
        )?;
        for (name, profile) in &self.profiles {
            let at = KeyPath::dotted("device_plugin.profiles").key(name);
            crate::names::check_label_value(name).map_err(|reason| Invalid {
                key: at.clone(),
                reason: format!("a profile name is selected by a label value: {reason}"),
            })?;
            if let Some(strategies) = &profile.device_list_strategy {
                check_strategies(at.clone().key("device_list_strategy"), strategies)?;
            }
            if let Some(imex) = &profile.imex {
                imex.validate(&at.clone().key("imex"))?;
            }
            if let Some(sharing) = &profile.sharing {
                let mig_strategy = profile.mig_strategy.unwrap_or(self.mig_strategy);
                sharing.validate(&at.key("sharing"), mig_strategy)?;
            }
        }
        self.imex.validate(&KeyPath::dotted("device_plugin.imex"))?;
        self.sharing
            .validate(&KeyPath::dotted("device_plugin.sharing"), self.mig_strategy)?;
        positive("device_plugin.memory_limits.interval", self.memory_limits.interval)?;
        if !self.default_profile.is_empty() && !self.profiles.contains_key(&self.default_profile) {
            return Err(invalid(
                "device_plugin.default_profile",
                "names no profile defined under [device_plugin.profiles]",
            ));
        }

        let prefix = &self.cdi_annotation_prefix;
        let prefix_ok = prefix.strip_suffix('/').is_some_and(crate::names::is_dns_subdomain);
        if !prefix_ok {
            return Err(invalid(
                "device_plugin.cdi_annotation_prefix",
                "expected a DNS name followed by '/', e.g. \"cdi.k8s.io/\"",
            ));
        }
        values::check_cdi_kind(&self.cdi_kind).map_err(|reason| invalid("device_plugin.cdi_kind", reason))?;

        absolute_path("device_plugin.driver_root", &self.driver_root)?;
        absolute_path("device_plugin.dev_root", &self.dev_root)?;
        absolute_path("device_plugin.host_mounts_driver_dir", &self.host_mounts_driver_dir)?;
        absolute_path(
            "device_plugin.host_mounts_container_dir",
            &self.host_mounts_container_dir,
        )
    }
}

/// `device_list_strategy` rules: non-empty, no duplicates, host-mounts not with CDI.
fn check_strategies(key: KeyPath, strategies: &DeviceListStrategies) -> Check {
    let at = |reason: String| Invalid {
        key: key.clone(),
        reason,
    };
    let list = strategies.as_slice();
    if list.is_empty() {
        return Err(at(format!(
            "expected at least one of {}",
            DeviceListStrategy::expected()
        )));
    }
    if list.len() > 1 && strategies.contains(DeviceListStrategy::Auto) {
        return Err(at(
            "auto picks one strategy itself (envvar, or cdi-cri without the NVIDIA runtime); list strategies without it"
                .to_owned(),
        ));
    }
    for (i, s) in list.iter().enumerate() {
        if list[..i].contains(s) {
            return Err(at(format!("{s} is listed twice")));
        }
    }
    if strategies.contains(DeviceListStrategy::HostMounts)
        && let Some(cdi) = list.iter().find(|s| s.is_cdi())
    {
        return Err(at(format!("host-mounts cannot be combined with {cdi}")));
    }
    Ok(())
}
