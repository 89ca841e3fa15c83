//! The opt-in injections of NVIDIA's device plugin (v0.20): `gdsEnabled`, `mofedEnabled`,
//! `gdrcopyEnabled` and the IMEX channels (`imex.channelIDs`, `imex.required`), decided once
//! from the config and the host's nodes ([`Injections::edits`]); Allocate and the CDI specs of
//! the classes render the same [`InjectionEdits`].
//!
//! What each renderer makes of them (NVIDIA's `getAllocateResponse` and `nvcdi`):
//! - every enabled flag sets its env (`NVIDIA_GDRCOPY=enabled`, ...) in Allocate, whatever the
//!   strategies, also when all are CDI ones;
//! - a class is handed out by CDI name (`<vendor>/gdrcopy=all`, `<vendor>/imex-channel=<N>`) and
//!   gets a CDI spec only when the host has its nodes (NVIDIA drops a class whose spec came out
//!   empty);
//! - IMEX channels are NVIDIA's `imex.GetChannels`: a configured channel is handed out only when
//!   its node exists under the dev root; with `required` a missing one is an error naming its
//!   path.

use std::path::Path;

use super::DeviceNode;
use super::nodes::{ExtraNodes, imex_channel_path};
use crate::config::DevicePluginConfig;

/// Env of the GDRCopy injection (`NVIDIA_GDRCOPY=enabled`).
pub const GDRCOPY_ENV: &str = "NVIDIA_GDRCOPY";
/// Env of the GPUDirect Storage injection.
pub const GDS_ENV: &str = "NVIDIA_GDS";
/// Env of the MOFED injection.
pub const MOFED_ENV: &str = "NVIDIA_MOFED";
/// The value of the three envs above.
pub const ENABLED: &str = "enabled";
/// Env listing the IMEX channels (`spec.ImexChannelEnvVar`).
pub const IMEX_CHANNELS_ENV: &str = "NVIDIA_IMEX_CHANNELS";
/// CDI class of the IMEX channels.
pub const IMEX_CLASS: &str = "imex-channel";
/// CDI classes of the flag injections, in the order NVIDIA hands them out.
pub const FLAG_CLASSES: [&str; 3] = ["gdrcopy", "gds", "mofed"];
/// The CDI device of a flag class.
pub const ALL_DEVICE: &str = "all";

/// What is enabled (the `[device_plugin]` keys `gds_enabled`, `mofed_enabled`,
/// `gdrcopy_enabled` and `[device_plugin.imex]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Injections {
    pub gds: bool,
    pub mofed: bool,
    pub gdrcopy: bool,
    /// `[]` or `[0]` (validated by the config).
    pub imex_channel_ids: Vec<u32>,
    pub imex_required: bool,
}

/// `[device_plugin.imex] required` and a listed channel's node does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImexChannelMissing {
    /// Host path of the channel's node.
    pub path: String,
}

/// One enabled flag injection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagEdits {
    /// Its CDI class, one of [`FLAG_CLASSES`].
    pub class: &'static str,
    /// Its env, set to [`ENABLED`].
    pub env: &'static str,
    /// Its nodes the host has; empty: the class is not handed out by name.
    pub device_nodes: Vec<DeviceNode>,
}

/// The injections of one config on one host: what every renderer hands out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InjectionEdits {
    /// The enabled flags, in [`FLAG_CLASSES`] order.
    pub flags: Vec<FlagEdits>,
    /// The IMEX channels handed out (configured and present), in config order, with their node.
    pub imex_channels: Vec<(u32, DeviceNode)>,
}

impl Injections {
    /// What the `[device_plugin]` keys enable.
    pub fn from_config(dp: &DevicePluginConfig) -> Injections {
        Injections {
            gds: dp.gds_enabled,
            mofed: dp.mofed_enabled,
            gdrcopy: dp.gdrcopy_enabled,
            imex_channel_ids: dp.imex.channel_ids.clone(),
            imex_required: dp.imex.required,
        }
    }

    /// Whether the flag of a class of [`FLAG_CLASSES`] is on.
    pub fn flag(&self, class: &str) -> bool {
        match class {
            "gdrcopy" => self.gdrcopy,
            "gds" => self.gds,
            "mofed" => self.mofed,
            _ => false,
        }
    }

    /// The injections' edits on a host with `nodes`, host paths under `dev_root`. A required
    /// IMEX channel whose node is missing is [`ImexChannelMissing`], naming its host path.
    pub fn edits(&self, nodes: &ExtraNodes, dev_root: &Path) -> Result<InjectionEdits, ImexChannelMissing> {
        let mut imex_channels = Vec::new();
        for &id in &self.imex_channel_ids {
            let node = DeviceNode::new(imex_channel_path(id), dev_root);
            if nodes.imex_channels.contains(&id) {
                imex_channels.push((id, node));
            } else if self.imex_required {
                return Err(ImexChannelMissing {
                    path: node.host_path.to_string_lossy().into_owned(),
                });
            }
        }
        let flags = FLAG_CLASSES
            .into_iter()
            .zip([GDRCOPY_ENV, GDS_ENV, MOFED_ENV])
            .filter(|(class, _)| self.flag(class))
            .map(|(class, env)| FlagEdits {
                class,
                env,
                device_nodes: class_nodes(nodes, class)
                    .iter()
                    .map(|path| DeviceNode::new(path.clone(), dev_root))
                    .collect(),
            })
            .collect();
        Ok(InjectionEdits { flags, imex_channels })
    }
}

/// The flag nodes a class of [`FLAG_CLASSES`] stands for.
pub fn class_nodes<'a>(nodes: &'a ExtraNodes, class: &str) -> &'a [String] {
    match class {
        "gdrcopy" => &nodes.gdrcopy,
        "gds" => &nodes.gds,
        "mofed" => &nodes.mofed,
        _ => &[],
    }
}

impl InjectionEdits {
    /// The flags whose nodes the host has: the classes handed out by CDI name and given a spec.
    pub fn present_flags(&self) -> impl Iterator<Item = &FlagEdits> {
        self.flags.iter().filter(|f| !f.device_nodes.is_empty())
    }
}
