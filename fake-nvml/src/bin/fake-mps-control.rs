//! A stand-in for `nvidia-cuda-mps-control`, the CUDA MPS control program, for nodes without a
//! GPU. `fake-nvml-host` (and `fake_nvml::host::install`) put it at
//! `<root>/usr/bin/nvidia-cuda-mps-control`.
//!
//! - `-f`: the control daemon in the foreground; `-d`: the same, in the background (the call
//!   returns once it listens). It needs `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`)
//!   to be a writable folder, listens on `<pipe dir>/control` (a Unix socket where the real
//!   daemon uses named pipes), writes `<pipe dir>/nvidia-cuda-mps-control.pid`, and logs to
//!   `<CUDA_MPS_LOG_DIRECTORY>/control.log` (default `/var/log/nvidia-mps`).
//! - No arguments: the control client. It reads commands from stdin, one per line (the last
//!   may lack its newline), sends them to the daemon of `CUDA_MPS_PIPE_DIRECTORY` and prints
//!   the answers; with no daemon it fails.
//!
//! - At start, the daemon reads `<pipe dir>/fake-probe` if there is one: a host path per line
//!   that it tries to read, writing `<path>\tread <n> bytes` or `<path>\terror: <reason>` per
//!   line to `<log dir>/probe.log`. A test asks it this way (no env: the agent chooses the
//!   daemon's env) what the daemon can reach of the host's files. A line
//!   `as-fsuid <uid> <dir> <file>` plays a compromised daemon instead: it opens `<dir>` (say
//!   `/proc/<pid>/root` of a host process of user `<uid>`) with its file system uid and gid
//!   switched to `<uid>` (`setfsuid`, `setfsgid`), switches them back (root's capabilities come
//!   back), then reads `<file>` and creates `<file>.written` (both relative) below what it
//!   opened; the result is `open: ...; read: ...; create: ...`.
//! - A daemon slow to come up: while `<pipe dir>/fake-hold` exists, the daemon has started but
//!   does not listen yet (the control client fails as with no daemon); it logs
//!   `Held by <path>` once, and listens once the file is gone. The real daemon takes a moment
//!   before its pipe answers; a test holds it there as long as it needs to.
//! - While it runs, the daemon keeps a file `/dev/shm/cuda.shm.fake-mps.<pid>` (removed at
//!   `quit`): the real MPS server and its clients meet in shared memory under `/dev/shm`, so a
//!   test can see which `/dev/shm` the daemon was given.
//!
//! Commands: `get_default_active_thread_percentage`, `set_default_active_thread_percentage
//! <p>`, `get_default_device_pinned_mem_limit <dev>`, `set_default_device_pinned_mem_limit
//! <dev> <limit>`, `get_server_list`, `quit`. The log records each as the real daemon does:
//! `[<time> Control <pid>] Cmd:<command>`.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SOCKET: &str = "control";
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
const LOG_FILE: &str = "control.log";
/// The test's list of paths to try, in the pipe folder.
const PROBE_FILE: &str = "fake-probe";
/// What came of each, in the log folder.
const PROBE_LOG: &str = "probe.log";
/// While this file is in the pipe folder, a starting daemon does not listen.
const HOLD_FILE: &str = "fake-hold";

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").map_or_else(|| PathBuf::from("/tmp/nvidia-mps"), PathBuf::from)
}

fn log_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_LOG_DIRECTORY").map_or_else(|| PathBuf::from("/var/log/nvidia-mps"), PathBuf::from)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => client(),
        ["-f"] => daemon(),
        ["-d"] => background(),
        ["-h"] | ["--help"] => {
            println!("usage: nvidia-cuda-mps-control [-d | -f]");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: nvidia-cuda-mps-control [-d | -f]");
            ExitCode::FAILURE
        }
    }
}

/// The pipe folder must exist and be writable, as the real daemon needs it.
fn check_pipe_dir(dir: &Path) -> Result<(), String> {
    let meta = fs::metadata(dir).map_err(|e| format!("Failed to access pipe directory {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("Pipe directory {} is not a directory", dir.display()));
    }
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    fs::write(&probe, b"").map_err(|e| format!("Pipe directory {} is not writable: {e}", dir.display()))?;
    let _ = fs::remove_file(probe);
    Ok(())
}

/// `-d`: the daemon as a child of its own; returns once it listens.
fn background() -> ExitCode {
    let dir = pipe_dir();
    if let Err(e) = check_pipe_dir(&dir) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("cannot find myself: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut child = match Command::new(exe)
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot start the daemon: {e}");
            return ExitCode::FAILURE;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if UnixStream::connect(dir.join(SOCKET)).is_ok() {
            return ExitCode::SUCCESS;
        }
        if let Ok(Some(_)) = child.try_wait() {
            return ExitCode::FAILURE;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ExitCode::FAILURE
}

/// The control daemon's state: the defaults new servers would get.
struct Defaults {
    thread_percentage: f64,
    pinned: BTreeMap<String, String>,
}

/// `-f`: the daemon.
fn daemon() -> ExitCode {
    let dir = pipe_dir();
    if let Err(e) = check_pipe_dir(&dir) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    let logs = log_dir();
    if let Err(e) = fs::create_dir_all(&logs) {
        eprintln!("Failed to create log directory {}: {e}", logs.display());
        return ExitCode::FAILURE;
    }
    let mut log = match OpenOptions::new().create(true).append(true).open(logs.join(LOG_FILE)) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("Failed to open log file {}: {e}", logs.join(LOG_FILE).display());
            return ExitCode::FAILURE;
        }
    };
    probe(&dir, &logs);
    hold(&dir, &mut log);
    let socket = dir.join(SOCKET);
    if UnixStream::connect(&socket).is_ok() {
        eprintln!("An instance of this daemon is already running");
        return ExitCode::FAILURE;
    }
    let _ = fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("Failed to create control socket {}: {e}", socket.display());
            return ExitCode::FAILURE;
        }
    };
    let _ = fs::set_permissions(&socket, fs::Permissions::from_mode(0o666));
    let pid = std::process::id();
    let _ = fs::write(dir.join(PID_FILE), format!("{pid}\n"));
    let segment = shm_segment(pid);
    if let Err(e) = fs::write(&segment, b"") {
        eprintln!("Failed to create {}: {e}", segment.display());
        return ExitCode::FAILURE;
    }
    let mut line = |text: &str| {
        let _ = writeln!(log, "[{} Control {pid}] {text}", timestamp());
    };
    line(&format!("Starting control daemon using socket {}", socket.display()));
    line(&format!(
        "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={}",
        dir.display()
    ));
    let mut defaults = Defaults {
        thread_percentage: 100.0,
        pinned: BTreeMap::new(),
    };
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        line("Accepting connection...");
        line("NEW UI");
        let mut text = String::new();
        if stream.read_to_string(&mut text).is_err() {
            continue;
        }
        let mut quit = false;
        let mut answer = String::new();
        for command in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            line(&format!("Cmd:{command}"));
            let reply = run(command, &mut defaults, &mut quit);
            if let Some(reply) = reply {
                line(&reply);
                answer.push_str(&reply);
                answer.push('\n');
            }
        }
        let _ = stream.write_all(answer.as_bytes());
        line("UI closed");
        if quit {
            line("Exit");
            let _ = fs::remove_file(&socket);
            let _ = fs::remove_file(dir.join(PID_FILE));
            let _ = fs::remove_file(&segment);
            return ExitCode::SUCCESS;
        }
    }
    ExitCode::SUCCESS
}

/// Waits while `<dir>/fake-hold` exists.
fn hold(dir: &Path, log: &mut fs::File) {
    let file = dir.join(HOLD_FILE);
    if fs::symlink_metadata(&file).is_err() {
        return;
    }
    let _ = writeln!(
        log,
        "[{} Control {}] Held by {}",
        timestamp(),
        std::process::id(),
        file.display()
    );
    while fs::symlink_metadata(&file).is_ok() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Tries to read each path `<dir>/fake-probe` names and writes what happened to
/// `<logs>/probe.log` (replaced each start).
fn probe(dir: &Path, logs: &Path) {
    let Ok(list) = fs::read_to_string(dir.join(PROBE_FILE)) else {
        return;
    };
    let mut out = String::new();
    for path in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(rest) = path.strip_prefix("as-fsuid ") {
            out.push_str(&format!("{path}\t{}\n", as_fsuid(rest)));
            continue;
        }
        match fs::read(path) {
            Ok(bytes) => out.push_str(&format!("{path}\tread {} bytes\n", bytes.len())),
            Err(e) => out.push_str(&format!("{path}\terror: {e}\n")),
        }
    }
    let _ = fs::write(logs.join(PROBE_LOG), out);
}

unsafe extern "C" {
    fn setfsuid(fsuid: u32) -> i32;
    fn setfsgid(fsgid: u32) -> i32;
}

/// `<uid> <dir> <file>` of an `as-fsuid` probe: `<dir>` opened as file system user `<uid>`,
/// then, as root again, `<file>` read and `<file>.written` created below it.
fn as_fsuid(probe: &str) -> String {
    let [uid, dir, file] = probe.split_whitespace().collect::<Vec<_>>()[..] else {
        return format!("error: want <uid> <dir> <file>, got {probe:?}");
    };
    let Ok(uid) = uid.parse::<u32>() else {
        return format!("error: bad uid {uid}");
    };
    // SAFETY: setfsuid/setfsgid take integers; they change this thread's file system ids.
    let opened = unsafe {
        setfsgid(uid);
        setfsuid(uid);
        let opened = fs::File::open(dir);
        setfsuid(0);
        setfsgid(0);
        opened
    };
    let dir = match opened {
        Ok(d) => d,
        Err(e) => return format!("open: error: {e}"),
    };
    let below = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&dir)));
    let read = match fs::read(below.join(file)) {
        Ok(b) => format!("{} bytes", b.len()),
        Err(e) => format!("error: {e}"),
    };
    let create = match fs::write(below.join(format!("{file}.written")), b"written by the MPS daemon\n") {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("error: {e}"),
    };
    format!("open: ok; read: {read}; create: {create}")
}

/// The shared-memory file the daemon keeps while it runs.
fn shm_segment(pid: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/cuda.shm.fake-mps.{pid}"))
}

/// One command; its answer.
fn run(command: &str, d: &mut Defaults, quit: &mut bool) -> Option<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    match words.as_slice() {
        ["get_default_active_thread_percentage"] => Some(format!("{:.1}", d.thread_percentage)),
        ["set_default_active_thread_percentage", p] => match p.parse::<f64>() {
            Ok(p) if p > 0.0 && p <= 100.0 => {
                d.thread_percentage = p;
                Some(format!("{p:.1}"))
            }
            _ => Some(format!("Invalid value {p}")),
        },
        ["get_default_device_pinned_mem_limit", dev] => {
            Some(d.pinned.get(*dev).cloned().unwrap_or_else(|| "0".to_string()))
        }
        ["set_default_device_pinned_mem_limit", dev, limit] => {
            d.pinned.insert((*dev).to_string(), (*limit).to_string());
            None
        }
        ["get_server_list"] => None,
        ["quit"] => {
            *quit = true;
            None
        }
        _ => Some(format!("Invalid command {command}")),
    }
}

/// The control client.
fn client() -> ExitCode {
    let mut input = String::new();
    for l in BufReader::new(std::io::stdin()).lines() {
        match l {
            Ok(l) => {
                input.push_str(&l);
                input.push('\n');
            }
            Err(_) => break,
        }
    }
    let socket = pipe_dir().join(SOCKET);
    let mut stream = match UnixStream::connect(&socket) {
        Ok(s) => s,
        Err(_) => {
            println!("Cannot find MPS control daemon process");
            return ExitCode::FAILURE;
        }
    };
    if stream.write_all(input.as_bytes()).is_err() || stream.shutdown(std::net::Shutdown::Write).is_err() {
        println!("Cannot find MPS control daemon process");
        return ExitCode::FAILURE;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    print!("{answer}");
    ExitCode::SUCCESS
}

/// `YYYY-MM-DD HH:MM:SS.mmm` in UTC.
fn timestamp() -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}
