//! The client APIs besides chat completions: OpenAI's Responses API (`POST /v1/responses`,
//! [`responses`]) and Anthropic's Messages API (`POST /v1/messages`, [`messages`]).
//!
//! Each writes the client's request as a chat completions body and routes it through
//! [`super::route_chat`], the path `/v1/chat/completions` takes (model → interface, routing,
//! policies, fallback, hedging, stream holds and continuations, feedback, judge and audit);
//! then writes the answer back in the client's API: an unstreamed answer as one object, a
//! stream event by event as the chat chunks arrive ([`ChunkReader`]), errors in the API's
//! error shape. What the chat path answers is read into one [`Answer`] (blocks of text and
//! tool calls, the finish reason, the usage) that each API's [`ApiWriter`] writes.
//!
//! Stateless: nothing is stored between requests. See docs/clients.md for what each API
//! supports and what it refuses.

pub mod messages;
pub mod responses;

use super::error::ApiError;
use crate::upstream::dialect::{self, EventTranslator, SseTranslator};
use crate::upstream::{ChunkStream, ClientBody};
use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// One piece of an answer, in the order the answer gave them.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    Text(String),
    ToolCall {
        call_id: String,
        name: String,
        /// The call's arguments as JSON text (as far as they have streamed).
        arguments: String,
    },
}

/// An answer of the chat path, as the client APIs write it.
#[derive(Debug, Clone, Default)]
pub struct Answer {
    /// The routed request's id without its `req-` prefix: the API's ids are made from it, so
    /// that they are unique and lead back to `x-equiroute-request-id`.
    pub id: String,
    /// The model that answered.
    pub model: String,
    pub blocks: Vec<Block>,
    /// Chat's `finish_reason`, once known.
    pub finish_reason: Option<String>,
    /// Chat's `usage`, once known.
    pub usage: Option<Value>,
}

impl Answer {
    /// An unstreamed chat completion's first choice.
    #[must_use]
    pub fn from_completion(chat: &Value, id: String) -> Answer {
        let message = chat.pointer("/choices/0/message").unwrap_or(&Value::Null);
        let mut blocks = Vec::new();
        for key in ["content", "refusal"] {
            if let Some(text) = message
                .get(key)
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
            {
                blocks.push(Block::Text(text.to_owned()));
            }
        }
        for call in message
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let text = |p: &str| {
                call.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            blocks.push(Block::ToolCall {
                call_id: text("/id"),
                name: text("/function/name"),
                arguments: text("/function/arguments"),
            });
        }
        Answer {
            id,
            model: chat["model"].as_str().unwrap_or_default().to_owned(),
            blocks,
            finish_reason: chat
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
                .map(str::to_owned),
            usage: chat.get("usage").filter(|u| u.is_object()).cloned(),
        }
    }

    /// Chat's usage count at `pointer` (0 when not reported).
    #[must_use]
    pub fn tokens(&self, pointer: &str) -> u64 {
        self.usage
            .as_ref()
            .and_then(|u| u.pointer(pointer))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// The answer as a chat assistant message (`content` and `tool_calls`).
    #[must_use]
    pub fn chat_message(&self) -> Value {
        let mut text: Option<String> = None;
        let mut calls = Vec::new();
        for b in &self.blocks {
            match b {
                Block::Text(t) => text.get_or_insert_with(String::new).push_str(t),
                Block::ToolCall {
                    call_id,
                    name,
                    arguments,
                } => calls.push(json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}})),
            }
        }
        let mut m = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }
}

/// How a client API writes an answer: whole ([`ApiWriter::object`]), or as the events of its
/// stream while the answer's blocks arrive. Every hook gets the answer as far as it has come;
/// `index` is a block's place in `answer.blocks`.
pub trait ApiWriter: Send + 'static {
    /// The whole answer as the API's object: the unstreamed answer, and what the stream's
    /// last event carries.
    fn object(&self, answer: &Answer) -> Value;
    /// The stream's first events (the model is known).
    fn start(&mut self, answer: &Answer, out: &mut Vec<u8>);
    /// Block `index` begins.
    fn open(&mut self, answer: &Answer, index: usize, out: &mut Vec<u8>);
    /// Block `index` grew by `delta`.
    fn delta(&mut self, answer: &Answer, index: usize, delta: &str, out: &mut Vec<u8>);
    /// Block `index` is whole.
    fn close(&mut self, answer: &Answer, index: usize, out: &mut Vec<u8>);
    /// The answer is whole (its finish reason and usage are in).
    fn finish(&mut self, answer: &Answer, out: &mut Vec<u8>);
    /// The stream broke: the last event, saying why.
    fn fail(&mut self, answer: &Answer, message: &str, out: &mut Vec<u8>);
}

/// Writes one server-sent event named `name`.
pub fn event(out: &mut Vec<u8>, name: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // Writing a tree into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}

/// Reads the chat chunks the request path relays (`chat.completion.chunk` events, `[DONE]`,
/// an error event when the stream broke, continuation markers) into an [`Answer`] and has
/// `W` write the API's events as the blocks arrive.
pub struct ChunkReader<W> {
    writer: W,
    answer: Answer,
    started: bool,
    /// Chat's tool call index → the call's block.
    tools: Vec<(u64, usize)>,
    /// The block being written, closed when another begins.
    open: Option<usize>,
    ended: bool,
}

impl<W: ApiWriter> ChunkReader<W> {
    pub fn new(writer: W, id: String) -> ChunkReader<W> {
        ChunkReader {
            writer,
            answer: Answer {
                id,
                ..Answer::default()
            },
            started: false,
            tools: Vec::new(),
            open: None,
            ended: false,
        }
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        if !self.started {
            self.started = true;
            self.writer.start(&self.answer, out);
        }
    }

    /// Closes the open block, if any.
    fn close(&mut self, out: &mut Vec<u8>) {
        if let Some(i) = self.open.take() {
            self.writer.close(&self.answer, i, out);
        }
    }

    /// Opens block `block` after closing the one before.
    fn open(&mut self, block: Block, out: &mut Vec<u8>) -> usize {
        self.close(out);
        self.answer.blocks.push(block);
        let i = self.answer.blocks.len() - 1;
        self.open = Some(i);
        self.writer.open(&self.answer, i, out);
        i
    }

    /// Appends `delta` to block `i` (a text or the arguments of a call).
    fn grow(&mut self, i: usize, delta: &str, out: &mut Vec<u8>) {
        if let Some(Block::Text(s) | Block::ToolCall { arguments: s, .. }) =
            self.answer.blocks.get_mut(i)
        {
            s.push_str(delta);
        }
        self.writer.delta(&self.answer, i, delta, out);
    }

    fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        let i = match self.open {
            Some(i) if matches!(self.answer.blocks[i], Block::Text(_)) => i,
            _ => self.open(Block::Text(String::new()), out),
        };
        self.grow(i, text, out);
    }

    fn tool_call(&mut self, call: &Value, out: &mut Vec<u8>) {
        let n = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let known = self.tools.iter().find(|(k, _)| *k == n).map(|&(_, i)| i);
        let i = if let Some(i) = known {
            i
        } else {
            let text = |p: &str| call.pointer(p).and_then(Value::as_str).unwrap_or_default();
            let call_id = match text("/id") {
                "" => format!("call_{n}"),
                id => id.to_owned(),
            };
            let block = Block::ToolCall {
                call_id,
                name: text("/function/name").to_owned(),
                arguments: String::new(),
            };
            let i = self.open(block, out);
            self.tools.push((n, i));
            i
        };
        if let Some(args) = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
        {
            self.grow(i, args, out);
        }
    }

    fn fail(&mut self, message: &str, out: &mut Vec<u8>) {
        self.start(out);
        self.writer.fail(&self.answer, message, out);
        self.ended = true;
    }
}

impl<W: ApiWriter> EventTranslator for ChunkReader<W> {
    fn data(&mut self, chunk: &Value, out: &mut Vec<u8>) -> Result<(), String> {
        if self.ended {
            return Ok(());
        }
        if let Some(e) = chunk.get("error") {
            let message = e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the answer's stream broke");
            self.fail(message, out);
            return Ok(());
        }
        // After a restart the answer begins again, which these APIs cannot show (their
        // clients keep what was sent): the stream ends there, as broken.
        if chunk.pointer("/equiroute/event").and_then(Value::as_str) == Some("restart") {
            self.fail(
                "the provider's stream broke and the answer was restarted on another provider, \
                 which this API cannot show: send the request again",
                out,
            );
            return Ok(());
        }
        if !self.started {
            chunk["model"]
                .as_str()
                .unwrap_or_default()
                .clone_into(&mut self.answer.model);
            self.start(out);
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.answer.usage = Some(u.clone());
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            return Ok(());
        };
        let delta = &choice["delta"];
        for key in ["content", "refusal"] {
            if let Some(t) = delta
                .get(key)
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
            {
                self.text(t, out);
            }
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.tool_call(call, out);
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.answer.finish_reason = Some(f.to_owned());
        }
        Ok(())
    }

    fn done(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        if !self.ended {
            self.start(out);
            self.close(out);
            self.writer.finish(&self.answer, out);
            self.ended = true;
        }
        Ok(())
    }

    fn end(&mut self, _out: &mut Vec<u8>) {
        // The relay ends every stream with `[DONE]` or an error event: nothing to add.
    }
}

/// Serves one request of a client API: the body parsed, written as chat by `to_chat`, routed
/// by [`route`], and the answer written by the writer `writer` makes from the request.
pub async fn serve<W: ApiWriter>(
    state: &Arc<super::AppState>,
    headers: &HeaderMap,
    caller: &super::auth::Caller,
    body: super::BodyBytes,
    to_chat: fn(&Value) -> Result<Value, ApiError>,
    writer: fn(&Value) -> W,
) -> Result<Response, ApiError> {
    let mut meta = super::RequestMeta::of(headers, caller)?;
    // These APIs' writers do not read the chat restart marker: their streams never restart
    // after content.
    meta.restart_events = false;
    let body = super::parse_json(body)?;
    let chat = to_chat(body.json())?;
    route(state, meta, chat, writer(body.json())).await
}

/// The request `body` as a JSON object, or a 400 saying it must be an `api` request.
///
/// # Errors
/// The body is not an object.
pub fn object<'a>(body: &'a Value, api: &str) -> Result<&'a Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| {
        ApiError::bad_request(
            "invalid_body",
            None,
            format!("the body must be a JSON object (a {api} request)"),
        )
    })
}

/// A 400 for the client's field `field`.
pub fn bad_field(field: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::bad_field("invalid_request", field.into(), message)
}

/// A 400 for a field the gateway does not support, saying why.
pub fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::bad_field(
        "unsupported_parameter",
        super::echo(field).into_owned(),
        format!("`{}` is not supported: {why}", super::echo(field)),
    )
}

/// A count of tokens (`max_output_tokens`, `max_tokens`) checked as chat checks its own.
///
/// # Errors
/// Not a whole number from 1 to 4294967295 (named).
pub fn token_count(v: &Value, field: &str) -> Result<Value, ApiError> {
    match v.as_u64() {
        Some(n) if n >= 1 && u32::try_from(n).is_ok() => Ok(json!(n)),
        _ => Err(bad_field(
            field,
            format!("`{field}` must be a whole number of tokens from 1 to 4294967295, got {v}"),
        )),
    }
}

/// `stream` checked (true or false); when true, the chat body asks for the usage chunk too.
///
/// # Errors
/// Not a boolean.
pub fn stream_into(v: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(stream) = v.as_bool() else {
        return Err(bad_field(
            "stream",
            format!(
                "`stream` must be true or false, got {}",
                super::json_kind(v)
            ),
        ));
    };
    chat.insert("stream".into(), json!(stream));
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(())
}

/// Routes the chat body `chat` and writes the answer with `writer`: a 200 as the API's object
/// or stream; anything else (an error in OpenAI's shape) as it came.
pub async fn route<W: ApiWriter>(
    state: &Arc<super::AppState>,
    meta: super::RequestMeta,
    chat: Value,
    writer: W,
) -> Result<Response, ApiError> {
    let stream = chat.get("stream") == Some(&Value::Bool(true));
    let resp = super::route_chat(state, meta, ClientBody::from_json(chat)).await?;
    if resp.status() != StatusCode::OK {
        return Ok(resp);
    }
    let id = resp
        .headers()
        .get("x-equiroute-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let id = id.strip_prefix("req-").unwrap_or(id).to_owned();
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    if stream {
        use futures_util::StreamExt;
        let chunks: ChunkStream = Box::pin(
            body.into_data_stream()
                .map(|r| r.map_err(|e| e.to_string())),
        );
        let reader = SseTranslator::new(Box::new(ChunkReader::new(writer, id)));
        let events = dialect::translate_stream(chunks, Box::new(reader))
            .map(|r| r.map_err(std::io::Error::other));
        return Ok(Response::from_parts(parts, Body::from_stream(events)));
    }
    // The chat path's answer is already in memory, whole.
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|_| ApiError::internal())?;
    let chat: Value = serde_json::from_slice(&bytes).map_err(|_| {
        ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            "invalid_answer",
            "the provider's answer is not JSON",
        )
    })?;
    let object = writer.object(&Answer::from_completion(&chat, id));
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(Response::from_parts(parts, Body::from(object.to_string())))
}
