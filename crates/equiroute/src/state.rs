//! `equiroute state export|import`: the saved learning state as JSON, for inspection, backup
//! and migration. Run them while no gateway holds the state file.

use anyhow::{bail, Context};
use equiroute_gateway::config::StateConfig;
use equiroute_gateway::store::Store;
use std::path::PathBuf;

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

fn store_of(config: &PathBuf) -> anyhow::Result<Store> {
    let text = std::fs::read_to_string(config)
        .with_context(|| format!("--config {}: cannot read it", config.display()))?;
    let cfg = equiroute_gateway::config::load(&text, &config.display().to_string(), &|name| {
        std::env::var(name).ok()
    })?;
    match cfg.state {
        Some(StateConfig::File(state)) => Ok(Store::open(&state.path)?),
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

pub fn run(command: &Command) -> anyhow::Result<()> {
    match command {
        Command::Export { config } => match store_of(config)?.export_json()? {
            Some(json) => println!("{}", serde_json::to_string_pretty(&json)?),
            None => bail!("the state file holds no snapshot yet"),
        },
        Command::Import { config, file } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            store_of(config)?.import_json(&json)?;
            println!("imported {} into the state file", file.display());
        }
    }
    Ok(())
}
