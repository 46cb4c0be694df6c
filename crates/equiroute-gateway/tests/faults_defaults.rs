//! Each fault row of docs/faults.md played with a configuration that declares only the
//! providers (id, kind and the mock's URL: no policy, deadline, timeout, breaker, hold or
//! resume settings): what a careful client sees with the defaults, the "with defaults"
//! column. Provider `a` (first in the file, so first while nothing is learnt) plays the
//! fault; `b`, on a healthy mock, is behind it. A request may carry the client's own
//! deadline (`x-equiroute-deadline-ms`), as a careful client does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{calls, http, mock, scraped, start, streamed_text, Gateway, Reply};
use serde_json::json;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// A client's deadline of 3 s, in the header a careful client sends.
const DEADLINE_3S: (&str, &str) = ("x-equiroute-deadline-ms", "3000");
/// The header by which a client says it drops what it joined before a restart marker.
const RESTART_EVENTS: (&str, &str) = ("x-equiroute-stream-restart", "events");

/// A chat interface of `providers` (id, kind, upstream), declared with nothing else.
fn providers_only(providers: &[(&str, &str, SocketAddr)]) -> String {
    let mut cfg = String::from("[interfaces.chat]\nkind = \"chat\"\n");
    for (id, kind, addr) in providers {
        let _ = write!(
            cfg,
            "\n[[interfaces.chat.providers]]\nid = \"{id}\"\nkind = \"{kind}\"\nbase_url = \"http://{addr}/v1\"\n"
        );
    }
    cfg
}

/// `a` on a mock playing `fault` (`lines` added to its table), `b` of `b_kind` on a mock
/// whose model `b` plays `b_profile` (healthy when empty).
struct Rig {
    faulty: Gateway,
    healthy: Gateway,
    gw: Gateway,
}

async fn rig(fault: &str, lines: &str) -> Rig {
    rig_onto(fault, lines, "openai", "").await
}

async fn rig_onto(fault: &str, lines: &str, b_kind: &str, b_profile: &str) -> Rig {
    let faulty = mock(&format!("[models.a]\nfault = \"{fault}\"\n{lines}\n")).await;
    let healthy = mock(b_profile).await;
    let cfg = providers_only(&[("a", "openai", faulty.addr), ("b", b_kind, healthy.addr)]);
    let gw = start(&cfg, &[]).await;
    Rig {
        faulty,
        healthy,
        gw,
    }
}

/// A client's request with its own deadline, after `warm` streams pinned to `a`: the policy
/// ranks `a` and `b` by a random draw of their deadline risk, so fresh rigs are made until
/// one tries `a` first. The rig, its reply and how long it took.
async fn first_on_a(fault: &str, lines: &str, stream: bool, warm: u64) -> (Rig, Reply, Duration) {
    let pinned =
        json!({"model": "chat/a", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..16 {
        let rig = rig(fault, lines).await;
        for _ in 0..warm {
            let body = pinned.to_string();
            let r = http(
                rig.gw.addr,
                "POST",
                "/v1/chat/completions",
                &[DEADLINE_3S],
                &body,
            )
            .await;
            assert_eq!(r.routed(), (200, Some("a"), Some("1")), "{}", r.body);
        }
        let t = Instant::now();
        let r = rig.ask(stream, &[DEADLINE_3S]).await;
        let took = t.elapsed();
        if rig.a_calls().await > warm {
            return (rig, r, took);
        }
        assert_eq!(r.routed(), (200, Some("b"), Some("1")), "{}", r.body);
    }
    panic!("{fault}: `a` was never ranked first")
}

fn chat_body(stream: bool) -> String {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

impl Rig {
    async fn chat(&self) -> Reply {
        self.ask(false, &[]).await
    }
    async fn stream(&self) -> Reply {
        self.ask(true, &[]).await
    }
    async fn ask(&self, stream: bool, headers: &[(&str, &str)]) -> Reply {
        let body = chat_body(stream);
        http(self.gw.addr, "POST", "/v1/chat/completions", headers, &body).await
    }
    async fn a_calls(&self) -> u64 {
        calls(self.faulty.addr, "a").await
    }
    async fn b_calls(&self) -> u64 {
        calls(self.healthy.addr, "b").await
    }
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
}

/// `b` answered after `attempts` attempts.
fn from_b(r: &Reply, attempts: &str) {
    assert_eq!(r.routed(), (200, Some("b"), Some(attempts)), "{}", r.body);
}

/// `b`'s whole stream, nothing of `a`'s.
fn only_bs_stream(r: &Reply) {
    assert_eq!(r.body, equiroute_mock::stream_chunks("b").concat());
}

/// A stream committed to `a` that broke: `a`'s first events, the error event, no `[DONE]`.
fn broken_stream_of_a(r: &Reply, fault: &str) {
    assert_eq!(r.routed(), (200, Some("a"), Some("1")), "{}", r.body);
    let chunks = equiroute_mock::stream_chunks("a");
    assert!(r.body.starts_with(&chunks[0]), "{}", r.body);
    assert!(r.body.contains("\"code\":\"stream_broken\""), "{}", r.body);
    assert!(!r.body.contains("data: [DONE]"), "{fault}: {}", r.body);
}

#[tokio::test]
async fn defaults_a_429_with_a_long_retry_after_falls_over_and_rests_the_provider() {
    let rig = rig("rate_limited", "retry_after_s = 30").await;
    from_b(&rig.chat().await, "2");
    assert_eq!(rig.breaker("a").await, "open");
    for _ in 0..3 {
        from_b(&rig.chat().await, "1");
    }
    assert_eq!(rig.a_calls().await, 1);
}

#[tokio::test]
async fn defaults_a_persistent_429_is_left_after_five_in_a_row() {
    let rig = rig("rate_limited_no_retry_after", "").await;
    for _ in 0..12 {
        let r = rig.chat().await;
        assert_eq!(r.routed().0, 200, "{}", r.body);
        assert_eq!(r.header("x-equiroute-provider"), Some("b"));
    }
    // The policy puts `b` first after `a`'s first failures; at most five in a row open the
    // breaker.
    let a = rig.a_calls().await;
    assert!((1..=5).contains(&a), "{a} calls to a");
}

#[tokio::test]
async fn defaults_a_500_once_is_retried_once_on_the_same_provider() {
    let rig = rig("error_500_once", "").await;
    assert_eq!(rig.chat().await.routed(), (200, Some("a"), Some("2")));
    assert_eq!(rig.b_calls().await, 0);
    assert_eq!(rig.breaker("a").await, "closed");
}

#[tokio::test]
async fn defaults_a_persistent_503_is_retried_once_then_falls_over() {
    let rig = rig("unavailable", "").await;
    from_b(&rig.chat().await, "3");
    for _ in 0..6 {
        let r = rig.chat().await;
        assert_eq!(r.header("x-equiroute-provider"), Some("b"), "{}", r.body);
    }
    // The policy puts `b` first after that (or `a`'s breaker opens after five in a row).
    let a = rig.a_calls().await;
    assert!((2..=5).contains(&a), "{a} calls to a");
}

#[tokio::test]
async fn defaults_a_short_retry_after_is_waited_out_once() {
    let rig = rig("rate_limited", "retry_after_s = 0.2").await;
    let began = Instant::now();
    let r = rig.chat().await;
    assert!(began.elapsed() >= Duration::from_millis(200));
    from_b(&r, "3");
    assert_eq!(rig.a_calls().await, 2);
}

#[tokio::test]
async fn defaults_a_connection_reset_before_headers_falls_over() {
    let rig = rig("reset", "").await;
    from_b(&rig.chat().await, "2");
    let streamed = self::rig("reset", "").await;
    let s = streamed.stream().await;
    from_b(&s, "2");
    only_bs_stream(&s);
}

/// A provider that never answers: a plain request gives it half of the client's 3 s (its
/// answer times are not learnt yet, and `b` is left), then asks `b`; a streamed one gives up
/// its first byte at the same share.
#[tokio::test]
async fn defaults_a_provider_that_never_answers_falls_over_within_the_clients_deadline() {
    for stream in [false, true] {
        let (rig, r, took) = first_on_a("no_answer", "", stream, 0).await;
        from_b(&r, "2");
        if stream {
            only_bs_stream(&r);
        }
        assert!(took >= Duration::from_millis(1400), "{stream}: {took:?}");
        assert!(took < Duration::from_millis(2900), "{stream}: {took:?}");
        assert_eq!(rig.b_calls().await, 1);
    }
}

/// What the plain-answer limit costs healthy slow providers (`a` and `b` alike, each on a
/// mock of its own), with the client's 3 s deadline: answers of 1.2 s, under half of it,
/// come from whichever is tried first. Answers of 2 s, while neither's answer times are
/// known, are given up at half of the time left each: a 504 (the cost, in docs/faults.md);
/// once five answers of each are learnt (asked without a deadline), their learnt limit
/// (about 16 s) lets every 2 s answer through on the first attempt.
#[tokio::test]
async fn defaults_healthy_slow_plain_answers_are_cut_at_half_the_deadline_only_until_learnt() {
    // `a` and `b` answering after `ms`, on mocks of their own, behind a gateway.
    let pair = |ms: u32| async move {
        let slow = |id: &str| {
            format!(
                "[models.{id}]\nlatency = {{ p50_ms = {ms}, p95_ms = {} }}\n",
                ms + 50
            )
        };
        let (a, b) = (mock(&slow("a")).await, mock(&slow("b")).await);
        let cfg = providers_only(&[("a", "openai", a.addr), ("b", "openai", b.addr)]);
        let gw = start(&cfg, &[]).await;
        (gw, a, b)
    };
    let ask = |gw: SocketAddr, body: String, headers: &'static [(&'static str, &'static str)]| async move {
        http(gw, "POST", "/v1/chat/completions", headers, &body).await
    };
    // Four requests with the client's 3 s deadline, each answered by its first attempt.
    let four_first_time = |gw: SocketAddr| async move {
        for _ in 0..4 {
            let r = ask(gw, chat_body(false), &[DEADLINE_3S]).await;
            let answered = (r.status, r.header("x-equiroute-attempts"));
            assert_eq!(answered, (200, Some("1")), "{}", r.body);
        }
    };
    let (gw, _a, _b) = pair(1200).await;
    four_first_time(gw.addr).await;
    let (gw, a, b) = pair(2000).await;
    let r = ask(gw.addr, chat_body(false), &[DEADLINE_3S]).await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(calls(a.addr, "a").await + calls(b.addr, "b").await, 2);
    for id in ["a", "b"] {
        let pinned =
            json!({"model": format!("chat/{id}"), "messages": [{"role": "user", "content": "hi"}]});
        for _ in 0..5 {
            let r = ask(gw.addr, pinned.to_string(), &[]).await;
            assert_eq!(r.routed(), (200, Some(id), Some("1")), "{}", r.body);
        }
    }
    four_first_time(gw.addr).await;
    assert_eq!(
        calls(a.addr, "a").await + calls(b.addr, "b").await,
        2 + 10 + 4
    );
}

#[tokio::test]
async fn defaults_a_slow_first_token_is_given_up_within_the_clients_deadline() {
    // 3 s and 8 s before the first byte: either is given up at half the 3 s left.
    for delay in [3000, 8000] {
        let lines = format!("first_token_delay_ms = {delay}");
        let (_rig, r, took) = first_on_a("slow_first_token", &lines, true, 0).await;
        from_b(&r, "2");
        only_bs_stream(&r);
        assert!(took < Duration::from_millis(2900), "{delay}: {took:?}");
    }
}

#[tokio::test]
async fn defaults_a_provider_that_stops_sending_first_bytes_is_cut_off_at_its_learnt_limit() {
    // After `a`'s 6 good streams, the next request `a` gets first is cut off at its learnt
    // limit (the 1 s floor), not at half of the 3 s left; `b` answers.
    let (_rig, r, took) = first_on_a("no_answer", "healthy_calls = 6", true, 6).await;
    from_b(&r, "2");
    only_bs_stream(&r);
    assert!(took < Duration::from_millis(1450), "{took:?}");
}

#[tokio::test]
async fn defaults_a_stream_cut_after_content_ends_in_an_error_event_without_prefill() {
    // `b` takes no prefill, and the client asked for no restart events: the honest error.
    for fault in ["stream_cut", "malformed_chunk", "no_done_unfinished"] {
        let rig = rig(fault, "").await;
        let r = rig.stream().await;
        broken_stream_of_a(&r, fault);
        assert_eq!(rig.b_calls().await, 0, "{fault}");
        if fault == "stream_cut" {
            let (text, markers) = streamed_text(&r.body);
            assert_eq!((text.as_str(), markers.len()), ("mock ", 0));
            assert!(r.body.contains("x-equiroute-stream-restart: events"));
        }
        if fault == "malformed_chunk" {
            assert!(!r.body.contains(equiroute_mock::MALFORMED_CHUNK));
            assert!(r.body.contains("not JSON"), "{}", r.body);
        }
    }
}

#[tokio::test]
async fn defaults_a_stream_cut_after_content_goes_on_from_its_prefix_on_a_provider_with_prefill() {
    for fault in ["stream_cut", "malformed_chunk", "no_done_unfinished"] {
        let rig = rig_onto(fault, "", "anthropic", "").await;
        let r = rig.stream().await;
        // Committed to `a` (its headers went with its first content).
        assert_eq!(
            r.routed(),
            (200, Some("a"), Some("1")),
            "{fault}: {}",
            r.body
        );
        assert!(r.body.ends_with("data: [DONE]\n\n"), "{fault}: {}", r.body);
        let (text, markers) = streamed_text(&r.body);
        assert!(
            text.starts_with("mock ") && text.ends_with("answer"),
            "{fault}: {text}"
        );
        assert_eq!(markers[0]["event"], "continue", "{fault}");
    }
}

#[tokio::test]
async fn defaults_a_stream_cut_before_content_falls_over_unseen() {
    // Cut after the role chunk: held (nothing the client joins was sent), `b`'s stream alone.
    for (fault, lines) in [
        ("stream_cut", "stream_cut_after = 1"),
        ("malformed_chunk", "stream_cut_after = 1"),
    ] {
        let rig = rig(fault, lines).await;
        let r = rig.stream().await;
        from_b(&r, "2");
        only_bs_stream(&r);
    }
}

#[tokio::test]
async fn defaults_a_stream_cut_restarts_marked_for_a_client_that_reads_restart_events() {
    let rig = rig("stream_cut", "").await;
    let r = rig.ask(true, &[RESTART_EVENTS]).await;
    assert_eq!(r.status, 200);
    let b_sent = equiroute_mock::stream_chunks("b").concat();
    assert!(r.body.ends_with(&b_sent), "{}", r.body);
    let (_, markers) = streamed_text(&r.body);
    assert_eq!(markers[0]["event"], "restart", "{}", r.body);
}

#[tokio::test]
async fn defaults_a_continuation_that_breaks_too_ends_in_an_error_event() {
    let rig = rig_onto(
        "stream_cut",
        "",
        "openai",
        "[models.b]\nfault = \"stream_cut\"\n",
    )
    .await;
    let r = rig.ask(true, &[RESTART_EVENTS]).await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("\"event\":\"restart\""), "{}", r.body);
    assert!(r.body.contains("\"code\":\"stream_broken\""), "{}", r.body);
    assert!(!r.body.contains("data: [DONE]"), "{}", r.body);
}

#[tokio::test]
async fn defaults_a_stream_with_its_finish_reason_but_no_done_is_completed() {
    let rig = rig("no_done_finished", "").await;
    let r = rig.stream().await;
    assert_eq!(r.routed(), (200, Some("a"), Some("1")));
    let mut want =
        equiroute_mock::faulty_stream_chunks("a", Some(equiroute_mock::Fault::NoDoneFinished))
            .concat();
    want.push_str("data: [DONE]\n\n");
    assert_eq!(r.body, want);
}

#[tokio::test]
async fn defaults_a_context_length_refusal_tries_one_other_candidate() {
    let rig = rig("context_length_exceeded", "").await;
    from_b(&rig.chat().await, "2");
    assert_eq!(rig.breaker("a").await, "closed");
    // Refused by two: the request ends, a third provider is not called.
    let refusing = mock(
        "[models.a]\nfault = \"context_length_exceeded\"\n[models.b]\nfault = \"context_length_exceeded\"\n",
    )
    .await;
    let healthy = mock("").await;
    let cfg = providers_only(&[
        ("a", "openai", refusing.addr),
        ("b", "openai", refusing.addr),
        ("c", "openai", healthy.addr),
    ]);
    let gw = start(&cfg, &[]).await;
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
    assert_eq!(calls(healthy.addr, "c").await, 0);
}

#[tokio::test]
async fn defaults_a_content_filter_refusal_goes_back_to_the_caller() {
    let rig = rig("content_filter", "").await;
    let r = rig.chat().await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.header("x-equiroute-attempts"), Some("1"));
    assert_eq!(r.json()["error"]["code"], "content_filter");
    assert_eq!(rig.b_calls().await, 0);
    assert_eq!(rig.breaker("a").await, "closed");
}

#[tokio::test]
async fn defaults_a_prefill_rejection_gets_a_second_opinion() {
    let rig = rig("prefill_rejected", "").await;
    from_b(&rig.chat().await, "2");
    let disputed = "equiroute_rejections_disputed_total{interface=\"chat\",provider=\"a\"}";
    assert_eq!(scraped(rig.gw.addr, disputed).await, 1);
}

#[tokio::test]
async fn defaults_a_flapping_provider_is_retried_past_each_bad_call() {
    let rig = rig("flapping", "").await;
    for _ in 0..6 {
        let r = rig.chat().await;
        assert_eq!(r.status, 200, "{}", r.body);
        // Whenever `a` is tried it meets a bad call, then a good one on the retry.
        if r.header("x-equiroute-provider") == Some("a") {
            assert_eq!(r.header("x-equiroute-attempts"), Some("2"));
        }
    }
    assert_eq!(rig.breaker("a").await, "closed");
}

#[tokio::test]
async fn defaults_all_breakers_open_answers_503_with_the_time_to_the_first_half_open() {
    let rig = rig("rate_limited", "retry_after_s = 30").await;
    let pinned =
        json!({"model": "chat/a", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let first = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &pinned).await;
    assert_eq!(first.status, 502, "{}", first.body);
    let r = http(rig.gw.addr, "POST", "/v1/chat/completions", &[], &pinned).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_eligible_provider");
    assert_eq!(r.header("retry-after"), Some("30"));
    assert_eq!(r.header("x-equiroute-attempts"), Some("0"));
}

#[tokio::test]
async fn defaults_with_every_breaker_tripped_by_failures_the_one_reopening_soonest_is_probed() {
    // `a` fails its first 6 calls, `b` every call.
    let faulty = mock(
        "[models.a]\nfault = \"outage_then_recovers\"\noutage_calls = [1, 7]\n[models.b]\nfault = \"unavailable\"\n",
    )
    .await;
    let cfg = providers_only(&[("a", "openai", faulty.addr), ("b", "openai", faulty.addr)]);
    let gw = start(&cfg, &[]).await;
    let mut seen = Vec::new();
    for _ in 0..8 {
        let r = http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_body(false),
        )
        .await;
        seen.push((
            r.status,
            r.header("x-equiroute-provider").map(str::to_owned),
        ));
        if r.status == 200 {
            break;
        }
    }
    // Never a 503 while both breakers are open: `a`, reopening first, is probed and answers.
    assert!(seen.iter().all(|(s, _)| *s != 503), "{seen:?}");
    assert_eq!(
        seen.last().unwrap(),
        &(200, Some("a".to_owned())),
        "{seen:?}"
    );
}

/// The rows whose defaults take seconds (the 30 s stream idle and send timeouts, the breaker's
/// 5 s), run at once.
#[tokio::test]
async fn defaults_the_slow_rows_end_as_a_careful_client_would() {
    tokio::join!(
        stall_after_content(),
        client_that_stops_reading(),
        slow_first_token_without_a_deadline(),
        outage_then_back(),
        outage_by_calls_then_back(),
    );
}

/// A stall after content: ended after `stream_idle_ms` (30 s), as a cut stream.
async fn stall_after_content() {
    let rig = rig("stream_stall", "").await;
    let t = Instant::now();
    let r = rig.stream().await;
    broken_stream_of_a(&r, "stream_stall");
    assert!(r.body.contains("stalled"), "{}", r.body);
    let took = t.elapsed();
    assert!(
        (Duration::from_secs(29)..Duration::from_secs(40)).contains(&took),
        "{took:?}"
    );
}

/// A 3 s first byte without a client deadline: within the unlearnt 5 s limit, `a` answers.
async fn slow_first_token_without_a_deadline() {
    let rig = rig("slow_first_token", "first_token_delay_ms = 3000").await;
    let t = Instant::now();
    let r = rig.stream().await;
    assert_eq!(r.routed(), (200, Some("a"), Some("1")), "{}", r.body);
    assert!(t.elapsed() >= Duration::from_secs(3));
}

/// `a` answers 503 for 1.5 s, then recovers: `b` answers meanwhile, `a` gets traffic back.
async fn outage_then_back() {
    let began = Instant::now();
    let rig = rig("outage", "outage_ms = 1500").await;
    let recovered = began + Duration::from_millis(1500);
    let mut back = None;
    while began.elapsed() < Duration::from_secs(30) {
        let r = rig.chat().await;
        assert_eq!(r.status, 200, "{}", r.body);
        if Instant::now() > recovered && r.header("x-equiroute-provider") == Some("a") {
            back = Some(recovered.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back = back.expect("a never got traffic back");
    eprintln!("outage: a back {back:?} after its recovery");
    // Within the breaker's longest open period (10 s) of its recovery.
    assert!(back < Duration::from_secs(12), "{back:?}");
}

/// `a` answers 503 to its first four calls (two requests, each retried once), then is
/// healthy (`outage_then_recovers`): `b` answers meanwhile; `a`, re-tested by the policy or its
/// breaker, gets traffic back.
async fn outage_by_calls_then_back() {
    let rig = rig("outage_then_recovers", "outage_calls = [1, 5]").await;
    let began = Instant::now();
    let (mut over, mut back) = (None, None);
    while began.elapsed() < Duration::from_secs(30) {
        let r = rig.chat().await;
        assert_eq!(r.status, 200, "{}", r.body);
        if over.is_none() && rig.a_calls().await >= 4 {
            over = Some(Instant::now());
        } else if let (Some(over), Some("a")) = (over, r.header("x-equiroute-provider")) {
            back = Some(over.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let over = over.expect("a was not called four times");
    let back = back.unwrap_or_else(|| {
        panic!(
            "a never got traffic back ({:?} after its outage)",
            over.elapsed()
        )
    });
    eprintln!("outage by calls: a back {back:?} after its last 503");
    assert!(back < Duration::from_secs(12), "{back:?}");
}

/// A client that stops reading an endless stream: cut off after `send_timeout_ms` (30 s).
async fn client_that_stops_reading() {
    let rig = rig("endless_stream", "chunk_gap_ms = 0").await;
    let _client = common::stalled_reader(rig.gw.addr).await;
    let open = || common::streams_open(rig.faulty.addr);
    let t = Instant::now();
    while open().await > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(45),
            "a's stream is still held open"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("endless stream: released after {:?}", t.elapsed());
}
