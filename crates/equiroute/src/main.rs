//! The `equiroute` binary: one subcommand per module.

mod policies;

use clap::{Parser, Subcommand};

/// Adaptive router for functionally equivalent providers.
#[derive(Parser)]
#[command(name = "equiroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the routing policies with one line each.
    Policies,
}

fn main() {
    match Cli::parse().command {
        Command::Policies => policies::run(),
    }
}
