//! The built-in layouts: the names of the GPU Operator's default mig-parted config, so that a
//! node labelled `nvidia.com/mig.config=all-1g.10gb` (or `all-balanced`, `all-disabled`, ...)
//! means the same here as under the GPU Operator.
//!
//! [`layout`] gives them as mig-manager v0.14 and later generates them on each node: the
//! profiles are worked out for each GPU from the profiles NVML reports for it
//! ([`Generated`]), so every MIG GPU, including one this file has never heard of, gets every
//! name. [`default_layouts`] is the Operator's file as a table, per model (checked against a
//! copy of that file in tests/fixtures/mig/): the list of names, and, for a GPU whose NVML lists
//! no profiles yet (drivers of the R535 class while MIG is off), whether a name covers a model
//! the table knows before the profiles are read by enabling MIG ([`fallback`], [`knows`]).
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

use super::{DeviceSelector, Generated, LayoutEntry, MigLayout};

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
    // GH200 144G HBM3e
    Model {
        device_ids: &[0x2348],
        profiles: &[
            ("1g.18gb", 7),
            ("1g.18gb+me", 1),
            ("1g.36gb", 4),
            ("2g.36gb", 3),
            ("3g.72gb", 2),
            ("4g.72gb", 1),
            ("7g.144gb", 1),
        ],
        balanced: &[("1g.18gb", 2), ("2g.36gb", 1), ("3g.72gb", 1)],
    },
    // H100-96GB (GH200 96GB), PG506-96GB, H20: the file's `all-balanced` names all four; its
    // profile names are the 96 GB ones.
    Model {
        device_ids: &[0x2342, 0x233D, 0x20B6, 0x2329],
        profiles: &[
            ("1g.12gb", 7),
            ("1g.12gb+me", 1),
            ("1g.24gb", 4),
            ("2g.24gb", 3),
            ("3g.48gb", 2),
            ("4g.48gb", 1),
            ("7g.96gb", 1),
        ],
        balanced: &[("1g.12gb", 2), ("2g.24gb", 1), ("3g.48gb", 1)],
    },
    // B200
    Model {
        device_ids: &[0x2901],
        profiles: &[
            ("1g.23gb", 7),
            ("1g.23gb+me", 1),
            ("1g.45gb", 4),
            ("2g.45gb", 3),
            ("3g.90gb", 2),
            ("4g.90gb", 1),
            ("7g.180gb", 1),
        ],
        balanced: &[("1g.23gb", 2), ("2g.45gb", 1), ("3g.90gb", 1)],
    },
    // RTX PRO 6000 Blackwell (4 slices)
    Model {
        device_ids: &[0x2BB5],
        profiles: &[
            ("1g.24gb", 4),
            ("1g.24gb+me", 1),
            ("1g.24gb+gfx", 4),
            ("1g.24gb+me.all", 1),
            ("1g.24gb-me", 4),
            ("2g.48gb", 2),
            ("2g.48gb+gfx", 2),
            ("2g.48gb+me.all", 1),
            ("2g.48gb-me", 2),
            ("4g.96gb", 1),
            ("4g.96gb+gfx", 1),
        ],
        balanced: &[("1g.24gb", 2), ("2g.48gb", 1)],
    },
    // Models of which only `all-balanced` is taken over (GB200 from the Operator's file; B300
    // and GB300 from its v25.10 release notes, newer than the file kept in
    // tests/fixtures/mig/).
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
];

fn model_entry(model: &Model, profiles: &[(&str, u32)]) -> LayoutEntry {
    LayoutEntry {
        devices: DeviceSelector::All,
        device_filter: model.device_ids.iter().map(|&d| d.into()).collect(),
        mig_enabled: true,
        profiles: profiles.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect(),
        generated: None,
    }
}

/// The built-in layout `name` (`all-disabled`, `all-enabled`, `all-balanced`, `all-<profile>`
/// with `+` written `.`), generated per GPU; `None` for any other name.
pub fn layout(name: &str) -> Option<MigLayout> {
    let everywhere = |mig_enabled, generated| {
        MigLayout::new(vec![LayoutEntry {
            devices: DeviceSelector::All,
            device_filter: Vec::new(),
            mig_enabled,
            profiles: BTreeMap::new(),
            generated,
        }])
    };
    match name.strip_prefix("all-")? {
        "disabled" => Some(everywhere(false, None)),
        "enabled" => Some(everywhere(true, None)),
        "balanced" => Some(everywhere(true, Some(Generated::Balanced))),
        label => profile_of_label(label).map(|p| everywhere(true, Some(Generated::Max(p)))),
    }
}

/// The profile a label part names: `1g.5gb.me` → `1g.5gb+me`, `1g.24gb.me.all` →
/// `1g.24gb+me.all`, `1g.24gb-me` and `3g.40gb` as they are (the Operator writes `+` as `.`).
/// `None` for what names no GPU instance profile (compute instance profiles `1c.4g.20gb`
/// included: mig-manager generates none).
pub fn profile_of_label(label: &str) -> Option<String> {
    let g = label.find("g.")?;
    let gb = g + 2 + label[g + 2..].find("gb")? + 2;
    let (base, rest) = label.split_at(gb);
    let name = match rest.strip_prefix('.') {
        Some(attrs) => format!("{base}+{attrs}"),
        None => label.to_owned(),
    };
    let parsed = super::parse_profile_name(&name).ok()?;
    parsed.compute_slices.is_none().then_some(name)
}

/// Whether the Operator's file (as this table) knows the model of PCI device id `device`.
pub fn knows(device: u16) -> bool {
    MODELS.iter().any(|m| m.device_ids.contains(&device))
}

/// What the Operator's file gives a GPU of PCI device id `device` for `generated`, for a GPU
/// whose NVML lists no GPU instance profiles yet (it decides whether the name covers the GPU;
/// the plan is made with the profiles read once MIG is on); `None` when the file has nothing
/// for that model and name.
pub fn fallback(generated: &Generated, device: u16) -> Option<BTreeMap<String, u32>> {
    let model = MODELS.iter().find(|m| m.device_ids.contains(&device))?;
    let list: Vec<(&str, u32)> = match generated {
        Generated::Balanced => model.balanced.to_vec(),
        Generated::Max(profile) => model.profiles.iter().filter(|(p, _)| p == profile).copied().collect(),
    };
    (!list.is_empty()).then(|| list.into_iter().map(|(p, n)| (p.to_owned(), n)).collect())
}

/// The Operator's file as a table (see the module docs): one entry per model, restricted to its
/// PCI device ids.
pub fn default_layouts() -> BTreeMap<String, MigLayout> {
    let everywhere = |mig_enabled| {
        MigLayout::new(vec![LayoutEntry {
            devices: DeviceSelector::All,
            device_filter: Vec::new(),
            mig_enabled,
            profiles: BTreeMap::new(),
            generated: None,
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
    use crate::mig_layout::ProfileFacts;
    use crate::names::check_label_value;

    fn counts(layout: &MigLayout, gpu: u32, device: u16) -> Option<Vec<(String, u32)>> {
        let entries = layout.entries_for(gpu, device.into());
        assert!(entries.len() <= 1, "{entries:?}");
        entries.first().map(|e| e.profiles.clone().into_iter().collect())
    }

    fn pairs(list: &[(&str, u32)]) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = list.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect();
        v.sort();
        v
    }

    #[test]
    fn label_names_give_profiles_as_the_operator_writes_them() {
        for (label, profile) in [
            ("1g.5gb", Some("1g.5gb")),
            ("1g.5gb.me", Some("1g.5gb+me")),
            ("1g.24gb.me.all", Some("1g.24gb+me.all")),
            ("1g.24gb-me", Some("1g.24gb-me")),
            ("1g.24gb.gfx", Some("1g.24gb+gfx")),
            ("7g.141gb", Some("7g.141gb")),
            ("1c.4g.20gb", None),
            ("9g", None),
            ("balance", None),
        ] {
            assert_eq!(profile_of_label(label).as_deref(), profile, "{label}");
        }
        assert!(layout("all-1g.23gb").is_some());
        assert!(layout("all-nope").is_none() && layout("custom").is_none());
        let balanced = layout("all-balanced").unwrap();
        assert_eq!(balanced.entries[0].generated, Some(Generated::Balanced));
        assert!(balanced.check().is_ok());
    }

    /// A model this file has no table for (a future one) gets every name from its NVML table.
    #[test]
    fn generated_profiles_follow_the_gpus_table() {
        let facts = |list: &[(&'static str, u32, u32)]| -> Vec<ProfileFacts<'static>> {
            list.iter()
                .map(|&(name, slices, instances)| ProfileFacts {
                    name,
                    slices,
                    instances,
                })
                .collect()
        };
        let b200 = facts(&[
            ("1g.23gb", 1, 7),
            ("1g.23gb+me", 1, 1),
            ("1g.45gb", 1, 4),
            ("2g.45gb", 2, 3),
            ("3g.90gb", 3, 2),
            ("4g.90gb", 4, 1),
            ("7g.180gb", 7, 1),
        ]);
        let one = |p: &str, n: u32| Some(BTreeMap::from([(p.to_owned(), n)]));
        assert_eq!(Generated::Max("1g.23gb".into()).profiles_for(&b200), one("1g.23gb", 7));
        assert_eq!(
            Generated::Max("1g.23gb+me".into()).profiles_for(&b200),
            one("1g.23gb+me", 1)
        );
        assert_eq!(Generated::Max("1g.5gb".into()).profiles_for(&b200), None);
        assert_eq!(
            Generated::Balanced.profiles_for(&b200),
            Some(BTreeMap::from([
                ("1g.23gb".to_owned(), 2),
                ("2g.45gb".to_owned(), 1),
                ("3g.90gb".to_owned(), 1)
            ]))
        );
        // A 4-slice GPU (A30): no 3g.
        let a30 = facts(&[
            ("1g.6gb", 1, 4),
            ("1g.6gb+me", 1, 1),
            ("2g.12gb", 2, 2),
            ("4g.24gb", 4, 1),
        ]);
        assert_eq!(
            Generated::Balanced.profiles_for(&a30),
            Some(BTreeMap::from([("1g.6gb".to_owned(), 2), ("2g.12gb".to_owned(), 1)]))
        );
        // No profiles at all: nothing generated (the planner falls back to the table).
        assert_eq!(Generated::Balanced.profiles_for(&[]), None);
        assert_eq!(
            fallback(&Generated::Balanced, 0x20B0),
            Some(BTreeMap::from([
                ("1g.5gb".to_owned(), 2),
                ("2g.10gb".to_owned(), 1),
                ("3g.20gb".to_owned(), 1)
            ]))
        );
        assert_eq!(fallback(&Generated::Max("7g.40gb".into()), 0x20B0), one("7g.40gb", 1));
        assert_eq!(fallback(&Generated::Max("7g.40gb".into()), 0x1EB8), None);
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
            let off = layouts["all-disabled"].entries_for(gpu, device.into());
            assert_eq!(off.len(), 1);
            assert!(!off[0].mig_enabled && off[0].profiles.is_empty());
            let on = layouts["all-enabled"].entries_for(gpu, device.into());
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
