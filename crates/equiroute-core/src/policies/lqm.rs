//! LQM-ContextRoute (latency–quality matching), exactly as DESIGN.md restates it.
//!
//! Per candidate: a LinUCB quality head and a latency EMA `τ̂`. For a query `x`:
//!
//! ```text
//! û_i = xᵀA_i⁻¹b_i                     c_i = α_ucb·sqrt(xᵀA_i⁻¹x)
//! Δ_i = max(0, max_j û_j − û_i)        s_i = û_i/(1 + τ̂_i/L_ref) + c_i/(1 + λ·Δ_i)
//! ```
//!
//! The first term is the renewal-reward rate: a call costs one unit plus `τ/L_ref` units of
//! service time, so a useless answer (û ≈ 0) scores ≈ 0 however fast it comes. The shrink
//! `1/(1+λΔ)` never penalises slowness; it only stops exploring arms the context model already
//! believes are worse. Only the chosen candidate is updated (bandit feedback).
//!
//! Defaults (the paper does not publish them): `α_ucb = 0.5`, `λr = 1`, `W = 2000`,
//! `β = 0.1`, `τ₀ = L_ref`, `λ = 1`, `L_ref = 1000 ms`. A failed or timed-out attempt teaches
//! quality 0 for its context (`failure_quality`), since it produced no answer.

use super::heads::{failure_lesson, HeadsState};
use super::{
    check_len, wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::estimators::ewma::LatencyEma;
use crate::estimators::linucb::LinUcbConfig;
use crate::{AttemptStatus, StateError};
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Parameters of LQM-ContextRoute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LqmConfig {
    /// Exploration scale α_ucb.
    pub alpha_ucb: f64,
    /// Shrink λ of the exploration bonus for dominated arms.
    pub shrink_lambda: f64,
    /// Latency budget L_ref in ms (set it to the SLA).
    pub l_ref_ms: f64,
    /// EMA weight β of the newest latency.
    pub ema_beta: f64,
    /// Initial latency estimate τ₀ in ms; `None` means `L_ref`.
    pub tau0_ms: Option<f64>,
    /// The quality heads.
    pub head: LinUcbConfig,
    /// Quality taught by a failed or timed-out attempt (`None`: nothing).
    pub failure_quality: Option<f64>,
}

impl Default for LqmConfig {
    fn default() -> Self {
        LqmConfig {
            alpha_ucb: 0.5,
            shrink_lambda: 1.0,
            l_ref_ms: 1000.0,
            ema_beta: 0.1,
            tau0_ms: None,
            head: LinUcbConfig::default(),
            failure_quality: Some(0.0),
        }
    }
}

impl LqmConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        use crate::error::{non_negative, positive, unit_interval};
        non_negative("alpha_ucb", self.alpha_ucb)?;
        non_negative("shrink_lambda", self.shrink_lambda)?;
        positive("l_ref_ms", self.l_ref_ms)?;
        if !(self.ema_beta > 0.0 && self.ema_beta <= 1.0) {
            return Err(crate::error::out_of_range(
                "ema_beta",
                self.ema_beta,
                "must be in (0, 1] (default 0.1)",
            ));
        }
        if let Some(t) = self.tau0_ms {
            non_negative("tau0_ms", t)?;
        }
        if let Some(q) = self.failure_quality {
            unit_interval("failure_quality", q)?;
        }
        self.head.validate()
    }

    fn tau0(&self) -> f64 {
        self.tau0_ms.unwrap_or(self.l_ref_ms)
    }
}

/// How expected latency `τ̂` discounts quality `û` (`lqm` always uses `Renewal`; `lqm-ts` lets you choose).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LatencyTerm {
    /// `û/(1 + τ̂/L_ref)`: LQM-ContextRoute's renewal-reward rate, every millisecond costs.
    /// Under load this steers traffic away from providers whose queues grow.
    #[default]
    Renewal,
    /// `û/(1 + max(0, τ̂ − L_ref)/L_ref)`: the latency budget is spent freely, only the
    /// excess costs — quality first within the budget (`argmax E[u]` s.t. `E[τ] ≤ L_ref`),
    /// the deadline's risk left to `P̃(bad)`. Better where providers are not load-bound
    /// (see docs/policies.md, the laboratory table); worse where queueing inflates latency faster
    /// than the risk model's half-life follows.
    OverBudget,
}

/// Learning state of LQM-ContextRoute.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LqmState {
    pub heads: HeadsState,
    pub latency: Vec<LatencyEma>,
}

impl LqmState {
    pub(crate) fn new(k: usize, dim: usize, cfg: &LqmConfig) -> LqmState {
        LqmState {
            heads: HeadsState::new(k, dim, cfg.head),
            latency: vec![LatencyEma::new(cfg.tau0()); k],
        }
    }

    /// The LQM scores of every eligible candidate, unsorted.
    pub(crate) fn score(
        &self,
        cfg: &LqmConfig,
        ctx: &RankContext<'_>,
        latency: LatencyTerm,
    ) -> Vec<ScoredCandidate> {
        self.score_faded(cfg, ctx, latency, |_| 1.0)
    }

    /// [`Self::score`] with candidate `i`'s latency estimate faded toward `τ₀` by
    /// `fresh(i)` ([`LatencyEma::faded_ms`]): 1 keeps it, 0 is the prior.
    pub(crate) fn score_faded(
        &self,
        cfg: &LqmConfig,
        ctx: &RankContext<'_>,
        latency: LatencyTerm,
        fresh: impl Fn(usize) -> f64,
    ) -> Vec<ScoredCandidate> {
        let estimates = self.heads.estimates(ctx.eligible, ctx.features);
        let mut out: Vec<ScoredCandidate> = ctx
            .eligible
            .iter()
            .zip(estimates)
            .map(|(&i, (u, w))| ScoredCandidate {
                index: i,
                score: 0.0,
                breakdown: ScoreBreakdown {
                    quality: Some(u),
                    exploration: Some(cfg.alpha_ucb * w),
                    latency_ms: Some(self.latency[i].faded_ms(cfg.tau0(), fresh(i))),
                    latency_unseen: self.latency[i].count == 0,
                    ..ScoreBreakdown::default()
                },
            })
            .collect();
        let best = out
            .iter()
            .filter_map(|s| s.breakdown.quality)
            .fold(f64::NEG_INFINITY, f64::max);
        for s in &mut out {
            let u = s.breakdown.quality.unwrap_or(0.0);
            let c = s.breakdown.exploration.unwrap_or(0.0);
            let tau = s.breakdown.latency_ms.unwrap_or(0.0);
            let delta = (best - u).max(0.0);
            let bonus = c / (1.0 + cfg.shrink_lambda * delta);
            s.breakdown.exploration = Some(bonus);
            let spent = match latency {
                LatencyTerm::Renewal => tau,
                LatencyTerm::OverBudget => (tau - cfg.l_ref_ms).max(0.0),
            };
            s.score = u / (1.0 + spent / cfg.l_ref_ms) + bonus;
        }
        out
    }

    /// Latency: answers and timeouts feed the EMA (a timeout's cut-off latency is a lower
    /// bound, still the service time the call consumed). Provider errors do not: a fast
    /// connection refusal is no evidence of fast service.
    pub(crate) fn observe_latency(&mut self, cfg: &LqmConfig, obs: &AttemptObservation<'_>) {
        self.observe_latency_faded(cfg, obs, 1.0);
    }

    /// [`Self::observe_latency`] for an estimate whose evidence counts `fresh` at the time of
    /// the attempt. Below one half (the belief is older than one stale half-life) the latency
    /// is folded into the faded value the ranking used ([`LatencyEma::faded_ms`]), not into
    /// the stale one, so a provider back from a spike needs a few answers, not dozens, to
    /// shed it; a younger estimate is updated as it is, so a provider in regular use keeps an
    /// EMA of its own latencies with no pull toward `τ₀`.
    pub(crate) fn observe_latency_faded(
        &mut self,
        cfg: &LqmConfig,
        obs: &AttemptObservation<'_>,
        fresh: f64,
    ) {
        if matches!(
            obs.outcome.status,
            AttemptStatus::Ok | AttemptStatus::Timeout
        ) {
            let ema = &mut self.latency[obs.candidate];
            if fresh < 0.5 {
                ema.value_ms = ema.faded_ms(cfg.tau0(), fresh);
            }
            ema.update(obs.outcome.latency.0, cfg.ema_beta);
        }
    }

    pub(crate) fn merge(&mut self, other: &LqmState) -> Result<(), StateError> {
        check_len("candidates", self.latency.len(), other.latency.len())?;
        self.heads.merge(&other.heads)?;
        for (l, o) in self.latency.iter_mut().zip(&other.latency) {
            l.merge(o);
        }
        Ok(())
    }
}

/// LQM-ContextRoute.
#[derive(Clone, Debug)]
pub struct Lqm {
    cfg: LqmConfig,
    state: LqmState,
}

impl Lqm {
    /// A policy over `k` candidates with `dim` features.
    #[must_use]
    pub fn new(k: usize, dim: usize, cfg: LqmConfig) -> Lqm {
        Lqm {
            state: LqmState::new(k, dim, &cfg),
            cfg,
        }
    }
}

impl Policy for Lqm {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lqm
    }

    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: self.state.score(&self.cfg, ctx, LatencyTerm::Renewal),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        r.sort();
        super::heads::warmup_first(&mut r, &self.state.heads, &self.cfg.head);
        r
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.state.heads.note_try(obs);
        self.state.observe_latency(&self.cfg, obs);
        if let Some(u) = failure_lesson(obs, self.cfg.failure_quality) {
            self.state
                .heads
                .learn(obs.candidate, obs.features, u, obs.now);
        }
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        self.state
            .heads
            .learn(obs.candidate, obs.features, obs.quality, obs.now);
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::Lqm(self.state.clone())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::Lqm(s) => self.state.merge(s),
            _ => Err(wrong_policy(PolicyKind::Lqm, other)),
        }
    }

    fn quality_observations(&self) -> Option<Vec<u64>> {
        Some(self.state.heads.quality_observations())
    }
}
