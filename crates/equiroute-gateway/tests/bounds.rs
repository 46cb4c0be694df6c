//! What a client sends must not grow the gateway's memory, state, logs or metric labels
//! without bound, nor be echoed back whole: slices capped by count and bytes, task classes
//! allow-listed and their length bounded, the full state paged, deadlines clamped, echoed
//! input cut, repetitive log lines rate-limited.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, start};
use serde_json::{json, Value};

/// One fast simulated provider behind `ts-deadline` with at most `max_slices` slices, and a
/// tool interface without a deadline.
fn config(max_slices: usize, extra: &str) -> String {
    format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "ts-deadline", risk = {{ max_slices = {max_slices} }} }}
deadline_ms = 3000
{extra}

[[interfaces.chat.providers]]
id = "fast"
kind = "sim"
model = "fast-model"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}

[interfaces.search]
kind = "tool"
policy = {{ name = "round-robin" }}

[[interfaces.search.providers]]
id = "s1"
kind = "sim"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}
"#
    )
}

fn chat_body(model: &str) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]}).to_string()
}

async fn chat_as(addr: std::net::SocketAddr, class: Option<&str>) -> common::Reply {
    let headers: Vec<(&str, &str)> = class
        .map(|c| vec![("x-equiroute-task-class", c)])
        .unwrap_or_default();
    http(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_body("chat"),
    )
    .await
}

/// `GET /v1/interfaces/chat/state` with `query`.
async fn state(addr: std::net::SocketAddr, query: &str) -> common::Reply {
    http(
        addr,
        "GET",
        &format!("/v1/interfaces/chat/state{query}"),
        &[],
        "",
    )
    .await
}

/// The value of the counter line starting with `series` (0 when absent).
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse().unwrap())
}

#[tokio::test]
async fn a_new_task_class_per_request_keeps_state_and_metrics_bounded() {
    let cap = 30;
    let gw = start(&config(cap, ""), &[]).await;
    for n in 0..120 {
        let r = chat_as(gw.addr, Some(&format!("class-{n}"))).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let s = state(gw.addr, "?full=true").await;
    assert_eq!(s.status, 200, "{}", s.body);
    let v = s.json();
    // 120 classes × 3 levels below the root would be 361 slices; the cap holds (plus the root).
    let total = v["slices_page"]["total"].as_u64().unwrap();
    assert!(total <= cap as u64 + 1, "{total} slices");
    assert_eq!(
        v["learning_state"]["slices"].as_array().unwrap().len() as u64,
        total
    );
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    let evicted = counter(&m, r#"equiroute_slices_evicted_total{interface="chat"}"#);
    assert!(evicted >= 360 - cap as u64, "{evicted} evicted\n{m}");
    assert!(
        !m.contains("class-"),
        "no client string becomes a label:\n{m}"
    );
}

#[tokio::test]
async fn unlisted_and_overlong_task_classes_are_routed_and_learnt_in_the_parent_slice() {
    let gw = start(&config(4096, r#"task_classes = ["code"]"#), &[]).await;
    let overlong = "x".repeat(65);
    for class in [
        Some("code"),
        Some("other"),
        Some("yet-another"),
        Some(overlong.as_str()),
        None,
    ] {
        let r = chat_as(gw.addr, class).await;
        assert_eq!(r.status, 200, "{class:?}: {}", r.body);
    }
    let v = state(gw.addr, "?full=true").await.json();
    // The root, three levels for `code`, and three for the untagged path that the two
    // unlisted classes, the one over 64 bytes and the untagged request share (classes of
    // their own would add nine more).
    assert_eq!(v["slices_page"]["total"], 7, "{v}");
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    for (series, n) in [
        (
            r#"equiroute_task_class_unlisted_total{interface="chat"}"#,
            2,
        ),
        (
            r#"equiroute_task_class_too_long_total{interface="chat"}"#,
            1,
        ),
    ] {
        assert_eq!(counter(&m, series), n, "{series}\n{m}");
    }
    assert!(!m.contains("other") && !m.contains("xxxx"), "{m}");
}

#[tokio::test]
async fn the_full_state_is_paged_and_its_query_errors_are_json() {
    let gw = start(&config(4096, ""), &[]).await;
    for class in ["a", "b", "c"] {
        assert_eq!(chat_as(gw.addr, Some(class)).await.status, 200);
    }
    // The root and three levels for each of three classes.
    let first = state(gw.addr, "?full=1&limit=4").await.json();
    assert_eq!(first["slices_page"]["total"], 10, "{first}");
    assert_eq!(first["slices_page"]["next_offset"], 4);
    assert_eq!(
        first["learning_state"]["slices"].as_array().unwrap().len(),
        4
    );
    let last = state(gw.addr, "?full=true&offset=8&limit=4").await.json();
    assert_eq!(
        last["learning_state"]["slices"].as_array().unwrap().len(),
        2
    );
    assert_eq!(last["slices_page"]["next_offset"], Value::Null);
    let past = state(gw.addr, "?full=true&offset=50").await.json();
    assert_eq!(past["learning_state"]["slices"], json!([]));
    // The pages together are the whole state, each slice once.
    let mut seen: Vec<Value> = Vec::new();
    let mut offset = Some(0);
    while let Some(at) = offset {
        let page = state(gw.addr, &format!("?full=true&limit=3&offset={at}"))
            .await
            .json();
        seen.extend(page["learning_state"]["slices"].as_array().unwrap().clone());
        offset = page["slices_page"]["next_offset"].as_u64();
    }
    assert_eq!(seen.len(), 10);
    let summary = state(gw.addr, "").await.json();
    assert!(
        summary.get("learning_state").is_none(),
        "the default is the summary"
    );
    assert!(state(gw.addr, "?full=0")
        .await
        .json()
        .get("learning_state")
        .is_none());
    for (query, param) in [
        ("?full=yes", "full"),
        ("?full=true&limit=0", "limit"),
        ("?full=true&limit=5000", "limit"),
        ("?offset=-1", "offset"),
        ("?fll=true", "fll"),
    ] {
        let r = state(gw.addr, query).await;
        assert_eq!(r.status, 400, "{query}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{query}: {e}");
        assert_eq!(e["error"]["code"], "invalid_query");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(param),
            "{e}"
        );
    }
}

#[tokio::test]
async fn api_keys_alone_protect_the_state_routes_and_401s_name_the_right_setting() {
    let only_api = format!("[server]\napi_keys_env = [\"GW_K\"]\n{}", config(4096, ""));
    let gw = start(&only_api, &[("GW_K", "user-key")]).await;
    for path in ["/v1/interfaces", "/v1/interfaces/chat/state?full=true"] {
        let r = http(gw.addr, "GET", path, &[], "").await;
        assert_eq!(r.status, 401, "{path}: {}", r.body);
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("server.api_keys_env"), "{message}");
        let ok = http(
            gw.addr,
            "GET",
            path,
            &[("authorization", "Bearer user-key")],
            "",
        )
        .await;
        assert_eq!(ok.status, 200, "{path}: {}", ok.body);
    }
    let both = format!(
        "[server]\napi_keys_env = [\"GW_K\"]\nadmin_keys_env = [\"GW_ADMIN\"]\n{}",
        config(4096, "")
    );
    let gw = start(&both, &[("GW_K", "user-key"), ("GW_ADMIN", "admin-key")]).await;
    let r = http(
        gw.addr,
        "GET",
        "/v1/interfaces/chat/state",
        &[("authorization", "Bearer user-key")],
        "",
    )
    .await;
    assert_eq!(r.status, 401);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("server.admin_keys_env"), "{message}");
}

#[tokio::test]
async fn echoed_client_input_is_cut_in_every_error() {
    let gw = start(&config(4096, ""), &[]).await;
    let huge = "m".repeat(900_000);
    let long = "p".repeat(4000);
    let cases = [
        ("POST", "/v1/chat/completions".to_owned(), chat_body(&huge)),
        (
            "POST",
            "/v1/chat/completions".to_owned(),
            chat_body(&format!("chat/{huge}")),
        ),
        ("POST", format!("/v1/tools/{long}"), "{}".to_owned()),
        ("GET", format!("/v1/models/{long}"), String::new()),
        ("GET", format!("/v1/interfaces/{long}/state"), String::new()),
        ("GET", format!("/{long}"), String::new()),
        ("DELETE", "/v1/chat/completions".to_owned(), String::new()),
        (
            "POST",
            "/v1/feedback".to_owned(),
            json!({"request_id": huge, "quality": 0.5}).to_string(),
        ),
        (
            "POST",
            "/v1/feedback".to_owned(),
            json!({"request_id": "x", "quality": 0.5, long.clone(): 1}).to_string(),
        ),
    ];
    for (method, path, body) in cases {
        let r = http(gw.addr, method, &path, &[], &body).await;
        assert!(r.status >= 400, "{method} {}: {}", r.status, r.body);
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.len() < 1200,
            "{method} {path:.40}: {} bytes: {message:.300}",
            message.len()
        );
    }
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat_body(&huge),
    )
    .await;
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("… (900000 bytes in all)"),
        "{message:.300}"
    );
}

#[tokio::test]
async fn a_deadline_header_is_clamped_and_the_answer_says_so() {
    let gw = start(&config(4096, ""), &[]).await;
    let ask = |path: &'static str, body: String, deadline: &'static str| {
        let addr = gw.addr;
        async move {
            http(
                addr,
                "POST",
                path,
                &[("x-equiroute-deadline-ms", deadline)],
                &body,
            )
            .await
        }
    };
    // Above the interface's deadline_ms (3000): clamped to it.
    let r = ask("/v1/chat/completions", chat_body("chat"), "1e300").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-deadline-applied-ms"), Some("3000"));
    // Within it: taken as given, no header.
    let r = ask("/v1/chat/completions", chat_body("chat"), "2500").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-equiroute-deadline-applied-ms"), None);
    // No deadline_ms on the interface: clamped to ten minutes.
    let r = ask("/v1/tools/search", "{}".to_owned(), "86400000").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-equiroute-deadline-applied-ms"), Some("600000"));
    let r = ask("/v1/chat/completions", chat_body("chat"), "-4").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_deadline");
}

#[tokio::test]
async fn a_long_tenant_is_not_repeated_whole_for_each_excluded_provider() {
    let gw = start(
        &config(4096, "").replace(
            "model = \"fast-model\"",
            "model = \"fast-model\"\ntenants = [\"acme\"]",
        ),
        &[],
    )
    .await;
    // Longer than a tenant name may be (128 characters): refused as such, quoted cut.
    let tenant = "t".repeat(6000);
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-equiroute-tenant", &tenant)],
        &chat_body("chat"),
    )
    .await;
    assert_eq!(r.status, 400, "{:.300}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_tenant");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.len() < 600,
        "{} bytes: {message:.300}",
        message.len()
    );
    assert!(message.contains("bytes in all"), "{message}");
}

#[tokio::test]
async fn the_slice_byte_budget_bounds_the_state_and_its_snapshot() {
    let dir = std::env::temp_dir().join(format!("equiroute-budget-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.redb");
    // 64 KiB: a table of 112 entries of 376 bytes (128 buckets), the provider's root and
    // at most 111 slices, where the count alone would keep 4,096.
    let text = format!(
        "[state]\npath = \"{}\"\n{}",
        path.display(),
        config(4096, "").replace(
            "max_slices = 4096",
            "max_slices = 4096, max_slice_bytes = 65536"
        )
    );
    common::serve_until(&text, |addr| async move {
        for n in 0..300 {
            let r = chat_as(addr, Some(&format!("class-{n}"))).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let v = state(addr, "?full=true").await.json();
        let total = v["slices_page"]["total"].as_u64().unwrap();
        assert!((90..=112).contains(&total), "{total} slices");
        let m = http(addr, "GET", "/metrics", &[], "").await.body;
        let evicted = counter(&m, r#"equiroute_slices_evicted_total{interface="chat"}"#);
        assert_eq!(evicted, 900 + 1 - total, "{m}");
    })
    .await
    .unwrap();
    // The snapshot holds what the table held.
    let saved = equiroute_gateway::store::Store::export_file(&path).unwrap();
    let slices = saved["interfaces"]["chat"]["policy"]["slices"]
        .as_array()
        .map(Vec::len);
    assert!(
        slices.is_some_and(|n| (90..=112).contains(&n)),
        "{saved:.2000}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn ten_thousand_unknown_feedback_ids_write_a_bounded_number_of_log_lines() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The gateway runs on this thread: this subscriber sees all it logs, up to `info`.
    let (lines, _guard) = common::capture_logs(tracing::Level::INFO);
    let gw = start(&config(4096, ""), &[]).await;
    let before = lines.0.lock().unwrap().len();
    let started = std::time::Instant::now();
    // 10,000 feedback calls on one keep-alive connection, written while the answers are read.
    let n = 10_000;
    let conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut rd, mut wr) = conn.into_split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let body = json!({"request_id": format!("req-{i:016x}"), "quality": 0.5}).to_string();
            let close = if i + 1 == n {
                "connection: close\r\n"
            } else {
                ""
            };
            let req = format!(
                "POST /v1/feedback HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{close}content-length: {}\r\n\r\n{body}",
                body.len()
            );
            wr.write_all(req.as_bytes()).await.unwrap();
        }
        wr
    });
    let mut raw = Vec::new();
    rd.read_to_end(&mut raw).await.unwrap();
    drop(sender.await.unwrap());
    let answers = String::from_utf8_lossy(&raw);
    assert_eq!(answers.matches("HTTP/1.1 404").count(), n, "{answers:.500}");
    let elapsed = started.elapsed().as_secs();
    let text = String::from_utf8(lines.0.lock().unwrap()[before..].to_vec()).unwrap();
    // Five lines per 10 s window, plus one summary per window: the windows this run touched.
    let windows = elapsed / 10 + 2;
    let written = text
        .lines()
        .filter(|l| l.contains("feedback rejected"))
        .count() as u64;
    assert!(
        (5..=5 * windows).contains(&written),
        "{written} lines in {elapsed} s:\n{text:.3000}"
    );
    assert!(
        text.lines().count() as u64 <= 6 * windows,
        "{} lines in {elapsed} s:\n{text:.3000}",
        text.lines().count()
    );
    // Every one is counted, written or not.
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert_eq!(
        counter(
            &m,
            r#"equiroute_log_events_total{kind="feedback_rejected"}"#
        ),
        n as u64,
        "{m}"
    );
    assert_eq!(
        counter(
            &m,
            r#"equiroute_log_lines_suppressed_total{kind="feedback_rejected"}"#
        ),
        n as u64 - written,
        "{m}"
    );
}
