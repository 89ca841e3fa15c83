//! Checks the MIG tables in `src/models.rs` against public `nvidia-smi mig -lgip`, `-lgipp`
//! and `-lcip` listings kept in `tests/fixtures/*.lgip` (each names its source in its header).
//!
//! Entry for entry: every listed GPU-instance profile must exist in the model with the same
//! id, name, instance count, SMs, engines and memory (as nvidia-smi prints it, GiB to two
//! decimals), every placement line must match, every compute-instance row must match the
//! derived CI profile, and every model profile must be listed unless the fixture names it in
//! an `# absent:` line (a driver that predates the profile).

use std::collections::BTreeSet;
use std::path::Path;

use fake_nvml::models::{GpuModel, ci_profile_by_index, model_by_key};

#[derive(Debug, Default)]
struct Listing {
    model: String,
    absent: BTreeSet<u32>,
    gis: Vec<GiRow>,
    placements: Vec<(u32, Vec<u32>, u32)>,
    cis: Vec<CiRow>,
}

#[derive(Debug)]
struct GiRow {
    name: String,
    id: u32,
    total: u32,
    mem_gib: String,
    p2p: String,
    sm: u32,
    dec: u32,
    enc: u32,
    ce: u32,
    jpeg: u32,
    ofa: u32,
}

#[derive(Debug)]
struct CiRow {
    name: String,
    index: u32,
    total: u32,
    sm: u32,
    dec: u32,
    enc: u32,
    ofa: u32,
    ce: u32,
    jpeg: u32,
}

fn num(s: &str) -> u32 {
    s.trim_end_matches('*')
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

fn total_of(s: &str) -> u32 {
    num(s.split('/').nth(1).unwrap_or_else(|| panic!("not free/total: {s:?}")))
}

/// Cells of a `| ... |` table row, split on whitespace.
fn cells(line: &str) -> Vec<&str> {
    line.trim().trim_matches('|').split_whitespace().collect()
}

fn parse(text: &str) -> Listing {
    let mut l = Listing::default();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim();
            if let Some(m) = rest.strip_prefix("model:") {
                l.model = m.trim().to_string();
            } else if let Some(a) = rest.strip_prefix("absent:") {
                l.absent.extend(a.split(',').map(|s| num(s.trim())));
            }
            continue;
        }
        if line.starts_with("GPU") && line.contains("Profile ID") {
            let after = line.split("Profile ID").nth(1).unwrap();
            let id = num(after.split_whitespace().next().unwrap());
            let open = after.find('{').unwrap();
            let close = after.find('}').unwrap();
            let starts = after[open + 1..close].split(',').map(num).collect();
            let size = num(after[close + 1..].trim_start_matches(':').trim());
            l.placements.push((id, starts, size));
            continue;
        }
        if !line.starts_with('|') {
            continue;
        }
        let c = cells(line);
        if c.first().is_none_or(|f| f.parse::<u32>().is_err()) {
            continue;
        }
        let next = cells(lines.get(i).copied().unwrap_or(""));
        i += 1;
        match c.iter().position(|&t| t == "MIG") {
            // -lgip: GPU MIG name id free/total GiB P2P SM DEC ENC / CE JPEG OFA
            Some(1) => l.gis.push(GiRow {
                name: c[2].to_string(),
                id: num(c[3]),
                total: total_of(c[4]),
                mem_gib: c[5].to_string(),
                p2p: c[6].to_string(),
                sm: num(c[7]),
                dec: num(c[8]),
                enc: num(c[9]),
                ce: num(next[0]),
                jpeg: num(next[1]),
                ofa: num(next[2]),
            }),
            // -lcip: GPU GI MIG name id free/total SM DEC ENC OFA / CE JPEG
            Some(2) => l.cis.push(CiRow {
                name: c[3].to_string(),
                index: num(c[4]),
                total: total_of(c[5]),
                sm: num(c[6]),
                dec: num(c[7]),
                enc: num(c[8]),
                ofa: num(c[9]),
                ce: num(next[0]),
                jpeg: num(next[1]),
            }),
            _ => panic!("unrecognised row: {line}"),
        }
    }
    l
}

/// MiB as nvidia-smi prints GiB: two decimals, ties to even (5952 MiB -> "5.81").
fn gib(mib: u64) -> String {
    let n = mib * 100;
    let (mut q, r) = (n / 1024, n % 1024);
    if r * 2 > 1024 || (r * 2 == 1024 && q % 2 == 1) {
        q += 1;
    }
    format!("{}.{:02}", q / 100, q % 100)
}

fn check(model: &GpuModel, l: &Listing) -> Vec<String> {
    let mut errs = Vec::new();
    let mut e = |s: String| errs.push(format!("{}: {s}", model.key));
    for r in &l.gis {
        let Some(p) = model.gi_profile_by_id(r.id) else {
            e(format!("listed profile id {} ({}) missing", r.id, r.name));
            continue;
        };
        let want = (
            r.name.as_str(),
            r.total,
            r.mem_gib.as_str(),
            r.sm,
            (r.ce, r.dec, r.enc, r.jpeg, r.ofa),
        );
        let got_mem = gib(p.memory_mib);
        let en = p.engines;
        let got = (
            p.name,
            p.instance_count,
            got_mem.as_str(),
            p.sm,
            (en.ce, en.dec, en.enc, en.jpeg, en.ofa),
        );
        if want != got {
            e(format!("id {}: listing {want:?}, model {got:?}", r.id));
        }
        if r.p2p != "No" {
            e(format!("id {}: P2P {} but the fake reports 0", r.id, r.p2p));
        }
    }
    let listed: BTreeSet<u32> = l.gis.iter().map(|r| r.id).collect();
    for p in model.gi_profiles {
        if !listed.contains(&p.id) && !l.absent.contains(&p.id) {
            e(format!("model profile {} ({}) not in the listing", p.id, p.name));
        }
    }
    for a in &l.absent {
        if listed.contains(a) || model.gi_profile_by_id(*a).is_none() {
            e(format!("absent id {a} is listed or unknown"));
        }
    }
    let placed: BTreeSet<u32> = l.placements.iter().map(|p| p.0).collect();
    for id in &listed {
        if !placed.contains(id) {
            e(format!("no -lgipp line for profile {id}"));
        }
    }
    for (id, starts, size) in &l.placements {
        match model.gi_profile_by_id(*id) {
            Some(p) if p.starts == starts.as_slice() && p.mem_size == *size => {}
            Some(p) => e(format!(
                "id {id}: placements {starts:?}:{size}, model {:?}:{}",
                p.starts, p.mem_size
            )),
            None => e(format!("placement line for unknown profile {id}")),
        }
    }
    for r in &l.cis {
        let gi_name = match r.name.split_once('.') {
            Some((first, rest)) if first.ends_with('c') => rest,
            _ => r.name.as_str(),
        };
        let Some(g) = model.gi_profile_by_name(gi_name) else {
            e(format!("CI {}: no GI profile {gi_name}", r.name));
            continue;
        };
        let Some(c) = ci_profile_by_index(g, r.index) else {
            e(format!("CI {}: no CI profile index {}", r.name, r.index));
            continue;
        };
        let en = g.engines;
        let want = (r.name.as_str(), r.total, r.sm, (r.ce, r.dec, r.enc, r.jpeg, r.ofa));
        let got = (
            c.name.as_str(),
            c.instance_count,
            c.sm,
            (en.ce, en.dec, en.enc, en.jpeg, en.ofa),
        );
        if want != got {
            e(format!("CI {}: listing {want:?}, model {got:?}", r.name));
        }
    }
    errs
}

fn fixtures() -> Vec<(String, Listing)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut out: Vec<(String, Listing)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "lgip"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p.file_name().unwrap().to_string_lossy().into_owned(), parse(&text))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn models_match_their_public_listings() {
    let all = fixtures();
    assert!(all.len() >= 4, "fixtures missing: {}", all.len());
    let mut errs = Vec::new();
    for (file, l) in &all {
        assert!(!l.gis.is_empty() && !l.placements.is_empty(), "{file}: nothing parsed");
        match model_by_key(&l.model) {
            Some(m) => errs.extend(check(m, l)),
            None => errs.push(format!("{file}: unknown model {:?}", l.model)),
        }
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

#[test]
fn the_check_catches_a_wrong_number() {
    // The A30 fixture with one number changed (4g.24gb SMs 56 -> 54) must not pass.
    let (_, good) = fixtures().into_iter().find(|(f, _)| f == "a30-24gb.lgip").unwrap();
    let a30 = model_by_key("A30-24GB").unwrap();
    assert!(check(a30, &good).is_empty());
    let mut bad = good;
    bad.gis.iter_mut().find(|r| r.id == 0).unwrap().sm = 54;
    assert_eq!(check(a30, &bad).len(), 1);
}

#[test]
fn memory_prints_like_nvidia_smi() {
    assert_eq!(gib(5952), "5.81");
    assert_eq!(gib(22144), "21.62");
    assert_eq!(gib(47488), "46.38");
    assert_eq!(gib(80640), "78.75");
}
