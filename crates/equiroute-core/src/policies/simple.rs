//! Baselines with simple rules: `round-robin`, `random`, `static`, `least-latency`,
//! `least-busy`, `cheapest` and the laboratory's `oracle`.

use super::{
    check_len, wrong_policy, AttemptObservation, FirstChoice, Policy, PolicyKind, PolicyState,
    Propensity, PropensityKind, QualityObservation, RankContext, Ranking, ScoreBreakdown,
    ScoredCandidate,
};
use crate::decision::AttemptStatus;
use crate::estimators::ewma::{FailureRate, FailureRateConfig, LatencyEma};
use crate::StateError;
use rand::seq::SliceRandom;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Scores an already ordered list `k, k−1, …` so that sorting keeps the order.
fn in_order(indices: impl IntoIterator<Item = usize>, k: usize) -> Vec<ScoredCandidate> {
    indices
        .into_iter()
        .enumerate()
        .map(|(pos, index)| ScoredCandidate {
            index,
            score: (k - pos) as f64,
            breakdown: ScoreBreakdown::default(),
        })
        .collect()
}

fn stateless(me: PolicyKind, other: &PolicyState) -> Result<(), StateError> {
    match other {
        PolicyState::Stateless { kind } if *kind == me => Ok(()),
        _ => Err(wrong_policy(me, other)),
    }
}

/// Rotates through the eligible candidates, one step per request.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Clone for RoundRobin {
    fn clone(&self) -> Self {
        RoundRobin {
            next: AtomicUsize::new(self.next.load(Ordering::Relaxed)),
        }
    }
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let n = ctx.eligible.len();
        // Relaxed: the counter only spreads load, no other memory depends on it.
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        Ranking {
            order: in_order((0..n).map(|p| ctx.eligible[(start + p) % n.max(1)]), n),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        }
    }
    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        _rng: &mut dyn RngCore,
        _draws: u32,
    ) -> FirstChoice {
        // The candidate the next rank would put first, without advancing the rotation.
        let n = ctx.eligible.len();
        let mut probabilities = vec![0.0; ctx.candidates.len()];
        if n > 0 {
            probabilities[ctx.eligible[self.next.load(Ordering::Relaxed) % n]] = 1.0;
        }
        FirstChoice {
            probabilities,
            kind: PropensityKind::Deterministic,
        }
    }
    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::RoundRobin,
        }
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        stateless(PolicyKind::RoundRobin, other)
    }
}

/// A uniformly random order.
#[derive(Clone, Debug, Default)]
pub struct RandomOrder;

impl Policy for RandomOrder {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }
    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let mut idx = ctx.eligible.to_vec();
        idx.shuffle(rng);
        let n = idx.len();
        Ranking {
            order: in_order(idx, n),
            propensity: (n > 0).then(|| Propensity::exact(1.0 / n as f64)),
            ..Ranking::default()
        }
    }
    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        _rng: &mut dyn RngCore,
        _draws: u32,
    ) -> FirstChoice {
        FirstChoice::uniform(ctx, ctx.eligible)
    }
    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::Random,
        }
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        stateless(PolicyKind::Random, other)
    }
}

/// Parameters of `static`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StaticConfig {
    /// The candidate id that always goes first (default: the first configured).
    pub candidate: Option<String>,
}

/// One fixed candidate first, then the others in configuration order.
#[derive(Clone, Debug)]
pub struct Static {
    preferred: usize,
}

impl Static {
    /// Always prefers candidate `preferred`.
    #[must_use]
    pub fn new(preferred: usize) -> Static {
        Static { preferred }
    }
}

impl Policy for Static {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Static
    }
    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let first = ctx
            .eligible
            .iter()
            .copied()
            .filter(|&i| i == self.preferred);
        let rest = ctx
            .eligible
            .iter()
            .copied()
            .filter(|&i| i != self.preferred);
        Ranking {
            order: in_order(first.chain(rest), ctx.eligible.len()),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        }
    }
    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::Static,
        }
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        stateless(PolicyKind::Static, other)
    }
}

/// Parameters of `least-latency`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeastLatencyConfig {
    /// EMA weight of the newest latency.
    pub ema_beta: f64,
}

impl Default for LeastLatencyConfig {
    fn default() -> Self {
        LeastLatencyConfig { ema_beta: 0.2 }
    }
}

/// Latency EMAs per candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmaState {
    pub latency: Vec<LatencyEma>,
}

/// Lowest latency EMA first; candidates never measured first of all (to measure them).
#[derive(Clone, Debug)]
pub struct LeastLatency {
    cfg: LeastLatencyConfig,
    state: EmaState,
}

impl LeastLatency {
    /// A policy over `k` candidates.
    #[must_use]
    pub fn new(k: usize, cfg: LeastLatencyConfig) -> LeastLatency {
        LeastLatency {
            cfg,
            state: EmaState {
                latency: vec![LatencyEma::new(0.0); k],
            },
        }
    }
}

impl Policy for LeastLatency {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLatency
    }
    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| {
                    let e = self.state.latency[i];
                    ScoredCandidate {
                        index: i,
                        score: if e.count == 0 { 1.0 } else { -e.value_ms },
                        breakdown: ScoreBreakdown {
                            latency_ms: (e.count > 0).then_some(e.value_ms),
                            ..ScoreBreakdown::default()
                        },
                    }
                })
                .collect(),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        r.sort();
        r
    }
    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        if obs.outcome.status != AttemptStatus::ClientError {
            let e = &mut self.state.latency[obs.candidate];
            if e.count == 0 {
                // Start from the first measurement rather than from zero.
                e.value_ms = obs.outcome.latency.0;
            }
            e.update(obs.outcome.latency.0, self.cfg.ema_beta);
        }
    }
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::LeastLatency(self.state.clone())
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        let PolicyState::LeastLatency(o) = other else {
            return Err(wrong_policy(PolicyKind::LeastLatency, other));
        };
        check_len("candidates", self.state.latency.len(), o.latency.len())?;
        for (l, r) in self.state.latency.iter_mut().zip(&o.latency) {
            l.merge(r);
        }
        Ok(())
    }
}

/// Fewest in-flight attempts first (counts passed in by the caller), random among ties.
#[derive(Clone, Debug, Default)]
pub struct LeastBusy;

impl Policy for LeastBusy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastBusy
    }
    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let mut idx = ctx.eligible.to_vec();
        idx.shuffle(rng);
        let busy = |i: usize| ctx.in_flight.and_then(|f| f.get(i)).copied().unwrap_or(0);
        idx.sort_by_key(|&i| busy(i));
        // The first is uniform among those tied for least busy.
        let ties = idx
            .first()
            .map_or(0, |&f| idx.iter().filter(|&&i| busy(i) == busy(f)).count());
        Ranking {
            order: idx
                .into_iter()
                .map(|i| ScoredCandidate {
                    index: i,
                    score: -f64::from(busy(i)),
                    breakdown: ScoreBreakdown::default(),
                })
                .collect(),
            propensity: (ties > 0).then(|| Propensity::exact(1.0 / ties as f64)),
            ..Ranking::default()
        }
    }
    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        _rng: &mut dyn RngCore,
        _draws: u32,
    ) -> FirstChoice {
        // Uniform among the least busy (ties are shuffled).
        let busy = |i: usize| ctx.in_flight.and_then(|f| f.get(i)).copied().unwrap_or(0);
        let least = ctx.eligible.iter().map(|&i| busy(i)).min().unwrap_or(0);
        let idle: Vec<usize> = ctx
            .eligible
            .iter()
            .copied()
            .filter(|&i| busy(i) == least)
            .collect();
        FirstChoice::uniform(ctx, &idle)
    }
    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::LeastBusy,
        }
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        stateless(PolicyKind::LeastBusy, other)
    }
}

/// Parameters of `cheapest`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheapestConfig {
    /// A candidate whose failure rate exceeds this is unhealthy and goes last.
    pub max_failure_rate: f64,
    pub failure: FailureRateConfig,
}

impl Default for CheapestConfig {
    fn default() -> Self {
        CheapestConfig {
            max_failure_rate: 0.3,
            failure: FailureRateConfig::default(),
        }
    }
}

/// Failure rates per candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HealthState {
    pub failures: Vec<FailureRate>,
}

/// The cheapest healthy candidate first; unhealthy ones last, healthiest first.
#[derive(Clone, Debug)]
pub struct Cheapest {
    cfg: CheapestConfig,
    state: HealthState,
}

impl Cheapest {
    /// A policy over `k` candidates.
    #[must_use]
    pub fn new(k: usize, cfg: CheapestConfig) -> Cheapest {
        Cheapest {
            cfg,
            state: HealthState {
                failures: vec![FailureRate::default(); k],
            },
        }
    }
}

impl Policy for Cheapest {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Cheapest
    }
    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| {
                    let rate = self.state.failures[i].rate(ctx.now, &self.cfg.failure);
                    let cost = ctx.expected_cost(i);
                    let unhealthy = rate > self.cfg.max_failure_rate;
                    ScoredCandidate {
                        index: i,
                        score: if unhealthy { -1e9 - rate } else { -cost },
                        breakdown: ScoreBreakdown {
                            failure_probability: Some(rate),
                            cost_usd: Some(cost),
                            guarded: unhealthy,
                            ..ScoreBreakdown::default()
                        },
                    }
                })
                .collect(),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        r.sort();
        r
    }
    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        let s = obs.outcome.status;
        if matches!(
            s,
            AttemptStatus::Ok | AttemptStatus::ProviderError(_) | AttemptStatus::Timeout
        ) {
            self.state.failures[obs.candidate].record(
                obs.now,
                s.is_provider_failure(),
                &self.cfg.failure,
            );
        }
    }
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Cheapest(self.state.clone())
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        let PolicyState::Cheapest(o) = other else {
            return Err(wrong_policy(PolicyKind::Cheapest, other));
        };
        check_len("candidates", self.state.failures.len(), o.failures.len())?;
        for (f, g) in self.state.failures.iter_mut().zip(&o.failures) {
            f.merge(g, &self.cfg.failure);
        }
        Ok(())
    }
}

/// Ranks by the true expected value of each candidate for this request, which only the
/// laboratory knows ([`RankContext::oracle_values`]), the cheaper first among equal values.
/// Without values it ranks by price with score 0.
#[derive(Clone, Debug, Default)]
pub struct Oracle;

impl Policy for Oracle {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Oracle
    }
    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| {
                    let v = ctx
                        .oracle_values
                        .and_then(|v| v.get(i))
                        .copied()
                        .filter(|v| v.is_finite())
                        .unwrap_or(0.0);
                    ScoredCandidate {
                        index: i,
                        score: v,
                        breakdown: ScoreBreakdown {
                            quality: Some(v),
                            cost_usd: Some(ctx.expected_cost(i)),
                            ..ScoreBreakdown::default()
                        },
                    }
                })
                .collect(),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        // Equal values: the cheaper first (a capacity-limited cheap provider whenever it has
        // capacity), then configuration order.
        let cost = |c: &ScoredCandidate| c.breakdown.cost_usd.unwrap_or(0.0);
        r.order.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then(cost(a).total_cmp(&cost(b)))
        });
        r
    }
    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}
    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}
    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::Oracle,
        }
    }
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        stateless(PolicyKind::Oracle, other)
    }
}
