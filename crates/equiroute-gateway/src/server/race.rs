//! Race: hedged requests in real time: the first attempt races a timer set to the hedge delay the
//! core computed from the policy's beliefs ([`equiroute_core::hedge`]); if the timer wins, the
//! breaker admits the hedge target and the interface's hedge budget has one, a second attempt
//! starts on the next candidate of the ranking. The first good answer wins and the other call
//! is dropped (its connection closed), booked as `cancelled` at that moment (a censored
//! latency) and billed at the request's estimated price. When the first to end failed, the
//! other is awaited: a hedge never turns a success into a failure. The core's
//! [`Execution`] records both, so the audit log shows the hedge per attempt.

use super::attempt::{admit, Opened, Opening};
use super::book::{AttemptEnd, Booking};
use super::capacity::Permit;
use super::error::ApiError;
use super::state::{AppState, InterfaceRuntime};
use crate::upstream::{ClientBody, UpstreamReply};
use equiroute_core::executor::{Execution, NextAttempt};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, Timestamp};
use std::time::{Duration, Instant};

/// Runs `first` (started at `now`) with `hedge` beside it if it is still out after
/// `hedge.wait`; returns the attempts that ended, in the order they were recorded, with
/// their replies (a cancelled attempt has none and is not returned).
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
pub(super) async fn race(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    (first, hedge): (NextAttempt, NextAttempt),
    now: Timestamp,
    body: &ClientBody,
    ctx: &Booking<'_>,
    seed: u64,
    router: &mut Duration,
) -> Result<Vec<(usize, AttemptOutcome, UpstreamReply)>, ApiError> {
    let call = |next: NextAttempt, seed: u64, is_hedge: bool| {
        super::attempt::call(iface, body, next, seed, is_hedge)
    };
    let book_reply = |run: &mut Execution,
                      router: &mut Duration,
                      next: NextAttempt,
                      started: Timestamp,
                      reply: UpstreamReply,
                      span: &tracing::Span| {
        super::attempt::book_reply(state, iface, run, ctx, (next, started), reply, span, router)
    };
    let (mut a, a_span) = call(first, seed, false);
    let wait = Duration::from_secs_f64(hedge.wait.0 / 1000.0);
    let early = tokio::select! {
        reply = &mut a => Some(reply),
        () = tokio::time::sleep(wait) => None,
    };
    if let Some(reply) = early {
        return Ok(vec![book_reply(run, router, first, now, reply, &a_span)?]);
    }
    // The hedge's permit is held until the race is booked.
    let Some(Hedged {
        hedge_now,
        hedge_started,
        first_started,
        permit: _hedge_permit,
    }) = start_hedge(state, iface, run, &hedge, now).await?
    else {
        let reply = a.await;
        return Ok(vec![book_reply(run, router, first, now, reply, &a_span)?]);
    };
    let (mut b, b_span) = call(hedge, seed ^ 0x5bd1_e995_0000_0001, true);
    let (hedge_first, reply) = tokio::select! {
        reply = &mut a => (false, reply),
        reply = &mut b => (true, reply),
    };
    let answered = reply.status == AttemptStatus::Ok;
    let (winner, winner_start, loser, loser_start, loser_clock) = if hedge_first {
        (hedge, hedge_now, first, now, first_started)
    } else {
        (first, now, hedge, hedge_now, hedge_started)
    };
    let (winner_span, loser_span) = if hedge_first {
        (&b_span, &a_span)
    } else {
        (&a_span, &b_span)
    };
    let mut ended = vec![book_reply(
        run,
        router,
        winner,
        winner_start,
        reply,
        winner_span,
    )?];
    if answered {
        // Cancel the other: dropping its call closes its connection.
        drop(a);
        drop(b);
        let loser = Loser {
            next: loser,
            start: loser_start,
            clock: loser_clock,
            span: loser_span,
        };
        cancel(state, iface, run, &loser, hedge_first, ctx, router)?;
    } else {
        let reply = if hedge_first { a.await } else { b.await };
        let hedge_won = !hedge_first && reply.status == AttemptStatus::Ok;
        ended.push(book_reply(
            run,
            router,
            loser,
            loser_start,
            reply,
            loser_span,
        )?);
        if hedge_won {
            state.metrics.hedge(&iface.name, "won");
        }
    }
    Ok(ended)
}

/// A hedge that started: when (`hedge_now`, and its clock), and the first attempt's clock
/// set back to that attempt's start (`now`).
struct Hedged {
    hedge_now: Timestamp,
    hedge_started: Instant,
    first_started: Instant,
    /// The hedge's place in its provider's capacity.
    permit: Permit,
}

/// Starts `hedge` beside the first attempt (started at `now`) once its delay is over, if the
/// budget has a hedge and the breaker admits its target: spends the hedge, tells the
/// execution, and counts it with the part of the rule that set its delay. `None`: no hedge.
async fn start_hedge(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    hedge: &NextAttempt,
    now: Timestamp,
) -> Result<Option<Hedged>, ApiError> {
    let hedge_now = state.now();
    if !has_hedge(iface)? {
        return Ok(None);
    }
    // A hedge skipped for want of capacity leaves the first attempt to go on alone.
    let mut skips = super::capacity::Skips::default();
    let Some(permit) = admit(state, iface, (hedge.candidate, hedge_now), &mut skips).await? else {
        return Ok(None);
    };
    spend_hedge(iface)?;
    run.start_hedge(hedge);
    state.metrics.hedge(&iface.name, "started");
    if let Some(reason) = run.hedge_reason() {
        state.metrics.hedge_reason(&iface.name, reason.as_str());
    }
    let hedge_started = Instant::now();
    let first_started = hedge_started
        .checked_sub(Duration::from_secs_f64(
            (hedge_now.0 - now.0).max(0.0) / 1000.0,
        ))
        .unwrap_or(hedge_started);
    Ok(Some(Hedged {
        hedge_now,
        hedge_started,
        first_started,
        permit,
    }))
}

fn has_hedge(iface: &InterfaceRuntime) -> Result<bool, ApiError> {
    let budget = iface
        .hedge_budget
        .lock()
        .map_err(|_| ApiError::internal())?;
    Ok(budget.has_hedge())
}

fn spend_hedge(iface: &InterfaceRuntime) -> Result<(), ApiError> {
    let mut budget = iface
        .hedge_budget
        .lock()
        .map_err(|_| ApiError::internal())?;
    budget.try_spend();
    Ok(())
}

/// Races a streamed first attempt and its hedge to their first byte (or the end of their
/// hold): as [`race`], with the first byte in place of the answer. `open` starts an attempt.
/// Returns the attempts to book (in the order they ended) then, last, the one that is ready
/// to be relayed, if one is; the other of the pair, when dropped for a winner, is booked here
/// as `cancelled`. Each attempt's first-byte limit goes to `limits`.
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
pub(super) async fn race_streams<'a>(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    (first, hedge): (NextAttempt, NextAttempt),
    (now, permit): (Timestamp, Permit),
    open: &(dyn Fn(NextAttempt, Timestamp, Permit) -> Result<Opening<'a>, ApiError> + Sync),
    limits: &mut Vec<super::decide::FirstByteLimitRecord>,
    ctx: &Booking<'_>,
    router: &mut Duration,
) -> Result<Vec<Opened>, ApiError> {
    let Opening {
        limit,
        opened: mut a,
        span: a_span,
    } = open(first, now, permit)?;
    limits.push((first.candidate, now, limit.map(|l| l.0)));
    let wait = Duration::from_secs_f64(hedge.wait.0 / 1000.0);
    let early = tokio::select! {
        opened = &mut a => Some(opened),
        () = tokio::time::sleep(wait) => None,
    };
    if let Some(opened) = early {
        return Ok(vec![opened]);
    }
    let Some(Hedged {
        hedge_now,
        hedge_started,
        first_started,
        permit,
    }) = start_hedge(state, iface, run, &hedge, now).await?
    else {
        return Ok(vec![a.await]);
    };
    let Opening {
        limit,
        opened: mut b,
        span: b_span,
    } = open(hedge, hedge_now, permit)?;
    if !b_span.is_disabled() {
        b_span.record("equiroute.hedge", true);
    }
    limits.push((hedge.candidate, hedge_now, limit.map(|l| l.0)));
    let (hedge_first, opened) = tokio::select! {
        opened = &mut a => (false, opened),
        opened = &mut b => (true, opened),
    };
    if opened.is_ready() {
        // Drop the other: its connection closes, before or during its hold.
        drop(a);
        drop(b);
        let (loser, loser_start, loser_clock, loser_span) = if hedge_first {
            (first, now, first_started, a_span)
        } else {
            (hedge, hedge_now, hedge_started, b_span)
        };
        let loser = Loser {
            next: loser,
            start: loser_start,
            clock: loser_clock,
            span: &loser_span,
        };
        cancel(state, iface, run, &loser, hedge_first, ctx, router)?;
        return Ok(vec![opened]);
    }
    // The first to end failed before anything was sent: the other may still deliver.
    let other = if hedge_first { a.await } else { b.await };
    if !hedge_first && other.is_ready() {
        state.metrics.hedge(&iface.name, "won");
    }
    Ok(vec![opened, other])
}

/// The attempt a hedge race dropped for a winner.
struct Loser<'s> {
    next: NextAttempt,
    start: Timestamp,
    clock: Instant,
    span: &'s tracing::Span,
}

/// Books the dropped attempt as `cancelled` at this moment (a censored latency), billed as if
/// it ran to the end by the request's estimate (providers bill a call they started, and a
/// cancelled one reports no usage), and counts the hedge's end.
fn cancel(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    loser: &Loser<'_>,
    hedge_won: bool,
    ctx: &Booking<'_>,
    router: &mut Duration,
) -> Result<(), ApiError> {
    let candidate = &iface.candidates[loser.next.candidate];
    let cancelled = AttemptOutcome {
        latency: Millis(loser.clock.elapsed().as_secs_f64() * 1000.0),
        status: AttemptStatus::Cancelled,
        cost: candidate.price.cost(ctx.tokens),
        time_to_first_byte: None,
        retry_after: None,
    };
    *router += state.ledger(iface).attempt(
        ctx,
        run,
        AttemptEnd {
            span: loser.span,
            candidate: loser.next.candidate,
            next: Some(loser.next),
            started: loser.start,
            outcome: cancelled,
            usage: None,
        },
    )?;
    state.metrics.hedge(&iface.name, "cancelled");
    if hedge_won {
        state.metrics.hedge(&iface.name, "won");
    }
    Ok(())
}
