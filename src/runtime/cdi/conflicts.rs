//! Other CDI specs that define the agent's device names, by the CDI library's rules
//! (`pkg/cdi/cache.go`): a spec's priority is the index of its directory in the spec
//! directories (`/etc/cdi`, then `/var/run/cdi`: later wins). The same fully qualified name in two
//! specs of one directory is a conflict and the CDI library drops the device (consumers then
//! fail with `unresolvable CDI devices <kind>=<name>`); in a later directory, the other spec's
//! device silently replaces the agent's. The NVIDIA Container Toolkit's `nvidia-cdi-refresh`
//! (1.18 and later) writes `/var/run/cdi/nvidia.yaml` with kind `nvidia.com/gpu` and index/UUID
//! names, which is exactly such a spec when `cdi_kind` is `nvidia.com/gpu`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The CDI library's default spec directories, lowest priority first.
pub const SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// Another spec that defines some of the agent's device names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The other spec (host path).
    pub other: PathBuf,
    /// The agent's spec (host path).
    pub ours: PathBuf,
    /// The fully qualified names both define, at most a few.
    pub names: Vec<String>,
    /// What the CDI library does with them.
    pub outcome: Outcome,
}

/// What a consumer gets for a name both specs define.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Same directory: the device is dropped, the name does not resolve.
    Dropped,
    /// The other spec is in a later directory: its device is used instead of the agent's.
    Overridden,
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.outcome {
            Outcome::Dropped => "so the CDI library drops them and containers asking for them do not start",
            Outcome::Overridden => "and, being in a later CDI directory, its devices are used instead of the agent's",
        };
        write!(
            f,
            "CDI spec {} defines {} like the agent's {}, {what}; set [device_plugin] cdi_kind to another kind (default \"k8s.device-plugin.nvidia.com/gpu\") or remove that file",
            self.other.display(),
            self.names.join(", "),
            self.ours.display()
        )
    }
}

#[derive(Deserialize)]
struct SpecHead {
    kind: String,
    #[serde(default)]
    devices: Vec<DeviceHead>,
}

#[derive(Deserialize)]
struct DeviceHead {
    name: String,
}

/// The kind and device names of a spec's text (JSON or YAML); `None` when it is not a spec.
pub fn kind_and_names(text: &str) -> Option<(String, Vec<String>)> {
    let head: SpecHead = serde_saphyr::from_str(text).ok()?;
    Some((head.kind, head.devices.into_iter().map(|d| d.name).collect()))
}

/// The conflicts between the agent's spec (`ours`, in `dirs[ours_dir]`, with `kind` and
/// `names`) and `others` (each a host path, the index of its directory in `dirs`, and its text).
/// Specs in an earlier directory lose to the agent's and are not reported.
pub fn conflicts(
    ours: &Path,
    ours_dir: usize,
    kind: &str,
    names: &[String],
    others: &[(PathBuf, usize, String)],
) -> Vec<Conflict> {
    let mut found = Vec::new();
    for (path, dir, text) in others {
        if path == ours || *dir < ours_dir {
            continue;
        }
        let Some((other_kind, other_names)) = kind_and_names(text) else {
            continue;
        };
        if other_kind != kind {
            continue;
        }
        let shared: Vec<String> = names
            .iter()
            .filter(|n| other_names.contains(n))
            .map(|n| format!("{kind}={n}"))
            .collect();
        if shared.is_empty() {
            continue;
        }
        let mut shown: Vec<String> = shared.iter().take(3).cloned().collect();
        if shared.len() > 3 {
            shown.push(format!("and {} more", shared.len() - 3));
        }
        found.push(Conflict {
            other: path.clone(),
            ours: ours.to_path_buf(),
            names: shown,
            outcome: if *dir == ours_dir {
                Outcome::Dropped
            } else {
                Outcome::Overridden
            },
        });
    }
    found
}

/// The spec files (`*.json`, `*.yaml`, `*.yml`) of the CDI directories on the host (under
/// `root`), with `ours_dir` added when it is not one of [`SPEC_DIRS`]; returns the directories
/// (host paths, priority order) and each file with its directory's index and text. Unreadable
/// files and directories are skipped (the CDI library skips them too).
pub fn read_spec_dirs(root: &Path, ours_dir: &Path) -> (Vec<PathBuf>, Vec<(PathBuf, usize, String)>) {
    let mut dirs: Vec<PathBuf> = SPEC_DIRS.iter().map(PathBuf::from).collect();
    if !dirs.iter().any(|d| d == ours_dir) {
        dirs.push(ours_dir.to_path_buf());
    }
    let mut files = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let Ok(entries) = std::fs::read_dir(crate::host::rooted(root, dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
        names.sort();
        for name in names {
            if !(name.ends_with(".json") || name.ends_with(".yaml") || name.ends_with(".yml")) {
                continue;
            }
            let path = dir.join(&name);
            if let Ok(text) = crate::host::read_text(&crate::host::rooted(root, &path)) {
                files.push((path, i, text));
            }
        }
    }
    (dirs, files)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLKIT: &str = "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: GPU-1\n  containerEdits: {}\n- name: all\n  containerEdits: {}\ncontainerEdits: {}\n";

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_toolkit_spec_of_the_same_kind_in_the_same_directory_drops_the_shared_names() {
        let ours = PathBuf::from("/var/run/cdi/nvidia.com-gpu.json");
        let others = vec![(PathBuf::from("/var/run/cdi/nvidia.yaml"), 1, TOOLKIT.to_string())];
        let found = conflicts(&ours, 1, "nvidia.com/gpu", &names(&["0", "GPU-1", "1", "all"]), &others);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].outcome, Outcome::Dropped);
        assert_eq!(
            found[0].names,
            ["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1", "nvidia.com/gpu=all"]
        );
        let text = found[0].to_string();
        assert!(
            text.contains("/var/run/cdi/nvidia.yaml") && text.contains("/var/run/cdi/nvidia.com-gpu.json"),
            "{text}"
        );
        assert!(text.contains("drops them"), "{text}");
    }

    #[test]
    fn another_kind_an_earlier_directory_or_other_names_do_not_conflict() {
        let ours = PathBuf::from("/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json");
        let others = vec![(PathBuf::from("/var/run/cdi/nvidia.yaml"), 1, TOOLKIT.to_string())];
        let kind = "k8s.device-plugin.nvidia.com/gpu";
        assert!(conflicts(&ours, 1, kind, &names(&["0", "all"]), &others).is_empty());
        // In /etc/cdi (earlier) the toolkit's spec loses to ours in /var/run/cdi.
        let earlier = vec![(PathBuf::from("/etc/cdi/nvidia.yaml"), 0, TOOLKIT.to_string())];
        assert!(conflicts(&ours, 1, "nvidia.com/gpu", &names(&["0"]), &earlier).is_empty());
        // Ours in /etc/cdi, theirs in /var/run/cdi: theirs is used instead.
        let found = conflicts(
            Path::new("/etc/cdi/x.json"),
            0,
            "nvidia.com/gpu",
            &names(&["0"]),
            &others,
        );
        assert_eq!(found[0].outcome, Outcome::Overridden);
        // No shared name, or not a spec at all.
        assert!(conflicts(&ours, 1, "nvidia.com/gpu", &names(&["7"]), &others).is_empty());
        let junk = vec![(PathBuf::from("/var/run/cdi/x.json"), 1, "not: [a spec".to_string())];
        assert!(conflicts(&ours, 1, "nvidia.com/gpu", &names(&["0"]), &junk).is_empty());
    }
}
