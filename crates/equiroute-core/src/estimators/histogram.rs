//! A bounded histogram of `ln(latency)` kept next to the Normal-Inverse-Gamma sums: the
//! empirical shape that [`super::shape`] blends with the NIG posterior.
//!
//! **Histogram.** [`BINS`] fixed bins half an octave wide (a factor √2), from 4 ms to 131 s
//! with an open bin at each end: 256 bytes per slice whatever the traffic. The bins are the
//! same everywhere, so histograms decay and merge exactly like the NIG sums (multiply by the
//! decay factor, add): two instances' histograms add up to the histogram of the union.
//! A censored observation ("at least `c`") is spread over the bins above `c` in proportion to
//! the current log-normal point estimate truncated at `c`, as the NIG sums impute it.

use super::dist::normal_cdf;
use serde::{Deserialize, Serialize};

/// Number of histogram bins.
pub const BINS: usize = 32;
/// `ln` of the upper edge of the first bin (4 ms).
const FIRST_EDGE: f64 = 1.386_294_361_119_890_6;
/// Bin width in `ln` units: half an octave.
const WIDTH: f64 = 0.5 * std::f64::consts::LN_2;

/// Decayed mass of `ln(latency)` per fixed bin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    pub mass: [f64; BINS],
}

/// `ln` of the lower edge of bin `j` (−∞ for the first).
fn lower_edge(j: usize) -> f64 {
    if j == 0 {
        f64::NEG_INFINITY
    } else {
        FIRST_EDGE + (j - 1) as f64 * WIDTH
    }
}

/// `ln` of the upper edge of bin `j` (+∞ for the last).
fn upper_edge(j: usize) -> f64 {
    if j + 1 >= BINS {
        f64::INFINITY
    } else {
        FIRST_EDGE + j as f64 * WIDTH
    }
}

/// The bin of log-latency `y`.
fn bin_of(y: f64) -> usize {
    if y.is_nan() || y < FIRST_EDGE {
        return 0;
    }
    (((y - FIRST_EDGE) / WIDTH).floor() as usize + 1).min(BINS - 1)
}

/// `P(lo < Y ≤ hi)` for `Y ~ N(mu, sigma²)`.
fn normal_mass(mu: f64, sigma: f64, lo: f64, hi: f64) -> f64 {
    if sigma <= 0.0 {
        return if lo < mu && mu <= hi { 1.0 } else { 0.0 };
    }
    let cdf = |x: f64| {
        if x == f64::INFINITY {
            1.0
        } else if x == f64::NEG_INFINITY {
            0.0
        } else {
            normal_cdf((x - mu) / sigma)
        }
    };
    (cdf(hi) - cdf(lo)).max(0.0)
}

impl LatencyHistogram {
    /// No mass at all (a state saved before histograms existed, or a new slice).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.mass.iter().all(|&m| m == 0.0)
    }

    /// Total mass `M`.
    #[must_use]
    pub fn total(&self) -> f64 {
        self.mass.iter().sum()
    }

    /// Adds log-latency `y` with weight `w`.
    pub fn add(&mut self, y: f64, w: f64) {
        self.mass[bin_of(y)] += w;
    }

    /// Adds weight `w` spread over `ln L > cut` as `N(mu, sigma²)` truncated at `cut`: a
    /// censored observation. The share that falls in the cut's own bin goes to the bin above
    /// it, so that a query at the cut counts the whole observation as a miss (deadlines
    /// repeat; within the bin a later query may count it too early, never too late); where
    /// the normal has no mass left above `cut`, all of it goes there.
    pub fn add_above(&mut self, cut: f64, mu: f64, sigma: f64, w: f64) {
        let first = bin_of(cut);
        let next = (first + 1).min(BINS - 1);
        let total = normal_mass(mu, sigma, cut, f64::INFINITY);
        if total.is_nan() || total <= 1e-300 {
            self.mass[next] += w;
            return;
        }
        for j in first..BINS {
            let part = normal_mass(mu, sigma, lower_edge(j).max(cut), upper_edge(j));
            self.mass[j.max(next)] += w * part / total;
        }
    }

    /// How a censored observation ("at least `e^cut`") spreads over the bins when it follows
    /// the belief's own tail: in proportion to the blend `n₀·N(mu, sigma²) + this histogram`
    /// restricted to `ln L > cut` (the mass of the cut's own bin split by the normal's shape
    /// within it). With `n₀ → 0` this is Efron's redistribution to the right, whose fixed point
    /// is the Kaplan–Meier estimate: the censored mass goes where the observed tail is, not
    /// where a normal fitted to the body would put it. As in [`Self::add_above`], the share of
    /// the cut's own bin goes to the bin above it. `None` when there is no mass above the cut.
    #[must_use]
    pub fn tail_shares(&self, cut: f64, mu: f64, sigma: f64, n0: f64) -> Option<[f64; BINS]> {
        let first = bin_of(cut);
        let next = (first + 1).min(BINS - 1);
        let mut shares = [0.0; BINS];
        for j in first..BINS {
            let (lo, hi) = (lower_edge(j), upper_edge(j));
            let normal = normal_mass(mu, sigma, lo.max(cut), hi);
            let observed = if j == first {
                self.mass[j] * within_bin_share_above(cut, lo, hi, mu, sigma)
            } else {
                self.mass[j]
            };
            shares[j.max(next)] += n0 * normal + observed;
        }
        let total: f64 = shares.iter().sum();
        if !total.is_finite() || total <= 1e-300 {
            return None;
        }
        for m in &mut shares {
            *m /= total;
        }
        Some(shares)
    }

    /// Adds weight `w` spread by `shares` (which sum to 1).
    pub fn add_shares(&mut self, shares: &[f64; BINS], w: f64) {
        for (m, s) in self.mass.iter_mut().zip(shares) {
            *m += w * s;
        }
    }

    /// Multiplies every bin by `factor` (decay, or a capped borrow).
    pub fn scale(&mut self, factor: f64) {
        for m in &mut self.mass {
            *m *= factor;
        }
    }

    /// A copy with every bin times `factor`.
    #[must_use]
    pub fn scaled(&self, factor: f64) -> LatencyHistogram {
        LatencyHistogram {
            mass: self.mass.map(|m| m * factor),
        }
    }

    /// Adds another histogram bin by bin, each of its bins multiplied by `factors` in turn
    /// (none: as it is): the products of scaling a copy once per factor, without the copy.
    pub fn add_scaled(&mut self, other: &LatencyHistogram, factors: &[f64]) {
        let bins = self.mass.iter_mut().zip(&other.mass);
        // The lengths a merge uses spelled out: the general fold alone, a loop per bin, made
        // `merge_scaled` cost ~980 more instructions a request (instructions.sh, 7 December).
        match *factors {
            [] => bins.for_each(|(m, o)| *m += o),
            [f] => bins.for_each(|(m, o)| *m += o * f),
            [f, g] => bins.for_each(|(m, o)| *m += o * f * g),
            _ => bins.for_each(|(m, o)| *m += factors.iter().fold(*o, |v, f| v * f)),
        }
    }

    /// Mass above log-latency `y`; the bin holding `y` is split by `N(mu, sigma²)`'s shape
    /// within it (by its width when the normal has no mass there).
    #[must_use]
    pub fn mass_above(&self, y: f64, mu: f64, sigma: f64) -> f64 {
        let j = bin_of(y);
        let above: f64 = self.mass[j + 1..].iter().sum();
        if self.mass[j] == 0.0 {
            return above;
        }
        let share = within_bin_share_above(y, lower_edge(j), upper_edge(j), mu, sigma);
        above + self.mass[j] * share
    }
}

/// The share of bin `(lo, hi]` above `y`, by `N(mu, sigma²)`'s shape within it (by its width
/// when the normal has no mass there).
fn within_bin_share_above(y: f64, lo: f64, hi: f64, mu: f64, sigma: f64) -> f64 {
    let in_bin = normal_mass(mu, sigma, lo, hi);
    let share = if in_bin > 1e-12 {
        normal_mass(mu, sigma, y, hi) / in_bin
    } else if lo.is_finite() && hi.is_finite() {
        ((hi - y) / WIDTH).clamp(0.0, 1.0)
    } else if hi.is_finite() {
        0.0
    } else {
        1.0
    };
    share.clamp(0.0, 1.0)
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // exact bin values, by construction
mod tests {
    use super::*;

    #[test]
    fn bins_are_half_octaves_from_4_ms() {
        assert_eq!(bin_of(3.9f64.ln()), 0);
        assert_eq!(bin_of(4.0f64.ln() + 1e-12), 1);
        assert_eq!(bin_of(5.7f64.ln()), 2); // 4·√2 = 5.66
        assert_eq!(bin_of(1e9f64.ln()), BINS - 1);
        assert!((upper_edge(BINS - 2).exp() - 4.0 * 2f64.powi(15)).abs() < 1e-6);
        assert_eq!(std::mem::size_of::<LatencyHistogram>(), 256);
    }

    #[test]
    fn a_censored_observation_lands_above_its_cut_off() {
        let mut h = LatencyHistogram::default();
        h.add_above(1500f64.ln(), 300f64.ln(), 0.8, 1.0);
        assert!((h.total() - 1.0).abs() < 1e-12);
        assert!((h.mass_above(1500f64.ln(), 300f64.ln(), 0.8) - 1.0).abs() < 1e-12);
        assert_eq!(h.mass[bin_of(1500f64.ln())], 0.0);
        // Far past the normal's mass: all in the bin above the cut's.
        let mut far = LatencyHistogram::default();
        far.add_above(1e5f64.ln(), 0.0, 0.1, 2.0);
        assert_eq!(far.mass[bin_of(1e5f64.ln()) + 1], 2.0);
    }

    #[test]
    fn a_censored_observation_can_follow_the_observed_tail_instead_of_the_normal() {
        // 90 answers at 300 ms and 10 at 4000 ms; a call cut at 1500 ms. The normal fitted to
        // the body (median 300, σ = 0.5) puts P(Z > ln 5/0.5 = 3.22) = 0.00064 of its mass
        // above the cut, n₀ = 20 of them 0.0128 against the 10 observed at 4000 ms: 99.9% of
        // the censored call goes to the 4000 ms bin.
        let mut h = LatencyHistogram::default();
        h.add(300f64.ln(), 90.0);
        h.add(4000f64.ln(), 10.0);
        let (cut, mu, sigma) = (1500f64.ln(), 300f64.ln(), 0.5);
        let shares = h.tail_shares(cut, mu, sigma, 20.0).unwrap();
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(shares[bin_of(4000f64.ln())] > 0.998, "{shares:?}");
        let mut by_belief = LatencyHistogram::default();
        by_belief.add_shares(&shares, 1.0);
        // The truncated normal keeps it next to the cut, in the bin above the cut's (2048 to
        // 2896 ms): past 2896 ms only P(Z > 4.53)/P(Z > 3.22) = 0.5% of it.
        let mut by_normal = LatencyHistogram::default();
        by_normal.add_above(cut, mu, sigma, 1.0);
        let past = |x: &LatencyHistogram| x.mass[bin_of(2900f64.ln())..].iter().sum::<f64>();
        assert!(past(&by_belief) > 0.998, "{}", past(&by_belief));
        assert!(past(&by_normal) < 0.01, "{}", past(&by_normal));
        // Nothing above the cut at all: no shares (the caller falls back to the normal).
        assert!(LatencyHistogram::default()
            .tail_shares(cut, mu, 0.0, 20.0)
            .is_none());
    }
}
