//! The additive load-aware baseline: a LinUCB head per candidate on the reward
//! `r = α·u − (1−α)·τ̃`, with `τ̃ = min(1, τ/latency_scale)` latency normalised to [0,1].
//!
//! It is here to show its failure mode: the two axes compensate. With α = 0.4,
//! (τ̃=0, u=0.1) scores 0.04 while (τ̃=1, u=0.65) scores −0.34, so a fast provider with useless
//! answers wins.

use super::heads::{failure_lesson, HeadsState};
use super::{
    wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::estimators::linucb::LinUcbConfig;
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Parameters of `additive`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdditiveConfig {
    /// Weight α of quality (1−α goes to latency).
    pub alpha: f64,
    /// Latency mapped to τ̃ = 1, in ms.
    pub latency_scale_ms: f64,
    /// Exploration scale of the LinUCB heads.
    pub alpha_ucb: f64,
    /// The quality heads.
    pub head: LinUcbConfig,
    /// Quality assumed for a failed or timed-out attempt (`None`: learn nothing).
    pub failure_quality: Option<f64>,
}

impl Default for AdditiveConfig {
    fn default() -> Self {
        AdditiveConfig {
            alpha: 0.4,
            latency_scale_ms: 2000.0,
            alpha_ucb: 0.5,
            head: LinUcbConfig::default(),
            failure_quality: Some(0.0),
        }
    }
}

impl AdditiveConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::unit_interval("alpha", self.alpha)?;
        crate::error::positive("latency_scale_ms", self.latency_scale_ms)?;
        crate::error::non_negative("alpha_ucb", self.alpha_ucb)?;
        if let Some(q) = self.failure_quality {
            crate::error::unit_interval("failure_quality", q)?;
        }
        self.head.validate()
    }

    /// `r = α·u − (1−α)·min(1, τ/scale)`.
    #[must_use]
    pub fn reward(&self, quality: f64, latency_ms: f64) -> f64 {
        let tau = (latency_ms / self.latency_scale_ms).clamp(0.0, 1.0);
        self.alpha * quality - (1.0 - self.alpha) * tau
    }
}

/// The additive-reward contextual bandit.
#[derive(Clone, Debug)]
pub struct Additive {
    cfg: AdditiveConfig,
    heads: HeadsState,
}

impl Additive {
    /// A policy over `k` candidates with `dim` features.
    #[must_use]
    pub fn new(k: usize, dim: usize, cfg: AdditiveConfig) -> Additive {
        Additive {
            cfg,
            heads: HeadsState::new(k, dim, cfg.head),
        }
    }
}

impl Policy for Additive {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Additive
    }

    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let estimates = self.heads.estimates(ctx.eligible, ctx.features);
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .zip(estimates)
                .map(|(&i, (reward, w))| {
                    let bonus = self.cfg.alpha_ucb * w;
                    ScoredCandidate {
                        index: i,
                        score: reward + bonus,
                        breakdown: ScoreBreakdown {
                            quality: Some(reward),
                            exploration: Some(bonus),
                            ..ScoreBreakdown::default()
                        },
                    }
                })
                .collect(),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        r.sort();
        super::heads::warmup_first(&mut r, &self.heads, &self.cfg.head);
        r
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.heads.note_try(obs);
        if let Some(u) = failure_lesson(obs, self.cfg.failure_quality) {
            let r = self.cfg.reward(u, obs.outcome.latency.0);
            self.heads.learn(obs.candidate, obs.features, r, obs.now);
        }
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        let r = self.cfg.reward(obs.quality, obs.latency.0);
        self.heads.learn(obs.candidate, obs.features, r, obs.now);
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::Additive(self.heads.clone())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::Additive(h) => self.heads.merge(h),
            _ => Err(wrong_policy(PolicyKind::Additive, other)),
        }
    }

    fn quality_observations(&self) -> Option<Vec<u64>> {
        Some(self.heads.quality_observations())
    }
}
