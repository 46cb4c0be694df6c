//! Errors of the HTTP API: each knows its status and renders the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`, which the official SDKs parse.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
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
            param,
        }
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            param: None,
        }
    }
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            message: "missing or wrong API key: send `Authorization: Bearer <key>` with a key configured in server.api_keys_env".into(),
            param: None,
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
        (self.status, axum::Json(body)).into_response()
    }
}
