//! Latency distributions: log-normal given a median and a 95th percentile.

use equiroute_core::estimators::dist::normal_cdf;
use rand::RngCore;
use rand_distr::{Distribution, StandardNormal};

/// `z` of the 95th percentile of the standard normal.
const Z95: f64 = 1.644_853_626_951_472_2;

/// A log-normal latency distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogNormal {
    pub mu: f64,
    pub sigma: f64,
}

impl LogNormal {
    /// The log-normal with median `p50` and 95th percentile `p95` (ms).
    #[must_use]
    pub fn from_p50_p95(p50: f64, p95: f64) -> LogNormal {
        LogNormal {
            mu: p50.ln(),
            sigma: ((p95 / p50).ln() / Z95).max(0.0),
        }
    }

    /// The same distribution with every latency multiplied by `factor`.
    #[must_use]
    pub fn scaled(&self, factor: f64) -> LogNormal {
        LogNormal {
            mu: self.mu + factor.ln(),
            sigma: self.sigma,
        }
    }

    /// One latency in ms.
    pub fn sample(&self, rng: &mut dyn RngCore) -> f64 {
        let z: f64 = StandardNormal.sample(rng);
        (self.mu + self.sigma * z).exp()
    }

    /// `P(L ≤ x)`.
    #[must_use]
    pub fn cdf(&self, x: f64) -> f64 {
        if x <= 0.0 {
            0.0
        } else if self.sigma == 0.0 {
            if x.ln() >= self.mu {
                1.0
            } else {
                0.0
            }
        } else {
            normal_cdf((x.ln() - self.mu) / self.sigma)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn percentiles_come_out_as_configured() {
        let d = LogNormal::from_p50_p95(316.0, 400.0);
        assert!((d.cdf(316.0) - 0.5).abs() < 1e-12);
        assert!((d.cdf(400.0) - 0.95).abs() < 1e-9);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut xs: Vec<f64> = (0..20_000).map(|_| d.sample(&mut rng)).collect();
        xs.sort_by(f64::total_cmp);
        assert!(
            (xs[10_000] / 316.0 - 1.0).abs() < 0.01,
            "median {}",
            xs[10_000]
        );
        assert!(
            (xs[19_000] / 400.0 - 1.0).abs() < 0.01,
            "p95 {}",
            xs[19_000]
        );
    }
}
