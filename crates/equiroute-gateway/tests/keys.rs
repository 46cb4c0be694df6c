//! Keys, tenants and feedback over real HTTP: a key's requests can be scored only by that key
//! (or a judge or admin key), and a foreign id is answered exactly like an unknown one; keys
//! bound to a tenant or to task classes cannot step out of them; a tenant-restricted provider
//! never serves a request without a valid tenant; each key's feedback and requests in flight
//! can be capped.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, start, Reply};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One interface of two fast simulated providers, `open` (any tenant) and `t1only`.
const CHAT: &str = r#"
[interfaces.chat]
kind = "chat"
policy = { name = "static", candidate = "open" }

[[interfaces.chat.providers]]
id = "open"
kind = "sim"
sim = { latency = { p50_ms = 1, p95_ms = 2 } }

[[interfaces.chat.providers]]
id = "t1only"
kind = "sim"
tenants = ["t1"]
sim = { latency = { p50_ms = 1, p95_ms = 2 } }
"#;

const ENV: [(&str, &str); 6] = [
    ("KEY_A", "sk-gw-team-a"),
    ("KEY_B", "sk-gw-team-b"),
    ("KEY_ADMIN", "sk-gw-admin"),
    ("KEY_JUDGE", "sk-gw-judge"),
    ("KEY_T1", "sk-gw-tenant-one"),
    ("KEY_CODE", "sk-gw-code-only"),
];

fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

/// A chat request for `model` with `key` (none when empty) and the `extra` headers.
async fn chat(addr: std::net::SocketAddr, key: &str, model: &str, extra: &[(&str, &str)]) -> Reply {
    let auth = bearer(key);
    let mut headers = if key.is_empty() {
        Vec::new()
    } else {
        vec![(auth.0, auth.1.as_str())]
    };
    headers.extend_from_slice(extra);
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    http(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &body.to_string(),
    )
    .await
}

async fn score(addr: std::net::SocketAddr, key: &str, id: &str, quality: f64) -> Reply {
    let auth = bearer(key);
    let body = json!({"request_id": id, "quality": quality});
    http(
        addr,
        "POST",
        "/v1/feedback",
        &[(auth.0, auth.1.as_str())],
        &body.to_string(),
    )
    .await
}

/// The id of an answered request.
fn id_of(r: &Reply) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    r.header("x-equiroute-request-id").unwrap().to_owned()
}

/// A well-formed id that no request has.
const NEVER_ISSUED: &str = "req-00000000000000000000000000000000";

/// Asserts that `r` is the error `status` with `code`, naming the request header `param`.
fn assert_refused(r: &Reply, status: u16, code: &str, param: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json();
    assert_eq!(
        (&e["error"]["code"], &e["error"]["param"]),
        (&json!(code), &json!(param)),
        "{e}"
    );
    e
}

/// The status and body of a 404, with the id it quotes replaced: what tells two answers apart.
fn answer_without_id(r: &Reply, id: &str) -> (u16, String) {
    (r.status, r.body.replace(id, "<id>"))
}

#[tokio::test]
async fn key_b_cannot_score_key_as_request_and_gets_the_answer_of_an_unknown_id() {
    let dir = std::env::temp_dir().join(format!("equiroute-keys-audit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let audit = dir.join("audit.jsonl");
    let config = format!(
        "[server]\napi_keys_env = [\"KEY_A\", \"KEY_B\"]\nadmin_keys_env = [\"KEY_ADMIN\"]\n[audit]\npath = \"{}\"\n{CHAT}",
        audit.display()
    );
    let gw = start(&config, &ENV).await;
    let mine = id_of(&chat(gw.addr, "sk-gw-team-a", "chat", &[]).await);
    let theirs = score(gw.addr, "sk-gw-team-b", &mine, 0.0).await;
    let unknown = score(gw.addr, "sk-gw-team-b", NEVER_ISSUED, 0.0).await;
    assert_eq!(theirs.status, 404, "B scored A's request: {}", theirs.body);
    assert_eq!(
        answer_without_id(&theirs, &mine),
        answer_without_id(&unknown, NEVER_ISSUED),
        "a foreign id is answered exactly like an unknown one"
    );
    assert_eq!(theirs.json()["error"]["code"], "unknown_request_id");
    // A scores it; B's second try still looks unknown, not "duplicate".
    let own = score(gw.addr, "sk-gw-team-a", &mine, 0.8).await;
    assert_eq!(
        (own.status, own.json()["status"].clone()),
        (200, json!("accepted"))
    );
    let again = score(gw.addr, "sk-gw-team-b", &mine, 0.0).await;
    assert_eq!(
        answer_without_id(&again, &mine),
        answer_without_id(&unknown, NEVER_ISSUED)
    );
    // An admin key scores any request (it opens /v1/feedback, not the traffic routes).
    let other = id_of(&chat(gw.addr, "sk-gw-team-a", "chat", &[]).await);
    let by_admin = score(gw.addr, "sk-gw-admin", &other, 0.4).await;
    assert_eq!(by_admin.status, 200, "{}", by_admin.body);
    assert_eq!(chat(gw.addr, "sk-gw-admin", "chat", &[]).await.status, 401);
    // The audit log names who scored, by label, never by key.
    let record = |quality: f64| {
        let text = std::fs::read_to_string(&audit).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|r| r["kind"] == "feedback" && r["quality"] == quality)
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while record(0.4).is_none() && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (a, admin) = (record(0.8).unwrap(), record(0.4).unwrap());
    assert_eq!(
        (&a["key"], &a["scored_by"], &a["request_id"]),
        (&json!("KEY_A"), &json!("api"), &json!(mine))
    );
    assert_eq!(admin["key"], "KEY_ADMIN");
    assert!(
        record(0.0).is_none(),
        "B's refused scores are not in the log"
    );
    let log = std::fs::read_to_string(&audit).unwrap();
    assert!(!log.contains("sk-gw-"), "no key in the audit log");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_judge_key_scores_any_request_and_sends_traffic() {
    let config = format!(
        "[server]\napi_keys_env = [\"KEY_A\"]\n[[server.keys]]\nenv = \"KEY_JUDGE\"\nname = \"ext-judge\"\nrole = \"judge\"\n{CHAT}"
    );
    let gw = start(&config, &ENV).await;
    let mine = id_of(&chat(gw.addr, "sk-gw-team-a", "chat", &[]).await);
    let r = score(gw.addr, "sk-gw-judge", &mine, 0.9).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let its_own = id_of(&chat(gw.addr, "sk-gw-judge", "chat", &[]).await);
    // A client key cannot score the judge's request either.
    assert_eq!(
        score(gw.addr, "sk-gw-team-a", &its_own, 0.9).await.status,
        404
    );
}

#[tokio::test]
async fn request_ids_are_32_hex_digits_each_new() {
    let gw = start(CHAT, &[]).await;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..20 {
        let r = chat(gw.addr, "", "chat", &[]).await;
        let id = id_of(&r);
        let hex = id.strip_prefix("req-").unwrap();
        assert_eq!(hex.len(), 32, "{id}");
        assert!(
            hex.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{id}"
        );
        assert!(seen.insert(id));
    }
}

/// Sends a chat request with raw header bytes (not necessarily text) and reads the answer.
async fn raw_status(addr: std::net::SocketAddr, header: &[u8]) -> Reply {
    let body = json!({"model": "chat/t1only", "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(header);
    req.extend_from_slice(b"\r\n\r\n");
    req.extend_from_slice(body.as_bytes());
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&req).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Reply {
        status,
        headers: Vec::new(),
        body,
    }
}

#[tokio::test]
async fn a_tenant_restricted_provider_serves_only_requests_with_a_valid_allowed_tenant() {
    let gw = start(CHAT, &[]).await;
    let pinned =
        |extra: &'static [(&'static str, &'static str)]| chat(gw.addr, "", "chat/t1only", extra);
    let r = pinned(&[("x-equiroute-tenant", "t1")]).await;
    assert_eq!(r.routed().0, 200, "{}", r.body);
    // Missing: not a wildcard.
    let r = pinned(&[]).await;
    // The request's own mistake: a 403 naming the header, not a 503 that SDKs retry.
    assert_refused(&r, 403, "tenant_not_allowed", "x-equiroute-tenant");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the request has none"),
        "{}",
        r.body
    );
    // Another tenant.
    assert_eq!(pinned(&[("x-equiroute-tenant", "t2")]).await.status, 403);
    // Not text: a 400 naming the header, not a request without a tenant.
    let r = raw_status(gw.addr, b"x-equiroute-tenant: t\xff1").await;
    assert_refused(&r, 400, "invalid_tenant", "x-equiroute-tenant");
    // Not a tenant name (a space inside), or sent twice.
    let r = pinned(&[("x-equiroute-tenant", "t 1")]).await;
    assert_refused(&r, 400, "invalid_tenant", "x-equiroute-tenant");
    let r = pinned(&[("x-equiroute-tenant", "t1"), ("x-equiroute-tenant", "t2")]).await;
    assert_refused(&r, 400, "invalid_tenant", "x-equiroute-tenant");
    // The routed interface still serves tenant-less requests on the unrestricted provider.
    let r = chat(gw.addr, "", "chat", &[]).await;
    assert_eq!(r.routed().1, Some("open"));
}

#[tokio::test]
async fn a_key_bound_to_a_tenant_cannot_claim_another_and_needs_no_header() {
    let config = format!(
        "[server]\napi_keys_env = [\"KEY_A\"]\n[[server.keys]]\nenv = \"KEY_T1\"\ntenant = \"t1\"\n[[server.keys]]\nenv = \"KEY_B\"\ntenant = \"t2\"\n{CHAT}"
    );
    let gw = start(&config, &ENV).await;
    // The key's tenant applies without the header, and with the header naming it.
    let r = chat(gw.addr, "sk-gw-tenant-one", "chat/t1only", &[]).await;
    assert_eq!(r.routed().0, 200, "{}", r.body);
    let r = chat(
        gw.addr,
        "sk-gw-tenant-one",
        "chat/t1only",
        &[("x-equiroute-tenant", "t1")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // A t2 key claiming t1: refused, naming the header and the fix.
    let r = chat(
        gw.addr,
        "sk-gw-team-b",
        "chat/t1only",
        &[("x-equiroute-tenant", "t1")],
    )
    .await;
    let e = assert_refused(&r, 403, "tenant_not_allowed", "x-equiroute-tenant");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("leave the header out"),
        "{e}"
    );
    // Without the header the t2 key is t2: not served by the t1 provider.
    assert_eq!(
        chat(gw.addr, "sk-gw-team-b", "chat/t1only", &[])
            .await
            .status,
        403
    );
    // An unbound key still names its tenant in the header.
    let r = chat(
        gw.addr,
        "sk-gw-team-a",
        "chat/t1only",
        &[("x-equiroute-tenant", "t1")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn a_key_restricted_to_task_classes_cannot_name_another() {
    let config = format!(
        "[server]\n[[server.keys]]\nenv = \"KEY_CODE\"\nname = \"code-bot\"\ntask_classes = [\"code\"]\n{CHAT}"
    );
    let gw = start(&config, &ENV).await;
    let r = chat(
        gw.addr,
        "sk-gw-code-only",
        "chat",
        &[("x-equiroute-task-class", "code")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = chat(gw.addr, "sk-gw-code-only", "chat", &[]).await;
    assert_eq!(r.status, 200, "no class: the unclassed slice, {}", r.body);
    let r = chat(
        gw.addr,
        "sk-gw-code-only",
        "chat",
        &[("x-equiroute-task-class", "invented-1")],
    )
    .await;
    assert_refused(&r, 403, "task_class_not_allowed", "x-equiroute-task-class");
}

#[tokio::test]
async fn each_keys_feedback_is_capped_with_a_429_and_retry_after() {
    let config = format!(
        "[server]\napi_keys_env = [\"KEY_A\", \"KEY_B\"]\nfeedback_rate_per_key = 0.01\nfeedback_burst_per_key = 2\n{CHAT}"
    );
    let gw = start(&config, &ENV).await;
    assert_eq!(
        score(gw.addr, "sk-gw-team-a", NEVER_ISSUED, 0.5)
            .await
            .status,
        404
    );
    assert_eq!(
        score(gw.addr, "sk-gw-team-a", NEVER_ISSUED, 0.5)
            .await
            .status,
        404
    );
    let r = score(gw.addr, "sk-gw-team-a", NEVER_ISSUED, 0.5).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "feedback_rate_limited");
    // One score at 0.01 per second: 100 s.
    assert_eq!(r.header("retry-after"), Some("100"));
    assert_eq!(
        score(gw.addr, "sk-gw-team-b", NEVER_ISSUED, 0.5)
            .await
            .status,
        404,
        "B has its own"
    );
}

#[tokio::test]
async fn a_key_past_its_share_of_requests_in_flight_gets_429_and_other_keys_are_served() {
    // Answers take a second, so that the three requests of A overlap.
    let config = r#"
[server]
api_keys_env = ["KEY_A", "KEY_B"]
max_in_flight_per_key = 2

[interfaces.chat]
kind = "chat"

[[interfaces.chat.providers]]
id = "slow"
kind = "sim"
sim = { latency = { p50_ms = 1000, p95_ms = 1100 } }
"#;
    let gw = start(config, &ENV).await;
    let a = |_| chat(gw.addr, "sk-gw-team-a", "chat", &[]);
    let (first, second, third, b) =
        tokio::join!(a(1), a(2), a(3), chat(gw.addr, "sk-gw-team-b", "chat", &[]));
    let mut statuses = [first.status, second.status, third.status];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 429], "two of A's three are served");
    let refused = [first, second, third]
        .into_iter()
        .find(|r| r.status == 429)
        .unwrap();
    assert_eq!(
        refused.json()["error"]["code"],
        "too_many_requests_in_flight"
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(b.status, 200, "B has its own share: {}", b.body);
    // Every seat was given back with its answer.
    assert_eq!(chat(gw.addr, "sk-gw-team-a", "chat", &[]).await.status, 200);
    let auth = bearer("sk-gw-team-a");
    let metrics = http(gw.addr, "GET", "/metrics", &[(auth.0, auth.1.as_str())], "").await;
    assert!(
        metrics
            .body
            .contains("equiroute_refusals_total{reason=\"too_many_requests_in_flight\"} 1"),
        "{}",
        metrics.body
    );
}
