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
pub(crate) struct Recent(Mutex<VecDeque<Kept>>);

/// One request as it came; read as JSON only when listed, so that keeping it costs a copy of
/// its bytes, not a parse (the mock also serves benchmarks, where it shares the CPU).
#[derive(Debug)]
struct Kept {
    speaks: Speaks,
    path: String,
    /// `None` when longer than [`MAX_BODY_BYTES`].
    body: Option<bytes::Bytes>,
    bytes: usize,
}

impl Recent {
    /// Keeps a request: its body, or only its length when it is longer than
    /// [`MAX_BODY_BYTES`].
    pub(crate) fn keep(&self, speaks: Speaks, path: &str, body: &[u8]) {
        let kept = Kept {
            speaks,
            path: path.to_owned(),
            body: (body.len() <= MAX_BODY_BYTES).then(|| bytes::Bytes::copy_from_slice(body)),
            bytes: body.len(),
        };
        if let Ok(mut recent) = self.0.lock() {
            if recent.len() == MAX_KEPT {
                recent.pop_front();
            }
            recent.push_back(kept);
        }
    }

    /// The requests kept, oldest first: each body as JSON (as text when it is not JSON; null
    /// when it was too long to keep).
    pub(crate) fn list(&self) -> Value {
        let Ok(recent) = self.0.lock() else {
            return json!([]);
        };
        Value::Array(
            recent
                .iter()
                .map(|k| {
                    let body = k.body.as_ref().map_or(Value::Null, |b| {
                        serde_json::from_slice(b).unwrap_or_else(|_| {
                            Value::String(String::from_utf8_lossy(b).into_owned())
                        })
                    });
                    json!({"dialect": dialect(k.speaks), "path": k.path, "body": body,
                        "bytes": k.bytes, "truncated": k.body.is_none()})
                })
                .collect(),
        )
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
