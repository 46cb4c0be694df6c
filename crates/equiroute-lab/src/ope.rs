//! Off-policy evaluation in the laboratory: a logged run's traffic, replayed to another
//! policy as the gateway's `replay` would, turned into [`LoggedDecision`]s for
//! [`equiroute_core::ope::evaluate`] — and the truth to compare with, from running that
//! policy on the same scenario and seed.
//!
//! The replay feeds the target policy the logged observations in the order the logging
//! policy received them (quality scores as they arrived, then the decision, then its
//! attempts): the target learns from the logger's traffic, never from its own, and is asked
//! for its first-choice distribution on each logged context.

use crate::runner::{run_logged, RunError};
use crate::scenario::ScenarioSpec;
pub use crate::traffic::{LoggedAttempt, LoggedFeedback, LoggedRound, TrafficLog};
use equiroute_core::ope::{
    evaluate, learns_as_own, learns_as_sample, learns_from, rejection_bound, with_learning_replays,
    Estimate, Estimator, LoggedDecision, OpeError, OpeOptions,
};
use equiroute_core::policies::{
    AttemptObservation, FirstChoice, Policy, QualityObservation, RankContext,
};
use equiroute_core::SlicePath;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The metric evaluated per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Gold quality (0 for a request without an answer), as [`crate::runner::RunResult::quality`].
    Quality,
    /// 1 for a missed deadline, as `deadline_miss_rate`.
    DeadlineMiss,
    /// Spend per request, as `cost_per_request`.
    Cost,
}

impl Metric {
    fn of(self, r: &LoggedRound) -> f64 {
        match self {
            Metric::Quality => r.quality,
            Metric::DeadlineMiss => f64::from(u8::from(r.missed)),
            Metric::Cost => r.cost,
        }
    }
}

/// What a replayed target learns from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Learning {
    /// Every logged observation: the target learns from the logging policy's traffic.
    All,
    /// Only a sample of the rounds as it would have served them itself (rejection sampling
    /// with a constant bound, Li et al. 2011): a round is kept with probability
    /// `c·π(action)/propensity`, `c` the log's smallest propensity
    /// ([`equiroute_core::ope::learns_as_own`]), so every round is kept with probability `c`
    /// and a kept round's (context, first choice) is distributed as on the target's own
    /// traffic. Its attempts and the quality of its answer are observed only when it is kept.
    Own,
    /// As `Own` but kept with probability `min(1, π(action)/propensity)`
    /// ([`equiroute_core::ope::learns_from`], the replay before): more rounds, but kept most
    /// where the logger was likely to make the target's choice, so the target learns from
    /// the contexts where it agrees with the logger rather than from its own mix.
    Agreeing,
    /// A uniformly random sample of the rounds of the same expected size as `Own`: every
    /// round kept with probability `c` whatever the target would choose
    /// ([`equiroute_core::ope::learns_as_sample`], the same coin as `Own`). Against `All` it
    /// shows what learning from fewer rounds alone changes; against `Own`, what learning on
    /// its own traffic changes at equal size.
    Sample,
}

/// A replay's result.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// The target's first-choice distribution on every logged context.
    pub choices: Vec<FirstChoice>,
    /// Per round, whether the target learnt from it (always, with [`Learning::All`]).
    pub learnt_from: Vec<bool>,
}

/// Replays `log` to `target`: its first-choice distribution on every logged context
/// (`draws` draws for Thompson-sampled targets, from `rng`), learning as `learning` says.
pub fn replay(
    log: &TrafficLog,
    target: &mut dyn Policy,
    rng: &mut ChaCha8Rng,
    draws: u32,
    learning: Learning,
) -> Replayed {
    let mut out = Vec::with_capacity(log.rounds.len());
    let mut kept = Vec::with_capacity(log.rounds.len());
    // The coin of rejection sampling, apart from the target's own draws.
    let mut coin = ChaCha8Rng::seed_from_u64(0x5eed_c017);
    let bound = rejection_bound(log.rounds.iter().map(|r| r.propensity));
    for r in &log.rounds {
        for f in r
            .feedback
            .iter()
            .filter(|f| kept.get(f.round) == Some(&true))
        {
            target.observe_quality(&QualityObservation {
                candidate: f.candidate,
                features: &f.features,
                quality: f.quality,
                latency: f.latency,
                now: f.now,
            });
        }
        let mut ctx = RankContext::new(&log.candidates, &r.eligible, &r.features);
        ctx.deadline = r.deadline;
        ctx.tokens = log.tokens;
        ctx.now = r.now;
        ctx.in_flight = Some(&r.in_flight);
        ctx.oracle_values = Some(&r.values);
        let dist = target.first_choice_distribution(&ctx, rng, draws);
        let keep = match learning {
            Learning::All => true,
            Learning::Own => learns_as_own(
                dist.probability(r.action),
                r.propensity,
                bound,
                coin.random::<f64>(),
            ),
            Learning::Sample => learns_as_sample(bound, coin.random::<f64>()),
            Learning::Agreeing => learns_from(
                dist.probability(r.action),
                r.propensity,
                coin.random::<f64>(),
            ),
        };
        out.push(dist);
        kept.push(keep);
        // The target ranks the request as a shadow would (round-robin moves on).
        let _ = target.rank(&ctx, rng);
        if !keep {
            continue;
        }
        for a in &r.attempts {
            target.observe_attempt(&AttemptObservation {
                candidate: a.candidate,
                features: &r.features,
                slice: SlicePath::root(),
                deadline: a.deadline,
                outcome: &a.outcome,
                now: a.now,
            });
        }
    }
    Replayed {
        choices: out,
        learnt_from: kept,
    }
}

/// The evaluator's records: the logged decisions with the target's distributions.
#[must_use]
pub fn decisions(log: &TrafficLog, target: &[FirstChoice], metric: Metric) -> Vec<LoggedDecision> {
    log.rounds
        .iter()
        .zip(target)
        .map(|(r, t)| LoggedDecision {
            features: r.features.clone(),
            eligible: r.eligible.clone(),
            action: r.action,
            propensity: r.propensity,
            propensity_exact: r.propensity_exact,
            target: t.probabilities.clone(),
            outcome: metric.of(r),
        })
        .collect()
}

/// The expected value of exactly the replayed decisions: the target's first-choice
/// probabilities times each provider's true expected value, averaged over the logged contexts
/// (only the laboratory knows the values).
fn replay_truth(log: &TrafficLog, dist: &[FirstChoice]) -> f64 {
    log.rounds
        .iter()
        .zip(dist)
        .map(|(r, d)| {
            r.eligible
                .iter()
                .map(|&c| d.probability(c) * r.values[c])
                .sum::<f64>()
        })
        .sum::<f64>()
        / log.rounds.len().max(1) as f64
}

/// One (scenario, target policy, seed) of the laboratory proof.
#[derive(Clone, Debug)]
pub struct OpeCase {
    pub scenario: String,
    pub logger: String,
    pub target: String,
    pub seed: u64,
    /// The target's on-policy value (its own run on the same scenario and seed).
    pub truth: f64,
    /// The standard error of `truth` as the mean of that run's per-request outcomes: the
    /// realised truth is itself one draw, which the estimator's interval does not cover.
    pub truth_se: f64,
    /// The expected value of exactly the replayed decisions: the target's first-choice
    /// probabilities times each provider's true expected value, averaged over the logged
    /// contexts. It is what the estimators estimate; `truth` also carries the difference
    /// between the target learning from the log and from its own traffic.
    pub replay_truth: f64,
    /// The logging run's own value.
    pub logged_value: f64,
    /// The logging run's regret against the oracle.
    pub logged_regret: f64,
    /// IPS, SNIPS and DR, in [`Estimator::ALL`] order, as the evaluator reports them: the
    /// target learning from every logged observation ([`Learning::All`]), the interval
    /// spanning the replay learning as on its own traffic too, warned as
    /// [`with_learning_replays`] says (with the random-sample replay).
    pub estimates: Vec<(Estimator, Estimate)>,
    /// IPS, SNIPS and DR of the target learning from every logged observation, alone (the
    /// interval before it spans the other replay, no learning warning).
    pub all_estimates: Vec<(Estimator, Estimate)>,
    /// The replay truth of the target learning from its own choices ([`Learning::Own`]).
    pub own_replay_truth: f64,
    /// IPS, SNIPS and DR of the target learning from its own choices.
    pub own_estimates: Vec<(Estimator, Estimate)>,
    /// The replay truth of the target learning from a random sample of the same expected
    /// size ([`Learning::Sample`]).
    pub sample_replay_truth: f64,
    /// IPS, SNIPS and DR of the target learning from that random sample.
    pub sample_estimates: Vec<(Estimator, Estimate)>,
    /// As `estimates`, by the evaluator without the block bootstrap and the load tests
    /// ([`baseline_options`]), on the same replays: the before of a before/after.
    pub baseline: Vec<(Estimator, Estimate)>,
}

/// The evaluator as it was before the block bootstrap and the load tests: iid bootstrap,
/// records dealt into cross-fitting folds one by one, no load-interference test.
#[must_use]
pub fn baseline_options(opts: &OpeOptions) -> OpeOptions {
    OpeOptions {
        bootstrap_block: 1,
        load_window: 0,
        ..*opts
    }
}

/// A laboratory case could not run.
#[derive(Debug, thiserror::Error)]
pub enum OpeLabError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("scenario {scenario}: {source}")]
    Evaluate { scenario: String, source: OpeError },
}

/// Logs `logger`'s traffic on `spec` with `seed` and evaluates every target offline against
/// its own on-policy run (same scenario and seed, `rounds` rounds each).
///
/// # Errors
/// A policy cannot be built, or the evaluator rejects the log.
pub fn evaluate_targets(
    spec: &ScenarioSpec,
    logger: &str,
    targets: &[String],
    seed: u64,
    rounds: usize,
    draws: u32,
    opts: &OpeOptions,
) -> Result<Vec<OpeCase>, OpeLabError> {
    let (logged, log) = run_logged(spec, logger, seed, rounds, draws)?;
    let mut out = Vec::with_capacity(targets.len());
    for target in targets {
        let build = || {
            spec.policy(target)
                .and_then(|c| {
                    c.build_with_floor(&log.candidates, spec.feature_dim, &spec.floor(target))
                })
                .map_err(|source| RunError::Policy {
                    scenario: spec.name.clone(),
                    policy: target.clone(),
                    source,
                })
        };
        let variants = [*opts, baseline_options(opts)];
        let mut runs = Vec::with_capacity(3);
        for learning in [Learning::All, Learning::Own, Learning::Sample] {
            let mut policy = build()?;
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0ff_9011c7);
            let dist = replay(&log, policy.as_mut(), &mut rng, draws, learning).choices;
            let records = decisions(&log, &dist, Metric::Quality);
            let per_variant = variants
                .iter()
                .map(|o| {
                    Estimator::ALL
                        .into_iter()
                        .map(|e| {
                            evaluate(&records, e, &OpeOptions { seed, ..*o })
                                .map(|est| (e, est))
                                .map_err(|source| OpeLabError::Evaluate {
                                    scenario: spec.name.clone(),
                                    source,
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()?;
            runs.push((replay_truth(&log, &dist), per_variant));
        }
        let (sample_replay_truth, mut sample) = runs.pop().unwrap_or_default();
        let (own_replay_truth, mut own) = runs.pop().unwrap_or_default();
        let (replay_truth, mut all) = runs.pop().unwrap_or_default();
        let combine = |all: &[(Estimator, Estimate)],
                       own: &[(Estimator, Estimate)],
                       sample: &[(Estimator, Estimate)],
                       o| {
            all.iter()
                .zip(own)
                .zip(sample)
                .map(|(((e, all), (_, own)), (_, sample))| {
                    (*e, with_learning_replays(all.clone(), own, Some(sample), o))
                })
                .collect::<Vec<_>>()
        };
        let (own_baseline, sample_baseline) = (
            own.pop().unwrap_or_default(),
            sample.pop().unwrap_or_default(),
        );
        let own_estimates = own.pop().unwrap_or_default();
        let sample_estimates = sample.pop().unwrap_or_default();
        let baseline = combine(
            &all.pop().unwrap_or_default(),
            &own_baseline,
            &sample_baseline,
            &variants[1],
        );
        let all_estimates = all.pop().unwrap_or_default();
        let estimates = combine(&all_estimates, &own_estimates, &sample_estimates, opts);
        let (on_policy, on_policy_log) = run_logged(spec, target, seed, rounds, 1)?;
        let truth = on_policy.quality;
        let n = on_policy_log.rounds.len().max(2) as f64;
        let var = on_policy_log
            .rounds
            .iter()
            .map(|r| (r.quality - truth).powi(2))
            .sum::<f64>()
            / (n - 1.0);
        let truth_se = (var / n).sqrt();
        out.push(OpeCase {
            scenario: spec.name.clone(),
            logger: logger.to_owned(),
            target: target.clone(),
            seed,
            truth,
            truth_se,
            replay_truth,
            logged_value: logged.quality,
            logged_regret: logged.regret,
            estimates,
            all_estimates,
            own_replay_truth,
            own_estimates,
            sample_replay_truth,
            sample_estimates,
            baseline,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::run;
    use crate::scenario::{builtin, Variant};
    use equiroute_core::policies::PolicyConfig;

    #[test]
    fn a_logged_run_is_the_plain_run_and_replays_to_itself() {
        let mut spec = builtin("retriever-pool").unwrap();
        let plain = run(&spec, "lqm", 3, 300).unwrap();
        let (logged, log) = run_logged(&spec, "lqm", 3, 300, 10).unwrap();
        assert_eq!(plain, logged);
        assert_eq!(log.rounds.len(), 300);
        let mean: f64 = log.rounds.iter().map(|r| r.quality).sum::<f64>() / 300.0;
        assert!((mean - logged.quality).abs() < 1e-12);
        // A deterministic logger reports probability 1 "by construction".
        assert!(log
            .rounds
            .iter()
            .all(|r| (r.propensity - 1.0).abs() < 1e-15 && !r.propensity_exact));
        // Replayed to a fresh copy of itself, lqm makes the logged choice every time.
        let mut me = spec
            .policy("lqm")
            .unwrap()
            .build(&log.candidates, spec.feature_dim)
            .unwrap();
        let dist = replay(
            &log,
            me.as_mut(),
            &mut ChaCha8Rng::seed_from_u64(1),
            1,
            Learning::All,
        )
        .choices;
        for (r, d) in log.rounds.iter().zip(&dist) {
            assert!((d.probability(r.action) - 1.0).abs() < 1e-12);
        }
        // With a floor, every logged propensity is at least the floor.
        spec.variants.push(Variant {
            label: "lqm-floor".into(),
            policy: PolicyConfig::from_name("lqm").unwrap(),
            min_propensity: 0.02,
            own_l_ref: true,
        });
        let (_, log) = run_logged(&spec, "lqm-floor", 3, 300, 10).unwrap();
        assert!(log
            .rounds
            .iter()
            .all(|r| r.propensity >= 0.02 - 1e-12 && r.propensity_exact));
        assert!(log.rounds.iter().any(|r| r.propensity < 0.5));
    }

    #[test]
    fn a_target_learning_from_its_own_choices_learns_only_where_the_log_made_them() {
        let mut spec = builtin("retriever-pool").unwrap();
        spec.variants.push(Variant {
            label: "lqm-ts-floor".into(),
            policy: PolicyConfig::from_name("lqm-ts").unwrap(),
            min_propensity: 0.05,
            own_l_ref: true,
        });
        let (_, log) = run_logged(&spec, "lqm-ts-floor", 4, 400, 20).unwrap();
        let build = || {
            spec.policy("lqm")
                .unwrap()
                .build(&log.candidates, spec.feature_dim)
                .unwrap()
        };
        let mut agreeing = build();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let r = replay(&log, agreeing.as_mut(), &mut rng, 1, Learning::Agreeing);
        // lqm is deterministic: π(action)/propensity is 0 where it would choose otherwise and
        // at least 1 where it agrees, so it learns from exactly the rounds that agree.
        for ((round, d), kept) in log.rounds.iter().zip(&r.choices).zip(&r.learnt_from) {
            assert_eq!(*kept, d.probability(round.action) > 0.5);
        }
        let agreed = r.learnt_from.iter().filter(|k| **k).count();
        assert!(agreed > 0 && agreed < 400, "{agreed}");
        // Learning as on its own traffic, it keeps only rounds that agree, each with
        // bound/propensity: about bound·400 of them, fewer than the agreeing ones.
        let mut own = build();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let r = replay(&log, own.as_mut(), &mut rng, 1, Learning::Own);
        for ((round, d), kept) in log.rounds.iter().zip(&r.choices).zip(&r.learnt_from) {
            assert!(!*kept || d.probability(round.action) > 0.5);
        }
        let kept = r.learnt_from.iter().filter(|k| **k).count();
        let bound = rejection_bound(log.rounds.iter().map(|r| r.propensity));
        assert!((0.04..=0.06).contains(&bound), "{bound}");
        assert!(kept > 0 && kept < agreed && kept < 50, "{kept} {agreed}");
        // A random sample of the same expected size keeps rounds whatever lqm would choose:
        // about bound·400 of them, agreeing or not, and never one the same coin's draw is
        // above the bound for.
        let mut sample = build();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let s = replay(&log, sample.as_mut(), &mut rng, 1, Learning::Sample);
        let sampled = s.learnt_from.iter().filter(|k| **k).count();
        assert!(
            (5..=40).contains(&sampled),
            "{sampled} of 400, bound {bound}"
        );
        let disagreeing = log
            .rounds
            .iter()
            .zip(&s.choices)
            .zip(&s.learnt_from)
            .filter(|((round, d), kept)| **kept && d.probability(round.action) < 0.5)
            .count();
        assert!(disagreeing > 0, "{sampled}");
        // It received the scores of those rounds only: fewer than when it learns from all.
        let mut all = build();
        let _ = replay(&log, all.as_mut(), &mut rng, 1, Learning::All);
        let scores = |p: &dyn Policy| p.quality_observations().unwrap().iter().sum::<u64>();
        let (own_scores, all_scores) = (scores(own.as_ref()), scores(all.as_ref()));
        assert!(
            own_scores > 0 && own_scores < all_scores,
            "{own_scores} {all_scores}"
        );
    }
}
