//! The shape of a latency distribution that a log-normal cannot describe (fast cache hits and
//! slow misses, a heavy tail): the belief that blends the Normal-Inverse-Gamma posterior with
//! the bounded histogram of `ln(latency)` kept next to its sums ([`super::histogram`]).
//!
//! **Blend.** `P(L > d)` is the posterior mean of a Dirichlet process whose base measure is
//! the NIG posterior predictive with `n₀` pseudo-observations (`shape_prior_weight`):
//!
//! ```text
//! P(L > d) = (n₀·P_nig(L > d) + M(> d)) / (n₀ + M)
//! ```
//!
//! with `M` the histogram's (decayed) mass and `M(> d)` its mass above `ln d`. With few
//! observations the NIG's smooth, prior-regularised tail dominates; as data accumulate the
//! empirical shape takes over, so a mixture's or a heavy tail's exceedance converges to the
//! truth instead of to a log-normal's. Within the bin that holds `ln d` the mass is split by the
//! NIG's own shape (not linearly), so a log-normal provider loses nothing to the bin width.

pub use super::histogram::{LatencyHistogram, BINS};
use super::nig::NigPosterior;
use rand::RngCore;

/// A candidate's latency belief in one slice: the NIG posterior (location already shifted
/// by the fast level, if any) and the slice's effective histogram.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyBelief {
    pub posterior: NigPosterior,
    /// The fast level's shift of `ln L`, applied to the histogram's query too.
    pub shift: f64,
    pub shape: LatencyHistogram,
    /// `n₀`: the NIG's weight against the histogram; `None` ignores the histogram.
    pub shape_prior_weight: Option<f64>,
}

impl LatencyBelief {
    /// A belief from the NIG posterior alone (a log-normal shape).
    #[must_use]
    pub fn log_normal(posterior: NigPosterior) -> LatencyBelief {
        LatencyBelief {
            posterior,
            shift: 0.0,
            shape: LatencyHistogram::default(),
            shape_prior_weight: None,
        }
    }

    /// `(n₀, M(> d), M)` when the histogram takes part.
    fn blend_terms(&self, deadline_ms: f64) -> Option<(f64, f64, f64)> {
        let n0 = self.shape_prior_weight?;
        let total = self.shape.total();
        if total.is_nan() || total <= 0.0 || deadline_ms <= 0.0 {
            return None;
        }
        let (mu, sigma) = self.posterior.point();
        let y = deadline_ms.ln() - self.shift;
        Some((n0, self.shape.mass_above(y, mu - self.shift, sigma), total))
    }

    /// The belief read at one deadline: the histogram's part computed once for every
    /// `P(L > d)` asked of it (a bound, a point, a draw).
    #[must_use]
    pub fn at(&self, deadline_ms: f64) -> Exceedance<'_> {
        Exceedance {
            belief: self,
            deadline_ms,
            terms: self.blend_terms(deadline_ms),
        }
    }

    /// Predictive `P(L > d)`: the blend of the Student-t predictive and the histogram.
    #[must_use]
    pub fn exceedance(&self, deadline_ms: f64) -> f64 {
        self.at(deadline_ms).point()
    }

    /// An upper bound of [`Self::exceedance`] that skips the t tail when the deadline is past
    /// the posterior median (NIG part at most ½): `None` when that does not hold.
    #[must_use]
    pub fn exceedance_bound(&self, deadline_ms: f64) -> Option<f64> {
        self.at(deadline_ms).bound()
    }

    /// One Thompson draw of `P(L > d)`: a NIG draw blended with the histogram (averages to
    /// [`Self::exceedance`]).
    pub fn sampled_exceedance(&self, deadline_ms: f64, rng: &mut dyn RngCore) -> f64 {
        self.at(deadline_ms).sampled(rng)
    }
}

/// A [`LatencyBelief`] at one deadline `d` ([`LatencyBelief::at`]).
#[derive(Clone, Copy, Debug)]
pub struct Exceedance<'b> {
    belief: &'b LatencyBelief,
    deadline_ms: f64,
    terms: Option<(f64, f64, f64)>,
}

impl Exceedance<'_> {
    /// `(n₀·p + M(> d)) / (n₀ + M)`, or `p` without histogram.
    fn blend(&self, nig: f64) -> f64 {
        match self.terms {
            Some((n0, above, total)) => ((n0 * nig + above) / (n0 + total)).clamp(0.0, 1.0),
            None => nig,
        }
    }

    /// [`LatencyBelief::exceedance`].
    #[must_use]
    pub fn point(&self) -> f64 {
        self.blend(
            self.belief
                .posterior
                .predictive_exceedance(self.deadline_ms),
        )
    }

    /// [`LatencyBelief::exceedance_bound`].
    #[must_use]
    pub fn bound(&self) -> Option<f64> {
        let d = self.deadline_ms;
        (d > 0.0 && d.ln() >= self.belief.posterior.mu_n).then(|| self.blend(0.5))
    }

    /// [`LatencyBelief::sampled_exceedance`].
    pub fn sampled(&self, rng: &mut dyn RngCore) -> f64 {
        let nig = self
            .belief
            .posterior
            .sampled_exceedance(self.deadline_ms, rng);
        self.blend(nig)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimators::dist::normal_cdf;
    use crate::estimators::nig::NigPrior;

    #[test]
    fn on_a_mixture_the_blend_converges_to_the_truth_and_the_log_normal_does_not() {
        // 70% at 80 ms, 30% at 2500 ms (tight modes), deadline 1500 ms: truth P(L > d) = 0.3.
        let mut lat = Vec::new();
        for i in 0..1000 {
            let wiggle = (f64::from(i % 7) - 3.0) * 0.03;
            lat.push(if i % 10 < 7 { 80.0 } else { 2500.0 } * wiggle.exp());
        }
        let mut shape = LatencyHistogram::default();
        for &l in &lat {
            shape.add(l.ln(), 1.0);
        }
        let posterior = crate::estimators::nig::LogLatencyStats::from_latencies(&lat)
            .posterior(&NigPrior::default());
        let log_normal = LatencyBelief::log_normal(posterior).exceedance(1500.0);
        let blended = LatencyBelief {
            posterior,
            shift: 0.0,
            shape,
            shape_prior_weight: Some(20.0),
        };
        let p = blended.exceedance(1500.0);
        assert!((log_normal - 0.3).abs() > 0.1, "log-normal {log_normal}");
        // (20·p_nig + 300)/(20 + 1000) is within 0.01 of 0.3.
        assert!((p - 0.3).abs() < 0.01, "blend {p}");
        // Past the slow mode the log-normal overestimates, the blend does not.
        let far = blended.exceedance(8000.0);
        assert!(far < 0.002, "{far}");
        assert!(LatencyBelief::log_normal(posterior).exceedance(8000.0) > 0.01);
        // The bound holds where it applies.
        let bound = blended.exceedance_bound(1500.0).unwrap_or(1.0);
        assert!(bound >= p);
    }

    #[test]
    fn a_log_normal_loses_nothing_to_the_bin_width() {
        // Quantile-spaced log-normal data: the within-bin split follows the fitted shape.
        let n = 4000;
        let lat: Vec<f64> = (0..n)
            .map(|i| {
                let u = (f64::from(i) + 0.5) / f64::from(n);
                // Inverse normal CDF by bisection on the core's CDF.
                let (mut lo, mut hi) = (-10.0f64, 10.0f64);
                for _ in 0..80 {
                    let mid = 0.5 * (lo + hi);
                    if normal_cdf(mid) < u {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                (300f64.ln() + 0.5 * 0.5 * (lo + hi)).exp()
            })
            .collect();
        let mut shape = LatencyHistogram::default();
        for &l in &lat {
            shape.add(l.ln(), 1.0);
        }
        let posterior = crate::estimators::nig::LogLatencyStats::from_latencies(&lat)
            .posterior(&NigPrior::default());
        let blended = LatencyBelief {
            posterior,
            shift: 0.0,
            shape,
            shape_prior_weight: Some(20.0),
        };
        for d in [250.0, 400.0, 600.0, 900.0] {
            let truth = 1.0 - normal_cdf((f64::ln(d) - 300f64.ln()) / 0.5);
            let p = blended.exceedance(d);
            assert!((p - truth).abs() < 0.003, "d {d}: {p} vs {truth}");
        }
    }
}
