//! Executing one request in real time: eligibility, ranking, then attempts in order driven
//! by the core's [`Execution`] state machine (the same loop the laboratory drives in virtual
//! time), feeding every attempt to the policy and the breaker.

use super::error::ApiError;
use super::state::{AppState, Features, InterfaceRuntime, PendingContext};
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
use rand::SeedableRng;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request that got an answer.
#[derive(Debug)]
pub struct Answered {
    pub request_id: String,
    pub provider: String,
    pub model: String,
    pub attempts: usize,
    pub body: crate::upstream::answer::ProviderJson,
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
    loop {
        let now = state.now();
        let Some(next) = run.next_attempt(now) else {
            break;
        };
        if !admit(state, iface, next.candidate, now)? {
            run.skip();
            continue;
        }
        if next.number > 0 {
            state.metrics.fallback(&iface.name);
        }
        let seed = state.seed_for(n) ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb);
        let (outcome, reply) = attempt(
            state,
            iface,
            &mut run,
            next,
            now,
            body,
            &features,
            decided.slice,
            tokens,
            seed,
            &mut router,
        )
        .await?;
        tried.push(next.candidate);
        if reply.context_overflow {
            reroute_larger(iface, &decided.order, &tried, next.candidate, &mut run);
        }
        if outcome.status == AttemptStatus::Ok {
            answer = Some(reply);
        } else {
            last = Some(reply);
        }
    }
    let ending = Instant::now();
    let end = state.now();
    let result = run.finish(end);
    let attempts = result.attempts.len();
    record_request(state, iface, &request_id, &decided, &result);
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
                },
            );
            state
                .metrics
                .router_time((router + ending.elapsed()).as_secs_f64() * 1e6);
            let c = &iface.candidates[candidate];
            Ok(Answered {
                request_id,
                provider: c.id.0.clone(),
                model: c.model.clone(),
                attempts,
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
    let started = Instant::now();
    let features = iface
        .featurizer
        .featurize(&super::query_text(iface.kind, body));
    let t0 = state.now();
    let (requirements, tokens) = super::request_profile(iface.kind, body);
    let decided = decide(
        state,
        iface,
        &features,
        n,
        pinned,
        deadline,
        t0,
        &requirements,
        tokens,
        meta,
    )
    .map_err(|e| e.for_request(&request_id, 0))?;
    let run = Execution::new(decided.order.clone(), t0, deadline, iface.limits);
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
    order: Vec<usize>,
    /// The statistics slice of the request.
    slice: SlicePath,
    ranking: equiroute_core::policies::Ranking,
    excluded: Vec<equiroute_core::eligibility::Exclusion>,
}

/// Eligibility then ranking: the router's share of the request, timed for `/metrics`.
#[allow(clippy::too_many_arguments)]
fn decide(
    state: &AppState,
    iface: &InterfaceRuntime,
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
    let eligible = {
        let breakers = iface.breakers.lock().map_err(|_| poisoned())?;
        let mut input = EligibilityInput::new(&iface.candidates, requirements);
        input.breakers = Some((&breakers, &iface.breaker_config));
        input.pinned = pinned;
        input.tenant = meta.tenant.as_deref();
        input.tokens = tokens;
        input.now = now;
        check_eligibility(&input)
    };
    if eligible.eligible.is_empty() {
        state.metrics.request(&iface.name, "no_eligible_provider");
        let reasons: Vec<String> = eligible
            .excluded
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
        return Err(ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_eligible_provider",
            format!(
                "no provider of `{}` can take this request ({})",
                iface.name,
                reasons.join("; ")
            ),
        ));
    }
    let ranking = {
        let policy = iface.policy.read().map_err(|_| poisoned())?;
        let mut ctx = RankContext::new(&iface.candidates, &eligible.eligible, features);
        ctx.deadline = deadline;
        ctx.tokens = tokens;
        ctx.slice = slice;
        ctx.now = now;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(state.seed_for(n));
        policy.rank(&ctx, &mut rng)
    };
    state
        .metrics
        .decision_time(started.elapsed().as_secs_f64() * 1e6);
    let order: Vec<usize> = ranking.indices().collect();
    if let Some(&first) = order.first() {
        iface.first_choices[first].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Decided {
        order,
        slice,
        ranking,
        excluded: eligible.excluded,
    })
}

/// Writes the audit record of a finished request, when an audit log is configured.
#[allow(clippy::too_many_arguments)]
fn audit(
    state: &AppState,
    iface: &InterfaceRuntime,
    request_id: &str,
    decided: &Decided,
    attempts: &[equiroute_core::executor::AttemptRecord],
    outcome: &str,
    fallback_reason: Option<String>,
    latency: Millis,
) {
    let Some(log) = &state.audit else { return };
    let id = |i: usize| iface.candidates[i].id.0.clone();
    log.record(super::audit::AuditRecord {
        ts_ms: state.now().0,
        request_id: request_id.to_owned(),
        interface: iface.name.clone(),
        policy: iface.policy_name,
        candidates: iface.candidates.iter().map(|c| c.id.0.clone()).collect(),
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
        propensity: decided.ranking.first_choice_probability,
        attempts: attempts
            .iter()
            .map(|a| super::audit::AuditAttempt {
                provider: id(a.candidate),
                status: a.outcome.status.as_str(),
                latency_ms: a.outcome.latency.0,
                cost_usd: a.outcome.cost.0,
            })
            .collect(),
        outcome: outcome.to_owned(),
        fallback_reason,
        latency_ms: latency.0,
        cost_usd: attempts.iter().map(|a| a.outcome.cost.0).sum(),
    });
}

/// The latency metric and the audit record of a finished request.
fn record_request(
    state: &AppState,
    iface: &InterfaceRuntime,
    request_id: &str,
    decided: &Decided,
    result: &equiroute_core::executor::RequestResult,
) {
    state.metrics.request_latency(&iface.name, result.latency.0);
    audit(
        state,
        iface,
        request_id,
        decided,
        &result.attempts,
        outcome_label(result.status),
        fallback_reason(&result.attempts),
        result.latency,
    );
}

/// The first attempt's status, when the request fell back.
fn fallback_reason(attempts: &[equiroute_core::executor::AttemptRecord]) -> Option<String> {
    match attempts {
        [first, _, ..] => Some(first.outcome.status.as_str().to_owned()),
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

/// After a provider refused the request as too long for its context window, continues with
/// the untried candidates of the ranking whose window is larger, if there are any.
fn reroute_larger(
    iface: &InterfaceRuntime,
    order: &[usize],
    tried: &[usize],
    failed: usize,
    run: &mut Execution,
) {
    let window = |i: usize| iface.candidates[i].capabilities.context_tokens;
    let larger: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| !tried.contains(&i) && window(i) > window(failed))
        .collect();
    if !larger.is_empty() {
        run.continue_with(larger);
    }
}

/// Asks the candidate's breaker whether an attempt may go now (half-open probes are bounded).
fn admit(
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
    features: &[f64],
    slice: SlicePath,
    tokens: TokenEstimate,
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
    let reply = iface.upstreams[next.candidate].call(req, timeout).await;
    let booked = Instant::now();
    let outcome = outcome_of(&reply, candidate, tokens);
    state.record_attempt(
        iface,
        next.candidate,
        features,
        slice,
        &outcome,
        run.remaining(now),
    )?;
    *router += booked.elapsed();
    run.record(next.candidate, outcome, now);
    Ok((outcome, reply))
}

/// The attempt outcome of a provider's reply.
fn outcome_of(
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
fn failure(
    state: &AppState,
    iface: &InterfaceRuntime,
    request_id: &str,
    status: RequestStatus,
    attempts: &[equiroute_core::executor::AttemptRecord],
    last: Option<UpstreamReply>,
    deadline: Option<Millis>,
) -> ApiError {
    let reason = last.and_then(|r| r.reason);
    // "2 attempts: a provider_error, b timeout": which providers were tried, and how each ended.
    let tried: Vec<String> = attempts
        .iter()
        .map(|a| {
            format!(
                "{} {}",
                iface.candidates[a.candidate].id,
                a.outcome.status.as_str()
            )
        })
        .collect();
    let summary = match tried.len() {
        0 => "no attempt".to_owned(),
        1 => format!("1 attempt: {}", tried[0]),
        n => format!("{n} attempts: {}", tried.join(", ")),
    };
    let error = match status {
        RequestStatus::ClientError { candidate } => {
            state.metrics.request(&iface.name, "client_error");
            ApiError::bad_request(
                "upstream_rejected_request",
                None,
                format!(
                    "provider `{}` rejected the request: {}",
                    iface.candidates[candidate].id,
                    reason.unwrap_or_else(|| "rejected".into())
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
                    reason.unwrap_or_else(|| "no attempt could be made".into())
                ),
            )
        }
    };
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
    let Begun {
        n,
        request_id,
        started,
        features,
        tokens,
        decided,
        mut run,
    } = begin(&state, &iface, &body, pinned, deadline, &meta)?;
    let mut tried: Vec<usize> = Vec::new();
    let mut last = None;
    loop {
        let now = state.now();
        let Some(next) = run.next_attempt(now) else {
            break;
        };
        if !admit(&state, &iface, next.candidate, now)? {
            run.skip();
            continue;
        }
        if next.number > 0 {
            state.metrics.fallback(&iface.name);
        }
        let candidate = &iface.candidates[next.candidate];
        let req = UpstreamRequest {
            kind: iface.kind,
            body: &body,
            model: &candidate.model,
            seed: state.seed_for(n) ^ u64::from(next.number).wrapping_mul(0x94d0_49bb_1331_11eb),
        };
        let limit = next.timeout.map(|t| Duration::from_secs_f64(t.0 / 1000.0));
        match iface.upstreams[next.candidate]
            .open_stream(req, limit)
            .await
        {
            StreamStart::Failed(reply) => {
                let outcome = outcome_of(&reply, candidate, tokens);
                state.record_attempt(
                    &iface,
                    next.candidate,
                    &features,
                    decided.slice,
                    &outcome,
                    run.remaining(now),
                )?;
                run.record(next.candidate, outcome, now);
                tried.push(next.candidate);
                if reply.context_overflow {
                    reroute_larger(&iface, &decided.order, &tried, next.candidate, &mut run);
                }
                last = Some(reply);
            }
            StreamStart::Started { first, rest, ttfb } => {
                let attempts = run.attempts() + 1;
                let relay = Relay {
                    tokens,
                    slice: decided.slice,
                    state: state.clone(),
                    iface: iface.clone(),
                    candidate: next.candidate,
                    features,
                    request_id: request_id.clone(),
                    started,
                    ttfb,
                };
                return Ok(relay.start(first, rest, attempts));
            }
        }
    }
    let result = run.finish(state.now());
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

/// A committed stream being relayed to the client.
struct Relay {
    tokens: TokenEstimate,
    slice: SlicePath,
    state: Arc<AppState>,
    iface: Arc<InterfaceRuntime>,
    candidate: usize,
    features: Vec<f64>,
    request_id: String,
    started: Instant,
    ttfb: Millis,
}

impl Relay {
    /// Starts relaying in a task; returns the SSE response with the routing headers.
    fn start(self, first: Bytes, rest: ChunkStream, attempts: usize) -> axum::response::Response {
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
            attempts,
        );
        // The task ends with the upstream stream, the idle limit, or a departed client.
        tokio::spawn(self.pump(first, rest, tx));
        resp
    }

    async fn pump(
        self,
        first: Bytes,
        mut rest: ChunkStream,
        tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) {
        use futures_util::StreamExt;
        let idle = Duration::from_secs_f64(self.iface.stream_idle.0 / 1000.0);
        let mut done = DoneScan::default();
        done.feed(&first);
        let mut broken: Option<String> = None;
        let mut client_gone = tx.send(Ok(first)).await.is_err();
        while !client_gone {
            match tokio::time::timeout(idle, rest.next()).await {
                Err(_) => {
                    broken = Some(format!(
                        "the provider's stream stalled for more than {:.0} ms",
                        idle.as_secs_f64() * 1000.0
                    ));
                    break;
                }
                Ok(None) => {
                    if !done.seen {
                        broken = Some("the provider's stream ended before [DONE]".into());
                    }
                    break;
                }
                Ok(Some(Err(reason))) => {
                    broken = Some(reason);
                    break;
                }
                Ok(Some(Ok(bytes))) => {
                    done.feed(&bytes);
                    client_gone = tx.send(Ok(bytes)).await.is_err();
                }
            }
        }
        if let Some(reason) = &broken {
            let event = serde_json::json!({"error": {"message": reason, "type": "api_error", "param": null, "code": "stream_broken"}});
            let _ = tx.send(Ok(Bytes::from(format!("data: {event}\n\n")))).await;
        }
        drop(tx);
        let status = match (&broken, client_gone) {
            (Some(_), _) => AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
            (None, true) => AttemptStatus::Cancelled,
            (None, false) => AttemptStatus::Ok,
        };
        let c = &self.iface.candidates[self.candidate];
        let latency = Millis(self.started.elapsed().as_secs_f64() * 1000.0);
        let outcome = AttemptOutcome {
            latency,
            status,
            cost: c.price.cost(self.tokens),
            time_to_first_byte: Some(self.ttfb),
            retry_after: None,
        };
        self.state
            .metrics
            .request_latency(&self.iface.name, latency.0);
        let _ = self.state.record_attempt(
            &self.iface,
            self.candidate,
            &self.features,
            self.slice,
            &outcome,
            None,
        );
        let label = match status {
            AttemptStatus::Ok => "ok",
            AttemptStatus::Cancelled => "cancelled",
            _ => "stream_broken",
        };
        self.state.metrics.request(&self.iface.name, label);
        if status == AttemptStatus::Ok {
            let at = self.state.now();
            self.state.remember(
                &self.request_id,
                PendingContext {
                    interface: &self.iface.name,
                    candidate: self.candidate,
                    features: Features::F64(&self.features),
                    latency,
                    at,
                },
            );
        }
    }
}

/// Finds `[DONE]` in a byte stream even when a chunk boundary splits it.
#[derive(Default)]
struct DoneScan {
    tail: Vec<u8>,
    seen: bool,
}

impl DoneScan {
    fn feed(&mut self, bytes: &[u8]) {
        const MARK: &[u8] = b"[DONE]";
        self.tail.extend_from_slice(bytes);
        if self.tail.windows(MARK.len()).any(|w| w == MARK) {
            self.seen = true;
        }
        let keep = self.tail.len().saturating_sub(MARK.len() - 1);
        self.tail.drain(..keep);
    }
}
