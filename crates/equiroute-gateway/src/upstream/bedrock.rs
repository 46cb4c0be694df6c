//! AWS Bedrock's Converse API (`POST {base_url}/model/{modelId}/converse`, and
//! `/converse-stream` for streams), signed with AWS Signature Version 4: the client's OpenAI
//! request written as a Converse request, the answer and its event stream written back as
//! OpenAI's.
//!
//! Translated: system and developer messages → `system` text blocks; user and assistant
//! messages → alternating turns (text, `data:` images as `image` bytes, tool calls as
//! `toolUse`); tool messages → user turns of `toolResult` blocks; `tools` → `toolConfig.tools`
//! (`toolSpec` with `inputSchema.json`), `tool_choice` → `toolConfig.toolChoice`;
//! `max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `stop` → `inferenceConfig`.
//! Anything else is dropped when droppable and the policy allows (`dialect::Leftovers`), else
//! a 400 naming the field. Answers: text and `toolUse` blocks → `content` and
//! `tool_calls`, `stopReason` → `finish_reason`, usage with cache reads and writes counted as
//! prompt tokens; a guardrail's intervention is a content-filter client error.

use super::dialect::{self, ChunkWriter, Leftovers, Refusal, Unanswerable};
use super::eventstream;
use crate::config::AwsCredentials;
use bytes::Bytes;
use serde_json::{json, Map, Value};

const API: &str = "Bedrock's Converse API";

/// The Converse request for the client's OpenAI `body` (the model is in the URL, and so is
/// whether to stream).
///
/// Members it cannot express go to `leftovers` (dropped or refused).
///
/// # Errors
/// A member or value Converse cannot express and may not drop, named.
pub fn request(body: &Value, leftovers: &mut Leftovers) -> Result<Value, Refusal> {
    let Some(obj) = body.as_object() else {
        return Err(Refusal::new("(body)", "must be a JSON object"));
    };
    let mut out = Map::new();
    let mut inference = Map::new();
    if let Some(n) = dialect::max_tokens(obj)? {
        inference.insert("maxTokens".into(), json!(n));
    }
    let mut tools_list: Option<Value> = None;
    let mut tool_choice: Option<Value> = None;
    for (key, value) in obj {
        match key.as_str() {
            k if dialect::handled_elsewhere(k) => {}
            _ if dialect::absent(value) => {}
            "messages" => {
                let (system, messages) = messages(value, leftovers)?;
                if !system.is_empty() {
                    out.insert("system".into(), Value::Array(system));
                }
                out.insert("messages".into(), Value::Array(messages));
            }
            "temperature" => {
                inference.insert("temperature".into(), value.clone());
            }
            "top_p" => {
                inference.insert("topP".into(), value.clone());
            }
            "stop" => {
                inference.insert(
                    "stopSequences".into(),
                    json!(dialect::stop_sequences(value)?),
                );
            }
            "n" => dialect::single_choice(value, API)?,
            "tools" => tools_list = Some(tools(value)?),
            "tool_choice" => tool_choice = choice(value)?,
            // Converse calls tools one or several at a time as the model chooses.
            "parallel_tool_calls" => {}
            other => leftovers.member(other, API)?,
        }
    }
    if !inference.is_empty() {
        out.insert("inferenceConfig".into(), Value::Object(inference));
    }
    if let Some(tools) = tools_list {
        let mut config = json!({ "tools": tools });
        if let Some(c) = tool_choice {
            config["toolChoice"] = c;
        }
        out.insert("toolConfig".into(), config);
    } else if tool_choice.is_some() {
        return Err(Refusal::new("tool_choice", "needs `tools`"));
    }
    Ok(Value::Object(out))
}

/// OpenAI `messages` → Converse's `system` blocks and alternating `messages`.
fn messages(value: &Value, leftovers: &mut Leftovers) -> Result<(Vec<Value>, Vec<Value>), Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("messages", "must be a list"));
    };
    let mut system = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        dialect::message(m, i, API, leftovers)?;
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        let content = m.get("content").unwrap_or(&Value::Null);
        let (role, blocks) = match role {
            "system" | "developer" => {
                let text = dialect::text_of(content, &at("content"))?;
                if !text.is_empty() {
                    system.push(json!({ "text": text }));
                }
                continue;
            }
            "user" => ("user", blocks(content, &at("content"))?),
            "assistant" => {
                let mut b = blocks(content, &at("content"))?;
                if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                    b.extend(tool_uses(calls, &at("tool_calls"))?);
                }
                ("assistant", b)
            }
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| Refusal::new(at("tool_call_id"), "a tool message needs one"))?;
                let text = dialect::text_of(content, &at("content"))?;
                (
                    "user",
                    vec![json!({"toolResult": {"toolUseId": id, "content": [{"text": text}]}})],
                )
            }
            other => return Err(dialect::unknown_role(i, other, API)),
        };
        dialect::push_turn(&mut out, role, "content", blocks);
    }
    Ok((system, out))
}

/// A message's content as Converse content blocks.
fn blocks(content: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({ "text": s })]),
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
        Some("text") => Ok(json!({"text": p.get("text").cloned().unwrap_or_default()})),
        Some("image_url") => {
            let field = format!("{at}.image_url.url");
            let url = p
                .pointer("/image_url/url")
                .and_then(Value::as_str)
                .ok_or_else(|| Refusal::new(field.clone(), "is missing"))?;
            let Some((media, data)) = dialect::data_url(url) else {
                return Err(Refusal::new(
                    field,
                    format!("{API} takes images as bytes: send a `data:` URL (base64)"),
                ));
            };
            let format = match media {
                "image/png" => "png",
                "image/jpeg" | "image/jpg" => "jpeg",
                "image/gif" => "gif",
                "image/webp" => "webp",
                other => {
                    return Err(Refusal::new(
                        field,
                        format!(
                        "`{other}` images have no equivalent in {API} (png, jpeg, gif and webp do)"
                    ),
                    ))
                }
            };
            Ok(json!({"image": {"format": format, "source": {"bytes": data}}}))
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

/// An assistant's `tool_calls` → `toolUse` blocks (arguments are JSON text in OpenAI's).
fn tool_uses(calls: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    dialect::tool_calls(
        calls,
        at,
        |id, name, input| json!({"toolUse": {"toolUseId": id, "name": name, "input": input}}),
    )
}

/// OpenAI `tools` (functions) → Converse `toolSpec`s.
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
            let schema = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            let mut spec = json!({"name": f["name"], "inputSchema": {"json": schema}});
            if let Some(d) = f.get("description") {
                spec["description"] = d.clone();
            }
            Ok(json!({ "toolSpec": spec }))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// OpenAI `tool_choice` → Converse's (`auto` is Converse's default and sent as none).
fn choice(value: &Value) -> Result<Option<Value>, Refusal> {
    match value {
        Value::String(s) if s == "auto" => Ok(None),
        Value::String(s) if s == "required" => Ok(Some(json!({"any": {}}))),
        Value::String(s) if s == "none" => Err(Refusal::new(
            "tool_choice",
            format!("{API} has no `none` choice: leave `tools` out instead"),
        )),
        v if v.pointer("/function/name").is_some() => {
            Ok(Some(json!({"tool": {"name": v.pointer("/function/name")}})))
        }
        _ => Err(Refusal::new(
            "tool_choice",
            "must be auto, required or a named function",
        )),
    }
}

/// Converse's `stopReason` → OpenAI's `finish_reason`.
fn finish_reason(stop: Option<&str>) -> &'static str {
    match stop {
        Some("max_tokens" | "model_context_window_exceeded") => "length",
        Some("tool_use") => "tool_calls",
        Some("guardrail_intervened" | "content_filtered") => "content_filter",
        _ => "stop",
    }
}

/// Converse `usage` → OpenAI's: cache writes and reads are prompt tokens too.
fn usage(u: &Value) -> Value {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let read = n("cacheReadInputTokens");
    dialect::usage(
        n("inputTokens") + n("cacheWriteInputTokens") + read,
        read,
        n("outputTokens"),
    )
}

/// A Converse answer → an OpenAI chat completion naming `model`.
///
/// # Errors
/// The body is not a Converse answer, or a guardrail stopped it.
pub fn answer(body: &Value, model: &str) -> Result<Value, Unanswerable> {
    let Some(content) = body
        .pointer("/output/message/content")
        .and_then(Value::as_array)
    else {
        return Err(Unanswerable::Malformed(
            "the answer has no `output.message.content` list".into(),
        ));
    };
    let stop = body.get("stopReason").and_then(Value::as_str);
    if matches!(stop, Some("guardrail_intervened" | "content_filtered")) {
        return Err(Unanswerable::Blocked(format!(
            "Bedrock stopped the answer ({}): its guardrail or content filter intervened",
            stop.unwrap_or_default()
        )));
    }
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for block in content {
        if let Some(t) = block.get("text").and_then(Value::as_str) {
            text.get_or_insert_with(String::new).push_str(t);
        } else if let Some(u) = block.get("toolUse") {
            calls.push(dialect::tool_call(
                u["toolUseId"].as_str().unwrap_or_default(),
                u["name"].as_str().unwrap_or_default(),
                &u["input"],
            ));
        }
        // Reasoning, citations and others: not part of an OpenAI message.
    }
    Ok(dialect::completion(
        &dialect::fresh_id("chatcmpl-"),
        model,
        text.as_deref(),
        calls,
        finish_reason(stop),
        &usage(&body["usage"]),
    ))
}

/// An AWS error type as Bedrock names it in `x-amzn-errortype` (`ThrottlingException:http://...`
/// → `ThrottlingException`) or in the body's `__type`.
#[must_use]
pub fn error_type(header: Option<&str>, body: Option<&Value>) -> Option<String> {
    let raw = header
        .map(str::to_owned)
        .or_else(|| body?.get("__type")?.as_str().map(str::to_owned))?;
    let name = raw.split(':').next().unwrap_or_default();
    let name = name.rsplit('#').next().unwrap_or_default();
    (!name.is_empty()).then(|| name.to_owned())
}

/// How an AWS error type is classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Throttled or out of quota: falls back (`ThrottlingException`, `ModelNotReadyException`).
    RateLimited,
    /// The host failed: falls back.
    Server,
    /// The gateway's credentials or the model's access were refused: the provider's
    /// configuration, falls back; the host's message is not shown (AWS echoes signed headers).
    Credentials,
    /// The caller's request (`ValidationException`).
    Client,
}

/// The class of an AWS error type, if it is one Bedrock sends.
#[must_use]
pub fn error_class(kind: &str) -> Option<ErrorClass> {
    Some(match kind {
        "ThrottlingException" | "ModelNotReadyException" | "ServiceQuotaExceededException" => {
            ErrorClass::RateLimited
        }
        "ServiceUnavailableException"
        | "InternalServerException"
        | "ModelTimeoutException"
        | "ModelErrorException"
        | "ModelStreamErrorException" => ErrorClass::Server,
        "AccessDeniedException"
        | "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "IncompleteSignatureException"
        | "MissingAuthenticationTokenException"
        | "ExpiredTokenException"
        | "ResourceNotFoundException" => ErrorClass::Credentials,
        "ValidationException" => ErrorClass::Client,
        _ => return None,
    })
}

/// Whether a `ValidationException`'s message says the prompt is longer than the model's window.
#[must_use]
pub fn is_context_overflow(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("input is too long")
        || m.contains("too many input tokens")
        || m.contains("prompt is too long")
        || m.contains("context window")
}

/// Signs `req` (its URI, headers and body) with AWS Signature Version 4 for `bedrock` in
/// `region` at `time`; the signature, date and session token go into its headers (the
/// `aws-sigv4` crate computes them).
///
/// # Errors
/// The crate could not sign (a header it cannot read); the message names no secret.
pub fn sign(
    req: &mut http::Request<http_body_util::Full<Bytes>>,
    body: &[u8],
    credentials: &AwsCredentials,
    region: &str,
    time: std::time::SystemTime,
) -> Result<(), String> {
    use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
    use aws_sigv4::sign::v4;
    let identity = credentials.identity();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("bedrock")
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|_| "the request could not be signed (AWS SigV4 parameters)".to_owned())?
        .into();
    let uri = req.uri().to_string();
    let headers: Vec<(&str, &str)> = req
        .headers()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
        .collect();
    let signable = SignableRequest::new(
        req.method().as_str(),
        uri.as_str(),
        headers.into_iter(),
        SignableBody::Bytes(body),
    )
    .map_err(|_| "the request could not be signed (AWS SigV4 request)".to_owned())?;
    let (instructions, _) = sign(signable, &params)
        .map_err(|_| "the request could not be signed (AWS SigV4)".to_owned())?
        .into_parts();
    instructions.apply_to_request_http1x(req);
    // Never printed by a `Debug` of the request.
    for name in ["authorization", "x-amz-security-token"] {
        if let Some(v) = req.headers_mut().get_mut(name) {
            v.set_sensitive(true);
        }
    }
    Ok(())
}

/// Bedrock's `ConverseStream` events (event-stream messages) → OpenAI chunks.
pub struct StreamTranslation {
    frames: eventstream::Decoder,
    writer: ChunkWriter,
    include_usage: bool,
    /// Content block index → the tool call's index among the answer's tool calls.
    tools: Vec<(u64, usize)>,
    /// `messageStop` came: the answer is whole.
    stopped: bool,
    /// `[DONE]` was written.
    done: bool,
}

impl StreamTranslation {
    #[must_use]
    pub fn new(model: &str, include_usage: bool) -> StreamTranslation {
        StreamTranslation {
            frames: eventstream::Decoder::default(),
            writer: ChunkWriter::new(dialect::fresh_id("chatcmpl-"), model),
            include_usage,
            tools: Vec::new(),
            stopped: false,
            done: false,
        }
    }

    fn message(&mut self, m: &eventstream::Message, out: &mut Vec<u8>) -> Result<(), String> {
        let data: Value = serde_json::from_slice(&m.payload)
            .map_err(|_| "the provider sent an event that is not JSON".to_owned())?;
        match m.header(":message-type") {
            Some("event") => {}
            Some("exception" | "error") => {
                let kind = m
                    .header(":exception-type")
                    .or_else(|| m.header(":error-code"))
                    .unwrap_or("exception");
                let message = data
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the provider's stream failed");
                dialect::error_event(out, &format!("{kind}: {message}"), kind);
                return Ok(());
            }
            _ => return Err("the provider sent an event-stream message of no known type".into()),
        }
        let index = data
            .get("contentBlockIndex")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        match m.header(":event-type") {
            Some("messageStart") => {
                self.writer
                    .delta(out, &json!({"role": "assistant", "content": ""}), None);
            }
            Some("contentBlockStart") => {
                if let Some(u) = data.pointer("/start/toolUse") {
                    let n = self.tools.len();
                    self.tools.push((index, n));
                    let call = json!([{"index": n, "id": u["toolUseId"], "type": "function",
                        "function": {"name": u["name"], "arguments": ""}}]);
                    self.writer.delta(out, &json!({"tool_calls": call}), None);
                }
            }
            Some("contentBlockDelta") => {
                let delta = &data["delta"];
                if let Some(t) = delta.get("text") {
                    self.writer.delta(out, &json!({"content": t}), None);
                } else if let Some(input) = delta.pointer("/toolUse/input") {
                    let Some(&(_, n)) = self.tools.iter().find(|(b, _)| *b == index) else {
                        return Err("the provider sent tool input for no tool call".into());
                    };
                    let call = json!([{"index": n, "function": {"arguments": input}}]);
                    self.writer.delta(out, &json!({"tool_calls": call}), None);
                }
                // Reasoning deltas: not part of an OpenAI answer.
            }
            Some("messageStop") => {
                let stop = data.get("stopReason").and_then(Value::as_str);
                self.writer
                    .delta(out, &json!({}), Some(finish_reason(stop)));
                self.stopped = true;
            }
            Some("metadata") => {
                if self.include_usage {
                    self.writer.usage(out, &usage(&data["usage"]));
                }
                if self.stopped {
                    dialect::done(out);
                    self.done = true;
                }
            }
            // `contentBlockStop` and event types added later: nothing to relay.
            _ => {}
        }
        Ok(())
    }
}

impl dialect::StreamTranslator for StreamTranslation {
    fn feed(&mut self, bytes: &[u8]) -> Result<Bytes, String> {
        let messages = self.frames.feed(bytes).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        for m in &messages {
            self.message(m, &mut out)?;
        }
        Ok(Bytes::from(out))
    }

    fn end(&mut self) -> Result<Bytes, String> {
        self.frames.end().map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        // `metadata` usually closes the stream; after a `messageStop` without it the answer is
        // still whole.
        if self.stopped && !self.done {
            dialect::done(&mut out);
            self.done = true;
        }
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::dialect::StreamTranslator;

    /// The request of Bedrock's Converse documentation (a conversation with a tool call, a
    /// tool result and an image), as the gateway writes it from OpenAI's.
    #[test]
    fn a_conversation_with_tools_and_images_is_written_as_converse() {
        let body = json!({
            "model": "chat", "stream": true, "max_tokens": 512, "stop": ["END"],
            "temperature": 0.5, "top_p": 0.9, "tool_choice": "required", "seed": null,
            "messages": [
                {"role": "system", "content": "You are an app that creates playlists."},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is the most popular song on WZPZ?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "type": "function",
                     "function": {"name": "top_song", "arguments": "{\"sign\":\"WZPZ\"}"}}]},
                {"role": "tool", "tool_call_id": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q",
                 "content": "Elemental Hotel by 8 Storey Hike"}],
            "tools": [{"type": "function", "function": {"name": "top_song",
                "description": "Get the most popular song played on a radio station.",
                "parameters": {"type": "object", "properties": {"sign": {"type": "string"}},
                    "required": ["sign"]}}}]
        });
        assert_eq!(
            request(&body, &mut Leftovers::default()).unwrap(),
            json!({
                "system": [{"text": "You are an app that creates playlists."}],
                "messages": [
                    {"role": "user", "content": [
                        {"text": "What is the most popular song on WZPZ?"},
                        {"image": {"format": "png", "source": {"bytes": "iVBOR"}}}]},
                    {"role": "assistant", "content": [
                        {"toolUse": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q",
                            "name": "top_song", "input": {"sign": "WZPZ"}}}]},
                    {"role": "user", "content": [
                        {"toolResult": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q",
                            "content": [{"text": "Elemental Hotel by 8 Storey Hike"}]}}]}],
                "inferenceConfig": {"maxTokens": 512, "temperature": 0.5, "topP": 0.9,
                    "stopSequences": ["END"]},
                "toolConfig": {
                    "tools": [{"toolSpec": {"name": "top_song",
                        "description": "Get the most popular song played on a radio station.",
                        "inputSchema": {"json": {"type": "object",
                            "properties": {"sign": {"type": "string"}}, "required": ["sign"]}}}}],
                    "toolChoice": {"any": {}}}
            })
        );
    }

    #[test]
    fn what_converse_cannot_express_is_dropped_or_refused_by_name_per_the_policy() {
        use crate::upstream::dialect::policy_table::{check, Expect::*};
        let image = |url: &str| json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]);
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let unreadable = "messages[0].content[0].image_url.url";
        check(
            &request,
            &[
                (json!({"parallel_tool_calls": true}), Translated),
                (
                    json!({"messages": image("data:image/png;base64,AAA")}),
                    Translated,
                ),
                (json!({"user": "u-1"}), Dropped("user", "user")),
                (json!({"seed": 7}), Dropped("seed", "seed")),
                (
                    json!({"response_format": {"type": "json_object"}}),
                    Refused("response_format"),
                ),
                (
                    json!({"presence_penalty": 0.5}),
                    Refused("presence_penalty"),
                ),
                (
                    json!({"tools": tools, "tool_choice": "none"}),
                    Refused("tool_choice"),
                ),
                (
                    json!({"messages": image("https://example.com/a.png")}),
                    Refused(unreadable),
                ),
                (
                    json!({"messages": image("data:image/tiff;base64,AAA")}),
                    Refused(unreadable),
                ),
            ],
        );
    }

    /// The response of Bedrock's Converse documentation, with a tool call and cache usage.
    #[test]
    fn an_answer_with_text_tools_and_cache_usage_reads_as_openai() {
        let body = json!({
            "output": {"message": {"role": "assistant", "content": [
                {"text": "Let me look that up."},
                {"toolUse": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "name": "top_song",
                    "input": {"sign": "WZPZ"}}}]}},
            "stopReason": "tool_use",
            "usage": {"inputTokens": 375, "outputTokens": 36, "totalTokens": 411,
                "cacheReadInputTokens": 100, "cacheWriteInputTokens": 5},
            "metrics": {"latencyMs": 2123}
        });
        let a = answer(&body, "anthropic.claude-3-haiku").unwrap();
        assert_eq!(a["model"], "anthropic.claude-3-haiku");
        assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            a["choices"][0]["message"]["content"],
            "Let me look that up."
        );
        assert_eq!(
            a["choices"][0]["message"]["tool_calls"][0],
            json!({"id": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "type": "function",
                "function": {"name": "top_song", "arguments": "{\"sign\":\"WZPZ\"}"}})
        );
        assert_eq!(
            a["usage"],
            json!({"prompt_tokens": 480, "completion_tokens": 36, "total_tokens": 516,
                "prompt_tokens_details": {"cached_tokens": 100}})
        );
        for (stop, finish) in [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("max_tokens", "length"),
        ] {
            assert_eq!(finish_reason(Some(stop)), finish);
        }
        let blocked = json!({"output": {"message": {"role": "assistant",
            "content": [{"text": "Sorry, I can't help."}]}}, "stopReason": "guardrail_intervened",
            "usage": {"inputTokens": 3, "outputTokens": 0}});
        assert!(matches!(
            answer(&blocked, "m"),
            Err(Unanswerable::Blocked(_))
        ));
        assert!(matches!(
            answer(&json!({"message": "x"}), "m"),
            Err(Unanswerable::Malformed(_))
        ));
    }

    #[test]
    fn aws_error_types_are_read_and_classified() {
        let t = |h: Option<&str>, b: Value| error_type(h, Some(&b));
        assert_eq!(
            t(
                Some("ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"),
                json!({})
            )
            .as_deref(),
            Some("ThrottlingException")
        );
        assert_eq!(
            t(
                None,
                json!({"__type": "com.amazon.coral.service#AccessDeniedException"})
            )
            .as_deref(),
            Some("AccessDeniedException")
        );
        assert_eq!(
            error_class("ThrottlingException"),
            Some(ErrorClass::RateLimited)
        );
        assert_eq!(
            error_class("ModelNotReadyException"),
            Some(ErrorClass::RateLimited)
        );
        assert_eq!(
            error_class("ServiceUnavailableException"),
            Some(ErrorClass::Server)
        );
        assert_eq!(error_class("ValidationException"), Some(ErrorClass::Client));
        assert_eq!(
            error_class("UnrecognizedClientException"),
            Some(ErrorClass::Credentials)
        );
        assert!(is_context_overflow(
            "The model returned the following errors: Input is too long for requested model."
        ));
        assert!(!is_context_overflow("messages: field required"));
    }

    #[test]
    fn a_request_is_signed_for_bedrock_and_no_secret_is_in_it_but_the_signature() {
        let creds = AwsCredentials::new(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            Some("session-token-xyz"),
        );
        let body = br#"{"messages":[]}"#;
        let mut req = http::Request::post(
            "https://bedrock-runtime.us-east-1.amazonaws.com/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
        )
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from_static(body)))
        .unwrap();
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        sign(&mut req, body, &creds, "us-east-1", time).unwrap();
        let h = |n: &str| req.headers()[n].to_str().unwrap().to_owned();
        let auth = h("authorization");
        assert!(
            auth.starts_with(
                "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20231114/us-east-1/bedrock/aws4_request, SignedHeaders="
            ),
            "{auth}"
        );
        assert!(auth.contains("x-amz-security-token"), "{auth}");
        assert_eq!(h("x-amz-date"), "20231114T221320Z");
        assert_eq!(h("x-amz-security-token"), "session-token-xyz");
        assert!(req.headers()["authorization"].is_sensitive());
        assert!(!auth.contains("wJalrXUtnFEMI"));
        // Same inputs, same signature: the crate's computation, deterministic.
        let mut again = req.clone();
        again.headers_mut().remove("authorization");
        again.headers_mut().remove("x-amz-date");
        again.headers_mut().remove("x-amz-security-token");
        sign(&mut again, body, &creds, "us-east-1", time).unwrap();
        assert_eq!(
            again.headers()["authorization"],
            req.headers()["authorization"]
        );
        assert!(!format!("{creds:?}").contains("AKIDEXAMPLE"));
    }

    #[test]
    fn stream_events_become_chunks_and_done() {
        let mut bytes = Vec::new();
        for (kind, payload) in [
            ("messageStart", json!({"role": "assistant"})),
            (
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": "Hi"}}),
            ),
            ("contentBlockStop", json!({"contentBlockIndex": 0})),
            (
                "contentBlockStart",
                json!({"contentBlockIndex": 1,
                "start": {"toolUse": {"toolUseId": "tooluse_1", "name": "look"}}}),
            ),
            (
                "contentBlockDelta",
                json!({"contentBlockIndex": 1,
                "delta": {"toolUse": {"input": "{\"q\":"}}}),
            ),
            ("contentBlockStop", json!({"contentBlockIndex": 1})),
            ("messageStop", json!({"stopReason": "tool_use"})),
            (
                "metadata",
                json!({"usage": {"inputTokens": 3, "cacheReadInputTokens": 2,
                "outputTokens": 9, "totalTokens": 14}, "metrics": {"latencyMs": 100}}),
            ),
        ] {
            bytes.extend(eventstream::event(kind, &payload));
        }
        let mut tr = StreamTranslation::new("claude-b", true);
        let mut out = Vec::new();
        for piece in bytes.chunks(13) {
            out.extend_from_slice(&tr.feed(piece).unwrap());
        }
        out.extend_from_slice(&tr.end().unwrap());
        let out = String::from_utf8(out).unwrap();
        let chunks: Vec<&str> = out.split("\n\n").filter(|c| !c.is_empty()).collect();
        assert_eq!(chunks.last(), Some(&"data: [DONE]"));
        assert_eq!(chunks.iter().filter(|c| **c == "data: [DONE]").count(), 1);
        let json: Vec<Value> = chunks[..chunks.len() - 1]
            .iter()
            .map(|c| serde_json::from_str(c.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        let deltas: Vec<&Value> = json.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0], &json!({"role": "assistant", "content": ""}));
        assert_eq!(deltas[1], &json!({"content": "Hi"}));
        assert_eq!(deltas[2]["tool_calls"][0]["id"], "tooluse_1");
        assert_eq!(
            deltas[3]["tool_calls"][0]["function"]["arguments"],
            "{\"q\":"
        );
        assert_eq!(json[4]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(json[5]["usage"]["prompt_tokens"], 5);
        assert_eq!(json[5]["usage"]["completion_tokens"], 9);
        assert!(json.iter().all(|c| c["model"] == "claude-b"));
    }

    #[test]
    fn an_exception_frame_ends_the_stream_as_broken_and_a_bad_frame_is_an_error() {
        let mut bytes = eventstream::event("messageStart", &json!({"role": "assistant"}));
        bytes.extend(eventstream::exception(
            "throttlingException",
            "Too many tokens, please wait before trying again.",
        ));
        let mut tr = StreamTranslation::new("m", false);
        let out = String::from_utf8(tr.feed(&bytes).unwrap().to_vec()).unwrap();
        assert!(out.contains("\"code\":\"throttlingException\""), "{out}");
        assert!(!out.contains("[DONE]"));
        let mut bad = eventstream::event("messageStart", &json!({}));
        let at = bad.len() - 1;
        bad[at] ^= 0xff;
        assert!(StreamTranslation::new("m", false).feed(&bad).is_err());
        // Cut inside a frame: the end says so.
        let mut tr = StreamTranslation::new("m", false);
        let whole = eventstream::event("messageStart", &json!({}));
        tr.feed(&whole[..whole.len() - 2]).unwrap();
        assert!(tr.end().is_err());
    }
}
