//! A mock upstream for tests, demos and benchmarks: a real HTTP server speaking the OpenAI
//! chat API (`POST /v1/chat/completions`), the native dialects of the other hosts (Anthropic's
//! `POST /v1/messages`, Azure OpenAI's `POST /openai/deployments/{deployment}/chat/completions
//! ?api-version=...`, Gemini's `POST /v1beta/models/{model}:generateContent` and
//! `:streamGenerateContent?alt=sse`, Bedrock's `POST /model/{model}/converse` and
//! `/converse-stream` in AWS event-stream framing) and a search-style JSON API (`POST /search`), with
//! per-route latency (log-normal, with a Pareto tail or a mixture: the laboratory's shapes)
//! and error rates (500, 503, 429 with or without `Retry-After`, 400), a
//! library of named faults, and call counters at `GET /_stats`.
//!
//! A fault is chosen per route (`[chat] fault = "..."`) or per model: a chat request whose
//! `model` has a `[models."NAME"]` table is served by that table instead of `[chat]` (every
//! field of it, with the defaults for those left out), so one mock plays every fault at once,
//! one model name each. The faults ([`Fault`]):
//!
//! | `fault` | what the mock does |
//! |---|---|
//! | `rate_limited` | 429 with `Retry-After: retry_after_s` (1 s when unset), every call |
//! | `rate_limited_no_retry_after` | 429 without `Retry-After`, every call |
//! | `error_500_once` | 500 on the first call of each request `model` (`/search`: of the route), then healthy |
//! | `unavailable` | 503, every call |
//! | `reset` | reads the request, then resets the connection (TCP RST) before any header |
//! | `no_answer` | reads the request and never answers (the connection stays open) |
//! | `slow_first_token` | waits `first_token_delay_ms` (1000 when unset) before the first byte |
//! | `stream_cut` | a streamed answer breaks off after `stream_cut_after` chunks (2 when unset) |
//! | `stream_stall` | a streamed answer goes silent after `stream_stall_after` chunks (2 when unset) |
//! | `malformed_chunk` | a streamed answer's third event is not JSON; the rest follows |
//! | `no_done_finished` | a streamed answer with its `finish_reason` but no `[DONE]`, then a clean end |
//! | `no_done_unfinished` | a streamed answer with neither `finish_reason` nor `[DONE]`, then a clean end |
//! | `context_length_exceeded` | 400 with `error.code = "context_length_exceeded"` |
//! | `content_filter` | 400 with `error.code = "content_filter"` (OpenAI's refusal of a prompt) |
//! | `prefill_rejected` | 400: the conversation must end with a user message (no assistant prefill) |
//! | `flapping` | odd-numbered calls answer 500, even-numbered ones answer normally |
//! | `endless_stream` | a streamed answer of 16 KiB content chunks that never ends |
//! | `outage` | 503 on every call for the first `outage_ms` (1000 when unset) after the mock started, then healthy |
//! | `outage_then_recovers` | 503 on calls `outage_calls = [from, to)` of the model (from 1; `[1, 6)` when unset), healthy before and after |
//! | `access_denied` | 403 in the host's shape (Bedrock: `InvalidSignatureException` quoting the signed headers, as AWS does) |
//!
//! A route can instead mix faults at random: `fault_mix = { reset = 0.02, stream_cut = 0.05 }`
//! plays each fault on that share of the calls, one draw per call from the call's seeded
//! random sequence (the faults that depend on the call history or the clock,
//! `error_500_once`, `flapping`, `outage` and `outage_then_recovers`, are not mixed; `error_500` is the random 500). `hang_ms` bounds how long
//! `no_answer` and `stream_stall` hold a connection (for ever when unset), so a long run
//! does not pile them up.
//!
//! `healthy_calls = N` spares a model's first N chat calls from its fault.
//!
//! The native routes check what their host requires (Anthropic's `anthropic-version` header
//! and `max_tokens`, no OpenAI-only members; Gemini's `contents`; Azure's `api-version`;
//! Bedrock's Signature Version 4 `Authorization` for service `bedrock` with `x-amz-date`, counted in
//! `/_stats` as `authorized`, and `session_tokens` for those with `x-amz-security-token`) and
//! answer every error and fault in their host's shape: Anthropic's `overloaded_error` is a
//! 529, Gemini's errors carry a `status` name, Bedrock's are `{"message"}` with the type in
//! `x-amzn-errortype` (429 `ThrottlingException`, 503 `ServiceUnavailableException`, 400
//! `ValidationException`, ...), a content filter is Anthropic's `refusal` stop, Gemini's
//! blocked prompt and Bedrock's `guardrail_intervened` (all with HTTP 200). Given tools, an
//! answer (of any dialect) calls the first one, unless the conversation's last turn carries
//! tool results: then it answers in text, so a client's tool loop ends.
//!
//! A streamed Anthropic answer whose conversation ends with an assistant prefill that begins
//! the mock's answer (`mock streamed answer`) goes on from it, as a model that takes prefills
//! does (what a continued stream needs).
//!
//! Stream faults apply to streamed answers only (an unstreamed one is answered normally);
//! `slow_first_token` delays an unstreamed answer by the same time. A fault decides first;
//! the error rates apply to calls it lets through. Calls are counted per route and per model
//! (the first 1024 model names; later ones under `(other)`); `/_stats` also shows the body
//! of the last chat call as it came (`last_chat`, in the route's dialect).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use equiroute_core::latency::LatencyShapeSpec;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A named fault the mock plays (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    RateLimited,
    RateLimitedNoRetryAfter,
    #[serde(rename = "error_500_once")]
    Error500Once,
    Unavailable,
    Reset,
    NoAnswer,
    SlowFirstToken,
    StreamCut,
    StreamStall,
    MalformedChunk,
    NoDoneFinished,
    NoDoneUnfinished,
    ContextLengthExceeded,
    ContentFilter,
    PrefillRejected,
    Flapping,
    Outage,
    EndlessStream,
    OutageThenRecovers,
    AccessDenied,
}

/// Behaviour of one route (or of one model's chat calls).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteProfile {
    /// The latency before the answer, as the laboratory writes it: a log-normal by `p50_ms`
    /// and `p95_ms` (both 0: no wait at all), optionally with a Pareto `tail`, or a `mixture`
    /// of log-normals.
    pub latency: LatencyShapeSpec,
    pub error_500: f64,
    pub error_503: f64,
    pub error_429: f64,
    /// `Retry-After` seconds sent with a 429 (none when unset; 1 for `fault = "rate_limited"`).
    pub retry_after_s: Option<f64>,
    pub error_400: f64,
    /// Streamed answers: milliseconds between chunks.
    pub chunk_gap_ms: f64,
    /// Streamed answers: break the connection after this many chunks.
    pub stream_cut_after: Option<usize>,
    /// Streamed answers: go silent (forever) after this many chunks.
    pub stream_stall_after: Option<usize>,
    /// The chat answer's text (e.g. a score, to act as an LLM judge).
    pub content: String,
    /// `error.code` of the 400s (e.g. `context_length_exceeded`).
    pub error_400_code: Option<String>,
    /// The fault this route plays on every call (none by default).
    pub fault: Option<Fault>,
    /// `slow_first_token`: milliseconds before the first byte (default 1000).
    pub first_token_delay_ms: Option<f64>,
    /// `outage`: milliseconds after the mock's start during which every call gets a 503
    /// (default 1000).
    pub outage_ms: Option<f64>,
    /// Chat calls: the first this many calls of the model are answered without the fault
    /// (a provider that works, then fails). Default 0.
    pub healthy_calls: u64,
    /// `outage_then_recovers`: the calls `[from, to)` that answer 503 (default `[1, 6)`).
    pub outage_calls: Option<[u64; 2]>,
    /// Faults played at random: each on this share of the calls (shares add up to at most 1).
    pub fault_mix: BTreeMap<Fault, f64>,
    /// `no_answer` and `stream_stall`: milliseconds before the mock closes the connection
    /// (for ever when unset).
    pub hang_ms: Option<f64>,
}

impl Default for RouteProfile {
    fn default() -> Self {
        RouteProfile {
            latency: LatencyShapeSpec::log_normal(20.0, 20.0),
            error_500: 0.0,
            error_503: 0.0,
            error_429: 0.0,
            retry_after_s: None,
            error_400: 0.0,
            chunk_gap_ms: 5.0,
            stream_cut_after: None,
            stream_stall_after: None,
            content: "mock answer".to_owned(),
            error_400_code: None,
            fault: None,
            first_token_delay_ms: None,
            outage_ms: None,
            healthy_calls: 0,
            outage_calls: None,
            fault_mix: BTreeMap::new(),
            hang_ms: None,
        }
    }
}

/// Behaviour of the whole mock.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockProfile {
    pub chat: RouteProfile,
    pub search: RouteProfile,
    /// Chat calls whose request `model` is a key here are served by its profile instead of
    /// `chat`.
    pub models: BTreeMap<String, RouteProfile>,
}

impl MockProfile {
    /// Parses a profile; `file` names it in errors.
    ///
    /// # Errors
    /// Syntax errors, unknown fields and values out of range, with the field named.
    pub fn from_toml(text: &str, file: &str) -> Result<MockProfile, String> {
        let profile: MockProfile =
            equiroute_toml::parse(text).map_err(|p| format!("{file}: `{}`: {}", p.field, p.fix))?;
        let routes = [
            ("chat".to_owned(), &profile.chat),
            ("search".to_owned(), &profile.search),
        ];
        let models = profile
            .models
            .iter()
            .map(|(name, route)| (format!("models.{name}"), route));
        for (name, route) in routes.into_iter().chain(models) {
            check_latency(&route.latency)
                .map_err(|(sub, fix)| format!("{file}: `{name}.latency{sub}`: {fix}"))?;
            route
                .check()
                .map_err(|(field, fix)| format!("{file}: `{name}.{field}`: {fix}"))?;
        }
        Ok(profile)
    }

    /// The profile that serves a chat call for `model`.
    fn chat_for(&self, model: Option<&str>) -> &RouteProfile {
        model.and_then(|m| self.models.get(m)).unwrap_or(&self.chat)
    }
}

/// A route's latency: the laboratory's shapes, plus `p50_ms = p95_ms = 0` (no wait, the
/// throughput benchmark's upstream).
/// On error: the sub-field after `latency` (`""` for the table) and the fix.
fn check_latency(l: &LatencyShapeSpec) -> Result<(), (String, String)> {
    let no_wait = l.p50_ms == Some(0.0) && l.p95_ms == Some(0.0);
    if no_wait && l.tail.is_none() && l.mixture.is_empty() {
        return Ok(());
    }
    l.check()
}

impl RouteProfile {
    /// The first field out of range, and what it must be.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let rates = [
            ("error_500", self.error_500),
            ("error_503", self.error_503),
            ("error_429", self.error_429),
            ("error_400", self.error_400),
        ];
        for (field, r) in rates {
            if !(0.0..=1.0).contains(&r) {
                return Err((field, format!("a probability from 0 to 1, got {r}")));
            }
        }
        let total: f64 = rates.iter().map(|(_, r)| r).sum();
        if total > 1.0 + 1e-9 {
            return Err((
                "error_500",
                format!(
                    "error_500 + error_503 + error_429 + error_400 must be at most 1, got {total}"
                ),
            ));
        }
        if !(self.chunk_gap_ms >= 0.0 && self.chunk_gap_ms.is_finite()) {
            return Err((
                "chunk_gap_ms",
                format!("milliseconds ≥ 0, got {}", self.chunk_gap_ms),
            ));
        }
        if let Some(s) = self.retry_after_s.filter(|s| !(*s >= 0.0 && s.is_finite())) {
            return Err(("retry_after_s", format!("seconds ≥ 0, got {s}")));
        }
        if let Some(d) = self
            .first_token_delay_ms
            .filter(|d| !(*d >= 0.0 && d.is_finite()))
        {
            return Err(("first_token_delay_ms", format!("milliseconds ≥ 0, got {d}")));
        }
        if let Some(h) = self.hang_ms.filter(|h| !(*h >= 0.0 && h.is_finite())) {
            return Err(("hang_ms", format!("milliseconds ≥ 0, got {h}")));
        }
        self.check_fault_mix()
    }

    /// `fault_mix`: shares in [0, 1] adding up to at most 1, no history-dependent fault, and
    /// not together with `fault`.
    fn check_fault_mix(&self) -> Result<(), (&'static str, String)> {
        if self.fault_mix.is_empty() {
            return Ok(());
        }
        if let Some(f) = self.fault {
            return Err((
                "fault_mix",
                format!("cannot be combined with `fault = {f:?}`: keep one of the two"),
            ));
        }
        for (fault, share) in &self.fault_mix {
            if matches!(
                fault,
                Fault::Error500Once | Fault::Flapping | Fault::Outage | Fault::OutageThenRecovers
            ) {
                return Err((
                    "fault_mix",
                    format!("{fault:?} depends on the call history, which a random mix has not: use error_500 for random 500s"),
                ));
            }
            if !(0.0..=1.0).contains(share) {
                return Err((
                    "fault_mix",
                    format!("{fault:?}: a share from 0 to 1, got {share}"),
                ));
            }
        }
        let total: f64 = self.fault_mix.values().sum();
        if total > 1.0 + 1e-9 {
            return Err((
                "fault_mix",
                format!("the shares must add up to at most 1, got {total}"),
            ));
        }
        if let Some(d) = self.outage_ms.filter(|d| !(*d >= 0.0 && d.is_finite())) {
            return Err(("outage_ms", format!("milliseconds ≥ 0, got {d}")));
        }
        Ok(())
    }
}

/// Model names counted one by one in `/_stats`; later ones are counted together.
const MAX_COUNTED_MODELS: usize = 1024;
/// Where calls for models beyond [`MAX_COUNTED_MODELS`] are counted.
const OTHER_MODELS: &str = "(other)";

#[derive(Debug, Default)]
struct Counters {
    chat: AtomicU64,
    search: AtomicU64,
    authorized: AtomicU64,
    /// Bedrock calls signed with a session token (`x-amz-security-token`).
    session_tokens: AtomicU64,
    /// Chat calls per request `model`.
    models: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    /// Counts a chat call for `model`; returns its number among that model's calls (from 1),
    /// which the faults that change over time (`error_500_once`, `flapping`) go by.
    fn count_model(&self, model: &str) -> u64 {
        let Ok(mut models) = self.models.lock() else {
            return 1;
        };
        let key = if models.len() < MAX_COUNTED_MODELS || models.contains_key(model) {
            model
        } else {
            OTHER_MODELS
        };
        let n = models.entry(key.to_owned()).or_insert(0);
        *n += 1;
        *n
    }
}

#[derive(Debug)]
struct MockState {
    profile: MockProfile,
    counters: Counters,
    seq: AtomicU64,
    /// Streamed answers being sent (their upstream connection still open).
    streams_open: Arc<AtomicU64>,
    /// When the mock started (the `outage` fault's clock).
    started: std::time::Instant,
    /// The body of the last chat call, as it came (in its dialect), for `/_stats`.
    last_chat: Mutex<Option<serde_json::Value>>,
}

/// The connection a request came on: the `reset` fault resets it.
#[derive(Clone, Debug)]
struct Connection(Arc<tokio::sync::Notify>);

/// The mock's router.
fn router(profile: MockProfile) -> Router {
    let state = Arc::new(MockState {
        profile,
        counters: Counters::default(),
        seq: AtomicU64::new(1),
        streams_open: Arc::new(AtomicU64::new(0)),
        started: std::time::Instant::now(),
        last_chat: Mutex::new(None),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/messages", post(anthropic_messages))
        .route(
            "/openai/deployments/{deployment}/chat/completions",
            post(azure_chat),
        )
        .route("/v1beta/models/{call}", post(gemini_call))
        .route("/model/{model}/{method}", post(bedrock_call))
        .route("/search", post(search))
        .route("/_stats", get(stats))
        .with_state(state)
}

/// Serves the mock on `listener` until `shutdown` resolves; open connections then get a
/// second to finish (a `no_answer` call never does, and is dropped).
///
/// The mock runs its own accept loop (not `axum::serve`) so that the `reset` fault can reach
/// the socket a request came on.
///
/// # Errors
/// The server fails.
pub async fn serve(
    profile: MockProfile,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(profile);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        // Out of file descriptors and the like: pause rather than spin.
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        tokio::spawn(connection(app.clone(), stream, stopped.clone()));
    }
    let _ = stop.send(true);
    Ok(())
}

/// Serves one connection until it closes, a request resets it, or the mock stops.
async fn connection(
    app: Router,
    stream: tokio::net::TcpStream,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    // A second handle on the socket, kept to reset it: `SO_LINGER` 0, then the last close
    // sends RST instead of FIN.
    let Ok((stream, spare)) = stream.into_std().and_then(|s| {
        let spare = s.try_clone()?;
        Ok((tokio::net::TcpStream::from_std(s)?, spare))
    }) else {
        return;
    };
    let reset = Arc::new(tokio::sync::Notify::new());
    let service = hyper_util::service::TowerToHyperService::new(app);
    let handle = Connection(reset.clone());
    let svc = hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(handle.clone());
        hyper::service::Service::call(&service, req)
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = reset.notified() => {
            if let Ok(spare) = tokio::net::TcpStream::from_std(spare) {
                let _ = spare.set_zero_linger();
            }
        }
        () = async { drop(stop.wait_for(|s| *s).await) } => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), conn).await;
        }
    }
}

/// Waits `wait` to within tens of microseconds. Tokio's timer has millisecond granularity
/// (a 20 ms sleep lasts 20 to 21 ms, by where in the millisecond it began): as the latency of
/// the benchmark's upstream that jitter would swamp the sub-millisecond overhead being
/// measured. A thread of the blocking pool sleeps instead (`nanosleep`, microsecond
/// resolution); the pool keeps its threads, so a warm mock starts none per request.
async fn precise_sleep(wait: std::time::Duration) {
    if wait.is_zero() {
        return;
    }
    if tokio::task::spawn_blocking(move || std::thread::sleep(wait))
        .await
        .is_err()
    {
        // The pool is shutting down: fall back to the timer.
        tokio::time::sleep(wait).await;
    }
}

/// The API a route speaks: errors and answers take its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Speaks {
    OpenAi,
    Azure,
    Anthropic,
    Gemini,
    Bedrock,
}

/// An error answer in the route's shape (OpenAI's: `error.message`, `type`, `code`).
fn error_answer(
    speaks: Speaks,
    status: StatusCode,
    kind: &str,
    code: &serde_json::Value,
    message: &str,
) -> Response {
    match speaks {
        Speaks::OpenAi | Speaks::Azure => {
            let body =
                json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
            (status, Json(body)).into_response()
        }
        Speaks::Anthropic => {
            // Anthropic answers overload with its own 529.
            let status = if status == StatusCode::SERVICE_UNAVAILABLE {
                StatusCode::from_u16(529).unwrap_or(status)
            } else {
                status
            };
            let kind = match status.as_u16() {
                400 => "invalid_request_error",
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                _ => "api_error",
            };
            let body = json!({"type": "error", "error": {"type": kind, "message": message}});
            (status, Json(body)).into_response()
        }
        Speaks::Gemini => {
            let name = match status.as_u16() {
                400 => "INVALID_ARGUMENT",
                403 => "PERMISSION_DENIED",
                404 => "NOT_FOUND",
                429 => "RESOURCE_EXHAUSTED",
                503 => "UNAVAILABLE",
                _ => "INTERNAL",
            };
            let body =
                json!({"error": {"code": status.as_u16(), "message": message, "status": name}});
            (status, Json(body)).into_response()
        }
        Speaks::Bedrock => {
            let name = match status.as_u16() {
                400 => "ValidationException",
                403 => "AccessDeniedException",
                404 => "ResourceNotFoundException",
                429 => "ThrottlingException",
                503 => "ServiceUnavailableException",
                _ => "InternalServerException",
            };
            bedrock_error(status, name, message)
        }
    }
}

/// Bedrock's error shape: `{"message"}`, the type in `x-amzn-errortype`.
fn bedrock_error(status: StatusCode, name: &str, message: &str) -> Response {
    let mut r = (status, Json(json!({ "message": message }))).into_response();
    if let Ok(v) = axum::http::HeaderValue::from_str(&format!(
        "{name}:http://internal.amazon.com/coral/com.amazon.bedrock/"
    )) {
        r.headers_mut().insert("x-amzn-errortype", v);
    }
    r
}

/// The mock's own error (`type: mock_error`, the status as `code`).
fn mock_error(speaks: Speaks, status: StatusCode, message: &str) -> Response {
    error_answer(
        speaks,
        status,
        "mock_error",
        &json!(status.as_u16()),
        message,
    )
}

/// A 429, with `Retry-After` when given.
fn rate_limited(speaks: Speaks, retry_after_s: Option<f64>) -> Response {
    let mut r = mock_error(speaks, StatusCode::TOO_MANY_REQUESTS, "mock rate limit");
    if let Some(v) =
        retry_after_s.and_then(|s| axum::http::HeaderValue::from_str(&format!("{s}")).ok())
    {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

/// The fault of `fault_mix` that `u` (uniform in [0, 1)) falls on, if any.
fn mixed_fault(mix: &BTreeMap<Fault, f64>, u: f64) -> Option<Fault> {
    let mut edge = 0.0;
    for (fault, share) in mix {
        edge += share;
        if u < edge {
            return Some(*fault);
        }
    }
    None
}

/// Never resolves, or resolves after `hang_ms` when set: what `no_answer` and `stream_stall`
/// wait on.
async fn hang(route: &RouteProfile) {
    match route.hang_ms {
        Some(ms) => tokio::time::sleep(std::time::Duration::from_secs_f64(ms / 1000.0)).await,
        None => std::future::pending().await,
    }
}

/// The context-window refusal's message, as each host words it.
fn context_message(speaks: Speaks) -> &'static str {
    match speaks {
        Speaks::Anthropic => "prompt is too long: 210000 tokens > 200000 maximum",
        Speaks::Gemini => "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
        Speaks::Bedrock => "The model returned the following errors: Input is too long for requested model.",
        Speaks::OpenAi | Speaks::Azure => "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.",
    }
}

/// The native hosts refuse with a 200: Anthropic's `refusal` stop, Gemini's blocked prompt.
fn native_refusal(speaks: Speaks) -> Option<Response> {
    let body = match speaks {
        Speaks::OpenAi | Speaks::Azure => return None,
        Speaks::Anthropic => json!({"id": "msg_mock", "type": "message", "role": "assistant",
            "model": "mock", "content": [], "stop_reason": "refusal", "stop_sequence": null,
            "usage": {"input_tokens": 3, "output_tokens": 0}}),
        Speaks::Gemini => json!({"promptFeedback": {"blockReason": "SAFETY"},
            "usageMetadata": {"promptTokenCount": 3, "totalTokenCount": 3}}),
        Speaks::Bedrock => json!({"output": {"message": {"role": "assistant",
            "content": [{"text": "Sorry, the model cannot answer this question."}]}},
            "stopReason": "guardrail_intervened",
            "usage": {"inputTokens": 3, "outputTokens": 0, "totalTokens": 3}}),
    };
    Some(Json(body).into_response())
}

/// One draw of the route's latency.
fn latency_of(route: &RouteProfile, rng: &mut rand_chacha::ChaCha8Rng) -> std::time::Duration {
    std::time::Duration::from_secs_f64(route.latency.model().sample(rng) / 1000.0)
}

/// Waits the route's latency, then decides the outcome: `Ok` with the fault that plays on
/// this call (the route's `fault`, or one drawn from its `fault_mix`), or `Err` with an error
/// response (or a connection that is reset or left unanswered). `call` is the call's number
/// for its model.
async fn behave(
    state: &MockState,
    route: &RouteProfile,
    call: u64,
    conn: Option<&Connection>,
    speaks: Speaks,
) -> Result<Option<Fault>, Response> {
    let n = state.seq.fetch_add(1, Ordering::Relaxed);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n);
    precise_sleep(latency_of(route, &mut rng)).await;
    let fault = if route.fault_mix.is_empty() {
        route.fault
    } else {
        mixed_fault(&route.fault_mix, rng.random())
    };
    play_fault(state, route, fault, call, conn, speaks).await?;
    if let Some(r) = error_rates(route, speaks, rng.random()) {
        return Err(r);
    }
    Ok(fault)
}

/// The answer of a fault that answers (or resets, or hangs) in place of the route:
/// `Err` with it, `Ok` for no fault or one that changes the answer itself (the stream faults).
async fn play_fault(
    state: &MockState,
    route: &RouteProfile,
    fault: Option<Fault>,
    call: u64,
    conn: Option<&Connection>,
    speaks: Speaks,
) -> Result<(), Response> {
    let invalid = |code: serde_json::Value, message: &str| {
        error_answer(
            speaks,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &code,
            message,
        )
    };
    match fault {
        Some(Fault::RateLimited) => {
            return Err(rate_limited(
                speaks,
                Some(route.retry_after_s.unwrap_or(1.0)),
            ))
        }
        Some(Fault::RateLimitedNoRetryAfter) => return Err(rate_limited(speaks, None)),
        Some(Fault::Error500Once) if call == 1 => {
            return Err(mock_error(
                speaks,
                StatusCode::INTERNAL_SERVER_ERROR,
                "mock internal error",
            ));
        }
        Some(Fault::Flapping) if call % 2 == 1 => {
            return Err(mock_error(
                speaks,
                StatusCode::INTERNAL_SERVER_ERROR,
                "mock flapping",
            ));
        }
        Some(Fault::Outage)
            if state.started.elapsed().as_secs_f64() * 1000.0
                < route.outage_ms.unwrap_or(1000.0) =>
        {
            return Err(mock_error(
                speaks,
                StatusCode::SERVICE_UNAVAILABLE,
                "mock outage",
            ));
        }
        Some(Fault::OutageThenRecovers)
            if (route.outage_calls.map_or(1, |c| c[0])..route.outage_calls.map_or(6, |c| c[1]))
                .contains(&call) =>
        {
            return Err(mock_error(
                speaks,
                StatusCode::SERVICE_UNAVAILABLE,
                "mock outage",
            ));
        }
        Some(f @ (Fault::Unavailable | Fault::AccessDenied)) => {
            let (status, text) = if f == Fault::AccessDenied {
                (StatusCode::FORBIDDEN, "mock denies access")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "mock overloaded")
            };
            return Err(mock_error(speaks, status, text));
        }
        Some(Fault::Reset) => {
            if let Some(c) = conn {
                c.0.notify_one();
            }
            // The connection task drops the connection, and this call with it.
            return Err(std::future::pending().await);
        }
        Some(Fault::NoAnswer) => {
            hang(route).await;
            // Closes the connection without an answer.
            if let Some(c) = conn {
                c.0.notify_one();
            }
            return Err(std::future::pending().await);
        }
        Some(Fault::ContextLengthExceeded) => {
            return Err(invalid(
                json!("context_length_exceeded"),
                context_message(speaks),
            ));
        }
        Some(Fault::ContentFilter) => {
            return Err(native_refusal(speaks).unwrap_or_else(|| {
                invalid(
                    json!("content_filter"),
                    "The response was filtered due to the prompt triggering the content management policy.",
                )
            }));
        }
        Some(Fault::PrefillRejected) => {
            return Err(invalid(
                serde_json::Value::Null,
                "This model does not support assistant message prefill. The conversation must end with a user message.",
            ));
        }
        _ => {}
    }
    Ok(())
}

/// The route's error rates, for a call the fault let through: the error answer when `u`
/// (uniform in [0, 1)) falls in one of the bands 500, 503, 429, 400, in this order.
fn error_rates(route: &RouteProfile, speaks: Speaks, u: f64) -> Option<Response> {
    let mut edge = route.error_500;
    if u < edge {
        return Some(mock_error(
            speaks,
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock internal error",
        ));
    }
    edge += route.error_503;
    if u < edge {
        return Some(mock_error(
            speaks,
            StatusCode::SERVICE_UNAVAILABLE,
            "mock overloaded",
        ));
    }
    edge += route.error_429;
    if u < edge {
        return Some(rate_limited(speaks, route.retry_after_s));
    }
    edge += route.error_400;
    if u < edge {
        return Some(match &route.error_400_code {
            Some(code) => error_answer(
                speaks,
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &json!(code),
                "mock rejects this request",
            ),
            None => mock_error(speaks, StatusCode::BAD_REQUEST, "mock rejects this request"),
        });
    }
    None
}

/// Counts a call that carried a key: a bearer token, or the native hosts' key headers.
fn count_auth(state: &MockState, headers: &HeaderMap) {
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("Bearer "));
    let native = ["x-api-key", "api-key", "x-goog-api-key"]
        .iter()
        .any(|h| headers.get(*h).is_some_and(|v| !v.is_empty()));
    if bearer || native || sigv4_problem(headers).is_none() {
        state.counters.authorized.fetch_add(1, Ordering::Relaxed);
    }
}

/// What is wrong with a request's AWS Signature Version 4 for Bedrock, if anything: the
/// `Authorization` header's form (`AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/bedrock/
/// aws4_request, SignedHeaders=..., Signature=...`), `x-amz-date` present and signed, and a
/// session token, when sent, signed too.
fn sigv4_problem(headers: &HeaderMap) -> Option<&'static str> {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let Some(auth) = header("authorization") else {
        return Some("Missing Authentication Token");
    };
    let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256 Credential=") else {
        return Some("Authorization header requires the AWS4-HMAC-SHA256 algorithm");
    };
    let mut parts = rest.split(", ");
    let scope = parts.next().unwrap_or_default();
    let signed = parts
        .next()
        .and_then(|p| p.strip_prefix("SignedHeaders="))
        .unwrap_or_default();
    let signature = parts
        .next()
        .and_then(|p| p.strip_prefix("Signature="))
        .unwrap_or_default();
    let scope_parts: Vec<&str> = scope.split('/').collect();
    if scope_parts.len() != 5 || scope_parts[3] != "bedrock" || scope_parts[4] != "aws4_request" {
        return Some("Credential should be scoped to correct service: 'bedrock'.");
    }
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Some("Authorization header requires a 64-digit hex Signature");
    }
    let signed: Vec<&str> = signed.split(';').collect();
    if header("x-amz-date").is_none()
        || !signed.contains(&"x-amz-date")
        || !signed.contains(&"host")
    {
        return Some("Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header, signed with the host");
    }
    if header("x-amz-security-token").is_some() && !signed.contains(&"x-amz-security-token") {
        return Some("The security token included in the request is not signed");
    }
    None
}

/// The request body as JSON, whatever its `Content-Type` (the gateway is as lenient).
fn json_body(speaks: Speaks, body: &Bytes) -> Result<serde_json::Value, Box<Response>> {
    serde_json::from_slice(body).map_err(|e| {
        Box::new(mock_error(
            speaks,
            StatusCode::BAD_REQUEST,
            &format!("the body is not JSON: {e}"),
        ))
    })
}

/// `slow_first_token`'s wait.
fn first_token_delay(route: &RouteProfile, fault: Option<Fault>) -> std::time::Duration {
    if fault == Some(Fault::SlowFirstToken) {
        std::time::Duration::from_secs_f64(route.first_token_delay_ms.unwrap_or(1000.0) / 1000.0)
    } else {
        std::time::Duration::ZERO
    }
}

async fn chat(
    State(state): State<Arc<MockState>>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::OpenAi,
        None,
    )
    .await
}

async fn azure_chat(
    State(state): State<Arc<MockState>>,
    axum::extract::Path(deployment): axum::extract::Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !query
        .unwrap_or_default()
        .split('&')
        .any(|kv| kv.starts_with("api-version="))
    {
        return mock_error(
            Speaks::Azure,
            StatusCode::NOT_FOUND,
            "Resource not found (the api-version query parameter is missing)",
        );
    }
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::Azure,
        Some(&deployment),
    )
    .await
}

async fn anthropic_messages(
    State(state): State<Arc<MockState>>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::Anthropic,
        None,
    )
    .await
}

/// `POST /v1beta/models/{model}:{method}`: the model and the method share a path segment.
async fn gemini_call(
    State(state): State<Arc<MockState>>,
    axum::extract::Path(call): axum::extract::Path<String>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match call.split_once(':') {
        Some((model, "generateContent" | "streamGenerateContent")) => {
            let stream = call.ends_with(":streamGenerateContent");
            let speaks = Speaks::Gemini;
            let mut body = match json_body(speaks, &body) {
                Ok(b) => b,
                Err(r) => return *r,
            };
            // As Gemini 3 does: a function call returned without its thought signature is
            // refused.
            if lost_thought_signature(&body) {
                return mock_error(
                    speaks,
                    StatusCode::BAD_REQUEST,
                    "Function call is missing a thought_signature in functionCall parts.",
                );
            }
            if mismatched_function_responses(&body) {
                return mock_error(
                    speaks,
                    StatusCode::BAD_REQUEST,
                    "Please ensure that the function response parts match the function call parts of the function call turn.",
                );
            }
            // Gemini's method says whether to stream; the shared path reads `stream`.
            if let Some(o) = body.as_object_mut() {
                if o.contains_key("stream") {
                    return mock_error(speaks, StatusCode::BAD_REQUEST, "Invalid JSON payload received. Unknown name \"stream\": Cannot find field.");
                }
                o.insert("stream".into(), json!(stream));
            }
            let bytes = Bytes::from(body.to_string());
            serve_chat(
                &state,
                conn.as_deref(),
                &headers,
                &bytes,
                speaks,
                Some(model),
            )
            .await
        }
        _ => mock_error(Speaks::Gemini, StatusCode::NOT_FOUND, "no such method"),
    }
}

/// Whether a model turn's first `functionCall` part (the one Gemini signs) came back without
/// its `thoughtSignature`.
fn lost_thought_signature(body: &serde_json::Value) -> bool {
    turns(body).any(|parts| {
        parts
            .iter()
            .find(|p| p.get("functionCall").is_some())
            .is_some_and(|p| p.get("thoughtSignature").is_none())
    })
}

/// Whether a turn of `functionResponse` parts names other functions than the calls of the
/// turn before it (Gemini matches each result to a call).
fn mismatched_function_responses(body: &serde_json::Value) -> bool {
    let names = |parts: &[serde_json::Value], kind: &str| -> Vec<String> {
        let mut n: Vec<String> = parts
            .iter()
            .filter_map(|p| p.get(kind).and_then(|c| c["name"].as_str()))
            .map(str::to_owned)
            .collect();
        n.sort_unstable();
        n
    };
    let all: Vec<&Vec<serde_json::Value>> = turns(body).collect();
    all.windows(2).any(|w| {
        let results = names(w[1], "functionResponse");
        !results.is_empty() && results != names(w[0], "functionCall")
    })
}

/// The parts of each turn of a Gemini request's `contents`.
fn turns(body: &serde_json::Value) -> impl Iterator<Item = &Vec<serde_json::Value>> {
    body["contents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|turn| turn["parts"].as_array())
}

/// `POST /model/{model}/converse` and `/converse-stream`: Bedrock's Converse, SigV4-signed.
async fn bedrock_call(
    State(state): State<Arc<MockState>>,
    axum::extract::Path((model, method)): axum::extract::Path<(String, String)>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let speaks = Speaks::Bedrock;
    let stream = match method.as_str() {
        "converse" => false,
        "converse-stream" => true,
        _ => {
            return bedrock_error(
                StatusCode::NOT_FOUND,
                "UnknownOperationException",
                "no such operation",
            )
        }
    };
    if let Some(problem) = sigv4_problem(&headers) {
        state.counters.chat.fetch_add(1, Ordering::Relaxed);
        let name = if headers.contains_key("authorization") {
            "IncompleteSignatureException"
        } else {
            "MissingAuthenticationTokenException"
        };
        return bedrock_error(StatusCode::FORBIDDEN, name, problem);
    }
    if headers.contains_key("x-amz-security-token") {
        state
            .counters
            .session_tokens
            .fetch_add(1, Ordering::Relaxed);
    }
    let mut json = match json_body(speaks, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if let Some(o) = json.as_object_mut() {
        if let Some(k) = ["stream", "model"].iter().find(|k| o.contains_key(**k)) {
            state.counters.chat.fetch_add(1, Ordering::Relaxed);
            return bedrock_error(
                StatusCode::BAD_REQUEST,
                "ValidationException",
                &format!("Malformed input request: extraneous key [{k}] is not permitted"),
            );
        }
        // The URL says whether to stream; the shared path reads `stream`.
        o.insert("stream".into(), json!(stream));
    }
    let route = state.profile.chat_for(Some(&model));
    if route.fault == Some(Fault::AccessDenied) && route.healthy_calls == 0 {
        state.counters.chat.fetch_add(1, Ordering::Relaxed);
        // AWS's signature errors quote the canonical request, signed headers and all.
        let echoed: Vec<String> = headers
            .iter()
            .filter_map(|(k, v)| Some(format!("{k}:{}", v.to_str().ok()?)))
            .collect();
        return bedrock_error(
            StatusCode::FORBIDDEN,
            "InvalidSignatureException",
            &format!(
                "The request signature we calculated does not match the signature you provided. The Canonical String for this request should have been\n'POST\n/model/{model}/{method}\n\n{}'",
                echoed.join("\n")
            ),
        );
    }
    let bytes = Bytes::from(json.to_string());
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &bytes,
        speaks,
        Some(&model),
    )
    .await
}

/// What a native route refuses that its host would: a missing required field or header, or a
/// member of OpenAI's API that is not the host's.
fn native_request_problem(
    speaks: Speaks,
    headers: &HeaderMap,
    body: &serde_json::Value,
) -> Option<String> {
    let (allowed, required): (&[&str], &[&str]) = match speaks {
        Speaks::OpenAi | Speaks::Azure => return None,
        Speaks::Anthropic => {
            if headers.get("anthropic-version").is_none() {
                return Some("anthropic-version: header is required".into());
            }
            (
                &[
                    "model",
                    "messages",
                    "max_tokens",
                    "system",
                    "temperature",
                    "top_p",
                    "top_k",
                    "stop_sequences",
                    "stream",
                    "tools",
                    "tool_choice",
                    "metadata",
                    "thinking",
                    "service_tier",
                ],
                &["model", "messages", "max_tokens"],
            )
        }
        Speaks::Gemini => (
            // `stream` is the mock's own note of the method (see `gemini_call`).
            &[
                "contents",
                "systemInstruction",
                "tools",
                "toolConfig",
                "generationConfig",
                "safetySettings",
                "cachedContent",
                "stream",
            ],
            &["contents"],
        ),
        Speaks::Bedrock => (
            // `stream` is the mock's own note of the method (see `bedrock_call`).
            &[
                "messages",
                "system",
                "inferenceConfig",
                "toolConfig",
                "guardrailConfig",
                "additionalModelRequestFields",
                "additionalModelResponseFieldPaths",
                "promptVariables",
                "requestMetadata",
                "performanceConfig",
                "stream",
            ],
            &["messages"],
        ),
    };
    let obj = body.as_object()?;
    if let Some(extra) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Some(format!("{extra}: Extra inputs are not permitted"));
    }
    if let Some(missing) = required.iter().find(|k| !obj.contains_key(**k)) {
        return Some(format!("{missing}: Field required"));
    }
    if speaks == Speaks::Anthropic
        && obj["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "system"))
    {
        return Some(
            "messages: Unexpected role \"system\"; use the top-level `system` parameter".into(),
        );
    }
    None
}

/// The name of the first tool of a request, which the answer calls; none once the
/// conversation's last turn carries tool results (the answer to them is text, so a client's
/// tool loop ends).
fn first_tool(speaks: Speaks, body: &serde_json::Value) -> Option<String> {
    let (pointer, turns, result) = match speaks {
        Speaks::OpenAi | Speaks::Azure => ("/tools/0/function/name", "/messages", "tool"),
        Speaks::Anthropic => ("/tools/0/name", "/messages", "tool_result"),
        Speaks::Gemini => (
            "/tools/0/functionDeclarations/0/name",
            "/contents",
            "functionResponse",
        ),
        Speaks::Bedrock => (
            "/toolConfig/tools/0/toolSpec/name",
            "/messages",
            "toolResult",
        ),
    };
    let last = body
        .pointer(turns)
        .and_then(serde_json::Value::as_array)
        .and_then(|t| t.last());
    // A tool message (OpenAI's role), or a turn ending with a result block or part (the
    // native turns' content; a question after the results asks again).
    let answered = last.is_some_and(|turn| {
        turn["role"] == result
            || ["content", "parts"].iter().any(|k| {
                turn[k]
                    .as_array()
                    .and_then(|blocks| blocks.last())
                    .is_some_and(|b| b["type"] == result || b.get(result).is_some())
            })
    });
    if answered {
        return None;
    }
    body.pointer(pointer)
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// The id of the mock's OpenAI tool call.
const OPENAI_CALL_ID: &str = "call_mock";

/// An OpenAI stream's finish with a call of `tool` instead: the call's chunks (its id and
/// name, then its arguments in two pieces) and `finish_reason = "tool_calls"`.
fn call_in_stream(chunks: &mut Vec<String>, model: &str, tool: &str) {
    let Some(at) = chunks
        .iter()
        .position(|c| c.contains("\"finish_reason\":\"stop\""))
    else {
        return;
    };
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let call = |c: serde_json::Value| json!({"tool_calls": [c]});
    let mut calling = vec![chunk(
        call(json!({"index": 0, "id": OPENAI_CALL_ID, "type": "function",
            "function": {"name": tool, "arguments": ""}})),
        serde_json::Value::Null,
    )];
    for piece in ["{\"q\": ", "\"mock\"}"] {
        calling.push(chunk(
            call(json!({"index": 0, "function": {"arguments": piece}})),
            serde_json::Value::Null,
        ));
    }
    calling.push(chunk(json!({}), json!("tool_calls")));
    chunks.splice(at..=at, calling);
}

/// A chat call of any dialect: `model` is the URL's when the dialect puts it there.
async fn serve_chat(
    state: &MockState,
    conn: Option<&Connection>,
    headers: &HeaderMap,
    body: &Bytes,
    speaks: Speaks,
    url_model: Option<&str>,
) -> Response {
    state.counters.chat.fetch_add(1, Ordering::Relaxed);
    count_auth(state, headers);
    let body = match json_body(speaks, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if let Some(problem) = native_request_problem(speaks, headers, &body) {
        return mock_error(speaks, StatusCode::BAD_REQUEST, &problem);
    }
    if let Ok(mut last) = state.last_chat.lock() {
        *last = Some(body.clone());
    }
    let model = url_model
        .or_else(|| body.get("model").and_then(serde_json::Value::as_str))
        .unwrap_or("mock-model");
    let call = state.counters.count_model(model);
    let mut route = state.profile.chat_for(Some(model));
    let healthy;
    if call <= route.healthy_calls {
        healthy = RouteProfile {
            fault: None,
            fault_mix: BTreeMap::new(),
            ..route.clone()
        };
        route = &healthy;
    }
    let fault = match behave(state, route, call, conn, speaks).await {
        Ok(fault) => fault,
        Err(r) => return r,
    };
    let tool = first_tool(speaks, &body);
    if body.get("stream").and_then(serde_json::Value::as_bool) == Some(true) {
        if fault == Some(Fault::EndlessStream) {
            return endless_stream(route, model, &state.streams_open);
        }
        let text = |events: Vec<String>| events.into_iter().map(Bytes::from).collect();
        let (chunks, content_type) = match speaks {
            Speaks::OpenAi | Speaks::Azure => {
                let mut chunks = faulty_stream_chunks(model, fault);
                if let Some(t) = &tool {
                    call_in_stream(&mut chunks, model, t);
                }
                if wants_usage(&body) && chunks.last().is_some_and(|c| c.contains("[DONE]")) {
                    chunks.insert(chunks.len() - 1, usage_chunk(model));
                }
                (text(chunks), "text/event-stream")
            }
            Speaks::Anthropic => {
                let mut events = anthropic_stream_events(model, tool.as_deref());
                if let Some(rest) = prefilled_rest(&body) {
                    continue_prefill(&mut events, &rest);
                }
                (text(with_fault(events, fault, true)), "text/event-stream")
            }
            Speaks::Gemini => (
                text(with_fault(
                    gemini_stream_events(model, &gemini_tools(&body, tool.clone())),
                    fault,
                    false,
                )),
                "text/event-stream",
            ),
            Speaks::Bedrock => (
                bedrock_stream_frames(tool.as_deref(), fault),
                "application/vnd.amazon.eventstream",
            ),
        };
        return stream_answer(route, chunks, fault, content_type);
    }
    tokio::time::sleep(first_token_delay(route, fault)).await;
    Json(match speaks {
        Speaks::OpenAi | Speaks::Azure => {
            let mut message = json!({"role": "assistant", "content": route.content});
            if let Some(t) = &tool {
                message["tool_calls"] = json!([{"id": OPENAI_CALL_ID, "type": "function",
                    "function": {"name": t, "arguments": "{\"q\":\"mock\"}"}}]);
            }
            json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message,
                    "finish_reason": if tool.is_some() { "tool_calls" } else { "stop" }}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            })
        }
        Speaks::Anthropic => anthropic_answer(model, &route.content, tool.as_deref()),
        Speaks::Gemini => gemini_answer(model, &route.content, &gemini_tools(&body, tool.clone())),
        Speaks::Bedrock => bedrock_answer(&route.content, tool.as_deref()),
    })
    .into_response()
}

/// The mock's Converse answer: the route's text, then a call of `tool` if given.
#[must_use]
pub fn bedrock_answer(text: &str, tool: Option<&str>) -> serde_json::Value {
    let mut content = vec![json!({ "text": text })];
    if let Some(t) = tool {
        content.push(
            json!({"toolUse": {"toolUseId": "tooluse_mock", "name": t, "input": {"q": "mock"}}}),
        );
    }
    json!({"output": {"message": {"role": "assistant", "content": content}},
        "stopReason": if tool.is_some() { "tool_use" } else { "end_turn" },
        "usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7, "cacheReadInputTokens": 0},
        "metrics": {"latencyMs": 20}})
}

/// The frames of the mock's `ConverseStream` answer (AWS event-stream framing), ending with
/// `messageStop` and `metadata`, with the faults that change what is sent: `malformed_chunk`
/// corrupts the third frame's CRC, `no_done_finished` drops `metadata`, `no_done_unfinished`
/// drops `messageStop` too.
#[must_use]
pub fn bedrock_stream_frames(tool: Option<&str>, fault: Option<Fault>) -> Vec<Bytes> {
    use crate::upstream::eventstream::event;
    let mut out = vec![event("messageStart", &json!({"role": "assistant"}))];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": word}}),
        ));
    }
    out.push(event("contentBlockStop", &json!({"contentBlockIndex": 0})));
    if let Some(t) = tool {
        out.push(event(
            "contentBlockStart",
            &json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tooluse_mock", "name": t}}}),
        ));
        for piece in ["{\"q\": ", "\"mock\"}"] {
            out.push(event(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": piece}}}),
            ));
        }
        out.push(event("contentBlockStop", &json!({"contentBlockIndex": 1})));
    }
    let stop = if tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    out.push(event("messageStop", &json!({ "stopReason": stop })));
    out.push(event(
        "metadata",
        &json!({"usage": {"inputTokens": 5, "outputTokens": 3, "totalTokens": 8}, "metrics": {"latencyMs": 20}}),
    ));
    match fault {
        Some(Fault::MalformedChunk) => {
            if let Some(last) = out[2].last_mut() {
                *last ^= 0xff;
            }
        }
        Some(Fault::NoDoneFinished) => out.truncate(out.len() - 1),
        Some(Fault::NoDoneUnfinished) => out.truncate(out.len() - 2),
        _ => {}
    }
    out.into_iter().map(Bytes::from).collect()
}

/// The mock's Messages answer: the route's text, then a call of `tool` if given.
#[must_use]
pub fn anthropic_answer(model: &str, text: &str, tool: Option<&str>) -> serde_json::Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    if let Some(t) = tool {
        content.push(
            json!({"type": "tool_use", "id": "toolu_mock", "name": t, "input": {"q": "mock"}}),
        );
    }
    json!({"id": "msg_mock", "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": if tool.is_some() { "tool_use" } else { "end_turn" },
        "stop_sequence": null,
        "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1, "output_tokens": 2}})
}

/// The thought signature of the mock's Gemini function calls.
pub const MOCK_THOUGHT_SIGNATURE: &str = "c2lnLW1vY2s=";

/// The mock's `GenerateContentResponse`: the route's text, then a call of `tool` if given.
#[must_use]
pub fn gemini_answer(model: &str, text: &str, tools: &[String]) -> serde_json::Value {
    let mut parts = vec![json!({"text": text})];
    parts.extend(gemini_calls(tools));
    json!({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 2, "totalTokenCount": 6},
        "modelVersion": model, "responseId": "mock-response"})
}

/// The events of the mock's streamed Messages answer, ending with `message_stop`.
#[must_use]
pub fn anthropic_stream_events(model: &str, tool: Option<&str>) -> Vec<String> {
    let event = |name: &str, data: serde_json::Value| format!("event: {name}\ndata: {data}\n\n");
    let mut out = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": word}}),
        ));
    }
    out.push(event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    if let Some(t) = tool {
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_mock", "name": t, "input": {}}}),
        ));
        for piece in ["{\"q\": ", "\"mock\"}"] {
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        out.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ));
    }
    let stop = if tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    out.push(event(
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 3}}),
    ));
    out.push(event("message_stop", json!({"type": "message_stop"})));
    out
}

/// The mock's streamed answer's text after an assistant prefill (the conversation's last
/// turn, Anthropic's shape) that begins it, as a model that takes prefills goes on from it.
fn prefilled_rest(body: &serde_json::Value) -> Option<String> {
    let last = body.pointer("/messages")?.as_array()?.last()?;
    if last["role"] != "assistant" {
        return None;
    }
    let prefill = match &last["content"] {
        serde_json::Value::String(t) => t.clone(),
        blocks => blocks
            .as_array()?
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect(),
    };
    "mock streamed answer"
        .strip_prefix(prefill.as_str())
        .filter(|_| !prefill.is_empty())
        .map(str::to_owned)
}

/// Replaces the text deltas of Anthropic `events` by one with `rest`.
fn continue_prefill(events: &mut Vec<String>, rest: &str) {
    let Some(at) = events.iter().position(|e| e.contains("\"text_delta\"")) else {
        return;
    };
    events.retain(|e| !e.contains("\"text_delta\""));
    let delta = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": rest}});
    events.insert(at, format!("event: content_block_delta\ndata: {delta}\n\n"));
}

/// The events of the mock's streamed Gemini answer (`alt=sse`): no end marker, the last
/// event carries the finish reason and the usage.
#[must_use]
pub fn gemini_stream_events(model: &str, tools: &[String]) -> Vec<String> {
    let event = |parts: serde_json::Value, finish: Option<&str>| {
        let mut c = json!({"content": {"role": "model", "parts": parts}, "index": 0});
        let mut e = json!({"candidates": [], "modelVersion": model, "responseId": "mock-response"});
        if let Some(f) = finish {
            c["finishReason"] = json!(f);
            e["usageMetadata"] =
                json!({"promptTokenCount": 4, "candidatesTokenCount": 3, "totalTokenCount": 7});
        }
        e["candidates"] = json!([c]);
        format!("data: {e}\r\n\r\n")
    };
    let mut out: Vec<String> = ["mock ", "streamed "]
        .iter()
        .map(|w| event(json!([{"text": w}]), None))
        .collect();
    let mut last = vec![json!({"text": "answer"})];
    last.extend(gemini_calls(tools));
    out.push(event(json!(last), Some("STOP")));
    out
}

/// The mock's Gemini function calls, one per tool: as Gemini 3 does with parallel calls, the
/// first carries a thought signature, which the next turn must return.
fn gemini_calls(tools: &[String]) -> impl Iterator<Item = serde_json::Value> + '_ {
    tools.iter().enumerate().map(|(i, t)| {
        let mut part = json!({"functionCall": {"name": t, "args": {"q": "mock"}}});
        if i == 0 {
            part["thoughtSignature"] = json!(MOCK_THOUGHT_SIGNATURE);
        }
        part
    })
}

/// The tools a Gemini answer calls: the first declared function, and the second when there
/// is one (two calls in one answer, as Gemini makes parallel calls); none after a result.
fn gemini_tools(body: &serde_json::Value, first: Option<String>) -> Vec<String> {
    let Some(first) = first else {
        return Vec::new();
    };
    let second = body
        .pointer("/tools/0/functionDeclarations/1/name")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    std::iter::once(first).chain(second).collect()
}

/// A native stream with the faults that change what is sent; `marker`: the stream ends with
/// an end event of its own (Anthropic's `message_stop`; Gemini's has none).
fn with_fault(mut events: Vec<String>, fault: Option<Fault>, marker: bool) -> Vec<String> {
    match fault {
        Some(Fault::MalformedChunk) => MALFORMED_CHUNK.clone_into(&mut events[2]),
        Some(Fault::NoDoneFinished) if marker => events.truncate(events.len() - 1),
        Some(Fault::NoDoneUnfinished) => events.truncate(events.len() - 1 - usize::from(marker)),
        _ => {}
    }
    events
}

/// The chunks of the mock's streamed answer, in OpenAI's format, ending with `[DONE]`.
#[must_use]
pub fn stream_chunks(model: &str) -> Vec<String> {
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        serde_json::Value::Null,
    )];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(chunk(json!({"content": word}), serde_json::Value::Null));
    }
    out.push(chunk(json!({}), json!("stop")));
    out.push("data: [DONE]\n\n".to_owned());
    out
}

/// Whether a chat request asks for the usage chunk (`stream_options.include_usage`).
fn wants_usage(body: &serde_json::Value) -> bool {
    body.pointer("/stream_options/include_usage")
        .and_then(serde_json::Value::as_bool)
        == Some(true)
}

/// The chunk OpenAI sends before `[DONE]` when asked (`stream_options.include_usage`): no
/// choices, the usage of the mock's answer (3 prompt and 2 completion tokens, as unstreamed).
fn usage_chunk(model: &str) -> String {
    let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
    format!("data: {c}\n\n")
}

/// The event `malformed_chunk` sends in place of the third: `data:` that is not JSON.
pub const MALFORMED_CHUNK: &str = "data: {\"id\": \"chatcmpl-mock\", \"choices\": [\n\n";

/// The chunks a route's stream sends, with its fault applied: [`stream_chunks`] but for the
/// faults that change what is sent.
#[must_use]
pub fn faulty_stream_chunks(model: &str, fault: Option<Fault>) -> Vec<String> {
    let mut chunks = stream_chunks(model);
    match fault {
        Some(Fault::MalformedChunk) => MALFORMED_CHUNK.clone_into(&mut chunks[2]),
        Some(Fault::NoDoneFinished) => chunks.truncate(chunks.len() - 1),
        Some(Fault::NoDoneUnfinished) => chunks.truncate(chunks.len() - 2),
        _ => {}
    }
    chunks
}

fn stream_answer(
    route: &RouteProfile,
    chunks: Vec<Bytes>,
    fault: Option<Fault>,
    content_type: &'static str,
) -> Response {
    let gap = std::time::Duration::from_secs_f64(route.chunk_gap_ms / 1000.0);
    let first_delay = first_token_delay(route, fault);
    let hang_ms = route.hang_ms;
    let (cut, stall) = match fault {
        Some(Fault::StreamCut) => (Some(route.stream_cut_after.unwrap_or(2)), None),
        Some(Fault::StreamStall) => (None, Some(route.stream_stall_after.unwrap_or(2))),
        _ => (route.stream_cut_after, route.stream_stall_after),
    };
    let stream = futures_util::stream::unfold((0usize, chunks), move |(i, chunks)| async move {
        if cut == Some(i) {
            // An error item makes the server drop the connection mid-body; waiting the gap
            // first lets the chunks before it go out (else the last may die in the buffer).
            tokio::time::sleep(gap).await;
            return Some((Err(std::io::Error::other("cut")), (usize::MAX, chunks)));
        }
        if stall == Some(i) {
            match hang_ms {
                // Then the connection breaks, as a cut stream.
                Some(ms) => {
                    tokio::time::sleep(std::time::Duration::from_secs_f64(ms / 1000.0)).await;
                    return Some((Err(std::io::Error::other("stalled")), (usize::MAX, chunks)));
                }
                None => std::future::pending::<()>().await,
            }
        }
        let next = chunks.get(i)?.clone();
        tokio::time::sleep(if i > 0 { gap } else { first_delay }).await;
        Some((Ok::<_, std::io::Error>(next), (i + 1, chunks)))
    });
    let mut r = axum::body::Body::from_stream(stream).into_response();
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static(content_type),
    );
    r
}

/// Counts a streamed answer as open until it is dropped (sent whole, or its connection gone).
struct OpenStream(Arc<AtomicU64>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A streamed answer that never ends: 16 KiB content chunks every `chunk_gap_ms`.
fn endless_stream(route: &RouteProfile, model: &str, open: &Arc<AtomicU64>) -> Response {
    open.fetch_add(1, Ordering::Relaxed);
    let guard = OpenStream(open.clone());
    let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [{"index": 0, "delta": {"content": "x".repeat(16 * 1024)}, "finish_reason": null}]});
    let chunk = Bytes::from(format!("data: {c}\n\n"));
    let gap = std::time::Duration::from_secs_f64(route.chunk_gap_ms / 1000.0);
    let stream = futures_util::stream::unfold(guard, move |guard| {
        let chunk = chunk.clone();
        async move {
            tokio::time::sleep(gap).await;
            Some((Ok::<_, std::io::Error>(chunk), guard))
        }
    });
    let mut r = axum::body::Body::from_stream(stream).into_response();
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    r
}

async fn search(
    State(state): State<Arc<MockState>>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = state.counters.search.fetch_add(1, Ordering::Relaxed) + 1;
    count_auth(&state, &headers);
    let body = match json_body(Speaks::OpenAi, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let fault = match behave(
        &state,
        &state.profile.search,
        call,
        conn.as_deref(),
        Speaks::OpenAi,
    )
    .await
    {
        Ok(fault) => fault,
        Err(r) => return r,
    };
    tokio::time::sleep(first_token_delay(&state.profile.search, fault)).await;
    Json(json!({"query": body.get("query"), "results": [{"title": "mock result", "url": "https://example.invalid/mock"}]})).into_response()
}

async fn stats(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    let models = state
        .counters
        .models
        .lock()
        .map_or_else(|_| json!({}), |m| json!(*m));
    let last_chat = state
        .last_chat
        .lock()
        .map_or(serde_json::Value::Null, |b| b.clone().unwrap_or_default());
    Json(json!({
        "chat": state.counters.chat.load(Ordering::Relaxed),
        "search": state.counters.search.load(Ordering::Relaxed),
        "authorized": state.counters.authorized.load(Ordering::Relaxed),
        "session_tokens": state.counters.session_tokens.load(Ordering::Relaxed),
        "streams_open": state.streams_open.load(Ordering::Relaxed),
        "models": models,
        "last_chat": last_chat,
    }))
}

#[cfg(test)]
mod tests {
    use super::{
        latency_of, mixed_fault, Counters, Fault, LatencyShapeSpec, MockProfile,
        MAX_COUNTED_MODELS, OTHER_MODELS,
    };
    use rand::SeedableRng;

    #[test]
    fn a_profile_names_the_field_at_fault() {
        let err = |text: &str| MockProfile::from_toml(text, "m.toml").unwrap_err();
        let e = err("[chat]\nerror_500 = \"often\"\n");
        assert!(e.starts_with("m.toml: `chat.error_500`:"), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = err("[search]\nlatency_ms = 5\n");
        assert!(
            e.contains("`search.latency_ms`") && e.contains("unknown field"),
            "{e}"
        );
        let e = err("[chat]\nerror_429 = 1.5\n");
        assert_eq!(
            e,
            "m.toml: `chat.error_429`: a probability from 0 to 1, got 1.5"
        );
        let e = err("[chat]\nerror_500 = 0.6\nerror_503 = 0.6\n");
        assert!(e.contains("must be at most 1, got 1.2"), "{e}");
        let e = err("[search]\nlatency = { p50_ms = 30, p95_ms = 10 }\n");
        assert!(
            e.starts_with("m.toml: `search.latency`: needs 0 < p50_ms ≤ p95_ms"),
            "{e}"
        );
        let e = err("[chat]\nretry_after_s = -1\n");
        assert!(e.contains("`chat.retry_after_s`"), "{e}");
        // A model's table is checked like a route, and names the model.
        let e = err("[models.\"m-1\"]\nfault = \"exploding\"\n");
        assert!(
            e.contains("`models.m-1.fault`") && e.contains("unknown variant"),
            "{e}"
        );
        let e = err("[models.m]\nfault = \"slow_first_token\"\nfirst_token_delay_ms = -5\n");
        assert_eq!(
            e,
            "m.toml: `models.m.first_token_delay_ms`: milliseconds ≥ 0, got -5"
        );
        let p = MockProfile::from_toml(
            "[chat]\nfault = \"unavailable\"\n[models.\"gpt-x\"]\nfault = \"flapping\"\n",
            "m.toml",
        )
        .unwrap();
        assert_eq!(p.chat_for(Some("gpt-x")).fault, Some(Fault::Flapping));
        assert_eq!(p.chat_for(Some("other")).fault, Some(Fault::Unavailable));
        // The throughput variant: no latency at all, and the defaults.
        let p = MockProfile::from_toml("[chat]\nlatency = { p50_ms = 0, p95_ms = 0 }\n", "m.toml")
            .unwrap();
        assert_eq!(
            (&p.chat.latency, &p.search.latency),
            (
                &LatencyShapeSpec::log_normal(0.0, 0.0),
                &LatencyShapeSpec::log_normal(20.0, 20.0)
            )
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        assert_eq!(latency_of(&p.chat, &mut rng), std::time::Duration::ZERO);
    }

    /// The p-quantile (in ms) of `n` draws of the chat route's latency.
    fn quantiles(profile: &MockProfile, n: usize, qs: &[f64]) -> Vec<f64> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut v: Vec<f64> = (0..n)
            .map(|_| latency_of(&profile.chat, &mut rng).as_secs_f64() * 1000.0)
            .collect();
        v.sort_by(f64::total_cmp);
        qs.iter().map(|q| v[(q * n as f64) as usize]).collect()
    }

    #[test]
    fn a_heavy_tailed_latency_is_drawn_as_written() {
        let parse = |text: &str| MockProfile::from_toml(text, "m.toml");
        // A Pareto tail beyond the body's p95: p50 and p95 stay the body's, p99 and p99.9
        // follow P(L > x) = 0.05·(p95/x)^α, far beyond the log-normal's.
        let tail =
            parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80, tail = { shape = 1.5 } }\n")
                .unwrap();
        let plain = parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80 }\n").unwrap();
        let qs = [0.5, 0.95, 0.99, 0.999];
        let (t, l) = (
            quantiles(&tail, 200_000, &qs),
            quantiles(&plain, 200_000, &qs),
        );
        // Sampling error: the p99.9 of 200,000 draws has 200 beyond it (±3σ ≈ ±21% of them,
        // ±14% in x as x ∝ count^(−1/1.5)); the p99 2,000 (±7% of them, ±5% in x).
        let near = |x: f64, want: f64, tol: f64| (x / want - 1.0).abs() < tol;
        assert!(near(t[0], 40.0, 0.05) && near(t[1], 80.0, 0.05), "{t:?}");
        assert!(near(t[2], 80.0 * 5f64.powf(1.0 / 1.5), 0.05), "p99 {t:?}");
        assert!(
            near(t[3], 80.0 * 50f64.powf(1.0 / 1.5), 0.15),
            "p99.9 {t:?}"
        );
        assert!(t[3] > 5.0 * l[3], "tail {t:?} against log-normal {l:?}");
        // A mixture: 90% fast, 10% slow.
        let mix = parse(
            "[chat]\nlatency = { mixture = [{ weight = 0.9, p50_ms = 10, p95_ms = 12 }, \
             { weight = 0.1, p50_ms = 500, p95_ms = 600 }] }\n",
        )
        .unwrap();
        let m = quantiles(&mix, 20_000, &[0.5, 0.85, 0.95]);
        assert!(m[0] < 12.0 && m[1] < 13.0 && m[2] > 400.0, "{m:?}");
        // Bad shapes name the field and the fix.
        let e = parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80, tail = { shape = 0.9 } }\n")
            .unwrap_err();
        assert!(
            e.starts_with("m.toml: `chat.latency.tail.shape`: must be a number above 1"),
            "{e}"
        );
        let e =
            parse("[chat]\nlatency = { mixture = [{ weight = 0.5, p50_ms = 1, p95_ms = 2 }] }\n")
                .unwrap_err();
        assert!(
            e.contains("`chat.latency.mixture`: the weights must sum to 1"),
            "{e}"
        );
        let e = parse("[chat]\nlatency = { p50_ms = 0, p95_ms = 0, tail = { shape = 2 } }\n")
            .unwrap_err();
        assert!(e.contains("needs 0 < p50_ms"), "{e}");
    }

    #[test]
    fn a_fault_mix_is_checked_and_drawn_by_share() {
        let err = |text: &str| MockProfile::from_toml(text, "m.toml").unwrap_err();
        let e = err("[chat]\nfault_mix = { reset = 0.7, no_answer = 0.4 }\n");
        assert_eq!(
            e,
            "m.toml: `chat.fault_mix`: the shares must add up to at most 1, got 1.1"
        );
        let e = err("[chat]\nfault_mix = { flapping = 0.1 }\n");
        assert!(e.contains("depends on the call history"), "{e}");
        let e = err("[chat]\nfault = \"reset\"\nfault_mix = { no_answer = 0.1 }\n");
        assert!(e.contains("cannot be combined with `fault"), "{e}");
        let e = err("[chat]\nfault_mix = { exploding = 0.1 }\n");
        assert!(e.contains("`chat.fault_mix"), "{e}");
        let e = err("[models.m]\nhang_ms = -1\n");
        assert_eq!(e, "m.toml: `models.m.hang_ms`: milliseconds ≥ 0, got -1");
        let p = MockProfile::from_toml(
            "[chat]\nfault_mix = { reset = 0.1, stream_cut = 0.2 }\nhang_ms = 500\n",
            "m.toml",
        )
        .unwrap();
        // Faults in their declared order (Fault's order): reset on [0, 0.1), stream_cut on
        // [0.1, 0.3), none above (0.31: the float sum 0.1 + 0.2 is a hair over 0.3).
        let mix = &p.chat.fault_mix;
        assert_eq!(mixed_fault(mix, 0.05), Some(Fault::Reset));
        assert_eq!(mixed_fault(mix, 0.1), Some(Fault::StreamCut));
        assert_eq!(mixed_fault(mix, 0.29), Some(Fault::StreamCut));
        assert_eq!(mixed_fault(mix, 0.31), None);
        assert_eq!(mixed_fault(&std::collections::BTreeMap::new(), 0.0), None);
    }

    #[test]
    fn calls_are_counted_per_model_and_the_names_kept_are_bounded() {
        let c = Counters::default();
        for i in 0..MAX_COUNTED_MODELS + 10 {
            let n = c.count_model(&format!("m{i}"));
            // Past the bound, the calls share one count.
            let want = i.saturating_sub(MAX_COUNTED_MODELS - 1).max(1) as u64;
            assert_eq!(n, want, "m{i}");
        }
        assert_eq!(
            c.count_model("m0"),
            2,
            "a model's calls are numbered from 1"
        );
        let models = c.models.lock().unwrap();
        assert_eq!(models.len(), MAX_COUNTED_MODELS + 1);
        assert_eq!(models[OTHER_MODELS], 10);
    }
}
