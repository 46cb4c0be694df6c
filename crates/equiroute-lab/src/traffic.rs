//! A logged run's traffic: what the runner records of each request (the feedback the policy
//! received before it, its context, first choice and propensity, its attempts and outcome)
//! for off-policy evaluation ([`crate::ope`]).

use equiroute_core::{AttemptOutcome, Candidate, Millis, Timestamp, TokenEstimate};

/// A quality score the logging policy received before a decision.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedFeedback {
    /// The logged round whose answer was scored.
    pub round: usize,
    pub candidate: usize,
    pub features: Vec<f64>,
    pub quality: f64,
    pub latency: Millis,
    pub now: Timestamp,
}

/// One attempt of a logged request.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedAttempt {
    pub candidate: usize,
    /// The deadline left when the attempt started.
    pub deadline: Option<Millis>,
    pub outcome: AttemptOutcome,
    pub now: Timestamp,
}

/// One logged request: what the policy learnt before it, its context and first choice, its
/// attempts and its outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedRound {
    pub feedback: Vec<LoggedFeedback>,
    pub features: Vec<f64>,
    pub eligible: Vec<usize>,
    pub deadline: Option<Millis>,
    pub now: Timestamp,
    pub in_flight: Vec<u32>,
    /// The true expected values (for the `oracle` target only).
    pub values: Vec<f64>,
    pub action: usize,
    pub propensity: f64,
    pub propensity_exact: bool,
    pub attempts: Vec<LoggedAttempt>,
    /// Gold quality of the answer (0 without one).
    pub quality: f64,
    pub missed: bool,
    pub cost: f64,
}

/// A logged run.
#[derive(Clone, Debug, PartialEq)]
pub struct TrafficLog {
    pub candidates: Vec<Candidate>,
    pub tokens: TokenEstimate,
    pub rounds: Vec<LoggedRound>,
}
