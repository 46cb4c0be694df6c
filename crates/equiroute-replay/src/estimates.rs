//! The replay and the estimates: each target policy replayed through an interface's log
//! (learning from every request, from a sample drawn as its own traffic would be, and from a
//! random sample of the same size), then IPS, SNIPS or doubly robust per metric, with the
//! warnings that say when an estimate cannot be trusted.

use crate::interfaces::{CandidatesFrom, Decision, Event, InterfaceLog, Known, Space};
use crate::targets::{context_free_names, reads_features, Target};
use crate::Options;
use equiroute_core::ope::{self, Estimate, LoggedDecision, OpeOptions, SupportWarning};
use equiroute_core::policies::{AttemptObservation, Policy, QualityObservation, RankContext};
use equiroute_core::{Millis, Timestamp};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// What a replayed policy learns from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Learning {
    /// Every logged request, as the gateway's policy did.
    All,
    /// A sample drawn as its own traffic would be ([`ope::learns_as_own`]).
    Own,
    /// A uniformly random sample of the same expected size ([`ope::learns_as_sample`]).
    Sample,
}

/// The four metrics, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Metric {
    Quality,
    DeadlineMiss,
    Bad,
    Cost,
}

impl Metric {
    pub(crate) const ALL: [Metric; 4] = [
        Metric::Quality,
        Metric::DeadlineMiss,
        Metric::Bad,
        Metric::Cost,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Metric::Quality => "quality",
            Metric::DeadlineMiss => "deadline_miss_rate",
            Metric::Bad => "bad_outcome_rate",
            Metric::Cost => "cost_per_request_usd",
        }
    }

    pub(crate) fn title(self) -> &'static str {
        match self {
            Metric::Quality => "quality",
            Metric::DeadlineMiss => "deadline miss",
            Metric::Bad => "bad outcome",
            Metric::Cost => "cost/request $",
        }
    }

    fn value(self, d: &Decision) -> Option<f64> {
        match self {
            Metric::Quality => d.quality.map(|(q, _)| q),
            Metric::DeadlineMiss => Some(f64::from(u8::from(d.miss))),
            Metric::Bad => Some(f64::from(u8::from(d.bad))),
            Metric::Cost => Some(d.cost),
        }
    }
}

/// The target's first-choice probabilities at each decision, learning from the log as the
/// gateway's policy did ([`Learning::All`]), or only from the requests where the log made the
/// choice it would have made ([`Learning::Own`]: rejection sampling with the log's smallest
/// propensity as the constant bound, [`ope::learns_as_own`], so the kept requests are a
/// sample of the target's own traffic, contexts included), or from a uniformly random sample
/// of the same expected size ([`Learning::Sample`], the same coin). A request without a
/// usable propensity is not learnt from by the samples.
pub(crate) fn replay(
    policy: &mut dyn Policy,
    log: &InterfaceLog,
    draws: u32,
    seed: u64,
    learning: Learning,
) -> Vec<Vec<f64>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // The coin of rejection sampling, apart from the target's own draws.
    let mut coin = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_c017);
    let mut learnt = vec![learning == Learning::All; log.decisions.len()];
    let bound = ope::rejection_bound(
        log.decisions
            .iter()
            .filter_map(|d| d.propensity.map(|(q, _)| q)),
    );
    let zeros = vec![0.0; log.space.feature_dim];
    let features = |d: &Decision| d.features.clone().unwrap_or_else(|| zeros.clone());
    let mut targets = vec![Vec::new(); log.decisions.len()];
    for event in &log.events {
        match *event {
            Event::Decide(i) => {
                let d = &log.decisions[i];
                let x = features(d);
                let mut ctx = RankContext::new(&log.space.candidates, &d.eligible, &x);
                ctx.deadline = d.deadline;
                ctx.slice = d.slice;
                ctx.tokens = d.tokens;
                ctx.now = Timestamp(d.decided);
                targets[i] = policy
                    .first_choice_distribution(&ctx, &mut rng, draws)
                    .probabilities;
                let p = targets[i].get(d.action).copied().unwrap_or(0.0);
                match learning {
                    Learning::All => {}
                    Learning::Own => {
                        learnt[i] = d.propensity.is_some_and(|(q, _)| {
                            ope::learns_as_own(p, q, bound, coin.random::<f64>())
                        });
                    }
                    Learning::Sample => {
                        learnt[i] = d
                            .propensity
                            .is_some_and(|_| ope::learns_as_sample(bound, coin.random::<f64>()));
                    }
                }
                // The decision itself, for policies whose state moves with it (round-robin).
                let _ = policy.rank(&ctx, &mut rng);
            }
            Event::Attempt(i, _) | Event::Feedback(i) if !learnt[i] => {}
            Event::Attempt(i, k) => {
                let d = &log.decisions[i];
                let (candidate, outcome, started) = d.attempts[k];
                let x = features(d);
                // The gateway passes the time left on the deadline when the attempt began.
                let left = d
                    .deadline
                    .map(|dl| Millis((dl.0 - (started - d.decided)).max(0.0)));
                policy.observe_attempt(&AttemptObservation {
                    candidate,
                    features: &x,
                    slice: d.slice,
                    deadline: left,
                    outcome: &outcome,
                    now: Timestamp(started + outcome.latency.0),
                });
            }
            Event::Feedback(i) => {
                let d = &log.decisions[i];
                let (Some((quality, at)), Some(candidate)) = (d.quality, d.answered_by) else {
                    continue;
                };
                // The gateway keeps a pending request's features in single precision.
                let x: Vec<f64> = features(d).iter().map(|&v| f64::from(v as f32)).collect();
                policy.observe_quality(&QualityObservation {
                    candidate,
                    features: &x,
                    quality,
                    latency: Millis(d.latency),
                    now: Timestamp(at),
                });
            }
        }
    }
    targets
}

/// What the logging policy's log supports, said once per interface.
pub(crate) fn propensity_summary(log: &InterfaceLog) -> (&'static str, bool) {
    let kinds: Vec<Known> = log
        .decisions
        .iter()
        .filter_map(|d| d.propensity.map(|(_, k)| k))
        .collect();
    let all = |k: Known| !kinds.is_empty() && kinds.iter().all(|x| *x == k);
    if kinds.is_empty() {
        ("none reported", false)
    } else if all(Known::Deterministic) {
        ("deterministic", true)
    } else if all(Known::Exact) {
        ("exact", false)
    } else if all(Known::Estimated) {
        ("estimated", false)
    } else {
        ("mixed", kinds.contains(&Known::Deterministic))
    }
}

/// The on-policy mean of `metric` with a normal 95% interval.
pub(crate) fn on_policy(log: &InterfaceLog, metric: Metric) -> Value {
    let xs: Vec<f64> = log
        .decisions
        .iter()
        .filter_map(|d| metric.value(d))
        .collect();
    if xs.is_empty() {
        return json!({"n": 0});
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    let half = 1.96 * (var / n).sqrt();
    json!({"value": mean, "ci_low": mean - half, "ci_high": mean + half, "n": xs.len(), "effective_sample_size": n})
}

/// A warning in words, with provider ids instead of indices.
pub(crate) fn warning_text(w: &SupportWarning, space: &Space) -> String {
    w.describe(|c| {
        space
            .candidates
            .get(c)
            .map_or_else(|| format!("candidate {c}"), |p| format!("`{}`", p.id.0))
    })
}

/// One interface's report, as JSON (the table is printed from it).
pub(crate) fn evaluate_interface(log: &InterfaceLog, targets: &[Target], opts: &Options) -> Value {
    let with_quality = log.decisions.iter().filter(|d| d.quality.is_some()).count();
    let (propensities, deterministic) = propensity_summary(log);
    let mut warnings: Vec<String> = Vec::new();
    if deterministic {
        warnings.push(format!(
            "the logging policy ({}) is deterministic: its log only shows what happens where another policy makes the same choice, so estimates are valid only for policies that agree with it; log with an exploration floor (min_propensity) or a stochastic policy to evaluate others",
            log.logging_policies.join(", ")
        ));
    }
    if log.unknown_provider > 0 {
        warnings.push(format!(
            "{} request(s) name a provider that {} does not have in `{}`: skipped (give --config the configuration the gateway ran with)",
            log.unknown_provider,
            match &log.space.from {
                CandidatesFrom::Config(name) => name.as_str(),
                CandidatesFrom::Log => "the log",
            },
            log.name
        ));
    }
    if log.no_propensity > 0 {
        warnings.push(format!(
            "{} of {} request(s) have no usable propensity (the logging policy did not report one, or an estimate of 0): they cannot be reweighted and are left out of the estimates (lqm-ts and ts-deadline report one with propensity_samples > 0)",
            log.no_propensity,
            log.decisions.len()
        ));
    }
    if let CandidatesFrom::Log = log.space.from {
        warnings.push(format!(
            "the configuration has no interface `{}`: candidates are the log's ids, with unknown prices (give --config the gateway's configuration for cost-aware policies)",
            log.name
        ));
    }
    let missing_features = log
        .decisions
        .iter()
        .filter(|d| d.features.is_none())
        .count();
    let logging = json!({
        "policy": log.logging_policies.join(","),
        "propensities": propensities,
        "on_policy": Metric::ALL.iter().map(|m| (m.key().to_owned(), on_policy(log, *m))).collect::<serde_json::Map<_, _>>(),
    });
    let usable: Vec<usize> = (0..log.decisions.len())
        .filter(|&i| log.decisions[i].propensity.is_some())
        .collect();
    let policies: Vec<Value> = targets
        .iter()
        .enumerate()
        .map(|(n, t)| {
            evaluate_target(
                log,
                t,
                &usable,
                missing_features,
                opts,
                opts.seed.wrapping_add(n as u64),
            )
        })
        .collect();
    json!({
        "interface": log.name,
        "requests": log.decisions.len() + log.unknown_provider,
        "with_quality": with_quality,
        "features": log.features,
        "candidates": log.space.candidates.iter().map(|c| c.id.0.clone()).collect::<Vec<_>>(),
        "candidates_from": log.space.from.describe(),
        "logging": logging,
        "warnings": warnings,
        "policies": policies,
    })
}

pub(crate) fn evaluate_target(
    log: &InterfaceLog,
    target: &Target,
    usable: &[usize],
    missing_features: usize,
    options: &Options,
    seed: u64,
) -> Value {
    let name = target.kind.as_str();
    let refused = |why: String| json!({"policy": name, "refused": why});
    if reads_features(target.kind) && missing_features > 0 {
        return refused(format!(
            "`{name}` reads each request's features, and {missing_features} of {} logged request(s) have none (written with [audit] features = \"hash\" or \"none\"): only context-free policies ({}) can be evaluated from this log; set features = \"full\" to evaluate contextual ones",
            log.decisions.len(),
            context_free_names()
        ));
    }
    if usable.is_empty() {
        return refused(
            "no logged request has a usable propensity: nothing can be reweighted (log with a policy that reports its propensities, or an exploration floor)".into(),
        );
    }
    let opts = OpeOptions {
        seed,
        learning_check: options.learning_check,
        ..OpeOptions::default()
    };
    // Replayed learning from every request (the estimate), then only from a sample drawn as
    // its own traffic would be, and from a random sample of the same size: a policy that
    // learns may score otherwise ([`ope::with_learning_replays`]).
    let mut learnings = vec![Learning::All, Learning::Own];
    if opts.learning_check == ope::LearningCheck::OwnVsSample {
        learnings.push(Learning::Sample);
    }
    let mut replays = Vec::with_capacity(learnings.len());
    for learning in learnings {
        let built = target.config(log.space.policy.as_ref()).and_then(|cfg| {
            cfg.build(&log.space.candidates, log.space.feature_dim)
                .map_err(|e| anyhow::anyhow!("{e}"))
        });
        match built {
            Ok(mut p) => replays.push(replay(p.as_mut(), log, options.draws, seed, learning)),
            Err(e) => {
                return refused(format!(
                    "cannot be built for interface `{}`: {e:#}",
                    log.name
                ))
            }
        }
    }
    let (distributions, own_distributions, sample_distributions) =
        (&replays[0], &replays[1], replays.get(2));
    // Contextual reward models for DR only when every record has its features.
    let with_features = missing_features == 0;
    let mut warnings: Vec<String> = Vec::new();
    let mut estimates = Vec::new();
    for estimator in options.estimators.clone() {
        let mut metrics = serde_json::Map::new();
        for metric in Metric::ALL {
            let records =
                |targets: &[Vec<f64>]| records(log, usable, with_features, metric, targets);
            let (all, own) = (records(distributions), records(own_distributions));
            let evaluated = ope::evaluate(&all, estimator, &opts).and_then(|e| {
                let o = ope::evaluate(&own, estimator, &opts)?;
                let s = sample_distributions
                    .map(|d| ope::evaluate(&records(d), estimator, &opts))
                    .transpose()?;
                Ok(ope::with_learning_replays(e, &o, s.as_ref(), &opts))
            });
            let value = match evaluated {
                Ok(e) => {
                    for w in &e.warnings {
                        // Said once for the interface.
                        if *w == SupportWarning::DeterministicLogger {
                            continue;
                        }
                        let mut text = warning_text(w, &log.space);
                        if matches!(w, SupportWarning::LearningDependent { .. }) {
                            text = format!("{} ({estimator}): {text}", metric.key());
                        }
                        let text = if metric == Metric::Quality && e.n < usable.len() {
                            format!("quality (the {} request(s) with a score): {text}", e.n)
                        } else {
                            text
                        };
                        if !warnings.contains(&text) {
                            warnings.push(text);
                        }
                    }
                    estimate_json(&e)
                }
                Err(ope::OpeError::Empty) => json!({"n": 0}),
                Err(e) => json!({"n": all.len(), "error": e.to_string()}),
            };
            metrics.insert(metric.key().to_owned(), value);
        }
        estimates.push(json!({"estimator": estimator.as_str(), "metrics": metrics}));
    }
    json!({"policy": name, "estimates": estimates, "warnings": warnings})
}

/// The evaluator's records of one metric: the usable logged decisions with the target's
/// first-choice probabilities (`targets`, indexed like the log's decisions).
pub(crate) fn records(
    log: &InterfaceLog,
    usable: &[usize],
    with_features: bool,
    metric: Metric,
    targets: &[Vec<f64>],
) -> Vec<LoggedDecision> {
    usable
        .iter()
        .filter_map(|&i| {
            let d = &log.decisions[i];
            let (propensity, known) = d.propensity?;
            Some(LoggedDecision {
                features: if with_features {
                    d.features.clone().unwrap_or_default()
                } else {
                    Vec::new()
                },
                eligible: d.eligible.clone(),
                action: d.action,
                propensity,
                propensity_exact: known != Known::Deterministic,
                target: targets[i].clone(),
                outcome: metric.value(d)?,
            })
        })
        .collect()
}

pub(crate) fn estimate_json(e: &Estimate) -> Value {
    json!({
        "value": e.value,
        "ci_low": e.ci_low,
        "ci_high": e.ci_high,
        "effective_sample_size": e.effective_sample_size,
        "n": e.n,
    })
}
