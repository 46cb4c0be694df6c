//! The process's logs: `tracing` events on stderr, for a person (the default) or as one JSON
//! object per line (`--log-format json`, `[server] log_format = "json"`), at the level
//! `RUST_LOG` sets (`info` without it). Standard output stays the commands' own output.

use equiroute_gateway::config::LogFormat;
use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

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
    init_with(format, None);
}

/// [`init`], with the gateway's spans also exported through `telemetry` (`[telemetry]`).
/// `RUST_LOG` filters the logs only: the exported spans are the gateway's whatever it says.
pub fn init_with(format: LogFormat, telemetry: Option<&equiroute_gateway::telemetry::Telemetry>) {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(f) => (f, None),
            Err(e) => (EnvFilter::new("info"), Some(e.to_string())),
        },
        _ => (EnvFilter::new("info"), None),
    };
    let logs = match format {
        LogFormat::Human => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_filter(filter)
            .boxed(),
    };
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(telemetry.map(equiroute_gateway::telemetry::Telemetry::layer))
        .try_init();
    if let (Ok(()), Some(why)) = (installed, bad) {
        tracing::warn!("RUST_LOG is not a valid filter ({why}); logging at info");
    }
}
