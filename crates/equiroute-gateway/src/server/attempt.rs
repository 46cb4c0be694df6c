//! Attempt: one upstream call. The breaker's admission, an unstreamed call and its outcome
//! (status, cost by the reported usage), and a streamed attempt opened up to its first byte
//! within its first-byte limit (learnt per provider: `ttfb`) and through the stream's hold
//! (`stream`). Its end is booked by the ledger (`book`).

use super::book::{AttemptEnd, Booking};
use super::capacity::{Permit, Skips};
use super::error::poisoned;
use super::error::ApiError;
use super::repeated::Repeated;
use super::state::{AppState, InterfaceRuntime};
use super::stream::{hold, Held};
use crate::shared::{SharedHandle, SharedTake};
use crate::upstream::limits::Capacity;
use crate::upstream::{ChunkStream, ClientBody, StreamStart, UpstreamReply, UpstreamRequest};
use bytes::Bytes;
use equiroute_core::breaker::Admission;
use equiroute_core::executor::{Execution, NextAttempt};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, ProviderFailure, TokenEstimate, Usd};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The next attempt `run` asks for (`None`: the request is over), after the pause it asked
/// for before it (a retry's), and the time the attempt starts at: the time it was asked at
/// when there was nothing to wait (one clock read), else the time after the wait.
pub(super) async fn next_attempt(
    state: &AppState,
    run: &mut Execution,
) -> Option<(NextAttempt, equiroute_core::Timestamp)> {
    let asked = state.now();
    let next = run.next_attempt(asked)?;
    if next.wait.0 <= 0.0 {
        return Some((next, asked));
    }
    tokio::time::sleep(Duration::from_secs_f64(next.wait.0 / 1000.0)).await;
    Some((next, state.now()))
}

/// Whether an attempt on `candidate` may go now: its capacity ([`super::capacity`]: a
/// provider with none left is skipped, not sent a request it would refuse), then its breaker
/// (half-open probes are bounded). `Some`: the attempt's permit, to hold until it ends.
/// A skip for want of capacity is noted in `skips`.
pub(super) async fn admit(
    state: &AppState,
    iface: &InterfaceRuntime,
    (candidate, now): (usize, equiroute_core::Timestamp),
    skips: &mut Skips,
) -> Result<Option<Permit>, ApiError> {
    let permit = match take_capacity(state, iface, candidate, now).await {
        Ok(permit) => permit,
        Err(wait) => {
            skips.note(wait);
            return Ok(None);
        }
    };
    let mut breakers = iface.breakers.lock().map_err(|_| poisoned())?;
    let (admission, transition) = breakers[candidate].admit(now, &iface.breaker_config);
    if let Some(t) = transition {
        state.metrics.breaker(
            &iface.name,
            &iface.candidates[candidate].id.0,
            super::metrics::transition_name(t),
        );
    }
    Ok((!matches!(admission, Admission::Rejected { .. })).then_some(permit))
}

/// The candidate's capacity for one request at `now`: counted in Redis when the instances
/// share state (else, or when Redis does not answer, by this instance alone). `None`: a limit
/// is used up (with when it frees, if known); counted by limit, and the execution goes on to
/// the next candidate.
async fn take_capacity(
    state: &AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
    now: equiroute_core::Timestamp,
) -> Result<Permit, Option<Millis>> {
    let capacity = &iface.capacity[candidate];
    let taken = match capacity.enter() {
        Ok(permit) if capacity.counted() => {
            let shared = match shared_counts(state, iface, candidate) {
                Some((shared, key)) => {
                    let caps = capacity.caps;
                    shared
                        .take_quota(&key, caps.rpm.unwrap_or(0), caps.tpm.unwrap_or(0))
                        .await
                }
                None => SharedTake::Unavailable,
            };
            match shared {
                SharedTake::Taken => capacity.take(now.0, true).map(|()| permit),
                SharedTake::Refused(limit, wait) => Err((limit, wait)),
                SharedTake::Unavailable => capacity.take(now.0, false).map(|()| permit),
            }
        }
        other => other,
    };
    taken.map_err(|(limit, wait)| {
        let provider = &iface.candidates[candidate].id.0;
        state
            .metrics
            .capacity_skip(&iface.name, provider, limit.as_str());
        tracing::debug!(provider = %provider, limit = limit.as_str(), wait_ms = wait.map(|w| w.0), "no capacity left: skipped");
        wait
    })
}

/// What an answer's rate-limit headers (`said`) tell the provider's capacity: the count of
/// requests left until their reset, from now on counted down by every request sent (here,
/// and in Redis when the instances share state).
pub(super) fn heard_capacity(
    state: &AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
    said: &Capacity,
) {
    if said.requests.is_none() {
        return;
    }
    if let Some((remaining, reset)) = iface.capacity[candidate].announce(state.now().0, said) {
        if let Some((shared, key)) = shared_counts(state, iface, candidate) {
            shared.announce_quota(&key, remaining, reset);
        }
    }
}

/// The shared state and the key of `candidate`'s counts in Redis, when the instances share
/// state (`shared/quotas.rs`).
fn shared_counts<'a>(
    state: &'a AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
) -> Option<(&'a SharedHandle, String)> {
    let shared = state.shared.as_ref()?;
    let key = shared.quota_key(&iface.name, &iface.candidates[candidate].id.0);
    Some((shared, key))
}

/// Counts the tokens an attempt used against its provider's `tpm` (when declared).
pub(super) fn spent_capacity(
    state: &AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
    tokens: TokenEstimate,
) {
    let capacity = &iface.capacity[candidate];
    if capacity.caps.tpm.is_none() {
        return;
    }
    let tokens = tokens.total();
    capacity.spent(state.now().0, tokens);
    if let Some((shared, key)) = shared_counts(state, iface, candidate) {
        shared.spend_quota(key, tokens);
    }
}

/// Makes one unstreamed attempt and books it ([`super::book`]).
#[allow(clippy::too_many_arguments)]
pub(super) async fn attempt(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    next: NextAttempt,
    now: equiroute_core::Timestamp,
    body: &ClientBody,
    ctx: &Booking<'_>,
    seed: u64,
    router: &mut Duration,
) -> Result<(usize, AttemptOutcome, UpstreamReply), ApiError> {
    let next = NextAttempt {
        timeout: wait_limit(
            iface,
            (next.candidate, Awaited::Answer),
            now,
            next.timeout,
            Unlearnt::of(run, &next, now),
        )?,
        ..next
    };
    let (call, span) = call(iface, body, next, seed, false);
    let reply = call.await;
    book_reply(state, iface, run, ctx, (next, now), reply, &span, router)
}

/// Feeds an unstreamed attempt's reply to its provider's answer times: its latency when it
/// answered, or at least its timeout when it had no answer within it.
fn learn_answer_time(
    state: &AppState,
    iface: &InterfaceRuntime,
    next: NextAttempt,
    reply: &UpstreamReply,
) -> Result<(), ApiError> {
    let mut stats = iface.answer_times.lock().map_err(|_| poisoned())?;
    let stats = &mut stats[next.candidate];
    match (reply.status, next.timeout) {
        (AttemptStatus::Ok, _) => super::ttfb::observe(stats, state.now(), reply.latency),
        (AttemptStatus::Timeout, Some(limit)) => {
            super::ttfb::observe_cut_off(stats, state.now(), limit);
        }
        _ => {}
    }
    Ok(())
}

/// The upstream call of an unstreamed attempt (`is_hedge`: a hedge beside the first), in
/// its span, not yet started.
pub(super) fn call<'a>(
    iface: &'a InterfaceRuntime,
    body: &'a ClientBody,
    next: NextAttempt,
    seed: u64,
    is_hedge: bool,
) -> (
    std::pin::Pin<Box<dyn std::future::Future<Output = UpstreamReply> + Send + 'a>>,
    tracing::Span,
) {
    let req = UpstreamRequest {
        kind: iface.kind,
        body,
        model: &iface.candidates[next.candidate].model,
        seed,
    };
    let timeout = next.timeout.map(|t| Duration::from_secs_f64(t.0 / 1000.0));
    let span = super::spans::attempt(iface, next, is_hedge);
    let call = Box::pin(
        iface.upstreams[next.candidate]
            .call(req, timeout)
            .instrument(span.clone()),
    );
    (call, span)
}

/// Books an unstreamed attempt's reply (`next`, started at the given time) in the ledger and
/// hands it back with its candidate and outcome; the booking's time goes to `router`.
#[allow(clippy::too_many_arguments)]
pub(super) fn book_reply(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    ctx: &Booking<'_>,
    (next, started): (NextAttempt, equiroute_core::Timestamp),
    reply: UpstreamReply,
    span: &tracing::Span,
    router: &mut Duration,
) -> Result<(usize, AttemptOutcome, UpstreamReply), ApiError> {
    learn_answer_time(state, iface, next, &reply)?;
    heard_capacity(state, iface, next.candidate, &reply.capacity);
    if reply.status == AttemptStatus::Ok {
        spent_capacity(
            state,
            iface,
            next.candidate,
            usage_of(&reply).unwrap_or(ctx.tokens),
        );
    }
    let outcome = outcome_of(&reply, &iface.candidates[next.candidate], ctx.tokens);
    *router += state.ledger(iface).attempt(
        ctx,
        run,
        AttemptEnd {
            span,
            candidate: next.candidate,
            next: Some(next),
            started,
            outcome,
            usage: usage_of(&reply),
        },
    )?;
    Ok((next.candidate, outcome, reply))
}

/// The token usage a provider reported in its answer, if it did.
pub(super) fn usage_of(reply: &UpstreamReply) -> Option<TokenEstimate> {
    reply
        .body
        .as_ref()
        .and_then(crate::upstream::answer::ProviderJson::usage)
}

/// The attempt outcome of a provider's reply.
pub(super) fn outcome_of(
    reply: &UpstreamReply,
    candidate: &equiroute_core::Candidate,
    estimate: TokenEstimate,
) -> AttemptOutcome {
    // The provider's reported usage when it sent one, else the request's estimate.
    let tokens = usage_of(reply).unwrap_or(estimate);
    AttemptOutcome {
        latency: reply.latency,
        status: reply.status,
        // Billed unless the provider refused before doing any work.
        cost: match reply.status {
            AttemptStatus::ProviderError(
                ProviderFailure::RateLimited | ProviderFailure::Connection,
            )
            | AttemptStatus::ClientError => Usd(0.0),
            _ => candidate.price.cost(tokens),
        },
        time_to_first_byte: None,
        retry_after: rest_of(reply.retry_after, &reply.capacity, tokens),
    }
}

/// How long the provider asked to be left alone: its `Retry-After`, or, when its rate-limit
/// headers (`capacity`) say nothing is left for another request of `tokens` (the one just
/// made), the time to their reset; the longer of the two. The breaker rests the provider that
/// long (see [`crate::upstream::limits`]).
fn rest_of(
    retry_after: Option<Millis>,
    capacity: &Capacity,
    tokens: TokenEstimate,
) -> Option<Millis> {
    let exhausted = capacity.exhausted_for(tokens.total());
    crate::upstream::limits::later(retry_after, exhausted)
}

/// A streamed attempt once it ended before anything was sent, or is ready to be relayed.
pub(super) struct Opened {
    pub(super) next: NextAttempt,
    /// The attempt's span (`attempt`, a child of the request's).
    pub(super) span: tracing::Span,
    /// When it started.
    pub(super) started: equiroute_core::Timestamp,
    pub(super) clock: Instant,
    pub(super) result: OpenResult,
    /// Its place in its provider's capacity: the relay keeps it until the stream ends.
    pub(super) permit: Permit,
}

impl Opened {
    /// Whether it has its first byte (and its hold, if any), ready to commit.
    pub(super) fn is_ready(&self) -> bool {
        matches!(self.result, OpenResult::Ready { .. })
    }
}

pub(super) enum OpenResult {
    /// Commit: send `first` (every byte read so far), then relay `rest`.
    Ready {
        first: Bytes,
        rest: ChunkStream,
        began: Began,
    },
    /// It ended before anything was sent (error, timeout, or broken while held).
    Ended {
        outcome: AttemptOutcome,
        reply: Option<UpstreamReply>,
    },
}

/// Starts a streamed attempt at `now`: its first-byte limit, and the future that opens it up
/// to its first byte and through its hold.
#[allow(clippy::too_many_arguments)]
pub(super) fn open_attempt<'a>(
    state: &'a AppState,
    iface: &'a InterfaceRuntime,
    body: &'a ClientBody,
    n: u64,
    next: NextAttempt,
    now: equiroute_core::Timestamp,
    tokens: TokenEstimate,
    (unlearnt, permit): (Unlearnt, Permit),
) -> Result<Opening<'a>, ApiError> {
    let limit = wait_limit(
        iface,
        (next.candidate, Awaited::FirstByte),
        now,
        next.timeout,
        unlearnt,
    )?;
    let span = super::spans::attempt(iface, next, false);
    let attempt_span = span.clone();
    let opened = async move {
        let clock = Instant::now();
        let candidate = &iface.candidates[next.candidate];
        let req = UpstreamRequest {
            kind: iface.kind,
            body,
            model: &candidate.model,
            seed: state.seed_for(n) ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb),
        };
        let mut watch = FirstByteWatch {
            state,
            iface,
            candidate: next.candidate,
            clock,
            pending: true,
        };
        let start = iface.upstreams[next.candidate]
            .open_stream(req, limit.map(|t| Duration::from_secs_f64(t.0 / 1000.0)))
            .await;
        watch.pending = false;
        // Only a poisoned lock fails here; the first-byte statistics then miss one time.
        let _ = learn_first_byte(state, iface, next.candidate, &start, limit);
        let result = match start {
            StreamStart::Failed(reply) => OpenResult::Ended {
                outcome: outcome_of(&reply, candidate, tokens),
                reply: Some(reply),
            },
            StreamStart::Started {
                first,
                rest,
                ttfb,
                capacity,
            } => {
                tracing::debug!(provider = %candidate.id, attempt = next.number, ttfb_ms = ttfb.0, "stream started");
                heard_capacity(state, iface, next.candidate, &capacity);
                match hold(iface.stream_hold, iface.stream_idle, first, rest).await {
                    Held::Commit { first, rest } => OpenResult::Ready {
                        first,
                        rest,
                        began: Began { ttfb, capacity },
                    },
                    Held::Broken(reason) => {
                        if state.logs.allow(Repeated::StreamBroken) {
                            tracing::warn!(interface = %iface.name, provider = %candidate.id, error = %reason, "stream broke while held; falling back");
                        }
                        let broken = AttemptStatus::ProviderError(ProviderFailure::StreamBroken);
                        let latency = state.now().since(now);
                        OpenResult::Ended {
                            outcome: streamed(
                                candidate,
                                tokens,
                                broken,
                                latency,
                                Began { ttfb, capacity },
                            ),
                            reply: None,
                        }
                    }
                }
            }
        };
        Opened {
            next,
            span: attempt_span,
            started: now,
            clock,
            result,
            permit,
        }
    };
    Ok(Opening {
        limit,
        opened: Box::pin(opened.instrument(span.clone())),
        span,
    })
}

/// A streamed attempt waiting for its first byte. Dropped while still waiting (the loser of a
/// hedge race, or a client gone), it is booked in its provider's first-byte statistics as
/// "at least this long", as a first-byte timeout is: else only the first bytes that beat the
/// hedges would be learnt, and a provider that stalls would keep its fast belief.
pub(super) struct FirstByteWatch<'a> {
    pub(super) state: &'a AppState,
    pub(super) iface: &'a InterfaceRuntime,
    pub(super) candidate: usize,
    pub(super) clock: Instant,
    pub(super) pending: bool,
}

impl Drop for FirstByteWatch<'_> {
    fn drop(&mut self) {
        if !self.pending {
            return;
        }
        let waited = Millis(self.clock.elapsed().as_secs_f64() * 1000.0);
        if let Ok(mut stats) = self.iface.first_bytes.lock() {
            if let Some(stats) = stats.get_mut(self.candidate) {
                super::ttfb::observe_cut_off(stats, self.state.now(), waited);
            }
        }
    }
}

/// How a streamed attempt began: its time to the first byte, and what the provider's
/// rate-limit headers said is left.
#[derive(Clone, Copy, Debug)]
pub(super) struct Began {
    pub(super) ttfb: Millis,
    pub(super) capacity: Capacity,
}

/// The outcome of a streamed attempt that began (it had its first byte, so it is billed).
pub(super) fn streamed(
    candidate: &equiroute_core::Candidate,
    tokens: TokenEstimate,
    status: AttemptStatus,
    latency: Millis,
    began: Began,
) -> AttemptOutcome {
    AttemptOutcome {
        latency,
        status,
        cost: candidate.price.cost(tokens),
        time_to_first_byte: Some(began.ttfb),
        retry_after: rest_of(None, &began.capacity, tokens),
    }
}

/// What bounds a streamed attempt's first-byte limit while its provider's first bytes are
/// not known, and an unstreamed attempt's wait for its answer (see [`super::ttfb`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Unlearnt {
    /// No other candidate is left: the attempt's timeout.
    LastCandidate,
    /// Another is: the unlearnt limit, within a share of `left` (the time to the deadline).
    Fallback { left: Option<Millis> },
}

impl Unlearnt {
    /// For the attempt `next` of `run`, started at `now`.
    pub(super) fn of(
        run: &Execution,
        next: &NextAttempt,
        now: equiroute_core::Timestamp,
    ) -> Unlearnt {
        if run.has_fallback_after(next) {
            Unlearnt::Fallback {
                left: run.remaining(now),
            }
        } else {
            Unlearnt::LastCandidate
        }
    }
}

/// What an attempt waits for within its limit.
#[derive(Clone, Copy, Debug)]
pub(super) enum Awaited {
    /// A stream's first byte.
    FirstByte,
    /// An unstreamed attempt's answer.
    Answer,
}

/// The limit of an attempt on `candidate` whose timeout is `max`, for what it awaits: a
/// stream's first byte, learnt from the provider's first-byte times (see [`super::ttfb`]) or
/// unlearnt; an unstreamed answer, with another candidate left,
/// [`super::ttfb::FirstByteLimit::answer_limit`] of its answer times. At most `max`.
pub(super) fn wait_limit(
    iface: &InterfaceRuntime,
    (candidate, awaited): (usize, Awaited),
    now: equiroute_core::Timestamp,
    max: Option<Millis>,
    unlearnt: Unlearnt,
) -> Result<Option<Millis>, ApiError> {
    let Some(max) = max else { return Ok(None) };
    let cfg = &iface.first_byte;
    Ok(Some(match (awaited, unlearnt) {
        (Awaited::FirstByte, unlearnt) => {
            let stats = iface.first_bytes.lock().map_err(|_| poisoned())?;
            match unlearnt {
                Unlearnt::Fallback { left } if !cfg.knows(&stats[candidate]) => {
                    cfg.unlearnt_limit(&stats, now, max, left)
                }
                _ => cfg.limit(&stats[candidate], now, max),
            }
        }
        // Without a deadline the answer limit is the timeout: no lock to take.
        (Awaited::Answer, Unlearnt::Fallback { left: Some(left) }) => {
            let stats = iface.answer_times.lock().map_err(|_| poisoned())?;
            cfg.answer_limit(&stats[candidate], now, max, Some(left))
        }
        (Awaited::Answer, Unlearnt::Fallback { left: None } | Unlearnt::LastCandidate) => max,
    }))
}

/// Feeds a streamed attempt's start to its provider's first-byte statistics: the first
/// byte's time, or at least the limit when none came within it.
pub(super) fn learn_first_byte(
    state: &AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
    start: &StreamStart,
    limit: Option<Millis>,
) -> Result<(), ApiError> {
    let mut stats = iface.first_bytes.lock().map_err(|_| poisoned())?;
    let stats = &mut stats[candidate];
    match (start, limit) {
        (StreamStart::Started { ttfb, .. }, _) => {
            state.metrics.first_byte(&iface.name, ttfb.0);
            super::ttfb::observe(stats, state.now(), *ttfb);
        }
        (StreamStart::Failed(reply), Some(limit)) if reply.status == AttemptStatus::Timeout => {
            super::ttfb::observe_cut_off(stats, state.now(), limit);
        }
        _ => {}
    }
    Ok(())
}

/// A streamed attempt being opened: its first-byte limit, and the future that opens it
/// (to its first byte, or to the end of its hold).
pub(super) struct Opening<'a> {
    pub limit: Option<Millis>,
    /// The attempt's span (also carried by what `opened` yields).
    pub span: tracing::Span,
    pub opened: std::pin::Pin<Box<dyn std::future::Future<Output = Opened> + Send + 'a>>,
}
