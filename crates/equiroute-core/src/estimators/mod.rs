//! Estimators: the statistics policies learn from. Each is small, serialisable and mergeable
//! where the policy needs it to be shared across gateway instances.
//!
//! - [`ewma`]: time-decayed failure rate (an EWMA over provider-side failures) and the
//!   latency EMA of LQM-ContextRoute.
//! - [`nig`]: Normal-Inverse-Gamma posterior over ln(latency) from decayed sufficient
//!   statistics, with censored observations and deadline-miss probabilities.
//! - [`histogram`]: a bounded log-latency histogram per slice, and [`shape`]: its blend with
//!   the NIG posterior, so that `P(latency > deadline)` stays calibrated on mixtures and
//!   heavy tails.
//! - [`linucb`]: a LinUCB quality head kept as `A⁻¹` with Sherman–Morrison updates and
//!   sliding-window downdates.
//! - [`shift`]: a two-sided CUSUM on a candidate's quality residuals (change detection).
//! - [`linalg`] and [`dist`]: the small numerical kernels those need.

pub mod dist;
pub mod ewma;
pub mod histogram;
pub mod linalg;
pub mod linucb;
pub mod nig;
pub mod shape;
pub mod shift;

/// The factor by which a statistic with half-life `half_life_ms` decays over `elapsed_ms`.
/// A half-life of `None` (or not positive) means no decay.
#[must_use]
pub fn decay_factor(half_life_ms: Option<f64>, elapsed_ms: f64) -> f64 {
    match half_life_ms {
        Some(h) if h > 0.0 && elapsed_ms > 0.0 => (-std::f64::consts::LN_2 * elapsed_ms / h).exp(),
        _ => 1.0,
    }
}
