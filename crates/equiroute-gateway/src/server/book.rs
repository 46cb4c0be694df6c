//! Book: the outcome ledger. The one place where an attempt's end, a request's end and a
//! quality score become all of their consequences, in one documented order each; the stages
//! (`attempt`, `race`, `relay`, `execute`) and the feedback route call it, never the pieces.
//!
//! An attempt's end ([`Ledger::attempt`]):
//! 1. its span gets the outcome and the usage; the provider's token histograms and the
//!    dashboard's token counts;
//! 2. `/metrics`: the attempt by status, its cost;
//! 3. learning: the policy of the arm that routed it (the live policy under its write side,
//!    or queued in `deferred` when that is busy; a canary's its own; the shadow beside the
//!    live one), the shared journal (Redis), evicted slices, quality shifts reported;
//! 4. the provider's breaker: its transitions counted, an opening journaled, a recovery told
//!    to the policy, an opening or a recovery marked on the dashboard's time line;
//! 5. the `debug` line;
//! 6. the request's [`Execution`], which decides what comes next.
//!
//! A request's end ([`Ledger::request`]):
//! 1. `/metrics`: latency, cost, the answering provider's latency;
//! 2. the request's span ends with its outcome;
//! 3. the canary's guard and the shadow's window (a rollback is journaled);
//! 4. the dashboard's history;
//! 5. the audit log;
//! 6. `/metrics`: the request by outcome;
//! 7. an answered request's context is kept for its quality score (and journaled).
//!
//! A quality score ([`Ledger::score`]): the dashboard's operations view, the arm that routed
//! the request learns it (the rollout's statistics too), the journal, quality shifts reported.

use super::arms::Arm;
use super::decide::Decided;
use super::metrics::outcome_label;
use super::shifts::ShiftRecord;
use super::state::{AppState, Features, InterfaceRuntime, PendingContext, Poisoned};
use crate::shared::Event;
use equiroute_core::breaker::{Breaker, BreakerConfig, BreakerState, Transition};
use equiroute_core::executor::{Execution, NextAttempt, RequestResult, RequestStatus};
use equiroute_core::policies::{
    AttemptObservation, Observation, Policy, QualityObservation, QualityShift, ShiftDirection,
};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, SlicePath, Timestamp, TokenEstimate};
use std::sync::RwLockWriteGuard;
use std::time::{Duration, Instant};

/// What booking a request's attempts needs besides the attempt: its decision.
pub(super) struct Booking<'a> {
    pub features: &'a [f64],
    /// The arm (live or canary) whose policy learns from the attempt.
    pub arm: Arm,
    pub slice: SlicePath,
    pub tokens: TokenEstimate,
}

impl Booking<'_> {
    /// What booking a request's attempts needs, from its decision.
    pub(super) fn of<'f>(
        features: &'f [f64],
        decided: &Decided,
        tokens: TokenEstimate,
    ) -> Booking<'f> {
        Booking {
            features,
            arm: decided.routed.arm,
            slice: decided.slice,
            tokens,
        }
    }
}

/// One attempt's end.
#[derive(Clone, Copy)]
pub(super) struct AttemptEnd<'s> {
    /// The attempt's span (`attempt`).
    pub span: &'s tracing::Span,
    pub candidate: usize,
    /// The attempt as the execution gave it; `None` for a committed stream's (the relay logs
    /// its end, and the deadline no longer bounds it).
    pub next: Option<NextAttempt>,
    /// When it started.
    pub started: Timestamp,
    pub outcome: AttemptOutcome,
    /// The tokens the provider reported, if it did.
    pub usage: Option<TokenEstimate>,
}

/// An answered request, whose context waits for its quality score.
pub(super) struct Answer<'a> {
    pub candidate: usize,
    pub latency: Millis,
    pub at: Timestamp,
    /// The label of the key that made the request.
    pub owner: Option<&'a str>,
}

/// One request's end.
#[derive(Clone, Copy)]
pub(super) struct RequestEnd<'a> {
    pub request_id: &'a str,
    pub decided: &'a Decided,
    pub features: &'a [f64],
    pub result: &'a RequestResult,
    /// The request's outcome in `equiroute_requests_total`.
    pub label: &'static str,
    /// The label of the key that made the request.
    pub owner: Option<&'a str>,
    /// It ended on a provider's content filter refusal.
    pub content_filter: bool,
    /// When it ended (its result was finished at this time): the time its bookkeeping
    /// uses, not read from the clock again.
    pub at: Timestamp,
}

/// The outcome ledger of one interface (see the module doc for what each end does).
pub struct Ledger<'a> {
    pub(super) state: &'a AppState,
    pub(super) iface: &'a InterfaceRuntime,
}

impl AppState {
    /// The outcome ledger of `iface`.
    #[must_use]
    pub fn ledger<'a>(&'a self, iface: &'a InterfaceRuntime) -> Ledger<'a> {
        Ledger { state: self, iface }
    }
}

impl<'a> Ledger<'a> {
    /// Books an attempt's end (steps 1–6 of the module doc) into `run`; returns the time its
    /// learning (steps 2–4) took, which counts in the router's share of the request.
    ///
    /// # Errors
    /// A poisoned lock (the execution then misses the attempt).
    pub(super) fn attempt(
        &self,
        ctx: &Booking<'_>,
        run: &mut Execution,
        end: AttemptEnd<'_>,
    ) -> Result<Duration, Poisoned> {
        let iface = self.iface;
        super::spans::record_attempt(end.span, iface, end.candidate, &end.outcome, end.usage);
        if let Some(u) = end.usage {
            iface
                .meters
                .provider_tokens(end.candidate, u.input, u.output);
            iface
                .history
                .tokens(end.candidate, u.input.into(), u.output.into());
        }
        let remaining = end.next.and_then(|_| run.remaining(end.started));
        // The router's share counts the learning (as before the ledger): the span and the
        // token histograms above are the attempt's own bookkeeping, not the routing.
        let booked = Instant::now();
        self.learn_attempt(
            ctx.arm,
            end.candidate,
            ctx.features,
            ctx.slice,
            &end.outcome,
            remaining,
        )?;
        let took = booked.elapsed();
        if let Some(next) = end.next {
            let outcome = &end.outcome;
            tracing::debug!(
                provider = %iface.candidates[end.candidate].id,
                attempt = next.number,
                retry = next.retry.map(equiroute_core::executor::RetryReason::as_str),
                outcome = outcome.status.as_str(),
                latency_ms = outcome.latency.0,
                "attempt"
            );
        }
        run.record(end.candidate, end.outcome, end.started);
        Ok(took)
    }

    /// Books a request's end (steps 1–6 of the module doc); `answer`: step 7.
    pub(super) fn request(&self, end: RequestEnd<'_>, answer: Option<Answer<'_>>) {
        let (state, iface) = (self.state, self.iface);
        let RequestEnd {
            request_id,
            decided,
            result,
            ..
        } = end;
        iface.meters.request_end(result.latency.0, result.cost.0);
        if let RequestStatus::Succeeded { candidate } = result.status {
            iface.meters.provider_latency(candidate, result.latency.0);
        }
        super::spans::finish_request(
            iface,
            result,
            outcome_label(result.status),
            fallback_reason(&result.attempts).as_deref(),
        );
        self.finish_routed(request_id, decided.routed, result.status, end.at);
        iface.history.count(
            end.at,
            decided.order.first().copied(),
            result,
            (end.owner, end.content_filter),
        );
        audit(state, iface, end);
        iface.meters.request(&state.metrics, end.label);
        // A request that ended on a runtime a reload retired keeps its context under the
        // current runtime's index of its provider (none when the provider is gone).
        if let Some((a, candidate)) =
            answer.and_then(|a| state.feedback_target(iface, a.candidate).map(|c| (a, c)))
        {
            remember(
                state,
                request_id,
                PendingContext {
                    interface: &iface.name,
                    candidate,
                    features: Features::F64(end.features),
                    latency: a.latency,
                    at: a.at,
                    owner: a.owner,
                },
            );
        }
    }

    /// Step 3 of a request's end, at `at`: the canary's guard and the shadow's window; a
    /// rollback the outcome set off is journaled.
    fn finish_routed(
        &self,
        request_id: &str,
        routed: super::arms::Routed,
        status: RequestStatus,
        at: Timestamp,
    ) {
        if let Some(end) = super::arms::finish(self.iface, request_id, routed, status, at.0) {
            self.journal_rollout_end(end);
        }
    }

    /// Books a quality score for `request_id` (see the module doc).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn score(&self, request_id: &str, obs: &QualityObservation<'_>) -> Result<(), Poisoned> {
        let (state, iface) = (self.state, self.iface);
        iface.history.score(obs.now, obs.candidate, obs.quality);
        let (live, ended) = iface
            .arms
            .observe_quality(&iface.name, request_id, obs, state.now().0);
        if let Some(end) = ended {
            self.journal_rollout_end(end);
        }
        if !live {
            // The rollout's candidate routed it and learnt the score.
            self.journal(|| Event::RolloutLearn {
                iface: iface.name.clone(),
                obs: Observation::quality(obs),
            });
            return Ok(());
        }
        let mut policy = self.policy_mut()?;
        policy.observe_quality(obs);
        self.journal(|| Event::Feedback {
            iface: iface.name.clone(),
            request_id: request_id.to_owned(),
            obs: Observation::quality(obs),
        });
        self.report_shifts(policy.as_mut());
        Ok(())
    }

    /// Feeds an observation made elsewhere (a breaker's recovery, one replayed from a log) to
    /// the policy, the shadow and the journal.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn observe(&self, obs: Observation) -> Result<(), Poisoned> {
        // The shadow learns from every observation the live policy learns from.
        if let Some(shadow) = &self.iface.arms.shadow {
            shadow.policy.observe(|| obs.clone());
        }
        let mut policy = self.policy_mut()?;
        self.learn(policy.as_mut(), obs);
        Ok(())
    }

    /// The policy's write side, with the observations deferred while it was busy applied
    /// (and journaled) first: every reader of the whole state and every other writer goes
    /// through here.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn policy_mut(&self) -> Result<RwLockWriteGuard<'a, Box<dyn Policy>>, Poisoned> {
        let mut policy = self.iface.policy.write().map_err(|_| Poisoned)?;
        self.apply_deferred(policy.as_mut());
        Ok(policy)
    }

    /// Counts a failure against candidate `index`'s breaker that no attempt of its own
    /// showed: a rejection another provider disputed (see `server::rejections`). Returns
    /// the open period's end when this failure opened (or re-opened) the breaker.
    ///
    /// # Errors
    /// A poisoned lock.
    pub(crate) fn count_failure(&self, index: usize) -> Result<Option<Timestamp>, Poisoned> {
        let end = self.state.now();
        self.move_breaker(index, end, |breaker, cfg| {
            [
                breaker.record(end, equiroute_core::breaker::BreakerOutcome::Failure, cfg),
                None,
            ]
        })
    }

    /// Journals the end of the interface's rollout decided here, so that the other instances
    /// end theirs (state shared through Redis).
    pub fn journal_rollout_end(&self, end: crate::shared::RolloutEnd) {
        self.journal(|| Event::RolloutEnd {
            iface: self.iface.name.clone(),
            end,
        });
    }

    /// Steps 2–4 of an attempt's end: feeds it (ending now) to the metrics, the policy of
    /// `arm` (a canary's attempts teach the candidate policy instead of the live one: see
    /// [`super::arms`]), the journal and the breaker.
    fn learn_attempt(
        &self,
        arm: Arm,
        index: usize,
        features: &[f64],
        slice: SlicePath,
        outcome: &AttemptOutcome,
        remaining: Option<Millis>,
    ) -> Result<(), Poisoned> {
        let (state, iface) = (self.state, self.iface);
        let end = state.now();
        iface.meters.attempt(
            &state.metrics,
            index,
            outcome.status.as_str(),
            outcome.cost.0,
        );
        let obs = AttemptObservation {
            candidate: index,
            features,
            slice,
            deadline: remaining,
            outcome,
            now: end,
        };
        // The journal is written under the policy lock: the sync task rebuilds the live
        // policy under the same lock (see `shared`). When the lock is busy the observation
        // waits in `deferred` rather than the request waiting for the lock. A canary's
        // attempts teach its own policy only.
        let live = iface.arms.observe_attempt(arm, &obs);
        if !live {
            // The rollout's candidate learnt it: the other instances' candidates learn it too.
            self.journal(|| Event::RolloutLearn {
                iface: iface.name.clone(),
                obs: Observation::attempt(&obs),
            });
        }
        if live {
            match iface.policy.try_write() {
                Ok(mut policy) => {
                    self.apply_deferred(policy.as_mut());
                    policy.observe_attempt(&obs);
                    self.journal_learn(|| Observation::attempt(&obs));
                    let evicted = policy.take_slice_evictions();
                    if evicted > 0 {
                        state.metrics.slices_evicted(&iface.name, evicted);
                    }
                    self.report_shifts(policy.as_mut());
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    iface
                        .defer(Observation::attempt(&obs))
                        .map_err(|()| Poisoned)?;
                }
                Err(std::sync::TryLockError::Poisoned(_)) => return Err(Poisoned),
            }
        }
        self.move_breaker(index, end, |breaker, cfg| {
            breaker.observe(end, outcome, cfg)
        })?;
        Ok(())
    }

    /// Applies and journals the deferred observations, oldest first; the caller holds the
    /// write side.
    fn apply_deferred(&self, policy: &mut dyn Policy) {
        for obs in self.iface.take_deferred() {
            self.learn(policy, obs);
        }
    }

    /// Applies `obs` and journals it, and reports the quality shifts it set off; the caller
    /// holds the write side.
    fn learn(&self, policy: &mut dyn Policy, obs: Observation) {
        obs.apply(policy);
        self.journal_learn(|| obs);
        self.report_shifts(policy);
    }

    /// Journals an observation the policy has just learnt (built only when a journal exists).
    fn journal_learn(&self, obs: impl FnOnce() -> Observation) {
        self.journal(|| Event::Learn {
            iface: self.iface.name.clone(),
            obs: obs(),
        });
    }

    fn journal(&self, event: impl FnOnce() -> Event) {
        if let Some(shared) = &self.state.shared {
            shared.journal.record(event());
        }
    }

    /// Applies `change` (at `end`) to candidate `index`'s breaker, counts its transitions,
    /// shares an opening with the other instances and tells the policy of a recovery.
    /// Returns the open period's end when it opened.
    fn move_breaker(
        &self,
        index: usize,
        end: Timestamp,
        change: impl FnOnce(&mut Breaker, &BreakerConfig) -> [Option<Transition>; 2],
    ) -> Result<Option<Timestamp>, Poisoned> {
        let (state, iface) = (self.state, self.iface);
        let id = &iface.candidates[index].id.0;
        let mut breakers = iface.breakers.lock().map_err(|_| Poisoned)?;
        let before = breakers[index].state;
        let mut recovered = false;
        for t in change(&mut breakers[index], &iface.breaker_config)
            .into_iter()
            .flatten()
        {
            state
                .metrics
                .breaker(&iface.name, id, super::metrics::transition_name(t));
            // Closed by an attempt: its half-open probes succeeded.
            recovered |= t == Transition::Closed;
        }
        let breaker_state = breakers[index].state;
        let pinned = breakers[index].is_pinned();
        drop(breakers);
        let opened = matches!(breaker_state, BreakerState::Open { .. }) && breaker_state != before;
        if opened || recovered {
            iface.history.mark(super::history::Mark {
                ts_ms: end.0,
                provider: id.clone(),
                kind: if opened {
                    "breaker_open"
                } else {
                    "breaker_closed"
                },
            });
        }
        if recovered {
            // A detected change: the failures from before the recovery no longer count.
            self.observe(Observation::Recovered {
                candidate: index,
                now: end,
            })?;
        }
        let BreakerState::Open { until } = breaker_state else {
            return Ok(None);
        };
        if breaker_state == before {
            return Ok(None);
        }
        self.journal(|| Event::BreakerOpen {
            iface: iface.name.clone(),
            candidate: index,
            until,
            pinned,
        });
        Ok(Some(until))
    }

    /// Reports the quality shifts `policy` (the interface's live policy, under its write
    /// lock) detected since the last call: one rate-limited `warn` line each, the counter,
    /// the dashboard and the audit log (see [`super::shifts`]).
    fn report_shifts(&self, policy: &mut dyn Policy) {
        for shift in policy.take_quality_shifts() {
            self.report_shift(&shift);
        }
    }

    fn report_shift(&self, shift: &QualityShift) {
        let (state, iface) = (self.state, self.iface);
        let Some(candidate) = iface.candidates.get(shift.candidate) else {
            return;
        };
        let provider = candidate.id.0.as_str();
        let direction = shift.direction.as_str();
        state
            .metrics
            .quality_shift(&iface.name, provider, direction);
        // Scores are posted by clients: a client can set shifts off at will, so the line is
        // rate-limited like the others a client can trigger (the counter counts every one).
        if state.logs.allow(super::repeated::Repeated::QualityShift) {
            tracing::warn!(
                interface = %iface.name,
                provider,
                direction,
                from = shift.from,
                to = shift.to,
                scores = shift.scores,
                "quality of {provider} on {} {} from {:.2} to {:.2} over the last {} scores",
                iface.name,
                verb(shift.direction),
                shift.from,
                shift.to,
                shift.scores,
            );
        }
        let record = ShiftRecord::of(&iface.name, provider, shift);
        iface.history.shift(&record);
        iface.history.mark(super::history::Mark {
            ts_ms: state.now().0,
            provider: provider.to_owned(),
            kind: match shift.direction {
                ShiftDirection::Down => "quality_down",
                ShiftDirection::Up => "quality_up",
            },
        });
        if let Some(audit) = &state.audit {
            audit.quality_shift(record);
        }
    }
}

/// The verb of a shift's log line.
pub(super) fn verb(direction: ShiftDirection) -> &'static str {
    match direction {
        ShiftDirection::Down => "fell",
        ShiftDirection::Up => "rose",
    }
}

/// The ledger's doors for code outside the request path (tests, the examples, the state
/// file): each is the ledger's own step, for the live arm where an arm is asked.
impl AppState {
    /// The policy's write side, deferred observations applied first ([`Ledger::policy_mut`]).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn policy_mut<'a>(
        &'a self,
        iface: &'a InterfaceRuntime,
    ) -> Result<RwLockWriteGuard<'a, Box<dyn Policy>>, Poisoned> {
        self.ledger(iface).policy_mut()
    }

    /// Feeds one finished attempt (ending now) to the policy, the breaker and the metrics,
    /// and to the shared journal when state is shared (steps 2–4 of an attempt's end).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn record_attempt(
        &self,
        iface: &InterfaceRuntime,
        index: usize,
        features: &[f64],
        slice: SlicePath,
        outcome: &AttemptOutcome,
        remaining: Option<Millis>,
    ) -> Result<(), Poisoned> {
        self.record_routed_attempt(iface, Arm::Live, index, features, slice, outcome, remaining)
    }

    /// [`AppState::record_attempt`] of a request routed by `arm`.
    ///
    /// # Errors
    /// A poisoned lock.
    #[allow(clippy::too_many_arguments)]
    pub fn record_routed_attempt(
        &self,
        iface: &InterfaceRuntime,
        arm: Arm,
        index: usize,
        features: &[f64],
        slice: SlicePath,
        outcome: &AttemptOutcome,
        remaining: Option<Millis>,
    ) -> Result<(), Poisoned> {
        self.ledger(iface)
            .learn_attempt(arm, index, features, slice, outcome, remaining)
    }

    /// Feeds an observation to the interface's policy (and the shared journal)
    /// ([`Ledger::observe`]).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn observe(&self, iface: &InterfaceRuntime, obs: Observation) -> Result<(), Poisoned> {
        self.ledger(iface).observe(obs)
    }

    /// Feeds a quality score for `request_id` to the policy (and the shared journal)
    /// ([`Ledger::score`]).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn record_quality(
        &self,
        iface: &InterfaceRuntime,
        request_id: &str,
        obs: &QualityObservation<'_>,
    ) -> Result<(), Poisoned> {
        self.ledger(iface).score(request_id, obs)
    }

    /// Books the end of request `request_id` with its arms (step 3 of a request's end: the
    /// canary's guard, the shadow's window), and shares the rollback its outcome set off.
    pub fn finish_routed(
        &self,
        iface: &InterfaceRuntime,
        request_id: &str,
        routed: super::arms::Routed,
        status: RequestStatus,
    ) {
        self.ledger(iface)
            .finish_routed(request_id, routed, status, self.now());
    }

    /// Keeps an answered request's context until its quality score arrives (step 7 of a
    /// request's end).
    pub fn remember(&self, request_id: &str, ctx: PendingContext<'_>) {
        remember(self, request_id, ctx);
    }
}

/// Writes the audit record of a finished request, when an audit log is configured, and keeps
/// it for the dashboard when the dashboard wants it.
#[allow(clippy::too_many_lines)]
pub(super) fn audit(state: &AppState, iface: &InterfaceRuntime, end: RequestEnd<'_>) {
    let RequestEnd {
        request_id,
        decided,
        features,
        result,
        at,
        ..
    } = end;
    let attempts = &result.attempts[..];
    let wanted = iface.history.wants_record(at, attempts);
    if state.audit.is_none() && !wanted {
        return;
    }
    let id = |i: usize| iface.candidates[i].id.0.clone();
    let keep = state.audit.as_ref().map_or(
        super::audit::AuditFeatures::Hash,
        super::audit::AuditLog::features,
    );
    let deadline_miss = matches!(result.status, RequestStatus::DeadlineExceeded)
        || decided.deadline.is_some_and(|d| result.latency.0 > d.0);
    // A re-test's first choice is the breaker's, not the policy's: no propensity.
    let propensity = decided.ranking.propensity.filter(|_| !decided.retest);
    let record = super::audit::AuditRecord {
        kind: "request",
        ts_ms: at.0,
        decided_ms: decided.at.0,
        request_id: request_id.to_owned(),
        interface: iface.name.clone(),
        policy: decided.routed.policy,
        candidates: iface.candidates.iter().map(|c| c.id.0.clone()).collect(),
        eligible: decided.eligible.iter().map(|&i| id(i)).collect(),
        excluded: decided
            .excluded
            .iter()
            .map(|e| (id(e.candidate), super::error::echo(&e.reason.to_string()).into_owned()))
            .collect(),
        scores: decided
            .ranking
            .order
            .iter()
            .map(|s| serde_json::json!({"provider": id(s.index), "score": s.score, "breakdown": s.breakdown}))
            .collect(),
        order: decided.order.iter().map(|&i| id(i)).collect(),
        propensity: propensity.map(|p| p.probability),
        propensity_kind: propensity.map(|p| p.kind_name()),
        propensity_draws: propensity.and_then(|p| match p.kind {
            equiroute_core::policies::PropensityKind::Estimated { draws } => Some(draws),
            _ => None,
        }),
        features: (keep == super::audit::AuditFeatures::Full).then(|| features.to_vec()),
        features_hash: (keep == super::audit::AuditFeatures::Hash)
            .then(|| super::audit::features_hash(features)),
        slice: decided.slice,
        tokens: decided.tokens,
        last_resort: decided.last_resort,
        retest: decided.retest,
        attempts: attempts
            .iter()
            .enumerate()
            .map(|(n, a)| super::audit::AuditAttempt {
                provider: id(a.candidate),
                status: a.outcome.status.as_str(),
                failure: match a.outcome.status {
                    AttemptStatus::ProviderError(f) => Some(f),
                    _ => None,
                },
                retry: a.retry.map(equiroute_core::executor::RetryReason::as_str),
                hedge: a.hedge,
                continuation: decided
                    .continuations
                    .iter()
                    .find(|(i, _)| *i == n)
                    .map(|(_, mode)| *mode),
                first_byte_limit_ms: decided
                    .first_byte_limits
                    .iter()
                    .find(|(c, at, _)| *c == a.candidate && at.0.to_bits() == a.started.0.to_bits())
                    .and_then(|(_, _, limit)| *limit),
                started_ms: a.started.0,
                latency_ms: a.outcome.latency.0,
                ttfb_ms: a.outcome.time_to_first_byte.map(|t| t.0),
                retry_after_ms: a.outcome.retry_after.map(|t| t.0),
                cost_usd: a.outcome.cost.0,
                dropped_params: decided.dropped[a.candidate].names().collect(),
            })
            .collect(),
        outcome: outcome_label(result.status).to_owned(),
        fallback_reason: fallback_reason(attempts),
        latency_ms: result.latency.0,
        cost_usd: attempts.iter().map(|a| a.outcome.cost.0).sum(),
        deadline_ms: decided.deadline.map(|d| d.0),
        deadline_miss,
        failed: matches!(
            result.status,
            RequestStatus::Exhausted | RequestStatus::DeadlineExceeded
        ),
    };
    if wanted {
        iface.history.keep(&record, attempts);
    }
    if let Some(log) = &state.audit {
        log.record(record);
    }
}

/// The first attempt's status, when the request fell back.
pub(super) fn fallback_reason(
    attempts: &[equiroute_core::executor::AttemptRecord],
) -> Option<String> {
    // A hedge is no fallback: the attempts besides it tell whether the request fell back.
    let mut unhedged = attempts.iter().filter(|a| !a.hedge);
    match (unhedged.next(), unhedged.next()) {
        (Some(first), Some(_)) => Some(first.outcome.status.as_str().to_owned()),
        _ => None,
    }
}

/// Keeps an answered request's context until its quality score arrives (without allocating,
/// once the store is warm, unless state is shared and journaled).
pub(super) fn remember(state: &AppState, request_id: &str, ctx: PendingContext<'_>) {
    if let Some(shared) = &state.shared {
        shared.journal.record(Event::Pending {
            request_id: request_id.to_owned(),
            ctx: ctx.to_feedback(),
        });
    }
    if let Ok(mut pending) = state.pending.lock() {
        pending.remember(request_id, ctx);
    }
}
