//! Distributions used by the policies: the standard normal CDF and tail, Student's t tail
//! (the posterior predictive of a log-latency), and the truncated-normal moments used to
//! impute censored observations.

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

/// Upper tail `P(T > t)` of Student's t with `nu` degrees of freedom, through the regularised
/// incomplete beta function: `P(T > t) = ½·I_{ν/(ν+t²)}(ν/2, ½)` for `t ≥ 0`.
#[must_use]
pub fn student_t_sf(t: f64, nu: f64) -> f64 {
    if t.is_nan() || nu.is_nan() || nu <= 0.0 {
        return f64::NAN;
    }
    if t.is_infinite() {
        return if t > 0.0 { 0.0 } else { 1.0 };
    }
    let tail = 0.5 * regularized_incomplete_beta(0.5 * nu, 0.5, nu / (nu + t * t));
    if t >= 0.0 {
        tail
    } else {
        1.0 - tail
    }
}

/// Regularised incomplete beta `I_x(a, b)` by Lentz's continued fraction (Numerical Recipes
/// `betai`), accurate to about 1e-14 for the moderate `a`, `b` used here.
fn regularized_incomplete_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front =
        libm::lgamma(a + b) - libm::lgamma(a) - libm::lgamma(b) + a * x.ln() + b * (1.0 - x).ln();
    // The fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_continued_fraction(a, b, x) / a
    } else {
        1.0 - ln_front.exp() * beta_continued_fraction(b, a, 1.0 - x) / b
    }
}

fn beta_continued_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        let aa = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 + aa * d;
        d = if d.abs() < TINY { TINY } else { d };
        c = 1.0 + aa / c;
        c = if c.abs() < TINY { TINY } else { c };
        d = 1.0 / d;
        h *= d * c;
        let aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 + aa * d;
        d = if d.abs() < TINY { TINY } else { d };
        c = 1.0 + aa / c;
        c = if c.abs() < TINY { TINY } else { c };
        d = 1.0 / d;
        let step = d * c;
        h *= step;
        if (step - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
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
    fn student_t_tail_known_values() {
        // Tabulated quantiles: t(0.975; 1) = 12.706, t(0.95; 10) = 1.8125, t(0.99; 11) = 2.718.
        assert!((student_t_sf(12.706_204_736_174_7, 1.0) - 0.025).abs() < 1e-12);
        assert!((student_t_sf(1.812_461_122_811_676, 10.0) - 0.05).abs() < 1e-12);
        let v = student_t_sf(2.718_079_183_921_44, 11.0);
        assert!((v - 0.01).abs() < 1e-9, "{v}");
        // Cauchy (ν = 1): P(T > 1) = ¼; symmetric; many degrees of freedom approach the normal.
        assert!((student_t_sf(1.0, 1.0) - 0.25).abs() < 1e-14);
        assert!((student_t_sf(-1.0, 1.0) - 0.75).abs() < 1e-14);
        assert!((student_t_sf(0.0, 7.0) - 0.5).abs() < 1e-15);
        assert!((student_t_sf(2.0, 1e6) / normal_sf(2.0) - 1.0).abs() < 1e-4);
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
