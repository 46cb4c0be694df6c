//! Errors of the HTTP API: each knows its status and renders the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`, which the official SDKs parse.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::borrow::Cow;

/// The most characters of a client's input an error message repeats.
pub const ECHO_MAX_CHARS: usize = 128;

/// Client input as an error message may repeat it: whole up to [`ECHO_MAX_CHARS`]
/// characters, else cut there with an ellipsis and the original length, so that a 900 KB
/// model name is not sent back (or logged) whole. Every error that quotes the client goes
/// through here.
#[must_use]
pub fn echo(input: &str) -> Cow<'_, str> {
    match input.char_indices().nth(ECHO_MAX_CHARS) {
        None => Cow::Borrowed(input),
        Some((cut, _)) => Cow::Owned(format!("{}… ({} bytes in all)", &input[..cut], input.len())),
    }
}

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
            "missing or wrong API key: send `Authorization: Bearer <key>` with a key configured in server.api_keys_env or a [[server.keys]] table",
        )
    }
    /// A 401 on the state routes, which take the admin keys (`server.admin_keys_env`) when
    /// any are configured, else the gateway keys.
    pub fn unauthorized_admin(admin_keys_configured: bool) -> Self {
        let setting = if admin_keys_configured {
            "server.admin_keys_env or a [[server.keys]] table with role = \"admin\" (the state routes take the admin keys, not the gateway keys)"
        } else {
            "server.api_keys_env (no server.admin_keys_env is configured; set one to give the state routes keys of their own)"
        };
        ApiError::invalid(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            format!("missing or wrong admin key: send `Authorization: Bearer <key>` with a key configured in {setting}"),
        )
    }
    /// The OpenAI-style 413 of a body over `server.max_body_bytes` (axum's own answer is
    /// plain text, which SDKs cannot parse).
    pub fn body_too_large() -> Self {
        ApiError::invalid(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            "the body is larger than the gateway accepts: send less, or raise server.max_body_bytes",
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

    /// Another full state dump is being built: one at a time per gateway.
    pub fn busy(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::invalid(StatusCode::TOO_MANY_REQUESTS, code, message)
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

impl ApiError {
    /// The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
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

/// A poisoned lock: a handler panicked while holding it.
#[derive(Debug, Clone, Copy)]
pub struct Poisoned;

impl From<Poisoned> for ApiError {
    fn from(_: Poisoned) -> Self {
        ApiError::internal()
    }
}

/// The answer when a lock is poisoned.
pub(super) fn poisoned() -> ApiError {
    ApiError::internal()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_input_is_cut_at_128_characters_with_its_length() {
        assert_eq!(echo("chat"), "chat");
        let exact = "é".repeat(ECHO_MAX_CHARS);
        assert_eq!(echo(&exact), exact.as_str());
        let long = "m".repeat(900_000);
        let cut = echo(&long);
        assert_eq!(cut, format!("{}… (900000 bytes in all)", "m".repeat(128)));
        // Cut on a character boundary, counted in characters.
        let wide = "é".repeat(200);
        assert!(echo(&wide).starts_with(&"é".repeat(128)));
        assert!(echo(&wide).ends_with("… (400 bytes in all)"));
    }
}
