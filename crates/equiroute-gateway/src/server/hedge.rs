//! Hedged requests in real time: the first attempt races a timer set to the hedge delay the
//! core computed from the policy's beliefs ([`equiroute_core::hedge`]); if the timer wins, the
//! breaker admits the hedge target and the interface's hedge budget has one, a second attempt
//! starts on the next candidate of the ranking. The first good answer wins and the other call
//! is dropped (its connection closed), booked as `cancelled` at that moment (a censored
//! latency) and billed at the request's estimated price. When the first to end failed, the
//! other is awaited: a hedge never turns a success into a failure. The core's
//! [`Execution`] records both, so the audit log shows the hedge per attempt.

use super::error::ApiError;
use super::execute::{admit, attempt_ended, book, outcome_of, usage_of, Opened};
use super::state::{AppState, InterfaceRuntime};
use crate::upstream::{ClientBody, UpstreamReply, UpstreamRequest};
use equiroute_core::executor::{Execution, NextAttempt};
use equiroute_core::hedge::{first_byte_outlook, hedge_plan, HedgePlan, HedgeRule, LatencyOutlook};
use equiroute_core::policies::{Policy, RankContext, Ranking};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, SlicePath, Timestamp, TokenEstimate};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// The hedge delay of a request just ranked, and the part of the rule that set it, when the
/// interface hedges. A `streamed` request
/// (on an interface whose streams hedge) races to the first byte, so it is planned on
/// first-byte beliefs once the first candidate has one ([`first_byte_outlooks`]), unless
/// `first_byte.plan_hedges` is off.
pub(super) fn delay(
    iface: &InterfaceRuntime,
    policy: &dyn Policy,
    ctx: &RankContext<'_>,
    ranking: &Ranking,
    streamed: bool,
) -> Option<HedgePlan> {
    if !iface.hedge.active() {
        return None;
    }
    // Every request earns its share of a hedge, whether it hedges or not; the price of a
    // hedge (for the priced rule) is read before this request moves it.
    let mut price = equiroute_core::hedge::HedgeBudget::INITIAL_PRICE;
    if let Ok(mut budget) = iface.hedge_budget.lock() {
        price = budget.price();
        budget.earn();
    }
    // The observed-quantile rule is the laboratory's baseline; config refuses it here.
    if matches!(iface.hedge.rule, HedgeRule::ObservedQuantile { .. }) {
        return None;
    }
    let mut order = ranking.indices();
    let (a, b) = (order.next()?, order.next());
    let mut first = policy.latency_outlook(a, ctx);
    let mut target = b.and_then(|j| policy.latency_outlook(j, ctx));
    if streamed && iface.first_byte.plan_hedges {
        (first, target) = first_byte_outlooks(iface, ctx.now, (a, b), (first, target));
    }
    hedge_plan(
        iface.hedge.rule,
        first.as_ref(),
        target.as_ref(),
        None,
        ctx.deadline,
        price,
    )
}

/// The outlooks of a streamed request's first candidate `a` and hedge target `b`: once `a`
/// has a first-byte belief (`first_byte.min_observations` first bytes seen), first-byte
/// beliefs in place of whole-answer latencies (failure rates kept), the target's whole-answer
/// outlook standing in for a first-byte belief it has not got yet (its first byte comes no
/// later than its answer: the stand-in only hedges later); before that, the outlooks as given.
fn first_byte_outlooks(
    iface: &InterfaceRuntime,
    now: Timestamp,
    (a, b): (usize, Option<usize>),
    (first, target): (Option<LatencyOutlook>, Option<LatencyOutlook>),
) -> (Option<LatencyOutlook>, Option<LatencyOutlook>) {
    let Ok(stats) = iface.first_bytes.lock() else {
        return (first, target);
    };
    let belief = |i: usize| stats.get(i).and_then(|s| iface.first_byte.belief(s, now));
    let Some(first_byte) = belief(a) else {
        return (first, target);
    };
    (
        first_byte_outlook(first.as_ref(), Some(first_byte)),
        first_byte_outlook(target.as_ref(), b.and_then(belief)),
    )
}

/// What booking an attempt needs besides the attempt.
pub(super) struct Booking<'a> {
    pub features: &'a [f64],
    /// The arm (live or canary) whose policy learns from the attempt.
    pub arm: super::arms::Arm,
    pub slice: SlicePath,
    pub tokens: TokenEstimate,
}

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
    };
    let book_reply = |run: &mut Execution,
                      router: &mut Duration,
                      next: NextAttempt,
                      started: Timestamp,
                      reply: UpstreamReply,
                      span: &tracing::Span|
     -> Result<(usize, AttemptOutcome, UpstreamReply), ApiError> {
        let outcome = outcome_of(&reply, &iface.candidates[next.candidate], ctx.tokens);
        attempt_ended(
            state,
            span,
            iface,
            next.candidate,
            &outcome,
            usage_of(&reply),
        );
        book(state, iface, run, next, started, outcome, ctx, router)?;
        Ok((next.candidate, outcome, reply))
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
    let hedge_now = state.now();
    if !(has_hedge(iface)? && admit(state, iface, hedge.candidate, hedge_now)?) {
        let reply = a.await;
        return Ok(vec![book_reply(run, router, first, now, reply, &a_span)?]);
    }
    spend_hedge(iface)?;
    run.start_hedge(&hedge);
    hedge_started(state, iface, run);
    let hedge_started = Instant::now();
    let first_started = hedge_started
        .checked_sub(Duration::from_secs_f64(
            (hedge_now.0 - now.0).max(0.0) / 1000.0,
        ))
        .unwrap_or(hedge_started);
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

/// Counts a hedge that started, and the part of the rule that set its delay.
fn hedge_started(state: &AppState, iface: &InterfaceRuntime, run: &Execution) {
    state.metrics.hedge(&iface.name, "started");
    if let Some(reason) = run.hedge_reason() {
        state.metrics.hedge_reason(&iface.name, reason.as_str());
    }
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

/// A streamed attempt being opened: its first-byte limit, and the future that opens it
/// (to its first byte, or to the end of its hold).
pub(super) struct Opening<'a> {
    pub limit: Option<Millis>,
    /// The attempt's span (also carried by what `opened` yields).
    pub span: tracing::Span,
    pub opened: std::pin::Pin<Box<dyn std::future::Future<Output = Opened> + Send + 'a>>,
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
    now: Timestamp,
    open: &(dyn Fn(NextAttempt, Timestamp) -> Result<Opening<'a>, ApiError> + Sync),
    limits: &mut Vec<super::execute::FirstByteLimitRecord>,
    ctx: &Booking<'_>,
    router: &mut Duration,
) -> Result<Vec<Opened>, ApiError> {
    let Opening {
        limit,
        opened: mut a,
        span: a_span,
    } = open(first, now)?;
    limits.push((first.candidate, now, limit.map(|l| l.0)));
    let wait = Duration::from_secs_f64(hedge.wait.0 / 1000.0);
    let early = tokio::select! {
        opened = &mut a => Some(opened),
        () = tokio::time::sleep(wait) => None,
    };
    if let Some(opened) = early {
        return Ok(vec![opened]);
    }
    let hedge_now = state.now();
    if !(has_hedge(iface)? && admit(state, iface, hedge.candidate, hedge_now)?) {
        return Ok(vec![a.await]);
    }
    spend_hedge(iface)?;
    run.start_hedge(&hedge);
    hedge_started(state, iface, run);
    let hedge_started = Instant::now();
    let first_started = hedge_started
        .checked_sub(Duration::from_secs_f64(
            (hedge_now.0 - now.0).max(0.0) / 1000.0,
        ))
        .unwrap_or(hedge_started);
    let Opening {
        limit,
        opened: mut b,
        span: b_span,
    } = open(hedge, hedge_now)?;
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
    attempt_ended(
        state,
        loser.span,
        iface,
        loser.next.candidate,
        &cancelled,
        None,
    );
    book(
        state,
        iface,
        run,
        loser.next,
        loser.start,
        cancelled,
        ctx,
        router,
    )?;
    state.metrics.hedge(&iface.name, "cancelled");
    if hedge_won {
        state.metrics.hedge(&iface.name, "won");
    }
    Ok(())
}
