//! `lqm-ts`: our policy. One decision over contextual quality, latency, deadline risk and
//! cost, which neither reference makes alone.
//!
//! **Objective.** Quality first, then risk and spend:
//!
//! ```text
//! q_i = û_i/(1 + τ̂_i/L_ref) + α·sqrt(xᵀA_i⁻¹x)/(1 + λΔ_i)     (LQM-ContextRoute's score)
//! V_i = q_i · (1 − P̃(bad)_i)          expected good quality per service cycle
//! g_i = (1 − P̃(bad)_i) / (1 + cost_i/C_ref)     good outcomes per unit of spend (ts-deadline)
//! ```
//!
//! The candidates whose `V` is within `quality_tolerance` (default 5%) of the best `V` form
//! the *top group*: they are ranked by expected cost (then by `V`), so among answers that are
//! as good and as likely to arrive in time, the cheapest goes first. Everyone else follows by
//! `V`, and candidates held back by the exploration guard come last. `P̃(bad)` is a Thompson draw from
//! the failure EWMA and the sliced log-latency posterior for *this request's* deadline
//! (exploration of risk); `q` carries LinUCB's optimism (exploration of quality).
//!
//! Neither speed nor cheapness can compensate for poor answers: speed only enters through the
//! renewal-reward discount of `q`, and cost only orders candidates whose expected good quality
//! is already within the tolerance of the best. A free, instant, never-failing candidate with
//! useless answers has `V ≈ 0` and is never in the top group while a useful one exists.
//!
//! **Degenerate cases** (tested):
//! - no deadline, equal costs, no failures: `P̃(bad) = 0` and `g` is the same for everyone,
//!   so the ranking is exactly LQM-ContextRoute's;
//! - no quality feedback yet: the ranking is exactly `ts-deadline`'s with the `cost-per-good`
//!   objective, from the same random draws (quality cannot order what it has not seen).
//!
//! Failures are learnt by the risk model only (not as quality 0, which would count them twice).

use super::lqm::{LatencyTerm, LqmConfig, LqmState};
use super::risk::{CostObjective, RiskConfig, RiskModel, RiskState};
use super::ts_deadline::sample_scores;
use super::{
    wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, QualityObservation,
    RankContext, Ranking,
};
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Parameters of `lqm-ts`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LqmTsConfig {
    /// The quality part (its `failure_quality` is ignored: failures go to the risk model).
    pub lqm: LqmConfig,
    /// The risk part.
    pub risk: RiskConfig,
    /// `C_ref` in USD; unset means the mean expected cost of the eligible candidates.
    pub cost_ref_usd: Option<f64>,
    /// Relative width of the top group: candidates with `V ≥ (1 − tolerance)·V_best`.
    pub quality_tolerance: f64,
    /// How expected latency discounts quality in `q`.
    pub latency: LatencyTerm,
}

impl Default for LqmTsConfig {
    fn default() -> Self {
        LqmTsConfig {
            lqm: LqmConfig {
                failure_quality: None,
                ..LqmConfig::default()
            },
            risk: RiskConfig::default(),
            cost_ref_usd: None,
            quality_tolerance: 0.05,
            latency: LatencyTerm::Renewal,
        }
    }
}

impl LqmTsConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        self.lqm.validate()?;
        self.risk.validate()?;
        crate::error::unit_interval("quality_tolerance", self.quality_tolerance)?;
        self.objective().validate()
    }

    fn objective(&self) -> CostObjective {
        CostObjective::CostPerGood {
            cost_ref_usd: self.cost_ref_usd,
        }
    }
}

/// Learning state of `lqm-ts`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LqmTsState {
    pub quality: LqmState,
    pub risk: RiskState,
}

/// LQM-ContextRoute × deadline-risk Thompson sampling × cost.
#[derive(Clone, Debug)]
pub struct LqmTs {
    cfg: LqmTsConfig,
    quality: LqmState,
    risk: RiskModel,
}

impl LqmTs {
    /// A policy over `k` candidates with `dim` features.
    #[must_use]
    pub fn new(k: usize, dim: usize, cfg: LqmTsConfig) -> LqmTs {
        LqmTs {
            quality: LqmState::new(k, dim, &cfg.lqm),
            risk: RiskModel::new(k, cfg.risk),
            cfg,
        }
    }
}

impl Policy for LqmTs {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LqmTs
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let quality = self.quality.score(&self.cfg.lqm, ctx, self.cfg.latency);
        let mut order = sample_scores(&self.risk, self.cfg.objective(), ctx, rng);
        let learnt = ctx
            .eligible
            .iter()
            .any(|&i| self.quality.heads.heads[i].count() > 0);
        // Both lists follow ctx.eligible, so they pair up index by index.
        // (tier, V, g, cost, position)
        let mut keyed: Vec<(u8, f64, f64, f64, usize)> = Vec::with_capacity(order.len());
        for (pos, (risk, q)) in order.iter_mut().zip(&quality).enumerate() {
            let g = risk.score;
            let good = 1.0 - risk.breakdown.bad_probability.unwrap_or(0.0);
            let v = q.score * good;
            risk.breakdown.quality = q.breakdown.quality;
            risk.breakdown.exploration = q.breakdown.exploration;
            risk.breakdown.latency_ms = q.breakdown.latency_ms;
            risk.score = if learnt { v } else { g };
            keyed.push((0, v, g, risk.breakdown.cost_usd.unwrap_or(0.0), pos));
        }
        let best = keyed
            .iter()
            .filter(|k| !order[k.4].breakdown.guarded)
            .map(|k| k.1)
            .fold(f64::NEG_INFINITY, f64::max);
        let bar = best - self.cfg.quality_tolerance * best.abs();
        for k in &mut keyed {
            let top = !learnt || k.1 >= bar;
            k.0 = if order[k.4].breakdown.guarded {
                2
            } else {
                u8::from(!top)
            };
        }
        // Tier (top group, rest, guarded). Before any quality feedback everyone is in the top
        // group ordered by g, exactly as ts-deadline; after, the top group goes by cost then V
        // and the rest by V. Guarded candidates carry ts-deadline's negative g.
        keyed.sort_by(|a, b| {
            a.0.cmp(&b.0).then_with(|| match a.0 {
                0 if learnt => a.3.total_cmp(&b.3).then(b.1.total_cmp(&a.1)),
                1 => b.1.total_cmp(&a.1),
                _ => b.2.total_cmp(&a.2).then(b.1.total_cmp(&a.1)),
            })
        });
        let mut ranking = Ranking {
            order: keyed.iter().map(|k| order[k.4]).collect(),
            first_choice_probability: None,
        };
        if learnt {
            super::heads::warmup_first(&mut ranking, &self.quality.heads, self.cfg.lqm.head.warmup);
        }
        ranking
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.quality.heads.note_try(obs);
        self.quality.observe_latency(&self.cfg.lqm, obs);
        self.risk.observe(obs);
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        self.quality.heads.heads[obs.candidate].update(obs.features, obs.quality, obs.now);
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::LqmTs(LqmTsState {
            quality: self.quality.clone(),
            risk: self.risk.export(),
        })
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::LqmTs(s) => {
                self.quality.merge(&s.quality)?;
                self.risk.merge(&s.risk)
            }
            _ => Err(wrong_policy(PolicyKind::LqmTs, other)),
        }
    }
}
