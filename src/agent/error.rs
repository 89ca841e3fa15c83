//! Why the agent stopped with an error, and the exit code that says so.

use crate::exit::Exit;
use crate::nvml::GpuError;
use crate::plugin::sharing::SharingError;
use crate::plugin::strategy::StrategyError;

/// Why the agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Nvml(#[from] GpuError),
    #[error("{0}")]
    Strategy(#[from] StrategyError),
    #[error("{0}")]
    Sharing(#[from] SharingError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("cannot start the NVML health watcher thread: {0}")]
    HealthThread(std::io::Error),
}

impl AgentError {
    /// Exit code: 69 (EX_UNAVAILABLE) when NVML is missing, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Nvml(_) => Exit::NoNvml.code(),
            _ => Exit::Failed.code(),
        }
    }
}
