//! The native dialects end to end: the gateway speaks OpenAI to the client and Anthropic's
//! Messages API, Azure OpenAI and Gemini to mock upstreams that speak only those (and check
//! what their hosts require), streamed and not, with tools, errors of each class, a cut
//! stream, and fallback from one dialect to another inside one request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, mock, start};
use serde_json::{json, Value};
use std::net::SocketAddr;

const KEY: &str = "sk-never-shown-4711";

/// A chat interface whose first provider (`first`, of any kind, with the key) falls back to an
/// OpenAI one.
fn config(first: &str, backup: SocketAddr) -> String {
    common::fallback_config(
        "",
        &format!("api_key_env = \"NATIVE_KEY\"\n{first}"),
        backup,
    )
}

fn anthropic(at: SocketAddr) -> String {
    format!("kind = \"anthropic\"\nmodel = \"claude-x\"\nbase_url = \"http://{at}/v1\"\nmax_tokens = 1000\n")
}

fn azure(at: SocketAddr) -> String {
    format!("kind = \"azure_openai\"\nmodel = \"gpt-4o\"\ndeployment = \"prod-4o\"\nendpoint = \"http://{at}\"\n")
}

fn gemini(at: SocketAddr) -> String {
    format!("kind = \"gemini\"\nmodel = \"gemini-x\"\nbase_url = \"http://{at}/v1beta\"\n")
}

fn request(stream: bool, tools: bool) -> String {
    let mut body = json!({"model": "chat", "stream": stream, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"}]});
    if tools {
        body["tools"] = json!([{"type": "function", "function": {"name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    }
    body.to_string()
}

async fn stats(addr: SocketAddr) -> Value {
    http(addr, "GET", "/_stats", &[], "").await.json()
}

async fn chat(gw: SocketAddr, body: &str) -> common::Reply {
    let r = http(gw, "POST", "/v1/chat/completions", &[], body).await;
    assert!(!r.body.contains(KEY), "the key never shows: {}", r.body);
    r
}

/// The `data:` events of an OpenAI stream, `[DONE]` as a string.
fn events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d)))
        .collect()
}

/// The text a stream's chunks spell, and its finish reason.
fn streamed_text(events: &[Value]) -> (String, Option<String>) {
    let text = events
        .iter()
        .filter_map(|e| {
            e.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    let finish = events
        .iter()
        .find_map(|e| {
            e.pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
        })
        .map(str::to_owned);
    (text, finish)
}

async fn gateway(first: String, backup: SocketAddr) -> common::Gateway {
    start(&config(&first, backup), &[("NATIVE_KEY", KEY)]).await
}

#[tokio::test]
async fn every_dialect_answers_in_openai_shape_with_its_tool_calls_and_usage() {
    let native = mock("").await;
    let backup = mock("").await;
    // (provider table, model that answers, tool call id, prompt tokens the mock reports)
    let cases = [
        (anthropic(native.addr), "claude-x", Some("toolu_mock"), 4),
        (gemini(native.addr), "gemini-x", Some("call_"), 4),
        (azure(native.addr), "gpt-4o", None, 3),
    ];
    for (n, (first, model, call_id, prompt)) in cases.into_iter().enumerate() {
        let gw = gateway(first, backup.addr).await;
        let r = chat(gw.addr, &request(false, true)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("first"));
        let a = r.json();
        assert_eq!(a["model"], model, "the model that answered is named");
        assert_eq!(a["choices"][0]["message"]["content"], "mock answer");
        assert_eq!(a["usage"]["prompt_tokens"], prompt, "{model}");
        if let Some(id) = call_id {
            assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
            let call = &a["choices"][0]["message"]["tool_calls"][0];
            assert!(call["id"].as_str().unwrap().starts_with(id), "{call}");
            if model == "gemini-x" {
                // Gemini's thought signature rides in the id and in Google's extension field.
                let signature = equiroute_mock::MOCK_THOUGHT_SIGNATURE;
                assert!(call["id"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!(":ts:{signature}")));
                assert_eq!(
                    call["extra_content"]["google"]["thought_signature"],
                    signature
                );
            }
            assert_eq!(call["function"]["name"], "lookup");
            assert_eq!(call["function"]["arguments"], r#"{"q":"mock"}"#);
        }
        let s = stats(native.addr).await;
        assert_eq!(s["chat"], n + 1, "the native route answered, no fallback");
        assert_eq!(s["authorized"], n + 1, "the key went in the host's header");
    }
    assert_eq!(
        stats(native.addr).await["models"]["prod-4o"],
        1,
        "Azure's deployment URL"
    );
    assert_eq!(stats(backup.addr).await["chat"], 0);
}

#[tokio::test]
async fn every_dialect_streams_openai_chunks_ending_with_done() {
    let native = mock("").await;
    let backup = mock("").await;
    for (first, model) in [
        (anthropic(native.addr), "claude-x"),
        (gemini(native.addr), "gemini-x"),
        (azure(native.addr), "gpt-4o"),
    ] {
        let gw = gateway(first, backup.addr).await;
        let r = chat(gw.addr, &request(true, false)).await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        let ev = events(&r.body);
        assert_eq!(ev.last(), Some(&json!("[DONE]")), "{model}: {}", r.body);
        assert_eq!(
            streamed_text(&ev),
            ("mock streamed answer".to_owned(), Some("stop".to_owned())),
            "{model}: {}",
            r.body
        );
        assert!(
            ev[..ev.len() - 1]
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk"),
            "{model}: {}",
            r.body
        );
        // One rule for `model`, as unstreamed: the configured one in every chunk (Azure's
        // mock streams its deployment's name, `prod-4o`, as Azure streams its own).
        assert!(
            ev[..ev.len() - 1].iter().all(|c| c["model"] == model),
            "{model}: {}",
            r.body
        );
    }
    let anthropic_stream = {
        let gw = gateway(anthropic(native.addr), backup.addr).await;
        chat(gw.addr, &request(true, true)).await
    };
    let ev = events(&anthropic_stream.body);
    let args: String = ev
        .iter()
        .filter_map(|e| {
            e.pointer("/choices/0/delta/tool_calls/0/function/arguments")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(args, r#"{"q": "mock"}"#, "tool input deltas in order");
    assert_eq!(streamed_text(&ev).1.as_deref(), Some("tool_calls"));
}

#[tokio::test]
async fn overload_and_rate_limits_fall_back_to_another_dialect() {
    let backup = mock("").await;
    for (profile, first) in [
        ("[chat]\nfault = \"unavailable\"\n", "anthropic"),
        (
            "[chat]\nfault = \"rate_limited\"\nretry_after_s = 30\n",
            "anthropic",
        ),
        ("[chat]\nfault = \"unavailable\"\n", "gemini"),
        ("[chat]\nfault = \"rate_limited\"\n", "gemini"),
        ("[chat]\nfault = \"unavailable\"\n", "azure"),
    ] {
        let native = mock(profile).await;
        let table = match first {
            "anthropic" => anthropic(native.addr),
            "gemini" => gemini(native.addr),
            _ => azure(native.addr),
        };
        let gw = gateway(table, backup.addr).await;
        for stream in [false, true] {
            let r = chat(gw.addr, &request(stream, false)).await;
            assert_eq!(r.status, 200, "{first} {profile}: {}", r.body);
            assert_eq!(
                r.header("x-equiroute-provider"),
                Some("backup"),
                "{first} {profile}"
            );
        }
    }
}

#[tokio::test]
async fn safety_blocks_go_back_to_the_caller_and_other_rejections_get_a_second_opinion() {
    let backup = mock("").await;
    for (profile, first, code, says) in [
        (
            "[chat]\nfault = \"content_filter\"\n",
            "anthropic",
            "content_filter",
            "refused",
        ),
        (
            "[chat]\nfault = \"content_filter\"\n",
            "gemini",
            "content_filter",
            "SAFETY",
        ),
        (
            "[chat]\nfault = \"content_filter\"\n",
            "azure",
            "content_filter",
            "filtered",
        ),
    ] {
        let native = mock(profile).await;
        let table = match first {
            "anthropic" => anthropic(native.addr),
            "gemini" => gemini(native.addr),
            _ => azure(native.addr),
        };
        let gw = gateway(table, backup.addr).await;
        let r = chat(gw.addr, &request(false, false)).await;
        assert_eq!(r.status, 400, "{first} {profile}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["code"], code, "{first} {profile}: {}", r.body);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{first} {profile}: {message}");
        assert_eq!(stats(native.addr).await["chat"], 1);
        assert_eq!(stats(backup.addr).await["chat"], 0, "not retried elsewhere");
    }
    // Another rejection, in each native dialect's words, may be the provider's (a wrong
    // model name): the backup is asked, and answers.
    for first in ["anthropic", "gemini"] {
        let native = mock("[chat]\nerror_400 = 1.0\n").await;
        let table = match first {
            "anthropic" => anthropic(native.addr),
            _ => gemini(native.addr),
        };
        let before = stats(backup.addr).await["chat"].as_u64().unwrap_or(0);
        let gw = gateway(table, backup.addr).await;
        let r = chat(gw.addr, &request(false, false)).await;
        assert_eq!(
            r.routed(),
            (200, Some("backup"), Some("2")),
            "{first}: {}",
            r.body
        );
        assert_eq!(stats(native.addr).await["chat"], 1);
        assert_eq!(stats(backup.addr).await["chat"], before + 1, "{first}");
    }
}

/// A member one dialect cannot express passes that provider over for one that can (the
/// exclusion's reason names the member); only when no provider can is it the caller's 400.
#[tokio::test]
async fn a_provider_that_cannot_express_the_request_is_passed_over_for_one_that_can() {
    let native = mock("").await;
    let backup = mock("").await;
    for first in [anthropic(native.addr), gemini(native.addr)] {
        let gw = gateway(first.clone(), backup.addr).await;
        let mut body: Value = serde_json::from_str(&request(false, false)).unwrap();
        // Not droppable: it changes the answer.
        body["logit_bias"] = json!({"50256": -100});
        let r = chat(gw.addr, &body.to_string()).await;
        assert_eq!(r.status, 200, "{first}: {}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("backup"), "{first}");
    }
    assert_eq!(
        stats(native.addr).await["chat"],
        0,
        "nothing sent where it cannot be said"
    );
    assert_eq!(stats(backup.addr).await["chat"], 2);
    // Anthropic cannot say `presence_penalty`, Gemini can: Gemini answers, though ranked
    // second.
    let mixed = format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "claude" }}

[[interfaces.chat.providers]]
id = "claude"
api_key_env = "NATIVE_KEY"
{}
[[interfaces.chat.providers]]
id = "gem"
api_key_env = "NATIVE_KEY"
{}"#,
        anthropic(native.addr),
        gemini(native.addr)
    );
    let gw = start(&mixed, &[("NATIVE_KEY", KEY)]).await;
    let mut body: Value = serde_json::from_str(&request(false, false)).unwrap();
    body["presence_penalty"] = json!(0.5);
    let r = chat(gw.addr, &body.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-provider"), Some("gem"));
    // Neither can say `logit_bias`: a 400 naming it, and nothing sent.
    body["logit_bias"] = json!({"50256": -100});
    let before = stats(native.addr).await["chat"].clone();
    let r = chat(gw.addr, &body.to_string()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["code"], "unsupported_parameter");
    assert_eq!(e["error"]["param"], "logit_bias");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`logit_bias`"),
        "{}",
        r.body
    );
    assert_eq!(stats(native.addr).await["chat"], before);
}

/// `unsupported_params`: by default a native provider drops what does not change the answer
/// (`user` on Gemini, `seed` and a message's `name` on Anthropic), answers, and says what it
/// dropped in a header and the audit record; nothing of it reaches the provider. With
/// `"reject"` (on the interface, or the provider) the same request is a 400 naming the member.
#[tokio::test]
async fn members_a_native_api_cannot_express_are_dropped_and_named_or_refused_per_the_policy() {
    let native = mock("").await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-dialects-dropped-{}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    let single = |provider: String, interface: &str| {
        format!(
            "[audit]\npath = {:?}\n[interfaces.chat]\nkind = \"chat\"\n{interface}\n\
             [[interfaces.chat.providers]]\nid = \"first\"\napi_key_env = \"NATIVE_KEY\"\n{provider}",
            audit.display().to_string()
        )
    };
    let mut gem_body: Value = serde_json::from_str(&request(false, false)).unwrap();
    gem_body["user"] = json!("end-user-4711");
    let mut claude_body = gem_body.clone();
    claude_body["seed"] = json!(7);
    claude_body["messages"][1]["name"] = json!("ann");
    // Sampling, which the current Messages API has not (its SDK's request types refuse it).
    claude_body["temperature"] = json!(0.25);
    claude_body["top_p"] = json!(0.75);
    // (provider, request, header, the member the reject names, what is not sent)
    let cases = [
        (
            gemini(native.addr),
            &gem_body,
            "user",
            "user",
            &["end-user-4711"][..],
        ),
        (
            anthropic(native.addr),
            &claude_body,
            "temperature,top_p,seed,messages[].name",
            "messages[1].name",
            &[
                "\"seed\"",
                "\"ann\"",
                "temperature",
                "top_p",
                "0.25",
                "0.75",
            ][..],
        ),
    ];
    for (provider, body, header, member, unsent) in cases {
        let gw = start(&single(provider.clone(), ""), &[("NATIVE_KEY", KEY)]).await;
        let r = chat(gw.addr, &body.to_string()).await;
        assert_eq!(r.status, 200, "{provider}: {}", r.body);
        assert_eq!(r.header("x-equiroute-dropped-params"), Some(header));
        let sent = stats(native.addr).await["last_chat"].to_string();
        assert!(sent.contains("hi"), "the request was sent: {sent}");
        assert!(unsent.iter().all(|u| !sent.contains(u)), "{sent}");
        let record =
            common::audit_record(&audit, r.header("x-equiroute-request-id").unwrap()).await;
        let named: Vec<&str> = header.split(',').collect();
        assert_eq!(record["attempts"][0]["dropped_params"], json!(named));
        // A stream says it too.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let r = chat(gw.addr, &streamed.to_string()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-equiroute-dropped-params"), Some(header));
        // Refused, on the interface or the provider: nothing sent.
        let strict = [
            single(provider.clone(), "unsupported_params = \"reject\""),
            single(format!("{provider}unsupported_params = \"reject\"\n"), ""),
        ];
        for cfg in strict {
            let before = stats(native.addr).await["chat"].clone();
            let gw = start(&cfg, &[("NATIVE_KEY", KEY)]).await;
            let r = chat(gw.addr, &body.to_string()).await;
            assert_eq!(r.status, 400, "{cfg}: {}", r.body);
            assert_eq!(r.json()["error"]["param"], member, "{}", r.body);
            assert_eq!(r.header("x-equiroute-dropped-params"), None);
            assert_eq!(stats(native.addr).await["chat"], before);
        }
    }
    // What the answer depends on is refused under `drop` too.
    let gw = start(&single(gemini(native.addr), ""), &[("NATIVE_KEY", KEY)]).await;
    let mut biased = gem_body.clone();
    biased["logit_bias"] = json!({"50256": -100});
    let r = chat(gw.addr, &biased.to_string()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "logit_bias");
    let _ = std::fs::remove_file(&audit);
}

/// A two-round tool loop on Gemini with two calls per round, as a plain client writes it (each
/// call's id, name and arguments, nothing else): the thought signature Gemini gave the first
/// call comes back with it (the mock, like Gemini 3, refuses a turn without it), every call has
/// an id of its own, and each result goes to its call (the mock refuses results that do not
/// match the calls before them).
#[tokio::test]
async fn a_gemini_tool_loop_returns_the_thought_signature_and_ids_never_repeat() {
    let native = mock("").await;
    let backup = mock("").await;
    let gw = gateway(gemini(native.addr), backup.addr).await;
    let mut body: Value = serde_json::from_str(&request(false, true)).unwrap();
    body["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "function", "function": {"name": "fetch", "parameters": {"type": "object"}}}));
    let by_gemini = |r: &common::Reply| {
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-equiroute-provider"),
            Some("first"),
            "no fallback: {}",
            r.body
        );
        r.json()["choices"][0]["message"].clone()
    };
    let mut ids: Vec<String> = Vec::new();
    for round in 0..2 {
        let message = by_gemini(&chat(gw.addr, &body.to_string()).await);
        let calls = message["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("round {round}: {message}"))
            .clone();
        let names: Vec<&str> = calls
            .iter()
            .map(|c| c["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["lookup", "fetch"], "round {round}");
        assert!(
            calls[0]["id"].as_str().unwrap().contains(":ts:"),
            "the first call is signed"
        );
        let messages = body["messages"].as_array_mut().unwrap();
        // The client keeps only the id, name and arguments of each call.
        let plain: Vec<Value> = calls
            .iter()
            .map(|c| {
                json!({"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"]["arguments"]}})
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": plain}));
        for c in &calls {
            let id = c["id"].as_str().unwrap().to_owned();
            assert!(!ids.contains(&id), "round {round} repeats an id: {id}");
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("result of {}", c["function"]["name"])}));
            ids.push(id);
        }
        if round == 0 {
            messages.push(json!({"role": "user", "content": "and once more"}));
        }
    }
    // The answer after the second round's results: the whole loop went to Gemini.
    let last = by_gemini(&chat(gw.addr, &body.to_string()).await);
    assert_eq!(last["content"], "mock answer");
    assert_eq!(stats(backup.addr).await["chat"], 0);
    // Without the signature, or with results swapped between calls, the mock refuses as
    // Gemini does: the checks above could fail.
    let unsigned = body.to_string().replace(":ts:", ":xx:");
    let r = chat(gw.addr, &unsigned).await;
    assert_ne!(
        r.header("x-equiroute-provider"),
        Some("first"),
        "{}",
        r.body
    );
    // Both second-round results sent under the first call's id: two `lookup` results.
    let mut swapped = body.clone();
    let messages = swapped["messages"].as_array_mut().unwrap();
    let last = messages.len() - 1;
    assert_eq!(messages[last]["tool_call_id"], ids[3].as_str());
    messages[last]["tool_call_id"] = ids[2].clone().into();
    let r = chat(gw.addr, &swapped.to_string()).await;
    assert_ne!(
        r.header("x-equiroute-provider"),
        Some("first"),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn a_native_stream_cut_midway_ends_in_an_error_event_not_done() {
    // After content (the backup, an OpenAI provider, takes no prefill: not continued) the
    // error event ends the stream; before content (Anthropic's third event, its `ping`, made
    // malformed) the held start falls back to the backup invisibly.
    let backup = mock("").await;
    for (first, profile, broken) in [
        ("anthropic", "[chat]\nstream_cut_after = 4\n", true),
        (
            "anthropic",
            "[chat]\nfault = \"no_done_unfinished\"\n",
            true,
        ),
        ("anthropic", "[chat]\nfault = \"malformed_chunk\"\n", false),
        ("gemini", "[chat]\nstream_cut_after = 2\n", true),
        ("gemini", "[chat]\nfault = \"no_done_unfinished\"\n", true),
        ("gemini", "[chat]\nfault = \"malformed_chunk\"\n", true),
    ] {
        let native = mock(profile).await;
        let table = match first {
            "anthropic" => anthropic(native.addr),
            _ => gemini(native.addr),
        };
        let gw = gateway(table, backup.addr).await;
        let r = chat(gw.addr, &request(true, false)).await;
        assert_eq!(r.status, 200, "{first} {profile}: {}", r.body);
        let ev = events(&r.body);
        if broken {
            assert_ne!(
                ev.last(),
                Some(&json!("[DONE]")),
                "{first} {profile}: {}",
                r.body
            );
            assert_eq!(
                ev.last().unwrap()["error"]["code"],
                "stream_broken",
                "{first} {profile}: {}",
                r.body
            );
        } else {
            assert_eq!(
                ev.last(),
                Some(&json!("[DONE]")),
                "{first} {profile}: {}",
                r.body
            );
            assert_eq!(
                r.header("x-equiroute-provider"),
                Some("backup"),
                "{first} {profile}"
            );
        }
    }
}

#[test]
fn check_config_names_each_kinds_fields() {
    let load = |provider: &str| {
        let text = format!(
            "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"p\"\n{provider}"
        );
        equiroute_gateway::config::load_all(&text, "t.toml", &|_| Some("k".into()))
    };
    let first_error = |provider: &str| load(provider).unwrap_err()[0].to_string();
    assert!(first_error("kind = \"azure_openai\"\n")
        .contains("`interfaces.chat.providers[0].endpoint`"));
    assert!(
        first_error("kind = \"anthropic\"\nmax_tokens = 0\n").contains("providers[0].max_tokens`")
    );
    assert!(first_error("kind = \"gemini\"\nmodel = \"a/b\"\n").contains("providers[0].model`"));
    assert!(
        first_error("kind = \"azure_openai\"\nendpoint = \"http://x\"\nauth = \"basic\"\n")
            .contains("auth")
    );
    let cfg = load("kind = \"anthropic\"\nendpoint = \"http://x\"\n").unwrap();
    assert!(cfg.warnings[0]
        .to_string()
        .contains("`interfaces.chat.providers[0].endpoint`: ignored"));
    // Capabilities: the kind's defaults, and a declared field over them.
    let caps = |provider: &str| {
        load(provider).unwrap().interfaces[0].providers[0]
            .candidate
            .capabilities
            .clone()
    };
    let claude = caps("kind = \"anthropic\"\n");
    assert!(!claude.json_mode && claude.vision && claude.context_tokens == 200_000);
    let small = caps("kind = \"gemini\"\ncapabilities = { context_tokens = 32000 }\n");
    assert!(small.vision && small.json_mode && small.context_tokens == 32_000);
}

#[tokio::test]
async fn a_stream_is_billed_by_the_usage_its_provider_reported_not_the_estimate() {
    let native = mock("").await;
    let backup = mock("").await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-dialects-stream-cost-{}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    // A dollar per input token and two per output token: the cost says which tokens counted.
    let first = format!(
        "{}price = {{ per_million_input_tokens = 1000000.0, per_million_output_tokens = 2000000.0 }}\n",
        anthropic(native.addr)
    );
    let cfg = format!(
        "[audit]\npath = {:?}\n{}",
        audit.display().to_string(),
        config(&first, backup.addr)
    );
    let gw = start(&cfg, &[("NATIVE_KEY", KEY)]).await;
    let mut body: Value = serde_json::from_str(&request(true, false)).unwrap();
    body["stream_options"] = json!({"include_usage": true});
    let r = chat(gw.addr, &body.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = events(&r.body)
        .into_iter()
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or_else(|| panic!("a usage chunk: {}", r.body));
    let (input, output) = (
        usage["prompt_tokens"].as_f64().unwrap(),
        usage["completion_tokens"].as_f64().unwrap(),
    );
    let record = common::audit_record(&audit, r.header("x-equiroute-request-id").unwrap()).await;
    let estimated = record["tokens"]["input"].as_f64().unwrap()
        + 2.0 * record["tokens"]["output"].as_f64().unwrap();
    let billed = record["cost_usd"].as_f64().unwrap();
    assert!(
        (billed - (input + 2.0 * output)).abs() < 1e-9,
        "billed {billed} for {input} in and {output} out: {record}"
    );
    assert!(
        (billed - estimated).abs() > 1e-9,
        "the estimate differs: {record}"
    );
    let _ = std::fs::remove_file(&audit);
}
