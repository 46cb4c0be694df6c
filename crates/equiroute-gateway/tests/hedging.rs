//! Hedged requests through the gateway, against two in-process mock upstreams: a slow first
//! choice (every call 2.5 s) and a fast, dear fallback (10 ms). `ts-deadline` ranks the cheap
//! one first; with a hedge at its predictive median (the prior's 1 s), the fast provider's
//! answer arrives about 1 s in, and the slow call is dropped and booked as cancelled.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{audit_record, calls, http, mock, start, Gateway};
use equiroute_core::hedge::HedgeRule;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn metric(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

struct Rig {
    slow: Gateway,
    fast: Gateway,
    gw: Gateway,
    audit: std::path::PathBuf,
}

/// A fresh audit log path for the test `name`.
fn audit_path(name: &str) -> std::path::PathBuf {
    let audit = std::env::temp_dir().join(format!(
        "equiroute-hedging-{}-{name}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    audit
}

/// A `chat` interface under `ts-deadline` with `interface`'s extra lines, auditing to
/// `audit`: provider `a` (cheap, ranked first) on the first mock's model, `b` (dear) on the
/// second's. The cost reference is `a`'s price, so that `a` is ranked first whatever its
/// latency draw: with the default reference (the mean price) `b`'s cost factor is ⅓, and a
/// fresh prior's draw put `b` first in 0.18% of the ranks (367 of 200,000), which failed a
/// run of these tests now and then; with `a`'s price `b` would need `a`'s sampled `P(good)`
/// below 0.0002 of its own (0 of 2,000,000 draws).
fn chat_config(
    audit: &std::path::Path,
    interface: &str,
    (a, a_model): (std::net::SocketAddr, &str),
    (b, b_model): (std::net::SocketAddr, &str),
) -> String {
    format!(
        r#"
[audit]
path = {audit:?}

[interfaces.chat]
kind = "chat"
policy = {{ name = "ts-deadline", objective = {{ kind = "cost-per-good", cost_ref_usd = 0.0001 }} }}
{interface}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "{a_model}"
base_url = "http://{a}/v1"
price = {{ per_call = 0.0001 }}

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "{b_model}"
base_url = "http://{b}/v1"
price = {{ per_call = 1.0 }}
"#,
        audit = audit.display().to_string(),
    )
}

async fn rig(name: &str, hedge: &str) -> Rig {
    let slow = mock("[chat]\nlatency = { p50_ms = 2500, p95_ms = 2500 }\n").await;
    let fast = mock("[chat]\nlatency = { p50_ms = 10, p95_ms = 10 }\n").await;
    let audit = audit_path(name);
    let interface = format!("deadline_ms = 10000\n{hedge}");
    let cfg = chat_config(&audit, &interface, (slow.addr, "slow"), (fast.addr, "fast"));
    let gw = start(&cfg, &[]).await;
    Rig {
        slow,
        fast,
        gw,
        audit,
    }
}

impl Rig {
    async fn audit_of(&self, id: &str) -> Value {
        audit_record(&self.audit, id).await
    }

    /// Calls each upstream received: (slow, fast).
    async fn calls(&self) -> (u64, u64) {
        (
            calls(self.slow.addr, "slow").await,
            calls(self.fast.addr, "fast").await,
        )
    }
}

/// `equiroute_hedges_total` of the chat interface in a `/metrics` text: (started, won,
/// cancelled).
fn hedges(m: &str) -> (u64, u64, u64) {
    let event = |e: &str| {
        metric(
            m,
            &format!("equiroute_hedges_total{{interface=\"chat\",event=\"{e}\"}} "),
        )
    };
    (event("started"), event("won"), event("cancelled"))
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.audit);
    }
}

fn body() -> String {
    json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}).to_string()
}

/// `a`: first byte in about 30 ms, then a chunk every `gap_ms`, for its first `healthy`
/// calls; from then on its first byte (and an unstreamed answer) takes 1.5 s. `b`: fast and
/// dear, so `a` is ranked first. No deadline: a hedge at the first candidate's predictive
/// p95 (`tail_quantile`). `interface` adds lines to the interface's table.
struct FirstByteRig {
    a: Gateway,
    gw: Gateway,
    audit: std::path::PathBuf,
    _b: Gateway,
}

impl FirstByteRig {
    async fn new(name: &str, gap_ms: u32, healthy: u32, interface: &str) -> FirstByteRig {
        let a = mock(&format!(
            "[models.a]\nlatency = {{ p50_ms = 30, p95_ms = 45 }}\nchunk_gap_ms = {gap_ms}\n\
             fault = \"slow_first_token\"\nfirst_token_delay_ms = 1500\nhealthy_calls = {healthy}\n"
        ))
        .await;
        let b =
            mock("[models.b]\nlatency = { p50_ms = 20, p95_ms = 30 }\nchunk_gap_ms = 5\n").await;
        let audit = audit_path(name);
        let interface = format!("hedge = {{ streams = true }}\n{interface}");
        let cfg = chat_config(&audit, &interface, (a.addr, "a"), (b.addr, "b"));
        let gw = start(&cfg, &[]).await;
        FirstByteRig {
            a,
            gw,
            audit,
            _b: b,
        }
    }
}

impl FirstByteRig {
    /// Eight streams, two at a time, each answered in full; returns the streamed body.
    async fn warm_up(&self) -> String {
        let streamed = stream_body();
        for _ in 0..4 {
            let (x, y) = tokio::join!(
                stream_timed(self.gw.addr, &streamed),
                stream_timed(self.gw.addr, &streamed)
            );
            assert!(x.1.contains("data: [DONE]") && y.1.contains("data: [DONE]"));
        }
        streamed
    }
}

impl Drop for FirstByteRig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.audit);
    }
}

/// The request id of a raw reply.
fn request_id(text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("x-equiroute-request-id: "))
        .unwrap()
        .trim()
        .to_owned()
}

#[tokio::test]
async fn a_hedge_cuts_a_slow_first_attempt_and_the_loser_is_cancelled() {
    let rig = rig(
        "cut",
        r#"hedge = { rule = { kind = "predictive-quantile", quantile = 0.5 } }"#,
    )
    .await;
    let t = Instant::now();
    let reply = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &body()).await;
    let took = t.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.body);
    // The hedge's answer, well before the slow call's 2.5 s.
    assert_eq!(reply.header("x-equiroute-provider"), Some("b"));
    assert!(took < Duration::from_secs(2), "{took:?}");
    // Both upstreams were called once.
    assert_eq!(rig.calls().await, (1, 1));
    let m = http(rig.gw.addr, "GET", "/metrics", &[], "").await.body;
    assert_eq!(hedges(&m), (1, 1, 1));
    // The predictive-quantile rule set the delay.
    assert_eq!(
        metric(
            &m,
            "equiroute_hedge_reasons_total{interface=\"chat\",reason=\"quantile\"} "
        ),
        1
    );
    assert_eq!(
        metric(
            &m,
            "equiroute_attempts_total{interface=\"chat\",provider=\"a\",status=\"cancelled\"} "
        ),
        1
    );
    // The audit record: the hedge answered first, then the first attempt was cancelled (its
    // latency censored about when the answer came, its per-call price billed).
    let id = reply.header("x-equiroute-request-id").unwrap().to_owned();
    let record = rig.audit_of(&id).await;
    let attempts = record["attempts"].as_array().unwrap();
    let seen: Vec<(&str, &str, bool)> = attempts
        .iter()
        .map(|a| {
            (
                a["provider"].as_str().unwrap(),
                a["status"].as_str().unwrap(),
                a["hedge"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    assert_eq!(seen, [("b", "ok", true), ("a", "cancelled", false)]);
    let cancelled_ms = attempts[1]["latency_ms"].as_f64().unwrap();
    assert!(
        cancelled_ms > 500.0 && cancelled_ms < 2000.0,
        "{cancelled_ms}"
    );
    assert!((attempts[1]["cost_usd"].as_f64().unwrap() - 0.0001).abs() < 1e-12);
    assert_eq!(record["outcome"], "ok");
    assert!(
        record["fallback_reason"].is_null(),
        "a hedge is no fallback"
    );
}

fn stream_body() -> String {
    json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

#[tokio::test]
async fn a_stream_hedges_until_its_first_byte_and_the_slow_one_is_dropped() {
    let rig = rig(
        "stream",
        r#"hedge = { rule = { kind = "predictive-quantile", quantile = 0.5 }, streams = true }"#,
    )
    .await;
    let t = Instant::now();
    let reply = http(
        rig.gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &stream_body(),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.body);
    // The hedge's first byte came first (the slow one sends none for 2.5 s): its stream,
    // whole, is the client's.
    assert_eq!(reply.header("x-equiroute-provider"), Some("b"));
    assert_eq!(reply.body, equiroute_mock::stream_chunks("fast").concat());
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(rig.calls().await, (1, 1));
    let m = http(rig.gw.addr, "GET", "/metrics", &[], "").await.body;
    assert_eq!(hedges(&m), (1, 1, 1));
    // The audit record: the slow attempt dropped when the hedge's first byte came (booked
    // then, billed at its price), the hedge's stream relayed to its end.
    let id = reply.header("x-equiroute-request-id").unwrap().to_owned();
    let record = rig.audit_of(&id).await;
    let attempts = record["attempts"].as_array().unwrap();
    let seen: Vec<(&str, &str, bool)> = attempts
        .iter()
        .map(|a| {
            (
                a["provider"].as_str().unwrap(),
                a["status"].as_str().unwrap(),
                a["hedge"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    assert_eq!(seen, [("a", "cancelled", false), ("b", "ok", true)]);
    assert!((attempts[0]["cost_usd"].as_f64().unwrap() - 0.0001).abs() < 1e-12);
    assert!(attempts[1]["ttfb_ms"].as_f64().is_some(), "{record}");
    assert_eq!(record["outcome"], "ok");
}

#[tokio::test]
async fn a_stream_does_not_hedge_unless_the_interface_says_streams_hedge() {
    let rig = rig(
        "stream-off",
        r#"hedge = { rule = { kind = "predictive-quantile", quantile = 0.5 } }"#,
    )
    .await;
    let reply = http(
        rig.gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &stream_body(),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-equiroute-provider"), Some("a"));
    assert_eq!(calls(rig.fast.addr, "fast").await, 0);
}

#[tokio::test]
async fn without_hedging_the_slow_first_attempt_is_waited_for() {
    let rig = rig("off", "").await;
    let reply = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &body()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-equiroute-provider"), Some("a"));
    assert_eq!(calls(rig.fast.addr, "fast").await, 0);
    let m = http(rig.gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(!m.contains("equiroute_hedges_total"), "{m}");
}

#[tokio::test]
async fn a_tool_interface_hedges_only_when_marked_idempotent() {
    let cfg = |extra: &str| {
        format!(
            "[interfaces.search]\nkind = \"tool\"\nhedge = {{ {extra} }}\n\
             [[interfaces.search.providers]]\nid = \"a\"\nkind = \"sim\"\n\
             sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n"
        )
    };
    let env = |_: &str| None;
    let err = equiroute_gateway::config::load(&cfg("max_rate = 0.05"), "t.toml", &env)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hedge.idempotent") && err.contains("idempotent = true"),
        "{err}"
    );
    assert!(equiroute_gateway::config::load(&cfg("idempotent = true"), "t.toml", &env).is_ok());
    let err = equiroute_gateway::config::load(
        &cfg("idempotent = true, max_parallel = 3"),
        "t.toml",
        &env,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("hedge.max_parallel"), "{err}");
}

#[tokio::test]
async fn latency_hedges_are_configured_on_the_priced_rule_and_checked_by_field() {
    let cfg = |rule: &str| {
        format!(
            "[interfaces.chat]\nkind = \"chat\"\nhedge = {{ rule = {rule} }}\n\
             [[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\n\
             sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}\n"
        )
    };
    let env = |_: &str| None;
    let ok = equiroute_gateway::config::load(
        &cfg("{ kind = \"priced-saving\", latency_quantile = 0.95 }"),
        "t.toml",
        &env,
    )
    .unwrap();
    assert!(
        matches!(
            ok.interfaces[0].hedge.rule,
            HedgeRule::PricedSaving { latency_quantile: Some(q), loose_risk, .. }
                if (q - 0.95).abs() < 1e-12 && (loose_risk - 0.01).abs() < 1e-12
        ),
        "{:?}",
        ok.interfaces[0].hedge.rule
    );
    for (rule, field) in [
        (
            "{ kind = \"priced-saving\", latency_quantile = 1.5 }",
            "hedge.latency_quantile",
        ),
        (
            "{ kind = \"priced-saving\", latency_quantile = 0.95, loose_risk = 0 }",
            "hedge.loose_risk",
        ),
    ] {
        let err = equiroute_gateway::config::load(&cfg(rule), "t.toml", &env)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{err}");
    }
}

/// Sends a streamed request over a raw connection; returns (time to the first `data:` event
/// on the client's side, the whole reply as text) once the stream has ended.
async fn stream_timed(addr: std::net::SocketAddr, body: &str) -> (Duration, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let t = Instant::now();
    s.write_all(req.as_bytes()).await.unwrap();
    let (mut seen, mut first) = (Vec::new(), None);
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if first.is_none() && String::from_utf8_lossy(&seen).contains("data: ") {
            first = Some(t.elapsed());
        }
    }
    (
        first.expect("no event reached the client"),
        String::from_utf8_lossy(&seen).into_owned(),
    )
}

/// The planned hedge of a request, as its audit record shows it: (the hedge's start after
/// the first attempt's, in ms), or `None` when no hedge started.
fn hedge_start(record: &Value) -> Option<f64> {
    let attempts = record["attempts"].as_array().unwrap();
    let hedge = attempts.iter().find(|a| a["hedge"] == true)?;
    let first = attempts.iter().find(|a| a["hedge"] != true).unwrap();
    Some(hedge["started_ms"].as_f64().unwrap() - first["started_ms"].as_f64().unwrap())
}

#[tokio::test]
async fn a_stream_hedges_on_its_first_byte_belief_and_an_unstreamed_request_on_its_answer() {
    // `a` sends its first byte in about 30 ms and then a chunk every 200 ms (a 1 s stream)
    // for its first 8 calls; from then on its first byte (and an unstreamed answer) takes
    // 1.5 s. `b` is fast and dear, so `a` is ranked first.
    let rig = FirstByteRig::new("first-byte", 200, 8, "").await;
    let (a, gw, audit) = (&rig.a, &rig.gw, &rig.audit);
    // Warm-up: 8 streams from `a`, two at a time (its first bytes: about 30 ms; its
    // answers: about 1 s, which is what the whole-answer belief learns).
    let streamed = rig.warm_up().await;
    assert_eq!(calls(a.addr, "a").await, 8);
    let before = hedges(&http(gw.addr, "GET", "/metrics", &[], "").await.body);

    // `a` now stalls its first byte for 1.5 s: the stream hedges at the first byte's p95
    // (tens of ms), far before the whole-answer belief (about 1 s) would.
    let (first_byte, text) = stream_timed(gw.addr, &streamed).await;
    assert!(text.contains("x-equiroute-provider: b"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(first_byte < Duration::from_millis(600), "{first_byte:?}");
    let after = hedges(&http(gw.addr, "GET", "/metrics", &[], "").await.body);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1, after.2 - before.2),
        (1, 1, 1)
    );
    let id = request_id(&text);
    let record = audit_record(audit, &id).await;
    assert_eq!(record["order"][0], "a", "{record}");
    let started = hedge_start(&record).unwrap();
    assert!(started < 400.0, "the hedge started {started} ms in");

    // An unstreamed request keeps the whole-answer delay: no hedge for at least 600 ms (it
    // would come at about 60 ms from the first-byte belief).
    let reply = http(gw.addr, "POST", "/v1/chat/completions", &[], &body()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let id = reply.header("x-equiroute-request-id").unwrap().to_owned();
    let record = audit_record(audit, &id).await;
    assert_eq!(record["order"][0], "a", "{record}");
    if let Some(started) = hedge_start(&record) {
        assert!(started >= 600.0, "the hedge started {started} ms in");
    }
}

#[tokio::test]
async fn with_plan_hedges_off_a_stream_hedges_on_its_answer_belief() {
    // The rig above with `first_byte = { plan_hedges = false }`: after the same warm-up, a
    // stream whose first byte stalls hedges no earlier than the whole-answer belief says
    // (about 1 s), not at the first byte's tens of ms; the learnt first-byte limit (1.5 s
    // stalls are cut at its floor) still applies.
    let rig = FirstByteRig::new(
        "first-byte-off",
        200,
        8,
        "first_byte = { plan_hedges = false }\n",
    )
    .await;
    let (gw, audit) = (&rig.gw, &rig.audit);
    let streamed = rig.warm_up().await;
    let (first_byte, text) = stream_timed(gw.addr, &streamed).await;
    assert!(text.contains("data: [DONE]"), "{text}");
    // With the first-byte plan, `b`'s first byte arrives within 600 ms (the test above).
    assert!(first_byte >= Duration::from_millis(600), "{first_byte:?}");
    let record = audit_record(audit, &request_id(&text)).await;
    assert_eq!(record["order"][0], "a", "{record}");
    if let Some(started) = hedge_start(&record) {
        assert!(started >= 600.0, "the hedge started {started} ms in");
    }
}

#[tokio::test]
async fn a_stream_dropped_for_a_hedge_before_its_first_byte_teaches_its_first_byte_belief() {
    // With a floor of 1 ms the first-byte limit, 3 × the first byte's p99, shows the belief.
    let rig = FirstByteRig::new("first-byte-drop", 5, 6, "first_byte = { floor_ms = 1 }").await;
    let streamed = stream_body();
    for _ in 0..6 {
        stream_timed(rig.gw.addr, &streamed).await;
    }
    // `a` stalls: two streams hedge to `b` and `a` is dropped about 100 ms in each time. Each
    // drop is booked as a first byte of at least that long, so the second limit is higher.
    let mut limits = Vec::new();
    for _ in 0..2 {
        let (_, text) = stream_timed(rig.gw.addr, &streamed).await;
        assert!(text.contains("x-equiroute-provider: b"), "{text}");
        let record = audit_record(&rig.audit, &request_id(&text)).await;
        let first = &record["attempts"].as_array().unwrap()[0];
        assert_eq!(
            (&first["provider"], &first["status"]),
            (&json!("a"), &json!("cancelled")),
            "{record}"
        );
        limits.push(first["first_byte_limit_ms"].as_f64().unwrap());
    }
    assert!(limits[1] > 1.2 * limits[0], "{limits:?}");
}
