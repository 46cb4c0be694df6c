//! Quality feedback: from the API (`POST /v1/feedback`) and from the LLM-as-judge
//! ([`crate::feedback::judge`]). Both end in [`apply_from`], which hands the score to the
//! policy with the context of the request it is about, once: with state shared through Redis,
//! once across instances (see [`crate::shared::Claims`]).
//!
//! A score is taken only from a caller that may score the request ([`Caller::may_score`]: the
//! key that made it, a judge or admin key, the gateway's judge). Any other caller gets exactly
//! the answer of an unknown id, checked before anything that would tell them apart (consumed,
//! expired, claimed elsewhere), so that the answer never reveals that the id exists.

use super::auth::Caller;
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

/// [`apply_from`] for a score from the API, posted by the gateway itself (it may score any
/// request).
///
/// # Errors
/// As [`apply_from`].
pub async fn apply(state: &AppState, request_id: &str, quality: f64) -> Result<Applied, ApiError> {
    apply_from(
        state,
        request_id,
        quality,
        FeedbackSource::Api,
        &Caller::Internal,
    )
    .await
}

/// The answer to a score for an id that is not kept, or not `caller`'s to score: the same
/// status and body either way.
fn unknown(request_id: &str) -> ApiError {
    ApiError::not_found(
        "unknown_request_id",
        format!("no answered request `{}` is waiting for feedback (unknown, or evicted: at most server.max_pending_feedback contexts are kept)", super::error::echo(request_id)),
    )
}

/// Hands `quality` for `request_id`, posted by `caller`, to its interface's policy, once, and
/// writes it to the audit log (a `"kind": "feedback"` line naming `source`, who posted it
/// and with which key). A caller that may not score the request gets the answer of an unknown
/// id. With shared state the
/// request id is claimed in Redis first: the instance that claims it applies the score, the
/// others answer `Duplicate`. A claim that gets no answer within `claim_timeout_ms` falls
/// back to this instance's local check (the stream then counts the score once).
///
/// # Errors
/// Unknown id, or not the caller's (404), or older than the feedback window (410).
pub async fn apply_from(
    state: &AppState,
    request_id: &str,
    quality: f64,
    source: FeedbackSource,
    caller: &Caller,
) -> Result<Applied, ApiError> {
    let now = state.now();
    state.prune_pending(now);
    let entry = {
        let mut pending = state.pending.lock().map_err(|_| ApiError::internal())?;
        let Some(e) = pending.get_if(request_id, |owner| caller.may_score(owner)) else {
            return Err(unknown(request_id));
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
    if let Some(iface) = state.interface(&entry.interface) {
        state
            .record_quality(
                &iface,
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
            caller,
        ));
    }
    Ok(Applied::Accepted)
}
