//! `equiroute policies [NAME]`: the policy names accepted in configuration, and one policy's
//! parameters with their defaults and meaning.

use anyhow::Context;
use equiroute_core::policies::{PolicyConfig, PolicyKind};
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A policy (e.g. `lqm-ts`): print its parameters, their defaults and what they mean.
    name: Option<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let Some(name) = &args.name else {
        for kind in PolicyKind::ALL {
            println!("{:<18} {}", kind.as_str(), kind.summary());
        }
        println!("\n`equiroute policies NAME` lists a policy's parameters.");
        return Ok(());
    };
    let kind: PolicyKind = name
        .parse()
        .with_context(|| format!("`equiroute policies {name}`"))?;
    println!("{} — {}\n", kind.as_str(), kind.summary());
    let params = parameters(kind);
    if params.is_empty() {
        println!("no parameters: policy = \"{}\"", kind.as_str());
        return Ok(());
    }
    let width = params.iter().map(|p| p.path.len()).max().unwrap_or(0);
    let default_width = params.iter().map(|p| p.default.len()).max().unwrap_or(0);
    for p in &params {
        println!(
            "  {:<width$}  {:<default_width$}  {}",
            p.path, p.default, p.meaning
        );
    }
    println!(
        "\nIn a configuration: policy = {{ name = \"{}\", {} = … }}; in the laboratory: \
         equiroute bench --set {}.{}=VALUE",
        kind.as_str(),
        params[0].path,
        kind.as_str(),
        params[0].path
    );
    Ok(())
}

/// One parameter of a policy: its dotted path, its default as written in configuration, and
/// what it means.
#[derive(Debug)]
struct Parameter {
    path: String,
    default: String,
    meaning: &'static str,
}

/// Every leaf parameter of `kind`'s default configuration, in serialisation order.
fn parameters(kind: PolicyKind) -> Vec<Parameter> {
    let mut out = Vec::new();
    let Ok(Value::Object(root)) = serde_json::to_value(PolicyConfig::default_for(kind)) else {
        return out;
    };
    for (key, value) in root {
        if key != "name" {
            collect(&key, &value, &mut out);
        }
    }
    out
}

fn collect(path: &str, value: &Value, out: &mut Vec<Parameter>) {
    match value {
        // A tagged table (`objective = { kind = … }`) is one parameter: its variants differ.
        Value::Object(table) if !table.contains_key("kind") => {
            for (key, v) in table {
                collect(&format!("{path}.{key}"), v, out);
            }
        }
        _ => out.push(Parameter {
            path: path.to_owned(),
            default: match value {
                Value::Null => "(unset)".to_owned(),
                other => other.to_string(),
            },
            meaning: meaning(path),
        }),
    }
}

/// What a parameter means, by its path (the last segments decide: `head.window` is the same
/// in every policy that has quality heads).
fn meaning(path: &str) -> &'static str {
    let ends = |suffix: &str| path == suffix || path.ends_with(&format!(".{suffix}"));
    DESCRIPTIONS
        .iter()
        .find(|(suffix, _)| ends(suffix))
        .map_or("", |(_, text)| text)
}

/// Meanings, most specific suffix first.
const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        "shift.threshold",
        "CUSUM threshold on the quality residuals, in their spreads (0 = no change detection)",
    ),
    (
        "shift.slack",
        "CUSUM slack: half the quality shift, in spreads, the detector is tuned to, >= 0",
    ),
    (
        "shift.min_scores",
        "residuals that set the spread before the detector tests",
    ),
    (
        "shift.spread_floor",
        "least spread of the quality residuals assumed, > 0",
    ),
    (
        "retest",
        "most probability per request of re-testing a quality level lost in a drop, in [0, 1]",
    ),
    (
        "max_slices",
        "latency slices kept per interface beyond the roots (least useful evicted)",
    ),
    (
        "max_slice_bytes",
        "bytes of the latency slice table per interface (least useful evicted), >= 65536",
    ),
    (
        "head.lambda_r",
        "ridge of each quality head (A starts as lambda_r·I), > 0",
    ),
    (
        "head.window",
        "quality scores kept per provider (older ones are downdated), >= 1",
    ),
    (
        "head.refresh_every",
        "updates between two exact re-inversions of A, >= 1",
    ),
    (
        "head.fast_width",
        "exploration widths from a single-precision copy of A^-1",
    ),
    (
        "head.warmup",
        "quality scores each candidate gets before the score decides alone",
    ),
    (
        "head.warmup_exit_z",
        "leave the warm-up early once clearly worse (z standard errors; 0 = off)",
    ),
    (
        "head.warmup_order",
        "\"scores\" or \"attempts\": which provider in its warm-up goes first, the one with the fewest scores or the fewest attempts",
    ),
    (
        "head.center",
        "shrink towards the head's mean score instead of 0",
    ),
    ("latency_prior.mu0", "NIG prior: mean of ln(latency ms)"),
    (
        "latency_prior.kappa0",
        "NIG prior: pseudo-observations behind mu0, > 0",
    ),
    (
        "latency_prior.alpha0",
        "NIG prior: shape of the variance's inverse gamma, > 0",
    ),
    (
        "latency_prior.beta0",
        "NIG prior: scale of the variance's inverse gamma, > 0",
    ),
    (
        "latency_half_life_ms",
        "latency evidence loses half its weight in this time, > 0",
    ),
    (
        "failure.half_life_ms",
        "failure evidence loses half its weight in this time, > 0",
    ),
    (
        "failure.prior_rate",
        "failure rate assumed before any attempt, in [0, 1]",
    ),
    ("failure.prior_weight", "attempts that prior is worth, >= 0"),
    (
        "slice_depth",
        "statistics slice levels used (1 = none, up to 4)",
    ),
    (
        "borrow_strength",
        "pseudo-observations a slice borrows from its parent, >= 0",
    ),
    (
        "shape_prior_weight",
        "weight of the log-normal against the latency histogram (null = log-normal only), > 0",
    ),
    (
        "exploration_guard",
        "a candidate whose point P(bad) exceeds this is only a last fallback",
    ),
    (
        "level_beta",
        "weight of the fast latency level (0 = off), in [0, 1]",
    ),
    (
        "stale_half_life_ms",
        "an untried provider's evidence halves after this long (null = off), > 0",
    ),
    (
        "stale_latency_half_life_ms",
        "stale_half_life_ms for the latency belief (lqm-ts: and its latency EMA tau) alone (absent: stale_half_life_ms), > 0",
    ),
    (
        "stale_failure_half_life_ms",
        "stale_half_life_ms for the failure belief alone (absent: stale_half_life_ms), > 0",
    ),
    (
        "censored_tail",
        "\"log-normal\" or \"belief\": how a cut-off call's \"at least t\" is spread in the histogram",
    ),
    (
        "head.gate",
        "rank by each provider's context-free mean (with its head's width) until the query is shown to move scores",
    ),
    (
        "head.gate_margin",
        "share by which the contextual heads must predict better to open the gate, in [0, 1)",
    ),
    (
        "head.gate_z",
        "z the predicted deviations from the means must clear to open the gate (0: judge errors by gate_margin), >= 0",
    ),
    (
        "head.gate_retry",
        "c of the closed gate's lock-in guard: width at least sqrt(c·ln N/n), N the interface's scores (0 = off), >= 0",
    ),
    (
        "head.gate_tie_z",
        "z within which a provider's mean score is not yet told apart from the leader's; such near-ties rank on the query while the gate is closed (0 = off), >= 0",
    ),
    (
        "level_z",
        "standard errors the fast level must clear before it moves the latency (0 = always), >= 0",
    ),
    (
        "level_half_life_ms",
        "the fast level's weight halves after this long without a call",
    ),
    ("alpha_ucb", "exploration width of the quality heads, >= 0"),
    (
        "shrink_lambda",
        "lambda of the exploration shrink 1/(1+lambda·gap), >= 0",
    ),
    (
        "l_ref_ms",
        "the latency budget L_ref: one service time, > 0",
    ),
    (
        "ema_beta",
        "weight of the newest latency in the EMA, in (0, 1]",
    ),
    (
        "tau0_ms",
        "latency assumed before the first call (unset = l_ref_ms)",
    ),
    (
        "failure_quality",
        "quality taught by a failed or timed-out attempt, in [0, 1]",
    ),
    (
        "cost_ref_usd",
        "cost that halves a candidate's value (unset = mean eligible cost)",
    ),
    (
        "quality_tolerance",
        "candidates within this share of the best estimate go cheapest first",
    ),
    (
        "latency",
        "\"over-budget\" (latency beyond l_ref_ms discounts) or \"renewal\" (LQM's)",
    ),
    (
        "objective",
        "{ kind = \"cost-per-good\" | \"risk-budget\", max_bad | \"min-risk\" } (lqm-ts: \"cheapest-in-group\" | \"risk-budget\")",
    ),
    (
        "propensity_samples",
        "extra draws to estimate the first choice's probability (0 = off)",
    ),
    ("window", "scores kept in the sliding window, >= 1"),
    ("c", "exploration constant of the UCB bonus, >= 0"),
    ("xi", "exponent of the window's log term, > 0"),
    (
        "failure_reward",
        "reward taught by a failed attempt, in [0, 1]",
    ),
    (
        "alpha",
        "weight of quality against normalised latency, in [0, 1]",
    ),
    ("latency_scale_ms", "latency that normalises to 1, > 0"),
    (
        "order",
        "provider ids, most preferred first (unlisted ones follow)",
    ),
    (
        "allowed_fails",
        "failures within fail_window_ms before a cooldown",
    ),
    (
        "fail_window_ms",
        "window in which failures are counted, > 0",
    ),
    (
        "cooldown_ms",
        "length of a cooldown (a Retry-After also starts one), >= 0",
    ),
    ("candidate", "the provider id that goes first (required)"),
    (
        "max_failure_rate",
        "candidates failing more often than this are skipped, in [0, 1]",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_of_every_policy_has_a_meaning_and_a_default() {
        for kind in PolicyKind::ALL {
            for p in parameters(kind) {
                assert!(
                    !p.meaning.is_empty(),
                    "`{}.{}` has no description in DESCRIPTIONS",
                    kind.as_str(),
                    p.path
                );
                assert!(!p.default.is_empty());
            }
        }
    }

    #[test]
    fn nested_tables_become_dotted_paths_with_their_defaults() {
        let params = parameters(PolicyKind::LqmTs);
        let find = |path: &str| params.iter().find(|p| p.path == path);
        let alpha = find("lqm.alpha_ucb").expect("lqm-ts has lqm.alpha_ucb");
        assert_eq!(alpha.default, "0.2");
        assert_eq!(
            find("lqm.head.warmup").map(|p| p.default.as_str()),
            Some("10")
        );
        assert!(find("risk.failure.half_life_ms").is_some());
        assert!(parameters(PolicyKind::RoundRobin).is_empty());
    }
}
