//! Connections a client cannot hold for ever, and load shed instead of taken: the
//! `[server]` header, body and idle timeouts and `max_connections`, on a real gateway on a
//! loopback port driven over raw sockets.

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
        "max_connections = 8\nheader_read_timeout_ms = 1000",
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
    let answered = tokio::time::timeout(
        Duration::from_secs(2),
        http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat_request(false),
        ),
    )
    .await
    .expect("a request after the slow connections were cut is answered promptly");
    assert_eq!(answered.status, 200, "{}", answered.body);
}

/// Three event loops on one port (`SO_REUSEPORT`, the kernel spreading connections over
/// them) share one `max_connections`: of 12 silent connections 4 are served, 8 refused.
/// Counted per loop, up to 12 would be served.
#[cfg(unix)]
#[tokio::test]
async fn the_connection_limit_is_counted_over_every_event_loop() {
    let cfg = load(
        &config("max_connections = 4\nheader_read_timeout_ms = 1000"),
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
        equiroute_gateway::mock::stream_chunks("model-a").concat(),
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
    for (line, field, fix) in [
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
    ] {
        let e = load(&config(line), "t.toml", &|_| None).unwrap_err();
        assert_eq!(e.field, field, "{line}");
        assert!(e.fix.contains(fix), "{line}: {}", e.fix);
    }
    let e = load(&config("idle_timeout_s = 5"), "t.toml", &|_| None).unwrap_err();
    assert!(e.to_string().contains("idle_timeout_s"), "{e}");
}
