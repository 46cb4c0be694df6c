//! The mock's answers in each dialect, unstreamed and streamed (OpenAI chunks, Anthropic and
//! Gemini events, Bedrock's event-stream frames), with the stream faults that change what is
//! sent, cut or stall it, or never end it.

use crate::faults::first_token_delay;
use crate::profile::{Fault, RouteProfile};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The id of the mock's OpenAI tool call.
pub(crate) const OPENAI_CALL_ID: &str = "call_mock";

/// An OpenAI stream's finish with a call of `tool` instead: the call's chunks (its id and
/// name, then its arguments in two pieces) and `finish_reason = "tool_calls"`.
pub(crate) fn call_in_stream(chunks: &mut Vec<String>, model: &str, tool: &str) {
    let Some(at) = chunks
        .iter()
        .position(|c| c.contains("\"finish_reason\":\"stop\""))
    else {
        return;
    };
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let call = |c: serde_json::Value| json!({"tool_calls": [c]});
    let mut calling = vec![chunk(
        call(json!({"index": 0, "id": OPENAI_CALL_ID, "type": "function",
            "function": {"name": tool, "arguments": ""}})),
        serde_json::Value::Null,
    )];
    for piece in ["{\"q\": ", "\"mock\"}"] {
        calling.push(chunk(
            call(json!({"index": 0, "function": {"arguments": piece}})),
            serde_json::Value::Null,
        ));
    }
    calling.push(chunk(json!({}), json!("tool_calls")));
    chunks.splice(at..=at, calling);
}

/// The mock's Converse answer: the route's text, then a call of `tool` if given.
#[must_use]
pub fn bedrock_answer(text: &str, tool: Option<&str>) -> serde_json::Value {
    let mut content = vec![json!({ "text": text })];
    if let Some(t) = tool {
        content.push(
            json!({"toolUse": {"toolUseId": "tooluse_mock", "name": t, "input": {"q": "mock"}}}),
        );
    }
    json!({"output": {"message": {"role": "assistant", "content": content}},
        "stopReason": if tool.is_some() { "tool_use" } else { "end_turn" },
        "usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7, "cacheReadInputTokens": 0},
        "metrics": {"latencyMs": 20}})
}

/// The frames of the mock's `ConverseStream` answer (AWS event-stream framing), ending with
/// `messageStop` and `metadata`, with the faults that change what is sent: `malformed_chunk`
/// corrupts the third frame's CRC, `no_done_finished` drops `metadata`, `no_done_unfinished`
/// drops `messageStop` too.
#[must_use]
pub fn bedrock_stream_frames(tool: Option<&str>, fault: Option<Fault>) -> Vec<Bytes> {
    use equiroute_eventstream::event;
    let mut out = vec![event("messageStart", &json!({"role": "assistant"}))];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(event(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": word}}),
        ));
    }
    out.push(event("contentBlockStop", &json!({"contentBlockIndex": 0})));
    if let Some(t) = tool {
        out.push(event(
            "contentBlockStart",
            &json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tooluse_mock", "name": t}}}),
        ));
        for piece in ["{\"q\": ", "\"mock\"}"] {
            out.push(event(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": piece}}}),
            ));
        }
        out.push(event("contentBlockStop", &json!({"contentBlockIndex": 1})));
    }
    let stop = if tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    out.push(event("messageStop", &json!({ "stopReason": stop })));
    out.push(event(
        "metadata",
        &json!({"usage": {"inputTokens": 5, "outputTokens": 3, "totalTokens": 8}, "metrics": {"latencyMs": 20}}),
    ));
    match fault {
        Some(Fault::MalformedChunk) => {
            if let Some(last) = out[2].last_mut() {
                *last ^= 0xff;
            }
        }
        Some(Fault::NoDoneFinished) => out.truncate(out.len() - 1),
        Some(Fault::NoDoneUnfinished) => out.truncate(out.len() - 2),
        _ => {}
    }
    out.into_iter().map(Bytes::from).collect()
}

/// The mock's Messages answer: the route's text, then a call of `tool` if given.
#[must_use]
pub fn anthropic_answer(model: &str, text: &str, tool: Option<&str>) -> serde_json::Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    if let Some(t) = tool {
        content.push(
            json!({"type": "tool_use", "id": "toolu_mock", "name": t, "input": {"q": "mock"}}),
        );
    }
    json!({"id": "msg_mock", "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": if tool.is_some() { "tool_use" } else { "end_turn" },
        "stop_sequence": null,
        "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1, "output_tokens": 2}})
}

/// The thought signature of the mock's Gemini function calls.
pub const MOCK_THOUGHT_SIGNATURE: &str = "c2lnLW1vY2s=";

/// The mock's `GenerateContentResponse`: the route's text, then a call of `tool` if given.
#[must_use]
pub fn gemini_answer(model: &str, text: &str, tools: &[String]) -> serde_json::Value {
    let mut parts = vec![json!({"text": text})];
    parts.extend(gemini_calls(tools));
    json!({"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 2, "totalTokenCount": 6},
        "modelVersion": model, "responseId": "mock-response"})
}

/// The events of the mock's streamed Messages answer, ending with `message_stop`.
#[must_use]
pub fn anthropic_stream_events(model: &str, tool: Option<&str>) -> Vec<String> {
    let event = |name: &str, data: serde_json::Value| format!("event: {name}\ndata: {data}\n\n");
    let mut out = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": word}}),
        ));
    }
    out.push(event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    if let Some(t) = tool {
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_mock", "name": t, "input": {}}}),
        ));
        for piece in ["{\"q\": ", "\"mock\"}"] {
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        out.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ));
    }
    let stop = if tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    };
    out.push(event(
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 3}}),
    ));
    out.push(event("message_stop", json!({"type": "message_stop"})));
    out
}

/// The mock's streamed answer's text after an assistant prefill (the conversation's last
/// turn, Anthropic's shape) that begins it, as a model that takes prefills goes on from it.
pub(crate) fn prefilled_rest(body: &serde_json::Value) -> Option<String> {
    let last = body.pointer("/messages")?.as_array()?.last()?;
    if last["role"] != "assistant" {
        return None;
    }
    let prefill = match &last["content"] {
        serde_json::Value::String(t) => t.clone(),
        blocks => blocks
            .as_array()?
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect(),
    };
    "mock streamed answer"
        .strip_prefix(prefill.as_str())
        .filter(|_| !prefill.is_empty())
        .map(str::to_owned)
}

/// Replaces the text deltas of Anthropic `events` by one with `rest`.
pub(crate) fn continue_prefill(events: &mut Vec<String>, rest: &str) {
    let Some(at) = events.iter().position(|e| e.contains("\"text_delta\"")) else {
        return;
    };
    events.retain(|e| !e.contains("\"text_delta\""));
    let delta = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": rest}});
    events.insert(at, format!("event: content_block_delta\ndata: {delta}\n\n"));
}

/// The events of the mock's streamed Gemini answer (`alt=sse`): no end marker, the last
/// event carries the finish reason and the usage.
#[must_use]
pub fn gemini_stream_events(model: &str, tools: &[String]) -> Vec<String> {
    let event = |parts: serde_json::Value, finish: Option<&str>| {
        let mut c = json!({"content": {"role": "model", "parts": parts}, "index": 0});
        let mut e = json!({"candidates": [], "modelVersion": model, "responseId": "mock-response"});
        if let Some(f) = finish {
            c["finishReason"] = json!(f);
            e["usageMetadata"] =
                json!({"promptTokenCount": 4, "candidatesTokenCount": 3, "totalTokenCount": 7});
        }
        e["candidates"] = json!([c]);
        format!("data: {e}\r\n\r\n")
    };
    let mut out: Vec<String> = ["mock ", "streamed "]
        .iter()
        .map(|w| event(json!([{"text": w}]), None))
        .collect();
    let mut last = vec![json!({"text": "answer"})];
    last.extend(gemini_calls(tools));
    out.push(event(json!(last), Some("STOP")));
    out
}

/// The mock's Gemini function calls, one per tool: as Gemini 3 does with parallel calls, the
/// first carries a thought signature, which the next turn must return.
pub(crate) fn gemini_calls(tools: &[String]) -> impl Iterator<Item = serde_json::Value> + '_ {
    tools.iter().enumerate().map(|(i, t)| {
        let mut part = json!({"functionCall": {"name": t, "args": {"q": "mock"}}});
        if i == 0 {
            part["thoughtSignature"] = json!(MOCK_THOUGHT_SIGNATURE);
        }
        part
    })
}

/// The tools a Gemini answer calls: the first declared function, and the second when there
/// is one (two calls in one answer, as Gemini makes parallel calls); none after a result.
pub(crate) fn gemini_tools(body: &serde_json::Value, first: Option<String>) -> Vec<String> {
    let Some(first) = first else {
        return Vec::new();
    };
    let second = body
        .pointer("/tools/0/functionDeclarations/1/name")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    std::iter::once(first).chain(second).collect()
}

/// A native stream with the faults that change what is sent; `marker`: the stream ends with
/// an end event of its own (Anthropic's `message_stop`; Gemini's has none).
pub(crate) fn with_fault(
    mut events: Vec<String>,
    fault: Option<Fault>,
    marker: bool,
) -> Vec<String> {
    match fault {
        Some(Fault::MalformedChunk) => MALFORMED_CHUNK.clone_into(&mut events[2]),
        Some(Fault::NoDoneFinished) if marker => events.truncate(events.len() - 1),
        Some(Fault::NoDoneUnfinished) => events.truncate(events.len() - 1 - usize::from(marker)),
        _ => {}
    }
    events
}

/// The chunks of the mock's streamed answer, in OpenAI's format, ending with `[DONE]`.
#[must_use]
pub fn stream_chunks(model: &str) -> Vec<String> {
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        serde_json::Value::Null,
    )];
    for word in ["mock ", "streamed ", "answer"] {
        out.push(chunk(json!({"content": word}), serde_json::Value::Null));
    }
    out.push(chunk(json!({}), json!("stop")));
    out.push("data: [DONE]\n\n".to_owned());
    out
}

/// Whether a chat request asks for the usage chunk (`stream_options.include_usage`).
pub(crate) fn wants_usage(body: &serde_json::Value) -> bool {
    body.pointer("/stream_options/include_usage")
        .and_then(serde_json::Value::as_bool)
        == Some(true)
}

/// The chunk OpenAI sends before `[DONE]` when asked (`stream_options.include_usage`): no
/// choices, the usage of the mock's answer (3 prompt and 2 completion tokens, as unstreamed).
pub(crate) fn usage_chunk(model: &str) -> String {
    let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
    format!("data: {c}\n\n")
}

/// The event `malformed_chunk` sends in place of the third: `data:` that is not JSON.
pub const MALFORMED_CHUNK: &str = "data: {\"id\": \"chatcmpl-mock\", \"choices\": [\n\n";

/// The chunks a route's stream sends, with its fault applied: [`stream_chunks`] but for the
/// faults that change what is sent.
#[must_use]
pub fn faulty_stream_chunks(model: &str, fault: Option<Fault>) -> Vec<String> {
    let mut chunks = stream_chunks(model);
    match fault {
        Some(Fault::MalformedChunk) => MALFORMED_CHUNK.clone_into(&mut chunks[2]),
        Some(Fault::NoDoneFinished) => chunks.truncate(chunks.len() - 1),
        Some(Fault::NoDoneUnfinished) => chunks.truncate(chunks.len() - 2),
        _ => {}
    }
    chunks
}

pub(crate) fn stream_answer(
    route: &RouteProfile,
    chunks: Vec<Bytes>,
    fault: Option<Fault>,
    content_type: &'static str,
) -> Response {
    let gap = std::time::Duration::from_secs_f64(route.chunk_gap_ms / 1000.0);
    let first_delay = first_token_delay(route, fault);
    let hang_ms = route.hang_ms;
    let (cut, stall) = match fault {
        Some(Fault::StreamCut) => (Some(route.stream_cut_after.unwrap_or(2)), None),
        Some(Fault::StreamStall) => (None, Some(route.stream_stall_after.unwrap_or(2))),
        _ => (route.stream_cut_after, route.stream_stall_after),
    };
    let stream = futures_util::stream::unfold((0usize, chunks), move |(i, chunks)| async move {
        if cut == Some(i) {
            // An error item makes the server drop the connection mid-body; waiting the gap
            // first lets the chunks before it go out (else the last may die in the buffer).
            tokio::time::sleep(gap).await;
            return Some((Err(std::io::Error::other("cut")), (usize::MAX, chunks)));
        }
        if stall == Some(i) {
            match hang_ms {
                // Then the connection breaks, as a cut stream.
                Some(ms) => {
                    tokio::time::sleep(std::time::Duration::from_secs_f64(ms / 1000.0)).await;
                    return Some((Err(std::io::Error::other("stalled")), (usize::MAX, chunks)));
                }
                None => std::future::pending::<()>().await,
            }
        }
        let next = chunks.get(i)?.clone();
        tokio::time::sleep(if i > 0 { gap } else { first_delay }).await;
        Some((Ok::<_, std::io::Error>(next), (i + 1, chunks)))
    });
    let mut r = axum::body::Body::from_stream(stream).into_response();
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static(content_type),
    );
    r
}

/// Counts a streamed answer as open until it is dropped (sent whole, or its connection gone).
pub(crate) struct OpenStream(Arc<AtomicU64>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A streamed answer that never ends: 16 KiB content chunks every `chunk_gap_ms`.
pub(crate) fn endless_stream(route: &RouteProfile, model: &str, open: &Arc<AtomicU64>) -> Response {
    open.fetch_add(1, Ordering::Relaxed);
    let guard = OpenStream(open.clone());
    let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [{"index": 0, "delta": {"content": "x".repeat(16 * 1024)}, "finish_reason": null}]});
    let chunk = Bytes::from(format!("data: {c}\n\n"));
    let gap = std::time::Duration::from_secs_f64(route.chunk_gap_ms / 1000.0);
    let stream = futures_util::stream::unfold(guard, move |guard| {
        let chunk = chunk.clone();
        async move {
            tokio::time::sleep(gap).await;
            Some((Ok::<_, std::io::Error>(chunk), guard))
        }
    });
    let mut r = axum::body::Body::from_stream(stream).into_response();
    r.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    r
}
