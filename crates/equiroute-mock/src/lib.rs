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
//! `rate_limit = { requests = N, window_ms = W }` admits N chat calls per window of W ms and
//! announces what is left in every answer's rate-limit headers, OpenAI's or Anthropic's by
//! the route's dialect; a call past it gets a 429 with `Retry-After` (see `limits`).
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
//!
//! `GET /_requests` lists the last 64 chat requests of every route, oldest first, exactly as
//! they came: `{"requests": [{"dialect", "path", "body", "bytes", "truncated"}]}` (`dialect` is
//! the gateway's provider kind, `path` has the query; a body over 64 KiB is kept as its
//! length only, `body: null, truncated: true`). What a test validates the gateway's
//! outgoing bodies against each provider's own request types with.

mod answers;
mod errors;
mod faults;
mod limits;
mod profile;
mod recent;
mod routes;
#[cfg(test)]
mod tests;

pub use answers::{
    anthropic_answer, anthropic_stream_events, bedrock_answer, bedrock_stream_frames,
    faulty_stream_chunks, gemini_answer, gemini_stream_events, stream_chunks, MALFORMED_CHUNK,
    MOCK_THOUGHT_SIGNATURE,
};
pub use profile::{Fault, MockProfile, RouteProfile};

use axum::routing::{get, post};
use axum::Router;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

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
    /// The last chat requests as they came, for `/_requests`.
    recent: recent::Recent,
    /// The windows of the rate-limited routes.
    windows: limits::Windows,
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
        recent: recent::Recent::default(),
        windows: limits::Windows::default(),
    });
    Router::new()
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/messages", post(routes::anthropic_messages))
        .route(
            "/openai/deployments/{deployment}/chat/completions",
            post(routes::azure_chat),
        )
        .route("/v1beta/models/{call}", post(routes::gemini_call))
        .route("/model/{model}/{method}", post(routes::bedrock_call))
        .route("/search", post(routes::search))
        .route("/_stats", get(routes::stats))
        .route("/_requests", get(routes::requests))
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
