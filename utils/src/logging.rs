//! The tracing setup every cairn binary starts with: `RUST_LOG` filters,
//! logs go to stderr as text or JSON lines.

use std::io::IsTerminal as _;

/// `--log-format`: how log lines on stderr look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people (coloured at a terminal).
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Sets up tracing on stderr. `RUST_LOG` filters; without it, `default_level`
/// (`info` for servers and agents, `warn` for a CLI whose stdout is the
/// answer). Colours only for a person at a terminal, so a host agent's logs
/// stay plain. A second call does nothing.
pub fn init(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Err only when a subscriber is already set (tests set one per process).
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
