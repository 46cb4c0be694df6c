//! What a request is about, read from its body: below the server and the upstreams, which
//! both need it (the featurizer's input, the `sim` provider's echo).

use crate::config::InterfaceKind;
use serde_json::Value;
use std::borrow::Cow;

/// The text a request is about, for the featurizer: the last user message of a chat, the
/// `query` (or whole body) of a tool call.
/// Borrowed from the body when it is a string (a long prompt is not copied).
#[must_use]
pub fn query_text(kind: InterfaceKind, body: &Value) -> Cow<'_, str> {
    match kind {
        InterfaceKind::Chat => body
            .get("messages")
            .and_then(Value::as_array)
            .and_then(|m| {
                m.iter()
                    .rev()
                    .find(|msg| msg.get("role").and_then(Value::as_str) == Some("user"))
                    .or_else(|| m.last())
            })
            .and_then(|msg| msg.get("content"))
            .map_or(Cow::Borrowed(""), |c| match c {
                Value::String(s) => Cow::Borrowed(s.as_str()),
                other => Cow::Owned(other.to_string()),
            }),
        InterfaceKind::Tool => body
            .get("query")
            .and_then(Value::as_str)
            .map_or_else(|| Cow::Owned(body.to_string()), Cow::Borrowed),
    }
}
