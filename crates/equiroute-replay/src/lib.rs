//! # equiroute-replay
//!
//! What other policies would have done on the traffic a gateway already served, estimated
//! from its audit log (off-policy evaluation, [`equiroute_core::ope`]): the library behind
//! `equiroute replay`, which parses the arguments and prints [`report`] (JSON) or [`table`].
//!
//! Per interface: the log's requests are replayed in time order through each target policy,
//! which observes every logged attempt and every quality score as they happened and, at each
//! logged decision, gives its first-choice distribution. With the logging policy's
//! propensity of what it chose, IPS, SNIPS or doubly robust estimate the target's mean
//! quality, deadline-miss rate, bad-outcome rate and cost per request, with 95% intervals
//! and the effective sample size; the logging policy's own means are the sanity row.
//!
//! The log gives the index space (each record's `candidates`); the providers' prices, tiers
//! and capabilities come from `--config` (else the embedded default), and from the log alone
//! (ids, no prices) for an interface the configuration does not have.
//!
//! Modules: `log` reads the files and joins feedback to requests, `interfaces` puts
//! each interface's requests in its index space, `targets` checks the policies to evaluate,
//! `estimates` replays and estimates, `table` writes the report as text.

mod estimates;
mod interfaces;
mod log;
mod table;
mod targets;

pub use table::table;
pub use targets::{targets, Target};

use anyhow::bail;
use equiroute_core::ope::{self, Estimator};
use equiroute_gateway::config::GatewayConfig;
use estimates::evaluate_interface;
use interfaces::split;
use serde_json::{json, Value};
use std::path::PathBuf;

/// How the targets are replayed and estimated.
#[derive(Clone, Debug)]
pub struct Options {
    /// Rankings drawn per decision to estimate a Thompson-sampled policy's first-choice
    /// probabilities.
    pub draws: u32,
    /// Seed of the policies' sampling and of the bootstrap intervals.
    pub seed: u64,
    /// The estimators, in report order.
    pub estimators: Vec<Estimator>,
    /// Which comparison of a learning policy's replays warns.
    pub learning_check: ope::LearningCheck,
}

/// The report of `targets` on the audit log files `audit` (with their rotations), as JSON:
/// per interface (only `interface` when given), the logging policy's own means and each
/// target's estimates and warnings. `config` (named `config_name`) gives the providers'
/// prices, tiers and capabilities.
///
/// # Errors
/// The files cannot be read, hold no request record, or none of `interface`.
pub fn report(
    audit: &[PathBuf],
    config: &GatewayConfig,
    config_name: &str,
    interface: Option<&str>,
    targets: &[Target],
    options: &Options,
) -> anyhow::Result<Value> {
    let files = log::with_rotations(audit)?;
    let lines = log::read(&files)?;
    let malformed_count = lines.malformed_count;
    let malformed: Vec<String> = lines.malformed.iter().map(ToString::to_string).collect();
    let joined = log::join(lines);
    let mut interfaces = split(&joined.requests, config, config_name);
    if let Some(only) = interface {
        interfaces.retain(|i| i.name == only);
        if interfaces.is_empty() {
            bail!("--interface `{only}`: the log has no request of that interface");
        }
    }
    if interfaces.is_empty() {
        bail!(
            "no request record in {} ({} malformed line(s)): is this the gateway's `[audit] path`?",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            malformed_count
        );
    }
    let mut notes = Vec::new();
    if malformed_count > 0 {
        notes.push(format!(
            "{malformed_count} malformed line(s) skipped (a line cut by a crash, or not written by the gateway): {}",
            malformed.join("; ")
        ));
    }
    if joined.duplicate_requests > 0 {
        notes.push(format!(
            "{} request record(s) repeat an id already read (the first is kept: was a file given twice?)",
            joined.duplicate_requests
        ));
    }
    if joined.orphan_feedback > 0 {
        notes.push(format!(
            "{} quality score(s) name a request no file holds (rotated away or dropped): not counted",
            joined.orphan_feedback
        ));
    }
    let reports: Vec<Value> = interfaces
        .iter()
        .map(|i| evaluate_interface(i, targets, options))
        .collect();
    let report = json!({
        "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
        "malformed_lines": malformed_count,
        "notes": notes,
        "interfaces": reports,
    });
    Ok(report)
}
