//! Execute: one request through the stages, in real time. [`execute`] (unstreamed) and
//! [`execute_stream`] run the same loop: `decide` (number, featurize, eligibility, rank),
//! then attempts in the order the core's [`Execution`] state machine gives (the same loop the
//! laboratory drives in virtual time): each is an `attempt`, or a `race` when a hedge is
//! planned beside it; a streamed answer, once committed, goes to the `relay`. Every attempt's
//! and the request's end is booked by the ledger (`book`); this module turns the result into
//! the answer or the error.

use super::attempt::{admit, next_attempt, open_attempt, usage_of, OpenResult, Unlearnt};
use super::book::{Answer, AttemptEnd, Booking, RequestEnd};
use super::decide::{begin, Begun};
use super::error::ApiError;
use super::relay::Relay;
use super::repeated::Repeated;
use super::state::{AppState, InterfaceRuntime};
use crate::redact::Redacted;
use crate::upstream::dialect::Dropped;
use crate::upstream::{ClientBody, UpstreamReply};
use axum::http::StatusCode;
use equiroute_core::executor::{Execution, NextAttempt, RequestStatus};
use equiroute_core::{AttemptStatus, Millis};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// A request that got an answer.
#[derive(Debug)]
pub struct Answered {
    pub request_id: String,
    /// The request's number, which seeds its random choices (the id does not: it is random).
    pub number: u64,
    pub provider: String,
    pub model: String,
    pub attempts: usize,
    pub body: crate::upstream::answer::ProviderJson,
    /// The request members the answering provider's API dropped.
    pub dropped: Dropped,
}

/// Routes and executes one request on `iface`.
///
/// # Errors
/// No eligible provider (503), every attempt failed (502), the deadline passed (504), or the
/// provider rejected the request itself (400 with the provider's reason, not retried).
pub async fn execute(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &ClientBody,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: &super::RequestMeta,
) -> Result<Answered, ApiError> {
    let work = execute_unstreamed(state, iface, body, pinned, deadline, meta);
    boxed_in_span(work, request_span(iface, meta)).await
}

/// A request's work as one boxed future in its span. Its state (its attempts, races and
/// upstream calls, some 3.4 KB unstreamed) is allocated once where it runs, instead of being
/// copied into each enclosing future (the handler's, axum's, the connection's) as each is
/// built and moved. Boxed before it is put in the span: the other way round, the state was
/// copied once more, into the span's wrapper on the stack, before the box.
fn boxed_in_span<F: std::future::Future>(
    work: F,
    span: tracing::Span,
) -> tracing::instrument::Instrumented<std::pin::Pin<Box<F>>> {
    Box::pin(work).instrument(span)
}

/// The span around one request's handling; its id is recorded once [`begin`] numbers it.
/// With the client's `traceparent` it continues the client's trace.
pub(super) fn request_span(iface: &InterfaceRuntime, meta: &super::RequestMeta) -> tracing::Span {
    let span = super::spans::request(iface);
    if let Some(parent) = &meta.trace_parent {
        use opentelemetry::trace::TraceContextExt as _;
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        // Not yet entered, so its parent can still be set; a disabled span has none.
        let _ =
            span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent.clone()));
    }
    span
}

#[allow(clippy::too_many_lines)]
pub(super) async fn execute_unstreamed(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &ClientBody,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: &super::RequestMeta,
) -> Result<Answered, ApiError> {
    let Begun {
        n,
        request_id,
        started,
        features,
        tokens,
        decided,
        mut run,
    } = begin(state, iface, body, pinned, deadline, meta)?;
    // The router's share: everything but the upstream calls (see `Metrics::router_time`);
    // `started` is taken at the top of `begin`.
    let mut router = started.elapsed();
    let mut tried: Vec<usize> = Vec::new();
    let (mut last, mut answer) = (None, None);
    let mut refusals = ContextRefusals::default();
    let mut rejections = super::rejections::Rejections::default();
    let mut skips = super::capacity::Skips::default();
    while let Some((next, now)) = next_attempt(state, &mut run).await {
        // Held until the attempt (or the race) is booked.
        let Some(_permit) = admit(state, iface, (next.candidate, now), &mut skips).await? else {
            run.skip();
            continue;
        };
        if next.number > 0 && next.retry.is_none() {
            iface.meters.fallback();
        }
        let seed = state.seed_for(n) ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb);
        let ctx = Booking::of(&features, &decided, tokens);
        // The first attempt with a hedge planned beside it races it (server/race.rs).
        let ended = if let Some(hedge) = run.hedge(&next, now) {
            let pair = (next, hedge);
            super::race::race(
                state,
                iface,
                &mut run,
                pair,
                now,
                body,
                &ctx,
                seed,
                &mut router,
            )
            .await?
        } else {
            let one = super::attempt::attempt(
                state,
                iface,
                &mut run,
                next,
                now,
                body,
                &ctx,
                seed,
                &mut router,
            );
            vec![one.await?]
        };
        for (candidate, outcome, reply) in ended {
            tried.push(candidate);
            if reply.context_overflow {
                refusals.reroute(iface, &decided.order, &tried, candidate, &mut run);
            }
            rejections.after_attempt(&decided.order, &tried, candidate, &reply, &mut run);
            if outcome.status == AttemptStatus::Ok {
                answer = Some(reply);
            } else {
                last = Some(reply);
            }
        }
    }
    let ending = Instant::now();
    let end = state.at(ending);
    let mut result = run.finish(end);
    rejections.settle(state, iface, &mut result, &mut last);
    let attempts = result.attempts.len();
    let ledger = state.ledger(iface);
    let request_end = RequestEnd {
        request_id: &request_id,
        decided: &decided,
        features: &features,
        result: &result,
        label: failed_label(result.status),
        owner: meta.owner.as_deref(),
        content_filter: last.as_ref().is_some_and(|r| r.content_filter),
        at: end,
    };
    match (result.status, answer) {
        (RequestStatus::Succeeded { candidate }, Some(reply)) => {
            if n % 1024 == 0 {
                state.prune_pending(end);
            }
            let answer = Answer {
                candidate,
                latency: Millis(ending.duration_since(started).as_secs_f64() * 1000.0),
                at: end,
                owner: meta.owner.as_deref(),
            };
            ledger.request(
                RequestEnd {
                    label: "ok",
                    ..request_end
                },
                Some(answer),
            );
            state
                .metrics
                .router_time((router + ending.elapsed()).as_secs_f64() * 1e6);
            let c = &iface.candidates[candidate];
            Ok(Answered {
                request_id,
                number: n,
                provider: c.id.0.clone(),
                model: c.model.clone(),
                attempts,
                dropped: decided.dropped[candidate],
                body: reply.body.unwrap_or_else(|| {
                    crate::upstream::answer::ProviderJson::from_value(&serde_json::Value::Null)
                }),
            })
        }
        (status, _) => {
            ledger.request(request_end, None);
            if let Some(refused) = skips.refusal(result.attempts.len()) {
                return Err(refused.for_request(&request_id, 0));
            }
            Err(failure(
                state,
                iface,
                &request_id,
                status,
                &result.attempts,
                last,
                deadline,
            ))
        }
    }
}

/// The outcome label of a request that got no answer (`equiroute_requests_total`).
pub(super) fn failed_label(status: RequestStatus) -> &'static str {
    match status {
        RequestStatus::Succeeded { .. } => "failed",
        other => super::metrics::outcome_label(other),
    }
}

/// The context-window refusals of one request so far.
#[derive(Default)]
pub(super) struct ContextRefusals(u32);

impl ContextRefusals {
    /// After a provider refused the request as too long for its context window, continues
    /// with the untried candidates of the ranking whose window is larger, if there are any.
    /// When none is larger but one has the same window (windows not declared are all the
    /// default: their real sizes are unknown), the first such candidate gets one attempt, on
    /// the request's first refusal only; the refusing candidate is never tried again.
    pub(super) fn reroute(
        &mut self,
        iface: &InterfaceRuntime,
        order: &[usize],
        tried: &[usize],
        failed: usize,
        run: &mut Execution,
    ) {
        self.0 += 1;
        let window = |i: usize| iface.candidates[i].capabilities.context_tokens;
        let untried = || order.iter().copied().filter(|i| !tried.contains(i));
        let larger: Vec<usize> = untried().filter(|&i| window(i) > window(failed)).collect();
        if !larger.is_empty() {
            run.continue_with(larger);
        } else if self.0 == 1 {
            if let Some(same) = untried().find(|&i| window(i) == window(failed)) {
                run.continue_with(vec![same]);
            }
        }
    }
}

/// The error answer of request `request_id`, which got no answer, with its routing headers.
///
/// The client is told the last provider's words, redacted (every secret of the gateway's and
/// every credential shape cut out: see [`crate::redact`]); they may quote the client's own
/// prompt back to it, which is no leak. The logs at `info` and `warn` say only which providers
/// were tried, how each ended, the HTTP status and the error code: the provider's words, which
/// may quote the prompt, go to `debug` only.
pub(super) fn failure(
    state: &AppState,
    iface: &InterfaceRuntime,
    request_id: &str,
    status: RequestStatus,
    attempts: &[equiroute_core::executor::AttemptRecord],
    last: Option<UpstreamReply>,
    deadline: Option<Millis>,
) -> ApiError {
    let refused = last.as_ref().is_some_and(|r| r.content_filter);
    let http_status = last.as_ref().map_or(0, |r| r.http_status);
    let reason = last.and_then(|r| r.reason);
    let said = |otherwise: &'static str| reason.as_ref().map_or(otherwise, Redacted::as_str);
    // "2 attempts: a provider_error, b timeout": which providers were tried, and how each ended.
    let tried: Vec<String> = attempts
        .iter()
        .map(|a| {
            format!(
                "{} {}{}",
                iface.candidates[a.candidate].id,
                a.outcome.status.as_str(),
                if a.retry.is_some() { " (retry)" } else { "" }
            )
        })
        .collect();
    let summary = match tried.len() {
        0 => "no attempt".to_owned(),
        1 => format!("1 attempt: {}", tried[0]),
        n => format!("{n} attempts: {}", tried.join(", ")),
    };
    let error = match status {
        RequestStatus::ClientError { candidate } if refused => {
            // The provider's own code, so that the caller can tell a refusal from a mistake.
            ApiError::bad_request(
                "content_filter",
                None,
                format!(
                    "provider `{}` refused the request (content filter): {}",
                    iface.candidates[candidate].id,
                    said("refused")
                ),
            )
        }
        RequestStatus::ClientError { candidate } => ApiError::bad_request(
            "upstream_rejected_request",
            None,
            format!(
                "provider `{}` rejected the request: {}",
                iface.candidates[candidate].id,
                said("rejected")
            ),
        ),
        RequestStatus::DeadlineExceeded => ApiError::upstream(
            StatusCode::GATEWAY_TIMEOUT,
            "deadline_exceeded",
            format!(
                "no provider answered within the {:.0} ms deadline ({summary})",
                deadline.map_or(0.0, |d| d.0)
            ),
        ),
        RequestStatus::Exhausted | RequestStatus::Succeeded { .. } => ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            "all_providers_failed",
            format!(
                "every attempt failed ({summary}); last: {}",
                said("no attempt could be made")
            ),
        ),
    };
    // Once per failed request, rate-limited (a client can fail its requests at will); a
    // provider refusing the client's own request is not ours.
    if let RequestStatus::ClientError { candidate } = status {
        if state.logs.allow(Repeated::ProviderRejected) {
            let provider = &iface.candidates[candidate].id;
            tracing::info!(request_id, %provider, http_status, code = error.code, "request rejected by the provider");
        }
    } else if state.logs.allow(Repeated::RequestFailed) {
        tracing::warn!(request_id, code = error.code, http_status, attempts = %summary, "request failed");
    }
    if let Some(reason) = &reason {
        tracing::debug!(request_id, provider_said = %reason, "the last provider's words (redacted)");
    }
    error.for_request(request_id, tried.len())
}

/// Routes and executes a streamed chat request. Attempts fall back, exactly as unstreamed
/// ones, until one produces its first byte within the time left; from then on the answer is
/// committed and relayed chunk by chunk. A stream that breaks, stalls longer than the
/// interface's idle limit or ends without `[DONE]` is closed with an OpenAI-style error event
/// and no `[DONE]`, and the attempt is recorded as failed.
///
/// # Errors
/// As [`execute`], when no attempt produced a first byte.
///
/// Handed back as `boxed_in_span` makes it, not wrapped in a future of its own: that one
/// would hold the arguments until its first poll (some 600 bytes, in every chat request's
/// future, streamed or not).
pub fn execute_stream(
    state: Arc<AppState>,
    iface: Arc<InterfaceRuntime>,
    body: ClientBody,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: super::RequestMeta,
) -> impl std::future::Future<Output = Result<axum::response::Response, ApiError>> {
    let span = request_span(&iface, &meta);
    boxed_in_span(
        execute_streamed(state, iface, body, pinned, deadline, meta),
        span,
    )
}

#[allow(clippy::too_many_lines)]
pub(super) async fn execute_streamed(
    state: Arc<AppState>,
    iface: Arc<InterfaceRuntime>,
    body: ClientBody,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: super::RequestMeta,
) -> Result<axum::response::Response, ApiError> {
    let Begun {
        n,
        request_id,
        started,
        features,
        tokens,
        mut decided,
        mut run,
    } = begin(&state, &iface, &body, pinned, deadline, &meta)?;
    let mut tried: Vec<usize> = Vec::new();
    let mut last = None;
    let mut rejections = super::rejections::Rejections::default();
    let mut refusals = ContextRefusals::default();
    let mut router = Duration::ZERO;
    let mut skips = super::capacity::Skips::default();
    while let Some((next, now)) = next_attempt(&state, &mut run).await {
        let Some(permit) = admit(&state, &iface, (next.candidate, now), &mut skips).await? else {
            run.skip();
            continue;
        };
        if next.number > 0 && next.retry.is_none() {
            iface.meters.fallback();
        }
        let unlearnt = Unlearnt::of(&run, &next, now);
        let open = |next: NextAttempt, now, permit| {
            open_attempt(
                &state,
                &iface,
                &body,
                n,
                next,
                now,
                tokens,
                (unlearnt, permit),
            )
        };
        let ctx = Booking::of(&features, &decided, tokens);
        // The first attempt with a hedge planned beside it races to its first byte.
        let opened = if let Some(hedge) = run.hedge(&next, now) {
            super::race::race_streams(
                &state,
                &iface,
                &mut run,
                (next, hedge),
                (now, permit),
                &open,
                &mut decided.first_byte_limits,
                &ctx,
                &mut router,
            )
            .await?
        } else {
            let opening = open(next, now, permit)?;
            decided
                .first_byte_limits
                .push((next.candidate, now, opening.limit.map(|l| l.0)));
            vec![opening.opened.await]
        };
        for opened in opened {
            // An attempt that ends here sent nothing to the client: booked, and on to the next.
            let (outcome, reply) = match opened.result {
                OpenResult::Ready { first, rest, began } => {
                    rejections.answered(&state, &iface, opened.next.candidate);
                    // The relay keeps the attempt's span open until the stream ends, and
                    // records the outcome and usage on it then.
                    let relay = Relay {
                        permit: opened.permit,
                        span: opened.span,
                        tokens,
                        state: state.clone(),
                        iface: iface.clone(),
                        candidate: opened.next.candidate,
                        features,
                        request_id: request_id.clone(),
                        owner: meta.owner.clone(),
                        restart_events: meta.restart_events,
                        n,
                        body,
                        started,
                        // A hedge's latency counts from its own start (it began after the
                        // attempt it raced); others' from the request's, as before.
                        attempt_clock: if opened.started.0 > now.0 {
                            opened.clock
                        } else {
                            started
                        },
                        began,
                        attempt_started: opened.started,
                        run,
                        decided,
                    };
                    return Ok(relay.start(first, rest));
                }
                OpenResult::Ended { outcome, reply } => (outcome, reply),
            };
            state.ledger(&iface).attempt(
                &ctx,
                &mut run,
                AttemptEnd {
                    span: &opened.span,
                    candidate: opened.next.candidate,
                    next: Some(opened.next),
                    started: opened.started,
                    outcome,
                    usage: reply.as_ref().and_then(usage_of),
                },
            )?;
            tried.push(opened.next.candidate);
            if let Some(reply) = reply {
                if reply.context_overflow {
                    refusals.reroute(
                        &iface,
                        &decided.order,
                        &tried,
                        opened.next.candidate,
                        &mut run,
                    );
                }
                let at = opened.next.candidate;
                rejections.after_attempt(&decided.order, &tried, at, &reply, &mut run);
                last = Some(reply);
            }
        }
    }
    let end = state.now();
    let mut result = run.finish(end);
    rejections.settle(&state, &iface, &mut result, &mut last);
    state.ledger(&iface).request(
        RequestEnd {
            request_id: &request_id,
            decided: &decided,
            features: &features,
            result: &result,
            label: failed_label(result.status),
            owner: meta.owner.as_deref(),
            content_filter: last.as_ref().is_some_and(|r| r.content_filter),
            at: end,
        },
        None,
    );
    if let Some(refused) = skips.refusal(result.attempts.len()) {
        return Err(refused.for_request(&request_id, 0));
    }
    Err(failure(
        &state,
        &iface,
        &request_id,
        result.status,
        &result.attempts,
        last,
        deadline,
    ))
}
