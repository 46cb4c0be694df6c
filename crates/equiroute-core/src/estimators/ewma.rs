//! Exponentially weighted averages.
//!
//! [`FailureRate`] is the EWMA of provider-side failures of the Thompson design, kept as
//! time-decayed counts (`failures`, `attempts`) referenced to a timestamp. With evenly spaced
//! attempts this is the classic EWMA with `γ = 1 − 2^(−Δt/half_life)`; keeping the two sums
//! instead of the ratio makes it exactly mergeable across gateway instances (decay both to
//! the same time, add). A Beta-style prior (`prior_rate` with `prior_weight` pseudo-attempts)
//! keeps the estimate sensible before the first attempt.
//!
//! [`LatencyEma`] is LQM-ContextRoute's latency estimate `τ̂ ← (1−β)·τ̂ + β·τ`.

use super::decay_factor;
use crate::decision::Timestamp;
use serde::{Deserialize, Serialize};

/// Prior and decay of a [`FailureRate`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailureRateConfig {
    /// Half-life of past attempts in milliseconds; `None` keeps all history.
    pub half_life_ms: Option<f64>,
    /// Failure rate assumed before any attempt.
    pub prior_rate: f64,
    /// How many attempts the prior is worth.
    pub prior_weight: f64,
}

impl Default for FailureRateConfig {
    fn default() -> Self {
        FailureRateConfig {
            half_life_ms: Some(20_000.0),
            prior_rate: 0.0,
            prior_weight: 2.0,
        }
    }
}

impl FailureRateConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A field outside its range, named.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if let Some(h) = self.half_life_ms {
            crate::error::positive("failure.half_life_ms", h)?;
        }
        crate::error::unit_interval("failure.prior_rate", self.prior_rate)?;
        crate::error::non_negative("failure.prior_weight", self.prior_weight)?;
        Ok(())
    }
}

/// Time-decayed failure counts of one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FailureRate {
    /// Decayed number of provider-side failures.
    pub failures: f64,
    /// Decayed number of attempts that counted (failures and successes, not client errors).
    pub attempts: f64,
    /// Exact number of attempts ever recorded (not decayed).
    pub count: u64,
    /// The time the decayed sums refer to.
    pub at: Timestamp,
}

impl FailureRate {
    /// Decays the sums to time `now` (never backwards).
    pub fn decay_to(&mut self, now: Timestamp, cfg: &FailureRateConfig) {
        if now.0 > self.at.0 {
            let f = decay_factor(cfg.half_life_ms, now.0 - self.at.0);
            self.failures *= f;
            self.attempts *= f;
            self.at = now;
        }
    }

    /// Records one attempt that counts for the provider's health. An attempt older than the
    /// sums (another instance's, arriving late) counts with the weight it has decayed to, so
    /// the sums do not depend on the order observations arrive in.
    pub fn record(&mut self, now: Timestamp, failed: bool, cfg: &FailureRateConfig) {
        self.decay_to(now, cfg);
        let w = decay_factor(cfg.half_life_ms, self.at.0 - now.0);
        self.attempts += w;
        self.count += 1;
        if failed {
            self.failures += w;
        }
    }

    /// The smoothed failure probability at time `now`.
    #[must_use]
    pub fn rate(&self, now: Timestamp, cfg: &FailureRateConfig) -> f64 {
        let f = if now.0 > self.at.0 {
            decay_factor(cfg.half_life_ms, now.0 - self.at.0)
        } else {
            1.0
        };
        let num = self.failures * f + cfg.prior_rate * cfg.prior_weight;
        let den = self.attempts * f + cfg.prior_weight;
        if den > 0.0 {
            num / den
        } else {
            cfg.prior_rate
        }
    }

    /// Adds another instance's counts (both decayed to the later of the two times).
    pub fn merge(&mut self, other: &FailureRate, cfg: &FailureRateConfig) {
        let mut other = *other;
        let t = if other.at.0 > self.at.0 {
            other.at
        } else {
            self.at
        };
        self.decay_to(t, cfg);
        other.decay_to(t, cfg);
        self.failures += other.failures;
        self.attempts += other.attempts;
        self.count += other.count;
    }
}

/// LQM-ContextRoute's latency estimate: `τ̂ ← (1−β)·τ̂ + β·τ`, starting at `τ₀`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyEma {
    /// Current estimate τ̂ in milliseconds.
    pub value_ms: f64,
    /// Number of observations folded in.
    pub count: u64,
}

impl LatencyEma {
    /// An estimate starting at `tau0_ms`.
    #[must_use]
    pub fn new(tau0_ms: f64) -> LatencyEma {
        LatencyEma {
            value_ms: tau0_ms,
            count: 0,
        }
    }

    /// Folds in one latency with weight `beta`.
    pub fn update(&mut self, latency_ms: f64, beta: f64) {
        self.value_ms = (1.0 - beta) * self.value_ms + beta * latency_ms;
        self.count += 1;
    }

    /// The estimate with its evidence weighted by `fresh` (in [0, 1]): `τ₀ + fresh·(τ̂ − τ₀)`,
    /// back at the prior `tau0_ms` once the evidence is wholly stale.
    #[must_use]
    pub fn faded_ms(&self, tau0_ms: f64, fresh: f64) -> f64 {
        tau0_ms + fresh.clamp(0.0, 1.0) * (self.value_ms - tau0_ms)
    }

    /// Combines two instances' estimates. An EMA has no exact merge: this is the
    /// observation-count-weighted mean of the two, which equals either side when the other
    /// has seen nothing.
    pub fn merge(&mut self, other: &LatencyEma) {
        let total = self.count + other.count;
        if total > 0 {
            self.value_ms = (self.value_ms * self.count as f64
                + other.value_ms * other.count as f64)
                / total as f64;
        }
        self.count = total;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_follows_the_formula() {
        // τ̂ = 0.9·400 + 0.1·100 = 370, then 0.9·370 + 0.1·100 = 343.
        let mut e = LatencyEma::new(400.0);
        e.update(100.0, 0.1);
        assert!((e.value_ms - 370.0).abs() < 1e-12);
        e.update(100.0, 0.1);
        assert!((e.value_ms - 343.0).abs() < 1e-12);
    }

    #[test]
    fn failure_rate_counts_decay_and_merge_exactly() {
        let cfg = FailureRateConfig {
            half_life_ms: Some(1000.0),
            prior_rate: 0.0,
            prior_weight: 0.0,
        };
        let mut a = FailureRate::default();
        a.record(Timestamp(0.0), true, &cfg);
        a.record(Timestamp(1000.0), false, &cfg);
        // The failure is one half-life old: 0.5 failures over 1.5 attempts.
        assert!((a.rate(Timestamp(1000.0), &cfg) - 1.0 / 3.0).abs() < 1e-12);

        // Splitting the same stream across two instances and merging gives the same sums.
        let mut left = FailureRate::default();
        let mut right = FailureRate::default();
        left.record(Timestamp(0.0), true, &cfg);
        right.record(Timestamp(1000.0), false, &cfg);
        left.merge(&right, &cfg);
        assert!((left.failures - a.failures).abs() < 1e-12);
        assert!((left.attempts - a.attempts).abs() < 1e-12);
        assert_eq!(left.count, 2);
    }

    #[test]
    fn late_attempts_count_with_their_decayed_weight_whatever_the_order() {
        let cfg = FailureRateConfig {
            half_life_ms: Some(1000.0),
            prior_rate: 0.0,
            prior_weight: 0.0,
        };
        let events: [(f64, bool); 4] =
            [(0.0, true), (250.0, false), (1700.0, true), (900.0, false)];
        let mut in_order = FailureRate::default();
        let mut sorted = events;
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, f) in sorted {
            in_order.record(Timestamp(t), f, &cfg);
        }
        let mut shuffled = FailureRate::default();
        for (t, f) in [events[2], events[0], events[3], events[1]] {
            shuffled.record(Timestamp(t), f, &cfg);
        }
        assert_eq!(shuffled.at, in_order.at);
        assert!((shuffled.failures - in_order.failures).abs() < 1e-12);
        assert!((shuffled.attempts - in_order.attempts).abs() < 1e-12);
        // A late failure 1 s old counts as half a failure.
        let mut late = FailureRate::default();
        late.record(Timestamp(1000.0), false, &cfg);
        late.record(Timestamp(0.0), true, &cfg);
        assert!((late.failures - 0.5).abs() < 1e-12);
    }

    #[test]
    fn prior_dominates_before_any_attempt() {
        let cfg = FailureRateConfig {
            prior_rate: 0.02,
            ..FailureRateConfig::default()
        };
        assert!((FailureRate::default().rate(Timestamp(5.0), &cfg) - 0.02).abs() < 1e-15);
    }
}
