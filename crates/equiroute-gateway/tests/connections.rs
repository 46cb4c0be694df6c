//! Connections a client cannot hold for ever, nor more than its share, and load shed
//! instead of taken: the `[server]` header, body and idle timeouts, `max_connections` and the
//! per-address shares, the head and body size limits, on a real gateway on a loopback port
//! driven over raw sockets. Two clients are two loopback addresses: 127.0.0.2 misbehaves,
//! 127.0.0.1 does not.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, mock};
use equiroute_gateway::config::{load, ConnectionLimits};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A chat interface on a fast simulated provider, with `server` as the `[server]` table.
fn config(server: &str) -> String {
    format!(
        r#"
[server]
{server}

[interfaces.chat]
kind = "chat"
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "a"
kind = "sim"
sim = {{ latency = {{ p50_ms = 5, p95_ms = 10 }} }}
"#
    )
}

/// A running gateway whose end the test can wait for.
struct Gateway {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Each `(line, field, fix)`: the configuration with `line` in `[server]` is refused, naming
/// `field` with a fix that says `fix`.
fn assert_refused(cases: &[(&str, &str, &str)]) {
    for &(line, field, fix) in cases {
        let e = load(&config(line), "t.toml", &|_| None).unwrap_err();
        assert_eq!(e.field, field, "{line}");
        assert!(e.fix.contains(fix), "{line}: {}", e.fix);
    }
}

async fn start(config: &str) -> Gateway {
    let cfg = load(config, "test.toml", &|_| None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        equiroute_gateway::serve(&cfg, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    Gateway { addr, stop, served }
}

fn chat_request(stream: bool) -> String {
    json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        .to_string()
}

/// A chat request to `addr`, answered 200 within 2 s (`why` says what that shows).
async fn answered_within_2s(addr: SocketAddr, why: &str) {
    let answered = tokio::time::timeout(
        Duration::from_secs(2),
        http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_request(false),
        ),
    )
    .await
    .expect(why);
    assert_eq!(answered.status, 200, "{}", answered.body);
}

/// Everything the server sends until it closes the connection, and how long that took;
/// `None` if it is still open after `within`.
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Option<(String, Duration)> {
    let started = Instant::now();
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    read.ok().map(|()| {
        (
            String::from_utf8_lossy(&got).into_owned(),
            started.elapsed(),
        )
    })
}

/// The status code and the body of a raw response.
fn status_and_body(raw: &str) -> (u16, &str) {
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body)
}

fn has_header(raw: &str, name: &str, value: &str) -> bool {
    let head = raw.split_once("\r\n\r\n").map_or(raw, |(h, _)| h);
    head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case(name) && v.trim().eq_ignore_ascii_case(value)
        })
    })
}

#[tokio::test]
async fn half_sent_headers_are_cut_at_the_header_timeout() {
    let gw = start(&config("header_read_timeout_ms = 300")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: app")
        .await
        .unwrap();
    let (sent, after) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("a connection with half its headers must be closed");
    assert_eq!(sent, "", "nothing is answered to a request never complete");
    assert!(
        after >= Duration::from_millis(200),
        "closed at the timeout, not before: {after:?}"
    );
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_cut_at_the_header_timeout() {
    let gw = start(&config("header_read_timeout_ms = 300")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let (sent, after) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("a silent connection must be closed");
    assert_eq!(sent, "");
    assert!(after >= Duration::from_millis(200), "{after:?}");
}

#[tokio::test]
async fn half_a_body_gets_a_408_and_the_connection_is_closed() {
    let gw = start(&config("body_read_timeout_ms = 300")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let body = chat_request(false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .unwrap();
    let (sent, after) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("a connection with half a body must be closed after its 408");
    let (status, json) = status_and_body(&sent);
    assert_eq!(status, 408, "{sent}");
    assert!(has_header(&sent, "connection", "close"), "{sent}");
    let error: Value = serde_json::from_str(json).unwrap();
    assert_eq!(error["error"]["code"], "request_timeout");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.body_read_timeout_ms"),
        "{error}"
    );
    assert!(after >= Duration::from_millis(200), "{after:?}");
}

/// The idle timeout, not the (shorter) header timeout, closes a keep-alive connection
/// waiting for its next request; a request sent on it before then is served.
#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let gw = start(&config(
        "header_read_timeout_ms = 300\nidle_timeout_ms = 900",
    ))
    .await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let health = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut buf = [0u8; 1024];
    for _ in 0..2 {
        s.write_all(health).await.unwrap();
        let mut got = String::new();
        while !got.ends_with("\r\n\r\nok") {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "closed while a request was answered: {got}");
            got.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert_eq!(status_and_body(&got), (200, "ok"));
    }
    let (sent, after) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("an idle keep-alive connection must be closed");
    assert_eq!(sent, "");
    assert!(
        after >= Duration::from_millis(700),
        "closed by the idle timeout (900 ms), not the header timeout (300 ms): {after:?}"
    );
}

/// Slowloris: more silent connections than `max_connections`. The ones over the limit are
/// answered with a 503 at once and closed; the ones within are cut at the header timeout,
/// after which a real request is answered at once.
#[tokio::test]
async fn connections_over_the_limit_get_a_503_and_a_slowloris_does_not_starve_requests() {
    let gw = start(&config(
        "max_connections = 8\nmax_connections_per_address = 8\nheader_read_timeout_ms = 1000",
    ))
    .await;
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(gw.addr).await.unwrap());
    }
    let (mut refused, mut cut) = (0, 0);
    for s in &mut silent {
        let (sent, _) = read_until_closed(s, Duration::from_secs(5))
            .await
            .expect("every silent connection is closed, refused or timed out");
        if sent.is_empty() {
            let after = opened.elapsed();
            assert!(
                after >= Duration::from_millis(900),
                "cut at the header timeout: {after:?}"
            );
            cut += 1;
            continue;
        }
        let (status, body) = status_and_body(&sent);
        assert_eq!(status, 503, "{sent}");
        assert!(has_header(&sent, "retry-after", "1"), "{sent}");
        assert!(has_header(&sent, "connection", "close"), "{sent}");
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "overloaded", "{error}");
        assert!(error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_connections"));
        refused += 1;
    }
    assert_eq!((cut, refused), (8, 12), "8 served (then cut), 12 refused");
    answered_within_2s(
        gw.addr,
        "a request after the slow connections were cut is answered promptly",
    )
    .await;
}

/// Three event loops on one port (`SO_REUSEPORT`, the kernel spreading connections over
/// them) share one `max_connections`: of 12 silent connections 4 are served, 8 refused.
/// Counted per loop, up to 12 would be served.
#[cfg(unix)]
#[tokio::test]
async fn the_connection_limit_is_counted_over_every_event_loop() {
    let cfg = load(
        &config(
            "max_connections = 4\nmax_connections_per_address = 4\nheader_read_timeout_ms = 1000",
        ),
        "test.toml",
        &|_| None,
    )
    .unwrap();
    let bind = |addr: SocketAddr| {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseport(true).unwrap();
        socket.bind(addr).unwrap();
        socket.listen(64).unwrap()
    };
    let first = bind("127.0.0.1:0".parse().unwrap());
    let addr = first.local_addr().unwrap();
    let more = (0..2)
        .map(|_| bind(addr).into_std().unwrap())
        .collect::<Vec<_>>();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        equiroute_gateway::serve_loops(&cfg, first, more, async {
            let _ = stopped.await;
        })
        .await
    });
    let mut silent = Vec::new();
    for _ in 0..12 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let (mut refused, mut cut) = (0, 0);
    for s in &mut silent {
        let (sent, _) = read_until_closed(s, Duration::from_secs(5))
            .await
            .expect("every silent connection is closed, refused or timed out");
        if sent.is_empty() {
            cut += 1;
        } else {
            assert_eq!(status_and_body(&sent).0, 503, "{sent}");
            refused += 1;
        }
    }
    assert_eq!((cut, refused), (4, 8));
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("every loop stops")
        .unwrap()
        .unwrap();
}

/// A streamed answer longer than the idle timeout is in flight all along: not cut.
#[tokio::test]
async fn a_stream_longer_than_the_idle_timeout_is_not_cut() {
    // 6 chunks 150 ms apart: about 0.9 s, three times the idle timeout.
    let upstream = mock("[chat]\nchunk_gap_ms = 150\n").await;
    let cfg = format!(
        r#"
[server]
idle_timeout_ms = 300
header_read_timeout_ms = 300

[interfaces.chat]
kind = "chat"
deadline_ms = 5000
stream_idle_ms = 2000

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "model-a"
base_url = "http://{}/v1"
"#,
        upstream.addr
    );
    let gw = start(&cfg).await;
    let started = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_request(true),
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        started.elapsed() > Duration::from_millis(600),
        "the stream outlasted the idle timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(
        r.body,
        equiroute_mock::stream_chunks("model-a").concat(),
        "the whole stream, ending with [DONE]"
    );
}

/// Stopping drains: a request in flight when the stop comes is answered, then `serve`
/// returns and the port is closed.
#[tokio::test]
async fn stopping_finishes_the_request_in_flight() {
    let upstream = mock("[chat]\nlatency = { p50_ms = 600, p95_ms = 600 }\n").await;
    let cfg = format!(
        r#"
[interfaces.chat]
kind = "chat"
deadline_ms = 5000

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "model-a"
base_url = "http://{}/v1"
"#,
        upstream.addr
    );
    let gw = start(&cfg).await;
    let addr = gw.addr;
    let request = tokio::spawn(async move {
        http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_request(false),
        )
        .await
    });
    // Stop once the upstream has the request, i.e. while it is in flight.
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let stats = http(upstream.addr, "GET", "/_stats", &[], "").await.json();
            if stats["chat"].as_u64() == Some(1) {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the upstream receives the request");
    gw.stop.send(()).unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(5), request)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answered.status, 200, "{}", answered.body);
    tokio::time::timeout(Duration::from_secs(5), gw.served)
        .await
        .expect("serve returns once drained")
        .unwrap()
        .unwrap();
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}

#[test]
fn connection_limits_default_to_the_documented_values_and_reject_bad_ones() {
    let defaults = load(&config(""), "t.toml", &|_| None).unwrap().connections;
    assert_eq!(
        defaults,
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_address: 512,
            max_header_bytes: 32 << 10,
            max_buffered_bytes: 64 << 20,
            max_buffered_bytes_per_address: 32 << 20,
            max_in_flight_per_key: 512,
        }
    );
    let set = load(
        &config("header_read_timeout_ms = 1500\nbody_read_timeout_ms = 2500\nidle_timeout_ms = 0.5\nmax_connections = 3"),
        "t.toml",
        &|_| None,
    )
    .unwrap()
    .connections;
    assert_eq!(
        (
            set.header_read_timeout,
            set.body_read_timeout,
            set.idle_timeout,
            set.max_connections
        ),
        (
            Duration::from_millis(1500),
            Duration::from_millis(2500),
            Duration::from_micros(500),
            3
        )
    );
    assert_refused(&[
        (
            "header_read_timeout_ms = 0",
            "server.header_read_timeout_ms",
            "greater than 0",
        ),
        (
            "body_read_timeout_ms = -5",
            "server.body_read_timeout_ms",
            "greater than 0",
        ),
        (
            "idle_timeout_ms = 1e12",
            "server.idle_timeout_ms",
            "at most 86400000",
        ),
        (
            "send_timeout_ms = 0",
            "server.send_timeout_ms",
            "greater than 0",
        ),
        (
            "idle_timeout_ms = nan",
            "server.idle_timeout_ms",
            "milliseconds",
        ),
        (
            "max_connections = 0",
            "server.max_connections",
            "at least 1",
        ),
    ]);
    let e = load(&config("idle_timeout_s = 5"), "t.toml", &|_| None).unwrap_err();
    assert!(e.to_string().contains("idle_timeout_s"), "{e}");
}

/// A connection to `addr` from the loopback address `source` (127.0.0.2 is a second client
/// on Linux, where all of 127/8 is loopback).
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::from((source, 0)))
        .expect("127.0.0.2 is a loopback address");
    socket.connect(addr).await.unwrap()
}

const HOG: [u8; 4] = [127, 0, 0, 2];

/// The issue's slowloris, scaled down: one client opens as many silent connections as the
/// gateway serves. At the default share (half of `max_connections`) it holds 4 of 8, its
/// others get a 429 at once, and another client is served at once. Before fair shares, the
/// first client held all 8 and the other got a 503.
#[tokio::test]
async fn one_address_holds_at_most_its_share_and_another_address_is_served() {
    let gw = start(&config(
        "max_connections = 8\nheader_read_timeout_ms = 5000",
    ))
    .await;
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(connect_from(HOG, gw.addr).await);
    }
    answered_within_2s(
        gw.addr,
        "the other address is answered at once, not after the hog's header timeout",
    )
    .await;
    // The hog's last 4 were refused at once with a 429 naming the setting.
    for s in &mut silent[4..] {
        let (sent, _) = read_until_closed(s, Duration::from_secs(2))
            .await
            .expect("a connection over the address's share is refused at once");
        let (status, body) = status_and_body(&sent);
        assert_eq!(status, 429, "{sent}");
        assert!(has_header(&sent, "retry-after", "1"), "{sent}");
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "too_many_connections", "{error}");
        assert!(error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_connections_per_address"));
    }
    let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        metrics.contains("equiroute_refusals_total{reason=\"too_many_connections\"} 4"),
        "{metrics}"
    );
}

/// With every connection taken by one address, a newcomer from another address takes the
/// hog's oldest connection (closed unanswered); a newcomer from the hog, which holds the
/// most, gets the 503; the other address's next connection is served the same way.
#[tokio::test]
async fn when_every_connection_is_taken_the_biggest_holder_is_shed_first() {
    let gw = start(&config(
        "max_connections = 4\nmax_connections_per_address = 4\nheader_read_timeout_ms = 5000",
    ))
    .await;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(connect_from(HOG, gw.addr).await);
    }
    let _newcomer = TcpStream::connect(gw.addr).await.unwrap();
    let (sent, after) = read_until_closed(&mut silent[0], Duration::from_secs(2))
        .await
        .expect("the hog's oldest connection is closed at once for the newcomer");
    assert_eq!(sent, "", "a shed connection is closed unanswered");
    assert!(after < Duration::from_secs(2), "{after:?}");
    // 3 + 1 taken: the hog's next one has nobody holding more to take from.
    let mut one_more = connect_from(HOG, gw.addr).await;
    let (sent, _) = read_until_closed(&mut one_more, Duration::from_secs(2))
        .await
        .expect("refused at once");
    assert_eq!(status_and_body(&sent).0, 503, "{sent}");
    answered_within_2s(gw.addr, "the other address's request is answered at once").await;
    let (sent, _) = read_until_closed(&mut silent[1], Duration::from_secs(2))
        .await
        .expect("the hog's next oldest made room for it");
    assert_eq!(sent, "");
    let metrics = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        metrics.contains("equiroute_refusals_total{reason=\"overloaded\"} 1"),
        "{metrics}"
    );
    let shed = common::metric(&metrics, "equiroute_refusals_total{reason=\"shed\"}");
    assert!(
        shed >= 2,
        "two hog connections were shed at least: {metrics}"
    );
}

/// A `Content-Length` over `max_body_bytes` is answered 413 at once (an OpenAI-style body),
/// not after waiting for a body that would be refused: before, 1e12 waited the body timeout
/// (30 s by default) for a 408.
#[tokio::test]
async fn a_content_length_over_the_body_limit_gets_413_at_once() {
    let gw = start(&config("max_body_bytes = 4096")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000000000\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    let (sent, after) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("answered and closed at once, not at the body timeout");
    let (status, body) = status_and_body(&sent);
    assert_eq!(status, 413, "{sent}");
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["code"], "request_too_large", "{error}");
    assert!(after < Duration::from_secs(2), "{after:?}");
}

/// A request head over `max_header_bytes` (32 KiB by default) gets a 431 and the connection
/// is closed: before, hyper's own ~400 KB were buffered per connection.
#[tokio::test]
async fn a_head_over_the_header_limit_gets_431() {
    let gw = start(&config("")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let padding = "a".repeat(40 << 10);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-padding: {padding}\r\ncontent-length: {}\r\n\r\n{}",
        chat_request(false).len(),
        chat_request(false)
    );
    // The gateway may close before it has read everything: a failed write is fine.
    let _ = s.write_all(request.as_bytes()).await;
    let (sent, _) = read_until_closed(&mut s, Duration::from_secs(5))
        .await
        .expect("the connection is closed");
    assert_eq!(status_and_body(&sent).0, 431, "{sent}");
}

/// Bodies still arriving count against their address's share of buffered bytes: past it, a
/// 429 and the connection closed; another address's body is still read and served.
#[tokio::test]
async fn bodies_still_arriving_past_the_address_share_get_429_and_others_are_served() {
    let gw = start(&config(
        "max_body_bytes = 65536\nmax_buffered_bytes = 262144\nmax_buffered_bytes_per_address = 131072",
    ))
    .await;
    // Three bodies of which 60,000 bytes arrive and the rest never does: 180,000 bytes would
    // be held, over the 131,072 of the address's share.
    let mut stalled = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let mut s = connect_from(HOG, gw.addr).await;
        s.write_all(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 65536\r\n\r\n{}",
                " ".repeat(60_000)
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        stalled.spawn(async move { read_until_closed(&mut s, Duration::from_secs(10)).await });
    }
    let first = tokio::time::timeout(Duration::from_secs(5), stalled.join_next())
        .await
        .expect("one stalled body is refused at once")
        .unwrap()
        .unwrap()
        .expect("and its connection closed");
    let (status, body) = status_and_body(&first.0);
    assert_eq!(status, 429, "{}", first.0);
    let error: Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["error"]["code"], "too_many_buffered_bytes", "{error}");
    // Another client's large body is read and served.
    let padded =
        json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(60_000)}]});
    let answered = tokio::time::timeout(
        Duration::from_secs(5),
        http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &padded.to_string(),
        ),
    )
    .await
    .expect("answered at once");
    assert_eq!(answered.status, 200, "{}", answered.body);
    stalled.abort_all();
}

#[test]
fn fair_share_limits_follow_their_totals_and_reject_bad_ones() {
    // The shares follow the totals they are parts of, and hold the largest body.
    let derived = load(
        &config("max_connections = 9\nmax_body_bytes = 50000000"),
        "t.toml",
        &|_| None,
    )
    .unwrap()
    .connections;
    assert_eq!(
        (
            derived.max_connections_per_address,
            derived.max_buffered_bytes,
            derived.max_buffered_bytes_per_address,
            derived.max_in_flight_per_key,
        ),
        (5, 100_000_000, 50_000_000, 5)
    );
    assert_refused(&[
        (
            "max_connections = 10\nmax_connections_per_address = 11",
            "server.max_connections_per_address",
            "from 1 to server.max_connections (10)",
        ),
        (
            "max_in_flight_per_key = 0",
            "server.max_in_flight_per_key",
            "must be at least 1",
        ),
        (
            "max_header_bytes = 100",
            "server.max_header_bytes",
            "from 8192 to 1048576",
        ),
        (
            "max_buffered_bytes_per_address = 1000",
            "server.max_buffered_bytes_per_address",
            "less than server.max_body_bytes (1048576)",
        ),
        (
            "max_buffered_bytes = 2000000\nmax_buffered_bytes_per_address = 3000000",
            "server.max_buffered_bytes",
            "less than server.max_buffered_bytes_per_address (3000000)",
        ),
    ]);
}
