//! Anthropic's Messages API, `POST /v1/messages`, routed as a chat completion: what
//! `upstream/anthropic.rs` does for a provider, done the other way for a client, with the
//! same tables (stop reasons, tool choices, usage, images, tool calls).
//!
//! Request → chat: `system` (a string or text blocks) → a first system message; `messages`:
//! text and `image` blocks (base64 or URL) → content parts, `tool_result` blocks → `tool`
//! messages (text content; `is_error` marks the text with `Error: `), an assistant's
//! `tool_use` blocks → `tool_calls`, thinking blocks left out; `max_tokens` →
//! `max_completion_tokens`; `stop_sequences` → `stop`; `temperature`, `top_p`;
//! `metadata.user_id` → `user`; client `tools` (`input_schema`) and `tool_choice` (`auto`,
//! `any`, `none`, `tool`, `disable_parallel_tool_use` → `parallel_tool_calls = false`);
//! structured output `output_config.format` (`json_schema`) → `response_format`. Ignored:
//! `cache_control` (a caching hint), `service_tier = "auto"`, `thinking` disabled. Refused with
//! a 400 that names the field: server tools, `document` blocks, `top_k`, `thinking` enabled,
//! `output_config.effort`, and any other field.
//!
//! Answer: a `message` with `text` and `tool_use` blocks, `stop_reason` from the finish
//! reason, `usage` with cached prompt tokens as `cache_read_input_tokens`. Streamed:
//! `message_start`, per block `content_block_start`, `content_block_delta` (`text_delta`,
//! `input_json_delta`)…, `content_block_stop`, then `message_delta` (stop reason and usage)
//! and `message_stop`; an `error` event when the stream broke. Errors, the gateway's own
//! included (401, 404, 413, 503…), are `{"type": "error", "error": {"type", "message"}}`.

use super::{bad_field, event, unsupported, Answer, ApiWriter, Block};
use crate::server::auth::Caller;
use crate::server::error::ApiError;
use crate::server::{AppState, BodyBytes, TakenHeaders};
use crate::upstream::anthropic;
use crate::upstream::dialect::{self, Refusal};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Extension;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// `POST /v1/messages`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    TakenHeaders(headers): TakenHeaders,
    body: BodyBytes,
) -> Result<Response, ApiError> {
    super::serve(&state, &headers, &caller, body, to_chat, |_| Writer).await
}

/// A refusal of the shared Anthropic mapping, as a 400 naming the field.
#[allow(clippy::needless_pass_by_value)] // Taken by value to be used in `map_err`.
fn refused(r: Refusal) -> ApiError {
    bad_field(r.field.clone(), r.reason())
}

/// The chat completions body for a Messages request.
///
/// # Errors
/// A field or block the gateway does not translate, or a value of the wrong shape (named).
pub fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let obj = super::object(body, "Messages API")?;
    let mut chat = Map::new();
    let mut out = Vec::new();
    if let Some(system) = obj.get("system").filter(|v| !v.is_null()) {
        let text = dialect::text_of(system, "system").map_err(refused)?;
        out.push(json!({"role": "system", "content": text}));
    }
    for (key, value) in obj {
        if value.is_null() {
            continue;
        }
        match key.as_str() {
            "system" | "cache_control" => {}
            "model" | "temperature" | "top_p" => {
                chat.insert(key.clone(), value.clone());
            }
            "messages" => messages(value, &mut out)?,
            "max_tokens" => {
                chat.insert(
                    "max_completion_tokens".into(),
                    super::token_count(value, key)?,
                );
            }
            "stream" => super::stream_into(value, &mut chat)?,
            "stop_sequences" => {
                let stop = dialect::stop_sequences(value).map_err(|_| {
                    bad_field(key.clone(), "`stop_sequences` must be a list of strings")
                })?;
                chat.insert("stop".into(), Value::Array(stop));
            }
            "metadata" => {
                if let Some(user) = value.get("user_id").filter(|u| !u.is_null()) {
                    chat.insert("user".into(), user.clone());
                }
            }
            "tools" => {
                chat.insert(
                    "tools".into(),
                    anthropic::openai_tools(value).map_err(refused)?,
                );
            }
            "tool_choice" => {
                let (choice, one_at_a_time) =
                    anthropic::openai_choice(value).map_err(refused)?;
                chat.insert("tool_choice".into(), choice);
                if one_at_a_time {
                    chat.insert("parallel_tool_calls".into(), json!(false));
                }
            }
            "output_config" => output_config(value, &mut chat)?,
            "thinking" if value.get("type").and_then(Value::as_str) == Some("disabled") => {}
            "service_tier" if value == "auto" => {}
            "thinking" => {
                return Err(unsupported(
                    key,
                    "extended thinking has no equivalent in the chat completions the gateway routes: leave it out or disable it",
                ))
            }
            other => {
                return Err(unsupported(
                    other,
                    "the gateway routes Messages requests as chat completions, which have no equivalent: leave it out",
                ))
            }
        }
    }
    if !out.iter().any(|m| m["role"] != "system") {
        return Err(bad_field("messages", "`messages` must be a non-empty list"));
    }
    chat.insert("messages".into(), Value::Array(out));
    Ok(Value::Object(chat))
}

/// `output_config`: its `format` (`json_schema`) → `response_format`.
fn output_config(value: &Value, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(config) = value.as_object() else {
        return Err(bad_field(
            "output_config",
            "`output_config` must be an object",
        ));
    };
    for (key, v) in config {
        match key.as_str() {
            _ if v.is_null() => {}
            "format" => {
                let Some(schema) = v
                    .get("schema")
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("json_schema"))
                else {
                    return Err(bad_field(
                        "output_config.format",
                        "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {...}}",
                    ));
                };
                chat.insert(
                    "response_format".into(),
                    json!({"type": "json_schema",
                        "json_schema": {"name": "output", "schema": schema, "strict": true}}),
                );
            }
            other => {
                return Err(unsupported(
                    &format!("output_config.{other}"),
                    "only output_config.format is routed",
                ))
            }
        }
    }
    Ok(())
}

/// `messages` → chat messages, appended to `out`.
fn messages(value: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let Some(list) = value.as_array() else {
        return Err(bad_field("messages", "`messages` must be a list"));
    };
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        let blocks = match m.get("content") {
            _ if !matches!(role, "user" | "assistant") => return Err(bad_role(&at)),
            Some(Value::String(s)) => {
                out.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => {
                return Err(bad_field(
                    format!("{at}.content"),
                    format!("`{at}.content` must be a string or a list of content blocks"),
                ))
            }
        };
        match role {
            "assistant" => {
                let (text, calls) = anthropic::assistant_message(blocks);
                let mut message = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                out.push(message);
            }
            _ => user_turn(blocks, &at, out)?,
        }
    }
    Ok(())
}

fn bad_role(at: &str) -> ApiError {
    bad_field(
        format!("{at}.role"),
        format!("`{at}.role` must be user or assistant (the system prompt goes in `system`)"),
    )
}

/// A user turn's blocks: its tool results as `tool` messages (first, as chat wants them right
/// after the calls), then its text and images as one user message.
fn user_turn(blocks: &[Value], at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut parts = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => parts.push(json!({"type": "text", "text": b["text"]})),
            Some("image") => {
                let Some(url) = anthropic::image_url(&b["source"]) else {
                    return Err(bad_field(
                        format!("{at}.source"),
                        format!("`{at}.source` must be base64 data or a URL"),
                    ));
                };
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            Some("tool_result") => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(bad_field(
                        format!("{at}.tool_use_id"),
                        format!("`{at}.tool_use_id` is required, as a string"),
                    ));
                };
                let mut text = dialect::text_of(
                    b.get("content").unwrap_or(&Value::Null),
                    &format!("{at}.content"),
                )
                .map_err(refused)?;
                if b.get("is_error") == Some(&Value::Bool(true)) {
                    text.insert_str(0, "Error: ");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            other => {
                return Err(bad_field(
                    format!("{at}.type"),
                    format!(
                    "`{}` blocks are not supported in a user turn: text, image and tool_result are",
                    crate::server::echo(other.unwrap_or("(none)"))
                ),
                ))
            }
        }
    }
    if !parts.is_empty() {
        out.push(json!({"role": "user", "content": parts}));
    }
    Ok(())
}

/// The content blocks of an answer (the same mapping as an assistant turn of a request to
/// an Anthropic provider); a tool call whose arguments are not JSON (cut by `max_tokens`)
/// gets an empty input.
fn content(answer: &Answer) -> Vec<Value> {
    anthropic::assistant_blocks(&answer.chat_message(), "answer").unwrap_or_else(|_| {
        answer
            .blocks
            .iter()
            .map(|b| match b {
                Block::Text(t) => json!({"type": "text", "text": t}),
                Block::ToolCall {
                    call_id,
                    name,
                    arguments,
                } => json!({"type": "tool_use", "id": call_id, "name": name,
                    "input": serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!({}))}),
            })
            .collect()
    })
}

/// Writes a chat answer as a Messages answer: the message, or its stream's events.
pub struct Writer;

impl ApiWriter for Writer {
    fn object(&self, answer: &Answer) -> Value {
        json!({
            "id": format!("msg_{}", answer.id),
            "type": "message",
            "role": "assistant",
            "model": answer.model,
            "content": content(answer),
            "stop_reason": anthropic::stop_reason(answer.finish_reason.as_deref()),
            "stop_sequence": null,
            "usage": anthropic::anthropic_usage(answer.usage.as_ref().unwrap_or(&Value::Null)),
        })
    }

    fn start(&mut self, answer: &Answer, out: &mut Vec<u8>) {
        // The usage is known at the end only: `message_delta` carries it whole.
        event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": format!("msg_{}", answer.id), "type": "message", "role": "assistant",
                "model": answer.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        );
    }

    fn open(&mut self, answer: &Answer, i: usize, out: &mut Vec<u8>) {
        let block = match &answer.blocks[i] {
            Block::Text(_) => json!({"type": "text", "text": ""}),
            Block::ToolCall { call_id, name, .. } => {
                json!({"type": "tool_use", "id": call_id, "name": name, "input": {}})
            }
        };
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": i, "content_block": block}),
        );
    }

    fn delta(&mut self, answer: &Answer, i: usize, delta: &str, out: &mut Vec<u8>) {
        let delta = match answer.blocks[i] {
            Block::Text(_) => json!({"type": "text_delta", "text": delta}),
            Block::ToolCall { .. } => json!({"type": "input_json_delta", "partial_json": delta}),
        };
        event(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": i, "delta": delta}),
        );
    }

    fn close(&mut self, _answer: &Answer, i: usize, out: &mut Vec<u8>) {
        event(
            out,
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": i}),
        );
    }

    fn finish(&mut self, answer: &Answer, out: &mut Vec<u8>) {
        let stop = anthropic::stop_reason(answer.finish_reason.as_deref());
        let usage = anthropic::anthropic_usage(answer.usage.as_ref().unwrap_or(&Value::Null));
        event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": usage}),
        );
        event(out, "message_stop", &json!({"type": "message_stop"}));
    }

    fn fail(&mut self, _answer: &Answer, message: &str, out: &mut Vec<u8>) {
        event(
            out,
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        );
    }
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The most bytes of an error body read to rewrite it (the gateway's errors are small).
const ERROR_BODY_MAX: usize = 64 * 1024;

/// Rewrites an error answer of `/v1/messages` (OpenAI's shape, from the gateway's common path
/// and its key check) in Anthropic's: `{"type": "error", "error": {"type", "message"}}`, the
/// status and headers (`retry-after`, the routing headers) kept.
pub async fn error_shape(resp: Response) -> Response {
    let status = resp.status();
    if status.is_success() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, ERROR_BODY_MAX)
        .await
        .unwrap_or_default();
    let message = if status == StatusCode::UNAUTHORIZED {
        "missing or wrong API key: send `x-api-key: <key>` (or `Authorization: Bearer <key>`) with a key configured in server.api_keys_env".to_owned()
    } else {
        serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned())
    };
    let body = json!({"type": "error", "error": {"type": error_type(status), "message": message}});
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_turn_with_tool_results_and_text_becomes_tool_messages_then_the_user_message() {
        let body = json!({"model": "chat", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": true,
                    "content": [{"type": "text", "text": "boom"}]},
                {"type": "text", "text": "and?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVB"}}]}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"], "metadata": {"user_id": "u-1"}});
        let chat = to_chat(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                    {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "one"},
                {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
                {"role": "user", "content": [
                    {"type": "text", "text": "and?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVB"}}]}])
        );
        assert_eq!(chat["tool_choice"], "required");
        assert_eq!(chat["parallel_tool_calls"], false);
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["user"], "u-1");
        assert_eq!(chat["max_completion_tokens"], 10);
    }

    #[test]
    fn an_answer_reads_as_a_message_with_anthropics_stop_reasons_and_usage() {
        let chat = json!({"model": "m", "choices": [{"message": {"role": "assistant",
            "content": "hi", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\":"}}]}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 6}}});
        let m = Writer.object(&Answer::from_completion(&chat, "ab".into()));
        assert_eq!(m["id"], "msg_ab");
        assert_eq!(m["stop_reason"], "max_tokens");
        // Arguments cut off by the token limit: the call is kept, with an empty input.
        assert_eq!(
            m["content"],
            json!([{"type": "text", "text": "hi"},
                {"type": "tool_use", "id": "c", "name": "f", "input": {}}])
        );
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 4, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 6, "output_tokens": 4})
        );
    }

    #[test]
    fn the_gateways_own_errors_take_anthropics_types_by_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (502, "api_error"),
            (503, "api_error"),
            (504, "timeout_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
    }
}
