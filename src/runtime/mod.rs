//! The container runtime stage: the `nvidia` runtime in containerd (config v2 and v3), docker
//! and CRI-O, and the CDI spec for the node's GPUs.
//!
//! The engine modules are pure text-to-text edits (existing file text in, new file text out);
//! the stage in this module decides which engines to touch, writes files atomically with
//! backups, checks and restarts the runtimes, and rolls back on failure.

pub mod cdi;
pub mod containerd;
pub mod crio;
pub mod docker;
pub mod stage;

use std::path::PathBuf;

/// The runtime the agent adds to each engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaRuntime {
    /// Runtime (handler) name, normally `nvidia`.
    pub name: String,
    /// Absolute host path of the runtime binary, e.g. `/usr/bin/nvidia-container-runtime`.
    pub binary: PathBuf,
    /// Make it the engine's default runtime.
    pub set_as_default: bool,
    /// Turn on the engine's CDI support (containerd `enable_cdi`, docker `features.cdi`; CRI-O
    /// always has it).
    pub enable_cdi: bool,
}

/// An engine's configuration could not be edited. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EditError {
    /// The existing file is not valid TOML / JSON.
    #[error("{file}: line {line}, column {column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// The file parses but a key the edit needs has the wrong type (e.g. `imports` is not an
    /// array of strings, `runtimes` is not a table/object).
    #[error("{file}: key {key}: {message}")]
    Shape { file: String, key: String, message: String },
}
