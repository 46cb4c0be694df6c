//! Secrets and private text at the boundaries: an upstream that echoes the credential it
//! received and the prompt, in its error bodies and its response headers (as some providers,
//! self-hosted servers and proxies do), for a 5xx, a 400, a content-filter refusal and an
//! error in the middle of a stream, behind the `openai` and the `anthropic` provider kinds.
//! No client answer, no log line at any level, no exported span and no audit record carries a
//! credential; the prompt appears in no log line above `debug`.
//!
//! The test runs on its own single-threaded runtime with a JSON log subscriber (every level
//! down to `debug`) and the OTLP export layer as the thread's subscriber, so that the gateway
//! it starts (on the same thread) is the only one logged and traced.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use bytes::Bytes;
use common::{http, start, Lines};
use equiroute_gateway::config::load;
use equiroute_gateway::telemetry::Telemetry;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::Layer as _;

/// The OpenAI-kind provider's key: no known credential shape, so only the configured
/// secret's value can catch it.
const OPENAI_KEY: &str = "opaque-openai-credential-5c1d9e";
/// The Anthropic-kind provider's key, in Anthropic's shape.
const ANTHROPIC_KEY: &str = "sk-ant-api03-Zx8Qv2Lm7Np4Rt6Yw1";
/// The gateway's own key (clients send it; no upstream ever should).
const GATEWAY_KEY: &str = "gateway-key-77a1c3e9f0";
const PROMPT: &str = "my-private-prompt-4b8e";

/// The echoing upstream: the model names what it does.
///
/// - `fail`: 500; `reject`: 400; `filter`: a content-filter refusal (OpenAI's 400 with
///   `code = content_filter`, Anthropic's 200 with `stop_reason = refusal`); `midstream`: a
///   stream whose second event is an error.
///
/// Every error message quotes the credential headers it received, the bare credential and
/// the whole request body (the prompt); every response carries them in headers too.
async fn echo(headers: HeaderMap, body: Bytes) -> axum::response::Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (auth, key) = (header("authorization"), header("x-api-key"));
    let bare = auth.strip_prefix("Bearer ").unwrap_or(&key).to_owned();
    let sent = String::from_utf8_lossy(&body).into_owned();
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let model = request["model"].as_str().unwrap_or_default();
    let anthropic = !key.is_empty();
    let message = format!(
        "refused. Authorization: {auth}; x-api-key: {key}; credential ({bare}) rejected; you sent {sent}"
    );
    let error = |code: Option<&str>| {
        if anthropic {
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
        } else {
            json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}})
        }
    };
    let echoed = [
        ("x-echo-credential", bare.clone()),
        ("x-echo-authorization", format!("{auth}{key}")),
        ("x-echo-prompt", PROMPT.to_owned()),
    ];
    let json_reply =
        |status: StatusCode, v: Value| (status, echoed.clone(), axum::Json(v)).into_response();
    match model {
        "fail" => json_reply(StatusCode::INTERNAL_SERVER_ERROR, error(None)),
        "reject" => json_reply(StatusCode::BAD_REQUEST, error(None)),
        "filter" if anthropic => json_reply(
            StatusCode::OK,
            json!({"id": "msg", "type": "message", "role": "assistant", "model": "filter",
                   "content": [], "stop_reason": "refusal", "stop_sequence": null,
                   "usage": {"input_tokens": 1, "output_tokens": 0}}),
        ),
        "filter" => json_reply(StatusCode::BAD_REQUEST, error(Some("content_filter"))),
        _ => {
            // `midstream`: a first chunk, then an error event quoting it all.
            let first = json!({"id": "c", "object": "chat.completion.chunk", "model": "midstream",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": null}]});
            let events = format!("data: {first}\n\ndata: {}\n\n", error(None));
            let mut headers = echoed.to_vec();
            headers.push(("content-type", "text/event-stream".to_owned()));
            let mut resp = events.into_response();
            for (k, v) in headers {
                resp.headers_mut().insert(k, v.parse().unwrap());
            }
            resp
        }
    }
}

async fn echoing_upstream() -> SocketAddr {
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(echo))
        .route("/v1/messages", axum::routing::post(echo));
    common::serve_app(app).await
}

/// An OTLP/HTTP receiver keeping each export's raw bytes.
async fn span_receiver() -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let exported = Arc::new(Mutex::new(Vec::new()));
    let keep = exported.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            keep.lock().unwrap().extend_from_slice(&body);
            async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    (common::serve_app(app).await, exported)
}

fn config(upstream: SocketAddr, otlp: SocketAddr, audit: &std::path::Path) -> String {
    let audit = audit.display().to_string();
    let mut text = format!(
        r#"
[server]
api_keys_env = ["GW_KEY"]

[audit]
path = {audit:?}

[telemetry]
endpoint = "http://{otlp}"
service_name = "equiroute-redaction"
batch_delay_ms = 50
"#
    );
    for (kind, key_env) in [("openai", "OA_KEY"), ("anthropic", "AN_KEY")] {
        for model in ["fail", "reject", "filter", "midstream"] {
            let _ = write!(
                text,
                r#"
[interfaces.{kind}_{model}]
kind = "chat"

[[interfaces.{kind}_{model}.providers]]
id = "{kind}-{model}"
kind = "{kind}"
model = "{model}"
base_url = "http://{upstream}/v1"
api_key_env = "{key_env}"
"#
            );
        }
    }
    text
}

#[tokio::test]
async fn an_upstream_echoing_its_credential_and_the_prompt_leaks_neither_key_nor_prompt_above_debug(
) {
    let upstream = echoing_upstream().await;
    let (otlp, exported) = span_receiver().await;
    let audit =
        std::env::temp_dir().join(format!("equiroute-redaction-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&audit);
    let cfg = config(upstream, otlp, &audit);
    let env = [
        ("OA_KEY", OPENAI_KEY),
        ("AN_KEY", ANTHROPIC_KEY),
        ("GW_KEY", GATEWAY_KEY),
    ];
    let lookup = |name: &str| {
        env.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    };
    let (_telemetry, logs, _guard) = observed(&cfg, &lookup);
    let gw = start(&cfg, &env).await;

    let secrets = [OPENAI_KEY, ANTHROPIC_KEY, GATEWAY_KEY];
    let auth = format!("Bearer {GATEWAY_KEY}");
    let mut ids = Vec::new();
    let mut answers = String::new();
    for kind in ["openai", "anthropic"] {
        for (model, stream, status, code) in [
            ("fail", false, 502, "all_providers_failed"),
            ("fail", true, 502, "all_providers_failed"),
            ("reject", false, 400, "upstream_rejected_request"),
            ("filter", false, 400, "content_filter"),
            ("midstream", true, 200, "stream_broken"),
        ] {
            let body = json!({"model": format!("{kind}_{model}"), "stream": stream,
                "messages": [{"role": "user", "content": PROMPT}]});
            let r = http(
                gw.addr,
                "POST",
                "/v1/chat/completions",
                &[("authorization", &auth)],
                &body.to_string(),
            )
            .await;
            let what = format!("{kind} {model} (stream: {stream})");
            assert_eq!(r.status, status, "{what}: {}", r.body);
            assert!(r.body.contains(code), "{what}: {}", r.body);
            let whole = format!("{:?}\n{}", r.headers, r.body);
            for secret in secrets {
                assert!(
                    !whole.contains(secret),
                    "{what}: the answer has a key: {whole}"
                );
            }
            ids.push(r.header("x-equiroute-request-id").unwrap().to_owned());
            answers.push_str(&whole);
        }
    }
    // The provider's words reach the client (redacted): the OpenAI 400 quoted the prompt,
    // which the client itself sent, and the keys' places are marked.
    assert!(answers.contains(PROMPT), "{answers}");
    assert!(answers.contains("<redacted>"), "{answers}");

    // The audit log: every request's record, none with a key.
    for id in &ids {
        common::audit_record(&audit, id).await;
    }
    let audited = std::fs::read_to_string(&audit).unwrap();
    for secret in secrets {
        assert!(!audited.contains(secret), "the audit log has a key");
    }

    // The exported spans: wait until every request's span arrived.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let spans = String::from_utf8_lossy(&exported.lock().unwrap()).into_owned();
        if ids.iter().all(|id| spans.contains(id.as_str())) {
            for secret in secrets.iter().chain([&PROMPT]) {
                assert!(!spans.contains(secret), "an exported span has {secret}");
            }
            break;
        }
        assert!(
            Instant::now() < until,
            "not every request's span was exported"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The logs: no key at any level; the prompt at debug only, and only there the
    // provider's (redacted) words.
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    check_logs(&text, &secrets);
    drop(gw);
    let _ = std::fs::remove_file(&audit);
}

/// The export pipeline of `cfg` and a JSON log of every event down to `debug`, installed as
/// this thread's subscriber.
fn observed(
    cfg: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> (Telemetry, Lines, tracing::subscriber::DefaultGuard) {
    let loaded = load(cfg, "test.toml", env).unwrap();
    let telemetry = Telemetry::start(
        loaded.telemetry.as_ref().unwrap(),
        &tokio::runtime::Handle::current(),
    )
    .unwrap();
    let logs = Lines::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::registry().with(telemetry.layer()).with(
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(move || writer.clone())
            .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
    );
    let guard = tracing::subscriber::set_default(subscriber);
    (telemetry, logs, guard)
}

/// No line of `text` has a secret; the prompt is in debug lines only, and is there (the
/// provider's words are kept at debug); each failed request is logged once above debug.
fn check_logs(text: &str, secrets: &[&str]) {
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let mut debug_quotes_prompt = false;
    for (line, raw) in lines.iter().zip(text.lines()) {
        for secret in secrets {
            assert!(!raw.contains(secret), "a log line has a key: {raw}");
        }
        match line["level"].as_str().unwrap() {
            "DEBUG" | "TRACE" => debug_quotes_prompt |= raw.contains(PROMPT),
            _ => assert!(
                !raw.contains(PROMPT),
                "the prompt is logged above debug: {raw}"
            ),
        }
    }
    let said = |message: &str| {
        lines
            .iter()
            .filter(|l| l["fields"]["message"] == message)
            .count()
    };
    // Each failed request logged once, at info or warn, without the provider's words.
    assert_eq!(said("request rejected by the provider"), 4, "{text}");
    assert_eq!(said("request failed"), 4, "{text}");
    assert!(
        debug_quotes_prompt,
        "the provider's words are kept at debug: {text}"
    );
}
