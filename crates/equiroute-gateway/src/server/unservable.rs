//! A request that no provider can serve because of the request itself: JSON mode where no
//! provider declares it, image input where none takes it, more tokens than any context
//! window, a tenant no provider allows, a member no provider's API can express. That is the
//! caller's mistake, answered with a 4xx naming the member (`param`) and the fix; a 503 would
//! be retried by the SDKs, and would fail the same way every time.
//!
//! Only when every exclusion is the request's: one provider shut out by its breaker, its
//! spend cap or its quality gate leaves a request that could be served later (503).

use super::error::{echo, ApiError};
use axum::http::StatusCode;
use equiroute_core::eligibility::{Exclusion, ExclusionReason};
use equiroute_core::TokenEstimate;
use std::borrow::Cow;

/// What makes one exclusion the request's own: the status, code and member of its answer,
/// and the fix to suggest.
struct Fault {
    status: StatusCode,
    code: &'static str,
    param: Option<Cow<'static, str>>,
    fix: &'static str,
}

/// The request member that a missing capability (as `equiroute_core::eligibility` names it)
/// asks for.
fn capability_param(capability: &str) -> Option<&'static str> {
    match capability {
        "tools" => Some("tools"),
        "JSON mode" => Some("response_format"),
        "streaming" => Some("stream"),
        "image input" | "audio input" => Some("messages"),
        _ => None,
    }
}

/// The name the request gave its completion limit (`max_completion_tokens` before
/// `max_tokens`, as the gateway reads them).
fn completion_limit(body: &serde_json::Value) -> &'static str {
    if body.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    }
}

/// The request's share of `reason`: `None` when the exclusion is about the provider (its
/// breaker, spend or quality), or says nothing (another provider was pinned).
fn fault_of(
    reason: &ExclusionReason,
    body: &serde_json::Value,
    tokens: TokenEstimate,
) -> Option<Fault> {
    let unsupported = |param: Option<Cow<'static, str>>| {
        Fault {
        status: StatusCode::BAD_REQUEST,
        code: "unsupported_parameter",
        param,
        fix: "leave the member out, or send the request to an interface with a provider that takes it",
    }
    };
    Some(match reason {
        ExclusionReason::MissingCapability { capability } => {
            unsupported(capability_param(capability).map(Cow::Borrowed))
        }
        ExclusionReason::Inexpressible { field, .. } => {
            unsupported(Some(Cow::Owned(field.clone())))
        }
        ExclusionReason::ContextTooSmall { available, .. } => Fault {
            status: StatusCode::BAD_REQUEST,
            code: "context_length_exceeded",
            // The completion limit alone is too much, else the conversation is.
            param: Some(Cow::Borrowed(if tokens.output >= *available {
                completion_limit(body)
            } else {
                "messages"
            })),
            fix: "ask for fewer completion tokens, or send a shorter conversation",
        },
        ExclusionReason::TenantNotAllowed { .. } | ExclusionReason::TenantRequired => Fault {
            status: StatusCode::FORBIDDEN,
            code: "tenant_not_allowed",
            param: Some(Cow::Borrowed("x-equiroute-tenant")),
            fix: "send a tenant that a provider of the interface allows",
        },
        ExclusionReason::LabelMismatch { .. } | ExclusionReason::RequestCostCap { .. } => Fault {
            status: StatusCode::BAD_REQUEST,
            code: "no_matching_provider",
            param: None,
            fix: "relax the request's labels or cost cap",
        },
        ExclusionReason::NotPinned
        | ExclusionReason::QualityGate { .. }
        | ExclusionReason::SpendCap { .. }
        | ExclusionReason::CircuitOpen { .. } => return None,
    })
}

/// The caller's 4xx when every provider of `interface` was shut out by the request itself
/// (`ids[i]` names candidate `i`), else `None`. The first exclusion that is not "another
/// provider was pinned" gives the status, code and member; the message lists every reason.
pub(crate) fn answer(
    interface: &str,
    ids: &dyn Fn(usize) -> String,
    excluded: &[Exclusion],
    body: &serde_json::Value,
    tokens: TokenEstimate,
) -> Option<ApiError> {
    let mut first = None;
    for e in excluded {
        if matches!(e.reason, ExclusionReason::NotPinned) {
            continue;
        }
        let fault = fault_of(&e.reason, body, tokens)?;
        first.get_or_insert(fault);
    }
    let fault = first?;
    let reasons: Vec<String> = excluded
        .iter()
        // A reason may quote the client's tenant header: cut like any echoed input.
        .map(|e| format!("{}: {}", ids(e.candidate), echo(&e.reason.to_string())))
        .collect();
    Some(ApiError {
        param: fault.param,
        ..ApiError::invalid(
            fault.status,
            fault.code,
            format!(
                "no provider of `{interface}` can serve this request as sent ({}): {}",
                reasons.join("; "),
                fault.fix
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn excluded(reasons: Vec<ExclusionReason>) -> Vec<Exclusion> {
        reasons
            .into_iter()
            .enumerate()
            .map(|(candidate, reason)| Exclusion { candidate, reason })
            .collect()
    }

    fn answer_to(reasons: Vec<ExclusionReason>, body: &serde_json::Value) -> Option<ApiError> {
        let tokens = TokenEstimate {
            input: 10,
            output: 9000,
        };
        answer(
            "chat",
            &|i| format!("p{i}"),
            &excluded(reasons),
            body,
            tokens,
        )
    }

    #[test]
    fn a_request_every_provider_refuses_for_itself_is_the_callers_4xx_naming_the_member() {
        let json_mode = || ExclusionReason::MissingCapability {
            capability: "JSON mode".into(),
        };
        let e = answer_to(vec![json_mode(), ExclusionReason::NotPinned], &json!({})).unwrap();
        assert_eq!(
            (e.status, e.kind, e.code, e.param.as_deref()),
            (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "unsupported_parameter",
                Some("response_format")
            )
        );
        assert!(
            e.message.contains("p0: does not support JSON mode"),
            "{}",
            e.message
        );
        // 9000 completion tokens alone overflow an 8000-token window: the limit is named,
        // as the request spelled it.
        let small = || ExclusionReason::ContextTooSmall {
            needed: 9010,
            available: 8000,
        };
        let e = answer_to(vec![small()], &json!({"max_completion_tokens": 9000})).unwrap();
        assert_eq!(
            (e.code, e.param.as_deref()),
            ("context_length_exceeded", Some("max_completion_tokens"))
        );
        let roomy = ExclusionReason::ContextTooSmall {
            needed: 9010,
            available: 9005,
        };
        let e = answer_to(vec![roomy], &json!({})).unwrap();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = answer_to(vec![ExclusionReason::TenantRequired], &json!({})).unwrap();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::FORBIDDEN, "tenant_not_allowed")
        );
    }

    #[test]
    fn one_provider_shut_out_for_itself_leaves_the_503_to_the_caller() {
        let open = ExclusionReason::CircuitOpen { until: None };
        let vision = ExclusionReason::MissingCapability {
            capability: "image input".into(),
        };
        assert!(answer_to(vec![vision, open], &json!({})).is_none());
        let spent = ExclusionReason::SpendCap {
            spent: 2.0,
            cap: 1.0,
        };
        assert!(answer_to(vec![spent], &json!({})).is_none());
        assert!(answer_to(vec![ExclusionReason::NotPinned], &json!({})).is_none());
    }
}
