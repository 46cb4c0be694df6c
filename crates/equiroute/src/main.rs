//! The `equiroute` binary: one subcommand per module.

mod bench;
mod check;
mod logs;
mod mock;
mod png;
mod policies;
mod replay;
mod scenarios;
mod serve;
mod state;

use clap::{Parser, Subcommand};

/// mimalloc instead of the system allocator: the gateway allocates small buffers on every
/// request from several threads, where glibc's malloc showed up as ~18% of CPU in a profile
/// (bench/gateway/README.md). Its v2 line (the `v2` feature): v3 kept about 10 MiB of pages a
/// burst of slow clients had touched (RSS 33 → 43 MiB after the attack, with ~6 MB live),
/// where v2 purges them (back to 30–31 MiB, `bench/gateway/slowloris.sh`, issue 41).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Adaptive router for functionally equivalent providers.
#[derive(Parser)]
#[command(name = "equiroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How logs are written on stderr: `human` (default) or `json`, one object per line
    /// (`serve` also reads `[server] log_format`). The level comes from `RUST_LOG` (default info).
    #[arg(long, global = true, value_enum)]
    log_format: Option<logs::Format>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the embedded default routes to simulated providers).
    Serve(serve::Args),
    /// Run a mock OpenAI-compatible and search upstream with configurable faults.
    MockUpstream(mock::Args),
    /// Validate a gateway configuration file.
    CheckConfig(check::Args),
    /// Export or import the saved learning state as JSON.
    #[command(subcommand)]
    State(state::Command),
    /// Run policies side by side in simulated scenarios and report over seeds.
    Bench(bench::Args),
    /// List the built-in scenarios with one line each.
    Scenarios,
    /// List the routing policies, or one policy's parameters with defaults and meaning.
    Policies(policies::Args),
    /// Estimate what other policies would have done on the traffic in a gateway's audit log
    /// (off-policy evaluation: IPS, SNIPS, doubly robust).
    Replay(replay::Args),
}

/// Runs the command; an error is printed as `Error: ` and its chain of causes, one line, and
/// the exit status is 1. (Returning it from `main` would print anyhow's debug form, with a
/// stack backtrace whenever `RUST_BACKTRACE` is set: noise for a user who mistyped a field.)
/// `state export` with nothing saved yet exits with 3 ([`state::NOTHING_SAVED`]).
fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // `serve` installs the subscriber once it has read its configuration's `log_format`.
    if !matches!(cli.command, Command::Serve(_)) {
        logs::init(cli.log_format.map_or_else(Default::default, Into::into));
    }
    match run(cli.command, cli.log_format) {
        Ok(status) => status,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(
    command: Command,
    log_format: Option<logs::Format>,
) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Serve(args) => serve::run(&args, log_format.map(Into::into))?,
        Command::MockUpstream(args) => mock::run(&args)?,
        Command::CheckConfig(args) => check::run(&args)?,
        Command::State(cmd) => return state::run(&cmd),
        Command::Bench(args) => bench::run(&args)?,
        Command::Scenarios => scenarios::run()?,
        Command::Policies(args) => policies::run(&args)?,
        Command::Replay(args) => replay::run(&args)?,
    }
    Ok(std::process::ExitCode::SUCCESS)
}
