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
}

impl ApiError {
    pub fn bad_request(
        code: &'static str,
        param: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            param: param.map(Cow::Borrowed),
            routed: None,
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
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            param: None,
            routed: None,
        }
    }
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            message: "missing or wrong API key: send `Authorization: Bearer <key>` with a key configured in server.api_keys_env".into(),
            param: None,
            routed: None,
        }
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
        ApiError {
            status,
            kind: "api_error",
            code,
            message: message.into(),
            param: None,
            routed: None,
        }
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
            let h = resp.headers_mut();
            if let Ok(v) = axum::http::HeaderValue::from_str(id) {
                h.insert("x-equiroute-request-id", v);
            }
            h.insert(
                "x-equiroute-attempts",
                axum::http::HeaderValue::from(*attempts),
            );
        }
        resp
    }
}
