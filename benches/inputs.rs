//! `cargo bench --bench inputs`: how long the agent takes over large inputs a user or a host
//! can hand it, printed as a table. Every parser must stay linear: a config file is numbered
//! line by line for its error messages, and that numbering once took 6.4 s for 40,000 lines.
//!
//! | what | budget |
//! | config check, 40,000-line file | ≤ 250 ms |
//! | config error on line 40,005 | ≤ 250 ms |

use std::time::{Duration, Instant};

use gpu_node_agent::config::{Config, Source};

/// A valid config whose `health.ignored_xids` has `n` entries, one per line.
fn long_config(n: usize) -> String {
    let mut text = String::from("[health]\nignored_xids = [\n");
    for i in 0..n {
        text.push_str(&format!("  {},\n", i % 200));
    }
    text.push_str("]\n");
    text
}

fn best_of(runs: usize, mut f: impl FnMut()) -> Duration {
    (0..runs)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn main() {
    let budget = Duration::from_millis(250);
    let mut rows = Vec::new();

    let valid = long_config(40_000);
    let took = best_of(3, || {
        let sources = [Source::new("/etc/gpu-node-agent/config.toml", valid.clone())];
        if let Err(e) = Config::from_sources(&sources) {
            panic!("the long config is valid: {e}");
        }
    });
    rows.push(("config check, 40,000-line file", took));

    let invalid = format!("{valid}[device_plugin]\nmig_strategy = \"mixd\"\n");
    let took = best_of(3, || {
        let sources = [Source::new("/etc/gpu-node-agent/config.toml", invalid.clone())];
        match Config::from_sources(&sources) {
            Ok(_) => panic!("mig_strategy = \"mixd\" is invalid"),
            Err(e) => assert!(e.to_string().contains("config.toml:40005"), "{e}"),
        }
    });
    rows.push(("config error on line 40,005", took));

    println!("| what | measured | budget | |");
    println!("|---|---|---|---|");
    let mut failed = false;
    for (what, took) in rows {
        let ok = took <= budget;
        failed |= !ok;
        println!(
            "| {what} | {:.1} ms | ≤ {} ms | {} |",
            took.as_secs_f64() * 1000.0,
            budget.as_millis(),
            if ok { "ok" } else { "OVER" }
        );
    }
    if failed {
        std::process::exit(1);
    }
}
