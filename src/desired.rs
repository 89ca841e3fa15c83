//! Desired state: what the Node's labels (or a labels file) ask of the agent, validated.
//!
//! A label only *names* something the root-owned config defines; a value that is not a valid
//! label value, or that names nothing, changes nothing and is reported with the reason.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::{DevicePluginConfig, LabelsConfig};
use crate::names::{check_label_key, check_label_value};

/// What one desired-state label asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Selection {
    /// The label is not set.
    Unset,
    /// A well-formed value.
    Name { name: String },
    /// A value that is not a valid label value (only possible from a labels file; the API
    /// server validates values itself).
    Invalid { value: String, reason: String },
}

impl Selection {
    fn from_label(labels: &BTreeMap<String, String>, key: &str) -> Selection {
        match labels.get(key) {
            None => Selection::Unset,
            Some(v) if v.is_empty() => Selection::Unset,
            Some(v) => match check_label_value(v) {
                Ok(()) => Selection::Name { name: v.clone() },
                Err(reason) => Selection::Invalid {
                    value: v.clone(),
                    reason,
                },
            },
        }
    }
}

/// Where the labels came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The Node object, through the API server.
    Node,
    /// `[desired] labels_file`.
    File,
    /// Neither: the config's defaults apply.
    None,
}

/// The desired state read from labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Desired {
    pub mig_config: Selection,
    pub device_plugin_config: Selection,
}

impl Desired {
    /// Reads the desired-state labels named in `[labels]`.
    pub fn from_labels(labels: &BTreeMap<String, String>, keys: &LabelsConfig) -> Desired {
        Desired {
            mig_config: Selection::from_label(labels, &keys.mig_config),
            device_plugin_config: Selection::from_label(labels, &keys.device_plugin_config),
        }
    }

    /// Nothing asked for (no labels, or no source at all).
    pub fn none() -> Desired {
        Desired {
            mig_config: Selection::Unset,
            device_plugin_config: Selection::Unset,
        }
    }
}

/// The outcome of choosing the device plugin profile, reported as the
/// `nvidia.com/device-plugin.config.state` label, in status and as Events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileOutcome {
    /// The profile in effect (`None`: the `[device_plugin]` keys as they are).
    pub applied: Option<String>,
    /// `success`, or `failed` when the label asked for something that cannot be applied.
    pub state: ProfileState,
    /// Why it failed.
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfileState {
    /// No label and no default profile: nothing to report.
    None,
    Success,
    Failed,
}

impl ProfileState {
    pub fn as_str(self) -> Option<&'static str> {
        match self {
            ProfileState::None => None,
            ProfileState::Success => Some("success"),
            ProfileState::Failed => Some("failed"),
        }
    }
}

/// Chooses the effective `[device_plugin]` settings for a selection (pure).
///
/// A label naming a defined profile applies it; no label applies `default_profile` if set, else
/// the keys as they are; a label naming no profile (or not a valid value) changes nothing: the
/// settings in effect before (`current`, the profile applied last) stay, and the outcome says
/// why.
pub fn choose_profile(
    config: &DevicePluginConfig,
    selection: &Selection,
    current: Option<&str>,
    label_key: &str,
) -> (DevicePluginConfig, ProfileOutcome) {
    let keep = |reason: String| {
        let effective = current
            .and_then(|name| config.with_profile(name))
            .unwrap_or_else(|| config.clone());
        let outcome = ProfileOutcome {
            applied: current.map(str::to_string),
            state: ProfileState::Failed,
            reason: Some(reason),
        };
        (effective, outcome)
    };
    match selection {
        Selection::Unset if config.default_profile.is_empty() => (
            config.clone(),
            ProfileOutcome {
                applied: None,
                state: ProfileState::None,
                reason: None,
            },
        ),
        Selection::Unset => {
            let name = &config.default_profile;
            match config.with_profile(name) {
                Some(effective) => (
                    effective,
                    ProfileOutcome {
                        applied: Some(name.clone()),
                        state: ProfileState::Success,
                        reason: None,
                    },
                ),
                // Config validation guarantees the default profile exists.
                None => keep(format!("default_profile {name:?} is not defined")),
            }
        }
        Selection::Name { name } => match config.with_profile(name) {
            Some(effective) => (
                effective,
                ProfileOutcome {
                    applied: Some(name.clone()),
                    state: ProfileState::Success,
                    reason: None,
                },
            ),
            None => {
                let defined: Vec<&str> = config.profiles.keys().map(String::as_str).collect();
                let defined = if defined.is_empty() {
                    "none".to_string()
                } else {
                    defined.join(", ")
                };
                keep(format!(
                    "label {label_key}={name} names no profile under [device_plugin.profiles] (defined: {defined}); nothing changed"
                ))
            }
        },
        Selection::Invalid { value, reason } => keep(format!(
            "label {label_key}={value:?} is not valid: {reason}; nothing changed"
        )),
    }
}

/// A malformed line in the labels file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct LabelsFileError {
    pub file: String,
    pub line: usize,
    pub reason: String,
}

/// Parses a labels file: `key=value` lines; blank lines and `#` comments ignored; spaces around
/// key and value trimmed. Keys must be valid label keys; values are checked later, per label,
/// so one bad value does not hide the others.
pub fn parse_labels_file(file: &str, text: &str) -> Result<BTreeMap<String, String>, LabelsFileError> {
    let mut labels = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |reason: String| LabelsFileError {
            file: file.to_string(),
            line: i + 1,
            reason,
        };
        let Some((key, value)) = line.split_once('=') else {
            return Err(err(format!("expected key=value, got {line:?}")));
        };
        let key = key.trim();
        check_label_key(key).map_err(err)?;
        labels.insert(key.to_string(), value.trim().to_string());
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, DevicePluginProfile, MigStrategy};

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn config_with_profile() -> DevicePluginConfig {
        let mut dp = Config::default().device_plugin;
        dp.profiles.insert(
            "mig-mixed".into(),
            DevicePluginProfile {
                mig_strategy: Some(MigStrategy::Mixed),
                ..Default::default()
            },
        );
        dp
    }

    #[test]
    fn desired_reads_the_configured_keys_and_validates_values() {
        let keys = LabelsConfig::default();
        let d = Desired::from_labels(
            &labels(&[
                ("nvidia.com/mig.config", "all-1g.5gb"),
                ("nvidia.com/device-plugin.config", "bad value"),
            ]),
            &keys,
        );
        assert_eq!(
            d.mig_config,
            Selection::Name {
                name: "all-1g.5gb".into()
            }
        );
        assert!(matches!(d.device_plugin_config, Selection::Invalid { .. }));
        assert_eq!(Desired::from_labels(&labels(&[]), &keys), Desired::none());
    }

    #[test]
    fn a_known_profile_applies() {
        let dp = config_with_profile();
        let (eff, out) = choose_profile(
            &dp,
            &Selection::Name {
                name: "mig-mixed".into(),
            },
            None,
            "k",
        );
        assert_eq!(eff.mig_strategy, MigStrategy::Mixed);
        assert_eq!(out.state, ProfileState::Success);
        assert_eq!(out.applied.as_deref(), Some("mig-mixed"));
    }

    #[test]
    fn an_unknown_profile_changes_nothing_and_says_why() {
        let dp = config_with_profile();
        // Nothing applied before: the base keys stay.
        let (eff, out) = choose_profile(
            &dp,
            &Selection::Name { name: "nope".into() },
            None,
            "nvidia.com/device-plugin.config",
        );
        assert_eq!(eff, dp);
        assert_eq!(out.state, ProfileState::Failed);
        let reason = out.reason.expect("reason");
        assert!(
            reason.contains("nvidia.com/device-plugin.config=nope") && reason.contains("mig-mixed"),
            "{reason}"
        );
        // A profile applied before stays applied.
        let (eff, out) = choose_profile(&dp, &Selection::Name { name: "nope".into() }, Some("mig-mixed"), "k");
        assert_eq!(eff.mig_strategy, MigStrategy::Mixed);
        assert_eq!(out.applied.as_deref(), Some("mig-mixed"));
        let invalid = Selection::Invalid {
            value: "a b".into(),
            reason: "bad".into(),
        };
        let (_, out) = choose_profile(&dp, &invalid, Some("mig-mixed"), "k");
        assert_eq!(out.state, ProfileState::Failed);
    }

    #[test]
    fn no_label_uses_the_default_profile_or_the_plain_keys() {
        let mut dp = config_with_profile();
        let (eff, out) = choose_profile(&dp, &Selection::Unset, Some("mig-mixed"), "k");
        assert_eq!(
            eff.mig_strategy,
            MigStrategy::None,
            "removing the label returns to the plain keys"
        );
        assert_eq!(out.state, ProfileState::None);
        dp.default_profile = "mig-mixed".into();
        let (eff, out) = choose_profile(&dp, &Selection::Unset, None, "k");
        assert_eq!(eff.mig_strategy, MigStrategy::Mixed);
        assert_eq!(out.state, ProfileState::Success);
    }

    #[test]
    fn labels_file_lines() {
        let text =
            "# desired state\n\nnvidia.com/mig.config = all-disabled\nnvidia.com/device-plugin.config=mig-mixed\n";
        let l = parse_labels_file("/etc/labels", text).expect("parses");
        assert_eq!(l["nvidia.com/mig.config"], "all-disabled");
        assert_eq!(l["nvidia.com/device-plugin.config"], "mig-mixed");
        let e = parse_labels_file("/etc/labels", "ok=1\nno equals sign\n").expect_err("bad line");
        assert_eq!(e.line, 2);
        assert!(e.to_string().starts_with("/etc/labels:2: expected key=value"), "{e}");
        let e = parse_labels_file("/etc/labels", "bad key!=1\n").expect_err("bad key");
        assert!(e.to_string().starts_with("/etc/labels:1:"), "{e}");
    }
}
