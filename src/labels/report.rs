//! What the agent writes on its Node: the labels it owns, and the merge patch that brings the
//! Node's labels to them (pure), plus the record of owned keys that survives a restart.
//!
//! The agent removes labels it owns that no longer apply, and only those: a key is owned once
//! the agent has written it, and the set of owned keys is kept in the state dir so a restarted
//! agent (or one with a changed config) still knows what it may remove.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::host::{WriteError, write_atomic};

/// File under the state dir holding the owned label keys, one per line.
pub const OWNED_LABELS_FILE: &str = "owned-labels";

/// The label changes that bring `current` to `wanted`: `Some(value)` sets, `None` removes. Keys
/// in `owned` but not in `wanted` are removed if present; keys nobody owns are never touched.
/// Empty when nothing changes, so no request is sent.
pub fn label_patch(
    current: &BTreeMap<String, String>,
    wanted: &BTreeMap<String, String>,
    owned: &BTreeSet<String>,
) -> BTreeMap<String, Option<String>> {
    let mut patch = BTreeMap::new();
    for (key, value) in wanted {
        if current.get(key) != Some(value) {
            patch.insert(key.clone(), Some(value.clone()));
        }
    }
    for key in owned {
        if !wanted.contains_key(key) && current.contains_key(key) {
            patch.insert(key.clone(), None);
        }
    }
    patch
}

/// The owned-keys record in the state dir.
#[derive(Debug, Clone)]
pub struct OwnedLabels {
    path: PathBuf,
    keys: BTreeSet<String>,
}

impl OwnedLabels {
    /// Loads the record from `state_dir` (already under the root); a missing or unreadable
    /// file is an empty set (logged), never an error.
    pub fn load(state_dir: &Path) -> OwnedLabels {
        let path = state_dir.join(OWNED_LABELS_FILE);
        let keys = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => {
                tracing::warn!(
                    "cannot read {}: {e}; assuming the agent owns no labels yet",
                    path.display()
                );
                BTreeSet::new()
            }
        };
        OwnedLabels { path, keys }
    }

    pub fn keys(&self) -> &BTreeSet<String> {
        &self.keys
    }

    /// Records `keys` as owned, writing the file only when the set changes.
    pub fn set(&mut self, keys: BTreeSet<String>) -> Result<(), WriteError> {
        if keys == self.keys {
            return Ok(());
        }
        let mut text = String::new();
        for k in &keys {
            text.push_str(k);
            text.push('\n');
        }
        write_atomic(&self.path, text.as_bytes(), 0o644)?;
        self.keys = keys;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn set(keys: &[&str]) -> BTreeSet<String> {
        keys.iter().map(|k| k.to_string()).collect()
    }

    #[test]
    fn patch_sets_changed_removes_stale_owned_and_leaves_others() {
        let current = map(&[
            ("nvidia.com/gpu.count", "4"),
            ("nvidia.com/gpu.old", "x"),
            ("team", "ml"),
            ("nvidia.com/mine-not", "y"),
        ]);
        let wanted = map(&[("nvidia.com/gpu.count", "8"), ("nvidia.com/gpu.present", "true")]);
        let owned = set(&["nvidia.com/gpu.count", "nvidia.com/gpu.old", "nvidia.com/gone-already"]);
        let patch = label_patch(&current, &wanted, &owned);
        let expected: BTreeMap<String, Option<String>> = [
            ("nvidia.com/gpu.count".to_string(), Some("8".to_string())),
            ("nvidia.com/gpu.old".to_string(), None),
            ("nvidia.com/gpu.present".to_string(), Some("true".to_string())),
        ]
        .into_iter()
        .collect();
        assert_eq!(patch, expected);
    }

    #[test]
    fn nothing_to_change_is_an_empty_patch() {
        let current = map(&[("a/b", "1"), ("team", "ml")]);
        assert!(label_patch(&current, &map(&[("a/b", "1")]), &set(&["a/b"])).is_empty());
    }

    #[test]
    fn owned_keys_survive_a_reload_and_write_only_on_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut owned = OwnedLabels::load(dir.path());
        assert!(owned.keys().is_empty());
        owned.set(set(&["a/b", "c/d"])).expect("write");
        let path = dir.path().join(OWNED_LABELS_FILE);
        let before = std::fs::metadata(&path).expect("written").modified().expect("mtime");
        owned.set(set(&["a/b", "c/d"])).expect("no-op");
        assert_eq!(
            std::fs::metadata(&path)
                .expect("still there")
                .modified()
                .expect("mtime"),
            before
        );
        assert_eq!(OwnedLabels::load(dir.path()).keys(), &set(&["a/b", "c/d"]));
    }
}
