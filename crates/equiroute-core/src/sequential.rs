//! Anytime-valid comparison of two arms (a canary and the live policy) on a metric in
//! `[0, 1]` (a bad outcome as 0/1, a quality score): confidence sequences that stay valid
//! however often they are looked at, so a guard may check after every request.
//!
//! Each arm's mean gets Robbins' normal-mixture confidence sequence for a 1/4-sub-Gaussian
//! variable (any variable in `[0, 1]`, by Hoeffding's lemma; Howard et al. 2021, "Time-uniform,
//! nonparametric, nonasymptotic confidence sequences"). With `S_n` the sum of the deviations
//! from the true mean, `V_n = n/4` and mixing precision `ρ > 0`, the martingale
//! `sqrt(ρ/(V_n+ρ))·exp(S_n²/(2(V_n+ρ)))` exceeds `1/α` at some `n` with probability at most
//! `α` (Ville's inequality), so, for every `n` at once,
//!
//! `|mean_n − μ| ≤ sqrt((V_n+ρ)·ln((V_n+ρ)/(ρ·α²))) / n`.
//!
//! Two arms' sequences at `α/2` each give one for the difference of their means at `α` (a
//! union bound): the canary is declared worse than the live arm beyond a margin `m` once the
//! whole interval of `candidate − live` lies above `m` (lower-is-better metrics). Any `ρ` is
//! valid; it only decides where the boundary is tightest ([`mixing_precision`]).

use serde::{Deserialize, Serialize};

/// A running mean of observations in `[0, 1]` (values outside are clamped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BoundedMean {
    pub n: u64,
    pub sum: f64,
}

impl BoundedMean {
    /// Adds one observation, clamped to `[0, 1]` (NaN is ignored).
    pub fn push(&mut self, x: f64) {
        if x.is_nan() {
            return;
        }
        self.n += 1;
        self.sum += x.clamp(0.0, 1.0);
    }

    /// The mean so far; `None` before any observation.
    #[must_use]
    pub fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }

    /// The confidence sequence for the mean at `alpha` with mixing precision `rho`, clipped to
    /// `[0, 1]`; `[0, 1]` before any observation.
    #[must_use]
    pub fn interval(&self, alpha: f64, rho: f64) -> Interval {
        match self.mean() {
            None => Interval {
                low: 0.0,
                high: 1.0,
            },
            Some(m) => {
                let r = radius(self.n, alpha, rho);
                Interval {
                    low: (m - r).max(0.0),
                    high: (m + r).min(1.0),
                }
            }
        }
    }
}

/// A closed interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

impl Interval {
    /// Whether `x` is inside.
    #[must_use]
    pub fn contains(&self, x: f64) -> bool {
        self.low <= x && x <= self.high
    }
}

/// The half-width of the normal-mixture confidence sequence for the mean of `n` observations
/// in `[0, 1]` at error `alpha`: `sqrt((n/4+ρ)·ln((n/4+ρ)/(ρ·α²))) / n` (infinite for `n = 0`).
#[must_use]
pub fn radius(n: u64, alpha: f64, rho: f64) -> f64 {
    if n == 0 {
        return f64::INFINITY;
    }
    let v = n as f64 / 4.0 + rho;
    (v * (v / (rho * alpha * alpha)).ln()).sqrt() / n as f64
}

/// The mixing precision that makes the boundary tightest at `n` observations for error
/// `alpha`: `ρ = (n/4)/r` with `r = 2·ln(1/α) + ln(1 + 2·ln(1/α))` (one step of the fixed point
/// `r = 2·ln(1/α) + ln(1+r)` of the boundary's derivative in `ρ`).
#[must_use]
pub fn mixing_precision(n: u64, alpha: f64) -> f64 {
    let l = 2.0 * (1.0 / alpha).ln();
    let r = l + (1.0 + l).ln();
    (n.max(1) as f64 / 4.0) / r
}

/// How a canary is compared with the live arm on one lower-is-better metric.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Guard {
    /// How much worse the candidate may be (in the metric's units) before it is rolled back.
    pub margin: f64,
    /// The probability of a rollback when the candidate is in fact at most `margin` worse,
    /// over the whole rollout however often it is checked.
    pub alpha: f64,
    /// The mixing precision (see [`mixing_precision`]).
    pub rho: f64,
}

/// The evidence of one comparison.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub candidate: BoundedMean,
    pub live: BoundedMean,
    /// Confidence sequence of `candidate − live`, valid at `1 − alpha` at all times.
    pub difference: Interval,
    /// The whole interval lies above the margin: the candidate is worse beyond it.
    pub worse: bool,
}

impl Guard {
    /// Compares the arms on a lower-is-better metric (for a higher-is-better one, pass
    /// `1 − x`: the difference is then `live − candidate` in the metric's own terms).
    #[must_use]
    pub fn compare(&self, candidate: &BoundedMean, live: &BoundedMean) -> Comparison {
        let c = candidate.interval(self.alpha / 2.0, self.rho);
        let l = live.interval(self.alpha / 2.0, self.rho);
        let difference = Interval {
            low: c.low - l.high,
            high: c.high - l.low,
        };
        Comparison {
            candidate: *candidate,
            live: *live,
            difference,
            worse: candidate.n > 0 && live.n > 0 && difference.low > self.margin,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rand::{Rng, SeedableRng};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-4
    }

    #[test]
    fn the_radius_is_the_normal_mixture_boundary_by_hand() {
        // n = 100, α = 0.05, ρ = 1: V+ρ = 26, ln(26 / 0.0025) = ln 10400 = 9.24956,
        // sqrt(26 · 9.24956) = 15.508, / 100 = 0.15508.
        assert!(
            close(radius(100, 0.05, 1.0), 0.15508),
            "{}",
            radius(100, 0.05, 1.0)
        );
        // n = 4, α = 0.1, ρ = 1: V+ρ = 2, ln(2/0.01) = 5.29832, sqrt(10.5966)/4 = 0.81382.
        assert!(
            close(radius(4, 0.1, 1.0), 0.81382),
            "{}",
            radius(4, 0.1, 1.0)
        );
        assert!(radius(0, 0.05, 1.0).is_infinite());
        // Wider when more confident, narrower with more data.
        assert!(radius(100, 0.01, 1.0) > radius(100, 0.05, 1.0));
        assert!(radius(1000, 0.05, 1.0) < radius(100, 0.05, 1.0));
    }

    #[test]
    fn the_mixing_precision_is_where_the_boundary_is_tightest() {
        // α = 0.05: 2 ln 20 = 5.99146, r = 5.99146 + ln 6.99146 = 7.93601, ρ = 25 / 7.93601.
        let rho = mixing_precision(100, 0.05);
        assert!(close(rho, 25.0 / 7.93601), "{rho}");
        // At n = 100 it beats a ρ ten times larger or smaller.
        let at = |rho: f64| radius(100, 0.05, rho);
        assert!(at(rho) < at(rho * 10.0) && at(rho) < at(rho / 10.0));
    }

    #[test]
    fn a_candidate_that_always_fails_is_worse_after_a_bounded_number_of_requests() {
        let guard = Guard {
            margin: 0.05,
            alpha: 0.05,
            rho: mixing_precision(100, 0.05),
        };
        let live = BoundedMean { n: 500, sum: 10.0 }; // 2% bad
        let mut candidate = BoundedMean::default();
        let mut worse_at = None;
        for k in 1..=200 {
            candidate.push(1.0);
            if guard.compare(&candidate, &live).worse {
                worse_at = Some(k);
                break;
            }
        }
        // Candidate interval [1 − r_c(k), 1], live [0.02 − r_l, 0.02 + r_l], each at α/2: the
        // guard fires at the first k where 1 − r_c(k) − (0.02 + r_l) > margin, and not before.
        let k = worse_at.unwrap();
        let rho = guard.rho;
        let r_l = radius(500, 0.025, rho);
        assert!(1.0 - radius(k, 0.025, rho) - (0.02 + r_l) > 0.05);
        assert!(1.0 - radius(k - 1, 0.025, rho) - (0.02 + r_l) <= 0.05);
        assert!(k <= 40, "{k}");
        // An equal candidate is never declared worse.
        let same = BoundedMean { n: 100, sum: 2.0 };
        assert!(!guard.compare(&same, &live).worse);
    }

    #[test]
    fn checked_after_every_observation_it_still_errs_at_most_alpha() {
        // 400 runs of 2000 Bernoulli(0.3) draws: the share of runs whose interval ever misses
        // the true mean stays under α = 0.1, where the fixed-sample 90% interval
        // (mean ± 1.645·sqrt(p(1−p)/n)) checked at every step misses in most runs.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (alpha, p) = (0.1, 0.3);
        let rho = mixing_precision(200, alpha);
        let (mut anytime_missed, mut naive_missed) = (0, 0);
        let runs = 400;
        for _ in 0..runs {
            let mut m = BoundedMean::default();
            let (mut a, mut b) = (false, false);
            for _ in 0..2000 {
                m.push(f64::from(u8::from(rng.random::<f64>() < p)));
                a |= !m.interval(alpha, rho).contains(p);
                let mean = m.mean().unwrap();
                let half = 1.645 * (mean * (1.0 - mean) / m.n as f64).sqrt();
                b |= m.n >= 10 && (mean - p).abs() > half;
            }
            anytime_missed += u32::from(a);
            naive_missed += u32::from(b);
        }
        assert!(
            f64::from(anytime_missed) / f64::from(runs) <= alpha,
            "{anytime_missed}/{runs}"
        );
        assert!(
            f64::from(naive_missed) / f64::from(runs) > 0.3,
            "{naive_missed}/{runs}"
        );
    }
}
