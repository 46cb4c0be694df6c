//! A circuit breaker per candidate: closed → open after `consecutive_failures` provider
//! failures in a row, or a failure rate of at least `failure_rate` over the last `window`
//! attempts (once `min_attempts` were seen) → half-open after `open_ms`, admitting at most
//! `half_open_probes` probes → closed after `successes_to_close` probe successes (any probe
//! failure re-opens). A provider's `Retry-After` opens it for that long: "pinned", the
//! provider said when to come back.
//!
//! Last resort (Envoy's panic threshold, for one candidate): when every candidate a request
//! could use is shut out by a breaker that failures opened (none pinned), the gateway ends
//! the open period of the one whose period ends soonest ([`Breaker::last_resort`]) instead of
//! answering that no provider can take the request; that attempt is a half-open probe.
//!
//! Re-tests ([`Breaker::retest_due`], on by default: `retest`): a provider the ranking left
//! after failures is tried again whatever its rank, by the next request (the others stay
//! its fallbacks) — once its open period is over (the half-open probes), or, when its
//! breaker did not open (the policy moved the traffic away first), once `open_ms` passed
//! since its last try while its last counted attempt failed. So a provider that failed is
//! tried at least once per `max_open_ms` while down, and a recovery is found within
//! `max_open_ms` (10 s by default) of it, whatever the policy.
//!
//! Time is passed in; every transition is returned so the caller can count it.

use crate::decision::{Millis, Timestamp};
use serde::{Deserialize, Serialize};

/// Thresholds of a [`Breaker`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    pub consecutive_failures: u32,
    pub failure_rate: f64,
    /// Attempts remembered for the failure rate (at most 64).
    pub window: u32,
    pub min_attempts: u32,
    /// The first open period after a trip.
    pub open_ms: f64,
    /// Each failed half-open probe in a row multiplies the open period by this (≥ 1).
    pub backoff_factor: f64,
    /// The longest open period the back-off reaches. Below `open_ms` it is `open_ms` (a
    /// configuration that only raises `open_ms` keeps a fixed period, with no back-off).
    pub max_open_ms: f64,
    pub half_open_probes: u32,
    pub successes_to_close: u32,
    /// When every candidate is shut out by breakers opened by failures, probe the one whose
    /// open period ends soonest rather than refuse the request.
    pub last_resort: bool,
    /// Re-test a provider that failed whatever its rank ([`Breaker::retest_due`]).
    pub retest: bool,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            consecutive_failures: 5,
            failure_rate: 0.5,
            window: 20,
            min_attempts: 10,
            open_ms: 5_000.0,
            backoff_factor: 2.0,
            max_open_ms: 10_000.0,
            half_open_probes: 2,
            successes_to_close: 2,
            last_resort: true,
            retest: true,
        }
    }
}

impl BreakerConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A field outside its range, named.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        use crate::error::out_of_range;
        if self.consecutive_failures == 0 {
            return Err(out_of_range(
                "breaker.consecutive_failures",
                0,
                "must be at least 1",
            ));
        }
        crate::error::unit_interval("breaker.failure_rate", self.failure_rate)?;
        if !(1..=64).contains(&self.window) {
            return Err(out_of_range(
                "breaker.window",
                self.window,
                "must be 1 to 64",
            ));
        }
        if self.min_attempts > self.window {
            return Err(out_of_range(
                "breaker.min_attempts",
                self.min_attempts,
                "must not exceed breaker.window",
            ));
        }
        crate::error::non_negative("breaker.open_ms", self.open_ms)?;
        if !(self.backoff_factor.is_finite() && self.backoff_factor >= 1.0) {
            return Err(out_of_range(
                "breaker.backoff_factor",
                self.backoff_factor,
                "must be a finite number of at least 1 (1: every failed probe re-opens for open_ms)",
            ));
        }
        if !(self.max_open_ms.is_finite() && self.max_open_ms >= 0.0) {
            return Err(out_of_range(
                "breaker.max_open_ms",
                self.max_open_ms,
                "must be a finite number of milliseconds ≥ 0 (below open_ms: open_ms)",
            ));
        }
        if self.half_open_probes == 0 || self.successes_to_close == 0 {
            return Err(out_of_range(
                "breaker.half_open_probes / successes_to_close",
                0,
                "must be at least 1",
            ));
        }
        if self.successes_to_close > self.half_open_probes {
            return Err(out_of_range(
                "breaker.successes_to_close",
                self.successes_to_close,
                "must not exceed breaker.half_open_probes, or the breaker could never close",
            ));
        }
        Ok(())
    }

    /// How long the breaker stays open after `failed_probes` half-open probes failed in a
    /// row: `open_ms × backoff_factor^failed_probes`, at most `max_open_ms`.
    #[must_use]
    pub fn open_period(&self, failed_probes: u32) -> Millis {
        let k = i32::try_from(failed_probes).unwrap_or(i32::MAX);
        Millis((self.open_ms * self.backoff_factor.powi(k)).min(self.max_open_ms.max(self.open_ms)))
    }
}

/// Where a breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open { until: Timestamp },
    HalfOpen { probes: u32, successes: u32 },
}

/// Whether an attempt may go to the candidate now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Admission {
    Allowed,
    /// Allowed as one of the bounded half-open probes.
    Probe,
    Rejected {
        until: Option<Timestamp>,
    },
}

/// A state change, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    Opened,
    HalfOpened,
    Closed,
}

/// What an attempt means to the breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerOutcome {
    Success,
    Failure,
    /// Client errors and cancellations say nothing about the provider's health.
    Ignored,
}

impl BreakerOutcome {
    /// The health verdict of an attempt. A deadline cut-off says the provider was slow for
    /// this request, not that it is down, so it is left to the policies.
    #[must_use]
    pub fn of(status: crate::decision::AttemptStatus) -> BreakerOutcome {
        use crate::decision::AttemptStatus;
        match status {
            AttemptStatus::Ok => BreakerOutcome::Success,
            AttemptStatus::ProviderError(_) => BreakerOutcome::Failure,
            AttemptStatus::Timeout | AttemptStatus::ClientError | AttemptStatus::Cancelled => {
                BreakerOutcome::Ignored
            }
        }
    }
}

/// One candidate's circuit breaker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Breaker {
    pub state: BreakerState,
    consecutive: u32,
    /// Last `len` outcomes, newest in bit 0, 1 = failure.
    recent: u64,
    len: u32,
    /// Half-open probes that failed in a row since the breaker last closed: the back-off.
    #[serde(default)]
    failed_probes: u32,
    /// The open period was set (or extended) by the provider (a `Retry-After`).
    #[serde(default)]
    pinned: bool,
    /// The open period was set by failures (a trip, or a failed probe).
    #[serde(default)]
    tripped: bool,
    /// When an attempt was last admitted: the clock of the re-tests while closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_tried: Option<Timestamp>,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: BreakerState::Closed,
            consecutive: 0,
            recent: 0,
            len: 0,
            failed_probes: 0,
            pinned: false,
            tripped: false,
            last_tried: None,
        }
    }
}

impl Breaker {
    /// What [`Breaker::admit`] would answer, without changing anything.
    #[must_use]
    pub fn peek(&self, now: Timestamp, cfg: &BreakerConfig) -> Admission {
        match self.state {
            BreakerState::Closed => Admission::Allowed,
            BreakerState::Open { until } if now.0 < until.0 => {
                Admission::Rejected { until: Some(until) }
            }
            // A period only the provider set is over when it says: no probing.
            BreakerState::Open { .. } if self.pinned && !self.tripped => Admission::Allowed,
            BreakerState::Open { .. } => Admission::Probe,
            BreakerState::HalfOpen { probes, .. } if probes < cfg.half_open_probes => {
                Admission::Probe
            }
            BreakerState::HalfOpen { .. } => Admission::Rejected { until: None },
        }
    }

    /// Admits an attempt: moves open → half-open when the open period is over and counts
    /// half-open probes.
    pub fn admit(
        &mut self,
        now: Timestamp,
        cfg: &BreakerConfig,
    ) -> (Admission, Option<Transition>) {
        let mut transition = None;
        if let BreakerState::Open { until } = self.state {
            if now.0 >= until.0 && self.pinned && !self.tripped {
                // The provider's `Retry-After` is over: closed again, as a careful client
                // resumes when told (failures never opened it, so there is nothing to probe).
                *self = Breaker {
                    failed_probes: self.failed_probes,
                    ..Breaker::default()
                };
                transition = Some(Transition::Closed);
            } else if now.0 >= until.0 {
                self.state = BreakerState::HalfOpen {
                    probes: 0,
                    successes: 0,
                };
                transition = Some(Transition::HalfOpened);
            }
        }
        let admission = self.peek(now, cfg);
        if let (Admission::Probe, BreakerState::HalfOpen { probes, .. }) =
            (admission, &mut self.state)
        {
            *probes += 1;
        }
        if !matches!(admission, Admission::Rejected { .. }) {
            self.last_tried = Some(now);
        }
        (admission, transition)
    }

    /// Whether the provider is due a re-test at `now` (see the module doc): its open period
    /// is over (or it is half-open) and a probe is free, or it is closed, its last counted
    /// attempt failed and nothing was admitted to it for `open_ms`. The caller tries it first
    /// (then [`Breaker::admit`] takes the probe or restarts the clock). Never with `retest`
    /// off, nor for an open period only a `Retry-After` set (it just closes when over).
    #[must_use]
    pub fn retest_due(&self, now: Timestamp, cfg: &BreakerConfig) -> bool {
        if !cfg.retest {
            return false;
        }
        match self.state {
            BreakerState::Closed => {
                self.consecutive > 0 && self.last_tried.is_none_or(|t| now.0 - t.0 >= cfg.open_ms)
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } => {
                self.peek(now, cfg) == Admission::Probe
            }
        }
    }

    /// Records an attempt's outcome at `now`.
    pub fn record(
        &mut self,
        now: Timestamp,
        outcome: BreakerOutcome,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        if outcome == BreakerOutcome::Ignored {
            return None;
        }
        let failed = outcome == BreakerOutcome::Failure;
        match &mut self.state {
            BreakerState::HalfOpen { probes, successes } => {
                *probes = probes.saturating_sub(1);
                if failed {
                    self.failed_probes = self.failed_probes.saturating_add(1);
                    return self.trip(now.plus(cfg.open_period(self.failed_probes)));
                }
                *successes += 1;
                if *successes >= cfg.successes_to_close {
                    *self = Breaker::default();
                    return Some(Transition::Closed);
                }
                None
            }
            // A late result of an attempt admitted before the breaker opened.
            BreakerState::Open { .. } => None,
            BreakerState::Closed => {
                self.recent = (self.recent << 1) | u64::from(failed);
                self.len = (self.len + 1).min(cfg.window);
                self.consecutive = if failed { self.consecutive + 1 } else { 0 };
                let mask = if cfg.window >= 64 {
                    u64::MAX
                } else {
                    (1u64 << cfg.window) - 1
                };
                let failures = (self.recent & mask).count_ones();
                let rate_trip = self.len >= cfg.min_attempts
                    && f64::from(failures) >= cfg.failure_rate * f64::from(self.len);
                if failed && (self.consecutive >= cfg.consecutive_failures || rate_trip) {
                    return self.trip(now.plus(cfg.open_period(self.failed_probes)));
                }
                None
            }
        }
    }

    /// Records a finished attempt ending at `now`: its health verdict, then its `Retry-After`
    /// (which opens the breaker for that long). Returns the transitions, in order.
    pub fn observe(
        &mut self,
        now: Timestamp,
        outcome: &crate::decision::AttemptOutcome,
        cfg: &BreakerConfig,
    ) -> [Option<Transition>; 2] {
        let verdict = self.record(now, BreakerOutcome::of(outcome.status), cfg);
        let retry = outcome.retry_after.and_then(|r| self.open(now.plus(r)));
        [verdict, retry]
    }

    /// Half-open probes failed in a row since the breaker last closed.
    #[must_use]
    pub fn failed_probes(&self) -> u32 {
        self.failed_probes
    }

    /// Opens until `until` because the provider said so (a `Retry-After`), unless already
    /// open for longer: pinned, so never ended early as a last resort.
    pub fn open(&mut self, until: Timestamp) -> Option<Transition> {
        self.open_until(until, true)
    }

    /// Opens until `until` because of failures (or, shared, because another instance saw
    /// them): `pinned` says which kind the period is.
    pub fn open_until(&mut self, until: Timestamp, pinned: bool) -> Option<Transition> {
        match self.state {
            BreakerState::Open { until: current } if current.0 >= until.0 => {
                self.pinned |= pinned;
                self.tripped |= !pinned;
                None
            }
            BreakerState::Open { .. } => {
                self.state = BreakerState::Open { until };
                self.pinned |= pinned;
                self.tripped |= !pinned;
                None
            }
            _ => {
                self.state = BreakerState::Open { until };
                self.pinned = pinned;
                self.tripped = !pinned;
                self.consecutive = 0;
                self.recent = 0;
                self.len = 0;
                Some(Transition::Opened)
            }
        }
    }

    fn trip(&mut self, until: Timestamp) -> Option<Transition> {
        self.open_until(until, false)
    }

    /// Whether the breaker is open for a period the provider set (`Retry-After`).
    #[must_use]
    pub fn is_pinned(&self) -> bool {
        self.pinned && matches!(self.state, BreakerState::Open { .. })
    }

    /// Ends an open period that failures set, now: the breaker goes half-open and the next
    /// admission is a probe. `None` (nothing changed) when it is closed, half-open, or pinned.
    pub fn last_resort(&mut self) -> Option<Transition> {
        if !matches!(self.state, BreakerState::Open { .. }) || self.pinned {
            return None;
        }
        self.state = BreakerState::HalfOpen {
            probes: 0,
            successes: 0,
        };
        Some(Transition::HalfOpened)
    }
}

/// Moves the first candidate of `order` after its head whose breaker (`breakers[i]`) is due a
/// re-test at `now` ([`Breaker::retest_due`]) to the front: a provider that failed is tried
/// again whatever its rank, the others staying its fallbacks. Whether one moved.
pub fn promote_retest(
    order: &mut Vec<usize>,
    breakers: &[Breaker],
    now: Timestamp,
    cfg: &BreakerConfig,
) -> bool {
    let due = order
        .iter()
        .skip(1)
        .position(|&i| breakers.get(i).is_some_and(|b| b.retest_due(now, cfg)));
    if let Some(p) = due {
        let i = order.remove(p + 1);
        order.insert(0, i);
    }
    due.is_some()
}

/// The order of `ranking` with the first provider due a re-test moved to the front
/// ([`promote_retest`]), and whether one moved. Then the ranking's claim that its head is as
/// good as what follows ([`Ranking::interchangeable`]) no longer holds, the first being the
/// breaker's choice, not the policy's: it is dropped here, for the gateway and the laboratory
/// alike.
///
/// [`Ranking::interchangeable`]: crate::policies::Ranking::interchangeable
pub fn retested_order(
    ranking: &mut crate::policies::Ranking,
    breakers: &[Breaker],
    now: Timestamp,
    cfg: &BreakerConfig,
) -> (Vec<usize>, bool) {
    let mut order: Vec<usize> = ranking.indices().collect();
    let retest = promote_retest(&mut order, breakers, now, cfg);
    if retest {
        ranking.interchangeable = 0;
    }
    (order, retest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: f64) -> Timestamp {
        Timestamp(ms)
    }

    #[test]
    fn opens_after_consecutive_failures_then_probes_then_closes() {
        let cfg = BreakerConfig::default();
        let mut b = Breaker::default();
        for i in 0..4 {
            assert_eq!(
                b.record(t(f64::from(i)), BreakerOutcome::Failure, &cfg),
                None
            );
        }
        assert_eq!(
            b.record(t(4.0), BreakerOutcome::Failure, &cfg),
            Some(Transition::Opened)
        );
        assert!(matches!(b.peek(t(10.0), &cfg), Admission::Rejected { .. }));
        // After open_ms: half-open, at most two probes.
        let later = t(4.0 + cfg.open_ms);
        assert_eq!(
            b.admit(later, &cfg),
            (Admission::Probe, Some(Transition::HalfOpened))
        );
        assert_eq!(b.admit(later, &cfg).0, Admission::Probe);
        assert!(matches!(b.admit(later, &cfg).0, Admission::Rejected { .. }));
        assert_eq!(b.record(later, BreakerOutcome::Success, &cfg), None);
        assert_eq!(
            b.record(later, BreakerOutcome::Success, &cfg),
            Some(Transition::Closed)
        );
        assert_eq!(b.peek(later, &cfg), Admission::Allowed);
    }

    /// The first provider after the head whose breaker is due a re-test goes first, the others
    /// keeping their order; none due, none moved.
    #[test]
    fn a_provider_due_a_retest_is_moved_first() {
        let cfg = BreakerConfig::default();
        let mut breakers = vec![Breaker::default(); 4];
        for i in [1, 3] {
            assert_eq!(breakers[i].admit(t(0.0), &cfg).0, Admission::Allowed);
            breakers[i].record(t(100.0), BreakerOutcome::Failure, &cfg);
        }
        let mut order = vec![0, 2, 3, 1];
        assert!(!promote_retest(&mut order, &breakers, t(4_999.0), &cfg));
        assert_eq!(order, [0, 2, 3, 1]);
        assert!(promote_retest(&mut order, &breakers, t(5_000.0), &cfg));
        assert_eq!(order, [3, 0, 2, 1]);
        // A head that is due is tried anyway, so the next due one goes first and the head
        // is its fallback: both re-tested.
        let mut order = vec![1, 0, 3];
        assert!(promote_retest(&mut order, &breakers, t(5_000.0), &cfg));
        assert_eq!(order, [3, 1, 0]);
    }

    /// A provider that failed is due a re-test `open_ms` (5 s) after it was last tried while
    /// closed, at once when its open period is over, while a probe is free; never after a
    /// success, for a period only a `Retry-After` set, or with `retest = false`.
    #[test]
    fn a_provider_that_failed_is_due_a_retest_on_the_breaker_clock() {
        let cfg = BreakerConfig::default();
        let mut b = Breaker::default();
        assert!(!b.retest_due(t(0.0), &cfg), "nothing failed");
        assert_eq!(b.admit(t(0.0), &cfg).0, Admission::Allowed);
        b.record(t(100.0), BreakerOutcome::Failure, &cfg);
        assert!(!b.retest_due(t(4_999.0), &cfg));
        assert!(b.retest_due(t(5_000.0), &cfg));
        let off = BreakerConfig {
            retest: false,
            ..cfg
        };
        assert!(!b.retest_due(t(5_000.0), &off));
        // The re-test is admitted: the clock restarts; it succeeds: nothing more is due.
        b.admit(t(5_000.0), &cfg);
        assert!(!b.retest_due(t(9_999.0), &cfg) && b.retest_due(t(10_000.0), &cfg));
        b.record(t(5_010.0), BreakerOutcome::Success, &cfg);
        assert!(!b.retest_due(t(60_000.0), &cfg));
        // Open: not before the period ends, then for the two probes only.
        for k in 0..5 {
            b.record(t(20_000.0 + f64::from(k)), BreakerOutcome::Failure, &cfg);
        }
        assert!(matches!(b.state, BreakerState::Open { .. }));
        assert!(!b.retest_due(t(24_000.0), &cfg));
        assert!(b.retest_due(t(25_004.0), &cfg));
        b.admit(t(25_004.0), &cfg);
        assert!(b.retest_due(t(25_004.0), &cfg), "a second probe is free");
        b.admit(t(25_004.0), &cfg);
        assert!(!b.retest_due(t(25_004.0), &cfg), "both probes out");
        // A period only the provider set: it closes when over, nothing to re-test.
        let mut told = Breaker::default();
        told.open(t(1_000.0));
        assert!(!told.retest_due(t(2_000.0), &cfg));
    }

    #[test]
    fn failure_rate_over_the_window_trips() {
        let cfg = BreakerConfig::default();
        let mut b = Breaker::default();
        // Alternate failure/success: never 5 in a row, but 50% over 10 attempts.
        let mut opened = None;
        for i in 0..10 {
            let o = if i % 2 == 0 {
                BreakerOutcome::Success
            } else {
                BreakerOutcome::Failure
            };
            opened = opened.or(b.record(t(f64::from(i)), o, &cfg));
        }
        assert_eq!(opened, Some(Transition::Opened));
    }

    #[test]
    fn a_retry_after_ends_closed_and_a_failed_probe_reopens_with_back_off() {
        let cfg = BreakerConfig::default();
        let mut b = Breaker::default();
        assert_eq!(b.open(t(1000.0)), Some(Transition::Opened));
        assert!(b.is_pinned());
        assert!(matches!(b.peek(t(999.0), &cfg), Admission::Rejected { .. }));
        // The provider's period is over when it says: closed at once, nothing to probe.
        assert_eq!(b.peek(t(1000.0), &cfg), Admission::Allowed);
        assert_eq!(
            b.admit(t(1000.0), &cfg),
            (Admission::Allowed, Some(Transition::Closed))
        );
        // Opened by failures, it half-opens instead, and a failed probe backs off.
        let mut opened = None;
        for _ in 0..cfg.consecutive_failures {
            opened = opened.or(b.record(t(1000.0), BreakerOutcome::Failure, &cfg));
        }
        assert_eq!(opened, Some(Transition::Opened));
        assert!(!b.is_pinned());
        let end = 1000.0 + cfg.open_ms;
        assert_eq!(
            b.admit(t(end), &cfg),
            (Admission::Probe, Some(Transition::HalfOpened))
        );
        assert_eq!(
            b.record(t(end), BreakerOutcome::Failure, &cfg),
            Some(Transition::Opened)
        );
        // The first failed probe backs off: open_ms × backoff_factor.
        assert_eq!(
            b.state,
            BreakerState::Open {
                until: t(end + cfg.open_ms * cfg.backoff_factor)
            }
        );
        // A Retry-After on a breaker failures opened extends it but does not make it a pin
        // that ends closed: it still half-opens.
        let _ = b.open(t(end + 60_000.0));
        assert!(b.is_pinned());
        assert_eq!(
            b.admit(t(end + 60_000.0), &cfg).1,
            Some(Transition::HalfOpened)
        );
        // Client errors are ignored whatever the state.
        assert_eq!(b.record(t(1.0), BreakerOutcome::Ignored, &cfg), None);
    }

    #[test]
    fn failed_probes_back_off_exponentially_up_to_the_maximum_and_a_close_resets_it() {
        let cfg = BreakerConfig {
            consecutive_failures: 1,
            open_ms: 1000.0,
            backoff_factor: 2.0,
            max_open_ms: 5000.0,
            ..BreakerConfig::default()
        };
        let mut b = Breaker::default();
        let mut now = 0.0;
        assert_eq!(
            b.record(t(now), BreakerOutcome::Failure, &cfg),
            Some(Transition::Opened)
        );
        // Each failed probe re-opens for twice as long: 2 s, 4 s, then the 5 s ceiling.
        let mut periods = vec![];
        let mut until = 1000.0;
        for _ in 0..4 {
            now = until;
            assert_eq!(b.admit(t(now), &cfg).0, Admission::Probe);
            let _ = b.record(t(now), BreakerOutcome::Failure, &cfg);
            let BreakerState::Open { until: u } = b.state else {
                panic!("{:?}", b.state)
            };
            periods.push(u.0 - now);
            until = u.0;
        }
        assert_eq!(periods, [2000.0, 4000.0, 5000.0, 5000.0]);
        assert_eq!(b.failed_probes(), 4);
        // Probes succeed: closed, and the next trip opens for open_ms again.
        now = until;
        for _ in 0..cfg.successes_to_close {
            assert_eq!(b.admit(t(now), &cfg).0, Admission::Probe);
            let _ = b.record(t(now), BreakerOutcome::Success, &cfg);
        }
        assert_eq!((b.state, b.failed_probes()), (BreakerState::Closed, 0));
        let _ = b.record(t(now), BreakerOutcome::Failure, &cfg);
        assert_eq!(
            b.state,
            BreakerState::Open {
                until: t(now + 1000.0)
            }
        );
        // Limits are checked.
        let bad = BreakerConfig {
            max_open_ms: f64::INFINITY,
            ..cfg
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_open_ms"));
        let bad = BreakerConfig {
            backoff_factor: 0.5,
            ..cfg
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("backoff_factor"));
    }
}
