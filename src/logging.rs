//! Logging: journald when running under systemd (or when the config says so), readable text on
//! a terminal. The level comes from `RUST_LOG` when set, else `[log] level`.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{LogConfig, LogFormat};

/// Installs the global subscriber. Never fails: a journald that cannot be reached falls back to
/// text on stderr with a warning.
pub fn init(config: &LogConfig) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directive) if !directive.trim().is_empty() => EnvFilter::try_new(&directive).unwrap_or_else(|e| {
            eprintln!(
                "gpu-node-agent: RUST_LOG={directive:?} is not valid ({e}); using [log] level {:?}",
                config.level
            );
            EnvFilter::new(&config.level)
        }),
        _ => EnvFilter::new(&config.level),
    };
    let journald = match config.format {
        LogFormat::Journald => true,
        LogFormat::Text => false,
        LogFormat::Auto => std::env::var_os("JOURNAL_STREAM").is_some(),
    };
    let registry = tracing_subscriber::registry().with(filter);
    if journald {
        match tracing_journald::layer() {
            Ok(layer) => {
                registry
                    .with(layer.with_syslog_identifier("gpu-node-agent".into()))
                    .init();
                return;
            }
            Err(e) => eprintln!("gpu-node-agent: journald is not reachable ({e}); logging to stderr"),
        }
    }
    let text = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: a file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    registry.with(text).init();
}
