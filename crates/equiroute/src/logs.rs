//! The process's logs: `tracing` events on stderr, for a person (the default) or as one JSON
//! object per line (`--log-format json`, `[server] log_format = "json"`), at the level
//! `RUST_LOG` sets (`info` without it). Standard output stays the commands' own output.

use equiroute_gateway::config::LogFormat;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// `--log-format` on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Human,
    Json,
}

impl From<Format> for LogFormat {
    fn from(f: Format) -> Self {
        match f {
            Format::Human => LogFormat::Human,
            Format::Json => LogFormat::Json,
        }
    }
}

/// Installs the subscriber, once per process (a second call changes nothing). A `RUST_LOG`
/// that does not parse falls back to `info` with a warning rather than stopping the command.
pub fn init(format: LogFormat) {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(f) => (f, None),
            Err(e) => (EnvFilter::new("info"), Some(e.to_string())),
        },
        _ => (EnvFilter::new("info"), None),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Human => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    if let (Ok(()), Some(why)) = (installed, bad) {
        tracing::warn!("RUST_LOG is not a valid filter ({why}); logging at info");
    }
}
