//! The time-to-first-byte limit of a streamed attempt, from what the gateway has learnt of
//! the provider: a posterior (normal-inverse-gamma over the log of its first-byte times,
//! decayed with a 10-minute half-life, timeouts and attempts dropped before their first byte
//! recorded as censored observations) whose predictive `quantile` times `factor`, clamped to
//! `[floor_ms, the attempt's timeout]`, cuts off a provider that stops sending first bytes in
//! a few of its usual first-byte times rather than at the configured maximum. With fewer than `min_observations`
//! first bytes seen, the limit is unlearnt: while another candidate is left it is
//! `min(the attempt's timeout, deadline_share × the time left, L)`, with L the limit derived
//! from the interface's providers' first bytes together (the interface's prior for a provider
//! it has not seen) once they have `min_observations`, else `unlearnt_ms` (5 s): a first byte
//! that stalls is given up in seconds for the next candidate. The last candidate waits its
//! whole timeout (nothing would be gained). The same posterior's predictive is
//! the provider's first-byte belief, which a streamed request's hedge delay is planned on
//! (see `server::hedge::delay`).
//!
//! An unstreamed attempt's first byte is its whole answer: its answer times are learnt the
//! same way, apart ([`FirstByteLimit::answer_limit`]). While another candidate is left and the
//! request has a deadline, it waits at most `max(deadline_share × the time left, the learnt
//! limit)`, so that a provider that never answers leaves the next one its turn; a whole answer
//! has no interface-wide prior (its length is the client's), so `unlearnt_ms` does not apply,
//! and without a deadline the attempt's timeout does.

pub use crate::config::first_byte::FirstByteLimit;
use equiroute_core::estimators::dist::normal_cdf;
use equiroute_core::estimators::nig::{LogLatencyStats, NigPosterior, NigPrior};
use equiroute_core::estimators::shape::LatencyBelief;
use equiroute_core::{Millis, Timestamp};

/// Half-life of the first-byte statistics: a provider's last ten minutes count most.
const HALF_LIFE_MS: f64 = 600_000.0;

/// A weak prior: its location (1 s) is forgotten after one observation; its spread (a
/// factor of two either way) keeps a few identical observations from a zero-width limit.
const PRIOR: NigPrior = NigPrior {
    mu0: 6.907_755_278_982_137,
    kappa0: 0.01,
    alpha0: 2.0,
    beta0: 0.5,
};

impl FirstByteLimit {
    /// The limit for an attempt whose timeout is `max`, given the provider's statistics at
    /// `now`: `clamp(factor × exp(μ + z_q·σ), floor_ms, max)`, with (μ, σ²) the posterior
    /// mean of the log first-byte time and its predictive variance `E[σ²]·(1 + 1/κ)`.
    #[must_use]
    pub fn limit(&self, stats: &LogLatencyStats, now: Timestamp, max: Millis) -> Millis {
        let Some(post) = self.learnt_posterior(stats, now) else {
            return max;
        };
        let sigma = (post.mean_sigma2() * (1.0 + 1.0 / post.kappa_n)).sqrt();
        let quantile = (post.mu_n + z_of(self.quantile) * sigma).exp();
        Millis((self.factor * quantile).max(self.floor_ms).min(max.0))
    }
}

impl FirstByteLimit {
    /// Whether the limit of a provider with `stats` is learnt from them.
    #[must_use]
    pub fn knows(&self, stats: &LogLatencyStats) -> bool {
        !self.learned || stats.count >= self.min_observations
    }

    /// The limit of an attempt whose provider's first bytes are not known yet (see the module
    /// doc), given every provider's statistics of the interface, the attempt's timeout `max`
    /// and the time `left` before the deadline.
    #[must_use]
    pub fn unlearnt_limit(
        &self,
        all: &[LogLatencyStats],
        now: Timestamp,
        max: Millis,
        left: Option<Millis>,
    ) -> Millis {
        let mut pooled = LogLatencyStats::default();
        for stats in all {
            pooled.merge(stats, Some(HALF_LIFE_MS));
        }
        let prior = if self.knows(&pooled) {
            self.limit(&pooled, now, Millis(f64::INFINITY)).0
        } else {
            self.unlearnt_ms
        };
        let share = left.map_or(f64::INFINITY, |l| self.deadline_share * l.0);
        Millis(prior.min(share).min(max.0))
    }

    /// The limit of an unstreamed attempt whose provider's answer times are `stats`, while
    /// another candidate is left, given the attempt's timeout `max` and the time `left` before
    /// the deadline (see the module doc): `max` without a deadline, else
    /// `min(max, max(deadline_share × left, the learnt limit))`.
    #[must_use]
    pub fn answer_limit(
        &self,
        stats: &LogLatencyStats,
        now: Timestamp,
        max: Millis,
        left: Option<Millis>,
    ) -> Millis {
        let Some(left) = left else { return max };
        let learnt = if self.knows(stats) {
            self.limit(stats, now, max).0
        } else {
            0.0
        };
        Millis((self.deadline_share * left.0).max(learnt).min(max.0))
    }

    /// The provider's first-byte belief at `now`: the Student-t predictive of the posterior
    /// the limit is derived from, once it has `min_observations` first bytes (and with
    /// `learned`); `None` otherwise.
    #[must_use]
    pub fn belief(&self, stats: &LogLatencyStats, now: Timestamp) -> Option<LatencyBelief> {
        self.learnt_posterior(stats, now)
            .map(LatencyBelief::log_normal)
    }

    /// The posterior at `now` once the statistics are learnt from (`learned`, at least
    /// `min_observations` first bytes).
    fn learnt_posterior(&self, stats: &LogLatencyStats, now: Timestamp) -> Option<NigPosterior> {
        (self.learned && stats.count >= self.min_observations).then(|| posterior_at(stats, now))
    }
}

/// The posterior of `stats` decayed to `now`.
fn posterior_at(stats: &LogLatencyStats, now: Timestamp) -> NigPosterior {
    let mut s = *stats;
    s.decay_to(now, Some(HALF_LIFE_MS));
    s.posterior(&PRIOR)
}

/// Records a first byte after `ttfb`.
pub fn observe(stats: &mut LogLatencyStats, now: Timestamp, ttfb: Millis) {
    stats.observe(now, ttfb.0, Some(HALF_LIFE_MS));
}

/// Records an attempt that had no first byte within `cutoff`: at least that long.
pub fn observe_cut_off(stats: &mut LogLatencyStats, now: Timestamp, cutoff: Millis) {
    let belief = posterior_at(stats, now);
    stats.observe_censored(now, cutoff.0, &belief, Some(HALF_LIFE_MS));
}

/// The standard normal quantile `Φ⁻¹(p)`, by bisection (p in (0.5, 1), checked at loading),
/// remembered per thread for the last `p` asked: an interface has one quantile, and the
/// bisection's 80 evaluations of Φ took a few percent of the gateway's CPU when every
/// attempt's limit asked for it.
fn z_of(p: f64) -> f64 {
    thread_local! {
        static LAST: std::cell::Cell<(u64, f64)> = const { std::cell::Cell::new((u64::MAX, 0.0)) };
    }
    let (bits, z) = LAST.with(std::cell::Cell::get);
    if bits == p.to_bits() {
        return z;
    }
    let (mut lo, mut hi) = (0.0, 10.0);
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let z = 0.5 * (lo + hi);
    LAST.with(|last| last.set((p.to_bits(), z)));
    z
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_a_multiple_of_a_high_quantile_clamped_between_the_floor_and_the_max() {
        assert!((z_of(0.99) - 2.326_347_874).abs() < 1e-6);
        let cfg = FirstByteLimit {
            floor_ms: 10.0,
            ..FirstByteLimit::default()
        };
        let now = Timestamp(0.0);
        let max = Millis(30_000.0);
        let mut stats = LogLatencyStats::default();
        // Four first bytes at 100 ms: not enough yet, the max.
        for _ in 0..4 {
            observe(&mut stats, now, Millis(100.0));
        }
        assert_eq!(cfg.limit(&stats, now, max), max);
        observe(&mut stats, now, Millis(100.0));
        // n = 5 at ln 100: κ = 5.01, μ ≈ ln 100 (the prior weighs 0.01), α = 4.5,
        // β ≈ 0.5 + 0.01·5·(ln 1000 − ln 100)²/(2·5.01) = 0.526, E[σ²] = 0.526/3.5 = 0.150,
        // σ = sqrt(0.150 × (1 + 1/5.01)) = 0.425: 3 × 100·e^(0.0046 + 2.326 × 0.425) ≈ 807 ms.
        let limit = cfg.limit(&stats, now, max).0;
        assert!((limit - 807.0).abs() < 10.0, "{limit}");
        // The floor and the max clamp it.
        let floored = FirstByteLimit::default().limit(&stats, now, max).0;
        assert!((floored - 1000.0).abs() < 1e-9);
        assert!((cfg.limit(&stats, now, Millis(500.0)).0 - 500.0).abs() < 1e-9);
        // A cut-off at the limit raises it: it is censored, not dropped.
        observe_cut_off(&mut stats, now, Millis(limit));
        assert!(cfg.limit(&stats, now, max).0 > limit);
        // Switched off: the max.
        let off = FirstByteLimit {
            learned: false,
            ..cfg
        };
        assert_eq!(off.limit(&stats, now, max), max);
        assert!(FirstByteLimit {
            quantile: 1.0,
            ..cfg
        }
        .check()
        .is_err());
    }

    #[test]
    fn an_unlearnt_limit_is_the_interfaces_prior_within_a_share_of_the_deadline() {
        let cfg = FirstByteLimit::default();
        let now = Timestamp(0.0);
        let max = Millis(60_000.0);
        let mut a = LogLatencyStats::default();
        let b = LogLatencyStats::default();
        // Nothing seen anywhere: unlearnt_ms (5 s), or half of the 3 s left.
        assert!((cfg.unlearnt_limit(&[a, b], now, max, None).0 - 5000.0).abs() < 1e-9);
        let left = Some(Millis(3000.0));
        assert!((cfg.unlearnt_limit(&[a, b], now, max, left).0 - 1500.0).abs() < 1e-9);
        assert!((cfg.unlearnt_limit(&[a, b], now, Millis(800.0), left).0 - 800.0).abs() < 1e-9);
        // a's five first bytes at 100 ms are the interface's prior for b: 3 × their predicted
        // 99th percentile (807 ms, see the test above), floored at 1 s.
        for _ in 0..5 {
            observe(&mut a, now, Millis(100.0));
        }
        assert!(!cfg.knows(&b) && cfg.knows(&a));
        assert!((cfg.unlearnt_limit(&[a, b], now, max, None).0 - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn an_unstreamed_answer_waits_half_the_time_left_or_its_learnt_limit_if_longer() {
        let cfg = FirstByteLimit::default();
        let now = Timestamp(0.0);
        let max = Millis(60_000.0);
        let mut stats = LogLatencyStats::default();
        // No deadline: the attempt's timeout, learnt or not.
        assert_eq!(cfg.answer_limit(&stats, now, max, None), max);
        // Unlearnt, 3 s left: half of them; within a shorter timeout, the timeout.
        let left = Some(Millis(3000.0));
        assert!((cfg.answer_limit(&stats, now, max, left).0 - 1500.0).abs() < 1e-9);
        assert!((cfg.answer_limit(&stats, now, Millis(900.0), left).0 - 900.0).abs() < 1e-9);
        // Five answers at 2 s: β ≈ 0.5 + 0.01·5·(ln 1000 − ln 2000)²/(2·5.01) = 0.502,
        // σ = sqrt(0.502/3.5 × 1.1996) = 0.415, 3 × 2000·e^(2.326 × 0.415) ≈ 15.8 s: longer
        // than half of the 3 s left.
        for _ in 0..5 {
            observe(&mut stats, now, Millis(2000.0));
        }
        let learnt = cfg.limit(&stats, now, max).0;
        assert!((15_000.0..17_000.0).contains(&learnt), "{learnt}");
        assert!((cfg.answer_limit(&stats, now, max, left).0 - learnt).abs() < 1e-9);
        // Five answers at 100 ms: the learnt limit (the 1 s floor) is below half of 3 s.
        let mut quick = LogLatencyStats::default();
        for _ in 0..5 {
            observe(&mut quick, now, Millis(100.0));
        }
        assert!((cfg.answer_limit(&quick, now, max, left).0 - 1500.0).abs() < 1e-9);
        // Not derived at all (`learned = false`): the timeout.
        let off = FirstByteLimit {
            learned: false,
            ..cfg
        };
        assert_eq!(off.answer_limit(&stats, now, max, left), max);
    }

    #[test]
    fn the_first_byte_belief_is_the_limits_posterior_once_it_has_enough_first_bytes() {
        let cfg = FirstByteLimit::default();
        let now = Timestamp(0.0);
        let mut stats = LogLatencyStats::default();
        for _ in 0..4 {
            observe(&mut stats, now, Millis(100.0));
        }
        assert_eq!(cfg.belief(&stats, now), None, "4 of min_observations = 5");
        observe(&mut stats, now, Millis(100.0));
        // The posterior of the limit's test: μ ≈ ln 100 + 0.0046, so a median near 100 ms.
        let belief = cfg.belief(&stats, now).unwrap();
        assert!((belief.posterior.mu_n.exp() - 100.5).abs() < 0.5);
        assert!((belief.exceedance(100.5) - 0.5).abs() < 0.01);
        let off = FirstByteLimit {
            learned: false,
            ..cfg
        };
        assert_eq!(off.belief(&stats, now), None);
    }
}
