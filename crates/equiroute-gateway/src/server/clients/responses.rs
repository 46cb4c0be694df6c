//! OpenAI's Responses API, `POST /v1/responses`, routed as a chat completion.
//!
//! Request → chat: `instructions` → a first system message; `input` (a string, or items:
//! messages with `input_text` / `output_text` / `input_image` / `refusal` parts,
//! `function_call` → an assistant's `tool_calls`, `function_call_output` → a `tool` message,
//! `reasoning` items left out) → `messages`; `max_output_tokens` → `max_completion_tokens`;
//! function `tools` and `tool_choice`; `text.format` (`json_schema`, `json_object`) →
//! `response_format`, `text.verbosity` → `verbosity`; `reasoning.effort` →
//! `reasoning_effort`; `temperature`, `top_p`, `user`, `parallel_tool_calls`, `service_tier`,
//! `safety_identifier`, `prompt_cache_key` as they are. Ignored: `store` (nothing is stored),
//! `metadata`, `include`, `stream_options`, `truncation = "disabled"`. Refused with a 400 that
//! names the field: `previous_response_id`, `conversation` and `item_reference` items (the
//! gateway keeps no state: send the whole conversation), `background`, `prompt`, built-in
//! tools, file inputs, and any other field.
//!
//! Answer: a `response` object whose `output` holds a `message` item (`output_text`) and a
//! `function_call` item per tool call, `status` `completed` or `incomplete` (`length` →
//! `max_output_tokens`, `content_filter`), `usage` in the Responses API's names. Streamed:
//! `response.created`, `response.in_progress`, per item `response.output_item.added`, (text)
//! `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
//! `response.content_part.done`, (call) `response.function_call_arguments.delta`…,
//! `response.function_call_arguments.done`, then `response.output_item.done`; last
//! `response.completed` (or `response.incomplete`) with the whole response, or
//! `response.failed` when the stream broke. Errors keep OpenAI's error shape.

use super::{bad_field, event, unsupported, Answer, ApiWriter, Block};
use crate::server::auth::Caller;
use crate::server::error::ApiError;
use crate::server::{AppState, BodyBytes, TakenHeaders};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// `POST /v1/responses`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    TakenHeaders(headers): TakenHeaders,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    super::serve(&state, &headers, &caller, body, to_chat, Writer::new).await
}

/// Why a conversation cannot be continued by reference.
const STATELESS: &str = "the gateway keeps no conversations (it is stateless): send the whole \
conversation in `input`, the earlier output items included";

/// The chat completions body for a Responses request.
///
/// # Errors
/// A field or item the gateway does not translate, or a value of the wrong shape (named).
pub fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let obj = super::object(body, "Responses API")?;
    let mut chat = Map::new();
    let mut messages = Vec::new();
    if let Some(i) = obj.get("instructions").filter(|v| !v.is_null()) {
        let Some(text) = i.as_str() else {
            return Err(bad_field("instructions", "`instructions` must be a string"));
        };
        messages.push(json!({"role": "system", "content": text}));
    }
    for (key, value) in obj {
        if value.is_null() {
            continue;
        }
        match key.as_str() {
            "instructions" | "store" | "metadata" | "include" | "stream_options" => {}
            "model" | "temperature" | "top_p" | "user" | "parallel_tool_calls"
            | "service_tier" | "safety_identifier" | "prompt_cache_key" => {
                chat.insert(key.clone(), value.clone());
            }
            "input" => input(value, &mut messages)?,
            "stream" => super::stream_into(value, &mut chat)?,
            "max_output_tokens" => {
                chat.insert(
                    "max_completion_tokens".into(),
                    super::token_count(value, key)?,
                );
            }
            "tools" => {
                chat.insert("tools".into(), tools(value)?);
            }
            "tool_choice" => {
                chat.insert("tool_choice".into(), tool_choice(value)?);
            }
            "text" => text(value, &mut chat)?,
            "reasoning" => {
                if let Some(effort) = value.get("effort").filter(|e| !e.is_null()) {
                    chat.insert("reasoning_effort".into(), effort.clone());
                }
            }
            "truncation" if value == "disabled" => {}
            "truncation" => {
                return Err(unsupported(
                    key,
                    "the gateway does not cut conversations: leave it out or set it to \"disabled\"",
                ))
            }
            "background" if value == &Value::Bool(false) => {}
            "previous_response_id" | "conversation" => return Err(unsupported(key, STATELESS)),
            other => {
                return Err(unsupported(
                    other,
                    "the gateway routes Responses requests as chat completions, which have no equivalent: leave it out",
                ))
            }
        }
    }
    if messages.is_empty() {
        return Err(bad_field(
            "input",
            "`input` is required: a string, or a non-empty list of items",
        ));
    }
    chat.insert("messages".into(), Value::Array(messages));
    Ok(Value::Object(chat))
}

/// `input` → chat messages, appended to `out`.
fn input(value: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match value {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(items) => items,
        _ => {
            return Err(bad_field(
                "input",
                "`input` must be a string or a list of items",
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = match item.get("type").and_then(Value::as_str) {
            Some(t) => t,
            None if item.get("role").is_some() => "message",
            None => {
                return Err(bad_field(
                    format!("{at}.type"),
                    format!("`{at}` needs a `type` (message, function_call, function_call_output) or a `role`"),
                ))
            }
        };
        match kind {
            "message" => out.push(message(item, &at)?),
            "function_call" => {
                let field = |f: &str| {
                    item.get(f)
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad_field(format!("{at}.{f}"), format!("`{at}.{f}` is required, as a string")))
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls after an assistant message belong to its turn.
                match out.last_mut().filter(|m| m["role"] == "assistant") {
                    Some(m) => match m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => m["tool_calls"] = json!([call]),
                    },
                    None => out.push(
                        json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                    ),
                }
            }
            "function_call_output" => {
                let Some(id) = item.get("call_id").and_then(Value::as_str) else {
                    return Err(bad_field(
                        format!("{at}.call_id"),
                        format!("`{at}.call_id` is required, as a string"),
                    ));
                };
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_parts(parts, &format!("{at}.output"))?,
                    _ => {
                        return Err(bad_field(
                            format!("{at}.output"),
                            format!("`{at}.output` must be a string or a list of input_text parts"),
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            // The model's reasoning from an earlier turn: chat has no place for it.
            "reasoning" => {}
            "item_reference" => return Err(unsupported(&format!("{at}.type"), STATELESS)),
            other => {
                return Err(bad_field(
                    format!("{at}.type"),
                    format!("`{}` items are not supported: message, function_call, function_call_output and reasoning are", crate::server::echo(other)),
                ))
            }
        }
    }
    Ok(())
}

/// A message item → a chat message.
fn message(item: &Value, at: &str) -> Result<Value, ApiError> {
    let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
    if !matches!(role, "user" | "assistant" | "system" | "developer") {
        return Err(bad_field(
            format!("{at}.role"),
            format!("`{at}.role` must be user, assistant, system or developer"),
        ));
    }
    let content = match item.get("content") {
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(parts)) if role == "user" => {
            let mut out = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                out.push(part(p, &format!("{at}.content[{j}]"))?);
            }
            Value::Array(out)
        }
        // Others take text only: joined, as chat's assistant and system messages read best.
        Some(Value::Array(parts)) => json!(text_parts(parts, &format!("{at}.content"))?),
        _ => {
            return Err(bad_field(
                format!("{at}.content"),
                format!("`{at}.content` must be a string or a list of parts"),
            ))
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// A user message's content part → a chat content part.
fn part(p: &Value, at: &str) -> Result<Value, ApiError> {
    match p.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text") => {
            Ok(json!({"type": "text", "text": p.get("text").cloned().unwrap_or_default()}))
        }
        Some("input_image") => {
            let Some(url) = p.get("image_url").and_then(Value::as_str) else {
                return Err(bad_field(
                    format!("{at}.image_url"),
                    format!("`{at}.image_url` is required (an http or data: URL); file ids are not supported"),
                ));
            };
            let mut image = json!({"url": url});
            if let Some(d) = p.get("detail").filter(|d| !d.is_null()) {
                image["detail"] = d.clone();
            }
            Ok(json!({"type": "image_url", "image_url": image}))
        }
        other => Err(bad_field(
            format!("{at}.type"),
            format!(
                "`{}` parts are not supported: input_text, output_text and input_image are",
                other.unwrap_or("(none)")
            ),
        )),
    }
}

/// The text of text parts (`input_text`, `output_text`, `refusal`), joined.
fn text_parts(parts: &[Value], at: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let piece = match p.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text") => p.get("text"),
            Some("refusal") => p.get("refusal"),
            _ => None,
        };
        let Some(piece) = piece.and_then(Value::as_str) else {
            return Err(bad_field(
                format!("{at}[{j}]"),
                format!("`{at}[{j}]` must be a text part (input_text or output_text)"),
            ));
        };
        text.push_str(piece);
    }
    Ok(text)
}

/// Function tools → chat tools; built-in tools are refused by name.
fn tools(value: &Value) -> Result<Value, ApiError> {
    let Some(list) = value.as_array() else {
        return Err(bad_field("tools", "`tools` must be a list"));
    };
    list.iter()
        .enumerate()
        .map(|(j, t)| {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                other => {
                    return Err(bad_field(
                        format!("tools[{j}].type"),
                        format!("`{}` tools are not supported: the gateway runs no built-in tools; only function tools are routed", other.unwrap_or("(none)")),
                    ))
                }
            }
            let mut f = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                    f.insert(key.into(), v.clone());
                }
            }
            if !f.get("name").is_some_and(Value::is_string) {
                return Err(bad_field(
                    format!("tools[{j}].name"),
                    format!("`tools[{j}].name` is required, as a string"),
                ));
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `tool_choice` → chat's.
fn tool_choice(value: &Value) -> Result<Value, ApiError> {
    match (value.as_str(), value.get("type").and_then(Value::as_str)) {
        (Some("auto" | "none" | "required"), _) => Ok(value.clone()),
        (None, Some("function")) if value.get("name").is_some_and(Value::is_string) => {
            Ok(json!({"type": "function", "function": {"name": value["name"]}}))
        }
        _ => Err(bad_field(
            "tool_choice",
            "`tool_choice` must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text` (`format`, `verbosity`) → chat's `response_format` and `verbosity`.
fn text(value: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(v) = value.get("verbosity").filter(|v| !v.is_null()) {
        chat.insert("verbosity".into(), v.clone());
    }
    let Some(format) = value.get("format").filter(|f| !f.is_null()) else {
        return Ok(());
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some("json_object") => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "description", "strict"] {
                if let Some(v) = format.get(key).filter(|v| !v.is_null()) {
                    schema.insert(key.into(), v.clone());
                }
            }
            if !schema.contains_key("schema") {
                return Err(bad_field(
                    "text.format.schema",
                    "`text.format.schema` is required for json_schema",
                ));
            }
            schema.entry("name").or_insert_with(|| json!("output"));
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": schema}),
            );
        }
        _ => {
            return Err(bad_field(
                "text.format.type",
                "`text.format.type` must be text, json_object or json_schema",
            ))
        }
    }
    Ok(())
}

/// A request field a response object repeats, and how to write its value when left out.
type Echoed = (&'static str, fn() -> Value);

/// The request fields a response object repeats, with the values they have when left out.
const ECHOED: [Echoed; 10] = [
    ("instructions", || Value::Null),
    ("max_output_tokens", || Value::Null),
    ("metadata", || json!({})),
    ("parallel_tool_calls", || json!(true)),
    ("temperature", || Value::Null),
    ("text", || json!({"format": {"type": "text"}})),
    ("tool_choice", || json!("auto")),
    ("tools", || json!([])),
    ("top_p", || Value::Null),
    ("user", || Value::Null),
];

/// Writes a chat answer as a Responses answer: the response object, or its stream's events.
pub struct Writer {
    created_at: u64,
    echoed: Map<String, Value>,
    /// The next event's `sequence_number`.
    sequence: u64,
}

impl Writer {
    #[must_use]
    pub fn new(request: &Value) -> Writer {
        let echoed = ECHOED
            .iter()
            .map(|(k, default)| {
                let v = request.get(*k).filter(|v| !v.is_null()).cloned();
                ((*k).to_owned(), v.unwrap_or_else(default))
            })
            .collect();
        Writer {
            created_at: crate::upstream::dialect::now_s(),
            echoed,
            sequence: 0,
        }
    }

    fn emit(&mut self, out: &mut Vec<u8>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        event(out, kind, &data);
    }

    /// The response object with `status` and `output`, the usage when known.
    fn response(&self, answer: &Answer, status: &str, output: &[Value]) -> Value {
        let mut r = json!({
            "id": format!("resp_{}", answer.id),
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "model": answer.model,
            "output": output,
            "previous_response_id": null,
            "store": false,
            "truncation": "disabled",
            "usage": null,
        });
        for (k, v) in &self.echoed {
            r[k] = v.clone();
        }
        r
    }

    /// Block `i` as an output item with `status`.
    fn item(answer: &Answer, i: usize, status: &str) -> Value {
        match &answer.blocks[i] {
            Block::Text(text) => json!({
                "type": "message", "id": format!("msg_{}_{i}", answer.id), "status": status,
                "role": "assistant",
                "content": if status == "in_progress" { json!([]) } else { json!([output_text(text)]) },
            }),
            Block::ToolCall {
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": format!("fc_{}_{i}", answer.id), "status": status,
                "call_id": call_id, "name": name,
                "arguments": if status == "in_progress" { "" } else { arguments.as_str() },
            }),
        }
    }

    fn item_id(answer: &Answer, i: usize) -> String {
        match answer.blocks[i] {
            Block::Text(_) => format!("msg_{}_{i}", answer.id),
            Block::ToolCall { .. } => format!("fc_{}_{i}", answer.id),
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// `status` and `incomplete_details` of an answer that ended for `finish_reason`.
fn ending(finish_reason: Option<&str>) -> (&'static str, Value) {
    match finish_reason {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    }
}

impl ApiWriter for Writer {
    fn object(&self, answer: &Answer) -> Value {
        let (status, incomplete) = ending(answer.finish_reason.as_deref());
        let output: Vec<Value> = (0..answer.blocks.len())
            .map(|i| Self::item(answer, i, "completed"))
            .collect();
        let mut r = self.response(answer, status, &output);
        r["incomplete_details"] = incomplete;
        if answer.usage.is_some() {
            let input = answer.tokens("/prompt_tokens");
            let output = answer.tokens("/completion_tokens");
            r["usage"] = json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": answer.tokens("/prompt_tokens_details/cached_tokens")},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": answer.tokens("/completion_tokens_details/reasoning_tokens")},
                "total_tokens": input + output,
            });
        }
        r
    }

    fn start(&mut self, answer: &Answer, out: &mut Vec<u8>) {
        let r = self.response(answer, "in_progress", &[]);
        self.emit(out, "response.created", json!({"response": r}));
        self.emit(out, "response.in_progress", json!({"response": r}));
    }

    fn open(&mut self, answer: &Answer, i: usize, out: &mut Vec<u8>) {
        let item = Self::item(answer, i, "in_progress");
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": i, "item": item}),
        );
        if let Block::Text(_) = answer.blocks[i] {
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": Self::item_id(answer, i), "output_index": i, "content_index": 0,
                    "part": output_text("")}),
            );
        }
    }

    fn delta(&mut self, answer: &Answer, i: usize, delta: &str, out: &mut Vec<u8>) {
        let item_id = Self::item_id(answer, i);
        match answer.blocks[i] {
            Block::Text(_) => self.emit(
                out,
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": i, "content_index": 0,
                    "delta": delta, "logprobs": []}),
            ),
            Block::ToolCall { .. } => self.emit(
                out,
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": i, "delta": delta}),
            ),
        }
    }

    fn close(&mut self, answer: &Answer, i: usize, out: &mut Vec<u8>) {
        let item_id = Self::item_id(answer, i);
        match &answer.blocks[i] {
            Block::Text(text) => {
                self.emit(
                    out,
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": i, "content_index": 0,
                        "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": i, "content_index": 0,
                        "part": output_text(text)}),
                );
            }
            Block::ToolCall {
                name, arguments, ..
            } => self.emit(
                out,
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": i, "name": name,
                    "arguments": arguments}),
            ),
        }
        let item = Self::item(answer, i, "completed");
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }

    fn finish(&mut self, answer: &Answer, out: &mut Vec<u8>) {
        let r = self.object(answer);
        let kind = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(out, kind, json!({"response": r}));
    }

    fn fail(&mut self, answer: &Answer, message: &str, out: &mut Vec<u8>) {
        let mut r = self.response(answer, "failed", &[]);
        r["error"] = json!({"code": "server_error", "message": message});
        self.emit(out, "response.failed", json!({"response": r}));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn items_become_chat_messages_with_the_calls_in_the_assistants_turn() {
        let body = json!({"model": "chat", "instructions": "Be brief.", "max_output_tokens": 64,
            "reasoning": {"effort": "low", "summary": "auto"}, "store": true,
            "text": {"format": {"type": "json_object"}, "verbosity": "low"},
            "tool_choice": {"type": "function", "name": "f"},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "https://x/a.png", "detail": "low"}]},
                {"type": "reasoning", "id": "rs", "summary": []},
                {"type": "message", "role": "assistant", "id": "m", "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}]}]});
        let chat = to_chat(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}]},
                {"role": "assistant", "content": "ok", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "one"},
                {"role": "tool", "tool_call_id": "c2", "content": "two"}])
        );
        assert_eq!(chat["max_completion_tokens"], 64);
        assert_eq!(chat["reasoning_effort"], "low");
        assert_eq!(chat["response_format"], json!({"type": "json_object"}));
        assert_eq!(chat["verbosity"], "low");
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert!(chat.get("store").is_none());
    }

    #[test]
    fn an_answer_cut_by_the_token_limit_is_incomplete() {
        let chat = json!({"model": "m", "choices": [{"message": {"role": "assistant",
            "content": "partial"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7}});
        let r = Writer::new(&json!({"max_output_tokens": 7}))
            .object(&Answer::from_completion(&chat, "ab".into()));
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["max_output_tokens"], 7);
        assert_eq!(r["output"][0]["content"][0]["text"], "partial");
        assert_eq!(r["usage"]["total_tokens"], 12);
    }
}
