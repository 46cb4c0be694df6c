//! `equiroute state export|import`: the saved learning state as JSON, for inspection, backup
//! and migration. Both refuse a state file a gateway holds; `export` never writes the file
//! nor creates it (a read-only file or mount is read as it is); `import` checks the snapshot
//! against the configuration as `serve` would at start, and leaves the file untouched when
//! it refuses.

use anyhow::{bail, Context};
use equiroute_gateway::config::{GatewayConfig, StateConfig};
use equiroute_gateway::server::state::AppState;
use equiroute_gateway::store::{Store, StoreError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `state export`'s exit status when there is nothing to export yet (no file, or no
/// snapshot in it): distinct from 1 (an error) and 2 (a usage error), so that a backup
/// script can tell "nothing yet" from a failure.
pub const NOTHING_SAVED: u8 = 3;

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print the saved snapshot as JSON.
    Export {
        /// The gateway configuration whose `[state] path` to read.
        #[arg(long)]
        config: PathBuf,
    },
    /// Replace the saved snapshot with a JSON file written by `export`.
    Import {
        #[arg(long)]
        config: PathBuf,
        /// The JSON snapshot.
        file: PathBuf,
    },
}

/// The configuration at `config` and its `[state] path` (file backend only).
fn state_path(config: &Path) -> anyhow::Result<(GatewayConfig, PathBuf)> {
    let text = std::fs::read_to_string(config)
        .with_context(|| format!("--config {}: cannot read it", config.display()))?;
    let cfg = equiroute_gateway::config::load(&text, &config.display().to_string(), &|name| {
        std::env::var(name).ok()
    })?;
    match &cfg.state {
        Some(StateConfig::File(state)) => {
            let path = state.path.clone();
            Ok((cfg, path))
        }
        Some(StateConfig::Redis(_)) => bail!(
            "{}: [state] uses the redis backend: export and import work on the file backend; point a configuration with `[state] path = \"…\"` at a copy, or read the shared state from GET /v1/interfaces/NAME/state?full=true",
            config.display()
        ),
        None => bail!(
            "{}: has no [state] section: add `[state] path = \"…\"` to keep learning state",
            config.display()
        ),
    }
}

pub fn run(command: &Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Export { config } => match Store::export_file(&state_path(config)?.1) {
            Ok(json) => {
                let mut out = std::io::stdout().lock();
                writeln!(out, "{}", serde_json::to_string_pretty(&json)?)
                    .and_then(|()| out.flush())
                    .context("cannot write the snapshot to standard output")?;
            }
            Err(e @ StoreError::NothingSaved { .. }) => {
                eprintln!("{e}");
                return Ok(ExitCode::from(NOTHING_SAVED));
            }
            Err(e) => return Err(e.into()),
        },
        Command::Import { config, file } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            let (cfg, path) = state_path(config)?;
            // The check start-up makes, on a state built from the same configuration.
            let state = AppState::new(&cfg, 0).map_err(|e| anyhow::anyhow!("{e}"))?;
            Store::import_file(&path, &json, &state)
                .with_context(|| format!("cannot import {}", file.display()))?;
            println!("imported {} into the state file", file.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
