//! A cheap provider behind a rate limit it announces (issue 42, bar 4b): its answers' rate-limit
//! headers say what is left; once nothing is, the gateway rests it until the reset the headers
//! name, so the requests beyond its capacity go to the dearer provider instead of taking a 429
//! and a fallback, and the cheap one's capacity is used again as soon as it is back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{calls, http, mock, start};
use std::time::{Duration, Instant};

/// `cheap` admits 4 calls a second and says so (OpenAI's headers, or Anthropic's); `dear`, four
/// times its price, has no limit. Requests (streamed or not) offered at about 25 a second for
/// 3.5 s.
async fn play(kind: &str, stream: bool) {
    let limited = mock("[models.cheap]\nrate_limit = { requests = 4, window_ms = 1000 }\n").await;
    let unlimited = mock("").await;
    let cfg = format!(
        r#"
[interfaces.chat]
kind = "chat"

[[interfaces.chat.providers]]
id = "a"
kind = "{kind}"
model = "cheap"
base_url = "http://{}/v1"
max_tokens = 100
price = {{ per_call = 0.001 }}

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "dear"
base_url = "http://{}/v1"
price = {{ per_call = 0.004 }}
"#,
        limited.addr, unlimited.addr
    );
    let cfg = if kind == "anthropic" {
        cfg
    } else {
        cfg.replacen("max_tokens = 100\n", "", 1)
    };
    let gw = start(&cfg, &[]).await;
    let body = format!(
        r#"{{"model":"chat","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let until = Instant::now() + Duration::from_millis(3500);
    let (mut requests, mut from_a) = (0, 0);
    while Instant::now() < until {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &body).await;
        assert_eq!(r.status, 200, "{kind}: {}", r.body);
        if r.header("x-equiroute-provider") == Some("a") {
            assert_eq!(
                r.header("x-equiroute-attempts"),
                Some("1"),
                "{kind}: {}",
                r.body
            );
            from_a += 1;
        }
        requests += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a_calls = calls(limited.addr, "cheap").await;
    eprintln!("{kind} (stream: {stream}): {from_a} of {requests} requests answered by the limited provider, {a_calls} calls to it");
    // Every call to `a` was admitted: not one 429 taken, not even the first window's.
    assert_eq!(
        a_calls, from_a,
        "{kind}: a call to the limited provider was refused"
    );
    // Its capacity (4 a second, at most 16 in 3.5 s) was used again after each reset.
    assert!(
        from_a >= 8,
        "{kind}: only {from_a} of {requests} on the limited provider"
    );
    assert!(
        requests > from_a + 20,
        "{kind}: {requests} requests, {from_a} on a"
    );
}

#[tokio::test]
async fn a_provider_announcing_openai_rate_limit_headers_is_rested_until_the_reset_not_429d() {
    play("openai", false).await;
}

#[tokio::test]
async fn a_provider_announcing_anthropic_rate_limit_headers_is_rested_until_the_reset_not_429d() {
    play("anthropic", false).await;
}

#[tokio::test]
async fn a_provider_announcing_its_rate_limit_on_streams_is_rested_until_the_reset_not_429d() {
    play("openai", true).await;
    play("anthropic", true).await;
}
