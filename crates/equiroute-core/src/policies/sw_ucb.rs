//! SW-UCB: sliding-window UCB on a scalar reward (Garivier & Moulines), the non-contextual
//! baseline of the LQM paper. The reward is the quality score; a failed or timed-out attempt
//! counts as reward `failure_reward`.
//!
//! Over the last `window` rewards (all candidates together): `N_i` plays and mean `r̄_i` of
//! candidate i; score `r̄_i + c·sqrt(ξ·ln(min(t, window)) / N_i)`, candidates absent from the
//! window first.

use super::{
    check_len, wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::decision::Timestamp;
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Parameters of `sw-ucb`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SwUcbConfig {
    /// Number of most recent rewards kept.
    pub window: usize,
    /// Exploration scale `c` (the reward bound B of the original).
    pub c: f64,
    /// Exploration exponent ξ.
    pub xi: f64,
    /// Reward of a failed or timed-out attempt; `None` learns nothing from it.
    pub failure_reward: Option<f64>,
}

impl Default for SwUcbConfig {
    fn default() -> Self {
        SwUcbConfig {
            window: 500,
            c: 1.0,
            xi: 0.6,
            failure_reward: Some(0.0),
        }
    }
}

impl SwUcbConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        if self.window == 0 {
            return Err(crate::error::out_of_range(
                "window",
                0,
                "must be at least 1 (default 500)",
            ));
        }
        crate::error::non_negative("c", self.c)?;
        crate::error::positive("xi", self.xi)?;
        if let Some(r) = self.failure_reward {
            crate::error::unit_interval("failure_reward", r)?;
        }
        Ok(())
    }
}

/// One reward in the window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reward {
    pub candidate: u32,
    pub value: f64,
    pub at: Timestamp,
}

/// SW-UCB state: the window and the total number of rewards seen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwUcbState {
    pub k: usize,
    pub window: VecDeque<Reward>,
    pub total: u64,
}

/// Sliding-window UCB.
#[derive(Clone, Debug)]
pub struct SwUcb {
    cfg: SwUcbConfig,
    state: SwUcbState,
    sums: Vec<f64>,
    plays: Vec<u32>,
}

impl SwUcb {
    /// A policy over `k` candidates.
    #[must_use]
    pub fn new(k: usize, cfg: SwUcbConfig) -> SwUcb {
        SwUcb {
            cfg,
            state: SwUcbState {
                k,
                window: VecDeque::with_capacity(cfg.window + 1),
                total: 0,
            },
            sums: vec![0.0; k],
            plays: vec![0; k],
        }
    }

    fn push(&mut self, r: Reward) {
        let i = r.candidate as usize;
        self.sums[i] += r.value;
        self.plays[i] += 1;
        self.state.window.push_back(r);
        self.state.total += 1;
        while self.state.window.len() > self.cfg.window {
            if let Some(old) = self.state.window.pop_front() {
                let j = old.candidate as usize;
                self.sums[j] -= old.value;
                self.plays[j] -= 1;
            }
        }
    }

    fn recount(&mut self) {
        self.sums.fill(0.0);
        self.plays.fill(0);
        for r in &self.state.window {
            self.sums[r.candidate as usize] += r.value;
            self.plays[r.candidate as usize] += 1;
        }
    }
}

impl Policy for SwUcb {
    fn kind(&self) -> PolicyKind {
        PolicyKind::SwUcb
    }

    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let horizon = (self.state.total.min(self.cfg.window as u64)).max(1) as f64;
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| {
                    let n = f64::from(self.plays[i]);
                    let (mean, bonus) = if n > 0.0 {
                        let mean = self.sums[i] / n;
                        (mean, self.cfg.c * (self.cfg.xi * horizon.ln() / n).sqrt())
                    } else {
                        // Unplayed in the window: above any played candidate's bound.
                        (0.0, 1e6)
                    };
                    ScoredCandidate {
                        index: i,
                        score: mean + bonus,
                        breakdown: ScoreBreakdown {
                            quality: Some(mean),
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
        r
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        if let Some(reward) = super::heads::failure_lesson(obs, self.cfg.failure_reward) {
            self.push(Reward {
                candidate: obs.candidate as u32,
                value: reward,
                at: obs.now,
            });
        }
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        self.push(Reward {
            candidate: obs.candidate as u32,
            value: obs.quality,
            at: obs.now,
        });
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::SwUcb(self.state.clone())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        let PolicyState::SwUcb(o) = other else {
            return Err(wrong_policy(PolicyKind::SwUcb, other));
        };
        check_len("candidates", self.state.k, o.k)?;
        if let Some(bad) = o
            .window
            .iter()
            .find(|r| r.candidate as usize >= self.state.k)
        {
            return Err(StateError::Shape {
                what: format!("reward for candidate {}", bad.candidate),
            });
        }
        let mut all: Vec<Reward> = self.state.window.drain(..).collect();
        all.extend(o.window.iter().copied());
        all.sort_by(|a, b| a.at.0.total_cmp(&b.at.0));
        let skip = all.len().saturating_sub(self.cfg.window);
        self.state.window = all.into_iter().skip(skip).collect();
        self.state.total += o.total;
        self.recount();
        Ok(())
    }

    /// The rewards in the window: the mean rests on nothing older.
    fn quality_observations(&self) -> Option<Vec<u64>> {
        Some(self.plays.iter().map(|&n| u64::from(n)).collect())
    }
}
