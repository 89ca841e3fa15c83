//! Injection files in `$FAKE_NVML_STATE_DIR`: `xid`, `processes` and `lost`.
//!
//! The readers here are what the library uses; the `write_*`/`append_*` functions are helpers
//! for tests written in Rust (any tool that appends lines works just as well).
//!
//! - `xid`: append-only lines `<uuid> <xid>`, read as a log (only new complete lines).
//! - `processes`: the current set of lines `<uuid> <pid> <used_mib>`.
//! - `lost`: the current set of lines `<uuid>`.
//!
//! Blank lines and lines starting with `#` are ignored. A malformed line is skipped with a
//! note on stderr naming the file and line number.

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, SystemTime};

/// Name of the Xid injection file.
pub const XID_FILE: &str = "xid";
/// Name of the running-processes injection file.
pub const PROCESSES_FILE: &str = "processes";
/// Name of the lost-GPU injection file.
pub const LOST_FILE: &str = "lost";

/// Writes `fake-nvml: <msg>` to stderr, once per distinct message per process.
pub(crate) fn note(msg: String) {
    static SEEN: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.insert(msg.clone()) {
        eprintln!("fake-nvml: {msg}");
    }
}

/// One line of the `processes` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessLine {
    /// GPU or MIG UUID the process runs on.
    pub uuid: String,
    /// Process id.
    pub pid: u32,
    /// Used memory in MiB.
    pub used_mib: u64,
}

/// One line of the `xid` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidLine {
    /// Byte offset of the line's start in the file.
    pub offset: u64,
    /// 1-based line number, for notes.
    pub line_no: usize,
    /// GPU or MIG UUID.
    pub uuid: String,
    /// The Xid number.
    pub xid: u64,
}

/// Identity of a file version: if none of these changed, the content did not either
/// (except within the filesystem's timestamp granularity, handled by [`Watched`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    ino: u64,
    mtime: SystemTime,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let md = fs::metadata(path).ok()?;
    Some(Stamp {
        len: md.len(),
        ino: md.ino(),
        mtime: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    })
}

/// Files modified this recently are re-read even when their stamp looks unchanged, because
/// kernel timestamps are coarse (a few ms) and two same-length writes can share one.
const FRESH: Duration = Duration::from_millis(100);

/// A small "current set" file, re-read only when it changed.
#[derive(Debug)]
struct Watched<T> {
    path: PathBuf,
    stamp: Option<Stamp>,
    value: T,
}

impl<T: Default> Watched<T> {
    fn new(path: PathBuf) -> Self {
        Watched {
            path,
            stamp: None,
            value: T::default(),
        }
    }

    fn refresh(&mut self, parse: impl Fn(&str, &Path) -> T) -> &T {
        match stamp(&self.path) {
            None => {
                self.stamp = None;
                self.value = T::default();
            }
            Some(now) => {
                let recent = now.mtime.elapsed().map_or(true, |age| age < FRESH);
                if self.stamp != Some(now) || recent {
                    // A read error (file vanished in between) counts as empty.
                    let text = fs::read_to_string(&self.path).unwrap_or_default();
                    self.value = parse(&text, &self.path);
                    self.stamp = Some(now);
                }
            }
        }
        &self.value
    }
}

/// Content lines with their 1-based numbers, skipping blanks and `#` comments.
fn content_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

fn malformed(path: &Path, line_no: usize, line: &str, expected: &str) {
    note(format!(
        "{}:{line_no}: malformed line {line:?} skipped (expected \"{expected}\")",
        path.display()
    ));
}

fn parse_processes(text: &str, path: &Path) -> Vec<ProcessLine> {
    let mut out = Vec::new();
    for (n, line) in content_lines(text) {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [uuid, pid, mib] => match (pid.parse(), mib.parse()) {
                (Ok(pid), Ok(used_mib)) => out.push(ProcessLine {
                    uuid: (*uuid).to_string(),
                    pid,
                    used_mib,
                }),
                _ => malformed(path, n, line, "<uuid> <pid> <used_mib>"),
            },
            _ => malformed(path, n, line, "<uuid> <pid> <used_mib>"),
        }
    }
    out
}

fn parse_lost(text: &str, path: &Path) -> HashSet<String> {
    let mut out = HashSet::new();
    for (n, line) in content_lines(text) {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [uuid] => {
                out.insert((*uuid).to_string());
            }
            _ => malformed(path, n, line, "<uuid>"),
        }
    }
    out
}

/// The `xid` file read as an append-only log.
#[derive(Debug)]
pub(crate) struct XidLog {
    path: PathBuf,
    /// Bytes consumed so far (always just after a newline).
    read_len: u64,
    /// Lines consumed so far.
    lines_seen: usize,
    /// Bumped when the file shrinks (rewritten): readers must start over.
    pub generation: u64,
    /// Parsed lines, in file order.
    pub lines: Vec<XidLine>,
}

impl XidLog {
    fn new(path: PathBuf) -> Self {
        XidLog {
            path,
            read_len: 0,
            lines_seen: 0,
            generation: 0,
            lines: Vec::new(),
        }
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Offset just past the last complete line consumed.
    pub fn consumed(&self) -> u64 {
        self.read_len
    }

    /// Current size of the file (0 when missing): the offset a new registration starts at.
    pub fn current_len(&self) -> u64 {
        stamp(&self.path).map_or(0, |s| s.len)
    }

    /// Reads complete lines appended since the last call. A partial last line (no newline
    /// yet) waits for its newline.
    pub fn refresh(&mut self) {
        let len = self.current_len();
        if len < self.read_len {
            self.read_len = 0;
            self.lines_seen = 0;
            self.lines.clear();
            self.generation += 1;
        }
        if len == self.read_len {
            return;
        }
        let Ok(mut file) = fs::File::open(&self.path) else {
            return;
        };
        let mut buf = Vec::new();
        if file.seek(SeekFrom::Start(self.read_len)).is_err() || file.read_to_end(&mut buf).is_err() {
            return;
        }
        let Some(last_nl) = buf.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let complete = &buf[..=last_nl];
        let mut offset = self.read_len;
        for raw in complete.split_inclusive(|&b| b == b'\n') {
            self.lines_seen += 1;
            let line_no = self.lines_seen;
            let text = String::from_utf8_lossy(raw);
            let line = text.trim();
            if !line.is_empty() && !line.starts_with('#') {
                let f: Vec<&str> = line.split_whitespace().collect();
                match f.as_slice() {
                    [uuid, xid] => match xid.parse::<u64>() {
                        Ok(xid) => self.lines.push(XidLine {
                            offset,
                            line_no,
                            uuid: (*uuid).to_string(),
                            xid,
                        }),
                        Err(_) => malformed(&self.path, line_no, line, "<uuid> <xid>"),
                    },
                    _ => malformed(&self.path, line_no, line, "<uuid> <xid>"),
                }
            }
            offset += raw.len() as u64;
        }
        self.read_len = offset;
    }
}

/// All injection files of one state dir.
#[derive(Debug)]
pub(crate) struct Injections {
    processes: Watched<Vec<ProcessLine>>,
    lost: Watched<HashSet<String>>,
    /// The Xid log.
    pub xid: XidLog,
}

impl Injections {
    /// Readers for the files in `dir`.
    pub fn new(dir: &Path) -> Self {
        Injections {
            processes: Watched::new(dir.join(PROCESSES_FILE)),
            lost: Watched::new(dir.join(LOST_FILE)),
            xid: XidLog::new(dir.join(XID_FILE)),
        }
    }

    /// Path of the `processes` file.
    pub fn processes_path(&self) -> &Path {
        &self.processes.path
    }

    /// The current `processes` lines.
    pub fn processes(&mut self) -> &[ProcessLine] {
        self.processes.refresh(parse_processes)
    }

    /// The current `lost` UUIDs.
    pub fn lost(&mut self) -> &HashSet<String> {
        self.lost.refresh(parse_lost)
    }
}

/// Appends `<uuid> <xid>` to `dir/xid` (one write, so a concurrent reader never sees half).
pub fn append_xid(dir: &Path, uuid: &str, xid: u64) -> io::Result<()> {
    let mut f = OpenOptions::new().create(true).append(true).open(dir.join(XID_FILE))?;
    f.write_all(format!("{uuid} {xid}\n").as_bytes())
}

/// Replaces `dir/processes` with these `(uuid, pid, used_mib)` entries (atomically).
pub fn write_processes(dir: &Path, procs: &[(&str, u32, u64)]) -> io::Result<()> {
    let text: String = procs.iter().map(|(u, p, m)| format!("{u} {p} {m}\n")).collect();
    write_atomic(&dir.join(PROCESSES_FILE), text.as_bytes())
}

/// Replaces `dir/lost` with these GPU UUIDs (atomically).
pub fn write_lost(dir: &Path, uuids: &[&str]) -> io::Result<()> {
    let text: String = uuids.iter().map(|u| format!("{u}\n")).collect();
    write_atomic(&dir.join(LOST_FILE), text.as_bytes())
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    // Unique per process and call, so concurrent writers never share a temporary file.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_file_name(format!(".{}.tmp.{}.{n}", name.to_string_lossy(), std::process::id()));
    // No fsync: the rename alone guarantees readers see the old or the new content, and a
    // test double does not need to survive power loss.
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_log_reads_only_complete_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = XidLog::new(dir.path().join(XID_FILE));
        log.refresh();
        assert!(log.lines.is_empty());
        append_xid(dir.path(), "GPU-a", 79).unwrap();
        fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join(XID_FILE))
            .unwrap()
            .write_all(b"garbage\nGPU-b 4")
            .unwrap();
        log.refresh();
        assert_eq!(log.lines.len(), 1);
        assert_eq!((log.lines[0].offset, log.lines[0].xid), (0, 79));
        fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join(XID_FILE))
            .unwrap()
            .write_all(b"8\n")
            .unwrap();
        log.refresh();
        assert_eq!(log.lines.len(), 2);
        assert_eq!(
            (log.lines[1].uuid.as_str(), log.lines[1].xid, log.lines[1].line_no),
            ("GPU-b", 48, 3)
        );
        fs::write(dir.path().join(XID_FILE), "GPU-c 1\n").unwrap();
        log.refresh();
        assert_eq!(log.generation, 1);
        assert_eq!(log.lines.len(), 1);
    }

    #[test]
    fn current_set_files_follow_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let mut inj = Injections::new(dir.path());
        assert!(inj.processes().is_empty());
        write_processes(dir.path(), &[("GPU-a", 10, 100), ("MIG-b", 11, 5)]).unwrap();
        assert_eq!(inj.processes().len(), 2);
        write_processes(dir.path(), &[("GPU-a", 10, 100)]).unwrap();
        assert_eq!(inj.processes().len(), 1);
        fs::write(dir.path().join(PROCESSES_FILE), "GPU-a x 1\n# c\n\nGPU-z 2 3\n").unwrap();
        assert_eq!(inj.processes()[0].uuid, "GPU-z");
        write_lost(dir.path(), &["GPU-a"]).unwrap();
        assert!(inj.lost().contains("GPU-a"));
        fs::remove_file(dir.path().join(LOST_FILE)).unwrap();
        assert!(inj.lost().is_empty());
    }
}
