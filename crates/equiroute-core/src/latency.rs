//! Latency shapes of a simulated provider, shared by the laboratory's world and the gateway's
//! `sim` provider: the distributions (log-normal given a median and a 95th percentile, a
//! log-normal body with a Pareto tail, and mixtures of log-normals) and their TOML spec types.

use crate::estimators::dist::normal_cdf;
use rand::{Rng, RngCore};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

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

/// The standard normal quantile `Φ⁻¹(p)` for `p` in (0, 1), by bisection on the CDF (computed
/// once per distribution, so speed does not matter).
fn normal_quantile(p: f64) -> f64 {
    let (mut lo, mut hi) = (-40.0f64, 40.0f64);
    for _ in 0..200 {
        let mid = f64::midpoint(lo, hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    f64::midpoint(lo, hi)
}

/// A log-normal body with a Pareto tail: below the body's `from_quantile` quantile `x₀` the
/// distribution is the log-normal; beyond it, `P(L > x) = (1 − q₀)·(x₀/x)^shape`. With
/// `q₀ ≥ 0.95` the median and the 95th percentile are the body's; the tail only makes rare
/// latencies far longer than a log-normal would.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParetoTail {
    pub body: LogNormal,
    /// `q₀`: the share of calls drawn from the body.
    pub from_quantile: f64,
    /// `x₀`: where the tail starts, in ms.
    pub threshold_ms: f64,
    /// The Pareto shape (tail index) `α`: smaller is heavier; the mean is finite for `α > 1`.
    pub shape: f64,
}

impl ParetoTail {
    /// The body `LogNormal::from_p50_p95(p50, p95)` with a tail of `shape` beyond its
    /// `from_quantile` quantile.
    #[must_use]
    pub fn new(p50: f64, p95: f64, shape: f64, from_quantile: f64) -> ParetoTail {
        let body = LogNormal::from_p50_p95(p50, p95);
        ParetoTail {
            body,
            from_quantile,
            threshold_ms: (body.mu + body.sigma * normal_quantile(from_quantile)).exp(),
            shape,
        }
    }
}

/// The latency distribution of a simulated provider.
#[derive(Clone, Debug, PartialEq)]
pub enum LatencyModel {
    LogNormal(LogNormal),
    ParetoTail(ParetoTail),
    /// Components with weights summing to 1 (e.g. fast cache hits and slow misses).
    Mixture(Vec<(f64, LogNormal)>),
}

impl LatencyModel {
    /// The same distribution with every latency multiplied by `factor`.
    #[must_use]
    pub fn scaled(&self, factor: f64) -> LatencyModel {
        match self {
            LatencyModel::LogNormal(d) => LatencyModel::LogNormal(d.scaled(factor)),
            LatencyModel::ParetoTail(t) => LatencyModel::ParetoTail(ParetoTail {
                body: t.body.scaled(factor),
                threshold_ms: t.threshold_ms * factor,
                ..*t
            }),
            LatencyModel::Mixture(parts) => {
                LatencyModel::Mixture(parts.iter().map(|(w, d)| (*w, d.scaled(factor))).collect())
            }
        }
    }

    /// One latency in ms.
    pub fn sample(&self, rng: &mut dyn RngCore) -> f64 {
        match self {
            LatencyModel::LogNormal(d) => d.sample(rng),
            LatencyModel::ParetoTail(t) => {
                // A body draw beyond x₀ happens with probability exactly 1 − q₀; it is replaced
                // by a draw from the tail's conditional law, x₀·V^(−1/α) with V uniform on (0, 1].
                let x = t.body.sample(rng);
                if x <= t.threshold_ms {
                    x
                } else {
                    let v = 1.0 - rng.random::<f64>();
                    t.threshold_ms * v.powf(-1.0 / t.shape)
                }
            }
            LatencyModel::Mixture(parts) => {
                let mut u = rng.random::<f64>();
                for (w, d) in parts {
                    if u < *w {
                        return d.sample(rng);
                    }
                    u -= w;
                }
                parts.last().map_or(0.0, |(_, d)| d.sample(rng))
            }
        }
    }

    /// `P(L ≤ x)`.
    #[must_use]
    pub fn cdf(&self, x: f64) -> f64 {
        match self {
            LatencyModel::LogNormal(d) => d.cdf(x),
            LatencyModel::ParetoTail(t) => {
                if x <= t.threshold_ms {
                    t.body.cdf(x)
                } else {
                    1.0 - (1.0 - t.from_quantile) * (t.threshold_ms / x).powf(t.shape)
                }
            }
            LatencyModel::Mixture(parts) => parts.iter().map(|(w, d)| w * d.cdf(x)).sum(),
        }
    }
}

/// Latency of a provider: log-normal with the given median and 95th percentile.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencySpec {
    pub p50_ms: f64,
    pub p95_ms: f64,
}

/// The latency of a simulated provider as written: a log-normal by `p50_ms` and `p95_ms`,
/// optionally with a Pareto `tail`; or a `mixture` of log-normal components instead.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyShapeSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p95_ms: Option<f64>,
    /// Beyond the body's `from_quantile` quantile, a Pareto tail of this `shape`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<ParetoTailSpec>,
    /// Log-normal components with weights summing to 1; replaces `p50_ms`/`p95_ms`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mixture: Vec<LatencyComponentSpec>,
}

/// A Pareto tail on a log-normal body: `P(L > x) = (1 − from_quantile)·(x₀/x)^shape` beyond the
/// body's `from_quantile` quantile `x₀`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParetoTailSpec {
    /// The tail index `α` (> 1, so the mean is finite): 1.1 is very heavy, 3 is mild.
    pub shape: f64,
    /// Where the tail starts, as a quantile of the body (default 0.95: p50 and p95 stay exact).
    #[serde(default = "default_tail_quantile")]
    pub from_quantile: f64,
}

fn default_tail_quantile() -> f64 {
    0.95
}

/// One component of a latency mixture.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyComponentSpec {
    pub weight: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
}

impl LatencyShapeSpec {
    /// A plain log-normal.
    #[must_use]
    pub fn log_normal(p50_ms: f64, p95_ms: f64) -> LatencyShapeSpec {
        LatencyShapeSpec {
            p50_ms: Some(p50_ms),
            p95_ms: Some(p95_ms),
            ..LatencyShapeSpec::default()
        }
    }

    /// Checks the shape; returns the sub-field (after `latency`) and the fix.
    ///
    /// # Errors
    /// The first sub-field out of range (`""` for the table itself) and what it must be.
    pub fn check(&self) -> Result<(), (String, String)> {
        let fix = |f: &str, m: &str| Err((f.to_owned(), m.to_owned()));
        if !self.mixture.is_empty() {
            if self.p50_ms.is_some() || self.p95_ms.is_some() || self.tail.is_some() {
                return fix(
                    "",
                    "give either `mixture` or `p50_ms`/`p95_ms` (with an optional `tail`), not both",
                );
            }
            for (n, c) in self.mixture.iter().enumerate() {
                if !(c.weight.is_finite() && c.weight > 0.0) {
                    return fix(
                        &format!(".mixture[{n}].weight"),
                        "must be a positive number",
                    );
                }
                if let Err(m) = check_latency(&LatencySpec {
                    p50_ms: c.p50_ms,
                    p95_ms: c.p95_ms,
                }) {
                    return fix(&format!(".mixture[{n}]"), m);
                }
            }
            let total: f64 = self.mixture.iter().map(|c| c.weight).sum();
            if (total - 1.0).abs() > 1e-6 {
                return Err((
                    ".mixture".to_owned(),
                    format!("the weights must sum to 1 (they sum to {total}); they are not normalised for you"),
                ));
            }
            return Ok(());
        }
        let (Some(p50_ms), Some(p95_ms)) = (self.p50_ms, self.p95_ms) else {
            return fix(
                "",
                "give `p50_ms` and `p95_ms` (a log-normal), or `mixture = [{ weight, p50_ms, p95_ms }, ...]`",
            );
        };
        check_latency(&LatencySpec { p50_ms, p95_ms }).or_else(|m| fix("", m))?;
        if let Some(t) = self.tail {
            if !(t.shape.is_finite() && t.shape > 1.0) {
                return fix(
                    ".tail.shape",
                    "must be a number above 1 (a finite mean); 1.1 is very heavy, 3 is mild",
                );
            }
            if !(0.5..=0.999).contains(&t.from_quantile) {
                return fix(
                    ".tail.from_quantile",
                    "must be between 0.5 and 0.999 (0.95 keeps p50_ms and p95_ms exact)",
                );
            }
        }
        Ok(())
    }

    /// The distribution (for a validated spec; a missing median or 95th percentile counts as 1 ms
    /// and mixture weights are normalised).
    #[must_use]
    pub fn model(&self) -> LatencyModel {
        if !self.mixture.is_empty() {
            let total: f64 = self.mixture.iter().map(|c| c.weight).sum();
            return LatencyModel::Mixture(
                self.mixture
                    .iter()
                    .map(|c| {
                        (
                            c.weight / total,
                            LogNormal::from_p50_p95(c.p50_ms, c.p95_ms),
                        )
                    })
                    .collect(),
            );
        }
        let (p50, p95) = (self.p50_ms.unwrap_or(1.0), self.p95_ms.unwrap_or(1.0));
        match self.tail {
            Some(t) => {
                LatencyModel::ParetoTail(ParetoTail::new(p50, p95, t.shape, t.from_quantile))
            }
            None => LatencyModel::LogNormal(LogNormal::from_p50_p95(p50, p95)),
        }
    }
}

/// Checks a log-normal's median and 95th percentile; the fix otherwise.
///
/// # Errors
/// The fix when `p50_ms` is not positive or `p95_ms` is below it or not finite.
pub fn check_latency(l: &LatencySpec) -> Result<(), &'static str> {
    if l.p50_ms > 0.0 && l.p95_ms >= l.p50_ms && l.p95_ms.is_finite() {
        Ok(())
    } else {
        Err("needs 0 < p50_ms ≤ p95_ms")
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

    /// Share of `n` samples at or below `x`.
    fn share_below(d: &LatencyModel, x: f64, n: usize, seed: u64) -> f64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).filter(|_| d.sample(&mut rng) <= x).count() as f64 / n as f64
    }

    #[test]
    fn a_pareto_tail_keeps_p50_and_p95_and_decays_as_a_power_law() {
        // Tail from the 95th percentile with shape 1.5: P(L > x) = 0.05·(400/x)^1.5 beyond
        // p95 = 400 ms, so P(L > 1600) = 0.05·(1/4)^1.5 = 0.00625 (a log-normal: 1.7e-10).
        let d = LatencyModel::ParetoTail(ParetoTail::new(316.0, 400.0, 1.5, 0.95));
        assert!((d.cdf(316.0) - 0.5).abs() < 1e-9);
        assert!((d.cdf(400.0) - 0.95).abs() < 1e-9);
        assert!((1.0 - d.cdf(1600.0) - 0.00625).abs() < 1e-9);
        let n = 200_000;
        assert!((share_below(&d, 316.0, n, 2) - 0.5).abs() < 0.005);
        assert!((1.0 - share_below(&d, 1600.0, n, 3) - 0.00625).abs() < 0.001);
        // From the 80th percentile x₀ = exp(μ + σ·0.8416): P(L > 2·x₀) = 0.2·2^−1.3 = 0.0812.
        let t = ParetoTail::new(300.0, 700.0, 1.3, 0.8);
        let sigma = (700.0f64 / 300.0).ln() / Z95;
        assert!((t.threshold_ms - 300.0 * (sigma * 0.841_621).exp()).abs() < 0.01);
        let d = LatencyModel::ParetoTail(t);
        assert!((1.0 - d.cdf(2.0 * t.threshold_ms) - 0.2 * 2f64.powf(-1.3)).abs() < 1e-9);
        let scaled = d.scaled(2.0);
        assert!((scaled.cdf(4.0 * t.threshold_ms) - d.cdf(2.0 * t.threshold_ms)).abs() < 1e-12);
    }

    #[test]
    fn a_mixture_draws_each_component_by_its_weight() {
        // 70% around 80 ms, 30% around 2500 ms: 70% of calls under 1000 ms (each component has
        // under 0.1% of its mass on the other side of 1000 ms).
        let d = LatencyModel::Mixture(vec![
            (0.7, LogNormal::from_p50_p95(80.0, 150.0)),
            (0.3, LogNormal::from_p50_p95(2500.0, 4000.0)),
        ]);
        assert!((d.cdf(1000.0) - 0.7).abs() < 1e-3);
        // The overall median is in the fast mode: P(L ≤ 80) = 0.7·0.5 = 0.35.
        assert!((d.cdf(80.0) - 0.35).abs() < 1e-6);
        assert!((share_below(&d, 1000.0, 100_000, 4) - 0.7).abs() < 0.005);
        assert!((share_below(&d.scaled(2.0), 2000.0, 100_000, 5) - 0.7).abs() < 0.005);
    }
}
