//! What the native dialects (Anthropic Messages, Gemini) share: refusing what a dialect cannot
//! express, reading the client's OpenAI request, writing OpenAI answers and stream chunks, and
//! turning a provider's server-sent events into OpenAI `chat.completion.chunk` events.
//!
//! The client always speaks OpenAI's chat completions; a native provider gets a body written
//! for it from the parsed request, and its answer is written back in OpenAI's shape (`usage`
//! included, so that cost accounting reads the same numbers for every kind).

use bytes::Bytes;
use serde_json::{json, Map, Value};

pub use crate::config::UnsupportedParams;

/// A request member the dialect cannot express and may not drop: the request goes back to the
/// caller as a 400 naming it (never dropped silently).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The member's path in the client's body, e.g. `messages[2].name`.
    pub field: String,
    pub why: String,
}

impl Refusal {
    pub fn new(field: impl Into<String>, why: impl Into<String>) -> Refusal {
        Refusal {
            field: field.into(),
            why: why.into(),
        }
    }

    /// A top-level member the dialect has no equivalent for.
    pub fn unsupported(field: &str, api: &str) -> Refusal {
        Refusal::new(
            field,
            format!(
                "{api} has no equivalent: remove it, or pin the request to a provider that \
                 speaks OpenAI's API"
            ),
        )
    }

    /// The reason shown to the client.
    #[must_use]
    pub fn reason(&self) -> String {
        format!("`{}`: {}", self.field, self.why)
    }
}

/// The request members a provider may leave out, when its API cannot express them, without
/// changing what the answer says: `unsupported_params = "drop"` drops these (and only these;
/// tools, JSON mode, images and anything else are refused). Each is named by this fixed text
/// in `x-equiroute-dropped-params` and the audit record, never by a value of the client's.
pub const DROPPABLE: [&str; 13] = [
    // An id of the end user, for the provider's abuse monitoring.
    "user",
    // Sampling: Anthropic's current Messages API (version 2026-10-21, the types of its
    // `anthropic` SDK) has neither, and its current models answer 400 "deprecated for this
    // model" to them; the answer's meaning does not hang on them.
    "temperature",
    "top_p",
    // Best-effort determinism: no provider promises the same answer for a seed.
    "seed",
    // Token probabilities: the answer comes without them (`logprobs: null`).
    "logprobs",
    "top_logprobs",
    // The model may call several tools in a turn; each call is still answered.
    "parallel_tool_calls",
    // OpenAI's stored completions and prompt caching.
    "metadata",
    "store",
    "prompt_cache_key",
    "safety_identifier",
    // A processing tier: a native provider has one (dropped under either policy, as always).
    "service_tier",
    // A participant's name in a message.
    "messages[].name",
];

/// Droppable members dropped whatever the policy says (they were never refused).
const ALWAYS_DROPPED: [&str; 1] = ["service_tier"];

/// The droppable members a translation left out (a set of [`DROPPABLE`] entries).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped(u16);

impl Dropped {
    #[must_use]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The members' fixed names, in [`DROPPABLE`]'s order.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        DROPPABLE
            .iter()
            .enumerate()
            .filter(move |(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, name)| *name)
    }

    /// The value of `x-equiroute-dropped-params`: the names joined by commas; `None` when
    /// nothing was dropped.
    #[must_use]
    pub fn header(self) -> Option<String> {
        (!self.is_empty()).then(|| self.names().collect::<Vec<_>>().join(","))
    }
}

/// What a translation does with the members its API cannot express: the one place that
/// decides whether such a member is dropped (and recorded) or refused.
#[derive(Clone, Copy, Debug, Default)]
pub struct Leftovers {
    policy: UnsupportedParams,
    dropped: Dropped,
}

impl Leftovers {
    #[must_use]
    pub fn new(policy: UnsupportedParams) -> Leftovers {
        Leftovers {
            policy,
            dropped: Dropped::default(),
        }
    }

    /// What was dropped so far.
    #[must_use]
    pub fn dropped(&self) -> Dropped {
        self.dropped
    }

    /// A top-level member `key` that `api` has no equivalent for.
    ///
    /// # Errors
    /// The member is not droppable, or the policy is `reject`.
    pub fn member(&mut self, key: &str, api: &str) -> Result<(), Refusal> {
        self.decide(key, || key.to_owned(), api)
    }

    /// Member `key` of message `i` that `api` has no equivalent for.
    ///
    /// # Errors
    /// The member is not droppable, or the policy is `reject`.
    pub fn message_member(&mut self, i: usize, key: &str, api: &str) -> Result<(), Refusal> {
        self.decide(
            &format!("messages[].{key}"),
            || format!("messages[{i}].{key}"),
            api,
        )
    }

    fn decide(
        &mut self,
        name: &str,
        field: impl FnOnce() -> String,
        api: &str,
    ) -> Result<(), Refusal> {
        let droppable = DROPPABLE.iter().position(|d| *d == name);
        match droppable {
            Some(i) if self.policy == UnsupportedParams::Drop || ALWAYS_DROPPED.contains(&name) => {
                self.dropped.0 |= 1 << i;
                Ok(())
            }
            Some(_) => Err(Refusal::new(
                field(),
                format!(
                    "{api} has no equivalent: remove it, set `unsupported_params = \"drop\"` \
                     on the provider or its interface to have it dropped, or pin the request to \
                     a provider that speaks OpenAI's API"
                ),
            )),
            None => Err(Refusal::unsupported(&field(), api)),
        }
    }
}

/// An answer the provider sent that is not an answer to relay: a safety block (a client
/// error, not held against the provider) or a body of the wrong shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unanswerable {
    /// The provider's safety system blocked the prompt or the answer.
    Blocked(String),
    /// The body is not the dialect's answer.
    Malformed(String),
}

/// Request members a dialect's translation does not copy: set by the gateway (`model`), read
/// by [`max_tokens`], or read by the stream's translation.
pub fn handled_elsewhere(key: &str) -> bool {
    matches!(
        key,
        "model" | "stream" | "max_tokens" | "max_completion_tokens" | "stream_options"
    )
}

/// Whether a member counts as absent: `null` (an SDK writing every field) or `false`.
pub fn absent(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}

/// The client's `max_completion_tokens` or `max_tokens`, if given.
///
/// # Errors
/// The value is not a positive whole number.
pub fn max_tokens(body: &Map<String, Value>) -> Result<Option<u64>, Refusal> {
    for key in ["max_completion_tokens", "max_tokens"] {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => {
                return match v.as_u64() {
                    Some(n) if n > 0 => Ok(Some(n)),
                    _ => Err(Refusal::new(key, "must be a positive whole number")),
                }
            }
        }
    }
    Ok(None)
}

/// Message `i` of the client's `messages`, checked to hold only the members a native dialect
/// translates (`role`, `content`, `tool_calls`, `tool_call_id`); the others go to
/// `leftovers` (a `name` may be dropped).
///
/// # Errors
/// Not an object, or another member that is set and not dropped (an `audio`, ...).
pub fn message(m: &Value, i: usize, api: &str, leftovers: &mut Leftovers) -> Result<(), Refusal> {
    let Some(fields) = m.as_object() else {
        return Err(Refusal::new(format!("messages[{i}]"), "must be an object"));
    };
    for (k, v) in fields {
        if !matches!(
            k.as_str(),
            "role" | "content" | "tool_calls" | "tool_call_id"
        ) && !absent(v)
        {
            leftovers.message_member(i, k, api)?;
        }
    }
    Ok(())
}

/// A message role the dialect has no turn for.
#[must_use]
pub fn unknown_role(i: usize, role: &str, api: &str) -> Refusal {
    Refusal::new(
        format!("messages[{i}].role"),
        format!(
            "`{role}` has no equivalent in {api} (system, developer, user, assistant and tool do)"
        ),
    )
}

/// Appends a turn of `role` whose `key` (`content`, `parts`) holds `items`; consecutive
/// messages of one role become one turn (the native APIs' turns alternate).
pub fn push_turn(turns: &mut Vec<Value>, role: &str, key: &str, items: Vec<Value>) {
    if let Some(last) = turns.last_mut().filter(|t| t["role"] == role) {
        if let Some(list) = last[key].as_array_mut() {
            list.extend(items);
        }
        return;
    }
    turns.push(json!({"role": role, key: items}));
}

/// `stop` as a list of strings.
///
/// # Errors
/// `stop` is neither a string nor a list of strings.
pub fn stop_sequences(v: &Value) -> Result<Vec<Value>, Refusal> {
    match v {
        Value::String(s) => Ok(vec![json!(s)]),
        Value::Array(items) if items.iter().all(Value::is_string) => Ok(items.clone()),
        _ => Err(Refusal::new(
            "stop",
            "must be a string or a list of strings",
        )),
    }
}

/// `n`: only one choice can be asked of a native dialect.
///
/// # Errors
/// `n` is not 1.
pub fn single_choice(v: &Value, api: &str) -> Result<(), Refusal> {
    if v.as_u64() == Some(1) {
        Ok(())
    } else {
        Err(Refusal::new(
            "n",
            format!("{api} gives one choice per request: leave `n` out or set it to 1"),
        ))
    }
}

/// Whether the client asked for a usage chunk at the end of a stream.
#[must_use]
pub fn wants_stream_usage(body: &Map<String, Value>) -> bool {
    body.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true)
}

/// The text of a message's content: a string, or the `text` parts of a list.
///
/// # Errors
/// A part that is not text, or content of another shape.
pub fn text_of(content: &Value, at: &str) -> Result<String, Refusal> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(Refusal::new(
                            format!("{at}[{j}]"),
                            "only text parts can go here",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(Refusal::new(at, "must be a string or a list of parts")),
    }
}

/// A `data:` URL split into its media type and base64 payload.
#[must_use]
pub fn data_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("data:")?;
    let (media, data) = rest.split_once(";base64,")?;
    Some((media, data))
}

/// OpenAI's `usage` from input, cached-input and output token counts (`prompt_tokens`
/// includes the cached ones, as OpenAI counts them).
#[must_use]
pub fn usage(prompt: u64, cached: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}
    })
}

/// Seconds since the epoch, for `created`.
#[must_use]
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new id with `prefix` and 96 random bits (24 hex digits), for an answer or a tool call
/// whose provider gave none: every answer and call has its own, so that a client's later
/// turns never confuse two (Gemini numbered every answer's calls from `call_0`).
#[must_use]
pub fn fresh_id(prefix: &str) -> String {
    let bits: u128 = rand::Rng::random(&mut rand::rng());
    format!("{prefix}{:024x}", bits >> 32)
}

/// A tool call in OpenAI's shape; `arguments` is the JSON text of the call's input.
#[must_use]
pub fn tool_call(id: &str, name: &str, input: &Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}})
}

/// A whole OpenAI chat completion of one choice.
#[must_use]
pub fn completion(
    id: &str,
    model: &str,
    text: Option<&str>,
    tool_calls: Vec<Value>,
    finish_reason: &str,
    usage: &Value,
) -> Value {
    let mut message = json!({"role": "assistant", "content": text});
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls);
    }
    json!({
        "id": id,
        "object": "chat.completion",
        "created": now_s(),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason}],
        "usage": usage
    })
}

/// Writes OpenAI stream chunks of one answer.
#[derive(Debug)]
pub struct ChunkWriter {
    pub id: String,
    pub model: String,
    created: u64,
}

impl ChunkWriter {
    #[must_use]
    pub fn new(id: String, model: &str) -> ChunkWriter {
        ChunkWriter {
            id,
            model: model.to_owned(),
            created: now_s(),
        }
    }

    /// A chunk with `delta` and `finish_reason` as one `data:` event.
    pub fn delta(&self, out: &mut Vec<u8>, delta: &Value, finish_reason: Option<&str>) {
        Self::event(
            out,
            &json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]}),
        );
    }

    /// The usage chunk OpenAI sends last when `stream_options.include_usage` is set.
    pub fn usage(&self, out: &mut Vec<u8>, usage: &Value) {
        Self::event(
            out,
            &json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage}),
        );
    }

    fn event(out: &mut Vec<u8>, chunk: &Value) {
        out.extend_from_slice(b"data: ");
        // Writing a tree into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, chunk);
        out.extend_from_slice(b"\n\n");
    }
}

/// The end marker of an OpenAI stream.
pub fn done(out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: [DONE]\n\n");
}

/// An error event in OpenAI's shape: the relay ends the stream there as broken.
pub fn error_event(out: &mut Vec<u8>, message: &str, code: &str) {
    let e =
        json!({"error": {"message": message, "type": "api_error", "param": null, "code": code}});
    out.extend_from_slice(format!("data: {e}\n\n").as_bytes());
}

/// Why a stream with an event that is not JSON is broken.
const NOT_JSON: &str = "the provider sent an event that is not JSON";

/// The longest event held while its end has not arrived.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// What a dialect does with each event of its stream.
pub trait EventTranslator: Send {
    /// Translates one event's `data` (JSON) into OpenAI events appended to `out`.
    ///
    /// # Errors
    /// The event is not the dialect's: the stream is broken there.
    fn data(&mut self, data: &Value, out: &mut Vec<u8>) -> Result<(), String>;
    /// An event whose data is OpenAI's end marker `[DONE]`: only OpenAI's own stream has one
    /// (read back by the client APIs in `server/clients`); elsewhere it is not JSON.
    ///
    /// # Errors
    /// The dialect has no such marker.
    fn done(&mut self, _out: &mut Vec<u8>) -> Result<(), String> {
        Err(NOT_JSON.to_owned())
    }
    /// The provider's stream ended cleanly: append what closes the OpenAI stream, if the
    /// answer is whole.
    fn end(&mut self, out: &mut Vec<u8>);
}

/// A provider's stream bytes → OpenAI stream events: server-sent events ([`SseTranslator`]) or
/// Bedrock's binary event stream.
pub trait StreamTranslator: Send {
    /// Takes the next bytes; returns the OpenAI events of the whole events they complete.
    ///
    /// # Errors
    /// The stream is broken there (an event not the dialect's, a bad frame, a bound passed).
    fn feed(&mut self, bytes: &[u8]) -> Result<Bytes, String>;
    /// The provider's stream ended cleanly.
    ///
    /// # Errors
    /// What is left is not a whole event.
    fn end(&mut self) -> Result<Bytes, String>;
}

/// Splits a provider's server-sent events and translates each.
pub struct SseTranslator {
    pending: Vec<u8>,
    inner: Box<dyn EventTranslator>,
}

impl SseTranslator {
    #[must_use]
    pub fn new(inner: Box<dyn EventTranslator>) -> SseTranslator {
        SseTranslator {
            pending: Vec::new(),
            inner,
        }
    }

    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        let mut data: Vec<u8> = Vec::new();
        for line in event.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(d) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(d.strip_prefix(b" ").unwrap_or(d));
            }
        }
        if data.is_empty() {
            // A comment, or an `event:` line alone.
            return Ok(());
        }
        if data == b"[DONE]" {
            return self.inner.done(out);
        }
        let value: Value = serde_json::from_slice(&data).map_err(|_| NOT_JSON.to_owned())?;
        self.inner.data(&value, out)
    }
}

impl StreamTranslator for SseTranslator {
    /// An event that is not JSON or not the dialect's, or longer than the bound, breaks it.
    fn feed(&mut self, bytes: &[u8]) -> Result<Bytes, String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some((end, next)) = event_end(&self.pending[start..]) {
            let event = self.pending[start..start + end].to_vec();
            self.event(&event, &mut out)?;
            start += next;
        }
        self.pending.drain(..start);
        if self.pending.len() > MAX_EVENT_BYTES {
            return Err(format!(
                "the provider sent an event longer than {MAX_EVENT_BYTES} bytes"
            ));
        }
        Ok(Bytes::from(out))
    }

    fn end(&mut self) -> Result<Bytes, String> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        if !rest.iter().all(u8::is_ascii_whitespace) {
            self.event(&rest, &mut out)?;
        }
        self.inner.end(&mut out);
        Ok(Bytes::from(out))
    }
}

/// Where the first server-sent event in `bytes` ends: the end of its text and the start of
/// the next (past the blank line, `\n\n` or `\r\n\r\n`).
#[must_use]
pub fn event_end(bytes: &[u8]) -> Option<(usize, usize)> {
    let lf = memchr::memmem::find(bytes, b"\n\n").map(|i| (i, i + 2));
    let crlf = memchr::memmem::find(bytes, b"\r\n\r\n").map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The provider's byte stream with its events translated; a clean end appends what closes the
/// OpenAI stream. Chunks that translate to nothing (pings) are skipped.
pub fn translate_stream(
    rest: super::ChunkStream,
    translator: Box<dyn StreamTranslator>,
) -> super::ChunkStream {
    use futures_util::StreamExt;
    let stream = futures_util::stream::unfold(Some((rest, translator)), |state| async move {
        let (mut rest, mut tr) = state?;
        loop {
            match rest.next().await {
                Some(Ok(bytes)) => match tr.feed(&bytes) {
                    Ok(out) if out.is_empty() => {}
                    Ok(out) => return Some((Ok(out), Some((rest, tr)))),
                    Err(why) => return Some((Err(why), None)),
                },
                Some(Err(why)) => return Some((Err(why), None)),
                None => {
                    return match tr.end() {
                        Ok(out) if out.is_empty() => None,
                        Ok(out) => Some((Ok(out), None)),
                        Err(why) => Some((Err(why), None)),
                    }
                }
            }
        }
    });
    Box::pin(stream)
}

/// An assistant's `tool_calls` (OpenAI's shape, at `at`), each written by `block` from its id,
/// its function's name and its arguments parsed (JSON text in OpenAI's; empty text is `{}`).
///
/// # Errors
/// Not a list, or arguments that are not JSON text (the member named).
pub fn tool_calls(
    calls: &Value,
    at: &str,
    block: impl Fn(Option<&Value>, Option<&Value>, Value) -> Value,
) -> Result<Vec<Value>, Refusal> {
    let Some(list) = calls.as_array() else {
        return Err(Refusal::new(at, "must be a list"));
    };
    list.iter()
        .enumerate()
        .map(|(j, c)| {
            let args = c
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or("{}");
            let input: Value =
                serde_json::from_str(if args.trim().is_empty() { "{}" } else { args }).map_err(
                    |_| Refusal::new(format!("{at}[{j}].function.arguments"), "must be JSON text"),
                )?;
            Ok(block(c.get("id"), c.pointer("/function/name"), input))
        })
        .collect()
}

/// The parameter policy's table, checked for one dialect (the tests of each dialect module).
#[cfg(test)]
pub(crate) mod policy_table {
    use super::{Leftovers, Refusal, UnsupportedParams};
    use serde_json::{json, Value};

    /// What a dialect does with a request that sets one member.
    #[derive(Debug)]
    pub enum Expect {
        /// The API expresses it: taken under either policy, nothing dropped.
        Translated,
        /// Dropped under `drop` (named so) and refused under `reject` (at this path).
        Dropped(&'static str, &'static str),
        /// Dropped under either policy.
        AlwaysDropped(&'static str),
        /// Refused under either policy, at this path.
        Refused(&'static str),
    }

    /// What a translation dropped, or the path it refused.
    fn names(r: &Result<(Value, super::Dropped), Refusal>) -> Result<Option<String>, String> {
        r.as_ref()
            .map(|(_, d)| d.header())
            .map_err(|e| e.field.clone())
    }

    /// The rows every native kind shares: what none of their APIs expresses.
    fn every_native_kind() -> Vec<(Value, Expect)> {
        let name = json!([{"role": "user", "name": "ann", "content": "hi"}]);
        let audio = json!([{"role": "user", "content": [{"type": "input_audio"}]}]);
        vec![
            (
                json!({"logprobs": true}),
                Expect::Dropped("logprobs", "logprobs"),
            ),
            (
                json!({"top_logprobs": 2}),
                Expect::Dropped("top_logprobs", "top_logprobs"),
            ),
            (
                json!({"metadata": {"k": "v"}}),
                Expect::Dropped("metadata", "metadata"),
            ),
            (json!({"store": true}), Expect::Dropped("store", "store")),
            (
                json!({"messages": name}),
                Expect::Dropped("messages[].name", "messages[0].name"),
            ),
            (
                json!({"service_tier": "flex"}),
                Expect::AlwaysDropped("service_tier"),
            ),
            (
                json!({"logit_bias": {"1": 2}}),
                Expect::Refused("logit_bias"),
            ),
            (
                json!({"modalities": ["audio"]}),
                Expect::Refused("modalities"),
            ),
            (json!({"n": 2}), Expect::Refused("n")),
            (
                json!({"messages": audio}),
                Expect::Refused("messages[0].content[0].type"),
            ),
        ]
    }

    /// Checks each row (members set over a one-message request; `messages` replaces the
    /// conversation), then those [`every_native_kind`] shares, under both policies. A dropped
    /// member leaves the provider's request exactly as if the client had not sent it.
    pub fn check(
        translate: &dyn Fn(&Value, &mut Leftovers) -> Result<Value, Refusal>,
        rows: &[(Value, Expect)],
    ) {
        let base = json!({"messages": [{"role": "user", "content": "hi"}]});
        let run = |b: &Value, policy| {
            let mut leftovers = Leftovers::new(policy);
            translate(b, &mut leftovers).map(|v| (v, leftovers.dropped()))
        };
        let (without, _) = run(&base, UnsupportedParams::Drop).unwrap();
        for (patch, expect) in rows.iter().chain(&every_native_kind()) {
            let mut b = base.clone();
            for (k, v) in patch.as_object().unwrap() {
                b[k] = v.clone();
            }
            let dropped = run(&b, UnsupportedParams::Drop);
            let rejected = run(&b, UnsupportedParams::Reject);
            match expect {
                Expect::Translated => {
                    assert_eq!(names(&dropped), Ok(None), "{patch}");
                    assert_eq!(names(&rejected), Ok(None), "{patch}");
                }
                Expect::Dropped(name, field) => {
                    let (out, _) = dropped.as_ref().unwrap();
                    assert_eq!(out, &without, "{patch}: sent as if absent");
                    assert_eq!(names(&dropped), Ok(Some((*name).to_owned())), "{patch}");
                    assert_eq!(rejected.unwrap_err().field, *field, "{patch}");
                }
                Expect::AlwaysDropped(name) => {
                    for r in [&dropped, &rejected] {
                        assert_eq!(&r.as_ref().unwrap().0, &without, "{patch}");
                        assert_eq!(names(r), Ok(Some((*name).to_owned())), "{patch}");
                    }
                }
                Expect::Refused(field) => {
                    assert_eq!(dropped.unwrap_err().field, *field, "{patch}");
                    assert_eq!(rejected.unwrap_err().field, *field, "{patch}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn droppable_members_are_named_by_fixed_text_in_one_header() {
        let mut l = Leftovers::new(UnsupportedParams::Drop);
        l.member("seed", "X").unwrap();
        l.message_member(3, "name", "X").unwrap();
        l.member("user", "X").unwrap();
        l.message_member(0, "name", "X").unwrap();
        // In the table's order, each once, without the message's index.
        assert_eq!(
            l.dropped().header().as_deref(),
            Some("user,seed,messages[].name")
        );
        // Anything off the list is refused by its path, whatever the policy.
        assert_eq!(l.member("logit_bias", "X").unwrap_err().field, "logit_bias");
        assert_eq!(
            l.message_member(2, "audio", "X").unwrap_err().field,
            "messages[2].audio"
        );
        let mut strict = Leftovers::new(UnsupportedParams::Reject);
        let refusal = strict.member("user", "X").unwrap_err();
        assert!(
            refusal.why.contains("unsupported_params = \"drop\""),
            "{refusal:?}"
        );
        strict.member("service_tier", "X").unwrap();
        assert_eq!(strict.dropped().header().as_deref(), Some("service_tier"));
        assert_eq!(Dropped::default().header(), None);
        // Every droppable name fits the bit set.
        assert!(DROPPABLE.len() <= 16);
    }
}
