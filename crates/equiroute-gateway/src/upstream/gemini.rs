//! Google's Gemini API (`POST {base_url}/models/{model}:generateContent`, and
//! `:streamGenerateContent?alt=sse` for streams): the client's OpenAI request written as a
//! `GenerateContentRequest`, the answer and its stream written back as OpenAI's.
//!
//! Translated: system and developer messages → `systemInstruction`; user and assistant
//! messages → `user` and `model` turns of `contents` (text parts, `data:` images as
//! `inlineData`, tool calls as `functionCall`); tool messages → `functionResponse` parts (the
//! function's name found from the assistant's call with that id); `tools` →
//! `functionDeclarations` (`parametersJsonSchema`), `tool_choice` → `toolConfig`;
//! `max_completion_tokens`/`max_tokens`, `temperature`, `top_p`, `stop`, `seed`,
//! `presence_penalty`, `frequency_penalty` and `response_format` (JSON mode and JSON schema)
//! → `generationConfig`. Anything else is dropped when droppable and the policy allows
//! (`dialect::Leftovers`), else a 400 naming the field. A blocked prompt, or an
//! answer stopped for safety with nothing in it, is a client error (a content filter refusal).

use super::dialect::{self, ChunkWriter, EventTranslator, Leftovers, Refusal, Unanswerable};
use serde_json::{json, Map, Value};

const API: &str = "Gemini's generateContent";

/// The `GenerateContentRequest` for the client's OpenAI `body`.
///
/// Members it cannot express go to `leftovers` (dropped or refused).
///
/// # Errors
/// A member or value Gemini cannot express and may not drop, named.
pub fn request(body: &Value, leftovers: &mut Leftovers) -> Result<Value, Refusal> {
    let Some(obj) = body.as_object() else {
        return Err(Refusal::new("(body)", "must be a JSON object"));
    };
    let mut out = Map::new();
    let mut config = Map::new();
    if let Some(n) = dialect::max_tokens(obj)? {
        config.insert("maxOutputTokens".into(), json!(n));
    }
    for (key, value) in obj {
        match key.as_str() {
            // Set by the gateway, read above, or read by the stream's translation.
            k if dialect::handled_elsewhere(k) => {}
            _ if dialect::absent(value) => {}
            "messages" => {
                let (system, contents) = contents(value, leftovers)?;
                if let Some(s) = system {
                    out.insert("systemInstruction".into(), json!({"parts": [{"text": s}]}));
                }
                out.insert("contents".into(), Value::Array(contents));
            }
            "temperature" | "seed" => {
                config.insert(key.clone(), value.clone());
            }
            "top_p" => {
                config.insert("topP".into(), value.clone());
            }
            "presence_penalty" => {
                config.insert("presencePenalty".into(), value.clone());
            }
            "frequency_penalty" => {
                config.insert("frequencyPenalty".into(), value.clone());
            }
            "stop" => {
                config.insert(
                    "stopSequences".into(),
                    json!(dialect::stop_sequences(value)?),
                );
            }
            "n" => dialect::single_choice(value, API)?,
            "response_format" => response_format(value, &mut config)?,
            "tools" => {
                out.insert("tools".into(), tools(value)?);
            }
            "tool_choice" => {
                out.insert(
                    "toolConfig".into(),
                    json!({"functionCallingConfig": choice(value)?}),
                );
            }
            other => leftovers.member(other, API)?,
        }
    }
    if !config.is_empty() {
        out.insert("generationConfig".into(), Value::Object(config));
    }
    Ok(Value::Object(out))
}

fn response_format(value: &Value, config: &mut Map<String, Value>) -> Result<(), Refusal> {
    match value.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some("json_object") => {
            config.insert("responseMimeType".into(), json!("application/json"));
        }
        Some("json_schema") => {
            config.insert("responseMimeType".into(), json!("application/json"));
            if let Some(schema) = value.pointer("/json_schema/schema") {
                config.insert("responseJsonSchema".into(), schema.clone());
            }
        }
        _ => {
            return Err(Refusal::new(
                "response_format.type",
                "must be text, json_object or json_schema",
            ))
        }
    }
    Ok(())
}

/// OpenAI `messages` → Gemini's system instruction and `contents`.
fn contents(
    value: &Value,
    leftovers: &mut Leftovers,
) -> Result<(Option<String>, Vec<Value>), Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("messages", "must be a list"));
    };
    let mut system: Vec<String> = Vec::new();
    let mut out: Vec<Value> = Vec::new();
    // Tool call id → function name, from the assistant messages so far.
    let mut names: Vec<(String, Value)> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        dialect::message(m, i, API, leftovers)?;
        let content = m.get("content").unwrap_or(&Value::Null);
        let (role, parts) = match m.get("role").and_then(Value::as_str).unwrap_or_default() {
            "system" | "developer" => {
                system.push(dialect::text_of(content, &at("content"))?);
                continue;
            }
            "user" => ("user", parts(content, &at("content"))?),
            "assistant" => {
                let mut p = parts(content, &at("content"))?;
                for (j, c) in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let args = c
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or("{}");
                    let args: Value = serde_json::from_str(args).map_err(|_| {
                        Refusal::new(
                            at(&format!("tool_calls[{j}].function.arguments")),
                            "must be JSON text",
                        )
                    })?;
                    let name = c.pointer("/function/name").cloned().unwrap_or_default();
                    let id = c.get("id").and_then(Value::as_str);
                    if let Some(id) = id {
                        names.push((id.to_owned(), name.clone()));
                    }
                    let mut part = json!({"functionCall": {"name": name, "args": args}});
                    if let Some(signature) = thought_signature(c, id) {
                        part["thoughtSignature"] = json!(signature);
                    }
                    p.push(part);
                }
                ("model", p)
            }
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                // The latest call with the id: a client may reuse ids across rounds.
                let Some((_, name)) = names.iter().rev().find(|(k, _)| k == id) else {
                    return Err(Refusal::new(
                        at("tool_call_id"),
                        "names no tool call of an earlier assistant message (Gemini needs the function's name)",
                    ));
                };
                let text = dialect::text_of(content, &at("content"))?;
                // Gemini wants an object: JSON objects go as they are, other text is wrapped.
                let response = match serde_json::from_str::<Value>(&text) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => json!({"content": text}),
                };
                (
                    "user",
                    vec![json!({"functionResponse": {"name": name, "response": response}})],
                )
            }
            other => return Err(dialect::unknown_role(i, other, API)),
        };
        dialect::push_turn(&mut out, role, "parts", parts);
    }
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    Ok((system, out))
}

/// Where a tool call id carries Gemini's thought signature: `<id>:ts:<signature>`.
const SIGNATURE_IN_ID: &str = ":ts:";

/// The thought signature Gemini gave with a tool call, as the client returns it: in the
/// call's `extra_content.google.thought_signature` (Google's own OpenAI-compatible shape),
/// else in its id, which every client returns unchanged.
fn thought_signature<'a>(call: &'a Value, id: Option<&'a str>) -> Option<&'a str> {
    call.pointer("/extra_content/google/thought_signature")
        .and_then(Value::as_str)
        .or_else(|| {
            id.and_then(|id| id.split_once(SIGNATURE_IN_ID))
                .map(|(_, s)| s)
        })
        .filter(|s| !s.is_empty())
}

/// A message's content as Gemini parts.
fn parts(content: &Value, at: &str) -> Result<Vec<Value>, Refusal> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({"text": s})]),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(j, p)| {
                let at = format!("{at}[{j}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => Ok(json!({"text": p.get("text").cloned().unwrap_or_default()})),
                    Some("image_url") => {
                        let url = p
                            .pointer("/image_url/url")
                            .and_then(Value::as_str)
                            .unwrap_or_default();
                        match dialect::data_url(url) {
                            Some((mime, data)) => {
                                Ok(json!({"inlineData": {"mimeType": mime, "data": data}}))
                            }
                            None => Err(Refusal::new(
                                format!("{at}.image_url.url"),
                                "Gemini takes images inline: send a data: URL (base64)",
                            )),
                        }
                    }
                    other => Err(Refusal::new(
                        format!("{at}.type"),
                        format!(
                            "`{}` parts have no equivalent in {API} (text and image_url do)",
                            other.unwrap_or("(none)")
                        ),
                    )),
                }
            })
            .collect(),
        _ => Err(Refusal::new(at, "must be a string or a list of parts")),
    }
}

fn tools(value: &Value) -> Result<Value, Refusal> {
    let Some(list) = value.as_array() else {
        return Err(Refusal::new("tools", "must be a list"));
    };
    let declarations = list
        .iter()
        .enumerate()
        .map(|(j, t)| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(Refusal::new(
                    format!("tools[{j}].type"),
                    format!("only `function` tools have an equivalent in {API}"),
                ));
            }
            let f = &t["function"];
            let mut d = json!({"name": f["name"]});
            if let Some(desc) = f.get("description") {
                d["description"] = desc.clone();
            }
            if let Some(p) = f.get("parameters") {
                d["parametersJsonSchema"] = p.clone();
            }
            Ok(d)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json!([{"functionDeclarations": declarations}]))
}

fn choice(value: &Value) -> Result<Value, Refusal> {
    match value {
        Value::String(s) if s == "auto" => Ok(json!({"mode": "AUTO"})),
        Value::String(s) if s == "none" => Ok(json!({"mode": "NONE"})),
        Value::String(s) if s == "required" => Ok(json!({"mode": "ANY"})),
        v if v.pointer("/function/name").is_some() => {
            Ok(json!({"mode": "ANY", "allowedFunctionNames": [v.pointer("/function/name")]}))
        }
        _ => Err(Refusal::new(
            "tool_choice",
            "must be auto, none, required or a named function",
        )),
    }
}

/// Gemini's `finishReason` → OpenAI's `finish_reason`.
fn finish_reason(reason: &str, has_calls: bool) -> &'static str {
    match reason {
        "MAX_TOKENS" => "length",
        "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY" => {
            "content_filter"
        }
        _ if has_calls => "tool_calls",
        _ => "stop",
    }
}

fn usage(u: &Value) -> Value {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    dialect::usage(
        n("promptTokenCount"),
        n("cachedContentTokenCount"),
        n("candidatesTokenCount") + n("thoughtsTokenCount"),
    )
}

/// The text and tool calls of a candidate's parts. A call without Gemini's own id gets a
/// fresh one; a call with a thought signature carries it in its id and in
/// `extra_content.google.thought_signature`, so that the next turn returns it to Gemini
/// (which refuses a turn whose function call lost its signature).
fn read_parts(candidate: &Value) -> (Option<String>, Vec<Value>) {
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for p in candidate
        .pointer("/content/parts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        // Thought summaries are not part of an OpenAI answer.
        if p.get("thought").and_then(Value::as_bool) == Some(true) {
            continue;
        }
        if let Some(t) = p.get("text").and_then(Value::as_str) {
            text.get_or_insert_with(String::new).push_str(t);
        } else if let Some(f) = p.get("functionCall") {
            let mut id = f
                .get("id")
                .and_then(Value::as_str)
                .filter(|id| !id.is_empty())
                .map_or_else(|| dialect::fresh_id("call_"), str::to_owned);
            let signature = p.get("thoughtSignature").and_then(Value::as_str);
            if let Some(signature) = signature {
                id = format!("{id}{SIGNATURE_IN_ID}{signature}");
            }
            let mut call = dialect::tool_call(
                &id,
                f["name"].as_str().unwrap_or_default(),
                f.get("args").unwrap_or(&json!({})),
            );
            if let Some(signature) = signature {
                call["extra_content"] = json!({"google": {"thought_signature": signature}});
            }
            calls.push(call);
        }
    }
    (text, calls)
}

/// Why the prompt was blocked, if it was.
fn blocked(body: &Value) -> Option<Unanswerable> {
    body.pointer("/promptFeedback/blockReason")
        .and_then(Value::as_str)
        .map(|r| Unanswerable::Blocked(format!("Gemini blocked the prompt ({r})")))
}

/// A `GenerateContentResponse` → an OpenAI chat completion naming `model`.
///
/// # Errors
/// The prompt or the answer was blocked, or the body is not an answer.
pub fn answer(body: &Value, model: &str) -> Result<Value, Unanswerable> {
    let Some(candidate) = body.pointer("/candidates/0") else {
        return Err(blocked(body)
            .unwrap_or_else(|| Unanswerable::Malformed("an answer without candidates".into())));
    };
    let (text, calls) = read_parts(candidate);
    let reason = candidate["finishReason"].as_str().unwrap_or("STOP");
    let finish = finish_reason(reason, !calls.is_empty());
    if finish == "content_filter" && text.is_none() && calls.is_empty() {
        return Err(Unanswerable::Blocked(format!(
            "Gemini stopped the answer ({reason})"
        )));
    }
    Ok(dialect::completion(
        &body["responseId"]
            .as_str()
            .map_or_else(|| dialect::fresh_id("chatcmpl-"), str::to_owned),
        model,
        text.as_deref(),
        calls,
        finish,
        &usage(&body["usageMetadata"]),
    ))
}

/// Gemini's stream (each event a `GenerateContentResponse`) → OpenAI chunks.
pub struct StreamTranslation {
    writer: Option<ChunkWriter>,
    model: String,
    include_usage: bool,
    calls: usize,
    usage: Value,
    finished: bool,
}

impl StreamTranslation {
    #[must_use]
    pub fn new(model: &str, include_usage: bool) -> StreamTranslation {
        StreamTranslation {
            writer: None,
            model: model.to_owned(),
            include_usage,
            calls: 0,
            usage: json!({}),
            finished: false,
        }
    }
}

impl EventTranslator for StreamTranslation {
    fn data(&mut self, data: &Value, out: &mut Vec<u8>) -> Result<(), String> {
        if let Some(e) = data.get("error") {
            let message = e["message"]
                .as_str()
                .unwrap_or("the provider's stream failed");
            dialect::error_event(out, message, e["status"].as_str().unwrap_or("error"));
            return Ok(());
        }
        if let Some(Unanswerable::Blocked(why)) = blocked(data) {
            dialect::error_event(out, &why, "content_filter");
            return Ok(());
        }
        if self.writer.is_none() {
            let id = data["responseId"]
                .as_str()
                .map_or_else(|| dialect::fresh_id("chatcmpl-"), str::to_owned);
            let w = ChunkWriter::new(id, &self.model);
            w.delta(out, &json!({"role": "assistant", "content": ""}), None);
            self.writer = Some(w);
        }
        let Some(writer) = &self.writer else {
            return Ok(());
        };
        if let Some(u) = data.get("usageMetadata") {
            self.usage = u.clone();
        }
        let Some(candidate) = data.pointer("/candidates/0") else {
            return Ok(());
        };
        let (text, calls) = read_parts(candidate);
        if let Some(t) = text {
            writer.delta(out, &json!({"content": t}), None);
        }
        if !calls.is_empty() {
            let indexed: Vec<Value> = calls
                .into_iter()
                .enumerate()
                .map(|(j, mut c)| {
                    c["index"] = json!(self.calls + j);
                    c
                })
                .collect();
            self.calls += indexed.len();
            writer.delta(out, &json!({"tool_calls": indexed}), None);
        }
        if let Some(reason) = candidate.get("finishReason").and_then(Value::as_str) {
            writer.delta(out, &json!({}), Some(finish_reason(reason, self.calls > 0)));
            self.finished = true;
        }
        Ok(())
    }

    fn end(&mut self, out: &mut Vec<u8>) {
        // Gemini's stream has no end marker: a clean end after the finish reason is whole.
        if !self.finished {
            return;
        }
        if let (true, Some(w)) = (self.include_usage, &self.writer) {
            w.usage(out, &usage(&self.usage));
        }
        dialect::done(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::dialect::{SseTranslator, StreamTranslator};

    #[test]
    fn a_conversation_with_tools_images_and_json_mode_is_written_as_contents() {
        let body = json!({
            "model": "chat", "max_completion_tokens": 50, "stop": ["END"], "temperature": 0.1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
            "tool_choice": {"type": "function", "function": {"name": "look"}},
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is here?"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "look", "arguments": "{\"q\":\"a\"}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "a cat"}],
            "tools": [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
        });
        assert_eq!(
            request(&body, &mut Leftovers::default()).unwrap(),
            json!({
                "systemInstruction": {"parts": [{"text": "Be brief."}]},
                "contents": [
                    {"role": "user", "parts": [{"text": "What is here?"},
                        {"inlineData": {"mimeType": "image/jpeg", "data": "/9j/"}}]},
                    {"role": "model", "parts": [{"functionCall": {"name": "look", "args": {"q": "a"}}}]},
                    {"role": "user", "parts": [{"functionResponse": {"name": "look", "response": {"content": "a cat"}}}]}],
                "tools": [{"functionDeclarations": [{"name": "look", "parametersJsonSchema": {"type": "object"}}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["look"]}},
                "generationConfig": {"maxOutputTokens": 50, "stopSequences": ["END"], "temperature": 0.1,
                    "responseMimeType": "application/json", "responseJsonSchema": {"type": "object"}}
            })
        );
        let refused = |b: Value| request(&b, &mut Leftovers::default()).unwrap_err().field;
        assert_eq!(
            refused(json!({"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]})),
            "messages[0].tool_call_id"
        );
        assert_eq!(
            refused(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/b.png"}}]}]})
            ),
            "messages[0].content[0].image_url.url"
        );
    }

    #[test]
    fn what_gemini_cannot_express_is_dropped_or_refused_by_name_per_the_policy() {
        use crate::upstream::dialect::policy_table::{check, Expect::*};
        check(
            &request,
            &[
                (json!({"seed": 7}), Translated),
                (json!({"presence_penalty": 0.5}), Translated),
                (
                    json!({"response_format": {"type": "json_object"}}),
                    Translated,
                ),
                (json!({"user": "u-1"}), Dropped("user", "user")),
                (
                    json!({"parallel_tool_calls": true}),
                    Dropped("parallel_tool_calls", "parallel_tool_calls"),
                ),
            ],
        );
    }

    #[test]
    fn tool_results_go_to_the_latest_call_with_their_id_and_signatures_come_back() {
        // Two rounds whose calls share an id (as every answer's first call did when they were
        // numbered from call_0): each result goes under the name of the call just before it.
        let call = |id: &str, name: &str, extra: Value| {
            let mut c = json!({"id": id, "type": "function", "function": {"name": name, "arguments": "{}"}});
            if !extra.is_null() {
                c["extra_content"] = extra;
            }
            json!({"role": "assistant", "content": null, "tool_calls": [c]})
        };
        let body = json!({"messages": [
            {"role": "user", "content": "go"},
            call("call_0", "first", Value::Null),
            {"role": "tool", "tool_call_id": "call_0", "content": "r1"},
            call("call_0:ts:c2ln", "second", Value::Null),
            {"role": "tool", "tool_call_id": "call_0:ts:c2ln", "content": "r2"},
            call("call_9", "third", json!({"google": {"thought_signature": "dGhy"}})),
            {"role": "tool", "tool_call_id": "call_9", "content": "r3"}]});
        let out = request(&body, &mut Leftovers::default()).unwrap();
        let parts: Vec<&Value> = out["contents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["parts"][0])
            .collect();
        assert_eq!(parts[1]["functionCall"]["name"], "first");
        assert!(parts[1].get("thoughtSignature").is_none(), "none was given");
        assert_eq!(parts[2]["functionResponse"]["name"], "first");
        assert_eq!(parts[3]["thoughtSignature"], "c2ln", "from the id");
        assert_eq!(parts[4]["functionResponse"]["name"], "second");
        assert_eq!(parts[5]["thoughtSignature"], "dGhy", "from extra_content");
        assert_eq!(parts[6]["functionResponse"]["name"], "third");
    }

    #[test]
    fn each_call_and_answer_without_an_id_of_gemini_gets_a_fresh_one() {
        let body = json!({"candidates": [{"content": {"role": "model", "parts": [
                {"functionCall": {"name": "a", "args": {}}, "thoughtSignature": "c2ln"},
                {"functionCall": {"name": "b", "args": {}}},
                {"functionCall": {"name": "c", "args": {}, "id": "g-7"}}]},
                "finishReason": "STOP"}]});
        let a = answer(&body, "gemini-x").unwrap();
        let b = answer(&body, "gemini-x").unwrap();
        let calls = a["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        let id = |i: usize| calls[i]["id"].as_str().unwrap();
        assert!(
            id(0).starts_with("call_") && id(0).ends_with(":ts:c2ln"),
            "{}",
            id(0)
        );
        assert_eq!(
            calls[0]["extra_content"]["google"]["thought_signature"],
            "c2ln"
        );
        assert!(id(1).starts_with("call_") && id(1).len() == 29, "{}", id(1));
        assert_ne!(id(1), b["choices"][0]["message"]["tool_calls"][1]["id"]);
        assert_eq!(id(2), "g-7", "Gemini's own id is kept");
        assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_ne!(a["id"], b["id"], "no constant answer id");
    }

    #[test]
    fn answers_blocks_and_usage_read_as_openai() {
        let body = json!({"candidates": [{"content": {"role": "model", "parts": [
                {"text": "Looking."}, {"functionCall": {"name": "look", "args": {"q": "a"}}}]},
                "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 4, "thoughtsTokenCount": 2,
                "cachedContentTokenCount": 6, "totalTokenCount": 16},
            "modelVersion": "gemini-x-001", "responseId": "r1"});
        let a = answer(&body, "gemini-x").unwrap();
        assert_eq!(a["model"], "gemini-x");
        assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(a["choices"][0]["message"]["content"], "Looking.");
        assert_eq!(
            a["choices"][0]["message"]["tool_calls"][0]["function"],
            json!({"name": "look", "arguments": "{\"q\":\"a\"}"})
        );
        assert_eq!(
            a["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
                "prompt_tokens_details": {"cached_tokens": 6}})
        );
        let blocked_prompt = json!({"promptFeedback": {"blockReason": "SAFETY"}});
        assert!(matches!(
            answer(&blocked_prompt, "m"),
            Err(Unanswerable::Blocked(_))
        ));
        let blocked_answer = json!({"candidates": [{"finishReason": "SAFETY", "index": 0}]});
        assert!(matches!(
            answer(&blocked_answer, "m"),
            Err(Unanswerable::Blocked(_))
        ));
        assert!(matches!(
            answer(&json!({}), "m"),
            Err(Unanswerable::Malformed(_))
        ));
    }

    #[test]
    fn a_stream_becomes_chunks_and_done_only_when_finished() {
        let events = [
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}], "responseId": "r1"}),
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]}, "finishReason": "STOP", "index": 0}],
                "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2}}),
        ];
        let text: String = events
            .iter()
            .map(|e| format!("data: {e}\r\n\r\n"))
            .collect::<Vec<_>>()
            .concat();
        let run = |text: &str, usage: bool| {
            let mut tr = SseTranslator::new(Box::new(StreamTranslation::new("gemini-x", usage)));
            let mut out = tr.feed(text.as_bytes()).unwrap().to_vec();
            out.extend_from_slice(&tr.end().unwrap());
            String::from_utf8(out).unwrap()
        };
        let out = run(&text, true);
        let chunks: Vec<&str> = out.split("\n\n").filter(|c| !c.is_empty()).collect();
        assert_eq!(chunks.len(), 6, "{out}");
        assert!(chunks[0].contains(r#""role":"assistant""#));
        assert!(
            chunks[1].contains(r#""content":"Hel""#) && chunks[2].contains(r#""content":"lo""#)
        );
        assert!(chunks[3].contains(r#""finish_reason":"stop""#));
        assert!(chunks[4].contains(r#""prompt_tokens":3"#));
        assert_eq!(chunks[5], "data: [DONE]");
        // Cut before its finish reason: no end marker, the relay reports it broken.
        let first = format!("data: {}\n\n", events[0]);
        assert!(!run(&first, false).contains("[DONE]"));
    }
}
