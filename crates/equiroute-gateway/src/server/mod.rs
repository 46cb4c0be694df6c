//! The HTTP server.
//!
//! Middleware order, outermost first (written once, here):
//! 0. the connection ([`conn`], around the router): at most `server.max_connections` over
//!    every event loop and `server.max_connections_per_address` per client address (beyond, a
//!    raw 503 or 429, or the biggest holder's oldest connection shed); headers due within
//!    `header_read_timeout_ms` and at most `max_header_bytes` (else 431), the body within
//!    `body_read_timeout_ms` (else 408) and within the buffered-bytes limits (else 429 or 503),
//!    an idle keep-alive connection closed after `idle_timeout_ms`;
//!    the drain's cutoff ([`drain`], added around the router by the gateway's `serve`): after
//!    `server.shutdown_grace_ms`, requests still in flight are ended;
//! 1. request body limit: a `Content-Length` over `server.max_body_bytes` gets 413 at once,
//!    before any of the body is read; a body that grows past it (chunked) gets 413 too;
//! 2. authentication on `/v1/*` when keys are configured: a missing or wrong bearer key gets
//!    an OpenAI-style 401 (keys compared in constant time; `/v1/messages` also takes
//!    `x-api-key`, and answers its errors, this 401 included, in Anthropic's shape); the key
//!    that matched becomes the request's [`auth::Caller`] (an extension), which decides its tenant, its task classes
//!    and whose requests it may score; on the traffic routes it holds one of its key's
//!    `server.max_in_flight_per_key` seats until its answer's last byte (else 429). The traffic routes take client and judge keys,
//!    `/v1/feedback` those and the admin keys; the state routes (`/v1/interfaces…`) take the
//!    admin keys when those are configured, else the gateway keys: they are open only when no
//!    key at all is configured (local use); the dashboard (`/dashboard…`) takes the same keys,
//!    also as HTTP Basic (see [`dashboard`]);
//! 3. the routes below.

pub mod arms;
pub mod audit;
pub mod auth;
mod clients;
pub mod conn;
pub mod dashboard;
pub mod drain;
pub mod error;
mod execute;
pub mod feedback;
mod hedge;
pub mod metrics;
mod rejections;
pub mod repeated;
mod rollouts;
pub mod shifts;
mod spans;
pub mod state;
pub mod ttfb;
mod unservable;

use crate::config::InterfaceKind;
use crate::upstream::ClientBody;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use equiroute_core::policies::RankContext;
use equiroute_core::{Millis, QualityFeedback};
use error::{echo, ApiError};
use repeated::Repeated;
use serde_json::{json, Value};
use state::{AppState, InterfaceRuntime};
use std::sync::Arc;

/// The router of a gateway with `state`.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(clients::responses::create))
        .route("/v1/tools/{interface}", post(tool_call))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(get_model))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let scores = Router::new()
        .route("/v1/feedback", post(feedback))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_feedback_key,
        ));
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
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_admin_key,
        ));
    // Anthropic's clients read errors in Anthropic's shape, the 401 included: the shape is
    // rewritten outside the key check.
    let messages = Router::new()
        .route("/v1/messages", post(clients::messages::create))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key))
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
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn_with_state(
            max_body_bytes,
            refuse_declared_oversize,
        ))
        .with_state(state)
}

pub use crate::request::query_text;

/// What a request needs from a provider, and its expected size in tokens: `tools` present
/// → tool support; `response_format` json → JSON mode; `stream` → streaming; image parts →
/// vision; input ≈ characters/4 + 4 per message, output = `max_completion_tokens` or
/// `max_tokens` (256 when unset); the context window must hold both.
#[must_use]
pub fn request_profile(
    kind: InterfaceKind,
    body: &Value,
) -> (equiroute_core::Requirements, equiroute_core::TokenEstimate) {
    let mut req = equiroute_core::Requirements::default();
    let mut tokens = equiroute_core::TokenEstimate::default();
    if kind != InterfaceKind::Chat {
        return (req, tokens);
    }
    req.tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    req.json_mode = body
        .pointer("/response_format/type")
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("json"));
    req.streaming = body.get("stream").and_then(Value::as_bool) == Some(true);
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut chars = 0usize;
    for m in messages {
        match m.get("content") {
            Some(Value::String(s)) => chars += s.chars().count(),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if p.get("type").and_then(Value::as_str) == Some("image_url") {
                        req.vision = true;
                    }
                    chars += p
                        .get("text")
                        .and_then(Value::as_str)
                        .map_or(0, |t| t.chars().count());
                }
            }
            _ => {}
        }
    }
    tokens.input = u32::try_from(chars / 4 + 4 * messages.len()).unwrap_or(u32::MAX);
    tokens.output = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(256, |t| u32::try_from(t).unwrap_or(u32::MAX));
    req.context_tokens = tokens.input.saturating_add(tokens.output);
    (req, tokens)
}

/// Lets through a request whose key opens `route`, with its [`auth::Caller`] as an extension;
/// else the 401 that names the setting holding the route's keys.
async fn gate(state: &AppState, route: auth::Route, mut req: Request, next: Next) -> Response {
    // Anthropic's clients send their key as `x-api-key`: taken on `/v1/messages` only.
    let x_api_key = req.uri().path() == "/v1/messages";
    match state.keys.caller(req.headers(), route, x_api_key) {
        Some(caller) => {
            // A traffic request holds a seat among its key's requests in flight until its
            // answer's last byte (a stream's too).
            let seat = match route {
                auth::Route::Traffic => match state.keys.enter(&caller) {
                    Ok(seat) => seat,
                    Err(refused) => return refused.into_response(),
                },
                auth::Route::Feedback | auth::Route::Admin => None,
            };
            req.extensions_mut().insert(caller);
            let response = next.run(req).await;
            match seat {
                Some(seat) => conn::HeldBody::hold(response, seat),
                None => response,
            }
        }
        None if route == auth::Route::Admin => {
            ApiError::unauthorized_admin(state.keys.has_admin_keys()).into_response()
        }
        None => ApiError::unauthorized().into_response(),
    }
}

/// The state and admin routes: a 401 that names the setting holding their keys.
async fn require_admin_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    gate(&state, auth::Route::Admin, req, next).await
}

async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    gate(&state, auth::Route::Traffic, req, next).await
}

async fn require_feedback_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    gate(&state, auth::Route::Feedback, req, next).await
}

/// A request body as the handlers take it: the bytes, or why axum could not read them.
type BodyBytes = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// The OpenAI-style 413 of a body over `server.max_body_bytes` (axum's own answer is plain
/// text, which SDKs cannot parse).
fn body_too_large() -> ApiError {
    ApiError::invalid(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        "the body is larger than the gateway accepts: send less, or raise server.max_body_bytes",
    )
}

/// The bytes of `body`; a body over `server.max_body_bytes` is a 413 ([`body_too_large`]).
fn read_body(body: BodyBytes) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return body_too_large();
        }
        ApiError::invalid(
            status,
            "unreadable_body",
            format!("the body could not be read: {}", e.body_text()),
        )
    })
}

/// Layer 1's first check: a `Content-Length` over `max_body_bytes` is answered 413 at once,
/// instead of after waiting (up to the body timeout) for a body that would be refused; the
/// connection closes after it, its body unread.
async fn refuse_declared_oversize(
    State(max_body_bytes): State<usize>,
    req: Request,
    next: Next,
) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body_bytes as u64) {
        let mut response = body_too_large().into_response();
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            HeaderValue::from_static("close"),
        );
        return response;
    }
    next.run(req).await
}

fn parse_json(body: BodyBytes) -> Result<ClientBody, ApiError> {
    ClientBody::parse(read_body(body)?).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            None,
            format!("the body is not valid JSON: {e}"),
        )
    })
}

pub use crate::config::MAX_TASK_CLASS_BYTES;

/// Who a request is for and what kind of task it is, from its caller and its headers: the
/// tenant (the key's, else `x-equiroute-tenant`; checked against providers' tenant
/// allow-lists) and `x-equiroute-task-class` (the first level of the statistics slices; see
/// [`auth`]).
#[derive(Debug, Clone, Default)]
pub struct RequestMeta {
    pub tenant: Option<String>,
    pub task_class: Option<String>,
    /// The label of the key that made the request: its answered request can be scored only by
    /// that key (or a judge or admin key). `None`: made without a key.
    pub owner: Option<Arc<str>>,
    /// The session key that keeps a conversation on one arm of a canary rollout
    /// ([`arms::SESSION_HEADER`]).
    pub session: Option<String>,
    /// The client's span, from W3C `traceparent` and `tracestate`, when traces are exported:
    /// the request's span continues the client's trace.
    pub trace_parent: Option<opentelemetry::trace::SpanContext>,
    /// The client reads restart events ([`RESTART_HEADER`]`: events`): a broken stream may
    /// start its answer again after content was sent, announced by the marker event.
    pub restart_events: bool,
}

/// The request header by which a chat client says it reads the `restart` marker event and
/// drops the text it joined before it (`x-equiroute-stream-restart: events`); without it a
/// stream that broke after content is never restarted (see `docs/faults.md`).
pub const RESTART_HEADER: &str = "x-equiroute-stream-restart";

/// Whether the request asks for restart events.
///
/// # Errors
/// The header with another value than `events` (400 naming it and the fix).
fn restart_events_of(headers: &HeaderMap) -> Result<bool, ApiError> {
    let Some(value) = headers.get(RESTART_HEADER) else {
        return Ok(false);
    };
    match value.to_str().map(str::trim) {
        Ok(v) if v.eq_ignore_ascii_case("events") => Ok(true),
        Ok("") => Ok(false),
        _ => Err(ApiError::bad_request(
            "invalid_header",
            Some(RESTART_HEADER),
            format!("`{RESTART_HEADER}` accepts one value, `events` (the client drops the text before a restart marker): send `events`, or leave the header out"),
        )),
    }
}

impl RequestMeta {
    /// The request of `caller` with `headers`.
    ///
    /// # Errors
    /// A tenant header that is not a tenant name (400) or that another tenant's key sent
    /// (403); a task class the key may not name (403).
    fn of(headers: &HeaderMap, caller: &auth::Caller) -> Result<RequestMeta, ApiError> {
        Ok(RequestMeta {
            tenant: auth::tenant_of(headers, caller)?,
            task_class: auth::task_class_of(headers, caller)?,
            owner: caller.owner(),
            session: headers
                .get(arms::SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned),
            trace_parent: crate::telemetry::remote_parent(headers),
            restart_events: restart_events_of(headers)?,
        })
    }

    /// The same request as `iface` sees it: a task class longer than
    /// [`MAX_TASK_CLASS_BYTES`] or missing from the interface's `task_classes` allow-list is
    /// dropped (the request is routed and learnt from in the parent, untagged slice) and
    /// counted, without its name, in `/metrics`.
    fn for_interface(mut self, state: &AppState, iface: &InterfaceRuntime) -> RequestMeta {
        if self
            .task_class
            .as_ref()
            .is_some_and(|c| c.len() > MAX_TASK_CLASS_BYTES)
        {
            self.task_class = None;
            state.metrics.task_class_too_long(&iface.name);
        }
        if let (Some(class), Some(allowed)) = (&self.task_class, &iface.task_classes) {
            if !allowed.iter().any(|a| a == class) {
                self.task_class = None;
                state.metrics.task_class_unlisted(&iface.name);
            }
        }
        self
    }
}

/// The longest deadline a request may ask for on an interface without `deadline_ms`.
pub const MAX_DEADLINE_MS: f64 = 600_000.0;

/// A request's deadline: `x-equiroute-deadline-ms`, else the interface's `deadline_ms`. The
/// header is clamped to the interface's `deadline_ms` (or [`MAX_DEADLINE_MS`] without one):
/// the second value is `true` when it was, and the answer then says which deadline applied.
fn deadline_from(
    headers: &HeaderMap,
    iface: &InterfaceRuntime,
) -> Result<(Option<Millis>, bool), ApiError> {
    let Some(v) = headers.get("x-equiroute-deadline-ms") else {
        return Ok((iface.deadline, false));
    };
    // Less than an attempt's least time (1 ms) could never be met: the caller's mistake,
    // not a 504.
    let least = iface.limits.min_attempt_budget.0;
    let asked = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|d| d.is_finite() && *d >= least)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_deadline",
                Some("x-equiroute-deadline-ms"),
                format!("x-equiroute-deadline-ms must be a number of milliseconds, at least {least} (the least time an attempt is given)"),
            )
        })?;
    let most = iface.deadline.map_or(MAX_DEADLINE_MS, |d| d.0);
    Ok((Some(Millis(asked.min(most))), asked > most))
}

/// The answer (or error) of a routed request; when its deadline header was clamped,
/// `x-equiroute-deadline-applied-ms` says which deadline applied.
fn with_deadline(
    result: Result<Response, ApiError>,
    deadline: Option<Millis>,
    clamped: bool,
) -> Response {
    let mut resp = result.unwrap_or_else(IntoResponse::into_response);
    if let (true, Some(d)) = (clamped, deadline) {
        resp.headers_mut().insert(
            "x-equiroute-deadline-applied-ms",
            HeaderValue::from(d.0 as u64),
        );
    }
    resp
}

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
    for (name, value) in [
        ("x-equiroute-request-id", Some(request_id)),
        ("x-equiroute-provider", provider),
    ] {
        if let Some(v) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            h.insert(name, v);
        }
    }
    h.insert("x-equiroute-attempts", HeaderValue::from(attempts));
}

/// What a JSON value is, for an error message ("got a string").
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A chat field the gateway reads: its name, whether a value is valid, and what it must be.
type FieldCheck = (&'static str, fn(&Value) -> bool, &'static str);

/// Checks the fields of a chat body that the gateway acts on itself — `model` (routing),
/// `messages` (features and size), `stream`, `max_tokens` / `max_completion_tokens` (size
/// and cost), `tools` and `response_format` (eligibility) — and answers the model. A field of
/// the wrong type would otherwise be read as absent: a `"stream": "yes"` answered without
/// streaming, a `"max_tokens": -5` sized as the default. Everything else goes to the provider
/// as it came, and the provider judges it.
fn check_chat_body(body: &Value) -> Result<&str, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "invalid_body",
            None,
            format!(
                "the body must be a JSON object (a chat completions request), got {}",
                json_kind(body)
            ),
        ));
    };
    let Some(Value::String(model)) = obj.get("model") else {
        let got = obj
            .get("model")
            .map_or(String::new(), |v| format!(", got {}", json_kind(v)));
        return Err(ApiError::bad_request(
            "missing_model",
            Some("model"),
            format!(
                "`model` is required as a string: name an interface, or interface/provider{got}"
            ),
        ));
    };
    let Some(messages) = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
    else {
        return Err(ApiError::bad_request(
            "missing_messages",
            Some("messages"),
            "`messages` must be a non-empty array",
        ));
    };
    for (i, m) in messages.iter().enumerate() {
        if !m.is_object() {
            return Err(ApiError::bad_field(
                "invalid_type",
                format!("messages[{i}]"),
                format!(
                    "`messages[{i}]` must be an object with a `role` and a `content`, got {}",
                    json_kind(m)
                ),
            ));
        }
        if !m.get("role").is_some_and(Value::is_string) {
            let got = m.get("role").map_or("nothing", json_kind);
            return Err(ApiError::bad_field(
                "invalid_type",
                format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be a string such as \"user\", got {got}"),
            ));
        }
    }
    let tokens = |v: &Value| {
        v.as_u64()
            .is_some_and(|t| t >= 1 && u32::try_from(t).is_ok())
    };
    let checks: [FieldCheck; 5] = [
        ("stream", Value::is_boolean, "true or false"),
        (
            "max_tokens",
            tokens,
            "a whole number of tokens from 1 to 4294967295",
        ),
        (
            "max_completion_tokens",
            tokens,
            "a whole number of tokens from 1 to 4294967295",
        ),
        ("tools", Value::is_array, "an array of tool definitions"),
        (
            "response_format",
            |v| v.get("type").is_some_and(Value::is_string),
            "an object with a string `type` (\"text\", \"json_object\", \"json_schema\")",
        ),
    ];
    for (name, valid, expected) in checks {
        // `null` is "unset", as OpenAI reads it.
        let Some(v) = obj.get(name).filter(|v| !v.is_null() && !valid(v)) else {
            continue;
        };
        let (code, got) = match v {
            // A number where a count of tokens is wanted: the value is wrong, not the type.
            Value::Number(n) if name.ends_with("tokens") => ("invalid_value", n.to_string()),
            _ => ("invalid_type", json_kind(v).to_owned()),
        };
        return Err(ApiError::bad_request(
            code,
            Some(name),
            format!("`{name}` must be {expected}, got {got}"),
        ));
    }
    Ok(model)
}

/// `POST /v1/chat/completions`: `model` names an interface, or `interface/provider` to pin one.
async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<auth::Caller>,
    headers: HeaderMap,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    let meta = RequestMeta::of(&headers, &caller)?;
    route_chat(&state, &headers, meta, parse_json(body)?).await
}

/// Routes a chat completions request: the one entry point of every client API (the Responses
/// and Messages APIs translate into it, see [`clients`]).
async fn route_chat(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    meta: RequestMeta,
    body: ClientBody,
) -> Result<Response, ApiError> {
    let model = check_chat_body(&body)?;
    let (name, pinned) = model
        .split_once('/')
        .map_or((model, None), |(i, p)| (i, Some(p)));
    let iface = state
        .interfaces
        .get(name)
        .filter(|i| i.kind == InterfaceKind::Chat)
        .ok_or_else(|| {
            let chats: Vec<&str> = state
                .interfaces
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
    let (deadline, clamped) = deadline_from(headers, iface)?;
    let meta = meta.for_interface(state, iface);
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        let streamed =
            execute::execute_stream(state.clone(), iface.clone(), body, pinned, deadline, meta)
                .await;
        return Ok(with_deadline(streamed, deadline, clamped));
    }
    let answered = execute::execute(state, iface, &body, pinned, deadline, &meta)
        .await
        .inspect(|a| maybe_judge(state, iface, &body, a));
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
    headers: HeaderMap,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    let meta = RequestMeta::of(&headers, &caller)?;
    let body = parse_json(body)?;
    let iface = state
        .interfaces
        .get(&name)
        .filter(|i| i.kind == InterfaceKind::Tool)
        .ok_or_else(|| {
            let tools: Vec<&str> = state
                .interfaces
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
    let (deadline, clamped) = deadline_from(&headers, iface)?;
    let meta = meta.for_interface(&state, iface);
    let answered = execute::execute(&state, iface, &body, None, deadline, &meta)
        .await
        .inspect(|a| maybe_judge(&state, iface, &body, a));
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
GET /v1/models, GET /v1/interfaces, GET /v1/interfaces/{name}/state, GET /v1/interfaces/{name}/shadow, GET /v1/interfaces/{name}/rollout, POST /v1/interfaces/{name}/rollout/promote, POST /v1/interfaces/{name}/rollout/abort, GET /dashboard, GET /metrics, GET /healthz, GET /readyz";

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

/// The OpenAI model objects: each chat interface (routed), then each of its providers
/// pinned as `interface/provider`.
fn model_objects(state: &AppState) -> Vec<Value> {
    let mut out = Vec::new();
    for i in state
        .interfaces
        .values()
        .filter(|i| i.kind == InterfaceKind::Chat)
    {
        out.push(json!({"id": i.name, "object": "model", "created": 0, "owned_by": "equiroute"}));
        for c in &i.candidates {
            out.push(json!({
                "id": format!("{}/{}", i.name, c.id.0),
                "object": "model",
                "created": 0,
                "owned_by": c.model,
            }));
        }
    }
    out
}

/// `GET /v1/models`: what `model` can name, as OpenAI lists models.
async fn list_models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": model_objects(&state)}))
}

/// `GET /v1/models/{model}`: one of them (`chat` or `chat/provider`).
async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let mut all = model_objects(&state);
    if let Some(at) = all.iter().position(|m| m["id"] == model.as_str()) {
        return Ok(Json(all.swap_remove(at)));
    }
    let ids: Vec<&str> = all.iter().filter_map(|m| m["id"].as_str()).collect();
    Err(ApiError::not_found(
        "model_not_found",
        format!("no model `{}`: use one of {}", echo(&model), ids.join(", ")),
    ))
}

async fn list_interfaces(State(state): State<Arc<AppState>>) -> Json<Value> {
    let list: Vec<Value> = state
        .interfaces
        .values()
        .map(|i| {
            json!({
                "name": i.name,
                "kind": i.kind,
                "policy": i.policy_name(),
                "deadline_ms": i.deadline.map(|d| d.0),
                "providers": i.candidates.iter().map(|c| json!({"id": c.id, "model": c.model, "tier": c.tier, "price": c.price})).collect::<Vec<_>>(),
            })
        })
        .collect();
    Json(json!({"interfaces": list}))
}

/// The most slices one page of `?full=true` carries, and its default `limit`.
pub const STATE_PAGE_MAX: usize = 1000;

/// The query of `GET /v1/interfaces/{name}/state`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StateQuery {
    full: bool,
    /// First slice of the page (`offset`, default 0).
    offset: usize,
    /// Slices in the page (`limit`, 1 to [`STATE_PAGE_MAX`], default the most).
    limit: usize,
}

/// Parses the state route's query. Any fault is an OpenAI-style 400 naming the parameter
/// (axum's own rejection is plain text).
fn parse_state_query(raw: Option<&str>) -> Result<StateQuery, ApiError> {
    let mut q = StateQuery {
        full: false,
        offset: 0,
        limit: STATE_PAGE_MAX,
    };
    let bad = |param: &'static str, what: &str, got: &str| {
        ApiError::bad_request(
            "invalid_query",
            Some(param),
            format!("`{param}` must be {what}, got `{}`", echo(got)),
        )
    };
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "full" => {
                q.full = match value {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad("full", "true, false, 1 or 0", value)),
                };
            }
            "offset" => {
                q.offset = value
                    .parse()
                    .map_err(|_| bad("offset", "a whole number of slices", value))?;
            }
            "limit" => {
                q.limit = value
                    .parse()
                    .ok()
                    .filter(|l| (1..=STATE_PAGE_MAX).contains(l))
                    .ok_or_else(|| bad("limit", "a whole number from 1 to 1000", value))?;
            }
            other => {
                return Err(ApiError::bad_field(
                    "invalid_query",
                    echo(other).into_owned(),
                    format!(
                    "unknown query parameter `{}`: the state route takes full, offset and limit",
                    echo(other)
                ),
                ))
            }
        }
    }
    Ok(q)
}

/// The one full state dump a gateway builds at a time: taken before the dump is started,
/// released when the blocking task that builds it ends (even if the client has gone).
struct FullDump(Arc<AppState>);

impl FullDump {
    fn begin(state: &Arc<AppState>) -> Option<FullDump> {
        state
            .full_dump_busy
            .compare_exchange(
                false,
                true,
                std::sync::atomic::Ordering::Acquire,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
            .then(|| FullDump(state.clone()))
    }
}

impl Drop for FullDump {
    fn drop(&mut self) {
        self.0
            .full_dump_busy
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// The slices of a learning state (sliced policies only).
fn slices_of(
    learnt: &mut equiroute_core::policies::PolicyState,
) -> Option<&mut Vec<equiroute_core::policies::SliceStats>> {
    use equiroute_core::policies::PolicyState;
    match learnt {
        PolicyState::TsDeadline(risk) => Some(&mut risk.slices),
        PolicyState::LqmTs(s) => Some(&mut s.risk.slices),
        _ => None,
    }
}

/// One page of an interface's learning state: everything but the latency slices, and the
/// slices from `offset`, at most `limit` of them. Runs on a blocking thread.
fn learning_page(iface: &InterfaceRuntime, offset: usize, limit: usize) -> Result<Value, ApiError> {
    let mut learnt = iface
        .policy
        .read()
        .map_err(|_| ApiError::internal())?
        .export_state();
    let page = slices_of(&mut learnt).map(|slices| {
        let total = slices.len();
        let end = offset.saturating_add(limit).min(total);
        slices.truncate(end);
        slices.drain(..offset.min(end));
        json!({
            "total": total,
            "offset": offset,
            "limit": limit,
            "next_offset": (end < total).then_some(end),
        })
    });
    let mut out = json!({"learning_state": learnt});
    if let Some(page) = page {
        out["slices_page"] = page;
    }
    Ok(out)
}

/// A candidate's estimates for the state route: its score breakdown, with the number of
/// quality scores behind the quality estimate (for policies that learn one) and the estimate
/// itself `null` while that number is 0, since it is then only the policy's prior.
fn estimates_json(
    breakdown: &equiroute_core::policies::ScoreBreakdown,
    quality_observations: Option<u64>,
) -> Value {
    let mut estimates = json!(breakdown);
    if let (Some(n), Some(map)) = (quality_observations, estimates.as_object_mut()) {
        if n == 0 && map.contains_key("quality") {
            map.insert("quality".to_owned(), Value::Null);
        }
        map.insert("quality_observations".to_owned(), json!(n));
    }
    estimates
}

/// `GET /v1/interfaces/{name}/state`: each candidate's current estimates (from the policy's
/// view of an empty query at the interface deadline), breaker state and traffic share.
/// A quality estimate that rests on no score yet is `null` (the policy ranks by its prior
/// meanwhile), next to the count of scores behind it; the traffic counts cover this process
/// since it started (`traffic_window`), as they are neither saved nor shared.
/// `?full=true` adds the policy's learning state, its latency slices paged by `offset` and
/// `limit`; it is built on a blocking thread, one at a time per gateway (a second gets 429).
async fn interface_state(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
) -> Result<Json<Value>, ApiError> {
    let query = parse_state_query(raw.as_deref())?;
    let iface = state.interfaces.get(&name).cloned().ok_or_else(|| {
        ApiError::not_found(
            "interface_not_found",
            format!("no interface `{}`", echo(&name)),
        )
    })?;
    let features = iface.featurizer.featurize("");
    let all: Vec<usize> = (0..iface.candidates.len()).collect();
    let (ranking, quality_observations) = {
        // The write side, so that observations deferred by busy requests are in the state shown.
        let policy = state.policy_mut(&iface).map_err(|_| ApiError::internal())?;
        let mut ctx = RankContext::new(&iface.candidates, &all, &features);
        ctx.deadline = iface.deadline;
        ctx.now = state.now();
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
        (policy.rank(&ctx, &mut rng), policy.quality_observations())
    };
    let breakers = iface.breakers.lock().map(|b| b.clone()).unwrap_or_default();
    let total: u64 = iface
        .first_choices
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let candidates: Vec<Value> = ranking
        .order
        .iter()
        .map(|s| {
            let c = &iface.candidates[s.index];
            let first = iface.first_choices[s.index].load(std::sync::atomic::Ordering::Relaxed);
            json!({
                "id": c.id,
                "score": s.score,
                "estimates": estimates_json(&s.breakdown, quality_observations.as_ref().and_then(|n| n.get(s.index).copied())),
                "breaker": breakers.get(s.index).map(|b| b.state),
                "first_choices": first,
                "traffic_share": (total > 0).then(|| first as f64 / total as f64),
            })
        })
        .collect();
    let mut body = json!({
        "interface": name,
        "policy": iface.policy_name(),
        "candidates": candidates,
        "traffic_window": {
            "scope": "process",
            "since_unix_ms": state.started_unix_ms(),
            "requests": total,
        },
    });
    if query.full {
        let Some(dump) = FullDump::begin(&state) else {
            return Err(ApiError::busy(
                "state_dump_in_progress",
                "another full state dump is being built (one at a time): retry after a second, or leave out full=true for the summary",
            ));
        };
        let page = tokio::task::spawn_blocking(move || {
            let _dump = dump;
            learning_page(&iface, query.offset, query.limit)
        })
        .await
        .map_err(|_| ApiError::internal())??;
        if let (Some(b), Value::Object(p)) = (body.as_object_mut(), page) {
            b.extend(p);
        }
    }
    Ok(Json(body))
}

/// Ready to serve. With shared state, the body says whether Redis is reachable: an instance
/// without Redis still routes (on its local state), so it stays ready.
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match &state.shared {
        None => "ready".into_response(),
        Some(shared) => Json(json!({
            "status": "ready",
            "state": shared.readiness(state.now()),
        }))
        .into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = state.metrics.render();
    arms::render_metrics(&state.interfaces, &mut text);
    if let Some(shared) = &state.shared {
        shared.render_metrics(&mut text);
    }
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const CONFIG: &str = r#"
[interfaces.chat]
kind = "chat"
policy = { name = "ts-deadline" }

[[interfaces.chat.providers]]
id = "a"
kind = "sim"
sim = { latency = { p50_ms = 1, p95_ms = 2 } }
"#;

    async fn full_state(state: &Arc<AppState>) -> Response {
        interface_state(
            State(state.clone()),
            Path("chat".to_owned()),
            axum::extract::RawQuery(Some("full=true".to_owned())),
        )
        .await
        .into_response()
    }

    #[tokio::test]
    async fn one_full_state_dump_at_a_time_the_second_gets_429_with_retry_after() {
        let cfg = crate::config::load(CONFIG, "t.toml", &|_| None).unwrap();
        let state = Arc::new(AppState::new(&cfg, 1).unwrap());
        let dump = FullDump::begin(&state).expect("free");
        assert!(FullDump::begin(&state).is_none(), "a second dump waits");
        let busy = full_state(&state).await;
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(busy.headers().get("retry-after").unwrap(), "1");
        let body = axum::body::to_bytes(busy.into_body(), 1 << 16)
            .await
            .unwrap();
        let e: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(e["error"]["code"], "state_dump_in_progress");
        // The summary is never refused.
        let summary = interface_state(
            State(state.clone()),
            Path("chat".to_owned()),
            axum::extract::RawQuery(None),
        )
        .await;
        assert!(summary.is_ok());
        drop(dump);
        let done = full_state(&state).await;
        assert_eq!(done.status(), StatusCode::OK);
        // The dump released its turn when it ended.
        assert!(FullDump::begin(&state).is_some());
    }
}
