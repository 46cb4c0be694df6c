//! Quality feedback: from the API (`POST /v1/feedback`) and from the LLM-as-judge
//! ([`crate::feedback::judge`]). Both end in [`apply`], which hands the score to the policy
//! with the context of the request it is about, once: with state shared through Redis, once
//! across instances (see [`crate::shared::Claims`]).

use super::error::ApiError;
use super::state::AppState;
use crate::shared::Claim;
use axum::http::StatusCode;
use equiroute_core::policies::QualityObservation;
use equiroute_core::FeedbackSource;

/// What happened to a score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Accepted,
    Duplicate,
}

/// [`apply_from`] for a score from the API.
///
/// # Errors
/// As [`apply_from`].
pub async fn apply(state: &AppState, request_id: &str, quality: f64) -> Result<Applied, ApiError> {
    apply_from(state, request_id, quality, FeedbackSource::Api).await
}

/// Hands `quality` for `request_id` to its interface's policy, once, and writes it to the
/// audit log (a `"kind": "feedback"` line naming `source`). With shared state the
/// request id is claimed in Redis first: the instance that claims it applies the score, the
/// others answer `Duplicate`. A claim that gets no answer within `claim_timeout_ms` falls
/// back to this instance's local check (the stream then counts the score once).
///
/// # Errors
/// Unknown id (404), or older than the feedback window (410).
pub async fn apply_from(
    state: &AppState,
    request_id: &str,
    quality: f64,
    source: FeedbackSource,
) -> Result<Applied, ApiError> {
    let now = state.now();
    state.prune_pending(now);
    let entry = {
        let mut pending = state.pending.lock().map_err(|_| ApiError::internal())?;
        let Some(e) = pending.get(request_id) else {
            return Err(ApiError::not_found(
                "unknown_request_id",
                format!("no answered request `{}` is waiting for feedback (unknown, or evicted: at most server.max_pending_feedback contexts are kept)", super::error::echo(request_id)),
            ));
        };
        if e.consumed {
            return Ok(Applied::Duplicate);
        }
        if now.0 - e.at.0 > state.feedback_ttl.0 {
            return Err(ApiError::invalid(
                StatusCode::GONE,
                "feedback_expired",
                format!("request `{request_id}` is older than the feedback window (server.feedback_ttl_s)"),
            ));
        }
        // Consumed before the claim, so that a second score posted here meanwhile is a
        // duplicate without asking Redis.
        pending.consume(request_id);
        e
    };
    if let Some(shared) = &state.shared {
        if shared.claims.claim(request_id, state.feedback_ttl).await == Claim::Lost {
            return Ok(Applied::Duplicate);
        }
    }
    if let Some(iface) = state.interfaces.get(&entry.interface) {
        state
            .record_quality(
                iface,
                request_id,
                &QualityObservation {
                    candidate: entry.candidate,
                    features: &entry.features_f64(),
                    quality,
                    latency: entry.latency,
                    now,
                },
            )
            .map_err(|_| ApiError::internal())?;
        // Under the interface's configured name (`iface.name`), never the stored one.
        state
            .metrics
            .feedback_delay(&iface.name, now.since(entry.at).0 / 1000.0);
    }
    if let Some(log) = &state.audit {
        log.feedback(super::audit::FeedbackRecord::new(
            now.0,
            request_id,
            &entry.interface,
            quality,
            source,
        ));
    }
    Ok(Applied::Accepted)
}
