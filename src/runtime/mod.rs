//! The container runtime stage: the `nvidia` runtime in containerd (config v2 and v3), docker
//! and CRI-O, and the CDI spec for the node's GPUs.
//!
//! The engine modules are pure text-to-text edits (existing file text in, new file text out),
//! each with its implementation of the engine seam ([`engine::ContainerEngine`]: its facts, its
//! edit, its check, its CRI after a restart); the stage (`stage`) asks them only through it,
//! decides which engines to touch, writes files atomically with backups, restarts the runtimes,
//! and rolls back on failure.

pub mod cdi;
pub mod containerd;
pub mod cri;
pub mod crio;
pub mod docker;
pub mod engine;
pub mod facts_cache;
pub mod kubelet;
pub mod node_spec;
pub mod stage;
pub mod toolkit;

use std::path::PathBuf;

/// The runtime the agent adds to each engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaRuntime {
    /// Runtime (handler) name, normally `nvidia`.
    pub name: String,
    /// Absolute host path of the runtime binary, e.g. `/usr/bin/nvidia-container-runtime`.
    pub binary: PathBuf,
    /// What happens to the engine's default runtime.
    pub default: DefaultRuntime,
    /// Turn on the engine's CDI support (containerd `enable_cdi`, docker `features.cdi`; CRI-O
    /// always has it).
    pub enable_cdi: bool,
    /// More runtimes added next to `name`, with the same options: the GPU Operator's
    /// `nvidia-cdi` and `nvidia-legacy` (name, binary), for the toolkit binaries the node has.
    pub also: Vec<(String, PathBuf)>,
    /// Add the runtimes. `false` under `cdi-only`: the engine gets its CDI switch and no runtime
    /// ([`NvidiaRuntime::all`] is empty), and `default` is [`DefaultRuntime::Unset`], so a default
    /// naming one of the agent's runtimes (from a run with the toolkit) goes back to the engine's.
    pub runtimes: bool,
}

impl NvidiaRuntime {
    /// Every runtime name the agent adds: `name`, then the `also` names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.name.as_str()).chain(self.also.iter().map(|(n, _)| n.as_str()))
    }

    /// Every runtime the agent adds, name and binary: none under `cdi-only`.
    pub fn all(&self) -> impl Iterator<Item = (&str, &std::path::Path)> {
        std::iter::once((self.name.as_str(), self.binary.as_path()))
            .chain(self.also.iter().map(|(n, b)| (n.as_str(), b.as_path())))
            .filter(|_| self.runtimes)
    }

    /// The CDI switch alone, for `cdi-only`: no runtime, CDI on, a default naming one of the
    /// agent's runtimes undone.
    pub fn cdi_only(mut self) -> NvidiaRuntime {
        self.runtimes = false;
        self.enable_cdi = true;
        self.default = DefaultRuntime::Unset;
        self
    }
}

/// What the edit does with the engine's default runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultRuntime {
    /// The agent's runtime becomes the default (unmodified pods get GPUs through it).
    Set,
    /// Whatever the engine's files say stays, an earlier `nvidia` default included.
    Keep,
    /// A default that names the agent's runtime goes back to the engine's own (`runc`); any
    /// other stays.
    Unset,
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
