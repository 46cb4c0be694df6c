//! Anthropic's Messages API (`POST {base_url}/messages`): the client's OpenAI request written
//! as a Messages request, the answer and its stream events written back as OpenAI's.
//!
//! Translated: system and developer messages → `system`; user, assistant and tool messages →
//! alternating turns (tool results are user turns of `tool_result` blocks); images (`data:`
//! and http URLs); `tools`, `tool_choice`, `parallel_tool_calls`; `stop` → `stop_sequences`;
//! `max_completion_tokens`/`max_tokens` (the provider's `max_tokens` when absent: Anthropic
//! requires one); `user` → `metadata.user_id`. Anything else is dropped when droppable and
//! the policy allows (`dialect::Leftovers`), else a 400 naming the field: `temperature` and
//! `top_p` among them, which the current Messages API has not (its SDK's request types lack
//! them, and its current models refuse them). Answers: text and `tool_use` blocks → `content` and `tool_calls`,
//! `stop_reason` → `finish_reason`, usage with cache reads and writes counted as prompt tokens.

use super::dialect::{self, ChunkWriter, EventTranslator, Leftovers, Refusal, Unanswerable};
use serde_json::{json, Map, Value};

const API: &str = "Anthropic's Messages API";

pub use crate::config::anthropic_defaults::{DEFAULT_MAX_TOKENS, DEFAULT_VERSION};

/// The Messages request for the client's OpenAI `body`; members it cannot express go to
/// `leftovers` (dropped or refused).
///
/// # Errors
/// A member or value the Messages API cannot express and may not drop, named.
pub fn request(
    body: &Value,
    model: &str,
    (stream, default_max_tokens): (bool, u32),
    leftovers: &mut Leftovers,
) -> Result<Value, Refusal> {
    let Some(obj) = body.as_object() else {
        return Err(Refusal::new("(body)", "must be a JSON object"));
    };
    let mut out = Map::new();
    out.insert("model".into(), json!(model));
    let max_tokens = dialect::max_tokens(obj)?.unwrap_or(u64::from(default_max_tokens));
    out.insert("max_tokens".into(), json!(max_tokens));
    let mut tool_choice: Option<Value> = None;
    let mut parallel = true;
    for (key, value) in obj {
        match key.as_str() {
            // Set by the gateway, read above, or read by the stream's translation.
            k if dialect::handled_elsewhere(k) => {}
            _ if dialect::absent(value) => {}
            "messages" => {
                let (system, messages) = messages(value, leftovers)?;
                if let Some(s) = system {
                    out.insert("system".into(), json!(s));
                }
                out.insert("messages".into(), Value::Array(messages));
            }
            "stop" => {
                out.insert(
                    "stop_sequences".into(),
                    json!(dialect::stop_sequences(value)?),
                );
            }
            "n" => dialect::single_choice(value, API)?,
            "user" => {
                out.insert("metadata".into(), json!({"user_id": value}));
            }
            "tools" => {
                out.insert("tools".into(), tools(value)?);
            }
            "tool_choice" => tool_choice = Some(choice(value)?),
            "parallel_tool_calls" => parallel = value.as_bool() != Some(false),
            other => leftovers.member(other, API)?,
        }
    }
    // `parallel_tool_calls = false` is `false` and so "absent" above: read it here.
    if obj.get("parallel_tool_calls") == Some(&Value::Bool(false)) {
        parallel = false;
    }
    if !parallel || tool_choice.is_some() {
        let mut c = tool_choice.unwrap_or_else(|| json!({"type": "auto"}));
        if !parallel && c["type"] != "none" {
            c["disable_parallel_tool_use"] = json!(true);
        }
        out.insert("tool_choice".into(), c);
    }
    if stream {
        out.insert("stream".into(), json!(true));
    }
    Ok(Value::Object(out))
}

/// OpenAI `messages` → Anthropic's `system` and alternating `messages`.
fn messages(
    value: &Value,
    leftovers: &mut Leftovers,
) -> Result<(Option<String>, Vec<Value>), Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("messages", "must be a list"));
    };
    let mut system: Vec<String> = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        dialect::message(m, i, API, leftovers)?;
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        let content = m.get("content").unwrap_or(&Value::Null);
        let (role, blocks) = match role {
            "system" | "developer" => {
                system.push(dialect::text_of(content, &at("content"))?);
                continue;
            }
            "user" => ("user", blocks(content, &at("content"))?),
            "assistant" => ("assistant", assistant_blocks(m, &format!("messages[{i}]"))?),
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| Refusal::new(at("tool_call_id"), "a tool message needs one"))?;
                let text = dialect::text_of(content, &at("content"))?;
                (
                    "user",
                    vec![json!({"type": "tool_result", "tool_use_id": id, "content": text})],
                )
            }
            other => return Err(dialect::unknown_role(i, other, API)),
        };
        dialect::push_turn(&mut out, role, "content", blocks);
    }
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    Ok((system, out))
}

/// An OpenAI assistant message (`content` and `tool_calls`, at `at`) as Anthropic content
/// blocks: text, then `tool_use`. The same mapping writes an assistant turn of a request and
/// the answer to a Messages client (`server/clients/messages.rs`).
///
/// # Errors
/// Content of another shape, or tool call arguments that are not JSON text (named).
pub fn assistant_blocks(m: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    let mut b = blocks(
        m.get("content").unwrap_or(&Value::Null),
        &format!("{at}.content"),
    )?;
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        b.extend(tool_uses(calls, &format!("{at}.tool_calls"))?);
    }
    Ok(b)
}

/// Anthropic content blocks as an OpenAI assistant message's text and `tool_calls` (the
/// inverse of [`assistant_blocks`]): text blocks joined, `tool_use` blocks as calls, thinking
/// and other blocks left out (not part of an OpenAI message).
#[must_use]
pub fn assistant_message(content: &[Value]) -> (Option<String>, Vec<Value>) {
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for block in content {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text
                .get_or_insert_with(String::new)
                .push_str(block["text"].as_str().unwrap_or_default()),
            Some("tool_use") => calls.push(dialect::tool_call(
                block["id"].as_str().unwrap_or_default(),
                block["name"].as_str().unwrap_or_default(),
                &block["input"],
            )),
            _ => {}
        }
    }
    (text, calls)
}

/// A message's content as Anthropic content blocks.
fn blocks(content: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s})]),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| part(p, &format!("{at}[{j}]")))
            .collect(),
        _ => Err(Refusal::new(at, "must be a string or a list of parts")),
    }
}

fn part(p: &Value, at: &str) -> Result<Value, Refusal> {
    match p.get("type").and_then(Value::as_str) {
        Some("text") => {
            Ok(json!({"type": "text", "text": p.get("text").cloned().unwrap_or_default()}))
        }
        Some("image_url") => {
            let url = p
                .pointer("/image_url/url")
                .and_then(Value::as_str)
                .ok_or_else(|| Refusal::new(format!("{at}.image_url.url"), "is missing"))?;
            Ok(match dialect::data_url(url) {
                Some((media, data)) => json!({"type": "image",
                    "source": {"type": "base64", "media_type": media, "data": data}}),
                None => json!({"type": "image", "source": {"type": "url", "url": url}}),
            })
        }
        other => Err(Refusal::new(
            format!("{at}.type"),
            format!(
                "`{}` parts have no equivalent in {API} (text and image_url do)",
                other.unwrap_or("(none)")
            ),
        )),
    }
}

/// An Anthropic image block's `source` as the URL of an OpenAI `image_url` part (the inverse
/// of [`part`]'s images: base64 data as a `data:` URL).
#[must_use]
pub fn image_url(source: &Value) -> Option<String> {
    match source.get("type").and_then(Value::as_str)? {
        "base64" => Some(format!(
            "data:{};base64,{}",
            source.get("media_type")?.as_str()?,
            source.get("data")?.as_str()?
        )),
        "url" => source.get("url")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// An assistant's `tool_calls` → `tool_use` blocks (arguments are JSON text in OpenAI's).
fn tool_uses(calls: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    dialect::tool_calls(
        calls,
        at,
        |id, name, input| json!({"type": "tool_use", "id": id, "name": name, "input": input}),
    )
}

/// OpenAI `tools` (functions) → Anthropic tools.
fn tools(value: &Value) -> Result<Value, Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("tools", "must be a list"));
    };
    list.iter()
        .enumerate()
        .map(|(j, t)| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(Refusal::new(
                    format!("tools[{j}].type"),
                    format!("only `function` tools have an equivalent in {API}"),
                ));
            }
            let f = &t["function"];
            let mut tool = json!({"name": f["name"],
                "input_schema": f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = f.get("description") {
                tool["description"] = d.clone();
            }
            Ok(tool)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// Anthropic tools → OpenAI `tools` (the inverse of [`tools`]); a server tool (one with a
/// `type`, such as `web_search_20250305`) has no OpenAI equivalent and is refused by name.
///
/// # Errors
/// Not a list, a tool without a name, or a server tool.
pub fn openai_tools(value: &Value) -> Result<Value, Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("tools", "must be a list"));
    };
    list.iter()
        .enumerate()
        .map(|(j, t)| {
            if let Some(kind) = t
                .get("type")
                .and_then(Value::as_str)
                .filter(|k| *k != "custom")
            {
                return Err(Refusal::new(
                    format!("tools[{j}].type"),
                    format!("`{kind}` is a server tool, which the gateway does not run: only client tools (name, description, input_schema) are routed"),
                ));
            }
            let Some(name) = t.get("name").filter(|n| n.is_string()) else {
                return Err(Refusal::new(format!("tools[{j}].name"), "is required, as a string"));
            };
            let mut f = json!({"name": name,
                "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}))});
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                f["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// OpenAI's `tool_choice` words and Anthropic's `tool_choice.type`, read both ways.
const TOOL_CHOICES: [(&str, &str); 3] = [("auto", "auto"), ("none", "none"), ("required", "any")];

/// OpenAI `tool_choice` → Anthropic's.
fn choice(value: &Value) -> Result<Value, Refusal> {
    let word = value
        .as_str()
        .and_then(|s| TOOL_CHOICES.iter().find(|(o, _)| *o == s));
    match (word, value.pointer("/function/name")) {
        (Some((_, a)), _) => Ok(json!({"type": a})),
        (None, Some(name)) => Ok(json!({"type": "tool", "name": name})),
        (None, None) => Err(Refusal::new(
            "tool_choice",
            "must be auto, none, required or a named function",
        )),
    }
}

/// Anthropic `tool_choice` → OpenAI's (the inverse of [`choice`]), and whether it asks for one
/// tool call at a time (`disable_parallel_tool_use`).
///
/// # Errors
/// A type other than auto, any, none and tool, or a `tool` without a name.
pub fn openai_choice(value: &Value) -> Result<(Value, bool), Refusal> {
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let one_at_a_time = value.get("disable_parallel_tool_use") == Some(&Value::Bool(true));
    if let Some((o, _)) = TOOL_CHOICES.iter().find(|(_, a)| *a == kind) {
        return Ok((json!(o), one_at_a_time));
    }
    match value.get("name").and_then(Value::as_str) {
        Some(name) if kind == "tool" => Ok((
            json!({"type": "function", "function": {"name": name}}),
            one_at_a_time,
        )),
        _ => Err(Refusal::new(
            "tool_choice",
            "must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
        )),
    }
}

/// Anthropic's `stop_reason` and OpenAI's `finish_reason`, one table read both ways: each
/// way takes the first row that names the reason.
const STOP_REASONS: [(&str, &str); 6] = [
    ("end_turn", "stop"),
    ("max_tokens", "length"),
    ("tool_use", "tool_calls"),
    ("refusal", "content_filter"),
    ("stop_sequence", "stop"),
    ("model_context_window_exceeded", "length"),
];

/// Anthropic's `stop_reason` → OpenAI's `finish_reason` (`stop` for others, `pause_turn`).
fn finish_reason(stop: Option<&str>) -> &'static str {
    STOP_REASONS
        .iter()
        .find(|(a, _)| Some(*a) == stop)
        .map_or("stop", |(_, o)| o)
}

/// OpenAI's `finish_reason` → Anthropic's `stop_reason` (`end_turn` for others).
#[must_use]
pub fn stop_reason(finish: Option<&str>) -> &'static str {
    STOP_REASONS
        .iter()
        .find(|(_, o)| Some(*o) == finish)
        .map_or("end_turn", |(a, _)| a)
}

/// Anthropic `usage` → OpenAI's: cache writes and reads are prompt tokens too.
fn usage(u: &Value) -> Value {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let read = n("cache_read_input_tokens");
    dialect::usage(
        n("input_tokens") + n("cache_creation_input_tokens") + read,
        read,
        n("output_tokens"),
    )
}

/// OpenAI `usage` → Anthropic's (the inverse of [`usage`]): the cached prompt tokens are
/// cache reads, the others input tokens; OpenAI's usage does not tell cache writes apart.
#[must_use]
pub fn anthropic_usage(u: &Value) -> Value {
    let n = |p: &str| u.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let read = n("/prompt_tokens_details/cached_tokens");
    json!({
        "input_tokens": n("/prompt_tokens").saturating_sub(read),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": read,
        "output_tokens": n("/completion_tokens"),
    })
}

/// A Messages answer → an OpenAI chat completion naming `model`.
///
/// # Errors
/// The body is not a Messages answer.
pub fn answer(body: &Value, model: &str) -> Result<Value, Unanswerable> {
    let Some(content) = body.get("content").and_then(Value::as_array) else {
        return Err(Unanswerable::Malformed(
            "the answer has no `content` list".into(),
        ));
    };
    let (text, calls) = assistant_message(content);
    let stop = body.get("stop_reason").and_then(Value::as_str);
    if stop == Some("refusal") && text.is_none() && calls.is_empty() {
        return Err(Unanswerable::Blocked(
            "Anthropic's safety system refused to answer".into(),
        ));
    }
    Ok(dialect::completion(
        body["id"].as_str().unwrap_or("msg"),
        model,
        text.as_deref(),
        calls,
        finish_reason(stop),
        &usage(&body["usage"]),
    ))
}

/// Anthropic's stream events → OpenAI chunks.
pub struct StreamTranslation {
    writer: Option<ChunkWriter>,
    model: String,
    include_usage: bool,
    /// Content block index → the tool call's index among the answer's tool calls.
    tools: Vec<(u64, usize)>,
    input: Value,
    output_tokens: u64,
}

impl StreamTranslation {
    #[must_use]
    pub fn new(model: &str, include_usage: bool) -> StreamTranslation {
        StreamTranslation {
            writer: None,
            model: model.to_owned(),
            include_usage,
            tools: Vec::new(),
            input: json!({}),
            output_tokens: 0,
        }
    }

    fn writer(&mut self) -> &ChunkWriter {
        let model = &self.model;
        self.writer
            .get_or_insert_with(|| ChunkWriter::new("msg".into(), model))
    }
}

impl EventTranslator for StreamTranslation {
    fn data(&mut self, data: &Value, out: &mut Vec<u8>) -> Result<(), String> {
        let index = data.get("index").and_then(Value::as_u64).unwrap_or(0);
        match data.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let id = data
                    .pointer("/message/id")
                    .and_then(Value::as_str)
                    .unwrap_or("msg");
                self.writer = Some(ChunkWriter::new(id.to_owned(), &self.model));
                self.input = data.pointer("/message/usage").cloned().unwrap_or_default();
                self.writer()
                    .delta(out, &json!({"role": "assistant", "content": ""}), None);
            }
            Some("content_block_start") => {
                let block = &data["content_block"];
                match block.get("type").and_then(Value::as_str) {
                    Some("tool_use") => {
                        let n = self.tools.len();
                        self.tools.push((index, n));
                        let call = json!([{"index": n, "id": block["id"], "type": "function",
                            "function": {"name": block["name"], "arguments": ""}}]);
                        self.writer().delta(out, &json!({"tool_calls": call}), None);
                    }
                    Some("text") => {
                        if let Some(t) = block["text"].as_str().filter(|t| !t.is_empty()) {
                            self.writer().delta(out, &json!({"content": t}), None);
                        }
                    }
                    _ => {}
                }
            }
            Some("content_block_delta") => {
                let delta = &data["delta"];
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        self.writer()
                            .delta(out, &json!({"content": delta["text"]}), None);
                    }
                    Some("input_json_delta") => {
                        let Some(&(_, n)) = self.tools.iter().find(|(b, _)| *b == index) else {
                            return Err("the provider sent tool input for no tool call".into());
                        };
                        let call =
                            json!([{"index": n, "function": {"arguments": delta["partial_json"]}}]);
                        self.writer().delta(out, &json!({"tool_calls": call}), None);
                    }
                    // Thinking and signature deltas: not part of an OpenAI answer.
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(n) = data.pointer("/usage/output_tokens").and_then(Value::as_u64) {
                    self.output_tokens = n;
                }
                let stop = data.pointer("/delta/stop_reason").and_then(Value::as_str);
                if stop.is_some() {
                    self.writer()
                        .delta(out, &json!({}), Some(finish_reason(stop)));
                }
            }
            Some("message_stop") => {
                if self.include_usage {
                    let mut u = self.input.clone();
                    u["output_tokens"] = json!(self.output_tokens);
                    let u = usage(&u);
                    self.writer().usage(out, &u);
                }
                dialect::done(out);
            }
            Some("error") => {
                let kind = data
                    .pointer("/error/type")
                    .and_then(Value::as_str)
                    .unwrap_or("error");
                let message = data
                    .pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("the provider's stream failed");
                dialect::error_event(out, &format!("{kind}: {message}"), kind);
            }
            // `ping` and event types added later: nothing to relay.
            _ => {}
        }
        Ok(())
    }

    fn end(&mut self, _out: &mut Vec<u8>) {
        // `[DONE]` went with `message_stop`; without it the answer may be cut, and the relay
        // judges by what it saw (a finish reason, or not).
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::dialect::{SseTranslator, StreamTranslator};

    #[test]
    fn a_conversation_with_tools_and_images_is_written_as_messages() {
        let body = json!({
            "model": "chat", "stream": true, "max_tokens": null, "stop": "END", "user": "u-1",
            "temperature": 0.2, "parallel_tool_calls": false, "tool_choice": "required",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is here?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{\"q\":\"a\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
                {"role": "user", "content": "thanks"}],
            "tools": [{"type": "function", "function": {"name": "look", "description": "Looks",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
        });
        let mut leftovers = Leftovers::default();
        let out = request(&body, "claude-x", (true, 1000), &mut leftovers).unwrap();
        // The current Messages API has no sampling members: dropped, and named.
        assert_eq!(
            leftovers.dropped().names().collect::<Vec<_>>(),
            ["temperature"]
        );
        assert_eq!(
            out,
            json!({
                "model": "claude-x", "max_tokens": 1000, "stream": true,
                "system": "Be brief.\n\nUse tools.",
                "stop_sequences": ["END"], "metadata": {"user_id": "u-1"},
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "messages": [
                    {"role": "user", "content": [
                        {"type": "text", "text": "What is here?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}}]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "call_1", "name": "look", "input": {"q": "a"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": "a cat"},
                        {"type": "text", "text": "thanks"}]}],
                "tools": [{"name": "look", "description": "Looks",
                    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]
            })
        );
        // The client's own max_completion_tokens wins over the provider's default.
        let mut short = body.clone();
        short["max_completion_tokens"] = json!(7);
        let out = request(&short, "m", (false, 1000), &mut Leftovers::default()).unwrap();
        assert_eq!(out["max_tokens"], 7);
    }

    #[test]
    fn what_messages_cannot_express_is_dropped_or_refused_by_name_per_the_policy() {
        use crate::upstream::dialect::policy_table::{check, Expect::*};
        check(
            &|b, l| request(b, "m", (false, 10), l),
            &[
                (json!({"user": "u-1"}), Translated),
                (json!({"parallel_tool_calls": false}), Translated),
                (json!({"seed": 7}), Dropped("seed", "seed")),
                (
                    json!({"response_format": {"type": "json_object"}}),
                    Refused("response_format"),
                ),
                (
                    json!({"presence_penalty": 0.5}),
                    Refused("presence_penalty"),
                ),
                (json!({"max_tokens": 0}), Refused("max_tokens")),
            ],
        );
        // Absent: nulls and falses, and `n = 1`.
        let absent = json!({"messages": [], "logprobs": false, "seed": null, "n": 1});
        let mut strict = Leftovers::new(dialect::UnsupportedParams::Reject);
        assert!(request(&absent, "m", (false, 10), &mut strict).is_ok());
    }

    #[test]
    fn an_answer_with_text_tools_and_cache_usage_reads_as_openai() {
        let body = json!({"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"q": "a"}}],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 100, "output_tokens": 7}});
        let a = answer(&body, "claude-x").unwrap();
        assert_eq!(a["model"], "claude-x");
        assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(a["choices"][0]["message"]["content"], "Let me look.");
        assert_eq!(
            a["choices"][0]["message"]["tool_calls"][0],
            json!({"id": "toolu_1", "type": "function", "function": {"name": "look", "arguments": "{\"q\":\"a\"}"}})
        );
        assert_eq!(
            a["usage"],
            json!({"prompt_tokens": 115, "completion_tokens": 7, "total_tokens": 122,
                "prompt_tokens_details": {"cached_tokens": 100}})
        );
        for (stop, finish) in [
            ("end_turn", "stop"),
            ("max_tokens", "length"),
            ("stop_sequence", "stop"),
        ] {
            assert_eq!(finish_reason(Some(stop)), finish);
        }
    }

    #[test]
    fn the_tables_read_back_the_other_way() {
        for stop in ["end_turn", "max_tokens", "tool_use", "refusal"] {
            assert_eq!(stop_reason(Some(finish_reason(Some(stop)))), stop);
        }
        for word in ["auto", "none", "required"] {
            let (back, _) = openai_choice(&choice(&json!(word)).unwrap()).unwrap();
            assert_eq!(back, word);
        }
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(
            openai_choice(&choice(&named).unwrap()).unwrap(),
            (named, false)
        );
        let u = json!({"input_tokens": 10, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 100, "output_tokens": 7});
        assert_eq!(anthropic_usage(&usage(&u)), u);
        let tools = json!([{"type": "function", "function": {"name": "look", "description": "d",
            "parameters": {"type": "object"}}}]);
        assert_eq!(openai_tools(&super::tools(&tools).unwrap()).unwrap(), tools);
        let source = json!({"type": "base64", "media_type": "image/png", "data": "iVB"});
        assert_eq!(image_url(&source).unwrap(), "data:image/png;base64,iVB");
    }

    #[test]
    fn stream_events_become_chunks_and_done() {
        let events = [
            r#"{"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":3,"cache_read_input_tokens":2,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"look","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"q\":"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":9}}"#,
            r#"{"type":"message_stop"}"#,
        ];
        let text: String = events
            .iter()
            .map(|e| format!("event: x\ndata: {e}\n\n"))
            .collect::<Vec<_>>()
            .concat();
        let mut tr = SseTranslator::new(Box::new(StreamTranslation::new("claude-x", true)));
        // Fed in pieces that split events anywhere.
        let mut out = Vec::new();
        for piece in text.as_bytes().chunks(17) {
            out.extend_from_slice(&tr.feed(piece).unwrap());
        }
        out.extend_from_slice(&tr.end().unwrap());
        let out = String::from_utf8(out).unwrap();
        let chunks: Vec<&str> = out.split("\n\n").filter(|c| !c.is_empty()).collect();
        assert_eq!(chunks.last(), Some(&"data: [DONE]"));
        let json: Vec<Value> = chunks[..chunks.len() - 1]
            .iter()
            .map(|c| serde_json::from_str(c.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        let deltas: Vec<&Value> = json.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0], &json!({"role": "assistant", "content": ""}));
        assert_eq!(deltas[1], &json!({"content": "Hi"}));
        assert_eq!(deltas[2]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            deltas[3]["tool_calls"][0]["function"]["arguments"],
            "{\"q\":"
        );
        assert_eq!(json[4]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(json[5]["usage"]["prompt_tokens"], 5);
        assert_eq!(json[5]["usage"]["completion_tokens"], 9);
        assert!(json
            .iter()
            .all(|c| c["id"] == "msg_1" && c["model"] == "claude-x"));
    }
}
