//! Normal-Inverse-Gamma posterior over the log-latency of a candidate.
//!
//! State is kept as decayed sufficient statistics of `y = ln(latency)`: the (decayed) weight
//! `n`, the weighted mean `meanLog` and the weighted sum of squared deviations
//! `deviationSum`. With a prior (μ0, κ0, α0, β0) the posterior is
//!
//! ```text
//! κn = κ0 + n
//! μn = (κ0·μ0 + n·meanLog) / κn
//! αn = α0 + n/2
//! βn = β0 + 0.5·deviationSum + κ0·n·(meanLog − μ0)² / (2·κn)
//! ```
//!
//! Statistics merge exactly (Chan's parallel formula), so instances can share them; time
//! decay multiplies `n` and `deviationSum` by `2^(−Δt/half_life)`, keeping the mean.
//!
//! **Censoring.** A request cancelled at the deadline `d` only says `y ≥ ln d`. Recording it
//! as `ln d` biases the tail low; dropping it biases toward fast. We impute it with the
//! moments of the current posterior truncated to `y > ln d` (mean `μ + σ·λ(a)` and variance
//! `σ²·(1 + aλ − λ²)`, with `λ` the inverse Mills ratio): the point enters the mean and its
//! conditional variance enters `deviationSum`. Repeated online, this is the EM fixed point
//! of the censored normal likelihood; `tests/calibration.rs` checks that the predicted
//! deadline-miss probability converges to the true one.

use super::decay_factor;
use super::dist::{lognormal_exceedance, student_t_sf, truncated_normal_moments};
use super::histogram::LatencyHistogram;
use crate::decision::Timestamp;
use rand::RngCore;
use rand_distr::{Distribution, Gamma, StandardNormal};
use serde::{Deserialize, Serialize};

/// Prior of the log-latency posterior.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NigPrior {
    /// Prior mean of ln(latency in ms).
    pub mu0: f64,
    /// Pseudo-observations behind `mu0`.
    pub kappa0: f64,
    /// Shape of the variance prior (> 1 for a finite prior mean of σ²).
    pub alpha0: f64,
    /// Scale of the variance prior; the prior mean of σ² is β0/(α0−1).
    pub beta0: f64,
}

impl Default for NigPrior {
    /// A weak prior centred on 1 s with σ² ≈ 0.5 (a factor of two either way is one σ).
    fn default() -> Self {
        NigPrior {
            mu0: 1000f64.ln(),
            kappa0: 1.0,
            alpha0: 2.0,
            beta0: 0.5,
        }
    }
}

impl NigPrior {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A field outside its range, named.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if !self.mu0.is_finite() {
            return Err(crate::error::out_of_range(
                "latency_prior.mu0",
                self.mu0,
                "must be a finite log-latency, e.g. ln(1000 ms) = 6.9",
            ));
        }
        crate::error::positive("latency_prior.kappa0", self.kappa0)?;
        crate::error::positive("latency_prior.alpha0", self.alpha0)?;
        crate::error::positive("latency_prior.beta0", self.beta0)?;
        Ok(())
    }

    /// The posterior of no data: the prior itself.
    #[must_use]
    pub fn as_posterior(&self) -> NigPosterior {
        NigPosterior {
            mu_n: self.mu0,
            kappa_n: self.kappa0,
            alpha_n: self.alpha0,
            beta_n: self.beta0,
        }
    }
}

/// Decayed sufficient statistics of log-latencies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogLatencyStats {
    /// Decayed number of observations `n`.
    pub weight: f64,
    /// Weighted mean of the logs, `meanLog`.
    pub mean_log: f64,
    /// Weighted sum of squared deviations from the mean, `deviationSum`.
    pub deviation_sum: f64,
    /// Exact number of observations ever recorded (not decayed).
    pub count: u64,
    /// Exact number of those that were censored.
    pub censored: u64,
    /// The time the decayed sums refer to.
    pub at: Timestamp,
    /// The same observations binned by log-latency, decayed and merged with the sums (empty in
    /// states saved before it existed).
    #[serde(default, skip_serializing_if = "LatencyHistogram::is_empty")]
    pub shape: LatencyHistogram,
}

impl LogLatencyStats {
    /// Statistics of a batch of latencies (no decay), e.g. for tests and fixtures.
    #[must_use]
    pub fn from_latencies(latencies_ms: &[f64]) -> LogLatencyStats {
        let mut s = LogLatencyStats::default();
        for &l in latencies_ms {
            s.add_log(l.ln(), 1.0, 0.0);
            s.shape.add(l.ln(), 1.0);
        }
        s.count = latencies_ms.len() as u64;
        s
    }

    /// Decays the sums to `now` (never backwards).
    pub fn decay_to(&mut self, now: Timestamp, half_life_ms: Option<f64>) {
        self.decay_parts(now, half_life_ms, true);
    }

    /// [`Self::decay_to`], the histogram too only when `shape`.
    fn decay_parts(&mut self, now: Timestamp, half_life_ms: Option<f64>, shape: bool) {
        if now.0 > self.at.0 {
            self.scale_parts(decay_factor(half_life_ms, now.0 - self.at.0), shape);
            self.at = now;
        }
    }

    /// Multiplies the weight and the deviation sum by `factor` (the mean is unchanged).
    pub fn scale(&mut self, factor: f64) {
        self.scale_parts(factor, true);
    }

    /// [`Self::scale`], the histogram too only when `shape` (a caller that reads only the
    /// posterior skips its bins).
    pub fn scale_parts(&mut self, factor: f64, shape: bool) {
        self.weight *= factor;
        self.deviation_sum *= factor;
        if shape {
            self.shape.scale(factor);
        }
    }

    /// A copy dated `at` with its sums, and its histogram when `shape` (else an empty one),
    /// times `factor`: the products of [`Self::scale_parts`] on a copy, made in one pass.
    #[must_use]
    pub fn scaled(&self, factor: f64, at: Timestamp, shape: bool) -> LogLatencyStats {
        LogLatencyStats {
            weight: self.weight * factor,
            deviation_sum: self.deviation_sum * factor,
            at,
            shape: if shape {
                self.shape.scaled(factor)
            } else {
                LatencyHistogram::default()
            },
            ..*self
        }
    }

    /// Adds a log-latency `y` with weight `w` and extra spread `extra_var` (the conditional
    /// variance of an imputed observation; 0 for an exact one).
    fn add_log(&mut self, y: f64, w: f64, extra_var: f64) {
        let new_weight = self.weight + w;
        let delta = y - self.mean_log;
        self.mean_log += delta * w / new_weight;
        self.deviation_sum += w * delta * (y - self.mean_log) + w * extra_var;
        self.weight = new_weight;
    }

    /// Records a completed attempt's latency at time `now`.
    /// An observation older than the sums (another instance's, arriving late) counts with
    /// the weight it has decayed to, so the sums do not depend on arrival order.
    pub fn observe(&mut self, now: Timestamp, latency_ms: f64, half_life_ms: Option<f64>) {
        self.decay_to(now, half_life_ms);
        let w = decay_factor(half_life_ms, self.at.0 - now.0);
        let y = latency_ms.max(1e-3).ln();
        self.add_log(y, w, 0.0);
        self.shape.add(y, w);
        self.count += 1;
    }

    /// Records an attempt cut off after `cutoff_ms` (true latency ≥ cutoff), imputed from
    /// `belief`, the current posterior of this slice.
    pub fn observe_censored(
        &mut self,
        now: Timestamp,
        cutoff_ms: f64,
        belief: &NigPosterior,
        half_life_ms: Option<f64>,
    ) {
        let (mean, var) = belief.censored_moments(cutoff_ms);
        self.observe_imputed(now, mean, var, half_life_ms);
    }

    /// Records a censored attempt already imputed as log-mean `mean` and variance `var`
    /// (see [`NigPosterior::censored_moments`]); lets one imputation feed several slices.
    pub fn observe_imputed(
        &mut self,
        now: Timestamp,
        mean: f64,
        var: f64,
        half_life_ms: Option<f64>,
    ) {
        self.decay_to(now, half_life_ms);
        let w = decay_factor(half_life_ms, self.at.0 - now.0);
        self.add_log(mean, w, var);
        self.count += 1;
        self.censored += 1;
    }

    /// Adds a censored attempt's mass to the histogram only: spread above `ln cutoff` as
    /// `N(mu, sigma²)` truncated there (the point estimate the sums imputed it from). Call it
    /// with [`Self::observe_imputed`], which updates the sums and the counts.
    pub fn observe_tail_shape(
        &mut self,
        now: Timestamp,
        cutoff_ms: f64,
        (mu, sigma): (f64, f64),
        half_life_ms: Option<f64>,
    ) {
        self.decay_to(now, half_life_ms);
        let w = decay_factor(half_life_ms, self.at.0 - now.0);
        self.shape.add_above(cutoff_ms.max(1e-3).ln(), mu, sigma, w);
    }

    /// Adds a censored attempt's mass to the histogram only, spread by `shares` (from
    /// [`LatencyHistogram::tail_shares`]); the counterpart of [`Self::observe_tail_shape`].
    pub fn observe_tail_shares(
        &mut self,
        now: Timestamp,
        shares: &[f64; super::histogram::BINS],
        half_life_ms: Option<f64>,
    ) {
        self.decay_to(now, half_life_ms);
        let w = decay_factor(half_life_ms, self.at.0 - now.0);
        self.shape.add_shares(shares, w);
    }

    /// Adds another instance's statistics (Chan's parallel formula after decaying both to the
    /// later of their two times): the statistics of the union of the two streams.
    pub fn merge(&mut self, other: &LogLatencyStats, half_life_ms: Option<f64>) {
        self.merge_scaled(other, None, half_life_ms, true);
    }

    /// [`Self::merge`] of `other` as it is after `pre = (factor, at)`, its sums and histogram
    /// times `factor` and its time `at` (a decay done by the caller), without copying it; the
    /// histograms only when `shape`. Each number gets the products a scaled copy would, in the
    /// same order, so the result is the same to the bit.
    pub fn merge_scaled(
        &mut self,
        other: &LogLatencyStats,
        pre: Option<(f64, Timestamp)>,
        half_life_ms: Option<f64>,
        shape: bool,
    ) {
        // The factors `other`'s numbers are multiplied by, in order: `pre`'s, then the decay
        // to the later time.
        let mut factors = [1.0; 2];
        let mut used = 0;
        let (mut weight, mut deviation_sum, mut at) = (other.weight, other.deviation_sum, other.at);
        if let Some((f, to)) = pre {
            weight *= f;
            deviation_sum *= f;
            at = to;
            factors[used] = f;
            used += 1;
        }
        let t = if at.0 > self.at.0 { at } else { self.at };
        self.decay_parts(t, half_life_ms, shape);
        if t.0 > at.0 {
            let f = decay_factor(half_life_ms, t.0 - at.0);
            weight *= f;
            deviation_sum *= f;
            factors[used] = f;
            used += 1;
        }
        let total = self.weight + weight;
        if total > 0.0 {
            let delta = other.mean_log - self.mean_log;
            self.mean_log += delta * weight / total;
            self.deviation_sum += deviation_sum + delta * delta * self.weight * weight / total;
        }
        self.weight = total;
        if shape {
            self.shape.add_scaled(&other.shape, &factors[..used]);
        }
        self.count += other.count;
        self.censored += other.censored;
    }

    /// Makes these statistics worth at most `max_weight` observations (mean kept, spread
    /// scaled, the histogram too only when `shape`): what a sparse child slice borrows from
    /// its parent.
    pub fn cap(&mut self, max_weight: f64, shape: bool) {
        if self.weight > max_weight {
            let f = max_weight / self.weight;
            self.weight = max_weight;
            self.deviation_sum *= f;
            if shape {
                self.shape.scale(f);
            }
        }
    }

    /// The posterior under `prior` (the four update formulas).
    #[must_use]
    pub fn posterior(&self, prior: &NigPrior) -> NigPosterior {
        let n = self.weight;
        let kappa_n = prior.kappa0 + n;
        NigPosterior {
            kappa_n,
            mu_n: (prior.kappa0 * prior.mu0 + n * self.mean_log) / kappa_n,
            alpha_n: prior.alpha0 + n / 2.0,
            beta_n: prior.beta0
                + 0.5 * self.deviation_sum
                + prior.kappa0 * n * (self.mean_log - prior.mu0).powi(2) / (2.0 * kappa_n),
        }
    }
}

/// Posterior parameters (μn, κn, αn, βn).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NigPosterior {
    pub mu_n: f64,
    pub kappa_n: f64,
    pub alpha_n: f64,
    pub beta_n: f64,
}

impl NigPosterior {
    /// Posterior mean of σ²: βn/(αn−1) (βn/αn when αn ≤ 1, the mode-like fallback).
    #[must_use]
    pub fn mean_sigma2(&self) -> f64 {
        if self.alpha_n > 1.0 {
            self.beta_n / (self.alpha_n - 1.0)
        } else {
            self.beta_n / self.alpha_n
        }
    }

    /// A point estimate (μn, sqrt(E[σ²])).
    #[must_use]
    pub fn point(&self) -> (f64, f64) {
        (self.mu_n, self.mean_sigma2().sqrt())
    }

    /// A Thompson draw: σ² ~ InvGamma(αn, βn), μ ~ N(μn, σ²/κn). Returns (μ, σ).
    pub fn sample(&self, rng: &mut dyn RngCore) -> (f64, f64) {
        // InvGamma(α, β) = β / Gamma(α, 1). Parameters are positive by construction.
        let g = Gamma::new(self.alpha_n, 1.0).map_or(self.alpha_n, |g| g.sample(rng));
        let sigma2 = self.beta_n / g.max(1e-300);
        let z: f64 = StandardNormal.sample(rng);
        let mu = self.mu_n + (sigma2 / self.kappa_n).sqrt() * z;
        (mu, sigma2.sqrt())
    }

    /// `P(L > d)` for one posterior draw.
    pub fn sampled_exceedance(&self, deadline_ms: f64, rng: &mut dyn RngCore) -> f64 {
        let (mu, sigma) = self.sample(rng);
        lognormal_exceedance(mu, sigma, deadline_ms)
    }

    /// Posterior predictive `P(L > d)`: `ln L` is Student-t with `2αn` degrees of freedom,
    /// location `μn` and scale² `βn(κn+1)/(αn·κn)`. What the Thompson draws average to, and
    /// the point estimate the policies use (exploration guard, guarded candidates, display):
    /// unlike [`Self::point_exceedance`] it keeps the uncertainty of σ², which fattens the tail
    /// while observations are few.
    #[must_use]
    pub fn predictive_exceedance(&self, deadline_ms: f64) -> f64 {
        if deadline_ms <= 0.0 {
            return 1.0;
        }
        let scale2 = self.beta_n * (self.kappa_n + 1.0) / (self.alpha_n * self.kappa_n);
        if scale2.is_nan() || scale2 <= 0.0 {
            return lognormal_exceedance(self.mu_n, 0.0, deadline_ms);
        }
        student_t_sf(
            (deadline_ms.ln() - self.mu_n) / scale2.sqrt(),
            2.0 * self.alpha_n,
        )
    }

    /// Plug-in `P(L > d)` at the point estimate (μn, sqrt(E[σ²])): a log-normal that ignores
    /// the posterior's uncertainty and underestimates far tails when data are few.
    #[must_use]
    pub fn point_exceedance(&self, deadline_ms: f64) -> f64 {
        let (mu, sigma) = self.point();
        lognormal_exceedance(mu, sigma, deadline_ms)
    }

    /// Mean and variance of `ln L` given `L ≥ cutoff`, at the point estimate: the imputation
    /// of a censored observation.
    #[must_use]
    pub fn censored_moments(&self, cutoff_ms: f64) -> (f64, f64) {
        let (mu, sigma) = self.point();
        truncated_normal_moments(mu, sigma, cutoff_ms.max(1e-3).ln())
    }

    /// Median latency in ms at the point estimate.
    #[must_use]
    pub fn median_ms(&self) -> f64 {
        self.mu_n.exp()
    }
}

/// `P(bad) = P(fail) + (1 − P(fail))·P(L > d)`.
#[must_use]
pub fn bad_outcome_probability(failure: f64, exceedance: f64) -> f64 {
    failure + (1.0 - failure) * exceedance
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_outcome_example_from_the_reference() {
        // 2% + (1 − 2%)·5% = 6.9%
        assert!((bad_outcome_probability(0.02, 0.05) - 0.069).abs() < 1e-15);
    }

    #[test]
    fn posterior_formulas_by_hand() {
        // Two latencies e^1 and e^3 ms: n = 2, meanLog = 2, deviationSum = 2.
        let s = LogLatencyStats::from_latencies(&[1f64.exp(), 3f64.exp()]);
        assert!((s.mean_log - 2.0).abs() < 1e-12 && (s.deviation_sum - 2.0).abs() < 1e-12);
        let prior = NigPrior {
            mu0: 0.0,
            kappa0: 1.0,
            alpha0: 2.0,
            beta0: 1.0,
        };
        let p = s.posterior(&prior);
        // κn = 3, μn = (0 + 2·2)/3 = 4/3, αn = 3, βn = 1 + 1 + 1·2·4/(2·3) = 10/3.
        assert!((p.kappa_n - 3.0).abs() < 1e-12);
        assert!((p.mu_n - 4.0 / 3.0).abs() < 1e-12);
        assert!((p.alpha_n - 3.0).abs() < 1e-12);
        assert!((p.beta_n - 10.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn late_observations_give_the_same_sums_whatever_the_order() {
        let h = Some(800.0);
        let events = [(0.0, 120.0), (300.0, 80.0), (2000.0, 450.0), (1100.0, 95.0)];
        let mut in_order = LogLatencyStats::default();
        for (t, l) in [events[0], events[1], events[3], events[2]] {
            in_order.observe(Timestamp(t), l, h);
        }
        let mut shuffled = LogLatencyStats::default();
        for (t, l) in [events[2], events[3], events[0], events[1]] {
            shuffled.observe(Timestamp(t), l, h);
        }
        assert_eq!(shuffled.count, 4);
        assert!((shuffled.weight - in_order.weight).abs() < 1e-12);
        assert!((shuffled.mean_log - in_order.mean_log).abs() < 1e-12);
        assert!((shuffled.deviation_sum - in_order.deviation_sum).abs() < 1e-12);
    }

    #[test]
    fn the_predictive_tail_is_fatter_than_the_plug_in_with_few_observations() {
        // Seven latencies around 1 s (log-deviations ±0.9, ±0.6, ±0.34, 0) under the default
        // prior: κn = 8, αn = 5.5, βn = 0.5 + 0.5·2.5712 = 1.7856, μn = ln 1000.
        let s = LogLatencyStats::from_latencies(
            &[-0.9, -0.6, -0.34, 0.0, 0.34, 0.6, 0.9].map(|d: f64| 1000.0 * d.exp()),
        );
        let p = s.posterior(&NigPrior::default());
        assert!((p.alpha_n - 5.5).abs() < 1e-12 && (p.beta_n - 1.7856).abs() < 1e-12);
        let five_medians = 5.0 * p.median_ms();
        // Plug-in: σ² = βn/(αn−1) = 0.3968, P(Z > ln 5/0.6299) = 0.0053.
        let plug_in = p.point_exceedance(five_medians);
        // Predictive: t with 11 degrees of freedom, scale² = 1.7856·9/(5.5·8) = 0.3652,
        // P(T > ln 5/0.6044) = 0.0110: about twice the plug-in. (Issue 23 quotes 0.0103 for
        // the same plug-in; with this prior the predictive is 0.0110, and 0.0103 would take
        // κ0 ≈ 4.)
        let predictive = p.predictive_exceedance(five_medians);
        assert!((plug_in - 0.0053).abs() < 5e-5, "{plug_in}");
        assert!((predictive - 0.0110).abs() < 5e-5, "{predictive}");
        // The Thompson draws average to the predictive, not to the plug-in.
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(7);
        let n = 200_000;
        let mean = (0..n)
            .map(|_| p.sampled_exceedance(five_medians, &mut rng))
            .sum::<f64>()
            / f64::from(n);
        assert!((mean - predictive).abs() < 4e-4, "{mean} vs {predictive}");
        // With many observations the two agree.
        let many: Vec<f64> = (0..2000)
            .map(|i| 1000.0 * (0.6 * ((f64::from(i) + 0.5) / 2000.0 - 0.5)).exp())
            .collect();
        let p = LogLatencyStats::from_latencies(&many).posterior(&NigPrior::default());
        let d = 1.4 * p.median_ms();
        assert!((p.point_exceedance(d) / p.predictive_exceedance(d) - 1.0).abs() < 0.01);
    }

    #[test]
    fn a_merge_of_a_scaled_view_is_the_merge_of_a_scaled_copy_to_the_bit() {
        let h = Some(700.0);
        let mut a = LogLatencyStats::default();
        let mut b = LogLatencyStats::default();
        for (t, l) in [(0.0, 120.0), (150.0, 35.0), (400.0, 900.0)] {
            a.observe(Timestamp(t), l, h);
        }
        for (t, l) in [(50.0, 80.0), (90.0, 2500.0), (260.0, 11.0)] {
            b.observe(Timestamp(t), l, h);
        }
        // `pre` brings b to 300 ms; the merge then decays it again to a's 400 ms.
        let f = decay_factor(h, 300.0 - 260.0);
        let mut copy = b;
        copy.scale(f);
        copy.at = Timestamp(300.0);
        let mut want = a;
        want.merge(&copy, h);
        let mut got = a;
        got.merge_scaled(&b, Some((f, Timestamp(300.0))), h, true);
        assert_eq!(got, want);
        assert!(got.shape.mass.iter().any(|&m| m > 0.0));
        // Without the histogram: the same sums, the histogram untouched.
        let mut sums = a;
        sums.merge_scaled(&b, Some((f, Timestamp(300.0))), h, false);
        assert_eq!(
            (sums.weight, sums.mean_log, sums.deviation_sum, sums.count),
            (want.weight, want.mean_log, want.deviation_sum, want.count)
        );
        assert_eq!(sums.shape, a.shape);
    }

    #[test]
    fn a_scaled_copy_is_a_copy_scaled_to_the_bit() {
        let h = Some(700.0);
        let mut a = LogLatencyStats::default();
        for (t, l) in [(0.0, 120.0), (150.0, 35.0), (400.0, 900.0), (420.0, 3.0)] {
            a.observe(Timestamp(t), l, h);
        }
        let f = decay_factor(h, 333.0);
        let mut want = a;
        want.scale_parts(f, true);
        want.at = Timestamp(733.0);
        assert_eq!(a.scaled(f, Timestamp(733.0), true), want);
        assert!(want.shape.mass.iter().filter(|&&m| m > 0.0).count() >= 3);
        // Without the histogram: the same sums, counts and time, and an empty histogram.
        let sums = a.scaled(f, Timestamp(733.0), false);
        assert_eq!(
            LogLatencyStats {
                shape: want.shape,
                ..sums
            },
            want
        );
        assert_eq!(sums.shape, LatencyHistogram::default());
    }

    #[test]
    fn decay_halves_the_weight_after_one_half_life() {
        let mut s = LogLatencyStats::default();
        s.observe(Timestamp(0.0), 100.0, Some(1000.0));
        s.decay_to(Timestamp(1000.0), Some(1000.0));
        assert!((s.weight - 0.5).abs() < 1e-12);
        assert!((s.mean_log - 100f64.ln()).abs() < 1e-12);
    }
}
