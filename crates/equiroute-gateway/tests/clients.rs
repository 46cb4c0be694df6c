//! The client APIs besides chat completions, end to end: OpenAI's Responses API
//! (`POST /v1/responses`) and Anthropic's Messages API (`POST /v1/messages`) against a
//! gateway whose provider speaks OpenAI's chat completions or Anthropic's Messages API (mock
//! upstreams), unstreamed and streamed, with a tool round trip, structured output, errors in
//! each API's shape, fallback and feedback by the request id.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{fallback_config, http, mock, start};
use serde_json::{json, Value};
use std::net::SocketAddr;

fn openai(at: SocketAddr) -> String {
    format!("kind = \"openai\"\nmodel = \"gpt-x\"\nbase_url = \"http://{at}/v1\"\n")
}

fn anthropic(at: SocketAddr) -> String {
    format!("kind = \"anthropic\"\nmodel = \"claude-x\"\nbase_url = \"http://{at}/v1\"\nmax_tokens = 1000\napi_key_env = \"NATIVE_KEY\"\n")
}

/// A provider of each dialect: (its table, the model that answers, its tool call id, the
/// prompt tokens its mock reports, the cached ones among them).
fn dialects(at: SocketAddr) -> [(String, &'static str, &'static str, u64, u64); 2] {
    [
        (openai(at), "gpt-x", "call_mock", 3, 0),
        (anthropic(at), "claude-x", "toolu_mock", 4, 1),
    ]
}

/// The prompt tokens both mocks report in a stream (OpenAI's usage chunk; Anthropic's
/// `message_start`, without cache reads).
const STREAMED_PROMPT: u64 = 3;

async fn gateway(first: &str, backup: SocketAddr) -> common::Gateway {
    start(&fallback_config("", first, backup), &[("NATIVE_KEY", "k")]).await
}

const LOOKUP: &str = "lookup";

fn responses_request(stream: bool) -> Value {
    json!({"model": "chat", "stream": stream, "instructions": "Be brief.", "input": "hi",
        "store": true,
        "tools": [{"type": "function", "name": LOOKUP, "description": "Looks up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]})
}

fn messages_request(stream: bool) -> Value {
    json!({"model": "chat", "max_tokens": 100, "stream": stream, "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": LOOKUP, "description": "Looks up",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]})
}

async fn post(gw: SocketAddr, path: &str, body: &Value) -> common::Reply {
    http(gw, "POST", path, &[], &body.to_string()).await
}

async fn last_chat(mock: SocketAddr) -> Value {
    http(mock, "GET", "/_stats", &[], "").await.json()["last_chat"].clone()
}

/// The `event:` name and `data:` JSON of each server-sent event, checked to agree on `type`.
fn sse(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_else(|| panic!("an event without a name: {e}"));
            let data: Value =
                serde_json::from_str(e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap())
                    .unwrap();
            assert_eq!(data["type"], name, "{e}");
            (name.to_owned(), data)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

#[tokio::test]
async fn responses_answers_with_a_message_a_function_call_and_usage_for_each_dialect() {
    let upstream = mock("").await;
    let backup = mock("").await;
    for (first, model, call_id, prompt, cached) in dialects(upstream.addr) {
        let gw = gateway(&first, backup.addr).await;
        let r = post(gw.addr, "/v1/responses", &responses_request(false)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let request_id = r.header("x-equiroute-request-id").unwrap().to_owned();
        assert_eq!(r.header("x-equiroute-provider"), Some("first"));
        let a = r.json();
        assert_eq!(a["object"], "response");
        assert_eq!(
            a["id"],
            format!("resp_{}", request_id.trim_start_matches("req-"))
        );
        assert_eq!(a["status"], "completed");
        assert_eq!(a["model"], model);
        assert_eq!(a["store"], false, "nothing is stored, whatever was asked");
        assert_eq!(
            a["tools"][0]["name"], LOOKUP,
            "the request's tools are echoed"
        );
        let output = a["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "{a}");
        assert_eq!(output[0]["type"], "message");
        assert_eq!(output[0]["role"], "assistant");
        assert_eq!(output[0]["content"][0]["type"], "output_text");
        assert_eq!(output[0]["content"][0]["text"], "mock answer");
        assert_eq!(output[1]["type"], "function_call");
        assert_eq!(output[1]["call_id"], call_id);
        assert_eq!(output[1]["name"], LOOKUP);
        let args: Value = serde_json::from_str(output[1]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"q": "mock"}));
        assert_eq!(a["usage"]["input_tokens"], prompt, "{model}");
        assert_eq!(a["usage"]["input_tokens_details"]["cached_tokens"], cached);
        assert_eq!(a["usage"]["output_tokens"], 2);
        assert_eq!(a["usage"]["total_tokens"], prompt + 2);
        // The instructions and the tools reached the provider, in its own dialect.
        let sent = last_chat(upstream.addr).await;
        let sent_text = sent.to_string();
        assert!(sent_text.contains("Be brief."), "{sent}");
        assert!(sent_text.contains(LOOKUP), "{sent}");
        assert!(
            sent.get("store").is_none(),
            "store is not passed on: {sent}"
        );
    }
    assert_eq!(
        http(backup.addr, "GET", "/_stats", &[], "").await.json()["chat"],
        0
    );
}

#[tokio::test]
async fn a_responses_tool_round_trip_sends_the_call_and_its_output_to_each_dialect() {
    let upstream = mock("").await;
    let backup = mock("").await;
    for (first, model, call_id, _, _) in dialects(upstream.addr) {
        let gw = gateway(&first, backup.addr).await;
        let mut req = responses_request(false);
        req["input"] = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": call_id, "name": LOOKUP, "arguments": "{\"q\":\"mock\"}"},
            {"type": "function_call_output", "call_id": call_id, "output": "a cat"}
        ]);
        let r = post(gw.addr, "/v1/responses", &req).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let a = r.json();
        assert_eq!(a["output"].as_array().unwrap().len(), 1, "{a}");
        assert_eq!(a["output"][0]["content"][0]["text"], "mock answer");
        let sent = last_chat(upstream.addr).await;
        let turns = sent["messages"].as_array().unwrap();
        if model == "gpt-x" {
            assert_eq!(
                turns[1],
                json!({"role": "user", "content": [{"type": "text", "text": "hi"}]})
            );
            assert_eq!(turns[2]["content"], "Let me look.");
            assert_eq!(turns[2]["tool_calls"][0]["id"], call_id);
            assert_eq!(
                turns[3],
                json!({"role": "tool", "tool_call_id": call_id, "content": "a cat"})
            );
        } else {
            assert_eq!(
                turns[1]["content"][1],
                json!({"type": "tool_use", "id": call_id, "name": LOOKUP, "input": {"q": "mock"}})
            );
            assert_eq!(
                turns[2]["content"][0],
                json!({"type": "tool_result", "tool_use_id": call_id, "content": "a cat"})
            );
        }
    }
}

#[tokio::test]
async fn responses_streams_its_own_events_in_order_for_each_dialect() {
    let upstream = mock("").await;
    let backup = mock("").await;
    for (first, model, call_id, _, _) in dialects(upstream.addr) {
        let gw = gateway(&first, backup.addr).await;
        let r = post(gw.addr, "/v1/responses", &responses_request(true)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        assert!(r.header("x-equiroute-request-id").is_some());
        let events = sse(&r.body);
        let mut want = vec![
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ];
        want.extend(["response.output_text.delta"; 3]);
        want.extend([
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]);
        assert_eq!(names(&events), want, "{model}: {}", r.body);
        for (n, (_, e)) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], n, "numbered in order");
        }
        let text: String = events
            .iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .map(|(_, e)| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(text, "mock streamed answer");
        assert_eq!(events[10].1["item"]["call_id"], call_id);
        assert_eq!(events[10].1["output_index"], 1);
        assert_eq!(events[13].1["arguments"], "{\"q\": \"mock\"}");
        let done = &events.last().unwrap().1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["id"], events[0].1["response"]["id"]);
        assert_eq!(
            done["output"][0]["content"][0]["text"],
            "mock streamed answer"
        );
        assert_eq!(done["output"][1]["name"], LOOKUP);
        assert_eq!(
            done["usage"]["input_tokens"], STREAMED_PROMPT,
            "{model}: {done}"
        );
        assert!(done["usage"]["output_tokens"].as_u64().unwrap() > 0);
    }
}

#[tokio::test]
async fn messages_answers_with_text_tool_use_and_usage_for_each_dialect() {
    let upstream = mock("").await;
    let backup = mock("").await;
    for (first, model, call_id, prompt, cached) in dialects(upstream.addr) {
        let gw = gateway(&first, backup.addr).await;
        let r = post(gw.addr, "/v1/messages", &messages_request(false)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let request_id = r.header("x-equiroute-request-id").unwrap();
        let a = r.json();
        assert_eq!(
            a["id"],
            format!("msg_{}", request_id.trim_start_matches("req-"))
        );
        assert_eq!(a["type"], "message");
        assert_eq!(a["role"], "assistant");
        assert_eq!(a["model"], model);
        assert_eq!(a["stop_reason"], "tool_use");
        assert_eq!(
            a["content"],
            json!([{"type": "text", "text": "mock answer"},
                {"type": "tool_use", "id": call_id, "name": LOOKUP, "input": {"q": "mock"}}])
        );
        assert_eq!(
            a["usage"],
            json!({"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": 2})
        );
        // The tool result goes back; the answer to it is text.
        let mut req = messages_request(false);
        req["messages"] = json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": call_id, "name": LOOKUP, "input": {"q": "mock"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": [{"type": "text", "text": "a cat"}]}]}
        ]);
        let r = post(gw.addr, "/v1/messages", &req).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let a = r.json();
        assert_eq!(a["stop_reason"], "end_turn");
        assert_eq!(
            a["content"],
            json!([{"type": "text", "text": "mock answer"}])
        );
        let sent = last_chat(upstream.addr).await;
        let turns = sent["messages"].as_array().unwrap();
        if model == "gpt-x" {
            assert_eq!(turns[0], json!({"role": "system", "content": "Be brief."}));
            assert_eq!(
                turns[2]["tool_calls"][0],
                json!({"id": call_id, "type": "function",
                    "function": {"name": LOOKUP, "arguments": "{\"q\":\"mock\"}"}})
            );
            assert_eq!(
                turns[3],
                json!({"role": "tool", "tool_call_id": call_id, "content": "a cat"})
            );
            assert_eq!(turns.len(), 4);
        } else {
            assert_eq!(sent["system"], "Be brief.");
            assert_eq!(
                turns[1]["content"],
                json!([{"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": call_id, "name": LOOKUP, "input": {"q": "mock"}}]),
                "the thinking block is left out"
            );
            assert_eq!(
                turns[2]["content"],
                json!([{"type": "tool_result", "tool_use_id": call_id, "content": "a cat"}])
            );
        }
    }
}

#[tokio::test]
async fn messages_streams_its_own_events_in_order_for_each_dialect() {
    let upstream = mock("").await;
    let backup = mock("").await;
    for (first, model, call_id, _, _) in dialects(upstream.addr) {
        let gw = gateway(&first, backup.addr).await;
        let r = post(gw.addr, "/v1/messages", &messages_request(true)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        let events = sse(&r.body);
        let mut want = vec!["message_start", "content_block_start"];
        want.extend(["content_block_delta"; 3]);
        want.extend([
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]);
        assert_eq!(names(&events), want, "{model}: {}", r.body);
        assert_eq!(events[0].1["message"]["model"], model);
        let text: String = events[2..5]
            .iter()
            .map(|(_, e)| e["delta"]["text"].as_str().unwrap())
            .collect();
        assert_eq!(text, "mock streamed answer");
        assert_eq!(
            events[6].1["content_block"],
            json!({"type": "tool_use", "id": call_id, "name": LOOKUP, "input": {}})
        );
        assert_eq!(events[6].1["index"], 1);
        let args: String = events[7..9]
            .iter()
            .map(|(_, e)| e["delta"]["partial_json"].as_str().unwrap())
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&args).unwrap(),
            json!({"q": "mock"})
        );
        let delta = &events[10].1;
        assert_eq!(delta["delta"]["stop_reason"], "tool_use");
        assert_eq!(delta["usage"]["input_tokens"], STREAMED_PROMPT, "{delta}");
        assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    }
}

#[tokio::test]
async fn structured_output_is_asked_of_the_provider_as_a_json_schema() {
    let upstream = mock("").await;
    let backup = mock("").await;
    let gw = gateway(&openai(upstream.addr), backup.addr).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let mut req = responses_request(false);
    req["text"] = json!({"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": true}});
    assert_eq!(post(gw.addr, "/v1/responses", &req).await.status, 200);
    assert_eq!(
        last_chat(upstream.addr).await["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": true}})
    );
    let mut req = messages_request(false);
    req["output_config"] = json!({"format": {"type": "json_schema", "schema": schema}});
    assert_eq!(post(gw.addr, "/v1/messages", &req).await.status, 200);
    assert_eq!(
        last_chat(upstream.addr).await["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}})
    );
}

#[tokio::test]
async fn what_the_apis_cannot_do_is_refused_in_each_apis_error_shape() {
    let upstream = mock("").await;
    let gw = gateway(&openai(upstream.addr), upstream.addr).await;
    // Responses: OpenAI's error shape, the field in `param`.
    for (patch, param, says) in [
        (
            json!({"previous_response_id": "resp_1"}),
            "previous_response_id",
            "stateless",
        ),
        (
            json!({"max_output_tokens": 0}),
            "max_output_tokens",
            "4294967295",
        ),
        (json!({"background": true}), "background", "not supported"),
        (
            json!({"tools": [{"type": "web_search"}]}),
            "tools[0].type",
            "function tools",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input[0].type",
            "stateless",
        ),
    ] {
        let mut req = responses_request(false);
        for (k, v) in patch.as_object().unwrap() {
            req[k] = v.clone();
        }
        let r = post(gw.addr, "/v1/responses", &req).await;
        assert_eq!(r.status, 400, "{param}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{}", r.body);
        assert!(
            e["error"]["message"].as_str().unwrap().contains(says),
            "{}",
            r.body
        );
    }
    // Messages: Anthropic's error shape.
    for (patch, says) in [
        (json!({"top_k": 5}), "`top_k`"),
        (json!({"max_tokens": -1}), "`max_tokens`"),
        (
            json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "server tool",
        ),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 2000}}),
            "`thinking`",
        ),
        (json!({"model": "no-such"}), "not a chat interface"),
    ] {
        let mut req = messages_request(false);
        for (k, v) in patch.as_object().unwrap() {
            req[k] = v.clone();
        }
        let r = post(gw.addr, "/v1/messages", &req).await;
        let e = r.json();
        assert_eq!(e["type"], "error", "{}", r.body);
        let kind = if says.contains("interface") {
            assert_eq!(r.status, 404);
            "not_found_error"
        } else {
            assert_eq!(r.status, 400);
            "invalid_request_error"
        };
        assert_eq!(e["error"]["type"], kind, "{}", r.body);
        assert!(
            e["error"]["message"].as_str().unwrap().contains(says),
            "{says}: {}",
            r.body
        );
    }
    let r = http(gw.addr, "POST", "/v1/messages", &[], "{not json").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn messages_takes_x_api_key_and_answers_a_wrong_key_in_anthropics_shape() {
    let upstream = mock("").await;
    let server = "[server]\napi_keys_env = [\"GW_KEY\"]\n";
    let gw = start(
        &fallback_config(server, &openai(upstream.addr), upstream.addr),
        &[("GW_KEY", "sk-gw")],
    )
    .await;
    let body = messages_request(false).to_string();
    let ok = http(
        gw.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sk-gw")],
        &body,
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let wrong = http(
        gw.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "sk-no")],
        &body,
    )
    .await;
    assert_eq!(wrong.status, 401);
    let e = wrong.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "authentication_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-api-key"));
    // The other routes still take the bearer key only.
    let chat = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-api-key", "sk-gw")],
        &chat.to_string(),
    )
    .await;
    assert_eq!(r.status, 401);
    let r = http(
        gw.addr,
        "POST",
        "/v1/responses",
        &[("authorization", "Bearer sk-gw")],
        &responses_request(false).to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn both_apis_fall_back_to_another_dialect_are_audited_and_take_feedback_by_request_id() {
    let down = mock("[chat]\nfault = \"unavailable\"\n").await;
    let backup = mock("").await;
    let dir = std::env::temp_dir().join(format!("equiroute-clients-audit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let audit = dir.join("audit.jsonl");
    let server = format!("[audit]\npath = {audit:?}\n");
    let gw = start(
        &fallback_config(&server, &anthropic(down.addr), backup.addr),
        &[("NATIVE_KEY", "k")],
    )
    .await;
    for (path, body) in [
        ("/v1/messages", messages_request(false)),
        ("/v1/responses", responses_request(true)),
    ] {
        let r = post(gw.addr, path, &body).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("backup"), "{path}");
        let attempts: usize = r.header("x-equiroute-attempts").unwrap().parse().unwrap();
        assert!(attempts >= 2, "{path}: the failed provider was tried first");
        let id = r.header("x-equiroute-request-id").unwrap();
        let record = common::audit_record(&audit, id).await;
        assert_eq!(record["outcome"], "ok", "{path}: {record}");
        assert_eq!(
            record["attempts"].as_array().unwrap().len(),
            attempts,
            "{path}: {record}"
        );
        let fb = post(
            gw.addr,
            "/v1/feedback",
            &json!({"request_id": id, "quality": 0.9}),
        )
        .await;
        assert_eq!(fb.status, 200, "{path}: {}", fb.body);
        assert_eq!(fb.json()["status"], "accepted");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn failures_end_in_each_apis_error_shape_and_a_broken_stream_in_its_failure_event() {
    let down = mock("[chat]\nfault = \"unavailable\"\n").await;
    let gw = gateway(&openai(down.addr), down.addr).await;
    let r = post(gw.addr, "/v1/messages", &messages_request(false)).await;
    assert!(r.status >= 500, "{}", r.body);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "api_error", "{}", r.body);
    assert!(r.header("x-equiroute-request-id").is_some());
    let r = post(gw.addr, "/v1/responses", &responses_request(false)).await;
    assert!(r.status >= 500, "{}", r.body);
    assert!(r.json()["error"]["message"].is_string(), "{}", r.body);

    let cut = mock("[chat]\nfault = \"stream_cut\"\nstream_cut_after = 3\n").await;
    let gw = gateway(&openai(cut.addr), cut.addr).await;
    let r = post(gw.addr, "/v1/responses", &responses_request(true)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse(&r.body);
    let (last, e) = events.last().unwrap();
    assert_eq!(last, "response.failed", "{}", r.body);
    assert_eq!(e["response"]["status"], "failed");
    assert!(e["response"]["error"]["message"].is_string());
    assert!(
        !names(&events).contains(&"response.completed"),
        "{}",
        r.body
    );
    let r = post(gw.addr, "/v1/messages", &messages_request(true)).await;
    let events = sse(&r.body);
    let (last, e) = events.last().unwrap();
    assert_eq!(last, "error", "{}", r.body);
    assert_eq!(e["error"]["type"], "api_error");
    assert!(!names(&events).contains(&"message_stop"), "{}", r.body);
}
