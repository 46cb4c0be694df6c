//! Calibration of a policy's deadline-miss estimate: for each request with a deadline, the
//! policy's point estimate of `P(latency > deadline)` for its first choice against whether
//! that first attempt ran past the deadline. Attempts that failed (5xx, 429, connection
//! failure) carry no latency verdict and are left out; so is a first choice the breaker
//! refused.
//!
//! The predictions are sorted and cut into ten equal-count groups (deciles of the
//! prediction); each group's mean prediction is compared with its observed miss rate. The
//! expected calibration error is the count-weighted mean gap,
//! `ECE = Σ_b (n_b/N)·|mean predicted_b − observed rate_b|`.

use serde::{Deserialize, Serialize};

/// Number of groups.
pub const DECILES: usize = 10;

/// One decile of the predictions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationBin {
    /// Mean predicted `P(latency > deadline)`.
    pub predicted: f64,
    /// Share of the group's first attempts that ran past the deadline.
    pub observed: f64,
    pub count: usize,
}

/// The calibration of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Predictions scored.
    pub count: usize,
    /// Mean prediction and observed rate over all of them.
    pub predicted: f64,
    pub observed: f64,
    /// Expected calibration error over the deciles.
    pub ece: f64,
    pub deciles: Vec<CalibrationBin>,
}

impl Calibration {
    /// The calibration of `(prediction, missed)` pairs; `None` when there are none.
    #[must_use]
    pub fn of(pairs: &mut [(f64, bool)]) -> Option<Calibration> {
        let n = pairs.len();
        if n == 0 {
            return None;
        }
        pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut deciles = Vec::with_capacity(DECILES);
        let mut ece = 0.0;
        for b in 0..DECILES {
            let group = &pairs[b * n / DECILES..(b + 1) * n / DECILES];
            if group.is_empty() {
                continue;
            }
            let count = group.len();
            let predicted = group.iter().map(|p| p.0).sum::<f64>() / count as f64;
            let observed = group.iter().filter(|p| p.1).count() as f64 / count as f64;
            ece += count as f64 / n as f64 * (predicted - observed).abs();
            deciles.push(CalibrationBin {
                predicted,
                observed,
                count,
            });
        }
        Some(Calibration {
            count: n,
            predicted: pairs.iter().map(|p| p.0).sum::<f64>() / n as f64,
            observed: pairs.iter().filter(|p| p.1).count() as f64 / n as f64,
            ece,
            deciles,
        })
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // exact bin values, by construction
mod tests {
    use super::*;

    #[test]
    fn deciles_and_the_expected_calibration_error_by_hand() {
        // 20 predictions: ten at 0.25, every other one a miss (observed 0.5), then ten at
        // 0.75, all misses (observed 1.0). Two per decile, each decile 0.25 off: ECE = 0.25.
        let mut pairs: Vec<(f64, bool)> = (0..10)
            .map(|i| (0.25, i % 2 == 0))
            .chain((0..10).map(|_| (0.75, true)))
            .collect();
        let c = Calibration::of(&mut pairs).unwrap_or_default();
        assert_eq!(c.count, 20);
        assert_eq!(c.deciles.len(), 10);
        assert!(c.deciles.iter().all(|d| d.count == 2));
        assert!(c.deciles[..5].iter().all(|d| d.observed == 0.5));
        assert!(c.deciles[5..].iter().all(|d| d.observed == 1.0));
        assert!((c.ece - 0.25).abs() < 1e-12, "{}", c.ece);
        assert!((c.predicted - 0.5).abs() < 1e-12 && (c.observed - 0.75).abs() < 1e-12);
        assert!(Calibration::of(&mut []).is_none());
    }
}
