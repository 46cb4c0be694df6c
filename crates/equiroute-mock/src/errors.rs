//! The API a route speaks ([`Speaks`]) and its errors in that host's shape: OpenAI's
//! `error` object, Anthropic's 529 overload, Gemini's `status` names, Bedrock's
//! `x-amzn-errortype`, and the native hosts' refusals with a 200.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The API a route speaks: errors and answers take its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Speaks {
    OpenAi,
    Azure,
    Anthropic,
    Gemini,
    Bedrock,
}

/// An error answer in the route's shape (OpenAI's: `error.message`, `type`, `code`).
pub(crate) fn error_answer(
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
pub(crate) fn bedrock_error(status: StatusCode, name: &str, message: &str) -> Response {
    let mut r = (status, Json(json!({ "message": message }))).into_response();
    if let Ok(v) = axum::http::HeaderValue::from_str(&format!(
        "{name}:http://internal.amazon.com/coral/com.amazon.bedrock/"
    )) {
        r.headers_mut().insert("x-amzn-errortype", v);
    }
    r
}

/// The mock's own error (`type: mock_error`, the status as `code`).
pub(crate) fn mock_error(speaks: Speaks, status: StatusCode, message: &str) -> Response {
    error_answer(
        speaks,
        status,
        "mock_error",
        &json!(status.as_u16()),
        message,
    )
}

/// A 429, with `Retry-After` when given.
pub(crate) fn rate_limited(speaks: Speaks, retry_after_s: Option<f64>) -> Response {
    let mut r = mock_error(speaks, StatusCode::TOO_MANY_REQUESTS, "mock rate limit");
    if let Some(v) =
        retry_after_s.and_then(|s| axum::http::HeaderValue::from_str(&format!("{s}")).ok())
    {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

/// The context-window refusal's message, as each host words it.
pub(crate) fn context_message(speaks: Speaks) -> &'static str {
    match speaks {
        Speaks::Anthropic => "prompt is too long: 210000 tokens > 200000 maximum",
        Speaks::Gemini => "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
        Speaks::Bedrock => "The model returned the following errors: Input is too long for requested model.",
        Speaks::OpenAi | Speaks::Azure => "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. Please reduce the length of the messages.",
    }
}

/// The native hosts refuse with a 200: Anthropic's `refusal` stop, Gemini's blocked prompt.
pub(crate) fn native_refusal(speaks: Speaks) -> Option<Response> {
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
