//! The gateway in front of real HTTP upstreams (mock servers on loopback ports).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, mock, start};
use serde_json::json;

fn config(a: std::net::SocketAddr, b: std::net::SocketAddr) -> String {
    format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "model-a"
base_url = "http://{a}/v1"
api_key_env = "MOCK_KEY_A"

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "model-b"
base_url = "http://{b}/v1"

[interfaces.web_search]
kind = "tool"

[[interfaces.web_search.providers]]
id = "search-a"
kind = "http"
url = "http://{a}/search"
api_key_env = "MOCK_KEY_A"
"#
    )
}

/// [`config`] with `lines` added to the chat interface's table.
fn config_with(a: std::net::SocketAddr, b: std::net::SocketAddr, lines: &str) -> String {
    config(a, b).replacen(
        "deadline_ms = 3000",
        &format!("deadline_ms = 3000\n{lines}"),
        1,
    )
}

fn chat() -> String {
    json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}).to_string()
}

async fn calls(addr: std::net::SocketAddr) -> serde_json::Value {
    http(addr, "GET", "/_stats", &[], "").await.json()
}

#[tokio::test]
async fn falls_back_on_500_and_forwards_the_key_only_to_its_provider() {
    let a = mock("[chat]\nerror_500 = 1.0\n").await;
    let b = mock("").await;
    let gw = start(&config(a.addr, b.addr), &[("MOCK_KEY_A", "sk-test-a")]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-provider"), Some("b"));
    // a, its one retry after a 5xx, then b.
    assert_eq!(r.header("x-equiroute-attempts"), Some("3"));
    assert_eq!(r.json()["model"], "model-b");
    assert!(!r.body.contains("sk-test-a"));
    let (sa, sb) = (calls(a.addr).await, calls(b.addr).await);
    assert_eq!(
        (sa["chat"].as_u64(), sa["authorized"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(
        (sb["chat"].as_u64(), sb["authorized"].as_u64()),
        (Some(1), Some(0)),
        "no key configured for b"
    );
}

#[tokio::test]
async fn a_429_with_retry_after_takes_the_provider_out_until_then() {
    let a = mock("[chat]\nerror_429 = 1.0\nretry_after_s = 30\n").await;
    let b = mock("").await;
    let gw = start(&config(a.addr, b.addr), &[("MOCK_KEY_A", "k")]).await;
    let first = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(
        (first.status, first.header("x-equiroute-attempts")),
        (200, Some("2"))
    );
    // `static` still prefers a, but its breaker is open for 30 s: b answers directly.
    for _ in 0..3 {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
        assert_eq!(
            (
                r.header("x-equiroute-provider"),
                r.header("x-equiroute-attempts")
            ),
            (Some("b"), Some("1"))
        );
    }
    assert_eq!(
        calls(a.addr).await["chat"],
        1,
        "no tight loop on a rate-limited provider"
    );
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        m.contains(
            r#"equiroute_breaker_transitions_total{interface="chat",provider="a",to="open"} 1"#
        ),
        "{m}"
    );
}

#[tokio::test]
async fn the_configured_breaker_opens_after_its_own_threshold_and_half_opens_after_its_own_time() {
    let a = mock("[chat]\nerror_500 = 1.0\n").await;
    let b = mock("").await;
    // Opens after 2 consecutive failures (default 5), for 300 ms (default 30 s).
    let text = config_with(
        a.addr,
        b.addr,
        "breaker = { consecutive_failures = 2, open_ms = 300 }",
    );
    let gw = start(&text, &[("MOCK_KEY_A", "k")]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(
        r.header("x-equiroute-attempts"),
        Some("3"),
        "a fails, its one retry fails, b answers"
    );
    // Open after the second failure: `static` still prefers a, but b answers directly.
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    assert_eq!(calls(a.addr).await["chat"], 2);
    // Half-open once its 300 ms are over: a is probed again (bounded: 5 s).
    let began = std::time::Instant::now();
    loop {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
        if r.header("x-equiroute-attempts") == Some("2") {
            break;
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(5),
            "a was not probed again within 5 s of opening for 300 ms"
        );
        tokio::task::yield_now().await;
    }
    // Not at once: the probe waited for the breaker's own time.
    assert!(began.elapsed() >= std::time::Duration::from_millis(100));
    // The failed probe re-opens the breaker, which refuses the retry: one call.
    assert_eq!(calls(a.addr).await["chat"], 3, "one probe");
}

/// The breaker state and the disputed-rejection count of provider `id`.
async fn rejection_marks(gw: std::net::SocketAddr, id: &str) -> (String, u64) {
    let state = http(gw, "GET", "/v1/interfaces/chat/state", &[], "")
        .await
        .json();
    let breaker = state["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap()["breaker"]["state"]
        .as_str()
        .unwrap()
        .to_owned();
    let metrics = http(gw, "GET", "/metrics", &[], "").await.body;
    let series =
        format!("equiroute_rejections_disputed_total{{interface=\"chat\",provider=\"{id}\"}} ");
    let disputed = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse().unwrap());
    (breaker, disputed)
}

#[tokio::test]
async fn a_rejection_gets_a_second_opinion_and_only_a_disputed_one_counts_against_the_provider() {
    // Both reject: the client's own mistake goes back, after one second opinion, and counts
    // against neither.
    let a = mock("[chat]\nerror_400 = 1.0\n").await;
    let b = mock("[chat]\nerror_400 = 1.0\n").await;
    let gw = start(&config(a.addr, b.addr), &[("MOCK_KEY_A", "k")]).await;
    for _ in 0..6 {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
        assert_eq!(r.status, 400, "{}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["code"], "upstream_rejected_request");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("mock rejects this request"));
        assert_eq!(r.header("x-equiroute-attempts"), Some("2"));
    }
    assert_eq!(calls(b.addr).await["chat"], 6, "asked once each");
    for id in ["a", "b"] {
        assert_eq!(
            rejection_marks(gw.addr, id).await,
            ("closed".into(), 0),
            "{id}"
        );
    }
    // `b` answers what `a` rejects: the client gets `b`'s answer, and `a`'s rejection is
    // its own, counted against its breaker (open after 5 in a row, the default).
    let b = mock("").await;
    let gw = start(&config(a.addr, b.addr), &[("MOCK_KEY_A", "k")]).await;
    for n in 1..=5 {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
        assert_eq!(r.routed(), (200, Some("b"), Some("2")), "{}", r.body);
        let breaker = if n < 5 { "closed" } else { "open" };
        assert_eq!(
            rejection_marks(gw.addr, "a").await,
            (breaker.into(), n),
            "{n}"
        );
    }
    // Demoted: straight to `b`.
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(r.routed(), (200, Some("b"), Some("1")), "{}", r.body);
}

#[tokio::test]
async fn timeouts_and_dead_providers_fall_back_within_the_deadline() {
    let a = mock("[chat]\nlatency = { p50_ms = 2000, p95_ms = 2000 }\n").await;
    let b = mock("").await;
    let cfg = config_with(a.addr, b.addr, "attempt_timeout_ms = 200");
    let gw = start(&cfg, &[("MOCK_KEY_A", "k")]).await;
    let t = std::time::Instant::now();
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(
        (r.status, r.header("x-equiroute-provider")),
        (200, Some("b"))
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        t.elapsed()
    );
    // A provider nobody listens on: connection refused, then fallback.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let gw = start(&config(dead, b.addr), &[("MOCK_KEY_A", "k")]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(
        (r.status, r.header("x-equiroute-provider")),
        (200, Some("b")),
        "{}",
        r.body
    );
    let tool = http(
        gw.addr,
        "POST",
        "/v1/tools/web_search",
        &[],
        r#"{"query":"x"}"#,
    )
    .await;
    assert_eq!(tool.status, 502, "{}", tool.body);
    assert!(
        !tool.body.contains(&dead.to_string()),
        "provider URLs stay private: {}",
        tool.body
    );
}

fn streamed() -> String {
    json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

#[tokio::test]
async fn streamed_bytes_are_the_providers_and_end_with_done() {
    let a = mock("").await;
    let b = mock("").await;
    let gw = start(&config(a.addr, b.addr), &[("MOCK_KEY_A", "k")]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &streamed()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("x-equiroute-provider"), Some("a"));
    let want: String = equiroute_mock::stream_chunks("model-a").concat();
    assert_eq!(r.body, want, "relayed byte for byte");
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        m.contains(r#"equiroute_requests_total{interface="chat",outcome="ok"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn a_broken_stream_ends_in_an_error_event_not_done() {
    for profile in [
        "[chat]\nstream_cut_after = 2\n",
        "[chat]\nstream_stall_after = 2\n",
    ] {
        let a = mock(profile).await;
        let b = mock("").await;
        let cfg = config_with(a.addr, b.addr, "stream_idle_ms = 300");
        let gw = start(&cfg, &[("MOCK_KEY_A", "k")]).await;
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &streamed()).await;
        assert_eq!(r.status, 200, "the stream was committed before it broke");
        // What arrived before the break was relayed as is (the mock's server may drop a buffered
        // chunk when it cuts the connection, so only the first is certain).
        assert!(
            r.body
                .starts_with(&equiroute_mock::stream_chunks("model-a")[0]),
            "{}",
            r.body
        );
        assert!(
            r.body.contains("\"code\":\"stream_broken\""),
            "{profile}: {}",
            r.body
        );
        assert!(
            !r.body.contains("[DONE]"),
            "{profile}: a broken stream must not look complete"
        );
        let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
        assert!(
            m.contains(r#"provider="a",status="provider_error"} 1"#),
            "{profile}: {m}"
        );
    }
}

#[tokio::test]
async fn no_first_byte_in_time_falls_back_before_anything_is_sent() {
    let a = mock("[chat]\nlatency = { p50_ms = 2000, p95_ms = 2000 }\n").await;
    let b = mock("").await;
    let cfg = config_with(a.addr, b.addr, "attempt_timeout_ms = 200");
    let gw = start(&cfg, &[("MOCK_KEY_A", "k")]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &streamed()).await;
    assert_eq!(
        (
            r.status,
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (200, Some("b"), Some("2"))
    );
    assert_eq!(r.body, equiroute_mock::stream_chunks("model-b").concat());
}

#[tokio::test]
async fn a_context_length_error_moves_to_a_larger_window() {
    let small =
        mock("[chat]\nerror_400 = 1.0\nerror_400_code = \"context_length_exceeded\"\n").await;
    let tiny = mock("").await;
    let large = mock("").await;
    let cfg = format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "static", candidate = "small" }}

[[interfaces.chat.providers]]
id = "small"
kind = "openai"
base_url = "http://{}/v1"
capabilities = {{ context_tokens = 8000 }}

[[interfaces.chat.providers]]
id = "tiny"
kind = "openai"
base_url = "http://{}/v1"
capabilities = {{ context_tokens = 4000 }}

[[interfaces.chat.providers]]
id = "large"
kind = "openai"
base_url = "http://{}/v1"
capabilities = {{ context_tokens = 200000 }}
"#,
        small.addr, tiny.addr, large.addr
    );
    let gw = start(&cfg, &[]).await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(
        (
            r.status,
            r.header("x-equiroute-provider"),
            r.header("x-equiroute-attempts")
        ),
        (200, Some("large"), Some("2")),
        "{}",
        r.body
    );
    assert_eq!(
        calls(tiny.addr).await["chat"],
        0,
        "a smaller window is not tried"
    );
    // Other 400s get a second opinion from the next in the ranking, whatever its window.
    let plain = mock("[chat]\nerror_400 = 1.0\n").await;
    let gw = start(
        &cfg.replace(&small.addr.to_string(), &plain.addr.to_string()),
        &[],
    )
    .await;
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat()).await;
    assert_eq!(r.routed(), (200, Some("tiny"), Some("2")), "{}", r.body);
    assert_eq!(calls(large.addr).await["chat"], 1);
}
