//! Checks the MIG tables in `src/models.rs` against the MIG user guide's "Supported MIG
//! Profiles" tables, transcribed in `tests/fixtures/<model key>.guide` (each names its table
//! in its header).
//!
//! Row for row, both ways: every row's profile exists in the model and every model profile
//! has a row. Instance count, NVDEC, NVENC, JPEG, OFA and copy engines must be equal; the
//! memory fraction must equal the profile's memory slices / the model's memory slices, and
//! the SM fraction its compute slices / the model's compute slices. The guide gives neither
//! SM counts, MiB nor profile ids; those are checked elsewhere (`guide_tables.rs` where a real
//! listing exists) or documented as estimates in `src/models.rs`.

use std::path::Path;

use fake_nvml::models::{GpuModel, model_by_key};

/// Every model whose guide rows must be checked: the ones built from the guide, and the
/// ones built from real listings whose guide table the copy has.
const GUIDE_MODELS: [&str; 7] = [
    "H200-141GB",
    "GH200-144GB",
    "H100-96GB",
    "B200",
    "RTX-PRO-6000",
    "H100-80GB-HBM3",
    "A100-SXM4-40GB",
];

/// Where the guide is known to be wrong and the model (built from real listings) right:
/// (model, profile, column). The check must report exactly these, so a fixed guide or a
/// changed model shows up.
const KNOWN_GUIDE_ERRORS: [(&str, &str, &str); 1] = [
    // The guide gives 1g.10gb a memory fraction of 1/8 (its L2 fraction); real A100 listings
    // place it on 2 of 8 memory slices, and the guide's H100 table gives 1g.20gb 1/4.
    ("A100-SXM4-40GB", "1g.10gb", "memory"),
];

/// A fraction of the whole GPU, `num/den`; "full" is 1/1.
#[derive(Debug, Clone, Copy)]
struct Fraction(u32, u32);

impl Fraction {
    fn parse(s: &str) -> Fraction {
        if s == "full" {
            return Fraction(1, 1);
        }
        let (n, d) = s.split_once('/').unwrap_or_else(|| panic!("not a fraction: {s:?}"));
        Fraction(num(n), num(d))
    }

    /// Equal as rational numbers (1/4 == 2/8).
    fn equals(self, num: u32, den: u32) -> bool {
        u64::from(self.0) * u64::from(den) == u64::from(num) * u64::from(self.1)
    }
}

#[derive(Debug, Clone)]
struct Row {
    profile: String,
    memory: Fraction,
    sms: Fraction,
    dec: u32,
    /// None where the guide's table has no NVENC column (checked as 0).
    enc: Option<u32>,
    jpeg: u32,
    ofa: u32,
    ce: u32,
    instances: u32,
}

#[derive(Debug, Clone)]
struct Guide {
    model: String,
    source: String,
    rows: Vec<Row>,
}

fn num(s: &str) -> u32 {
    s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

fn parse(text: &str) -> Guide {
    let mut g = Guide {
        model: String::new(),
        source: String::new(),
        rows: Vec::new(),
    };
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim();
            if let Some(m) = rest.strip_prefix("model:") {
                g.model = m.trim().to_string();
            } else if let Some(s) = rest.strip_prefix("source:") {
                g.source = s.trim().to_string();
            }
            continue;
        }
        let c: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(c.len(), 9, "a row has 9 columns: {line}");
        g.rows.push(Row {
            profile: c[0].to_string(),
            memory: Fraction::parse(c[1]),
            sms: Fraction::parse(c[2]),
            dec: num(c[3]),
            enc: (c[4] != "-").then(|| num(c[4])),
            jpeg: num(c[5]),
            ofa: num(c[6]),
            ce: num(c[7]),
            instances: num(c[8]),
        });
    }
    g
}

/// Differences between the model and the guide rows, as (profile, column, text).
fn check(model: &GpuModel, g: &Guide) -> Vec<(String, &'static str, String)> {
    let mut errs = Vec::new();
    for r in &g.rows {
        let Some(p) = model.gi_profile_by_name(&r.profile) else {
            errs.push((r.profile.clone(), "profile", "not in the model".to_string()));
            continue;
        };
        let mut col = |column: &'static str, ok: bool, guide: String, ours: String| {
            if !ok {
                errs.push((r.profile.clone(), column, format!("guide {guide}, model {ours}")));
            }
        };
        let (ms, cs) = (model.mig.memory_slices, model.mig.compute_slices);
        col(
            "memory",
            r.memory.equals(p.mem_size, ms),
            format!("{}/{}", r.memory.0, r.memory.1),
            format!("{}/{ms}", p.mem_size),
        );
        col(
            "SMs",
            r.sms.equals(p.slices, cs),
            format!("{}/{}", r.sms.0, r.sms.1),
            format!("{}/{cs}", p.slices),
        );
        let e = p.engines;
        col("NVDEC", r.dec == e.dec, r.dec.to_string(), e.dec.to_string());
        let enc = r.enc.unwrap_or(0);
        col("NVENC", enc == e.enc, enc.to_string(), e.enc.to_string());
        col("JPEG", r.jpeg == e.jpeg, r.jpeg.to_string(), e.jpeg.to_string());
        col("OFA", r.ofa == e.ofa, r.ofa.to_string(), e.ofa.to_string());
        col("CE", r.ce == e.ce, r.ce.to_string(), e.ce.to_string());
        col(
            "instances",
            r.instances == p.instance_count,
            r.instances.to_string(),
            p.instance_count.to_string(),
        );
    }
    for p in model.gi_profiles {
        if !g.rows.iter().any(|r| r.profile == p.name) {
            errs.push((p.name.to_string(), "profile", "no row in the guide".to_string()));
        }
    }
    errs
}

fn load(key: &str) -> Guide {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{key}.guide"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse(&text)
}

#[test]
fn models_match_the_guide_tables() {
    let mut errs = Vec::new();
    let mut known_seen = Vec::new();
    for key in GUIDE_MODELS {
        let g = load(key);
        assert_eq!(g.model, key, "{key}.guide names another model");
        assert!(!g.source.is_empty(), "{key}.guide names no source");
        assert!(!g.rows.is_empty(), "{key}.guide: no rows");
        let model = model_by_key(key).unwrap_or_else(|| panic!("no model {key}"));
        for (profile, column, text) in check(model, &g) {
            if KNOWN_GUIDE_ERRORS.contains(&(key, profile.as_str(), column)) {
                known_seen.push((key, profile, column));
            } else {
                errs.push(format!("{key} {profile} {column}: {text}"));
            }
        }
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    let known: Vec<(&str, String, &str)> = KNOWN_GUIDE_ERRORS
        .iter()
        .map(|&(m, p, c)| (m, p.to_string(), c))
        .collect();
    assert_eq!(known_seen, known, "known guide errors no longer seen");
}

#[test]
fn every_fixture_is_checked() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "guide"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    found.sort();
    let mut want: Vec<String> = GUIDE_MODELS.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(found, want);
}

/// A column name and a change to that column of a row.
type Mutation = (&'static str, fn(&mut Row));

#[test]
fn the_check_catches_a_changed_value() {
    let rtx = model_by_key("RTX-PRO-6000").unwrap();
    let good = load("RTX-PRO-6000");
    assert!(check(rtx, &good).is_empty());
    // Each column changed once in a copy of the guide rows: exactly that column is reported.
    let mutations: [Mutation; 8] = [
        ("memory", |r| r.memory = Fraction(1, 2)),
        ("SMs", |r| r.sms = Fraction(2, 4)),
        ("NVDEC", |r| r.dec += 1),
        ("NVENC", |r| r.enc = Some(0)),
        ("JPEG", |r| r.jpeg += 1),
        ("OFA", |r| r.ofa += 1),
        ("CE", |r| r.ce += 1),
        ("instances", |r| r.instances -= 1),
    ];
    for (column, mutate) in mutations {
        let mut bad = good.clone();
        let row = bad.rows.iter_mut().find(|r| r.profile == "1g.24gb+gfx").unwrap();
        mutate(row);
        let errs = check(rtx, &bad);
        assert_eq!(errs.len(), 1, "{column}: {errs:?}");
        assert_eq!((errs[0].0.as_str(), errs[0].1), ("1g.24gb+gfx", column));
    }
    // A row the model lacks, and a model profile without a row.
    let mut bad = good.clone();
    bad.rows.retain(|r| r.profile != "2g.48gb-me");
    assert_eq!(check(rtx, &bad).len(), 1);
    bad.rows.push(Row {
        profile: "3g.72gb".into(),
        ..good.rows[0].clone()
    });
    assert_eq!(check(rtx, &bad).len(), 2);
}

#[test]
fn fractions_compare_as_numbers() {
    assert!(Fraction::parse("1/4").equals(2, 8));
    assert!(Fraction::parse("full").equals(7, 7));
    assert!(!Fraction::parse("1/8").equals(1, 7));
}
