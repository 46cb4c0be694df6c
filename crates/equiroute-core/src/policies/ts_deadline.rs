//! Deadline-risk Thompson sampling (failure × latency tail × cost), as DESIGN.md restates
//! the reference.
//!
//! For each eligible candidate: the EWMA failure rate `P(fail)`; one draw
//! `σ² ~ InvGamma(αn, βn)`, `μ ~ N(μn, σ²/κn)` from its log-latency posterior in the request's
//! slice; `P(L>d) = 1 − Φ((ln d − μ)/σ)`; `P(bad) = P(fail) + (1−P(fail))·P(L>d)`. Then the
//! configured [`CostObjective`] orders them (default: good outcomes per unit of spend,
//! `(1 − P(bad)) / (1 + cost/C_ref)`). Candidates whose point-estimate `P(bad)` exceeds the
//! exploration guard are not sampled and go last.
//!
//! The candidates are taken as equivalent (quality does not enter): the ranking says every
//! candidate before the guarded ones is as good as the first
//! ([`Ranking::interchangeable`]), so a `Retry-After` on the first falls over to the next
//! rather than being waited out.

use super::risk::{cost_factor, cost_reference, CostObjective, RiskConfig, RiskModel};
use super::{
    wrong_policy, AttemptObservation, FirstChoice, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Parameters of `ts-deadline`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TsDeadlineConfig {
    /// Failure and latency statistics.
    pub risk: RiskConfig,
    pub objective: CostObjective,
    /// Extra draws used to estimate the propensity of the first choice (0: not estimated).
    pub propensity_samples: u32,
}

impl TsDeadlineConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        self.risk.validate()?;
        self.objective.validate()?;
        check_propensity_samples(self.propensity_samples)
    }
}

/// The propensity draws of the Thompson-sampled policies are bounded: each costs a ranking.
pub(crate) fn check_propensity_samples(samples: u32) -> Result<(), crate::ConfigError> {
    if samples > 10_000 {
        return Err(crate::error::out_of_range(
            "propensity_samples",
            samples,
            "must be at most 10000 (each costs one extra ranking)",
        ));
    }
    Ok(())
}

/// Deadline-risk Thompson sampling.
#[derive(Clone, Debug)]
pub struct TsDeadline {
    cfg: TsDeadlineConfig,
    risk: RiskModel,
}

impl TsDeadline {
    /// A policy over `k` candidates.
    #[must_use]
    pub fn new(k: usize, cfg: TsDeadlineConfig) -> TsDeadline {
        TsDeadline {
            risk: RiskModel::new(k, cfg.risk),
            cfg,
        }
    }

    /// The risk model (for the state endpoint and tests).
    #[must_use]
    pub fn risk(&self) -> &RiskModel {
        &self.risk
    }
}

/// One draw of the ts-deadline scores for every eligible candidate, unsorted. Shared with
/// `lqm-ts`, which must draw exactly the same numbers in the same order.
pub(crate) fn sample_scores(
    risk: &RiskModel,
    objective: CostObjective,
    ctx: &RankContext<'_>,
    rng: &mut dyn RngCore,
) -> Vec<ScoredCandidate> {
    let cost_ref = match objective {
        CostObjective::CostPerGood { cost_ref_usd } => cost_reference(cost_ref_usd, ctx),
        _ => cost_reference(None, ctx),
    };
    ctx.eligible
        .iter()
        .map(|&i| {
            let r = risk.sample(i, ctx, rng);
            let cost = ctx.expected_cost(i);
            let good = 1.0 - r.bad;
            let score = if r.guarded {
                -1.0 - r.bad
            } else {
                match objective {
                    CostObjective::CostPerGood { .. } => good * cost_factor(cost, cost_ref),
                    CostObjective::RiskBudget { max_bad } if r.bad <= max_bad => {
                        1.0 + cost_factor(cost, cost_ref)
                    }
                    CostObjective::RiskBudget { .. } | CostObjective::MinRisk => good,
                }
            };
            ScoredCandidate {
                index: i,
                score,
                breakdown: ScoreBreakdown {
                    latency_ms: Some(r.median_ms),
                    latency_unseen: r.latency_unseen,
                    failure_probability: Some(r.failure),
                    deadline_miss_probability: ctx.deadline.map(|_| r.exceedance),
                    bad_probability: Some(r.bad),
                    cost_usd: Some(cost),
                    guarded: r.guarded,
                    ..ScoreBreakdown::default()
                },
            }
        })
        .collect()
}

/// Index of the best-scoring candidate (first in eligibility order on ties).
pub(crate) fn best_index(scores: &[ScoredCandidate]) -> Option<usize> {
    scores
        .iter()
        .fold(None::<&ScoredCandidate>, |best, s| match best {
            Some(b) if b.score >= s.score => Some(b),
            _ => Some(s),
        })
        .map(|s| s.index)
}

impl Policy for TsDeadline {
    fn kind(&self) -> PolicyKind {
        PolicyKind::TsDeadline
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: sample_scores(&self.risk, self.cfg.objective, ctx, rng),
            propensity: None,
            ..Ranking::default()
        };
        r.sort();
        // Quality is not this policy's to judge: it takes its candidates as equivalent, so
        // every one not held back by the exploration guard is as good as the first.
        r.interchangeable = r.order.iter().take_while(|c| !c.breakdown.guarded).count();
        if self.cfg.propensity_samples > 0 {
            if let Some(first) = r.order.first().map(|s| s.index) {
                let hits = (0..self.cfg.propensity_samples)
                    .filter(|_| {
                        best_index(&sample_scores(&self.risk, self.cfg.objective, ctx, rng))
                            == Some(first)
                    })
                    .count();
                r.propensity = Some(Propensity::estimated(hits, self.cfg.propensity_samples));
            }
        }
        r
    }

    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
        draws: u32,
    ) -> FirstChoice {
        FirstChoice::from_draws(ctx, draws, || {
            best_index(&sample_scores(&self.risk, self.cfg.objective, ctx, rng))
        })
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.risk.observe(obs);
    }

    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {
        // The reference design routes on failure, latency and cost only.
    }

    fn recovered(&mut self, candidate: usize, now: crate::Timestamp) {
        self.risk.forget_failures(candidate, now);
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::TsDeadline(self.risk.export())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::TsDeadline(s) => self.risk.merge(s),
            _ => Err(wrong_policy(PolicyKind::TsDeadline, other)),
        }
    }

    fn deadline_miss_estimate(&self, candidate: usize, ctx: &RankContext<'_>) -> Option<f64> {
        ctx.deadline.map(|_| self.risk.point(candidate, ctx).1)
    }

    fn latency_outlook(
        &self,
        candidate: usize,
        ctx: &RankContext<'_>,
    ) -> Option<crate::hedge::LatencyOutlook> {
        Some(self.risk.outlook(candidate, ctx))
    }

    fn take_slice_evictions(&mut self) -> u64 {
        self.risk.take_evictions()
    }
}
