//! The gateway on a loopback port, driven over real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, start};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const TWO: &str = r#"
[interfaces.chat]
kind = "chat"
policy = { name = "static", candidate = "broken" }
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "broken"
kind = "sim"
model = "broken-model"
sim = { latency = { p50_ms = 5, p95_ms = 10 }, failure_rate = 1.0 }

[[interfaces.chat.providers]]
id = "good"
kind = "sim"
model = "good-model"
sim = { latency = { p50_ms = 5, p95_ms = 10 } }

[[interfaces.chat.providers]]
id = "slow"
kind = "sim"
model = "slow-model"
sim = { latency = { p50_ms = 5000, p95_ms = 6000 } }

[interfaces.search]
kind = "tool"
policy = { name = "lqm" }

[[interfaces.search.providers]]
id = "s1"
kind = "sim"
sim = { latency = { p50_ms = 5, p95_ms = 10 } }
"#;

/// `POST /v1/chat/completions` with `body`, no extra headers.
async fn post_chat(addr: std::net::SocketAddr, body: &Value) -> common::Reply {
    http(addr, "POST", "/v1/chat/completions", &[], &body.to_string()).await
}

fn chat(model: &str) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "what is the capital of france"}]}).to_string()
}

#[tokio::test]
async fn falls_back_past_a_failing_provider_and_reports_it() {
    let gw = start(TWO, &[]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat("chat")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-provider"), Some("good"));
    // broken, its one retry after a 5xx, then good.
    assert_eq!(r.header("x-equiroute-attempts"), Some("3"));
    assert!(r
        .header("x-equiroute-request-id")
        .unwrap()
        .starts_with("req-"));
    let v = r.json();
    assert_eq!(
        v["model"], "good-model",
        "the response names the model that answered"
    );
    assert_eq!(v["object"], "chat.completion");
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(m.contains(r#"equiroute_attempts_total{interface="chat",provider="broken",status="provider_error"} 2"#), "{m}");
    assert!(
        m.contains(r#"equiroute_fallbacks_total{interface="chat"} 1"#),
        "{m}"
    );
    assert!(m.contains("equiroute_decision_microseconds_count 1"), "{m}");
    assert!(m.contains("equiroute_router_microseconds_count 1"), "{m}");
}

#[tokio::test]
async fn a_pinned_provider_and_the_deadline_are_honoured() {
    let gw = start(TWO, &[]).await;
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat("chat/good"),
    )
    .await;
    assert_eq!(
        (r.status, r.header("x-equiroute-provider")),
        (200, Some("good"))
    );
    // The slow provider takes ~5 s; a 300 ms deadline must end the call at about 300 ms.
    let t = Instant::now();
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-equiroute-deadline-ms", "300")],
        &chat("chat/slow"),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "deadline_exceeded");
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_millis(900),
        "{took:?}"
    );
    // A failed request says which providers were tried and how each ended, and carries its
    // id (the audit log's) and attempt count like an answer.
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("(1 attempt: slow "), "{message}");
    assert!(r
        .header("x-equiroute-request-id")
        .is_some_and(|id| id.starts_with("req-")));
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat("chat/broken"),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("(2 attempts: broken provider_error, broken provider_error (retry))"),
        "{message}"
    );
    assert_eq!(r.header("x-equiroute-attempts"), Some("2"));
    // The same before a stream commits.
    let streamed = json!({"model": "chat/broken", "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post_chat(gw.addr, &streamed).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.body
            .contains("2 attempts: broken provider_error, broken provider_error (retry)"),
        "{}",
        r.body
    );
    assert_eq!(r.header("x-equiroute-attempts"), Some("2"));
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-equiroute-deadline-ms", "-3")],
        &chat("chat"),
    )
    .await;
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn bad_requests_get_openai_style_errors() {
    let gw = start(TWO, &[]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat("nope")).await;
    assert_eq!(r.status, 404);
    let e = r.json();
    assert_eq!(e["error"]["code"], "model_not_found");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("use one of chat"));
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat("chat/ghost"),
    )
    .await;
    assert!(r.status == 404 && r.body.contains("good"), "{}", r.body);
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], "{not json").await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (400, json!("invalid_json"))
    );
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        r#"{"model":"chat","messages":[]}"#,
    )
    .await;
    assert_eq!(r.json()["error"]["param"], "messages");
    let big = format!(
        r#"{{"model":"chat","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2 << 20)
    );
    for path in ["/v1/chat/completions", "/v1/tools/search", "/v1/feedback"] {
        let r = http(gw.addr, "POST", path, &[], &big).await;
        assert_eq!(r.status, 413, "{path}");
        assert_eq!(
            r.json()["error"]["code"],
            "request_too_large",
            "{path}: {}",
            r.body
        );
        assert!(r.body.contains("server.max_body_bytes"), "{}", r.body);
    }
}

/// The fields the gateway acts on are checked before routing: a wrong type is a 400 naming
/// the field, not read as absent (a `"stream": "yes"` answered unstreamed, a negative
/// `max_tokens` sized as the default); `null` stays "unset", as OpenAI reads it.
#[tokio::test]
async fn chat_fields_the_gateway_reads_are_checked_before_routing() {
    let gw = start(TWO, &[]).await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!([1, 2]), "invalid_body", Value::Null, "got an array"),
        (
            json!({"model": 5, "messages": user}),
            "missing_model",
            json!("model"),
            "got a number",
        ),
        (
            json!({"model": "chat", "messages": [7]}),
            "invalid_type",
            json!("messages[0]"),
            "got a number",
        ),
        (
            json!({"model": "chat", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]}),
            "invalid_type",
            json!("messages[1].role"),
            "got nothing",
        ),
        (
            json!({"model": "chat", "messages": user, "stream": "yes"}),
            "invalid_type",
            json!("stream"),
            "got a string",
        ),
        (
            json!({"model": "chat", "messages": user, "max_tokens": -5}),
            "invalid_value",
            json!("max_tokens"),
            "got -5",
        ),
        (
            json!({"model": "chat", "messages": user, "max_tokens": 1.5}),
            "invalid_value",
            json!("max_tokens"),
            "got 1.5",
        ),
        (
            json!({"model": "chat", "messages": user, "max_completion_tokens": 0}),
            "invalid_value",
            json!("max_completion_tokens"),
            "from 1 to",
        ),
        (
            json!({"model": "chat", "messages": user, "tools": {}}),
            "invalid_type",
            json!("tools"),
            "got an object",
        ),
        (
            json!({"model": "chat", "messages": user, "response_format": "json"}),
            "invalid_type",
            json!("response_format"),
            "got a string",
        ),
    ];
    for (body, code, param, says) in cases {
        let r = post_chat(gw.addr, &body).await;
        let e = r.json();
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(e["error"]["code"], code, "{body}: {}", r.body);
        assert_eq!(e["error"]["param"], param, "{body}: {}", r.body);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    // The attempt counters exist from start-up, at 0: none may have moved.
    let attempted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("equiroute_attempts_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(
        attempted.is_empty(),
        "a rejected body reached a provider:\n{metrics}"
    );
    // Explicit nulls are "unset"; well-typed fields pass.
    let ok = json!({"model": "chat/good", "messages": user, "stream": null, "max_tokens": null,
        "tools": null, "response_format": {"type": "text"}, "max_completion_tokens": 64});
    let r = post_chat(gw.addr, &ok).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A feedback body of the wrong shape is refused with the field at fault.
#[tokio::test]
async fn feedback_errors_name_the_field() {
    let gw = start(TWO, &[]).await;
    for (body, param, says) in [
        (
            r#"{"request_id": 5, "quality": 0.5}"#,
            json!("request_id"),
            "expected a string",
        ),
        (
            r#"{"request_id": "x", "quality": "high"}"#,
            json!("quality"),
            "expected f64",
        ),
        (
            r#"{"request_id": "x", "quality": 0.5, "source": "boss"}"#,
            json!("source"),
            "unknown variant",
        ),
        (
            r#"{"request_id": "x"}"#,
            Value::Null,
            "missing field `quality`",
        ),
        ("not json", Value::Null, "expected"),
    ] {
        let r = http(gw.addr, "POST", "/v1/feedback", &[], body).await;
        let e = r.json();
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(e["error"]["code"], "invalid_feedback", "{body}: {}", r.body);
        assert_eq!(e["error"]["param"], param, "{body}: {}", r.body);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
}

#[tokio::test]
async fn feedback_reaches_the_policy_once() {
    let gw = start(TWO, &[]).await;
    let r = http(
        gw.addr,
        "POST",
        "/v1/tools/search",
        &[],
        r#"{"query":"rust borrow checker"}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.header("x-equiroute-request-id").unwrap().to_owned();
    let quality = |state: &Value| {
        let estimates = &state["candidates"][0]["estimates"];
        (
            estimates["quality"].as_f64().unwrap(),
            estimates["quality_observations"].as_u64().unwrap(),
        )
    };
    let state = http(gw.addr, "GET", "/v1/interfaces/search/state", &[], "")
        .await
        .json();
    // Before any score there is no quality estimate, only the prior: null, from 0 scores.
    let estimates = &state["candidates"][0]["estimates"];
    assert_eq!(estimates["quality"], Value::Null, "{state}");
    assert_eq!(estimates["quality_observations"], 0, "{state}");
    // The traffic counts say what they cover: this process since it started.
    assert_eq!(state["candidates"][0]["first_choices"], 1, "{state}");
    assert_eq!(state["candidates"][0]["traffic_share"], 1.0, "{state}");
    assert_eq!(state["traffic_window"]["scope"], "process", "{state}");
    assert_eq!(state["traffic_window"]["requests"], 1, "{state}");
    let since = state["traffic_window"]["since_unix_ms"].as_f64().unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1000.0;
    assert!(since > 0.0 && since <= now_ms, "{state}");
    let fb = json!({"request_id": id, "quality": 1.0, "source": "user"}).to_string();
    let r = http(gw.addr, "POST", "/v1/feedback", &[], &fb).await;
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, json!("accepted"))
    );
    let after = quality(
        &http(gw.addr, "GET", "/v1/interfaces/search/state", &[], "")
            .await
            .json(),
    );
    assert!(
        after.0 > 0.01,
        "quality estimate after a score of 1: {after:?}"
    );
    assert_eq!(after.1, 1, "one score behind the estimate");
    let r = http(gw.addr, "POST", "/v1/feedback", &[], &fb).await;
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, json!("duplicate"))
    );
    let again = quality(
        &http(gw.addr, "GET", "/v1/interfaces/search/state", &[], "")
            .await
            .json(),
    );
    assert_eq!(again, after, "a duplicate changes nothing");
    let r = http(
        gw.addr,
        "POST",
        "/v1/feedback",
        &[],
        r#"{"request_id":"req-unknown","quality":0.5}"#,
    )
    .await;
    assert_eq!(r.status, 404);
    let r = http(
        gw.addr,
        "POST",
        "/v1/feedback",
        &[],
        &json!({"request_id": id, "quality": 1.5}).to_string(),
    )
    .await;
    assert_eq!(r.status, 400);
    let list = http(gw.addr, "GET", "/v1/interfaces", &[], "").await.json();
    assert_eq!(list["interfaces"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn keys_are_required_when_configured_and_never_echoed() {
    let config = format!("[server]\napi_keys_env = [\"GW_TEST_KEY\"]\n{TWO}");
    let gw = start(&config, &[("GW_TEST_KEY", "k-123-secret")]).await;
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat("chat/good"),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (401, json!("invalid_api_key"))
    );
    assert!(!r.body.contains("k-123-secret"));
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer wrong")],
        &chat("chat/good"),
    )
    .await;
    assert_eq!(r.status, 401);
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer k-123-secret")],
        &chat("chat/good"),
    )
    .await;
    assert_eq!(r.status, 200);
    // Health and metrics stay open for probes.
    assert_eq!(http(gw.addr, "GET", "/healthz", &[], "").await.status, 200);
    // The model list is behind the gateway key like the routes it describes.
    assert_eq!(
        http(gw.addr, "GET", "/v1/models", &[], "").await.status,
        401
    );
}

/// `GET /v1/models` lists what `model` can name, as OpenAI clients expect; a path or method
/// the gateway does not serve gets an OpenAI-style error body, not an empty one.
#[tokio::test]
async fn models_are_listed_and_unknown_routes_answer_in_json() {
    let gw = start(TWO, &[]).await;
    let r = http(gw.addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let list = r.json();
    assert_eq!(list["object"], "list");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat", "chat/broken", "chat/good", "chat/slow"]);
    assert!(list["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["object"] == "model"));
    // Every listed id is a `model` the chat route takes.
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat(ids[2])).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let one = http(gw.addr, "GET", "/v1/models/chat/good", &[], "").await;
    assert_eq!(
        (one.status, one.json()["owned_by"].clone()),
        (200, json!("good-model"))
    );
    let r = http(gw.addr, "GET", "/v1/models/search", &[], "").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert!(r.body.contains("chat/good"), "{}", r.body);
    let r = http(gw.addr, "POST", "/v1/embeddings", &[], "{}").await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (404, json!("unknown_route"))
    );
    assert!(r.body.contains("POST /v1/chat/completions"), "{}", r.body);
    let r = http(gw.addr, "GET", "/v1/chat/completions", &[], "").await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (405, json!("method_not_allowed"))
    );
}

#[tokio::test]
async fn first_byte_cost_and_feedback_delay_are_histograms_per_interface() {
    let cfg = r#"
[interfaces.chat]
kind = "chat"

[[interfaces.chat.providers]]
id = "only"
kind = "sim"
price = { per_call = 0.0004 }
sim = { latency = { p50_ms = 5, p95_ms = 10 } }
"#;
    let gw = start(cfg, &[]).await;
    let streamed =
        json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let a = post_chat(gw.addr, &streamed).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let b = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat("chat")).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let id = b.header("x-equiroute-request-id").unwrap();
    let fb = json!({"request_id": id, "quality": 0.8}).to_string();
    let r = http(gw.addr, "POST", "/v1/feedback", &[], &fb).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    // One streamed attempt had a first byte; two requests cost 0.0004 each (the sum kept in
    // micro-dollars, so it is exact); one score arrived, well within a minute.
    for line in [
        r#"equiroute_first_byte_ms_count{interface="chat"} 1"#,
        r#"equiroute_request_cost_usd_count{interface="chat"} 2"#,
        r#"equiroute_request_cost_usd_sum{interface="chat"} 0.0008"#,
        r#"equiroute_request_cost_usd_bucket{interface="chat",le="0.0003"} 0"#,
        r#"equiroute_request_cost_usd_bucket{interface="chat",le="0.001"} 2"#,
        r#"equiroute_feedback_delay_seconds_count{interface="chat"} 1"#,
        r#"equiroute_feedback_delay_seconds_bucket{interface="chat",le="60"} 1"#,
        // Both requests answered by the one provider, each attempt costing 0.0004.
        r#"equiroute_provider_latency_ms_count{interface="chat",provider="only"} 2"#,
        r#"equiroute_provider_cost_usd_count{interface="chat",provider="only"} 2"#,
        r#"equiroute_provider_cost_usd_bucket{interface="chat",provider="only",le="0.0003"} 0"#,
        r#"equiroute_provider_cost_usd_bucket{interface="chat",provider="only",le="0.001"} 2"#,
    ] {
        assert!(m.contains(line), "{line} not in:\n{m}");
    }
}
