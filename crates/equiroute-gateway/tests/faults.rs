//! Each fault of the mock upstream's library, played by a primary provider with a healthy
//! fallback behind it (`static` policy: the primary is tried first), through the gateway:
//! what the client sees, the attempts made (the routing header and the mock's per-model
//! counts), the breaker and the provider statistics (the state route, the metrics) and the
//! audit record.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{audit_record, calls, http, mock, start, streamed_text, Gateway, Reply};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The primary's price per call (billed attempts cost this much) and the fallback's.
const PRICE_A: f64 = 0.01;
const PRICE_B: f64 = 0.001;

/// A gateway whose provider `a` (model `fault`, on a mock playing that fault) comes first and
/// whose provider `b` (model `healthy`, on a healthy mock) is the fallback.
struct Rig {
    faulty: Gateway,
    healthy: Gateway,
    gw: Gateway,
    audit: PathBuf,
}

/// Rigs made so far: one audit file each (tests run at once, several play the same fault).
static RIGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `fault_lines` go into the fault's `[models."FAULT"]` table; `iface_lines` into the chat
/// interface's table.
async fn rig(fault: &str, fault_lines: &str, iface_lines: &str) -> Rig {
    rig_onto(fault, fault_lines, iface_lines, Fallback::default()).await
}

/// The fallback `b` of a rig: its provider kind and its mock's profile.
struct Fallback {
    kind: &'static str,
    profile: &'static str,
}

impl Default for Fallback {
    fn default() -> Self {
        Fallback {
            kind: "openai",
            profile: "",
        }
    }
}

/// [`rig`] with `b` of another kind, or on a mock with faults of its own.
async fn rig_onto(fault: &str, fault_lines: &str, iface_lines: &str, b: Fallback) -> Rig {
    let faulty = mock(&format!(
        "[models.\"{fault}\"]\nfault = \"{fault}\"\n{fault_lines}\n"
    ))
    .await;
    let healthy = mock(b.profile).await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-faults-{}-{fault}-{}.jsonl",
        std::process::id(),
        RIGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&audit);
    let cfg = format!(
        r#"
[audit]
path = {audit:?}

[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}
deadline_ms = 3000
stream_idle_ms = 300
{iface_lines}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "{fault}"
base_url = "http://{}/v1"
price = {{ per_call = {PRICE_A} }}

[[interfaces.chat.providers]]
id = "b"
kind = "{b_kind}"
model = "healthy"
base_url = "http://{}/v1"
price = {{ per_call = {PRICE_B} }}
"#,
        faulty.addr,
        healthy.addr,
        audit = audit.display().to_string(),
        b_kind = b.kind,
    );
    let gw = start(&cfg, &[]).await;
    Rig {
        faulty,
        healthy,
        gw,
        audit,
    }
}

fn chat_body(stream: bool) -> String {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

impl Rig {
    async fn chat(&self) -> Reply {
        http(
            self.gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_body(false),
        )
        .await
    }
    async fn stream(&self) -> Reply {
        self.stream_with(&[]).await
    }
    async fn stream_with(&self, headers: &[(&str, &str)]) -> Reply {
        http(
            self.gw.addr,
            "POST",
            "/v1/chat/completions",
            headers,
            &chat_body(true),
        )
        .await
    }
    /// Calls the faulty mock received for the fault's model.
    async fn faulty_calls(&self, model: &str) -> u64 {
        calls(self.faulty.addr, model).await
    }
    async fn healthy_calls(&self) -> u64 {
        calls(self.healthy.addr, "healthy").await
    }
    /// The breaker state of provider `id` (`closed`, `open`, `half_open`).
    async fn breaker(&self, id: &str) -> String {
        let state = http(self.gw.addr, "GET", "/v1/interfaces/chat/state", &[], "")
            .await
            .json();
        let c = state["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap()
            .clone();
        c["breaker"]["state"].as_str().unwrap().to_owned()
    }
    /// `equiroute_attempts_total` of provider `id` with `status`.
    async fn attempts_metric(&self, id: &str, status: &str) -> u64 {
        let m = http(self.gw.addr, "GET", "/metrics", &[], "").await.body;
        let key = format!(
            "equiroute_attempts_total{{interface=\"chat\",provider=\"{id}\",status=\"{status}\"}} "
        );
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map_or(0, |v| v.trim().parse().unwrap())
    }
    /// The audit record of the request `reply` answered (waits for the writer, bounded).
    async fn audit_of(&self, reply: &Reply) -> Value {
        let id = reply.header("x-equiroute-request-id").unwrap();
        audit_record(&self.audit, id).await
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.audit);
    }
}

/// The audit record's attempts as `(provider, status, cost)`.
fn attempts(record: &Value) -> Vec<(String, String, f64)> {
    record["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["provider"].as_str().unwrap().to_owned(),
                a["status"].as_str().unwrap().to_owned(),
                a["cost_usd"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

/// Asserts an answer from `b` after a failed attempt on `a`, with the routing header.
fn assert_fell_over(r: &Reply) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (Some("b"), Some("2")),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn a_429_with_retry_after_falls_over_unbilled_and_rests_the_provider() {
    let rig = rig("rate_limited", "retry_after_s = 30", "").await;
    let r = rig.chat().await;
    assert_fell_over(&r);
    assert_eq!(r.json()["model"], "healthy");
    let record = rig.audit_of(&r).await;
    assert_eq!(
        attempts(&record)
            .iter()
            .map(|(p, s, _)| (p.as_str(), s.as_str()))
            .collect::<Vec<_>>(),
        [("a", "provider_error"), ("b", "ok")]
    );
    // A 429 is not billed; the request costs the fallback's answer only.
    assert!(close(attempts(&record)[0].2, 0.0));
    assert!(close(record["cost_usd"].as_f64().unwrap(), PRICE_B));
    assert_eq!(record["fallback_reason"], "provider_error");
    assert_eq!(rig.breaker("a").await, "open", "open for the Retry-After");
    // Resting: the next requests go straight to b, a is not called again.
    let r = rig.chat().await;
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    assert_eq!(rig.faulty_calls("rate_limited").await, 1);
    assert_eq!(rig.healthy_calls().await, 2);
}

#[tokio::test]
async fn a_persistent_429_without_retry_after_opens_the_breaker_after_its_threshold() {
    let rig = rig(
        "rate_limited_no_retry_after",
        "",
        "breaker = { consecutive_failures = 3 }",
    )
    .await;
    for n in 1..=3 {
        let r = rig.chat().await;
        assert_fell_over(&r);
        // Closed until the third failure in a row.
        let want = if n < 3 { "closed" } else { "open" };
        assert_eq!(rig.breaker("a").await, want, "after {n} failures");
    }
    let r = rig.chat().await;
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    assert_eq!(rig.faulty_calls("rate_limited_no_retry_after").await, 3);
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 3);
    assert_eq!(rig.attempts_metric("b", "ok").await, 4);
}

/// The audit record's attempts as `(provider, status, retry)`.
fn tries(record: &Value) -> Vec<(String, String, Option<String>)> {
    record["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["provider"].as_str().unwrap().to_owned(),
                a["status"].as_str().unwrap().to_owned(),
                a["retry"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

fn t(provider: &str, status: &str, retry: Option<&str>) -> (String, String, Option<String>) {
    (
        provider.to_owned(),
        status.to_owned(),
        retry.map(str::to_owned),
    )
}

#[tokio::test]
async fn a_500_once_is_retried_once_on_the_same_provider_billed() {
    let rig = rig("error_500_once", "", "").await;
    let first = rig.chat().await;
    // One jittered retry of the best-ranked provider, not a fall over to a worse one.
    assert_eq!(
        first.routed(),
        (200, Some("a"), Some("2")),
        "{}",
        first.body
    );
    let record = rig.audit_of(&first).await;
    assert_eq!(
        tries(&record),
        [
            t("a", "provider_error", None),
            t("a", "ok", Some("server_error"))
        ]
    );
    // A 5xx is billed: the request's cost counts the failed attempt.
    let costs: Vec<f64> = attempts(&record).iter().map(|a| a.2).collect();
    assert_eq!(costs, [PRICE_A, PRICE_A]);
    assert!(close(record["cost_usd"].as_f64().unwrap(), 2.0 * PRICE_A));
    let second = rig.chat().await;
    assert_eq!(second.routed(), (200, Some("a"), Some("1")));
    assert_eq!(rig.faulty_calls("error_500_once").await, 3);
    assert_eq!(rig.healthy_calls().await, 0);
    assert_eq!(
        rig.breaker("a").await,
        "closed",
        "one failure opens nothing"
    );
    assert_eq!(rig.attempts_metric("a", "ok").await, 2);
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 1);
}

#[tokio::test]
async fn a_persistent_503_is_retried_once_then_falls_over_until_the_breaker_opens() {
    let rig = rig("unavailable", "", "breaker = { consecutive_failures = 2 }").await;
    let r = rig.chat().await;
    assert_eq!(r.routed(), (200, Some("b"), Some("3")), "{}", r.body);
    let record = rig.audit_of(&r).await;
    assert_eq!(
        tries(&record),
        [
            t("a", "provider_error", None),
            t("a", "provider_error", Some("server_error")),
            t("b", "ok", None)
        ]
    );
    // Two failures in a row: open; the next request goes straight to b.
    assert_eq!(rig.breaker("a").await, "open");
    assert_eq!(rig.chat().await.header("x-equiroute-attempts"), Some("1"));
    assert_eq!(rig.faulty_calls("unavailable").await, 2);
}

#[tokio::test]
async fn a_short_retry_after_on_the_best_provider_is_waited_out_once() {
    let rig = rig("rate_limited", "retry_after_s = 0.2", "").await;
    let began = Instant::now();
    let r = rig.chat().await;
    assert!(
        began.elapsed() >= Duration::from_millis(200),
        "{:?}",
        began.elapsed()
    );
    // The mock keeps refusing: after the one retry, b.
    assert_eq!(r.routed(), (200, Some("b"), Some("3")), "{}", r.body);
    let record = rig.audit_of(&r).await;
    assert_eq!(
        tries(&record),
        [
            t("a", "provider_error", None),
            t("a", "provider_error", Some("retry_after")),
            t("b", "ok", None)
        ]
    );
    assert_eq!(rig.faulty_calls("rate_limited").await, 2);
}

#[tokio::test]
async fn a_connection_reset_before_headers_falls_over_unbilled() {
    let rig = rig("reset", "", "").await;
    let r = rig.chat().await;
    assert_fell_over(&r);
    let record = rig.audit_of(&r).await;
    let tried = attempts(&record);
    assert_eq!((tried[0].1.as_str(), tried[0].2), ("provider_error", 0.0));
    // The mock received the request (it counts before it resets).
    assert_eq!(rig.faulty_calls("reset").await, 1);
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 1);
    // Streamed, the same: nothing was sent before the reset.
    let s = rig.stream().await;
    assert_eq!(s.routed(), (200, Some("b"), Some("2")));
    assert_eq!(s.body, equiroute_mock::stream_chunks("healthy").concat());
}

#[tokio::test]
async fn a_provider_that_never_answers_times_out_and_falls_over_within_the_deadline() {
    let rig = rig("no_answer", "", "attempt_timeout_ms = 200").await;
    let t = Instant::now();
    let r = rig.chat().await;
    assert_fell_over(&r);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let record = rig.audit_of(&r).await;
    let tried = attempts(&record);
    assert_eq!(tried[0].1, "timeout");
    assert_eq!(record["fallback_reason"], "timeout");
    // A timeout is censored latency for the policy, not a health failure.
    assert_eq!(rig.breaker("a").await, "closed");
    assert_eq!(rig.faulty_calls("no_answer").await, 1);
}

#[tokio::test]
async fn a_slow_first_token_falls_over_before_anything_is_sent() {
    let rig = rig(
        "slow_first_token",
        "first_token_delay_ms = 3000",
        "attempt_timeout_ms = 200",
    )
    .await;
    let t = Instant::now();
    let r = rig.stream().await;
    assert_fell_over(&r);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // Only the fallback's stream reached the client.
    assert_eq!(r.body, equiroute_mock::stream_chunks("healthy").concat());
    // The streamed request's audit record lists both attempts.
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(
        attempts(&record)
            .iter()
            .map(|(p, s, _)| (p.as_str(), s.as_str()))
            .collect::<Vec<_>>(),
        [("a", "timeout"), ("b", "ok")]
    );
    assert_eq!(rig.faulty_calls("slow_first_token").await, 1);
}

/// Asserts a stream committed to `a` that broke: what `a` sent first, then the error event,
/// never `[DONE]`; counted against `a`; the audit says so.
async fn assert_broken_stream(rig: &Rig, fault: &str, r: &Reply) {
    assert_eq!(r.status, 200, "committed before it broke");
    assert_eq!(
        (
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (Some("a"), Some("1"))
    );
    let chunks = equiroute_mock::stream_chunks(fault);
    assert!(r.body.starts_with(&chunks[0]), "{}", r.body);
    assert!(r.body.contains("\"code\":\"stream_broken\""), "{}", r.body);
    assert!(
        !r.body.contains("data: [DONE]"),
        "{fault}: must not look complete: {}",
        r.body
    );
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 1);
    assert_eq!(rig.attempts_metric("a", "ok").await, 0);
    let record = rig.audit_of(r).await;
    assert_eq!(record["outcome"], "failed", "{record}");
    let tried = attempts(&record);
    assert_eq!(tried.len(), 1);
    // Bytes were produced: the broken attempt is billed.
    assert_eq!(
        (tried[0].1.as_str(), tried[0].2),
        ("provider_error", PRICE_A)
    );
    assert_eq!(
        rig.healthy_calls().await,
        0,
        "a committed stream is not retried"
    );
}

#[tokio::test]
async fn a_stream_cut_mid_answer_ends_in_an_error_event() {
    let rig = rig("stream_cut", "", "").await;
    let r = rig.stream().await;
    assert_broken_stream(&rig, "stream_cut", &r).await;
}

/// Asserts a stream that failed while held fell back invisibly: the client got exactly `b`'s
/// stream; `a`'s attempt is a billed provider error, counted against it, `b` answered.
async fn assert_fell_back_while_held(rig: &Rig, fault: &str, r: &Reply) {
    assert_fell_over(r);
    assert_eq!(
        r.body,
        equiroute_mock::stream_chunks("healthy").concat(),
        "{fault}: only b's stream reaches the client"
    );
    let record = rig.audit_of(r).await;
    assert_eq!(record["outcome"], "ok", "{record}");
    assert_eq!(
        attempts(&record),
        [
            ("a".to_owned(), "provider_error".to_owned(), PRICE_A),
            ("b".to_owned(), "ok".to_owned(), PRICE_B)
        ],
        "{fault}"
    );
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 1);
    assert_eq!(
        rig.faulty_calls(fault).await,
        1,
        "{fault}: a is not retried"
    );
}

#[tokio::test]
async fn a_stream_that_breaks_while_held_falls_back_invisibly() {
    for fault in [
        "stream_cut",
        "malformed_chunk",
        "stream_stall",
        "no_done_unfinished",
    ] {
        let rig = rig(fault, "", "stream_hold = { ms = 2000 }").await;
        let r = rig.stream().await;
        assert_fell_back_while_held(&rig, fault, &r).await;
    }
}

#[tokio::test]
async fn with_defaults_a_stream_that_breaks_before_content_falls_back_invisibly() {
    // Only providers declared. `a` sends its role chunk (no content) and then breaks, stalls
    // (past stream_idle_ms) or sends a malformed event: held, so the client sees b alone.
    for (fault, lines) in [
        ("stream_cut", "stream_cut_after = 1"),
        ("stream_stall", "stream_stall_after = 1"),
    ] {
        let rig = rig(fault, lines, "").await;
        let r = rig.stream().await;
        assert_fell_back_while_held(&rig, fault, &r).await;
    }
}

#[tokio::test]
async fn with_defaults_a_healthy_stream_is_sent_from_its_first_content_token() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The hold keeps only the role chunk: the first content chunk leaves the gateway when it
    // arrives, not after the answer (chunks 250 ms apart; the first content at about 250 ms).
    let rig = rig(
        "slow_first_token",
        "first_token_delay_ms = 1\nchunk_gap_ms = 250",
        "",
    )
    .await;
    let started = Instant::now();
    let mut conn = tokio::net::TcpStream::connect(rig.gw.addr).await.unwrap();
    let body = chat_body(true);
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"mock \"") {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let first_token = started.elapsed();
    // The whole answer takes 5 gaps (1.25 s); its first token came with the second chunk.
    assert!(first_token < Duration::from_millis(700), "{first_token:?}");
    assert!(
        !String::from_utf8_lossy(&seen).contains("streamed"),
        "the rest came later"
    );
}

#[tokio::test]
async fn with_defaults_a_stream_cut_after_content_goes_on_from_its_prefix() {
    // Only providers declared; `b` takes a prefill (Anthropic): the joined text is one answer.
    for fault in ["stream_cut", "malformed_chunk"] {
        let b = Fallback {
            kind: "anthropic",
            profile: "",
        };
        let rig = rig_onto(fault, "", "", b).await;
        let r = rig.stream().await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.ends_with("data: [DONE]\n\n"), "{fault}: {}", r.body);
        let (text, markers) = streamed_text(&r.body);
        assert_eq!(text, "mock streamed answer", "{fault}: {}", r.body);
        assert_eq!(markers[0]["event"], "continue", "{fault}");
        assert_eq!(continuations_metric(&rig, "prefix").await, 1, "{fault}");
    }
}

#[tokio::test]
async fn a_stream_that_breaks_after_its_hold_still_ends_in_an_error_event() {
    // Held for one data event only: the cut after the second reaches the client as a cut.
    let rig = rig("stream_cut", "", "stream_hold = { ms = 2000, events = 1 }").await;
    let r = rig.stream().await;
    assert_broken_stream(&rig, "stream_cut", &r).await;
}

/// `equiroute_stream_continuations_total` of `mode`.
async fn continuations_metric(rig: &Rig, mode: &str) -> u64 {
    let m = http(rig.gw.addr, "GET", "/metrics", &[], "").await.body;
    let key =
        format!("equiroute_stream_continuations_total{{interface=\"chat\",mode=\"{mode}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn a_stream_cut_after_commit_is_continued_from_its_prefix_on_a_provider_that_takes_prefill() {
    // `a` is cut after its role chunk and "mock ": `b` (Anthropic's Messages, which takes a
    // prefill by default) gets the request with "mock" as the last assistant message.
    let b = Fallback {
        kind: "anthropic",
        profile: "",
    };
    let rig = rig_onto("stream_cut", "", "stream_resume = { mode = \"prefix\" }", b).await;
    let r = rig.stream().await;
    assert_eq!(r.status, 200);
    // Committed to `a`: its headers stand; the marker says who continued.
    assert_eq!(r.header("x-equiroute-provider"), Some("a"));
    let a_sent = equiroute_mock::stream_chunks("stream_cut")[..2].concat();
    assert!(r.body.starts_with(&a_sent), "{}", r.body);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    assert!(!r.body.contains("stream_broken"), "{}", r.body);
    let (text, markers) = streamed_text(&r.body);
    // a's "mock ", then b's continuation of "mock" (" streamed answer", the mock goes on from
    // a prefill), its leading space dropped as the client has it: one answer.
    assert_eq!(text, "mock streamed answer");
    assert_eq!(markers.len(), 1, "{}", r.body);
    assert_eq!(
        (
            &markers[0]["event"],
            &markers[0]["from"],
            &markers[0]["provider"]
        ),
        (&json!("continue"), &json!("a"), &json!("b"))
    );
    assert!(r.body.contains("\n: equiroute continue:"), "{}", r.body);
    // What b received: the conversation, then the partial answer as the assistant's turn.
    let stats = http(rig.healthy.addr, "GET", "/_stats", &[], "")
        .await
        .json();
    let messages = stats["last_chat"]["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{stats}");
    let last = &messages[1];
    assert_eq!(last["role"], "assistant", "{stats}");
    assert_eq!(last["content"][0]["text"], "mock", "{stats}");
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "ok", "{record}");
    assert_eq!(
        attempts(&record),
        [
            ("a".to_owned(), "provider_error".to_owned(), PRICE_A),
            ("b".to_owned(), "ok".to_owned(), PRICE_B)
        ]
    );
    assert_eq!(record["attempts"][1]["continuation"], "prefix", "{record}");
    assert!(record["attempts"][0].get("continuation").is_none());
    assert_eq!(continuations_metric(&rig, "prefix").await, 1);
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 1);
}

/// The header by which a client says it drops what it joined before a restart marker.
const RESTART_EVENTS: (&str, &str) = ("x-equiroute-stream-restart", "events");

#[tokio::test]
async fn a_stream_cut_after_content_is_never_restarted_for_a_client_that_joins_deltas() {
    // `b` takes no prefill: a restart would send its whole answer after a's "mock ", which a
    // client joining deltas shows as old + new text. Without the restart header: the honest
    // error, and `b` is not called; with a header of another value: a 400 naming it.
    for mode in ["prefix", "restart"] {
        let rig = rig(
            "stream_cut",
            "",
            &format!("stream_resume = {{ mode = \"{mode}\" }}"),
        )
        .await;
        let r = rig.stream().await;
        assert_broken_stream(&rig, "stream_cut", &r).await;
        let (text, markers) = streamed_text(&r.body);
        assert_eq!(
            (text.as_str(), markers.len()),
            ("mock ", 0),
            "{mode}: {}",
            r.body
        );
        assert!(
            r.body.contains("x-equiroute-stream-restart: events"),
            "{}",
            r.body
        );
        assert_eq!(continuations_metric(&rig, "restart").await, 0);
        let bad = rig.stream_with(&[(RESTART_EVENTS.0, "yes")]).await;
        assert_eq!(bad.status, 400, "{}", bad.body);
        assert_eq!(
            bad.json()["error"]["param"],
            RESTART_EVENTS.0,
            "{}",
            bad.body
        );
    }
}

#[tokio::test]
async fn a_stream_cut_before_content_restarts_on_a_provider_without_prefill() {
    // Cut after the role chunk only, sent at once (no hold): nothing the client joins was
    // sent, so `b` restarts the answer and the joined text is b's answer alone.
    let rig = rig(
        "stream_cut",
        "stream_cut_after = 1",
        "stream_hold = { until_content = false }",
    )
    .await;
    let r = rig.stream().await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    let (text, markers) = streamed_text(&r.body);
    assert_eq!(text, "mock streamed answer", "{}", r.body);
    assert_eq!(markers[0]["event"], "restart", "{}", r.body);
    assert_eq!(continuations_metric(&rig, "restart").await, 1);
}

#[tokio::test]
async fn a_stream_cut_after_commit_restarts_marked_for_a_client_that_reads_restart_events() {
    // `b` speaks OpenAI's chat, which takes no prefill: the answer starts again after the
    // marker, and `b` gets the client's request as it was.
    let rig = rig("stream_cut", "", "stream_resume = { mode = \"prefix\" }").await;
    let r = rig.stream_with(&[RESTART_EVENTS]).await;
    assert_eq!(r.status, 200);
    let a_sent = equiroute_mock::stream_chunks("stream_cut")[..2].concat();
    let b_sent = equiroute_mock::stream_chunks("healthy").concat();
    assert!(r.body.starts_with(&a_sent), "{}", r.body);
    assert!(
        r.body.ends_with(&b_sent),
        "b's whole answer, [DONE] last: {}",
        r.body
    );
    let marker = &r.body[a_sent.len()..r.body.len() - b_sent.len()];
    assert!(
        marker.starts_with(": equiroute restart: the stream of `a` broke"),
        "{marker}"
    );
    let (_, markers) = streamed_text(marker);
    assert_eq!(markers.len(), 1, "{marker}");
    assert_eq!(
        (
            &markers[0]["event"],
            &markers[0]["mode"],
            &markers[0]["provider"]
        ),
        (&json!("restart"), &json!("restart"), &json!("b"))
    );
    let stats = http(rig.healthy.addr, "GET", "/_stats", &[], "")
        .await
        .json();
    assert_eq!(
        stats["last_chat"]["messages"],
        json!([{"role": "user", "content": "hi"}]),
        "no prefix for a provider without prefill"
    );
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "ok", "{record}");
    assert_eq!(record["attempts"][1]["continuation"], "restart", "{record}");
    assert_eq!(continuations_metric(&rig, "restart").await, 1);
    assert_eq!(continuations_metric(&rig, "prefix").await, 0);
}

#[tokio::test]
async fn a_continuation_that_breaks_too_ends_in_an_error_event() {
    // `b` is cut as well: the client gets the stream_broken event, never [DONE].
    let b = Fallback {
        kind: "openai",
        profile: "[models.\"healthy\"]\nfault = \"stream_cut\"\n",
    };
    let rig = rig_onto(
        "stream_cut",
        "",
        "stream_resume = { mode = \"restart\" }",
        b,
    )
    .await;
    let r = rig.stream_with(&[RESTART_EVENTS]).await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("\"event\":\"restart\""), "{}", r.body);
    assert!(r.body.contains("\"code\":\"stream_broken\""), "{}", r.body);
    assert!(
        !r.body.contains("data: [DONE]"),
        "must not look complete: {}",
        r.body
    );
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "failed", "{record}");
    assert_eq!(
        attempts(&record),
        [
            ("a".to_owned(), "provider_error".to_owned(), PRICE_A),
            ("b".to_owned(), "provider_error".to_owned(), PRICE_B)
        ],
        "both broken attempts are billed"
    );
    assert_eq!(record["attempts"][1]["continuation"], "restart");
    assert_eq!(rig.attempts_metric("b", "provider_error").await, 1);
}

#[tokio::test]
async fn a_stalled_stream_ends_in_an_error_event_after_the_idle_limit() {
    let rig = rig("stream_stall", "", "").await;
    let t = Instant::now();
    let r = rig.stream().await;
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_broken_stream(&rig, "stream_stall", &r).await;
    assert!(r.body.contains("stalled"), "{}", r.body);
}

#[tokio::test]
async fn a_stream_without_done_or_finish_reason_ends_in_an_error_event() {
    let rig = rig("no_done_unfinished", "", "").await;
    let r = rig.stream().await;
    assert_broken_stream(&rig, "no_done_unfinished", &r).await;
    // Everything the provider sent was relayed before the error event.
    let sent = equiroute_mock::faulty_stream_chunks(
        "no_done_unfinished",
        Some(equiroute_mock::Fault::NoDoneUnfinished),
    )
    .concat();
    assert!(r.body.starts_with(&sent), "{}", r.body);
}

#[tokio::test]
async fn a_content_length_error_without_declared_windows_tries_one_other_candidate() {
    let rig = rig("context_length_exceeded", "", "").await;
    let r = rig.chat().await;
    assert_fell_over(&r);
    let record = rig.audit_of(&r).await;
    let tried = attempts(&record);
    assert_eq!((tried[0].1.as_str(), tried[0].2), ("client_error", 0.0));
    assert_eq!(
        rig.faulty_calls("context_length_exceeded").await,
        1,
        "never resent to a"
    );
    assert_eq!(rig.breaker("a").await, "closed", "not counted against a");
}

#[tokio::test]
async fn a_prefill_rejection_gets_a_second_opinion_and_counts_against_a_when_b_answers() {
    let rig = rig("prefill_rejected", "", "").await;
    let r = rig.chat().await;
    assert_eq!(r.routed(), (200, Some("b"), Some("2")), "{}", r.body);
    assert_eq!(rig.healthy_calls().await, 1);
    assert_eq!(rig.attempts_metric("a", "client_error").await, 1);
    // `b` took what `a` rejected: `a`'s rejection was its own, a failure on its breaker (one
    // of the 5 in a row that open it).
    let m = http(rig.gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        m.contains("equiroute_rejections_disputed_total{interface=\"chat\",provider=\"a\"} 1\n"),
        "{m}"
    );
    assert_eq!(rig.breaker("a").await, "closed");
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "ok");
    let tried = attempts(&record);
    assert_eq!(
        tried
            .iter()
            .map(|(p, status, _)| (p.as_str(), status.as_str()))
            .collect::<Vec<_>>(),
        [("a", "client_error"), ("b", "ok")]
    );
}

#[tokio::test]
async fn a_flapping_provider_is_retried_past_each_bad_call() {
    let rig = rig("flapping", "", "").await;
    for _ in 0..2 {
        let r = rig.chat().await;
        // Each request meets a bad call, then a good one on the retry.
        assert_eq!(r.routed(), (200, Some("a"), Some("2")), "{}", r.body);
    }
    assert_eq!(rig.faulty_calls("flapping").await, 4);
    assert_eq!(rig.healthy_calls().await, 0);
    // Never 5 failures in a row: the breaker stays closed.
    assert_eq!(rig.breaker("a").await, "closed");
    assert_eq!(rig.attempts_metric("a", "provider_error").await, 2);
}

#[tokio::test]
async fn the_mock_reads_a_body_without_content_type_as_the_gateway_does() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let m = mock("").await;
    for addr in [m.addr] {
        let body = chat_body(false);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    }
}

#[tokio::test]
async fn a_stream_with_its_finish_reason_but_no_done_is_completed_for_the_client() {
    // Sent from its first byte, and held whole (the answer ends within the hold): the same.
    for hold in ["", "stream_hold = { ms = 2000 }"] {
        let rig = rig("no_done_finished", "", hold).await;
        let r = rig.stream().await;
        assert_eq!(
            (r.status, r.header("x-equiroute-provider")),
            (200, Some("a"))
        );
        // Every byte the provider sent, then the end marker it left out; no error event.
        let mut want = equiroute_mock::faulty_stream_chunks(
            "no_done_finished",
            Some(equiroute_mock::Fault::NoDoneFinished),
        )
        .concat();
        want.push_str("data: [DONE]\n\n");
        assert_eq!(r.body, want);
        assert_eq!(rig.attempts_metric("a", "ok").await, 1);
        assert_eq!(rig.attempts_metric("a", "provider_error").await, 0);
        let record = rig.audit_of(&r).await;
        assert_eq!(record["outcome"], "ok");
        assert_eq!(
            attempts(&record),
            [("a".to_owned(), "ok".to_owned(), PRICE_A)]
        );
        assert_eq!(rig.breaker("a").await, "closed");
    }
}

#[tokio::test]
async fn a_malformed_chunk_is_not_relayed_and_ends_the_stream_in_an_error_event() {
    let rig = rig("malformed_chunk", "", "").await;
    let r = rig.stream().await;
    assert_broken_stream(&rig, "malformed_chunk", &r).await;
    let chunks = equiroute_mock::stream_chunks("malformed_chunk");
    // The two good events before it went through, whole; the bad one did not.
    assert!(r.body.starts_with(&chunks[..2].concat()), "{}", r.body);
    assert!(
        !r.body.contains(equiroute_mock::MALFORMED_CHUNK),
        "{}",
        r.body
    );
    assert!(r.body.contains("not JSON"), "{}", r.body);
}

#[tokio::test]
async fn a_content_filter_refusal_goes_back_to_the_caller_as_such() {
    let rig = rig("content_filter", "", "").await;
    let r = rig.chat().await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    let e = r.json();
    assert_eq!(e["error"]["code"], "content_filter", "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("provider `a`"),
        "{e}"
    );
    // Not retried elsewhere (another filter would refuse it too, or worse, not), not
    // counted against the provider, not billed.
    assert_eq!(rig.healthy_calls().await, 0);
    assert_eq!(rig.faulty_calls("content_filter").await, 1);
    assert_eq!(rig.breaker("a").await, "closed");
    let record = rig.audit_of(&r).await;
    assert_eq!(record["outcome"], "client_error");
    assert_eq!(
        attempts(&record),
        [("a".to_owned(), "client_error".to_owned(), 0.0)]
    );
}

#[tokio::test]
async fn all_breakers_open_answers_503_with_the_time_to_the_first_half_open() {
    let rig = rig("rate_limited", "retry_after_s = 30", "").await;
    let pinned =
        json!({"model": "chat/a", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let first = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &pinned).await;
    assert_eq!(first.status, 502, "{}", first.body);
    assert_eq!(first.header("x-equiroute-attempts"), Some("1"));
    let r = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &pinned).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_eligible_provider");
    // 30 s from the 429, less the few milliseconds since, rounded up.
    assert_eq!(r.header("retry-after"), Some("30"), "{:?}", r.headers);
    assert_eq!(r.header("x-equiroute-attempts"), Some("0"));
    assert_eq!(rig.faulty_calls("rate_limited").await, 1);
}

#[tokio::test]
async fn with_every_breaker_tripped_by_failures_the_one_reopening_soonest_is_probed() {
    // `a` fails its first call only, `b` every call; one failure trips a breaker for a minute.
    let faulty = mock(
        "[models.a]\nfault = \"outage_then_recovers\"\noutage_calls = [1, 2]\n[models.b]\nfault = \"unavailable\"\n",
    )
    .await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-faults-{}-last-resort.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    let cfg = format!(
        r#"
[audit]
path = {audit:?}

[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}
retry = {{ server_error = false }}
breaker = {{ consecutive_failures = 1, open_ms = 60000 }}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "a"
base_url = "http://{f}/v1"

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "b"
base_url = "http://{f}/v1"
"#,
        f = faulty.addr,
        audit = audit.display().to_string(),
    );
    let gw = start(&cfg, &[]).await;
    let body = chat_body(false);
    let first = http(gw.addr, "POST", "/v1/chat/completions", &[], &body).await;
    assert_eq!(first.status, 502, "both fail: {}", first.body);
    // Both breakers are open for a minute, neither pinned by a Retry-After: rather than a
    // 503 for that minute, `a` (open first, so reopening first) is probed, and answers.
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (Some("a"), Some("1"))
    );
    assert_eq!(
        (calls(faulty.addr, "a").await, calls(faulty.addr, "b").await),
        (2, 1)
    );
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        m.contains(r#"equiroute_last_resort_total{interface="chat"} 1"#),
        "{m}"
    );
    let record = audit_record(&audit, r.header("x-equiroute-request-id").unwrap()).await;
    assert_eq!(record["last_resort"], true, "{record}");
    let _ = std::fs::remove_file(&audit);
}

#[tokio::test]
async fn a_second_context_length_refusal_without_declared_windows_ends_the_request() {
    let faulty = mock(
        "[models.\"ctx-a\"]\nfault = \"context_length_exceeded\"\n[models.\"ctx-b\"]\nfault = \"context_length_exceeded\"\n",
    )
    .await;
    let healthy = mock("").await;
    let cfg = format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "ctx-a"
base_url = "http://{f}/v1"

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "ctx-b"
base_url = "http://{f}/v1"

[[interfaces.chat.providers]]
id = "c"
kind = "openai"
model = "healthy"
base_url = "http://{h}/v1"
"#,
        f = faulty.addr,
        h = healthy.addr
    );
    let gw = start(&cfg, &[]).await;
    // Pin the order a, b, c: `static` puts a first, then the configuration's order.
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(false),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.header("x-equiroute-attempts"), Some("2"));
    assert_eq!(r.json()["error"]["code"], "upstream_rejected_request");
    assert_eq!(
        (
            calls(faulty.addr, "ctx-a").await,
            calls(faulty.addr, "ctx-b").await,
            calls(healthy.addr, "healthy").await
        ),
        (1, 1, 0),
        "one attempt elsewhere, none after it"
    );
}

#[tokio::test]
async fn a_provider_down_then_recovered_is_probed_with_back_off_and_gets_traffic_back_promptly() {
    // `a` answers 503 for its first 1.5 s, then recovers. Its breaker trips at the first
    // failure, opens for 100 ms, and each failed probe doubles that, up to 400 ms.
    let outage = Duration::from_millis(1500);
    let began = Instant::now();
    let rig = rig(
        "outage",
        &format!("outage_ms = {}", outage.as_millis()),
        "breaker = { consecutive_failures = 1, open_ms = 100, backoff_factor = 2, max_open_ms = 400 }",
    )
    .await;
    let recovered = began + outage;
    let mut back = None;
    let mut during = 0;
    while began.elapsed() < Duration::from_secs(8) {
        let r = rig.chat().await;
        assert_eq!(r.status, 200, "{}", r.body);
        if Instant::now() < recovered {
            during = rig.faulty_calls("outage").await;
        }
        if r.header("x-equiroute-provider") == Some("a") {
            back = Some(Instant::now());
            break;
        }
        // Steady traffic, one request every 20 ms.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back = back.expect("a never got traffic back");
    // Within the back-off ceiling (400 ms) of recovering, with a wide margin for a loaded
    // machine; with the old fixed 30 s default period it could be 30 s.
    let late = back.saturating_duration_since(recovered);
    assert!(late < Duration::from_millis(1500), "{late:?}");
    // Backed off while down: the trip plus probes at about 0.1, 0.3, 0.7, 1.1 and 1.5 s
    // (about 6 calls), where a fixed 100 ms period would have made about 15.
    assert!((2..=9).contains(&during), "{during} calls to a while down");
    assert_eq!(
        rig.breaker("a").await,
        "half_open",
        "one probe succeeded so far"
    );
    // The next request is the second probe success: closed, traffic back for good.
    let r = rig.chat().await;
    assert_eq!(r.header("x-equiroute-provider"), Some("a"));
    assert_eq!(rig.breaker("a").await, "closed");
}

#[tokio::test]
async fn with_defaults_a_first_byte_that_stalls_is_given_up_for_the_next_provider_in_time() {
    // Nothing learnt of any provider; `a`'s first byte would come after 8 s. The unlearnt
    // limit is min(5 s, half of the 3 s deadline): `a` is given up at 1.5 s and `b` answers
    // within the deadline (waiting out the attempt timeout, 60 s, would have missed it).
    let rig = rig("slow_first_token", "first_token_delay_ms = 8000", "").await;
    let t = Instant::now();
    let r = rig.stream().await;
    assert_fell_over(&r);
    let took = t.elapsed();
    assert!(
        (Duration::from_millis(1400)..Duration::from_millis(2900)).contains(&took),
        "{took:?}"
    );
    let record = rig.audit_of(&r).await;
    assert_eq!(attempts(&record)[0].1, "timeout", "{record}");
    let limit = record["attempts"][0]["first_byte_limit_ms"]
        .as_f64()
        .unwrap();
    assert!((1400.0..=1500.0).contains(&limit), "{limit}");
}

#[tokio::test]
async fn a_provider_that_stops_sending_first_bytes_is_cut_off_at_a_limit_learnt_from_its_first_bytes(
) {
    // `a` streams normally (first byte in about 20 ms) for 6 calls, then never answers.
    let rig = rig(
        "no_answer",
        "healthy_calls = 6",
        "first_byte = { floor_ms = 200 }",
    )
    .await;
    let limit_of = |record: &Value, n: usize| record["attempts"][n]["first_byte_limit_ms"].as_f64();
    for n in 0..6 {
        let r = rig.stream().await;
        assert_eq!(r.header("x-equiroute-provider"), Some("a"), "{}", r.body);
        if n == 0 {
            // Nothing learnt yet, b left behind: half of the 3 s left (deadline_share 0.5).
            let limit = limit_of(&rig.audit_of(&r).await, 0).unwrap();
            assert!((1400.0..=1500.0).contains(&limit), "{limit}");
        }
    }
    let t = Instant::now();
    let r = rig.stream().await;
    // Cut off after a few of its usual first-byte times (floored at 200 ms), not at the
    // 3 s deadline, which would have left no time for b.
    assert_fell_over(&r);
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.body, equiroute_mock::stream_chunks("healthy").concat());
    let record = rig.audit_of(&r).await;
    assert_eq!(attempts(&record)[0].1, "timeout");
    let limit = limit_of(&record, 0).unwrap();
    assert!((200.0..1500.0).contains(&limit), "{limit}");
    // The audit shows b's limit too: nothing learnt of b, its timeout (what is left).
    assert!(limit_of(&record, 1).unwrap() > limit);
}

#[tokio::test]
async fn the_retry_rule_follows_its_knobs_and_the_audit_shows_each_choice() {
    // No 5xx retry: a's 500 falls over to b at once.
    let no_retry = rig("error_500_once", "", "retry = { server_error = false }").await;
    let r = no_retry.chat().await;
    assert_fell_over(&r);
    assert_eq!(
        tries(&no_retry.audit_of(&r).await),
        [t("a", "provider_error", None), t("b", "ok", None)]
    );
    // Never wait for a Retry-After: a short one falls over too, a called once.
    let no_wait = rig(
        "rate_limited",
        "retry_after_s = 0.2",
        "retry = { max_retry_after_wait_ms = 0 }",
    )
    .await;
    let r = no_wait.chat().await;
    assert_fell_over(&r);
    assert_eq!(no_wait.faulty_calls("rate_limited").await, 1);
    // A longer pause without jitter: the retry of a waits the whole 400 ms.
    let slow = rig(
        "flapping",
        "",
        "retry = { server_error_pause_ms = 400, jitter = 0 }",
    )
    .await;
    let began = Instant::now();
    let r = slow.chat().await;
    assert!(
        began.elapsed() >= Duration::from_millis(400),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(
        (
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (Some("a"), Some("2"))
    );
    assert_eq!(
        tries(&slow.audit_of(&r).await),
        [
            t("a", "provider_error", None),
            t("a", "ok", Some("server_error"))
        ]
    );
}

#[test]
fn retry_knobs_out_of_range_are_refused_naming_the_field() {
    let cfg = |retry: &str| {
        format!(
            "[interfaces.chat]\nkind = \"chat\"\nretry = {retry}\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n"
        )
    };
    let err = |retry: &str| {
        equiroute_gateway::config::load(&cfg(retry), "t.toml", &|_| None)
            .unwrap_err()
            .to_string()
    };
    assert!(err("{ jitter = 2 }").contains("retry.jitter"));
    assert!(err("{ server_error_pause_ms = -1 }").contains("retry.server_error_pause_ms"));
    assert!(err("{ retries = 2 }").contains("retries"));
    assert!(
        equiroute_gateway::config::load(&cfg("{ server_error = false }"), "t.toml", &|_| None)
            .is_ok()
    );
}

#[tokio::test]
async fn a_client_that_stops_reading_a_stream_is_cut_off_and_the_upstream_released() {
    use tokio::io::AsyncReadExt;
    // `a` streams 16 KiB chunks for ever; the client reads the first bytes, then stops.
    let rig = rig(
        "endless_stream",
        "chunk_gap_ms = 0",
        "[server]\nsend_timeout_ms = 300",
    )
    .await;
    let mut s = common::stalled_reader(rig.gw.addr).await;
    let open = || common::streams_open(rig.faulty.addr);
    assert_eq!(open().await, 1, "a is streaming");
    // Within the send timeout (300 ms) of the buffers filling up, with a wide margin: the
    // gateway gives up on the client and drops a's stream. Without the timeout it would
    // stream into the full socket for ever.
    let until = Instant::now() + Duration::from_secs(8);
    while open().await > 0 {
        assert!(Instant::now() < until, "a's stream is still held open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The client's connection was closed: what was buffered, then the end.
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(end.is_ok(), "the gateway kept the connection open");
    assert!(
        !String::from_utf8_lossy(&rest).contains("data: [DONE]"),
        "an abandoned stream never looks complete"
    );
    let record = loop {
        let text = std::fs::read_to_string(&rig.audit).unwrap_or_default();
        if let Some(line) = text.lines().next() {
            break serde_json::from_str::<Value>(line).unwrap();
        }
        assert!(Instant::now() < until, "no audit record");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(attempts(&record)[0].1, "cancelled", "{record}");
}

/// The mock's random mix (what the soak uses): each fault on about its share of the calls,
/// the same calls on every run (the draw is seeded by the call number), and a `stream_stall`
/// with `hang_ms` that ends instead of holding the connection for ever.
#[tokio::test]
async fn the_mocks_fault_mix_plays_each_fault_on_its_share_of_the_calls() {
    let profile = "[chat]\nlatency = { p50_ms = 0, p95_ms = 0 }\nfault_mix = { unavailable = 0.3, content_filter = 0.2 }\n[models.stall]\nlatency = { p50_ms = 0, p95_ms = 0 }\nfault_mix = { stream_stall = 1.0 }\nhang_ms = 50\n";
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let mut runs = Vec::new();
    for _ in 0..2 {
        let m = mock(profile).await;
        let mut statuses = Vec::new();
        for _ in 0..400 {
            statuses.push(
                http(m.addr, "POST", "/v1/chat/completions", &[], body)
                    .await
                    .status,
            );
        }
        runs.push(statuses);
    }
    assert_eq!(runs[0], runs[1], "the same calls fail on every run");
    let count = |s: u16| runs[0].iter().filter(|x| **x == s).count();
    // 400 calls: 120 and 80 expected; ±4 standard deviations.
    assert!((84..=156).contains(&count(503)), "503s: {}", count(503));
    assert!((50..=110).contains(&count(400)), "400s: {}", count(400));
    assert_eq!(count(200) + count(503) + count(400), 400);
    let m = mock(profile).await;
    let stream = r#"{"model":"stall","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        http(m.addr, "POST", "/v1/chat/completions", &[], stream),
    )
    .await
    .expect("a stall with hang_ms ends");
    assert_eq!(r.status, 200);
    assert_eq!(r.body.matches("data: ").count(), 2, "{}", r.body);
    assert!(!r.body.contains("[DONE]"), "{}", r.body);
}
