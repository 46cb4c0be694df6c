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

/// A gateway whose `a` (the mock's `cheap`) carries `caps` and `b` (`dear`) none, sharing
/// learning state through `redis` when given.
fn capped(
    caps: &str,
    cheap: std::net::SocketAddr,
    dear: std::net::SocketAddr,
    redis: Option<&str>,
) -> String {
    let state = redis.map_or(String::new(), |url| {
        format!("[state]\nbackend = \"redis\"\nurl = \"{url}\"\nnamespace = \"caps\"\nsync_interval_ms = 50\n\n")
    });
    format!(
        r#"{state}[interfaces.chat]
kind = "chat"

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "cheap"
base_url = "http://{cheap}/v1"
price = {{ per_call = 0.001 }}
{caps}

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "dear"
base_url = "http://{dear}/v1"
price = {{ per_call = 0.004 }}
"#
    )
}

const HI: &str = r#"{"model":"chat","messages":[{"role":"user","content":"hi"}]}"#;
const HI_TO_A: &str = r#"{"model":"chat/a","messages":[{"role":"user","content":"hi"}]}"#;

/// Sends `body` to `gw`; the status and whether a 429 is the gateway's capacity refusal with a
/// `Retry-After`.
async fn send(gw: std::net::SocketAddr, body: &str) -> (u16, Option<String>) {
    let r = http(gw, "POST", "/v1/chat/completions", &[], body).await;
    if r.status == 429 {
        assert_eq!(
            r.json()["error"]["code"],
            "capacity_exhausted",
            "{}",
            r.body
        );
        assert_eq!(r.header("x-equiroute-attempts"), Some("0"), "{}", r.body);
        let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=61).contains(&after), "Retry-After {after}");
    } else {
        assert_eq!(r.status, 200, "{}", r.body);
    }
    (
        r.status,
        r.header("x-equiroute-provider").map(str::to_owned),
    )
}

#[tokio::test]
async fn a_declared_rpm_is_never_exceeded_the_rest_goes_elsewhere_or_gets_429_with_retry_after() {
    let (cheap, dear) = (mock("").await, mock("").await);
    let gw = start(&capped("rpm = 3", cheap.addr, dear.addr, None), &[]).await;
    let mut statuses = Vec::new();
    for _ in 0..8 {
        statuses.push(send(gw.addr, HI_TO_A).await.0);
    }
    // Pinned to `a`: three answers, then the gateway's own 429 (no call made).
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429]);
    assert_eq!(calls(cheap.addr, "cheap").await, 3);
    // Unpinned, every request is answered, by `b`.
    for _ in 0..5 {
        assert_eq!(send(gw.addr, HI).await, (200, Some("b".to_owned())));
    }
    assert_eq!(calls(cheap.addr, "cheap").await, 3);
    let skipped = common::scraped(
        gw.addr,
        r#"equiroute_capacity_skips_total{interface="chat",provider="a",limit="rpm"}"#,
    )
    .await;
    assert!(skipped >= 5, "{skipped} skips counted");
}

#[tokio::test]
async fn a_declared_tpm_counts_the_tokens_answers_report() {
    let (cheap, dear) = (mock("").await, mock("").await);
    // The mock's answers report a few tokens: the first answer uses the minute's 5.
    let gw = start(&capped("tpm = 5", cheap.addr, dear.addr, None), &[]).await;
    assert_eq!(send(gw.addr, HI_TO_A).await.0, 200);
    assert_eq!(send(gw.addr, HI_TO_A).await.0, 429);
    assert_eq!(send(gw.addr, HI).await, (200, Some("b".to_owned())));
    assert_eq!(calls(cheap.addr, "cheap").await, 1);
}

#[tokio::test]
async fn max_concurrency_bounds_the_requests_in_flight_streams_until_their_end() {
    let cheap = mock("[models.cheap]\nlatency = { p50_ms = 400, p95_ms = 400 }\n").await;
    let dear = mock("").await;
    let gw = start(
        &capped("max_concurrency = 2", cheap.addr, dear.addr, None),
        &[],
    )
    .await;
    let addr = gw.addr;
    // Six at once, pinned to `a`: two go, four are refused while those are in flight.
    let sent: Vec<_> = (0..6)
        .map(|_| tokio::spawn(async move { send(addr, HI_TO_A).await.0 }))
        .collect();
    let mut statuses = Vec::new();
    for s in sent {
        statuses.push(s.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);
    // Once they ended, their places are free again.
    assert_eq!(send(addr, HI_TO_A).await.0, 200);
    // A stream holds its place until its last byte: one open stream and one more request
    // fill the two places.
    let streamed =
        r#"{"model":"chat/a","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let first =
        tokio::spawn(
            async move { http(addr, "POST", "/v1/chat/completions", &[], streamed).await },
        );
    let second = tokio::spawn(async move { send(addr, HI_TO_A).await.0 });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send(addr, HI_TO_A).await.0, 429);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(second.await.unwrap(), 200);
}

/// Waits until `gw` says its Redis is reachable (the shared counts need the connection).
async fn synced(gw: std::net::SocketAddr) {
    for _ in 0..100 {
        let r = http(gw, "GET", "/readyz", &[], "").await;
        if r.body.contains("\"redis_reachable\":true") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never reached its redis-server");
}

/// Starts two gateways on `cfg` (one Redis), waits until both reach it, and sends `n`
/// requests pinned to `a`, alternating between them: each reply's status and
/// `x-equiroute-attempts`.
async fn alternate(cfg: &str, n: usize) -> Vec<(u16, Option<String>)> {
    let (one, two) = (start(cfg, &[]).await, start(cfg, &[]).await);
    synced(one.addr).await;
    synced(two.addr).await;
    let mut replies = Vec::new();
    for i in 0..n {
        let gw = if i % 2 == 0 { one.addr } else { two.addr };
        let r = http(gw, "POST", "/v1/chat/completions", &[], HI_TO_A).await;
        replies.push((
            r.status,
            r.header("x-equiroute-attempts").map(str::to_owned),
        ));
    }
    replies
}

#[tokio::test]
async fn two_instances_sharing_redis_stay_within_one_declared_rpm_together() {
    let Some(redis) = common::redis::RedisServer::start("caps-rpm") else {
        return;
    };
    let (cheap, dear) = (mock("").await, mock("").await);
    let cfg = capped("rpm = 4", cheap.addr, dear.addr, Some(&redis.url()));
    let statuses: Vec<u16> = alternate(&cfg, 12).await.into_iter().map(|r| r.0).collect();
    // Alone, each instance would have sent four.
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 429, 429, 429, 429, 429, 429, 429, 429]
    );
    assert_eq!(calls(cheap.addr, "cheap").await, 4);
}

#[tokio::test]
async fn two_instances_sharing_redis_stay_within_the_limit_a_provider_announces() {
    let Some(redis) = common::redis::RedisServer::start("caps-announced") else {
        return;
    };
    let limited = mock("[models.cheap]\nrate_limit = { requests = 5, window_ms = 60000 }\n").await;
    let dear = mock("").await;
    let cfg = capped("", limited.addr, dear.addr, Some(&redis.url()));
    let replies = alternate(&cfg, 12).await;
    for (status, attempts) in &replies[5..] {
        // Past the limit: the shared count's 429, or, on an instance whose breaker rests
        // the provider until the reset the headers named, its 503; never a call.
        assert!(
            [429, 503].contains(status) && attempts.as_deref() == Some("0"),
            "{replies:?}"
        );
    }
    // The limit's five calls were used, and no call past it was made: each answer's headers
    // set the count both instances take from (an instance reads it once it has heard the
    // provider announce).
    assert!(replies[..5].iter().all(|r| r.0 == 200), "{replies:?}");
    assert_eq!(calls(limited.addr, "cheap").await, 5);
}
