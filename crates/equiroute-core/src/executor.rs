//! The execution of one request, as a pure state machine: which attempt comes next, how much
//! of the deadline it may use, when to stop, and what the request came to. The gateway drives
//! it in real time and the laboratory in virtual time, so there is one routing loop:
//!
//! ```text
//! let mut run = Execution::new(order, now, deadline, limits);
//! while let Some(attempt) = run.next_attempt(now) {
//!     let outcome = /* call attempt.candidate with attempt.timeout */;
//!     /* feed the outcome to the policy and the breaker */
//!     run.record(attempt.candidate, outcome, now);
//!     now = now + outcome.latency;
//! }
//! let result = run.finish(now);
//! ```
//!
//! Rules: candidates are tried in ranked order, each at most once; an attempt gets the smaller
//! of the per-attempt timeout and what is left of the deadline; a provider error, a cancelled
//! attempt or an attempt timeout falls back to the next candidate; a client error ends the
//! request (it is the caller's to fix, retrying elsewhere would fail the same way); reaching
//! the deadline ends it.
//!
//! One exception to "at most once", at most once per request: a provider error that says it
//! will pass retries the same candidate after a pause ([`NextAttempt::wait`]) instead of
//! falling over, when the deadline leaves at least as long for the retry as the pause takes:
//! - a `Retry-After` of at most [`ExecutionLimits::max_retry_after_wait`] on the candidate
//!   the policy ranked best (falling over would mean a worse candidate) waits it out, unless
//!   the policy holds the next candidate as good ([`Execution::with_interchangeable`]): then
//!   the request falls over to it (the wait would cost latency; behind a rate limit that
//!   admits less than the traffic it would buy no capacity either, docs/policies.md
//!   "Capacity");
//! - a 5xx without `Retry-After` waits [`ExecutionLimits::server_error_retry`] times a
//!   jitter factor in [1 − j, 1 + j) with j = [`ExecutionLimits::server_error_jitter`] (the
//!   random draw is passed in: [`Execution::with_jitter`]), on the candidate's first 5xx of
//!   the request.
//!
//! **Hedging** ([`crate::hedge`]): given a hedge delay ([`Execution::with_hedge`]), the
//! first attempt may get company. After starting it the driver asks [`Execution::hedge`],
//! which says "at `wait` after the first attempt's start, start this attempt on the next
//! candidate of the ranking, unless the first has answered"; the driver starts it
//! ([`Execution::start_hedge`]) if the first is still out at that time and the hedge budget
//! allows, then records both attempts in the order they end. The first good answer wins and
//! the driver records the other as `Cancelled` at that moment; when the first to end failed,
//! the driver waits for the other, so a hedge never turns a success into a failure. While
//! both are out no retry is planned: the hedge is the fallback.
//!
//! ```text
//! let first = run.next_attempt(now)?;            // start it
//! if let Some(h) = run.hedge(&first, now) {      // at now + h.wait, if still silent:
//!     run.start_hedge(&h);                       // start h.candidate with h.timeout
//!     /* record the attempt that ends first; if it answered, cancel and record the other
//!        as Cancelled, else record the other when it ends */
//! }
//! ```

use crate::decision::{AttemptOutcome, AttemptStatus, Millis, Timestamp, Usd};
use crate::hedge::{HedgePlan, HedgeReason};
use serde::{Deserialize, Serialize};

/// Limits on one request's attempts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutionLimits {
    /// Attempts per request, first try included.
    pub max_attempts: u32,
    /// Longest a single attempt may take (the deadline may cut it shorter).
    pub attempt_timeout: Option<Millis>,
    /// Do not start an attempt with less than this left of the deadline.
    pub min_attempt_budget: Millis,
    /// Longest `Retry-After` waited out on the best-ranked candidate before retrying it
    /// once, unless the ranking holds the next candidate as good
    /// ([`Execution::with_interchangeable`]) (0: never wait, fall over).
    pub max_retry_after_wait: Millis,
    /// Mean pause before the one retry of a candidate after a 5xx (`None`: no retry).
    pub server_error_retry: Option<Millis>,
    /// How far the 5xx retry's pause spreads around its mean, as a fraction j in [0, 1]:
    /// the pause is `server_error_retry × (1 − j + 2j·u)`, u uniform in [0, 1).
    pub server_error_jitter: f64,
}

impl Default for ExecutionLimits {
    fn default() -> Self {
        ExecutionLimits {
            max_attempts: 3,
            attempt_timeout: None,
            min_attempt_budget: Millis(1.0),
            max_retry_after_wait: Millis(1000.0),
            server_error_retry: Some(Millis(50.0)),
            server_error_jitter: 0.5,
        }
    }
}

/// The next attempt to make.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NextAttempt {
    pub candidate: usize,
    /// Cancel the attempt after this long (`None`: no limit).
    pub timeout: Option<Millis>,
    /// 0 for the first attempt, 1 for the first fallback, …
    pub number: u32,
    /// Wait this long before starting the attempt (a retry's pause; 0 otherwise).
    pub wait: Millis,
    /// Why the attempt retries the candidate just tried, if it does.
    pub retry: Option<RetryReason>,
}

impl NextAttempt {
    /// Whether this is the first attempt of the request (the one a hedge may join).
    #[must_use]
    pub fn is_first(&self) -> bool {
        self.number == 0 && self.retry.is_none()
    }
}

/// Why an attempt retries the same candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryReason {
    /// The candidate said when to come back (`Retry-After`), soon enough.
    RetryAfter,
    /// A 5xx, the candidate's first of the request.
    ServerError,
}

impl RetryReason {
    /// The name in logs and the audit record.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::RetryAfter => "retry_after",
            RetryReason::ServerError => "server_error",
        }
    }
}

/// A retry decided by [`Execution::record`], made by the next attempt.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ScheduledRetry {
    candidate: usize,
    not_before: Timestamp,
    reason: RetryReason,
}

/// One attempt as it happened.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub candidate: usize,
    pub started: Timestamp,
    pub outcome: AttemptOutcome,
    /// Set when the attempt retried the candidate tried just before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryReason>,
    /// The attempt was a hedge, started beside the first while the first was still out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hedge: bool,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum RequestStatus {
    Succeeded {
        candidate: usize,
    },
    /// A candidate rejected the request itself; not retried elsewhere.
    ClientError {
        candidate: usize,
    },
    /// The deadline passed before any candidate answered.
    DeadlineExceeded,
    /// Every allowed attempt failed, or no candidate was eligible.
    Exhausted,
}

/// What a request came to, with every attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    pub status: RequestStatus,
    pub attempts: Vec<AttemptRecord>,
    /// From the start of the request to its end.
    pub latency: Millis,
    /// Sum of the attempts' costs, failed ones included.
    pub cost: Usd,
}

impl RequestResult {
    /// Number of fallbacks (attempts after the first).
    #[must_use]
    pub fn fallbacks(&self) -> usize {
        self.attempts.len().saturating_sub(1)
    }

    /// Whether a hedge started, and whether it gave the answer.
    #[must_use]
    pub fn hedge(&self) -> Option<bool> {
        self.attempts.iter().find(|a| a.hedge).map(|a| {
            matches!(self.status, RequestStatus::Succeeded { candidate } if candidate == a.candidate)
        })
    }
}

/// One request being executed.
#[derive(Clone, Debug)]
pub struct Execution {
    order: Vec<usize>,
    next: usize,
    started: Timestamp,
    deadline: Option<Millis>,
    limits: ExecutionLimits,
    attempts: Vec<AttemptRecord>,
    ended: Option<RequestStatus>,
    /// The retry the next attempt makes, if one was decided.
    retry: Option<ScheduledRetry>,
    /// A retry was decided (at most one per request).
    retried: bool,
    /// Where in [0, 1) the 5xx retry's pause falls within its jitter range.
    jitter: f64,
    /// After how long beside the first attempt a hedge starts, and why (`None`: no hedging).
    hedge_plan: Option<HedgePlan>,
    /// The hedge's candidate, from its start until it is recorded.
    hedged: Option<usize>,
    /// A hedge started (at most one per request).
    hedge_started: bool,
    /// Attempts started beside another and not recorded yet (0 without a hedge).
    in_flight: u32,
    /// The first this many candidates of `order` are as good as one another (the policy's
    /// [`crate::policies::Ranking::interchangeable`]).
    interchangeable: usize,
}

impl Execution {
    /// A request started at `started` that will try `order` (the policy's ranking).
    #[must_use]
    pub fn new(
        order: Vec<usize>,
        started: Timestamp,
        deadline: Option<Millis>,
        limits: ExecutionLimits,
    ) -> Execution {
        Execution {
            order,
            next: 0,
            started,
            deadline,
            limits,
            attempts: Vec::new(),
            ended: None,
            retry: None,
            retried: false,
            jitter: 0.5,
            hedge_plan: None,
            hedged: None,
            hedge_started: false,
            in_flight: 0,
            interchangeable: 0,
        }
    }

    /// Says that the first `n` candidates of the order are as good as one another (the
    /// ranking's [`crate::policies::Ranking::interchangeable`]): a `Retry-After` on the
    /// first is then not waited out while the next of them can be tried; the request falls
    /// over to it (see the module doc).
    #[must_use]
    pub fn with_interchangeable(mut self, n: usize) -> Execution {
        self.interchangeable = n;
        self
    }

    /// Lets the first attempt be hedged after `plan.delay` (from [`crate::hedge::hedge_plan`];
    /// `None`: no hedge).
    #[must_use]
    pub fn with_hedge(mut self, plan: Option<HedgePlan>) -> Execution {
        self.hedge_plan = plan.filter(|p| p.delay.0.is_finite() && p.delay.0 >= 0.0);
        self
    }

    /// Why the planned hedge has its delay (`None`: no hedge planned).
    #[must_use]
    pub fn hedge_reason(&self) -> Option<HedgeReason> {
        self.hedge_plan.map(|p| p.reason)
    }

    /// The hedge of `first` (the attempt [`Execution::next_attempt`] just gave, started at
    /// `started`): its candidate is the next of the ranking, `wait` is the delay after
    /// `started` at which it starts (if `first` is still out), its timeout what the deadline
    /// leaves then. `None` when no hedge is planned, `first` is not the first attempt, the
    /// ranking or the attempt limit leaves no room for a second attempt, or the first
    /// attempt's own timeout (or the deadline) comes before the hedge would start.
    #[must_use]
    pub fn hedge(&self, first: &NextAttempt, started: Timestamp) -> Option<NextAttempt> {
        let delay = self.hedge_plan?.delay;
        if !first.is_first() || self.hedge_started || self.ended.is_some() {
            return None;
        }
        if self.counted_attempts() + 2 > self.limits.max_attempts as usize {
            return None;
        }
        let candidate = *self.order.get(self.next + 1)?;
        if first.timeout.is_some_and(|t| t.0 <= delay.0) {
            return None;
        }
        let remaining = self.remaining(started.plus(delay));
        if remaining.is_some_and(|r| r.0 < self.limits.min_attempt_budget.0) {
            return None;
        }
        let timeout = match (self.limits.attempt_timeout, remaining) {
            (Some(a), Some(r)) => Some(if a.0 < r.0 { a } else { r }),
            (a, r) => a.or(r),
        };
        Some(NextAttempt {
            candidate,
            timeout,
            number: 1,
            wait: delay,
            retry: None,
        })
    }

    /// The hedge [`Execution::hedge`] planned has started: two attempts are out.
    pub fn start_hedge(&mut self, hedge: &NextAttempt) {
        self.hedged = Some(hedge.candidate);
        self.hedge_started = true;
        self.in_flight = 2;
    }

    /// Sets where the 5xx retry's pause falls in its range: `u` in [0, 1) (from the caller's
    /// random source; 0.5, the mean, by default) gives `server_error_retry × (1 − j + 2j·u)`
    /// with j the limits' `server_error_jitter` (0.5: `× (0.5 + u)`).
    #[must_use]
    pub fn with_jitter(mut self, u: f64) -> Execution {
        self.jitter = if (0.0..1.0).contains(&u) { u } else { 0.5 };
        self
    }

    /// What is left of the deadline at `now`.
    #[must_use]
    pub fn remaining(&self, now: Timestamp) -> Option<Millis> {
        self.deadline
            .map(|d| Millis((d.0 - now.since(self.started).0).max(0.0)))
    }

    /// The next attempt to make at `now`, or `None` when the request is over.
    pub fn next_attempt(&mut self, now: Timestamp) -> Option<NextAttempt> {
        if self.ended.is_some() {
            return None;
        }
        let (candidate, wait, retry) = match self.retry {
            Some(r) => (
                r.candidate,
                Millis((r.not_before.0 - now.0).max(0.0)),
                Some(r.reason),
            ),
            None => (usize::MAX, Millis(0.0), None),
        };
        if self.counted_attempts() >= self.limits.max_attempts as usize
            || (retry.is_none() && self.next >= self.order.len())
        {
            self.ended = Some(RequestStatus::Exhausted);
            return None;
        }
        // What is left once the pause is over.
        let remaining = self.remaining(now).map(|r| Millis((r.0 - wait.0).max(0.0)));
        if remaining.is_some_and(|r| r.0 < self.limits.min_attempt_budget.0) {
            if retry.is_some() {
                // The pause no longer fits: fall over instead.
                self.retry = None;
                return self.next_attempt(now);
            }
            self.ended = Some(RequestStatus::DeadlineExceeded);
            return None;
        }
        let timeout = match (self.limits.attempt_timeout, remaining) {
            (Some(a), Some(r)) => Some(if a.0 < r.0 { a } else { r }),
            (a, r) => a.or(r),
        };
        Some(NextAttempt {
            candidate: if retry.is_some() {
                candidate
            } else {
                self.order[self.next]
            },
            timeout,
            number: self.attempts.len() as u32,
            wait,
            retry,
        })
    }

    /// Whether another candidate could still be tried after `proposed` (the attempt
    /// [`Execution::next_attempt`] just gave) fails: one left in the ranking and an attempt
    /// left under `max_attempts`.
    #[must_use]
    pub fn has_fallback_after(&self, proposed: &NextAttempt) -> bool {
        let after = if proposed.retry.is_some() {
            self.next
        } else {
            self.next + 1
        };
        after < self.order.len() && self.counted_attempts() + 1 < self.limits.max_attempts as usize
    }

    /// Attempts recorded so far.
    #[must_use]
    pub fn attempts(&self) -> usize {
        self.attempts.len()
    }

    /// Attempts recorded so far that count against `max_attempts`: all but rests (an
    /// unbilled 429 with `Retry-After`, [`AttemptOutcome::is_rest`]), which took the provider
    /// no work and the request only their latency, so that a provider at its capacity does
    /// not use up the request's fallbacks.
    fn counted_attempts(&self) -> usize {
        self.attempts
            .iter()
            .filter(|a| !a.outcome.is_rest())
            .count()
    }

    /// Continues with `order` instead of the rest of the ranking, and resumes a request that
    /// a client error had ended: for errors that belong to the candidate rather than the
    /// request, such as a context window too small for it.
    pub fn continue_with(&mut self, order: Vec<usize>) {
        if matches!(self.ended, Some(RequestStatus::ClientError { .. })) {
            self.ended = None;
        }
        self.order.truncate(self.next);
        self.order.extend(order);
    }

    /// Passes over the candidate [`Execution::next_attempt`] proposed without trying it (e.g. its
    /// circuit breaker refused the attempt at the last moment).
    pub fn skip(&mut self) {
        // A refused retry is dropped; the ranking goes on where it was.
        if self.retry.take().is_none() {
            self.next += 1;
        }
    }

    /// Records the outcome of the attempt on `candidate` that started at `started`.
    pub fn record(&mut self, candidate: usize, outcome: AttemptOutcome, started: Timestamp) {
        let retry = self
            .retry
            .take()
            .filter(|r| r.candidate == candidate)
            .map(|r| r.reason);
        let hedge = self.in_flight > 0 && self.hedged == Some(candidate);
        if hedge {
            self.hedged = None;
        }
        // Is the other attempt of a hedged pair still out?
        let other_out = self.in_flight == 2;
        self.in_flight = self.in_flight.saturating_sub(1);
        self.attempts.push(AttemptRecord {
            candidate,
            started,
            outcome,
            retry,
            hedge,
        });
        // A retry does not move on in the ranking: its candidate was passed already.
        if retry.is_none() {
            self.next += 1;
        }
        if let AttemptStatus::ProviderError(failure) = outcome.status {
            if !other_out {
                self.retry = self.plan_retry(candidate, failure, &outcome, started);
                self.retried |= self.retry.is_some();
            }
        }
        // An answer stands: the other attempt of a hedge cannot take it back.
        if matches!(self.ended, Some(RequestStatus::Succeeded { .. })) {
            return;
        }
        match outcome.status {
            AttemptStatus::Ok => self.ended = Some(RequestStatus::Succeeded { candidate }),
            AttemptStatus::ClientError => {
                self.ended = Some(RequestStatus::ClientError { candidate });
            }
            AttemptStatus::Timeout => {
                let end = started.plus(outcome.latency);
                if self
                    .remaining(end)
                    .is_some_and(|r| r.0 < self.limits.min_attempt_budget.0)
                {
                    self.ended = Some(RequestStatus::DeadlineExceeded);
                }
            }
            AttemptStatus::ProviderError(_) | AttemptStatus::Cancelled => {}
        }
    }

    /// Whether the provider error of `candidate` is worth one retry of it rather than falling
    /// over, and when: see the module doc.
    fn plan_retry(
        &self,
        candidate: usize,
        failure: crate::decision::ProviderFailure,
        outcome: &AttemptOutcome,
        started: Timestamp,
    ) -> Option<ScheduledRetry> {
        use crate::decision::ProviderFailure;
        if self.retried {
            return None;
        }
        let (wait, reason) = match (failure, outcome.retry_after) {
            (ProviderFailure::RateLimited | ProviderFailure::Server, Some(after)) => {
                let best = self.order.first() == Some(&candidate);
                // The next candidate is as good: the wait would cost latency and, behind a
                // rate limit under more traffic than it admits, buy no capacity.
                let as_good_next = self.next < self.interchangeable.min(self.order.len())
                    && self.counted_attempts() < self.limits.max_attempts as usize;
                if !best || as_good_next || after.0 > self.limits.max_retry_after_wait.0 {
                    return None;
                }
                (after, RetryReason::RetryAfter)
            }
            (ProviderFailure::Server, None) => {
                let base = self.limits.server_error_retry?;
                let j = self.limits.server_error_jitter.clamp(0.0, 1.0);
                (
                    Millis(base.0 * (1.0 - j + 2.0 * j * self.jitter)),
                    RetryReason::ServerError,
                )
            }
            _ => return None,
        };
        let end = started.plus(outcome.latency);
        // The deadline must leave at least as long for the retry as the pause takes.
        let room = wait.0.max(self.limits.min_attempt_budget.0);
        if self.remaining(end).is_some_and(|r| r.0 - wait.0 < room) {
            return None;
        }
        Some(ScheduledRetry {
            candidate,
            not_before: end.plus(wait),
            reason,
        })
    }

    /// The result at `now`, when the request is over (or abandoned).
    #[must_use]
    pub fn finish(self, now: Timestamp) -> RequestResult {
        let status = self.ended.unwrap_or(RequestStatus::Exhausted);
        RequestResult {
            status,
            cost: Usd(self.attempts.iter().map(|a| a.outcome.cost.0).sum()),
            latency: now.since(self.started),
            attempts: self.attempts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::ProviderFailure;

    /// A hedge planned `delay_ms` after the first attempt's start.
    fn plan(delay_ms: f64) -> HedgePlan {
        HedgePlan {
            delay: Millis(delay_ms),
            reason: HedgeReason::Quantile,
        }
    }

    fn outcome(latency: f64, status: AttemptStatus, cost: f64) -> AttemptOutcome {
        AttemptOutcome {
            cost: Usd(cost),
            ..AttemptOutcome::with_status(latency, status)
        }
    }

    #[test]
    fn a_retry_after_falls_over_to_a_candidate_the_policy_holds_as_good() {
        let rest = || failed(40.0, ProviderFailure::RateLimited, Some(300.0));
        // The same 300 ms Retry-After on the best candidate: waited out when the next one is
        // worse (or nothing is said), fallen over when the ranking says it is as good.
        for (interchangeable, next) in [(0, 2), (1, 2), (2, 1)] {
            let mut run = Execution::new(
                vec![2, 1, 0],
                Timestamp(0.0),
                Some(Millis(5000.0)),
                ExecutionLimits::default(),
            )
            .with_interchangeable(interchangeable);
            let a = run.next_attempt(Timestamp(0.0)).unwrap();
            run.record(a.candidate, rest(), Timestamp(0.0));
            let b = run.next_attempt(Timestamp(40.0)).unwrap();
            assert_eq!(b.candidate, next, "{interchangeable} interchangeable");
            let waited = if next == 2 { 300.0 } else { 0.0 };
            assert!(
                (b.wait.0 - waited).abs() < 1e-9,
                "{interchangeable}: {:?}",
                b.wait
            );
        }
    }

    #[test]
    fn rests_do_not_use_up_the_attempts() {
        // Two attempts allowed; two providers at capacity refuse with Retry-After (on the
        // second of the ranking: no wait), then the third answers.
        let limits = ExecutionLimits {
            max_attempts: 2,
            ..ExecutionLimits::default()
        };
        let mut run =
            Execution::new(vec![0, 1, 2, 3], Timestamp(0.0), None, limits).with_interchangeable(4);
        let rest = failed(30.0, ProviderFailure::RateLimited, Some(2000.0));
        let mut now = Timestamp(0.0);
        for expected in [0, 1] {
            let a = run.next_attempt(now).unwrap();
            assert_eq!(a.candidate, expected);
            run.record(a.candidate, rest, now);
            now = now.plus(rest.latency);
        }
        // A 5xx counts: one attempt of the two is left after it, none after a second.
        let c = run.next_attempt(now).unwrap();
        assert_eq!((c.candidate, c.number), (2, 2));
        let server = AttemptOutcome {
            cost: Usd(0.01),
            ..failed(100.0, ProviderFailure::Server, None)
        };
        run.record(2, server, now);
        now = now.plus(server.latency);
        // Its 5xx retry (50 ms ± jitter) is the second counted attempt.
        let d = run.next_attempt(now).unwrap();
        assert_eq!(d.candidate, 2);
        run.record(2, server, now.plus(d.wait));
        assert!(run.next_attempt(now.plus(Millis(1000.0))).is_none());
        let result = run.finish(now.plus(Millis(1000.0)));
        assert_eq!(result.status, RequestStatus::Exhausted);
        assert_eq!(result.attempts.len(), 4);
    }

    #[test]
    fn falls_back_on_provider_errors_and_counts_every_attempt() {
        // Without the 5xx retry (tested below): straight to the next candidate.
        let limits = ExecutionLimits {
            server_error_retry: None,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![2, 0, 1], Timestamp(0.0), Some(Millis(1000.0)), limits);
        let a = run.next_attempt(Timestamp(0.0)).unwrap();
        assert_eq!(
            (a.candidate, a.timeout, a.number),
            (2, Some(Millis(1000.0)), 0)
        );
        run.record(
            2,
            outcome(
                100.0,
                AttemptStatus::ProviderError(ProviderFailure::Server),
                0.01,
            ),
            Timestamp(0.0),
        );
        // 900 ms left for the fallback.
        let b = run.next_attempt(Timestamp(100.0)).unwrap();
        assert_eq!((b.candidate, b.timeout), (0, Some(Millis(900.0))));
        run.record(0, outcome(300.0, AttemptStatus::Ok, 0.02), Timestamp(100.0));
        assert!(run.next_attempt(Timestamp(400.0)).is_none());
        let r = run.finish(Timestamp(400.0));
        assert_eq!(r.status, RequestStatus::Succeeded { candidate: 0 });
        assert_eq!(r.fallbacks(), 1);
        assert!((r.cost.0 - 0.03).abs() < 1e-12 && (r.latency.0 - 400.0).abs() < 1e-12);
    }

    #[test]
    fn client_errors_end_the_request_and_deadlines_end_it_too() {
        let mut run = Execution::new(vec![0, 1], Timestamp(0.0), None, ExecutionLimits::default());
        let a = run.next_attempt(Timestamp(0.0)).unwrap();
        assert_eq!(a.timeout, None);
        run.record(
            0,
            outcome(5.0, AttemptStatus::ClientError, 0.0),
            Timestamp(0.0),
        );
        assert!(run.next_attempt(Timestamp(5.0)).is_none());
        assert_eq!(
            run.finish(Timestamp(5.0)).status,
            RequestStatus::ClientError { candidate: 0 }
        );

        let limits = ExecutionLimits {
            attempt_timeout: Some(Millis(400.0)),
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![0, 1, 2], Timestamp(0.0), Some(Millis(600.0)), limits);
        assert_eq!(
            run.next_attempt(Timestamp(0.0)).unwrap().timeout,
            Some(Millis(400.0))
        );
        // The attempt timeout (400 ms) is not the deadline: fall back with 200 ms left.
        run.record(
            0,
            outcome(400.0, AttemptStatus::Timeout, 0.0),
            Timestamp(0.0),
        );
        let b = run.next_attempt(Timestamp(400.0)).unwrap();
        assert_eq!((b.candidate, b.timeout), (1, Some(Millis(200.0))));
        run.record(
            1,
            outcome(200.0, AttemptStatus::Timeout, 0.0),
            Timestamp(400.0),
        );
        assert!(run.next_attempt(Timestamp(600.0)).is_none());
        assert_eq!(
            run.finish(Timestamp(600.0)).status,
            RequestStatus::DeadlineExceeded
        );
    }

    #[test]
    fn a_client_error_of_the_candidate_can_continue_elsewhere() {
        let mut run = Execution::new(
            vec![0, 1, 2],
            Timestamp(0.0),
            None,
            ExecutionLimits::default(),
        );
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            0,
            outcome(5.0, AttemptStatus::ClientError, 0.0),
            Timestamp(0.0),
        );
        assert!(
            run.clone().next_attempt(Timestamp(5.0)).is_none(),
            "a client error ends the request"
        );
        run.continue_with(vec![2]);
        assert_eq!(run.next_attempt(Timestamp(5.0)).unwrap().candidate, 2);
        run.record(2, outcome(5.0, AttemptStatus::Ok, 0.0), Timestamp(5.0));
        assert!(run.next_attempt(Timestamp(10.0)).is_none());
        assert_eq!(
            run.finish(Timestamp(10.0)).status,
            RequestStatus::Succeeded { candidate: 2 }
        );
    }

    #[test]
    fn a_skipped_candidate_uses_no_attempt() {
        let limits = ExecutionLimits {
            max_attempts: 1,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![4, 5], Timestamp(0.0), None, limits);
        assert_eq!(run.next_attempt(Timestamp(0.0)).unwrap().candidate, 4);
        run.skip();
        assert_eq!(run.next_attempt(Timestamp(0.0)).unwrap().candidate, 5);
        run.record(5, outcome(3.0, AttemptStatus::Ok, 0.0), Timestamp(0.0));
        assert_eq!(
            run.finish(Timestamp(3.0)).status,
            RequestStatus::Succeeded { candidate: 5 }
        );
    }

    #[test]
    fn attempt_limit_and_empty_order_exhaust() {
        let limits = ExecutionLimits {
            max_attempts: 1,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![0, 1], Timestamp(0.0), None, limits);
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            0,
            outcome(
                1.0,
                AttemptStatus::ProviderError(ProviderFailure::Connection),
                0.0,
            ),
            Timestamp(0.0),
        );
        assert!(run.next_attempt(Timestamp(1.0)).is_none());
        assert_eq!(run.finish(Timestamp(1.0)).status, RequestStatus::Exhausted);
        let mut empty = Execution::new(vec![], Timestamp(0.0), None, ExecutionLimits::default());
        assert!(empty.next_attempt(Timestamp(0.0)).is_none());
        assert_eq!(
            empty.finish(Timestamp(0.0)).status,
            RequestStatus::Exhausted
        );
    }

    fn failed(latency: f64, failure: ProviderFailure, retry_after: Option<f64>) -> AttemptOutcome {
        AttemptOutcome {
            retry_after: retry_after.map(Millis),
            ..outcome(latency, AttemptStatus::ProviderError(failure), 0.0)
        }
    }

    #[test]
    fn a_short_retry_after_on_the_best_candidate_is_waited_out_once() {
        let limits = ExecutionLimits::default();
        let mut run = Execution::new(vec![2, 0, 1], Timestamp(0.0), Some(Millis(1000.0)), limits);
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        // 429 after 50 ms, back in 300 ms: 950 ms left, 300 to wait leaves 650 ≥ 300.
        let limited = failed(50.0, ProviderFailure::RateLimited, Some(300.0));
        run.record(2, limited, Timestamp(0.0));
        let retry = run.next_attempt(Timestamp(50.0)).unwrap();
        assert_eq!(
            (
                retry.candidate,
                retry.wait,
                retry.retry,
                retry.timeout,
                retry.number
            ),
            (
                2,
                Millis(300.0),
                Some(RetryReason::RetryAfter),
                Some(Millis(650.0)),
                1
            )
        );
        // The same 429 again: no second retry, on to the next candidate.
        run.record(2, limited, Timestamp(350.0));
        let next = run.next_attempt(Timestamp(400.0)).unwrap();
        assert_eq!(
            (next.candidate, next.wait, next.retry),
            (0, Millis(0.0), None)
        );
        run.record(0, outcome(10.0, AttemptStatus::Ok, 0.0), Timestamp(400.0));
        let r = run.finish(Timestamp(410.0));
        assert_eq!(r.status, RequestStatus::Succeeded { candidate: 0 });
        let retries: Vec<Option<RetryReason>> = r.attempts.iter().map(|a| a.retry).collect();
        assert_eq!(retries, [None, Some(RetryReason::RetryAfter), None]);
    }

    #[test]
    fn a_retry_after_too_long_for_the_limit_or_the_deadline_or_on_a_fallback_falls_over() {
        let cases = [
            // Longer than max_retry_after_wait (1 s).
            (vec![2, 0], Some(1000.0), 1500.0, 0),
            // 300 ms to wait, 450 ms left: not as long again for the retry.
            (vec![2, 0], Some(500.0), 300.0, 0),
        ];
        for (order, deadline, after, want) in cases {
            let mut run = Execution::new(
                order,
                Timestamp(0.0),
                deadline.map(Millis),
                ExecutionLimits::default(),
            );
            let _ = run.next_attempt(Timestamp(0.0)).unwrap();
            run.record(
                2,
                failed(50.0, ProviderFailure::RateLimited, Some(after)),
                Timestamp(0.0),
            );
            let next = run.next_attempt(Timestamp(50.0)).unwrap();
            assert_eq!((next.candidate, next.retry), (want, None), "{after} ms");
        }
        // A fallback that says come back later: a worse candidate is not waited for.
        let mut run = Execution::new(
            vec![0, 1, 2],
            Timestamp(0.0),
            None,
            ExecutionLimits::default(),
        );
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            0,
            failed(5.0, ProviderFailure::Connection, None),
            Timestamp(0.0),
        );
        let _ = run.next_attempt(Timestamp(5.0)).unwrap();
        run.record(
            1,
            failed(5.0, ProviderFailure::RateLimited, Some(10.0)),
            Timestamp(5.0),
        );
        assert_eq!(run.next_attempt(Timestamp(10.0)).unwrap().candidate, 2);
    }

    #[test]
    fn a_5xx_gets_one_jittered_retry_and_a_refused_retry_moves_on() {
        for (u, pause) in [(0.0, 25.0), (0.5, 50.0), (0.9, 70.0)] {
            let mut run = Execution::new(
                vec![1, 0],
                Timestamp(0.0),
                Some(Millis(1000.0)),
                ExecutionLimits::default(),
            )
            .with_jitter(u);
            let _ = run.next_attempt(Timestamp(0.0)).unwrap();
            run.record(
                1,
                failed(20.0, ProviderFailure::Server, None),
                Timestamp(0.0),
            );
            let retry = run.next_attempt(Timestamp(20.0)).unwrap();
            assert_eq!(
                (retry.candidate, retry.retry),
                (1, Some(RetryReason::ServerError))
            );
            assert!(
                (retry.wait.0 - pause).abs() < 1e-9,
                "u = {u}: {:?}",
                retry.wait
            );
            // Its second 5xx: on to the next candidate.
            run.record(
                1,
                failed(20.0, ProviderFailure::Server, None),
                Timestamp(20.0 + pause),
            );
            let next = run.next_attempt(Timestamp(40.0 + pause)).unwrap();
            assert_eq!((next.candidate, next.retry), (0, None));
        }
        // Without jitter the pause is the mean, whatever the draw.
        let limits = ExecutionLimits {
            server_error_jitter: 0.0,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![1, 0], Timestamp(0.0), None, limits).with_jitter(0.9);
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            1,
            failed(20.0, ProviderFailure::Server, None),
            Timestamp(0.0),
        );
        assert_eq!(
            run.next_attempt(Timestamp(20.0)).unwrap().wait,
            Millis(50.0)
        );
        // A retry its breaker refuses is dropped; the ranking goes on.
        let mut run = Execution::new(vec![1, 0], Timestamp(0.0), None, ExecutionLimits::default());
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            1,
            failed(20.0, ProviderFailure::Server, None),
            Timestamp(0.0),
        );
        assert_eq!(run.next_attempt(Timestamp(20.0)).unwrap().candidate, 1);
        run.skip();
        assert_eq!(run.next_attempt(Timestamp(20.0)).unwrap().candidate, 0);
        // The pause counts against max_attempts like any attempt: with 1, none is made.
        let limits = ExecutionLimits {
            max_attempts: 1,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(vec![1, 0], Timestamp(0.0), None, limits);
        let _ = run.next_attempt(Timestamp(0.0)).unwrap();
        run.record(
            1,
            failed(20.0, ProviderFailure::Server, None),
            Timestamp(0.0),
        );
        assert!(run.next_attempt(Timestamp(20.0)).is_none());
    }

    fn hedged(order: Vec<usize>, deadline: f64, delay: f64) -> (Execution, NextAttempt) {
        let limits = ExecutionLimits {
            server_error_retry: None,
            ..ExecutionLimits::default()
        };
        let mut run = Execution::new(order, Timestamp(0.0), Some(Millis(deadline)), limits)
            .with_hedge(Some(plan(delay)));
        let first = run.next_attempt(Timestamp(0.0)).unwrap();
        (run, first)
    }

    #[test]
    fn a_hedge_joins_the_first_attempt_on_the_next_candidate_and_the_first_answer_wins() {
        let (mut run, first) = hedged(vec![2, 0, 1], 2000.0, 800.0);
        let h = run.hedge(&first, Timestamp(0.0)).unwrap();
        // At 800 ms on candidate 0, with the 1200 ms the deadline leaves then.
        assert_eq!(
            (h.candidate, h.wait, h.timeout, h.number),
            (0, Millis(800.0), Some(Millis(1200.0)), 1)
        );
        run.start_hedge(&h);
        // The hedge answers at 800 + 300 = 1100 ms; the first, still out, is cancelled then.
        run.record(0, outcome(300.0, AttemptStatus::Ok, 0.02), Timestamp(800.0));
        run.record(
            2,
            outcome(1100.0, AttemptStatus::Cancelled, 0.01),
            Timestamp(0.0),
        );
        assert!(run.next_attempt(Timestamp(1100.0)).is_none());
        let r = run.finish(Timestamp(1100.0));
        assert_eq!(r.status, RequestStatus::Succeeded { candidate: 0 });
        assert_eq!(r.hedge(), Some(true), "the hedge won");
        let flags: Vec<bool> = r.attempts.iter().map(|a| a.hedge).collect();
        assert_eq!(flags, [true, false]);
        // Both are paid: the loser was billed when it was cancelled.
        assert!((r.cost.0 - 0.03).abs() < 1e-12);
    }

    #[test]
    fn a_failure_beside_a_hedge_waits_for_it_and_an_answer_stands() {
        // The first fails (5xx) while the hedge is out: no retry, no fallback yet; the
        // hedge's answer is the request's.
        let (mut run, first) = hedged(vec![2, 0, 1], 2000.0, 500.0);
        let h = run.hedge(&first, Timestamp(0.0)).unwrap();
        run.start_hedge(&h);
        run.record(
            2,
            failed(600.0, ProviderFailure::Server, None),
            Timestamp(0.0),
        );
        run.record(0, outcome(400.0, AttemptStatus::Ok, 0.0), Timestamp(500.0));
        assert!(run.next_attempt(Timestamp(900.0)).is_none());
        let r = run.finish(Timestamp(900.0));
        assert_eq!(r.status, RequestStatus::Succeeded { candidate: 0 });
        assert_eq!(r.hedge(), Some(true));

        // The first answers; the hedge, cancelled, cannot undo it.
        let (mut run, first) = hedged(vec![2, 0, 1], 2000.0, 500.0);
        let h = run.hedge(&first, Timestamp(0.0)).unwrap();
        run.start_hedge(&h);
        run.record(2, outcome(700.0, AttemptStatus::Ok, 0.0), Timestamp(0.0));
        run.record(
            0,
            outcome(200.0, AttemptStatus::Cancelled, 0.0),
            Timestamp(500.0),
        );
        let r = run.finish(Timestamp(700.0));
        assert_eq!(r.status, RequestStatus::Succeeded { candidate: 2 });
        assert_eq!(r.hedge(), Some(false), "the hedge lost");

        // Both fail: the request falls back to the third candidate.
        let (mut run, first) = hedged(vec![2, 0, 1], 2000.0, 500.0);
        let h = run.hedge(&first, Timestamp(0.0)).unwrap();
        run.start_hedge(&h);
        run.record(
            0,
            failed(100.0, ProviderFailure::Connection, None),
            Timestamp(500.0),
        );
        run.record(
            2,
            failed(700.0, ProviderFailure::Server, None),
            Timestamp(0.0),
        );
        let next = run.next_attempt(Timestamp(700.0)).unwrap();
        assert_eq!((next.candidate, next.number, next.retry), (1, 2, None));
        assert!(
            run.hedge(&next, Timestamp(700.0)).is_none(),
            "one hedge per request"
        );
    }

    #[test]
    fn no_hedge_without_room_for_it() {
        // The deadline (or the first attempt's timeout) comes first.
        let (run, first) = hedged(vec![0, 1], 400.0, 500.0);
        assert!(run.hedge(&first, Timestamp(0.0)).is_none());
        // No next candidate.
        let (run, first) = hedged(vec![0], 2000.0, 500.0);
        assert!(run.hedge(&first, Timestamp(0.0)).is_none());
        // One attempt allowed.
        let limits = ExecutionLimits {
            max_attempts: 1,
            ..ExecutionLimits::default()
        };
        let mut run =
            Execution::new(vec![0, 1], Timestamp(0.0), None, limits).with_hedge(Some(plan(10.0)));
        let first = run.next_attempt(Timestamp(0.0)).unwrap();
        assert!(run.hedge(&first, Timestamp(0.0)).is_none());
        // No delay planned.
        let mut run = Execution::new(vec![0, 1], Timestamp(0.0), None, ExecutionLimits::default());
        let first = run.next_attempt(Timestamp(0.0)).unwrap();
        assert!(run.hedge(&first, Timestamp(0.0)).is_none());
        // Without a deadline the hedge has the attempt timeout only (here none).
        let mut run = Execution::new(vec![0, 1], Timestamp(0.0), None, ExecutionLimits::default())
            .with_hedge(Some(plan(10.0)));
        let first = run.next_attempt(Timestamp(0.0)).unwrap();
        let h = run.hedge(&first, Timestamp(0.0)).unwrap();
        assert_eq!((h.candidate, h.timeout), (1, None));
    }
}
