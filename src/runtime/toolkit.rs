//! The NVIDIA Container Toolkit's own config (`/etc/nvidia-container-runtime/config.toml`): with
//! the `volume-mounts` device list strategy, the two keys that make the toolkit take a
//! container's GPUs only from the device plugin's mounts.
//!
//! CUDA images set `NVIDIA_VISIBLE_DEVICES=all`, so under the toolkit's defaults an unprivileged
//! pod that requests no GPU sees every GPU (NVIDIA/k8s-device-plugin#87). With
//! `accept-nvidia-visible-devices-envvar-when-unprivileged = false` the toolkit ignores the
//! variable for unprivileged containers, and with `accept-nvidia-visible-devices-as-volume-mounts
//! = true` it reads the devices the plugin mounts under `/var/run/nvidia-container-devices/`.
//! Both are top-level keys. Pure text edits with `toml_edit`, everything else kept, CRLF line
//! endings included.

use toml_edit::{DocumentMut, value};

use super::EditError;
use super::containerd::{parse_toml, render_like};

/// The key that makes the toolkit ignore `NVIDIA_VISIBLE_DEVICES` in unprivileged containers.
pub const ENVVAR_WHEN_UNPRIVILEGED: &str = "accept-nvidia-visible-devices-envvar-when-unprivileged";
/// The key that makes the toolkit read the device plugin's volume mounts.
pub const AS_VOLUME_MOUNTS: &str = "accept-nvidia-visible-devices-as-volume-mounts";

/// The two settings and the values the agent wants.
const WANTED: [(&str, bool); 2] = [(ENVVAR_WHEN_UNPRIVILEGED, false), (AS_VOLUME_MOUNTS, true)];

/// `existing` (the file's text, `None`: no file) with both keys set; byte-identical when they are.
pub fn configure(existing: Option<&str>, file: &str) -> Result<String, EditError> {
    let text = existing.unwrap_or_default();
    let mut doc = parse_toml(text, file)?;
    let before = doc.clone();
    let mut changed = false;
    for (key, wanted) in WANTED {
        if doc.get(key).and_then(|v| v.as_bool()) != Some(wanted) {
            doc.insert(key, value(wanted));
            changed = true;
        }
    }
    Ok(if changed {
        render_like(text, &before, &doc)
    } else {
        text.to_owned()
    })
}

/// `existing` with each key as `original` (the file before the agent's first change) had it:
/// the value it had, or no key. A file edited since keeps everything else.
pub fn unconfigure(existing: &str, file: &str, original: Option<&str>) -> Result<String, EditError> {
    let mut doc = parse_toml(existing, file)?;
    let parsed = doc.clone();
    let before = original.and_then(|t| t.parse::<DocumentMut>().ok()).unwrap_or_default();
    let mut changed = false;
    for (key, _) in WANTED {
        let had = before.get(key).and_then(|v| v.as_bool());
        if doc.get(key).and_then(|v| v.as_bool()) == had {
            continue;
        }
        changed = true;
        match had {
            Some(v) => {
                doc.insert(key, value(v));
            }
            None => {
                doc.remove(key);
            }
        }
    }
    Ok(if changed {
        render_like(existing, &parsed, &doc)
    } else {
        existing.to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "/etc/nvidia-container-runtime/config.toml";

    /// The head of the config the nvidia-container-toolkit package ships (its defaults).
    const PACKAGED: &str = "#accept-nvidia-visible-devices-as-volume-mounts = false\n\
                            #accept-nvidia-visible-devices-envvar-when-unprivileged = true\n\
                            disable-require = false\nsupported-driver-capabilities = \"compat32,compute,display,graphics,ngx,utility,video\"\n\n\
                            [nvidia-container-cli]\nenvironment = []\nldconfig = \"@/sbin/ldconfig.real\"\n\n\
                            [nvidia-container-runtime]\nlog-level = \"info\"\nmode = \"auto\"\n";

    #[test]
    fn both_keys_are_set_at_the_top_and_the_rest_stays() {
        let out = configure(Some(PACKAGED), FILE).unwrap();
        let doc = out.parse::<DocumentMut>().unwrap();
        assert_eq!(doc[ENVVAR_WHEN_UNPRIVILEGED].as_bool(), Some(false));
        assert_eq!(doc[AS_VOLUME_MOUNTS].as_bool(), Some(true));
        assert_eq!(doc["nvidia-container-runtime"]["mode"].as_str(), Some("auto"));
        assert!(
            out.starts_with("#accept-nvidia-visible-devices-as-volume-mounts = false\n"),
            "{out}"
        );
        assert_eq!(configure(Some(&out), FILE).unwrap(), out, "stable");
        assert_eq!(unconfigure(&out, FILE, Some(PACKAGED)).unwrap(), PACKAGED);
        // No file: just the two keys.
        let fresh = configure(None, FILE).unwrap();
        assert_eq!(fresh.parse::<DocumentMut>().unwrap().len(), 2, "{fresh}");
    }

    /// Found by the property tests (issue 15): toml_edit writes `\n` after every line it
    /// renders, so a CRLF file came back from configure with mixed line endings and from
    /// unconfigure with none of its CRLFs.
    #[test]
    fn crlf_line_endings_are_kept() {
        let crlf = "disable-require = false\r\n\r\n[nvidia-container-runtime]\r\nmode = \"auto\"\r\n";
        let out = configure(Some(crlf), FILE).unwrap();
        assert!(!out.replace("\r\n", "").contains('\n'), "{out:?}");
        assert_eq!(unconfigure(&out, FILE, Some(crlf)).unwrap(), crlf);
    }

    #[test]
    fn values_the_file_had_come_back() {
        let had = format!("{AS_VOLUME_MOUNTS} = false\n{ENVVAR_WHEN_UNPRIVILEGED} = true\n");
        let out = configure(Some(&had), FILE).unwrap();
        let edited = format!("{out}debug = true\n");
        let back = unconfigure(&edited, FILE, Some(&had)).unwrap();
        let doc = back.parse::<DocumentMut>().unwrap();
        assert_eq!(doc[AS_VOLUME_MOUNTS].as_bool(), Some(false));
        assert_eq!(doc[ENVVAR_WHEN_UNPRIVILEGED].as_bool(), Some(true));
        assert_eq!(doc["debug"].as_bool(), Some(true), "the user's edit stays");
        assert!(matches!(configure(Some("x = ["), FILE), Err(EditError::Parse { .. })));
    }
}
