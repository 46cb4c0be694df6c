//! The HTTP server.
//!
//! Middleware order, outermost first (written once, here):
//! 0. the connection ([`conn`], around the router): at most `server.max_connections` over
//!    every event loop and `server.max_connections_per_address` per client address (beyond, a
//!    raw 503 or 429, or the biggest holder's oldest connection shed); headers due within
//!    `header_read_timeout_ms` and at most `max_header_bytes` (else 431), the body within
//!    `body_read_timeout_ms` (else 408) and within the buffered-bytes limits (else 429 or 503),
//!    an idle keep-alive connection closed after `idle_timeout_ms`;
//!    a `Content-Length` over `server.max_body_bytes` gets 413 at once, before any of the
//!    body is read; the drain's cutoff ([`drain`]): after `server.shutdown_grace_ms`,
//!    requests still in flight are ended;
//! 1. on the routes that read a body, a body that grows past `server.max_body_bytes`
//!    (chunked) gets 413 too;
//! 2. authentication on `/v1/*` when keys are configured (`gate.rs`): a missing or wrong
//!    bearer key gets an OpenAI-style 401 (keys compared in constant time; `/v1/messages` also takes
//!    `x-api-key`, and answers its errors, this 401 included, in Anthropic's shape); the key
//!    that matched becomes the request's [`auth::Caller`] (an extension), which decides its tenant, its task classes
//!    and whose requests it may score; on the traffic routes it holds one of its key's
//!    `server.max_in_flight_per_key` seats until its answer's last byte (else 429). The traffic routes take client and judge keys,
//!    `/v1/feedback` those and the admin keys; the state routes (`/v1/interfaces…`) and
//!    `POST /v1/admin/reload` take the admin keys when those are configured, else the gateway keys: they are open only when no
//!    key at all is configured (local use); the dashboard (`/dashboard…`) takes the same keys,
//!    also as HTTP Basic (see [`dashboard`]);
//! 3. the routes below.
//!
//! A routed request's path, one module per stage (each says its job in its first line):
//!
//! ```text
//! admit ──▶ decide ──▶ attempt ─┬─▶ (next attempt: fallback, retry) ──▶ … ──▶ answer / error
//!   │         │          │      └─ race: a hedge beside the first attempt
//!   │         │          └─ stream: the hold before a streamed answer commits
//!   │         │                          └─▶ relay: the committed stream, its continuation
//!   └ keys, body, headers   └ eligibility, ranking, hedge plan
//!                     every attempt's and the request's end ──▶ book (the outcome ledger)
//! ```
//!
//! - [`admit`]: the key's gate, the body's checks, the request's terms ([`RequestMeta`]);
//! - [`decide`]: eligibility, ranking (live, canary, shadow: [`arms`]), re-tests, the hedge
//!   plan, the core's `Execution` started;
//! - [`attempt`]: one upstream call (unstreamed, or a stream opened to its first byte);
//! - [`race`]: a hedge raced beside the first attempt;
//! - [`stream`] and [`relay`]: a stream's events read and held, then relayed and continued;
//! - [`book`]: the outcome ledger, where an attempt's, a request's and a score's end are
//!   learnt from, journaled, metered, traced, audited and kept for feedback, in one order;
//! - [`execute`] drives them, in the order the core's executor gives.
//!
//! Around them: [`state`] (what the handlers share), [`history`] (the dashboard's recent
//! traffic), [`introspect`] (state, models, metrics routes), [`feedback`], [`rollouts`],
//! [`sync`] (the Redis syncer's view of the state), [`reload`] (the configuration read again
//! and swapped in; [`learnt`]: what an interface's runtime has learnt, as a value).

mod admit;
pub mod arms;
mod attempt;
pub mod audit;
pub mod auth;
pub mod book;
pub mod capacity;
mod clients;
pub mod conn;
pub mod dashboard;
mod decide;
pub mod drain;
pub mod error;
mod execute;
pub mod feedback;
mod gate;
pub mod history;
mod introspect;
pub mod learnt;
mod lookout;
pub mod metrics;
pub mod minutes;
pub mod ops;
mod race;
mod rejections;
mod relay;
pub mod reload;
pub mod repeated;
mod rollouts;
pub mod shifts;
mod spans;
pub mod state;
mod stream;
mod sync;
pub mod ttfb;
mod unservable;

use crate::config::InterfaceKind;
use crate::upstream::ClientBody;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use equiroute_core::QualityFeedback;
use error::{echo, ApiError};
use gate::KeyGate;
use repeated::Repeated;
use serde_json::{json, Value};
use state::{AppState, InterfaceRuntime};
use std::sync::Arc;

pub use admit::{
    request_profile, RequestMeta, MAX_DEADLINE_MS, MAX_TASK_CLASS_BYTES, RESTART_HEADER,
};
pub use introspect::STATE_PAGE_MAX;

use admit::{
    check_chat_body, deadline_from, json_kind, parse_json, read_body, with_deadline, BodyBytes,
    TakenHeaders,
};
use introspect::{get_model, interface_state, list_interfaces, list_models, metrics, readyz};

/// The router of a gateway with `state`.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    // The body limit joins each group's key gate in one layer: every layer of a route is one
    // more boxed service and future per request. The other routes read no body.
    let limit = DefaultBodyLimit::max(max_body_bytes);
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(clients::responses::create))
        .route("/v1/tools/{interface}", post(tool_call))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(get_model))
        .route_layer((limit, KeyGate::new(&state, auth::Route::Traffic)));
    let scores = Router::new()
        .route("/v1/feedback", post(feedback))
        .route_layer((limit, KeyGate::new(&state, auth::Route::Feedback)));
    let admin = Router::new()
        .route("/v1/interfaces", get(list_interfaces))
        .route("/v1/interfaces/{name}/state", get(interface_state))
        .route("/v1/interfaces/{name}/shadow", get(rollouts::shadow))
        .route("/v1/interfaces/{name}/rollout", get(rollouts::rollout))
        .route(
            "/v1/interfaces/{name}/rollout/promote",
            post(rollouts::promote),
        )
        .route("/v1/interfaces/{name}/rollout/abort", post(rollouts::abort))
        .route("/v1/admin/reload", post(reload::route))
        .route_layer((limit, KeyGate::new(&state, auth::Route::Admin)));
    // Anthropic's clients read errors in Anthropic's shape, the 401 included: the shape is
    // rewritten outside the key check.
    let messages = Router::new()
        .route("/v1/messages", post(clients::messages::create))
        .route_layer((limit, KeyGate::messages(&state)))
        .route_layer(middleware::map_response(clients::messages::error_shape));
    Router::new()
        .merge(v1)
        .merge(scores)
        .merge(messages)
        .merge(admin)
        .merge(dashboard::routes(state.clone()))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
}

pub use crate::request::query_text;

/// Sends a sample of answers to the interface's judge, beside the request path.
fn maybe_judge(
    state: &Arc<AppState>,
    iface: &InterfaceRuntime,
    question: &Value,
    answered: &execute::Answered,
) {
    let Some(judge) = &iface.judge else { return };
    let u = (state.seed_for(answered.number) >> 11) as f64 / (1u64 << 53) as f64;
    if !judge.samples(u) {
        return;
    }
    let answer = match iface.kind {
        InterfaceKind::Chat => answered
            .body
            .value()
            .and_then(|v| {
                v.pointer("/choices/0/message/content")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .unwrap_or_default(),
        InterfaceKind::Tool => String::from_utf8_lossy(answered.body.bytes()).into_owned(),
    };
    let Some(permit) = judge.try_slot() else {
        state.metrics.feedback("judge_skipped");
        tracing::debug!(request_id = %answered.request_id, "judge skipped: every judge slot is busy");
        return;
    };
    let (judge, state) = (judge.clone(), state.clone());
    let request_id = answered.request_id.clone();
    let question = query_text(iface.kind, question).into_owned();
    tokio::spawn(async move {
        let _permit = permit;
        let label = if let Some(q) = judge.score(&question, &answer).await {
            match feedback::apply_from(
                &state,
                &request_id,
                q,
                equiroute_core::FeedbackSource::Judge,
                &auth::Caller::Internal,
            )
            .await
            {
                Ok(_) => "judge_accepted",
                Err(e) => {
                    if state.logs.allow(Repeated::JudgeFailed) {
                        tracing::warn!(%request_id, error = %e.message, "judge's score rejected");
                    }
                    "judge_unmatched"
                }
            }
        } else {
            if state.logs.allow(Repeated::JudgeFailed) {
                tracing::warn!(%request_id, "judge failed to score the answer");
            }
            "judge_failed"
        };
        state.metrics.feedback(label);
    });
}

/// The provider's answer with the routing headers; `model` names the model that answered.
fn routed(answered: &execute::Answered) -> Response {
    // The provider's bytes, relayed with only `model` replaced (no parse into a tree and no
    // re-encoding).
    let body = answered.body.with_model(&answered.model);
    let mut resp = (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response();
    routing_headers(
        resp.headers_mut(),
        &answered.request_id,
        Some(&answered.provider),
        answered.attempts,
    );
    dropped_header(resp.headers_mut(), answered.dropped);
    resp
}

/// The header naming the request members the answering provider's API dropped
/// (`unsupported_params = "drop"`), comma-separated: fixed names, never the client's values.
pub const DROPPED_PARAMS_HEADER: &str = "x-equiroute-dropped-params";

/// Sets [`DROPPED_PARAMS_HEADER`] when the answering provider dropped anything.
fn dropped_header(h: &mut HeaderMap, dropped: crate::upstream::dialect::Dropped) {
    if let Some(v) = dropped
        .header()
        .and_then(|v| HeaderValue::from_str(&v).ok())
    {
        h.insert(DROPPED_PARAMS_HEADER, v);
    }
}

/// The routing headers of a routed request's answer, success or error alike:
/// `x-equiroute-request-id`, `x-equiroute-provider` (when one answered) and
/// `x-equiroute-attempts`.
fn routing_headers(h: &mut HeaderMap, request_id: &str, provider: Option<&str>, attempts: usize) {
    // Names made once: a name given as text is parsed again at every insert.
    const REQUEST_ID: HeaderName = HeaderName::from_static("x-equiroute-request-id");
    const PROVIDER: HeaderName = HeaderName::from_static("x-equiroute-provider");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-equiroute-attempts");
    // The usual counts without an allocation each (`max_attempts` is 3 by default).
    const COUNTS: [&str; 11] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"];
    for (name, value) in [(REQUEST_ID, Some(request_id)), (PROVIDER, provider)] {
        if let Some(v) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            h.insert(name, v);
        }
    }
    let count = COUNTS.get(attempts).map_or_else(
        || HeaderValue::from(attempts),
        |c| HeaderValue::from_static(c),
    );
    h.insert(ATTEMPTS, count);
}

/// `POST /v1/chat/completions`: `model` names an interface, or `interface/provider` to pin one.
async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<auth::Caller>,
    TakenHeaders(headers): TakenHeaders,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    let meta = RequestMeta::of(&headers, &caller)?;
    route_chat(&state, meta, parse_json(body)?).await
}

/// Routes a chat completions request: the one entry point of every client API (the Responses
/// and Messages APIs translate into it, see [`clients`]).
async fn route_chat(
    state: &Arc<AppState>,
    meta: RequestMeta,
    body: ClientBody,
) -> Result<Response, ApiError> {
    let model = check_chat_body(&body)?;
    let (name, pinned) = model
        .split_once('/')
        .map_or((model, None), |(i, p)| (i, Some(p)));
    // The request's one read of the interfaces: it finishes on the runtime it found here,
    // whatever a reload swaps in meanwhile.
    let iface = state
        .interface(name)
        .filter(|i| i.kind == InterfaceKind::Chat)
        .ok_or_else(|| {
            let interfaces = state.interfaces();
            let chats: Vec<&str> = interfaces
                .values()
                .filter(|i| i.kind == InterfaceKind::Chat)
                .map(|i| i.name.as_str())
                .collect();
            ApiError::not_found(
                "model_not_found",
                format!(
                    "`{}` is not a chat interface: use one of {}",
                    echo(name),
                    chats.join(", ")
                ),
            )
        })?;
    let pinned = match pinned {
        None => None,
        Some(p) => Some(iface.index_of(p).ok_or_else(|| {
            let ids: Vec<&str> = iface.candidates.iter().map(|c| c.id.0.as_str()).collect();
            ApiError::not_found(
                "model_not_found",
                format!(
                    "`{name}` has no provider `{}`: use one of {}",
                    echo(p),
                    ids.join(", ")
                ),
            )
        })?),
    };
    let (deadline, clamped) = deadline_from(&meta, &iface)?;
    let meta = meta.for_interface(state, &iface);
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        let streamed =
            execute::execute_stream(state.clone(), iface, body, pinned, deadline, meta).await;
        return Ok(with_deadline(streamed, deadline, clamped));
    }
    let answered = execute::execute(state, &iface, &body, pinned, deadline, &meta)
        .await
        .inspect(|a| maybe_judge(state, &iface, &body, a));
    Ok(with_deadline(
        answered.map(|a| routed(&a)),
        deadline,
        clamped,
    ))
}

/// `POST /v1/tools/{interface}`: a JSON tool call routed to one of the interface's providers.
async fn tool_call(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<auth::Caller>,
    Path(name): Path<String>,
    TakenHeaders(headers): TakenHeaders,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    let meta = RequestMeta::of(&headers, &caller)?;
    let body = parse_json(body)?;
    let iface = state
        .interface(&name)
        .filter(|i| i.kind == InterfaceKind::Tool)
        .ok_or_else(|| {
            let interfaces = state.interfaces();
            let tools: Vec<&str> = interfaces
                .values()
                .filter(|i| i.kind == InterfaceKind::Tool)
                .map(|i| i.name.as_str())
                .collect();
            ApiError::not_found(
                "interface_not_found",
                format!(
                    "`{}` is not a tool interface: use one of {}",
                    echo(&name),
                    tools.join(", ")
                ),
            )
        })?;
    let (deadline, clamped) = deadline_from(&meta, &iface)?;
    let meta = meta.for_interface(&state, &iface);
    let answered = execute::execute(&state, &iface, &body, None, deadline, &meta)
        .await
        .inspect(|a| maybe_judge(&state, &iface, &body, a));
    Ok(with_deadline(
        answered.map(|a| routed(&a)),
        deadline,
        clamped,
    ))
}

/// `POST /v1/feedback`: `{request_id, quality in [0,1], source}`, from the key that made the
/// request (or a judge or admin key), within its key's feedback rate.
async fn feedback(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<auth::Caller>,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        request_id: String,
        quality: f64,
        #[serde(default)]
        source: Option<equiroute_core::FeedbackSource>,
    }
    state
        .keys
        .take_feedback(&caller, std::time::Instant::now())?;
    let body = read_body(body)?;
    let b: Body = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(
        &body,
    ))
    .map_err(|e| {
        let field = echo(&e.path().to_string()).into_owned();
        let expected = "expected {\"request_id\": str, \"quality\": number in [0,1], \"source\": \"judge|user|api|gold\"}";
        // serde's message quotes the offending key or value.
        let e = e.into_inner().to_string();
        let e = echo(&e);
        if field == "." {
            ApiError::bad_request("invalid_feedback", None, format!("{expected}: {e}"))
        } else {
            ApiError::bad_field(
                "invalid_feedback",
                field.clone(),
                format!("`{field}`: {e}; {expected}"),
            )
        }
    })?;
    if !(0.0..=1.0).contains(&b.quality) {
        return Err(ApiError::bad_request(
            "invalid_quality",
            Some("quality"),
            "`quality` must be between 0 and 1",
        ));
    }
    let source = b.source.unwrap_or(equiroute_core::FeedbackSource::Api);
    let applying = feedback::apply_from(&state, &b.request_id, b.quality, source, &caller);
    let span = tracing::debug_span!("feedback", equiroute.source = ?source);
    match tracing::Instrument::instrument(applying, span).await {
        Ok(feedback::Applied::Duplicate) => {
            state.metrics.feedback("duplicate");
            return Ok((
                StatusCode::OK,
                Json(json!({"status": "duplicate", "request_id": b.request_id})),
            )
                .into_response());
        }
        Ok(feedback::Applied::Accepted) => {}
        Err(e) => {
            let why = if e.status == StatusCode::GONE {
                "expired"
            } else {
                "unknown"
            };
            state.metrics.feedback(why);
            // The id is the client's: cut like any echoed input.
            if state.logs.allow(Repeated::FeedbackRejected) {
                tracing::warn!(request_id = %echo(&b.request_id), reason = why, "feedback rejected");
            }
            return Err(e);
        }
    }
    state.metrics.feedback("accepted");
    tracing::debug!(request_id = %b.request_id, quality = b.quality, "feedback accepted");
    let fb = QualityFeedback {
        decision_id: 0,
        quality: b.quality,
        source,
    };
    Ok((StatusCode::OK, Json(json!({"status": "accepted", "request_id": b.request_id, "quality": fb.quality, "source": fb.source}))).into_response())
}

/// The routes, for the answer to a request that matches none.
const ROUTES: &str = "POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, POST /v1/tools/{interface}, POST /v1/feedback, \
GET /v1/models, GET /v1/interfaces, GET /v1/interfaces/{name}/state, GET /v1/interfaces/{name}/shadow, GET /v1/interfaces/{name}/rollout, POST /v1/interfaces/{name}/rollout/promote, POST /v1/interfaces/{name}/rollout/abort, POST /v1/admin/reload, GET /dashboard, GET /metrics, GET /healthz, GET /readyz";

/// A path the gateway does not serve: an OpenAI-style 404 (SDKs show its message) instead of
/// an empty body.
async fn unknown_route(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(
        "unknown_route",
        format!(
            "no route {method} {}: the gateway serves {ROUTES}",
            echo(uri.path())
        ),
    )
}

/// A known path with another method.
async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::invalid(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} does not take {method}: the gateway serves {ROUTES}",
            echo(uri.path())
        ),
    )
}
