//! `equiroute replay`: what other policies would have done on the traffic a gateway already
//! served, estimated from its audit log (off-policy evaluation, [`equiroute_core::ope`]).
//!
//! This module parses the arguments and prints; reading the log, the replay and the estimates
//! are the `equiroute-replay` crate's ([`equiroute_replay::report`]).

use anyhow::{bail, Context};
use equiroute_core::ope::{self, Estimator};
use std::path::PathBuf;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// `--estimator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EstimatorArg {
    Ips,
    Snips,
    Dr,
    All,
}

impl EstimatorArg {
    fn estimators(self) -> Vec<Estimator> {
        match self {
            EstimatorArg::Ips => vec![Estimator::Ips],
            EstimatorArg::Snips => vec![Estimator::Snips],
            EstimatorArg::Dr => vec![Estimator::Dr],
            EstimatorArg::All => Estimator::ALL.to_vec(),
        }
    }
}

/// `--learning-check`: which comparison of a learning policy's replays warns
/// ([`ope::LearningCheck`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LearningCheckArg {
    /// Learning from every request against learning as on its own traffic (the rule before
    /// the random-sample replay: a policy that merely learns slowly is warned too).
    AllVsOwn,
    /// That, and learning as on its own traffic against learning from a uniformly random
    /// sample of the log of the same size.
    OwnVsSample,
}

impl From<LearningCheckArg> for ope::LearningCheck {
    fn from(a: LearningCheckArg) -> Self {
        match a {
            LearningCheckArg::AllVsOwn => ope::LearningCheck::AllVsOwn,
            LearningCheckArg::OwnVsSample => ope::LearningCheck::OwnVsSample,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Audit log files (the gateway's `[audit] path`); each file's rotations (`FILE.1`,
    /// `FILE.2`, …) are read too. Several gateways' logs may be given together.
    #[arg(long, num_args = 1.., required = true, value_name = "FILE")]
    audit: Vec<PathBuf>,
    /// Policies to evaluate, comma-separated (`equiroute policies` lists them). A policy of
    /// the same name as an interface's configured one starts from its configured parameters.
    #[arg(long, value_delimiter = ',', required = true)]
    policies: Vec<String>,
    /// Change one parameter of an evaluated policy, e.g. `--set lqm-ts.lqm.l_ref_ms=800` (a
    /// dotted path, as `equiroute policies NAME` lists it; the value is read as JSON, else
    /// as a string). May repeat.
    #[arg(long = "set", value_name = "POLICY.FIELD=VALUE")]
    sets: Vec<String>,
    /// The estimator: inverse propensity scoring, its self-normalised form, doubly robust,
    /// or all three.
    #[arg(long, value_enum, default_value = "dr")]
    estimator: EstimatorArg,
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// The configuration the gateway ran with: providers' prices, tiers and capabilities, each
    /// interface's feature dimension and policy parameters (default: the embedded default).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Only this interface.
    #[arg(long)]
    interface: Option<String>,
    /// Rankings drawn per decision to estimate a Thompson-sampled policy's first-choice
    /// probabilities.
    #[arg(long, default_value_t = 200)]
    draws: u32,
    /// Seed of the policies' sampling and of the bootstrap intervals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Which comparison warns that a learning policy's estimate depends on what it learns
    /// (docs/ope.md): `own-vs-sample` also replays it learning from a random sample of the
    /// log of the size of its own-traffic sample, and warns only when the own-traffic
    /// sample differs from both that and every request.
    #[arg(long, value_enum, default_value = "own-vs-sample")]
    learning_check: LearningCheckArg,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let targets = equiroute_replay::targets(&args.policies, &args.sets)?;
    if args.draws == 0 {
        bail!("--draws must be at least 1 (rankings drawn per decision for Thompson-sampled policies)");
    }
    let (config, config_name) = load_config(args.config.as_ref())?;
    let options = equiroute_replay::Options {
        draws: args.draws,
        seed: args.seed,
        estimators: args.estimator.estimators(),
        learning_check: args.learning_check.into(),
    };
    let report = equiroute_replay::report(
        &args.audit,
        &config,
        &config_name,
        args.interface.as_deref(),
        &targets,
        &options,
    )?;
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => print!("{}", equiroute_replay::table(&report)),
    }
    Ok(())
}

/// The configuration whose providers give the candidates' attributes.
fn load_config(
    path: Option<&PathBuf>,
) -> anyhow::Result<(equiroute_gateway::config::GatewayConfig, String)> {
    let env = |name: &str| std::env::var(name).ok();
    // Keys do not matter here: a missing one must not stop a replay.
    let lenient = |name: &str| env(name).or_else(|| Some("unused-by-replay".into()));
    match path {
        None => Ok((
            equiroute_gateway::config::load(
                equiroute_gateway::config::DEFAULT_CONFIG,
                "(embedded default)",
                &lenient,
            )?,
            "the embedded default".into(),
        )),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--config `{}`", p.display()))?;
            let name = p.display().to_string();
            Ok((
                equiroute_gateway::config::load(&text, &name, &lenient)?,
                name,
            ))
        }
    }
}
