//! Running host programs: one wrapper for every command the agent runs (systemctl, containerd,
//! nvidia-smi, package managers, kbuild). Programs are absolute host paths resolved under the
//! root prefix, arguments are an argv (never a shell), stdout and stderr are captured, and a
//! failure quotes what the program said.

use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::HostRoot;

/// Longest stdout/stderr tail quoted in an error.
const QUOTED_CHARS: usize = 600;

/// A command: an absolute program (a host path) and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    timeout: Duration,
    /// Whether a stop (SIGTERM) may kill the program: false for programs whose interruption
    /// would leave the host half-changed (package managers, the driver's installer).
    interruptible: bool,
}

impl Cmd {
    /// `program` is a host path such as `/usr/bin/systemctl`; it runs as
    /// `<root>/usr/bin/systemctl` under a root prefix (tests put stand-ins there).
    pub fn new(program: impl Into<PathBuf>) -> Cmd {
        Cmd {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            timeout: Duration::from_secs(60),
            interruptible: true,
        }
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Cmd {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An environment variable for the program (added to the agent's environment).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Cmd {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Kill the program after this long (default 60s).
    pub fn timeout(mut self, timeout: Duration) -> Cmd {
        self.timeout = timeout;
        self
    }

    /// A stop does not kill this program: the agent waits for it (up to its timeout), for
    /// programs that would leave the host half-changed (dpkg, rpm, the driver's installer).
    pub fn finish_on_stop(mut self) -> Cmd {
        self.interruptible = false;
        self
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The argv as strings, program first (for logs and tests).
    pub fn argv(&self) -> Vec<String> {
        std::iter::once(self.program.to_string_lossy().into_owned())
            .chain(self.args.iter().map(|a| a.to_string_lossy().into_owned()))
            .collect()
    }
}

impl fmt::Display for Cmd {
    /// The command line, each word quoted when it needs it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: Vec<String> = self
            .argv()
            .into_iter()
            .map(|w| {
                if !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c)) {
                    w
                } else {
                    format!("'{}'", w.replace('\'', r"'\''"))
                }
            })
            .collect();
        f.write_str(&words.join(" "))
    }
}

/// What a finished program printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

/// A command that could not run or did not succeed; the message has the command line and the
/// end of what it printed.
#[derive(Debug, thiserror::Error)]
pub enum CmdError {
    #[error("{cmd}: {program} not found")]
    NotFound { cmd: String, program: PathBuf },
    #[error("cannot run {cmd}: {source}")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("{cmd} did not finish within {}s and was killed", timeout.as_secs())]
    Timeout { cmd: String, timeout: Duration },
    #[error("{cmd} was killed: the agent is stopping")]
    Stopped { cmd: String },
    #[error("{cmd} exited with {status}{}", quote(stdout, stderr))]
    Failed {
        cmd: String,
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
}

/// `: "<tail of stderr, else stdout>"`, or nothing when both are empty.
fn quote(stdout: &str, stderr: &str) -> String {
    let text = if stderr.trim().is_empty() { stdout } else { stderr }.trim();
    if text.is_empty() {
        return String::new();
    }
    let count = text.chars().count();
    let tail: String = text.chars().skip(count.saturating_sub(QUOTED_CHARS)).collect();
    let cut = if count > QUOTED_CHARS { "…" } else { "" };
    format!(": \"{cut}{tail}\"")
}

/// Runs commands for one host root.
#[derive(Debug, Clone)]
pub struct Runner {
    root: HostRoot,
    stop: Option<CancellationToken>,
}

impl Runner {
    pub fn new(root: &HostRoot) -> Runner {
        Runner {
            root: root.clone(),
            stop: None,
        }
    }

    /// Programs run from now on are killed (their whole process group) when `stop` is
    /// cancelled, unless marked [`Cmd::finish_on_stop`]: the daemon's stop must not wait for a
    /// kernel module build or a hanging `systemctl restart`.
    pub fn with_stop(mut self, stop: &CancellationToken) -> Runner {
        self.stop = Some(stop.clone());
        self
    }

    /// Whether `program` (a host path) exists under the root.
    pub fn exists(&self, program: &Path) -> bool {
        self.root.join(program).is_file()
    }

    /// Runs `cmd` to the end; any exit status is `Ok`.
    pub fn output(&self, cmd: &Cmd) -> Result<Output, CmdError> {
        spawn(cmd, self.root.join(&cmd.program), self.stop.as_ref())
    }

    /// Runs `cmd`; a non-zero exit is [`CmdError::Failed`].
    pub fn run(&self, cmd: &Cmd) -> Result<Output, CmdError> {
        succeeded(cmd, self.output(cmd)?)
    }
}

/// Runs `cmd` with its program as given, not under a root prefix: for the agent's own binary
/// (child processes such as the CUDA check), never for host programs. A non-zero exit is `Ok`.
/// `stop` kills it as [`Runner::with_stop`] does.
pub fn run_unrooted(cmd: &Cmd, stop: Option<&CancellationToken>) -> Result<Output, CmdError> {
    spawn(cmd, cmd.program.clone(), stop)
}

fn succeeded(cmd: &Cmd, out: Output) -> Result<Output, CmdError> {
    if out.success() {
        Ok(out)
    } else {
        Err(CmdError::Failed {
            cmd: cmd.to_string(),
            status: out.status,
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }
}

fn spawn(cmd: &Cmd, program: PathBuf, stop: Option<&CancellationToken>) -> Result<Output, CmdError> {
    let line = cmd.to_string();
    if !cmd.program.is_absolute() {
        return Err(CmdError::Spawn {
            cmd: line,
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "the program is not an absolute path"),
        });
    }
    if !program.is_file() {
        return Err(CmdError::NotFound { cmd: line, program });
    }
    let stop = stop.filter(|_| cmd.interruptible);
    if stop.is_some_and(CancellationToken::is_cancelled) {
        return Err(CmdError::Stopped { cmd: line });
    }
    tracing::debug!(command = %line, "running");
    let mut command = Command::new(&program);
    command
        .args(&cmd.args)
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = spawn_when_not_busy(&mut command).map_err(|source| CmdError::Spawn {
        cmd: line.clone(),
        source,
    })?;
    wait(child, cmd.timeout, stop).map_err(|e| match e {
        Waited::Timeout => CmdError::Timeout {
            cmd: line,
            timeout: cmd.timeout,
        },
        Waited::Stopped => CmdError::Stopped { cmd: line },
        Waited::Io(source) => CmdError::Spawn { cmd: line, source },
    })
}

/// How long a spawn retries a program that is open for writing somewhere (`ETXTBSY`).
const BUSY_WAIT: Duration = Duration::from_secs(2);

/// `command.spawn()`, retried while the program is busy (`ETXTBSY`): a program the agent has just
/// written (a downloaded `.run`) can still be open for writing in a child another thread forked
/// in between, until that child execs and its copy of the descriptor closes. Any other error,
/// or still busy after [`BUSY_WAIT`], is returned as it is.
fn spawn_when_not_busy(command: &mut Command) -> std::io::Result<Child> {
    let deadline = std::time::Instant::now() + BUSY_WAIT;
    let mut pause = Duration::from_millis(2);
    loop {
        match command.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && std::time::Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            result => return result,
        }
    }
}

enum Waited {
    Timeout,
    Stopped,
    Io(std::io::Error),
}

/// How often a wait looks at its stop token: well inside the 1 s a stop may take.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Waits for `child` (the leader of its own process group) with a deadline, reading its pipes
/// on threads so a chatty program cannot block on a full pipe. The exit is awaited on a thread
/// too, so a command costs what the program takes, not a polling interval. A cancelled `stop`
/// kills the group as a timeout does.
fn wait(mut child: Child, timeout: Duration, stop: Option<&CancellationToken>) -> Result<Output, Waited> {
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let stdout = reader(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = reader(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let deadline = std::time::Instant::now() + timeout;
    let status = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let slice = if stop.is_some() { left.min(STOP_POLL) } else { left };
        let why = match rx.recv_timeout(slice) {
            Ok(Ok(status)) => break status,
            Ok(Err(e)) => return Err(Waited::Io(e)),
            Err(_) if stop.is_some_and(CancellationToken::is_cancelled) => Waited::Stopped,
            Err(_) if left > slice => continue,
            Err(_) => Waited::Timeout,
        };
        // The whole group: a shell script's children go too. The waiting thread reaps it.
        if let Ok(pid) = i32::try_from(pid) {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        return Err(why);
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// How long a GPU reset may take before it is given up on.
const GPU_RESET_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Resets one GPU with the driver's nvidia-smi (`--gpu-reset -i <uuid>`; `nvidia_smi` is the
/// path under the root), which fails by itself when anything holds the GPU. `Err` has the
/// command line, the exit status or timeout, and the end of what it printed.
pub fn reset_gpu(nvidia_smi: &Path, uuid: &str) -> Result<(), String> {
    if !nvidia_smi.exists() {
        return Err(format!("{} not found ([mig] nvidia_smi)", nvidia_smi.display()));
    }
    let cmd = Cmd::new(nvidia_smi)
        .args(["--gpu-reset", "-i", uuid])
        .timeout(GPU_RESET_TIMEOUT);
    match run_unrooted(&cmd, None) {
        Ok(out) if out.success() => Ok(()),
        Ok(out) => Err(CmdError::Failed {
            cmd: cmd.to_string(),
            status: out.status,
            stdout: out.stdout,
            stderr: out.stderr,
        }
        .to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(root: &Path, path: &str, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        let p = root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A program still open for writing (here by this test, as by a child another thread forked
    /// while the agent wrote it) is run once the writer lets go, not refused with ETXTBSY.
    #[test]
    fn a_program_still_open_for_writing_runs_once_it_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        script(dir.path(), "/usr/bin/fresh", "echo ran");
        let writer = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("usr/bin/fresh"))
            .unwrap();
        let busy = Command::new(dir.path().join("usr/bin/fresh"))
            .spawn()
            .map(|mut c| c.wait());
        assert_eq!(
            busy.err().map(|e| e.kind()),
            Some(std::io::ErrorKind::ExecutableFileBusy),
            "the kernel refuses to run a file open for writing"
        );
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(writer);
        });
        let runner = Runner::new(&HostRoot::new(dir.path()));
        let out = runner.run(&Cmd::new("/usr/bin/fresh")).unwrap();
        assert_eq!(out.stdout, "ran\n");
        release.join().unwrap();
    }

    #[test]
    fn runs_the_program_under_the_root_with_an_argv() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "/usr/bin/echoargs",
            "for a in \"$@\"; do echo \"[$a]\"; done",
        );
        let runner = Runner::new(&HostRoot::new(dir.path()));
        let out = runner
            .run(&Cmd::new("/usr/bin/echoargs").args(["a b", "$(x)", "c"]))
            .unwrap();
        assert_eq!(
            out.stdout, "[a b]\n[$(x)]\n[c]\n",
            "words reach the program as they are"
        );
    }

    #[test]
    fn failures_quote_the_command_and_what_it_said() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "/bin/fail",
            "echo 'out' ; echo 'Job for x.service failed' >&2; exit 3",
        );
        let runner = Runner::new(&HostRoot::new(dir.path()));
        let e = runner
            .run(&Cmd::new("/bin/fail").arg("restart").arg("two words"))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "/bin/fail restart 'two words' exited with exit status: 3: \"Job for x.service failed\""
        );
        let e = runner.run(&Cmd::new("/bin/missing")).unwrap_err();
        assert!(matches!(e, CmdError::NotFound { .. }), "{e}");
        assert!(e.to_string().contains("not found"), "{e}");
        let e = runner.run(&Cmd::new("relative")).unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }

    #[test]
    fn a_program_past_its_timeout_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        script(dir.path(), "/bin/slow", "sleep 5");
        let runner = Runner::new(&HostRoot::new(dir.path()));
        let started = std::time::Instant::now();
        let e = runner
            .run(&Cmd::new("/bin/slow").timeout(Duration::from_millis(100)))
            .unwrap_err();
        assert!(matches!(e, CmdError::Timeout { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(4), "killed, not waited for");
    }

    #[test]
    fn a_stop_kills_what_may_be_killed_and_waits_for_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        script(dir.path(), "/bin/slow", "sleep 5");
        script(dir.path(), "/bin/short", "sleep 0.3; echo done");
        let stop = CancellationToken::new();
        let runner = Runner::new(&HostRoot::new(dir.path())).with_stop(&stop);
        let cancel = stop.clone();
        let canceller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            cancel.cancel();
        });
        let started = std::time::Instant::now();
        let e = runner.run(&Cmd::new("/bin/slow")).unwrap_err();
        assert!(matches!(e, CmdError::Stopped { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(4), "killed at the stop");
        canceller.join().unwrap();
        // Already stopped: a program marked finish_on_stop still runs to its end.
        let out = runner.run(&Cmd::new("/bin/short").finish_on_stop()).unwrap();
        assert_eq!(out.stdout, "done\n");
        let e = runner.run(&Cmd::new("/bin/slow")).unwrap_err();
        assert!(matches!(e, CmdError::Stopped { .. }), "{e}");
    }
}
