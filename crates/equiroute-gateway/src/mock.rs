//! A mock upstream for tests, demos and benchmarks: a real HTTP server speaking the OpenAI
//! chat API (`POST /v1/chat/completions`) and a search-style JSON API (`POST /search`), with
//! per-route latency and error rates (500, 503, 429 with or without `Retry-After`, 400), and
//! call counters at `GET /_stats`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use equiroute_lab::scenario::LatencySpec;
use equiroute_lab::world::latency::LogNormal;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::json;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Behaviour of one route.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteProfile {
    pub latency: LatencySpec,
    pub error_500: f64,
    pub error_503: f64,
    pub error_429: f64,
    /// `Retry-After` seconds sent with a 429 (none when unset).
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
}

impl Default for RouteProfile {
    fn default() -> Self {
        RouteProfile {
            latency: LatencySpec {
                p50_ms: 20.0,
                p95_ms: 20.0,
            },
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
        }
    }
}

/// Behaviour of the whole mock.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockProfile {
    pub chat: RouteProfile,
    pub search: RouteProfile,
}

impl MockProfile {
    /// Parses a profile; `file` names it in errors.
    ///
    /// # Errors
    /// Syntax errors, unknown fields and values out of range, with the field named.
    pub fn from_toml(text: &str, file: &str) -> Result<MockProfile, String> {
        let profile: MockProfile = equiroute_lab::toml_text::parse(text)
            .map_err(|p| format!("{file}: `{}`: {}", p.field, p.fix))?;
        for (name, route) in [("chat", &profile.chat), ("search", &profile.search)] {
            route
                .check()
                .map_err(|(field, fix)| format!("{file}: `{name}.{field}`: {fix}"))?;
        }
        Ok(profile)
    }
}

impl RouteProfile {
    /// The first field out of range, and what it must be.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let l = &self.latency;
        if !(l.p50_ms >= 0.0 && l.p95_ms >= l.p50_ms && l.p95_ms.is_finite()) {
            return Err((
                "latency",
                format!(
                    "needs 0 ≤ p50_ms ≤ p95_ms (finite), got p50_ms = {}, p95_ms = {}",
                    l.p50_ms, l.p95_ms
                ),
            ));
        }
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
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Counters {
    chat: AtomicU64,
    search: AtomicU64,
    authorized: AtomicU64,
}

#[derive(Debug)]
struct MockState {
    profile: MockProfile,
    counters: Counters,
    seq: AtomicU64,
}

/// The mock's router.
pub fn router(profile: MockProfile) -> Router {
    let state = Arc::new(MockState {
        profile,
        counters: Counters::default(),
        seq: AtomicU64::new(1),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/search", post(search))
        .route("/_stats", get(stats))
        .with_state(state)
}

/// Serves the mock on `listener` until `shutdown` resolves.
///
/// # Errors
/// The server fails.
pub async fn serve(
    profile: MockProfile,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(profile))
        .with_graceful_shutdown(shutdown)
        .await
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

/// Waits the route's latency, then decides the outcome: `Err` is an error response.
async fn behave(state: &MockState, route: &RouteProfile) -> Result<(), Response> {
    let n = state.seq.fetch_add(1, Ordering::Relaxed);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n);
    let latency =
        LogNormal::from_p50_p95(route.latency.p50_ms, route.latency.p95_ms).sample(&mut rng);
    precise_sleep(std::time::Duration::from_secs_f64(latency / 1000.0)).await;
    let error = |status: StatusCode, message: &str| {
        (status, Json(json!({"error": {"message": message, "type": "mock_error", "code": status.as_u16()}}))).into_response()
    };
    let u: f64 = rng.random();
    let mut edge = route.error_500;
    if u < edge {
        return Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock internal error",
        ));
    }
    edge += route.error_503;
    if u < edge {
        return Err(error(StatusCode::SERVICE_UNAVAILABLE, "mock overloaded"));
    }
    edge += route.error_429;
    if u < edge {
        let mut r = error(StatusCode::TOO_MANY_REQUESTS, "mock rate limit");
        if let Some(s) = route.retry_after_s {
            if let Ok(v) = axum::http::HeaderValue::from_str(&format!("{s}")) {
                r.headers_mut().insert("retry-after", v);
            }
        }
        return Err(r);
    }
    edge += route.error_400;
    if u < edge {
        let mut r = error(StatusCode::BAD_REQUEST, "mock rejects this request");
        if let Some(code) = &route.error_400_code {
            let body = json!({"error": {"message": "mock rejects this request", "type": "invalid_request_error", "code": code}});
            r = (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
        return Err(r);
    }
    Ok(())
}

fn count_auth(state: &MockState, headers: &HeaderMap) {
    if headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("Bearer "))
    {
        state.counters.authorized.fetch_add(1, Ordering::Relaxed);
    }
}

async fn chat(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> Response {
    state.counters.chat.fetch_add(1, Ordering::Relaxed);
    count_auth(&state, &headers);
    if let Err(r) = behave(&state, &state.profile.chat).await {
        return r;
    }
    let model = body
        .get("model")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("mock-model");
    if body.get("stream").and_then(serde_json::Value::as_bool) == Some(true) {
        return stream_answer(&state.profile.chat, model);
    }
    Json(json!({
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": state.profile.chat.content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    }))
    .into_response()
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

fn stream_answer(route: &RouteProfile, model: &str) -> Response {
    let chunks = stream_chunks(model);
    let gap = std::time::Duration::from_secs_f64(route.chunk_gap_ms / 1000.0);
    let (cut, stall) = (route.stream_cut_after, route.stream_stall_after);
    let stream = futures_util::stream::unfold((0usize, chunks), move |(i, chunks)| async move {
        if cut == Some(i) {
            // An error item makes the server drop the connection mid-body.
            return Some((Err(std::io::Error::other("cut")), (usize::MAX, chunks)));
        }
        if stall == Some(i) {
            std::future::pending::<()>().await;
        }
        let next = chunks.get(i)?.clone();
        if i > 0 {
            tokio::time::sleep(gap).await;
        }
        Some((
            Ok::<_, std::io::Error>(bytes::Bytes::from(next)),
            (i + 1, chunks),
        ))
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
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> Response {
    state.counters.search.fetch_add(1, Ordering::Relaxed);
    count_auth(&state, &headers);
    if let Err(r) = behave(&state, &state.profile.search).await {
        return r;
    }
    Json(json!({"query": body.get("query"), "results": [{"title": "mock result", "url": "https://example.invalid/mock"}]})).into_response()
}

async fn stats(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    Json(json!({
        "chat": state.counters.chat.load(Ordering::Relaxed),
        "search": state.counters.search.load(Ordering::Relaxed),
        "authorized": state.counters.authorized.load(Ordering::Relaxed),
    }))
}

#[cfg(test)]
mod tests {
    use super::{LatencySpec, MockProfile};

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
            e.starts_with("m.toml: `search.latency`: needs 0 ≤ p50_ms ≤ p95_ms"),
            "{e}"
        );
        let e = err("[chat]\nretry_after_s = -1\n");
        assert!(e.contains("`chat.retry_after_s`"), "{e}");
        // The throughput variant: no latency at all, and the defaults.
        let p = MockProfile::from_toml("[chat]\nlatency = { p50_ms = 0, p95_ms = 0 }\n", "m.toml")
            .unwrap();
        assert_eq!(
            (p.chat.latency, p.search.latency),
            (
                LatencySpec {
                    p50_ms: 0.0,
                    p95_ms: 0.0
                },
                LatencySpec {
                    p50_ms: 20.0,
                    p95_ms: 20.0
                }
            )
        );
    }
}
