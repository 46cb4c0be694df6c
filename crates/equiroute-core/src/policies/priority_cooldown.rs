//! Priority list + cooldown, the production style of LiteLLM and Portkey: always try the
//! candidates in a fixed order; a candidate with more than `allowed_fails` failures (provider
//! errors and timeouts) within `fail_window_ms` cools down for `cooldown_ms`, and a
//! `Retry-After` cools it down for that long. Cooling candidates go to the end of the order
//! (soonest available first) so that they remain a last resort.

use super::{
    check_len, wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::decision::{AttemptStatus, Timestamp};
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Parameters of `priority-cooldown`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityCooldownConfig {
    /// Candidate ids, most preferred first; unlisted candidates follow in configuration
    /// order. Empty: configuration order.
    pub order: Vec<String>,
    /// Failures tolerated within the window before a cooldown.
    pub allowed_fails: u32,
    /// The window in which failures are counted, in ms.
    pub fail_window_ms: f64,
    /// How long a candidate cools down, in ms.
    pub cooldown_ms: f64,
}

impl Default for PriorityCooldownConfig {
    fn default() -> Self {
        PriorityCooldownConfig {
            order: Vec::new(),
            allowed_fails: 3,
            fail_window_ms: 60_000.0,
            cooldown_ms: 5_000.0,
        }
    }
}

impl PriorityCooldownConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::positive("fail_window_ms", self.fail_window_ms)?;
        crate::error::non_negative("cooldown_ms", self.cooldown_ms)?;
        Ok(())
    }
}

/// Failure times and cooldowns per candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CooldownState {
    pub recent_failures: Vec<VecDeque<Timestamp>>,
    pub cooldown_until: Vec<Timestamp>,
}

/// Priority list + cooldown.
#[derive(Clone, Debug)]
pub struct PriorityCooldown {
    cfg: PriorityCooldownConfig,
    /// Priority position of each candidate index (lower is preferred).
    position: Vec<usize>,
    state: CooldownState,
}

impl PriorityCooldown {
    /// A policy with the given priority (`position[i]` = rank of candidate i).
    #[must_use]
    pub fn new(position: Vec<usize>, cfg: PriorityCooldownConfig) -> PriorityCooldown {
        let k = position.len();
        PriorityCooldown {
            cfg,
            position,
            state: CooldownState {
                recent_failures: vec![VecDeque::new(); k],
                cooldown_until: vec![Timestamp(f64::NEG_INFINITY); k],
            },
        }
    }

    /// Whether candidate `i` is cooling down at `now`.
    #[must_use]
    pub fn cooling(&self, i: usize, now: Timestamp) -> bool {
        self.state.cooldown_until[i].0 > now.0
    }

    fn cool(&mut self, i: usize, until: Timestamp) {
        if until.0 > self.state.cooldown_until[i].0 {
            self.state.cooldown_until[i] = until;
        }
    }
}

impl Policy for PriorityCooldown {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PriorityCooldown
    }

    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let k = self.position.len() as f64;
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| {
                    let preference = k - self.position[i] as f64;
                    let score = if self.cooling(i, ctx.now) {
                        // After every available candidate, the one free soonest first.
                        -1.0 - (self.state.cooldown_until[i].0 - ctx.now.0) / 1e9
                    } else {
                        preference
                    };
                    ScoredCandidate {
                        index: i,
                        score,
                        breakdown: ScoreBreakdown {
                            guarded: self.cooling(i, ctx.now),
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
        let i = obs.candidate;
        let status = obs.outcome.status;
        if let Some(retry) = obs.outcome.retry_after {
            self.cool(i, obs.now.plus(retry));
        }
        if !(status.is_provider_failure() || status == AttemptStatus::Timeout) {
            return;
        }
        let window_start = obs.now.0 - self.cfg.fail_window_ms;
        let fails = &mut self.state.recent_failures[i];
        fails.push_back(obs.now);
        while fails.front().is_some_and(|t| t.0 <= window_start) {
            fails.pop_front();
        }
        if fails.len() > self.cfg.allowed_fails as usize {
            fails.clear();
            let until = obs.now.plus(crate::Millis(self.cfg.cooldown_ms));
            self.cool(i, until);
        }
    }

    fn observe_quality(&mut self, _obs: &QualityObservation<'_>) {}

    fn export_state(&self) -> PolicyState {
        PolicyState::PriorityCooldown(self.state.clone())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        let PolicyState::PriorityCooldown(o) = other else {
            return Err(wrong_policy(PolicyKind::PriorityCooldown, other));
        };
        check_len("candidates", self.position.len(), o.cooldown_until.len())?;
        check_len("candidates", self.position.len(), o.recent_failures.len())?;
        for i in 0..self.position.len() {
            self.cool(i, o.cooldown_until[i]);
            let mut all: Vec<Timestamp> = self.state.recent_failures[i].drain(..).collect();
            all.extend(o.recent_failures[i].iter().copied());
            all.sort_by(|a, b| a.0.total_cmp(&b.0));
            self.state.recent_failures[i] = all.into();
        }
        Ok(())
    }
}
