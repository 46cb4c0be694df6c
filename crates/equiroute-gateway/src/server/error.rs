//! Errors of the HTTP API: each knows its status and renders the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`, which the official SDKs parse.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::borrow::Cow;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// The request field at fault (`max_tokens`, `messages[2].role`), as OpenAI names it.
    pub param: Option<Cow<'static, str>>,
    /// The routed request this error ends, if it got that far: its id and attempts are sent
    /// as `x-equiroute-request-id` and `x-equiroute-attempts`, as on an answer.
    pub routed: Option<(String, usize)>,
    /// Seconds after which a retry may succeed, sent as `Retry-After` (a `u16`, beside
    /// `status`, keeps the error small).
    pub retry_after_s: Option<u16>,
}

impl ApiError {
    /// The base of every constructor: `kind` is `invalid_request_error` for the caller's
    /// mistakes ([`Self::invalid`]) and `api_error` for ours or the providers'
    /// ([`Self::upstream`]); no field named, no routed request.
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            param: None,
            routed: None,
            retry_after_s: None,
        }
    }
    /// The caller's mistake, answered with `status`.
    pub(crate) fn invalid(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError::new(status, "invalid_request_error", code, message)
    }
    pub fn bad_request(
        code: &'static str,
        param: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            param: param.map(Cow::Borrowed),
            ..ApiError::invalid(StatusCode::BAD_REQUEST, code, message)
        }
    }
    /// A 400 for the request field `param`, whose path is built per request
    /// (`messages[2].role`).
    pub fn bad_field(code: &'static str, param: String, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(Cow::Owned(param)),
            ..ApiError::bad_request(code, None, message)
        }
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::invalid(StatusCode::NOT_FOUND, code, message)
    }
    pub fn unauthorized() -> Self {
        ApiError::invalid(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or wrong API key: send `Authorization: Bearer <key>` with a key configured in server.api_keys_env",
        )
    }
    /// Shared state is unusable (a lock poisoned by a crash in another request).
    pub fn internal() -> Self {
        ApiError::upstream(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal state is unavailable after a crash in another request",
        )
    }

    pub fn upstream(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(status, "api_error", code, message)
    }

    /// The same error, for the routed request `request_id` after `attempts` attempts.
    #[must_use]
    pub fn for_request(self, request_id: &str, attempts: usize) -> Self {
        ApiError {
            routed: Some((request_id.to_owned(), attempts)),
            ..self
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some((id, attempts)) = &self.routed {
            super::routing_headers(resp.headers_mut(), id, None, *attempts);
        }
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from(s));
        }
        resp
    }
}
