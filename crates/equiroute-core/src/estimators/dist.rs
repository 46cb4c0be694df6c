//! Distributions used by the policies: the standard normal CDF and tail, and the
//! truncated-normal moments used to impute censored observations.

/// Standard normal CDF Φ(z), accurate to double precision in both tails (via `erfc`).
#[must_use]
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z / std::f64::consts::SQRT_2)
}

/// Standard normal upper tail 1 − Φ(z), accurate where Φ(z) is close to 1.
#[must_use]
pub fn normal_sf(z: f64) -> f64 {
    0.5 * libm::erfc(z / std::f64::consts::SQRT_2)
}

/// Standard normal density φ(z).
#[must_use]
pub fn normal_pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Probability that a log-normal latency with log-mean `mu` and log-sd `sigma` exceeds
/// `deadline_ms`: `1 − Φ((ln d − μ)/σ)`.
#[must_use]
pub fn lognormal_exceedance(mu: f64, sigma: f64, deadline_ms: f64) -> f64 {
    if deadline_ms <= 0.0 {
        return 1.0;
    }
    if sigma <= 0.0 {
        return if deadline_ms.ln() < mu { 1.0 } else { 0.0 };
    }
    normal_sf((deadline_ms.ln() - mu) / sigma)
}

/// Mean and variance of `Y | Y > c` for `Y ~ N(mu, sigma²)`: the moments used to impute a
/// censored observation ("at least c") instead of recording it as c or dropping it.
#[must_use]
pub fn truncated_normal_moments(mu: f64, sigma: f64, c: f64) -> (f64, f64) {
    let a = (c - mu) / sigma;
    let tail = normal_sf(a);
    // Inverse Mills ratio φ(a)/Q(a); its asymptote a + 1/a where Q underflows.
    let mills = if tail > 1e-300 && a < 35.0 {
        normal_pdf(a) / tail
    } else {
        a + 1.0 / a
    };
    let mean = mu + sigma * mills;
    let var_factor = (1.0 + a * mills - mills * mills).clamp(0.0, 1.0);
    (mean, sigma * sigma * var_factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_cdf_known_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-16);
        assert!((normal_cdf(1.959_963_984_540_054) - 0.975).abs() < 1e-15);
        assert!((normal_sf(1.281_551_565_544_600_4) - 0.1).abs() < 1e-15);
        // Far tail keeps relative accuracy.
        assert!((normal_sf(10.0) / 7.619_853_024_160_526e-24 - 1.0).abs() < 1e-12);
    }

    #[test]
    fn truncated_moments_match_the_closed_form_at_zero() {
        // Y ~ N(0,1), Y > 0: mean sqrt(2/π), variance 1 − 2/π.
        let (m, v) = truncated_normal_moments(0.0, 1.0, 0.0);
        assert!((m - (2.0 / std::f64::consts::PI).sqrt()).abs() < 1e-14);
        assert!((v - (1.0 - 2.0 / std::f64::consts::PI)).abs() < 1e-14);
        // Deep in the tail the conditional mean sits just above the cut.
        let (m, v) = truncated_normal_moments(0.0, 1.0, 40.0);
        assert!(m > 40.0 && m < 40.1 && v >= 0.0);
    }
}
