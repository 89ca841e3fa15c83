//! The process's exit codes, in one place: sysexits(3) and LSB where they fit.

/// How a command ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    Ok = 0,
    /// A stage or command failed, or an unexpected error.
    Failed = 1,
    /// `status` found no status file (LSB: program is not running).
    NotRunning = 3,
    /// An invalid configuration or command line; nothing was changed (EX_USAGE).
    Usage = 64,
    /// NVML cannot be loaded or initialised (EX_UNAVAILABLE).
    NoNvml = 69,
    /// Try again later: GPU work holds a MIG or driver change, or a run was stopped before it
    /// finished (EX_TEMPFAIL).
    TryLater = 75,
}

impl Exit {
    pub fn code(self) -> i32 {
        i32::from(self as u8)
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> Self {
        std::process::ExitCode::from(exit as u8)
    }
}
