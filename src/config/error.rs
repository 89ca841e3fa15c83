//! [`ConfigError`]: everything that can be wrong with the agent's configuration, each message
//! naming the file, the line and the key.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Exit status for any configuration error (`EX_USAGE` from sysexits.h).
pub const EXIT_CONFIG: i32 = crate::exit::Exit::Usage as i32;

/// A place in a config file: the file as shown to the user and a 1-based line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file's path as the user knows it (or the source name given to
    /// [`Config::from_sources`](super::Config::from_sources)).
    pub file: String,
    /// 1-based line number.
    pub line: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// Why the configuration could not be loaded. The `Display` text is the whole message for the
/// operator.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A config file could not be read: the explicitly named main file is missing, or any
    /// file is unreadable (permissions, not UTF-8, a directory).
    #[error("{}: cannot read config file: {source}", path.display())]
    ReadFile {
        /// The file as it was opened.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The drop-in directory exists but could not be listed.
    #[error("{}: cannot list drop-in directory: {source}", path.display())]
    ReadDir {
        /// The `config.d` directory as it was opened.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A file is not valid TOML.
    #[error("{at}: TOML syntax error: {message}")]
    Syntax {
        /// Where the parser stopped.
        at: Location,
        /// The parser's message, e.g. `invalid string`.
        message: String,
    },

    /// A key the agent does not know (a typo, or a key from a newer version).
    #[error("{}unknown key {key}: {expected}", prefix(at.as_ref()))]
    UnknownKey {
        /// Where the key was set.
        at: Option<Location>,
        /// Dotted key, e.g. `device_plugin.mig_stratgy`.
        key: String,
        /// The keys allowed there, e.g. `expected one of level, format`.
        expected: String,
    },

    /// A key whose value is wrong: the wrong type, not one of the allowed values, or breaking a
    /// rule (alone or together with other keys).
    #[error("{}{key} = {value}{} is not valid: {reason}", prefix(at.as_ref()), default_note(at.as_ref()))]
    InvalidValue {
        /// Where the key was set; `None` when no file set it and its default is what breaks
        /// a rule.
        at: Option<Location>,
        /// Dotted key, e.g. `device_plugin.mig_strategy` or `health.ignored_xids[2]`.
        key: String,
        /// The value as TOML, e.g. `"mixd"`.
        value: String,
        /// What is wrong and what is allowed, e.g. `expected one of none, single, mixed`.
        reason: String,
    },
}

fn prefix(at: Option<&Location>) -> String {
    at.map(|at| format!("{at}: ")).unwrap_or_default()
}

fn default_note(at: Option<&Location>) -> &'static str {
    if at.is_some() { "" } else { " (default)" }
}

impl ConfigError {
    /// The process exit status for this error: always [`EXIT_CONFIG`] (64).
    pub fn exit_code(&self) -> i32 {
        EXIT_CONFIG
    }

    /// The file and line the error points at, if it points into a file.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ConfigError::Syntax { at, .. } => Some(at),
            ConfigError::UnknownKey { at, .. } | ConfigError::InvalidValue { at, .. } => at.as_ref(),
            ConfigError::ReadFile { .. } | ConfigError::ReadDir { .. } => None,
        }
    }

    /// The dotted key the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::InvalidValue { key, .. } => Some(key),
            _ => None,
        }
    }
}
