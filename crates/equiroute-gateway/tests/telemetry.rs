//! OpenTelemetry export (`[telemetry]`): the gateway's spans reach a real OTLP/HTTP receiver
//! (started here, decoding the protobuf), with the `gen_ai.*` attributes and the parent links
//! of the request, decision and attempt spans; and a collector that never answers neither
//! delays nor fails a request, its spans dropped and counted.
//!
//! Each test runs on its own single-threaded runtime with the export layer as the thread's
//! subscriber, so that the gateway it starts (on the same thread) is the only one traced.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, mock, start};
use equiroute_gateway::config::load;
use equiroute_gateway::telemetry::Telemetry;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing_subscriber::layer::SubscriberExt as _;

/// A prompt no span may carry.
const PROMPT: &str = "the-secret-prompt-7f3a";

/// An OTLP/HTTP receiver on a loopback port: every span of every `POST /v1/traces` is sent
/// to the channel, and the request's raw bytes are checked for the prompt.
async fn receiver() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Span>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
            let tx = tx.clone();
            async move {
                assert_eq!(
                    headers.get("content-type").unwrap(),
                    "application/x-protobuf"
                );
                assert!(
                    !String::from_utf8_lossy(&body).contains(PROMPT),
                    "an exported span carries the prompt"
                );
                let request = ExportTraceServiceRequest::decode(body).unwrap();
                for resource in request.resource_spans {
                    let service = resource
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|kv| kv.key == "service.name")
                        .and_then(|kv| kv.value.clone());
                    assert_eq!(
                        service.and_then(|v| v.value),
                        Some(Any::StringValue("equiroute-test".into()))
                    );
                    for scope in resource.scope_spans {
                        for span in scope.spans {
                            let _ = tx.send(span);
                        }
                    }
                }
                // An empty ExportTraceServiceResponse: full success.
                (
                    [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    (common::serve_app(app).await, rx)
}

fn config(endpoint: &str, telemetry_lines: &str, a: SocketAddr, b: SocketAddr) -> String {
    format!(
        r#"
[telemetry]
endpoint = "{endpoint}"
service_name = "equiroute-test"
{telemetry_lines}

[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "down"
base_url = "http://{a}/v1"

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "healthy"
base_url = "http://{b}/v1"
"#
    )
}

/// The export pipeline of `cfg`, installed as this thread's subscriber.
fn traced(cfg: &str) -> (Telemetry, tracing::subscriber::DefaultGuard) {
    let loaded = load(cfg, "test.toml", &|_| None).unwrap();
    let telemetry = Telemetry::start(
        loaded.telemetry.as_ref().unwrap(),
        &tokio::runtime::Handle::current(),
    )
    .unwrap();
    let subscriber = tracing_subscriber::registry().with(telemetry.layer());
    let guard = tracing::subscriber::set_default(subscriber);
    (telemetry, guard)
}

fn chat() -> String {
    json!({"model": "chat", "messages": [{"role": "user", "content": PROMPT}]}).to_string()
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Any> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn text<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(span, key) {
        Some(Any::StringValue(s)) => s,
        other => panic!("{} has {key} = {other:?}", span.name),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Any::IntValue(n)) => *n,
        other => panic!("{} has {key} = {other:?}", span.name),
    }
}

/// A traced gateway exporting every 50 ms to a receiver of the test's, with provider `a`
/// down (an outage) and `b` healthy; the fields the tests do not read keep it running.
struct Rig {
    spans: tokio::sync::mpsc::UnboundedReceiver<Span>,
    gw: common::Gateway,
    _mocks: (common::Gateway, common::Gateway),
    _telemetry: (Telemetry, tracing::subscriber::DefaultGuard),
}

impl Rig {
    async fn start() -> Rig {
        Rig::with_healthy("").await
    }

    /// The rig with `healthy` as the healthy mock's configuration.
    async fn with_healthy(healthy: &str) -> Rig {
        let (otlp, spans) = receiver().await;
        let down = mock("[models.\"down\"]\nfault = \"outage\"\n").await;
        let healthy = mock(healthy).await;
        let cfg = config(
            &format!("http://{otlp}"),
            "batch_delay_ms = 50",
            down.addr,
            healthy.addr,
        );
        let telemetry = traced(&cfg);
        let gw = start(&cfg, &[]).await;
        Rig {
            spans,
            gw,
            _mocks: (down, healthy),
            _telemetry: telemetry,
        }
    }
}

#[tokio::test]
async fn a_fallback_request_exports_request_decision_and_two_attempt_spans() {
    // Bound, not `..`: the mocks and the exporter must live to the end of the test.
    let Rig {
        mut spans,
        gw,
        _mocks,
        _telemetry,
    } = Rig::start().await;
    let reply = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-equiroute-provider"), Some("b"));

    // Wait for the request span (it ends last), keeping every span received.
    let mut got = until_request(&mut spans).await;
    // On a loaded machine an export batch can arrive after the request's: every attempt
    // span carries its number, so the highest says how many there are; wait for the rest
    // (bounded; a span that never comes fails the count below).
    let attempt_spans = |got: &[Span]| {
        let attempts = got.iter().filter(|s| s.name == "attempt");
        let seen = attempts.clone().count();
        let highest = attempts
            .filter_map(|s| match attr(s, "equiroute.attempt") {
                Some(Any::IntValue(n)) => usize::try_from(*n).ok(),
                _ => None,
            })
            .max();
        (seen, highest.map_or(0, |n| n + 1))
    };
    loop {
        let (seen, numbered) = attempt_spans(&got);
        if seen >= numbered {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(10), spans.recv()).await {
            Ok(Some(span)) => got.push(span),
            _ => break,
        }
    }
    let request = got.iter().find(|s| s.name == "request").unwrap();
    assert!(
        request.parent_span_id.is_empty(),
        "the request span is a root"
    );
    assert_eq!(text(request, "gen_ai.operation.name"), "chat");
    assert_eq!(text(request, "gen_ai.request.model"), "chat");
    assert_eq!(text(request, "gen_ai.response.model"), "healthy");
    assert_eq!(text(request, "gen_ai.provider.name"), "openai");
    assert_eq!(text(request, "equiroute.outcome"), "ok");
    assert!(attr(request, "equiroute.fallback_reason").is_some());
    let request_id = text(request, "request_id");
    assert_eq!(reply.header("x-equiroute-request-id"), Some(request_id));

    let children = |name: &str| -> Vec<&Span> {
        got.iter()
            .filter(|s| s.name == name)
            .inspect(|s| {
                assert_eq!(
                    s.trace_id, request.trace_id,
                    "{name} is in the request's trace"
                );
                assert_eq!(
                    s.parent_span_id, request.span_id,
                    "{name} is the request's child"
                );
            })
            .collect()
    };
    let decision = children("decision");
    assert_eq!(decision.len(), 1);
    assert_eq!(text(decision[0], "equiroute.candidates"), "a,b");
    assert_eq!(text(decision[0], "equiroute.chosen"), "a");
    assert_eq!(text(decision[0], "equiroute.policy"), "static");
    assert!(text(decision[0], "equiroute.scores").starts_with("a="));

    let attempts = children("attempt");
    let providers: Vec<&str> = attempts
        .iter()
        .map(|s| text(s, "equiroute.provider"))
        .collect();
    assert!(
        attempts.len() >= 2 && providers.first() == Some(&"a") && providers.last() == Some(&"b"),
        "attempts on {providers:?}"
    );
    let (failed, answered) = (attempts[0], attempts[attempts.len() - 1]);
    assert_ne!(text(failed, "equiroute.outcome"), "ok");
    assert_eq!(text(failed, "gen_ai.request.model"), "down");
    assert_eq!(text(answered, "equiroute.outcome"), "ok");
    assert_eq!(text(answered, "gen_ai.provider.name"), "openai");
    assert_eq!(text(answered, "gen_ai.response.model"), "healthy");
    // The mock's OpenAI answer reports 3 prompt and 2 completion tokens.
    assert_eq!(int(answered, "gen_ai.usage.input_tokens"), 3);
    assert_eq!(int(answered, "gen_ai.usage.output_tokens"), 2);
    assert_eq!(
        int(answered, "equiroute.attempt"),
        i64::try_from(attempts.len()).unwrap() - 1
    );
    assert!(answered.start_time_unix_nano >= failed.end_time_unix_nano);
}

#[tokio::test]
async fn a_collector_that_never_answers_neither_delays_nor_fails_requests() {
    // A socket that is listened on but never accepted: connections open, exports hang.
    let black_hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = mock("[models.\"down\"]\nfault = \"outage\"\n").await;
    let healthy = mock("").await;
    let cfg = config(
        &format!("http://{}", black_hole.local_addr().unwrap()),
        "queue_size = 4\nbatch_size = 2\nbatch_delay_ms = 10\nexport_timeout_ms = 200",
        down.addr,
        healthy.addr,
    );
    let (_telemetry, _guard) = traced(&cfg);
    let gw = start(&cfg, &[]).await;
    let started = Instant::now();
    for _ in 0..40 {
        let reply = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    // 40 requests on loopback mocks: far under a second each even on a loaded machine,
    // whereas one waiting on the collector would take the export timeout or forever.
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "{:?}",
        started.elapsed()
    );
    // Over 160 spans into a queue of 4 behind a hung export: most are dropped, and counted.
    let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    assert!(value("equiroute_trace_spans_dropped_total") > 0);
    // The hung export is abandoned at its timeout and counted as a failure.
    let waited = Instant::now();
    loop {
        let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
        let failures: u64 = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix("equiroute_trace_export_failures_total")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap();
        if failures > 0 {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "no export failure counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(black_hole);
}

/// Every span received up to the request span, and those that arrive within 500 ms after it.
/// The request span ends last, but the exporter sends in batches, and a batch holding an
/// earlier attempt can reach the receiver after the one holding the request span (seen once
/// in six runs: the first attempt's span was missing when the test read them).
async fn until_request(spans: &mut tokio::sync::mpsc::UnboundedReceiver<Span>) -> Vec<Span> {
    let mut got: Vec<Span> = Vec::new();
    while !got.iter().any(|s| s.name == "request") {
        let span = tokio::time::timeout(Duration::from_secs(30), spans.recv())
            .await
            .expect("no request span within 30 s")
            .unwrap();
        got.push(span);
    }
    while let Ok(Some(span)) = tokio::time::timeout(Duration::from_millis(500), spans.recv()).await
    {
        got.push(span);
    }
    got
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[tokio::test]
async fn a_request_with_traceparent_continues_the_clients_trace_and_a_malformed_one_is_ignored() {
    // Bound, not `..`: the mocks and the exporter must live to the end of the test.
    let Rig {
        mut spans,
        gw,
        _mocks,
        _telemetry,
    } = Rig::start().await;
    // The W3C example: version 00, trace id, the client's span id, sampled.
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{trace}-{parent}-01");
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("tracestate", "vendor=opaque"),
    ];
    let reply = http(gw.addr, "POST", "/v1/chat/completions", &headers, &chat()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let got = until_request(&mut spans).await;
    let request = got.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(hex(&request.trace_id), trace, "the client's trace");
    assert_eq!(
        hex(&request.parent_span_id),
        parent,
        "the client's span is the parent"
    );
    assert_eq!(request.trace_state, "vendor=opaque");
    for child in got.iter().filter(|s| s.name != "request") {
        assert_eq!(
            hex(&child.trace_id),
            trace,
            "{} in the client's trace",
            child.name
        );
    }

    // Malformed: a bad version, a short id, an all-zero trace id. Each is answered as usual
    // and its request span is a root of a trace of its own.
    for bad in [
        format!("ff-{trace}-{parent}-01"),
        format!("00-{}-{parent}-01", &trace[..20]),
        format!("00-{}-{parent}-01", "0".repeat(32)),
        "not a traceparent".to_owned(),
    ] {
        let headers = [("traceparent", bad.as_str())];
        let reply = http(gw.addr, "POST", "/v1/chat/completions", &headers, &chat()).await;
        assert_eq!(reply.status, 200, "{bad}: {}", reply.body);
        let got = until_request(&mut spans).await;
        let request = got.iter().find(|s| s.name == "request").unwrap();
        assert!(request.parent_span_id.is_empty(), "{bad}: a root span");
        assert_ne!(hex(&request.trace_id), trace, "{bad}");
    }
}

#[tokio::test]
async fn a_streamed_attempts_span_ends_with_its_stream_and_carries_its_usage() {
    // Bound, not `..`: the mocks and the exporter must live to the end of the test.
    let Rig {
        mut spans,
        gw,
        _mocks,
        _telemetry,
    } = Rig::with_healthy("[models.\"healthy\"]\nchunk_gap_ms = 150\n").await;
    let body = json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": PROMPT}]});
    let reply = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &body.to_string(),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("[DONE]"), "{}", reply.body);
    let got = until_request(&mut spans).await;
    let request = got.iter().find(|s| s.name == "request").unwrap();
    let attempts: Vec<&Span> = got.iter().filter(|s| s.name == "attempt").collect();
    let relayed = attempts
        .iter()
        .find(|s| text(s, "equiroute.provider") == "b")
        .unwrap_or_else(|| panic!("no attempt on b in {attempts:?}"));
    assert_eq!(relayed.parent_span_id, request.span_id);
    // Its outcome is the stream's end, not "streaming" at the commit.
    assert_eq!(text(relayed, "equiroute.outcome"), "ok");
    assert_eq!(int(relayed, "gen_ai.usage.input_tokens"), 3);
    assert_eq!(int(relayed, "gen_ai.usage.output_tokens"), 2);
    let ttfb = match attr(relayed, "equiroute.ttfb_ms") {
        Some(Any::DoubleValue(ms)) => *ms,
        other => panic!("ttfb_ms = {other:?}"),
    };
    // Six events 150 ms apart after the first byte: the span lasts past the last one.
    let lasted_ms =
        (relayed.end_time_unix_nano - relayed.start_time_unix_nano) as f64 / 1_000_000.0;
    assert!(
        lasted_ms >= ttfb + 600.0,
        "the attempt span lasted {lasted_ms} ms with its first byte at {ttfb} ms"
    );

    let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    for token_type in ["input", "output"] {
        let series = format!(
            r#"equiroute_provider_tokens_count{{interface="chat",provider="b",token_type="{token_type}"}} 1"#
        );
        assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    }
}
