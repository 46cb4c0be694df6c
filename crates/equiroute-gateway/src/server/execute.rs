//! Executing one request in real time: eligibility, ranking, then attempts in order driven
//! by the core's [`Execution`] state machine (the same loop the laboratory drives in virtual
//! time), feeding every attempt to the policy and the breaker.

use super::error::ApiError;
use super::repeated::Repeated;
use super::state::{AppState, Features, InterfaceRuntime, PendingContext};
use crate::config::first_byte::{ResumeMode, StreamHold};
use crate::redact::Redacted;
use crate::upstream::dialect::{event_end, Dropped};
use crate::upstream::{ChunkStream, ClientBody, StreamStart, UpstreamReply, UpstreamRequest};
use axum::http::StatusCode;
use bytes::Bytes;
use equiroute_core::breaker::Admission;
use equiroute_core::eligibility::{check_eligibility, EligibilityInput};
use equiroute_core::executor::{Execution, NextAttempt, RequestStatus};
use equiroute_core::policies::RankContext;
use equiroute_core::{
    AttemptOutcome, AttemptStatus, Millis, ProviderFailure, Requirements, SlicePath, TokenEstimate,
    Usd,
};
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
    execute_unstreamed(state, iface, body, pinned, deadline, meta)
        .instrument(request_span(iface, meta))
        .await
}

/// The span around one request's handling; its id is recorded once [`begin`] numbers it.
/// With the client's `traceparent` it continues the client's trace.
fn request_span(iface: &InterfaceRuntime, meta: &super::RequestMeta) -> tracing::Span {
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
async fn execute_unstreamed(
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
    while let Some(next) = run.next_attempt(state.now()) {
        let now = pause(state, next).await;
        if !admit(state, iface, next.candidate, now)? {
            run.skip();
            continue;
        }
        if next.number > 0 && next.retry.is_none() {
            state.metrics.fallback(&iface.name);
        }
        let seed = state.seed_for(n) ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb);
        // The first attempt with a hedge planned beside it: server/hedge.rs.
        let ended = if let Some(hedge) = run.hedge(&next, now) {
            let ctx = super::hedge::Booking {
                features: &features,
                arm: decided.routed.arm,
                slice: decided.slice,
                tokens,
            };
            super::hedge::race(
                state,
                iface,
                &mut run,
                (next, hedge),
                now,
                body,
                &ctx,
                seed,
                &mut router,
            )
            .await?
        } else {
            let ctx = super::hedge::Booking {
                features: &features,
                arm: decided.routed.arm,
                slice: decided.slice,
                tokens,
            };
            let (outcome, reply) = attempt(
                state,
                iface,
                &mut run,
                next,
                now,
                body,
                &ctx,
                seed,
                &mut router,
            )
            .await?;
            vec![(next.candidate, outcome, reply)]
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
    let end = state.now();
    let mut result = run.finish(end);
    rejections.settle(state, iface, &mut result, &mut last);
    let attempts = result.attempts.len();
    record_request(state, iface, &request_id, &decided, &features, &result);
    match (result.status, answer) {
        (RequestStatus::Succeeded { candidate }, Some(reply)) => {
            state.metrics.request(&iface.name, "ok");
            if n % 1024 == 0 {
                state.prune_pending(end);
            }
            let latency = Millis(started.elapsed().as_secs_f64() * 1000.0);
            state.remember(
                &request_id,
                PendingContext {
                    interface: &iface.name,
                    candidate,
                    features: Features::F64(&features),
                    latency,
                    at: end,
                    owner: meta.owner.as_deref(),
                },
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
        (status, _) => Err(failure(
            state,
            iface,
            &request_id,
            status,
            &result.attempts,
            last,
            deadline,
        )),
    }
}

/// A request after its decision, ready for its first attempt.
struct Begun {
    n: u64,
    request_id: String,
    started: Instant,
    features: Vec<f64>,
    tokens: TokenEstimate,
    decided: Decided,
    run: Execution,
}

/// Numbers the request, sizes and featurizes it, decides, and starts its execution.
fn begin(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: &super::RequestMeta,
) -> Result<Begun, ApiError> {
    let (n, request_id) = state.next_request();
    tracing::Span::current().record("request_id", request_id.as_str());
    let started = Instant::now();
    let features = iface
        .featurizer
        .featurize(&super::query_text(iface.kind, body));
    let t0 = state.now();
    let (requirements, tokens) = super::request_profile(iface.kind, body);
    let span = super::spans::decision();
    let decided = span
        .in_scope(|| {
            decide(
                state,
                iface,
                body,
                &features,
                n,
                pinned,
                deadline,
                t0,
                &requirements,
                tokens,
                meta,
            )
        })
        .map_err(|e| {
            span.record("otel.status_code", "ERROR");
            if state.logs.allow(Repeated::NoEligibleProvider) {
                tracing::warn!(request_id = %request_id, error = %e.message, "no eligible provider");
            }
            e.for_request(&request_id, 0)
        })?;
    super::spans::record_decision(
        &span,
        iface,
        &super::spans::DecisionView {
            policy: decided.routed.policy,
            eligible: &decided.eligible,
            excluded: &decided.excluded,
            ranking: &decided.ranking,
            last_resort: decided.last_resort,
            hedge_delay: decided.hedge.map(|h| h.delay.0),
        },
    );
    drop(span);
    if tracing::enabled!(tracing::Level::DEBUG) {
        let id = |i: &usize| iface.candidates[*i].id.0.as_str();
        tracing::debug!(
            chosen = decided.order.first().map(id),
            candidates = ?decided.order.iter().map(id).collect::<Vec<_>>(),
            excluded = decided.excluded.len(),
            propensity = decided.ranking.first_choice_probability(),
            "decided"
        );
    }
    // Where a 5xx retry's pause falls in its jitter range, from the request's seed.
    let jitter = (state.seed_for(n).rotate_left(29) >> 11) as f64 / (1u64 << 53) as f64;
    let run = Execution::new(decided.order.clone(), t0, deadline, iface.limits)
        .with_jitter(jitter)
        .with_hedge(
            decided
                .hedge
                .filter(|_| iface.hedge.streams || !body_streams(body)),
        );
    Ok(Begun {
        n,
        request_id,
        started,
        features,
        tokens,
        decided,
        run,
    })
}

/// What was decided for a request, kept for the audit log.
struct Decided {
    /// When the request was decided.
    at: equiroute_core::Timestamp,
    /// The eligible candidates, in configuration order.
    eligible: Vec<usize>,
    deadline: Option<Millis>,
    tokens: TokenEstimate,
    order: Vec<usize>,
    /// The statistics slice of the request.
    slice: SlicePath,
    /// Which arm (live or canary) ranked it.
    routed: super::arms::Routed,
    ranking: equiroute_core::policies::Ranking,
    excluded: Vec<equiroute_core::eligibility::Exclusion>,
    /// Every usable provider's breaker was open: the first is probed as a last resort.
    last_resort: bool,
    /// The first in `order` was moved there, ahead of the policy's choice, for a re-test its
    /// breaker asked for ([`promote_retest`]).
    retest: bool,
    /// Each streamed attempt's first-byte limit in ms (streamed requests only).
    first_byte_limits: Vec<FirstByteLimitRecord>,
    /// When the first attempt gets a hedge and why (`None`: no hedge), from the policy's
    /// beliefs.
    hedge: Option<equiroute_core::hedge::HedgePlan>,
    /// The attempts (by number) that continued a broken stream, and how (`stream_resume`).
    continuations: Vec<(usize, &'static str)>,
    /// What each candidate's API drops from the request (`unsupported_params = "drop"`).
    dropped: Vec<Dropped>,
}

/// Moves the first provider of `order` whose breaker says it is due a re-test to the front
/// (see `equiroute_core::breaker`): a provider that failed is tried again whatever its rank,
/// the others staying its fallbacks. Whether one moved.
fn promote_retest(
    iface: &InterfaceRuntime,
    order: &mut Vec<usize>,
    now: equiroute_core::Timestamp,
) -> Result<bool, ApiError> {
    let breakers = iface.breakers.lock().map_err(|_| poisoned())?;
    let due = order
        .iter()
        .skip(1)
        .position(|&i| breakers[i].retest_due(now, &iface.breaker_config));
    if let Some(p) = due {
        let i = order.remove(p + 1);
        order.insert(0, i);
    }
    Ok(due.is_some())
}

/// Moves the eligible providers whose API cannot express `body` to the exclusions: the request
/// is passed over to a provider that can. Returns what each candidate's API drops from `body`
/// (`unsupported_params = "drop"`), by candidate.
fn exclude_inexpressible(
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    eligible: &mut equiroute_core::eligibility::Eligible,
) -> Vec<Dropped> {
    use equiroute_core::eligibility::{Exclusion, ExclusionReason};
    let mut dropped = vec![Dropped::default(); iface.candidates.len()];
    let excluded = &mut eligible.excluded;
    eligible.eligible.retain(
        |&i| match iface.upstreams[i].expressible(iface.kind, body) {
            Ok(d) => {
                dropped[i] = d;
                true
            }
            Err(refusal) => {
                excluded.push(Exclusion {
                    candidate: i,
                    reason: ExclusionReason::Inexpressible {
                        field: refusal.field,
                        why: refusal.why,
                    },
                });
                false
            }
        },
    );
    dropped
}

/// The answer when no provider is left: the caller's 4xx ([`super::unservable`]) when the request itself shut every
/// one out, else 503 `no_eligible_provider` with each exclusion's reason.
fn no_eligible(
    state: &AppState,
    iface: &InterfaceRuntime,
    excluded: &[equiroute_core::eligibility::Exclusion],
    (body, tokens): (&serde_json::Value, TokenEstimate),
    now: equiroute_core::Timestamp,
) -> ApiError {
    let ids = |i: usize| iface.candidates[i].id.to_string();
    if let Some(e) = super::unservable::answer(&iface.name, &ids, excluded, body, tokens) {
        state.metrics.request(&iface.name, "client_error");
        return e;
    }
    state.metrics.request(&iface.name, "no_eligible_provider");
    let reasons: Vec<String> = excluded
        .iter()
        // A reason may quote the client's tenant header: cut like any echoed input.
        .map(|e| {
            let reason = e.reason.to_string();
            format!(
                "{}: {}",
                iface.candidates[e.candidate].id,
                super::error::echo(&reason)
            )
        })
        .collect();
    ApiError {
        retry_after_s: breaker_retry_after(excluded, now),
        ..ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_eligible_provider",
            format!(
                "no provider of `{}` can take this request ({})",
                iface.name,
                reasons.join("; ")
            ),
        )
    }
}

/// Streamed requests hedge only with `hedge.streams` (a race to the first byte).
fn body_streams(body: &serde_json::Value) -> bool {
    body.get("stream").and_then(serde_json::Value::as_bool) == Some(true)
}

/// Eligibility then ranking: the router's share of the request, timed for `/metrics`.
#[allow(clippy::too_many_arguments)]
fn decide(
    state: &AppState,
    iface: &InterfaceRuntime,
    body: &serde_json::Value,
    features: &[f64],
    n: u64,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    now: equiroute_core::Timestamp,
    requirements: &Requirements,
    tokens: TokenEstimate,
    meta: &super::RequestMeta,
) -> Result<Decided, ApiError> {
    let started = Instant::now();
    let slice = SlicePath::from_parts(
        meta.task_class.as_deref(),
        Some(equiroute_core::deadline_class(deadline)),
        requirements.streaming,
        Some(equiroute_core::input_size_bucket(tokens.input)),
        SlicePath::MAX_DEPTH,
    );
    let (eligible, last_resort, mut dropped) = {
        let mut breakers = iface.breakers.lock().map_err(|_| poisoned())?;
        let mut input = EligibilityInput::new(&iface.candidates, requirements);
        input.breakers = Some((&breakers, &iface.breaker_config));
        input.pinned = pinned;
        input.tenant = meta.tenant.as_deref();
        input.tokens = tokens;
        input.now = now;
        let mut eligible = check_eligibility(&input);
        let dropped = exclude_inexpressible(iface, body, &mut eligible);
        // Every usable provider shut out by failures: probe the one reopening soonest now
        // rather than refuse the request (see `equiroute_core::breaker`).
        let last_resort = eligible.last_resort(&breakers, &iface.breaker_config);
        if let Some(i) = last_resort {
            if let Some(t) = breakers[i].last_resort() {
                state
                    .metrics
                    .breaker(&iface.candidates[i].id.0, super::state::transition_name(t));
            }
            state.metrics.last_resort(&iface.name);
            if state.logs.allow(Repeated::LastResort) {
                tracing::info!(provider = %iface.candidates[i].id, "every provider's breaker is open: probing the one that reopens soonest as a last resort");
            }
            eligible.excluded.retain(|e| e.candidate != i);
            eligible.eligible.push(i);
        }
        (eligible, last_resort, dropped)
    };
    // A last resort was shut out before its API was asked.
    if let Some(i) = last_resort {
        dropped[i] = iface.upstreams[i]
            .expressible(iface.kind, body)
            .unwrap_or_default();
    }
    if eligible.eligible.is_empty() {
        return Err(no_eligible(
            state,
            iface,
            &eligible.excluded,
            (body, tokens),
            now,
        ));
    }
    let (ranking, routed, hedge) = {
        let mut ctx = RankContext::new(&iface.candidates, &eligible.eligible, features);
        ctx.deadline = deadline;
        ctx.tokens = tokens;
        ctx.slice = slice;
        ctx.now = now;
        // The live policy, or the canary's for its share; the shadow ranks beside it.
        let (ranking, routed) =
            super::arms::rank(iface, &ctx, meta.session.as_deref(), state.seed_for(n), n)
                .map_err(|_| poisoned())?;
        // Hedges are planned from the live policy's beliefs (canary requests do not hedge);
        // without hedging the policy is not read a second time.
        let delay = if routed.arm == super::arms::Arm::Live && iface.hedge.active() {
            let policy = iface.policy.read().map_err(|_| poisoned())?;
            let streamed = iface.hedge.streams && body_streams(body);
            super::hedge::delay(iface, policy.as_ref(), &ctx, &ranking, streamed)
        } else {
            None
        };
        (ranking, routed, delay)
    };
    state
        .metrics
        .decision_time(started.elapsed().as_secs_f64() * 1e6);
    let mut order: Vec<usize> = ranking.indices().collect();
    let retest = promote_retest(iface, &mut order, now)?;
    if let Some(&first) = order.first() {
        iface.first_choices[first].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Decided {
        at: now,
        eligible: eligible.eligible,
        deadline,
        tokens,
        order,
        slice,
        routed,
        ranking,
        last_resort: last_resort.is_some(),
        retest,
        excluded: eligible.excluded,
        dropped,
        first_byte_limits: Vec::new(),
        // The plan is the policy's first choice's: not the re-tested provider's.
        hedge: hedge.filter(|_| !retest),
        continuations: Vec::new(),
    })
}

/// When a request that found no eligible provider may be retried: the seconds (rounded up,
/// at least 1) until the earliest open breaker half-opens; 1 when a breaker is half-open with
/// its probes in flight (they settle it soon). `None` when no breaker excluded anyone: the
/// request itself does not fit, and waiting will not change that.
fn breaker_retry_after(
    excluded: &[equiroute_core::eligibility::Exclusion],
    now: equiroute_core::Timestamp,
) -> Option<u16> {
    excluded
        .iter()
        .filter_map(|e| match e.reason {
            equiroute_core::eligibility::ExclusionReason::CircuitOpen { until } => {
                let wait_ms = until.map_or(0.0, |t| (t.0 - now.0).max(0.0));
                // Saturating float-to-int cast (18 hours at most); the ceiling of the wait.
                Some(((wait_ms / 1000.0).ceil() as u16).max(1))
            }
            _ => None,
        })
        .min()
}

/// A finished request, as the audit log sees it.
#[derive(Clone, Copy)]
struct Audited<'a> {
    request_id: &'a str,
    decided: &'a Decided,
    features: &'a [f64],
    result: &'a equiroute_core::executor::RequestResult,
}

/// Writes the audit record of a finished request, when an audit log is configured, and keeps
/// it for the dashboard when the dashboard wants it.
fn audit(state: &AppState, iface: &InterfaceRuntime, done: Audited<'_>) {
    let Audited {
        request_id,
        decided,
        features,
        result,
    } = done;
    let attempts = &result.attempts[..];
    let wanted = iface.history.wants_record(state.now(), attempts);
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
        ts_ms: state.now().0,
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

/// The latency metric, the dashboard's counts and the audit record of a finished request.
fn record_request(
    state: &AppState,
    iface: &InterfaceRuntime,
    request_id: &str,
    decided: &Decided,
    features: &[f64],
    result: &equiroute_core::executor::RequestResult,
) {
    state.metrics.request_latency(&iface.name, result.latency.0);
    state.metrics.request_cost(&iface.name, result.cost.0);
    if let equiroute_core::executor::RequestStatus::Succeeded { candidate } = result.status {
        let provider = &iface.candidates[candidate].id.0;
        state
            .metrics
            .provider_latency(&iface.name, provider, result.latency.0);
    }
    super::spans::finish_request(
        iface,
        result,
        outcome_label(result.status),
        fallback_reason(&result.attempts).as_deref(),
    );
    state.finish_routed(iface, request_id, decided.routed, result.status);
    iface.history.count(
        state.now(),
        decided.order.first().copied(),
        &result.attempts,
        result.status,
    );
    audit(
        state,
        iface,
        Audited {
            request_id,
            decided,
            features,
            result,
        },
    );
}

/// The first attempt's status, when the request fell back.
fn fallback_reason(attempts: &[equiroute_core::executor::AttemptRecord]) -> Option<String> {
    // A hedge is no fallback: the attempts besides it tell whether the request fell back.
    let mut unhedged = attempts.iter().filter(|a| !a.hedge);
    match (unhedged.next(), unhedged.next()) {
        (Some(first), Some(_)) => Some(first.outcome.status.as_str().to_owned()),
        _ => None,
    }
}

/// The request outcome's name in metrics and the audit log.
fn outcome_label(status: RequestStatus) -> &'static str {
    match status {
        RequestStatus::Succeeded { .. } => "ok",
        RequestStatus::ClientError { .. } => "client_error",
        RequestStatus::DeadlineExceeded => "deadline_exceeded",
        RequestStatus::Exhausted => "failed",
    }
}

/// The context-window refusals of one request so far.
#[derive(Default)]
struct ContextRefusals(u32);

impl ContextRefusals {
    /// After a provider refused the request as too long for its context window, continues
    /// with the untried candidates of the ranking whose window is larger, if there are any.
    /// When none is larger but one has the same window (windows not declared are all the
    /// default: their real sizes are unknown), the first such candidate gets one attempt, on
    /// the request's first refusal only; the refusing candidate is never tried again.
    fn reroute(
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

/// Waits the pause the execution asked for before `next` (a retry's), then gives the time.
async fn pause(state: &AppState, next: NextAttempt) -> equiroute_core::Timestamp {
    if next.wait.0 > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(next.wait.0 / 1000.0)).await;
    }
    state.now()
}

/// Asks the candidate's breaker whether an attempt may go now (half-open probes are bounded).
pub(super) fn admit(
    state: &AppState,
    iface: &InterfaceRuntime,
    candidate: usize,
    now: equiroute_core::Timestamp,
) -> Result<bool, ApiError> {
    let mut breakers = iface.breakers.lock().map_err(|_| poisoned())?;
    let (admission, transition) = breakers[candidate].admit(now, &iface.breaker_config);
    if let Some(t) = transition {
        state.metrics.breaker(
            &iface.candidates[candidate].id.0,
            super::state::transition_name(t),
        );
    }
    Ok(!matches!(admission, Admission::Rejected { .. }))
}

/// Makes one attempt and feeds its outcome to the policy, the breaker, the metrics and the
/// execution.
#[allow(clippy::too_many_arguments)]
async fn attempt(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    next: NextAttempt,
    now: equiroute_core::Timestamp,
    body: &ClientBody,
    ctx: &super::hedge::Booking<'_>,
    seed: u64,
    router: &mut Duration,
) -> Result<(AttemptOutcome, UpstreamReply), ApiError> {
    let candidate = &iface.candidates[next.candidate];
    let req = UpstreamRequest {
        kind: iface.kind,
        body,
        model: &candidate.model,
        seed,
    };
    let timeout = next.timeout.map(|t| Duration::from_secs_f64(t.0 / 1000.0));
    let span = super::spans::attempt(iface, next, false);
    let reply = iface.upstreams[next.candidate]
        .call(req, timeout)
        .instrument(span.clone())
        .await;
    let outcome = outcome_of(&reply, candidate, ctx.tokens);
    attempt_ended(
        state,
        &span,
        iface,
        next.candidate,
        &outcome,
        usage_of(&reply),
    );
    book(state, iface, run, next, now, outcome, ctx, router)?;
    Ok((outcome, reply))
}

/// Feeds one attempt's outcome (started at `now`) to the policy, the breaker, the metrics
/// and the execution.
#[allow(clippy::too_many_arguments)]
pub(super) fn book(
    state: &AppState,
    iface: &InterfaceRuntime,
    run: &mut Execution,
    next: NextAttempt,
    now: equiroute_core::Timestamp,
    outcome: AttemptOutcome,
    ctx: &super::hedge::Booking<'_>,
    router: &mut Duration,
) -> Result<(), ApiError> {
    let booked = Instant::now();
    state.record_routed_attempt(
        iface,
        ctx.arm,
        next.candidate,
        ctx.features,
        ctx.slice,
        &outcome,
        run.remaining(now),
    )?;
    *router += booked.elapsed();
    log_attempt(&iface.candidates[next.candidate], next, &outcome);
    run.record(next.candidate, outcome, now);
    Ok(())
}

/// The debug event of one attempt's outcome.
fn log_attempt(candidate: &equiroute_core::Candidate, next: NextAttempt, outcome: &AttemptOutcome) {
    tracing::debug!(
        provider = %candidate.id,
        attempt = next.number,
        retry = next.retry.map(equiroute_core::executor::RetryReason::as_str),
        outcome = outcome.status.as_str(),
        latency_ms = outcome.latency.0,
        "attempt"
    );
}

/// Ends an attempt's span with its outcome and counts the tokens the provider reported
/// (`usage`) in its provider's histograms.
pub(super) fn attempt_ended(
    state: &AppState,
    span: &tracing::Span,
    iface: &InterfaceRuntime,
    candidate: usize,
    outcome: &AttemptOutcome,
    usage: Option<TokenEstimate>,
) {
    super::spans::record_attempt(span, iface, candidate, outcome, usage);
    if let Some(u) = usage {
        let id = &iface.candidates[candidate].id.0;
        state
            .metrics
            .provider_tokens(&iface.name, id, u.input, u.output);
    }
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
    AttemptOutcome {
        latency: reply.latency,
        status: reply.status,
        // Billed unless the provider refused before doing any work; by the provider's reported
        // usage when it sent one, else by the request's estimate.
        cost: match reply.status {
            AttemptStatus::ProviderError(
                ProviderFailure::RateLimited | ProviderFailure::Connection,
            )
            | AttemptStatus::ClientError => Usd(0.0),
            _ => candidate.price.cost(
                reply
                    .body
                    .as_ref()
                    .and_then(crate::upstream::answer::ProviderJson::usage)
                    .unwrap_or(estimate),
            ),
        },
        time_to_first_byte: None,
        retry_after: reply.retry_after,
    }
}

/// The error answer of request `request_id`, which got no answer, with its routing headers.
///
/// The client is told the last provider's words, redacted (every secret of the gateway's and
/// every credential shape cut out: see [`crate::redact`]); they may quote the client's own
/// prompt back to it, which is no leak. The logs at `info` and `warn` say only which providers
/// were tried, how each ended, the HTTP status and the error code: the provider's words, which
/// may quote the prompt, go to `debug` only.
fn failure(
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
            state.metrics.request(&iface.name, "client_error");
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
        RequestStatus::ClientError { candidate } => {
            state.metrics.request(&iface.name, "client_error");
            ApiError::bad_request(
                "upstream_rejected_request",
                None,
                format!(
                    "provider `{}` rejected the request: {}",
                    iface.candidates[candidate].id,
                    said("rejected")
                ),
            )
        }
        RequestStatus::DeadlineExceeded => {
            state.metrics.request(&iface.name, "deadline_exceeded");
            ApiError::upstream(
                StatusCode::GATEWAY_TIMEOUT,
                "deadline_exceeded",
                format!(
                    "no provider answered within the {:.0} ms deadline ({summary})",
                    deadline.map_or(0.0, |d| d.0)
                ),
            )
        }
        RequestStatus::Exhausted | RequestStatus::Succeeded { .. } => {
            state.metrics.request(&iface.name, "failed");
            ApiError::upstream(
                StatusCode::BAD_GATEWAY,
                "all_providers_failed",
                format!(
                    "every attempt failed ({summary}); last: {}",
                    said("no attempt could be made")
                ),
            )
        }
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

fn poisoned() -> ApiError {
    ApiError::internal()
}

/// Routes and executes a streamed chat request. Attempts fall back, exactly as unstreamed
/// ones, until one produces its first byte within the time left; from then on the answer is
/// committed and relayed chunk by chunk. A stream that breaks, stalls longer than the
/// interface's idle limit or ends without `[DONE]` is closed with an OpenAI-style error event
/// and no `[DONE]`, and the attempt is recorded as failed.
///
/// # Errors
/// As [`execute`], when no attempt produced a first byte.
pub async fn execute_stream(
    state: Arc<AppState>,
    iface: Arc<InterfaceRuntime>,
    body: ClientBody,
    pinned: Option<usize>,
    deadline: Option<Millis>,
    meta: super::RequestMeta,
) -> Result<axum::response::Response, ApiError> {
    let span = request_span(&iface, &meta);
    execute_streamed(state, iface, body, pinned, deadline, meta)
        .instrument(span)
        .await
}

#[allow(clippy::too_many_lines)]
async fn execute_streamed(
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
    while let Some(next) = run.next_attempt(state.now()) {
        let now = pause(&state, next).await;
        if !admit(&state, &iface, next.candidate, now)? {
            run.skip();
            continue;
        }
        if next.number > 0 && next.retry.is_none() {
            state.metrics.fallback(&iface.name);
        }
        let unlearnt = Unlearnt::of(&run, &next, now);
        let open = |next: NextAttempt, now| {
            open_attempt(&state, &iface, &body, n, next, now, tokens, unlearnt)
        };
        // The first attempt with a hedge planned beside it races to its first byte.
        let opened = if let Some(hedge) = run.hedge(&next, now) {
            let ctx = super::hedge::Booking {
                features: &features,
                arm: decided.routed.arm,
                slice: decided.slice,
                tokens,
            };
            super::hedge::race_streams(
                &state,
                &iface,
                &mut run,
                (next, hedge),
                now,
                &open,
                &mut decided.first_byte_limits,
                &ctx,
                &mut router,
            )
            .await?
        } else {
            let opening = open(next, now)?;
            decided
                .first_byte_limits
                .push((next.candidate, now, opening.limit.map(|l| l.0)));
            vec![opening.opened.await]
        };
        for opened in opened {
            let candidate = &iface.candidates[opened.next.candidate];
            // An attempt that ends here sent nothing to the client: booked, and on to the next.
            let (outcome, reply) = match opened.result {
                OpenResult::Ready { first, rest, ttfb } => {
                    rejections.answered(&state, &iface, opened.next.candidate);
                    // The relay keeps the attempt's span open until the stream ends, and
                    // records the outcome and usage on it then.
                    let relay = Relay {
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
                        ttfb,
                        attempt_started: opened.started,
                        run,
                        decided,
                    };
                    return Ok(relay.start(first, rest));
                }
                OpenResult::Ended { outcome, reply } => (outcome, reply),
            };
            attempt_ended(
                &state,
                &opened.span,
                &iface,
                opened.next.candidate,
                &outcome,
                reply.as_ref().and_then(usage_of),
            );
            log_attempt(candidate, opened.next, &outcome);
            state.record_routed_attempt(
                &iface,
                decided.routed.arm,
                opened.next.candidate,
                &features,
                decided.slice,
                &outcome,
                run.remaining(opened.started),
            )?;
            run.record(opened.next.candidate, outcome, opened.started);
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
    let mut result = run.finish(state.now());
    rejections.settle(&state, &iface, &mut result, &mut last);
    record_request(&state, &iface, &request_id, &decided, &features, &result);
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

/// A streamed attempt's first-byte limit, as the audit record shows it: the attempt's
/// candidate, when it started, and the limit in ms.
pub(super) type FirstByteLimitRecord = (usize, equiroute_core::Timestamp, Option<f64>);

/// A streamed attempt once it ended before anything was sent, or is ready to be relayed.
pub(super) struct Opened {
    next: NextAttempt,
    /// The attempt's span (`attempt`, a child of the request's).
    pub(super) span: tracing::Span,
    /// When it started.
    started: equiroute_core::Timestamp,
    clock: Instant,
    result: OpenResult,
}

impl Opened {
    /// Whether it has its first byte (and its hold, if any), ready to commit.
    pub(super) fn is_ready(&self) -> bool {
        matches!(self.result, OpenResult::Ready { .. })
    }
}

enum OpenResult {
    /// Commit: send `first` (every byte read so far), then relay `rest`.
    Ready {
        first: Bytes,
        rest: ChunkStream,
        ttfb: Millis,
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
fn open_attempt<'a>(
    state: &'a AppState,
    iface: &'a InterfaceRuntime,
    body: &'a ClientBody,
    n: u64,
    next: NextAttempt,
    now: equiroute_core::Timestamp,
    tokens: TokenEstimate,
    unlearnt: Unlearnt,
) -> Result<super::hedge::Opening<'a>, ApiError> {
    let limit = first_byte_limit(iface, next.candidate, now, next.timeout, unlearnt)?;
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
            StreamStart::Started { first, rest, ttfb } => {
                tracing::debug!(provider = %candidate.id, attempt = next.number, ttfb_ms = ttfb.0, "stream started");
                match hold(iface.stream_hold, iface.stream_idle, first, rest).await {
                    Held::Commit { first, rest } => OpenResult::Ready { first, rest, ttfb },
                    Held::Broken(reason) => {
                        if state.logs.allow(Repeated::StreamBroken) {
                            tracing::warn!(provider = %candidate.id, error = %reason, "stream broke while held; falling back");
                        }
                        let broken = AttemptStatus::ProviderError(ProviderFailure::StreamBroken);
                        let latency = state.now().since(now);
                        OpenResult::Ended {
                            outcome: streamed(candidate, tokens, broken, latency, ttfb),
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
        }
    };
    Ok(super::hedge::Opening {
        limit,
        opened: Box::pin(opened.instrument(span.clone())),
        span,
    })
}

/// A streamed attempt waiting for its first byte. Dropped while still waiting (the loser of a
/// hedge race, or a client gone), it is booked in its provider's first-byte statistics as
/// "at least this long", as a first-byte timeout is: else only the first bytes that beat the
/// hedges would be learnt, and a provider that stalls would keep its fast belief.
struct FirstByteWatch<'a> {
    state: &'a AppState,
    iface: &'a InterfaceRuntime,
    candidate: usize,
    clock: Instant,
    pending: bool,
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

/// The outcome of a streamed attempt that began (it had its first byte, so it is billed).
fn streamed(
    candidate: &equiroute_core::Candidate,
    tokens: TokenEstimate,
    status: AttemptStatus,
    latency: Millis,
    ttfb: Millis,
) -> AttemptOutcome {
    AttemptOutcome {
        latency,
        status,
        cost: candidate.price.cost(tokens),
        time_to_first_byte: Some(ttfb),
        retry_after: None,
    }
}

/// What holding the start of a stream came to.
enum Held {
    /// Send `first` (every byte read so far), then relay `rest`.
    Commit { first: Bytes, rest: ChunkStream },
    /// The stream broke, stalled or started malformed before anything was sent.
    Broken(String),
}

/// Reads the start of a stream without sending it, for as long as `policy` says (see
/// [`StreamHold`](crate::config::first_byte::StreamHold)), checking each event as the relay
/// does; with no hold configured, commits at once.
async fn hold(policy: StreamHold, idle: Millis, first: Bytes, mut rest: ChunkStream) -> Held {
    use futures_util::StreamExt;
    if !policy.is_on() {
        return Held::Commit { first, rest };
    }
    // Without a timed hold, `until` is now: only the content gate holds.
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(policy.ms / 1000.0);
    let idle = Duration::from_secs_f64(idle.0 / 1000.0);
    let mut scan = SseScan::default();
    let mut held = Vec::with_capacity(first.len());
    let mut next = Some(first);
    loop {
        if let Some(bytes) = next.take() {
            held.extend_from_slice(&bytes);
            if let (_, Err(why)) = scan.feed(&bytes) {
                return Held::Broken(why);
            }
        }
        let now = tokio::time::Instant::now();
        let timed_over = !policy.is_timed()
            || now >= until
            || (policy.events > 0 && scan.seen.data_events >= policy.events);
        let content_gate = !policy.until_content || scan.seen.content;
        if (timed_over && content_gate) || scan.seen.done || held.len() >= StreamHold::MAX_BYTES {
            return Held::Commit {
                first: Bytes::from(held),
                rest,
            };
        }
        let wait = if timed_over {
            idle
        } else {
            (until - now).min(idle)
        };
        match tokio::time::timeout(wait, rest.next()).await {
            // The timed hold is over before the stream was silent for its idle limit.
            Err(_) if !timed_over && tokio::time::Instant::now() >= until => {}
            Err(_) => {
                return Held::Broken(format!(
                    "the provider's stream stalled for more than {:.0} ms",
                    idle.as_secs_f64() * 1000.0
                ));
            }
            Ok(Some(Err(reason))) => return Held::Broken(reason),
            Ok(Some(Ok(bytes))) => next = Some(bytes),
            Ok(None) => {
                // The whole answer arrived within the hold: send it if it is complete.
                return match scan.end() {
                    (_, Err(why)) => Held::Broken(why),
                    (_, Ok(())) if scan.seen.done || scan.seen.finished => Held::Commit {
                        first: Bytes::from(held),
                        rest: Box::pin(futures_util::stream::empty()),
                    },
                    (_, Ok(())) => Held::Broken("the provider's stream ended before [DONE]".into()),
                };
            }
        }
    }
}

/// What bounds a streamed attempt's first-byte limit while its provider's first bytes are
/// not known (see [`super::ttfb`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Unlearnt {
    /// No other candidate is left: the attempt's timeout.
    LastCandidate,
    /// Another is: the unlearnt limit, within a share of `left` (the time to the deadline).
    Fallback { left: Option<Millis> },
}

impl Unlearnt {
    /// For the attempt `next` of `run`, started at `now`.
    fn of(run: &Execution, next: &NextAttempt, now: equiroute_core::Timestamp) -> Unlearnt {
        if run.has_fallback_after(next) {
            Unlearnt::Fallback {
                left: run.remaining(now),
            }
        } else {
            Unlearnt::LastCandidate
        }
    }
}

/// The first-byte limit of a streamed attempt on `candidate` whose timeout is `max`: learnt
/// from the provider's first-byte times (see [`super::ttfb`]), or unlearnt, at most `max`.
fn first_byte_limit(
    iface: &InterfaceRuntime,
    candidate: usize,
    now: equiroute_core::Timestamp,
    max: Option<Millis>,
    unlearnt: Unlearnt,
) -> Result<Option<Millis>, ApiError> {
    let Some(max) = max else { return Ok(None) };
    let stats = iface.first_bytes.lock().map_err(|_| poisoned())?;
    let cfg = &iface.first_byte;
    Ok(Some(match unlearnt {
        Unlearnt::Fallback { left } if !cfg.knows(&stats[candidate]) => {
            cfg.unlearnt_limit(&stats, now, max, left)
        }
        _ => cfg.limit(&stats[candidate], now, max),
    }))
}

/// Feeds a streamed attempt's start to its provider's first-byte statistics: the first
/// byte's time, or at least the limit when none came within it.
fn learn_first_byte(
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

/// A committed stream being relayed to the client: the request's execution goes on in the
/// relay task, which records the streamed attempt and audits the request when it ends. A
/// stream that breaks is continued on the next candidate when the interface says so
/// (`stream_resume`): the relay is then on the continuing attempt.
struct Relay {
    /// The relayed attempt's span (`attempt`), ended when its stream ends.
    span: tracing::Span,
    tokens: TokenEstimate,
    state: Arc<AppState>,
    iface: Arc<InterfaceRuntime>,
    /// The candidate whose stream is being relayed.
    candidate: usize,
    features: Vec<f64>,
    request_id: String,
    /// The label of the key that made the request ([`super::RequestMeta::owner`]).
    owner: Option<Arc<str>>,
    /// The client reads restart events ([`super::RESTART_HEADER`]).
    restart_events: bool,
    /// The request's number (seeds a continuation's attempt).
    n: u64,
    /// The client's request, for a continuation.
    body: ClientBody,
    started: Instant,
    /// What the relayed attempt's latency is counted from.
    attempt_clock: Instant,
    ttfb: Millis,
    /// When the relayed attempt began.
    attempt_started: equiroute_core::Timestamp,
    run: Execution,
    decided: Decided,
}

/// A continuation's stream, started.
struct Continued {
    first: Bytes,
    rest: ChunkStream,
    mode: ResumeMode,
}

impl Relay {
    /// Starts relaying in a task; returns the SSE response with the routing headers.
    fn start(self, first: Bytes, rest: ChunkStream) -> axum::response::Response {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let body =
            axum::body::Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|item| (item, rx))
            }));
        let mut resp = axum::response::Response::new(body);
        let h = resp.headers_mut();
        h.insert(
            "content-type",
            axum::http::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            "cache-control",
            axum::http::HeaderValue::from_static("no-cache"),
        );
        super::routing_headers(
            h,
            &self.request_id,
            Some(&self.iface.candidates[self.candidate].id.0),
            self.run.attempts() + 1,
        );
        super::dropped_header(h, self.decided.dropped[self.candidate]);
        // The task ends with the upstream stream, the idle limit, or a departed client.
        tokio::spawn(
            self.pump(first, rest, tx)
                .instrument(tracing::Span::current()),
        );
        resp
    }

    /// Relays whole events until the stream ends; returns why it broke, if it did, and
    /// whether the client left.
    async fn relay(
        &self,
        events: &mut SseScan,
        first: Bytes,
        mut rest: ChunkStream,
        tx: &tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> (Option<String>, bool) {
        use futures_util::StreamExt;
        let idle = Duration::from_secs_f64(self.iface.stream_idle.0 / 1000.0);
        let mut next = Some(first);
        loop {
            let Some(bytes) = next.take() else {
                match tokio::time::timeout(idle, rest.next()).await {
                    Err(_) => {
                        let why = format!(
                            "the provider's stream stalled for more than {:.0} ms",
                            idle.as_secs_f64() * 1000.0
                        );
                        return (Some(why), false);
                    }
                    Ok(Some(Err(reason))) => return (Some(reason), false),
                    Ok(Some(Ok(bytes))) => next = Some(bytes),
                    Ok(None) => {
                        // A clean end: complete once the last event is read.
                        let (whole, verdict) = events.end();
                        if !whole.is_empty() && tx.send(Ok(whole)).await.is_err() {
                            return (None, true);
                        }
                        return match verdict {
                            Err(why) => (Some(why), false),
                            Ok(()) if events.seen.done => (None, false),
                            // The answer is whole (it has its finish_reason) and the body
                            // ended cleanly: only the end marker is missing, so add it.
                            Ok(()) if events.seen.finished => {
                                let done = Bytes::from_static(b"data: [DONE]\n\n");
                                (None, tx.send(Ok(done)).await.is_err())
                            }
                            Ok(()) => (
                                Some("the provider's stream ended before [DONE]".into()),
                                false,
                            ),
                        };
                    }
                }
                continue;
            };
            let (whole, verdict) = events.feed(&bytes);
            if !whole.is_empty() && tx.send(Ok(whole)).await.is_err() {
                return (None, true);
            }
            if let Err(why) = verdict {
                return (Some(why), false);
            }
        }
    }

    async fn pump(
        mut self,
        first: Bytes,
        rest: ChunkStream,
        tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) {
        let resume = self.iface.stream_resume;
        let mut events = SseScan::keeping(resume.is_on().then_some(resume.max_kept_bytes));
        // The relay runs in the attempt's span: an exported span ends at its last exit.
        let span = self.span.clone();
        let (mut broken, mut client_gone) = self
            .relay(&mut events, first, rest, &tx)
            .instrument(span)
            .await;
        let mut status = self.book_relayed(broken.as_deref(), client_gone, events.seen.usage);
        let mut continuations = 0;
        let mut not_continued = None;
        while let Some(reason) = broken.clone() {
            if let Some(why) = self.unresumable(&events, continuations) {
                not_continued = Some(why);
                break;
            }
            let broke_on = self.candidate;
            let Some(next) = self.open_continuation(&events).await else {
                not_continued = Some(if events.seen.content && !self.restart_events {
                    format!("no provider left takes an assistant prefill, and a restart would repeat the text already sent (a client that drops it on the restart event sends `{}: events`)", super::RESTART_HEADER)
                } else {
                    "no provider could take the continuation".into()
                });
                break;
            };
            continuations += 1;
            let marker = continuation_marker(
                &self.request_id,
                &self.iface.candidates[broke_on].id.0,
                &self.iface.candidates[self.candidate],
                next.mode,
                &reason,
            );
            if tx.send(Ok(marker)).await.is_err() {
                // The client left: the continuation is dropped unread.
                (broken, client_gone) = (None, true);
            } else {
                events.next_stream(next.mode);
                let span = self.span.clone();
                (broken, client_gone) = self
                    .relay(&mut events, next.first, next.rest, &tx)
                    .instrument(span)
                    .await;
            }
            status = self.book_relayed(broken.as_deref(), client_gone, events.seen.usage);
        }
        if let Some(reason) = &broken {
            let message = match &not_continued {
                Some(why) if resume.is_on() => format!("{reason}; not continued: {why}"),
                _ => reason.clone(),
            };
            let event = serde_json::json!({"error": {"message": message, "type": "api_error", "param": null, "code": "stream_broken"}});
            let _ = tx.send(Ok(Bytes::from(format!("data: {event}\n\n")))).await;
        }
        drop(tx);
        let latency = Millis(self.started.elapsed().as_secs_f64() * 1000.0);
        let end = self.state.now();
        let result = self.run.clone().finish(end);
        record_request(
            &self.state,
            &self.iface,
            &self.request_id,
            &self.decided,
            &self.features,
            &result,
        );
        let label = match status {
            AttemptStatus::Ok => "ok",
            AttemptStatus::Cancelled => "cancelled",
            _ => "stream_broken",
        };
        self.state.metrics.request(&self.iface.name, label);
        if status == AttemptStatus::Ok {
            self.state.remember(
                &self.request_id,
                PendingContext {
                    interface: &self.iface.name,
                    candidate: self.candidate,
                    features: Features::F64(&self.features),
                    latency,
                    at: end,
                    owner: self.owner.as_deref(),
                },
            );
        }
    }

    /// Books the relayed attempt, which ended (`broken`: why it broke), billed by the usage
    /// the provider reported in the stream, else by the request's estimate; returns its status.
    fn book_relayed(
        &mut self,
        broken: Option<&str>,
        client_gone: bool,
        usage: Option<TokenEstimate>,
    ) -> AttemptStatus {
        let status = match (broken, client_gone) {
            (Some(_), _) => AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
            (None, true) => AttemptStatus::Cancelled,
            (None, false) => AttemptStatus::Ok,
        };
        let c = &self.iface.candidates[self.candidate];
        let latency = Millis(self.attempt_clock.elapsed().as_secs_f64() * 1000.0);
        if let Some(reason) = broken {
            if self.state.logs.allow(Repeated::StreamBroken) {
                tracing::warn!(request_id = %self.request_id, provider = %c.id, error = %reason, "stream broken");
            }
        } else {
            tracing::debug!(provider = %c.id, outcome = status.as_str(), latency_ms = latency.0, "stream ended");
        }
        let outcome = streamed(c, usage.unwrap_or(self.tokens), status, latency, self.ttfb);
        attempt_ended(
            &self.state,
            &self.span,
            &self.iface,
            self.candidate,
            &outcome,
            usage,
        );
        let _ = self.state.record_routed_attempt(
            &self.iface,
            self.decided.routed.arm,
            self.candidate,
            &self.features,
            self.decided.slice,
            &outcome,
            None,
        );
        self.run
            .record(self.candidate, outcome, self.attempt_started);
        status
    }

    /// Why a stream that broke is not continued, if it is not.
    fn unresumable(&self, events: &SseScan, done: u32) -> Option<String> {
        let resume = self.iface.stream_resume;
        if !resume.is_on() {
            return Some("stream_resume is off".into());
        }
        if done >= resume.max {
            return Some(format!(
                "the request had its {} continuation(s) (stream_resume.max)",
                resume.max
            ));
        }
        if events.seen.finished {
            return Some("the answer had its finish_reason before the break".into());
        }
        let kept = events.seen.kept.as_ref()?;
        if let Some(why) = kept.unfit {
            return Some(why.to_owned());
        }
        // Content without text (reasoning only): no prefix to go on from, and a restart would
        // repeat what the client has.
        if events.seen.content && kept.text.trim().is_empty() && !self.restart_events {
            return Some("the content sent has no text to continue from".into());
        }
        None
    }

    /// Opens the continuation of the broken stream on the next candidate the execution
    /// gives (the breaker admitting it, within the deadline and the attempt limit); attempts
    /// that end before their first byte are booked and passed, as before a commit.
    async fn open_continuation(&mut self, events: &SseScan) -> Option<Continued> {
        let state = self.state.clone();
        let iface = self.iface.clone();
        loop {
            let next = self.run.next_attempt(state.now())?;
            let now = pause(&state, next).await;
            if !admit(&state, &iface, next.candidate, now).ok()? {
                self.run.skip();
                continue;
            }
            let candidate = &iface.candidates[next.candidate];
            let Some(mode) = continuation_mode(
                iface.stream_resume.mode,
                iface.prefill[next.candidate],
                events.seen.content,
                self.restart_events,
            ) else {
                // It could only restart, which would repeat the text the client has.
                self.run.skip();
                continue;
            };
            let prefixed = match (mode, &events.seen.kept) {
                (ResumeMode::Prefix, Some(kept)) => with_assistant_prefix(&self.body, &kept.text),
                _ => None,
            };
            let req = UpstreamRequest {
                kind: iface.kind,
                body: prefixed.as_ref().unwrap_or(&self.body),
                model: &candidate.model,
                seed: state.seed_for(self.n)
                    ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb),
            };
            let unlearnt = Unlearnt::of(&self.run, &next, now);
            let limit =
                first_byte_limit(&iface, next.candidate, now, next.timeout, unlearnt).ok()?;
            self.decided
                .first_byte_limits
                .push((next.candidate, now, limit.map(|l| l.0)));
            let clock = Instant::now();
            let span = super::spans::attempt(&iface, next, false);
            let start = iface.upstreams[next.candidate]
                .open_stream(req, limit.map(|t| Duration::from_secs_f64(t.0 / 1000.0)))
                .instrument(span.clone())
                .await;
            let _ = learn_first_byte(&state, &iface, next.candidate, &start, limit);
            match start {
                StreamStart::Started { first, rest, ttfb } => {
                    let name = mode.name();
                    tracing::info!(request_id = %self.request_id, provider = %candidate.id, mode = name, "continuing a broken stream");
                    state.metrics.stream_continuation(&iface.name, name);
                    self.decided
                        .continuations
                        .push((next.number as usize, name));
                    self.candidate = next.candidate;
                    self.span = span;
                    self.ttfb = ttfb;
                    self.attempt_started = now;
                    self.attempt_clock = clock;
                    return Some(Continued { first, rest, mode });
                }
                StreamStart::Failed(reply) => {
                    let outcome = outcome_of(&reply, candidate, self.tokens);
                    attempt_ended(
                        &state,
                        &span,
                        &iface,
                        next.candidate,
                        &outcome,
                        usage_of(&reply),
                    );
                    log_attempt(candidate, next, &outcome);
                    let _ = state.record_routed_attempt(
                        &iface,
                        self.decided.routed.arm,
                        next.candidate,
                        &self.features,
                        self.decided.slice,
                        &outcome,
                        self.run.remaining(now),
                    );
                    self.run.record(next.candidate, outcome, now);
                }
            }
        }
    }
}

/// How a broken stream goes on, on a candidate that takes a prefill (`prefill`) or not,
/// once the client has had content (`content_sent`) or not: a restart repeats the answer
/// from its beginning, which a client that joins deltas would show after the text it has, so
/// it is chosen only before any content or for a client that reads restart events; else a
/// prefix continuation on a candidate that takes one, or `None` (not on this candidate).
fn continuation_mode(
    configured: ResumeMode,
    prefill: bool,
    content_sent: bool,
    restart_events: bool,
) -> Option<ResumeMode> {
    let restart_allowed = !content_sent || restart_events;
    match configured {
        ResumeMode::Off => None,
        ResumeMode::Restart if restart_allowed => Some(ResumeMode::Restart),
        ResumeMode::Prefix | ResumeMode::Restart if prefill && content_sent => {
            Some(ResumeMode::Prefix)
        }
        _ if restart_allowed => Some(ResumeMode::Restart),
        _ => None,
    }
}

/// The client's request with `text` (the partial answer already sent) as a final assistant
/// message, for a provider that continues it; `None` when there is no text to continue.
/// Trailing whitespace is left out: Anthropic refuses a prefill that ends with it.
fn with_assistant_prefix(body: &ClientBody, text: &str) -> Option<ClientBody> {
    let text = text.trim_end();
    if text.is_empty() {
        return None;
    }
    let mut json = body.json().clone();
    let messages = json.get_mut("messages")?.as_array_mut()?;
    messages.push(serde_json::json!({"role": "assistant", "content": text}));
    Some(ClientBody::from_json(json))
}

/// The events that announce a continuation in the client's stream: an SSE comment (for a
/// person reading the stream) and a chat chunk with an empty delta on choice 0 (which any
/// OpenAI client reads as no text) and an `equiroute` member saying what happened:
/// `{"event": "continue" | "restart", "from": …, "provider": …, "reason": …}`. After
/// `restart` the answer starts again from its beginning: what came before is to be dropped.
fn continuation_marker(
    request_id: &str,
    from: &str,
    to: &equiroute_core::Candidate,
    mode: ResumeMode,
    reason: &str,
) -> Bytes {
    let event = match mode {
        ResumeMode::Restart => "restart",
        ResumeMode::Prefix | ResumeMode::Off => "continue",
    };
    let one_line = reason.replace(['\r', '\n'], " ");
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let chunk = serde_json::json!({
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": to.model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": null}],
        "equiroute": {"event": event, "mode": mode.name(), "from": from, "provider": to.id.0, "reason": one_line},
    });
    Bytes::from(format!(
        ": equiroute {event}: the stream of `{from}` broke ({one_line}); continued on `{}`\n\ndata: {chunk}\n\n",
        to.id
    ))
}

/// The longest server-sent event the relay holds while it waits for the event's end.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// Splits a relayed stream into whole server-sent events and reads each: `[DONE]`, a chunk
/// with a `finish_reason`, an error the provider sent mid-stream, or `data` that is not JSON
/// (which no client could read: the stream is broken there, and that event is not relayed).
#[derive(Default)]
struct SseScan {
    /// Bytes of an event whose end has not arrived yet.
    pending: Vec<u8>,
    seen: Seen,
    /// After a prefix continuation: the whitespace the prefill left out (the client has it),
    /// dropped from the start of the continuation's text so the seam reads as one answer.
    seam: String,
}

/// What the events read so far said.
#[derive(Default)]
struct Seen {
    /// `data: [DONE]` was seen.
    done: bool,
    /// A chunk carried a `finish_reason`.
    finished: bool,
    /// Data events read (chunks, not counting `[DONE]`).
    data_events: u64,
    /// An event carried content: text, a tool call, any delta member but `role`, or a
    /// `finish_reason` (what a client shows; kept across a continuation's streams).
    content: bool,
    /// The answer's text so far, when a broken stream may be continued.
    kept: Option<Kept>,
    /// The token usage the provider reported in the stream, if it did: what the attempt is
    /// billed by, as an unstreamed answer is.
    usage: Option<TokenEstimate>,
}

/// The assistant text a relayed answer has sent, kept (up to `cap` bytes) so that a broken
/// stream can be continued from it.
#[derive(Debug, Default)]
struct Kept {
    text: String,
    cap: usize,
    /// Why the answer cannot be continued, once it cannot (the text is no longer kept).
    unfit: Option<&'static str>,
}

impl Kept {
    fn take(&mut self, choices: &[ChoicePeek]) {
        if self.unfit.is_some() {
            return;
        }
        for ch in choices {
            let Some(delta) = &ch.delta else { continue };
            let unfit = if ch.index != 0 {
                Some("the answer has more than one choice")
            } else if delta.tool_calls.is_some() || delta.function_call.is_some() {
                Some("the answer calls tools")
            } else {
                let text = delta.content.as_deref().unwrap_or_default();
                if self.text.len() + text.len() > self.cap {
                    Some("the answer is longer than stream_resume.max_kept_bytes")
                } else {
                    self.text.push_str(text);
                    None
                }
            };
            if unfit.is_some() {
                self.unfit = unfit;
                self.text = String::new();
                return;
            }
        }
    }
}

/// The parts of a chat chunk the relay reads; the rest is only checked to be JSON.
#[derive(serde::Deserialize)]
struct ChunkPeek {
    #[serde(default)]
    choices: Vec<ChoicePeek>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    /// The usage chunk (`stream_options.include_usage`, and every native dialect's stream).
    #[serde(default)]
    usage: Option<UsagePeek>,
}

#[derive(serde::Deserialize)]
struct UsagePeek {
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
}

#[derive(serde::Deserialize)]
struct ChoicePeek {
    #[serde(default)]
    index: u64,
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    delta: Option<DeltaPeek>,
}

/// The parts of a chunk's delta a continuation needs, and the rest (reasoning, refusal …),
/// to tell content from a role-only or empty delta.
#[derive(serde::Deserialize)]
struct DeltaPeek {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    function_call: Option<serde::de::IgnoredAny>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

impl DeltaPeek {
    /// Whether the delta carries anything a client shows: not only a role, nor only empties.
    fn carries_content(&self) -> bool {
        let shown = |v: &serde_json::Value| match v {
            serde_json::Value::Null => false,
            serde_json::Value::String(s) => !s.is_empty(),
            serde_json::Value::Array(a) => !a.is_empty(),
            serde_json::Value::Object(o) => !o.is_empty(),
            serde_json::Value::Bool(_) | serde_json::Value::Number(_) => true,
        };
        self.content.as_deref().is_some_and(|c| !c.is_empty())
            || self.tool_calls.is_some()
            || self.function_call.is_some()
            || self.rest.iter().any(|(k, v)| k != "role" && shown(v))
    }
}

impl SseScan {
    /// A scan that keeps the answer's text, up to `cap` bytes, when `cap` is given.
    fn keeping(cap: Option<usize>) -> SseScan {
        let mut scan = SseScan::default();
        scan.seen.kept = cap.map(|cap| Kept {
            cap,
            ..Kept::default()
        });
        scan
    }

    /// Starts on a continuation's stream: the events are read afresh; the text kept goes on
    /// after a prefix continuation, and starts again after a restart.
    fn next_stream(&mut self, mode: ResumeMode) {
        let mut kept = self.seen.kept.take();
        if let (Some(k), ResumeMode::Restart) = (&mut kept, mode) {
            k.text.clear();
            k.unfit = None;
        }
        let content = self.seen.content;
        *self = SseScan::default();
        if let (Some(k), ResumeMode::Prefix) = (&kept, mode) {
            self.seam = k.text[k.text.trim_end().len()..].to_owned();
        }
        self.seen.kept = kept;
        self.seen.content = content;
    }

    /// Takes the next bytes; returns the whole events they complete (to relay) and whether
    /// the stream is still sound (`Err`: why it is broken; the bad event is not returned).
    fn feed(&mut self, bytes: &[u8]) -> (Bytes, Result<(), String>) {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some((end, next)) = event_end(&self.pending[start..]) {
            let event = &self.pending[start..start + end];
            let sewn = (!self.seam.is_empty())
                .then(|| sew(event, &mut self.seam))
                .flatten();
            if let Err(why) = self.seen.read(sewn.as_deref().unwrap_or(event)) {
                self.pending.clear();
                return (Bytes::from(out), Err(why));
            }
            match sewn {
                Some(event) => {
                    out.extend_from_slice(&event);
                    out.extend_from_slice(b"\n\n");
                }
                None => out.extend_from_slice(&self.pending[start..start + next]),
            }
            start += next;
        }
        self.pending.drain(..start);
        if self.pending.len() > MAX_EVENT_BYTES {
            let why = format!(
                "the provider sent an event longer than {MAX_EVENT_BYTES} bytes without its end"
            );
            return (Bytes::from(out), Err(why));
        }
        (Bytes::from(out), Ok(()))
    }

    /// At a clean end of the body: what is left is the last event (e.g. `data: [DONE]\n`
    /// without its blank line).
    fn end(&mut self) -> (Bytes, Result<(), String>) {
        let rest = std::mem::take(&mut self.pending);
        if rest.iter().all(u8::is_ascii_whitespace) {
            return (Bytes::new(), Ok(()));
        }
        match self.seen.read(&rest) {
            Ok(()) => (Bytes::from(rest), Ok(())),
            Err(why) => (Bytes::new(), Err(why)),
        }
    }
}

/// The first text event of a prefix continuation (a one-line `data:` chunk whose choice 0
/// has text) without the leading whitespace that `seam` (the whitespace the client already
/// has) covers; `seam` is then spent. `None`: not such an event, relayed as it came.
fn sew(event: &[u8], seam: &mut String) -> Option<Vec<u8>> {
    let data = std::str::from_utf8(event)
        .ok()?
        .trim_end()
        .strip_prefix("data:")?;
    if data.contains('\n') {
        return None;
    }
    let mut chunk: serde_json::Value = serde_json::from_str(data).ok()?;
    let content = chunk.pointer_mut("/choices/0/delta/content")?;
    let text = content.as_str().filter(|t| !t.is_empty())?;
    let owed: usize = text
        .chars()
        .zip(seam.chars())
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.len_utf8())
        .sum();
    *content = serde_json::Value::String(text[owed..].to_owned());
    seam.clear();
    Some(format!("data: {chunk}").into_bytes())
}

impl Seen {
    /// Reads one event (without its blank line).
    fn read(&mut self, event: &[u8]) -> Result<(), String> {
        let mut data: Vec<u8> = Vec::new();
        let mut lines = 0;
        for line in event.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(d) = line.strip_prefix(b"data:") {
                if lines > 0 {
                    data.push(b'\n');
                }
                data.extend_from_slice(d.strip_prefix(b" ").unwrap_or(d));
                lines += 1;
            }
        }
        if lines == 0 || self.done {
            // A comment or keep-alive, or whatever follows the end marker.
            return Ok(());
        }
        if data.trim_ascii() == b"[DONE]" {
            self.done = true;
            return Ok(());
        }
        match serde_json::from_slice::<ChunkPeek>(&data) {
            Err(_) => Err("the provider sent an event that is not JSON".into()),
            Ok(c) if c.error.is_some() => Err("the provider sent an error mid-stream".into()),
            Ok(c) => {
                self.data_events += 1;
                if c.choices.iter().any(|ch| ch.finish_reason.is_some()) {
                    self.finished = true;
                    self.content = true;
                }
                if c.choices
                    .iter()
                    .any(|ch| ch.delta.as_ref().is_some_and(DeltaPeek::carries_content))
                {
                    self.content = true;
                }
                if let Some(kept) = &mut self.kept {
                    kept.take(&c.choices);
                }
                if let Some(UsagePeek {
                    prompt_tokens: Some(input),
                    completion_tokens: Some(output),
                }) = c.usage
                {
                    self.usage = Some(TokenEstimate { input, output });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{breaker_retry_after, SseScan};
    use equiroute_core::eligibility::{Exclusion, ExclusionReason};
    use equiroute_core::Timestamp;

    #[test]
    fn retry_after_is_the_wait_to_the_earliest_half_open_rounded_up() {
        let open = |candidate, until: Option<f64>| Exclusion {
            candidate,
            reason: ExclusionReason::CircuitOpen {
                until: until.map(Timestamp),
            },
        };
        let now = Timestamp(1_000.0);
        // 29.001 s and 45 s away: the earlier, rounded up to 30.
        let excluded = [open(0, Some(30_001.0)), open(1, Some(46_000.0))];
        assert_eq!(breaker_retry_after(&excluded, now), Some(30));
        // Already due, or half-open with its probes in flight: soon, 1 s.
        assert_eq!(breaker_retry_after(&[open(0, Some(900.0))], now), Some(1));
        assert_eq!(breaker_retry_after(&[open(0, None)], now), Some(1));
        // Excluded for what the request needs: waiting changes nothing.
        let unfit = Exclusion {
            candidate: 0,
            reason: ExclusionReason::MissingCapability {
                capability: "tools".into(),
            },
        };
        assert_eq!(breaker_retry_after(&[unfit], now), None);
    }

    #[test]
    fn events_are_relayed_whole_across_chunk_boundaries() {
        let mut scan = SseScan::default();
        let (out, ok) = scan.feed(b"data: {\"choices\":[{\"finish_reason\":null}]}\n\nda");
        assert_eq!(ok, Ok(()));
        assert_eq!(
            &out[..],
            b"data: {\"choices\":[{\"finish_reason\":null}]}\n\n"
        );
        assert!(!scan.seen.finished);
        let (out, ok) =
            scan.feed(b"ta: {\"choices\":[{\"finish_reason\":\"stop\"}]}\r\n\r\ndata: [DO");
        assert_eq!(ok, Ok(()));
        assert!(out.starts_with(b"data: {") && out.ends_with(b"\r\n\r\n"));
        assert!(scan.seen.finished && !scan.seen.done);
        // The end marker without its blank line, at the end of the body.
        let (out, ok) = scan.feed(b"NE]\n");
        assert_eq!((out.len(), ok), (0, Ok(())));
        let (out, ok) = scan.end();
        assert_eq!((&out[..], ok), (&b"data: [DONE]\n"[..], Ok(())));
        assert!(scan.seen.done);
    }

    #[test]
    fn the_text_sent_is_kept_for_a_continuation_until_it_cannot_be_continued() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        let mut scan = SseScan::keeping(Some(10));
        let _ = scan.feed(chunk(r#"{"role":"assistant","content":""}"#).as_bytes());
        let _ = scan.feed(chunk(r#"{"content":"Hello, "}"#).as_bytes());
        let _ = scan.feed(chunk(r#"{"content":"wor"}"#).as_bytes());
        let kept = scan.seen.kept.as_ref().unwrap();
        assert_eq!((kept.text.as_str(), kept.unfit), ("Hello, wor", None));
        // One byte more than the cap: no longer continued, the text let go.
        let _ = scan.feed(chunk(r#"{"content":"ld"}"#).as_bytes());
        let kept = scan.seen.kept.as_ref().unwrap();
        assert_eq!(kept.text, "");
        assert!(kept.unfit.unwrap().contains("max_kept_bytes"));
        // A restart keeps text afresh; a tool call makes the answer unfit.
        scan.next_stream(super::ResumeMode::Restart);
        let _ = scan.feed(chunk(r#"{"content":"Hi"}"#).as_bytes());
        assert_eq!(scan.seen.kept.as_ref().unwrap().text, "Hi");
        let _ =
            scan.feed(chunk(r#"{"tool_calls":[{"index":0,"function":{"name":"f"}}]}"#).as_bytes());
        assert_eq!(
            scan.seen.kept.as_ref().unwrap().unfit,
            Some("the answer calls tools")
        );
        // Without stream_resume nothing is kept.
        let mut scan = SseScan::default();
        let _ = scan.feed(chunk(r#"{"content":"Hello"}"#).as_bytes());
        assert!(scan.seen.kept.is_none());
    }

    #[test]
    fn a_restart_follows_content_only_for_a_client_that_reads_restart_events() {
        use super::{
            continuation_mode,
            ResumeMode::{Off, Prefix, Restart},
        };
        // (configured, prefill, content sent, restart events) -> mode
        let table = [
            ((Off, true, false, true), None),
            ((Prefix, true, true, false), Some(Prefix)),
            ((Prefix, false, true, false), None),
            ((Prefix, false, true, true), Some(Restart)),
            ((Prefix, false, false, false), Some(Restart)),
            ((Prefix, true, false, false), Some(Restart)),
            ((Restart, true, true, true), Some(Restart)),
            ((Restart, true, true, false), Some(Prefix)),
            ((Restart, false, true, false), None),
            ((Restart, false, false, false), Some(Restart)),
        ];
        for ((mode, prefill, sent, events), want) in table {
            assert_eq!(
                continuation_mode(mode, prefill, sent, events),
                want,
                "{mode:?} prefill {prefill} sent {sent} events {events}"
            );
        }
    }

    #[test]
    fn a_role_or_empty_delta_is_not_content_and_anything_a_client_shows_is() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        for (delta, content) in [
            (r#"{"role":"assistant","content":""}"#, false),
            (
                r#"{"role":"assistant","content":null,"refusal":null}"#,
                false,
            ),
            ("{}", false),
            (r#"{"content":"H"}"#, true),
            (r#"{"reasoning_content":"thinking"}"#, true),
            (r#"{"tool_calls":[{"index":0}]}"#, true),
        ] {
            let mut scan = SseScan::default();
            let (_, ok) = scan.feed(chunk(delta).as_bytes());
            assert_eq!((ok, scan.seen.content), (Ok(()), content), "{delta}");
        }
        let mut scan = SseScan::default();
        let _ = scan.feed(
            b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        );
        assert!(
            scan.seen.content,
            "an empty answer's end is what the client shows"
        );
    }

    #[test]
    fn a_prefix_continuation_drops_the_whitespace_the_client_already_has_once() {
        let chunk =
            |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        let mut scan = SseScan::keeping(Some(100));
        let _ = scan.feed(chunk(r#"{"content":"mock "}"#).as_bytes());
        scan.next_stream(super::ResumeMode::Prefix);
        assert_eq!(scan.seam, " ");
        // A role chunk without text passes as it came; the seam waits for text.
        let role = chunk(r#"{"role":"assistant","content":""}"#);
        let (out, _) = scan.feed(role.as_bytes());
        assert_eq!((&out[..], scan.seam.as_str()), (role.as_bytes(), " "));
        let (out, ok) = scan.feed(chunk(r#"{"content":" streamed "}"#).as_bytes());
        assert_eq!(ok, Ok(()));
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(
            text.contains(r#""content":"streamed ""#) && text.ends_with("\n\n"),
            "{text}"
        );
        assert_eq!(scan.seen.kept.as_ref().unwrap().text, "mock streamed ");
        // Spent: later text is relayed as it came.
        let later = chunk(r#"{"content":" answer"}"#);
        assert_eq!(&scan.feed(later.as_bytes()).0[..], later.as_bytes());
    }

    #[test]
    fn a_prefix_is_the_text_sent_without_trailing_whitespace_as_the_last_assistant_turn() {
        let body = crate::upstream::ClientBody::from_json(
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        );
        let prefixed = super::with_assistant_prefix(&body, "Hello, wor \n").unwrap();
        assert_eq!(
            prefixed.json()["messages"][1],
            serde_json::json!({"role": "assistant", "content": "Hello, wor"})
        );
        assert!(super::with_assistant_prefix(&body, " \n").is_none());
    }

    #[test]
    fn data_that_is_not_json_or_an_error_event_breaks_the_stream() {
        let mut scan = SseScan::default();
        let (out, ok) = scan.feed(b": keep-alive\n\ndata: {\"choices\": [\n\ndata: {}\n\n");
        assert_eq!(
            &out[..],
            b": keep-alive\n\n",
            "the bad event is not relayed"
        );
        assert!(ok.is_err());
        let mut scan = SseScan::default();
        let (_, ok) = scan.feed(b"data: {\"error\": {\"message\": \"overloaded\"}}\n\n");
        assert_eq!(ok, Err("the provider sent an error mid-stream".into()));
        let mut scan = SseScan::default();
        let (_, ok) = scan.feed(&vec![b'x'; super::MAX_EVENT_BYTES + 1]);
        assert!(
            ok.is_err(),
            "an event without an end is not held without bound"
        );
    }
}
