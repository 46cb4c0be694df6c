//! A provider that rejects with a 4xx what its peers accept (a wrong model name, a revoked
//! key) is demoted: its rejections are disputed by the peer that answers the same request,
//! and count against its breaker. A request every provider rejects is the client's: it
//! demotes no one. Default policy and breaker: the configuration declares only providers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{calls, http, mock, start, Gateway, Lines};
use serde_json::json;
use std::fmt::Write as _;

/// A mock's route without its default latency: 200 requests take no time.
const NO_WAIT: &str = "latency = { p50_ms = 0, p95_ms = 0 }";

/// An interface `chat` of three OpenAI providers, `bad` first in the file, each with its own
/// model on the mock at `upstreams[i]`; nothing else configured.
async fn gateway(upstreams: [&Gateway; 3]) -> Gateway {
    let mut cfg = String::from("[interfaces.chat]\nkind = \"chat\"\n");
    for (id, up) in ["bad", "one", "two"].iter().zip(upstreams) {
        let _ = write!(
            cfg,
            "\n[[interfaces.chat.providers]]\nid = \"{id}\"\nkind = \"openai\"\nmodel = \"{id}\"\nbase_url = \"http://{}/v1\"\n",
            up.addr
        );
    }
    start(&cfg, &[]).await
}

async fn ask(gw: &Gateway) -> common::Reply {
    ask_streamed(gw, false).await
}

async fn ask_streamed(gw: &Gateway, stream: bool) -> common::Reply {
    let body =
        json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
    let body = body.to_string();
    http(gw.addr, "POST", "/v1/chat/completions", &[], &body).await
}

#[tokio::test]
async fn a_provider_rejecting_what_its_peers_accept_gets_at_most_5_percent_after_20_requests() {
    // The gateway runs on this thread: this subscriber sees its warnings.
    let (lines, _guard) = Lines::capture(tracing::Level::WARN);
    let bad = mock(&format!("[models.bad]\nerror_400 = 1.0\n{NO_WAIT}\n")).await;
    let healthy = mock(&format!("[chat]\n{NO_WAIT}\n")).await;
    let gw = gateway([&bad, &healthy, &healthy]).await;
    let mut answered = 0;
    for _ in 0..20 {
        answered += u32::from(ask(&gw).await.status == 200);
    }
    let early = calls(bad.addr, "bad").await;
    for _ in 20..200 {
        answered += u32::from(ask(&gw).await.status == 200);
    }
    let late = calls(bad.addr, "bad").await - early;
    // Every request answered: each rejection was asked again elsewhere.
    assert_eq!(answered, 200);
    assert!(
        early >= 1,
        "the bad provider was never tried: nothing shown"
    );
    // Its share of requests 21 to 200: at most 5 % (9 of 180).
    assert!(
        late * 20 <= 180,
        "after 20 requests `bad` still got {late} of 180 ({early} before)"
    );
    let disputed = common::scraped(
        gw.addr,
        "equiroute_rejections_disputed_total{interface=\"chat\",provider=\"bad\"}",
    )
    .await;
    assert_eq!(disputed, early + late, "each rejection was disputed");
    let warned = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        warned.lines().any(|l| l.contains("WARN")
            && l.contains("provider=bad")
            && l.contains("its breaker is open")),
        "no warning about `bad`: {warned}"
    );
}

#[tokio::test]
async fn a_request_every_provider_rejects_is_the_clients_and_demotes_no_one() {
    let rejecting = mock(&format!(
        "[models.bad]\nerror_400 = 1.0\n{NO_WAIT}\n[models.one]\nerror_400 = 1.0\n{NO_WAIT}\n[models.two]\nerror_400 = 1.0\n{NO_WAIT}\n"
    ))
    .await;
    let gw = gateway([&rejecting, &rejecting, &rejecting]).await;
    for _ in 0..60 {
        let r = ask(&gw).await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "upstream_rejected_request");
        // A second opinion, never a third.
        assert_eq!(r.header("x-equiroute-attempts"), Some("2"), "{}", r.body);
    }
    for id in ["bad", "one", "two"] {
        let series =
            format!("equiroute_rejections_disputed_total{{interface=\"chat\",provider=\"{id}\"}}");
        assert_eq!(common::scraped(gw.addr, &series).await, 0, "{id}");
        let opened = format!(
            "equiroute_breaker_transitions_total{{interface=\"chat\",provider=\"{id}\",to=\"open\"}}"
        );
        assert_eq!(
            common::scraped(gw.addr, &opened).await,
            0,
            "{id}'s breaker opened"
        );
    }
    // The policy's first choice (`bad`, learning nothing from rejections) was tried on
    // every request, never shut out; one of the others on each, for its second opinion.
    assert_eq!(calls(rejecting.addr, "bad").await, 60);
    let others = calls(rejecting.addr, "one").await + calls(rejecting.addr, "two").await;
    assert_eq!(others, 60);
}

#[tokio::test]
async fn a_streamed_request_a_provider_rejects_is_streamed_by_the_next_and_the_rejection_disputed()
{
    let bad = mock(&format!("[models.bad]\nerror_400 = 1.0\n{NO_WAIT}\n")).await;
    let healthy = mock(&format!("[chat]\n{NO_WAIT}\n")).await;
    let gw = gateway([&bad, &healthy, &healthy]).await;
    let r = ask_streamed(&gw, true).await;
    // The first choice of a fresh interface is the first provider: `bad`.
    assert_eq!(r.header("x-equiroute-attempts"), Some("2"), "{}", r.body);
    assert_eq!(r.status, 200);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    assert_eq!(calls(bad.addr, "bad").await, 1);
    let series = "equiroute_rejections_disputed_total{interface=\"chat\",provider=\"bad\"}";
    assert_eq!(common::scraped(gw.addr, series).await, 1);
}
