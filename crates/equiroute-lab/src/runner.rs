//! Runs one policy through one scenario with one seed, in virtual time, with the same
//! eligibility, breakers, executor and policies as the gateway.

use crate::calibration::Calibration;
use crate::scenario::ScenarioSpec;
use crate::traffic::{LoggedAttempt, LoggedFeedback, LoggedRound, TrafficLog};
use crate::world::World;
use equiroute_core::breaker::{retested_order, Admission, Breaker, BreakerConfig};
use equiroute_core::eligibility::{check_eligibility, EligibilityInput};
use equiroute_core::executor::{Execution, ExecutionLimits, RequestStatus};
use equiroute_core::features::Featurizer;
use equiroute_core::hedge::{hedge_plan, HedgeBudget, HedgeConfig, RecentLatencies};
use equiroute_core::policies::{AttemptObservation, Policy, QualityObservation, RankContext};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, Requirements, SlicePath, Timestamp};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Time series are kept in this many bins.
pub const BINS: usize = 40;

/// Everything measured in one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    pub policy: String,
    pub seed: u64,
    pub rounds: usize,
    /// Mean gold quality per request (a failed request scores 0).
    pub quality: f64,
    pub latency_mean_ms: f64,
    pub latency_p95_ms: f64,
    /// End-to-end latency quantiles (median and p99).
    #[serde(default)]
    pub latency_p50_ms: f64,
    #[serde(default)]
    pub latency_p99_ms: f64,
    /// Upstream calls per request, hedges and fallbacks included.
    #[serde(default)]
    pub calls_per_request: f64,
    /// Hedges started per request (the extra calls hedging made).
    #[serde(default)]
    pub hedge_rate: f64,
    /// Hedges whose answer was the request's, per request.
    #[serde(default)]
    pub hedge_win_rate: f64,
    /// Requests that missed the deadline (cut off, or answered after it).
    pub deadline_miss_rate: f64,
    /// Requests that got no answer.
    pub request_failure_rate: f64,
    /// Attempts that did not answer (provider errors, timeouts).
    pub attempt_failure_rate: f64,
    /// Spend per request, failed attempts included.
    pub cost_per_request: f64,
    /// Cumulative regret against the oracle's first choice, in expected delivered quality.
    pub regret: f64,
    /// Share of first choices per provider.
    pub share: Vec<f64>,
    /// Share of first choices per provider in each of [`BINS`] time bins.
    pub share_over_time: Vec<Vec<f64>>,
    /// Cumulative regret at the end of each time bin.
    pub regret_over_time: Vec<f64>,
    /// Share of requests without an answer in each of [`BINS`] time bins.
    pub request_failure_rate_over_time: Vec<f64>,
    /// The policy's deadline-miss estimate for its first choice against the first attempt's
    /// outcome (policies with a latency model, scenarios with a deadline).
    #[serde(default)]
    pub calibration: Option<Calibration>,
    /// How long each provider took to get its traffic back after each of its time-limited
    /// events that ended within the run, in the order of the scenario's providers and events.
    #[serde(default)]
    pub recovery: Vec<Recovery>,
    /// Latency and misses per deadline, for a scenario with 2 to [`MAX_DEADLINE_CLASSES`]
    /// deadlines (empty otherwise).
    #[serde(default)]
    pub by_deadline: Vec<DeadlineClass>,
    /// The quality shifts the policy detected ([`Policy::take_quality_shifts`]), in order.
    #[serde(default)]
    pub quality_shifts: Vec<ShiftRecord>,
}

/// One quality shift a policy detected during a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShiftRecord {
    /// The round before whose ranking the score that set it off was learnt.
    pub round: usize,
    pub provider: String,
    /// `down` or `up`.
    pub direction: String,
    pub from: f64,
    pub to: f64,
    pub scores: u64,
}

/// The requests of one deadline of a scenario's `deadline_mix`: with several deadlines, the
/// p99 of all requests often sits at one of them (the requests cut off there), which says
/// little; per deadline, the tail of the requests that had time to spare shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeadlineClass {
    pub deadline_ms: f64,
    /// Share of the run's requests with this deadline.
    pub share: f64,
    pub latency_p99_ms: f64,
    pub deadline_miss_rate: f64,
}

/// Most deadlines reported apart; a mix of more is not split.
pub const MAX_DEADLINE_CLASSES: usize = 8;

impl DeadlineClass {
    /// One class per distinct deadline, in increasing order, when there are 2 to
    /// [`MAX_DEADLINE_CLASSES`] of them; none otherwise.
    #[must_use]
    pub fn of(mut requests: Vec<(f64, f64, bool)>) -> Vec<DeadlineClass> {
        let total = requests.len() as f64;
        requests.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let classes: Vec<&[(f64, f64, bool)]> = requests
            .chunk_by(|a, b| a.0.total_cmp(&b.0).is_eq())
            .collect();
        if !(2..=MAX_DEADLINE_CLASSES).contains(&classes.len()) {
            return Vec::new();
        }
        classes
            .into_iter()
            .map(|c| {
                let n = c.len();
                let rank = ((n as f64 * 0.99).ceil() as usize).clamp(1, n);
                DeadlineClass {
                    deadline_ms: c[0].0,
                    share: n as f64 / total,
                    latency_p99_ms: c[rank - 1].1,
                    deadline_miss_rate: c.iter().filter(|r| r.2).count() as f64 / n as f64,
                }
            })
            .collect()
    }
}

/// The share of first choices in a window that counts as a provider's traffic being back.
pub const RECOVERY_SHARE: f64 = 0.6;

/// The time a provider took to get its traffic back after a time-limited event: rounds from
/// the event's end (its `end_round`; a `degrade`'s `recover_round`) to the first round `r`
/// such that the provider was ranked first in at least [`RECOVERY_SHARE`] of the rounds
/// `r..r + w`, where `w` is the length of one of the [`BINS`] time bins (`rounds / BINS`, at
/// least 1). `None` ("never") when no such window fits before the run ends or the provider's
/// next event starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    pub provider: String,
    /// The event's kind (`outage`, `error-burst`, `spike`, …).
    pub event: String,
    /// The first round after the event.
    pub end_round: usize,
    pub rounds: Option<usize>,
    /// Rounds from the event's start (`start_round`) to the first round `r` such that the
    /// provider was ranked first in less than [`DEPARTURE_SHARE`] of the rounds `r..r + w`
    /// (the same window), or `None` when that does not happen before the event ends. 0 when
    /// the provider had little of the traffic to begin with: read it against its share before
    /// the event.
    #[serde(default)]
    pub departure_rounds: Option<usize>,
}

/// The share of first choices in a window below which a provider has lost its traffic.
pub const DEPARTURE_SHARE: f64 = 0.3;

/// The rounds from `start` to the first window of `window` rounds, ending at or before
/// `limit`, in which `provider` was the first choice of less than [`DEPARTURE_SHARE`] of the
/// rounds.
#[must_use]
pub fn departure_rounds(
    firsts: &[Option<usize>],
    provider: usize,
    start: usize,
    limit: usize,
    window: usize,
) -> Option<usize> {
    let w = window.max(1) as f64;
    first_window(firsts, provider, start, limit, window, |hits| {
        (hits as f64) < DEPARTURE_SHARE * w
    })
}

/// The rounds from `end` to the first window of `window` rounds, ending at or before `limit`,
/// in which `provider` was the first choice of at least [`RECOVERY_SHARE`] of the rounds
/// (`firsts[t]` is round `t`'s first choice, `None` for a refused request).
#[must_use]
pub fn recovery_rounds(
    firsts: &[Option<usize>],
    provider: usize,
    end: usize,
    limit: usize,
    window: usize,
) -> Option<usize> {
    let needed = (RECOVERY_SHARE * window.max(1) as f64).ceil() as usize;
    first_window(firsts, provider, end, limit, window, |hits| hits >= needed)
}

/// The rounds from `from` to the first window of `window` rounds (sliding round by round,
/// ending at or before `limit`) whose count of rounds with `provider` first satisfies `ok`.
fn first_window(
    firsts: &[Option<usize>],
    provider: usize,
    from: usize,
    limit: usize,
    window: usize,
    ok: impl Fn(usize) -> bool,
) -> Option<usize> {
    let limit = limit.min(firsts.len());
    let window = window.max(1);
    if from + window > limit {
        return None;
    }
    let hit = |t: usize| usize::from(firsts[t] == Some(provider));
    let mut count: usize = (from..from + window).map(hit).sum();
    for start in from..=limit - window {
        if start > from {
            count = count + hit(start + window - 1) - hit(start - 1);
        }
        if ok(count) {
            return Some(start - from);
        }
    }
    None
}

/// Every time-limited event of `spec` that ends before `rounds`, with the recovery measured
/// on `firsts`.
fn recoveries(spec: &ScenarioSpec, firsts: &[Option<usize>], rounds: usize) -> Vec<Recovery> {
    let window = (rounds / BINS).max(1);
    let mut out = Vec::new();
    for (i, p) in spec.providers.iter().enumerate() {
        for e in &p.events {
            let Some(end) = e.kind.end_round(e.end_round).filter(|&end| end < rounds) else {
                continue;
            };
            // The provider's next event bounds the search.
            let limit = p
                .events
                .iter()
                .map(|n| n.start_round)
                .filter(|&s| s >= end)
                .min()
                .unwrap_or(rounds);
            out.push(Recovery {
                provider: p.id.clone(),
                event: e.kind.name().to_owned(),
                end_round: end,
                rounds: recovery_rounds(firsts, i, end, limit, window),
                departure_rounds: departure_rounds(firsts, i, e.start_round, end, window),
            });
        }
    }
    out
}

/// A run that could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("scenario {scenario}: policy `{policy}`: {source}")]
    Policy {
        scenario: String,
        policy: String,
        source: equiroute_core::ConfigError,
    },
    #[error("scenario {scenario}: {message}")]
    Settings { scenario: String, message: String },
}

/// A quality score on its way to the router.
struct PendingFeedback {
    /// The round whose answer was scored.
    round: usize,
    due_round: usize,
    candidate: usize,
    features: Vec<f64>,
    judged: f64,
    latency: Millis,
}

/// Stable per-label salt so that policies get different exploration randomness per seed.
fn salt(label: &str) -> u64 {
    let mut h = equiroute_core::features::Fnv64::new();
    h.write(label.as_bytes());
    h.finish()
}

/// Runs `label` (a policy name or variant) through `spec` for `rounds` rounds with `seed`.
///
/// The world's randomness is split into streams seeded by `seed` alone (queries, outcomes,
/// judge), so every policy faces the same queries; only the policy's own stream depends on
/// its label.
///
/// # Errors
/// The policy cannot be built for this scenario.
pub fn run(
    spec: &ScenarioSpec,
    label: &str,
    seed: u64,
    rounds: usize,
) -> Result<RunResult, RunError> {
    run_with(spec, label, &[], seed, rounds)
}

/// [`run`] with some of the policy's parameters changed ([`ScenarioSpec::policy_with`]: each
/// `(path, value)` sets a field of the configuration's JSON form), as the laboratory's
/// examples take `FIELD=VALUE` arguments; with no `sets` it is [`run`].
///
/// # Errors
/// A path that names no field or a value the field cannot take, or the policy cannot be
/// built for this scenario.
pub fn run_with(
    spec: &ScenarioSpec,
    label: &str,
    sets: &[(String, serde_json::Value)],
    seed: u64,
    rounds: usize,
) -> Result<RunResult, RunError> {
    let (world, policy) = built(spec, label, sets)?;
    simulate(spec, label, policy, world, seed, rounds, Extras::default())
}

/// The world of `spec` and the policy `label` built for it, with its exploration floor and
/// `sets` applied ([`run_with`]).
fn built(
    spec: &ScenarioSpec,
    label: &str,
    sets: &[(String, serde_json::Value)],
) -> Result<(World, Box<dyn equiroute_core::policies::Policy>), RunError> {
    let unbuilt = |source| RunError::Policy {
        scenario: spec.name.clone(),
        policy: label.to_owned(),
        source,
    };
    // Without changes the configuration is the scenario's own, not a JSON round trip of it.
    let cfg = if sets.is_empty() {
        spec.policy(label).map_err(unbuilt)?
    } else {
        spec.policy_with(label, sets)
            .map_err(|message| RunError::Settings {
                scenario: spec.name.clone(),
                message,
            })?
    };
    let world = World::new(spec);
    let policy = cfg
        .build_with_floor(&world.candidates(), spec.feature_dim, &spec.floor(label))
        .map_err(unbuilt)?;
    Ok((world, policy))
}

/// [`run`] with hedged requests: the first attempt gets a hedge on the next candidate after
/// the delay `hedge`'s rule gives, within its hedge budget (see `equiroute_core::hedge`).
///
/// # Errors
/// The policy cannot be built for this scenario, or `hedge` is out of range.
pub fn run_hedged(
    spec: &ScenarioSpec,
    label: &str,
    seed: u64,
    rounds: usize,
    hedge: &HedgeConfig,
) -> Result<RunResult, RunError> {
    let err = |source| RunError::Policy {
        scenario: spec.name.clone(),
        policy: label.to_owned(),
        source,
    };
    hedge.validate().map_err(err)?;
    let world = World::new(spec);
    let policy = spec
        .policy(label)
        .and_then(|c| c.build(&world.candidates(), spec.feature_dim))
        .map_err(err)?;
    simulate(
        spec,
        label,
        policy,
        world,
        seed,
        rounds,
        Extras {
            hedging: Some(*hedge),
            record: None,
        },
    )
}

/// Runs a policy built by the caller (one that is not among the built-in ones, e.g. a
/// research prototype) through `spec`, exactly as [`run`] runs a named one; `label` names it
/// in the result and salts its random stream.
///
/// # Errors
/// The featurizer cannot be built for this scenario.
pub fn run_policy(
    spec: &ScenarioSpec,
    label: &str,
    policy: Box<dyn equiroute_core::policies::Policy>,
    seed: u64,
    rounds: usize,
) -> Result<RunResult, RunError> {
    simulate(
        spec,
        label,
        policy,
        World::new(spec),
        seed,
        rounds,
        Extras::default(),
    )
}

/// Runs `label` through `spec` exactly as [`run`] does, and also returns the traffic log an
/// off-policy evaluator needs (every decision's context, first choice and propensity, every
/// observation in the order the policy learnt it, every request's outcome). Propensities come
/// from the ranking when the policy reports one, else from
/// [`first_choice_distribution`](equiroute_core::policies::Policy::first_choice_distribution)
/// with `propensity_draws` draws on a separate random stream (so the run is the same as
/// [`run`]'s).
///
/// # Errors
/// The policy cannot be built for this scenario.
pub fn run_logged(
    spec: &ScenarioSpec,
    label: &str,
    seed: u64,
    rounds: usize,
    propensity_draws: u32,
) -> Result<(RunResult, TrafficLog), RunError> {
    let (world, policy) = built(spec, label, &[])?;
    let mut log = TrafficLog {
        candidates: world.candidates(),
        tokens: spec.tokens,
        rounds: Vec::with_capacity(rounds),
    };
    let result = simulate(
        spec,
        label,
        policy,
        world,
        seed,
        rounds,
        Extras {
            hedging: None,
            record: Some((&mut log.rounds, propensity_draws)),
        },
    )?;
    Ok((result, log))
}

/// Feeds one finished attempt to the policy, the breaker and the execution.
#[allow(clippy::too_many_arguments)]
fn feed(
    policy: &mut dyn Policy,
    breaker: &mut Breaker,
    breaker_cfg: &BreakerConfig,
    run: &mut Execution,
    features: &[f64],
    candidate: usize,
    started: Timestamp,
    outcome: AttemptOutcome,
) {
    let end = started.plus(outcome.latency);
    policy.observe_attempt(&AttemptObservation {
        candidate,
        features,
        slice: SlicePath::root(),
        deadline: run.remaining(started),
        outcome: &outcome,
        now: end,
    });
    // Closed by this attempt: its half-open probes succeeded; the policy forgets the
    // failures from before the recovery, as the gateway's does.
    let transitions = breaker.observe(end, &outcome, breaker_cfg);
    if transitions.contains(&Some(equiroute_core::breaker::Transition::Closed)) {
        policy.recovered(candidate, end);
    }
    run.record(candidate, outcome, started);
}

/// What a simulation does besides the plain run: hedge requests, record the traffic log
/// (with the number of draws behind an estimated propensity).
#[derive(Default)]
struct Extras<'a> {
    hedging: Option<HedgeConfig>,
    record: Option<(&'a mut Vec<LoggedRound>, u32)>,
}

/// The simulation behind [`run`] and [`run_policy`], in the world built for it.
#[allow(clippy::too_many_lines)]
fn simulate(
    spec: &ScenarioSpec,
    label: &str,
    mut policy: Box<dyn equiroute_core::policies::Policy>,
    mut world: World,
    seed: u64,
    rounds: usize,
    extras: Extras<'_>,
) -> Result<RunResult, RunError> {
    let Extras {
        hedging,
        mut record,
    } = extras;
    let err = |source| RunError::Policy {
        scenario: spec.name.clone(),
        policy: label.to_owned(),
        source,
    };
    let candidates = world.candidates();
    let k = candidates.len();
    let is_oracle = policy.kind() == equiroute_core::policies::PolicyKind::Oracle;
    let featurizer = Featurizer::new(spec.feature_dim).map_err(err)?;
    let mut query_rng = ChaCha8Rng::seed_from_u64(seed);
    let mut outcome_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut judge_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x2545_f491_4f6c_dd1d);
    let mut policy_rng = ChaCha8Rng::seed_from_u64(seed ^ salt(label));
    let limits = ExecutionLimits {
        max_attempts: spec.max_attempts,
        ..ExecutionLimits::default()
    };
    let breaker_cfg = BreakerConfig::default();
    let mut breakers = vec![Breaker::default(); k];
    let requirements = Requirements::default();
    let drift_ids: Vec<usize> = spec
        .judge
        .drift_providers
        .iter()
        .filter_map(|id| spec.providers.iter().position(|p| &p.id == id))
        .collect();

    let mut pending: VecDeque<PendingFeedback> = VecDeque::new();
    let mut now = 0.0f64;
    let (mut quality_sum, mut cost_sum, mut regret) = (0.0, 0.0, 0.0);
    let (mut misses, mut failures, mut attempts, mut failed_attempts) =
        (0usize, 0usize, 0usize, 0usize);
    let mut latencies = Vec::with_capacity(rounds);
    // (deadline, latency, missed) of every request with a deadline, for `by_deadline`.
    let mut with_deadline: Vec<(f64, f64, bool)> = Vec::new();
    let mut share = vec![0.0; k];
    let mut share_over_time = vec![vec![0.0; k]; BINS];
    // Rounds with a first choice per bin (the shares' denominator), and every round.
    let mut bin_counts = vec![0usize; BINS];
    let mut round_counts = vec![0usize; BINS];
    let mut regret_over_time = vec![0.0; BINS];
    let mut failures_over_time = vec![0.0; BINS];
    let mut values = vec![0.0; k];
    let mut predictions: Vec<(f64, bool)> = Vec::new();
    let hedging = hedging.filter(HedgeConfig::active);
    let mut budget = hedging.as_ref().map(HedgeBudget::new);
    let mut recent = vec![RecentLatencies::default(); k];
    let (mut hedges, mut hedges_won) = (0usize, 0usize);
    // Propensity draws of the traffic log, apart from the policy's own stream.
    let mut propensity_rng = ChaCha8Rng::seed_from_u64(seed ^ salt(label) ^ 0x5851_f42d_4c95_7f2d);
    let mut delivered: Vec<LoggedFeedback> = Vec::new();
    let mut firsts: Vec<Option<usize>> = Vec::with_capacity(rounds);
    let mut quality_shifts: Vec<ShiftRecord> = Vec::new();

    for round in 0..rounds {
        let concurrency = world.concurrency(round);
        now += spec.interarrival_ms / concurrency;
        let t = Timestamp(now);
        // Quality that has arrived by now reaches the policy first.
        while pending.front().is_some_and(|p| p.due_round <= round) {
            if let Some(p) = pending.pop_front() {
                if record.is_some() {
                    delivered.push(LoggedFeedback {
                        round: p.round,
                        candidate: p.candidate,
                        features: p.features.clone(),
                        quality: p.judged,
                        latency: p.latency,
                        now: t,
                    });
                }
                policy.observe_quality(&QualityObservation {
                    candidate: p.candidate,
                    features: &p.features,
                    quality: p.judged,
                    latency: p.latency,
                    now: t,
                });
            }
        }
        for s in policy.take_quality_shifts() {
            quality_shifts.push(ShiftRecord {
                round,
                provider: spec.providers[s.candidate].id.clone(),
                direction: s.direction.as_str().to_owned(),
                from: s.from,
                to: s.to,
                scores: s.scores,
            });
        }
        let query = world.query(&mut query_rng);
        let deadline = spec.draw_deadline(&mut query_rng);
        let features = featurizer.featurize(&query.text);
        let mut input = EligibilityInput::new(&candidates, &requirements);
        input.breakers = Some((&breakers, &breaker_cfg));
        input.now = t;
        let mut checked = check_eligibility(&input);
        // A provider that has not joined yet is not there at all.
        checked.eligible.retain(|&i| world.available(i, round));
        checked
            .excluded
            .retain(|e| world.available(e.candidate, round));
        // Every available provider shut out by failures: probe the one reopening soonest,
        // as the gateway does (`Eligible::last_resort`); with none, the request is refused.
        if let Some(i) = checked.last_resort(&breakers, &breaker_cfg) {
            let _ = breakers[i].last_resort();
            checked.eligible.push(i);
        }
        let eligible = checked.eligible;
        for (i, v) in values.iter_mut().enumerate() {
            *v = if world.available(i, round) {
                world.true_value(i, round, now, query.cluster, deadline)
            } else {
                0.0
            };
        }
        let in_flight: Vec<u32> = (0..k).map(|i| world.in_flight(i, round)).collect();
        let mut ctx = RankContext::new(&candidates, &eligible, &features);
        ctx.deadline = deadline;
        ctx.slice = SlicePath::root();
        ctx.tokens = spec.tokens;
        ctx.now = t;
        ctx.in_flight = Some(&in_flight);
        if is_oracle {
            ctx.oracle_values = Some(&values);
        }
        let mut ranking = policy.rank(&ctx, &mut policy_rng);
        // A provider that failed is re-tested whatever its rank, as the gateway does (the
        // oracle aside).
        let (order, retest) = if is_oracle {
            (ranking.indices().collect(), false)
        } else {
            retested_order(&mut ranking, &breakers, t, &breaker_cfg)
        };
        let Some(&first) = order.first() else {
            // Refused (no eligible provider): no answer, at once and at no cost.
            firsts.push(None);
            latencies.push(0.0);
            if let Some(d) = deadline {
                with_deadline.push((d.0, 0.0, false));
            }
            failures += 1;
            failures_over_time[round * BINS / rounds] += 1.0;
            round_counts[round * BINS / rounds] += 1;
            continue;
        };
        firsts.push(Some(first));
        let mut predicted = policy.deadline_miss_estimate(first, &ctx);
        world.note_choice(first);
        let best = eligible.iter().map(|&i| values[i]).fold(0.0, f64::max);
        regret += (best - values[first]).max(0.0);
        let bin = round * BINS / rounds;
        share[first] += 1.0;
        share_over_time[bin][first] += 1.0;
        bin_counts[bin] += 1;
        round_counts[bin] += 1;
        regret_over_time[bin] = regret;
        let mut logged = record.as_mut().map(|(_, draws)| {
            let (propensity, propensity_exact) = if retest {
                // The breaker's rule, not the policy, chose it: surely.
                (1.0, false)
            } else if let Some(p) = ranking.propensity {
                (p.probability, !p.is_deterministic())
            } else {
                let fc = policy.first_choice_distribution(&ctx, &mut propensity_rng, *draws);
                (fc.probability(first), fc.is_stochastic())
            };
            LoggedRound {
                feedback: std::mem::take(&mut delivered),
                features: features.clone(),
                eligible: eligible.clone(),
                deadline,
                now: t,
                in_flight: in_flight.clone(),
                values: values.clone(),
                action: first,
                propensity,
                propensity_exact,
                attempts: Vec::new(),
                quality: 0.0,
                missed: false,
                cost: 0.0,
            }
        });

        let price = budget.as_ref().map_or(0.0, HedgeBudget::price);
        let plan = hedging.and_then(|h| {
            let outlook = |i: usize| policy.latency_outlook(i, &ctx);
            let target = order.get(1).and_then(|&j| outlook(j));
            hedge_plan(
                h.rule,
                outlook(first).as_ref(),
                target.as_ref(),
                Some(&recent[first]),
                deadline,
                price,
            )
        });
        if let Some(b) = budget.as_mut() {
            b.earn();
        }
        let mut run = Execution::new(order, t, deadline, limits)
            .with_hedge(plan)
            .with_interchangeable(ranking.interchangeable);
        let mut clock = t;
        while let Some(next) = run.next_attempt(clock) {
            // A retry's pause passes before the attempt.
            clock = clock.plus(next.wait);
            // The breaker admits the attempt now: it moves open → half-open when the open
            // period is over and bounds the half-open probes.
            let (admission, _) = breakers[next.candidate].admit(clock, &breaker_cfg);
            if matches!(admission, Admission::Rejected { .. }) {
                run.skip();
                continue;
            }
            let outcome = world.attempt(
                next.candidate,
                round,
                clock.0,
                next.timeout,
                &mut outcome_rng,
            );
            attempts += 1;
            // The first attempt, on the first choice, with the whole deadline: scored when
            // it answered or ran out of time (a failure says nothing about its latency).
            if let Some(p) = predicted.take().filter(|_| next.candidate == first) {
                match outcome.status {
                    AttemptStatus::Ok => predictions.push((p, false)),
                    AttemptStatus::Timeout => predictions.push((p, true)),
                    _ => {}
                }
            }
            if outcome.status == AttemptStatus::Ok {
                recent[next.candidate].push(outcome.latency.0);
            } else {
                failed_attempts += 1;
            }
            // A hedge starts if the first attempt is still out when its delay is up, the
            // budget has one and the target's breaker admits it then.
            let hedge = run.hedge(&next, clock).filter(|h| {
                outcome.latency.0 > h.wait.0
                    && budget.as_ref().is_some_and(HedgeBudget::has_hedge)
                    && !matches!(
                        breakers[h.candidate]
                            .admit(clock.plus(h.wait), &breaker_cfg)
                            .0,
                        Admission::Rejected { .. }
                    )
            });
            let Some(h) = hedge else {
                let end = clock.plus(outcome.latency);
                let b = &mut breakers[next.candidate];
                feed(
                    policy.as_mut(),
                    b,
                    &breaker_cfg,
                    &mut run,
                    &features,
                    next.candidate,
                    clock,
                    outcome,
                );
                clock = end;
                continue;
            };
            if let Some(b) = budget.as_mut() {
                b.try_spend();
            }
            run.start_hedge(&h);
            let hedge_start = clock.plus(h.wait);
            let hedged = world.attempt(
                h.candidate,
                round,
                hedge_start.0,
                h.timeout,
                &mut outcome_rng,
            );
            attempts += 1;
            hedges += 1;
            if hedged.status == AttemptStatus::Ok {
                recent[h.candidate].push(hedged.latency.0);
            } else {
                failed_attempts += 1;
            }
            // The two in the order they end; the first good answer cancels the other.
            let mut pair = [
                (next.candidate, clock, outcome),
                (h.candidate, hedge_start, hedged),
            ];
            if hedge_start.0 + hedged.latency.0 < clock.0 + outcome.latency.0 {
                pair.swap(0, 1);
            }
            let [(c1, s1, o1), (c2, s2, mut o2)] = pair;
            let e1 = s1.plus(o1.latency);
            if o1.status == AttemptStatus::Ok {
                if c1 == h.candidate {
                    hedges_won += 1;
                }
                // Censored at the cancellation; billed as the provider would have billed it.
                o2.latency = Millis((e1.0 - s2.0).max(0.0));
                o2.status = AttemptStatus::Cancelled;
            }
            feed(
                policy.as_mut(),
                &mut breakers[c1],
                &breaker_cfg,
                &mut run,
                &features,
                c1,
                s1,
                o1,
            );
            let e2 = s2.plus(o2.latency);
            feed(
                policy.as_mut(),
                &mut breakers[c2],
                &breaker_cfg,
                &mut run,
                &features,
                c2,
                s2,
                o2,
            );
            if o1.status != AttemptStatus::Ok && o2.status == AttemptStatus::Ok && c2 == h.candidate
            {
                hedges_won += 1;
            }
            clock = if e2.0 > e1.0 { e2 } else { e1 };
        }
        let result = run.finish(clock);
        cost_sum += result.cost.0;
        latencies.push(result.latency.0);
        let late = deadline.is_some_and(|d| result.latency.0 > d.0);
        let missed = matches!(result.status, RequestStatus::DeadlineExceeded) || late;
        if missed {
            misses += 1;
        }
        if let Some(d) = deadline {
            with_deadline.push((d.0, result.latency.0, missed));
        }
        if let Some(l) = logged.as_mut() {
            // Every attempt, in the order the policy learnt it (as `feed` gave it).
            for a in &result.attempts {
                l.attempts.push(LoggedAttempt {
                    candidate: a.candidate,
                    deadline: deadline.map(|d| Millis((d.0 - a.started.since(t).0).max(0.0))),
                    outcome: a.outcome,
                    now: a.started.plus(a.outcome.latency),
                });
            }
            l.missed = missed;
            l.cost = result.cost.0;
        }
        if let RequestStatus::Succeeded { candidate } = result.status {
            let gold = world.gold_quality(candidate, round, query.cluster, &mut outcome_rng);
            quality_sum += gold;
            if let Some(l) = logged.as_mut() {
                l.quality = gold;
            }
            let drift = match spec.judge.drift_at_round {
                Some(at) if round >= at && drift_ids.contains(&candidate) => spec.judge.drift_bias,
                _ => 0.0,
            };
            let noise: f64 =
                rand_distr::Distribution::sample(&rand_distr::StandardNormal, &mut judge_rng);
            let judged =
                (gold + spec.judge.bias + drift + spec.judge.noise_sd * noise).clamp(0.0, 1.0);
            // The answer's attempt (a hedge's loser is recorded after it).
            let answered = result
                .attempts
                .iter()
                .rev()
                .find(|a| a.candidate == candidate && a.outcome.status == AttemptStatus::Ok)
                .map_or(Millis(0.0), |a| a.outcome.latency);
            pending.push_back(PendingFeedback {
                round,
                due_round: round + spec.judge.delay_rounds,
                candidate,
                features,
                judged,
                latency: answered,
            });
        } else {
            failures += 1;
            failures_over_time[bin] += 1.0;
        }
        if let (Some((rounds_log, _)), Some(l)) = (record.as_mut(), logged) {
            rounds_log.push(l);
        }
    }

    let n = rounds.max(1) as f64;
    for (b, counts) in share_over_time.iter_mut().enumerate() {
        let total = bin_counts[b].max(1) as f64;
        for c in counts.iter_mut() {
            *c /= total;
        }
    }
    for (f, count) in failures_over_time.iter_mut().zip(&round_counts) {
        *f /= (*count).max(1) as f64;
    }
    // Bins without rounds (tiny runs) carry the last regret forward.
    for b in 1..BINS {
        if bin_counts[b] == 0 {
            regret_over_time[b] = regret_over_time[b - 1];
        }
    }
    let mut sorted = latencies.clone();
    sorted.sort_by(f64::total_cmp);
    let quantile = |q: f64| {
        sorted
            .get(((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };
    let p95 = quantile(0.95);
    Ok(RunResult {
        policy: label.to_owned(),
        seed,
        rounds,
        quality: quality_sum / n,
        latency_mean_ms: latencies.iter().sum::<f64>() / n,
        latency_p95_ms: p95,
        latency_p50_ms: quantile(0.5),
        latency_p99_ms: quantile(0.99),
        calls_per_request: attempts as f64 / n,
        hedge_rate: hedges as f64 / n,
        hedge_win_rate: hedges_won as f64 / n,
        deadline_miss_rate: misses as f64 / n,
        request_failure_rate: failures as f64 / n,
        attempt_failure_rate: failed_attempts as f64 / attempts.max(1) as f64,
        cost_per_request: cost_sum / n,
        regret,
        share: share.iter().map(|s| s / n).collect(),
        share_over_time,
        regret_over_time,
        request_failure_rate_over_time: failures_over_time,
        calibration: Calibration::of(&mut predictions),
        recovery: recoveries(spec, &firsts, rounds),
        by_deadline: DeadlineClass::of(with_deadline),
        quality_shifts,
    })
}

#[cfg(test)]
mod tests {
    use super::DeadlineClass;

    #[test]
    fn requests_are_split_by_deadline_with_their_own_p99_and_misses() {
        // 100 requests at 800 ms taking 1..=100 ms, two of them missed; 300 at 4000 ms
        // taking 10, 20, …, 3000 ms, none missed.
        let mut reqs: Vec<(f64, f64, bool)> =
            (1..=100).map(|k| (800.0, f64::from(k), k > 98)).collect();
        reqs.extend((1..=300).map(|k| (4000.0, f64::from(k) * 10.0, false)));
        let classes = DeadlineClass::of(reqs);
        assert_eq!(classes.len(), 2);
        let (short, long) = (&classes[0], &classes[1]);
        assert_eq!(
            (short.deadline_ms, short.share, short.latency_p99_ms),
            (800.0, 0.25, 99.0)
        );
        assert!((short.deadline_miss_rate - 0.02).abs() < 1e-12);
        // p99 of 300: the 297th, 2970 ms.
        assert_eq!((long.deadline_ms, long.latency_p99_ms), (4000.0, 2970.0));
        assert!((long.share - 0.75).abs() < 1e-12 && long.deadline_miss_rate == 0.0);
        // One deadline, or more than the bound: not split.
        assert!(DeadlineClass::of(vec![(800.0, 1.0, false); 5]).is_empty());
        let many = (0..9).map(|k| (f64::from(k) * 100.0, 1.0, false)).collect();
        assert!(DeadlineClass::of(many).is_empty());
    }
}
