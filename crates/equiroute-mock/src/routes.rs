//! The mock's routes, one handler per dialect (OpenAI, Azure, Anthropic, Gemini, Bedrock, the
//! search API and `/_stats`), and the chat path they share: what each host refuses, the
//! call's count, its behaviour, then its answer.

use crate::answers::{
    anthropic_answer, anthropic_stream_events, bedrock_answer, bedrock_stream_frames,
    call_in_stream, continue_prefill, endless_stream, faulty_stream_chunks, gemini_answer,
    gemini_stream_events, gemini_tools, prefilled_rest, stream_answer, usage_chunk, wants_usage,
    with_fault, OPENAI_CALL_ID,
};
use crate::errors::{bedrock_error, mock_error, Speaks};
use crate::faults::{behave, first_token_delay};
use crate::profile::{Fault, RouteProfile};
use crate::{Connection, MockState};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Counts a call that carried a key: a bearer token, or the native hosts' key headers.
pub(crate) fn count_auth(state: &MockState, headers: &HeaderMap) {
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("Bearer "));
    let native = ["x-api-key", "api-key", "x-goog-api-key"]
        .iter()
        .any(|h| headers.get(*h).is_some_and(|v| !v.is_empty()));
    if bearer || native || sigv4_problem(headers).is_none() {
        state.counters.authorized.fetch_add(1, Ordering::Relaxed);
    }
}

/// What is wrong with a request's AWS Signature Version 4 for Bedrock, if anything: the
/// `Authorization` header's form (`AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/bedrock/
/// aws4_request, SignedHeaders=..., Signature=...`), `x-amz-date` present and signed, and a
/// session token, when sent, signed too.
pub(crate) fn sigv4_problem(headers: &HeaderMap) -> Option<&'static str> {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let Some(auth) = header("authorization") else {
        return Some("Missing Authentication Token");
    };
    let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256 Credential=") else {
        return Some("Authorization header requires the AWS4-HMAC-SHA256 algorithm");
    };
    let mut parts = rest.split(", ");
    let scope = parts.next().unwrap_or_default();
    let signed = parts
        .next()
        .and_then(|p| p.strip_prefix("SignedHeaders="))
        .unwrap_or_default();
    let signature = parts
        .next()
        .and_then(|p| p.strip_prefix("Signature="))
        .unwrap_or_default();
    let scope_parts: Vec<&str> = scope.split('/').collect();
    if scope_parts.len() != 5 || scope_parts[3] != "bedrock" || scope_parts[4] != "aws4_request" {
        return Some("Credential should be scoped to correct service: 'bedrock'.");
    }
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Some("Authorization header requires a 64-digit hex Signature");
    }
    let signed: Vec<&str> = signed.split(';').collect();
    if header("x-amz-date").is_none()
        || !signed.contains(&"x-amz-date")
        || !signed.contains(&"host")
    {
        return Some("Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header, signed with the host");
    }
    if header("x-amz-security-token").is_some() && !signed.contains(&"x-amz-security-token") {
        return Some("The security token included in the request is not signed");
    }
    None
}

/// The request body as JSON, whatever its `Content-Type` (the gateway is as lenient).
pub(crate) fn json_body(speaks: Speaks, body: &Bytes) -> Result<serde_json::Value, Box<Response>> {
    serde_json::from_slice(body).map_err(|e| {
        Box::new(mock_error(
            speaks,
            StatusCode::BAD_REQUEST,
            &format!("the body is not JSON: {e}"),
        ))
    })
}

pub(crate) async fn chat(
    State(state): State<Arc<MockState>>,
    uri: axum::http::Uri,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.recent.keep(Speaks::OpenAi, &uri.to_string(), &body);
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::OpenAi,
        None,
    )
    .await
}

pub(crate) async fn azure_chat(
    State(state): State<Arc<MockState>>,
    axum::extract::Path(deployment): axum::extract::Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    uri: axum::http::Uri,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.recent.keep(Speaks::Azure, &uri.to_string(), &body);
    if !query
        .unwrap_or_default()
        .split('&')
        .any(|kv| kv.starts_with("api-version="))
    {
        return mock_error(
            Speaks::Azure,
            StatusCode::NOT_FOUND,
            "Resource not found (the api-version query parameter is missing)",
        );
    }
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::Azure,
        Some(&deployment),
    )
    .await
}

pub(crate) async fn anthropic_messages(
    State(state): State<Arc<MockState>>,
    uri: axum::http::Uri,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state
        .recent
        .keep(Speaks::Anthropic, &uri.to_string(), &body);
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &body,
        Speaks::Anthropic,
        None,
    )
    .await
}

/// `POST /v1beta/models/{model}:{method}`: the model and the method share a path segment.
pub(crate) async fn gemini_call(
    State(state): State<Arc<MockState>>,
    axum::extract::Path(call): axum::extract::Path<String>,
    uri: axum::http::Uri,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.recent.keep(Speaks::Gemini, &uri.to_string(), &body);
    match call.split_once(':') {
        Some((model, "generateContent" | "streamGenerateContent")) => {
            let stream = call.ends_with(":streamGenerateContent");
            let speaks = Speaks::Gemini;
            let mut body = match json_body(speaks, &body) {
                Ok(b) => b,
                Err(r) => return *r,
            };
            // As Gemini 3 does: a function call returned without its thought signature is
            // refused.
            if lost_thought_signature(&body) {
                return mock_error(
                    speaks,
                    StatusCode::BAD_REQUEST,
                    "Function call is missing a thought_signature in functionCall parts.",
                );
            }
            if mismatched_function_responses(&body) {
                return mock_error(
                    speaks,
                    StatusCode::BAD_REQUEST,
                    "Please ensure that the function response parts match the function call parts of the function call turn.",
                );
            }
            // Gemini's method says whether to stream; the shared path reads `stream`.
            if let Some(o) = body.as_object_mut() {
                if o.contains_key("stream") {
                    return mock_error(speaks, StatusCode::BAD_REQUEST, "Invalid JSON payload received. Unknown name \"stream\": Cannot find field.");
                }
                o.insert("stream".into(), json!(stream));
            }
            let bytes = Bytes::from(body.to_string());
            serve_chat(
                &state,
                conn.as_deref(),
                &headers,
                &bytes,
                speaks,
                Some(model),
            )
            .await
        }
        _ => mock_error(Speaks::Gemini, StatusCode::NOT_FOUND, "no such method"),
    }
}

/// Whether a model turn's first `functionCall` part (the one Gemini signs) came back without
/// its `thoughtSignature`.
pub(crate) fn lost_thought_signature(body: &serde_json::Value) -> bool {
    turns(body).any(|parts| {
        parts
            .iter()
            .find(|p| p.get("functionCall").is_some())
            .is_some_and(|p| p.get("thoughtSignature").is_none())
    })
}

/// Whether a turn of `functionResponse` parts names other functions than the calls of the
/// turn before it (Gemini matches each result to a call).
pub(crate) fn mismatched_function_responses(body: &serde_json::Value) -> bool {
    let names = |parts: &[serde_json::Value], kind: &str| -> Vec<String> {
        let mut n: Vec<String> = parts
            .iter()
            .filter_map(|p| p.get(kind).and_then(|c| c["name"].as_str()))
            .map(str::to_owned)
            .collect();
        n.sort_unstable();
        n
    };
    let all: Vec<&Vec<serde_json::Value>> = turns(body).collect();
    all.windows(2).any(|w| {
        let results = names(w[1], "functionResponse");
        !results.is_empty() && results != names(w[0], "functionCall")
    })
}

/// The parts of each turn of a Gemini request's `contents`.
pub(crate) fn turns(body: &serde_json::Value) -> impl Iterator<Item = &Vec<serde_json::Value>> {
    body["contents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|turn| turn["parts"].as_array())
}

/// `POST /model/{model}/converse` and `/converse-stream`: Bedrock's Converse, SigV4-signed.
pub(crate) async fn bedrock_call(
    State(state): State<Arc<MockState>>,
    axum::extract::Path((model, method)): axum::extract::Path<(String, String)>,
    uri: axum::http::Uri,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.recent.keep(Speaks::Bedrock, &uri.to_string(), &body);
    let speaks = Speaks::Bedrock;
    let stream = match method.as_str() {
        "converse" => false,
        "converse-stream" => true,
        _ => {
            return bedrock_error(
                StatusCode::NOT_FOUND,
                "UnknownOperationException",
                "no such operation",
            )
        }
    };
    if let Some(problem) = sigv4_problem(&headers) {
        state.counters.chat.fetch_add(1, Ordering::Relaxed);
        let name = if headers.contains_key("authorization") {
            "IncompleteSignatureException"
        } else {
            "MissingAuthenticationTokenException"
        };
        return bedrock_error(StatusCode::FORBIDDEN, name, problem);
    }
    if headers.contains_key("x-amz-security-token") {
        state
            .counters
            .session_tokens
            .fetch_add(1, Ordering::Relaxed);
    }
    let mut json = match json_body(speaks, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if let Some(o) = json.as_object_mut() {
        if let Some(k) = ["stream", "model"].iter().find(|k| o.contains_key(**k)) {
            state.counters.chat.fetch_add(1, Ordering::Relaxed);
            return bedrock_error(
                StatusCode::BAD_REQUEST,
                "ValidationException",
                &format!("Malformed input request: extraneous key [{k}] is not permitted"),
            );
        }
        // The URL says whether to stream; the shared path reads `stream`.
        o.insert("stream".into(), json!(stream));
    }
    let route = state.profile.chat_for(Some(&model));
    if route.fault == Some(Fault::AccessDenied) && route.healthy_calls == 0 {
        state.counters.chat.fetch_add(1, Ordering::Relaxed);
        // AWS's signature errors quote the canonical request, signed headers and all.
        let echoed: Vec<String> = headers
            .iter()
            .filter_map(|(k, v)| Some(format!("{k}:{}", v.to_str().ok()?)))
            .collect();
        return bedrock_error(
            StatusCode::FORBIDDEN,
            "InvalidSignatureException",
            &format!(
                "The request signature we calculated does not match the signature you provided. The Canonical String for this request should have been\n'POST\n/model/{model}/{method}\n\n{}'",
                echoed.join("\n")
            ),
        );
    }
    let bytes = Bytes::from(json.to_string());
    serve_chat(
        &state,
        conn.as_deref(),
        &headers,
        &bytes,
        speaks,
        Some(&model),
    )
    .await
}

/// What a native route refuses that its host would: a missing required field or header, or a
/// member of OpenAI's API that is not the host's.
pub(crate) fn native_request_problem(
    speaks: Speaks,
    headers: &HeaderMap,
    body: &serde_json::Value,
) -> Option<String> {
    let (allowed, required): (&[&str], &[&str]) = match speaks {
        Speaks::OpenAi | Speaks::Azure => return None,
        Speaks::Anthropic => {
            if headers.get("anthropic-version").is_none() {
                return Some("anthropic-version: header is required".into());
            }
            (
                &[
                    "model",
                    "messages",
                    "max_tokens",
                    "system",
                    "temperature",
                    "top_p",
                    "top_k",
                    "stop_sequences",
                    "stream",
                    "tools",
                    "tool_choice",
                    "metadata",
                    "thinking",
                    "service_tier",
                ],
                &["model", "messages", "max_tokens"],
            )
        }
        Speaks::Gemini => (
            // `stream` is the mock's own note of the method (see `gemini_call`).
            &[
                "contents",
                "systemInstruction",
                "tools",
                "toolConfig",
                "generationConfig",
                "safetySettings",
                "cachedContent",
                "stream",
            ],
            &["contents"],
        ),
        Speaks::Bedrock => (
            // `stream` is the mock's own note of the method (see `bedrock_call`).
            &[
                "messages",
                "system",
                "inferenceConfig",
                "toolConfig",
                "guardrailConfig",
                "additionalModelRequestFields",
                "additionalModelResponseFieldPaths",
                "promptVariables",
                "requestMetadata",
                "performanceConfig",
                "stream",
            ],
            &["messages"],
        ),
    };
    let obj = body.as_object()?;
    if let Some(extra) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Some(format!("{extra}: Extra inputs are not permitted"));
    }
    if let Some(missing) = required.iter().find(|k| !obj.contains_key(**k)) {
        return Some(format!("{missing}: Field required"));
    }
    if speaks == Speaks::Anthropic
        && obj["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "system"))
    {
        return Some(
            "messages: Unexpected role \"system\"; use the top-level `system` parameter".into(),
        );
    }
    None
}

/// The name of the first tool of a request, which the answer calls; none once the
/// conversation's last turn carries tool results (the answer to them is text, so a client's
/// tool loop ends).
pub(crate) fn first_tool(speaks: Speaks, body: &serde_json::Value) -> Option<String> {
    let (pointer, turns, result) = match speaks {
        Speaks::OpenAi | Speaks::Azure => ("/tools/0/function/name", "/messages", "tool"),
        Speaks::Anthropic => ("/tools/0/name", "/messages", "tool_result"),
        Speaks::Gemini => (
            "/tools/0/functionDeclarations/0/name",
            "/contents",
            "functionResponse",
        ),
        Speaks::Bedrock => (
            "/toolConfig/tools/0/toolSpec/name",
            "/messages",
            "toolResult",
        ),
    };
    let last = body
        .pointer(turns)
        .and_then(serde_json::Value::as_array)
        .and_then(|t| t.last());
    // A tool message (OpenAI's role), or a turn ending with a result block or part (the
    // native turns' content; a question after the results asks again).
    let answered = last.is_some_and(|turn| {
        turn["role"] == result
            || ["content", "parts"].iter().any(|k| {
                turn[k]
                    .as_array()
                    .and_then(|blocks| blocks.last())
                    .is_some_and(|b| b["type"] == result || b.get(result).is_some())
            })
    });
    if answered {
        return None;
    }
    body.pointer(pointer)
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// A chat call of any dialect: `model` is the URL's when the dialect puts it there.
pub(crate) async fn serve_chat(
    state: &MockState,
    conn: Option<&Connection>,
    headers: &HeaderMap,
    body: &Bytes,
    speaks: Speaks,
    url_model: Option<&str>,
) -> Response {
    state.counters.chat.fetch_add(1, Ordering::Relaxed);
    count_auth(state, headers);
    let body = match json_body(speaks, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if let Some(problem) = native_request_problem(speaks, headers, &body) {
        return mock_error(speaks, StatusCode::BAD_REQUEST, &problem);
    }
    if let Ok(mut last) = state.last_chat.lock() {
        *last = Some(body.clone());
    }
    let model = url_model
        .or_else(|| body.get("model").and_then(serde_json::Value::as_str))
        .unwrap_or("mock-model");
    let call = state.counters.count_model(model);
    let mut route = state.profile.chat_for(Some(model));
    let healthy;
    if call <= route.healthy_calls {
        healthy = RouteProfile {
            fault: None,
            fault_mix: BTreeMap::new(),
            ..route.clone()
        };
        route = &healthy;
    }
    let fault = match behave(state, route, call, conn, speaks).await {
        Ok(fault) => fault,
        Err(r) => return r,
    };
    // A limited route's window is the model's when it has a profile of its own.
    let limited = match &route.rate_limit {
        Some(limit) => {
            let key = if state.profile.models.contains_key(model) {
                model
            } else {
                "chat"
            };
            match state.windows.take(key, limit, speaks) {
                Ok(admitted) => Some(admitted),
                Err(r) => return *r,
            }
        }
        None => None,
    };
    let answer = chat_answer(state, route, fault, &body, speaks, model).await;
    match limited {
        Some(admitted) => admitted.stamp(answer),
        None => answer,
    }
}

/// A chat call's answer once admitted: streamed or whole, in the dialect `speaks`, with the
/// route's `fault` played.
async fn chat_answer(
    state: &MockState,
    route: &RouteProfile,
    fault: Option<Fault>,
    body: &serde_json::Value,
    speaks: Speaks,
    model: &str,
) -> Response {
    let tool = first_tool(speaks, body);
    if body.get("stream").and_then(serde_json::Value::as_bool) == Some(true) {
        if fault == Some(Fault::EndlessStream) {
            return endless_stream(route, model, &state.streams_open);
        }
        let text = |events: Vec<String>| events.into_iter().map(Bytes::from).collect();
        let (chunks, content_type) = match speaks {
            Speaks::OpenAi | Speaks::Azure => {
                let mut chunks = faulty_stream_chunks(model, fault);
                if let Some(t) = &tool {
                    call_in_stream(&mut chunks, model, t);
                }
                if wants_usage(body) && chunks.last().is_some_and(|c| c.contains("[DONE]")) {
                    chunks.insert(chunks.len() - 1, usage_chunk(model));
                }
                (text(chunks), "text/event-stream")
            }
            Speaks::Anthropic => {
                let mut events = anthropic_stream_events(model, tool.as_deref());
                if let Some(rest) = prefilled_rest(body) {
                    continue_prefill(&mut events, &rest);
                }
                (text(with_fault(events, fault, true)), "text/event-stream")
            }
            Speaks::Gemini => (
                text(with_fault(
                    gemini_stream_events(model, &gemini_tools(body, tool.clone())),
                    fault,
                    false,
                )),
                "text/event-stream",
            ),
            Speaks::Bedrock => (
                bedrock_stream_frames(tool.as_deref(), fault),
                "application/vnd.amazon.eventstream",
            ),
        };
        return stream_answer(route, chunks, fault, content_type);
    }
    tokio::time::sleep(first_token_delay(route, fault)).await;
    Json(match speaks {
        Speaks::OpenAi | Speaks::Azure => {
            let mut message = json!({"role": "assistant", "content": route.content});
            if let Some(t) = &tool {
                message["tool_calls"] = json!([{"id": OPENAI_CALL_ID, "type": "function",
                    "function": {"name": t, "arguments": "{\"q\":\"mock\"}"}}]);
            }
            json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message,
                    "finish_reason": if tool.is_some() { "tool_calls" } else { "stop" }}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            })
        }
        Speaks::Anthropic => anthropic_answer(model, &route.content, tool.as_deref()),
        Speaks::Gemini => gemini_answer(model, &route.content, &gemini_tools(body, tool.clone())),
        Speaks::Bedrock => bedrock_answer(&route.content, tool.as_deref()),
    })
    .into_response()
}

pub(crate) async fn search(
    State(state): State<Arc<MockState>>,
    conn: Option<axum::Extension<Connection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = state.counters.search.fetch_add(1, Ordering::Relaxed) + 1;
    count_auth(&state, &headers);
    let body = match json_body(Speaks::OpenAi, &body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let fault = match behave(
        &state,
        &state.profile.search,
        call,
        conn.as_deref(),
        Speaks::OpenAi,
    )
    .await
    {
        Ok(fault) => fault,
        Err(r) => return r,
    };
    tokio::time::sleep(first_token_delay(&state.profile.search, fault)).await;
    Json(json!({"query": body.get("query"), "results": [{"title": "mock result", "url": "https://example.invalid/mock"}]})).into_response()
}

pub(crate) async fn stats(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    let models = state
        .counters
        .models
        .lock()
        .map_or_else(|_| json!({}), |m| json!(*m));
    let last_chat = state
        .last_chat
        .lock()
        .map_or(serde_json::Value::Null, |b| b.clone().unwrap_or_default());
    Json(json!({
        "chat": state.counters.chat.load(Ordering::Relaxed),
        "search": state.counters.search.load(Ordering::Relaxed),
        "authorized": state.counters.authorized.load(Ordering::Relaxed),
        "session_tokens": state.counters.session_tokens.load(Ordering::Relaxed),
        "streams_open": state.streams_open.load(Ordering::Relaxed),
        "models": models,
        "last_chat": last_chat,
    }))
}

/// `GET /_requests`: the last chat requests as they came (see [`crate::recent`]).
pub(crate) async fn requests(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    Json(json!({"requests": state.recent.list()}))
}
