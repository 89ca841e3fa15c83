//! Measures `with-kube` (kube-rs) against `with-own` (the agent's own client) on the test API
//! server, and prints a markdown table (issue #34).
//!
//! `measure [--cold-builds | --no-build] [--runs N]` (`--no-build`: take the programs as last
//! built, for a rerun while the agent's sources change under it; `--verbose`: print each
//! request after each restart):
//! 1. builds each program on its own (`cargo build --release --no-default-features --features
//!    kube|own`, target dirs `target/kube` and `target/own`), from clean with `--cold-builds`,
//!    timing it; counts the crates in each dependency tree (`cargo tree -e normal`);
//! 2. for each program: starts a `TestApiServer`, creates the Node, writes a kubeconfig with a
//!    token and runs the (stripped) program. Then: startup requests; RSS after 20 s idle;
//!    requests in a 60 s steady window; reaction to a label change (`set_label` to the PATCH of
//!    `example.com/have`), N times; an API server restart (down, history compacted, 5 s, up)
//!    N times: requests in the 60 s after, time until a valid watch is open again, relists.
//!
//! Before each restart another Node is changed, so that the cluster's resourceVersion has moved
//! past the watched Node's own, as in any real cluster (Events, leases and other Nodes change
//! all the time): a watch from the Node's resourceVersion is then too old after the restart.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use test_apiserver::{KubeconfigAuth, RequestRecord, TestApiServer};

const NODE: &str = "gpu-1";
/// Changed before each restart, to move the cluster's resourceVersion on.
const OTHER_NODE: &str = "other-1";
const READY: &str = "example.com/ready";
const WANT: &str = "example.com/want";
const HAVE: &str = "example.com/have";

const IDLE: Duration = Duration::from_secs(20);
const STEADY: Duration = Duration::from_secs(60);
const DOWN: Duration = Duration::from_secs(5);
const AFTER_RESTART: Duration = Duration::from_secs(60);
/// Longer than the agent's longest backoff step (5 min), so that a client that only polls
/// still answers.
const LABEL_WAIT: Duration = Duration::from_secs(330);

/// The package directory (tools/kube-compare).
fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// One program: the feature that selects it and its binary name.
#[derive(Clone, Copy)]
struct Program {
    feature: &'static str,
    bin: &'static str,
}

const PROGRAMS: [Program; 2] = [
    Program {
        feature: "kube",
        bin: "with-kube",
    },
    Program {
        feature: "own",
        bin: "with-own",
    },
];

/// What was measured of one program.
#[derive(Default)]
struct Results {
    build_secs: Option<f64>,
    /// From the cold build's `--timings` report: (crate "name version", seconds compiling it).
    units: Vec<(String, f64)>,
    crates_normal: usize,
    crates_all: usize,
    size: u64,
    startup_ms: f64,
    startup_requests: String,
    rss_kib: u64,
    hwm_kib: u64,
    steady: String,
    label_ms: Vec<f64>,
    after_restarts: String,
    restarts: Vec<Restart>,
    crate_set: BTreeSet<String>,
}

struct Restart {
    requests: usize,
    by_verb: String,
    watch_open_ms: Option<f64>,
    relists: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut cold = false;
    let mut no_build = false;
    let mut verbose = false;
    let mut runs = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--cold-builds" => cold = true,
            "--no-build" => no_build = true,
            "--verbose" => verbose = true,
            "--runs" => {
                runs = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or("--runs needs a number")?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: measure [--cold-builds | --no-build] [--runs N] [--verbose]"
                )
                .into());
            }
        }
    }
    let work = tempfile::tempdir()?;
    let mut results = Vec::new();
    for program in PROGRAMS {
        let mut r = Results::default();
        let (binary, secs) = if no_build {
            let target = here().join("target").join(program.feature);
            (target.join("release").join(program.bin), None)
        } else {
            build(program, cold)?
        };
        r.build_secs = secs;
        // From this run's clean build, or the last one's report if there is one.
        r.units = timings(program).unwrap_or_else(|e| {
            eprintln!("measure: no per-crate build times for {}: {e}", program.bin);
            Vec::new()
        });
        let (normal, set) = crates(program, "normal")?;
        r.crates_normal = normal;
        r.crate_set = set;
        r.crates_all = crates(program, "normal,build")?.0;
        let stripped = work.path().join(program.bin);
        std::fs::copy(&binary, &stripped)?;
        let status = Command::new("strip").arg(&stripped).status()?;
        if !status.success() {
            return Err(format!("strip {} failed", stripped.display()).into());
        }
        r.size = std::fs::metadata(&stripped)?.len();
        results.push(r);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    for (program, r) in PROGRAMS.iter().zip(results.iter_mut()) {
        let binary = work.path().join(program.bin);
        eprintln!("measure: running {}", program.bin);
        runtime.block_on(run(&binary, work.path(), runs, verbose, r))?;
    }
    print_table(&results, runs);
    Ok(())
}

/// Builds a program alone (its own features, its own target dir); with `cold`, from clean.
fn build(program: Program, cold: bool) -> Result<(PathBuf, Option<f64>), Box<dyn std::error::Error>> {
    let target = here().join("target").join(program.feature);
    if cold && target.exists() {
        std::fs::remove_dir_all(&target)?;
    }
    eprintln!(
        "measure: building {}{}",
        program.bin,
        if cold { " from clean" } else { "" }
    );
    let started = Instant::now();
    let status = Command::new(cargo())
        .current_dir(here())
        .args([
            "build",
            "--release",
            "--no-default-features",
            "--features",
            program.feature,
            "--bin",
            program.bin,
        ])
        .args(cold.then_some("--timings"))
        .arg("--target-dir")
        .arg(&target)
        .status()?;
    if !status.success() {
        return Err(format!("building {} failed", program.bin).into());
    }
    let secs = cold.then(|| started.elapsed().as_secs_f64());
    Ok((target.join("release").join(program.bin), secs))
}

/// The compile time of each unit of the last `--timings` build: cargo writes them into its HTML
/// report as the JSON array `UNIT_DATA`. A build script's compile and run count for its crate.
fn timings(program: Program) -> Result<Vec<(String, f64)>, Box<dyn std::error::Error>> {
    let report = here()
        .join("target")
        .join(program.feature)
        .join("cargo-timings/cargo-timing.html");
    let html = std::fs::read_to_string(&report).map_err(|e| format!("{}: {e}", report.display()))?;
    let start = html.find("UNIT_DATA = [").ok_or("no UNIT_DATA in the timings report")? + "UNIT_DATA = ".len();
    let end = start + html[start..].find("];").ok_or("UNIT_DATA does not end")? + 1;
    let units: Vec<serde_json::Value> = serde_json::from_str(&html[start..end])?;
    Ok(units
        .iter()
        .map(|u| {
            let name = format!(
                "{} v{}",
                u["name"].as_str().unwrap_or("?"),
                u["version"].as_str().unwrap_or("?")
            );
            (name, u["duration"].as_f64().unwrap_or(0.0))
        })
        .collect())
}

/// The crates (name and version) in the program's dependency tree of these edge kinds,
/// without this package itself.
fn crates(program: Program, edges: &str) -> Result<(usize, BTreeSet<String>), Box<dyn std::error::Error>> {
    let out = Command::new(cargo())
        .current_dir(here())
        .args([
            "tree",
            "--no-default-features",
            "--features",
            program.feature,
            "--prefix",
            "none",
            "-e",
            edges,
        ])
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "cargo tree for {}: {}",
            program.bin,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let set: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some(format!("{} {}", words.next()?, words.next()?))
        })
        .filter(|c| !c.starts_with("kube-compare "))
        .collect();
    Ok((set.len(), set))
}

async fn run(
    binary: &Path,
    work: &Path,
    runs: usize,
    verbose: bool,
    r: &mut Results,
) -> Result<(), Box<dyn std::error::Error>> {
    let server = TestApiServer::start().await;
    server.add_token("t", "system:serviceaccount:kube-compare:program");
    server.create_node(NODE, &[("kubernetes.io/hostname", NODE)]);
    server.create_node(OTHER_NODE, &[]);
    let dir = tempfile::tempdir_in(work)?;
    let kubeconfig = server.write_kubeconfig(dir.path(), KubeconfigAuth::Token("t".into()));
    let log = std::fs::File::create(dir.path().join("program.log"))?;

    let started = Instant::now();
    let mut child = tokio::process::Command::new(binary)
        .arg(&kubeconfig)
        .arg(NODE)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().ok_or("the program exited at once")?;
    let up = server
        .wait_for(Duration::from_secs(60), |s| {
            s.labels(NODE).get(READY).map(String::as_str) == Some("true")
                && !s.events().is_empty()
                && s.requests().iter().any(|q| q.watch && q.status == 200)
        })
        .await;
    if !up {
        return Err(format!("{} did not start: see its log", binary.display()).into());
    }
    r.startup_ms = started.elapsed().as_secs_f64() * 1000.0;
    r.startup_requests = by_verb(&server.requests());

    tokio::time::sleep(IDLE).await;
    (r.rss_kib, r.hwm_kib) = memory(pid)?;

    server.clear_requests();
    tokio::time::sleep(STEADY).await;
    r.steady = by_verb(&server.requests());

    for i in 0..runs {
        r.label_ms.push(label_reaction(&server, &format!("v{i}")).await?);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    for i in 0..runs {
        // The rest of the cluster moves on, as it always does.
        server.set_label(OTHER_NODE, "example.com/tick", Some(&i.to_string()));
        server.clear_requests();
        server.set_down(true);
        server.compact();
        let floor: u64 = server.resource_version().parse()?;
        tokio::time::sleep(DOWN).await;
        server.set_down(false);
        let back = Instant::now();
        tokio::time::sleep(AFTER_RESTART).await;
        let log: Vec<RequestRecord> = server.requests().into_iter().filter(|q| q.at >= back).collect();
        let watch_open_ms = log
            .iter()
            .find(|q| q.watch && q.status == 200 && valid_watch(q, floor))
            .map(|q| q.at.duration_since(back).as_secs_f64() * 1000.0);
        let relists = log
            .iter()
            .filter(|q| !q.watch && (q.verb == "get" || q.verb == "list"))
            .count();
        r.restarts.push(Restart {
            requests: log.len(),
            by_verb: by_verb(&log),
            watch_open_ms,
            relists,
        });
        eprintln!(
            "measure: restart {i}: {} requests, watch open after {watch_open_ms:?} ms",
            log.len()
        );
        if verbose {
            for q in &log {
                eprintln!(
                    "  +{:>6} ms {} {} {}?{} -> {}",
                    q.at.duration_since(back).as_millis(),
                    if q.watch { "watch" } else { q.verb.as_str() },
                    q.method,
                    q.path,
                    q.query,
                    q.status
                );
            }
        }
    }
    // Whether the program still follows the Node after the restarts, and how fast.
    r.after_restarts = match label_reaction(&server, "after-restarts").await {
        Ok(ms) => format!("{ms:.0}"),
        Err(e) => e.to_string(),
    };

    child.kill().await?;
    Ok(())
}

/// A watch that will deliver events: from now (no resourceVersion, or 0), or from one the
/// server still has.
fn valid_watch(q: &RequestRecord, floor: u64) -> bool {
    match q.query_param("resourceVersion").as_deref() {
        None | Some("") | Some("0") => true,
        Some(rv) => rv.parse::<u64>().is_ok_and(|rv| rv >= floor),
    }
}

/// Sets `example.com/want` and returns the milliseconds until the program's PATCH of
/// `example.com/have` to the same value arrived.
async fn label_reaction(server: &TestApiServer, value: &str) -> Result<f64, Box<dyn std::error::Error>> {
    let set = Instant::now();
    server.set_label(NODE, WANT, Some(value));
    // The request is logged when its answer starts, a moment after the label changed: wait
    // for the log entry.
    let is_patch = |q: &RequestRecord| {
        q.method == "PATCH"
            && q.at >= set
            && q.body_json()
                .is_some_and(|b| b["metadata"]["labels"][HAVE].as_str() == Some(value))
    };
    let mut patch = None;
    server
        .wait_for(LABEL_WAIT, |s| {
            patch = s.requests().into_iter().find(|q| is_patch(q));
            patch.is_some()
        })
        .await;
    let patch = patch.ok_or_else(|| format!("no PATCH of {HAVE}={value} within {} s", LABEL_WAIT.as_secs()))?;
    Ok(patch.at.duration_since(set).as_secs_f64() * 1000.0)
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn memory(pid: u32) -> Result<(u64, u64), Box<dyn std::error::Error>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// `3 (get 1, watch 2)`.
fn by_verb(log: &[RequestRecord]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for q in log {
        *counts
            .entry(if q.watch { "watch" } else { q.verb.as_str() })
            .or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(v, n)| format!("{v} {n}")).collect();
    if parts.is_empty() {
        "0".into()
    } else {
        format!("{} ({})", log.len(), parts.join(", "))
    }
}

fn stats(values: &[f64]) -> String {
    if values.is_empty() {
        return "n/a".into();
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    format!(
        "median {:.0}, min {:.0}, max {:.0}",
        v[v.len() / 2],
        v[0],
        v[v.len() - 1]
    )
}

fn print_table(results: &[Results], runs: usize) {
    let (k, o) = (&results[0], &results[1]);
    let row = |what: &str, f: &dyn Fn(&Results) -> String| println!("| {what} | {} | {} |", f(k), f(o));
    println!("| | with-kube (kube 5 + k8s-openapi 0.29) | with-own (gpu_node_agent::kube) |");
    println!("|---|---|---|");
    row("cold release build, s", &|r| {
        r.build_secs
            .map_or("not measured (--cold-builds)".into(), |s| format!("{s:.0}"))
    });
    row("crates, `cargo tree -e normal`", &|r| r.crates_normal.to_string());
    row("crates, normal + build deps", &|r| r.crates_all.to_string());
    row("stripped binary, bytes", &|r| {
        format!("{} ({:.1} MiB)", r.size, r.size as f64 / 1048576.0)
    });
    row("start to ready + watching, ms", &|r| format!("{:.0}", r.startup_ms));
    row("requests at start", &|r| r.startup_requests.clone());
    row("VmRSS after 20 s idle, KiB", &|r| r.rss_kib.to_string());
    row("VmHWM after 20 s idle, KiB", &|r| r.hwm_kib.to_string());
    row("requests in 60 s steady", &|r| r.steady.clone());
    row(&format!("label change to PATCH, ms ({runs} runs)"), &|r| {
        stats(&r.label_ms)
    });
    row(&format!("restart: requests in 60 s after ({runs} runs)"), &|r| {
        r.restarts
            .iter()
            .map(|x| x.requests.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    });
    row("restart: requests by verb (run 1)", &|r| {
        r.restarts.first().map_or("n/a".into(), |x| x.by_verb.clone())
    });
    row("restart: back to valid watch open, ms", &|r| {
        let open: Vec<f64> = r.restarts.iter().filter_map(|x| x.watch_open_ms).collect();
        let never = r.restarts.len() - open.len();
        let mut s = stats(&open);
        if never > 0 {
            s.push_str(&format!("; never within 60 s in {never} run(s)"));
        }
        s
    });
    row("label change to PATCH after the restarts, ms", &|r| {
        r.after_restarts.clone()
    });
    row("restart: relist GET/LIST count per run", &|r| {
        r.restarts
            .iter()
            .map(|x| x.relists.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    });
    let added: Vec<&String> = k.crate_set.difference(&o.crate_set).collect();
    println!();
    println!(
        "Crates in the with-kube tree (normal edges) that the agent's tree does not have: {}",
        added.len()
    );
    println!();
    println!("{}", added.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", "));
    if !k.units.is_empty() {
        // Build-only crates (build scripts' and proc macros' dependencies) are not in the normal
        // tree; compare against the agent's build units instead.
        let own_units: BTreeSet<&str> = o.units.iter().map(|(c, _)| c.as_str()).collect();
        let total: f64 = k.units.iter().map(|(_, s)| s).sum();
        let new: f64 = k
            .units
            .iter()
            .filter(|(c, _)| !own_units.contains(c.as_str()) && !c.starts_with("kube-compare "))
            .map(|(_, s)| s)
            .sum();
        println!();
        println!(
            "From the last clean build's timings report. Compile time summed over units (CPU-ish seconds, one job each): with-kube {total:.0} s, with-own {:.0} s; \
             units of with-kube that the agent's build does not have: {new:.0} s.",
            o.units.iter().map(|(_, s)| s).sum::<f64>()
        );
    }
}
