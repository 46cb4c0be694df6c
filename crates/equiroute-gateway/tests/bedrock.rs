//! The `bedrock` kind end to end: the gateway speaks OpenAI to the client and Bedrock's
//! Converse (SigV4-signed, streams in AWS event-stream framing) to a mock that speaks only
//! that and checks the signature's form; streamed and not, with tools, errors of each class,
//! a cut stream, and fallback from Bedrock to another dialect inside one request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, mock, start};
use serde_json::{json, Value};
use std::net::SocketAddr;

const KEY_ID: &str = "AKIANEVERSHOWN4711";
const SECRET: &str = "never-shown-secret/K7MDENG+bPxRfiCY";
const TOKEN: &str = "never-shown-session-token-0815";
const MODEL: &str = "anthropic.claude-x-v1:0";

fn aws_env(session: bool) -> Vec<(&'static str, &'static str)> {
    let mut env = vec![
        ("AWS_ACCESS_KEY_ID", KEY_ID),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("AWS_REGION", "eu-west-3"),
        ("OTHER_KEY", "sk-other"),
    ];
    if session {
        env.push(("AWS_SESSION_TOKEN", TOKEN));
    }
    env
}

/// A chat interface: Bedrock first, then `backup` (a provider table) when given.
fn config(at: SocketAddr, backup: Option<String>) -> String {
    let mut text = format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "first" }}
deadline_ms = 5000

[[interfaces.chat.providers]]
id = "first"
kind = "bedrock"
model = "{MODEL}"
base_url = "http://{at}"
"#
    );
    if let Some(b) = backup {
        text = format!(
            "{text}\n[[interfaces.chat.providers]]\nid = \"backup\"\napi_key_env = \"OTHER_KEY\"\n{b}"
        );
    }
    text
}

fn openai(at: SocketAddr) -> String {
    format!("kind = \"openai\"\nmodel = \"gpt-backup\"\nbase_url = \"http://{at}/v1\"\n")
}

fn anthropic(at: SocketAddr) -> String {
    format!("kind = \"anthropic\"\nmodel = \"claude-x\"\nbase_url = \"http://{at}/v1\"\n")
}

fn request(stream: bool, tools: bool) -> Value {
    let mut body = json!({"model": "chat", "stream": stream, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"}]});
    if tools {
        body["tools"] = json!([{"type": "function", "function": {"name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    }
    body
}

async fn stats(addr: SocketAddr) -> Value {
    http(addr, "GET", "/_stats", &[], "").await.json()
}

/// A chat call; no AWS credential shows in the reply, whatever it is.
async fn chat(gw: SocketAddr, body: &Value) -> common::Reply {
    let r = http(gw, "POST", "/v1/chat/completions", &[], &body.to_string()).await;
    for secret in [KEY_ID, SECRET, TOKEN] {
        assert!(!r.body.contains(secret), "a credential shows: {}", r.body);
        assert!(
            r.headers.iter().all(|(_, v)| !v.contains(secret)),
            "a credential shows in a header"
        );
    }
    r
}

fn events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d)))
        .collect()
}

fn streamed(events: &[Value], pointer: &str) -> String {
    events
        .iter()
        .filter_map(|e| e.pointer(pointer).and_then(Value::as_str))
        .collect()
}

fn finish(events: &[Value]) -> Option<String> {
    events
        .iter()
        .find_map(|e| {
            e.pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
        })
        .map(str::to_owned)
}

#[tokio::test]
async fn bedrock_answers_in_openai_shape_signed_with_tools_and_usage() {
    let native = mock("").await;
    for (n, session) in [(1, true), (2, false)] {
        let gw = start(&config(native.addr, None), &aws_env(session)).await;
        let r = chat(gw.addr, &request(false, true)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("first"));
        let a = r.json();
        assert_eq!(a["model"], MODEL, "the model that answered is named");
        assert_eq!(a["choices"][0]["message"]["content"], "mock answer");
        assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
        let call = &a["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["id"], "tooluse_mock");
        assert_eq!(call["function"]["name"], "lookup");
        assert_eq!(call["function"]["arguments"], r#"{"q":"mock"}"#);
        assert_eq!(a["usage"]["prompt_tokens"], 5);
        assert_eq!(a["usage"]["completion_tokens"], 2);
        let s = stats(native.addr).await;
        assert_eq!(s["chat"], n);
        assert_eq!(
            s["authorized"], n,
            "SigV4-signed for bedrock, x-amz-date signed"
        );
        assert_eq!(
            s["session_tokens"], 1,
            "the session token only when one is set"
        );
        assert_eq!(
            s["models"][MODEL], n,
            "the model id is the URL's path segment"
        );
    }
}

#[tokio::test]
async fn bedrock_streams_event_frames_as_openai_chunks_ending_with_done() {
    let native = mock("").await;
    let gw = start(&config(native.addr, None), &aws_env(true)).await;
    let mut body = request(true, false);
    body["stream_options"] = json!({"include_usage": true});
    let r = chat(gw.addr, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let ev = events(&r.body);
    assert_eq!(ev.last(), Some(&json!("[DONE]")), "{}", r.body);
    assert_eq!(
        streamed(&ev, "/choices/0/delta/content"),
        "mock streamed answer"
    );
    assert_eq!(finish(&ev).as_deref(), Some("stop"));
    let usage = ev
        .iter()
        .find(|e| e.get("usage").is_some_and(|u| !u.is_null()))
        .unwrap();
    assert_eq!(usage["usage"]["prompt_tokens"], 5, "{}", r.body);
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert!(ev[..ev.len() - 1]
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["model"] == MODEL));
    // With a tool: the call's id, name and input deltas in order.
    let r = chat(gw.addr, &request(true, true)).await;
    let ev = events(&r.body);
    assert_eq!(ev.last(), Some(&json!("[DONE]")), "{}", r.body);
    assert_eq!(
        streamed(&ev, "/choices/0/delta/tool_calls/0/function/arguments"),
        r#"{"q": "mock"}"#
    );
    assert_eq!(
        streamed(&ev, "/choices/0/delta/tool_calls/0/id"),
        "tooluse_mock"
    );
    assert_eq!(finish(&ev).as_deref(), Some("tool_calls"));
}

#[tokio::test]
async fn throttling_unavailability_and_refused_credentials_fall_back() {
    let backup = mock("").await;
    for profile in [
        "[chat]\nfault = \"rate_limited\"\nretry_after_s = 30\n",
        "[chat]\nfault = \"rate_limited_no_retry_after\"\n",
        "[chat]\nfault = \"unavailable\"\n",
        "[chat]\nerror_500 = 1.0\n",
        "[chat]\nfault = \"access_denied\"\n",
        "[models.\"anthropic.claude-x-v1:0\"]\nfault = \"access_denied\"\n",
    ] {
        let native = mock(profile).await;
        let gw = start(
            &config(native.addr, Some(openai(backup.addr))),
            &aws_env(true),
        )
        .await;
        for stream in [false, true] {
            let r = chat(gw.addr, &request(stream, false)).await;
            assert_eq!(r.status, 200, "{profile}: {}", r.body);
            assert_eq!(
                r.header("x-equiroute-provider"),
                Some("backup"),
                "{profile}"
            );
        }
        assert!(
            stats(native.addr).await["chat"].as_u64().unwrap() >= 1,
            "{profile}"
        );
    }
}

#[tokio::test]
async fn a_refused_signature_names_no_credential_in_the_error() {
    // Bedrock alone: the error reaches the client, with the reason of the attempt. The mock
    // quotes every header it got, as AWS's signature errors quote the canonical request.
    let native = mock("[chat]\nfault = \"access_denied\"\n").await;
    let gw = start(&config(native.addr, None), &aws_env(true)).await;
    let r = chat(gw.addr, &request(false, false)).await;
    assert!(r.status >= 500, "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("InvalidSignatureException"), "{message}");
    assert!(
        message.contains("AWS_ACCESS_KEY_ID"),
        "says what to check: {message}"
    );
    // The stream's error too.
    let r = chat(gw.addr, &request(true, false)).await;
    assert!(r.status >= 500, "{}", r.body);
}

#[tokio::test]
async fn rejections_guardrails_and_long_prompts_go_back_to_the_caller() {
    let backup = mock("").await;
    // A rejection with no other provider to ask, and a guardrail's even with one.
    for (profile, code, says, with_backup) in [
        (
            "[chat]\nerror_400 = 1.0\n",
            "upstream_rejected_request",
            "ValidationException",
            false,
        ),
        (
            "[chat]\nfault = \"content_filter\"\n",
            "content_filter",
            "guardrail",
            true,
        ),
    ] {
        let native = mock(profile).await;
        let gw = start(
            &config(native.addr, with_backup.then(|| openai(backup.addr))),
            &aws_env(false),
        )
        .await;
        let r = chat(gw.addr, &request(false, false)).await;
        assert_eq!(r.status, 400, "{profile}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["code"], code, "{profile}: {}", r.body);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{profile}: {message}");
        assert_eq!(stats(native.addr).await["chat"], 1);
        assert_eq!(stats(backup.addr).await["chat"], 0, "not retried elsewhere");
    }
    // A ValidationException with another provider behind: asked there (it may be the
    // model's, not the request's), which answers.
    let native = mock("[chat]\nerror_400 = 1.0\n").await;
    let gw = start(
        &config(native.addr, Some(openai(backup.addr))),
        &aws_env(false),
    )
    .await;
    let r = chat(gw.addr, &request(false, false)).await;
    assert_eq!(r.routed(), (200, Some("backup"), Some("2")), "{}", r.body);
    assert_eq!(stats(backup.addr).await["chat"], 1);
    // What Converse cannot express: passed over for the OpenAI provider; alone, a 400 naming
    // the member. Never sent to Bedrock.
    let native = mock("").await;
    let mut no_bias = request(false, false);
    no_bias["logit_bias"] = json!({"50256": -100});
    let mut no_none = request(false, true);
    no_none["tool_choice"] = json!("none");
    for (body, field) in [(no_bias, "`logit_bias`"), (no_none, "`tool_choice`")] {
        let mixed = start(
            &config(native.addr, Some(openai(backup.addr))),
            &aws_env(false),
        )
        .await;
        let r = chat(mixed.addr, &body).await;
        assert_eq!(r.status, 200, "{field}: {}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("backup"));
        let alone = start(&config(native.addr, None), &aws_env(false)).await;
        let r = chat(alone.addr, &body).await;
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "unsupported_parameter");
        assert!(r.body.contains(field), "{}", r.body);
    }
    assert_eq!(stats(native.addr).await["chat"], 0);
    // A prompt too long for the model: a context-window refusal, named as Bedrock words it.
    let native = mock("[chat]\nfault = \"context_length_exceeded\"\n").await;
    let gw = start(&config(native.addr, None), &aws_env(false)).await;
    let r = chat(gw.addr, &request(false, false)).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("Input is too long"), "{}", r.body);
}

#[tokio::test]
async fn a_bedrock_stream_cut_midway_ends_in_an_error_event_not_done() {
    for profile in [
        "[chat]\nstream_cut_after = 2\n",
        "[chat]\nfault = \"no_done_unfinished\"\n",
        "[chat]\nfault = \"malformed_chunk\"\n",
    ] {
        let native = mock(profile).await;
        let gw = start(&config(native.addr, None), &aws_env(false)).await;
        let r = chat(gw.addr, &request(true, false)).await;
        assert_eq!(r.status, 200, "{profile}: {}", r.body);
        let ev = events(&r.body);
        assert_ne!(ev.last(), Some(&json!("[DONE]")), "{profile}: {}", r.body);
        assert_eq!(
            ev.last().unwrap()["error"]["code"],
            "stream_broken",
            "{profile}: {}",
            r.body
        );
    }
    // Without its closing `metadata` frame, a stream that said `messageStop` is whole.
    let native = mock("[chat]\nfault = \"no_done_finished\"\n").await;
    let gw = start(&config(native.addr, None), &aws_env(false)).await;
    let r = chat(gw.addr, &request(true, false)).await;
    assert_eq!(events(&r.body).last(), Some(&json!("[DONE]")), "{}", r.body);
}

#[tokio::test]
async fn bedrock_falls_back_to_anthropic_inside_one_request() {
    let native = mock("[chat]\nfault = \"unavailable\"\n").await;
    let other = mock("").await;
    let gw = start(
        &config(native.addr, Some(anthropic(other.addr))),
        &aws_env(true),
    )
    .await;
    let r = chat(gw.addr, &request(false, true)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-provider"), Some("backup"));
    let a = r.json();
    assert_eq!(a["model"], "claude-x");
    assert_eq!(
        a["choices"][0]["message"]["tool_calls"][0]["id"],
        "toolu_mock"
    );
    let r = chat(gw.addr, &request(true, false)).await;
    let ev = events(&r.body);
    assert_eq!(ev.last(), Some(&json!("[DONE]")), "{}", r.body);
    assert_eq!(
        streamed(&ev, "/choices/0/delta/content"),
        "mock streamed answer"
    );
    // Tried first each time (a 503 may be retried once there before the fallback).
    assert!(stats(native.addr).await["chat"].as_u64().unwrap() >= 2);
    assert_eq!(stats(other.addr).await["chat"], 2);
}

#[test]
fn check_config_names_bedrock_fields_and_the_missing_credentials() {
    let load = |provider: &str, env: &[(&str, &str)]| {
        let text = format!(
            "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"p\"\n{provider}"
        );
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        equiroute_gateway::config::load_all(&text, "t.toml", &move |n| {
            env.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone())
        })
    };
    let first_error = |provider: &str, env: &[(&str, &str)]| {
        let e = load(provider, env).unwrap_err()[0].to_string();
        for secret in [KEY_ID, SECRET] {
            assert!(!e.contains(secret), "{e}");
        }
        e
    };
    let creds = [
        ("AWS_ACCESS_KEY_ID", KEY_ID),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
    ];
    // No credentials: an error naming the variables.
    let e = first_error("kind = \"bedrock\"\nregion = \"us-east-1\"\n", &[]);
    assert!(
        e.contains("AWS_ACCESS_KEY_ID") && e.contains("AWS_SECRET_ACCESS_KEY"),
        "{e}"
    );
    // No region anywhere; a region that is not one; a model id that cannot be a path segment.
    let e = first_error("kind = \"bedrock\"\n", &creds);
    assert!(
        e.contains("providers[0].region`") && e.contains("AWS_REGION"),
        "{e}"
    );
    let e = first_error("kind = \"bedrock\"\nregion = \"US East\"\n", &creds);
    assert!(e.contains("providers[0].region`"), "{e}");
    let e = first_error(
        "kind = \"bedrock\"\nregion = \"us-east-1\"\nmodel = \"a b\"\n",
        &creds,
    );
    assert!(e.contains("providers[0].model`"), "{e}");
    // The region from the environment; `api_key_env` is not read (a warning says so).
    let mut env = creds.to_vec();
    env.push(("AWS_REGION", "ap-south-1"));
    env.push(("K", "v"));
    let cfg = load("kind = \"bedrock\"\napi_key_env = \"K\"\n", &env).unwrap();
    assert!(cfg.warnings[0]
        .to_string()
        .contains("api_key_env`: ignored"));
    let p = &cfg.interfaces[0].providers[0];
    match &p.upstream {
        equiroute_gateway::config::UpstreamConfig::Bedrock {
            base_url, region, ..
        } => {
            assert_eq!(region, "ap-south-1");
            assert_eq!(base_url, "https://bedrock-runtime.ap-south-1.amazonaws.com");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !format!("{cfg:?}").contains(KEY_ID),
        "Debug redacts the key id"
    );
    let caps = &p.candidate.capabilities;
    assert!(!caps.json_mode && caps.vision && caps.context_tokens == 200_000);
    // `region` on another kind is ignored, with a warning.
    let cfg = load("kind = \"gemini\"\nregion = \"us-east-1\"\n", &[]).unwrap();
    assert!(cfg.warnings[0].to_string().contains("region`: ignored"));
}
