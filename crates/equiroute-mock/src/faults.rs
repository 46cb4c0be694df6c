//! How a call behaves before its answer: the route's latency, the fault that plays on it (the
//! route's, or one drawn from its `fault_mix`) and the error rates, in this order.

use crate::errors::{
    context_message, error_answer, mock_error, native_refusal, rate_limited, Speaks,
};
use crate::profile::{Fault, RouteProfile};
use crate::{Connection, MockState};
use axum::http::StatusCode;
use axum::response::Response;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// Waits `wait` to within tens of microseconds. Tokio's timer has millisecond granularity
/// (a 20 ms sleep lasts 20 to 21 ms, by where in the millisecond it began): as the latency of
/// the benchmark's upstream that jitter would swamp the sub-millisecond overhead being
/// measured. A thread of the blocking pool sleeps instead (`nanosleep`, microsecond
/// resolution); the pool keeps its threads, so a warm mock starts none per request.
pub(crate) async fn precise_sleep(wait: std::time::Duration) {
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

/// The fault of `fault_mix` that `u` (uniform in [0, 1)) falls on, if any.
pub(crate) fn mixed_fault(mix: &BTreeMap<Fault, f64>, u: f64) -> Option<Fault> {
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
pub(crate) async fn hang(route: &RouteProfile) {
    match route.hang_ms {
        Some(ms) => tokio::time::sleep(std::time::Duration::from_secs_f64(ms / 1000.0)).await,
        None => std::future::pending().await,
    }
}

/// One draw of the route's latency.
pub(crate) fn latency_of(
    route: &RouteProfile,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> std::time::Duration {
    std::time::Duration::from_secs_f64(route.latency.model().sample(rng) / 1000.0)
}

/// Waits the route's latency, then decides the outcome: `Ok` with the fault that plays on
/// this call (the route's `fault`, or one drawn from its `fault_mix`), or `Err` with an error
/// response (or a connection that is reset or left unanswered). `call` is the call's number
/// for its model.
pub(crate) async fn behave(
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
pub(crate) async fn play_fault(
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
pub(crate) fn error_rates(route: &RouteProfile, speaks: Speaks, u: f64) -> Option<Response> {
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

/// `slow_first_token`'s wait.
pub(crate) fn first_token_delay(route: &RouteProfile, fault: Option<Fault>) -> std::time::Duration {
    if fault == Some(Fault::SlowFirstToken) {
        std::time::Duration::from_secs_f64(route.first_token_delay_ms.unwrap_or(1000.0) / 1000.0)
    } else {
        std::time::Duration::ZERO
    }
}
