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

use crate::decision::{AttemptOutcome, AttemptStatus, Millis, Timestamp, Usd};
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
}

impl Default for ExecutionLimits {
    fn default() -> Self {
        ExecutionLimits {
            max_attempts: 3,
            attempt_timeout: None,
            min_attempt_budget: Millis(1.0),
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
}

/// One attempt as it happened.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub candidate: usize,
    pub started: Timestamp,
    pub outcome: AttemptOutcome,
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
        }
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
        if self.attempts.len() >= self.limits.max_attempts as usize || self.next >= self.order.len()
        {
            self.ended = Some(RequestStatus::Exhausted);
            return None;
        }
        let remaining = self.remaining(now);
        if remaining.is_some_and(|r| r.0 < self.limits.min_attempt_budget.0) {
            self.ended = Some(RequestStatus::DeadlineExceeded);
            return None;
        }
        let timeout = match (self.limits.attempt_timeout, remaining) {
            (Some(a), Some(r)) => Some(if a.0 < r.0 { a } else { r }),
            (a, r) => a.or(r),
        };
        Some(NextAttempt {
            candidate: self.order[self.next],
            timeout,
            number: self.attempts.len() as u32,
        })
    }

    /// Attempts recorded so far.
    #[must_use]
    pub fn attempts(&self) -> usize {
        self.attempts.len()
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
        self.next += 1;
    }

    /// Records the outcome of the attempt on `candidate` that started at `started`.
    pub fn record(&mut self, candidate: usize, outcome: AttemptOutcome, started: Timestamp) {
        self.attempts.push(AttemptRecord {
            candidate,
            started,
            outcome,
        });
        self.next += 1;
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

    fn outcome(latency: f64, status: AttemptStatus, cost: f64) -> AttemptOutcome {
        AttemptOutcome {
            cost: Usd(cost),
            ..AttemptOutcome::with_status(latency, status)
        }
    }

    #[test]
    fn falls_back_on_provider_errors_and_counts_every_attempt() {
        let limits = ExecutionLimits::default();
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
}
