//! Hedged requests through the gateway, against two in-process mock upstreams: a slow first
//! choice (every call 2.5 s) and a fast, dear fallback (10 ms). `ts-deadline` ranks the cheap
//! one first; with a hedge at its predictive median (the prior's 1 s), the fast provider's
//! answer arrives about 1 s in, and the slow call is dropped and booked as cancelled.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{audit_record, calls, http, mock, start, Gateway};
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

async fn rig(name: &str, hedge: &str) -> Rig {
    let slow = mock("[chat]\nlatency = { p50_ms = 2500, p95_ms = 2500 }\n").await;
    let fast = mock("[chat]\nlatency = { p50_ms = 10, p95_ms = 10 }\n").await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-hedging-{}-{name}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    let cfg = format!(
        r#"
[audit]
path = {audit:?}

[interfaces.chat]
kind = "chat"
policy = {{ name = "ts-deadline" }}
deadline_ms = 10000
{hedge}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "slow"
base_url = "http://{}/v1"
price = {{ per_call = 0.0001 }}

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "fast"
base_url = "http://{}/v1"
price = {{ per_call = 1.0 }}
"#,
        slow.addr,
        fast.addr,
        audit = audit.display().to_string(),
    );
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
    assert_eq!(
        reply.body,
        equiroute_gateway::mock::stream_chunks("fast").concat()
    );
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
