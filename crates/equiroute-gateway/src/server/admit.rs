//! Admit: what a request passes before it is routed (after the key's gate, [`super::gate`]):
//! the body's limit, its JSON and its fields checked (a clear 400
//! naming the field and the fix), and the request's terms from its headers: tenant, task
//! class, session, deadline, the client's trace, restart events ([`RequestMeta`]); what it
//! needs of a provider ([`request_profile`]).

use super::error::ApiError;
use super::state::{AppState, InterfaceRuntime};
use super::{arms, auth};
use crate::config::InterfaceKind;
use crate::upstream::ClientBody;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use equiroute_core::Millis;
use serde_json::Value;
use std::sync::Arc;

/// What a request needs from a provider, and its expected size in tokens: `tools` present
/// → tool support; `response_format` json → JSON mode; `stream` → streaming; image parts →
/// vision; input ≈ characters/4 + 4 per message, output = `max_completion_tokens` or
/// `max_tokens` (256 when unset); the context window must hold both.
#[must_use]
pub fn request_profile(
    kind: InterfaceKind,
    body: &Value,
) -> (equiroute_core::Requirements, equiroute_core::TokenEstimate) {
    let mut req = equiroute_core::Requirements::default();
    let mut tokens = equiroute_core::TokenEstimate::default();
    if kind != InterfaceKind::Chat {
        return (req, tokens);
    }
    req.tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    // `get` twice rather than `pointer`, which allocates each step of its path.
    req.json_mode = body
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("json"));
    req.streaming = body.get("stream").and_then(Value::as_bool) == Some(true);
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut chars = 0usize;
    for m in messages {
        match m.get("content") {
            Some(Value::String(s)) => chars += s.chars().count(),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if p.get("type").and_then(Value::as_str) == Some("image_url") {
                        req.vision = true;
                    }
                    chars += p
                        .get("text")
                        .and_then(Value::as_str)
                        .map_or(0, |t| t.chars().count());
                }
            }
            _ => {}
        }
    }
    tokens.input = u32::try_from(chars / 4 + 4 * messages.len()).unwrap_or(u32::MAX);
    tokens.output = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(256, |t| u32::try_from(t).unwrap_or(u32::MAX));
    req.context_tokens = tokens.input.saturating_add(tokens.output);
    (req, tokens)
}

/// A request's headers, moved out of it instead of copied (axum's `HeaderMap` extractor
/// clones the map: an allocation and a copy of every header per request). Extractors after
/// it see no headers: it goes last among a handler's parts, before the body (whose bytes
/// axum reads without them).
pub(super) struct TakenHeaders(pub HeaderMap);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for TakenHeaders {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(TakenHeaders(std::mem::take(&mut parts.headers)))
    }
}

/// A request body as the handlers take it: the bytes, or why axum could not read them.
pub(super) type BodyBytes = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// The bytes of `body`; a body over `server.max_body_bytes` is a 413 ([`ApiError::body_too_large`]).
pub(super) fn read_body(body: BodyBytes) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::body_too_large();
        }
        ApiError::invalid(
            status,
            "unreadable_body",
            format!("the body could not be read: {}", e.body_text()),
        )
    })
}

pub(super) fn parse_json(body: BodyBytes) -> Result<ClientBody, ApiError> {
    ClientBody::parse(read_body(body)?).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            None,
            format!("the body is not valid JSON: {e}"),
        )
    })
}

pub use crate::config::MAX_TASK_CLASS_BYTES;

/// Who a request is for and what kind of task it is, from its caller and its headers: the
/// tenant (the key's, else `x-equiroute-tenant`; checked against providers' tenant
/// allow-lists) and `x-equiroute-task-class` (the first level of the statistics slices; see
/// [`auth`]).
#[derive(Debug, Clone, Default)]
pub struct RequestMeta {
    pub tenant: Option<String>,
    pub task_class: Option<String>,
    /// The label of the key that made the request: its answered request can be scored only by
    /// that key (or a judge or admin key). `None`: made without a key.
    pub owner: Option<Arc<str>>,
    /// The session key that keeps a conversation on one arm of a canary rollout
    /// ([`arms::SESSION_HEADER`]).
    pub session: Option<String>,
    /// The client's span, from W3C `traceparent` and `tracestate`, when traces are exported:
    /// the request's span continues the client's trace.
    pub trace_parent: Option<opentelemetry::trace::SpanContext>,
    /// The client reads restart events ([`RESTART_HEADER`]`: events`): a broken stream may
    /// start its answer again after content was sent, announced by the marker event.
    pub restart_events: bool,
    /// `x-equiroute-deadline-ms` as sent, read in the same pass as the other headers; checked
    /// against the interface by [`deadline_from`] once the interface is known.
    pub deadline: Option<HeaderValue>,
}

/// The request header by which a chat client says it reads the `restart` marker event and
/// drops the text it joined before it (`x-equiroute-stream-restart: events`); without it a
/// stream that broke after content is never restarted (see `docs/faults.md`).
pub const RESTART_HEADER: &str = "x-equiroute-stream-restart";

// The request headers read by name, made once: a name given as text is parsed again at every
// lookup.
const RESTART: HeaderName = HeaderName::from_static(RESTART_HEADER);
const SESSION: HeaderName = HeaderName::from_static(arms::SESSION_HEADER);
const DEADLINE: HeaderName = HeaderName::from_static("x-equiroute-deadline-ms");

/// The prefix every header the gateway reads by name shares (W3C `traceparent` aside).
const OWN_PREFIX: &str = "x-equiroute-";

/// The request's headers when it carries any of the gateway's own (`x-equiroute-*`), else an
/// empty map. Most requests carry none: one pass over the names spares the lookups by name
/// (each hashes the name) that would find nothing; a lookup in the empty map returns at once.
pub(super) fn own_headers(headers: &HeaderMap) -> &HeaderMap {
    static NONE: std::sync::LazyLock<HeaderMap> = std::sync::LazyLock::new(HeaderMap::new);
    if headers
        .keys()
        .any(|name| name.as_str().starts_with(OWN_PREFIX))
    {
        headers
    } else {
        &NONE
    }
}

/// Whether the request asks for restart events.
///
/// # Errors
/// The header with another value than `events` (400 naming it and the fix).
pub(super) fn restart_events_of(headers: &HeaderMap) -> Result<bool, ApiError> {
    let Some(value) = headers.get(RESTART) else {
        return Ok(false);
    };
    match value.to_str().map(str::trim) {
        Ok(v) if v.eq_ignore_ascii_case("events") => Ok(true),
        Ok("") => Ok(false),
        _ => Err(ApiError::bad_request(
            "invalid_header",
            Some(RESTART_HEADER),
            format!("`{RESTART_HEADER}` accepts one value, `events` (the client drops the text before a restart marker): send `events`, or leave the header out"),
        )),
    }
}

impl RequestMeta {
    /// The request of `caller` with `headers`.
    ///
    /// # Errors
    /// A tenant header that is not a tenant name (400) or that another tenant's key sent
    /// (403); a task class the key may not name (403).
    pub(super) fn of(headers: &HeaderMap, caller: &auth::Caller) -> Result<RequestMeta, ApiError> {
        let own = own_headers(headers);
        Ok(RequestMeta {
            tenant: auth::tenant_of(own, caller)?,
            task_class: auth::task_class_of(own, caller)?,
            owner: caller.owner(),
            session: own
                .get(SESSION)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned),
            trace_parent: crate::telemetry::remote_parent(headers),
            restart_events: restart_events_of(own)?,
            deadline: own.get(DEADLINE).cloned(),
        })
    }

    /// The same request as `iface` sees it: a task class longer than
    /// [`MAX_TASK_CLASS_BYTES`] or missing from the interface's `task_classes` allow-list is
    /// dropped (the request is routed and learnt from in the parent, untagged slice) and
    /// counted, without its name, in `/metrics`.
    pub(super) fn for_interface(
        mut self,
        state: &AppState,
        iface: &InterfaceRuntime,
    ) -> RequestMeta {
        if self
            .task_class
            .as_ref()
            .is_some_and(|c| c.len() > MAX_TASK_CLASS_BYTES)
        {
            self.task_class = None;
            state.metrics.task_class_too_long(&iface.name);
        }
        if let (Some(class), Some(allowed)) = (&self.task_class, &iface.task_classes) {
            if !allowed.iter().any(|a| a == class) {
                self.task_class = None;
                state.metrics.task_class_unlisted(&iface.name);
            }
        }
        self
    }
}

/// The longest deadline a request may ask for on an interface without `deadline_ms`.
pub const MAX_DEADLINE_MS: f64 = 600_000.0;

/// A request's deadline: `x-equiroute-deadline-ms` ([`RequestMeta::deadline`]), else the
/// interface's `deadline_ms`. The
/// header is clamped to the interface's `deadline_ms` (or [`MAX_DEADLINE_MS`] without one):
/// the second value is `true` when it was, and the answer then says which deadline applied.
pub(super) fn deadline_from(
    meta: &RequestMeta,
    iface: &InterfaceRuntime,
) -> Result<(Option<Millis>, bool), ApiError> {
    let Some(v) = &meta.deadline else {
        return Ok((iface.deadline, false));
    };
    // Less than an attempt's least time (1 ms) could never be met: the caller's mistake,
    // not a 504.
    let least = iface.limits.min_attempt_budget.0;
    let asked = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|d| d.is_finite() && *d >= least)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_deadline",
                Some("x-equiroute-deadline-ms"),
                format!("x-equiroute-deadline-ms must be a number of milliseconds, at least {least} (the least time an attempt is given)"),
            )
        })?;
    let most = iface.deadline.map_or(MAX_DEADLINE_MS, |d| d.0);
    Ok((Some(Millis(asked.min(most))), asked > most))
}

/// The answer (or error) of a routed request; when its deadline header was clamped,
/// `x-equiroute-deadline-applied-ms` says which deadline applied.
pub(super) fn with_deadline(
    result: Result<Response, ApiError>,
    deadline: Option<Millis>,
    clamped: bool,
) -> Response {
    let mut resp = result.unwrap_or_else(IntoResponse::into_response);
    if let (true, Some(d)) = (clamped, deadline) {
        resp.headers_mut().insert(
            "x-equiroute-deadline-applied-ms",
            HeaderValue::from(d.0 as u64),
        );
    }
    resp
}

/// What a JSON value is, for an error message ("got a string").
pub(super) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A chat field the gateway reads: its name, whether a value is valid, and what it must be.
pub(super) type FieldCheck = (&'static str, fn(&Value) -> bool, &'static str);

/// Checks the fields of a chat body that the gateway acts on itself — `model` (routing),
/// `messages` (features and size), `stream`, `max_tokens` / `max_completion_tokens` (size
/// and cost), `tools` and `response_format` (eligibility) — and answers the model. A field of
/// the wrong type would otherwise be read as absent: a `"stream": "yes"` answered without
/// streaming, a `"max_tokens": -5` sized as the default. Everything else goes to the provider
/// as it came, and the provider judges it.
pub(super) fn check_chat_body(body: &Value) -> Result<&str, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(
            "invalid_body",
            None,
            format!(
                "the body must be a JSON object (a chat completions request), got {}",
                json_kind(body)
            ),
        ));
    };
    let Some(Value::String(model)) = obj.get("model") else {
        let got = obj
            .get("model")
            .map_or(String::new(), |v| format!(", got {}", json_kind(v)));
        return Err(ApiError::bad_request(
            "missing_model",
            Some("model"),
            format!(
                "`model` is required as a string: name an interface, or interface/provider{got}"
            ),
        ));
    };
    let Some(messages) = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
    else {
        return Err(ApiError::bad_request(
            "missing_messages",
            Some("messages"),
            "`messages` must be a non-empty array",
        ));
    };
    for (i, m) in messages.iter().enumerate() {
        if !m.is_object() {
            return Err(ApiError::bad_field(
                "invalid_type",
                format!("messages[{i}]"),
                format!(
                    "`messages[{i}]` must be an object with a `role` and a `content`, got {}",
                    json_kind(m)
                ),
            ));
        }
        if !m.get("role").is_some_and(Value::is_string) {
            let got = m.get("role").map_or("nothing", json_kind);
            return Err(ApiError::bad_field(
                "invalid_type",
                format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be a string such as \"user\", got {got}"),
            ));
        }
    }
    let tokens = |v: &Value| {
        v.as_u64()
            .is_some_and(|t| t >= 1 && u32::try_from(t).is_ok())
    };
    let checks: [FieldCheck; 5] = [
        ("stream", Value::is_boolean, "true or false"),
        (
            "max_tokens",
            tokens,
            "a whole number of tokens from 1 to 4294967295",
        ),
        (
            "max_completion_tokens",
            tokens,
            "a whole number of tokens from 1 to 4294967295",
        ),
        ("tools", Value::is_array, "an array of tool definitions"),
        (
            "response_format",
            |v| v.get("type").is_some_and(Value::is_string),
            "an object with a string `type` (\"text\", \"json_object\", \"json_schema\")",
        ),
    ];
    for (name, valid, expected) in checks {
        // `null` is "unset", as OpenAI reads it.
        let Some(v) = obj.get(name).filter(|v| !v.is_null() && !valid(v)) else {
            continue;
        };
        let (code, got) = match v {
            // A number where a count of tokens is wanted: the value is wrong, not the type.
            Value::Number(n) if name.ends_with("tokens") => ("invalid_value", n.to_string()),
            _ => ("invalid_type", json_kind(v).to_owned()),
        };
        return Err(ApiError::bad_request(
            code,
            Some(name),
            format!("`{name}` must be {expected}, got {got}"),
        ));
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_header_read_by_name_is_one_the_single_pass_looks_for() {
        for name in [
            RESTART_HEADER,
            arms::SESSION_HEADER,
            DEADLINE.as_str(),
            auth::TENANT_HEADER,
            auth::TASK_CLASS_HEADER,
        ] {
            assert!(
                name.starts_with(OWN_PREFIX),
                "{name} is read through own_headers"
            );
        }
    }

    #[test]
    fn own_headers_are_the_requests_when_it_carries_one_else_none() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        assert!(own_headers(&headers).is_empty());
        headers.insert(DEADLINE, HeaderValue::from_static("250"));
        let own = own_headers(&headers);
        assert_eq!(own.len(), 2);
        assert_eq!(
            own.get(DEADLINE).map(HeaderValue::as_bytes),
            Some(&b"250"[..])
        );
    }
}
