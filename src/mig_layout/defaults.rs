//! The built-in layouts: the names of the GPU Operator's default mig-parted config, so that a
//! node labelled `nvidia.com/mig.config=all-1g.10gb` (or `all-balanced`, `all-disabled`, ...)
//! means the same here as under the GPU Operator.
//!
//! - `all-disabled`: MIG off on every GPU.
//! - `all-enabled`: MIG on, no instances, on every GPU.
//! - `all-<profile>` (`+` written `.`: `all-1g.5gb.me`): as many instances of the profile as
//!   fit, one entry per GPU model that has the profile, each restricted to that model's PCI
//!   device ids. A name that means different things on different models (`all-1g.10gb`: four
//!   instances on an A100-40GB, seven on an 80 GB A100/H100) has one entry per model.
//! - `all-balanced`: per model, 2 × the smallest 1-slice profile, 1 × the 2-slice one and (on
//!   7-slice GPUs) 1 × the 3-slice one.
//!
//! A GPU of a model a layout has no entry for is not covered by it (see
//! [`super`]); user layouts in `[mig.layouts]` with the same name replace these.

use std::collections::BTreeMap;

use super::{DeviceSelector, LayoutEntry, MigLayout};

/// One GPU model (or family of models with the same MIG profiles) of the operator's config.
struct Model {
    /// PCI device ids (the high half of the operator's `0x<device>10DE` filters).
    device_ids: &'static [u16],
    /// Every GPU instance profile with the most instances that fit.
    profiles: &'static [(&'static str, u32)],
    /// `all-balanced`.
    balanced: &'static [(&'static str, u32)],
}

const MODELS: &[Model] = &[
    // A100-40GB, A800-40GB
    Model {
        device_ids: &[0x20B0, 0x20B1, 0x20F1, 0x20F6],
        profiles: &[
            ("1g.5gb", 7),
            ("1g.5gb+me", 1),
            ("1g.10gb", 4),
            ("2g.10gb", 3),
            ("3g.20gb", 2),
            ("4g.20gb", 1),
            ("7g.40gb", 1),
        ],
        balanced: &[("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)],
    },
    // H100-80GB, H800-80GB, A100-80GB, A800-80GB
    Model {
        device_ids: &[0x2330, 0x2331, 0x2322, 0x20B2, 0x20B5, 0x20F3, 0x20F5, 0x2324],
        profiles: &[
            ("1g.10gb", 7),
            ("1g.10gb+me", 1),
            ("1g.20gb", 4),
            ("2g.20gb", 3),
            ("3g.40gb", 2),
            ("4g.40gb", 1),
            ("7g.80gb", 1),
        ],
        balanced: &[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)],
    },
    // A30
    Model {
        device_ids: &[0x20B7],
        profiles: &[
            ("1g.6gb", 4),
            ("1g.6gb+me", 1),
            ("2g.12gb", 2),
            ("2g.12gb+me", 1),
            ("4g.24gb", 1),
        ],
        balanced: &[("1g.6gb", 2), ("2g.12gb", 1)],
    },
    // H100 NVL, H800 NVL
    Model {
        device_ids: &[0x2321, 0x233A],
        profiles: &[
            ("1g.12gb", 7),
            ("1g.12gb+me", 1),
            ("1g.24gb", 4),
            ("2g.24gb", 3),
            ("3g.47gb", 2),
            ("4g.47gb", 1),
            ("7g.94gb", 1),
        ],
        balanced: &[("1g.12gb", 2), ("2g.24gb", 1), ("3g.47gb", 1)],
    },
    // H200-141GB, H200 NVL
    Model {
        device_ids: &[0x2335, 0x233B],
        profiles: &[
            ("1g.18gb", 7),
            ("1g.18gb+me", 1),
            ("1g.35gb", 4),
            ("2g.35gb", 3),
            ("3g.71gb", 2),
            ("4g.71gb", 1),
            ("7g.141gb", 1),
        ],
        balanced: &[("1g.18gb", 2), ("2g.35gb", 1), ("3g.71gb", 1)],
    },
    // Models of which only `all-balanced` is taken over.
    // B200
    Model {
        device_ids: &[0x2901],
        profiles: &[],
        balanced: &[("1g.23gb", 2), ("2g.45gb", 1), ("3g.90gb", 1)],
    },
    // GB200
    Model {
        device_ids: &[0x2941],
        profiles: &[],
        balanced: &[("1g.23gb", 2), ("2g.47gb", 1), ("3g.93gb", 1)],
    },
    // B300
    Model {
        device_ids: &[0x3182],
        profiles: &[],
        balanced: &[("1g.34gb", 2), ("2g.67gb", 1), ("3g.135gb", 1)],
    },
    // GB300
    Model {
        device_ids: &[0x31C2],
        profiles: &[],
        balanced: &[("1g.35gb", 2), ("2g.70gb", 1), ("3g.139gb", 1)],
    },
    // RTX PRO 6000
    Model {
        device_ids: &[0x2BB5],
        profiles: &[],
        balanced: &[("1g.24gb", 2), ("2g.48gb", 1)],
    },
];

fn model_entry(model: &Model, profiles: &[(&str, u32)]) -> LayoutEntry {
    LayoutEntry {
        devices: DeviceSelector::All,
        device_filter: model.device_ids.to_vec(),
        mig_enabled: true,
        profiles: profiles.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect(),
    }
}

/// The built-in layouts by name (see the module docs).
pub fn default_layouts() -> BTreeMap<String, MigLayout> {
    let everywhere = |mig_enabled| {
        MigLayout::new(vec![LayoutEntry {
            devices: DeviceSelector::All,
            device_filter: Vec::new(),
            mig_enabled,
            profiles: BTreeMap::new(),
        }])
    };
    let mut out = BTreeMap::new();
    out.insert("all-disabled".to_owned(), everywhere(false));
    out.insert("all-enabled".to_owned(), everywhere(true));
    for model in MODELS {
        for &(profile, count) in model.profiles {
            let name = format!("all-{}", profile.replace('+', "."));
            out.entry(name)
                .or_insert_with(MigLayout::default)
                .entries
                .push(model_entry(model, &[(profile, count)]));
        }
        if !model.balanced.is_empty() {
            out.entry("all-balanced".to_owned())
                .or_insert_with(MigLayout::default)
                .entries
                .push(model_entry(model, model.balanced));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::check_label_value;

    fn counts(layout: &MigLayout, gpu: u32, device: u16) -> Option<Vec<(String, u32)>> {
        let entries = layout.entries_for(gpu, device);
        assert!(entries.len() <= 1, "{entries:?}");
        entries.first().map(|e| e.profiles.clone().into_iter().collect())
    }

    fn pairs(list: &[(&str, u32)]) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = list.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect();
        v.sort();
        v
    }

    #[test]
    fn every_default_layout_is_valid() {
        let layouts = default_layouts();
        for (name, layout) in &layouts {
            assert!(!name.is_empty() && check_label_value(name).is_ok(), "{name}");
            layout.check().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        // No device id belongs to two models.
        let mut ids: Vec<u16> = MODELS.iter().flat_map(|m| m.device_ids.iter().copied()).collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n);
    }

    #[test]
    fn expected_names() {
        let layouts = default_layouts();
        for name in [
            "all-disabled",
            "all-enabled",
            "all-balanced",
            "all-1g.5gb",
            "all-1g.5gb.me",
            "all-1g.10gb",
            "all-1g.10gb.me",
            "all-2g.10gb",
            "all-3g.20gb",
            "all-4g.20gb",
            "all-7g.40gb",
            "all-1g.20gb",
            "all-2g.20gb",
            "all-3g.40gb",
            "all-4g.40gb",
            "all-7g.80gb",
            "all-1g.6gb",
            "all-2g.12gb.me",
            "all-4g.24gb",
            "all-1g.12gb",
            "all-7g.94gb",
            "all-1g.18gb.me",
            "all-1g.35gb",
            "all-7g.141gb",
        ] {
            assert!(layouts.contains_key(name), "{name} missing");
        }
        for (name, layout) in &layouts {
            if let Some(profile) = name
                .strip_prefix("all-")
                .filter(|p| !matches!(*p, "disabled" | "enabled" | "balanced"))
            {
                // Each entry holds the profile the name spells, `+` written `.`.
                for e in &layout.entries {
                    let (p, _) = e.profiles.iter().next().unwrap();
                    assert_eq!(p.replace('+', "."), profile);
                    assert_eq!(e.profiles.len(), 1);
                    assert!(!e.device_filter.is_empty());
                }
            }
        }
    }

    #[test]
    fn everywhere_layouts() {
        let layouts = default_layouts();
        for (gpu, device) in [(0, 0x20B0), (3, 0x2330), (1, 0x1EB8)] {
            let off = layouts["all-disabled"].entries_for(gpu, device);
            assert_eq!(off.len(), 1);
            assert!(!off[0].mig_enabled && off[0].profiles.is_empty());
            let on = layouts["all-enabled"].entries_for(gpu, device);
            assert_eq!(on.len(), 1);
            assert!(on[0].mig_enabled && on[0].profiles.is_empty());
        }
    }

    #[test]
    fn per_model_entries() {
        let layouts = default_layouts();
        const A100_SXM4_40GB: u16 = 0x20B0;
        const A100_PCIE_40GB: u16 = 0x20F1;
        const A100_SXM4_80GB: u16 = 0x20B2;
        const A100_PCIE_80GB: u16 = 0x20B5;
        const H100_SXM5: u16 = 0x2330;
        const H100_PCIE: u16 = 0x2331;
        const H200: u16 = 0x2335;

        // One name, two meanings: a layout with an entry per model.
        let l = &layouts["all-1g.10gb"];
        assert_eq!(counts(l, 0, A100_SXM4_40GB), Some(pairs(&[("1g.10gb", 4)])));
        assert_eq!(counts(l, 0, A100_PCIE_40GB), Some(pairs(&[("1g.10gb", 4)])));
        for d in [A100_SXM4_80GB, A100_PCIE_80GB, H100_SXM5, H100_PCIE] {
            assert_eq!(counts(l, 2, d), Some(pairs(&[("1g.10gb", 7)])), "{d:#x}");
        }
        assert_eq!(counts(l, 0, H200), None);

        let l = &layouts["all-1g.5gb"];
        assert_eq!(counts(l, 1, A100_SXM4_40GB), Some(pairs(&[("1g.5gb", 7)])));
        assert_eq!(counts(l, 1, H100_SXM5), None);
        assert_eq!(
            counts(&layouts["all-7g.80gb"], 0, H100_PCIE),
            Some(pairs(&[("7g.80gb", 1)]))
        );
        assert_eq!(counts(&layouts["all-7g.80gb"], 0, A100_SXM4_40GB), None);
        assert_eq!(
            counts(&layouts["all-1g.10gb.me"], 0, A100_SXM4_80GB),
            Some(pairs(&[("1g.10gb+me", 1)]))
        );

        let b = &layouts["all-balanced"];
        assert_eq!(
            counts(b, 0, A100_SXM4_40GB),
            Some(pairs(&[("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)]))
        );
        assert_eq!(
            counts(b, 0, H100_SXM5),
            Some(pairs(&[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)]))
        );
        assert_eq!(
            counts(b, 0, A100_PCIE_80GB),
            Some(pairs(&[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)]))
        );
        assert_eq!(counts(b, 0, 0x20B7), Some(pairs(&[("1g.6gb", 2), ("2g.12gb", 1)])));
        // A GPU without MIG (T4) is not covered by any per-model layout.
        assert_eq!(counts(b, 0, 0x1EB8), None);
    }
}
