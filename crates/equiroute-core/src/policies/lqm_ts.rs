//! `lqm-ts`: our policy. One decision over contextual quality, latency, deadline risk and
//! cost, which neither reference makes alone.
//!
//! **Objective.** Expected *good* quality per service cycle per unit of spend:
//!
//! ```text
//! V_i = q_i · g_i
//! q_i = û_i/(1 + τ̂_i/L_ref) + α·sqrt(xᵀA_i⁻¹x)/(1 + λΔ_i)     (LQM-ContextRoute's score)
//! g_i = (1 − P̃(bad)_i) / (1 + cost_i/C_ref)                    (ts-deadline's default objective)
//! ```
//!
//! `P̃(bad)` is a Thompson draw from the failure EWMA and the sliced log-latency posterior for
//! this request's deadline (exploration of risk); `q` carries LinUCB's optimism (exploration of
//! quality). Because the combination is a product and `g ≤ 1`, neither speed nor cheapness
//! can compensate for useless answers: `û → 0` sends the score to its exploration bonus, which
//! the dominance shrink `1/(1+λΔ)` keeps small once a better candidate is known. A free,
//! instant, never-failing candidate scores at most its own `q`. (For a negative `q`, possible
//! with ridge regression, the key is `q/g` so a worse `g` still ranks lower.)
//!
//! **Degenerate cases** (tested):
//! - no deadline, equal costs, no failures: `g` is the same for every candidate, so the
//!   ranking is exactly LQM-ContextRoute's;
//! - no quality feedback yet: `q` is the same for every candidate (û = 0, equal widths), so
//!   the ranking is exactly `ts-deadline`'s with the `cost-per-good` objective, from the same
//!   random draws.
//!
//! Failures are learnt by the risk model only (not as quality 0, which would count them twice).

use super::lqm::{LqmConfig, LqmState};
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
        }
    }
}

impl LqmTsConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        self.lqm.validate()?;
        self.risk.validate()?;
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

/// The sort key of `V = q·g`, monotone in `q` for a fixed `g` and in `g` for a fixed `q`.
fn value(q: f64, g: f64) -> f64 {
    let g = g.max(1e-9);
    if q >= 0.0 {
        q * g
    } else {
        q / g
    }
}

impl Policy for LqmTs {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LqmTs
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let quality = self.quality.score(&self.cfg.lqm, ctx);
        let mut order = sample_scores(&self.risk, self.cfg.objective(), ctx, rng);
        // Both lists follow ctx.eligible, so they pair up index by index.
        let mut keyed: Vec<(f64, f64, usize)> = Vec::with_capacity(order.len());
        for (pos, (risk, q)) in order.iter_mut().zip(&quality).enumerate() {
            let g = risk.score;
            let v = if risk.breakdown.guarded {
                // Below every unguarded candidate, whatever its q; the safest guarded first.
                -1e9 - risk.breakdown.bad_probability.unwrap_or(1.0)
            } else {
                value(q.score, g)
            };
            risk.breakdown.quality = q.breakdown.quality;
            risk.breakdown.exploration = q.breakdown.exploration;
            risk.breakdown.latency_ms = q.breakdown.latency_ms;
            risk.score = v;
            keyed.push((v, g, pos));
        }
        // Best V first; on a tie (e.g. identical q) the better risk/cost value g decides.
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.total_cmp(&a.1)));
        Ranking {
            order: keyed.iter().map(|&(_, _, pos)| order[pos]).collect(),
            first_choice_probability: None,
        }
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
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
