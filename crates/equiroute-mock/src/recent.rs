//! The last chat requests as they came (dialect, path and query, body), bounded in count and
//! bytes, for `GET /_requests`: what a test checks the gateway sent upstream against.

use crate::errors::Speaks;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Requests kept; an older one gives way to a newer one.
pub(crate) const MAX_KEPT: usize = 64;
/// The largest body kept whole; a longer one is kept as its length.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// The last [`MAX_KEPT`] chat requests, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Recent(Mutex<VecDeque<Value>>);

impl Recent {
    /// Keeps a request: its body as JSON (as text when it is not JSON), or only its length
    /// when it is longer than [`MAX_BODY_BYTES`].
    pub(crate) fn keep(&self, speaks: Speaks, path: &str, body: &[u8]) {
        let truncated = body.len() > MAX_BODY_BYTES;
        let json_body = if truncated {
            Value::Null
        } else {
            serde_json::from_slice(body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
        };
        let kept = json!({"dialect": dialect(speaks), "path": path, "body": json_body,
            "bytes": body.len(), "truncated": truncated});
        if let Ok(mut recent) = self.0.lock() {
            if recent.len() == MAX_KEPT {
                recent.pop_front();
            }
            recent.push_back(kept);
        }
    }

    /// The requests kept, oldest first.
    pub(crate) fn list(&self) -> Value {
        self.0
            .lock()
            .map_or_else(|_| json!([]), |r| Value::Array(r.iter().cloned().collect()))
    }
}

/// The name a request's dialect goes by in `/_requests` (the gateway's provider kinds).
fn dialect(speaks: Speaks) -> &'static str {
    match speaks {
        Speaks::OpenAi => "openai",
        Speaks::Azure => "azure_openai",
        Speaks::Anthropic => "anthropic",
        Speaks::Gemini => "gemini",
        Speaks::Bedrock => "bedrock",
    }
}
