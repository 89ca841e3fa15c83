//! `test-kubelet`: serves the kubelet's device plugin Registration on DIR/kubelet.sock and
//! prints what the kubelet sees of the plugins that register: registrations, every
//! ListAndWatch device list, and (with --allocate) a GetPreferredAllocation + Allocate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use test_kubelet::api::{self, ContainerAllocateResponse};
use test_kubelet::{Event, KubeletOptions, Outcome, RegistrationRecord, TestKubelet, numa_nodes, summarize};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;

/// How long the --once condition must hold before exiting (catches a plugin that registers
/// a second resource right after the first one's list arrived).
const SETTLE: Duration = Duration::from_millis(500);

#[derive(Parser, Debug)]
#[command(
    name = "test-kubelet",
    version,
    about = "A kubelet stand-in: serves device plugin Registration on DIR/kubelet.sock and shows \
             what the kubelet sees of the plugins that register",
    after_help = "Signals: SIGHUP restarts the kubelet (drops every plugin connection, removes every \
                  socket in DIR, serves a new kubelet.sock); SIGINT / SIGTERM stop it and remove \
                  kubelet.sock (plugin sockets are left alone)."
)]
struct Args {
    /// Device plugin directory (a real kubelet uses /var/lib/kubelet/device-plugins). It is
    /// created if missing, and every socket in it is removed at start, as the kubelet does.
    #[arg(long, value_name = "DIR")]
    dir: PathBuf,

    /// Call plugins with the socket path as HTTP/2 :authority, like kubelets before 1.26
    /// (default: "localhost", like 1.26 and later).
    #[arg(long)]
    legacy_authority: bool,

    /// Once RESOURCE has N healthy devices, call GetPreferredAllocation (if the plugin offers
    /// it) for N of them, then Allocate, and print the response. Repeatable.
    #[arg(long = "allocate", value_name = "RESOURCE=N", value_parser = parse_allocate)]
    allocate: Vec<(String, usize)>,

    /// Exit once every registered resource has sent its first device list and the requested
    /// allocations were made: 0 if all went well, 1 on a failed allocation, a protocol
    /// violation or the timeout.
    #[arg(long)]
    once: bool,

    /// With --once: give up after SECS seconds.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    timeout: u64,

    /// Reject every registration with MESSAGE (to see how a plugin copes).
    #[arg(long, value_name = "MESSAGE")]
    reject: Option<String>,
}

fn parse_allocate(s: &str) -> Result<(String, usize), String> {
    let (resource, n) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("expected RESOURCE=N, got {s:?}"))?;
    let n: usize = n
        .parse()
        .map_err(|_| format!("expected a device count after '=', got {n:?}"))?;
    if resource.is_empty() || n == 0 {
        return Err(format!("expected RESOURCE=N with N >= 1, got {s:?}"));
    }
    Ok((resource.to_string(), n))
}

struct Clock(Instant);

impl Clock {
    fn stamp(&self, at: Instant) -> String {
        format!("[{:>8.3}s]", at.saturating_duration_since(self.0).as_secs_f64())
    }
    fn now(&self) -> String {
        self.stamp(Instant::now())
    }
}

/// Where one `--allocate RESOURCE=N` stands.
enum AllocState {
    Waiting { short_reported: bool },
    Running,
    Done { ok: bool },
}

struct AllocResult {
    resource: String,
    lines: Vec<String>,
    ok: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("test-kubelet: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let socket = args.dir.join(test_kubelet::KUBELET_SOCKET);
    if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        return Err(format!(
            "something is already serving {}; refusing to take over a live kubelet socket",
            socket.display()
        ));
    }
    let opts = KubeletOptions {
        legacy_authority: args.legacy_authority,
        reject_registration: args.reject.clone(),
        ..Default::default()
    };
    let kubelet = TestKubelet::start(&args.dir, opts)
        .await
        .map_err(|e| format!("cannot serve {}: {e}", socket.display()))?;
    // Single-threaded runtime: nothing has run since start(), so no event is missed.
    let mut events = kubelet.subscribe();
    let kubelet = Arc::new(kubelet);
    let clock = Clock(Instant::now());

    println!("{} serving Registration on {}", clock.now(), socket.display());
    println!(
        "{:11} calls to plugins carry :authority {}",
        "",
        if args.legacy_authority {
            "= the plugin's socket path (kubelet < 1.26)"
        } else {
            "= localhost (kubelet >= 1.26)"
        }
    );
    println!(
        "{:12}waiting for device plugins to register ({})",
        "",
        if args.once {
            format!("--once: up to {}s", args.timeout)
        } else {
            "Ctrl-C to stop, SIGHUP to simulate a kubelet restart".to_string()
        }
    );
    if let Some(m) = &args.reject {
        println!("{:11} every registration will be rejected with {m:?}", "");
    }

    let mut allocs: BTreeMap<String, (usize, AllocState)> = args
        .allocate
        .iter()
        .map(|(r, n)| (r.clone(), (*n, AllocState::Waiting { short_reported: false })))
        .collect();
    let (alloc_tx, mut alloc_rx) = mpsc::unbounded_channel::<AllocResult>();

    let mut registered: BTreeSet<String> = BTreeSet::new();
    let mut listed: BTreeSet<String> = BTreeSet::new();
    let mut last_lists: HashMap<String, Vec<api::Device>> = HashMap::new();
    let mut violations = 0usize;

    let mut sigint = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut sighup = signal(SignalKind::hangup()).map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout);
    let mut settle_at: Option<tokio::time::Instant> = None;
    let far = tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);

    loop {
        let settle_timer = settle_at.unwrap_or(far);
        let once_deadline = if args.once { deadline } else { far };
        tokio::select! {
            ev = events.recv() => match ev {
                Ok(ev) => {
                    match ev {
                        Event::Serving { socket, at } => {
                            println!("{} kubelet serving on {}", clock.stamp(at), socket.display());
                        }
                        Event::Stopped { at } => println!("{} kubelet stopped", clock.stamp(at)),
                        Event::Registration(rec) => {
                            print_registration(&clock, &rec);
                            if rec.is_accepted() {
                                registered.insert(rec.resource.clone());
                                listed.remove(&rec.resource);
                                last_lists.remove(&rec.resource);
                            }
                        }
                        Event::Devices { resource, at, devices } => {
                            print_devices(&clock, at, &resource, last_lists.get(&resource), &devices);
                            listed.insert(resource.clone());
                            if let Some((n, state)) = allocs.get_mut(&resource) {
                                maybe_allocate(&clock, &kubelet, &alloc_tx, &resource, *n, state, &devices);
                            }
                            last_lists.insert(resource, devices);
                        }
                        Event::Disconnected { resource, at, reason } => {
                            println!("{} ListAndWatch {resource} closed: {reason}", clock.stamp(at));
                            registered.remove(&resource);
                        }
                        Event::Violation { at, message } => {
                            violations += 1;
                            println!("{} PROTOCOL VIOLATION: {message}", clock.stamp(at));
                        }
                    }
                }
                Err(RecvError::Lagged(n)) => println!("{} (output fell behind: {n} events not shown)", clock.now()),
                Err(RecvError::Closed) => return Err("event stream closed".into()),
            },
            Some(res) = alloc_rx.recv() => {
                for line in &res.lines {
                    println!("{line}");
                }
                if let Some((_, state)) = allocs.get_mut(&res.resource) {
                    *state = AllocState::Done { ok: res.ok };
                }
            }
            _ = sigint.recv() => {
                println!("{} SIGINT: stopping, removing {}", clock.now(), socket.display());
                break;
            }
            _ = sigterm.recv() => {
                println!("{} SIGTERM: stopping, removing {}", clock.now(), socket.display());
                break;
            }
            _ = sighup.recv() => {
                println!(
                    "{} SIGHUP: restarting the kubelet (connections dropped, every socket in {} removed)",
                    clock.now(),
                    args.dir.display()
                );
                kubelet.restart().await.map_err(|e| format!("restart failed: {e}"))?;
                registered.clear();
                listed.clear();
                last_lists.clear();
            }
            _ = tokio::time::sleep_until(settle_timer) => {
                let failed: Vec<&String> = allocs
                    .iter()
                    .filter(|(_, (_, s))| matches!(s, AllocState::Done { ok: false }))
                    .map(|(r, _)| r)
                    .collect();
                let resources: Vec<&str> = registered.iter().map(String::as_str).collect();
                stop(kubelet).await;
                if !failed.is_empty() || violations > 0 {
                    println!(
                        "test-kubelet: FAILED: {} allocation(s) failed, {violations} protocol violation(s)",
                        failed.len()
                    );
                    return Ok(ExitCode::from(1));
                }
                println!(
                    "test-kubelet: done: {} registered and listed{}",
                    resources.join(", "),
                    if allocs.is_empty() { String::new() } else { format!(", {} allocation(s) made", allocs.len()) }
                );
                return Ok(ExitCode::SUCCESS);
            }
            _ = tokio::time::sleep_until(once_deadline) => {
                let missing = missing(&registered, &listed, &allocs);
                println!(
                    "test-kubelet: FAILED: timed out after {}s: {}",
                    args.timeout,
                    if missing.is_empty() { "not settled".to_string() } else { missing.join("; ") }
                );
                stop(kubelet).await;
                return Ok(ExitCode::from(1));
            }
        }
        if args.once {
            let complete = missing(&registered, &listed, &allocs).is_empty();
            settle_at = match (complete, settle_at) {
                (true, Some(t)) => Some(t),
                (true, None) => Some(tokio::time::Instant::now() + SETTLE),
                (false, _) => None,
            };
        }
    }
    stop(kubelet).await;
    Ok(ExitCode::SUCCESS)
}

async fn stop(kubelet: Arc<TestKubelet>) {
    // Allocation tasks may still hold a reference; dropping ours then stops it via Drop.
    if let Ok(k) = Arc::try_unwrap(kubelet) {
        k.stop().await;
    }
}

/// What --once still waits for; empty when done.
fn missing(
    registered: &BTreeSet<String>,
    listed: &BTreeSet<String>,
    allocs: &BTreeMap<String, (usize, AllocState)>,
) -> Vec<String> {
    let mut out = Vec::new();
    if registered.is_empty() {
        out.push("no device plugin has registered".to_string());
    }
    for r in registered.difference(listed) {
        out.push(format!("{r} has sent no device list"));
    }
    for (r, (n, state)) in allocs {
        match state {
            AllocState::Waiting { .. } if !registered.contains(r) => {
                out.push(format!("{r} (to allocate {n}) has not registered"))
            }
            AllocState::Waiting { .. } => out.push(format!("{r} has fewer than {n} healthy devices to allocate")),
            AllocState::Running => out.push(format!("the allocation of {n} {r} has not returned")),
            AllocState::Done { .. } => {}
        }
    }
    out
}

fn on_off(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn print_registration(clock: &Clock, rec: &RegistrationRecord) {
    let head = format!(
        "{} Register {} endpoint={} version={}",
        clock.stamp(rec.at),
        if rec.resource.is_empty() { "\"\"" } else { &rec.resource },
        rec.endpoint,
        rec.version
    );
    match &rec.outcome {
        Outcome::Accepted => {
            let o = rec.plugin_options.unwrap_or_default();
            println!(
                "{head}: accepted (GetDevicePluginOptions: preferred allocation {}, pre-start {})",
                on_off(o.get_preferred_allocation_available),
                on_off(o.pre_start_required)
            );
        }
        Outcome::Rejected(msg) => println!("{head}: REJECTED: {msg}"),
    }
}

fn print_devices(
    clock: &Clock,
    at: Instant,
    resource: &str,
    previous: Option<&Vec<api::Device>>,
    devices: &[api::Device],
) {
    println!("{} ListAndWatch {resource}: {}", clock.stamp(at), summarize(devices));
    let prev: HashMap<&str, &api::Device> = previous
        .map(|p| p.iter().map(|d| (d.id.as_str(), d)).collect())
        .unwrap_or_default();
    let mut rows: Vec<[String; 5]> = devices
        .iter()
        .map(|d| {
            let note = match (previous, prev.get(d.id.as_str())) {
                (None, _) => String::new(),
                (Some(_), None) => "new".to_string(),
                (Some(_), Some(p)) if p.health != d.health => format!("was {}", p.health),
                (Some(_), Some(p)) if p.topology != d.topology => {
                    format!("NUMA was {}", numa_nodes(p))
                }
                _ => String::new(),
            };
            [
                resource.to_string(),
                d.id.clone(),
                d.health.clone(),
                numa_nodes(d),
                note,
            ]
        })
        .collect();
    if let Some(previous) = previous {
        let now: BTreeSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        for p in previous.iter().filter(|p| !now.contains(p.id.as_str())) {
            rows.push([
                resource.to_string(),
                p.id.clone(),
                "-".to_string(),
                numa_nodes(p),
                "removed".to_string(),
            ]);
        }
    }
    if rows.is_empty() {
        println!("{:11} (no devices)", "");
        return;
    }
    let header = ["RESOURCE", "DEVICE ID", "HEALTH", "NUMA", ""];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 5]| {
        let mut s = format!("{:12}", "");
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 4 {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_string()
    };
    println!("{}", line(header));
    for row in &rows {
        println!("{}", line([&row[0], &row[1], &row[2], &row[3], &row[4]]));
    }
}

fn maybe_allocate(
    clock: &Clock,
    kubelet: &Arc<TestKubelet>,
    tx: &mpsc::UnboundedSender<AllocResult>,
    resource: &str,
    n: usize,
    state: &mut AllocState,
    devices: &[api::Device],
) {
    let AllocState::Waiting { short_reported } = state else {
        return;
    };
    let healthy: Vec<String> = devices
        .iter()
        .filter(|d| d.health == "Healthy")
        .map(|d| d.id.clone())
        .collect();
    if healthy.len() < n {
        if !*short_reported {
            println!(
                "{} waiting to allocate {n} {resource}: only {} healthy",
                clock.now(),
                healthy.len()
            );
            *short_reported = true;
        }
        return;
    }
    *state = AllocState::Running;
    let kubelet = Arc::clone(kubelet);
    let tx = tx.clone();
    let resource = resource.to_string();
    let start = clock.0;
    tokio::spawn(async move {
        let clock = Clock(start);
        let result = allocate(&clock, &kubelet, &resource, n, &healthy).await;
        let (lines, ok) = match result {
            Ok(lines) => (lines, true),
            Err(lines) => (lines, false),
        };
        let _ = tx.send(AllocResult { resource, lines, ok });
    });
}

/// GetPreferredAllocation (if offered) and Allocate; the lines to print.
async fn allocate(
    clock: &Clock,
    kubelet: &TestKubelet,
    resource: &str,
    n: usize,
    healthy: &[String],
) -> Result<Vec<String>, Vec<String>> {
    let mut lines = Vec::new();
    let available: Vec<&str> = healthy.iter().map(String::as_str).collect();
    let mut chosen: Vec<String> = healthy[..n].to_vec();
    let offered = kubelet
        .options(resource)
        .await
        .is_some_and(|o| o.get_preferred_allocation_available);
    if offered {
        match kubelet.preferred_allocation(resource, &available, &[], n as i32).await {
            Ok(ids) => {
                lines.push(format!(
                    "{} GetPreferredAllocation {resource} size={n} from {} healthy -> [{}]",
                    clock.now(),
                    healthy.len(),
                    ids.join(", ")
                ));
                let distinct: BTreeSet<&String> = ids.iter().collect();
                if ids.len() == n && distinct.len() == n && ids.iter().all(|i| healthy.contains(i)) {
                    chosen = ids;
                } else {
                    lines.push(format!(
                        "{:11} not {n} distinct available devices; using the first {n} healthy instead",
                        ""
                    ));
                }
            }
            Err(s) => lines.push(format!(
                "{} GetPreferredAllocation {resource} failed: {} ({:?}); using the first {n} healthy",
                clock.now(),
                s.message(),
                s.code()
            )),
        }
    } else {
        lines.push(format!(
            "{} GetPreferredAllocation not offered by the {resource} plugin; taking the first {n} healthy",
            clock.now()
        ));
    }
    let ids: Vec<&str> = chosen.iter().map(String::as_str).collect();
    match kubelet.allocate(resource, &ids).await {
        Ok(resp) => {
            lines.push(format!("{} Allocate {resource} [{}]: OK", clock.now(), ids.join(", ")));
            lines.extend(describe_response(&resp));
            Ok(lines)
        }
        Err(s) => {
            lines.push(format!(
                "{} Allocate {resource} [{}]: FAILED: {} ({:?})",
                clock.now(),
                ids.join(", "),
                s.message(),
                s.code()
            ));
            Err(lines)
        }
    }
}

fn describe_response(r: &ContainerAllocateResponse) -> Vec<String> {
    let mut out = Vec::new();
    let mut section = |name: &str, items: Vec<String>| {
        if items.is_empty() {
            out.push(format!("{:11} {name:<12} (none)", ""));
        }
        for (i, item) in items.into_iter().enumerate() {
            let label = if i == 0 { name } else { "" };
            out.push(format!("{:11} {label:<12} {item}", ""));
        }
    };
    let sorted = |m: &HashMap<String, String>| {
        let b: BTreeMap<&String, &String> = m.iter().collect();
        b.into_iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>()
    };
    section("envs", sorted(&r.envs));
    section(
        "mounts",
        r.mounts
            .iter()
            .map(|m| {
                format!(
                    "{} -> {}{}",
                    m.host_path,
                    m.container_path,
                    if m.read_only { " (ro)" } else { "" }
                )
            })
            .collect(),
    );
    section(
        "devices",
        r.devices
            .iter()
            .map(|d| format!("{} -> {} ({})", d.host_path, d.container_path, d.permissions))
            .collect(),
    );
    section("annotations", sorted(&r.annotations));
    section("cdi_devices", r.cdi_devices.iter().map(|c| c.name.clone()).collect());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_flag() {
        assert_eq!(
            parse_allocate("nvidia.com/gpu=2").unwrap(),
            ("nvidia.com/gpu".to_string(), 2)
        );
        assert!(parse_allocate("nvidia.com/gpu").is_err());
        assert!(parse_allocate("nvidia.com/gpu=0").is_err());
        assert!(parse_allocate("=2").is_err());
        assert!(parse_allocate("nvidia.com/gpu=x").is_err());
    }

    #[test]
    fn response_sections() {
        let mut r = ContainerAllocateResponse::default();
        r.envs.insert("B".into(), "2".into());
        r.envs.insert("A".into(), "1".into());
        r.cdi_devices.push(api::CdiDevice { name: "v/c=x".into() });
        let lines = describe_response(&r);
        assert!(lines[0].ends_with("envs         A=1"), "{lines:?}");
        assert!(lines[1].ends_with("B=2"));
        assert!(lines[2].contains("mounts") && lines[2].ends_with("(none)"));
        assert!(lines.last().unwrap().ends_with("cdi_devices  v/c=x"));
    }
}
